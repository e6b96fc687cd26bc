"""Paged KV caches (attention_with_paged_kvcache) against the float64
reference on each sequence's contiguous keys, and a continuous-batching
loop against full causal attention recomputed for each sequence."""

import subprocess
import sys

import numpy as np
import pytest

import cattention as ca
from cattention._native import driver
from reference import assert_bitwise_equal, assert_matches_reference, misaligned


def _cache(rng, n_seq, n_kv_heads, page_size, max_pages, d_k, d_v, dtype, spare=3):
    """Pages in shuffled order (with unused ones between), a block table of
    non-contiguous ids with -1 past each sequence's pages."""
    n_pages = n_seq * max_pages + spare
    ids = rng.permutation(n_pages)[: n_seq * max_pages].reshape(n_seq, max_pages)
    k_pages = rng.standard_normal((n_pages, n_kv_heads, page_size, d_k)).astype(dtype)
    v_pages = rng.standard_normal((n_pages, n_kv_heads, page_size, d_v)).astype(dtype)
    return k_pages, v_pages, ids


def _contiguous(pages, table, b, length):
    """Sequence b's first `length` positions, (H_kv, length, d), gathered for
    the reference."""
    page_size = pages.shape[2]
    positions = np.arange(length)
    rows = pages[table[b, positions // page_size], :, positions % page_size]
    return np.swapaxes(rows, 0, 1)


def _check(attn, lse, q, k_pages, v_pages, table, lengths, group, cu_q=None, **options):
    for b in range(table.shape[0]):
        if cu_q is None:
            q_b, attn_b = q[b], attn[b]
            lse_b = None if lse is None else lse[b]
        else:
            rows = slice(cu_q[b], cu_q[b + 1])
            q_b, attn_b = np.swapaxes(q[rows], 0, 1), np.swapaxes(attn[rows], 0, 1)
            lse_b = None if lse is None else np.swapaxes(lse[rows], 0, 1)
        k_b = np.repeat(_contiguous(k_pages, table, b, lengths[b]), group, axis=0)
        v_b = np.repeat(_contiguous(v_pages, table, b, lengths[b]), group, axis=0)
        assert_matches_reference(attn_b, None, q_b, k_b.astype(np.float64),
                                 v_b.astype(np.float64), lse=lse_b, **options)


@pytest.mark.parametrize("page_size", [1, 7, 16, 64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=str)
@pytest.mark.parametrize("n_queries", [1, 3, 40])
def test_paged_matches_reference(simd, dtype, page_size, heads, n_queries):
    n_heads, n_kv_heads = heads
    rng = np.random.default_rng(page_size * 10 + n_queries)
    max_pages = -(-300 // page_size)
    k_pages, v_pages, table = _cache(rng, 4, n_kv_heads, page_size, max_pages, 16, 8, dtype)
    old = np.array([0, 1, 150, 300 - n_queries])
    lengths = old.copy()
    q = rng.standard_normal((4, n_heads, n_queries, 16)).astype(dtype)
    k_new = rng.standard_normal((4, n_kv_heads, n_queries, 16)).astype(dtype)
    v_new = rng.standard_normal((4, n_kv_heads, n_queries, 8)).astype(dtype)
    attn, lse = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, k_new,
                                                v_new, return_lse=True)
    assert attn.shape == (4, n_heads, n_queries, 8) and attn.dtype == dtype
    np.testing.assert_array_equal(lengths, old + n_queries)
    for b in range(4):
        # the new rows are where the table says
        np.testing.assert_array_equal(
            _contiguous(k_pages, table, b, lengths[b])[:, old[b]:], k_new[b])
    _check(attn, lse, q, k_pages, v_pages, table, lengths, n_heads // n_kv_heads,
           causal=True)


@pytest.mark.parametrize("option", ["window", "softcap", "alibi", "sinks", "no_causal"])
def test_paged_options(simd, dtype, option):
    rng = np.random.default_rng(1)
    k_pages, v_pages, table = _cache(rng, 3, 2, 7, 40, 8, 8, dtype)
    lengths = np.array([5, 90, 250])
    q = rng.standard_normal((3, 8, 2, 8)).astype(dtype)
    kwargs = {
        "window": {"window": (17, 0)},
        "softcap": {"softcap": 1.5},
        "alibi": {"alibi_slopes": rng.uniform(0.01, 0.3, 8)},
        "sinks": {"sinks": np.where(np.arange(8) % 2 == 0, -np.inf, 1.0)},
        "no_causal": {"causal": False},
    }[option]
    attn, lse = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths,
                                                return_lse=True,
                                                **{"causal": True, **kwargs})
    _check(attn, lse, q, k_pages, v_pages, table, lengths, 4, **{"causal": True, **kwargs})


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_paged_lse_without_values(dtype, packed):
    """d_v = 0: no output to write, but each row's log-sum-exp is computed."""
    rng = np.random.default_rng(5)
    k_pages, v_pages, table = _cache(rng, 3, 2, 4, 6, 8, 0, dtype)
    lengths = np.array([5, 1, 23])
    q = rng.standard_normal((3, 4, 2, 8)).astype(dtype)
    if packed:
        cu_q = np.array([0, 2, 4, 6])
        tokens = np.swapaxes(q, 1, 2).reshape(6, 4, 8)
        attn, lse = ca.attention_with_paged_kvcache(tokens, k_pages, v_pages, table, lengths,
                                                    cu_seqlens_q=cu_q, return_lse=True)
        assert attn.shape == (6, 4, 0) and lse.shape == (6, 4)
        _check(attn, lse, tokens, k_pages, v_pages, table, lengths, 2, cu_q=cu_q,
               causal=True)
    else:
        attn, lse = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths,
                                                    return_lse=True)
        assert attn.shape == (3, 4, 2, 0) and lse.shape == (3, 4, 2)
        _check(attn, lse, q, k_pages, v_pages, table, lengths, 2, causal=True)


def test_paged_float16_pages(simd):
    rng = np.random.default_rng(2)
    k_pages, v_pages, table = _cache(rng, 3, 2, 16, 20, 16, 16, np.float16)
    lengths = np.array([0, 17, 300])
    q = rng.standard_normal((3, 8, 1, 16)).astype(np.float32)
    new = rng.standard_normal((3, 2, 1, 16)).astype(np.float32)
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, new, new)
    assert attn.dtype == np.float32
    _check(attn, None, q, k_pages.astype(np.float32), v_pages.astype(np.float32), table,
           lengths, 4, causal=True)


