"""The cache calls a serving runtime makes (issue 43): cache_batch_idx,
ALiBi slopes per sequence in the packed and paged calls, paged appends of
another number of rows than q has. Each against the float64 reference
(tests/reference.py)."""

import numpy as np
import pytest

import cattention as ca
from reference import (assert_bfloat16_matches_reference, assert_bitwise_equal,
                       assert_matches_reference)

try:
    import ml_dtypes
    BFLOAT16 = [ml_dtypes.bfloat16]
except ImportError:
    ml_dtypes = None
    BFLOAT16 = []

CACHE_DTYPES = [np.float32, np.float64, np.float16, "int8"] + BFLOAT16


def _compute(cache_dtype):
    return np.float64 if cache_dtype == np.float64 else np.float32


def _caches(rng, cache_dtype, shape_k, shape_v):
    """Caches of cache_dtype (int8: quantized, with their scales)."""
    k = rng.standard_normal(shape_k).astype(np.float32)
    v = rng.standard_normal(shape_v).astype(np.float32)
    if cache_dtype == "int8":
        (k8, k_scale), (v8, v_scale) = ca.quantize_kv(k), ca.quantize_kv(v)
        return k8, v8, dict(k_scale=k_scale, v_scale=v_scale)
    return k.astype(cache_dtype), v.astype(cache_dtype), {}


def _values(cache, scale=None):
    """What a cache holds, as float64 (int8 rows times their scales)."""
    if cache.dtype == np.int8:
        return cache.astype(np.float64) * scale[..., None]
    return cache.astype(np.float64)


def _copies(*arrays):
    return [a.copy() for a in arrays]


def _q_dtype(cache_dtype):
    """A q the cache takes: bfloat16 beside bfloat16 (rotated q rounded back
    to it), else the compute dtype."""
    if ml_dtypes is not None and cache_dtype == ml_dtypes.bfloat16:
        return ml_dtypes.bfloat16
    return _compute(cache_dtype)


# ------------------------------------------------------------- paged helpers

def _pages_from(rng, n_seq, H_kv, page_size, max_pages, d, dtype, spare=3):
    """Shuffled pages (unused ones between) and the block table."""
    n_pages = n_seq * max_pages + spare
    table = rng.permutation(n_pages)[: n_seq * max_pages].reshape(n_seq, max_pages)
    k_pages, v_pages, scales = _caches(rng, dtype, (n_pages, H_kv, page_size, d),
                                       (n_pages, H_kv, page_size, d))
    return k_pages, v_pages, scales, table


