"""fp8 K/V (ml_dtypes.float8_e4m3fn and float8_e5m2): attention over fp8
K/V with scales of every shape on every path (the float64 reference on the
dequantized values), bfloat16 prompts over fp8 keys, the special codes
(zeros, subnormals, the largest, NaN, e5m2's infinities), grouped decode
rows, thread counts and strides, and the errors. quantize_kv_fp8 is
test_fp8_quantize.py's, the caches test_fp8_caches.py's."""

import warnings

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

import cattention as ca  # noqa: E402
from reference import (assert_bitwise_equal, assert_matches_reference,  # noqa: E402
                       reference_attention)
from reference import saturated_fp8_codes as saturated_codes  # noqa: E402
from fp8_rules import (BF16, E4M3, E5M2, FMAX, FORMAT_PAIRS, FORMATS, INF_CODES,  # noqa: E402
                       LARGEST, N_SUBNORMALS, NAN_CODES, SCALE_BOUND, SMALLEST, check,
                       check_non_finite, dequantize, feature_strided, feature_transposed,
                       finite_codes, fp8_operand, from_bytes, repeat_kv, unit_codes)


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


# E4M3FN has two decode routes on the AVX-512 tables: codes without a NaN code
# read as 2^-120 times their values with q and the weights 2^120 up, where |q|
# and the weights stay below 2^8 and the thread reads subnormals; else the
# binary16 kernels. Powers of two moved between q (or the weights) and the
# scales take a call from one route to the other and must keep every bit.