def test_paged_int8_pages(simd):
    rng = np.random.default_rng(4)
    k_float, v_float, table = _cache(rng, 3, 2, 16, 20, 16, 16, np.float32)
    (k_pages, k_scale), (v_pages, v_scale) = ca.quantize_kv(k_float), ca.quantize_kv(v_float)
    lengths = np.array([3, 17, 290])
    q = rng.standard_normal((3, 8, 2, 16)).astype(np.float32)
    new = rng.standard_normal((3, 2, 2, 16)).astype(np.float32)
    attn, lse = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, new,
                                                new, k_scale=k_scale, v_scale=v_scale,
                                                return_lse=True)
    # the reference sees exactly the values the int8 pages and scales hold
    k_values = k_pages.astype(np.float32) * k_scale[..., None]
    v_values = v_pages.astype(np.float32) * v_scale[..., None]
    _check(attn, lse, q, k_values, v_values, table, lengths, 4, causal=True)


def test_paged_bitwise_contiguous_cache_and_threads(dtype):
    """Pages that hold whole decode steps (32 keys, 64 for int8) give the
    bits of the same step on contiguous caches, at every thread count."""
    rng = np.random.default_rng(9)
    n_seq, page_size, max_pages = 3, 64, 16
    k_pages, v_pages, table = _cache(rng, n_seq, 2, page_size, max_pages, 32, 32, dtype)
    lengths = np.array([1000, 37, 640])
    q = rng.standard_normal((n_seq, 8, 1, 32)).astype(dtype)
    k_cache = np.stack([_contiguous(k_pages, table, b, max_pages * page_size)
                        for b in range(n_seq)])
    v_cache = np.stack([_contiguous(v_pages, table, b, max_pages * page_size)
                        for b in range(n_seq)])
    want = ca.attention_with_kvcache(q, k_cache, v_cache, lengths.copy(), num_threads=1)
    for threads in (1, 2, 5):
        got = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                              num_threads=threads)
        assert_bitwise_equal(got, want)


