"""Paged KV caches: keys and values in fixed-size pages owned by the caller,
addressed through a block table (vLLM's PagedAttention layout), appended to
in place and read where they are; with packed queries, one call serves a
continuous-batching step (prompt chunks being prefilled beside sequences
being decoded)."""

from __future__ import annotations

from typing import Any, Literal, SupportsIndex, cast, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attention, _entries
from ._checks import (
    _array,
    _as_input,
    _check_flag,
    _check_fits,
    _check_softcap,
    _check_window,
    _output,
    _readable_in_place,
    _refuse_shared_memory,
    _resolve_scale,
    _to_compute,
)
from ._kvcache import _check_cache_lengths
from ._quantize import cache_rows
from ._threads import _check_num_threads, _local, get_num_threads
from ._varlen import cu_seqlens, head_options, place, rows_of

__all__ = ["attention_with_paged_kvcache"]

_Float = NDArray[np.floating[Any]]


def _check_pages(k_pages: object, v_pages: object) -> tuple[NDArray[Any], NDArray[Any]]:
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(pages, np.ndarray) or pages.ndim != 4:
            raise ValueError(f"{name} must be a 4-D ndarray (n_pages, H_kv, page_size, d); "
                             f"got {getattr(pages, 'shape', type(pages).__name__)}")
        if pages.dtype != np.int8 and (pages.dtype.kind != "f"
                                       or pages.dtype.itemsize not in (2, 4, 8)):
            raise TypeError(f"{name} has dtype {pages.dtype}; pages must be float16, "
                            "float32, float64 or int8 (with scales)")
        if not pages.dtype.isnative:
            raise TypeError(f"{name} has non-native byte order ({pages.dtype.str}): reading "
                            "it would copy every page on every call; convert it once")
        if not _readable_in_place(pages):
            raise ValueError(f"{name} must be aligned with strides that are multiples of "
                             "its itemsize (reading it otherwise would copy it)")
    k_pages = cast("NDArray[Any]", k_pages)
    v_pages = cast("NDArray[Any]", v_pages)
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) must "
                        "share one dtype")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must share "
                         "(n_pages, H_kv, page_size)")
    if k_pages.shape[2] < 1:
        raise ValueError(f"page_size (axis 2 of k_pages {k_pages.shape}) must be >= 1")
    return k_pages, v_pages


def _check_scale_pages(k_pages: NDArray[Any], k_scale: object, v_scale: object,
                       q_dtype: np.dtype[Any]) -> None:
    if q_dtype not in (np.float32, np.float16):
        raise TypeError(f"int8 pages need a float32 (or float16) q, got {q_dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (not isinstance(scale, np.ndarray) or scale.dtype != np.float32
                or not scale.dtype.isnative or scale.shape != k_pages.shape[:3]
                or not _readable_in_place(scale)):
            got = (f"{scale.shape} {scale.dtype}" if isinstance(scale, np.ndarray)
                   else type(scale).__name__)
            raise ValueError(f"int8 pages need {name}: a native float32 ndarray of shape "
                             f"{k_pages.shape[:3]} (n_pages, H_kv, page_size), the scale of "
                             f"each row; got {got}")


@overload
def attention_with_paged_kvcache(
    q: ArrayLike, k_pages: NDArray[Any], v_pages: NDArray[Any], block_table: ArrayLike,
    cache_lengths: NDArray[np.integer[Any]], k_new: ArrayLike | None = None,
    v_new: ArrayLike | None = None, *, cu_seqlens_q: ArrayLike | None = None,
    causal: bool = True, scale: float | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None, return_lse: Literal[False] = False,
    num_threads: SupportsIndex | None = None,
) -> _Float: ...


@overload
def attention_with_paged_kvcache(
    q: ArrayLike, k_pages: NDArray[Any], v_pages: NDArray[Any], block_table: ArrayLike,
    cache_lengths: NDArray[np.integer[Any]], k_new: ArrayLike | None = None,
    v_new: ArrayLike | None = None, *, cu_seqlens_q: ArrayLike | None = None,
    causal: bool = True, scale: float | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None, return_lse: Literal[True],
    num_threads: SupportsIndex | None = None,
) -> tuple[_Float, _Float]: ...


