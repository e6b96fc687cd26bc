"""Error paths: every bad input raises a precise exception with a useful message."""

import re
import warnings

import numpy as np
import pytest

import cattention as ca
from reference import (
    assert_bitwise_equal, assert_matches_reference, make_qkv, reference_attention_lse,
    shapes_regex)

SUPPORTED_DTYPES_RE = r"(?s)(?=.*float32)(?=.*float64)"


def _qkv(q_shape, k_shape, v_shape):
    return make_qkv(0, q_shape, k_shape, v_shape)


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("q_shape,k_shape,v_shape,bad", [
    ((8,), (5, 8), (5, 3), (8,)),
    ((3, 8), (8,), (5, 3), (8,)),
    ((3, 8), (5, 8), (5,), (5,)),
    ((), (5, 8), (5, 3), ()),
])
def test_ndim_below_two(q_shape, k_shape, v_shape, bad):
    q, k, v = _qkv(q_shape, k_shape, v_shape)
    with pytest.raises(ValueError, match=shapes_regex(bad)):
        ca.attention(q, k, v)
    if v_shape == (5, 3):  # attention_scores only sees q and k
        with pytest.raises(ValueError, match=shapes_regex(bad)):
            ca.attention_scores(q, k)


@pytest.mark.parametrize("q_shape,k_shape", [
    ((3, 8), (5, 7)),
    ((2, 3, 8), (2, 5, 9)),
    ((3, 1), (5, 8)),
])
def test_dk_mismatch_between_q_and_k(q_shape, k_shape):
    q, k, v = _qkv(q_shape, k_shape, k_shape[:-1] + (4,))
    with pytest.raises(ValueError, match=shapes_regex(q_shape, k_shape)):
        ca.attention(q, k, v)
    with pytest.raises(ValueError, match=shapes_regex(q_shape, k_shape)):
        ca.attention_scores(q, k)


@pytest.mark.parametrize("k_shape,v_shape", [
    ((5, 8), (6, 4)),
    ((2, 5, 8), (2, 4, 8)),
    ((5, 8), (0, 8)),
])
def test_s_mismatch_between_k_and_v(k_shape, v_shape):
    q, k, v = _qkv((3, 8), k_shape, v_shape)
    with pytest.raises(ValueError, match=shapes_regex(k_shape, v_shape)):
        ca.attention(q, k, v)
    with pytest.raises(ValueError, match=shapes_regex(k_shape, v_shape)):
        ca.attention(q, k, v, return_scores=True)


@pytest.mark.parametrize("q_shape,k_shape,v_shape,offenders", [
    ((2, 3, 8), (3, 5, 8), (3, 5, 4), [(2, 3, 8), (3, 5, 8)]),
    ((2, 3, 8), (2, 5, 8), (3, 5, 4), [(2, 5, 8), (3, 5, 4)]),
    ((4, 2, 3, 8), (3, 1, 5, 8), (5, 4), [(4, 2, 3, 8), (3, 1, 5, 8)]),
])
def test_unbroadcastable_batch(q_shape, k_shape, v_shape, offenders):
    q, k, v = _qkv(q_shape, k_shape, v_shape)
    with pytest.raises(ValueError, match=shapes_regex(*offenders)):
        ca.attention(q, k, v)


def test_unbroadcastable_batch_attention_scores():
    q, k, _ = _qkv((2, 3, 8), (3, 5, 8), (5, 4))
    with pytest.raises(ValueError, match=shapes_regex((2, 3, 8), (3, 5, 8))):
        ca.attention_scores(q, k)


@pytest.mark.parametrize("mask_shape", [
    (4, 5),        # T mismatch (T = 3)
    (3, 6),        # S mismatch (S = 5)
    (6,),          # S mismatch, 1-D
    (3, 3, 5),     # batch mismatch (batch = 2)
    (2, 1, 3, 4),
])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_unbroadcastable_mask(mask_shape, kind):
    q, k, v = _qkv((2, 3, 8), (2, 5, 8), (2, 5, 4))
    mask = np.ones(mask_shape, dtype=bool if kind == "bool" else np.float64)
    with pytest.raises(ValueError, match=shapes_regex(mask_shape)):
        ca.attention(q, k, v, mask=mask)
    with pytest.raises(ValueError, match=shapes_regex(mask_shape)):
        ca.attention_scores(q, k, mask=mask)


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------

