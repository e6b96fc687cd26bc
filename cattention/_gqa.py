"""Grouped-query attention: q has H heads, k and v H_kv (H a multiple of
H_kv). The heads are regrouped by views, never by copies: q (..., H, T, d)
becomes (..., H_kv, G, T, d) and k, v (..., H_kv, 1, S, d), so ordinary
batch broadcasting pairs query head h with K/V head h // G. For a decode
step the G heads' rows are instead stacked as rows of their one K/V head,
so that its keys and values are read once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attention
from ._call import Call, Results, run
from ._checks import _array, _broadcast_shapes, _prepare_sinks


def _split_head_axis(arr: ArrayLike | None, n_heads: int, n_kv_heads: int, what: str,
                     q_batch: tuple[int, ...]) -> NDArray[Any] | None:
    """An array broadcast against q's leading dimensions (heads last), with
    its head axis split to (H_kv, G) or, if 1, widened to (1, 1)."""
    if arr is None:
        return None
    arr = _array(arr, what)
    if arr.ndim == 0:
        return arr
    if arr.shape[-1] == n_heads and n_heads != 1:
        return arr.reshape(arr.shape[:-1] + (n_kv_heads, n_heads // n_kv_heads))
    if arr.shape[-1] == 1:
        return arr[..., None]
    raise ValueError(
        f"{what} of shape {arr.shape} does not broadcast to the batch dimensions "
        f"{q_batch} of q")


def _group_query_heads(
        q: NDArray[Any], k: NDArray[Any], v: NDArray[Any] | None, mask: ArrayLike | None,
        kv_lengths: ArrayLike | None, alibi_slopes: ArrayLike | None = None,
        sinks: ArrayLike | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any] | None, NDArray[Any] | None,
           NDArray[Any] | None, NDArray[Any] | None, NDArray[Any] | None, int]:
    """Views for grouped-query attention: q (..., H, T, d) becomes
    (..., H_kv, G, T, d) and k, v (..., H_kv, S, d) become (..., H_kv, 1, S, d),
    so ordinary batch broadcasting pairs query head h with key/value head
    h // G, without copying K or V (they are packed once per K/V head)."""
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
    group = n_heads // n_kv_heads
    # splitting one axis in two, or adding a unit axis, never copies
    q = q.reshape(q.shape[:-3] + (n_kv_heads, group) + q.shape[-2:])
    k = k[..., None, :, :]
    if v is not None:
        v = v[..., None, :, :]
    if mask is not None:
        mask = _array(mask, "mask")
        if mask.ndim >= 3 and mask.shape[-3] == n_heads and n_heads != 1:
            mask = mask.reshape(mask.shape[:-3] + (n_kv_heads, group) + mask.shape[-2:])
        elif mask.ndim >= 3:
            if mask.shape[-3] != 1:
                raise ValueError(
                    f"mask of shape {mask.shape} does not broadcast to the {n_heads} "
                    f"query heads of q (shape {q.shape[:-4] + (n_heads,) + q.shape[-2:]})")
            mask = mask[..., None, :, :]
    q_batch = q.shape[:-4] + (n_heads,)
    kv_lengths = _split_head_axis(kv_lengths, n_heads, n_kv_heads, "kv_lengths", q_batch)
    alibi_slopes = _split_head_axis(alibi_slopes, n_heads, n_kv_heads, "alibi_slopes",
                                    q_batch)
    sinks = _split_head_axis(sinks, n_heads, n_kv_heads, "sinks", q_batch)
    return q, k, v, mask, kv_lengths, alibi_slopes, sinks, n_heads


def run_grouped(call: Call) -> Results:
    """(ATTN, SCORES, LSE) of a grouped-query call, as for H heads."""
    q, k, v, mask, kv_lengths, alibi_slopes, sinks, n_heads = _group_query_heads(
        call.q, call.k, call.v, call.mask, call.kv_lengths, call.alibi_slopes, call.sinks)
    # the same views of the int8 row scales: (..., H_kv, 1, S, 1)
    ks = call.k_scale[..., None, :, :] if call.k_scale is not None else None
    vs = call.v_scale[..., None, :, :] if call.v_scale is not None else None
    group, n_queries = q.shape[-3], q.shape[-2]
    lengths_per_kv_head = kv_lengths is None or np.ndim(kv_lengths) == 0 or (
        np.shape(kv_lengths)[-1] == 1)
    if (group > 1 and group * n_queries <= _attention.DIRECT_QUERY_ROWS
            and mask is None and alibi_slopes is None and lengths_per_kv_head):
        return _run_stacked(call, q, k, v, ks, vs, kv_lengths, sinks, n_heads)
    out, scores, lse = run(dataclasses.replace(
        call, q=q, k=k, v=v, mask=mask, kv_lengths=kv_lengths, alibi_slopes=alibi_slopes,
        sinks=sinks, k_scale=ks, v_scale=vs))

    def merge_heads(arr: NDArray[Any] | None, trailing: int) -> NDArray[Any] | None:
        # (..., H_kv, G, *trailing) -> (..., H, *trailing); C-contiguous, a view
        if arr is None:
            return None
        rest = arr.shape[arr.ndim - trailing:]
        return arr.reshape(arr.shape[:-2 - trailing] + (n_heads,) + rest)

    return merge_heads(out, 2), merge_heads(scores, 2), merge_heads(lse, 1)


def _run_stacked(call: Call, q: NDArray[Any], k: NDArray[Any], v: NDArray[Any] | None,
                 ks: NDArray[np.float32] | None, vs: NDArray[np.float32] | None,
                 kv_lengths: ArrayLike | None, sinks: ArrayLike | None,
                 n_heads: int) -> Results:
    """Decode: the G query heads' rows stacked as rows of their K/V head."""
    group, n_queries = q.shape[-3], q.shape[-2]
    q = q.reshape(q.shape[:-3] + (group * n_queries, q.shape[-1]))
    k = k[..., 0, :, :]
    v = v[..., 0, :, :] if v is not None else None
    ks = ks[..., 0, :, :] if ks is not None else None
    vs = vs[..., 0, :, :] if vs is not None else None
    if kv_lengths is not None and np.ndim(kv_lengths) > 0:
        kv_lengths = np.asarray(kv_lengths)[..., 0]
    stacked_sinks = None
    if sinks is not None:
        # one sink per stacked group of n_queries rows: (batch entry, g)
        stacked_leading = [a.shape[:-2] for a in (q, k, v) if a is not None]
        try:
            stacked_batch = _broadcast_shapes(*stacked_leading)
        except ValueError:
            stacked_batch = None  # reported by the run below
        if stacked_batch is not None:
            stacked_sinks = _prepare_sinks(sinks, stacked_batch + (group,))
    out, scores, lse = run(dataclasses.replace(
        call, q=q, k=k, v=v, mask=None, kv_lengths=kv_lengths, alibi_slopes=None, sinks=None,
        k_scale=ks, v_scale=vs, query_period=n_queries, sink_rows=stacked_sinks))

    def split_rows(arr: NDArray[Any] | None, trailing: int) -> NDArray[Any] | None:
        # (..., H_kv, G * T, *rest) -> (..., H, T, *rest), a view
        if arr is None:
            return None
        lead = arr.shape[:arr.ndim - trailing - 1]
        rest = arr.shape[arr.ndim - trailing:]
        return arr.reshape(lead[:-1] + (n_heads, n_queries) + rest)

    return split_rows(out, 1), split_rows(scores, 1), split_rows(lse, 0)
