"""Sequences of their own lengths (packed variable-length batches, paged KV
caches), checked into an :class:`EntriesCall`: where each sequence's rows
lie (:class:`Place`), how many query rows and valid keys it has, and the
options per (sequence, query head). The driver turns it into entry tables
(``_driver/from_entries.pxd``), the same builder the compiled paged step
uses."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .arrays import (array, as_input, check_out, compute_dtype, native, output, to_compute,
                     to_result, writes_in_place)
from .fp8 import kv_scale
from .options import RowOptions, check_alibi_values, check_sink_values, row_options

_Array = NDArray[Any]
_Intp = NDArray[np.intp]


@dataclasses.dataclass
class Place:
    """Row t of head h of sequence i at ``seq_offset[i] + t * t_stride + h *
    h_stride`` elements from the data of ``array`` (a paged K/V: rows
    through the pages, ``page_stride`` elements per page id)."""

    array: _Array
    seq_offset: _Intp
    t_stride: int
    h_stride: int
    col_stride: int
    page_stride: int = 0


def place(arr: _Array, seq_index: _Intp, t_axis: int, h_axis: int,
          page_axis: Optional[int] = None) -> Place:
    """The Place of arr whose sequence i starts at index seq_index[i] of its
    first axis (all 0 for pages)."""
    item = arr.itemsize
    return Place(arr, np.ascontiguousarray(seq_index * (arr.strides[0] // item), np.intp),
                 arr.strides[t_axis] // item, arr.strides[h_axis] // item,
                 arr.strides[-1] // item,
                 arr.strides[page_axis] // item if page_axis is not None else 0)


@dataclasses.dataclass
class EntriesCall:
    """A call over sequences of their own lengths, checked."""

    q: Place
    k: Place
    v: Place
    out: Place
    lse: Optional[Place]
    k_scale: Optional[Place]         # int8 / fp8 K/V: their row scales
    v_scale: Optional[Place]
    q_lengths: _Intp
    kv_lengths: _Intp
    n_heads: int
    n_kv_heads: int
    d_k: int
    d_v: int
    options: RowOptions              # alibi and sinks per (sequence, query head)
    page_ids: Optional[_Intp] = None     # a paged K/V's block table, flattened
    pages_per_seq: int = 0
    page_size: int = 0
    kv_starts: Optional[_Intp] = None    # the first valid key of each sequence
    out_given: Optional[_Array] = None   # the caller's out=, when out is not it


def cu_seqlens(values: object, name: str, total: int, total_name: str) -> _Intp:
    """n_seq + 1 cumulative offsets: integers, from 0, non-decreasing, to total."""
    if values is None:
        raise TypeError(f"{name} must be an integer array, got None")
    arr = array(values, name)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array; got dtype {arr.dtype}")
    if arr.ndim != 1 or arr.size < 1:
        raise ValueError(f"{name} must be 1-D with n_seq + 1 >= 1 offsets; got shape "
                         f"{arr.shape}")
    # checked in Python ints: a uint64 beyond int64 would wrap around
    if int(arr[0]) != 0 or int(arr[-1]) != total:
        raise ValueError(f"{name} must start at 0 and end at {total_name} = {total}; got "
                         f"{int(arr[0])} ... {int(arr[-1])}")
    if int(arr.max()) > total:
        raise ValueError(f"{name} must be non-decreasing; got {arr.tolist()}")
    offsets = arr.astype(np.int64)
    if np.any(np.diff(offsets) < 0):
        raise ValueError(f"{name} must be non-decreasing; got {offsets.tolist()}")
    return offsets.astype(np.intp)


def _per_head(values: Optional[ArrayLike], n_seq: int, n_heads: int,
              name: str) -> Optional[NDArray[np.float64]]:
    """alibi_slopes or sinks as float64: one real number per query head,
    shape (H,), or per (sequence, query head), (n_seq, H), or a shape that
    broadcasts to it."""
    if values is None:
        return None
    arr = native(array(values, name))
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be real numbers, got dtype {arr.dtype}")
    target = (n_seq, n_heads)
    try:
        fits = arr.ndim <= 2 and np.broadcast_shapes(arr.shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name} must hold one real number per query head, shape "
                         f"({n_heads},), or one per sequence and query head, shape "
                         f"({n_seq}, {n_heads}); got shape {arr.shape}, dtype {arr.dtype}")
    return arr.astype(np.float64)


def _per_sequence_and_head(values: NDArray[np.float64], n_seq: int,
                           n_heads: int) -> NDArray[np.float64]:
    """values broadcast to (n_seq, H), flattened in (sequence, head) order."""
    return np.ascontiguousarray(np.broadcast_to(values, (n_seq, n_heads))).reshape(-1)


def head_options(options: RowOptions, alibi_slopes: Optional[ArrayLike],
                 sinks: Optional[ArrayLike], n_seq: int, n_heads: int,
                 compute: np.dtype[Any]) -> None:
    """ALiBi slopes and sink logits per (sequence, query head), checked (and
    the sinks fitted to the compute dtype) as a dense call checks them."""
    alibi = _per_head(alibi_slopes, n_seq, n_heads, "alibi_slopes")
    if alibi is not None:
        check_alibi_values(alibi, compute)
        options.alibi = _per_sequence_and_head(alibi, n_seq, n_heads)
    sink_logits = _per_head(sinks, n_seq, n_heads, "sinks")
    if sink_logits is not None:
        sink_logits = check_sink_values(sink_logits, compute)
        options.sinks = _per_sequence_and_head(sink_logits, n_seq, n_heads)


def outputs(q: _Array, cu_q: Optional[_Intp], n_seq: int, n_heads: int, d_v: int,
            compute: np.dtype[Any], want_lse: bool,
            given: Optional[_Array] = None) -> tuple[Place, Optional[Place]]:
    """ATTN (and LSE) in q's layout, packed ((total_q, H, ...), sequence i
    from row cu_q[i]) or padded ((n_seq, H, T, ...)), as Places: ATTN in the
    caller's out= (given, checked) where the driver writes it as it lies."""
    if cu_q is not None:
        out = (given if given is not None and given.dtype == compute
               and writes_in_place(given)
               else output((q.shape[0], n_heads, d_v), compute, "the output"))
        lse = output((q.shape[0], n_heads), compute, "the log-sum-exp") if want_lse else None
        starts = cu_q[:-1]
        return (place(out, starts, 0, 1),
                place(lse, starts, 0, 1) if lse is not None else None)
    n_queries = q.shape[2]
    out = (given if given is not None and given.dtype == compute and writes_in_place(given)
           else output((n_seq, n_heads, n_queries, d_v), compute, "the output"))
    lse = (output((n_seq, n_heads, n_queries), compute, "the log-sum-exp")
           if want_lse else None)
    seqs = np.arange(n_seq, dtype=np.intp)
    return place(out, seqs, 2, 1), (place(lse, seqs, 2, 1) if lse is not None else None)


