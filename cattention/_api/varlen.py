"""Public: packed variable-length attention, sequences of different lengths
concatenated along the token axis (FlashAttention's varlen layout), with no
work for padding because there is none."""

from __future__ import annotations

from typing import Any, Literal, Optional, SupportsIndex, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._prepare import entries
from .._prepare.options import Precision

__all__ = ["attention_varlen"]

_Float = NDArray[np.floating[Any]]


@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
    *, causal: bool = False, scale: Optional[float] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, enable_gqa: bool = False,
    k_scale: Optional[ArrayLike] = None, v_scale: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    return_lse: Literal[False] = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> _Float: ...


@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
    *, causal: bool = False, scale: Optional[float] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, enable_gqa: bool = False,
    k_scale: Optional[ArrayLike] = None, v_scale: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    return_lse: Literal[True],
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> tuple[_Float, _Float]: ...


@overload
def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
    *, causal: bool = False, scale: Optional[float] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, enable_gqa: bool = False,
    k_scale: Optional[ArrayLike] = None, v_scale: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    return_lse: bool = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> "_Float | tuple[_Float, _Float]": ...


def attention_varlen(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, cu_seqlens_q: ArrayLike, cu_seqlens_k: ArrayLike,
    *, causal: bool = False, scale: Optional[float] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, enable_gqa: bool = False,
    k_scale: Optional[ArrayLike] = None, v_scale: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    return_lse: bool = False,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> "_Float | tuple[_Float, _Float]":
    """Attention over a batch of sequences of different lengths, packed
    along the token axis (FlashAttention's varlen layout).

    Sequence i's query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` attend
    only to its keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``, with the
    conventions of :func:`cattention.attention` applied to each sequence
    alone: causal alignment is bottom-right (a sequence's T_i queries are
    the last T_i of its S_i positions), a row that sees no key gives zeros
    (LSE -inf); see :ref:`conventions`. The time follows the real tokens:
    nothing is padded.

    Parameters
    ----------
    q : array_like, shape (total_q, H, d_k)
        Queries of every sequence, packed along the first axis; any
        strides. float32 or float64 (see ``v`` for half-size k and v).
    k : array_like, shape (total_k, H_kv, d_k)
        Keys, packed likewise.
    v : array_like, shape (total_k, H_kv, d_v)
        Values, packed likewise. float16 k and v with a float32 q are
        converted block by block as they are read, and so are int8 and fp8
        (``ml_dtypes.float8_e4m3fn``, ``float8_e5m2``) k and v with their
        scales.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (n_seq + 1,)
        Cumulative lengths: non-decreasing, from 0 to total_q (total_k).
        Sequences of length 0 are allowed.
    causal, scale, window, softcap, precision, num_threads
        As in :func:`cattention.attention`, within each sequence.
    alibi_slopes, sinks : array_like, shape (H,) or (n_seq, H), optional
        One ALiBi slope, or one sink logit (-inf: none), per query head, or
        per sequence and query head.
    enable_gqa : bool, default False
        Allow H to be a multiple of H_kv: query head h reads K/V head
        h // (H // H_kv).
    k_scale, v_scale : array_like of float32, optional
        The scales of int8 or fp8 k and v, as :func:`cattention.attention`
        takes them, of the packed rows: one per row (total_k, H_kv), for
        int8 required; for fp8 anything that broadcasts to (total_k, H_kv)
        (a scalar: one per tensor), or none (1).
    return_lse : bool, default False
        Also return the log-sum-exp of each row, shape (total_q, H);
        ``-inf`` for a row that sees no key (see :func:`cattention.merge`).
    out : ndarray, shape (total_q, H, d_v), optional
        Where to write ATTN, as :func:`cattention.attention`'s ``out``.

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
        without its scales, a scale out of range, or an option out of range.
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
    call, result = entries.prepare_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, enable_gqa=enable_gqa,
        return_lse=return_lse, num_threads=num_threads, out=out, k_scale=k_scale,
        v_scale=v_scale, precision=precision)
    attn, lse = entries.run(call, result)
    if lse is not None:
        return attn, lse
    return attn
