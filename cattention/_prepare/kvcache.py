"""A decoding step against a contiguous KV cache, checked once: the cache's
own checks (caches.py), the rotary embeddings of q and the new keys
(rotary.py), then the attention over the cache, all before anything is
written. The attention is a dense call (dense.py) when batch row b uses
cache entry b, and an entries call (entries.py: each sequence read where
its entry lies, no cache copied) when ``cache_batch_idx`` picks the entries."""

from __future__ import annotations

from typing import Any, Optional, SupportsIndex, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .arrays import array, as_input, check_out, is_fp8, is_half, refuse_shared_memory
from .caches import (Appends, as_stored, check_cache_lengths, check_new_rows_dtype,
                     check_scales, check_scales_hold, check_sequence_starts, check_storage,
                     fp8_read_scale, new_rows, result_dtype, store_compute)
from .dense import DenseCall, prepare_dense
from .entries import EntriesCall, head_options, outputs, place, queries
from .options import row_options
from .rotary import check_rotary, rotate_queries

_Array = NDArray[Any]


def prepare_kvcache(q: ArrayLike, k_cache: object, v_cache: object, cache_lengths: object,
                    k_new: Optional[ArrayLike], v_new: Optional[ArrayLike], *, causal: bool,
                    scale: Optional[float], enable_gqa: Optional[bool], window: Any,
                    softcap: Optional[float], alibi_slopes: Optional[ArrayLike],
                    sinks: Optional[ArrayLike], k_scale: Optional[_Array],
                    v_scale: Optional[_Array], return_lse: bool,
                    num_threads: Optional[SupportsIndex], kv_starts: Optional[ArrayLike] = None,
                    out: Optional[_Array] = None, rotary_cos: Optional[ArrayLike] = None,
                    rotary_sin: Optional[ArrayLike] = None, rotary_interleaved: object = False,
                    cache_batch_idx: Optional[ArrayLike] = None, precision: object = None,
                    ) -> tuple[Union[DenseCall, EntriesCall], Appends, np.dtype[Any]]:
    """The call over the cache after the append (dense, or an entries call
    with cache_batch_idx), the append, and the result dtype."""
    k_cache, v_cache = check_storage(k_cache, v_cache, ("k_cache", "v_cache"),
                                     "(B, H_kv, S_max, d)", "(B, H_kv, S_max)", "KV caches")
    n_entries, n_kv_heads, max_keys, d_k = k_cache.shape
    d_v = v_cache.shape[3]
    q = as_input(q, "q")
    entry_of = _cache_entries(cache_batch_idx, n_entries, k_cache.shape)
    n_batch = n_entries if entry_of is None else entry_of.size
    if q.ndim != 4 or q.shape[0] != n_batch or q.shape[3] != d_k:
        against = (f"k_cache {k_cache.shape}" if entry_of is None
                   else f"cache_batch_idx ({n_batch} batch rows) and k_cache {k_cache.shape}")
        raise ValueError(f"q must have shape (B, H, T, d_k) = ({n_batch}, H, T, {d_k}) "
                         f"to match {against}; got {q.shape}")
    # float16 and bfloat16 caches are read as they are (converted block by
    # block, computed in float32) with a 16-bit or float32 q; otherwise q must
    # not be wider than the cache, or the cache would be converted whole
    half_cache = is_half(k_cache.dtype) and (is_half(q.dtype) or q.dtype == np.float32)
    int8_cache = k_cache.dtype == np.int8
    fp8_cache = is_fp8(k_cache.dtype)
    # checked, and those the call writes with the rows it appends
    written_scales = check_scales(k_cache, k_scale, v_scale, q.dtype, "caches",
                                  "(B, H_kv, S_max)")
    if (not half_cache and not int8_cache and not fp8_cache
            and np.result_type(q.dtype, k_cache.dtype) != k_cache.dtype):
        raise TypeError(f"q of dtype {q.dtype} with a {k_cache.dtype} cache would "
                        "convert (copy) the cache; pass q in the cache's dtype")
    compute = store_compute(k_cache.dtype)
    n_heads, n_queries = q.shape[1], q.shape[2]
    if enable_gqa is not None:
        enable_gqa = driver.check_flag(enable_gqa, "enable_gqa")
    if enable_gqa is False and n_heads != n_kv_heads:
        raise ValueError(f"enable_gqa=False needs as many query heads as key/value heads: "
                         f"q {q.shape} has {n_heads}, k_cache {k_cache.shape} has "
                         f"{n_kv_heads}; pass enable_gqa=True (or None) for grouped-query "
                         "attention")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"the query heads of q {q.shape} must be a multiple of the "
                         f"key/value heads of k_cache {k_cache.shape}")
    lengths = check_cache_lengths(cache_lengths, n_batch, max_keys)
    rotary = check_rotary(rotary_cos, rotary_sin, rotary_interleaved, d_k, compute)

    n_new = 0
    given = new_rows(k_new, v_new)
    if given is not None:
        k_rows, v_rows = given
        for name, new, d in (("k_new", k_rows, d_k), ("v_new", v_rows, d_v)):
            if new.ndim != 4:
                raise ValueError(
                    f"{name} must be 4-D (B, H_kv, T_new, d) = ({n_batch}, {n_kv_heads}, "
                    f"T_new, {d}); got shape {new.shape}")
        n_new = k_rows.shape[2]
        expected_k = (n_batch, n_kv_heads, n_new, d_k)
        expected_v = (n_batch, n_kv_heads, n_new, d_v)
        if k_rows.shape != expected_k or v_rows.shape != expected_v:
            raise ValueError(f"k_new {k_rows.shape} and v_new {v_rows.shape} must have shapes "
                             f"{expected_k} and {expected_v} to match the caches")
        for name, new in (("k_new", k_rows), ("v_new", v_rows)):
            check_new_rows_dtype(name, new, k_cache.dtype, "caches")
        if not (k_cache.flags.writeable and v_cache.flags.writeable
                and lengths.flags.writeable):
            raise ValueError("k_cache, v_cache and cache_lengths must be writable to append")
        if written_scales:
            if not all(scale.flags.writeable for _, scale in written_scales):
                raise ValueError(f"{' and '.join(name for name, _ in written_scales)} must "
                                 "be writable to append (a scale per row is written with "
                                 "each row)")
            if int8_cache:
                check_scales_hold(k_scale, v_scale)  # type: ignore[arg-type]
        if n_new > 0:
            refuse_shared_memory(
                [("k_cache", k_cache), ("v_cache", v_cache), ("cache_lengths", lengths)]
                + written_scales,
                [("q", q), ("k_new", k_rows), ("v_new", v_rows)])
            if entry_of is not None:
                _refuse_shared_entries(entry_of)
    # in Python ints: in the array's own dtype the sum could wrap around
    if lengths.size and int(lengths.max()) + n_new > max_keys:
        raise ValueError(
            f"cache overflow: cache_lengths {lengths.tolist()} + {n_new} new "
            f"positions must stay within S_max = {max_keys}")
    start = lengths.astype(np.intp)
    if isinstance(out, np.ndarray):
        # out= must not be the cache, the lengths or q (named so here; the
        # call checks it against what it reads)
        refuse_shared_memory([("out", out)], [("q", q), ("k_cache", k_cache),
                                              ("v_cache", v_cache), ("cache_lengths", lengths),
                                              ("k_scale", k_scale), ("v_scale", v_scale)])
    q_tables = None
    if rotary is not None:
        # q's rows are the last T positions after the append (bottom-right,
        # as the causal mask aligns them), the new keys the n_new from start
        rows = np.arange(n_batch, dtype=np.intp)[:, None]
        q_at = start[:, None] + (n_new - n_queries) + np.arange(n_queries, dtype=np.intp)
        q, q_tables = rotate_queries(q, rotary, q_at, np.broadcast_to(rows, q_at.shape))
        if given is not None and n_new > 0:
            k_at = start[:, None] + np.arange(n_new, dtype=np.intp)
            k_rows = rotary.rotate(k_rows, k_at, np.broadcast_to(rows, k_at.shape), "k_new")
    writes = []
    if given is not None and n_new > 0:
        sequences = np.arange(n_batch, dtype=np.intp)
        entries = entry_of if entry_of is not None else sequences
        # (entry, head, position) of each new row
        at = (entries[:, None, None], np.arange(n_kv_heads)[None, :, None],
              start[:, None, None] + np.arange(n_new)[None, None, :])
        writes = (as_stored("k_new (rotated)" if rotary is not None else "k_new", k_rows,
                            k_cache, k_scale, sequences, at)
                  + as_stored("v_new", v_rows, v_cache, v_scale, sequences, at))

    # with cache_batch_idx, sequence b's rows go to cache entry entry_of[b]:
    # the caches as pages of S_max rows, one page per sequence
    appends = Appends(lengths, start, np.full(n_batch, n_new, dtype=np.intp), writes,
                      entry_of, 1 if entry_of is not None else 0)
    causal = driver.check_flag(causal, "causal")
    return_lse = driver.check_flag(return_lse, "return_lse")
    if entry_of is not None:
        if fp8_cache:
            # the scales as the entries read them: of the cache's first
            # three axes (1 where none is given)
            k_scale, v_scale = (fp8_read_scale(k_scale, k_cache),
                                fp8_read_scale(v_scale, v_cache))
        call = _entries_over_cache(
            q, k_cache, v_cache, k_scale, v_scale, entry_of, start + n_new, compute,
            causal=causal, scale=scale, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
            num_threads=num_threads, kv_starts=kv_starts, out=out, precision=precision)
        call.options.rotary = q_tables
        return call, appends, result_dtype(q.dtype, k_cache.dtype)
    # the attention over the cache as it will be after the append
    dense_call = prepare_dense(
        q, k_cache, v_cache, causal=causal, mask=None, scale=scale, want_out=True,
        want_scores=False, want_lse=return_lse, enable_gqa=True, num_threads=num_threads,
        kv_lengths=start + n_new, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        kv_starts=_per_sequence(kv_starts, n_batch), out=out, precision=precision)
    dense_call.options.rotary = q_tables
    return dense_call, appends, dense_call.result