def test_continuous_batching_loop(simd):
    """64 steps of a serving loop: requests join and leave, prompts are
    prefilled in chunks while others decode, all in one call per step;
    every output row matches full causal attention recomputed over the
    sequence so far."""
    rng = np.random.default_rng(64)
    n_heads, n_kv_heads, d, page_size, chunk = 4, 2, 16, 7, 24
    n_slots, max_pages = 4, 40
    n_pages = n_slots * max_pages
    k_pages = np.full((n_pages, n_kv_heads, page_size, d), np.nan, np.float32)
    v_pages = np.full((n_pages, n_kv_heads, page_size, d), np.nan, np.float32)
    free_pages = list(rng.permutation(n_pages))
    table = np.full((n_slots, max_pages), -1, dtype=np.int64)
    lengths = np.zeros(n_slots, dtype=np.int64)
    # per slot: the request's whole token stream (q, k, v) and how far it is
    streams = [None] * n_slots
    done = 0
    for step in range(64):
        for slot in range(n_slots):
            if streams[slot] is None and rng.random() < 0.5:
                total = int(rng.integers(1, 70))
                prompt = int(rng.integers(1, total + 1))
                streams[slot] = {
                    "q": rng.standard_normal((total, n_heads, d)).astype(np.float32),
                    "k": rng.standard_normal((total, n_kv_heads, d)).astype(np.float32),
                    "v": rng.standard_normal((total, n_kv_heads, d)).astype(np.float32),
                    "prompt": prompt, "total": total}
                lengths[slot] = 0
        counts = np.zeros(n_slots, dtype=np.int64)
        for slot, stream in enumerate(streams):
            if stream is None:
                continue
            at = int(lengths[slot])
            counts[slot] = min(chunk, stream["prompt"] - at) if at < stream["prompt"] else 1
            # pages for the positions this step fills
            for page in range(-(-at // page_size), -(-(at + counts[slot]) // page_size)):
                table[slot, page] = free_pages.pop()
        cu = np.concatenate([[0], np.cumsum(counts)])
        pieces = [(slot, int(lengths[slot]), int(counts[slot]))
                  for slot in range(n_slots) if counts[slot]]
        q = np.zeros((cu[-1], n_heads, d), np.float32)
        k_new = np.zeros((cu[-1], n_kv_heads, d), np.float32)
        v_new = np.zeros((cu[-1], n_kv_heads, d), np.float32)
        for slot, at, count in pieces:
            rows = slice(cu[slot], cu[slot] + count)
            for name, arr in (("q", q), ("k", k_new), ("v", v_new)):
                arr[rows] = streams[slot][name][at:at + count]
        attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, k_new,
                                               v_new, cu_seqlens_q=cu, causal=True)
        np.testing.assert_array_equal(lengths[counts > 0], [a + c for _, a, c in pieces])
        for slot, at, count in pieces:
            stream = streams[slot]
            end = at + count
            k_full = np.repeat(np.swapaxes(stream["k"][:end], 0, 1), 2, axis=0)
            v_full = np.repeat(np.swapaxes(stream["v"][:end], 0, 1), 2, axis=0)
            assert_matches_reference(
                np.swapaxes(attn[cu[slot]:cu[slot] + count], 0, 1), None,
                np.swapaxes(stream["q"][at:end], 0, 1), k_full, v_full, causal=True)
            if end == stream["total"]:
                # the request leaves: its pages go back
                free_pages.extend(int(p) for p in table[slot] if p >= 0)
                table[slot] = -1
                lengths[slot] = 0
                streams[slot] = None
                done += 1
    assert done >= 3


def _small_call():
    k_pages = np.zeros((6, 2, 4, 8), np.float32)
    v_pages = np.zeros((6, 2, 4, 8), np.float32)
    table = np.array([[0, 1, -1], [2, 3, 4]])
    lengths = np.array([3, 8])
    x = np.ones((2, 2, 2, 8), np.float32)
    return k_pages, v_pages, table, lengths, x


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(table=np.array([[0, -1, -1], [2, 3, 4]])),
     r"block_table\[0, 1\] = -1 is not a page id in \[0, 6\)"),
    (lambda a: a.update(table=np.array([[0, 9, -1], [2, 3, 4]])),
     r"block_table\[0, 1\] = 9 is not a page id"),
    (lambda a: a.update(lengths=np.array([3, 11])),
     r"sequence 1 needs 13 positions .* at most 3 pages of 4"),
    (lambda a: a.update(table=np.array([[0, 1, -1], [2, 3, 1]])),
     "two new rows would be written to one page row"),
    # a page another sequence, or the same one, still holds
    (lambda a: a.update(table=np.array([[0, 2, -1], [2, 3, 4]])),
     r"sequence 0's new position 4 would be written to page 2 row 0, which sequence 1 "
     r"holds \(its position 0\)"),
    (lambda a: a.update(table=np.array([[0, 0, -1], [2, 3, 4]])),
     r"sequence 0's new position 4 would be written to page 0 row 0, which sequence 0 "
     r"holds \(its position 0\)"),
    # (new rows of another count than q's are appended: issue 43)
    (lambda a: a.update(k_new=np.ones((2, 3, 2, 8), np.float32)),
     r"k_new must have shape \(2, 2, 2, 8\)"),
    (lambda a: a.update(k_new=np.ones((2, 2, 3, 8), np.float32)),
     r"v_new must have shape \(2, 2, 3, 8\)"),
    (lambda a: a.update(v_new=None), "k_new and v_new must be given together"),
    (lambda a: a.update(lengths=np.array([3.0, 8.0])),
     r"cache_lengths must be an integer ndarray of shape \(2,\)"),
    (lambda a: a.update(lengths=np.array([-1, 8])), "cache_lengths must be >= 0"),
    (lambda a: a.update(q=np.ones((2, 3, 2, 8), np.float32)), "multiple of the key/value"),
    (lambda a: a.update(v_pages=np.zeros((6, 2, 4, 8), np.float64)), "share one dtype"),
    (lambda a: a.update(q=np.ones((2, 2, 2, 8))), "would convert"),
    (lambda a: a.update(table=np.zeros((2, 3))), "block_table must be a 2-D integer"),
    (lambda a: a.update(softcap=-1.0), "softcap"),
])
def test_paged_errors_write_nothing(change, match):
    k_pages, v_pages, table, lengths, x = _small_call()
    args = {"q": x, "table": table, "lengths": lengths, "k_new": x, "v_new": x,
            "v_pages": v_pages, "softcap": None}
    change(args)
    before = (k_pages.copy(), args["v_pages"].copy(), args["lengths"].copy())
    with pytest.raises((ValueError, TypeError), match=match):
        ca.attention_with_paged_kvcache(args["q"], k_pages, args["v_pages"], args["table"],
                                        args["lengths"], args["k_new"], args["v_new"],
                                        softcap=args["softcap"])
    assert_bitwise_equal(k_pages, before[0])
    assert_bitwise_equal(args["v_pages"], before[1])
    assert_bitwise_equal(args["lengths"], before[2])


