"""Decoding against a preallocated key/value cache owned by the caller."""

from __future__ import annotations

from typing import Any, Literal, SupportsIndex, cast, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attention
from ._api import attention
from ._call import check_options
from ._checks import (_array, _as_input, _check_flag, _readable_in_place,
                      _refuse_shared_memory)
from ._quantize import SCALE_RANGE, cache_rows, scales_in_range
from ._threads import _local

__all__ = ["attention_with_kvcache"]


@overload
def attention_with_kvcache(
    q: ArrayLike, k_cache: NDArray[np.floating[Any]], v_cache: NDArray[np.floating[Any]],
    cache_lengths: NDArray[np.integer[Any]], k_new: ArrayLike | None = None,
    v_new: ArrayLike | None = None, *, causal: bool = True, scale: float | None = None,
    enable_gqa: bool | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None,
    return_lse: Literal[False] = False, num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]]: ...


@overload
def attention_with_kvcache(
    q: ArrayLike, k_cache: NDArray[np.floating[Any]], v_cache: NDArray[np.floating[Any]],
    cache_lengths: NDArray[np.integer[Any]], k_new: ArrayLike | None = None,
    v_new: ArrayLike | None = None, *, causal: bool = True, scale: float | None = None,
    enable_gqa: bool | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None,
    return_lse: Literal[True], num_threads: SupportsIndex | None = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]: ...


@overload
def attention_with_kvcache(
    q: ArrayLike, k_cache: NDArray[np.floating[Any]], v_cache: NDArray[np.floating[Any]],
    cache_lengths: NDArray[np.integer[Any]], k_new: ArrayLike | None = None,
    v_new: ArrayLike | None = None, *, causal: bool = True, scale: float | None = None,
    enable_gqa: bool | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None,
    return_lse: bool = False, num_threads: SupportsIndex | None = None,
) -> (NDArray[np.floating[Any]]
      | tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]): ...


