"""Dense calls: q, k, v (and a mask) whose leading dimensions broadcast to
one batch, checked once into a :class:`DenseCall` (prepare_dense) that
``run`` hands to the driver as it is.

Grouped-query heads (q with H heads, K and V with H_kv) need no views:
the driver's batch offsets send query head h to K/V head h // G. A decode
step instead stacks the G query heads' rows as the rows of their one K/V
head, so that its keys and values are read once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .arrays import (array, as_input, broadcast_shapes, check_out, compute_dtype, gqa_hint,
                     output, prepare_mask, to_compute, to_result, view_as, writes_in_place)
from .fp8 import kv_scale
from .options import (RowOptions, per_entry_alibi, per_entry_key_positions,
                      per_entry_query_offset, per_entry_sinks, per_sequence, row_options)

_Array = NDArray[Any]


@dataclasses.dataclass
class DenseCall:
    """A dense call, checked: operands as the driver reads them (the compute
    dtype, or float16 / bfloat16 q, K and V and int8 K and V read as they
    are, bfloat16 as the uint16 of its bits), their batch, and
    the outputs it fills."""

    q: _Array
    k: _Array
    v: Optional[_Array]              # None: SCORES alone
    mask: Optional[_Array]
    k_scale: Optional[_Array]        # int8 / fp8 K/V: row scales, features axis of size 1
    v_scale: Optional[_Array]
    batch_shape: tuple[int, ...]
    kv_group: int                    # G > 1: query head h reads K/V head h // G
    query_period: int                # > 0: rows are stacked groups of this many positions
    kv_lengths: Optional[NDArray[np.intp]]   # per batch entry
    kv_starts: Optional[NDArray[np.intp]]    # per batch entry
    options: RowOptions
    compute: np.dtype[Any]
    result: np.dtype[Any]            # the dtype returned (float16 or bfloat16 in:
                                     # the same out)
    result_shape: tuple[int, ...]    # leading shape of the results (the stacked
                                     # batch is q's again)
    want_out: bool
    want_scores: bool
    want_lse: bool
    out: Optional[_Array] = None     # the caller's array for ATTN (out=)
    query_offset: Optional[NDArray[np.intp]] = None   # per batch entry: the key
                                     # position of query row 0 (None: bottom-right)


Results = tuple[Optional[_Array], Optional[_Array], Optional[_Array]]


def _group_heads(q: _Array, k: _Array, v: Optional[_Array]) -> int:
    """G for grouped-query attention: q has H heads on axis -3, k and v
    H_kv, H a multiple of H_kv."""
    operands = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, arr in operands:
        if arr.ndim < 3:
            raise ValueError(
                "enable_gqa needs a head axis (-3) on q, k and v; "
                f"{name} has shape {arr.shape}")
    n_heads, n_kv_heads = q.shape[-3], k.shape[-3]
    if v is not None and v.shape[-3] != n_kv_heads:
        raise ValueError(
            f"enable_gqa: k and v must have the same number of heads (axis -3): "
            f"k has shape {k.shape}, v has shape {v.shape}")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(
            f"enable_gqa: the query heads ({n_heads}, q shape {q.shape}) must be a "
            f"multiple of the key/value heads ({n_kv_heads}, k shape {k.shape})")
    return int(n_heads // n_kv_heads)


def _per_query_head(arr: Any, n_heads: int, what: str, q_shape: tuple[int, ...]) -> None:
    """Under grouped heads, a per-entry option or mask has a head axis of
    H or 1."""
    if arr is None:
        return
    shape = array(arr, what).shape
    if what == "mask":
        if len(shape) >= 3 and shape[-3] not in (1, n_heads):
            raise ValueError(
                f"mask of shape {shape} does not broadcast to the {n_heads} query heads "
                f"of q (shape {q_shape})")
    elif len(shape) > 0 and shape[-1] not in (1, n_heads):
        raise ValueError(
            f"{what} of shape {shape} does not broadcast to the batch dimensions "
            f"{q_shape[:-2]} of q")


def prepare_dense(q: ArrayLike, k: ArrayLike, v: Optional[ArrayLike], *, causal: bool,
                  mask: Optional[ArrayLike], scale: Optional[float], want_out: bool,
                  want_scores: bool, want_lse: bool, enable_gqa: bool,
                  num_threads: Optional[SupportsIndex], kv_lengths: Optional[ArrayLike],
                  window: Any, softcap: Optional[float], alibi_slopes: Optional[ArrayLike],
                  sinks: Optional[ArrayLike], k_scale: Optional[ArrayLike],
                  v_scale: Optional[ArrayLike], kv_starts: Optional[ArrayLike] = None,
                  out: Optional[_Array] = None,
                  query_offset: Optional[ArrayLike] = None,
                  precision: object = None) -> DenseCall:
    """Every check of a dense call, in the order its errors are reported."""
    q = as_input(q, "q")
    k = as_input(k, "k")
    if v is not None:
        v = as_input(v, "v")
    ks = kv_scale(k, k_scale, "k", q.dtype)
    vs = None
    if v is not None:
        vs = kv_scale(v, v_scale, "v", q.dtype)
    elif v_scale is not None:
        raise ValueError("v_scale is given without v")
    if kv_lengths is not None:
        kv_lengths = per_sequence(kv_lengths, q, k, v, mask, "kv_lengths")
    if kv_starts is not None:
        kv_starts = per_sequence(kv_starts, q, k, v, mask, "kv_starts")
    if query_offset is not None:
        query_offset = per_sequence(query_offset, q, k, v, mask, "query_offset")
    given = [a for a in (kv_lengths, kv_starts, query_offset) if a is not None]
    operands = (q, k) if v is None else (q, k, v)
    compute, result = compute_dtype(*operands)
    group = _group_heads(q, k, v) if enable_gqa else 1
    n_heads = q.shape[-3] if enable_gqa else 1
    if enable_gqa:
        for what, arr in (("mask", mask), ("kv_lengths", kv_lengths), ("kv_starts", kv_starts),
                          ("query_offset", query_offset), ("alibi_slopes", alibi_slopes),
                          ("sinks", sinks)):
            _per_query_head(arr, n_heads, what, q.shape)

    n_queries, d_k = q.shape[-2:]
    n_keys = k.shape[-2]
    if k.shape[-1] != d_k:
        raise ValueError(
            f"q and k must share d_k (their last dimension): q has shape {q.shape}, "
            f"k has shape {k.shape}")
    if v is not None and v.shape[-2] != n_keys:
        raise ValueError(
            f"k and v must have the same number of keys S (second-to-last "
            f"dimension): k has shape {k.shape}, v has shape {v.shape}")
    if compute != np.float32 and (ks is not None or vs is not None):
        raise TypeError(f"int8 K/V are computed in float32 (as fp8 K/V are), but these inputs "
                        f"compute in {compute} (q {q.dtype}, k {k.dtype}"
                        f"{f', v {v.dtype}' if v is not None else ''}); pass float32 q and "
                        "float32 (or float16, bfloat16, int8 or fp8) k and v")

    if mask is not None:
        mask = prepare_mask(mask, n_queries, n_keys, compute)
    # K and V (and their scales) take part in the batch with q's heads
    kv_leading = [a.shape[:-3] + (n_heads if a.shape[-3] > 1 else 1,) if group > 1
                  else a.shape[:-2] for a in operands[1:]]
    leading = [q.shape[:-2]] + kv_leading
    if mask is not None:
        leading.append(mask.shape[:-2])
    try:
        batch_shape = broadcast_shapes(*leading)
    except ValueError:
        names = ["q", "k", "v"][: len(operands)] + (["mask"] if mask is not None else [])
        described = ", ".join(
            f"{name} {arr.shape}"
            for name, arr in zip(names, list(operands) + ([mask] if mask is not None else [])))
        raise ValueError(
            f"batch dimensions do not broadcast: {described} "
            f"(leading shapes {', '.join(str(s) for s in leading)})"
            f"{gqa_hint(q, k)}") from None

    options = row_options(causal=causal, scale=scale, d_k=d_k, compute=compute, result=result,
                          window=window, softcap=softcap, precision=precision,
                          num_threads=num_threads)
    if kv_lengths is not None:
        kv_lengths = per_entry_key_positions(kv_lengths, batch_shape, n_keys, "kv_lengths")
    if kv_starts is not None:
        kv_starts = per_entry_key_positions(kv_starts, batch_shape, n_keys, "kv_starts")
    if query_offset is not None:
        query_offset = per_entry_query_offset(query_offset, batch_shape)
    if alibi_slopes is not None:
        options.alibi = per_entry_alibi(alibi_slopes, batch_shape, compute)
    if sinks is not None:
        options.sinks = per_entry_sinks(sinks, batch_shape, compute)

    # float16 and bfloat16 q, K and V (a halved KV cache) and int8 K or V
    # (with row scales) are read as they are and converted block by block in
    # the kernels, never copied to float32 whole
    q = to_compute(q, compute)
    k = k if ks is not None else to_compute(k, compute)
    if v is not None:
        v = v if vs is not None else to_compute(v, compute)
    if out is not None:
        d_v = v.shape[-1] if v is not None else 0
        out = check_out(out, batch_shape + (n_queries, d_v), result,
                        [("q", q), ("k", k), ("v", v), ("mask", mask), ("k_scale", ks),
                         ("v_scale", vs)])
    call = DenseCall(q, k, v, mask, ks, vs, batch_shape, group, 0, kv_lengths, kv_starts,
                     options, compute, result, batch_shape, want_out, want_scores, want_lse,
                     out, query_offset)
    # lengths, starts and offsets given per head might differ within a group
    per_kv_head = all(a.ndim == 0 or a.shape[-1] == 1 for a in given)
    if driver.stacks_grouped_rows(group, n_queries, mask is not None) and per_kv_head:
        _stack_grouped_rows(call)
    return call


def _stack_grouped_rows(call: DenseCall) -> None:
    """Decode under grouped heads: the G query heads' rows become the rows of
    their K/V head's entry (positions repeating every T rows), so the keys
    are read once for all of them; the results are q's layout again, the
    same memory."""
    group = call.kv_group
    q = call.q
    n_queries = q.shape[-2]
    n_kv_heads = call.batch_shape[-1] // group
    # (..., H, T, d) -> (..., H_kv, G * T, d): a view when q's heads and rows
    # are laid out in order, else a copy of q alone
    call.q = q.reshape(q.shape[:-3] + (n_kv_heads, group * n_queries, q.shape[-1]))
    call.batch_shape = call.batch_shape[:-1] + (n_kv_heads,)
    if call.kv_lengths is not None:
        call.kv_lengths = np.ascontiguousarray(call.kv_lengths[::group])
    if call.kv_starts is not None:
        call.kv_starts = np.ascontiguousarray(call.kv_starts[::group])
    if call.query_offset is not None:
        call.query_offset = np.ascontiguousarray(call.query_offset[::group])
    # the ALiBi slopes and sinks, one per (K/V head, g), are already one per
    # group of query_period rows
    call.kv_group = 1
    call.query_period = n_queries


def _attn_in_place(call: DenseCall, shape: tuple[int, ...]) -> Optional[_Array]:
    """The caller's out= as the driver writes ATTN: a view of it in the
    driver's batch layout (stacked rows too) when its dtype is the compute
    dtype and its strides are ones the driver writes (aligned, non-negative
    element strides, contiguous features); else None (computed aside, then
    copied in)."""
    out = call.out
    if out is None or out.dtype != call.compute or not writes_in_place(out):
        return None
    return view_as(out, shape)


def run(call: DenseCall) -> Results:
    """(ATTN, SCORES, LSE) of a prepared dense call, each None unless asked
    for; ATTN in the caller's out= array when given."""
    rows = call.q.shape[-2]
    n_keys = call.k.shape[-2]
    d_v = call.v.shape[-1] if call.v is not None else 0
    batch = call.batch_shape
    out = None
    in_place = False
    if call.want_out:
        out = _attn_in_place(call, batch + (rows, d_v))
        in_place = out is not None
        if out is None:
            out = output(batch + (rows, d_v), call.compute, "the output")
    scores = (output(batch + (rows, n_keys), call.compute, "SCORES")
              if call.want_scores else None)
    lse = (output(batch + (rows,), call.compute, "the log-sum-exp")
           if call.want_lse else None)
    if rows > 0 and math.prod(batch) > 0:
        driver.run_arrays(call.q, call.k, call.v, call.mask, call.k_scale, call.v_scale,
                          batch, call.kv_group, call.query_period, call.kv_lengths,
                          call.kv_starts, call.query_offset, call.options, out, scores,
                          lse)
    if call.query_period:
        # stacked rows back to q's heads: (..., H_kv, G * T, *) -> (..., H, T, *)
        lead = call.result_shape
        period = call.query_period
        out = out.reshape(lead + (period, d_v)) if out is not None else None
        scores = scores.reshape(lead + (period, n_keys)) if scores is not None else None
        lse = lse.reshape(lead + (period,)) if lse is not None else None
    if call.out is not None and out is not None:
        if not in_place:
            # another dtype (rounded once, to nearest even) or layout
            to_result(out, call.out.dtype, call.out)
        out = call.out
    elif call.result != call.compute and out is not None:
        # float16 or bfloat16 in: ATTN back to it, rounded once (to nearest
        # even)
        out = to_result(out, call.result)
    if call.result != call.compute and scores is not None:
        # so is SCORES; the log-sum-exp stays float32
        scores = to_result(scores, call.result)
    return out, scores, lse