@pytest.mark.parametrize("causal", ["yes", 1, np.array([True, False])],
                         ids=["str", "int", "array"])
def test_paged_causal_must_be_a_bool_and_nothing_is_written(causal):
    k_pages, v_pages, table, lengths, x = _small_call()
    with pytest.raises(TypeError, match=r"^causal must be a bool"):
        ca.attention_with_paged_kvcache(x, k_pages, v_pages, table, lengths, x, x,
                                        causal=causal)
    assert not k_pages.any() and not v_pages.any() and lengths.tolist() == [3, 8]


def test_paged_numpy_bool_causal_is_a_bool():
    rng = np.random.default_rng(5)
    results = []
    for causal in (True, np.True_):
        k_pages, v_pages, table, lengths, x = _small_call()
        k_pages[:] = rng.standard_normal(k_pages.shape)
        v_pages[:] = rng.standard_normal(v_pages.shape)
        results.append(ca.attention_with_paged_kvcache(x, k_pages, v_pages, table, lengths,
                                                       x, x, causal=causal))
        rng = np.random.default_rng(5)
    assert_bitwise_equal(results[0], results[1])


def test_pages_shared_for_a_common_prefix_take_appends_past_them():
    """Two sequences share page 0 (a full common prefix) and append into
    pages of their own: allowed, the shared rows stay, and each sequence
    attends to the prefix and its own rows, as the reference does."""
    rng = np.random.default_rng(31)
    k_pages = rng.standard_normal((4, 1, 4, 8)).astype(np.float32)
    v_pages = rng.standard_normal((4, 1, 4, 5)).astype(np.float32)
    prefix = (k_pages[0].copy(), v_pages[0].copy())
    table = np.array([[0, 1], [0, 2]])
    lengths = np.array([4, 5])
    q = rng.standard_normal((2, 2, 1, 8)).astype(np.float32)
    k_new = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    v_new = rng.standard_normal((2, 1, 1, 5)).astype(np.float32)
    out = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, k_new, v_new)
    assert lengths.tolist() == [5, 6]
    assert_bitwise_equal(k_pages[0], prefix[0])
    assert_bitwise_equal(v_pages[0], prefix[1])
    for b, n in enumerate(lengths.tolist()):
        k_seen = np.concatenate([k_pages[p, 0] for p in table[b]])[:n]
        v_seen = np.concatenate([v_pages[p, 0] for p in table[b]])[:n]
        assert_bitwise_equal(k_seen[-1], k_new[b, 0, 0])
        for h in range(2):
            assert_matches_reference(out[b, h], None, q[b, h], k_seen, v_seen, causal=True)