def attention_with_kvcache(
    q: ArrayLike, k_cache: NDArray[np.floating[Any]], v_cache: NDArray[np.floating[Any]],
    cache_lengths: NDArray[np.integer[Any]], k_new: ArrayLike | None = None,
    v_new: ArrayLike | None = None, *, causal: bool = True, scale: float | None = None,
    enable_gqa: bool | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None,
    return_lse: bool = False, num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]:
    """Append new keys and values to a KV cache in place, then attend to it.

    For each sequence b, ``k_new[b]`` and ``v_new[b]`` are written into the
    caches at positions ``cache_lengths[b]`` onwards, ``cache_lengths`` is
    advanced by ``T_new`` **in place**, and ``q[b]`` attends to the first
    ``cache_lengths[b]`` keys (after the update) with bottom-right causal
    alignment: the T queries are the last T of those positions. The caches
    are never reallocated or copied.

    Parameters
    ----------
    q : ndarray, shape (B, H, T, d_k)
        Queries; H may be a multiple of H_kv (grouped-query attention).
    k_cache : ndarray, shape (B, H_kv, S_max, d_k)
    v_cache : ndarray, shape (B, H_kv, S_max, d_v)
        Writable arrays of one dtype, owned by the caller: float32, float64,
        or float16 or int8 with a float32 (or float16) q, in which case the
        cache is converted block by block as it is read (a half or a quarter
        of the bytes per decode step) and the result is float32 (float16
        for a float16 q).
    cache_lengths : ndarray of int, shape (B,)
        Filled positions of each sequence; a writable integer array, updated
        in place. Its dtype must hold S_max (``int32`` or ``int64`` always
        do; ``uint8`` holds at most 255, ``int16`` 32767) so that advancing
        it cannot wrap around.
    k_new : array_like, shape (B, H_kv, T_new, d_k), optional
    v_new : array_like, shape (B, H_kv, T_new, d_v), optional
        Keys and values to append (both or neither), cast to the cache dtype.
    causal : bool, default True
    scale, window, softcap, alibi_slopes, sinks, return_lse, num_threads
        As in :func:`cattention.attention` (a sliding window, Mistral's, a
        softcap, Gemma 2's, and attention sinks, gpt-oss's, apply in
        decoding too); the window and ALiBi distances count from the last
        filled position.
    k_scale, v_scale : ndarray of float32, shape (B, H_kv, S_max), optional
        With int8 caches (and only then): the scale of each cached row,
        read in place and written as rows are appended; ``k_new`` and
        ``v_new`` are then float and quantized on append
        (:func:`cattention.quantize_kv`). Finite, >= 0 and at most float32's
        largest value / 127 (2.68e36) everywhere (zeros where no row is
        cached yet).
    enable_gqa : bool, optional
        None (the default) infers grouped-query attention from the head
        counts (H a multiple of H_kv); True requires it; False requires
        H == H_kv.

    Returns
    -------
    attn : ndarray, shape (B, H, T, d_v)
    lse : ndarray, shape (B, H, T)
        Only with ``return_lse=True``; the result is then ``(attn, lse)``.

    Raises
    ------
    ValueError
        On any shape mismatch (including caches that are not 4-D ndarrays
        and ``cache_lengths`` that is not an integer ndarray of shape (B,)),
        if only one of ``k_new`` and ``v_new`` is given, if an array to be
        updated (the caches, cache_lengths, the scales) is read-only or
        shares memory with another of them, q, k_new or v_new, if a cache
        is not aligned to its itemsize (it would be copied), if a length
        is negative, if some
        ``cache_lengths[b] + T_new`` exceeds S_max, ``enable_gqa=False``
        with H != H_kv, if ``k_new`` or ``v_new`` holds a value the cache
        cannot store (beyond a float cache's range, or NaN or infinite for
        an int8 one), or an option out of range (as in
        :func:`cattention.attention`).
    TypeError
        If the caches are not float16, float32, float64 or int8, differ in dtype
        or are not in native byte order (reading them would copy them), if
        q is wider than the cache (it would be converted whole), if
        ``k_new`` or ``v_new`` cannot be cast to the cache dtype, or if the
        dtype of ``cache_lengths`` cannot hold S_max.

    Every check runs before anything is written, so a call refused for its
    arguments leaves caches and lengths as they were. If the computation
    itself fails after the append (a ``MemoryError``), ``cache_lengths``
    are put back; the slots past them, free again, may hold the new rows.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> k_cache = np.zeros((1, 2, 16, 8), np.float32)
    >>> v_cache = np.zeros((1, 2, 16, 8), np.float32)
    >>> lengths = np.array([0])
    >>> step = np.ones((1, 2, 3, 8), np.float32)
    >>> out = ca.attention_with_kvcache(step, k_cache, v_cache, lengths, step, step)
    >>> out.shape, lengths
    ((1, 2, 3, 8), array([3]))
    """
    if (window is None and softcap is None and alibi_slopes is None and sinks is None
            and k_scale is None and v_scale is None and return_lse is False
            and (enable_gqa is None or enable_gqa is True)):
        # a serving step of float caches: checked, appended and computed in
        # one compiled call, or None for everything else (and every error)
        fast = _attention.kvcache_fast(q, k_cache, v_cache, cache_lengths, k_new, v_new,
                                       causal, scale, num_threads, _local.limit)
        if fast is not None:
            return fast
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, np.ndarray) or cache.ndim != 4:
            raise ValueError(f"{name} must be a 4-D ndarray (B, H_kv, S_max, d); got "
                             f"{getattr(cache, 'shape', type(cache).__name__)}")
        if cache.dtype != np.int8 and (cache.dtype.kind != "f"
                                       or cache.dtype.itemsize not in (2, 4, 8)):
            raise TypeError(f"{name} has dtype {cache.dtype}; KV caches must be float16, "
                            "float32, float64 or int8 (with scales)")
        if not cache.dtype.isnative:
            raise TypeError(
                f"{name} has non-native byte order ({cache.dtype.str}): reading it would "
                "copy the whole cache on every call; convert it once, e.g. "
                f"{name} = {name}.astype({name}.dtype.newbyteorder('='))")
        if not _readable_in_place(cache):
            raise ValueError(f"{name} must be aligned with strides that are multiples of "
                             "its itemsize (reading it otherwise would copy the whole cache "
                             "on every call)")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must "
                        "share one dtype")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must share "
                         "(B, H_kv, S_max)")
    n_batch, n_kv_heads, max_keys, d_k = k_cache.shape
    d_v = v_cache.shape[3]
    q = _as_input(q, "q")
    if q.ndim != 4 or q.shape[0] != n_batch or q.shape[3] != d_k:
        raise ValueError(f"q must have shape (B, H, T, d_k) = ({n_batch}, H, T, {d_k}) "
                         f"to match k_cache {k_cache.shape}; got {q.shape}")
    # float16 caches are read as they are (converted block by block, computed
    # in float32) with a float16 or float32 q; otherwise q must not be wider
    # than the cache, or the cache would be converted whole
    half_cache = k_cache.dtype == np.float16 and q.dtype in (np.float16, np.float32)
    int8_cache = k_cache.dtype == np.int8
    if int8_cache:
        _check_scale_caches(k_cache, v_cache, k_scale, v_scale, q.dtype,
                            appending=k_new is not None)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with int8 caches; these are {k_cache.dtype}")
    if (not half_cache and not int8_cache
            and np.result_type(q.dtype, k_cache.dtype) != k_cache.dtype):
        raise TypeError(f"q of dtype {q.dtype} with a {k_cache.dtype} cache would "
                        "convert (copy) the cache; pass q in the cache's dtype")
    n_heads = q.shape[1]
    if enable_gqa is not None:
        enable_gqa = _check_flag(enable_gqa, "enable_gqa")
    if enable_gqa is False and n_heads != n_kv_heads:
        raise ValueError(f"enable_gqa=False needs as many query heads as key/value heads: "
                         f"q {q.shape} has {n_heads}, k_cache {k_cache.shape} has "
                         f"{n_kv_heads}; pass enable_gqa=True (or None) for grouped-query "
                         "attention")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"the query heads of q {q.shape} must be a multiple of the "
                         f"key/value heads of k_cache {k_cache.shape}")
    _check_cache_lengths(cache_lengths, n_batch, max_keys)

    n_new = 0
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is not None:
        k_new = _array(k_new, "k_new")
        v_new = _array(v_new, "v_new")
        for name, new, d in (("k_new", k_new, d_k), ("v_new", v_new, d_v)):
            if new.ndim != 4:
                raise ValueError(
                    f"{name} must be 4-D (B, H_kv, T_new, d) = ({n_batch}, {n_kv_heads}, "
                    f"T_new, {d}); got shape {new.shape}")
        n_new = k_new.shape[2]
        expected_k = (n_batch, n_kv_heads, n_new, d_k)
        expected_v = (n_batch, n_kv_heads, n_new, d_v)
        if k_new.shape != expected_k or v_new.shape != expected_v:
            raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} must have shapes "
                             f"{expected_k} and {expected_v} to match the caches")
        for name, new in (("k_new", k_new), ("v_new", v_new)):
            if int8_cache:
                if new.dtype.kind not in "fiu" or new.dtype == np.int8:
                    raise TypeError(f"{name} of dtype {new.dtype} for an int8 cache: pass "
                                    "float values, which are quantized as they are appended")
                continue
            if not np.can_cast(new.dtype, k_cache.dtype, casting="same_kind"):
                raise TypeError(f"{name} of dtype {new.dtype} cannot be written into a "
                                f"{k_cache.dtype} cache")
        if not (k_cache.flags.writeable and v_cache.flags.writeable
                and cache_lengths.flags.writeable):
            raise ValueError("k_cache, v_cache and cache_lengths must be writable to append")
        if int8_cache and not (cast("NDArray[Any]", k_scale).flags.writeable
                               and cast("NDArray[Any]", v_scale).flags.writeable):
            raise ValueError("k_scale and v_scale must be writable to append")
        if n_new > 0:
            _refuse_shared_memory(
                [("k_cache", k_cache), ("v_cache", v_cache), ("cache_lengths", cache_lengths)]
                + ([("k_scale", k_scale), ("v_scale", v_scale)] if int8_cache else []),
                [("q", q), ("k_new", k_new), ("v_new", v_new)])
    # in Python ints: in the array's own dtype the sum could wrap around
    if cache_lengths.size and int(cache_lengths.max()) + n_new > max_keys:
        raise ValueError(
            f"cache overflow: cache_lengths {cache_lengths.tolist()} + {n_new} new "
            f"positions must stay within S_max = {max_keys}")
    # the attention options are checked before anything is written, too
    causal = _check_flag(causal, "causal")
    return_lse = _check_flag(return_lse, "return_lse")
    check_options(q, k_cache, v_cache, causal=causal, scale=scale, window=window,
                  softcap=softcap, alibi_slopes=alibi_slopes, num_threads=num_threads,
                  sinks=sinks)

    if n_new > 0:
        # n_new > 0 only when both were given and made arrays above; int8
        # caches take them quantized: int8 rows and their scales
        k_add, k_row_scale = cache_rows(cast("NDArray[Any]", k_new), k_cache.dtype, "k_new")
        v_add, v_row_scale = cache_rows(cast("NDArray[Any]", v_new), v_cache.dtype, "v_new")
    # every check has passed: nothing below can fail half-way on bad input
    if n_new > 0:
        for b, start in enumerate(cache_lengths.tolist()):
            k_cache[b, :, start:start + n_new] = k_add[b]
            v_cache[b, :, start:start + n_new] = v_add[b]
            if k_row_scale is not None and v_row_scale is not None:
                cast("NDArray[Any]", k_scale)[b, :, start:start + n_new] = k_row_scale[b]
                cast("NDArray[Any]", v_scale)[b, :, start:start + n_new] = v_row_scale[b]
        old_lengths = cache_lengths.copy()
        cache_lengths += n_new
    try:
        return attention(q, k_cache, v_cache, causal=causal, scale=scale, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                         k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                         enable_gqa=True, kv_lengths=cache_lengths, num_threads=num_threads)
    except BaseException:
        # the computation failed (its memory): the new rows are given back,
        # their slots free again past the lengths
        if n_new > 0:
            cache_lengths[...] = old_lengths
        raise