BAD_DTYPE_MAKERS = {
    "complex64": lambda x: x.astype(np.complex64),
    "complex128": lambda x: x.astype(np.complex128),
    "object": lambda x: x.astype(object),
    "str": lambda x: x.astype(str),
    "bytes": lambda x: x.astype(np.bytes_),
}


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", list(BAD_DTYPE_MAKERS))
def test_unsupported_dtype(bad, which):
    arrays = dict(zip("qkv", _qkv((3, 4), (5, 4), (5, 2))))
    arrays[which] = BAD_DTYPE_MAKERS[bad](arrays[which])
    with pytest.raises(TypeError, match=SUPPORTED_DTYPES_RE):
        ca.attention(arrays["q"], arrays["k"], arrays["v"])
    if which != "v":
        with pytest.raises(TypeError, match=SUPPORTED_DTYPES_RE):
            ca.attention_scores(arrays["q"], arrays["k"])


@pytest.mark.parametrize("mask_dtype", [np.int8, np.int32, np.int64, np.uint8])
def test_integer_mask_is_type_error(mask_dtype):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    mask = np.ones((3, 5), dtype=mask_dtype)
    with pytest.raises(TypeError, match=r"(?i)mask"):
        ca.attention(q, k, v, mask=mask)
    with pytest.raises(TypeError, match=r"(?i)mask"):
        ca.attention_scores(q, k, mask=mask)


# ---------------------------------------------------------------------------
# scale
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [np.inf, -np.inf, np.nan, np.float32(np.nan)],
                         ids=["inf", "-inf", "nan", "float32-nan"])
def test_non_finite_scale(scale):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(ValueError, match=r"(?i)scale"):
        ca.attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match=r"(?i)scale"):
        ca.attention_scores(q, k, scale=scale)


def test_zero_dk_without_scale():
    q, k, v = _qkv((3, 0), (5, 0), (5, 2))
    with pytest.raises(ValueError, match=r"(?i)d_k|scale"):
        ca.attention(q, k, v)


# ---------------------------------------------------------------------------
# Signature
# ---------------------------------------------------------------------------

def test_options_are_keyword_only():
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(TypeError, match=r"(?i)positional|argument"):
        ca.attention(q, k, v, True)
    with pytest.raises(TypeError, match=r"(?i)positional|argument"):
        ca.attention_scores(q, k, True)


def test_unknown_keyword():
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(TypeError, match=r"(?i)keyword|argument|casual"):
        ca.attention(q, k, v, casual=True)