def _sequence(pages, table, b, length, scale=None):
    """Sequence b's first `length` positions (H_kv, length, d) as float64."""
    page_size = pages.shape[2]
    p = np.arange(length)
    rows = _values(pages, scale)[table[b, p // page_size], :, p % page_size]
    return np.swapaxes(rows, 0, 1)


# ------------------------------------------------------------ cache_batch_idx

@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_cache_batch_idx_reads_and_appends_the_chosen_entries(cache_dtype):
    """Batch row b works on cache entry cache_batch_idx[b]: the entries it
    names take the rows the same call appends to copies of them, the others
    stay as they were, and the result matches the float64 reference over
    the entries' keys."""
    rng = np.random.default_rng(11)
    n_entries, H, H_kv, S_max, d = 5, 4, 2, 30, 8
    k_cache, v_cache, scales = _caches(rng, cache_dtype, (n_entries, H_kv, S_max, d),
                                       (n_entries, H_kv, S_max, d))
    idx = np.array([4, 0, 2])
    q = rng.standard_normal((3, H, 2, d)).astype(_q_dtype(cache_dtype))
    new = rng.standard_normal((3, H_kv, 2, d)).astype(np.float32 if cache_dtype != np.float64
                                                      else np.float64)
    lengths = np.array([7, 0, 28])
    got = _copies(k_cache, v_cache, lengths, *scales.values())
    out, lse = ca.attention_with_kvcache(q, got[0], got[1], got[2], new, new,
                                         cache_batch_idx=idx, return_lse=True,
                                         **dict(zip(scales, got[3:])))
    assert got[2].tolist() == [9, 2, 30]
    # the same append to copies of the entries, without cache_batch_idx
    entries = [a[idx] for a in (k_cache, v_cache)] + [lengths.copy()]
    entry_scales = [a[idx] for a in scales.values()]
    ca.attention_with_kvcache(q, *entries, new, new, **dict(zip(scales, entry_scales)))
    for cache, chosen in zip(got[:2] + got[3:], entries[:2] + entry_scales):
        assert_bitwise_equal(cache[idx], chosen)
    others = [1, 3]
    for cache, before in zip(got[:2] + got[3:], [k_cache, v_cache, *scales.values()]):
        assert_bitwise_equal(cache[others], before[others])
    k_scale, v_scale = (got[3], got[4]) if scales else (None, None)
    for b, entry in enumerate(idx):
        n = int(got[2][b])
        keys, values = (np.repeat(_values(c[entry], s[entry] if s is not None else None)[:, :n],
                                  2, axis=0)
                        for c, s in ((got[0], k_scale), (got[1], v_scale)))
        if q.dtype in (np.float32, np.float64):
            assert_matches_reference(out[b], None, q[b], keys, values, causal=True, lse=lse[b])
        else:
            assert_bfloat16_matches_reference(out[b], None, q[b], keys.astype(np.float32),
                                              values.astype(np.float32), causal=True,
                                              lse=lse[b])


def test_cache_batch_idx_of_every_entry_in_order_is_the_call_without_it():
    rng = np.random.default_rng(12)
    k_cache = rng.standard_normal((3, 2, 20, 8)).astype(np.float32)
    q = rng.standard_normal((3, 4, 1, 8)).astype(np.float32)
    new = rng.standard_normal((3, 2, 1, 8)).astype(np.float32)
    lengths = np.array([4, 0, 19])
    plain = _copies(k_cache, k_cache, lengths)
    want = ca.attention_with_kvcache(q, *plain, new, new)
    got = _copies(k_cache, k_cache, lengths)
    out = ca.attention_with_kvcache(q, *got, new, new, cache_batch_idx=np.arange(3))
    for g, w in zip(got, plain):
        assert_bitwise_equal(g, w)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("change,error,match", [
    (dict(idx=[0, 2, 0]), ValueError, r"cache_batch_idx gives cache entry 0 to batch rows 0 "
                                      r"and 2, and the call appends to it"),
    (dict(idx=[0, 4, 1]), ValueError, r"cache_batch_idx\[1\] = 4 is not a cache entry: "
                                      r"k_cache \(4, 1, 8, 4\) has 4, \[0, 4\)"),
    (dict(idx=[0, -1, 1]), ValueError, r"cache_batch_idx\[1\] = -1 is not a cache entry"),
    (dict(idx=[0.0, 1.0, 2.0]), TypeError, r"cache_batch_idx must be integers"),
    (dict(idx=[[0, 1, 2]]), ValueError, r"cache_batch_idx must be 1-D"),
    (dict(idx=[0, 1]), ValueError, r"q must have shape \(B, H, T, d_k\) = \(2, H, T, 4\) to "
                                   r"match cache_batch_idx \(2 batch rows\)"),
    (dict(lengths=np.array([1, 2, 3, 4])), ValueError,
     r"cache_lengths must be an integer ndarray of shape \(3,\)"),
    (dict(lengths=np.array([1, 8, 0])), ValueError, r"cache overflow"),
])
def test_cache_batch_idx_errors_write_nothing(change, error, match):
    k_cache = np.zeros((4, 1, 8, 4), np.float32)
    v_cache = np.zeros((4, 1, 8, 4), np.float32)
    lengths = change.get("lengths", np.array([1, 2, 3]))
    before = lengths.copy()
    step = np.ones((3, 1, 1, 4), np.float32)
    with pytest.raises(error, match=match):
        ca.attention_with_kvcache(step, k_cache, v_cache, lengths, step, step,
                                  cache_batch_idx=change.get("idx", [3, 0, 1]))
    assert not k_cache.any() and not v_cache.any()
    assert_bitwise_equal(lengths, before)


def test_cache_batch_idx_rows_may_share_an_entry_they_only_read():
    rng = np.random.default_rng(14)
    k_cache = rng.standard_normal((3, 2, 16, 8)).astype(np.float64)
    q = rng.standard_normal((2, 2, 1, 8))
    lengths = np.array([9, 12])
    out = ca.attention_with_kvcache(q, k_cache, k_cache, lengths, cache_batch_idx=[1, 1])
    for b in range(2):
        keys = k_cache[1, :, :lengths[b]]
        assert_matches_reference(out[b], None, q[b], keys, keys, causal=True)


# ------------------------------------------------- ALiBi slopes per sequence

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_varlen_alibi_and_sinks_per_sequence_match_the_reference(simd, dtype):
    rng = np.random.default_rng(15)
    q_lengths, k_lengths, H = [5, 1, 0, 30], [9, 40, 3, 30], 4
    cu_q = np.concatenate([[0], np.cumsum(q_lengths)])
    cu_k = np.concatenate([[0], np.cumsum(k_lengths)])
    q = rng.standard_normal((cu_q[-1], H, 16)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], 2, 16)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], 2, 8)).astype(dtype)
    slopes = rng.uniform(0.01, 0.6, (4, H))
    sinks = np.where(rng.random((4, H)) < 0.3, -np.inf, rng.standard_normal((4, H)))
    attn, lse = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=True, enable_gqa=True,
                                    alibi_slopes=slopes, sinks=sinks, return_lse=True)
    for i in range(4):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        assert_matches_reference(
            np.swapaxes(attn[rows], 0, 1), None, np.swapaxes(q[rows], 0, 1),
            np.repeat(np.swapaxes(k[keys], 0, 1), 2, axis=0),
            np.repeat(np.swapaxes(v[keys], 0, 1), 2, axis=0), causal=True,
            alibi_slopes=slopes[i], sinks=sinks[i],
            lse=np.swapaxes(lse[rows], 0, 1))
    # one row of slopes for every sequence is the (H,) call, bitwise
    assert_bitwise_equal(
        ca.attention_varlen(q, k, v, cu_q, cu_k, enable_gqa=True,
                            alibi_slopes=np.tile(slopes[0], (4, 1))),
        ca.attention_varlen(q, k, v, cu_q, cu_k, enable_gqa=True, alibi_slopes=slopes[0]))


