"""Public: paged KV caches. Keys and values in fixed-size pages owned by the
caller, addressed through a block table (vLLM's PagedAttention layout),
appended to in place and read where they are; with packed queries, one call
serves a continuous-batching step (prompt chunks being prefilled beside
sequences being decoded). An engine that places rows itself writes them at
its own slots (``paged_append``)."""

from __future__ import annotations

from typing import Any, Literal, Optional, SupportsIndex, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .._prepare import entries
from .._prepare.options import Precision, local
from .._prepare.paged import prepare_paged, prepare_slot_append

__all__ = ["attention_with_paged_kvcache", "paged_append"]

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
    cu_seqlens_k_new: Optional[ArrayLike] = None, rotary_cos: Optional[ArrayLike] = None,
    rotary_sin: Optional[ArrayLike] = None, rotary_interleaved: bool = False,
    v_scale: Optional[NDArray[np.float32]] = None, return_lse: Literal[False] = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
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
    cu_seqlens_k_new: Optional[ArrayLike] = None, rotary_cos: Optional[ArrayLike] = None,
    rotary_sin: Optional[ArrayLike] = None, rotary_interleaved: bool = False,
    v_scale: Optional[NDArray[np.float32]] = None, return_lse: Literal[True],
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
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
    cu_seqlens_k_new: Optional[ArrayLike] = None, rotary_cos: Optional[ArrayLike] = None,
    rotary_sin: Optional[ArrayLike] = None, rotary_interleaved: bool = False,
    v_scale: Optional[NDArray[np.float32]] = None, return_lse: bool = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
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
    cu_seqlens_k_new: Optional[ArrayLike] = None, rotary_cos: Optional[ArrayLike] = None,
    rotary_sin: Optional[ArrayLike] = None, rotary_interleaved: bool = False,
    v_scale: Optional[NDArray[np.float32]] = None, return_lse: bool = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> "_Float | tuple[_Float, _Float]":
    """Append to a paged KV cache in place, then attend to it.

    Keys and values live in pages owned by the caller; sequence b's
    position p is row ``p % page_size`` of page ``block_table[b, p //
    page_size]`` (for every K/V head). The new rows are written there at
    positions ``cache_lengths[b]`` onwards, ``cache_lengths`` is advanced
    **in place**, then each sequence's queries attend to its valid
    positions with bottom-right causal alignment (its queries are the last
    of them; a sequence may append another number of rows than it has
    queries). With rotary tables, q and the new keys are rotated at their
    positions as they are read and appended. Pages are read where they
    are, never gathered. The results are bitwise the same for any thread
    count and any order of the pages; they agree with those of the same keys held contiguously
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
    k_new, v_new : array_like, shapes (B, H_kv, T_new, d_k) and (B, H_kv, T_new, d_v), optional
        Rows to append (both or neither), in q's layout: padded with any
        T_new (T_new = T for a step whose every new token is a query, as in
        the contiguous call), or packed ``(total_new, H_kv, d)``, sequence
        b's from ``cu_seqlens_k_new[b]`` (by default ``cu_seqlens_q``: one
        new row per query row).
    cu_seqlens_q : array_like of int, shape (B + 1,), optional
        Continuous batching: q, k_new and v_new are packed along the token
        axis, sequence b bringing ``cu_seqlens_q[b+1] - cu_seqlens_q[b]``
        tokens (a prompt chunk, 1 for a decoding sequence, or 0).
    cu_seqlens_k_new : array_like of int, shape (B + 1,), optional
        With packed rows: where each sequence's new rows start in k_new and
        v_new, when their counts differ from its queries' (speculative
        decoding, a chunk appended without all of its queries).
    causal, scale, window, softcap, return_lse, precision, num_threads
        As in :func:`cattention.attention`. The log-sum-exp of a row that
        sees no key is ``-inf`` (see :func:`cattention.merge`).
    kv_starts : array_like of int, shape (B,), optional
        The first valid position of each sequence (left padding): sequence
        b attends to positions ``kv_starts[b] <= j < cache_lengths[b]``
        (after the update), aligned against the end; the pages before it
        are never read.
    out : ndarray, shape of q with d_v last, optional
        Where to write ATTN, as :func:`cattention.attention`'s ``out``.
    alibi_slopes, sinks : array_like, shape (H,) or (B, H), optional
        One ALiBi slope, or one sink logit (-inf: none), per query head, or
        per sequence and query head.
    rotary_cos, rotary_sin : array_like, shape (max_position, rotary_dim / 2), optional
        Rotary position embeddings, as in
        :func:`cattention.attention_with_kvcache`: sequence b's new keys at
        positions ``cache_lengths[b] + t``, its queries at the last of its
        positions after the append, the pages holding rotated keys; bitwise
        the call without tables on rows rotated first by the formula
        documented there.
    rotary_interleaved : bool, default False
        Rotate the pairs ``(x[2i], x[2i + 1])`` instead (GPT-J's layout).
    k_scale, v_scale : ndarray of float32, shape (n_pages, H_kv, page_size)
        With int8 pages: each row's scale, written as rows are appended
        (k_new and v_new are then float, quantized on append). The scales
        of the rows a sequence holds must be finite, >= 0 and at most
        float32's largest value / 127 (2.68e36; those this function writes
        are); another gives NaN. They are not checked on every call, which
        would read every page's scales.
        With fp8 pages: as for :func:`attention_with_kvcache`'s fp8
        caches, scales that broadcast to ``(n_pages, H_kv, page_size)``:
        one per tensor (vLLM's) or per (page, head) is fixed and divides
        new rows; an array of exactly that shape is a scale per row,
        written on append. Checked on every call.

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
        or one the compute dtype cannot hold; ``cu_seqlens_k_new`` without
        packed new rows, or not describing k_new; rotary tables as
        :func:`cattention.attention_with_kvcache` refuses them.
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
    fast = (driver.paged_shortcut(q, k_pages, v_pages, block_table, cache_lengths, k_new,
                                  v_new, cu_seqlens_q, causal, scale, window, softcap,
                                  alibi_slopes, sinks, k_scale, v_scale, kv_starts, out,
                                  return_lse, num_threads, local.limit, rotary_cos, rotary_sin,
                                  rotary_interleaved, precision)
            if cu_seqlens_k_new is None else None)
    if fast is not None:
        return fast  # type: ignore[no-any-return]
    call, appends, result = prepare_paged(
        q, k_pages, v_pages, block_table, cache_lengths, k_new, v_new,
        cu_seqlens_q=cu_seqlens_q, causal=causal, scale=scale, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        return_lse=return_lse, num_threads=num_threads, kv_starts=kv_starts, out=out,
        cu_seqlens_k_new=cu_seqlens_k_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, precision=precision)
    # every check has passed: nothing below can fail half-way on bad input
    with appends.written():
        attn, lse = entries.run(call, result)
    if lse is not None:
        return attn, lse
    return attn


def paged_append(k_pages: NDArray[Any], v_pages: NDArray[Any], slot_mapping: ArrayLike,
                 k_new: ArrayLike, v_new: ArrayLike, *,
                 k_scale: Optional[NDArray[np.float32]] = None,
                 v_scale: Optional[NDArray[np.float32]] = None) -> None:
    """Write new key and value rows into pages at the slots an engine chose.

    Row i of ``k_new`` and ``v_new`` (every K/V head) goes to slot
    ``slot_mapping[i]``: row ``slot % page_size`` of page ``slot //
    page_size``, in place; a negative slot marks a row to skip (an
    engine's padding). This is the write of a serving engine whose
    scheduler places each new token itself (vLLM's ``slot_mapping``, with
    pages shared by prefix caching); :func:`attention_with_paged_kvcache`
    then reads the pages through the block table without appending. The
    rows are converted (or quantized) as that function appends them, by
    the same compiled loop.

    Parameters
    ----------
    k_pages, v_pages : ndarray, shapes (n_pages, H_kv, page_size, d_k) and (..., d_v)
        Writable pages of one dtype, any strides (e.g. the K and V halves
        of one engine cache tensor), as :func:`attention_with_paged_kvcache`
        takes them.
    slot_mapping : array_like of int, shape (n_rows,)
        The slot of each new row, ``page * page_size + row``, or negative.
    k_new, v_new : array_like, shapes (n_rows, H_kv, d_k) and (n_rows, H_kv, d_v)
        The rows, any strides: castable to the pages' dtype (bfloat16
        pages take bfloat16, float32 or float64 rows), or float rows for
        int8 pages, quantized per row with their scales written to
        ``k_scale``/``v_scale``.
    k_scale, v_scale : ndarray of float32, shape (n_pages, H_kv, page_size)
        With int8 pages: the scale of each row, written. With fp8 pages:
        as :func:`attention_with_paged_kvcache` takes them (a fixed scale
        divides the new rows, one per row is written).

    Raises
    ------
    ValueError
        On a shape mismatch, a slot past the last page, two rows given one
        slot, read-only pages, pages that share memory with each other's
        rows or with the new rows, values the pages cannot store (beyond a
        float dtype's range; NaN or infinite for int8 pages).
    TypeError
        On pages that differ in dtype or are not in native byte order, new
        rows that cannot be cast to the pages' dtype.

    Every check runs before anything is written: a refused call leaves
    the pages as they were.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> k_pages = np.zeros((4, 2, 8, 16), np.float32)    # 4 pages of 8 positions
    >>> v_pages = np.zeros((4, 2, 8, 16), np.float32)
    >>> rows = np.ones((3, 2, 16), np.float32)
    >>> ca.paged_append(k_pages, v_pages, [17, -1, 3], rows, rows)   # the second is padding
    >>> float(k_pages[2, 0, 1, 0]), float(k_pages[0, 1, 3, 0]), float(k_pages.sum())
    (1.0, 1.0, 64.0)
    """
    writes = prepare_slot_append(k_pages, v_pages, slot_mapping, k_new, v_new, k_scale, v_scale)
    # every check has passed
    for write in writes.writes:
        driver.append_rows(write.cache, write.rows, write.seq_offset, write.row_axis,
                           write.head_axis, writes.start, writes.n_new, writes.page_ids, 1)
