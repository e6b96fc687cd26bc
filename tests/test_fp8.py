"""fp8 K/V (ml_dtypes.float8_e4m3fn and float8_e5m2): quantize_kv_fp8 against
the quantization rule written out in NumPy, attention over fp8 K/V with
scales of every shape on every path (the float64 reference on the
dequantized values), fp8 KV caches and pages quantized on append (the
stored bytes against the rule, then the reference over what the cache
holds), packed sequences, the special codes (zeros, subnormals, the
largest, NaN, e5m2's infinities), thread counts and strides, and the
errors, each leaving caches and pages as they were."""

import re
import warnings

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

import cattention as ca  # noqa: E402
from reference import (assert_bitwise_equal, assert_half_matches_reference,  # noqa: E402
                       assert_matches_reference, reference_attention)
from reference import saturated_fp8_codes as saturated_codes  # noqa: E402

try:
    # the settings of the cache property tests (40 examples, 400 with
    # CATTENTION_HYPOTHESIS_PROFILE=long); without hypothesis only the
    # property test below is skipped
    from hypothesis import given
    from hypothesis import strategies as st
    from test_cache_properties import _SETTINGS
except (ImportError, pytest.skip.Exception):
    given = None

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


# ---- quantize_kv_fp8 --------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["row", "head", "tensor"])
@pytest.mark.parametrize("x_dtype", [np.float32, np.float64, np.float16], ids=str)
def test_quantize_kv_fp8_computed_scales(fmt, mode, x_dtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 5, 17)) * np.array([1, 10, 0.01])[:, None, None, None]
    x[1, 0, 2] = 0.0                                       # an all-zero row
    x[2, 1] = 0.0                                          # an all-zero head
    x = x.astype(x_dtype)
    codes, scale = ca.quantize_kv_fp8(x, dtype=fmt.name, scale=mode)
    want_codes, want_scale = quantize_reference(x, fmt, mode)
    assert codes.dtype == fmt and codes.shape == x.shape
    assert isinstance(scale, np.ndarray) and scale.dtype == np.float32
    assert scale.shape == {"row": (3, 2, 5), "head": (3, 2, 1), "tensor": ()}[mode]
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(codes.view(np.uint8), want_codes.view(np.uint8))
    values = np.abs(codes.astype(np.float64))
    if mode == "row":
        assert scale[1, 0, 2] == 0 and not values[1, 0, 2].any()
        nonzero = scale > 0
        # every row reaches +-fmax at its largest magnitude
        assert np.all(values.max(axis=-1)[nonzero] == FMAX[fmt])
    elif mode == "head":
        assert scale[2, 1, 0] == 0 and not values[2, 1].any()
        assert np.all(values.max(axis=(-2, -1))[scale[..., 0] > 0] == FMAX[fmt])
    else:
        assert values.max() == FMAX[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["row", "head", "tensor"])
def test_quantize_kv_fp8_error_bound(fmt, mode):
    """|x - code * scale| is at most half a step: |x| / 2^(m+1) for normal
    codes, scale * 2^(emin-m-1) in the subnormal range, plus the float32
    roundings of x and of x / scale."""
    rng = np.random.default_rng(2)
    x = rng.standard_t(3, size=(2, 4, 60, 33))
    # magnitudes from 1e-12 to 1: the subnormal codes of a head's or the tensor's scale
    x[0, 0, 1] = np.logspace(-12, 0, 33) * np.where(np.arange(33) % 2, 1, -1)
    x = x.astype(np.float32)
    codes, scale = ca.quantize_kv_fp8(x, dtype=fmt, scale=mode)
    m, emin = MANTISSA_EMIN[fmt]
    ax = np.abs(x.astype(np.float64))
    s = np.broadcast_to(np.asarray(scale, np.float64)[..., None], x.shape)
    eps = float(np.finfo(np.float32).eps)
    half_step = np.maximum(ax * 2.0 ** -(m + 1) * (1 + 2 * eps), s * 2.0 ** (emin - m - 1))
    bound = half_step + 2 * eps * ax
    err = np.abs(x - dequantize(codes, scale))
    assert np.all(err <= bound)
    # the subnormal range is reached (small values against a head's or the tensor's peak)
    if mode != "row":
        small = np.abs(codes.astype(np.float64))
        assert np.any((small > 0) & (small < 2.0 ** emin))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kv_fp8_takes_the_dtype_as_a_type_a_dtype_or_its_name(fmt):
    x = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)
    results = [ca.quantize_kv_fp8(x, dtype=spelling)
               for spelling in (fmt.type, fmt, fmt.name)]
    want_codes, want_scale = quantize_reference(x, fmt, "row")
    for codes, scale in results:
        assert codes.dtype == fmt
        np.testing.assert_array_equal(codes.view(np.uint8), want_codes.view(np.uint8))
        np.testing.assert_array_equal(scale, want_scale)


def test_quantize_kv_fp8_defaults_to_e4m3fn_per_row():
    x = np.random.default_rng(4).standard_normal((2, 3, 8)).astype(np.float32)
    codes, scale = ca.quantize_kv_fp8(x)
    want_codes, want_scale = quantize_reference(x, E4M3, "row")
    assert codes.dtype == E4M3
    np.testing.assert_array_equal(codes.view(np.uint8), want_codes.view(np.uint8))
    np.testing.assert_array_equal(scale, want_scale)


GIVEN_SCALES = {
    "float": 0.25,
    "float32": np.float32(0.5),
    "per entry and head": np.array([[[0.25], [2.0], [0.0625]], [[1.0], [0.5], [4.0]]],
                                   np.float32),
    "per row": np.linspace(0.05, 3, 30).reshape(2, 3, 5).astype(np.float32),
    "per head, broadcast": np.array([[0.5], [1.0], [0.125]], np.float32),    # (3, 1)
    "list": [[[0.5]], [[1.5]]],                                             # (2, 1, 1)
    "float64 per row": np.linspace(0.05, 3, 30).reshape(2, 3, 5),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("given", GIVEN_SCALES)
def test_quantize_kv_fp8_with_given_scales_saturates(fmt, given):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 5, 11)) * 30
    x[0, 0, 0, :4] = [1e30, -1e30, np.inf, -np.inf]       # beyond fmax: +-fmax
    x[1, 2, 4, 3] = np.nan                                 # NaN stays NaN
    x[0, 1, 3, :3] = [1e-3, -2e-4, 3e-6]                   # the subnormal range, or zero
    scale_in = GIVEN_SCALES[given]
    codes, scale = ca.quantize_kv_fp8(x, dtype=fmt, scale=scale_in)
    assert isinstance(scale, np.ndarray) and scale.dtype == np.float32
    assert scale.shape == np.shape(scale_in)
    np.testing.assert_array_equal(scale, np.asarray(scale_in, np.float32))
    want = saturated_codes(x, np.asarray(scale_in, np.float32), fmt)
    nan = np.isnan(want.astype(np.float32))
    assert nan.sum() == 1
    np.testing.assert_array_equal(np.isnan(codes.astype(np.float32)), nan)
    np.testing.assert_array_equal(codes.view(np.uint8)[~nan], want.view(np.uint8)[~nan])
    fmax = FMAX[fmt]
    np.testing.assert_array_equal(codes[0, 0, 0, :4].astype(np.float64),
                                  [fmax, -fmax, fmax, -fmax])


