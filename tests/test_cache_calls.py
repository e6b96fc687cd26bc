"""The cache calls a serving runtime makes (issue 43): rotary embeddings of q
and the new keys as they are read and appended, cache_batch_idx, ALiBi
slopes per sequence in the packed and paged calls, paged appends of
another number of rows than q has, and the log-sum-exp of rows that see no
key. Each against the float64 reference (tests/reference.py), or bitwise
against what a caller doing the same work first in NumPy gets."""

import numpy as np
import pytest

import cattention as ca
from reference import (assert_bfloat16_matches_reference, assert_bitwise_equal,
                       assert_matches_reference, reference_rotary)

try:
    import ml_dtypes
    BFLOAT16 = [ml_dtypes.bfloat16]
except ImportError:
    ml_dtypes = None
    BFLOAT16 = []

CACHE_DTYPES = [np.float32, np.float64, np.float16, "int8"] + BFLOAT16


def rope_tables(n_positions, half, dtype=np.float32, base=10000.0):
    """cos and sin of position p times the frequencies base^(-i / half)."""
    angles = np.arange(n_positions)[:, None] * base ** (-np.arange(half) / half)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rotate_first(x, cos, sin, positions, interleaved, compute):
    """What a caller rotating first does, by the documented formula, in
    NumPy in the compute dtype: x (..., d) at positions (broadcastable to
    x.shape[:-1])."""
    x = np.asarray(x).astype(compute)
    half = cos.shape[1]
    at = np.broadcast_to(positions, x.shape[:-1])
    c = cos.astype(compute)[at]
    s = sin.astype(compute)[at]
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    x1, x2 = x[..., first].copy(), x[..., second].copy()
    out = x.copy()
    out[..., first] = x1 * c - x2 * s
    out[..., second] = x2 * c + x1 * s
    return out


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


# ------------------------------------------------------------ rotary: kvcache

