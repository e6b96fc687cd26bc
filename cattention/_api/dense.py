"""Public: attention and attention_scores, dense calls over arrays whose
leading dimensions broadcast.

Nothing here loops over data. A call takes the compiled shortcut when it is
the common case (``_driver/shortcuts.pxd`` decides), else its arrays and
options are checked once into a prepared call (``_prepare/dense.py``) that
the driver runs; either reads the inputs in any layout (transposed,
negative or zero strides) without copying.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, SupportsIndex, cast, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .._prepare import dense
from .._prepare.options import Precision, local

__all__ = ["attention", "attention_scores"]


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: Optional[ArrayLike] = None, scale: Optional[float] = None,
    return_scores: Literal[False] = False, return_lse: Literal[False] = False,
    enable_gqa: bool = False, kv_lengths: Optional[ArrayLike] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[ArrayLike] = None,
    v_scale: Optional[ArrayLike] = None, kv_starts: Optional[ArrayLike] = None,
    query_offset: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> NDArray[np.floating[Any]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: Optional[ArrayLike] = None, scale: Optional[float] = None,
    return_scores: Literal[True], return_lse: Literal[False] = False,
    enable_gqa: bool = False, kv_lengths: Optional[ArrayLike] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[ArrayLike] = None,
    v_scale: Optional[ArrayLike] = None, kv_starts: Optional[ArrayLike] = None,
    query_offset: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: Optional[ArrayLike] = None, scale: Optional[float] = None,
    return_scores: Literal[False] = False, return_lse: Literal[True],
    enable_gqa: bool = False, kv_lengths: Optional[ArrayLike] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[ArrayLike] = None,
    v_scale: Optional[ArrayLike] = None, kv_starts: Optional[ArrayLike] = None,
    query_offset: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: Optional[ArrayLike] = None, scale: Optional[float] = None,
    return_scores: Literal[True], return_lse: Literal[True],
    enable_gqa: bool = False, kv_lengths: Optional[ArrayLike] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[ArrayLike] = None,
    v_scale: Optional[ArrayLike] = None, kv_starts: Optional[ArrayLike] = None,
    query_offset: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]],
           NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: Optional[ArrayLike] = None, scale: Optional[float] = None,
    return_scores: bool = False, return_lse: bool = False,
    enable_gqa: bool = False, kv_lengths: Optional[ArrayLike] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[ArrayLike] = None,
    v_scale: Optional[ArrayLike] = None, kv_starts: Optional[ArrayLike] = None,
    query_offset: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]: ...


def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: Optional[ArrayLike] = None, scale: Optional[float] = None,
    return_scores: bool = False, return_lse: bool = False,
    enable_gqa: bool = False, kv_lengths: Optional[ArrayLike] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[ArrayLike] = None,
    v_scale: Optional[ArrayLike] = None, kv_starts: Optional[ArrayLike] = None,
    query_offset: Optional[ArrayLike] = None,
    out: Optional[NDArray[Any]] = None,
    precision: Optional[Precision] = None, num_threads: Optional[SupportsIndex] = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]:
    """Scaled dot-product attention.

    Computes ``SCORES = softmax(Q K^T * scale + mask)`` row by row and
    ``ATTN = SCORES V``, exactly (float32 and float64 agree with a float64
    reference to rounding), in parallel over blocks of query rows.

    Parameters
    ----------
    q : array_like, shape (..., T, d_k)
        Queries: float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or
        float64, or integer or bool (computed as float64); see Notes for
        mixed dtypes.
    k : array_like, shape (..., S, d_k)
        Keys, of the same kinds of dtype.
    v : array_like, shape (..., S, d_v)
        Values, likewise; d_v may differ from d_k.
    causal : bool, default False
        Query ``i`` sees key ``j`` only if ``j <= i + (S - T)``: the queries
        are the *last* T positions of the key sequence ("bottom-right"
        alignment, what a KV cache needs; PyTorch's ``causal_lower_right``).
        For T == S this is ``j <= i``. When T > S the first T - S rows see no
        key and are zero.
    mask : array_like, optional
        Broadcastable to ``(..., T, S)``. A bool mask where **True means
        "may attend"**, or a float mask **added to the scaled logits**
        (``-inf`` masks; a NaN or ``+inf`` where a key is visible makes the
        row NaN, as the formula does). Combines with ``causal``. Its
        leading dimensions take part in batch broadcasting.
    scale : float, optional
        Multiplies ``Q K^T``; default ``1 / sqrt(d_k)``. Any finite value
        the compute dtype holds (for float32, 0 or a magnitude between
        1.4e-45 and 3.4e38), including 0 and negatives. It multiplies the
        finished dot products, so both they and the scaled logits must be
        finite in the compute dtype: a row with either beyond its range
        (float32: 3.4e38) towards +inf is NaN, even if the scale would
        bring it back, and so is a row whose every visible logit is beyond
        it towards -inf (among finite logits such a one weighs 0).
        With int8 K, at most 8 query rows and no SCORES, q.k is taken over
        the int8 values before their row scale, so that product must be
        finite too.
    return_scores : bool, default False
        Also return SCORES.
    return_lse : bool, default False
        Also return the log-sum-exp of each row's scaled, masked logits,
        the row's sink included when ``sinks`` is given (``-inf`` for a row
        that sees no key and has no sink: the log of an empty sum;
        FlashAttention gives ``+inf``, see :func:`merge`). Attention over
        disjoint key chunks combines exactly with :func:`merge` using it.
    enable_gqa : bool, default False
        Grouped-query attention: q has H query heads on axis -3 and k, v
        have H_kv heads there, H a multiple of H_kv; query head h uses
        key/value head ``h // (H // H_kv)`` (PyTorch's ``enable_gqa``). K and
        V are never copied or repeated. A mask's head axis may be H or 1.
    kv_lengths : array_like of int, optional
        Valid key counts: a scalar; a 1-D array of length B, one length per
        sequence (the first batch axis: for ``(B, H, T, d)`` inputs it
        applies to every head of sequence b, as ``cache_lengths`` does; any
        other 1-D length is an error when there are several batch
        dimensions); or an array broadcastable to the batch shape (the
        dimensions before T, e.g. ``(B, H)`` for one length per head).
        Batch entry b has only its first ``kv_lengths[b]`` keys (right
        padding, as in a batched KV cache); the others take no part. With
        ``causal=True`` the alignment uses the valid length: key j is visible
        to query i iff ``j <= i + (kv_lengths[b] - T)``. Values in [0, S].
    kv_starts : array_like of int, optional
        The first valid key of each batch entry (left padding: a batch
        ``generate`` pads on the left; FlashAttention's ``cache_leftpad``),
        shaped and read as ``kv_lengths``: batch entry b has only the keys
        ``kv_starts[b] <= j < kv_lengths[b]``. The alignment stays
        against the end of that range, so a left-padded row's positions,
        its window and its ALiBi distances are those of the same row
        without the padding. Key blocks before the start are never read.
        Values in [0, S]; a start at or past the end leaves no key.
    query_offset : array_like of int, optional
        The key position that query row 0 sits at, shaped and read as
        ``kv_lengths`` (one value per batch entry): query row i sits at
        position ``i + query_offset[b]``, which the causal mask, the window
        and the ALiBi distances use in place of the default
        ``i + (S - T)`` (``i + (kv_lengths[b] - T)``). None (the default) keeps
        that bottom-right alignment. With it, a chunk of query rows
        ``[t0, t1)`` against a chunk of keys ``[s0, s1)`` of a longer
        sequence is computed at its global position by passing
        ``query_offset = t0 - s0 + (S - T)`` for the whole sequence's
        (S, T) (``t0 - s0`` when T == S); the chunks then combine with
        :func:`merge`. Any integer of magnitude up to 2**62: a row whose
        position lies before every key sees none under ``causal`` (zero
        rows), one far past them sees them all.
    window : (int or None, int or None), optional
        Sliding-window (local) attention: key j is visible to query i iff
        ``i + off - left <= j <= i + off + right`` with ``off = S - T`` (or
        ``kv_lengths[b] - T``, or ``query_offset``); None on a side means unbounded (so does a
        width past every key, however large). ``causal`` implies
        ``right = 0``. Cost scales with the window, not with S.
    softcap : float, optional
        Logits become ``softcap * tanh(logits / softcap)`` after scaling and
        before ALiBi and the mask. Positive, and a value the compute dtype
        holds (float32: 1.4e-45 to 3.4e38).
    alibi_slopes : array_like, shape (H,) or (B, H), optional
        Adds ``-slope * |i + off - j|`` to the logits (FlashAttention's
        convention), the slope of each query head; ``off`` as for
        ``window``.
    k_scale, v_scale : array_like, optional
        With an int8 k or v (a quantized cache, see :func:`quantize_kv`):
        the float32 scale of each row, of shape ``k.shape[:-1]`` /
        ``v.shape[:-1]``. The result is attention over ``k * k_scale[...,
        None]`` (and likewise v), computed in float32 as the rows are read,
        never from a float copy. int8 K/V need a float32 (or float16) q;
        with a float q an int8 K or V without its scale is an error (with an
        integer q and no scales, integer inputs are computed as float64).
        With an fp8 k or v (``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2``,
        see :func:`quantize_kv_fp8`): scales that broadcast to
        ``k.shape[:-1]`` (one per tensor, per entry and head, or per row;
        none means 1), each in [0, float32's largest / the format's
        largest]; fp8 K/V need a float32, float16 or bfloat16 q, are
        widened exactly and computed in float32, and the result follows q.
    sinks : array_like, shape (H,) or (B, H), optional
        Attention sinks (gpt-oss): one logit per query head that joins each
        row's softmax with no value, ``p_j = e^(s_j - m) / (e^(sink - m) +
        sum_i e^(s_i - m))`` with m the maximum over the row's visible
        logits and the sink, so SCORES rows sum to ``1 - p_sink``. Broadcast
        like ``alibi_slopes``; ``-inf`` is no sink (bitwise), and so is one
        below the compute dtype's range; at most its largest value
        (float32: 3.4e38). A row that
        sees no key is zero. The log-sum-exp includes the sink, so chunks
        combine with :func:`merge` when exactly one chunk is given the
        sinks.
    out : ndarray, optional
        Where to write ATTN (NumPy's ``out=``): of the result's shape and
        dtype, any strides (e.g. ``y.transpose(0, 2, 1, 3)`` of a
        ``(B, T, H, d_v)`` array ``y``, the layout models want), writable,
        sharing no memory with the inputs. It is returned; its values are
        bitwise those of the call without ``out=``. A call refused for its
        arguments writes nothing.
    precision : {"highest", "high", "medium"}, optional
        How accurate a bfloat16 or float16 result is before its one
        rounding (default "high": faithfully rounded; "highest":
        float32-accurate; "medium": P rounded once to bfloat16 for P.V, as
        PyTorch and serving engines compute). float32 and float64 results
        are the highest at every level. The bounds, and what each kernel
        table runs: :ref:`precision`.
    num_threads : int, optional
        Threads for this call; default ``get_num_threads()`` (which
        :func:`limit_threads` sets for the calling Python thread). A call
        never starts more threads than the CPUs the process may run on.

    Returns
    -------
    attn : ndarray, shape (..., T, d_v)
        float32, float64 or float16, by the dtype rules in the Notes.
    scores : ndarray, shape (..., T, S)
        Only with ``return_scores=True``; the dtype of ``attn``. Each row
        sums to 1, or is all zero if the row sees no key.
    lse : ndarray, shape (..., T)
        Only with ``return_lse=True``; float32 for float32 (and float16)
        inputs, float64 for float64.

    The result is ``attn``, ``(attn, scores)``, ``(attn, lse)`` or
    ``(attn, scores, lse)``.

    Raises
    ------
    TypeError
        q or k None, an input of unsupported dtype (complex, object,
        string, wider than 64 bits), a mask neither bool nor float, or an
        option of the wrong type (``causal``, ``return_scores``,
        ``return_lse`` or ``enable_gqa`` not a bool, ``scale`` or
        ``softcap`` not a real number, ``window`` not a pair of integers or
        None, ``kv_lengths``, ``kv_starts`` or ``query_offset`` not
        integers, ``alibi_slopes`` not real).
    ValueError
        Shapes that do not match or broadcast (d_k of q and k, S of k and v,
        the batch dimensions, the mask, the heads under ``enable_gqa``, the
        batch shape for ``kv_lengths`` or ``alibi_slopes``, a 1-D
        ``kv_lengths`` whose length is not B), an input of fewer than 2
        dimensions or not a regular array (a ragged list), an option out of
        range (``scale`` non-finite or beyond the compute dtype,
        ``num_threads`` not an integer in [1, 2**31 - 1], a negative window
        side, ``kv_lengths`` outside [0, S], ``query_offset`` beyond
        [-2**62, 2**62], ``softcap`` <= 0, ``alibi_slopes``
        non-finite or beyond the compute dtype), d_k == 0 with no ``scale``,
        or ``v`` None (use :func:`attention_scores` for SCORES alone).
    MemoryError
        If per-thread scratch memory cannot be allocated.

    Notes
    -----
    The conventions every call shares are set out once, in the user guide
    (:ref:`conventions`): leading dimensions broadcast by NumPy's rules (a
    K/V with leading dimensions of size 1 is shared, not copied); any
    strides and either byte order give bitwise the result of a native
    contiguous copy, and so does any thread count; float32 and float64 are
    computed in their own precision, mixed inputs follow ``np.result_type``,
    integer and bool inputs are computed as float64, float16 and bfloat16
    in float32 and returned in their own dtype; rows that see no key (fully
    masked, T > S under ``causal``, S == 0) are zero in ATTN and SCORES;
    a key whose weight is exactly zero (a masked key) never touches the
    output, not even with a NaN or Inf in it. The GIL is released while
    computing.

    Memory: without SCORES nothing of size T x S is allocated; the extra
    memory is per-thread scratch of about
    ``(96 * (d_k + 256 + 2 * d_v) + 256 * (d_k + d_v))`` elements. With SCORES
    the SCORES array itself is the scratch.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 8), dtype=np.float32)
    >>> k = rng.standard_normal((2, 6, 8), dtype=np.float32)
    >>> v = rng.standard_normal((2, 6, 3), dtype=np.float32)
    >>> out, scores = ca.attention(q, k, v, causal=True, return_scores=True)
    >>> out.shape, scores.shape
    ((2, 4, 3), (2, 4, 6))
    >>> bool(np.allclose(scores.sum(axis=-1), 1))
    True
    """
    fast = (driver.attention_shortcut(q, k, v, causal, mask, scale, return_scores, return_lse,
                                      enable_gqa, kv_lengths, window, softcap, alibi_slopes,
                                      sinks, k_scale, v_scale, kv_starts, out, num_threads,
                                      local.limit, precision)
            if query_offset is None else None)
    if fast is not None:
        return fast  # type: ignore[no-any-return]
    causal = driver.check_flag(causal, "causal")
    return_scores = driver.check_flag(return_scores, "return_scores")
    return_lse = driver.check_flag(return_lse, "return_lse")
    enable_gqa = driver.check_flag(enable_gqa, "enable_gqa")
    if v is None:
        raise ValueError("v is required; use attention_scores(q, k) for SCORES alone")
    call = dense.prepare_dense(
        q, k, v, causal=causal, mask=mask, scale=scale, want_out=True,
        want_scores=return_scores, want_lse=return_lse, enable_gqa=enable_gqa,
        num_threads=num_threads, kv_lengths=kv_lengths, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        kv_starts=kv_starts, query_offset=query_offset, out=out, precision=precision)
    attn, scores, lse = dense.run(call)
    result = (attn,) + ((scores,) if return_scores else ()) + ((lse,) if return_lse else ())
    # run fills every array it is asked for
    return cast("NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]",
                result if len(result) > 1 else attn)


def attention_scores(
    q: ArrayLike, k: ArrayLike, *, causal: bool = False, mask: Optional[ArrayLike] = None,
    scale: Optional[float] = None, enable_gqa: bool = False,
    kv_lengths: Optional[ArrayLike] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, k_scale: Optional[ArrayLike] = None,
    query_offset: Optional[ArrayLike] = None, num_threads: Optional[SupportsIndex] = None,
) -> NDArray[np.floating[Any]]:
    """The attention weights ``softmax(Q K^T * scale + mask)`` alone.

    Same conventions as :func:`attention` (causal alignment, mask meaning,
    dtypes, broadcasting, zero rows for rows that see no key), set out in
    the user guide: :ref:`conventions`.

    Parameters
    ----------
    q : array_like, shape (..., T, d_k)
        Queries, of the dtypes :func:`attention` accepts.
    k : array_like, shape (..., S, d_k)
        Keys, likewise.
    causal, mask, scale, enable_gqa, kv_lengths, window
        As in :func:`attention`.
    softcap, alibi_slopes, sinks, k_scale, query_offset, num_threads
        As in :func:`attention`.

    Returns
    -------
    scores : ndarray, shape (..., T, S)
        Each row sums to 1, or is all zero if the row sees no key. float32,
        float64 or float16, by the dtype rules of :func:`attention`.

    Raises
    ------
    TypeError, ValueError, MemoryError
        As in :func:`attention`.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> q = np.ones((2, 4))
    >>> ca.attention_scores(q, q, causal=True)
    array([[1. , 0. ],
           [0.5, 0.5]])
    """
    call = dense.prepare_dense(
        q, k, None, causal=driver.check_flag(causal, "causal"), mask=mask, scale=scale,
        want_out=False, want_scores=True, want_lse=False,
        enable_gqa=driver.check_flag(enable_gqa, "enable_gqa"), num_threads=num_threads,
        kv_lengths=kv_lengths, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, k_scale=k_scale, v_scale=None, query_offset=query_offset)
    _, scores, _ = dense.run(call)
    return cast("NDArray[np.floating[Any]]", scores)
