"""int8 K/V: quantize_kv, attention over int8 K/V with row scales on every path
(the float64 reference on the dequantized values), int8 KV caches quantized
on append, and the errors."""

import warnings

import numpy as np
import pytest

import cattention as ca
from reference import (assert_bitwise_equal, assert_matches_reference, make_qkv,
                       numpy_attention_f32, reference_attention, rms_err)


def dequantize(x_int8, scale):
    """The values int8 K/V stand for, as the docs define them (float32)."""
    return x_int8.astype(np.float32) * scale[..., None]


def repeat_kv(x, group):
    return np.repeat(x, group, axis=-3)


# ---- quantize_kv ---------------------------------------------------------------

def test_quantize_kv_rule():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)) * np.array([1, 10, 0.01])[:, None, None]
    x[1, 2] = 0.0                                    # an all-zero row
    x_int8, scale = ca.quantize_kv(x)
    assert x_int8.dtype == np.int8 and scale.dtype == np.float32
    assert x_int8.shape == x.shape and scale.shape == x.shape[:-1]
    expected_scale = (np.max(np.abs(x.astype(np.float32)), axis=-1) / np.float32(127))
    np.testing.assert_array_equal(scale, expected_scale.astype(np.float32))
    assert scale[1, 2] == 0 and not x_int8[1, 2].any()
    safe = np.where(scale > 0, scale, 1)[..., None]
    expected = np.clip(np.rint(x.astype(np.float32) / safe), -127, 127)
    np.testing.assert_array_equal(x_int8, np.where(scale[..., None] > 0, expected, 0))
    # every row reaches +-127 at its largest magnitude
    nonzero = scale > 0
    assert np.all(np.max(np.abs(x_int8.astype(int)), axis=-1)[nonzero] == 127)


def test_quantize_kv_error_bound():
    """|x - x_int8 * scale| <= scale / 2 (half a step), up to float32 rounding."""
    rng = np.random.default_rng(1)
    x = (rng.standard_t(3, size=(4, 8, 200, 64))).astype(np.float32)
    x_int8, scale = ca.quantize_kv(x)
    err = np.abs(x.astype(np.float64) - dequantize(x_int8, scale).astype(np.float64))
    bound = scale.astype(np.float64)[..., None] / 2 + np.abs(x) * 2 * np.finfo(np.float32).eps
    assert np.all(err <= bound)


@pytest.mark.parametrize("T", [1, 9])
def test_a_row_at_float32s_largest_value_quantizes_to_finite_values(T):
    """float32 max / 127 rounds up to a scale whose 127 steps overflow: the
    scale is the largest below it, and attention over the row is finite."""
    k = np.ones((1, 1, 4, 8), np.float32)
    k[0, 0, 1, 3] = np.finfo(np.float32).max
    k_int8, k_scale = ca.quantize_kv(k)
    values = dequantize(k_int8, k_scale)
    assert np.all(np.isfinite(values))
    assert values[0, 0, 1, 3] == pytest.approx(float(np.finfo(np.float32).max), rel=1e-6)
    q = np.full((1, 1, T, 8), 1e-38, np.float32)
    v = np.arange(32, dtype=np.float32).reshape(1, 1, 4, 8)
    attn = ca.attention(q, k_int8, v, k_scale=k_scale, scale=1.0)
    assert_matches_reference(attn, None, q, values, v, False, scale=1.0)


def test_quantize_kv_error_bound_for_tiny_rows():
    """Rows below float32's normal range: the documented 1/254 of the row's
    largest magnitude, plus at most 1e-43."""
    rng = np.random.default_rng(2)
    for peak in np.logspace(-46, -34, 60):
        x = (rng.uniform(-1, 1, (20, 16)) * peak).astype(np.float32)
        x_int8, scale = ca.quantize_kv(x)
        err = np.abs(x.astype(np.float64) - dequantize(x_int8, scale).astype(np.float64))
        largest = np.abs(x.astype(np.float64)).max(axis=-1, keepdims=True)
        assert np.all(err <= largest / 254 + 1e-43), peak


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_kv_refuses_non_finite_rows(bad):
    x = np.ones((2, 3, 4), np.float32)
    x[1, 2, 3] = bad
    with pytest.raises(ValueError, match=r"NaN or infinite values \(first at row index "
                                         r"\(1, 2\)\)"):
        ca.quantize_kv(x)


def test_quantize_kv_errors():
    with pytest.raises(TypeError, match="real values"):
        ca.quantize_kv(np.ones(3, complex))
    with pytest.raises(ValueError, match="last axis"):
        ca.quantize_kv(1.0)