@pytest.mark.parametrize("T", [1, 3, 8, 40])
@pytest.mark.parametrize("d", [19, 64, 128])
def test_e4m3_routes_give_the_same_bits(T, d, simd):
    rng = np.random.default_rng(40 + T + d)
    q = rng.standard_normal((1, 4, T, d)).astype(np.float32)
    k, _ = fp8_operand(rng, (1, 2, 150, d), E4M3, "none")
    v, _ = fp8_operand(rng, (1, 2, 150, d), E4M3, "none")
    scale = np.float32(0.75)
    base = ca.attention(q, k, v, k_scale=scale, v_scale=scale, enable_gqa=True)
    assert_matches_reference(base, None, q, repeat_kv(dequantize(k, scale), 2),
                             repeat_kv(dequantize(v, scale), 2))
    # q 1024 times larger (beyond 2^8), K's scale 1024 times smaller
    assert_bitwise_equal(
        ca.attention(q * 1024, k, v, k_scale=scale / 1024, v_scale=scale, enable_gqa=True),
        base)
    # |q| of 2^8 and just below: the largest that stays finite 2^120 up
    edge = q.copy()
    edge[0, :, :, 0] = np.array([256, -256, 255.99998, -255.99998], np.float32)[:, None]
    assert_bitwise_equal(
        ca.attention(edge, k, v, k_scale=scale, v_scale=scale, enable_gqa=True),
        ca.attention(edge / 1024, k, v, k_scale=scale * 1024, v_scale=scale, enable_gqa=True))
    # weights beyond 2^8 on the keys near each row's largest logit
    assert_bitwise_equal(
        ca.attention(q, k, v, k_scale=scale, v_scale=scale * 1024, enable_gqa=True),
        base * 1024)
    # a NaN code in a masked key sends its step's keys and values to the
    # binary16 kernels
    mask = np.ones((T, 150), bool)
    mask[:, 70] = False
    hidden = ca.attention(q, k, v, k_scale=scale, v_scale=scale, mask=mask, enable_gqa=True)
    kb, vb = k.view(np.uint8).copy(), v.view(np.uint8).copy()
    kb[0, 0, 70, 3], vb[0, 1, 70, 5] = 0x7F, 0xFF
    assert_bitwise_equal(
        ca.attention(q, from_bytes(kb, E4M3), from_bytes(vb, E4M3), k_scale=scale,
                     v_scale=scale, mask=mask, enable_gqa=True), hidden)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_e4m3_subnormal_codes_where_the_thread_flushes_subnormals(T, simd):
    """A thread that reads float32 subnormals as zero (torch.set_flush_denormal,
    a library built with -ffast-math) still reads E4M3FN's subnormal codes,
    which the fast route holds as float32 subnormals."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(50 + T)
    q = rng.standard_normal((1, 2, T, 32)).astype(np.float32)
    sign = (rng.integers(0, 2, (1, 2, 64, 32)) << 7).astype(np.uint8)
    k = from_bytes(sign | rng.integers(1, 8, sign.shape).astype(np.uint8), E4M3)
    v = from_bytes(sign[..., ::-1] | rng.integers(1, 8, sign.shape).astype(np.uint8), E4M3)
    scale = np.float32(64)
    assert torch.set_flush_denormal(True)
    try:
        attn = ca.attention(q, k, v, k_scale=scale, v_scale=scale, num_threads=1)
    finally:
        torch.set_flush_denormal(False)
    assert_matches_reference(attn, None, q, dequantize(k, scale), dequantize(v, scale))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scores", [False, True], ids=["attn", "scores"])
@pytest.mark.parametrize("kind", ["special", "head", "tensor"])
def test_fp8_keys_under_bfloat16_queries_on_prompt_rows(fmt, scores, kind, simd):
    """A bfloat16 prompt over fp8 keys: on the tables with bfloat16 tiles
    the codes are multiplied as bfloat16 (every code is one) and each key's
    scale joins its logits (a scale shared by a block's keys, per tensor or
    per entry and head, through the logits' factor); zero, subnormal,
    largest codes and scale 0 (special_codes, a scale per row), causal,
    grouped heads, with and without SCORES."""
    rng = np.random.default_rng(31)
    q = rng.standard_normal((2, 4, 70, 16)).astype(BF16)
    k, ks = (special_codes(rng, (2, 2, 150, 16), fmt) if kind == "special"
             else fp8_operand(rng, (2, 2, 150, 16), fmt, kind))
    v, vs = fp8_operand(rng, (2, 2, 150, 8), fmt, "row")
    result = ca.attention(q, k, v, k_scale=ks, v_scale=vs, causal=True, enable_gqa=True,
                          return_scores=scores)
    attn, weights = result if scores else (result, None)
    check(attn, weights, q, repeat_kv(dequantize(k, ks), 2), repeat_kv(dequantize(v, vs), 2),
          causal=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_nan_keys_under_bfloat16_queries_on_prompt_rows(fmt, simd):
    """A NaN code in a key under bfloat16 prompt rows: the rows that see it
    are NaN, the others exact (NaN stays NaN through the bfloat16 tiles)."""
    rng = np.random.default_rng(32)
    q = rng.standard_normal((1, 2, 40, 16)).astype(BF16)
    k, ks = fp8_operand(rng, (1, 2, 40, 16), fmt, "row")
    v, vs = fp8_operand(rng, (1, 2, 40, 8), fmt, "row")
    kb = k.view(np.uint8).copy()
    kb[0, 1, 23, 5] = NAN_CODES[fmt][0]
    k = from_bytes(kb, fmt)
    attn = ca.attention(q, k, v, k_scale=ks, v_scale=vs, causal=True)
    kd, vd = dequantize(k, ks), dequantize(v, vs)
    ref = reference_attention(q.astype(np.float64), kd, vd, causal=True)[0]
    assert np.isnan(ref[0, 1, 23:]).all() and not np.isnan(ref[0, 1, :23]).any()
    np.testing.assert_array_equal(np.isnan(attn), np.isnan(ref))
    check(attn[:, :1], None, q[:, :1], kd[:, :1], vd[:, :1], causal=True)
    check(attn[:, 1:, :23], None, q[:, 1:, :23], kd[:, 1:, :23], vd[:, 1:, :23], causal=True)


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


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"])
@pytest.mark.parametrize("S", [37, 300])
@pytest.mark.parametrize("d", [64, 128])
def test_grouped_decode_rows_give_each_heads_bits(kv, S, d, simd):
    """Four query heads on one K/V head of a narrow dtype (fp8, bfloat16,
    float16): the decode kernels widen each key once for the four rows
    (and each value once in P.V), and every row gets the bits it gets
    alone, on every table."""
    rng = np.random.default_rng(S + d)
    q = rng.standard_normal((2, 8, 1, d)).astype(np.float32)
    x = rng.standard_normal((2, 2, S, d)).astype(np.float32)
    if kv.startswith("float8"):
        k, ks = ca.quantize_kv_fp8(x, kv, "row")
        scales = dict(k_scale=ks, v_scale=ks)
    else:
        k, scales = x.astype(BF16 if kv == "bfloat16" else np.float16), {}
    grouped = ca.attention(q, k, k, enable_gqa=True, **scales)
    for h in range(8):
        kv_head = slice(h // 4, h // 4 + 1)
        alone = ca.attention(q[:, h:h + 1], k[:, kv_head], k[:, kv_head],
                             **{name: value[:, kv_head] for name, value in scales.items()})
        assert_bitwise_equal(grouped[:, h:h + 1], alone)


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


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_decode_value_columns_of_any_width(fmt, group, simd):
    """P.V of a decode reads V's vectors in pairs where the table widens
    pairs (in an order of its own, put back before the sums join ATTN), a
    masked last vector alone: every column's sum takes the same steps
    whatever V's width, so the first d columns of a wide V are bitwise the
    call over those d columns (and meet the reference)."""
    rng = np.random.default_rng(40 + group)
    q = rng.standard_normal((1, 2 * group, 1, 64)).astype(np.float32)
    k, ks = fp8_operand(rng, (1, 2, 300, 64), fmt, "row")
    v, vs = fp8_operand(rng, (1, 2, 300, 256), fmt, "head")
    wide = ca.attention(q, k, v, k_scale=ks, v_scale=vs, enable_gqa=True)
    for d in (1, 15, 16, 17, 31, 32, 33, 48, 64, 80, 96, 112, 127, 128, 144, 160, 200):
        narrow = ca.attention(q, k, np.ascontiguousarray(v[..., :d]), k_scale=ks, v_scale=vs,
                              enable_gqa=True)
        assert_bitwise_equal(narrow, np.ascontiguousarray(wide[..., :d]))
    assert_matches_reference(wide, None, q, repeat_kv(dequantize(k, ks), group),
                             repeat_kv(dequantize(v, vs), group))
