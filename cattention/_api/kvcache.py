"""Public: decoding against a preallocated key/value cache owned by the caller."""

from __future__ import annotations

from typing import Any, Literal, Optional, SupportsIndex, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .._prepare import dense, entries
from .._prepare.kvcache import prepare_kvcache
from .._prepare.options import Precision, local

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
    rotary_cos: Optional[ArrayLike] = None, rotary_sin: Optional[ArrayLike] = None,
    rotary_interleaved: bool = False, cache_batch_idx: Optional[ArrayLike] = None,
    return_lse: Literal[False] = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
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
    rotary_cos: Optional[ArrayLike] = None, rotary_sin: Optional[ArrayLike] = None,
    rotary_interleaved: bool = False, cache_batch_idx: Optional[ArrayLike] = None,
    return_lse: Literal[True],
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
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
    rotary_cos: Optional[ArrayLike] = None, rotary_sin: Optional[ArrayLike] = None,
    rotary_interleaved: bool = False, cache_batch_idx: Optional[ArrayLike] = None,
    return_lse: bool = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
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
    rotary_cos: Optional[ArrayLike] = None, rotary_sin: Optional[ArrayLike] = None,
    rotary_interleaved: bool = False, cache_batch_idx: Optional[ArrayLike] = None,
    return_lse: bool = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]:
    """Append new keys and values to a KV cache in place, then attend to it.

    For each sequence b, ``k_new[b]`` and ``v_new[b]`` are written into the
    caches at positions ``cache_lengths[b]`` onwards, ``cache_lengths`` is
    advanced by ``T_new`` **in place**, and ``q[b]`` attends to the first
    ``cache_lengths[b]`` keys (after the update) with bottom-right causal
    alignment: the T queries are the last T of those positions. The caches
    are never reallocated or copied. With rotary tables, q and the new keys
    are rotated at their positions as they are read and appended; with
    ``cache_batch_idx``, batch row b works on the cache entry it names. The
    rules shared with every call (dtypes, zero rows, masks and options per
    logit) are in :ref:`conventions`.

    Parameters
    ----------
    q : ndarray, shape (B, H, T, d_k)
        Queries; H may be a multiple of H_kv (grouped-query attention).
    k_cache, v_cache : ndarray, shapes (B, H_kv, S_max, d_k) and (B, H_kv, S_max, d_v)
        The caches (B_cache entries instead of B with ``cache_batch_idx``):
        writable arrays of one dtype, owned by the caller: float32, float64,
        or float16 (bfloat16) or int8 with a float32 (or float16) q, in
        which case the cache is converted block by block as it is read (a
        half or a quarter of the bytes per decode step) and the result is
        float32 (float16 for a float16 q).
    cache_lengths : ndarray of int, shape (B,)
        Filled positions of each sequence (of the cache entry of each batch
        row, with ``cache_batch_idx``); a writable integer array, updated
        in place. Its dtype must hold S_max (``int32`` or ``int64`` always
        do; ``uint8`` holds at most 255, ``int16`` 32767) so that advancing
        it cannot wrap around.
    k_new, v_new : array_like, shapes (B, H_kv, T_new, d_k) and (B, H_kv, T_new, d_v), optional
        Keys and values to append (both or neither), cast to the cache dtype.
    causal : bool, default True
        Bottom-right causal alignment: the T queries are the last T of the
        sequence's positions. False lets every query see every valid key.
    scale, window, softcap, alibi_slopes, sinks, return_lse, precision, num_threads
        As in :func:`cattention.attention` (a sliding window, Mistral's, a
        softcap, Gemma 2's, and attention sinks, gpt-oss's, apply in
        decoding too); the window and ALiBi distances count from the last
        filled position.
    k_scale, v_scale : ndarray of float32, shape (B, H_kv, S_max), optional
        With int8 caches: the scale of each cached row, read in place and
        written as rows are appended; ``k_new`` and ``v_new`` are then float
        and quantized on append (:func:`cattention.quantize_kv`). Finite,
        >= 0 and at most float32's largest value / 127 (2.68e36) everywhere
        (zeros where no row is cached yet).
        With fp8 caches (``ml_dtypes.float8_e4m3fn``, ``float8_e5m2``):
        optional (none means 1), any float32 scales that broadcast to
        ``(B, H_kv, S_max)``. One per tensor or per (entry, head) is fixed:
        new rows are stored as ``value / scale`` in float32, rounded to
        nearest even and saturated to the format's largest value (NaN
        stays NaN), and must not meet a scale of 0. An array of exactly
        ``(B, H_kv, S_max)`` holds a scale per row, written as rows are
        appended (``max|row| / largest``, as
        :func:`cattention.quantize_kv_fp8` computes). Each at most float32's
        largest value / the format's largest, checked on every call.
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
        (any strides; not the caches, the lengths, the scales or q).
    rotary_cos, rotary_sin : array_like, shape (max_position, rotary_dim / 2), optional
        Rotary position embeddings (RoPE), both or neither, applied as q is
        read and the new keys are appended: the cache then holds rotated
        keys (the keys already in it were rotated when they came); values
        are not rotated; the caller's q is not modified. Sequence b's new
        keys sit at positions ``cache_lengths[b] + t`` (before the update)
        and its T queries at the last T positions after it,
        ``cache_lengths[b] + T_new - T + t`` (where the causal mask aligns
        them; ``cache_lengths[b] + t`` when T == T_new), whatever
        ``causal`` is. Positions count from row 0 of the cache, left
        padding (``kv_starts``) included, as FlashAttention counts them
        with ``cache_leftpad``. A row x at position p has its first
        ``rotary_dim`` features rotated in pairs, for i < rotary_dim / 2::

            x1 * cos[p, i] - x2 * sin[p, i],   x2 * cos[p, i] + x1 * sin[p, i]

        with ``(x1, x2) = (x[i], x[i + rotary_dim / 2])`` (GPT-NeoX's half
        split); the other features are kept. Computed in the compute dtype
        (float32; float64 for float64 caches), each product and sum rounded
        on its own (never fused), then rounded once to where the row goes:
        q to its own dtype, a new key to the cache's (quantized for an int8
        cache). The result, the caches and the lengths are bitwise those of
        the call without tables on q and k_new rotated first in NumPy by
        that formula. Tables of float32, or of float16 or bfloat16 (exact in
        float32), or float64 for float64 caches; any layout or byte order
        (only the rows of the positions used are read). Every position must
        lie in [0, max_position).
    rotary_interleaved : bool, default False
        Rotate the pairs ``(x[2i], x[2i + 1])`` instead (GPT-J's layout).
    cache_batch_idx : array_like of int, shape (B,), optional
        The cache entry of each batch row (FlashAttention's
        ``cache_batch_idx``): batch row b reads and appends entry
        ``cache_batch_idx[b]`` of caches (and int8 scales) of B_cache
        entries, so requests join and leave a batch while their caches
        stay where they are. Everything else (q, k_new, v_new,
        cache_lengths, kv_starts, out, ALiBi slopes and sinks per sequence)
        is per batch row. Entries in [0, B_cache); two batch rows that
        append may not name one entry (rows that only read may). The
        results agree with those of the same entries in caches of their own
        to rounding, not bitwise (the keys are split into chunks by other
        shapes).

    Returns
    -------
    attn : ndarray, shape (B, H, T, d_v)
    lse : ndarray, shape (B, H, T)
        Only with ``return_lse=True``; the result is then ``(attn, lse)``.
        ``-inf`` for a row that sees no key (the log of an empty sum), as
        in :func:`cattention.attention`; FlashAttention gives ``+inf``
        there (see :func:`cattention.merge`).

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
        an int8 one, the rotated ``k_new`` included), or an option out of
        range (as in :func:`cattention.attention`); rotary tables of
        different shapes, not 2-D, or of a rotary_dim beyond d_k, a
        position at or past max_position (or a q row before position 0:
        more rows than positions), only one table, or
        ``rotary_interleaved=True`` without them; a ``cache_batch_idx``
        that is not 1-D of B entries, names an entry outside the caches, or
        gives one entry to two batch rows that append.
    TypeError
        If the caches are not float16, float32, float64 or int8, differ in dtype
        or are not in native byte order (reading them would copy them), if
        q is wider than the cache (it would be converted whole), if
        ``k_new`` or ``v_new`` cannot be cast to the cache dtype, if the
        dtype of ``cache_lengths`` cannot hold S_max, if a rotary table is
        not floating point or is wider than the compute dtype, or if
        ``cache_batch_idx`` is not integers.

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

    Rotary embeddings on the next step (tables of 16 positions, rotary_dim
    8: every feature), the new keys stored rotated at positions 3, 4, 5:

    >>> angles = np.arange(16)[:, None] * 10000.0 ** (-np.arange(4) / 4)
    >>> cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    >>> out = ca.attention_with_kvcache(step, k_cache, v_cache, lengths, step, step,
    ...                                 rotary_cos=cos, rotary_sin=sin)
    >>> lengths, bool(np.allclose(k_cache[0, 0, 3, :4], cos[3] - sin[3]))
    (array([6]), True)
    """
    fast = (driver.kvcache_shortcut(q, k_cache, v_cache, cache_lengths, k_new, v_new, causal,
                                    scale, enable_gqa, window, softcap, alibi_slopes, sinks,
                                    k_scale, v_scale, kv_starts, out, return_lse, num_threads,
                                    local.limit, rotary_cos, rotary_sin, rotary_interleaved,
                                    precision)
            if cache_batch_idx is None else None)
    if fast is not None:
        return fast  # type: ignore[no-any-return]
    call, appends, result = prepare_kvcache(
        q, k_cache, v_cache, cache_lengths, k_new, v_new, causal=causal, scale=scale,
        enable_gqa=enable_gqa, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
        num_threads=num_threads, kv_starts=kv_starts, out=out, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_batch_idx=cache_batch_idx, precision=precision)
    # every check has passed: nothing below can fail half-way on bad input
    with appends.written():
        if isinstance(call, entries.EntriesCall):
            attn, lse = entries.run(call, result)
        else:
            dense_attn, _, lse = dense.run(call)
            assert dense_attn is not None
            attn = dense_attn
    if lse is not None:
        return attn, lse
    return attn
