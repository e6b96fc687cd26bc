"""Packed variable-length attention: sequences of different lengths
concatenated along the token axis (FlashAttention's varlen layout), with no
work for padding because there is none."""

from __future__ import annotations

from typing import Any, Literal, SupportsIndex, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _entries
from ._checks import (
    _array,
    _as_input,
    _check_alibi_values,
    _check_fits,
    _check_flag,
    _check_sink_values,
    _fit_sinks,
    _check_softcap,
    _check_window,
    _compute_dtype,
    _output,
    _resolve_scale,
    _to_compute,
)
from ._threads import _check_num_threads, get_num_threads

__all__ = ["attention_varlen"]

_Float = NDArray[np.floating[Any]]


def cu_seqlens(values: object, name: str, total: int, total_name: str) -> NDArray[np.intp]:
    """n_seq + 1 cumulative offsets: integers, from 0, non-decreasing, to total."""
    if values is None:
        raise TypeError(f"{name} must be an integer array, got None")
    arr = _array(values, name)
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


def per_head(values: ArrayLike | None, n_heads: int, name: str) -> NDArray[np.float64] | None:
    """alibi_slopes or sinks: one real number per query head, shape (H,)."""
    if values is None:
        return None
    arr = _array(values, name)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be real numbers, got dtype {arr.dtype}")
    if arr.shape != (n_heads,):
        raise ValueError(f"{name} must hold one real number per query head, shape "
                         f"({n_heads},); got shape {arr.shape}, dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float64)


def head_options(alibi_slopes: ArrayLike | None, sinks: ArrayLike | None, n_heads: int,
                 compute: np.dtype[Any],
                 ) -> tuple[NDArray[np.float64] | None, NDArray[np.float64] | None]:
    """ALiBi slopes and sink logits per query head, checked (and the sinks
    fitted to the compute dtype) as attention checks them."""
    alibi = per_head(alibi_slopes, n_heads, "alibi_slopes")
    if alibi is not None:
        _check_alibi_values(alibi, compute)
    sink_logits = per_head(sinks, n_heads, "sinks")
    if sink_logits is not None:
        _check_sink_values(sink_logits)
    return alibi, _fit_sinks(sink_logits, compute)


def rows_of(arr: NDArray[Any]) -> _entries.Rows:
    """An array whose last axis is the features, as the driver reads it."""
    return _entries.Rows(arr, 0, arr.strides[-1] // arr.itemsize)


def place(arr: NDArray[Any], seq_offset: NDArray[np.intp], t_axis: int,
          h_axis: int) -> _entries.Place:
    return _entries.Place(arr, seq_offset, arr.strides[t_axis] // arr.itemsize,
                          arr.strides[h_axis] // arr.itemsize)


@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
    *, causal: bool = False, scale: float | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, enable_gqa: bool = False,
    return_lse: Literal[False] = False, num_threads: SupportsIndex | None = None,
) -> _Float: ...


@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
    *, causal: bool = False, scale: float | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, enable_gqa: bool = False,
    return_lse: Literal[True], num_threads: SupportsIndex | None = None,
) -> tuple[_Float, _Float]: ...


@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
    *, causal: bool = False, scale: float | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, enable_gqa: bool = False,
    return_lse: bool = False, num_threads: SupportsIndex | None = None,
) -> _Float | tuple[_Float, _Float]: ...