# ---------------------------------------------------------------------------
# Arguments that are not arrays, options of the wrong kind
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_none_operand_names_it(which):
    arrays = dict(zip("qkv", _qkv((3, 4), (5, 4), (5, 2))))
    arrays[which] = None
    with pytest.raises((TypeError, ValueError), match=rf"^{which} must be an array, got None"
                       if which != "v" else r"v is required"):
        ca.attention(arrays["q"], arrays["k"], arrays["v"])
    if which != "v":
        with pytest.raises(TypeError, match=rf"^{which} must be an array, got None"):
            ca.attention_scores(arrays["q"], arrays["k"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_ragged_list_names_the_argument(which):
    arrays = dict(zip("qkv", _qkv((3, 4), (5, 4), (5, 2))))
    arrays[which] = [[1.0, 2.0], [3.0]]
    with pytest.raises(ValueError, match=rf"^{which} is not a regular array"):
        ca.attention(arrays["q"], arrays["k"], arrays["v"])


@pytest.mark.parametrize("value", [np.array([True, False]), "no", "", 1, 0, None, 1.0],
                         ids=["array", "str-no", "str-empty", "int1", "int0", "None",
                              "float"])
@pytest.mark.parametrize("flag", ["causal", "return_scores", "return_lse", "enable_gqa"])
def test_flags_must_be_bools(flag, value):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
        ca.attention(q, k, v, **{flag: value})
    if flag in ("causal", "enable_gqa"):
        with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
            ca.attention_scores(q, k, **{flag: value})


def test_numpy_bools_are_bools():
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    assert_equal = np.testing.assert_array_equal
    assert_equal(ca.attention(q, k, v, causal=np.True_), ca.attention(q, k, v, causal=True))


@pytest.mark.parametrize("n", [2**31, 2**63, 10**30])
def test_huge_num_threads_names_the_argument(n):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(ValueError, match=r"^num_threads must be at most 2147483647"):
        ca.attention(q, k, v, num_threads=n)
    # set_num_threads and limit_threads name their parameter, n
    with pytest.raises(ValueError, match=r"^n must be at most 2147483647"):
        ca.set_num_threads(n)
    with pytest.raises(ValueError, match=r"^n must be at most 2147483647"):
        with ca.limit_threads(n):
            pass


@pytest.mark.parametrize("scale", [1e300, -1e39, 1e-50, 3.5e38])
def test_scale_float32_cannot_hold_is_refused(scale):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"scale .* not representable in float32"):
        ca.attention(q32, k32, v32, scale=scale)
    with pytest.raises(ValueError, match=r"scale .* not representable in float32"):
        ca.attention_scores(q32, k32, scale=scale)
    # float64 inputs hold it, and give a number where the docs promise one
    out = ca.attention(q, k, v, scale=1e-50 if scale == 1e-50 else 1e30)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("n_queries", [1, 9])
def test_dot_product_beyond_float32_is_a_nan_row_as_documented(n_queries):
    # q.k = 5.8e38 overflows float32 before the scale (1/8) would bring it
    # to 7.2e37: the docs say such a row is NaN; rows with finite dot
    # products are not touched by it
    q = np.zeros((n_queries, 64), np.float32)
    q[0] = 3e18
    k = np.zeros((3, 64), np.float32)
    k[0] = 3e18
    v = np.arange(9, dtype=np.float32).reshape(3, 3)
    out = ca.attention(q, k, v)
    assert np.all(np.isnan(out[0]))
    assert_matches_reference(out[1:], None, q[1:], k, v)
    # the same logits from dot products float32 holds are a number
    out = ca.attention(q / np.float32(8), k, v, scale=1.0)
    assert_matches_reference(out, None, q / np.float32(8), k, v, scale=1.0)


def _rows_of_neg_inf_logits(n_queries, n_keys, dtype=np.float32):
    """Row 0's every q.k is -5.8e38, beyond float32, and row 1's is -inf in
    any dtype (an infinity in q: the reference's own NaN row); the other
    rows have finite logits."""
    q = np.zeros((n_queries, 64), dtype)
    q[0] = 3e18
    q[1, 0] = np.inf
    k = np.full((n_keys, 64), -3e18, dtype)
    k[:, 1:] = 1.0 if dtype == np.float64 else -3e18
    v = np.arange(n_keys * 3, dtype=dtype).reshape(n_keys, 3) / n_keys
    return q, k, v


@pytest.mark.parametrize("n_queries,n_keys", [(2, 3), (9, 3), (9, 700), (2, 5000)])
def test_a_row_whose_every_logit_is_minus_inf_is_nan_not_empty(simd, n_queries, n_keys):
    # A row that sees keys whose logits are all -inf is NaN (-inf - (-inf) in
    # the formula, and the reference's NaN), not a row that sees no key: with
    # return_scores or not, few rows (keys read in place, split into chunks
    # for 5000 keys) or many (packed), and through the KV cache.
    q, k, v = _rows_of_neg_inf_logits(n_queries, n_keys)
    out, lse = ca.attention(q, k, v, return_lse=True)
    with_scores, scores, lse_s = ca.attention(q, k, v, return_scores=True, return_lse=True)
    for attn, row_lse in ((out, lse), (with_scores, lse_s)):
        assert np.all(np.isnan(attn[:2])) and np.all(np.isnan(row_lse[:2]))
        if n_queries > 2:
            assert_matches_reference(attn[2:], None, q[2:], k, v, lse=row_lse[2:],
                                     f32_abs_cap=None)
    assert np.all(np.isnan(scores[:2]))
    assert_bitwise_equal(scores, ca.attention_scores(q, k))
    # an infinity in q gives -inf logits in float64 too: the reference's NaN
    # row (row 1), beside rows whose LSE must be theirs (float64 LSE rows
    # of a call whose keys are split into chunks among them)
    q64, k64, v64 = _rows_of_neg_inf_logits(n_queries, n_keys, np.float64)
    out64, lse64 = ca.attention(q64, k64, v64, return_lse=True)
    ref = reference_attention_lse(q64, k64, v64)[0]
    assert np.all(np.isnan(out64[1])) and np.all(np.isnan(ref[1])) and np.isnan(lse64[1])
    others = np.arange(n_queries) != 1
    assert_matches_reference(out64[others], None, q64[others], k64, v64,
                             lse=lse64[others], f64_abs_tol=1e-9)
    k_cache = np.zeros((1, 1, n_keys + 4, 64), np.float32)
    v_cache = np.zeros((1, 1, n_keys + 4, 3), np.float32)
    lengths = np.zeros(1, np.int64)
    cached = ca.attention_with_kvcache(q[None, None], k_cache, v_cache, lengths,
                                       k[None, None], v[None, None], causal=False)
    assert np.all(np.isnan(cached[0, 0, :2]))
    assert_bitwise_equal(cached[0, 0, 2:], out[2:])


@pytest.mark.parametrize("n_queries,n_keys", [(2, 3), (9, 700), (2, 5000)])
def test_a_row_of_minus_inf_logits_that_sees_no_key_or_has_a_sink_is_a_number(
        simd, n_queries, n_keys):
    q, k, v = _rows_of_neg_inf_logits(n_queries, n_keys)
    # a sink takes the whole row: zeros, and the sink's LSE (the reference's)
    sinks = np.array([0.5], np.float32)           # one head
    out, lse = ca.attention(q[None], k[None], v[None], sinks=sinks, return_lse=True)
    assert np.all(out[0, :2] == 0) and np.all(lse[0, :2] == np.float32(0.5))
    assert_matches_reference(out[:, 2:], None, q[None, 2:], k[None], v[None],
                             lse=lse[:, 2:], sinks=sinks, f32_abs_cap=None)
    # every key masked out (bool or additive, or float64 entries beyond
    # float32's range, which mask float32 inputs): a row that sees no key
    # is zero
    hidden = np.ones((n_queries, n_keys), bool)
    hidden[:2] = False
    additive = np.where(hidden, np.float32(0), np.float32(-np.inf))
    beyond_float32 = np.where(hidden, 0.0, -1e300)
    for mask in (hidden, additive, beyond_float32):
        out, lse = ca.attention(q, k, v, mask=mask, return_lse=True)
        assert np.all(out[:2] == 0) and np.all(lse[:2] == -np.inf)
        assert_matches_reference(out[2:], None, q[2:], k, v, mask=mask[2:], lse=lse[2:],
                                 f32_abs_cap=None)
    # one key left visible by the mask is enough to make the row NaN
    hidden[:2, -1] = True
    out = ca.attention(q, k, v, mask=hidden)
    assert np.all(np.isnan(out[:2]))


@pytest.mark.parametrize("n_queries,n_keys", [(1, 2), (9, 2), (3, 300), (9, 700), (2, 5000)])
def test_values_near_the_largest_float_give_their_weighted_mean(simd, dtype, n_queries,
                                                                 n_keys):
    # ATTN is a weighted mean of V, so it is finite when V is, however close
    # to the dtype's largest value: the sum of weighted values before the
    # division must not overflow (it did, to inf, with two keys of 2e38).
    # Head 0 has such values in column 0 (one infinite value among them in
    # its last query's visible keys: that row is inf, as in the reference);
    # head 1 and the LSE keep the bits of the same call on unit-scale values.
    big = 2e38 if dtype == np.float32 else 1e308
    rng = np.random.default_rng(n_keys)
    q = rng.standard_normal((2, n_queries, 8)).astype(dtype)
    k = rng.standard_normal((2, n_keys, 8)).astype(dtype)
    v = rng.standard_normal((2, n_keys, 3)).astype(dtype)
    unit_scale = v.copy()
    v[0, :, 0] = big * (0.75 + 0.25 * rng.random(n_keys))
    mask = np.ones((n_queries, n_keys), bool)
    mask[:-1, -1] = False                  # only the last query sees key -1
    v[0, -1, 0] = np.inf
    out, lse = ca.attention(q, k, v, mask=mask, return_lse=True)
    assert np.all(np.isinf(out[0, -1, 0])) and np.all(np.isfinite(out[0, :-1]))
    # (the other rows do not see the infinite value's key)
    assert_matches_reference(out[:, :-1], None, q[:, :-1], k[:, :-1], v[:, :-1],
                             f32_abs_cap=None, f64_abs_tol=1e-14 * big)
    plain, plain_lse = ca.attention(q, k, unit_scale, mask=mask, return_lse=True)
    assert_bitwise_equal(out[1], plain[1])
    assert_bitwise_equal(lse, plain_lse)
    # through the KV cache too (no mask, and no infinite value)
    v[0, -1, 0] = big
    cached = ca.attention_with_kvcache(q[None], np.zeros((1, 2, n_keys, 8), dtype),
                                       np.zeros((1, 2, n_keys, 3), dtype),
                                       np.zeros(1, np.int64), k[None], v[None], causal=False)
    assert_matches_reference(cached[0], None, q, k, v, f32_abs_cap=None,
                             f64_abs_tol=1e-14 * big)


@pytest.mark.parametrize("scale", [0.0, -0.0, 3.0e38, -3.0e38, 1.5e-45, -2.0])
def test_scale_at_float32_limits_is_accepted(scale):
    q, k, v = (x.astype(np.float32) for x in _qkv((3, 4), (5, 4), (5, 2)))
    if abs(scale) > 1:
        # logits must stay finite in float32 (documented): zero queries keep them 0
        q = np.zeros_like(q)
    out = ca.attention(q, k, v, scale=scale)
    assert_matches_reference(out, None, q, k, v, scale=scale)


def test_fewer_kv_heads_without_enable_gqa_hints_at_it():
    q, k, v = _qkv((2, 8, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3))
    with pytest.raises(ValueError, match=r"batch dimensions.*pass enable_gqa=True"):
        ca.attention(q, k, v)
    with pytest.raises(ValueError, match=r"pass enable_gqa=True"):
        ca.attention_scores(q, k)
    # a real mismatch gets no hint
    q, k, v = _qkv((2, 8, 3, 4), (2, 3, 5, 4), (2, 3, 5, 3))
    with pytest.raises(ValueError, match=r"batch dimensions") as info:
        ca.attention(q, k, v)
    assert "enable_gqa" not in str(info.value)


# ---------------------------------------------------------------------------
# Options the compute dtype cannot hold; in-place calls refuse before writing
# ---------------------------------------------------------------------------

def _paged_call(q, k_pages, v_pages, lengths, **options):
    """One sequence over pages [0, 1] of (2, H_kv, 4, d) pages."""
    return ca.attention_with_paged_kvcache(q, k_pages, v_pages, np.array([[0, 1]]), lengths,
                                           **options)


def _entry_points(dtype):
    """attention, attention_varlen, attention_with_kvcache and the paged
    call on the same 1 sequence x 2 heads x 3 keys, as callables of options."""
    q, k, v = (x.astype(dtype) for x in make_qkv(5, (1, 2, 1, 4), (1, 2, 3, 4), (1, 2, 3, 4)))
    k_pages = np.zeros((2, 2, 4, 4), dtype)
    v_pages = np.zeros((2, 2, 4, 4), dtype)
    k_pages[0, :, :3], v_pages[0, :, :3] = k[0], v[0]
    return {
        "attention": lambda **o: ca.attention(q, k, v, **o),
        "varlen": lambda **o: ca.attention_varlen(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2),
                                                  v[0].transpose(1, 0, 2), np.array([0, 1]),
                                                  np.array([0, 3]), **o),
        "kvcache": lambda **o: ca.attention_with_kvcache(q, k.copy(), v.copy(), np.array([3]),
                                                         **o),
        "paged": lambda **o: _paged_call(q, k_pages.copy(), v_pages.copy(), np.array([3]), **o),
    }