# ---- attention over int8 K/V ----------------------------------------------------

def quantized(seed, q_shape, k_shape, v_shape):
    q, k, v = make_qkv(seed, q_shape, k_shape, v_shape, np.float32)
    (k8, ks), (v8, vs) = ca.quantize_kv(k), ca.quantize_kv(v)
    return q, k8, ks, v8, vs


# T = 1: direct path (S = 2048 over 2 heads splits the keys); 40, 130: packed
@pytest.mark.parametrize("T,S", [(1, 300), (1, 2048), (5, 77), (40, 300), (130, 129)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_int8_matches_the_reference_of_the_dequantized_values(T, S, causal, which, simd):
    # feature sizes off the 8-lane width: the conversion tails too
    q, k8, ks, v8, vs = quantized(400 + T, (1, 2, T, 37), (1, 2, S, 37), (1, 2, S, 21))
    k = k8 if "k" in which else dequantize(k8, ks)
    v = v8 if "v" in which else dequantize(v8, vs)
    scales = dict(k_scale=ks if "k" in which else None, v_scale=vs if "v" in which else None)
    kd, vd = dequantize(k8, ks), dequantize(v8, vs)
    attn, lse = ca.attention(q, k, v, causal=causal, return_lse=True, **scales)
    assert attn.dtype == np.float32
    assert_matches_reference(attn, None, q, kd, vd, causal, lse=lse)
    if T > 8:
        # packed block by block, the int8 rows give exactly what float32 rows
        # give (decode applies the scales inside its kernels instead, which
        # rounds differently, within the rule above)
        for got, want in zip((attn, lse), ca.attention(q, kd, vd, causal=causal,
                                                       return_lse=True)):
            assert_bitwise_equal(got, want)
    if T * S <= 40000:
        attn, scores = ca.attention(q, k, v, causal=causal, return_scores=True, **scales)
        assert_matches_reference(attn, scores, q, kd, vd, causal)
        assert_bitwise_equal(ca.attention_scores(q, k, causal=causal, k_scale=scales["k_scale"]),
                             scores)


#: (batch, queries, keys, d, which operands are int8): decode rows whose
#: keys are all one chunk (fewer than 16 entries: the keys may split in two)
DECODE_ROWS = {
    "kv-700": (4, 1, 700, 64, "kv"),
    "kv-300-d129": (8, 1, 300, 129, "kv"),
    "v-300-d129": (8, 1, 300, 129, "v"),
}


@pytest.mark.parametrize("case", DECODE_ROWS)
def test_int8_decode_rows_stay_near_numpy(case, simd):
    """The decode kernels added every key's weighted int8 V row to the
    accumulator in one float32 chain, where float32 V sums runs of
    CA_SUM_KEYS keys from zero: ATTN had 1.6-2.8x NumPy's RMS error on the
    dequantized values (25 seeds, every table), inside the tolerance rule
    only by its ulp terms. Runs from zero: 0.44-1.06x. So besides the rule,
    the RMS error must be within 1.4x NumPy's, with no ulp term; V has mean
    1, so that a bias in a row's sum shows in each of its outputs."""
    batch, n_queries, n_keys, d, which = DECODE_ROWS[case]
    rng = np.random.default_rng(23)
    q = rng.standard_normal((batch, n_queries, d), dtype=np.float32)
    k = rng.standard_normal((batch, n_keys, d), dtype=np.float32)
    v = rng.standard_normal((batch, n_keys, d), dtype=np.float32) + 1
    (k8, ks), (v8, vs) = ca.quantize_kv(k), ca.quantize_kv(v)
    kd, vd = dequantize(k8, ks), dequantize(v8, vs)
    if which == "kv":
        attn = ca.attention(q, k8, v8, k_scale=ks, v_scale=vs)
    else:
        kd = k
        attn = ca.attention(q, k, v8, v_scale=vs)
    assert_matches_reference(attn, None, q, kd, vd)
    ref = reference_attention(q, kd, vd)[0]
    numpy_rms = rms_err(numpy_attention_f32(q, kd, vd)[0], ref)
    assert rms_err(attn, ref) <= 1.4 * numpy_rms, (
        f"ATTN RMS error {rms_err(attn, ref):.3g} > 1.4 x NumPy's {numpy_rms:.3g}")


@pytest.mark.parametrize("T", [1, 3, 40])
def test_int8_with_grouped_heads_windows_and_lengths(T, simd):
    q, k8, ks, v8, vs = quantized(410 + T, (2, 8, T, 16), (2, 2, 1200, 16), (2, 2, 1200, 8))
    options = dict(window=(300, 0), kv_lengths=np.array([[1200], [517]]))
    attn, lse = ca.attention(q, k8, v8, k_scale=ks, v_scale=vs, causal=True, enable_gqa=True,
                             return_lse=True, **options)
    kd, vd = dequantize(k8, ks), dequantize(v8, vs)
    assert_matches_reference(attn, None, q, repeat_kv(kd, 4), repeat_kv(vd, 4), True, lse=lse,
                             **options)


def test_int8_with_a_float16_q_and_strided_rows(simd):
    # 10 query rows: the packed path, which converts rows exactly
    q, k8, ks, v8, vs = quantized(420, (1, 2, 10, 16), (1, 2, 90, 16), (1, 2, 90, 8))
    wide = np.zeros((1, 2, 90, 32), np.int8)
    wide[..., ::2] = k8                                  # strided features
    attn = ca.attention(q.astype(np.float16), wide[..., ::2], v8[:, ::-1][:, ::-1],
                        k_scale=ks[:, ::-1][:, ::-1], v_scale=vs)
    assert attn.dtype == np.float16
    expected = ca.attention(q.astype(np.float16).astype(np.float32), dequantize(k8, ks),
                            dequantize(v8, vs))
    assert_bitwise_equal(attn, expected.astype(np.float16))


def feature_strided(x_int8):
    """The same int8 values with features two bytes apart."""
    wide = np.zeros(x_int8.shape[:-1] + (2 * x_int8.shape[-1],), np.int8)
    wide[..., ::2] = x_int8
    return wide[..., ::2]


@pytest.mark.parametrize("T", [1, 4, 8])
@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_int8_strided_features_on_the_direct_path_give_the_contiguous_bits(T, which, simd):
    # at most 8 query rows: the int8 kernels read the rows themselves, so
    # strided features must reach them as the same bytes, not dequantized
    q, k8, ks, v8, vs = quantized(425 + T, (1, 2, T, 16), (1, 2, 300, 16), (1, 2, 300, 12))
    k_strided = feature_strided(k8) if "k" in which else k8
    v_strided = feature_strided(v8) if "v" in which else v8
    assert not k_strided.flags.c_contiguous or not v_strided.flags.c_contiguous
    attn, lse = ca.attention(q, k_strided, v_strided, k_scale=ks, v_scale=vs, causal=True,
                             return_lse=True)
    expected, expected_lse = ca.attention(q, k8, v8, k_scale=ks, v_scale=vs, causal=True,
                                          return_lse=True)
    assert_bitwise_equal(attn, expected)
    assert_bitwise_equal(lse, expected_lse)
    assert_matches_reference(attn, None, q, dequantize(k8, ks), dequantize(v8, vs), True,
                             lse=lse)


@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_int8_cache_with_strided_features_gives_the_contiguous_bits(which, simd):
    q, k8, ks, v8, vs = quantized(427, (1, 2, 1, 16), (1, 2, 64, 16), (1, 2, 64, 16))
    lengths = np.array([40])
    expected = ca.attention_with_kvcache(q, k8.copy(), v8.copy(), lengths.copy(),
                                         k_scale=ks.copy(), v_scale=vs.copy())
    k_cache = feature_strided(k8) if "k" in which else k8.copy()
    v_cache = feature_strided(v8) if "v" in which else v8.copy()
    attn = ca.attention_with_kvcache(q, k_cache, v_cache, lengths.copy(),
                                     k_scale=ks.copy(), v_scale=vs.copy())
    assert_bitwise_equal(attn, expected)
    kd, vd = dequantize(k8[:, :, :40], ks[:, :, :40]), dequantize(v8[:, :, :40], vs[:, :, :40])
    assert_matches_reference(attn, None, q, kd, vd, True)


@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_int8_pages_with_strided_features_give_the_contiguous_bits(which, simd):
    # pages (n_pages, H_kv, page_size, d); sequences of 40 and 33 keys
    _, k8, ks, v8, vs = quantized(428, (1, 1, 1, 16), (6, 2, 16, 16), (6, 2, 16, 16))
    q = make_qkv(429, (2, 2, 1, 16), (1, 1, 1, 16), (1, 1, 1, 16), np.float32)[0]
    table = np.array([[3, 1, 0], [5, 2, 4]])
    lengths = np.array([40, 33])
    expected = ca.attention_with_paged_kvcache(q, k8.copy(), v8.copy(), table, lengths.copy(),
                                               k_scale=ks.copy(), v_scale=vs.copy())
    k_pages = feature_strided(k8) if "k" in which else k8.copy()
    v_pages = feature_strided(v8) if "v" in which else v8.copy()
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                           k_scale=ks.copy(), v_scale=vs.copy())
    assert_bitwise_equal(attn, expected)
    for b in range(2):
        rows = np.concatenate([np.arange(p * 16, p * 16 + 16) for p in table[b]])[:lengths[b]]
        kd = dequantize(k8, ks).transpose(1, 0, 2, 3).reshape(2, 96, 16)[:, rows]
        vd = dequantize(v8, vs).transpose(1, 0, 2, 3).reshape(2, 96, 16)[:, rows]
        assert_matches_reference(attn[b], None, q[b], kd, vd, True)


def test_int8_end_to_end_error_against_unquantized_keys():
    """The error the quantization itself brings on unit-normal K and V: a
    fraction of a percent of the outputs' scale. (Heavy-tailed keys, whose
    outliers set each row's scale, lose more: figures in BENCHMARKS.md.)"""
    rng = np.random.default_rng(430)
    q = rng.standard_normal((1, 4, 8, 64)).astype(np.float32)
    k = rng.standard_normal((1, 4, 512, 64)).astype(np.float32)
    v = rng.standard_normal((1, 4, 512, 64)).astype(np.float32)
    (k8, ks), (v8, vs) = ca.quantize_kv(k), ca.quantize_kv(v)
    exact = ca.attention(q, k, v)
    approx = ca.attention(q, k8, v8, k_scale=ks, v_scale=vs)
    assert np.max(np.abs(approx - exact)) < 0.02 * np.max(np.abs(exact))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(k="int8"), ValueError, r"k is int8 but k_scale is missing.*shape \(1, 2, 9\)"),
    (dict(k="int8", k_scale=np.ones((1, 2, 8), np.float32)), ValueError,
     r"k_scale of shape \(1, 2, 8\) does not match k of shape \(1, 2, 9, 4\)"),
    (dict(k="int8", k_scale="ones", q="float64"), TypeError,
     r"int8 k needs a float32 \(or float16\) q"),
    (dict(k_scale="ones"), ValueError, r"k_scale is given but k has dtype float32"),
    (dict(v="int8", v_scale=-np.ones((1, 2, 9), np.float32)), ValueError,
     r"v_scale must be finite, >= 0 and at most 2\.68e\+36"),
    # 127 steps of it would be beyond float32 (an inf key or value, NaN outputs)
    (dict(k="int8", k_scale=np.full((1, 2, 9), 3e38, np.float32)), ValueError,
     r"k_scale must be finite, >= 0 and at most 2\.68e\+36"),
    # beyond float32 (it would be inf), refused without a cast warning
    (dict(k="int8", k_scale=np.full((1, 2, 9), 1e39)), ValueError,
     r"k_scale must be finite, >= 0 and at most"),
    (dict(v="int8", v_scale=np.full((1, 2, 9), np.nan, np.float32)), ValueError,
     r"v_scale must be finite"),
    (dict(k="int8", k_scale="ones", v="float64"), TypeError,
     r"int8 K/V are computed in float32"),
])
def test_int8_errors(kwargs, error, match):
    q, k, v = make_qkv(440, (1, 2, 3, 4), (1, 2, 9, 4), (1, 2, 9, 3), np.float32)
    args = dict(q=q, k=k, v=v)
    for name in ("q", "k", "v"):
        if isinstance(kwargs.get(name), str) and kwargs[name] == "int8":
            args[name] = ca.quantize_kv(args[name])[0]
        elif isinstance(kwargs.get(name), str) and kwargs[name] == "float64":
            args[name] = args[name].astype(np.float64)
    scales = {name: (np.ones((1, 2, 9), np.float32) if isinstance(kwargs[name], str)
                     else kwargs[name])
              for name in ("k_scale", "v_scale") if name in kwargs}
    # refused as it is, without a warning on the way (an overflowing cast)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(error, match=match):
            ca.attention(args["q"], args["k"], args["v"], **scales)