@pytest.mark.parametrize("mode", ["row", "head", "tensor"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_kv_fp8_refuses_non_finite_values_with_computed_scales(mode, bad):
    x = np.ones((2, 3, 4), np.float32)
    x[1, 2, 3] = bad
    with pytest.raises(ValueError, match=r"(?i)nan|infinite|finite"):
        ca.quantize_kv_fp8(x, scale=mode)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", ["negative", "nan", "inf", "beyond the bound", "shape"])
def test_quantize_kv_fp8_refuses_bad_scales(fmt, bad):
    x = np.ones((2, 3, 5, 4), np.float32)
    scale = {"negative": np.float32(-0.5), "nan": np.float32(np.nan), "inf": np.inf,
             "beyond the bound": np.float32(2 * SCALE_BOUND[fmt]),
             "shape": np.ones(4, np.float32)}[bad]
    with pytest.raises(ValueError, match="scale"):
        ca.quantize_kv_fp8(x, dtype=fmt, scale=scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kv_fp8_takes_a_scale_up_to_the_bound(fmt):
    """float32's largest value / fmax (as float32) is a scale: fmax codes
    times it stay finite in float32, and attention over them is finite."""
    bound = np.float32(SCALE_BOUND[fmt])
    assert np.isfinite(np.float32(FMAX[fmt]) * bound)
    x = np.full((1, 1, 4, 8), F32_MAX, np.float32)
    codes, scale = ca.quantize_kv_fp8(x, dtype=fmt, scale=bound)
    assert np.all(codes.astype(np.float64) == FMAX[fmt])
    # a row at float32's largest value, its scale computed
    k = np.ones((1, 1, 4, 8), np.float32)
    k[0, 0, 1, 3] = F32_MAX
    k_codes, k_scale = ca.quantize_kv_fp8(k, dtype=fmt)
    values = dequantize(k_codes, k_scale)
    assert np.all(np.isfinite(values.astype(np.float32)))
    assert values[0, 0, 1, 3] == pytest.approx(F32_MAX, rel=1e-6)
    for T in (1, 9):
        q = np.full((1, 1, T, 8), 1e-38, np.float32)
        v = np.arange(32, dtype=np.float32).reshape(1, 1, 4, 8)
        attn = ca.attention(q, k_codes, v, k_scale=k_scale, scale=1.0)
        assert_matches_reference(attn, None, q, values, v, scale=1.0)


@pytest.mark.parametrize("dtype,name", [
    ("float8_e4m3", "float8_e4m3"), (ml_dtypes.float8_e4m3fnuz, "float8_e4m3fnuz"),
    ("e4m3", "e4m3"), (np.int8, "int8"), ("float16", "float16"), (np.float32, "float32")])
def test_quantize_kv_fp8_refuses_other_dtypes(dtype, name):
    with pytest.raises((TypeError, ValueError),
                       match=rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"):
        ca.quantize_kv_fp8(np.ones((2, 4), np.float32), dtype=dtype)


@pytest.mark.parametrize("mode", ["rows", "per_tensor", ""])
def test_quantize_kv_fp8_refuses_other_scale_strings(mode):
    with pytest.raises(ValueError, match=rf"scale|'{mode}'"):
        ca.quantize_kv_fp8(np.ones((2, 4), np.float32), scale=mode)


@pytest.mark.parametrize("mode", ["row", "head", "tensor"])
def test_quantize_kv_fp8_scales_go_into_attention(mode):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 3, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, 50, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 50, 8)).astype(np.float32)
    (k8, ks), (v8, vs) = (ca.quantize_kv_fp8(k, scale=mode),
                          ca.quantize_kv_fp8(v, dtype="float8_e5m2", scale=mode))
    attn = ca.attention(q, k8, v8, k_scale=ks, v_scale=vs, enable_gqa=True)
    assert_matches_reference(attn, None, q, repeat_kv(dequantize(k8, ks), 2),
                             repeat_kv(dequantize(v8, vs), 2))


# ---- attention over fp8 K/V ---------------------------------------------------------

#: (B, H, H_kv, T, S, d_k, d_v, K's scale, V's scale, causal): T <= 8 the
#: decode path (and the packed one with SCORES), larger T the packed path;
#: S = 1025 over few heads splits the keys
CASES = {
    "T1-S1-d1": (1, 1, 1, 1, 1, 1, 1, "none", "row", False),
    "T3-S3-d3": (2, 2, 2, 3, 3, 3, 5, "row", "tensor", True),
    "T1-S17-d17": (2, 4, 2, 1, 17, 17, 17, "tensor", "head", True),
    "T8-S97-d65": (1, 4, 2, 8, 97, 65, 65, "head", "none", False),
    "T2-S203-d128": (1, 2, 2, 2, 203, 128, 3, "row", "row", True),
    "T1-S1025-d128": (1, 2, 1, 1, 1025, 128, 128, "row", "head", False),
    "T33-S203-d17": (2, 2, 2, 33, 203, 17, 65, "none", "tensor", True),
    "T100-S97-d65": (1, 2, 2, 100, 97, 65, 1, "tensor", "row", True),     # zero rows
    "T33-S1025-d64": (1, 4, 2, 33, 1025, 64, 64, "head", "row", False),
}


@pytest.mark.parametrize("k_fmt,v_fmt", FORMAT_PAIRS)
@pytest.mark.parametrize("case", CASES)
def test_fp8_attention_matches_the_reference(case, k_fmt, v_fmt, simd):
    B, H, H_kv, T, S, d_k, d_v, k_kind, v_kind, causal = CASES[case]
    rng = np.random.default_rng(100 + list(CASES).index(case))
    q = rng.standard_normal((B, H, T, d_k)).astype(np.float32)
    k, k_scale = fp8_operand(rng, (B, H_kv, S, d_k), k_fmt, k_kind)
    v, v_scale = fp8_operand(rng, (B, H_kv, S, d_v), v_fmt, v_kind)
    group = H // H_kv
    kd, vd = repeat_kv(dequantize(k, k_scale), group), repeat_kv(dequantize(v, v_scale), group)
    options = dict(causal=causal, k_scale=k_scale, v_scale=v_scale, enable_gqa=group > 1)
    attn, lse = ca.attention(q, k, v, return_lse=True, **options)
    assert attn.dtype == np.float32 and attn.shape == (B, H, T, d_v)
    assert_matches_reference(attn, None, q, kd, vd, causal, lse=lse)
    attn, scores = ca.attention(q, k, v, return_scores=True, **options)
    assert_matches_reference(attn, scores, q, kd, vd, causal)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_every_tail_length(fmt, simd):
    """Every feature count 1..33 (the tails of 8, 16 and 32 lanes, K's and
    V's) and every key count 1..33 and around 64 and 128, on the decode path
    (1 row) and the packed one (9 rows)."""
    rng = np.random.default_rng(7)
    shapes = ([(T, 19, d, d) for d in range(1, 34) for T in (1, 9)]
              + [(T, S, 16, 5) for S in [*range(1, 34), 63, 65, 127, 129] for T in (1, 9)])
    for T, S, d_k, d_v in shapes:
        q = rng.standard_normal((1, 2, T, d_k)).astype(np.float32)
        k, ks = fp8_operand(rng, (1, 2, S, d_k), fmt, "row")
        v, vs = fp8_operand(rng, (1, 2, S, d_v), fmt, "head")
        attn = ca.attention(q, k, v, k_scale=ks, v_scale=vs, causal=True)
        assert_matches_reference(attn, None, q, dequantize(k, ks), dequantize(v, vs), True)


OPTIONS = ["gqa-window-lengths", "softcap", "alibi", "sinks", "bool-mask", "additive-mask"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [3, 40])
@pytest.mark.parametrize("option", OPTIONS)
def test_fp8_attention_options(fmt, T, option, simd):
    rng = np.random.default_rng(8 + T)
    B, H, H_kv, S = 2, 4, 2, 203
    q = rng.standard_normal((B, H, T, 17)).astype(np.float32)
    k, ks = fp8_operand(rng, (B, H_kv, S, 17), fmt, "row")
    v, vs = fp8_operand(rng, (B, H_kv, S, 8), fmt, "head")
    causal, mask = True, None
    options = {
        "gqa-window-lengths": dict(window=(30, 0), kv_lengths=np.array([[203], [57]])),
        "softcap": dict(softcap=2.0),
        "alibi": dict(alibi_slopes=np.array([0.05, 0.1, 0.2, 0.4])),
        "sinks": dict(sinks=np.array([0.5, -np.inf, 2.0, -1.0])),
        "bool-mask": {},
        "additive-mask": {},
    }[option]
    if option == "bool-mask":
        causal, mask = False, rng.random((T, S)) > 0.3
    elif option == "additive-mask":
        causal, mask = False, np.where(rng.random((T, S)) > 0.3, rng.standard_normal((T, S)),
                                       -np.inf).astype(np.float32)
    kd, vd = repeat_kv(dequantize(k, ks), 2), repeat_kv(dequantize(v, vs), 2)
    attn, lse = ca.attention(q, k, v, k_scale=ks, v_scale=vs, causal=causal, mask=mask,
                             enable_gqa=True, return_lse=True, **options)
    assert_matches_reference(attn, None, q, kd, vd, causal, mask=mask, lse=lse, **options)
    if T > 8:
        attn, scores = ca.attention(q, k, v, k_scale=ks, v_scale=vs, causal=causal, mask=mask,
                                    enable_gqa=True, return_scores=True, **options)
        assert_matches_reference(attn, scores, q, kd, vd, causal, mask=mask, **options)


@pytest.mark.parametrize("q_dtype", [np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("which", ["kv", "k", "v"])
@pytest.mark.parametrize("T", [4, 40])
def test_fp8_k_or_v_alone_and_16bit_queries(q_dtype, which, T, simd):
    """A float32 q gives float32, a float16 or bfloat16 q its own dtype; the
    operand that is not fp8 has q's dtype."""
    rng = np.random.default_rng(9 + T)
    q = rng.standard_normal((1, 4, T, 17)).astype(q_dtype)
    k8, ks = fp8_operand(rng, (1, 2, 203, 17), E4M3, "row")
    v8, vs = fp8_operand(rng, (1, 2, 203, 9), E5M2, "head")
    k = k8 if "k" in which else dequantize(k8, ks).astype(q_dtype)
    v = v8 if "v" in which else dequantize(v8, vs).astype(q_dtype)
    kd = dequantize(k8, ks) if "k" in which else k.astype(np.float64)
    vd = dequantize(v8, vs) if "v" in which else v.astype(np.float64)
    scales = dict(k_scale=ks if "k" in which else None, v_scale=vs if "v" in which else None)
    attn, lse = ca.attention(q, k, v, causal=True, enable_gqa=True, return_lse=True, **scales)
    assert attn.dtype == q_dtype and lse.dtype == np.float32
    check(attn, None, q, repeat_kv(kd, 2), repeat_kv(vd, 2), True, lse=lse)


def special_codes(rng, shape, fmt):
    """Codes (..., S, d) whose rows cycle through: +-0, subnormals, +-fmax,
    any finite code, unit values, any finite code with scale 0; and the
    per-row scales that make each row O(1)."""
    S = shape[-2]
    sign = (rng.integers(0, 2, shape) << 7).astype(np.uint8)
    finite = finite_codes(fmt)
    b = np.empty(shape, np.uint8)
    scale = np.empty(shape[:-1], np.float32)
    for s in range(S):
        row = (Ellipsis, s, slice(None))
        kind = s % 6
        if kind == 0:
            b[row], scale[..., s] = sign[row], 1.0
        elif kind == 1:
            sub = rng.integers(1, N_SUBNORMALS[fmt] + 1, shape[:-2] + shape[-1:])
            b[row], scale[..., s] = sign[row] | sub.astype(np.uint8), 1 / (4 * SMALLEST[fmt])
        elif kind == 2:
            b[row], scale[..., s] = sign[row] | LARGEST[fmt], 1 / FMAX[fmt]
        elif kind == 4:
            b[row] = unit_codes(rng, shape[:-2] + shape[-1:], fmt).view(np.uint8)
            scale[..., s] = 1.0
        else:
            b[row] = rng.choice(finite, shape[:-2] + shape[-1:])
            scale[..., s] = 1 / FMAX[fmt] if kind == 3 else 0.0
    return from_bytes(b, fmt), scale


@pytest.mark.parametrize("k_fmt,v_fmt", FORMAT_PAIRS[:3])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_fp8_zero_subnormal_and_largest_codes(k_fmt, v_fmt, T, simd):
    rng = np.random.default_rng(10 + T)
    q = rng.standard_normal((2, 2, T, 19)).astype(np.float32)
    k, ks = special_codes(rng, (2, 2, 97, 19), k_fmt)
    v, vs = special_codes(rng, (2, 2, 97, 11), v_fmt)
    kd, vd = dequantize(k, ks), dequantize(v, vs)
    # the codes decode as the formats define them
    assert np.all(np.abs(k[:, :, 2::6].astype(np.float64)) == FMAX[k_fmt])
    sub = np.abs(v[:, :, 1::6].astype(np.float64)) / SMALLEST[v_fmt]
    assert set(np.unique(sub)) == set(range(1, N_SUBNORMALS[v_fmt] + 1))
    attn, lse = ca.attention(q, k, v, k_scale=ks, v_scale=vs, causal=True, return_lse=True)
    assert_matches_reference(attn, None, q, kd, vd, True, lse=lse)
    attn, scores = ca.attention(q, k, v, k_scale=ks, v_scale=vs, return_scores=True)
    assert_matches_reference(attn, scores, q, kd, vd)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 5, 40])
def test_fp8_special_codes_without_scales(fmt, T, simd):
    """No scales: head 0's values are zeros and subnormals only (so that
    their decoding shows in the output), head 1's +-fmax and any finite
    code; K: subnormal codes in head 0, unit values in head 1."""
    rng = np.random.default_rng(11 + T)
    S, finite = 64, finite_codes(fmt)
    sign = (rng.integers(0, 2, (S, 13)) << 7).astype(np.uint8)
    v = np.empty((1, 2, S, 13), np.uint8)
    v[0, 0] = sign | rng.integers(0, N_SUBNORMALS[fmt] + 1, (S, 13)).astype(np.uint8)
    v[0, 1] = np.where(rng.random((S, 13)) < 0.5, sign | LARGEST[fmt], rng.choice(finite, (S, 13)))
    k = np.empty((1, 2, S, 7), np.uint8)
    k[0, 0] = sign[:, :7] | rng.integers(1, N_SUBNORMALS[fmt] + 1, (S, 7)).astype(np.uint8)
    k[0, 1] = unit_codes(rng, (S, 7), fmt).view(np.uint8)
    k, v = from_bytes(k, fmt), from_bytes(v, fmt)
    q = rng.standard_normal((1, 2, T, 7)).astype(np.float32)
    attn, lse = ca.attention(q, k, v, causal=True, return_lse=True)
    assert_matches_reference(attn, None, q, dequantize(k), dequantize(v), True, lse=lse,
                             f32_abs_cap=None)
    # head 0 holds only values below 8 subnormal steps: its outputs too
    assert np.all(np.abs(attn[0, 0]) <= N_SUBNORMALS[fmt] * SMALLEST[fmt] * (1 + 1e-6))
    assert np.any(attn[0, 0] != 0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 4, 33])
def test_fp8_nan_codes_reach_only_the_rows_that_see_them(fmt, T, simd):
    """A NaN code in K makes every row that sees its key NaN; one in V the
    column of those rows; rows that do not see the key stay finite."""
    rng = np.random.default_rng(12 + T)
    S = 40
    q = rng.standard_normal((1, 2, T, 9)).astype(np.float32)
    k, ks = fp8_operand(rng, (1, 2, S, 9), fmt, "row")
    v, vs = fp8_operand(rng, (1, 2, S, 6), fmt, "head")
    kb, vb = k.view(np.uint8).copy(), v.view(np.uint8).copy()
    # causal: key j is seen from row j - (S - T) on
    jk, jv = S - T + T // 2, S - T + (T - 1) // 2
    kb[0, 0, jk, 4] = NAN_CODES[fmt][0]                    # head 0: a NaN key
    vb[0, 1, jv, 2] = NAN_CODES[fmt][-1]                   # head 1: a NaN value
    k, v = from_bytes(kb, fmt), from_bytes(vb, fmt)
    kd, vd = dequantize(k, ks), dequantize(v, vs)
    attn = ca.attention(q, k, v, k_scale=ks, v_scale=vs, causal=True)
    check_non_finite(attn, q, kd, vd, True)
    assert np.isnan(attn[0, 0, T // 2:]).all()
    assert np.isfinite(attn[0, 0, :T // 2]).all()
    assert np.isnan(attn[0, 1, (T - 1) // 2:, 2]).all()
    assert np.isfinite(np.delete(attn[0, 1], 2, axis=-1)).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 4, 33])
@pytest.mark.parametrize("hidden_by", ["mask", "kv_lengths", "window"])
def test_fp8_nan_and_infinity_codes_in_hidden_keys_never_reach_the_output(fmt, T, hidden_by,
                                                                          simd):
    rng = np.random.default_rng(13 + T)
    S = 97
    q = rng.standard_normal((2, 2, T, 9)).astype(np.float32)
    k, ks = fp8_operand(rng, (2, 2, S, 9), fmt, "row")
    v, vs = fp8_operand(rng, (2, 2, S, 6), fmt, "tensor")
    kb, vb = k.view(np.uint8).copy(), v.view(np.uint8).copy()
    bad = NAN_CODES[fmt] + (INF_CODES if fmt == E5M2 else ())
    options, mask = {}, None
    if hidden_by == "mask":
        hidden = [3, 50, 96]
        mask = np.ones((T, S), bool)
        mask[:, hidden] = False
    elif hidden_by == "kv_lengths":
        options = dict(kv_lengths=np.array([[60], [97]]))
        hidden = list(range(60, 97))                       # entry 0's padding
    else:
        options = dict(window=(10, 0))
        hidden = list(range(0, S - T - 11))                # before every row's window
    entries = [0] if hidden_by == "kv_lengths" else [0, 1]
    for i, j in enumerate(hidden):
        for b in entries:
            kb[b, i % 2, j, i % 9] = bad[i % len(bad)]
            vb[b, (i + 1) % 2, j, i % 6] = bad[(i + 1) % len(bad)]
    k, v = from_bytes(kb, fmt), from_bytes(vb, fmt)
    causal = hidden_by != "mask"
    attn, lse = ca.attention(q, k, v, k_scale=ks, v_scale=vs, causal=causal, mask=mask,
                             return_lse=True, **options)
    assert np.all(np.isfinite(attn))
    assert_matches_reference(attn, None, q, dequantize(k, ks), dequantize(v, vs), causal,
                             mask=mask, lse=lse, **options)


@pytest.mark.parametrize("T", [1, 5, 33])
def test_e5m2_infinity_codes(T, simd):
    """+-inf in V: +-inf in the column of every row that sees it. +inf in a
    key: the rows whose logit it makes -inf ignore the key, those it makes
    +inf are NaN (as the formula: e^(inf - inf))."""
    rng = np.random.default_rng(14 + T)
    S = 40
    q = rng.standard_normal((1, 2, T, 9)).astype(np.float32)
    k, ks = fp8_operand(rng, (1, 2, S, 9), E5M2, "row")
    v, vs = fp8_operand(rng, (1, 2, S, 6), E5M2, "row")
    kb, vb = k.view(np.uint8).copy(), v.view(np.uint8).copy()
    vb[0, 0, 5, 1], vb[0, 0, 9, 4] = INF_CODES             # head 0: +inf and -inf values
    kb[0, 1, 7, 0] = INF_CODES[0]                          # head 1: +inf in a key
    q[0, 1, :, 0] = np.where(np.arange(T) % 2, 1.0, -1.0)  # odd rows: a +inf logit
    k, v = from_bytes(kb, E5M2), from_bytes(vb, E5M2)
    kd, vd = dequantize(k, ks), dequantize(v, vs)
    attn = ca.attention(q, k, v, k_scale=ks, v_scale=vs)
    check_non_finite(attn[:, :1], q[:, :1], kd[:, :1], vd[:, :1])
    assert np.all(attn[0, 0, :, 1] == np.inf) and np.all(attn[0, 0, :, 4] == -np.inf)
    ref = reference_attention(q[:, 1:], kd[:, 1:], vd[:, 1:])[0]
    np.testing.assert_array_equal(np.isnan(attn[:, 1:]), np.isnan(ref))
    odd = np.arange(T) % 2 == 1
    assert np.isnan(attn[0, 1, odd]).all()
    even = ~odd
    assert_matches_reference(attn[:, 1:, even], None, q[:, 1:, even], kd[:, 1:], vd[:, 1:])


def _threads_case(case, rng):
    if case == "decode":
        q = rng.standard_normal((2, 8, 1, 128)).astype(np.float32)
        k, ks = fp8_operand(rng, (2, 2, 1025, 128), E4M3, "row")
        v, vs = fp8_operand(rng, (2, 2, 1025, 128), E5M2, "head")
        return (q, k, v), dict(k_scale=ks, v_scale=vs, enable_gqa=True, return_lse=True)
    q = rng.standard_normal((1, 4, 100, 65)).astype(np.float32)
    k, ks = fp8_operand(rng, (1, 2, 203, 65), E5M2, "tensor")
    v, vs = fp8_operand(rng, (1, 2, 203, 17), E4M3, "row")
    return (q, k, v), dict(k_scale=ks, v_scale=vs, enable_gqa=True, causal=True,
                           return_scores=True, return_lse=True)


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_fp8_thread_counts_give_the_same_bits(case):
    (q, k, v), options = _threads_case(case, np.random.default_rng(15))
    runs = [ca.attention(q, k, v, num_threads=n, **options) for n in (1, 2, 3)]
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert_bitwise_equal(got, want)
    kd = repeat_kv(dequantize(k, options["k_scale"]), 4 if case == "decode" else 2)
    vd = repeat_kv(dequantize(v, options["v_scale"]), 4 if case == "decode" else 2)
    scores = runs[0][1] if case == "prefill" else None
    assert_matches_reference(runs[0][0], scores, q, kd, vd, options.get("causal", False),
                             lse=runs[0][-1])


def test_fp8_cache_thread_counts_give_the_same_bits():
    rng = np.random.default_rng(16)
    k_cache, ks = fp8_operand(rng, (3, 2, 600, 64), E4M3, "row")
    v_cache, vs = fp8_operand(rng, (3, 2, 600, 64), E4M3, "row")
    q = rng.standard_normal((3, 4, 1, 64)).astype(np.float32)
    lengths = np.array([600, 17, 333])
    runs = [ca.attention_with_kvcache(q, k_cache, v_cache, lengths.copy(), k_scale=ks,
                                      v_scale=vs, return_lse=True, num_threads=n)
            for n in (1, 2, 3)]
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert_bitwise_equal(got, want)
    for b, n in enumerate(lengths):
        assert_matches_reference(runs[0][0][b], None, q[b],
                                 repeat_kv(dequantize(k_cache[b, :, :n], ks[b, :, :n]), 2),
                                 repeat_kv(dequantize(v_cache[b, :, :n], vs[b, :, :n]), 2),
                                 True, lse=runs[0][1][b])


@pytest.mark.parametrize("T", [1, 8, 40])
@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_fp8_strided_features_give_the_contiguous_bits(T, which, simd):
    """K's features two bytes apart (a slice), V's a row of keys apart (a
    transposed copy), strided scales: the bits of contiguous copies."""
    rng = np.random.default_rng(17 + T)
    q = rng.standard_normal((1, 2, T, 17)).astype(np.float32)
    k, ks = fp8_operand(rng, (1, 2, 300, 17), E4M3, "row")
    v, vs = fp8_operand(rng, (1, 2, 300, 12), E5M2, "row")
    k_view = feature_strided(k) if "k" in which else k
    v_view = feature_transposed(v) if "v" in which else v
    assert not k_view.flags.c_contiguous or not v_view.flags.c_contiguous
    wide = np.zeros(ks.shape[:-1] + (2 * ks.shape[-1],), np.float32)
    wide[..., ::2] = ks
    options = dict(causal=True, return_lse=True)
    got = ca.attention(q, k_view, v_view, k_scale=wide[..., ::2], v_scale=vs[:, ::-1][:, ::-1],
                       **options)
    want = ca.attention(q, k, v, k_scale=ks, v_scale=vs, **options)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w)
    assert_matches_reference(got[0], None, q, dequantize(k, ks), dequantize(v, vs), True,
                             lse=got[1])


def test_fp8_scale_bound_is_the_formats():
    """float32's largest value / fmax: 1e34 is a scale for e4m3fn (bound
    7.6e35), not for e5m2 (5.9e33); each bound itself is one."""
    rng = np.random.default_rng(18)
    q = np.zeros((1, 1, 2, 8), np.float32)                 # logits 0: the mean of V
    for fmt in (E4M3, E5M2):
        k, v = unit_codes(rng, (1, 1, 9, 8), fmt), unit_codes(rng, (1, 1, 9, 4), fmt)
        for scale in (SCALE_BOUND[fmt], 1e34):
            if scale > SCALE_BOUND[fmt]:
                with pytest.raises(ValueError, match="v_scale"):
                    ca.attention(q, k, v, k_scale=1.0, v_scale=scale)
                continue
            attn = ca.attention(q, k, v, k_scale=scale, v_scale=scale)
            assert np.all(np.isfinite(attn))
            assert_matches_reference(attn, None, q, dequantize(k, scale), dequantize(v, scale),
                                     f32_abs_cap=None)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(k=E4M3, q="float64"), TypeError, r"(?i)float8|fp8"),
    (dict(v=E5M2, q="float64"), TypeError, r"(?i)float8|fp8"),
    (dict(k_scale=1.0), ValueError, "k_scale"),                      # k is float32
    (dict(k=E4M3, v_scale=np.ones((1, 2, 9), np.float32)), ValueError, "v_scale"),
    (dict(v=E5M2, k_scale=0.5, v_scale=0.5), ValueError, "k_scale"),  # k float32 again
    (dict(k=E4M3, k_scale=-1.0), ValueError, "k_scale"),
    (dict(k=E4M3, k_scale=np.array([[[1.0], [-0.5]]], np.float32)), ValueError, "k_scale"),
    (dict(v=E5M2, v_scale=np.nan), ValueError, "v_scale"),
    (dict(v=E4M3, v_scale="a NaN row"), ValueError, "v_scale"),
    (dict(k=E4M3, k_scale=np.inf), ValueError, "k_scale"),
    (dict(k=E4M3, k_scale=np.float32(2 * SCALE_BOUND[E4M3])), ValueError, "k_scale"),
    (dict(v=E5M2, v_scale=1e34), ValueError, "v_scale"),
    # beyond float32 (it would be inf), refused as it is
    (dict(k=E4M3, k_scale=1e39), ValueError, "k_scale"),
    (dict(k=E4M3, k_scale=np.ones((1, 2, 8), np.float32)), ValueError, "k_scale"),
    (dict(v=E5M2, v_scale=np.ones((2, 1, 1), np.float32)), ValueError, "v_scale"),
])
def test_fp8_attention_errors(kwargs, error, match):
    rng = np.random.default_rng(19)
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    args = dict(q=q, k=rng.standard_normal((1, 2, 9, 4)).astype(np.float32),
                v=rng.standard_normal((1, 2, 9, 3)).astype(np.float32))
    for name in ("q", "k", "v"):
        value = kwargs.get(name)
        if isinstance(value, np.dtype):
            args[name] = saturated_codes(args[name], np.float32(1), value)
        elif value == "float64":
            args[name] = args[name].astype(np.float64)
    scales = {name: kwargs[name] for name in ("k_scale", "v_scale") if name in kwargs}
    for name, value in scales.items():
        if isinstance(value, str):                         # a per-row scale with one NaN
            scales[name] = np.ones((1, 2, 9), np.float32)
            scales[name][0, 1, 4] = np.nan
    # refused as it is, without a warning on the way (an overflowing cast)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(error, match=match):
            ca.attention(args["q"], args["k"], args["v"], **scales)


# ---- fp8 KV caches --------------------------------------------------------------

def cache_values(cache, scale):
    """What a cache holds, as float64: the codes times the scale broadcast
    against cache.shape[:3] (None: 1)."""
    if scale is None:
        return dequantize(cache)
    return dequantize(cache, np.broadcast_to(np.asarray(scale, np.float32), cache.shape[:3]))


def scale_at(scale, shape):
    """A scale (None, a float, an array) broadcast to shape, float32."""
    return np.broadcast_to(np.asarray(1.0 if scale is None else scale, np.float32), shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T_new", [1, 5])
def test_fp8_cache_quantizes_appended_rows_per_row(fmt, T_new, simd):
    """Per-row scale arrays: appended rows get their scale computed as
    quantize_kv_fp8's "row" and written; the cache reads them in place
    (positions past the lengths hold NaN codes: never read)."""
    rng = np.random.default_rng(20 + T_new)
    B, H, H_kv, S_max, d, d_v = 2, 4, 2, 40, 17, 8
    nan = NAN_CODES[fmt][0]
    k_cache = filled((B, H_kv, S_max, d), nan, fmt)
    v_cache = filled((B, H_kv, S_max, d_v), nan, fmt)
    k_scale = np.zeros((B, H_kv, S_max), np.float32)
    v_scale = np.zeros((B, H_kv, S_max), np.float32)
    k_cache[1, :, :3], k_scale[1, :, :3] = quantize_reference(
        rng.standard_normal((H_kv, 3, d)), fmt)
    v_cache[1, :, :3], v_scale[1, :, :3] = quantize_reference(
        rng.standard_normal((H_kv, 3, d_v)), fmt)
    lengths = np.array([0, 3])
    options = dict(window=(6, 0), softcap=3.0, sinks=np.array([0.5, -np.inf, 1.0, 0.0]))
    for step in range(3):
        before = lengths.copy()
        q = rng.standard_normal((B, H, T_new, d)).astype(np.float32)
        # rows of very different magnitudes
        k_new = (rng.standard_normal((B, H_kv, T_new, d))
                 * rng.lognormal(0, 1, (B, H_kv, T_new, 1))).astype(np.float32)
        v_new = (rng.standard_normal((B, H_kv, T_new, d_v))
                 * rng.lognormal(0, 1, (B, H_kv, T_new, 1))).astype(np.float32)
        attn, lse = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new,
                                              k_scale=k_scale, v_scale=v_scale, return_lse=True,
                                              **options)
        assert attn.dtype == np.float32
        assert lengths.tolist() == (before + T_new).tolist()
        for cache, scale, new in ((k_cache, k_scale, k_new), (v_cache, v_scale, v_new)):
            codes, row_scale = quantize_reference(new, fmt, "row")
            for b in range(B):
                at = slice(before[b], before[b] + T_new)
                np.testing.assert_array_equal(cache[b, :, at].view(np.uint8),
                                              codes[b].view(np.uint8))
                np.testing.assert_array_equal(scale[b, :, at], row_scale[b])
                assert np.all(cache[b, :, lengths[b]:].view(np.uint8) == nan)
                assert not scale[b, :, lengths[b]:].any()
        for b in range(B):
            n = lengths[b]
            kd = dequantize(k_cache[b, :, :n], k_scale[b, :, :n])
            vd = dequantize(v_cache[b, :, :n], v_scale[b, :, :n])
            assert_matches_reference(attn[b], None, q[b], repeat_kv(kd, 2), repeat_kv(vd, 2),
                                     True, lse=lse[b], f32_abs_cap=None, **options)


FIXED_KINDS = ["none", "tensor", "entry-head", "head"]


def fixed_scale(kind, rng, shape):
    """A scale that is not a per-row array: None, a float, one per
    (entry, head) (shape[:2] + (1,)), one per head (1, H_kv, 1)."""
    if kind == "none":
        return None
    if kind == "tensor":
        return 0.03125
    if kind == "entry-head":
        return rng.uniform(0.01, 0.05, shape[:2] + (1,)).astype(np.float32)
    return rng.uniform(0.01, 0.05, (1, shape[1], 1)).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", FIXED_KINDS)
@pytest.mark.parametrize("T", [1, 3])
def test_fp8_cache_with_fixed_scales_saturates_on_append(fmt, kind, T, simd):
    """Scales that are not per-row arrays stay as they are: appended rows are
    saturate(value / scale) rounded to nearest even (beyond fmax and +-inf
    to +-fmax, NaN to a NaN code). The saturated keys sit in feature 0,
    where q is 0; a NaN key makes its rows NaN, a NaN value its column."""
    rng = np.random.default_rng(21 + T)
    B, H, H_kv, S_max, d, d_v = 2, 4, 2, 30, 9, 5
    k_scale, v_scale = (fixed_scale(kind, rng, (B, H_kv)) for _ in range(2))
    k_cache = saturated_codes(rng.standard_normal((B, H_kv, S_max, d)),
                              scale_at(k_scale, (B, H_kv, S_max)), fmt)
    v_cache = saturated_codes(rng.standard_normal((B, H_kv, S_max, d_v)),
                              scale_at(v_scale, (B, H_kv, S_max)), fmt)
    lengths = np.array([5, 9])
    q = rng.standard_normal((B, H, T, d)).astype(np.float32)
    q[..., 0] = 0.0
    k_new = rng.standard_normal((B, H_kv, T, d)).astype(np.float32)
    v_new = rng.standard_normal((B, H_kv, T, d_v)).astype(np.float32)
    k_new[0, 1, 0, 0], k_new[1, 0, 0, 0] = 1e30, -np.inf
    k_new[1, 1, -1, 0], k_new[0, 0, 0, 0] = np.inf, -1e30
    v_new[0, 0, 0, :2] = [1e30, -np.inf]
    v_new[1, 0, -1, 3] = np.inf
    k_new[0, 0, -1, 0] = np.nan                            # entry 0, heads 0 and 1: NaN rows
    v_new[1, 1, -1, 2] = np.nan                            # entry 1, heads 2 and 3: a NaN column
    k_before, v_before = k_cache.copy(), v_cache.copy()
    after = lengths.copy()
    attn = ca.attention_with_kvcache(q, k_cache, v_cache, after, k_new, v_new,
                                     k_scale=k_scale, v_scale=v_scale)
    assert after.tolist() == [5 + T, 9 + T]
    for cache, old, scale, new in ((k_cache, k_before, k_scale, k_new),
                                   (v_cache, v_before, v_scale, v_new)):
        for b in range(B):
            at = slice(lengths[b], lengths[b] + T)
            want = saturated_codes(new[b], scale_at(scale, (B, H_kv, S_max))[b, :, at], fmt)
            got = cache[b, :, at]
            nan = np.isnan(want.astype(np.float32))
            np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
            np.testing.assert_array_equal(got.view(np.uint8)[~nan], want.view(np.uint8)[~nan])
            # the other positions as they were
            rest = np.ones(S_max, bool)
            rest[at] = False
            np.testing.assert_array_equal(cache[b][:, rest].view(np.uint8),
                                          old[b][:, rest].view(np.uint8))
    fmax = FMAX[fmt]
    assert float(k_cache[0, 1, 5, 0]) == fmax and float(k_cache[1, 0, 9, 0]) == -fmax
    assert np.all(v_cache[0, 0, 5, :2].astype(np.float64) == [fmax, -fmax])
    for b in range(B):
        n = after[b]
        kd = cache_values(k_cache, k_scale)[b, :, :n]
        vd = cache_values(v_cache, v_scale)[b, :, :n]
        check_non_finite(attn[b], q[b], repeat_kv(kd, 2), repeat_kv(vd, 2), True)


NEW_DTYPES = [np.float16, BF16, np.float32, np.float64]


@pytest.mark.parametrize("new_dtype", NEW_DTYPES, ids=str)
@pytest.mark.parametrize("per_row", [True, False], ids=["row-scales", "fixed-scale"])
def test_fp8_cache_takes_new_rows_of_every_float_dtype(new_dtype, per_row):
    """float16, bfloat16, float32 and float64 rows, quantized from their
    float32 values; a 16-bit q (that of the rows) gives its own dtype."""
    rng = np.random.default_rng(22)
    fmt = E5M2 if per_row else E4M3
    B, H_kv, S_max, d = 2, 2, 16, 12
    k_cache, v_cache = unit_codes(rng, (B, H_kv, S_max, d), fmt), unit_codes(
        rng, (B, H_kv, S_max, d), fmt)
    if per_row:
        k_scale, v_scale = (np.ones((B, H_kv, S_max), np.float32) for _ in range(2))
    else:
        k_scale, v_scale = 0.125, np.array([[[0.25]], [[0.5]]], np.float32)
    q_dtype = new_dtype if new_dtype in (np.float16, BF16) else np.float32
    q = rng.standard_normal((B, 4, 2, d)).astype(q_dtype)
    k_new = (rng.standard_normal((B, H_kv, 2, d)) * 3).astype(new_dtype)
    v_new = (rng.standard_normal((B, H_kv, 2, d)) * 3).astype(new_dtype)
    lengths = np.array([4, 11])
    attn = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new,
                                     k_scale=k_scale, v_scale=v_scale)
    assert attn.dtype == q_dtype
    for cache, scale, new in ((k_cache, k_scale, k_new), (v_cache, v_scale, v_new)):
        if per_row:
            want, want_scale = quantize_reference(new.astype(np.float32), fmt, "row")
        for b, start in enumerate((4, 11)):
            at = slice(start, start + 2)
            if per_row:
                np.testing.assert_array_equal(scale[b, :, at], want_scale[b])
                want_b = want[b]
            else:
                want_b = saturated_codes(new[b], scale_at(scale, (B, H_kv, S_max))[b, :, at],
                                         fmt)
            np.testing.assert_array_equal(cache[b, :, at].view(np.uint8), want_b.view(np.uint8))
    for b, n in enumerate(lengths):
        kd = cache_values(k_cache, k_scale)[b, :, :n]
        vd = cache_values(v_cache, v_scale)[b, :, :n]
        check(attn[b], None, q[b], repeat_kv(kd, 2), repeat_kv(vd, 2), True)


