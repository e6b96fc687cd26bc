"""A step against a paged KV cache, checked once: the pages' own checks
(caches.py), the block table, the rows each sequence appends and where
they land, and the attention options, all before anything is written; and
an engine's append of new rows at the slots it chose (slot_mapping)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .arrays import array, as_input, check_out, is_fp8, is_half, refuse_shared_memory
from .caches import (Appends, Write, as_stored, check_cache_lengths, check_new_rows_dtype,
                     check_scales, check_sequence_starts, check_storage, fp8_read_scale,
                     new_rows, result_dtype, store_compute)
from .entries import (EntriesCall, cu_seqlens, head_options, outputs, place, queries)
from .options import row_options
from .rotary import Rotary, check_rotary, rotate_queries

_Array = NDArray[Any]
_Intp = NDArray[np.intp]
# the axes of pages and their row scales, as messages name them
_PAGE_AXES = "(n_pages, H_kv, page_size)"


def prepare_paged(q: ArrayLike, k_pages: object, v_pages: object, block_table: ArrayLike,
                  cache_lengths: object, k_new: Optional[ArrayLike],
                  v_new: Optional[ArrayLike], *, cu_seqlens_q: Optional[ArrayLike],
                  causal: object, scale: Optional[float], window: Any,
                  softcap: Optional[float], alibi_slopes: Optional[ArrayLike],
                  sinks: Optional[ArrayLike], k_scale: Optional[_Array],
                  v_scale: Optional[_Array], return_lse: object,
                  num_threads: Optional[SupportsIndex], kv_starts: Optional[ArrayLike] = None,
                  out: Optional[_Array] = None, cu_seqlens_k_new: Optional[ArrayLike] = None,
                  rotary_cos: Optional[ArrayLike] = None, rotary_sin: Optional[ArrayLike] = None,
                  rotary_interleaved: object = False, precision: object = None,
                  ) -> tuple[EntriesCall, Appends, np.dtype[Any]]:
    """The entries call over the pages after the append, the append, and
    the result dtype."""
    k_pages, v_pages = check_storage(k_pages, v_pages, ("k_pages", "v_pages"),
                                     "(n_pages, H_kv, page_size, d)",
                                     _PAGE_AXES, "pages")
    if k_pages.shape[2] < 1:
        raise ValueError(f"page_size (axis 2 of k_pages {k_pages.shape}) must be >= 1")
    n_pages, n_kv_heads, page_size, d_k = k_pages.shape
    d_v = v_pages.shape[3]
    q = as_input(q, "q")
    table = array(block_table, "block_table")
    if table.dtype.kind not in "iu" or table.ndim != 2:
        raise ValueError(f"block_table must be a 2-D integer array (B, max_pages); got "
                         f"shape {table.shape}, dtype {table.dtype}")
    n_seq, max_pages = table.shape
    packed = cu_seqlens_q is not None
    cu_q = None
    if packed:
        if q.ndim != 3 or q.shape[2] != d_k:
            raise ValueError(f"with cu_seqlens_q, q must be packed (total_q, H, d_k) = "
                             f"(total_q, H, {d_k}); got {q.shape}")
        cu_q = cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "total_q (q.shape[0])")
        if cu_q.size != n_seq + 1:
            raise ValueError(f"cu_seqlens_q describes {cu_q.size - 1} sequences, "
                             f"block_table {table.shape} {n_seq}")
        q_lengths = np.diff(cu_q)
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
    half = is_half(k_pages.dtype) and (is_half(q.dtype) or q.dtype == np.float32)
    int8 = k_pages.dtype == np.int8
    fp8 = is_fp8(k_pages.dtype)
    written_scales = check_scales(k_pages, k_scale, v_scale, q.dtype, "pages", _PAGE_AXES)
    if (not half and not int8 and not fp8
            and np.result_type(q.dtype, k_pages.dtype) != k_pages.dtype):
        raise TypeError(f"q of dtype {q.dtype} with {k_pages.dtype} pages would convert "
                        "(copy) every page; pass q in the pages' dtype")
    lengths = check_cache_lengths(cache_lengths, n_seq, max_pages * page_size)
    compute = store_compute(k_pages.dtype)
    rotary = check_rotary(rotary_cos, rotary_sin, rotary_interleaved, d_k, compute)

    given = new_rows(k_new, v_new)
    if cu_seqlens_k_new is not None and (given is None or not packed):
        raise ValueError("cu_seqlens_k_new goes with packed new rows: pass it with "
                         "cu_seqlens_q, k_new and v_new")
    # the new rows: in q's layout, padded (n_seq, H_kv, T_new, d) with any
    # T_new, or packed (total_new, H_kv, d), sequence b's from
    # cu_seqlens_k_new[b] (by default cu_seqlens_q: as many as its queries)
    cu_new = cu_q
    n_new = np.zeros(n_seq, dtype=np.intp)
    if given is not None:
        if packed and cu_seqlens_k_new is not None:
            cu_new = cu_seqlens(cu_seqlens_k_new, "cu_seqlens_k_new", given[0].shape[0],
                                "total_new (k_new.shape[0])")
            if cu_new.size != n_seq + 1:
                raise ValueError(f"cu_seqlens_k_new describes {cu_new.size - 1} sequences, "
                                 f"block_table {table.shape} {n_seq}")
        for name, new, d in zip(("k_new", "v_new"), given, (d_k, d_v)):
            want: tuple[int, ...]
            if cu_new is not None:
                want = (int(cu_new[-1]), n_kv_heads, d)
            else:
                want = (n_seq, n_kv_heads, given[0].shape[2] if given[0].ndim == 4
                        else q.shape[2], d)
            if new.shape != want:
                against = ("cu_seqlens_k_new" if cu_seqlens_k_new is not None
                           else f"q {q.shape}")
                raise ValueError(f"{name} must have shape {want} to match {against} and "
                                 f"the pages; got {new.shape}")
            check_new_rows_dtype(name, new, k_pages.dtype, "pages")
        n_new = (np.diff(cu_new) if cu_new is not None
                 else np.full(n_seq, given[0].shape[2], dtype=np.intp))
        writable = [k_pages, v_pages, lengths] + [scale for _, scale in written_scales]
        if not all(a.flags.writeable for a in writable if a is not None):
            raise ValueError("k_pages, v_pages, cache_lengths (and k_scale, v_scale) must "
                             "be writable to append")
        refuse_shared_memory(
            [("k_pages", k_pages), ("v_pages", v_pages), ("cache_lengths", lengths)]
            + written_scales,
            [("q", q), ("k_new", given[0]), ("v_new", given[1])])
    # in Python ints: a uint64 length beyond int64 would wrap around in int64
    needed = [int(old) + int(new) for old, new in zip(lengths.tolist(), n_new.tolist())]
    if needed and max(needed) > max_pages * page_size:
        worst = int(np.argmax(needed))
        raise ValueError(
            f"sequence {worst} needs {needed[worst]} positions (cache_lengths "
            f"{int(lengths[worst])} + {int(n_new[worst])} new) but block_table "
            f"{table.shape} gives at most {max_pages} pages of {page_size}")
    old_lengths = lengths.astype(np.int64)
    new_lengths = old_lengths + n_new
    # every page a sequence reads must exist
    used_pages = -(-new_lengths // page_size)
    in_use = np.arange(max_pages) < used_pages[:, None]
    bad = in_use & ((table < 0) | (table >= n_pages))
    if bad.any():
        b, slot = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{b}, {slot}] = {int(table[b, slot])} is not a page id "
                         f"in [0, {n_pages}) (k_pages has {n_pages} pages), and sequence "
                         f"{b} uses it")
    causal = driver.check_flag(causal, "causal")
    return_lse = driver.check_flag(return_lse, "return_lse")
    result = result_dtype(q.dtype, k_pages.dtype)
    options = row_options(causal=causal, scale=scale, d_k=d_k, compute=compute, result=result,
                          window=window, softcap=softcap, precision=precision,
                          num_threads=num_threads)
    head_options(options, alibi_slopes, sinks, n_seq, n_heads, compute)
    # a copy, always: cache_lengths, advanced by the append, may be a view of
    # the caller's table, whose page ids were checked against the old lengths
    table = np.array(table, dtype=np.intp, order="C")
    writes = []
    if given is not None:
        _refuse_clashing_writes(table, old_lengths, n_new, page_size, n_pages)
    if out is not None:
        out = check_out(out, q.shape[:-1] + (d_v,), result,
                        [("q", q), ("k_pages", k_pages), ("v_pages", v_pages),
                         ("cache_lengths", lengths), ("k_scale", k_scale), ("v_scale", v_scale)]
                        + ([("k_new", given[0]), ("v_new", given[1])] if given else []))
    starts = None
    if kv_starts is not None:
        starts = check_sequence_starts(kv_starts, n_seq, max_pages * page_size,
                                       f"the positions block_table {table.shape} gives")
    if rotary is not None:
        q, options.rotary, given = _rotated(rotary, q, given, cu_q, cu_new, q_lengths,
                                            old_lengths, n_new)
    if given is not None:
        seq_index = cu_new[:-1] if cu_new is not None else np.arange(n_seq, dtype=np.intp)
        at = _places_of_new_rows(table, old_lengths, n_new, cu_new, page_size, n_kv_heads)
        writes = (as_stored("k_new (rotated)" if rotary is not None else "k_new", given[0],
                            k_pages, k_scale, seq_index, at)
                  + as_stored("v_new", given[1], v_pages, v_scale, seq_index, at))
    appends = Appends(lengths, old_lengths.astype(np.intp), n_new.astype(np.intp), writes,
                      table.reshape(-1), max_pages)
    attn, lse = outputs(q, cu_q, n_seq, n_heads, d_v, compute, return_lse, out)
    zeros = np.zeros(n_seq, dtype=np.intp)
    if fp8:
        # the scales as the entries read them: of the pages' first three
        # axes (1 where none is given)
        k_scale, v_scale = fp8_read_scale(k_scale, k_pages), fp8_read_scale(v_scale, v_pages)
    call = EntriesCall(
        queries(q, cu_q, compute), place(k_pages, zeros, 2, 1, 0), place(v_pages, zeros, 2, 1, 0),
        attn, lse,
        place(k_scale[..., None], zeros, 2, 1, 0) if k_scale is not None else None,
        place(v_scale[..., None], zeros, 2, 1, 0) if v_scale is not None else None,
        np.ascontiguousarray(q_lengths, np.intp), new_lengths.astype(np.intp), n_heads,
        n_kv_heads, d_k, d_v, options, table.reshape(-1), max_pages, page_size, starts, out)
    return call, appends, result


def _rotated(rotary: Rotary, q: _Array, given: Optional[tuple[_Array, _Array]],
             cu_q: Optional[_Intp], cu_new: Optional[_Intp], q_lengths: _Intp,
             old_lengths: NDArray[np.int64], n_new: _Intp,
             ) -> tuple[_Array, Optional[tuple[Any, ...]], Optional[tuple[_Array, _Array]]]:
    """q (and the tables the driver rotates it with as it reads it) and the
    new rows, their keys rotated: sequence b's queries are the last of its
    positions after the append (bottom-right, as the causal mask aligns
    them), its new keys those from old_lengths[b]."""
    new_lengths = (old_lengths + n_new).astype(np.intp)
    old = old_lengths.astype(np.intp)
    q_seq, q_row = _rows_of(cu_q, q_lengths, q.shape[2] if q.ndim == 4 else 0)
    q, tables = rotate_queries(q, rotary, new_lengths[q_seq] - q_lengths[q_seq] + q_row, q_seq)
    if given is None:
        return q, tables, None
    k_new, v_new = given
    k_seq, k_row = _rows_of(cu_new, n_new, k_new.shape[2] if k_new.ndim == 4 else 0)
    return q, tables, (rotary.rotate(k_new, old[k_seq] + k_row, k_seq, "k_new"), v_new)


def _rows_of(cu: Optional[_Intp], counts: _Intp, n_rows: int) -> tuple[_Intp, _Intp]:
    """(sequence, row within it) of each row: packed, of the rows from
    cu[b] (shape (total,)); padded, n_rows each (shape (n_seq, n_rows))."""
    if cu is None:
        grid = np.indices((counts.size, n_rows), dtype=np.intp)
        return grid[0], grid[1]
    sequence = np.repeat(np.arange(counts.size, dtype=np.intp), counts)
    return sequence, np.arange(sequence.size, dtype=np.intp) - cu[:-1][sequence]


def _places_of_new_rows(table: _Intp, old_lengths: NDArray[np.int64], n_new: _Intp,
                        cu_new: Optional[_Intp], page_size: int,
                        n_kv_heads: int) -> tuple[_Array, _Array, _Array]:
    """(page, head, row in page) of each new row: padded rows (n_seq,
    H_kv, T_new), or packed (total_new, H_kv) when cu_new is given."""
    heads = np.arange(n_kv_heads)
    if cu_new is None:
        positions = old_lengths[:, None] + np.arange(int(n_new.max(initial=0)))
        sequence = np.arange(table.shape[0])[:, None]
        pages = table[sequence, positions // page_size]
        return pages[:, None, :], heads[None, :, None], (positions % page_size)[:, None, :]
    sequence = np.repeat(np.arange(table.shape[0]), n_new)
    positions = old_lengths[sequence] + np.arange(sequence.size) - cu_new[:-1][sequence]
    pages = table[sequence, positions // page_size]
    return pages[:, None], heads[None, :], (positions % page_size)[:, None]


def _refuse_clashing_writes(table: _Intp, old_lengths: NDArray[np.int64], n_new: _Intp,
                            page_size: int, n_pages: int) -> None:
    """No two new rows land on one page row, and no new row on a page row
    some sequence holds (one of its first old_lengths positions): that
    sequence would read the new row in place of its own, silently. Pages
    shared for a common prefix are fine as long as every sequence appends
    past them."""
    n_seq = table.shape[0]
    seq_of_row = np.repeat(np.arange(n_seq), n_new)
    first_row = np.repeat(np.cumsum(n_new) - n_new, n_new)
    position = old_lengths[seq_of_row] + np.arange(seq_of_row.size) - first_row
    page = table[seq_of_row, position // page_size]
    row = position % page_size
    slots = page * page_size + row
    if np.unique(slots).size != slots.size:
        raise ValueError("two new rows would be written to one page row: the block "
                         "table gives two sequences the same page where both append")
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


@dataclasses.dataclass
class SlotWrites:
    """New rows bound for page slots, checked: each Write's row i goes to
    row ``start[i]`` of page ``page_ids[i]`` (``n_new``: ones, one row per
    slot, as the append loop counts them)."""

    writes: list[Write]
    start: _Intp
    n_new: _Intp
    page_ids: _Intp


def prepare_slot_append(k_pages: object, v_pages: object, slot_mapping: ArrayLike,
                        k_new: ArrayLike, v_new: ArrayLike, k_scale: Optional[_Array],
                        v_scale: Optional[_Array]) -> SlotWrites:
    """The writes of ``paged_append``, every check made: row i of k_new and
    v_new goes to slot ``slot_mapping[i]`` (page ``slot // page_size``, row
    ``slot % page_size``), a negative slot marking a row to skip."""
    k_pages, v_pages = check_storage(k_pages, v_pages, ("k_pages", "v_pages"),
                                     "(n_pages, H_kv, page_size, d)",
                                     _PAGE_AXES, "pages")
    n_pages, n_kv_heads, page_size, d_k = k_pages.shape
    d_v = v_pages.shape[3]
    given = new_rows(k_new, v_new)
    if given is None:
        raise ValueError("paged_append needs the rows to write: k_new and v_new")
    slots = array(slot_mapping, "slot_mapping")
    if slots.dtype.kind not in "iu" or slots.ndim != 1:
        raise ValueError(f"slot_mapping must be a 1-D integer array, one slot per new row; "
                         f"got shape {slots.shape}, dtype {slots.dtype}")
    for name, new, d in zip(("k_new", "v_new"), given, (d_k, d_v)):
        want = (slots.size, n_kv_heads, d)
        if new.shape != want:
            raise ValueError(f"{name} must have shape {want} (n_rows, H_kv, d) to match "
                             f"slot_mapping {slots.shape} and the pages; got {new.shape}")
        check_new_rows_dtype(name, new, k_pages.dtype, "pages")
    written_scales = check_scales(k_pages, k_scale, v_scale, np.dtype(np.float32), "pages",
                                  _PAGE_AXES)
    capacity = n_pages * page_size
    # (in Python ints, before any cast: a uint64 slot past int64 would wrap)
    if slots.size and int(slots.max()) >= capacity:
        row = int(np.argmax(slots))
        raise ValueError(f"slot_mapping[{row}] = {int(slots[row])} is past the last slot "
                         f"{capacity - 1} ({n_pages} pages of {page_size})")
    slots = slots.astype(np.int64)
    used = slots >= 0
    if not used.all():
        # padding rows are neither converted nor checked: only what is written
        given = (given[0][used], given[1][used])
        slots = slots[used]
    if np.unique(slots).size != slots.size:
        values, counts = np.unique(slots, return_counts=True)
        raise ValueError(f"slot {int(values[counts > 1][0])} is given to more than one new "
                         "row of slot_mapping: which row it holds would depend on the order "
                         "of the writes")
    writable = [k_pages, v_pages] + [scale for _, scale in written_scales]
    if not all(a.flags.writeable for a in writable if a is not None):
        raise ValueError("k_pages, v_pages (and k_scale, v_scale) must be writable to append")
    refuse_shared_memory(
        [("k_pages", k_pages), ("v_pages", v_pages)] + written_scales,
        [("k_new", given[0]), ("v_new", given[1])])
    row_index = np.arange(slots.size, dtype=np.intp)
    at = ((slots // page_size)[:, None], np.arange(n_kv_heads)[None, :],
          (slots % page_size)[:, None])
    writes = (as_stored("k_new", given[0], k_pages, k_scale, row_index, at)
              + as_stored("v_new", given[1], v_pages, v_scale, row_index, at))
    return SlotWrites(writes, (slots % page_size).astype(np.intp),
                      np.ones(slots.size, dtype=np.intp), (slots // page_size).astype(np.intp))