def test_paged_failed_computation_gives_the_rows_back(monkeypatch):
    """A call that fails after its append (out of memory) puts cache_lengths
    back: the page rows past them are free again."""
    k_pages, v_pages, table, lengths, x = _small_call()

    def out_of_memory(*args, **kwargs):
        raise MemoryError("cattention: could not allocate scratch memory")

    monkeypatch.setattr("cattention._prepare.entries.run", out_of_memory)
    monkeypatch.setattr(driver, "paged_shortcut", lambda *args: None)
    with pytest.raises(MemoryError):
        ca.attention_with_paged_kvcache(x, k_pages, v_pages, table, lengths, x, x)
    assert lengths.tolist() == [3, 8]
    monkeypatch.undo()
    # the same call then appends as a first call would
    ca.attention_with_paged_kvcache(x, k_pages, v_pages, table, lengths, x, x)
    assert lengths.tolist() == [5, 10]


def test_paged_packed_queries_shape_errors():
    k_pages, v_pages, table, lengths, x = _small_call()
    q = np.ones((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q describes 1 sequences"):
        ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths,
                                        cu_seqlens_q=[0, 4])
    with pytest.raises(ValueError, match=r"q must have shape \(B, H, T, d_k\)"):
        ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths)
    with pytest.raises(ValueError, match=r"k_new must have shape \(4, 2, 8\)"):
        ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, x, x,
                                        cu_seqlens_q=[0, 1, 4])


def test_distinct_caches_from_many_threads_give_the_serial_results():
    """A thread pool of serving loops, each with its own paged cache: every
    step's output and cache is bitwise what the same steps give serially."""
    from concurrent.futures import ThreadPoolExecutor

    def serve(seed):
        rng = np.random.default_rng(seed)
        k_pages, v_pages, table = _cache(rng, 2, 2, 16, 8, 16, 16, np.float32)
        k_pages[:] = 0
        v_pages[:] = 0
        lengths = np.zeros(2, dtype=np.int64)
        outputs = []
        for n_new in (20, 1, 1, 7, 1):
            q = rng.standard_normal((2 * n_new, 4, 16)).astype(np.float32)
            kv = rng.standard_normal((2 * n_new, 2, 16)).astype(np.float32)
            outputs.append(ca.attention_with_paged_kvcache(
                q, k_pages, v_pages, table, lengths, kv, kv,
                cu_seqlens_q=[0, n_new, 2 * n_new], num_threads=2))
        return outputs, k_pages

    serial = [serve(seed) for seed in range(6)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        threaded = list(pool.map(serve, range(6)))
    for (outs, pages), (want_outs, want_pages) in zip(threaded, serial):
        assert_bitwise_equal(pages, want_pages)
        for out, want in zip(outs, want_outs):
            assert_bitwise_equal(out, want)


def test_paged_byte_order_gives_the_native_bits_or_a_clear_refusal():
    """Big-endian q, new rows, block table, lengths and cu_seqlens_q give
    bitwise the native result and the same pages; big-endian pages are
    refused (reading them would copy every page)."""
    def run(swap):
        rng = np.random.default_rng(21)
        k_pages, v_pages, table = _cache(rng, 2, 2, 7, 6, 8, 8, np.float32)
        lengths = np.array([3, 20])
        q = rng.standard_normal((5, 4, 8)).astype(np.float32)
        kv = rng.standard_normal((5, 2, 8)).astype(np.float32)
        cu = np.array([0, 4, 5])
        if swap:
            q, kv, table, cu = (x.astype(x.dtype.newbyteorder(">")) for x in (q, kv, table, cu))
            lengths = lengths.astype(">i8")
        out = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, kv, kv,
                                              cu_seqlens_q=cu)
        return out, k_pages, lengths.astype(np.int64)

    for want, got in zip(run(False), run(True)):
        assert_bitwise_equal(got, want)
    k_pages, v_pages, table, lengths, x = _small_call()
    with pytest.raises(TypeError, match="k_pages has non-native byte order"):
        ca.attention_with_paged_kvcache(x, k_pages.astype(">f4"), v_pages, table, lengths)