def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
    *, causal: bool = False, scale: float | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, enable_gqa: bool = False,
    return_lse: bool = False, num_threads: SupportsIndex | None = None,
) -> _Float | tuple[_Float, _Float]:
    """Attention over a batch of sequences of different lengths, packed
    along the token axis (FlashAttention's varlen layout).

    Sequence i's query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` attend
    only to its keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``, with the
    conventions of :func:`cattention.attention` applied to each sequence
    alone: causal alignment is bottom-right (a sequence's T_i queries are
    the last T_i of its S_i positions), a row that sees no key gives zeros
    (LSE -inf). The time follows the real tokens: nothing is padded.

    Parameters
    ----------
    q : array_like, shape (total_q, H, d_k)
    k : array_like, shape (total_k, H_kv, d_k)
    v : array_like, shape (total_k, H_kv, d_v)
        Any strides. float32 or float64; float16 k and v with a float32 q
        are converted block by block as they are read.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (n_seq + 1,)
        Cumulative lengths: non-decreasing, from 0 to total_q (total_k).
        Sequences of length 0 are allowed.
    causal, scale, window, softcap, num_threads
        As in :func:`cattention.attention`, within each sequence.
    alibi_slopes, sinks : array_like, shape (H,), optional
        One ALiBi slope, or one sink logit (-inf: none), per query head.
    enable_gqa : bool, default False
        Allow H to be a multiple of H_kv: query head h reads K/V head
        h // (H // H_kv).
    return_lse : bool, default False
        Also return the log-sum-exp of each row, shape (total_q, H).

    Returns
    -------
    attn : ndarray, shape (total_q, H, d_v)
    lse : ndarray, shape (total_q, H), only with ``return_lse=True``

    Raises
    ------
    ValueError
        On shapes that do not match (named with theirs), cumulative lengths
        that are not 1-D, do not start at 0, decrease or do not end at the
        total, H not a multiple of H_kv, int8 K or V beside a float q
        (quantized K/V, whose scales this call does not take), or an option
        out of range.
    TypeError
        On dtypes that cannot be computed, or non-integer lengths.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> x = np.ones((5, 2, 8), np.float32)          # sequences of 2 and 3 tokens
    >>> cu = np.array([0, 2, 5])
    >>> ca.attention_varlen(x, x, x, cu, cu, causal=True).shape
    (5, 2, 8)
    """
    q = _as_input(q, "q")
    k = _as_input(k, "k")
    v = _as_input(v, "v")
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
    enable_gqa = _check_flag(enable_gqa, "enable_gqa")
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
    causal = _check_flag(causal, "causal")
    return_lse = _check_flag(return_lse, "return_lse")
    for name, operand in (("k", k), ("v", v)):
        if operand.dtype == np.int8 and q.dtype.kind == "f":
            # beside a float q, cattention reads int8 K/V as quantized
            raise ValueError(
                f"{name} is int8, which with a float q means quantized K/V with row scales; "
                "attention_varlen takes no scales: pass float K/V (int8 pages with their "
                "scales go to attention_with_paged_kvcache)")
    compute, result = _compute_dtype(q, k, v)
    scale_value = _resolve_scale(scale, d_k)
    _check_fits(scale_value, compute, "scale")
    window_sides = _check_window(window, causal)
    softcap_value = _check_softcap(softcap)
    _check_fits(softcap_value, compute, "softcap")
    alibi, sink_logits = head_options(alibi_slopes, sinks, n_heads, compute)
    threads = get_num_threads() if num_threads is None else _check_num_threads(num_threads)

    kv_dtype = compute
    if compute == np.float32 and k.dtype == np.float16 and v.dtype == np.float16:
        kv_dtype = np.dtype(np.float16)
    q = _to_compute(q, compute)
    k = _to_compute(k, kv_dtype)
    v = _to_compute(v, kv_dtype)
    d_v = v.shape[2]
    out = _output((total_q, n_heads, d_v), compute, "the output")
    lse = _output((total_q, n_heads), compute, "the log-sum-exp") if return_lse else None
    if total_q and n_heads:
        starts_q = cu_q[:-1]
        starts_k = cu_k[:-1]
        tables = _entries.plan(
            place(q, starts_q * (q.strides[0] // q.itemsize), 0, 1),
            place(k, starts_k * (k.strides[0] // k.itemsize), 0, 1),
            place(v, starts_k * (v.strides[0] // v.itemsize), 0, 1),
            place(out, starts_q * n_heads * d_v, 0, 1),
            place(lse, starts_q * n_heads, 0, 1) if lse is not None else None,
            np.diff(cu_q), np.diff(cu_k), n_heads, n_kv_heads,
            alibi=alibi, sinks=sink_logits)
        k_rows = rows_of(k)
        k_rows.row_stride = k.strides[0] // k.itemsize
        v_rows = rows_of(v)
        v_rows.row_stride = v.strides[0] // v.itemsize
        _entries.run(tables, rows_of(q), k_rows, v_rows, out, lse, causal=causal,
                     scale=scale_value, threads=threads, window=window_sides,
                     softcap=softcap_value)
    result_out = out.astype(result) if result != compute else out
    if return_lse:
        return result_out, lse  # type: ignore[return-value]
    return result_out