@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("T,T_new", [(1, 1), (5, 5), (2, 6)], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=str)
def test_kvcache_rotary_is_rotating_first(compiled_path, general_path, cache_dtype, interleaved,
                                          T, T_new, heads):
    """Output, caches and lengths are bitwise those of the call without
    rotary on q and k_new rotated first in NumPy (the documented formula, in
    the compute dtype, then rounded once to where each goes); the caller's
    q is not modified; the compiled step and the general path agree."""
    H, H_kv = heads
    rng = np.random.default_rng(T * 10 + T_new + H)
    B, S_max, d = 3, 40, 16
    compute = _compute(cache_dtype)
    k_cache, v_cache, scales = _caches(rng, cache_dtype, (B, H_kv, S_max, d), (B, H_kv, S_max, 8))
    q = rng.standard_normal((B, H, T, d)).astype(_q_dtype(cache_dtype))
    new_dtype = compute if cache_dtype != np.float16 else np.float32
    k_new = rng.standard_normal((B, H_kv, T_new, d)).astype(new_dtype)
    v_new = rng.standard_normal((B, H_kv, T_new, 8)).astype(new_dtype)
    lengths = np.array([0, 9, S_max - T_new])
    cos, sin = rope_tables(S_max, 6, compute)
    q_before = q.copy()
    taken = compiled_path("kvcache_shortcut")
    got = _copies(k_cache, v_cache, lengths, *scales.values())
    out = ca.attention_with_kvcache(q, *got[:3], k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                    rotary_interleaved=interleaved,
                                    **dict(zip(scales, got[3:])))
    assert_bitwise_equal(q, q_before)
    # the caller's way: positions first, rotation in NumPy, the plain call
    q_at = (lengths + T_new - T)[:, None, None] + np.arange(T)
    k_at = lengths[:, None, None] + np.arange(T_new)
    q_rot = rotate_first(q, cos, sin, q_at, interleaved, compute).astype(q.dtype)
    k_rot = rotate_first(k_new, cos, sin, k_at, interleaved, compute)
    want = _copies(k_cache, v_cache, lengths, *scales.values())
    expected = ca.attention_with_kvcache(q_rot, *want[:3], k_rot, v_new, return_lse=True,
                                         **dict(zip(scales, want[3:])))
    for g, w in zip([out] + got, [expected[0]] + want):
        assert_bitwise_equal(g, w)
    # the general path gives the same bits
    general = _copies(k_cache, v_cache, lengths, *scales.values())
    with general_path("kvcache_shortcut"):
        by_general = ca.attention_with_kvcache(
            q, *general[:3], k_new, v_new, rotary_cos=cos, rotary_sin=sin,
            rotary_interleaved=interleaved, return_lse=True, **dict(zip(scales, general[3:])))
    for g, w in zip(by_general + tuple(general), expected + tuple(want)):
        assert_bitwise_equal(g, w)
    if cache_dtype in (np.float32, np.float64, np.float16):
        # a plain serving step with rotary runs compiled (its tables read in place)
        assert taken[0] is True


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_kvcache_rotary_matches_the_float64_reference(simd, dtype, causal):
    """q rotated at the last T positions, the new keys at theirs, the cached
    keys as they are (rotated when they were appended): the float64
    reference on those rotated exactly."""
    rng = np.random.default_rng(7)
    B, H, H_kv, d, S_max, T = 3, 8, 2, 32, 70, 4
    k_cache = rng.standard_normal((B, H_kv, S_max, d)).astype(dtype)
    v_cache = rng.standard_normal((B, H_kv, S_max, d)).astype(dtype)
    q = rng.standard_normal((B, H, T, d)).astype(dtype)
    k_new = rng.standard_normal((B, H_kv, T, d)).astype(dtype)
    v_new = rng.standard_normal((B, H_kv, T, d)).astype(dtype)
    lengths = np.array([0, 20, 66])
    old = lengths.copy()
    cos, sin = rope_tables(128, 12, dtype)
    out = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new, causal=causal,
                                    rotary_cos=cos, rotary_sin=sin)
    for b in range(B):
        n = int(lengths[b])
        positions = np.arange(old[b], n)
        k_ref = np.concatenate([k_cache[b, :, :old[b]].astype(np.float64),
                                reference_rotary(k_new[b], cos, sin, positions)], axis=1)
        v_ref = v_cache[b, :, :n]
        # the keys stored: the reference rotation, rounded once
        np.testing.assert_allclose(k_cache[b, :, old[b]:n], k_ref[:, old[b]:],
                                   rtol=0, atol=4 * np.finfo(dtype).eps * 4)
        q_ref = reference_rotary(q[b], cos, sin, positions)
        assert_matches_reference(out[b], None, q_ref, np.repeat(k_ref, 4, axis=0),
                                 np.repeat(v_ref, 4, axis=0).astype(np.float64), causal=causal)


def test_kvcache_rotary_positions_count_the_left_padding():
    """With kv_starts, positions still count from the cache's row 0 (as
    FlashAttention's with cache_leftpad): the rotation is that of the call
    without kv_starts, which only hides the padding keys."""
    rng = np.random.default_rng(8)
    k_cache = rng.standard_normal((2, 2, 32, 8)).astype(np.float32)
    q = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    new = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    cos, sin = rope_tables(64, 4)
    lengths = np.array([10, 4])
    starts = np.array([6, 0])
    caches = _copies(k_cache, k_cache, lengths)
    out = ca.attention_with_kvcache(q, *caches, new, new, rotary_cos=cos, rotary_sin=sin,
                                    kv_starts=starts)
    at = lengths[:, None, None] + np.arange(3)
    rotated = rotate_first(new, cos, sin, at, False, np.float32)
    assert_bitwise_equal(caches[0][:, :, 10:13][0], rotated[0])
    plain = _copies(k_cache, k_cache, lengths)
    want = ca.attention_with_kvcache(rotate_first(q, cos, sin, at, False, np.float32),
                                     *plain, rotated, new, kv_starts=starts)
    assert_bitwise_equal(out, want)
    assert_bitwise_equal(caches[0], plain[0])


