"""Public: decoding against a preallocated key/value cache owned by the caller."""

from __future__ import annotations

from typing import Any, Literal, Optional, SupportsIndex, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .._prepare import dense
from .._prepare.kvcache import prepare_kvcache
from .._prepare.options import local

__all__ = ["attention_with_kvcache"]


@overload
def attention_with_kvcache(
    q: ArrayLike, k_cache: NDArray[np.floating[Any]], v_cache: NDArray[np.floating[Any]],
    cache_lengths: NDArray[np.integer[Any]], k_new: Optional[ArrayLike] = None,
    v_new: Optional[ArrayLike] = None, *, causal: bool = True, scale: Optional[float] = None,
    enable_gqa: Optional[bool] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[NDArray[np.float32]] = None,
    v_scale: Optional[NDArray[np.float32]] = None,
    kv_starts: Optional[ArrayLike] = None, out: Optional[NDArray[Any]] = None,
    return_lse: Literal[False] = False, num_threads: Optional[SupportsIndex] = None,
) -> NDArray[np.floating[Any]]: ...


@overload
def attention_with_kvcache(
    q: ArrayLike, k_cache: NDArray[np.floating[Any]], v_cache: NDArray[np.floating[Any]],
    cache_lengths: NDArray[np.integer[Any]], k_new: Optional[ArrayLike] = None,
    v_new: Optional[ArrayLike] = None, *, causal: bool = True, scale: Optional[float] = None,
    enable_gqa: Optional[bool] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[NDArray[np.float32]] = None,
    v_scale: Optional[NDArray[np.float32]] = None,
    kv_starts: Optional[ArrayLike] = None, out: Optional[NDArray[Any]] = None,
    return_lse: Literal[True], num_threads: Optional[SupportsIndex] = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]: ...


@overload
def attention_with_kvcache(
    q: ArrayLike, k_cache: NDArray[np.floating[Any]], v_cache: NDArray[np.floating[Any]],
    cache_lengths: NDArray[np.integer[Any]], k_new: Optional[ArrayLike] = None,
    v_new: Optional[ArrayLike] = None, *, causal: bool = True, scale: Optional[float] = None,
    enable_gqa: Optional[bool] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[NDArray[np.float32]] = None,
    v_scale: Optional[NDArray[np.float32]] = None,
    kv_starts: Optional[ArrayLike] = None, out: Optional[NDArray[Any]] = None,
    return_lse: bool = False, num_threads: Optional[SupportsIndex] = None,
) -> (NDArray[np.floating[Any]]
      | tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]): ...


def attention_with_kvcache(
    q: ArrayLike, k_cache: NDArray[np.floating[Any]], v_cache: NDArray[np.floating[Any]],
    cache_lengths: NDArray[np.integer[Any]], k_new: Optional[ArrayLike] = None,
    v_new: Optional[ArrayLike] = None, *, causal: bool = True, scale: Optional[float] = None,
    enable_gqa: Optional[bool] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[NDArray[np.float32]] = None,
    v_scale: Optional[NDArray[np.float32]] = None,
    kv_starts: Optional[ArrayLike] = None, out: Optional[NDArray[Any]] = None,
    return_lse: bool = False, num_threads: Optional[SupportsIndex] = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]:
    """Append new keys and values to a KV cache in place, then attend to it.

    For each sequence b, ``k_new[b]`` and ``v_new[b]`` are written into the
    caches at positions ``cache_lengths[b]`` onwards, ``cache_lengths`` is
    advanced by ``T_new`` **in place**, and ``q[b]`` attends to the first
    ``cache_lengths[b]`` keys (after the update) with bottom-right causal
    alignment: the T queries are the last T of those positions. The caches
    are never reallocated or copied. The rules shared with every call
    (dtypes, zero rows, masks and options per logit) are in
    :ref:`conventions`.

    Parameters
    ----------
    q : ndarray, shape (B, H, T, d_k)
        Queries; H may be a multiple of H_kv (grouped-query attention).
    k_cache, v_cache : ndarray, shapes (B, H_kv, S_max, d_k) and (B, H_kv, S_max, d_v)
        The caches: writable arrays of one dtype, owned by the caller:
        float32, float64, or float16 (bfloat16) or int8 with a float32 (or
        float16) q, in which case the cache is converted block by block as
        it is read (a half or a quarter of the bytes per decode step) and
        the result is float32 (float16 for a float16 q).
    cache_lengths : ndarray of int, shape (B,)
        Filled positions of each sequence; a writable integer array, updated
        in place. Its dtype must hold S_max (``int32`` or ``int64`` always
        do; ``uint8`` holds at most 255, ``int16`` 32767) so that advancing
        it cannot wrap around.
    k_new, v_new : array_like, shapes (B, H_kv, T_new, d_k) and (B, H_kv, T_new, d_v), optional
        Keys and values to append (both or neither), cast to the cache dtype.
    causal : bool, default True
        Bottom-right causal alignment: the T queries are the last T of the
        sequence's positions. False lets every query see every valid key.
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
    kv_starts : array_like of int, shape (B,), optional
        The first valid position of each sequence (left padding,
        FlashAttention's ``cache_leftpad``): sequence b attends to positions
        ``kv_starts[b] <= j < cache_lengths[b]`` (after the update), aligned
        against the end, as :func:`cattention.attention`'s ``kv_starts``.
    out : ndarray, shape (B, H, T, d_v), optional
        Where to write ATTN, as :func:`cattention.attention`'s ``out``
        (any strides; not the caches, the lengths or the scales).

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
    fast = driver.kvcache_shortcut(q, k_cache, v_cache, cache_lengths, k_new, v_new, causal,
                                   scale, enable_gqa, window, softcap, alibi_slopes, sinks,
                                   k_scale, v_scale, kv_starts, out, return_lse, num_threads,
                                   local.limit)
    if fast is not None:
        return fast  # type: ignore[no-any-return]
    call, appends = prepare_kvcache(
        q, k_cache, v_cache, cache_lengths, k_new, v_new, causal=causal, scale=scale,
        enable_gqa=enable_gqa, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
        num_threads=num_threads, kv_starts=kv_starts, out=out)
    # every check has passed: nothing below can fail half-way on bad input
    with appends.written():
        attn, _, lse = dense.run(call)
    if call.want_lse:
        return attn, lse  # type: ignore[return-value]
    return attn  # type: ignore[return-value]