def _per_sequence(kv_starts: Optional[ArrayLike], n_batch: int) -> Optional[ArrayLike]:
    """kv_starts of a cache: one per sequence (B,), as cache_lengths."""
    if kv_starts is None:
        return None
    starts = np.asarray(kv_starts)
    if starts.ndim > 1 or (starts.ndim == 1 and starts.shape[0] != n_batch):
        raise ValueError(f"kv_starts must hold one start per sequence, shape ({n_batch},); "
                         f"got shape {starts.shape}")
    return starts


def _cache_entries(cache_batch_idx: Optional[ArrayLike], n_entries: int,
                   cache_shape: tuple[int, ...]) -> Optional[NDArray[np.intp]]:
    """The cache entry of each batch row: integers (B,) in [0, n_entries),
    as a copy (the lengths the call advances may be a view of them)."""
    if cache_batch_idx is None:
        return None
    given = array(cache_batch_idx, "cache_batch_idx")
    if given.dtype.kind not in "iu":
        raise TypeError(f"cache_batch_idx must be integers, one cache entry per batch row; "
                        f"got dtype {given.dtype}")
    if given.ndim != 1:
        raise ValueError(f"cache_batch_idx must be 1-D, one cache entry per batch row (B,); "
                         f"got shape {given.shape}")
    # in Python ints: a uint64 beyond intp would wrap around
    if given.size and (int(given.min()) < 0 or int(given.max()) >= n_entries):
        row = int(np.argmin(given)) if int(given.min()) < 0 else int(np.argmax(given))
        raise ValueError(
            f"cache_batch_idx[{row}] = {int(given[row])} is not a cache entry: k_cache "
            f"{cache_shape} has {n_entries}, [0, {n_entries})")
    return np.array(given, dtype=np.intp)


