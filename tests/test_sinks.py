"""Attention sinks: one logit per query head that joins each row's softmax with
no value (p_j = e^(s_j - m) / (e^(sink - m) + sum_i e^(s_i - m))), against the
float64 reference, on every path and entry point."""

import numpy as np
import pytest

import cattention as ca
from reference import (
    assert_bitwise_equal,
    assert_matches_reference,
    make_qkv,
    reference_attention_lse,
)

SINKS_H = np.array([0.5, -1.0, 2.5, 0.0])
SINKS_BH = np.array([[0.5, -1.0, 2.5, 0.0], [3.0, -np.inf, 1.0, -2.0]])


def repeat_kv(x, group):
    return np.repeat(x, group, axis=-3)


# T = 1 and 5: direct path (S = 2048 with 2 heads splits the keys), 40 and 130 packed
@pytest.mark.parametrize("T,S", [(1, 300), (1, 2048), (5, 77), (40, 300), (130, 129)])
@pytest.mark.parametrize("sinks", [SINKS_H, SINKS_BH], ids=["H", "BH"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sinks_match_the_reference(dtype, T, S, sinks, causal, simd):
    q, k, v = make_qkv(300 + T, (2, 4, T, 16), (2, 4, S, 16), (2, 4, S, 6), dtype)
    attn, lse = ca.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    assert_matches_reference(attn, None, q, k, v, causal, lse=lse, sinks=sinks)
    if T * S <= 40000:
        attn, scores, lse = ca.attention(q, k, v, causal=causal, sinks=sinks,
                                         return_scores=True, return_lse=True)
        assert_matches_reference(attn, scores, q, k, v, causal, lse=lse, sinks=sinks)
        assert_bitwise_equal(ca.attention_scores(q, k, causal=causal, sinks=sinks), scores)
        if T <= S or not causal:  # (else the first rows see no key: zero, checked below)
            # rows sum to 1 - p_sink, with p_sink = e^(sink - lse)
            with np.errstate(invalid="ignore"):
                p_sink = np.exp(np.broadcast_to(sinks, (2, 4))[..., None]
                                - lse.astype(np.float64))
            p_sink = np.where(np.broadcast_to(sinks, (2, 4))[..., None] == -np.inf, 0, p_sink)
            np.testing.assert_allclose(scores.sum(-1), 1 - p_sink,
                                       atol=1e-5 if dtype == np.float32 else 1e-12)


def test_the_formula_by_hand():
    """One row, three keys, written out."""
    q = np.array([[1.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
    v = np.array([[1.0], [2.0], [3.0]])
    s = q @ k.T                               # scale 1
    sink = 1.5
    m = max(s.max(), sink)
    denominator = np.exp(sink - m) + np.exp(s - m).sum()
    p = np.exp(s - m) / denominator
    out, scores, lse = ca.attention(q, k, v, scale=1.0, sinks=sink, return_scores=True,
                                    return_lse=True)
    np.testing.assert_allclose(scores, p, rtol=1e-14)
    np.testing.assert_allclose(out, p @ v, rtol=1e-14)
    np.testing.assert_allclose(lse, m + np.log(denominator), rtol=1e-14)


@pytest.mark.parametrize("T", [1, 3, 40])
def test_sinks_with_grouped_heads(dtype, T):
    """T = 1 and 3 stack the group's rows on one K/V head (decode)."""
    q, k, v = make_qkv(310 + T, (2, 4, T, 16), (2, 2, 1500, 16), (2, 2, 1500, 6), dtype)
    attn, lse = ca.attention(q, k, v, causal=True, enable_gqa=True, sinks=SINKS_BH,
                             return_lse=True)
    assert_matches_reference(attn, None, q, repeat_kv(k, 2), repeat_kv(v, 2), True,
                             lse=lse, sinks=SINKS_BH)


def test_sinks_with_every_other_option(dtype):
    q, k, v = make_qkv(320, (2, 4, 33, 16), (2, 2, 90, 16), (2, 2, 90, 5), dtype)
    mask = np.random.default_rng(3).random((2, 4, 33, 90)) > 0.2
    options = dict(window=(25, None), softcap=3.0, alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05]),
                   kv_lengths=np.array([[90], [41]]), sinks=SINKS_BH)
    attn, scores, lse = ca.attention(q, k, v, causal=True, mask=mask, enable_gqa=True,
                                     return_scores=True, return_lse=True, **options)
    assert_matches_reference(attn, scores, q, repeat_kv(k, 2), repeat_kv(v, 2), True, mask,
                             lse=lse, **options)


def test_sinks_with_float16_kv():
    q, k, v = make_qkv(330, (1, 4, 7, 16), (1, 4, 200, 16), (1, 4, 200, 8), np.float32)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    attn, lse = ca.attention(q, k16, v16, sinks=SINKS_H, return_lse=True)
    assert_matches_reference(attn, None, q, k16.astype(np.float32), v16.astype(np.float32),
                             lse=lse, sinks=SINKS_H)


@pytest.mark.parametrize("T_new", [1, 4])
def test_sinks_in_the_kv_cache(dtype, T_new):
    rng = np.random.default_rng(340)
    k_cache = rng.standard_normal((2, 2, 64, 16)).astype(dtype)
    v_cache = rng.standard_normal((2, 2, 64, 8)).astype(dtype)
    lengths = np.array([9, 40])
    q = rng.standard_normal((2, 4, T_new, 16)).astype(dtype)
    new_k = rng.standard_normal((2, 2, T_new, 16)).astype(dtype)
    new_v = rng.standard_normal((2, 2, T_new, 8)).astype(dtype)
    attn, lse = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new_k, new_v,
                                          sinks=SINKS_H, window=(20, 0), return_lse=True)
    assert_matches_reference(attn, None, q, repeat_kv(k_cache, 2), repeat_kv(v_cache, 2),
                             True, lse=lse, sinks=SINKS_H, window=(20, 0),
                             kv_lengths=lengths[:, None])


@pytest.mark.parametrize("T,S,gqa", [(1, 300, False), (1, 2048, False), (40, 300, False),
                                     (1, 300, True), (3, 1500, True), (40, 300, True)])
def test_minus_infinity_is_no_sink_bitwise(dtype, T, S, gqa, simd):
    q, k, v = make_qkv(350, (2, 4, T, 16), (2, 2 if gqa else 4, S, 16),
                       (2, 2 if gqa else 4, S, 6), dtype)
    options = dict(causal=True, enable_gqa=gqa, return_lse=True)
    none = ca.attention(q, k, v, **options)
    minus_inf = ca.attention(q, k, v, sinks=np.full(4, -np.inf), **options)
    for a, b in zip(minus_inf, none):
        assert_bitwise_equal(a, b)
    if T * S <= 40000:
        assert_bitwise_equal(ca.attention_scores(q, k, sinks=-np.inf, enable_gqa=gqa),
                             ca.attention_scores(q, k, enable_gqa=gqa))


@pytest.mark.parametrize("T,S,gqa", [(1, 300, False), (2, 1100, False), (9, 300, False),
                                     (40, 300, False), (3, 1500, True), (40, 300, True)])
def test_a_sink_below_float32_is_no_sink_bitwise(T, S, gqa, simd):
    """-1e39 is -inf in float32: on every path (SCORES, split decode keys,
    varlen, pages) the bits of no sink."""
    q, k, v = make_qkv(351, (1, 4, T, 16), (1, 2 if gqa else 4, S, 16),
                       (1, 2 if gqa else 4, S, 6), np.float32)
    below = np.full(4, -1e39)
    for scores in (False, True):
        options = dict(causal=True, enable_gqa=gqa, return_lse=True, return_scores=scores)
        for a, b in zip(ca.attention(q, k, v, sinks=below, **options),
                        ca.attention(q, k, v, **options)):
            assert_bitwise_equal(a, b)
    if gqa:
        return
    packed = [np.ascontiguousarray(x[0].transpose(1, 0, 2)) for x in (q, k, v)]
    cu_q, cu_k = np.array([0, T]), np.array([0, S])
    assert_bitwise_equal(ca.attention_varlen(*packed, cu_q, cu_k, causal=True, sinks=below),
                         ca.attention_varlen(*packed, cu_q, cu_k, causal=True))
    pages = [np.ascontiguousarray(x.reshape(4, -1, 100, x.shape[-1]).transpose(1, 0, 2, 3))
             for x in (k, v)] if S % 100 == 0 else None
    if pages is not None:
        table = np.arange(S // 100)[None]
        lengths = np.array([S])
        assert_bitwise_equal(
            ca.attention_with_paged_kvcache(q, *pages, table, lengths, sinks=below),
            ca.attention_with_paged_kvcache(q, *pages, table, lengths))


@pytest.mark.parametrize("sink", [60.0, 1e30, 3e38])
@pytest.mark.parametrize("T", [1, 40])
def test_very_large_sinks_take_every_weight_without_nan(dtype, sink, T):
    q, k, v = make_qkv(360, (1, 2, T, 16), (1, 2, 300, 16), (1, 2, 300, 4), dtype)
    attn, scores, lse = ca.attention(q, k, v, sinks=sink, return_scores=True, return_lse=True)
    assert np.all(np.isfinite(attn)) and np.all(np.isfinite(scores))
    # the keys' weights are e^(s - sink): about 1e-24 at 60, exactly 0 beyond
    bound = 1e-20 if sink == 60.0 else 0
    assert np.all(np.abs(scores) <= bound) and np.all(np.abs(attn) <= 10 * bound)
    np.testing.assert_allclose(lse, np.float64(dtype(sink)), rtol=1e-6)
    attn_only = ca.attention(q, k, v, sinks=sink)
    assert np.all(np.isfinite(attn_only)) and np.all(np.abs(attn_only) <= 10 * bound)


def test_rows_that_see_no_key_are_zero_with_the_sinks_lse():
    q, k, v = make_qkv(370, (1, 4, 6, 8), (1, 4, 3, 8), (1, 4, 3, 2))
    attn, scores, lse = ca.attention(q, k, v, causal=True, sinks=SINKS_H, return_scores=True,
                                     return_lse=True)
    # T > S under causal: the first T - S rows see no key
    np.testing.assert_array_equal(attn[..., :3, :], 0)
    np.testing.assert_array_equal(scores[..., :3, :], 0)
    np.testing.assert_array_equal(lse[..., :3], np.broadcast_to(SINKS_H[:, None], (1, 4, 3)))
    ref = reference_attention_lse(q, k, v, True, sinks=SINKS_H)
    np.testing.assert_allclose(lse, ref[2], atol=1e-12)


@pytest.mark.parametrize("split", [1, 40, 299])
def test_merge_with_the_sinks_given_to_one_chunk(dtype, split):
    q, k, v = make_qkv(380, (2, 4, 5, 16), (2, 4, 300, 16), (2, 4, 300, 6), dtype)
    first = ca.attention(q, k[..., :split, :], v[..., :split, :], sinks=SINKS_BH,
                         return_lse=True)
    rest = ca.attention(q, k[..., split:, :], v[..., split:, :], return_lse=True)
    out, lse = ca.merge([first[0], rest[0]], [first[1], rest[1]])
    whole = ca.attention(q, k, v, sinks=SINKS_BH, return_lse=True)
    tol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(out, whole[0], atol=tol)
    np.testing.assert_allclose(lse, whole[1], atol=tol)
    # a chunk that sees no key but holds the sinks still counts
    empty = ca.attention(q, k[..., :0, :], v[..., :0, :], sinks=SINKS_BH, return_lse=True)
    everything = ca.attention(q, k, v, return_lse=True)
    out, lse = ca.merge([empty[0], everything[0]], [empty[1], everything[1]])
    np.testing.assert_allclose(out, whole[0], atol=tol)


@pytest.mark.parametrize("sinks,error,match", [
    (np.array([np.nan, 0, 0, 0]), ValueError, r"sinks must be finite, or -inf"),
    (np.inf, ValueError, r"sinks must be finite, or -inf"),
    (np.array([1.0, 2.0, 3.0]), ValueError, r"sinks of shape \(3,\) does not broadcast"),
    (np.array(["a"] * 4), TypeError, r"sinks must be real numbers"),
])
def test_sink_errors(sinks, error, match):
    q, k, v = make_qkv(390, (2, 4, 3, 8), (2, 4, 5, 8), (2, 4, 5, 2))
    with pytest.raises(error, match=match):
        ca.attention(q, k, v, sinks=sinks)
    with pytest.raises(error, match=match):
        ca.attention_scores(q, k, sinks=sinks)
    k_cache, v_cache = np.zeros((2, 4, 16, 8)), np.zeros((2, 4, 16, 2))
    lengths = np.array([3, 1])
    with pytest.raises(error, match=match):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, np.ones((2, 4, 1, 8)),
                                  np.ones((2, 4, 1, 2)), sinks=sinks)
    assert lengths.tolist() == [3, 1] and not k_cache.any()


def test_sinks_in_other_byte_order():
    q, k, v = make_qkv(395, (2, 4, 3, 8), (2, 4, 50, 8), (2, 4, 50, 2))
    assert_bitwise_equal(ca.attention(q, k, v, sinks=SINKS_BH.astype(">f8")),
                         ca.attention(q, k, v, sinks=SINKS_BH))