def test_rotary_reads_tables_of_any_layout_byte_order_and_exact_dtype():
    """Big-endian, strided, transposed, float16 (exact in float32) tables,
    strided and big-endian q and new rows: the bits of native contiguous
    float32 ones; the tables are not modified."""
    rng = np.random.default_rng(9)
    k_cache = rng.standard_normal((2, 2, 40, 16)).astype(np.float32)
    q = rng.standard_normal((2, 4, 2, 16)).astype(np.float32)
    new = rng.standard_normal((2, 2, 2, 16)).astype(np.float32)
    lengths = np.array([3, 30])
    cos, sin = (t.astype(np.float16).astype(np.float32) for t in rope_tables(48, 8))
    plain = _copies(k_cache, k_cache, lengths)
    want = ca.attention_with_kvcache(q, *plain, new, new, rotary_cos=cos, rotary_sin=sin)
    wide = np.zeros(q.shape[:-1] + (32,), np.float32)
    wide[..., 1::2] = q
    layouts = [
        (cos.astype(">f4"), sin.astype(">f4"), q, new),
        (np.asfortranarray(cos), sin.T.copy().T, wide[..., 1::2], new.astype(">f4")),
        (np.repeat(cos, 2, axis=1)[:, ::2], sin[::-1][::-1], q.astype(">f4"), new),
        (cos.astype(np.float16), sin.astype(np.float16), q, new),
    ]
    for c, s, q_given, new_given in layouts:
        before = (c.copy(), s.copy())
        caches = _copies(k_cache, k_cache, lengths)
        got = ca.attention_with_kvcache(q_given, *caches, new_given, new, rotary_cos=c,
                                        rotary_sin=s)
        assert_bitwise_equal(got, want)
        for g, w in zip(caches, plain):
            assert_bitwise_equal(g, w)
        assert_bitwise_equal(c, before[0])
        assert_bitwise_equal(s, before[1])


def test_rotary_gives_the_same_bits_for_any_thread_count():
    rng = np.random.default_rng(10)
    k_cache = rng.standard_normal((3, 2, 600, 64)).astype(np.float32)
    q = rng.standard_normal((3, 8, 40, 64)).astype(np.float32)
    new = rng.standard_normal((3, 2, 40, 64)).astype(np.float32)
    cos, sin = rope_tables(700, 32)
    results = []
    for threads in (1, 2, 3):
        caches = _copies(k_cache, k_cache, np.array([0, 100, 550]))
        results.append(ca.attention_with_kvcache(q, *caches, new, new, rotary_cos=cos,
                                                 rotary_sin=sin, num_threads=threads))
    for r in results[1:]:
        assert_bitwise_equal(r, results[0])