# ---- int8 KV caches --------------------------------------------------------------

def int8_cache(B=2, H_kv=2, S_max=64, d=16):
    return (np.zeros((B, H_kv, S_max, d), np.int8), np.zeros((B, H_kv, S_max, d), np.int8),
            np.zeros((B, H_kv, S_max), np.float32), np.zeros((B, H_kv, S_max), np.float32))


@pytest.mark.parametrize("T_new", [1, 5])
def test_int8_cache_is_quantized_on_append_and_read_in_place(T_new):
    rng = np.random.default_rng(450)
    k_cache, v_cache, k_scale, v_scale = int8_cache()
    lengths = np.array([0, 0])
    dequantized_k, dequantized_v = [], []
    for step in range(3):
        q = rng.standard_normal((2, 4, T_new, 16)).astype(np.float32)
        k_new = rng.standard_normal((2, 2, T_new, 16)).astype(np.float32)
        v_new = rng.standard_normal((2, 2, T_new, 16)).astype(np.float32)
        attn = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new,
                                         k_scale=k_scale, v_scale=v_scale, sinks=0.5)
        (k8, ks), (v8, vs) = ca.quantize_kv(k_new), ca.quantize_kv(v_new)
        start = step * T_new
        np.testing.assert_array_equal(k_cache[:, :, start:start + T_new], k8)
        np.testing.assert_array_equal(v_scale[:, :, start:start + T_new], vs)
        dequantized_k.append(dequantize(k8, ks))
        dequantized_v.append(dequantize(v8, vs))
        kd = repeat_kv(np.concatenate(dequantized_k, axis=2), 2)
        vd = repeat_kv(np.concatenate(dequantized_v, axis=2), 2)
        assert_matches_reference(attn, None, q, kd, vd, True, sinks=0.5)
    assert lengths.tolist() == [3 * T_new, 3 * T_new]