@pytest.mark.parametrize("entry", ["attention", "varlen", "kvcache", "paged"])
@pytest.mark.parametrize("option,match", [
    (dict(softcap=1e39), r"softcap 1e\+39 is not representable in float32"),
    (dict(softcap=1e-46), r"softcap 1e-46 is not representable in float32"),
    (dict(sinks=np.array([0.0, 1e39])), r"sinks must be at most 3.403e\+38 \(the largest "
                                        r"float32"),
])
def test_options_float32_cannot_hold_are_refused(entry, option, match):
    with pytest.raises(ValueError, match=match):
        _entry_points(np.float32)[entry](**option)
    # float64 inputs hold them, and give numbers
    out = _entry_points(np.float64)[entry](**option)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("entry", ["attention", "varlen", "kvcache", "paged"])
def test_a_sink_below_float32_weighs_nothing(entry):
    call = _entry_points(np.float32)[entry]
    assert np.array_equal(call(sinks=np.array([-1e39, -np.inf])), call())


@pytest.mark.parametrize("entry", ["attention", "varlen", "kvcache", "paged"])
def test_a_window_wider_than_any_sequence_is_no_window(entry):
    call = _entry_points(np.float32)[entry]
    expected = call(window=None, causal=False)
    q, k, v = make_qkv(5, (1, 2, 1, 4), (1, 2, 3, 4), (1, 2, 3, 4))
    assert_matches_reference(expected.reshape(1, 2, 1, 4), None, q.astype(np.float32),
                             k.astype(np.float32), v.astype(np.float32))
    for side in (2**62, 2**63, 10**30):
        assert np.array_equal(call(window=(side, None), causal=False), expected)
        assert np.array_equal(call(window=(None, side), causal=False), expected)