def queries(q: _Array, cu_q: Optional[_Intp], compute: np.dtype[Any]) -> Place:
    """q in the compute dtype as a Place, packed or padded like outputs."""
    q = to_compute(q, compute)
    if cu_q is not None:
        return place(q, cu_q[:-1], 0, 1)
    return place(q, np.arange(q.shape[0], dtype=np.intp), 2, 1)


def run(call: EntriesCall, result: np.dtype[Any]) -> tuple[_Array, Optional[_Array]]:
    """ATTN (as ``result``, in the caller's out= when given) and the LSE (or
    None) of a checked call."""
    out = call.out.array
    lse = call.lse.array if call.lse is not None else None
    # with d_v = 0 there is no output to write, but there are LSEs
    if out.size or (lse is not None and lse.size):
        driver.run_entries(call)
    if call.out_given is not None:
        if out is not call.out_given:
            # another dtype (rounded once, to nearest even) or layout
            to_result(out, call.out_given.dtype, call.out_given)
        return call.out_given, lse
    if result != out.dtype:
        out = to_result(out, result)
    return out, lse


def prepare_varlen(q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike,
                   cu_seqlens_k: ArrayLike, *, causal: object, scale: Optional[float],
                   window: Any, softcap: Optional[float], alibi_slopes: Optional[ArrayLike],
                   sinks: Optional[ArrayLike], enable_gqa: object, return_lse: object,
                   num_threads: Any, out: Optional[_Array] = None,
                   k_scale: Optional[ArrayLike] = None, v_scale: Optional[ArrayLike] = None,
                   precision: object = None) -> tuple[EntriesCall, np.dtype[Any]]:
    """A packed variable-length call, checked; and its result dtype."""
    q = as_input(q, "q")
    k = as_input(k, "k")
    v = as_input(v, "v")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if arr.ndim != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, features); got shape "
                             f"{arr.shape}")
    total_q, n_heads, d_k = q.shape
    total_k, n_kv_heads, _ = k.shape
    if k.shape[2] != d_k:
        raise ValueError(f"q {q.shape} and k {k.shape} must share d_k (last dimension)")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k {k.shape} and v {v.shape} must share (total_k, H_kv)")
    enable_gqa = driver.check_flag(enable_gqa, "enable_gqa")
    if n_heads != n_kv_heads:
        if not enable_gqa:
            raise ValueError(
                f"q has {n_heads} heads and k {n_kv_heads} (q {q.shape}, k {k.shape}); "
                "for grouped-query attention pass enable_gqa=True")
        if n_kv_heads == 0 or n_heads % n_kv_heads:
            raise ValueError(f"enable_gqa: the query heads ({n_heads}, q {q.shape}) must "
                             f"be a multiple of the key/value heads ({n_kv_heads}, "
                             f"k {k.shape})")
    cu_q = cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q, "total_q (q.shape[0])")
    cu_k = cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k, "total_k (k.shape[0])")
    if cu_q.size != cu_k.size:
        raise ValueError(f"cu_seqlens_q ({cu_q.size - 1} sequences) and cu_seqlens_k "
                         f"({cu_k.size - 1} sequences) must describe as many sequences")
    causal = driver.check_flag(causal, "causal")
    return_lse = driver.check_flag(return_lse, "return_lse")
    # int8 K/V (with a float q) and fp8 K/V are read with their scales
    ks = kv_scale(k, k_scale, "k", q.dtype)
    vs = kv_scale(v, v_scale, "v", q.dtype)
    compute, result = compute_dtype(q, k, v)
    if compute != np.float32 and (ks is not None or vs is not None):
        raise TypeError(f"int8 and fp8 K/V are computed in float32, but these inputs compute "
                        f"in {compute} (q {q.dtype}, k {k.dtype}, v {v.dtype})")
    options = row_options(causal=causal, scale=scale, d_k=d_k, compute=compute, result=result,
                          window=window, softcap=softcap, precision=precision,
                          num_threads=num_threads)
    n_seq = cu_q.size - 1
    head_options(options, alibi_slopes, sinks, n_seq, n_heads, compute)
    d_v = v.shape[2]
    if out is not None:
        out = check_out(out, (total_q, n_heads, d_v), result,
                        [("q", q), ("k", k), ("v", v), ("k_scale", ks), ("v_scale", vs)])
    attn, lse = outputs(q, cu_q, n_seq, n_heads, d_v, compute, return_lse, out)
    starts_k = cu_k[:-1]
    call = EntriesCall(queries(q, cu_q, compute),
                       place(k if ks is not None else to_compute(k, compute), starts_k, 0, 1),
                       place(v if vs is not None else to_compute(v, compute), starts_k, 0, 1),
                       attn, lse,
                       place(ks, starts_k, 0, 1) if ks is not None else None,
                       place(vs, starts_k, 0, 1) if vs is not None else None,
                       np.diff(cu_q), np.diff(cu_k), n_heads,
                       n_kv_heads, d_k, d_v, options, out_given=out)
    return call, result