def _read_only(pages):
    pages = pages.copy()
    pages.flags.writeable = False
    return pages


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(k_pages=misaligned(a["k_pages"])),
     "k_pages must be aligned with strides that are multiples of its itemsize"),
    (lambda a: a.update(k_pages=np.zeros((6, 2, 0, 8), np.float32),
                        v_pages=np.zeros((6, 2, 0, 8), np.float32)),
     r"page_size \(axis 2 of k_pages \(6, 2, 0, 8\)\) must be >= 1"),
    (lambda a: a.update(k_pages=np.zeros((6, 2, 4, 8), np.int32)),
     r"k_pages has dtype int32; pages must be float16, bfloat16, float32, float64, int8 "
     r"\(with scales\) or fp8"),
    (lambda a: a.update(k_pages=np.zeros((6, 2, 4, 8), np.int8),
                        v_pages=np.zeros((6, 2, 4, 8), np.int8)),
     r"int8 pages need k_scale: a native float32 ndarray of shape \(6, 2, 4\)"),
    (lambda a: a.update(k_scale=np.ones((6, 2, 4), np.float32)),
     "k_scale and v_scale go with int8 and fp8 pages; these are float32"),
    (lambda a: a.update(k_pages=np.zeros((6, 2, 4, 8), np.int8),
                        v_pages=np.zeros((6, 2, 4, 8), np.int8), q=np.ones((2, 2, 2, 8)),
                        k_new=np.ones((2, 2, 2, 8)), v_new=np.ones((2, 2, 2, 8))),
     "int8 pages need a float32 \\(or float16\\) q, or a bfloat16 one, got float64"),
    (lambda a: a.update(k_pages=np.zeros((6, 2, 4, 8), np.int8),
                        v_pages=np.zeros((6, 2, 4, 8), np.int8),
                        k_scale=np.ones((6, 2, 4), np.float32),
                        v_scale=np.ones((6, 2, 4), np.float32),
                        k_new=np.ones((2, 2, 2, 8), np.int8)),
     "k_new of dtype int8 for int8 pages: pass float values"),
    (lambda a: a.update(k_new=np.ones((2, 2, 2, 8), np.complex64)),
     "k_new of dtype complex64 cannot be written into float32 pages"),
    (lambda a: a.update(v_pages=_read_only(a["v_pages"])),
     "must be writable to append"),
    (lambda a: a.update(cu=[0, 2, 4]),
     r"with cu_seqlens_q, q must be packed \(total_q, H, d_k\)"),
    # float16 pages would store it as inf
    (lambda a: a.update(k_pages=np.zeros((6, 2, 4, 8), np.float16),
                        v_pages=np.zeros((6, 2, 4, 8), np.float16),
                        v_new=np.where(np.arange(8) == 3, 7e4, a["v_new"])),
     r"v_new\[0, 0, 0, 3\] = 70000\.0 is beyond the range of the float16 cache"),
    # int8 pages cannot quantize it
    (lambda a: a.update(k_pages=np.zeros((6, 2, 4, 8), np.int8),
                        v_pages=np.zeros((6, 2, 4, 8), np.int8),
                        k_scale=np.ones((6, 2, 4), np.float32),
                        v_scale=np.ones((6, 2, 4), np.float32),
                        k_new=np.where(np.arange(8) == 3, np.inf, a["k_new"])),
     r"k_new: rows hold NaN or infinite values"),
])
def test_paged_more_errors_write_nothing(change, match):
    k_pages, v_pages, table, lengths, x = _small_call()
    args = {"q": x, "k_pages": k_pages, "v_pages": v_pages, "k_new": x, "v_new": x,
            "k_scale": None, "v_scale": None, "cu": None}
    change(args)
    before = (args["k_pages"].copy(), args["v_pages"].copy(), lengths.copy())
    with pytest.raises((ValueError, TypeError), match=match):
        ca.attention_with_paged_kvcache(args["q"], args["k_pages"], args["v_pages"], table,
                                        lengths, args["k_new"], args["v_new"],
                                        cu_seqlens_q=args["cu"], k_scale=args["k_scale"],
                                        v_scale=args["v_scale"])
    assert_bitwise_equal(args["k_pages"], before[0])
    assert_bitwise_equal(args["v_pages"], before[1])
    assert_bitwise_equal(lengths, before[2])