def _snapshot(*arrays):
    return [a.copy() for a in arrays]


def _unchanged(before, *arrays):
    return all(np.array_equal(b, a, equal_nan=True) for b, a in zip(before, arrays))


def test_int8_cache_scales_are_checked_before_the_append():
    k_cache = np.zeros((1, 2, 8, 4), np.int8)
    v_cache = k_cache.copy()
    k_scale = np.zeros((1, 2, 8), np.float32)
    v_scale = k_scale.copy()
    k_scale[..., 4:] = np.nan
    lengths = np.array([0])
    x = np.ones((1, 2, 1, 4), np.float32)
    before = _snapshot(k_cache, v_cache, k_scale, v_scale, lengths)
    with pytest.raises(ValueError, match=r"k_scale must be finite, >= 0 and at most 2\.68e\+36 "
                                         r"\(float32's largest value / 127\) everywhere"):
        ca.attention_with_kvcache(x, k_cache, v_cache, lengths, x, x, k_scale=k_scale,
                                  v_scale=v_scale)
    assert _unchanged(before, k_cache, v_cache, k_scale, v_scale, lengths)


def test_paged_lengths_beyond_int64_are_refused_before_the_append():
    k_pages = np.zeros((4, 1, 2, 4), np.float32)
    v_pages = k_pages.copy()
    x = np.ones((1, 1, 1, 4), np.float32)
    lengths = np.array([2**63 + 3], np.uint64)
    before = _snapshot(k_pages, v_pages, lengths)
    with pytest.raises(ValueError, match=r"sequence 0 needs 9223372036854775812 positions "
                                         r"\(cache_lengths 9223372036854775811 \+ 1 new\)"):
        ca.attention_with_paged_kvcache(x, k_pages, v_pages, np.array([[0, 1, 2, 3]]),
                                        lengths, x, x)
    assert _unchanged(before, k_pages, v_pages, lengths)