# -------------------------------------------------------------- rotary: paged

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


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_paged_rotary_is_rotating_first(compiled_path, general_path, cache_dtype, layout,
                                        page_size):
    rng = np.random.default_rng(page_size)
    n_seq, H, H_kv, d, max_pages = 3, 8, 2, 16, -(-50 // page_size)
    compute = _compute(cache_dtype)
    k_pages, v_pages, scales, table = _pages_from(rng, n_seq, H_kv, page_size, max_pages, d,
                                                  cache_dtype)
    lengths = np.array([0, 13, 40])
    cos, sin = rope_tables(64, 8, compute)
    interleaved = page_size == 7
    new_dtype = compute if cache_dtype != np.float16 else np.float32
    if layout == "padded":
        T = 3
        q = rng.standard_normal((n_seq, H, T, d)).astype(_q_dtype(cache_dtype))
        new = rng.standard_normal((n_seq, H_kv, T, d)).astype(new_dtype)
        q_at = k_at = lengths[:, None, None] + np.arange(T)
        kwargs = {}
    else:
        counts = np.array([4, 1, 2])
        cu = np.concatenate([[0], np.cumsum(counts)])
        q = rng.standard_normal((int(cu[-1]), H, d)).astype(_q_dtype(cache_dtype))
        new = rng.standard_normal((int(cu[-1]), H_kv, d)).astype(new_dtype)
        seq = np.repeat(np.arange(n_seq), counts)
        q_at = k_at = (lengths[seq] + np.arange(cu[-1]) - cu[:-1][seq])[:, None]
        kwargs = dict(cu_seqlens_q=cu)
    taken = compiled_path("paged_shortcut")
    got = _copies(k_pages, v_pages, lengths, *scales.values())
    out = ca.attention_with_paged_kvcache(
        q, got[0], got[1], table, got[2], new, new, rotary_cos=cos, rotary_sin=sin,
        rotary_interleaved=interleaved, **kwargs, **dict(zip(scales, got[3:])))
    want = _copies(k_pages, v_pages, lengths, *scales.values())
    expected = ca.attention_with_paged_kvcache(
        rotate_first(q, cos, sin, q_at, interleaved, compute).astype(q.dtype), want[0],
        want[1], table, want[2], rotate_first(new, cos, sin, k_at, interleaved, compute),
        new, **kwargs, **dict(zip(scales, want[3:])))
    for g, w in zip([out] + got, [expected] + want):
        assert_bitwise_equal(g, w)
    if layout == "padded" and cache_dtype in (np.float32, np.float64):
        assert taken[0] is True
    # the general path gives the same bits
    general = _copies(k_pages, v_pages, lengths, *scales.values())
    with general_path("paged_shortcut"):
        by_general = ca.attention_with_paged_kvcache(
            q, general[0], general[1], table, general[2], new, new, rotary_cos=cos,
            rotary_sin=sin, rotary_interleaved=interleaved, **kwargs,
            **dict(zip(scales, general[3:])))
    for g, w in zip([by_general] + general, [expected] + want):
        assert_bitwise_equal(g, w)


# ------------------------------------------------------------ rotary: errors

def _small_kvcache():
    k_cache = np.zeros((2, 1, 8, 4), np.float32)
    v_cache = np.zeros((2, 1, 8, 4), np.float32)
    lengths = np.array([2, 5])
    step = np.ones((2, 1, 1, 4), np.float32)
    return k_cache, v_cache, lengths, step


_COS, _SIN = rope_tables(8, 2)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(rotary_cos=_COS), ValueError, "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_sin=_SIN), ValueError, "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_interleaved=True), ValueError,
     r"rotary_interleaved=True is given without rotary_cos and rotary_sin"),
    (dict(rotary_cos=_COS, rotary_sin=_SIN, rotary_interleaved="yes"), TypeError,
     r"^rotary_interleaved must be a bool"),
    (dict(rotary_cos=_COS, rotary_sin=_SIN[:, :1]), ValueError,
     r"rotary_cos \(8, 2\) and rotary_sin \(8, 1\) must share one shape"),
    (dict(rotary_cos=_COS[:, 0], rotary_sin=_SIN[:, 0]), ValueError,
     r"rotary_cos must be 2-D \(max_position, rotary_dim / 2\); got shape \(8,\)"),
    (dict(rotary_cos=np.ones((8, 3), np.float32), rotary_sin=np.ones((8, 3), np.float32)),
     ValueError, r"rotary_dim = 2 \* rotary_cos.shape\[1\] = 6 must lie in \[2, d_k = 4\]"),
    (dict(rotary_cos=np.ones((8, 0), np.float32), rotary_sin=np.ones((8, 0), np.float32)),
     ValueError, r"rotary_dim = 2 \* rotary_cos.shape\[1\] = 0 must lie in"),
    (dict(rotary_cos=_COS.astype(np.float64), rotary_sin=_SIN), TypeError,
     r"rotary_cos has dtype float64, but these inputs compute in float32"),
    (dict(rotary_cos=_COS, rotary_sin=np.ones((8, 2), np.int32)), TypeError,
     r"rotary_sin must be floating point .* got dtype int32"),
    (dict(rotary_cos=_COS[:5], rotary_sin=_SIN[:5]), ValueError,
     r"rotary_cos and rotary_sin hold 5 positions \(axis 0 of shape \(5, 2\)\), but q of "
     r"sequence 1 needs position 5"),
])
@pytest.mark.parametrize("call", ["kvcache", "paged"])
def test_rotary_errors_name_the_argument_and_write_nothing(kwargs, error, match, call):
    k_cache, v_cache, lengths, step = _small_kvcache()
    before = _copies(k_cache, v_cache, lengths)
    with pytest.raises(error, match=match):
        if call == "kvcache":
            ca.attention_with_kvcache(step, k_cache, v_cache, lengths, step, step, **kwargs)
        else:
            # the same two sequences as pages of 8 positions
            ca.attention_with_paged_kvcache(step, k_cache, v_cache, np.array([[0], [1]]),
                                            lengths, step, step, **kwargs)
    for got, want in zip((k_cache, v_cache, lengths), before):
        assert_bitwise_equal(got, want)