def _cache_arguments(rng):
    B, H_kv, S_max, d = 2, 2, 32, 16
    k_cache = from_bytes(rng.choice(finite_codes(E4M3), (B, H_kv, S_max, d)), E4M3)
    v_cache = from_bytes(rng.choice(finite_codes(E4M3), (B, H_kv, S_max, d)), E4M3)
    return dict(q=rng.standard_normal((B, 4, 1, d)).astype(np.float32), k_cache=k_cache,
                v_cache=v_cache, k_new=rng.standard_normal((B, H_kv, 1, d)).astype(np.float32),
                v_new=rng.standard_normal((B, H_kv, 1, d)).astype(np.float32),
                k_scale=rng.uniform(0.1, 1, (B, H_kv, S_max)).astype(np.float32),
                v_scale=rng.uniform(0.1, 1, (B, H_kv, S_max)).astype(np.float32))


CACHE_ERRORS = [
    (dict(k_new="int32"), TypeError, both_named("int32", "float8_e4m3fn")),
    (dict(v_new="int8"), TypeError, both_named("int8", "float8_e4m3fn")),
    (dict(v_new=E5M2), TypeError, both_named("float8_e5m2", "float8_e4m3fn")),
    (dict(k_new=E4M3), TypeError, "float8_e4m3fn"),
    (dict(q="float64"), TypeError, r"(?i)float8|fp8"),
    (dict(k_scale=0.0), ValueError, "scale"),              # a fixed 0 where rows go
    (dict(v_scale=np.array([[[0.5]], [[0.0]]], np.float32)), ValueError, "scale"),
    (dict(k_scale=-1.0), ValueError, "k_scale"),
    (dict(v_scale=np.float32(np.nan)), ValueError, "v_scale"),
    (dict(v_scale=2 * SCALE_BOUND[E4M3]), ValueError, "v_scale"),
    (dict(k_new="nan"), ValueError, r"(?i)nan|finite"),    # per-row scales: computed
    (dict(v_new="inf"), ValueError, r"(?i)inf|finite"),
]


