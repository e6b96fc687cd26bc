"""Entry tables: sequences of their own lengths (packed variable-length
batches, paged KV caches) as the driver's batch entries.

A call over ``n_seq`` sequences and H query heads becomes one or two tables
(:class:`Entries`), each one run of the driver:

- sequences with one new query row, when the heads are grouped (H > H_kv):
  one entry per (sequence, K/V head), its G query heads stacked as rows, so
  that each K/V head's keys are read once per decode step;
- every other sequence: one entry per (sequence, query head), its rows its
  own, reading the K/V of head h // G (entries of one K/V head share its
  packed copy).

Sequences with no query row give no entry. Where a row lives is described
per sequence (:class:`Place`: an offset per sequence, element strides along
the token and head axes), so a packed ``(total, H, d)`` array and a padded
``(B, H, T, d)`` one are the same to the driver.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _attention

_Intp = NDArray[np.intp]


@dataclasses.dataclass
class Place:
    """Row t of head h of sequence i at ``seq_offset[i] + t * t_stride +
    h * h_stride`` elements from the data of ``array``."""

    array: NDArray[Any]
    seq_offset: _Intp
    t_stride: int
    h_stride: int


@dataclasses.dataclass
class Rows:
    """An operand as the driver reads it: entry b's rows start at its offset
    and are ``row_stride`` elements apart, features ``col_stride`` apart; a
    paged K/V also steps ``page_stride`` elements per page id. int8 K/V
    carry their float32 row scales, addressed alike."""

    array: NDArray[Any]
    row_stride: int
    col_stride: int
    page_stride: int = 0
    scale: NDArray[np.float32] | None = None
    scale_offset: _Intp | None = None
    scale_stride: int = 0
    scale_page_stride: int = 0


@dataclasses.dataclass
class Entries:
    """One driver run: per entry (intp arrays of one value per entry) where
    its query rows, K/V rows, ATTN and LSE rows start, how many query rows
    (None: all have n_queries) and valid keys it has, and which packed K/V
    it reads (kv_index, numbered 0..n_kv-1)."""

    n_queries: int
    n_keys: int
    n_kv: int
    q_offset: _Intp
    q_rows: _Intp | None
    q_row_stride: int
    k_offset: _Intp
    v_offset: _Intp
    kv_index: _Intp
    kv_length: _Intp
    out_offset: _Intp
    ld_out: int
    lse_offset: _Intp | None
    ld_lse: int
    query_period: int = 0            # > 0: stacked heads, rows repeat positions
    alibi: NDArray[np.float64] | None = None     # per entry
    sinks: NDArray[np.float64] | None = None     # per group of query_period rows
    page_ids: _Intp | None = None    # the block table, flattened
    page_first: _Intp | None = None  # where each entry's row of it starts
    page_size: int = 0
    k_scale_offset: _Intp | None = None
    v_scale_offset: _Intp | None = None


def _intp(x: Any) -> _Intp:
    return np.ascontiguousarray(x, dtype=np.intp)


def plan(q: Place, k: Place, v: Place, out: Place, lse: Place | None,
         q_lengths: _Intp, kv_lengths: _Intp, n_heads: int, n_kv_heads: int, *,
         alibi: NDArray[np.float64] | None, sinks: NDArray[np.float64] | None,
         pages: tuple[_Intp, int, int] | None = None,
         k_scale: Place | None = None, v_scale: Place | None = None) -> list[Entries]:
    """The tables of a call: q_lengths[i] query rows and kv_lengths[i] keys
    for sequence i; alibi and sinks one per query head (or None). ``pages``
    is (block_table flattened, its row length, page_size) when K and V are
    paged (k and v then hold the K/V-head offset only)."""
    group = n_heads // n_kv_heads
    q_lengths = _intp(q_lengths)
    decode = q_lengths == 1
    stack = group > 1 and group <= _attention.DIRECT_QUERY_ROWS and alibi is None
    tables = []
    if stack:
        stacked = np.flatnonzero(decode)
        rest = np.flatnonzero(q_lengths > 1)
        if stacked.size:
            tables.append(_stacked(stacked, q, k, v, out, lse, kv_lengths, n_kv_heads,
                                   group, sinks, pages, k_scale, v_scale))
    else:
        rest = np.flatnonzero(q_lengths > 0)
    if rest.size:
        tables.append(_per_head(rest, q, k, v, out, lse, q_lengths, kv_lengths, n_heads,
                                group, alibi, sinks, pages, k_scale, v_scale))
    return tables


def _kv_fields(seqs: _Intp, kv_head: _Intp, k: Place, v: Place,
               pages: tuple[_Intp, int, int] | None, k_scale: Place | None,
               v_scale: Place | None) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "k_offset": _intp(k.seq_offset[seqs] + kv_head * k.h_stride),
        "v_offset": _intp(v.seq_offset[seqs] + kv_head * v.h_stride),
    }
    if pages is not None:
        table, width, page_size = pages
        fields.update(page_ids=table, page_first=_intp(seqs * width), page_size=page_size)
    if k_scale is not None:
        fields["k_scale_offset"] = _intp(k_scale.seq_offset[seqs] + kv_head * k_scale.h_stride)
    if v_scale is not None:
        fields["v_scale_offset"] = _intp(v_scale.seq_offset[seqs] + kv_head * v_scale.h_stride)
    return fields


def _stacked(seqs: _Intp, q: Place, k: Place, v: Place, out: Place, lse: Place | None,
             kv_lengths: _Intp, n_kv_heads: int, group: int,
             sinks: NDArray[np.float64] | None, pages: tuple[_Intp, int, int] | None,
             k_scale: Place | None, v_scale: Place | None) -> Entries:
    """Entries (sequence, K/V head) with the G query heads of one new token
    as rows."""
    seq = np.repeat(seqs, n_kv_heads)
    kv_head = np.tile(np.arange(n_kv_heads, dtype=np.intp), seqs.size)
    first_head = kv_head * group
    return Entries(
        n_queries=group, n_keys=int(kv_lengths.max(initial=0)), n_kv=seq.size,
        q_offset=_intp(q.seq_offset[seq] + first_head * q.h_stride), q_rows=None,
        q_row_stride=q.h_stride, kv_index=np.arange(seq.size, dtype=np.intp),
        kv_length=_intp(kv_lengths[seq]),
        out_offset=_intp(out.seq_offset[seq] + first_head * out.h_stride),
        ld_out=out.h_stride,
        lse_offset=(_intp(lse.seq_offset[seq] + first_head * lse.h_stride)
                    if lse is not None else None),
        ld_lse=lse.h_stride if lse is not None else 1,
        query_period=1,
        sinks=(np.ascontiguousarray(np.tile(sinks, seqs.size), dtype=np.float64)
               if sinks is not None else None),
        **_kv_fields(seq, kv_head, k, v, pages, k_scale, v_scale))


def _per_head(seqs: _Intp, q: Place, k: Place, v: Place, out: Place, lse: Place | None,
              q_lengths: _Intp, kv_lengths: _Intp, n_heads: int, group: int,
              alibi: NDArray[np.float64] | None, sinks: NDArray[np.float64] | None,
              pages: tuple[_Intp, int, int] | None, k_scale: Place | None,
              v_scale: Place | None) -> Entries:
    """Entries (sequence, query head), each with its sequence's rows."""
    seq = np.repeat(seqs, n_heads)
    head = np.tile(np.arange(n_heads, dtype=np.intp), seqs.size)
    n_kv_heads = n_heads // group
    kv_head = head // group
    rows = _intp(q_lengths[seq])
    return Entries(
        n_queries=int(rows.max()), n_keys=int(kv_lengths[seqs].max(initial=0)),
        n_kv=seqs.size * n_kv_heads,
        q_offset=_intp(q.seq_offset[seq] + head * q.h_stride), q_rows=rows,
        q_row_stride=q.t_stride,
        kv_index=_intp(np.repeat(np.arange(seqs.size, dtype=np.intp), n_heads) * n_kv_heads
                       + kv_head),
        kv_length=_intp(kv_lengths[seq]),
        out_offset=_intp(out.seq_offset[seq] + head * out.h_stride), ld_out=out.t_stride,
        lse_offset=(_intp(lse.seq_offset[seq] + head * lse.h_stride)
                    if lse is not None else None),
        ld_lse=lse.t_stride if lse is not None else 1,
        alibi=(np.ascontiguousarray(np.tile(alibi, seqs.size), dtype=np.float64)
               if alibi is not None else None),
        sinks=(np.ascontiguousarray(np.tile(sinks, seqs.size), dtype=np.float64)
               if sinks is not None else None),
        **_kv_fields(seq, kv_head, k, v, pages, k_scale, v_scale))


def run(tables: list[Entries], q: Rows, k: Rows, v: Rows, out: NDArray[Any],
        lse: NDArray[Any] | None, *, causal: bool, scale: float, threads: int,
        window: tuple[int, int], softcap: float) -> None:
    """Run each table into out (and lse)."""
    for table in tables:
        q_rows = dataclasses.replace(q, row_stride=table.q_row_stride)
        k_rows = dataclasses.replace(k, scale_offset=table.k_scale_offset)
        v_rows = dataclasses.replace(v, scale_offset=table.v_scale_offset)
        _attention.attention_entries_into(
            q_rows, k_rows, v_rows, table, causal, scale, out, lse, threads,
            window[0], window[1], softcap)