def test_rotary_rows_before_position_zero_are_refused():
    """More query rows than a sequence has positions after the append: the
    first would sit before position 0."""
    k_cache, v_cache, lengths, step = _small_kvcache()
    q = np.ones((2, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match=r"rotary: a row of q of sequence 0 sits at position "
                                         r"-3"):
        ca.attention_with_kvcache(q, k_cache, v_cache, np.array([0, 5]), step, step,
                                  rotary_cos=_COS, rotary_sin=_SIN)
    assert not k_cache.any()


def test_rotary_beyond_a_float16_cache_is_named_as_rotated():
    """A new key whose rotation leaves float16's range is refused before
    anything is written, named as rotated (its own value fits)."""
    k_cache = np.zeros((1, 1, 8, 4), np.float16)
    lengths = np.array([1])
    new = np.full((1, 1, 1, 4), 60000.0, np.float32)
    cos = np.full((8, 2), np.float32(np.sqrt(0.5)))
    with pytest.raises(ValueError, match=r"k_new \(rotated\)\[0, 0, 0, 2\] = .* is beyond the "
                                         r"range of the float16 cache"):
        ca.attention_with_kvcache(np.ones((1, 1, 1, 4), np.float32), k_cache, k_cache.copy(),
                                  lengths, new, new, rotary_cos=cos, rotary_sin=cos)
    assert lengths.tolist() == [1] and not k_cache.any()


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


def test_cache_batch_idx_with_rotary_starts_out_alibi_and_threads():
    """Every option of the call beside cache_batch_idx: the rotation, left
    padding, ALiBi slopes per (batch row, head), out=, the LSE; and the same
    bits for any thread count."""
    rng = np.random.default_rng(13)
    n_entries, H, H_kv, S_max, d, T = 4, 4, 2, 64, 16, 3
    k_cache = rng.standard_normal((n_entries, H_kv, S_max, d)).astype(np.float32)
    v_cache = rng.standard_normal((n_entries, H_kv, S_max, d)).astype(np.float32)
    idx = np.array([3, 1])
    q = rng.standard_normal((2, H, T, d)).astype(np.float32)
    new = rng.standard_normal((2, H_kv, T, d)).astype(np.float32)
    lengths = np.array([10, 40])
    starts = np.array([4, 0])
    slopes = rng.uniform(0.05, 0.5, (2, H))
    cos, sin = rope_tables(S_max, 8)
    results = []
    for threads in (1, 2):
        caches = _copies(k_cache, v_cache, lengths)
        out = np.empty((2, T, H, d), np.float32).transpose(0, 2, 1, 3)
        got, lse = ca.attention_with_kvcache(
            q, *caches, new, new, cache_batch_idx=idx, rotary_cos=cos, rotary_sin=sin,
            kv_starts=starts, alibi_slopes=slopes, out=out, return_lse=True,
            num_threads=threads)
        assert got is out
        results.append((got.copy(), lse, *caches))
    for a, b in zip(*results):
        assert_bitwise_equal(a, b)
    got, lse, k_after, v_after, lengths_after = results[0]
    for b, entry in enumerate(idx):
        n = int(lengths_after[b])
        positions = np.arange(lengths[b], n)
        keys = k_cache[entry, :, :n].astype(np.float64)
        keys[:, lengths[b]:] = reference_rotary(new[b], cos, sin, positions)
        np.testing.assert_allclose(k_after[entry, :, :n], keys, rtol=0, atol=1e-5)
        q_ref = reference_rotary(q[b], cos, sin, positions)
        assert_matches_reference(
            got[b], None, q_ref, np.repeat(keys, 2, axis=0)[:, starts[b]:],
            np.repeat(v_after[entry, :, :n], 2, axis=0)[:, starts[b]:].astype(np.float64),
            causal=True, alibi_slopes=slopes[b], lse=lse[b])


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
    """Packed queries and packed new rows of other counts per sequence,
    with rotary: bitwise the contiguous caches' call on the same rows
    (pages holding whole decode steps), and the reference."""
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
    cos, sin = rope_tables(64, 8)
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, new, new,
                                           cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new,
                                           rotary_cos=cos, rotary_sin=sin)
    assert lengths.tolist() == (old + new_counts).tolist()
    for b in range(3):
        n = int(lengths[b])
        keys = _sequence(k_pages, table, b, n)
        rows = slice(cu_new[b], cu_new[b + 1])
        rotated = reference_rotary(np.swapaxes(new[rows], 0, 1), cos, sin, np.arange(old[b], n))
        np.testing.assert_allclose(keys[:, old[b]:], rotated, rtol=0, atol=1e-5)
        q_b = np.swapaxes(q[cu_q[b]:cu_q[b + 1]], 0, 1)
        q_ref = reference_rotary(q_b, cos, sin, np.arange(n - q_counts[b], n))
        assert_matches_reference(
            np.swapaxes(attn[cu_q[b]:cu_q[b + 1]], 0, 1), None, q_ref,
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


# ------------------------------------------------ LSE of rows that see no key

def test_lse_of_rows_that_see_no_key_is_minus_inf_in_every_cache_call():
    """-inf, as the log of an empty sum (FlashAttention's kernels give +inf):
    a merge then gives such a chunk no weight. A row whose chunks all see no
    key stays a zero row with -inf."""
    rng = np.random.default_rng(18)
    k_cache = rng.standard_normal((2, 1, 8, 4))
    q = rng.standard_normal((2, 1, 3, 4))
    # sequence 0 holds one key, so under causal alignment its first 2 rows see none
    out, lse = ca.attention_with_kvcache(q, k_cache, k_cache, np.array([1, 8]),
                                         return_lse=True)
    assert np.all(np.isneginf(lse[0, 0, :2])) and not out[0, 0, :2].any()
    paged, paged_lse = ca.attention_with_paged_kvcache(q, k_cache, k_cache, [[0], [1]],
                                                       np.array([1, 8]), return_lse=True)
    assert_bitwise_equal(np.isneginf(paged_lse), np.isneginf(lse))
    # chunks of another library giving +inf for such rows: -inf first, as merge documents
    other = np.where(np.isneginf(lse), np.inf, lse)
    merged, merged_lse = ca.merge([out, out], [np.where(np.isposinf(other), -np.inf, other),
                                              lse])
    assert not merged[0, 0, :2].any() and np.all(np.isneginf(merged_lse[0, 0, :2]))
    np.testing.assert_allclose(merged, out, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(merged_lse[np.isfinite(lse)], lse[np.isfinite(lse)] + np.log(2))
    # left as +inf, merge reads the row as a NaN row of attention
    with np.errstate(invalid="ignore"):
        assert np.all(np.isnan(ca.merge([out, out], [other, lse])[0][0, 0, :2]))