@pytest.mark.parametrize("change,error,match", [
    (dict(k_scale=None), ValueError, r"int8 caches need k_scale.*\(2, 2, 64\)"),
    (dict(v_scale=np.zeros((2, 2, 63), np.float32)), ValueError,
     r"v_scale must be a native float32 ndarray of shape \(2, 2, 64\)"),
    (dict(k_scale=np.zeros((2, 2, 64))), ValueError, r"k_scale must be a native float32"),
    (dict(k_new="int8"), TypeError, r"k_new of dtype int8 for an int8 cache"),
    (dict(q="float64"), TypeError, r"int8 caches need a float32 \(or float16\) q"),
    (dict(v_cache="float32"), TypeError, r"k_cache \(int8\) and v_cache \(float32\)"),
])
def test_int8_cache_errors_write_nothing(change, error, match):
    k_cache, v_cache, k_scale, v_scale = int8_cache()
    lengths = np.array([3, 1])
    args = dict(q=np.ones((2, 4, 1, 16), np.float32), k_cache=k_cache, v_cache=v_cache,
                k_new=np.ones((2, 2, 1, 16), np.float32), v_new=np.ones((2, 2, 1, 16), np.float32),
                k_scale=k_scale, v_scale=v_scale)
    for name, value in change.items():
        if isinstance(value, str):
            args[name] = args[name].astype(value)
        else:
            args[name] = value
    with pytest.raises(error, match=match):
        ca.attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"], lengths,
                                  args["k_new"], args["v_new"], k_scale=args["k_scale"],
                                  v_scale=args["v_scale"])
    assert lengths.tolist() == [3, 1]
    assert not k_cache.any() and not v_cache.any() and not k_scale.any() and not v_scale.any()


