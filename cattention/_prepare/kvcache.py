"""A decoding step against a contiguous KV cache, checked once: the cache's
own checks (caches.py), then the attention over the cache as a dense call
(dense.py), all before anything is written."""

from __future__ import annotations

from typing import Any, Optional, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .arrays import as_input, is_half, refuse_shared_memory
from .caches import (Appends, as_stored, check_cache_lengths, check_int8_scales,
                     check_new_rows_dtype, check_scales_hold, check_storage, new_rows)
from .dense import DenseCall, prepare_dense

_Array = NDArray[Any]


def prepare_kvcache(q: ArrayLike, k_cache: object, v_cache: object, cache_lengths: object,
                    k_new: Optional[ArrayLike], v_new: Optional[ArrayLike], *, causal: bool,
                    scale: Optional[float], enable_gqa: Optional[bool], window: Any,
                    softcap: Optional[float], alibi_slopes: Optional[ArrayLike],
                    sinks: Optional[ArrayLike], k_scale: Optional[_Array],
                    v_scale: Optional[_Array], return_lse: bool,
                    num_threads: Optional[SupportsIndex], kv_starts: Optional[ArrayLike] = None,
                    out: Optional[_Array] = None) -> tuple[DenseCall, Appends]:
    """The dense call over the cache after the append, and the append."""
    k_cache, v_cache = check_storage(k_cache, v_cache, ("k_cache", "v_cache"),
                                     "(B, H_kv, S_max, d)", "(B, H_kv, S_max)", "KV caches")
    n_batch, n_kv_heads, max_keys, d_k = k_cache.shape
    d_v = v_cache.shape[3]
    q = as_input(q, "q")
    if q.ndim != 4 or q.shape[0] != n_batch or q.shape[3] != d_k:
        raise ValueError(f"q must have shape (B, H, T, d_k) = ({n_batch}, H, T, {d_k}) "
                         f"to match k_cache {k_cache.shape}; got {q.shape}")
    # float16 and bfloat16 caches are read as they are (converted block by
    # block, computed in float32) with a 16-bit or float32 q; otherwise q must
    # not be wider than the cache, or the cache would be converted whole
    half_cache = is_half(k_cache.dtype) and (is_half(q.dtype) or q.dtype == np.float32)
    int8_cache = k_cache.dtype == np.int8
    if int8_cache:
        check_int8_scales(k_cache, k_scale, v_scale, q.dtype, "caches", "(B, H_kv, S_max)")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with int8 caches; these are {k_cache.dtype}")
    if (not half_cache and not int8_cache
            and np.result_type(q.dtype, k_cache.dtype) != k_cache.dtype):
        raise TypeError(f"q of dtype {q.dtype} with a {k_cache.dtype} cache would "
                        "convert (copy) the cache; pass q in the cache's dtype")
    n_heads = q.shape[1]
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
        if int8_cache:
            assert isinstance(k_scale, np.ndarray) and isinstance(v_scale, np.ndarray)
            if not (k_scale.flags.writeable and v_scale.flags.writeable):
                raise ValueError("k_scale and v_scale must be writable to append")
            check_scales_hold(k_scale, v_scale)
        if n_new > 0:
            refuse_shared_memory(
                [("k_cache", k_cache), ("v_cache", v_cache), ("cache_lengths", lengths)]
                + ([("k_scale", k_scale), ("v_scale", v_scale)] if int8_cache else []),
                [("q", q), ("k_new", k_rows), ("v_new", v_rows)])
    # in Python ints: in the array's own dtype the sum could wrap around
    if lengths.size and int(lengths.max()) + n_new > max_keys:
        raise ValueError(
            f"cache overflow: cache_lengths {lengths.tolist()} + {n_new} new "
            f"positions must stay within S_max = {max_keys}")
    start = lengths.astype(np.intp)
    writes = []
    if given is not None and n_new > 0:
        sequences = np.arange(n_batch, dtype=np.intp)
        writes = (as_stored("k_new", k_rows, k_cache, k_scale, sequences)
                  + as_stored("v_new", v_rows, v_cache, v_scale, sequences))
    appends = Appends(lengths, start, np.full(n_batch, n_new, dtype=np.intp), writes)
    if isinstance(out, np.ndarray):
        # out= must not be the cache or the lengths (named so here; prepare_dense
        # checks it against what it reads)
        refuse_shared_memory([("out", out)], [("k_cache", k_cache), ("v_cache", v_cache),
                                              ("cache_lengths", lengths), ("k_scale", k_scale),
                                              ("v_scale", v_scale)])
    # the attention over the cache as it will be after the append
    causal = driver.check_flag(causal, "causal")
    return_lse = driver.check_flag(return_lse, "return_lse")
    call = prepare_dense(q, k_cache, v_cache, causal=causal, mask=None, scale=scale,
                         want_out=True, want_scores=False, want_lse=return_lse, enable_gqa=True,
                         num_threads=num_threads, kv_lengths=start + n_new, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                         k_scale=k_scale, v_scale=v_scale,
                         kv_starts=_per_sequence(kv_starts, n_batch), out=out)
    return call, appends


def _per_sequence(kv_starts: Optional[ArrayLike], n_batch: int) -> Optional[ArrayLike]:
    """kv_starts of a cache: one per sequence (B,), as cache_lengths."""
    if kv_starts is None:
        return None
    starts = np.asarray(kv_starts)
    if starts.ndim > 1 or (starts.ndim == 1 and starts.shape[0] != n_batch):
        raise ValueError(f"kv_starts must hold one start per sequence, shape ({n_batch},); "
                         f"got shape {starts.shape}")
    return starts