@overload
def attention_with_paged_kvcache(
    q: ArrayLike, k_pages: NDArray[Any], v_pages: NDArray[Any], block_table: ArrayLike,
    cache_lengths: NDArray[np.integer[Any]], k_new: ArrayLike | None = None,
    v_new: ArrayLike | None = None, *, cu_seqlens_q: ArrayLike | None = None,
    causal: bool = True, scale: float | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None, return_lse: bool = False,
    num_threads: SupportsIndex | None = None,
) -> _Float | tuple[_Float, _Float]: ...


def attention_with_paged_kvcache(
    q: ArrayLike, k_pages: NDArray[Any], v_pages: NDArray[Any], block_table: ArrayLike,
    cache_lengths: NDArray[np.integer[Any]], k_new: ArrayLike | None = None,
    v_new: ArrayLike | None = None, *, cu_seqlens_q: ArrayLike | None = None,
    causal: bool = True, scale: float | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None, return_lse: bool = False,
    num_threads: SupportsIndex | None = None,
) -> _Float | tuple[_Float, _Float]:
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
    them).

    Parameters
    ----------
    q : array_like, shape (B, H, T, d_k), or (total_q, H, d_k) with cu_seqlens_q
        Queries; H may be a multiple of H_kv (grouped-query attention).
    k_pages : ndarray, shape (n_pages, H_kv, page_size, d_k)
    v_pages : ndarray, shape (n_pages, H_kv, page_size, d_v)
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
    k_new : array_like, shape (B, H_kv, T, d_k), or (total_q, H_kv, d_k)
    v_new : array_like, shape (B, H_kv, T, d_v), or (total_q, H_kv, d_v)
        Rows to append (both or neither), in q's layout.
    cu_seqlens_q : array_like of int, shape (B + 1,), optional
        Continuous batching: q, k_new and v_new are packed along the token
        axis, sequence b bringing ``cu_seqlens_q[b+1] - cu_seqlens_q[b]``
        tokens (a prompt chunk, 1 for a decoding sequence, or 0).
    causal, scale, window, softcap, return_lse, num_threads
        As in :func:`cattention.attention`.
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
    if (cu_seqlens_q is None and window is None and softcap is None and alibi_slopes is None
            and sinks is None and k_scale is None and v_scale is None and return_lse is False):
        # a decode or prefill step of float pages: checked, appended and
        # computed in one compiled call, or None for everything else (and
        # every error)
        fast = _attention.paged_fast(q, k_pages, v_pages, block_table, cache_lengths, k_new,
                                     v_new, causal, scale, num_threads, _local.limit)
        if fast is not None:
            return fast
    k_pages, v_pages = _check_pages(k_pages, v_pages)
    n_pages, n_kv_heads, page_size, d_k = k_pages.shape
    d_v = v_pages.shape[3]
    q = _as_input(q, "q")
    table = _array(block_table, "block_table")
    if table.dtype.kind not in "iu" or table.ndim != 2:
        raise ValueError(f"block_table must be a 2-D integer array (B, max_pages); got "
                         f"shape {table.shape}, dtype {table.dtype}")
    n_seq, max_pages = table.shape
    packed = cu_seqlens_q is not None
    if packed:
        if q.ndim != 3 or q.shape[2] != d_k:
            raise ValueError(f"with cu_seqlens_q, q must be packed (total_q, H, d_k) = "
                             f"(total_q, H, {d_k}); got {q.shape}")
        cu_q = cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "total_q (q.shape[0])")
        if cu_q.size != n_seq + 1:
            raise ValueError(f"cu_seqlens_q describes {cu_q.size - 1} sequences, "
                             f"block_table {table.shape} {n_seq}")
        q_lengths = np.diff(cu_q)
        n_heads = q.shape[1]
    else:
        if q.ndim != 4 or q.shape[0] != n_seq or q.shape[3] != d_k:
            raise ValueError(f"q must have shape (B, H, T, d_k) = ({n_seq}, H, T, {d_k}) "
                             f"to match block_table {table.shape} and k_pages "
                             f"{k_pages.shape} (or be packed, with cu_seqlens_q); got "
                             f"{q.shape}")
        q_lengths = np.full(n_seq, q.shape[2], dtype=np.intp)
        n_heads = q.shape[1]
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"the query heads of q {q.shape} must be a multiple of the "
                         f"key/value heads of k_pages {k_pages.shape}")
    half = k_pages.dtype == np.float16 and q.dtype in (np.float16, np.float32)
    int8 = k_pages.dtype == np.int8
    if int8:
        _check_scale_pages(k_pages, k_scale, v_scale, q.dtype)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with int8 pages; these are {k_pages.dtype}")
    if not half and not int8 and np.result_type(q.dtype, k_pages.dtype) != k_pages.dtype:
        raise TypeError(f"q of dtype {q.dtype} with {k_pages.dtype} pages would convert "
                        "(copy) every page; pass q in the pages' dtype")
    _check_cache_lengths(cache_lengths, n_seq, max_pages * page_size)

    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    new_rows: list[NDArray[Any]] = []
    new_scales: list[NDArray[np.float32] | None] = []
    new_given: list[tuple[str, NDArray[Any]]] = []
    if k_new is not None:
        for name, new, d in (("k_new", k_new, d_k), ("v_new", v_new, d_v)):
            new = _array(new, name)
            new_given.append((name, new))
            want = ((q.shape[0], n_kv_heads, d) if packed
                    else (n_seq, n_kv_heads, q.shape[2], d))
            if new.shape != want:
                raise ValueError(f"{name} must have shape {want} to match q {q.shape} and "
                                 f"the pages; got {new.shape}")
            if int8:
                if new.dtype.kind not in "fiu" or new.dtype == np.int8:
                    raise TypeError(f"{name} of dtype {new.dtype} for int8 pages: pass "
                                    "float values, which are quantized as they are appended")
            elif not np.can_cast(new.dtype, k_pages.dtype, casting="same_kind"):
                raise TypeError(f"{name} of dtype {new.dtype} cannot be written into "
                                f"{k_pages.dtype} pages")
            # as the pages store them (int8 pages take them quantized), then
            # (tokens, H_kv, d) in sequence order
            rows, row_scale = cache_rows(new, k_pages.dtype, name)
            if not packed:
                rows = np.swapaxes(rows, 1, 2).reshape(n_seq * q.shape[2], n_kv_heads, d)
                if row_scale is not None:
                    row_scale = np.swapaxes(row_scale, 1, 2).reshape(n_seq * q.shape[2],
                                                                     n_kv_heads)
            new_rows.append(rows)
            new_scales.append(row_scale)
        writable = [k_pages, v_pages, cache_lengths] + (
            [cast("NDArray[Any]", k_scale), cast("NDArray[Any]", v_scale)] if int8 else [])
        if not all(a.flags.writeable for a in writable):
            raise ValueError("k_pages, v_pages, cache_lengths (and k_scale, v_scale) must "
                             "be writable to append")
        _refuse_shared_memory(
            [("k_pages", k_pages), ("v_pages", v_pages), ("cache_lengths", cache_lengths)]
            + ([("k_scale", k_scale), ("v_scale", v_scale)] if int8 else []),
            [("q", q)] + new_given)
    n_new = q_lengths if new_rows else np.zeros(n_seq, dtype=np.intp)
    # in Python ints: a uint64 length beyond int64 would wrap around in int64
    needed = [int(old) + int(new) for old, new in zip(cache_lengths.tolist(), n_new.tolist())]
    if needed and max(needed) > max_pages * page_size:
        worst = int(np.argmax(needed))
        raise ValueError(
            f"sequence {worst} needs {needed[worst]} positions (cache_lengths "
            f"{int(cache_lengths[worst])} + {int(n_new[worst])} new) but block_table "
            f"{table.shape} gives at most {max_pages} pages of {page_size}")
    old_lengths = cache_lengths.astype(np.int64)
    lengths = old_lengths + n_new
    # every page a sequence reads must exist
    used_pages = -(-lengths // page_size)
    in_use = np.arange(max_pages) < used_pages[:, None]
    bad = in_use & ((table < 0) | (table >= n_pages))
    if bad.any():
        b, slot = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{b}, {slot}] = {int(table[b, slot])} is not a page id "
                         f"in [0, {n_pages}) (k_pages has {n_pages} pages), and sequence "
                         f"{b} uses it")
    causal = _check_flag(causal, "causal")
    return_lse = _check_flag(return_lse, "return_lse")
    # float16 and int8 pages are computed in float32
    compute = np.dtype(np.float32) if k_pages.dtype in (np.float16, np.int8) else k_pages.dtype
    scale_value = _resolve_scale(scale, d_k)
    _check_fits(scale_value, compute, "scale")
    window_sides = _check_window(window, causal)
    softcap_value = _check_softcap(softcap)
    _check_fits(softcap_value, compute, "softcap")
    alibi, sink_logits = head_options(alibi_slopes, sinks, n_heads, compute)
    threads = get_num_threads() if num_threads is None else _check_num_threads(num_threads)
    # a copy, always: cache_lengths, advanced below, may be a view of the
    # caller's table, whose page ids were checked against the old lengths
    table = np.array(table, dtype=np.intp, order="C")
    if new_rows:
        seq_of_row = np.repeat(np.arange(n_seq), n_new)
        first_row = np.repeat(np.cumsum(n_new) - n_new, n_new)
        position = old_lengths[seq_of_row] + np.arange(seq_of_row.size) - first_row
        page = table[seq_of_row, position // page_size]
        row = position % page_size
        slots = page * page_size + row
        if np.unique(slots).size != slots.size:
            raise ValueError("two new rows would be written to one page row: the block "
                             "table gives two sequences the same page where both append")
        _refuse_writes_to_held_rows(table, old_lengths, page_size, n_pages, page, row,
                                    seq_of_row, position)

    # every check has passed: nothing below can fail half-way on bad input
    if new_rows:
        k_add, v_add = new_rows
        k_row_scale, v_row_scale = new_scales
        if int8:
            cast("NDArray[Any]", k_scale)[page, :, row] = k_row_scale
            cast("NDArray[Any]", v_scale)[page, :, row] = v_row_scale
        k_pages[page, :, row] = k_add
        v_pages[page, :, row] = v_add
        cache_lengths += n_new.astype(cache_lengths.dtype)
    try:
        return _attend(q, k_pages, v_pages, table, q_lengths, lengths,
                       cu_q if packed else None, n_heads, compute, causal=causal,
                       scale=scale_value, window=window_sides, softcap=softcap_value,
                       alibi=alibi, sinks=sink_logits, k_scale=k_scale, v_scale=v_scale,
                       return_lse=return_lse, threads=threads)
    except BaseException:
        # the computation failed (its memory): the new rows are given back,
        # their slots free again past the lengths
        if new_rows:
            cache_lengths[...] = old_lengths   # (every value fits: they were its own)
        raise


def _refuse_writes_to_held_rows(table: NDArray[np.intp], old_lengths: NDArray[np.int64],
                                page_size: int, n_pages: int,
                                page: NDArray[np.intp], row: NDArray[np.intp],
                                seq_of_row: NDArray[np.intp],
                                position: NDArray[np.int64]) -> None:
    """A new row (page[n], row[n]) must not land on a page row some sequence
    holds (one of its first old_lengths positions): that sequence would read
    the new row in place of its own, silently. Pages shared for a common
    prefix are fine as long as every sequence appends past them."""
    held_slots = np.arange(table.shape[1]) < -(-old_lengths // page_size)[:, None]
    # held table entries are page ids (checked); the others may hold anything
    written = np.zeros(n_pages, dtype=bool)
    written[page] = True
    holder, slot = np.nonzero(held_slots & written[np.where(held_slots, table, 0)])
    held_page = table[holder, slot]
    # rows 0 .. held_rows - 1 of held_page are held
    held_rows = np.minimum(page_size, old_lengths[holder] - slot * page_size)
    # the most rows any sequence holds of each page written to
    pages, inverse = np.unique(page, return_inverse=True)
    most = np.zeros(pages.size, np.int64)
    np.maximum.at(most, np.searchsorted(pages, held_page), held_rows)
    clash = np.flatnonzero(row < most[inverse])
    if clash.size:
        n = int(clash[0])
        h = int(np.flatnonzero((held_page == page[n]) & (held_rows > row[n]))[0])
        raise ValueError(
            f"sequence {int(seq_of_row[n])}'s new position {int(position[n])} would be "
            f"written to page {int(page[n])} row {int(row[n])}, which sequence "
            f"{int(holder[h])} holds (its position "
            f"{int(slot[h]) * page_size + int(row[n])}): the block table gives a page "
            "a sequence still holds to later positions")


def _attend(q: NDArray[Any], k_pages: NDArray[Any], v_pages: NDArray[Any],
            table: NDArray[np.intp], q_lengths: NDArray[Any], lengths: NDArray[Any],
            cu_q: NDArray[np.intp] | None, n_heads: int, compute: np.dtype[Any], *,
            causal: bool, scale: float, window: tuple[int, int], softcap: float,
            alibi: NDArray[np.float64] | None, sinks: NDArray[np.float64] | None,
            k_scale: NDArray[np.float32] | None, v_scale: NDArray[np.float32] | None,
            return_lse: bool, threads: int) -> _Float | tuple[_Float, _Float]:
    """The attention of each sequence's queries to its valid positions (the
    options checked, scale resolved, computed in ``compute``)."""
    n_seq, max_pages = table.shape
    n_pages, n_kv_heads, page_size, d_k = k_pages.shape
    d_v = v_pages.shape[3]
    # a float16 q with float16 or int8 pages gives float16, as attention would
    result = (np.dtype(np.float16) if q.dtype == np.float16 and compute == np.float32
              and k_pages.dtype != np.float32 else compute)
    q = _to_compute(q, compute)
    item = q.itemsize
    if cu_q is not None:
        out = _output((q.shape[0], n_heads, d_v), compute, "the output")
        lse = _output((q.shape[0], n_heads), compute, "the log-sum-exp") if return_lse else None
        starts = cu_q[:-1]
        q_place = place(q, starts * (q.strides[0] // item), 0, 1)
        out_place = place(out, starts * n_heads * d_v, 0, 1)
        lse_place = place(lse, starts * n_heads, 0, 1) if lse is not None else None
    else:
        n_queries = q.shape[2]
        out = _output((n_seq, n_heads, n_queries, d_v), compute, "the output")
        lse = (_output((n_seq, n_heads, n_queries), compute, "the log-sum-exp")
               if return_lse else None)
        seqs = np.arange(n_seq, dtype=np.intp)
        q_place = place(q, seqs * (q.strides[0] // item), 2, 1)
        out_place = place(out, seqs * n_heads * n_queries * d_v, 2, 1)
        lse_place = place(lse, seqs * n_heads * n_queries, 2, 1) if lse is not None else None
    zeros = np.zeros(n_seq, dtype=np.intp)

    def paged(pages: NDArray[Any], scales: NDArray[np.float32] | None,
              ) -> tuple[_entries.Place, _entries.Rows, _entries.Place | None]:
        step = pages.itemsize
        rows = _entries.Rows(pages, pages.strides[2] // step, pages.strides[3] // step,
                             page_stride=pages.strides[0] // step)
        scale_place = None
        if scales is not None:
            rows.scale = scales
            rows.scale_stride = scales.strides[2] // 4
            rows.scale_page_stride = scales.strides[0] // 4
            scale_place = _entries.Place(scales, zeros, 0, scales.strides[1] // 4)
        return _entries.Place(pages, zeros, 0, pages.strides[1] // step), rows, scale_place

    k_place, k_rows, k_scale_place = paged(k_pages, k_scale)
    v_place, v_rows, v_scale_place = paged(v_pages, v_scale)
    # with d_v = 0 there is no output to write, but there are LSEs
    if out.size or (lse is not None and lse.size):
        tables = _entries.plan(
            q_place, k_place, v_place, out_place, lse_place, q_lengths,
            np.asarray(lengths, dtype=np.intp), n_heads, n_kv_heads, alibi=alibi,
            sinks=sinks, pages=(table.reshape(-1), max_pages, page_size),
            k_scale=k_scale_place, v_scale=v_scale_place)
        _entries.run(tables, rows_of(q), k_rows, v_rows, out, lse, causal=causal,
                     scale=scale, threads=threads, window=window, softcap=softcap)
    result_out = out.astype(result) if result != compute else out
    if return_lse:
        return result_out, cast("_Float", lse)
    return result_out