def test_paged_alibi_per_sequence_matches_the_reference(simd):
    rng = np.random.default_rng(16)
    k_pages, v_pages, _, table = _pages_from(rng, 3, 2, 5, 12, 16, np.float32)
    lengths = np.array([3, 30, 55])
    q = rng.standard_normal((3, 8, 2, 16)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.4, (3, 8))
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths,
                                           alibi_slopes=slopes)
    for b in range(3):
        keys = np.repeat(_sequence(k_pages, table, b, lengths[b]), 4, axis=0)
        values = np.repeat(_sequence(v_pages, table, b, lengths[b]), 4, axis=0)
        assert_matches_reference(attn[b], None, q[b], keys, values, causal=True,
                                 alibi_slopes=slopes[b])


@pytest.mark.parametrize("slopes", [np.ones((3, 4)), np.ones((2, 3)), np.ones((1, 2, 4))],
                         ids=str)
def test_alibi_slopes_of_another_shape_are_named(slopes):
    x = np.ones((5, 4, 8), np.float32)
    cu = [0, 2, 5]
    with pytest.raises(ValueError, match=r"alibi_slopes must hold one real number per query "
                                         r"head, shape \(4,\), or one per sequence and query "
                                         r"head, shape \(2, 4\); got shape"):
        ca.attention_varlen(x, x, x, cu, cu, alibi_slopes=slopes)


# ------------------------------------------ paged appends of any number of rows

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("T,T_new", [(1, 4), (4, 1), (3, 0), (2, 2)], ids=str)
def test_paged_new_rows_of_another_count_than_q(simd, dtype, T, T_new):
    """Padded q of T rows beside T_new new rows: the append of the
    contiguous call, causal alignment over the updated length."""
    rng = np.random.default_rng(T * 7 + T_new)
    page_size, max_pages = 4, 10
    k_pages, v_pages, _, table = _pages_from(rng, 3, 2, page_size, max_pages, 8, dtype)
    lengths = np.array([3, 0, 30])
    old = lengths.copy()
    q = rng.standard_normal((3, 4, T, 8)).astype(dtype)
    new = rng.standard_normal((3, 2, T_new, 8)).astype(dtype)
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, new, new)
    assert lengths.tolist() == (old + T_new).tolist()
    for b in range(3):
        keys = _sequence(k_pages, table, b, lengths[b])
        np.testing.assert_array_equal(keys[:, old[b]:], new[b])
        values = _sequence(v_pages, table, b, lengths[b])
        assert_matches_reference(attn[b], None, q[b], np.repeat(keys, 2, axis=0),
                                 np.repeat(values, 2, axis=0), causal=True)