@pytest.mark.parametrize("change,error,match", CACHE_ERRORS)
def test_fp8_cache_errors_write_nothing(change, error, match):
    args = _cache_arguments(np.random.default_rng(23))
    for name, value in change.items():
        if isinstance(value, str) and value in ("nan", "inf"):
            args[name] = args[name].copy()
            args[name][1, 0, 0, 3] = np.nan if value == "nan" else np.inf
        elif isinstance(value, (str, np.dtype)):
            args[name] = args[name].astype(value)
        else:
            args[name] = value
    lengths = np.array([3, 1])
    before = {name: args[name].copy() for name in ("k_cache", "v_cache")}
    scales_before = {name: np.copy(args[name]) for name in ("k_scale", "v_scale")}
    with pytest.raises(error, match=match):
        ca.attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"], lengths,
                                  args["k_new"], args["v_new"], k_scale=args["k_scale"],
                                  v_scale=args["v_scale"])
    assert lengths.tolist() == [3, 1]
    for name, old in before.items():
        np.testing.assert_array_equal(args[name].view(np.uint8), old.view(np.uint8))
    for name, old in scales_before.items():
        np.testing.assert_array_equal(np.asarray(args[name]), old)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_fp8_cache_with_strided_features_gives_the_contiguous_bits(fmt, which, simd):
    rng = np.random.default_rng(24)
    q = rng.standard_normal((2, 2, 1, 17)).astype(np.float32)
    k, ks = fp8_operand(rng, (2, 2, 64, 17), fmt, "row")
    v, vs = fp8_operand(rng, (2, 2, 64, 16), fmt, "row")
    lengths = np.array([40, 64])
    expected = ca.attention_with_kvcache(q, k.copy(), v.copy(), lengths.copy(), k_scale=ks.copy(),
                                         v_scale=vs.copy())
    k_cache = feature_strided(k) if "k" in which else k.copy()
    v_cache = feature_strided(v) if "v" in which else v.copy()
    attn = ca.attention_with_kvcache(q, k_cache, v_cache, lengths.copy(), k_scale=ks.copy(),
                                     v_scale=vs.copy())
    assert_bitwise_equal(attn, expected)
    for b, n in enumerate(lengths):
        assert_matches_reference(attn[b], None, q[b], dequantize(k[b, :, :n], ks[b, :, :n]),
                                 dequantize(v[b, :, :n], vs[b, :, :n]), True)