def test_paged_lengths_that_share_memory_with_the_block_table():
    # advancing cache_lengths rewrites the caller's table; the call reads
    # the table it checked
    k_pages = np.zeros((1, 1, 1000, 4), np.float32)
    v_pages = k_pages.copy()
    x = make_qkv(6, (1, 1, 1000, 4), (1, 1, 1, 4), (1, 1, 1, 4), np.float32)[0]
    meta = np.zeros(1, np.intp)
    out = ca.attention_with_paged_kvcache(x, k_pages, v_pages, meta.reshape(1, 1), meta, x, x)
    expected = ca.attention_with_paged_kvcache(x, np.zeros_like(k_pages),
                                               np.zeros_like(v_pages), np.zeros((1, 1), np.intp),
                                               np.zeros(1, np.intp), x, x)
    assert np.array_equal(out, expected)
    assert meta[0] == 1000


def _cache_args():
    rng = np.random.default_rng(7)
    cache = rng.standard_normal((2, 2, 8, 4)).astype(np.float32)
    new = rng.standard_normal((2, 2, 1, 4)).astype(np.float32)
    return cache, new


@pytest.mark.parametrize("alias", ["k_cache is v_cache", "overlapping views", "q in k_cache",
                                   "v_new in k_cache", "k_new in v_cache"])
def test_kvcache_refuses_arrays_sharing_memory_with_what_it_writes(alias):
    buffer, new = _cache_args()
    k_cache, v_cache = buffer, buffer.copy()
    q, k_new, v_new = new.copy(), new.copy(), new.copy()
    if alias == "k_cache is v_cache":
        v_cache = k_cache
    elif alias == "overlapping views":
        wide = np.zeros((2, 2, 9, 4), np.float32)
        k_cache, v_cache = wide[:, :, :8], wide[:, :, 1:]
    elif alias == "q in k_cache":
        q = k_cache[:, :, 3:4]
    elif alias == "v_new in k_cache":
        v_new = k_cache[:, :, 3:4]
    else:
        k_new = v_cache[:, :, 3:4]
    lengths = np.array([3, 3])
    before = _snapshot(k_cache, v_cache, lengths)
    with pytest.raises(ValueError, match=r"share memory, but .* is written in place"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new)
    assert _unchanged(before, k_cache, v_cache, lengths)