def test_paged_packed_new_rows_with_cu_seqlens_k_new(simd):
    """Packed queries and packed new rows of other counts per sequence:
    the new rows where the table says, and the reference."""
    rng = np.random.default_rng(17)
    H, H_kv, d, page_size, max_pages = 4, 2, 16, 8, 8
    k_pages, v_pages, _, table = _pages_from(rng, 3, H_kv, page_size, max_pages, d,
                                             np.float32)
    lengths = np.array([5, 20, 0])
    old = lengths.copy()
    q_counts, new_counts = np.array([1, 3, 2]), np.array([4, 0, 2])
    cu_q = np.concatenate([[0], np.cumsum(q_counts)])
    cu_new = np.concatenate([[0], np.cumsum(new_counts)])
    q = rng.standard_normal((cu_q[-1], H, d)).astype(np.float32)
    new = rng.standard_normal((cu_new[-1], H_kv, d)).astype(np.float32)
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, new, new,
                                           cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new)
    assert lengths.tolist() == (old + new_counts).tolist()
    for b in range(3):
        n = int(lengths[b])
        keys = _sequence(k_pages, table, b, n)
        rows = slice(cu_new[b], cu_new[b + 1])
        np.testing.assert_array_equal(keys[:, old[b]:], np.swapaxes(new[rows], 0, 1))
        q_b = np.swapaxes(q[cu_q[b]:cu_q[b + 1]], 0, 1)
        assert_matches_reference(
            np.swapaxes(attn[cu_q[b]:cu_q[b + 1]], 0, 1), None, q_b,
            np.repeat(keys, 2, axis=0),
            np.repeat(_sequence(v_pages, table, b, n), 2, axis=0), causal=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(cu_seqlens_k_new=[0, 1, 2]), r"cu_seqlens_k_new goes with packed new rows"),
    (dict(packed=True, cu_seqlens_k_new=[0, 4]), r"cu_seqlens_k_new describes 1 sequences"),
    (dict(packed=True, cu_seqlens_k_new=[0, 3, 5]),
     r"cu_seqlens_k_new must start at 0 and end at total_new \(k_new.shape\[0\]\) = 4"),
    (dict(packed=True, cu_seqlens_k_new=[0, 4, 2]),
     r"cu_seqlens_k_new must be non-decreasing|end at total_new"),
    (dict(packed=True, new_rows=3), r"k_new must have shape \(4, 2, 8\) to match q"),
    (dict(packed=True, no_new=True, cu_seqlens_k_new=[0, 2, 4]),
     r"cu_seqlens_k_new goes with packed new rows"),
])
def test_paged_new_row_counts_are_checked_and_nothing_is_written(kwargs, match):
    k_pages = np.zeros((6, 2, 4, 8), np.float32)
    v_pages = np.zeros((6, 2, 4, 8), np.float32)
    table = np.array([[0, 1, -1], [2, 3, 4]])
    lengths = np.array([3, 8])
    kwargs = dict(kwargs)
    packed = kwargs.pop("packed", False)
    n_rows = kwargs.pop("new_rows", 4)
    no_new = kwargs.pop("no_new", False)
    if packed:
        q = np.ones((4, 2, 8), np.float32)
        new = None if no_new else np.ones((n_rows, 2, 8), np.float32)
        kwargs["cu_seqlens_q"] = [0, 1, 4]
    else:
        q = new = np.ones((2, 2, 2, 8), np.float32)
    with pytest.raises(ValueError, match=match):
        ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, new, new, **kwargs)
    assert lengths.tolist() == [3, 8] and not k_pages.any() and not v_pages.any()
