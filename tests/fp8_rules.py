"""fp8 codes and the rules the fp8 tests check against, in NumPy: the
formats' constants, the dequantized values of codes (codes times scale,
float64), quantize_kv_fp8's computed scales, special codes, and the
checks of attention results against reference.py's float64 attention
(test_fp8.py, test_fp8_caches.py)."""

import re

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

from reference import (assert_half_matches_reference, assert_matches_reference,  # noqa: E402
                       reference_attention)
from reference import saturated_fp8_codes as saturated_codes  # noqa: E402

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)
FORMATS = [pytest.param(E4M3, id="e4m3fn"), pytest.param(E5M2, id="e5m2")]
#: K and V formats (each may be either, independently)
FORMAT_PAIRS = [pytest.param(E4M3, E4M3, id="e4m3fn"), pytest.param(E5M2, E5M2, id="e5m2"),
                pytest.param(E4M3, E5M2, id="k_e4m3fn-v_e5m2"),
                pytest.param(E5M2, E4M3, id="k_e5m2-v_e4m3fn")]

#: the largest finite value of each format
FMAX = {E4M3: 448.0, E5M2: 57344.0}
#: the codes of +fmax (-fmax: with the sign bit, 0xFE / 0xFB)
LARGEST = {E4M3: 0x7E, E5M2: 0x7B}
#: the positive subnormal codes are 0x01 .. 0x07 (e4m3fn) and 0x01 .. 0x03 (e5m2)
N_SUBNORMALS = {E4M3: 7, E5M2: 3}
#: the smallest subnormal (code 0x01) of each format
SMALLEST = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}
#: (mantissa bits, smallest normal exponent) of each format
MANTISSA_EMIN = {E4M3: (3, -6), E5M2: (2, -14)}
NAN_CODES = {E4M3: (0x7F, 0xFF), E5M2: (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)}
INF_CODES = (0x7C, 0xFC)                                    # e5m2's +inf and -inf
F32_MAX = float(np.finfo(np.float32).max)
#: the largest scale each format takes: float32's largest value / fmax
SCALE_BOUND = {fmt: float(np.float32(F32_MAX) / np.float32(FMAX[fmt])) for fmt in FMAX}
SCALE_KINDS = ["none", "tensor", "head", "row"]


# ---- the rule, in NumPy ------------------------------------------------------

def dequantize(codes, scale=None):
    """The values fp8 codes with their scale stand for, in float64: the codes
    times the scale (None: 1), broadcast against codes.shape[:-1]."""
    values = np.asarray(codes).astype(np.float64)
    if scale is None:
        return values
    with np.errstate(invalid="ignore"):                   # a NaN or inf code times 0
        return values * np.asarray(scale, np.float64)[..., None]


def quantize_reference(x, fmt, mode="row"):
    """quantize_kv_fp8's computed scales: max|x| / fmax in float32 over each
    row ("row", shape x.shape[:-1]), each head ("head", the last two axes,
    shape x.shape[:-2] + (1,)) or everything ("tensor", shape ()); codes by
    saturated_codes; a scale of 0 (all zeros) gives zero codes."""
    x32 = np.asarray(x).astype(np.float32)
    magnitude = np.abs(x32)
    if mode == "row":
        peak = magnitude.max(axis=-1)
    elif mode == "head":
        peak = magnitude.max(axis=(-2, -1))[..., None]
    else:
        peak = magnitude.max()
    scale = np.asarray(peak / np.float32(FMAX[fmt]), np.float32)
    codes = saturated_codes(x32, np.where(scale > 0, scale, np.float32(1)), fmt)
    zero = np.broadcast_to((scale == 0)[..., None], x32.shape)
    return np.where(zero, np.float32(0), codes.astype(np.float32)).astype(fmt), scale


def fp8_operand(rng, shape, fmt, kind):
    """Codes of unit-normal values and their scale of the kind: "none" (the
    codes hold the values), "tensor" (one Python float), "head" (one per
    batch entry and K/V head, shape[:-2] + (1,)) or "row" (shape[:-1])."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "none":
        return saturated_codes(x, np.float32(1), fmt), None
    codes, scale = quantize_reference(x, fmt, kind)
    return codes, (float(scale) if kind == "tensor" else scale)


def from_bytes(b, fmt):
    return np.ascontiguousarray(b, dtype=np.uint8).view(fmt)


def filled(shape, code, fmt):
    """An fp8 array holding one code everywhere (a NaN code: nothing may read it)."""
    return from_bytes(np.full(shape, code, np.uint8), fmt)


def finite_codes(fmt):
    every = np.arange(256, dtype=np.uint8)
    return every[np.isfinite(every.view(fmt).astype(np.float32))]


def unit_codes(rng, shape, fmt):
    return saturated_codes(rng.standard_normal(shape), np.float32(1), fmt)


def repeat_kv(x, group):
    return np.repeat(x, group, axis=-3)


def feature_strided(codes):
    """The same codes with features two bytes apart (a sliced view)."""
    wide = np.zeros(codes.shape[:-1] + (2 * codes.shape[-1],), codes.dtype)
    wide[..., ::2] = codes
    return wide[..., ::2]


def feature_transposed(codes):
    """The same codes with features a row of keys apart (a transposed view)."""
    return np.ascontiguousarray(np.swapaxes(codes, -1, -2)).swapaxes(-1, -2)


def both_named(a, b):
    """A message that names both a and b, in any order."""
    return f"(?s)(?=.*{re.escape(a)})(?=.*{re.escape(b)})"


def check(attn, scores, q, k, v, causal=False, lse=None, f32_abs_cap=1e-5, **options):
    """The tolerance rule for q's dtype: float32 results by the float32 rule,
    a float16 or bfloat16 q's results (in q's dtype) by the rounding rule."""
    q = np.asarray(q)
    attn = np.asarray(attn)
    if q.dtype == np.float32:
        assert attn.dtype == np.float32
        assert_matches_reference(attn, scores, q, k, v, causal, lse=lse, f32_abs_cap=f32_abs_cap,
                                 **options)
    else:
        assert attn.dtype == q.dtype, (attn.dtype, q.dtype)
        assert_half_matches_reference(attn, scores, q, k, v, causal, lse=lse, **options)


def check_non_finite(attn, q, k, v, causal=False, **options):
    """K holding NaN (no infinity), V holding NaN or +-inf: the result is NaN
    and +-inf exactly where the float64 reference is; everything else meets
    the tolerance rule against the reference of the problem with those
    values taken as zero, which is the same there (a NaN key makes only the
    rows that see it NaN, a non-finite value only its column of them)."""
    ref = reference_attention(q, k, v, causal, **options)[0]
    attn = np.asarray(attn)
    bad = ~np.isfinite(ref)
    assert bad.any(), "the case was meant to reach a NaN or an infinity"
    np.testing.assert_array_equal(np.isnan(attn), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(attn), np.isinf(ref))
    np.testing.assert_array_equal(attn[np.isinf(ref)], ref[np.isinf(ref)])
    assert not np.isinf(k).any()
    k0 = np.where(np.isnan(k), 0.0, k)
    v0 = np.where(np.isfinite(v), v, 0.0)
    clean = reference_attention(q, k0, v0, causal, **options)[0]
    filled_in = np.where(bad, clean, attn.astype(np.float64)).astype(attn.dtype)
    check(filled_in, None, q, k0, v0, causal, f32_abs_cap=None, **options)