def test_kvcache_accepts_k_and_v_interleaved_in_one_buffer():
    fused = np.zeros((2, 2, 2, 8, 4), np.float32)       # (B, H_kv, K or V, S_max, d)
    _, new = _cache_args()
    lengths = np.array([0, 0])
    out = ca.attention_with_kvcache(new, fused[:, :, 0], fused[:, :, 1], lengths, new, 2 * new)
    expected = ca.attention_with_kvcache(new, np.zeros((2, 2, 8, 4), np.float32),
                                         np.zeros((2, 2, 8, 4), np.float32), np.array([0, 0]),
                                         new, 2 * new)
    assert np.array_equal(out, expected)
    assert np.array_equal(fused[:, :, 1, :1], 2 * new)


@pytest.mark.parametrize("n_new", [1, 2])
def test_paged_refuses_new_rows_that_are_views_of_its_pages(n_new):
    # with 2 new rows per sequence the rows are copied into sequence order
    # before the write: the check looks at k_new as given
    k_pages = np.zeros((6, 2, 4, 8), np.float32)
    v_pages = k_pages.copy()
    k_new = k_pages[:2, :, 2:2 + n_new]
    with pytest.raises(ValueError, match=r"k_pages and k_new share memory"):
        ca.attention_with_paged_kvcache(np.ones((2, 2, n_new, 8), np.float32), k_pages, v_pages,
                                        np.array([[2, 3], [4, 5]]), np.array([0, 0]), k_new,
                                        k_new.copy())


def test_paged_refuses_pages_sharing_memory_with_what_it_writes():
    pages = np.zeros((2, 2, 4, 4), np.float32)
    x = np.ones((1, 2, 1, 4), np.float32)
    lengths = np.array([0])
    with pytest.raises(ValueError, match=r"k_pages and v_pages share memory"):
        ca.attention_with_paged_kvcache(x, pages, pages, np.array([[0, 1]]), lengths, x, x)
    with pytest.raises(ValueError, match=r"k_pages and q share memory"):
        ca.attention_with_paged_kvcache(pages[:1, :, :1], pages, pages.copy(),
                                        np.array([[0, 1]]), lengths, x, x)
    assert not pages.any() and lengths[0] == 0


def test_ragged_arguments_are_named():
    ragged = [[1.0, 0.0], [1.0]]
    x = np.ones((1, 1, 1, 2), np.float32)
    cache = np.zeros((1, 1, 4, 2), np.float32)
    pages = np.zeros((2, 1, 4, 2), np.float32)
    calls = {
        "mask": lambda: ca.attention(x[0, 0], x[0, 0], x[0, 0], mask=ragged),
        "q": lambda: ca.attention_with_kvcache(ragged, cache, cache.copy(), np.array([0])),
        "k_new": lambda: ca.attention_with_kvcache(x, cache, cache.copy(), np.array([0]),
                                                   ragged, x),
        "block_table": lambda: ca.attention_with_paged_kvcache(x, pages, pages.copy(), ragged,
                                                               np.array([0])),
        "outs[0]": lambda: ca.merge([ragged], [np.zeros(2)]),
        "alibi_slopes": lambda: ca.attention(x, x, x, alibi_slopes=ragged),
        "sinks": lambda: ca.attention(x, x, x, sinks=ragged),
        "kv_lengths": lambda: ca.attention(x, x, x, kv_lengths=ragged),
        "quantize_kv: x": lambda: ca.quantize_kv(ragged),
    }
    for option in ("alibi_slopes", "sinks", "kv_lengths"):
        # grouped heads reach them another way
        calls[f"{option} "] = (lambda option=option: ca.attention(
            x, x, x, enable_gqa=True, **{option: ragged}))
    for name, call in calls.items():
        with pytest.raises(ValueError,
                           match=rf"^{re.escape(name.strip())} is not a regular array"):
            call()
    with pytest.raises(TypeError, match=r"^outs must be an iterable of arrays, one per chunk; "
                                        r"got NoneType"):
        ca.merge(None, None)


@pytest.mark.parametrize("option", ["scale", "softcap"])
def test_integers_beyond_float_range_are_named(option):
    x = np.ones((2, 4))
    with pytest.raises(ValueError, match=rf"^{option} must be finite, got a number too "
                                         r"large for a float"):
        ca.attention(x, x, x, **{option: 10**400})


