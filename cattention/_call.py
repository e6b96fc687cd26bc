"""One call: its operands and options checked once into a :class:`Call`,
and the run of an ungrouped call (compute dtype, batch broadcasting,
per-batch-entry options, outputs allocated, the driver called).

Grouped-query calls are turned into ungrouped ones by ``_gqa``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attention
from ._checks import (
    _as_input,
    _broadcast_shapes,
    _check_fits,
    _fit_sinks,
    _check_softcap,
    _check_window,
    _compute_dtype,
    _gqa_hint,
    _lengths_per_sequence,
    _output,
    _prepare_alibi,
    _prepare_kv_lengths,
    _prepare_mask,
    _prepare_sinks,
    _resolve_scale,
    _to_compute,
)
from ._quantize import int8_scale
from ._threads import _check_num_threads, get_num_threads

_FloatArray = NDArray[np.floating[Any]]
Results = tuple[_FloatArray | None, _FloatArray | None, _FloatArray | None]


@dataclasses.dataclass
class Call:
    """A call's operands and checked options, handed down unchanged except by
    the views grouped-query attention takes (``dataclasses.replace``)."""

    q: NDArray[Any]
    k: NDArray[Any]
    v: NDArray[Any] | None           # None: SCORES alone
    mask: ArrayLike | None
    causal: bool
    scale: float | None              # None: 1 / sqrt(d_k)
    threads: int
    want_out: bool
    want_scores: bool
    want_lse: bool
    kv_lengths: ArrayLike | None = None
    window: tuple[int, int] = (-1, -1)       # (left, right); -1: unbounded
    softcap: float = 0.0                     # 0: off
    alibi_slopes: ArrayLike | None = None
    sinks: ArrayLike | None = None
    # int8 K/V: float32 row scales of k's / v's shape with a last axis of 1,
    # so that every view taken of k or v is taken of them alike
    k_scale: NDArray[np.float32] | None = None
    v_scale: NDArray[np.float32] | None = None
    # grouped decode: the q rows are stacked groups of query_period
    # positions, each group with its own sink (sink_rows); 0: not stacked
    query_period: int = 0
    sink_rows: NDArray[np.float64] | None = None


def make_call(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, *, causal: bool,
              mask: ArrayLike | None, scale: float | None, want_out: bool,
              want_scores: bool, want_lse: bool, num_threads: SupportsIndex | None,
              kv_lengths: ArrayLike | None, window: Any, softcap: float | None,
              alibi_slopes: ArrayLike | None, sinks: ArrayLike | None,
              k_scale: ArrayLike | None, v_scale: ArrayLike | None) -> Call:
    """Check the arrays and the options that do not depend on the shapes."""
    q = _as_input(q, "q")
    k = _as_input(k, "k")
    if v is not None:
        v = _as_input(v, "v")
    ks = int8_scale(k, k_scale, "k", q.dtype)
    vs = None
    if v is not None:
        vs = int8_scale(v, v_scale, "v", q.dtype)
    elif v_scale is not None:
        raise ValueError("v_scale is given without v")
    if kv_lengths is not None:
        kv_lengths = _lengths_per_sequence(kv_lengths, q, k, v, mask)
    threads = get_num_threads() if num_threads is None else _check_num_threads(num_threads)
    return Call(q, k, v, mask, causal, scale, threads, want_out, want_scores, want_lse,
                kv_lengths=kv_lengths, window=_check_window(window, causal),
                softcap=_check_softcap(softcap), alibi_slopes=alibi_slopes, sinks=sinks,
                k_scale=ks, v_scale=vs)


def check_options(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], *, causal: bool,
                  scale: float | None, window: Any, softcap: float | None,
                  alibi_slopes: ArrayLike | None,
                  num_threads: SupportsIndex | None, sinks: ArrayLike | None = None) -> None:
    """Raise as :func:`cattention.attention` would on these options,
    computing nothing: for callers that must refuse a call before they write
    (a KV cache)."""
    compute, _ = _compute_dtype(q, k, v)
    _check_fits(_resolve_scale(scale, q.shape[-1]), compute, "scale")
    _check_window(window, causal)
    _check_fits(_check_softcap(softcap), compute, "softcap")
    if num_threads is not None:
        _check_num_threads(num_threads)
    if alibi_slopes is not None:
        _prepare_alibi(alibi_slopes, q.shape[:-2], compute)
    if sinks is not None:
        _fit_sinks(_prepare_sinks(sinks, q.shape[:-2]), compute)


def run(call: Call) -> Results:
    """(ATTN, SCORES, LSE) of an ungrouped call, each None unless asked for."""
    q, k, v, mask = call.q, call.k, call.v, call.mask
    ks, vs = call.k_scale, call.v_scale
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

    operands = (q, k) if v is None else (q, k, v)
    compute, result = _compute_dtype(*operands)
    if compute != np.float32 and (ks is not None or vs is not None):
        raise TypeError(f"int8 K/V are computed in float32, but these inputs compute in "
                        f"{compute} (q {q.dtype}, k {k.dtype}"
                        f"{f', v {v.dtype}' if v is not None else ''}); pass float32 q and "
                        "float32 (or float16, or int8) k and v")

    if mask is not None:
        mask = _prepare_mask(mask, n_queries, n_keys, compute)
    leading = [a.shape[:-2] for a in operands]
    if mask is not None:
        leading.append(mask.shape[:-2])
    try:
        batch_shape = _broadcast_shapes(*leading)
    except ValueError:
        names = ["q", "k", "v"][: len(operands)] + (["mask"] if mask is not None else [])
        described = ", ".join(
            f"{name} {arr.shape}"
            for name, arr in zip(names, list(operands) + ([mask] if mask is not None else [])))
        raise ValueError(
            f"batch dimensions do not broadcast: {described} "
            f"(leading shapes {', '.join(str(s) for s in leading)})"
            f"{_gqa_hint(q, k)}") from None

    scale = _resolve_scale(call.scale, d_k)
    _check_fits(scale, compute, "scale")
    _check_fits(call.softcap, compute, "softcap")
    kv_lengths = None
    if call.kv_lengths is not None:
        kv_lengths = _prepare_kv_lengths(call.kv_lengths, batch_shape, n_keys)
    alibi_slopes = None
    if call.alibi_slopes is not None:
        alibi_slopes = _prepare_alibi(call.alibi_slopes, batch_shape, compute)
    sink_rows = call.sink_rows
    if sink_rows is None and call.sinks is not None:
        sink_rows = _prepare_sinks(call.sinks, batch_shape)
    sink_rows = _fit_sinks(sink_rows, compute)

    # float16 K and V (a halved KV cache) and int8 K or V (with row scales)
    # are read as they are and converted block by block in the kernels,
    # never copied to float32 whole
    floats = [a for a, s in ((k, ks), (v, vs)) if a is not None and s is None]
    kv_dtype = compute
    if compute == np.float32 and all(a.dtype == np.float16 for a in floats):
        kv_dtype = np.dtype(np.float16)
    q = _to_compute(q, compute)
    k = k if ks is not None else _to_compute(k, kv_dtype)
    if v is not None:
        v = v if vs is not None else _to_compute(v, kv_dtype)
    d_v = v.shape[-1] if v is not None else 0

    out = (_output(batch_shape + (n_queries, d_v), compute, "the output")
           if call.want_out else None)
    scores = (_output(batch_shape + (n_queries, n_keys), compute, "SCORES")
              if call.want_scores else None)
    lse = (_output(batch_shape + (n_queries,), compute, "the log-sum-exp")
           if call.want_lse else None)
    if n_queries > 0 and math.prod(batch_shape) > 0:
        window_left, window_right = call.window
        _attention.attention_into(
            q, k, v, mask, batch_shape, bool(call.causal), scale, out, scores, call.threads,
            lse, kv_lengths, call.query_period, window_left, window_right, call.softcap,
            alibi_slopes, sink_rows, ks, vs)
    if result != compute:
        # float16 in: outputs back to float16, the log-sum-exp stays float32
        out = out.astype(result) if out is not None else None
        scores = scores.astype(result) if scores is not None else None
    return out, scores, lse
