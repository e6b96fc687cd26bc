"""Public: paged KV caches. Keys and values in fixed-size pages owned by the
caller, addressed through a block table (vLLM's PagedAttention layout),
appended to in place and read where they are; with packed queries, one call
serves a continuous-batching step (prompt chunks being prefilled beside
sequences being decoded)."""

from __future__ import annotations

from typing import Any, Literal, Optional, SupportsIndex, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .._prepare import entries
from .._prepare.options import local
from .._prepare.paged import prepare_paged

__all__ = ["attention_with_paged_kvcache"]

_Float = NDArray[np.floating[Any]]


@overload
def attention_with_paged_kvcache(
    q: ArrayLike, k_pages: NDArray[Any], v_pages: NDArray[Any], block_table: ArrayLike,
    cache_lengths: NDArray[np.integer[Any]], k_new: Optional[ArrayLike] = None,
    v_new: Optional[ArrayLike] = None, *, cu_seqlens_q: Optional[ArrayLike] = None,
    causal: bool = True, scale: Optional[float] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[NDArray[np.float32]] = None,
    kv_starts: Optional[ArrayLike] = None, out: Optional[NDArray[Any]] = None,
    v_scale: Optional[NDArray[np.float32]] = None, return_lse: Literal[False] = False,
    num_threads: Optional[SupportsIndex] = None,
) -> _Float: ...


@overload
def attention_with_paged_kvcache(
    q: ArrayLike, k_pages: NDArray[Any], v_pages: NDArray[Any], block_table: ArrayLike,
    cache_lengths: NDArray[np.integer[Any]], k_new: Optional[ArrayLike] = None,
    v_new: Optional[ArrayLike] = None, *, cu_seqlens_q: Optional[ArrayLike] = None,
    causal: bool = True, scale: Optional[float] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[NDArray[np.float32]] = None,
    kv_starts: Optional[ArrayLike] = None, out: Optional[NDArray[Any]] = None,
    v_scale: Optional[NDArray[np.float32]] = None, return_lse: Literal[True],
    num_threads: Optional[SupportsIndex] = None,
) -> tuple[_Float, _Float]: ...


@overload
def attention_with_paged_kvcache(
    q: ArrayLike, k_pages: NDArray[Any], v_pages: NDArray[Any], block_table: ArrayLike,
    cache_lengths: NDArray[np.integer[Any]], k_new: Optional[ArrayLike] = None,
    v_new: Optional[ArrayLike] = None, *, cu_seqlens_q: Optional[ArrayLike] = None,
    causal: bool = True, scale: Optional[float] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[NDArray[np.float32]] = None,
    kv_starts: Optional[ArrayLike] = None, out: Optional[NDArray[Any]] = None,
    v_scale: Optional[NDArray[np.float32]] = None, return_lse: bool = False,
    num_threads: Optional[SupportsIndex] = None,
) -> "_Float | tuple[_Float, _Float]": ...