def _refuse_shared_entries(entry_of: NDArray[np.intp]) -> None:
    """No two batch rows that append use one cache entry: both would write
    its next positions."""
    order = np.argsort(entry_of, kind="stable")
    same = np.flatnonzero(entry_of[order][1:] == entry_of[order][:-1])
    if same.size:
        first, second = int(order[same[0]]), int(order[same[0] + 1])
        raise ValueError(
            f"cache_batch_idx gives cache entry {int(entry_of[first])} to batch rows {first} "
            f"and {second}, and the call appends to it: each batch row that appends needs "
            "an entry of its own")


def _entries_over_cache(q: _Array, k_cache: _Array, v_cache: _Array,
                        k_scale: Optional[_Array], v_scale: Optional[_Array],
                        entry_of: NDArray[np.intp], new_lengths: NDArray[np.intp],
                        compute: np.dtype[Any], *, causal: bool, scale: Optional[float],
                        window: Any, softcap: Optional[float],
                        alibi_slopes: Optional[ArrayLike], sinks: Optional[ArrayLike],
                        return_lse: bool, num_threads: Optional[SupportsIndex],
                        kv_starts: Optional[ArrayLike], out: Optional[_Array],
                        precision: object) -> EntriesCall:
    """The attention of batch row b over cache entry entry_of[b], read where
    it lies: the places of K and V (and their scales) start at each row's
    entry."""
    n_batch, n_heads = q.shape[:2]
    n_kv_heads, max_keys, d_k = k_cache.shape[1:]
    d_v = v_cache.shape[3]
    options = row_options(causal=causal, scale=scale, d_k=d_k, compute=compute,
                          result=result_dtype(q.dtype, k_cache.dtype), window=window,
                          softcap=softcap, precision=precision, num_threads=num_threads)
    head_options(options, alibi_slopes, sinks, n_batch, n_heads, compute)
    if out is not None:
        out = check_out(out, q.shape[:-1] + (d_v,), result_dtype(q.dtype, k_cache.dtype),
                        [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                         ("k_scale", k_scale), ("v_scale", v_scale)])
    starts = None
    if kv_starts is not None:
        # one start per batch row, as cache_lengths (a scalar is every row's)
        given = np.asarray(kv_starts)
        starts = check_sequence_starts(
            np.broadcast_to(given, (n_batch,)) if given.ndim == 0 else given, n_batch,
            max_keys, f"S_max of k_cache {k_cache.shape}")
    attn, lse = outputs(q, None, n_batch, n_heads, d_v, compute, return_lse, out)
    scales = [place(s[..., None], entry_of, 2, 1) if s is not None else None
              for s in (k_scale, v_scale)]
    return EntriesCall(
        queries(q, None, compute), place(k_cache, entry_of, 2, 1),
        place(v_cache, entry_of, 2, 1), attn, lse, scales[0], scales[1],
        np.full(n_batch, q.shape[2], dtype=np.intp), np.ascontiguousarray(new_lengths),
        n_heads, n_kv_heads, d_k, d_v, options, kv_starts=starts, out_given=out)