def _serving_pages(seed, dtype, page_dtype, n_seq, heads, kv_heads, T, lengths, page_size,
                   length_dtype, table_dtype, d_k=16, d_v=8):
    rng = np.random.default_rng(seed)
    max_pages = -(-(max(lengths) + T) // page_size) + 1
    k_pages, v_pages, table = _cache(rng, n_seq, kv_heads, page_size, max_pages, d_k, d_v,
                                     page_dtype)
    q = rng.standard_normal((n_seq, heads, T, d_k)).astype(dtype)
    k_new = rng.standard_normal((n_seq, kv_heads, T, d_k)).astype(page_dtype)
    v_new = rng.standard_normal((n_seq, kv_heads, T, d_v)).astype(page_dtype)
    return (q, k_pages, v_pages, table.astype(table_dtype),
            np.array(lengths, dtype=length_dtype), k_new, v_new)


# (H, H_kv, T): ungrouped; grouped decode (rows stacked per K/V head: G * T
# <= 8); grouped with more rows (one entry per query head)
@pytest.mark.parametrize("heads,kv_heads,T", [(2, 2, 1), (2, 2, 3), (8, 2, 1), (8, 2, 2),
                                              (4, 1, 5), (12, 1, 1)])
@pytest.mark.parametrize("types", [("float32", "float32"), ("float64", "float64"),
                                   ("float32", "float16")],
                         ids=["f32", "f64", "f16-pages"])
@pytest.mark.parametrize("append", [True, False], ids=["append", "read"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_paged_serving_step_matches_reference_and_general_path(
        compiled_path, general_path, heads, kv_heads, T, types, append, causal):
    """The serving step (float pages, no options) runs a compiled path of its
    own: its output matches the float64 reference, and its output, pages
    and lengths are bitwise those of the general path."""
    dtype, page_dtype = types
    taken = compiled_path("paged_shortcut")
    cases = [([7, 0, 30], 4, np.int64, np.int64), ([31, 12], 16, np.int32, np.int32),
             ([300], 16, np.int64, np.int32)]
    for seed, (lengths, page_size, length_dtype, table_dtype) in enumerate(cases):
        if not append:
            lengths = [max(n, T) for n in lengths]
        q, k_pages, v_pages, table, cache_lengths, k_new, v_new = _serving_pages(
            940 + seed, dtype, page_dtype, len(lengths), heads, kv_heads, T, lengths,
            page_size, length_dtype, table_dtype)
        step = (k_new, v_new) if append else ()
        general = [a.copy() for a in (k_pages, v_pages, cache_lengths)]
        out = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, cache_lengths,
                                              *step, causal=causal)
        with general_path("paged_shortcut"):
            expected = ca.attention_with_paged_kvcache(q, general[0], general[1], table,
                                                       general[2], *step, causal=causal)
        assert taken == [True] * (seed + 1)
        assert out.dtype == np.dtype(dtype) and out.shape == expected.shape
        assert_bitwise_equal(out, expected)
        for got, want in zip((k_pages, v_pages, cache_lengths), general):
            assert got.dtype == want.dtype
            assert_bitwise_equal(got, want)
        for b, n in enumerate(cache_lengths.tolist()):
            assert n == lengths[b] + (T if append else 0)
        _check(out, None, q, k_pages.astype(dtype), v_pages.astype(dtype), table,
               cache_lengths, heads // kv_heads, causal=causal)


def test_paged_serving_step_takes_strided_views_and_threads_alike(compiled_path):
    """Strided q and pages (views into larger buffers), a transposed block
    table, new rows from a transposed buffer, 1 and 2 threads: the bits of
    contiguous copies."""
    taken = compiled_path("paged_shortcut")
    q, k_pages, v_pages, table, lengths, k_new, v_new = _serving_pages(
        950, np.float32, np.float32, 3, 8, 2, 1, [5, 17, 40], 8, np.int64, np.int64)
    expected_pages = [a.copy() for a in (k_pages, v_pages, lengths)]
    expected = ca.attention_with_paged_kvcache(q, *expected_pages[:2], table,
                                               expected_pages[2], k_new, v_new)
    q_wide = np.zeros(q.shape[:-1] + (2 * q.shape[-1],), np.float32)
    q_wide[..., ::2] = q
    for threads in (1, 2):
        k_buffer = np.zeros(k_pages.shape[:-1] + (3 * k_pages.shape[-1],), np.float32)
        v_buffer = np.zeros((2,) + v_pages.shape, np.float32)
        k_strided, v_strided = k_buffer[..., 1::3], v_buffer[1]
        k_strided[...] = k_pages
        v_strided[...] = v_pages
        step_lengths = lengths.copy()
        table_t = np.ascontiguousarray(table.T).T
        k_new_t = np.ascontiguousarray(np.swapaxes(k_new, 2, 3)).swapaxes(2, 3)
        out = ca.attention_with_paged_kvcache(q_wide[..., ::2], k_strided, v_strided, table_t,
                                              step_lengths, k_new_t, v_new,
                                              num_threads=threads)
        assert_bitwise_equal(out, expected)
        assert_bitwise_equal(k_strided, expected_pages[0])
        assert_bitwise_equal(v_strided, expected_pages[1])
        assert step_lengths.tolist() == expected_pages[2].tolist()
        assert np.all(k_buffer[..., 0::3] == 0) and np.all(v_buffer[0] == 0)
    assert taken == [True] * 3


def test_paged_serving_step_leaves_written_shared_pages_to_the_general_path(compiled_path):
    """A page read by several sequences (a common prefix) keeps the compiled
    path; a page a sequence writes to that another sequence (or the same one,
    listed twice) also uses is the general path's to refuse, and nothing is
    written."""
    taken = compiled_path("paged_shortcut")
    rng = np.random.default_rng(33)
    k_pages = rng.standard_normal((5, 1, 4, 8)).astype(np.float32)
    v_pages = rng.standard_normal((5, 1, 4, 8)).astype(np.float32)
    q = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    new = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)

    def step(table, lengths):
        return ca.attention_with_paged_kvcache(q, k_pages, v_pages, np.array(table),
                                               np.array(lengths), new, new)

    step([[0, 1], [0, 2]], [4, 5])                  # page 0 read by both
    assert taken == [True]
    before = (k_pages.copy(), v_pages.copy())
    for table, lengths, match in [([[3, 1], [3, 2]], [2, 5], "which sequence 1 holds"),
                                  ([[3, 1], [3, 2]], [2, 2], "two new rows"),
                                  ([[3, 3], [4, 2]], [4, 1], "which sequence 0 holds")]:
        with pytest.raises(ValueError, match=match):
            step(table, lengths)
    assert taken == [True, False, False, False]
    assert_bitwise_equal(k_pages, before[0])
    assert_bitwise_equal(v_pages, before[1])


_FAILING_PAGED_SCRATCH = """
import re, resource
import numpy as np
import cattention as ca
S = 1 << 21
k_pages = np.ones((S // 256, 1, 256, 8), np.float32)
v_pages = np.ones((S // 256, 1, 256, 8), np.float32)
table = np.arange(S // 256)[None]
lengths = np.array([S - 200], dtype=np.{length_dtype})
chunk = np.full((1, 1, 100, 8), 2, np.float32)
ca.attention(chunk, chunk, chunk, num_threads=1)
# room for small allocations, not for the chunk's 64 MiB of packed keys
status = open("/proc/self/status").read()
in_use = int(re.search(r"VmSize:\\s+(\\d+)", status).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (in_use + (16 << 20), resource.RLIM_INFINITY))
try:
    ca.attention_with_paged_kvcache(chunk, k_pages, v_pages, table, lengths, chunk, chunk,
                                    num_threads=1)
    print("no error")
except MemoryError as error:
    position = S - 150
    print(type(error).__name__, int(lengths[0]),
          float(k_pages[position // 256, 0, position % 256, 0]))
"""


@pytest.mark.parametrize("length_dtype", ["int64", "int32"])
def test_paged_serving_step_failing_for_scratch_gives_the_rows_back(length_dtype):
    """The compiled path too: a step whose scratch cannot be allocated
    raises MemoryError with cache_lengths put back (the new rows were
    written to the page rows past them)."""
    result = subprocess.run([sys.executable, "-c", _FAILING_PAGED_SCRATCH.format(
        length_dtype=length_dtype)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["MemoryError", str((1 << 21) - 200), "2.0"]


@pytest.mark.parametrize("layout", ["fortran", "stepped_features"])
@pytest.mark.parametrize("n_queries", [3, 13, 40])
@pytest.mark.parametrize("page_dtype", ["float32", "float64", "float16"])
def test_paged_strided_features_give_the_contiguous_bits(simd, layout, n_queries, page_dtype):
    """Pages whose features are strided (a Fortran-ordered array, a stepped
    view), read by the packed path (more than 8 query rows) too, where a key
    block gathered from several pages is a contiguous copy: the bits of
    C-ordered pages, and the reference."""
    dtype = np.float64 if page_dtype == "float64" else np.float32
    rng = np.random.default_rng(n_queries)
    k_pages, v_pages, table = _cache(rng, 2, 2, 4, 90, 12, 6, page_dtype)
    lengths = np.array([5, 300])
    q = rng.standard_normal((2, 4, n_queries, 12)).astype(dtype)
    k_new = rng.standard_normal((2, 2, n_queries, 12)).astype(page_dtype)
    v_new = rng.standard_normal((2, 2, n_queries, 6)).astype(page_dtype)

    def strided(pages):
        if layout == "fortran":
            return np.asfortranarray(pages)
        buffer = np.zeros(pages.shape[:-1] + (2 * pages.shape[-1],), pages.dtype)
        buffer[..., ::2] = pages
        return buffer[..., ::2]

    contiguous = [k_pages.copy(), v_pages.copy(), lengths.copy()]
    odd = [strided(k_pages), strided(v_pages), lengths.copy()]
    assert odd[0].strides[-1] != odd[0].itemsize
    want = ca.attention_with_paged_kvcache(q, contiguous[0], contiguous[1], table,
                                           contiguous[2], k_new, v_new)
    got = ca.attention_with_paged_kvcache(q, odd[0], odd[1], table, odd[2], k_new, v_new)
    assert_bitwise_equal(got, want)
    for a, b in zip(odd, contiguous):
        assert_bitwise_equal(np.ascontiguousarray(a), b)
    _check(got, None, q, contiguous[0].astype(dtype), contiguous[1].astype(dtype), table,
           contiguous[2], 2, causal=True)