# ---- fp8 pages ---------------------------------------------------------------------

def paged_values(pages, scale, table, b, n):
    """Sequence b's first n positions (H_kv, n, d) of pages, as float64."""
    page_size = pages.shape[2]
    p = np.arange(n)
    rows = cache_values(pages, scale)[table[b, p // page_size], :, p % page_size]
    return np.swapaxes(rows, 0, 1)


def slots_of(table, b, positions, page_size):
    positions = np.asarray(positions)
    return table[b, positions // page_size] * page_size + positions % page_size


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_fp8_pages_quantize_appended_rows_per_row(fmt, page_size, simd):
    """paged_append with per-row scale arrays, then the paged call reading
    them and appending more in the call (decode and a 3-row step)."""
    rng = np.random.default_rng(25 + page_size)
    n_seq, H, H_kv, d, d_v = 2, 4, 2, 17, 8
    max_pages = -(-46 // page_size)
    n_pages = n_seq * max_pages + 2
    table = rng.permutation(n_pages)[:n_seq * max_pages].reshape(n_seq, max_pages)
    nan = NAN_CODES[fmt][-1]
    k_pages = filled((n_pages, H_kv, page_size, d), nan, fmt)
    v_pages = filled((n_pages, H_kv, page_size, d_v), nan, fmt)
    k_scale = np.zeros((n_pages, H_kv, page_size), np.float32)
    v_scale = np.zeros((n_pages, H_kv, page_size), np.float32)
    lengths = np.array([40, 23])
    for b, n in enumerate(lengths):
        k_rows = (rng.standard_normal((n, H_kv, d))
                  * rng.lognormal(0, 1, (n, H_kv, 1))).astype(np.float32)
        v_rows = rng.standard_normal((n, H_kv, d_v)).astype(np.float32)
        slots = slots_of(table, b, np.arange(n), page_size)
        ca.paged_append(k_pages, v_pages, slots, k_rows, v_rows, k_scale=k_scale,
                        v_scale=v_scale)
        for pages, scale, rows in ((k_pages, k_scale, k_rows), (v_pages, v_scale, v_rows)):
            codes, row_scale = quantize_reference(rows, fmt, "row")
            got = pages[slots // page_size, :, slots % page_size]
            np.testing.assert_array_equal(got.view(np.uint8), codes.view(np.uint8))
            np.testing.assert_array_equal(scale[slots // page_size, :, slots % page_size],
                                          row_scale)
    q = rng.standard_normal((n_seq, H, 1, d)).astype(np.float32)
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                           k_scale=k_scale, v_scale=v_scale)
    for b, n in enumerate(lengths):
        assert_matches_reference(attn[b], None, q[b],
                                 repeat_kv(paged_values(k_pages, k_scale, table, b, n), 2),
                                 repeat_kv(paged_values(v_pages, v_scale, table, b, n), 2),
                                 True, f32_abs_cap=None)
    # a 3-row step appended by the call itself, with a window
    q = rng.standard_normal((n_seq, H, 3, d)).astype(np.float32)
    k_new = rng.standard_normal((n_seq, H_kv, 3, d)).astype(np.float32)
    v_new = rng.standard_normal((n_seq, H_kv, 3, d_v)).astype(np.float32)
    after = lengths.copy()
    attn, lse = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, after, k_new, v_new,
                                                k_scale=k_scale, v_scale=v_scale, window=(9, 0),
                                                return_lse=True)
    assert after.tolist() == (lengths + 3).tolist()
    for b, n in enumerate(after):
        slots = slots_of(table, b, np.arange(lengths[b], n), page_size)
        codes, row_scale = quantize_reference(k_new[b].swapaxes(0, 1), fmt, "row")
        np.testing.assert_array_equal(
            k_pages[slots // page_size, :, slots % page_size].view(np.uint8),
            codes.view(np.uint8))
        np.testing.assert_array_equal(v_scale[slots // page_size, :, slots % page_size],
                                      quantize_reference(v_new[b].swapaxes(0, 1), fmt)[1])
        assert_matches_reference(attn[b], None, q[b],
                                 repeat_kv(paged_values(k_pages, k_scale, table, b, n), 2),
                                 repeat_kv(paged_values(v_pages, v_scale, table, b, n), 2),
                                 True, lse=lse[b], f32_abs_cap=None, window=(9, 0))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["none", "tensor", "page-head", "head"])
def test_fp8_paged_append_with_fixed_scales_saturates(fmt, kind, simd):
    """Fixed scales on pages: saturate(value / scale) at each slot; a scale of
    0 on a page nothing is written to is no error; padding slots are
    skipped; the paged call reads what was written."""
    rng = np.random.default_rng(26)
    n_pages, H_kv, page_size, d = 6, 2, 5, 9
    table = np.array([[4, 1], [0, 5]])
    scale = {"none": None, "tensor": 0.0625,
             "page-head": rng.uniform(0.02, 0.1, (n_pages, H_kv, 1)).astype(np.float32),
             "head": np.array([[[0.05]], [[0.1]]], np.float32).reshape(1, 2, 1)}[kind]
    if kind == "page-head":
        # one per (page, head): each appended row divided by the scale at its
        # position; page 3, never written, may have 0
        scale[3] = 0.0
    nan = NAN_CODES[fmt][0]
    k_pages, v_pages = filled((n_pages, H_kv, page_size, d), nan, fmt), filled(
        (n_pages, H_kv, page_size, d), nan, fmt)
    lengths = np.array([8, 6])
    slots = np.concatenate([slots_of(table, 0, np.arange(8), page_size), [-1],
                            slots_of(table, 1, np.arange(6), page_size), [2 * page_size + 1]])
    n_rows = len(slots)
    k_rows = rng.standard_normal((n_rows, H_kv, d)).astype(np.float32)
    v_rows = rng.standard_normal((n_rows, H_kv, d)).astype(np.float32)
    k_rows[[0, 3, 10, 12], 0, 0] = [1e30, -1e30, np.inf, -np.inf]     # feature 0: q is 0 there
    v_rows[[1, 4, 11], 1, 2] = [1e30, -np.inf, np.inf]
    k_rows[-1, 0, 3], v_rows[-1, 1, 1] = np.nan, np.nan    # to spare page 2
    k_before, v_before = k_pages.copy(), v_pages.copy()
    ca.paged_append(k_pages, v_pages, slots, k_rows, v_rows, k_scale=scale, v_scale=scale)
    written = slots >= 0
    s = slots[written]
    for pages, old, rows in ((k_pages, k_before, k_rows), (v_pages, v_before, v_rows)):
        want = saturated_codes(rows[written], scale_at(scale, pages.shape[:3])[
            s // page_size, :, s % page_size], fmt)
        got = pages[s // page_size, :, s % page_size]
        nan_codes = np.isnan(want.astype(np.float32))
        assert nan_codes.sum() == 1
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan_codes)
        np.testing.assert_array_equal(got.view(np.uint8)[~nan_codes],
                                      want.view(np.uint8)[~nan_codes])
        untouched = np.ones(pages.shape[:3], bool)
        untouched[s // page_size, :, s % page_size] = False
        np.testing.assert_array_equal(pages.view(np.uint8)[untouched],
                                      old.view(np.uint8)[untouched])
    fmax = FMAX[fmt]
    assert [float(k_pages[4, 0, i, 0]) for i in (0, 3)] == [fmax, -fmax]
    q = rng.standard_normal((2, 4, 2, d)).astype(np.float32)
    q[..., 0] = 0.0
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                           k_scale=scale, v_scale=scale)
    for b, n in enumerate(lengths):
        assert_matches_reference(attn[b], None, q[b],
                                 repeat_kv(paged_values(k_pages, scale, table, b, n), 2),
                                 repeat_kv(paged_values(v_pages, scale, table, b, n), 2),
                                 True, f32_abs_cap=None)


def _paged_arguments(rng):
    k_pages = from_bytes(rng.choice(finite_codes(E4M3), (4, 2, 8, 16)), E4M3)
    v_pages = from_bytes(rng.choice(finite_codes(E4M3), (4, 2, 8, 16)), E4M3)
    return dict(k_pages=k_pages, v_pages=v_pages, slot_mapping=np.array([1, 9, 30]),
                k_new=rng.standard_normal((3, 2, 16)).astype(np.float32),
                v_new=rng.standard_normal((3, 2, 16)).astype(np.float32),
                k_scale=rng.uniform(0.1, 1, (4, 2, 8)).astype(np.float32),
                v_scale=rng.uniform(0.1, 1, (4, 2, 8)).astype(np.float32))


PAGED_ERRORS = [
    (dict(k_new="int32"), TypeError, both_named("int32", "float8_e4m3fn")),
    (dict(v_new=E5M2), TypeError, both_named("float8_e5m2", "float8_e4m3fn")),
    (dict(k_scale=np.array([[[1.0], [0.0]]], np.float32)), ValueError, "scale"),  # head 1: 0
    (dict(v_scale=0.0), ValueError, "scale"),
    (dict(k_scale=-0.5), ValueError, "k_scale"),
    (dict(v_scale=np.inf), ValueError, "v_scale"),
    (dict(k_new="nan"), ValueError, r"(?i)nan|finite"),    # per-row scales: computed
]


@pytest.mark.parametrize("change,error,match", PAGED_ERRORS)
def test_fp8_paged_append_errors_write_nothing(change, error, match):
    args = _paged_arguments(np.random.default_rng(27))
    for name, value in change.items():
        if isinstance(value, str) and value == "nan":
            args[name] = args[name].copy()
            args[name][2, 1, 5] = np.nan
        elif isinstance(value, (str, np.dtype)):
            args[name] = args[name].astype(value)
        else:
            args[name] = value
    before = {name: args[name].copy() for name in ("k_pages", "v_pages")}
    scales_before = {name: np.copy(args[name]) for name in ("k_scale", "v_scale")}
    with pytest.raises(error, match=match):
        ca.paged_append(**args)
    for name, old in before.items():
        np.testing.assert_array_equal(args[name].view(np.uint8), old.view(np.uint8))
    for name, old in scales_before.items():
        np.testing.assert_array_equal(np.asarray(args[name]), old)


def test_fp8_paged_call_refuses_a_float64_q_and_writes_nothing():
    args = _paged_arguments(np.random.default_rng(28))
    lengths = np.array([3, 5])
    before = args["k_pages"].copy()
    with pytest.raises(TypeError, match=r"(?i)float8|fp8"):
        ca.attention_with_paged_kvcache(np.ones((2, 2, 1, 16)), args["k_pages"],
                                        args["v_pages"], np.array([[0, 1], [2, 3]]), lengths,
                                        np.ones((2, 2, 1, 16), np.float32),
                                        np.ones((2, 2, 1, 16), np.float32),
                                        k_scale=args["k_scale"], v_scale=args["v_scale"])
    assert lengths.tolist() == [3, 5]
    np.testing.assert_array_equal(args["k_pages"].view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_fp8_pages_with_strided_features_give_the_contiguous_bits(fmt, which, simd):
    rng = np.random.default_rng(29)
    k, ks = fp8_operand(rng, (6, 2, 16, 16), fmt, "row")
    v, vs = fp8_operand(rng, (6, 2, 16, 16), fmt, "head")
    q = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    table = np.array([[3, 1, 0], [5, 2, 4]])
    lengths = np.array([40, 33])
    expected = ca.attention_with_paged_kvcache(q, k.copy(), v.copy(), table, lengths.copy(),
                                               k_scale=ks.copy(), v_scale=vs.copy())
    k_pages = feature_strided(k) if "k" in which else k.copy()
    v_pages = feature_strided(v) if "v" in which else v.copy()
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                           k_scale=ks.copy(), v_scale=vs.copy())
    assert_bitwise_equal(attn, expected)
    for b, n in enumerate(lengths):
        assert_matches_reference(attn[b], None, q[b], paged_values(k, ks, table, b, n),
                                 paged_values(v, vs, table, b, n), True)


# ---- packed sequences (attention_varlen) -------------------------------------------

def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def packed_operand(rng, shape, fmt, kind):
    """Codes (total, H_kv, d) and a scale broadcastable to (total, H_kv):
    None, a float, one per K/V head (H_kv,), one per row (total, H_kv)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "none":
        return saturated_codes(x, np.float32(1), fmt), None
    if kind == "head":
        scale = (np.abs(x).max(axis=(0, 2)) / np.float32(FMAX[fmt])).astype(np.float32)
        return saturated_codes(x, scale, fmt), scale
    codes, scale = quantize_reference(x, fmt, kind)
    return codes, (float(scale) if kind == "tensor" else scale)


@pytest.mark.parametrize("k_fmt,v_fmt", FORMAT_PAIRS[:3])
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_fp8_varlen_matches_the_reference(k_fmt, v_fmt, kind, simd):
    rng = np.random.default_rng(30 + SCALE_KINDS.index(kind))
    q_lengths, k_lengths = [1, 9, 1, 40, 3, 0], [30, 9, 1, 203, 0, 5]
    H, H_kv, d, d_v = 4, 2, 17, 3
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    q = rng.standard_normal((cu_q[-1], H, d)).astype(np.float32)
    k, ks = packed_operand(rng, (cu_k[-1], H_kv, d), k_fmt, kind)
    v, vs = packed_operand(rng, (cu_k[-1], H_kv, d_v), v_fmt, kind)
    attn, lse = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=True, enable_gqa=True,
                                    k_scale=ks, v_scale=vs, return_lse=True)
    assert attn.shape == (cu_q[-1], H, d_v) and attn.dtype == np.float32
    kd, vd = dequantize(k, ks), dequantize(v, vs)
    for i in range(len(q_lengths)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        assert_matches_reference(np.swapaxes(attn[rows], 0, 1), None,
                                 np.swapaxes(q[rows], 0, 1),
                                 repeat_kv(np.swapaxes(kd[keys], 0, 1), 2),
                                 repeat_kv(np.swapaxes(vd[keys], 0, 1), 2), True,
                                 lse=np.swapaxes(lse[rows], 0, 1))


def test_fp8_varlen_refuses_bad_scales():
    rng = np.random.default_rng(31)
    q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    k = unit_codes(rng, (5, 2, 8), E4M3)
    with pytest.raises(ValueError, match="k_scale"):
        ca.attention_varlen(q, k, k, [0, 1, 3], [0, 2, 5], k_scale=-1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="v_scale"):
        ca.attention_varlen(q, k, k, [0, 1, 3], [0, 2, 5], v_scale=np.ones((4, 2), np.float32))
    with pytest.raises(TypeError, match=r"(?i)float8|fp8"):
        ca.attention_varlen(q.astype(np.float64), k, k, [0, 1, 3], [0, 2, 5])


# ---- property: random fp8 caches against the reference ------------------------------

def _property_codes(rng, shape, fmt, large):
    """Random codes: mostly unit values, with zeros, subnormals and (when
    large) +-fmax and any finite code."""
    sign = (rng.integers(0, 2, shape) << 7).astype(np.uint8)
    unit = unit_codes(rng, shape, fmt).view(np.uint8)
    sub = sign | rng.integers(1, N_SUBNORMALS[fmt] + 1, shape).astype(np.uint8)
    pick = rng.random(shape)
    b = np.where(pick < 0.1, sign, np.where(pick < 0.25, sub, unit))
    if large:
        b = np.where(pick > 0.95, sign | LARGEST[fmt],
                     np.where(pick > 0.9, rng.choice(finite_codes(fmt), shape), b))
    return b.astype(np.uint8)


def _property_scale(rng, kind, values, lengths):
    """A scale of the kind for codes (B, H_kv, S_max, d) that brings them to
    O(1): None, a float, (B, H_kv, 1), or a per-row array (B, H_kv, S_max)
    with zeros past the lengths and on a few rows."""
    peak = np.abs(values)
    if kind == "none":
        return None
    if kind == "tensor":
        return float(np.float32(rng.uniform(0.5, 2) / max(peak.max(), 1e-3)))
    if kind == "head":
        m = peak.max(axis=(2, 3), keepdims=True)[..., 0]
        return (rng.uniform(0.5, 2, m.shape) / np.maximum(m, 1e-3)).astype(np.float32)
    m = peak.max(axis=3)
    scale = (rng.uniform(0.5, 2, m.shape) / np.maximum(m, 1e-3)).astype(np.float32)
    scale[rng.random(scale.shape) < 0.05] = 0.0
    for b, n in enumerate(lengths):
        scale[b, :, n:] = 0.0
    return scale


if given is not None:
    @st.composite
    def fp8_cache_steps(draw):
        S_max = draw(st.sampled_from([1, 7, 33, 97]))
        B = draw(st.integers(1, 3))
        T_new = draw(st.integers(0, min(S_max, 3)))
        H_kv = draw(st.sampled_from([1, 2]))
        return dict(fmt=draw(st.sampled_from([E4M3, E5M2])), B=B, H_kv=H_kv,
                    H=H_kv * draw(st.sampled_from([1, 2, 3])),
                    d=draw(st.sampled_from([1, 3, 8, 17, 33])),
                    d_v=draw(st.sampled_from([1, 5, 16])), S_max=S_max, T_new=T_new,
                    T=draw(st.integers(1, 9)),
                    lengths=draw(st.lists(st.integers(0, S_max - T_new), min_size=B,
                                          max_size=B)),
                    k_kind=draw(st.sampled_from(SCALE_KINDS)),
                    v_kind=draw(st.sampled_from(SCALE_KINDS)),
                    q_dtype=draw(st.sampled_from([np.float32, np.float16, BF16])),
                    new_dtype=draw(st.sampled_from(NEW_DTYPES)),
                    causal=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))

    @_SETTINGS
    @given(fp8_cache_steps())
    def test_property_fp8_caches_match_the_reference(case):
        """Random fp8 caches (unit codes, zeros, subnormals, +-fmax, any
        finite code; NaN and infinity codes past the lengths), scales of a
        random shape for K and for V, new rows of any float dtype: the bytes
        appended against the rule, the rest of the caches untouched, the
        result against the float64 reference over what the caches hold."""
        rng = np.random.default_rng(case["seed"])
        fmt, B, H, H_kv = case["fmt"], case["B"], case["H"], case["H_kv"]
        d, d_v, S_max, T, T_new = (case[k] for k in ("d", "d_v", "S_max", "T", "T_new"))
        lengths = np.array(case["lengths"])
        caches, scales = [], []
        # past the lengths: NaN and infinity codes, which nothing may read
        tail = np.broadcast_to(np.arange(S_max) >= lengths[:, None, None], (B, H_kv, S_max))
        junk = np.array(NAN_CODES[fmt] + (INF_CODES if fmt == E5M2 else ()), np.uint8)
        for width, kind, is_v in ((d, case["k_kind"], False), (d_v, case["v_kind"], True)):
            # K without a scale keeps to unit codes, zeros and subnormals
            b = _property_codes(rng, (B, H_kv, S_max, width), fmt, large=kind != "none" or is_v)
            b[tail] = rng.choice(junk, (int(tail.sum()), width))
            cache = from_bytes(b, fmt)
            values = np.where(tail[..., None], 0.0, dequantize(cache))
            caches.append(cache)
            scales.append(_property_scale(rng, kind, values, lengths))
        (k_cache, v_cache), (k_scale, v_scale) = caches, scales
        q = rng.standard_normal((B, H, T, d)).astype(case["q_dtype"])
        new = [(rng.standard_normal((B, H_kv, T_new, w))
                * rng.choice([0.5, 1, 4], (B, H_kv, T_new, 1))).astype(case["new_dtype"])
               for w in (d, d_v)]
        before = [c.copy() for c in caches]
        given_lengths = lengths.copy()
        out, lse = ca.attention_with_kvcache(q, k_cache, v_cache, given_lengths, *new,
                                             k_scale=k_scale, v_scale=v_scale,
                                             causal=case["causal"], return_lse=True)
        assert out.dtype == case["q_dtype"]
        assert given_lengths.tolist() == (lengths + T_new).tolist()
        for cache, old, scale, rows in zip(caches, before, scales, new):
            per_row = isinstance(scale, np.ndarray) and scale.shape == cache.shape[:3]
            for b in range(B):
                at = slice(lengths[b], lengths[b] + T_new)
                if per_row:
                    want, want_scale = quantize_reference(rows[b], fmt, "row")
                    np.testing.assert_array_equal(scale[b, :, at], want_scale)
                else:
                    want = saturated_codes(rows[b], scale_at(scale, cache.shape[:3])[b, :, at],
                                           fmt)
                np.testing.assert_array_equal(cache[b, :, at].view(np.uint8),
                                              want.view(np.uint8))
                rest = np.ones(S_max, bool)
                rest[at] = False
                np.testing.assert_array_equal(cache[b][:, rest].view(np.uint8),
                                              old[b][:, rest].view(np.uint8))
        group = H // H_kv
        for b in range(B):
            n = given_lengths[b]
            kd = cache_values(k_cache, k_scale)[b, :, :n]
            vd = cache_values(v_cache, v_scale)[b, :, :n]
            check(out[b], None, q[b], repeat_kv(kd, group), repeat_kv(vd, group),
                  case["causal"], lse=lse[b], f32_abs_cap=None)
else:
    def test_property_fp8_caches_match_the_reference():
        pytest.skip("hypothesis is not installed")