def test_float_caches_refuse_scales():
    k_cache = np.zeros((1, 1, 8, 4), np.float32)
    with pytest.raises(ValueError, match="k_scale and v_scale go with int8 and fp8 caches"):
        ca.attention_with_kvcache(np.ones((1, 1, 1, 4), np.float32), k_cache, k_cache.copy(),
                                  np.array([2]), k_scale=np.ones((1, 1, 8), np.float32))


def test_int8_scales_in_other_byte_order_and_strides():
    q, k8, ks, v8, vs = quantized(460, (1, 2, 3, 16), (1, 2, 80, 16), (1, 2, 80, 8))
    want = ca.attention(q, k8, v8, k_scale=ks, v_scale=vs)
    big_ks = ks.astype(ks.dtype.newbyteorder("S"))
    wide = np.zeros(vs.shape[:-1] + (2 * vs.shape[-1],), np.float32)
    wide[..., ::2] = vs                                   # strided scales
    assert_bitwise_equal(ca.attention(q, k8, v8, k_scale=big_ks, v_scale=wide[..., ::2]), want)
    # float64 scales are taken as float32, the dtype quantize_kv gives
    assert_bitwise_equal(ca.attention(q, k8, v8, k_scale=ks.astype(np.float64), v_scale=vs),
                         want)