def _check_scale_caches(k_cache: NDArray[Any], v_cache: NDArray[Any], k_scale: object,
                        v_scale: object, q_dtype: np.dtype[Any], appending: bool) -> None:
    """int8 caches come with float32 scale caches of shape (B, H_kv, S_max),
    read and written in place."""
    if v_cache.dtype != np.int8:
        raise TypeError(f"k_cache is int8 but v_cache is {v_cache.dtype}: both or neither")
    if q_dtype not in (np.float32, np.float16):
        raise TypeError(f"int8 caches need a float32 (or float16) q, got {q_dtype}")
    for name, cache, scale in (("k_scale", k_cache, k_scale), ("v_scale", v_cache, v_scale)):
        if scale is None:
            raise ValueError(f"int8 caches need {name}: a float32 array of shape "
                             f"{cache.shape[:3]} (B, H_kv, S_max), written as keys are "
                             "appended")
        if (not isinstance(scale, np.ndarray) or scale.dtype != np.float32
                or not scale.dtype.isnative or scale.shape != cache.shape[:3]):
            got = (f"{scale.shape} {scale.dtype}" if isinstance(scale, np.ndarray)
                   else type(scale).__name__)
            raise ValueError(f"{name} must be a native float32 ndarray of shape "
                             f"{cache.shape[:3]} (B, H_kv, S_max); got {got}")
        if not _readable_in_place(scale):
            raise ValueError(f"{name} must be aligned with strides that are multiples of 4 "
                             "(reading it otherwise would copy it on every call)")
        # attention() refuses them too, but only after the append
        if appending and not scales_in_range(scale):
            raise ValueError(f"{name} must be {SCALE_RANGE} everywhere (zeros where no "
                             "row is cached yet)")


def _check_cache_lengths(cache_lengths: object, n_batch: int, max_keys: int) -> None:
    if (not isinstance(cache_lengths, np.ndarray) or cache_lengths.dtype.kind not in "iu"
            or cache_lengths.shape != (n_batch,)):
        given = getattr(cache_lengths, "shape", type(cache_lengths).__name__)
        if isinstance(cache_lengths, np.ndarray):
            given = f"{given} {cache_lengths.dtype}"
        raise ValueError(f"cache_lengths must be an integer ndarray of shape ({n_batch},); "
                         f"got {given}")
    if np.iinfo(cache_lengths.dtype).max < max_keys:
        holding = [name for name in ("int16", "uint16", "int32", "uint32", "int64", "uint64")
                   if np.iinfo(name).max >= max_keys]
        raise TypeError(
            f"cache_lengths of dtype {cache_lengths.dtype} cannot hold S_max = {max_keys} "
            f"(at most {np.iinfo(cache_lengths.dtype).max}), so advancing it could wrap "
            f"around; use one of {', '.join(holding)}")
    if cache_lengths.size and cache_lengths.min() < 0:
        raise ValueError(f"cache_lengths must be >= 0; got {cache_lengths.tolist()}")