def test_cache_calls_name_a_q_of_unsupported_dtype():
    q = np.zeros((1, 1, 1, 2), "datetime64[s]")
    cache = np.zeros((1, 1, 4, 2), np.float32)
    pages = np.zeros((2, 1, 4, 2), np.float32)
    with pytest.raises(TypeError, match=r"^q has dtype datetime64\[s\]"):
        ca.attention_with_kvcache(q, cache, cache.copy(), np.array([0]))
    with pytest.raises(TypeError, match=r"^q has dtype datetime64\[s\]"):
        ca.attention_with_paged_kvcache(q, pages, pages.copy(), np.array([[0, 1]]),
                                        np.array([0]))


def test_paged_append_with_no_key_features():
    # d_k = 0 (with a scale): the new rows still land, and attention sees them
    k_pages = np.zeros((2, 1, 4, 0), np.float32)
    v_pages = np.zeros((2, 1, 4, 3), np.float32)
    empty = np.ones((1, 1, 1, 0), np.float32)
    values = np.arange(3, dtype=np.float32).reshape(1, 1, 1, 3)
    lengths = np.array([0])
    out = ca.attention_with_paged_kvcache(empty, k_pages, v_pages, np.array([[0, 1]]), lengths,
                                          empty, values, scale=1.0)
    assert lengths[0] == 1 and np.array_equal(v_pages[0, :, 0], values[0, :, 0])
    assert np.array_equal(out, values)


def test_quantize_kv_beyond_float32_is_refused_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"NaN or infinite values \(first at row index "
                                             r"\(0,\)\).*beyond float32's range"):
            ca.quantize_kv(np.array([[3.5e38, 1.0]]))


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0",
                    reason="NumPy before 2.0 makes arrays of at most 32 dimensions")
def test_more_than_32_batch_dimensions_on_every_path():
    """NumPy's arrays have up to 64 dimensions; its broadcast helper only 32."""
    q = np.random.default_rng(0).standard_normal((2,) + (1,) * 34 + (3, 4)).astype(np.float32)
    k = q[..., :2, :] + 1
    attn, lse = ca.attention(q, k, k, causal=True, return_lse=True)
    assert attn.shape == q.shape and lse.shape == q.shape[:-1]
    flat = ca.attention(q.reshape(2, 3, 4), k.reshape(2, 2, 4), k.reshape(2, 2, 4), causal=True)
    np.testing.assert_array_equal(attn.reshape(2, 3, 4), flat)
    assert_matches_reference(attn.reshape(2, 3, 4), None, q.reshape(2, 3, 4),
                             k.reshape(2, 2, 4), k.reshape(2, 2, 4), True)
    with pytest.raises(ValueError, match="batch dimensions do not broadcast"):
        ca.attention(q, k[:1].repeat(3, axis=0), k[:1].repeat(3, axis=0), return_lse=True)


@pytest.mark.parametrize("outs, lses, error, match", [
    ([np.float32(1)], [np.float32(0)], ValueError,
     r"chunk 0: the output needs rows and features, \(\.\.\., T, d_v\); got shape \(\)"),
    (["a"], ["b"], TypeError, r"merge needs floating-point arrays; outs\[0\] has dtype <U1"),
])
def test_merge_names_what_is_wrong_with_a_chunk(outs, lses, error, match):
    with pytest.raises(error, match=match):
        ca.merge(outs, lses)


def test_lengths_beyond_int64_are_reported_as_given():
    q = np.ones((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"got values from 9223372036854775808 to "
                                         r"9223372036854775808"):
        ca.attention(q, q, q, kv_lengths=np.uint64(2**63))
    x = np.ones((5, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"non-decreasing; got \[0, 18446744073709551615, 5\]"):
        ca.attention_varlen(x, x, x, np.array([0, 2**64 - 1, 5], np.uint64), np.array([0, 2, 5]))


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"return_lse": True},
                                     {"return_scores": True}])
def test_an_output_no_array_can_hold_is_named(options):
    """2**60 query rows of a broadcast q, d_k = 1, d_v = 8: no call path
    passes NumPy's nameless message on."""
    q = np.lib.stride_tricks.as_strided(np.ones(1, np.float32), (2, 1, 2**59, 1), (0,) * 4)
    k = np.ones((2, 1, 16, 1), np.float32)
    v = np.ones((2, 1, 16, 8), np.float32)
    with pytest.raises(ValueError, match="^the output would hold .* values: more bytes than "
                                         "an array can hold"):
        ca.attention(q, k, v, **options)