def attention_with_paged_kvcache(
    q: ArrayLike, k_pages: NDArray[Any], v_pages: NDArray[Any], block_table: ArrayLike,
    cache_lengths: NDArray[np.integer[Any]], k_new: Optional[ArrayLike] = None,
    v_new: Optional[ArrayLike] = None, *, cu_seqlens_q: Optional[ArrayLike] = None,
    causal: bool = True, scale: Optional[float] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[NDArray[np.float32]] = None,
    kv_starts: Optional[ArrayLike] = None, out: Optional[NDArray[Any]] = None,
    v_scale: Optional[NDArray[np.float32]] = None, return_lse: bool = False,
    num_threads: Optional[SupportsIndex] = None,
) -> "_Float | tuple[_Float, _Float]":
    """Append to a paged KV cache in place, then attend to it.

    Keys and values live in pages owned by the caller; sequence b's
    position p is row ``p % page_size`` of page ``block_table[b, p //
    page_size]`` (for every K/V head). The new rows are written there at
    positions ``cache_lengths[b]`` onwards, ``cache_lengths`` is advanced
    **in place**, then each sequence's queries attend to its valid
    positions with bottom-right causal alignment (its new tokens are the
    last of them). Pages are read where they are, never gathered. The
    results are bitwise the same for any thread count and any order of the
    pages; they agree with those of the same keys held contiguously
    (:func:`cattention.attention_with_kvcache`) to rounding, not bitwise: a
    decode step's key steps end where pages do, and how its keys are split
    into chunks depends on the shapes (a contiguous cache's S_max among
    them). The rules shared with every call are in :ref:`conventions`.

    Parameters
    ----------
    q : array_like, shape (B, H, T, d_k), or (total_q, H, d_k) with cu_seqlens_q
        Queries; H may be a multiple of H_kv (grouped-query attention).
    k_pages, v_pages : ndarray, shapes (n_pages, H_kv, page_size, d_k) and (..., d_v)
        Writable pages of one dtype: float32 or float64 (with a q no wider:
        the result has the wider dtype of the two), float16 (read block by
        block as float32, with a float16 or float32 q), or int8 with
        ``k_scale``/``v_scale``. Any page_size >= 1.
    block_table : array_like of int, shape (B, max_pages)
        Page ids of each sequence; entries past a sequence's pages are
        ignored (they may hold anything, e.g. -1).
    cache_lengths : ndarray of int, shape (B,)
        Filled positions of each sequence, updated in place; its dtype must
        hold max_pages * page_size.
    k_new, v_new : array_like, shapes (B, H_kv, T, d_k) and (B, H_kv, T, d_v), optional
        Rows to append (both or neither), in q's layout: packed
        ``(total_q, H_kv, d)`` with ``cu_seqlens_q``.
    cu_seqlens_q : array_like of int, shape (B + 1,), optional
        Continuous batching: q, k_new and v_new are packed along the token
        axis, sequence b bringing ``cu_seqlens_q[b+1] - cu_seqlens_q[b]``
        tokens (a prompt chunk, 1 for a decoding sequence, or 0).
    causal, scale, window, softcap, return_lse, num_threads
        As in :func:`cattention.attention`.
    kv_starts : array_like of int, shape (B,), optional
        The first valid position of each sequence (left padding): sequence
        b attends to positions ``kv_starts[b] <= j < cache_lengths[b]``
        (after the update), aligned against the end; the pages before it
        are never read.
    out : ndarray, shape of q with d_v last, optional
        Where to write ATTN, as :func:`cattention.attention`'s ``out``.
    alibi_slopes, sinks : array_like, shape (H,), optional
        One ALiBi slope, or one sink logit (-inf: none), per query head.
    k_scale, v_scale : ndarray of float32, shape (n_pages, H_kv, page_size)
        With int8 pages (and only then): each row's scale, written as rows
        are appended (k_new and v_new are then float, quantized on append).
        The scales of the rows a sequence holds must be finite, >= 0 and at
        most float32's largest value / 127 (2.68e36; those this function
        writes are); another gives NaN. They are not checked on every
        call, which would read every page's scales.

    Returns
    -------
    attn : ndarray, shape of q with d_v last
    lse : ndarray, shape of q without its last axis; only with return_lse

    Raises
    ------
    ValueError
        On any shape mismatch; a sequence that would need a page the table
        does not give or a page id outside [0, n_pages); two new rows that
        would land on one page row, or a new row that would land on a page
        row some sequence holds (a page shared for a common prefix, or
        listed twice in one table, where a sequence appends); read-only
        arrays to be written; an array
        written in place (pages, cache_lengths, scales) that shares memory
        with another of them, q, k_new or v_new; new rows holding a value
        the pages cannot store (beyond a float dtype's range, or NaN or
        infinite for int8 pages); negative lengths; an option out of range,
        or one the compute dtype cannot hold.
    TypeError
        On pages that differ in dtype or are not in native byte order, a q
        wider than the pages, new rows that cannot be cast to the pages'
        dtype, a cache_lengths dtype that cannot hold the positions.

    Every check runs before anything is written, so a call refused for its
    arguments leaves pages and lengths as they were. If the computation
    itself fails after the append (a ``MemoryError``), ``cache_lengths``
    are put back; the page rows past them, free again, may hold the new rows.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> k_pages = np.zeros((8, 2, 4, 16), np.float32)    # 8 pages of 4 positions
    >>> v_pages = np.zeros((8, 2, 4, 16), np.float32)
    >>> table = np.array([[5, 2, 7], [0, 1, 3]])           # 2 sequences
    >>> lengths = np.array([0, 6])
    >>> x = np.ones((2, 2, 3, 16), np.float32)            # 3 new tokens each
    >>> ca.attention_with_paged_kvcache(x, k_pages, v_pages, table, lengths, x, x).shape
    (2, 2, 3, 16)
    >>> lengths
    array([3, 9])
    """
    fast = driver.paged_shortcut(q, k_pages, v_pages, block_table, cache_lengths, k_new,
                                 v_new, cu_seqlens_q, causal, scale, window, softcap,
                                 alibi_slopes, sinks, k_scale, v_scale, kv_starts, out,
                                 return_lse, num_threads, local.limit)
    if fast is not None:
        return fast  # type: ignore[no-any-return]
    call, appends, result = prepare_paged(
        q, k_pages, v_pages, block_table, cache_lengths, k_new, v_new,
        cu_seqlens_q=cu_seqlens_q, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        return_lse=return_lse, num_threads=num_threads, kv_starts=kv_starts, out=out)
    # every check has passed: nothing below can fail half-way on bad input
    with appends.written():
        attn, lse = entries.run(call, result)
    if lse is not None:
        return attn, lse
    return attn
