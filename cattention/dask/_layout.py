"""Operands of a Dask call, checked once at graph construction: the same
checks as ``ca.attention`` (run on stand-ins of the operands' shapes and
dtypes, so nothing is computed or allocated), then the chunkings brought
into line so that every task reads whole chunks of q, K and V.

Chunk rules: the output takes q's chunks on the batch axes and T (K's,
or V's, on a batch axis where q has size 1); K and V are rechunked to them
on each batch axis they share, V to K's chunks of S; features are one
chunk. Under grouped heads (G query heads per K/V head) a query chunk that
straddles groups of G heads is split at multiples of G, and K/V take head
chunks whose G-fold covers whole query chunks, so each task reads one K/V
chunk (or a view of some of its heads).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

import dask.array as da

from .._native import driver
from .._prepare import dense
from .._prepare.arrays import compute_dtype, is_half
from .._prepare.options import (per_entry_alibi, per_entry_key_positions, per_entry_sinks,
                                per_sequence)

_Array = NDArray[Any]
Chunks = tuple[tuple[int, ...], ...]


@dataclasses.dataclass
class Layout:
    """A call's operands with their chunks in line, and its options per
    batch entry (arrays of the batch shape, small)."""

    q: da.Array                        # (*batch, T, d_k), every input padded to one ndim
    k: da.Array
    v: da.Array
    batch_shape: tuple[int, ...]
    batch_chunks: Chunks               # of the output
    group: int                         # G: query heads per K/V head (1: no grouping)
    kv_head_bounds: tuple[int, ...]    # grouped heads: K/V head chunk boundaries
    n_valid: _Array                    # valid keys of each batch entry (int64)
    kv_lengths_given: bool
    alibi_slopes: Optional[_Array]
    sinks: Optional[_Array]
    causal: bool
    scale: float
    window: tuple[int, int]            # (left, right); -1: unbounded
    softcap: Optional[float]
    enable_gqa: bool
    compute: np.dtype[Any]             # dtype of the partial results and the LSE
    result: np.dtype[Any]              # of ATTN


def as_dask(x: Any, name: str, chunks: Any) -> da.Array:
    """A Dask array as it is; anything else (a NumPy array, a list) wrapped
    with ``chunks`` (dask's forms; a dict's negative axes count from the
    end; None: one chunk)."""
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    if isinstance(x, da.Array):
        return x
    arr = np.asarray(x)
    if chunks is None:
        spec: Any = arr.shape
    elif isinstance(chunks, dict):
        # axes this array does not have are left out (a 2-D v beside 4-D q)
        spec = {axis % arr.ndim: size for axis, size in chunks.items()
                if isinstance(axis, int) and -arr.ndim <= axis < arr.ndim}
    else:
        spec = chunks
    try:
        return da.from_array(arr, chunks=spec)
    except ValueError as exc:
        raise ValueError(f"chunks={chunks!r} does not fit {name} of shape {arr.shape}: "
                         f"{exc}") from None


def refuse_unknown_chunks(x: da.Array, name: str) -> None:
    """Chunk sizes are needed to place every task (NaN after a boolean
    index, for example)."""
    axes = [axis for axis, sizes in enumerate(x.chunks)
            if any(math.isnan(size) for size in sizes)]
    if axes:
        raise ValueError(
            f"{name} has unknown chunk sizes (NaN) on axes {axes} (shape {x.shape}); "
            f"call {name}.compute_chunk_sizes() or rechunk it to known sizes first")


def _stand_in(x: da.Array, compute: np.dtype[Any], float_q: bool) -> _Array:
    """An array of the operand's shape that holds no data (every stride 0),
    for ca.attention's checks. Its dtype is the one the checks see: the
    operand's where ca.attention reads it as it is (the compute dtype,
    float16 or bfloat16 under float32, int8 beside a float q: a quantized
    K or V, refused without its scales), else the compute dtype it would be
    converted to (so that the checks convert no stand-in of the full size).
    A dtype cattention does not take stays, in an empty array, to be
    refused."""
    dtype = x.dtype
    if dtype.kind not in "fiub" and not is_half(dtype):
        return np.empty((0,) * x.ndim, dtype)
    keep = (dtype == compute or (dtype == np.int8 and float_q)
            or (compute == np.float32 and is_half(dtype))
            or compute not in (np.float32, np.float64))
    return np.broadcast_to(np.zeros((), dtype if keep else compute), x.shape)


def _head_bounds(q_chunks: tuple[int, ...], group: int) -> tuple[list[int], list[int]]:
    """(query head boundaries, K/V head boundaries) under grouped heads:
    q's boundaries plus the multiples of G inside any chunk that straddles
    a group of G heads; K/V's those of them that are multiples of G,
    divided by G. Each query chunk then lies in one group or is a run of
    whole groups, and its K/V heads in one K/V chunk."""
    bounds = np.cumsum((0,) + q_chunks).tolist()
    q_bounds = [0]
    for start, stop in zip(bounds, bounds[1:]):
        within_one = start // group == (stop - 1) // group
        if stop > start and not within_one:
            q_bounds.extend(range(-(-start // group) * group, stop, group))
        q_bounds.append(stop)
    q_bounds = sorted(set(q_bounds))
    kv_bounds = [b // group for b in q_bounds if b % group == 0]
    return q_bounds, kv_bounds


def _sizes(bounds: list[int]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(bounds, bounds[1:])) or (0,)


def prepare(q: Any, k: Any, v: Any, *, chunks: Any, causal: Any, scale: Any,
            enable_gqa: Any, kv_lengths: Any, window: Any, softcap: Any, alibi_slopes: Any,
            sinks: Any, return_lse: Any, num_threads: Any) -> Layout:
    """Every check of ``ca.attention``, then the chunks in line."""
    causal = driver.check_flag(causal, "causal")
    enable_gqa = driver.check_flag(enable_gqa, "enable_gqa")
    return_lse = driver.check_flag(return_lse, "return_lse")
    operands = [as_dask(x, name, chunks) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    for x, name in zip(operands, "qkv"):
        refuse_unknown_chunks(x, name)
    q, k, v = operands

    try:
        compute = compute_dtype(q.dtype, k.dtype, v.dtype)[0]
    except TypeError:
        compute = np.dtype(np.float64)    # no common dtype: refused by the checks below
    float_q = q.dtype.kind == "f" or is_half(q.dtype)
    stand_ins = [_stand_in(x, compute, float_q) for x in operands]
    call = dense.prepare_dense(
        *stand_ins, causal=causal, mask=None, scale=scale, want_out=True, want_scores=False,
        want_lse=return_lse, enable_gqa=enable_gqa, num_threads=num_threads,
        kv_lengths=kv_lengths, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, k_scale=None, v_scale=None)
    batch_shape = call.result_shape
    n_keys = k.shape[-2]

    # one number of dimensions: leading axes of size 1 broadcast
    ndim = len(batch_shape) + 2
    q, k, v = (x[(None,) * (ndim - x.ndim)] if x.ndim < ndim else x for x in (q, k, v))
    # features in one chunk: a task needs whole rows
    q, k, v = (x.rechunk({ndim - 1: -1}) if len(x.chunks[-1]) > 1 else x for x in (q, k, v))
    if k.chunks[-2] != v.chunks[-2]:
        v = v.rechunk({ndim - 2: k.chunks[-2]})

    group = call.kv_group if enable_gqa else 1
    head_axis = ndim - 3 if enable_gqa else -1
    batch_chunks = []
    kv_bounds: list[int] = []
    for axis, size in enumerate(batch_shape):
        if axis == head_axis:
            q_bounds, kv_bounds = _head_bounds(q.chunks[axis], group)
            q = q.rechunk({axis: _sizes(q_bounds)})
            kv_sizes = _sizes(kv_bounds)
            k, v = (x if x.chunks[axis] == kv_sizes else x.rechunk({axis: kv_sizes})
                    for x in (k, v))
            batch_chunks.append(q.chunks[axis])
            continue
        holders = [x for x in (q, k, v) if x.shape[axis] == size]
        target = holders[0].chunks[axis]
        q, k, v = (x.rechunk({axis: target})
                   if x.shape[axis] == size and x.chunks[axis] != target else x
                   for x in (q, k, v))
        batch_chunks.append(target)

    # the options per batch entry, by ca.attention's own rules
    stand_q, stand_k, stand_v = stand_ins
    if kv_lengths is not None:
        lengths = per_entry_key_positions(
            per_sequence(kv_lengths, stand_q, stand_k, stand_v, None, "kv_lengths"),
            batch_shape, n_keys, "kv_lengths")
        n_valid = lengths.astype(np.int64).reshape(batch_shape)
    else:
        n_valid = np.full(batch_shape, n_keys, np.int64)
    slopes = (per_entry_alibi(alibi_slopes, batch_shape, compute).reshape(batch_shape)
              if alibi_slopes is not None else None)
    sink_logits = (per_entry_sinks(sinks, batch_shape, compute).reshape(batch_shape)
                   if sinks is not None else None)
    return Layout(q, k, v, batch_shape, tuple(batch_chunks), group, tuple(kv_bounds),
                  n_valid, kv_lengths is not None, slopes, sink_logits, causal,
                  call.options.scale, call.options.window,
                  call.options.softcap if call.options.softcap > 0 else None, enable_gqa,
                  call.compute, call.result)
