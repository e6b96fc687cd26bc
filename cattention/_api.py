"""Public API: attention, attention_scores and merge.

Nothing here loops over data. A call's arrays and options are checked once
into a :class:`~cattention._call.Call` (``_checks``, ``_call``), grouped-query
calls are regrouped by views (``_gqa``), and the Cython driver reads the
inputs in any layout (transposed, negative or zero strides) without copying.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, SupportsIndex, cast, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import _attention
from ._call import make_call, run
from ._checks import _array, _check_flag
from ._gqa import run_grouped
from ._threads import _local, get_num_threads, limit_threads, set_num_threads

__all__ = [
    "attention",
    "attention_scores",
    "get_num_threads",
    "limit_threads",
    "merge",
    "set_num_threads",
]


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: Literal[False] = False, return_lse: Literal[False] = False,
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: Literal[True], return_lse: Literal[False] = False,
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: Literal[False] = False, return_lse: Literal[True],
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: Literal[True], return_lse: Literal[True],
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]],
           NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: bool = False, return_lse: bool = False,
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]: ...


def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: bool = False, return_lse: bool = False,
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]:
    """Scaled dot-product attention.

    Computes ``SCORES = softmax(Q K^T * scale + mask)`` row by row and
    ``ATTN = SCORES V``, exactly (float32 and float64 agree with a float64
    reference to rounding), in parallel over blocks of query rows.

    Parameters
    ----------
    q : array_like, shape (..., T, d_k)
        Queries: float16, float32 or float64, or integer or bool (computed
        as float64); see Notes for mixed dtypes.
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
        that sees no key and has no sink). Attention over disjoint key
        chunks combines exactly with :func:`merge` using it.
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
    window : (int or None, int or None), optional
        Sliding-window (local) attention: key j is visible to query i iff
        ``i + off - left <= j <= i + off + right`` with ``off = S - T`` (or
        ``kv_lengths[b] - T``); None on a side means unbounded (so does a
        width past every key, however large). ``causal`` implies
        ``right = 0``. Cost scales with the window, not with S.
    softcap : float, optional
        Logits become ``softcap * tanh(logits / softcap)`` after scaling and
        before ALiBi and the mask. Positive, and a value the compute dtype
        holds (float32: 1.4e-45 to 3.4e38).
    alibi_slopes : array_like, shape (H,) or (B, H), optional
        Adds ``-slope * |i + off - j|`` to the logits (FlashAttention's
        convention), the slope of each query head.
    k_scale, v_scale : array_like, optional
        With an int8 k or v (a quantized cache, see :func:`quantize_kv`):
        the float32 scale of each row, of shape ``k.shape[:-1]`` /
        ``v.shape[:-1]``. The result is attention over ``k * k_scale[...,
        None]`` (and likewise v), computed in float32 as the rows are read,
        never from a float copy. int8 K/V need a float32 (or float16) q;
        with a float q an int8 K or V without its scale is an error (with an
        integer q and no scales, integer inputs are computed as float64).
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
        None, ``kv_lengths`` not integers, ``alibi_slopes`` not real).
    ValueError
        Shapes that do not match or broadcast (d_k of q and k, S of k and v,
        the batch dimensions, the mask, the heads under ``enable_gqa``, the
        batch shape for ``kv_lengths`` or ``alibi_slopes``, a 1-D
        ``kv_lengths`` whose length is not B), an input of fewer than 2
        dimensions or not a regular array (a ragged list), an option out of
        range (``scale`` non-finite or beyond the compute dtype,
        ``num_threads`` not an integer in [1, 2**31 - 1], a negative window
        side, ``kv_lengths`` outside [0, S], ``softcap`` <= 0, ``alibi_slopes``
        non-finite or beyond the compute dtype), d_k == 0 with no ``scale``,
        or ``v`` None (use :func:`attention_scores` for SCORES alone).
    MemoryError
        If per-thread scratch memory cannot be allocated.

    Notes
    -----
    Leading (batch) dimensions of q, k, v and mask broadcast by NumPy's
    rules; a K/V with leading dimensions of size 1 is shared, not copied.
    Any strides are accepted (transposed, negative, zero, read-only), and
    so is either byte order (a big-endian array from a file is converted);
    each gives bitwise the same result as a native contiguous copy. Results
    are also bitwise the same for any thread count. The GIL is released
    while computing.

    dtypes: float32 and float64 are computed in their own precision; mixed
    inputs follow ``np.result_type``; integer and bool inputs are computed as
    float64; float16 is computed in float32 and returned as float16.

    Rows that can see no key (fully masked, T > S under ``causal``, S == 0)
    are zero in ATTN and SCORES. Masked keys take no part at all: a NaN or
    Inf in a masked-out key or value cannot reach the output. More generally
    a key whose weight is exactly zero never touches the output.

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
    if (mask is None and return_lse is False and kv_lengths is None
            and window is None and softcap is None and alibi_slopes is None and sinks is None
            and k_scale is None and v_scale is None):
        # (attention_fast takes only bool flags: anything else comes here)
        fast = _attention.attention_fast(
            q, k, v, causal, scale, num_threads, return_scores, _local.limit, enable_gqa)
        if fast is not None:
            return fast
    causal = _check_flag(causal, "causal")
    return_scores = _check_flag(return_scores, "return_scores")
    return_lse = _check_flag(return_lse, "return_lse")
    enable_gqa = _check_flag(enable_gqa, "enable_gqa")
    if v is None:
        raise ValueError("v is required; use attention_scores(q, k) for SCORES alone")
    call = make_call(q, k, v, causal=causal, mask=mask, scale=scale, want_out=True,
                     want_scores=return_scores, want_lse=return_lse,
                     num_threads=num_threads, kv_lengths=kv_lengths, window=window,
                     softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                     k_scale=k_scale, v_scale=v_scale)
    out, scores, lse = run_grouped(call) if enable_gqa else run(call)
    result = (out,) + ((scores,) if return_scores else ()) + ((lse,) if return_lse else ())
    # run fills every array it is asked for
    return cast("NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]",
                result if len(result) > 1 else out)


def attention_scores(
    q: ArrayLike, k: ArrayLike, *, causal: bool = False, mask: ArrayLike | None = None,
    scale: float | None = None, enable_gqa: bool = False,
    kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]]:
    """The attention weights ``softmax(Q K^T * scale + mask)`` alone.

    Same conventions as :func:`attention` (causal alignment, mask meaning,
    dtypes, broadcasting, zero rows for rows that see no key).

    Parameters
    ----------
    q : array_like, shape (..., T, d_k)
    k : array_like, shape (..., S, d_k)
        Queries and keys, of the dtypes :func:`attention` accepts.
    causal, mask, scale, enable_gqa, kv_lengths, window, softcap, alibi_slopes, sinks
    k_scale, num_threads
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
    call = make_call(q, k, None, causal=_check_flag(causal, "causal"), mask=mask,
                     scale=scale, want_out=False, want_scores=True, want_lse=False,
                     num_threads=num_threads, kv_lengths=kv_lengths, window=window,
                     softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                     k_scale=k_scale, v_scale=None)
    _, scores, _ = (run_grouped(call) if _check_flag(enable_gqa, "enable_gqa")
                    else run(call))
    return cast("NDArray[np.floating[Any]]", scores)


def merge(
    outs: Iterable[ArrayLike], lses: Iterable[ArrayLike],
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]:
    """Combine attention computed over disjoint key chunks into the result
    over all keys.

    With ``lse = logsumexp_i lse_i`` the result is
    ``out = sum_i outs[i] * exp(lses[i] - lse)``: exactly attention over the
    union of the chunks, up to rounding. Chunks that see no key
    (``lse_i = -inf``) contribute nothing; if no chunk sees a key the row is
    zero with ``lse = -inf``, as from :func:`attention`. A row where some
    ``lse_i`` is NaN or +inf (a NaN row of attention) is NaN. With attention
    sinks, pass ``sinks=`` to exactly one chunk's call: its log-sum-exp then
    carries the sink (even if that chunk sees no key), and the merge equals
    attention with the sinks over all keys.

    Parameters
    ----------
    outs : sequence of array_like, each of shape (..., T, d_v)
        ``attention(q, k_i, v_i, return_lse=True)[0]`` for each chunk i;
        floating point.
    lses : sequence of array_like, each of shape (..., T)
        The matching log-sum-exp values.

    Returns
    -------
    out : ndarray, shape (..., T, d_v)
    lse : ndarray, shape (..., T)
        Both of ``np.result_type(*outs, *lses)``.

    Raises
    ------
    ValueError
        If there are no chunks, a different number of outputs and lse
        arrays, outputs of different shapes, or an lse whose shape is not
        its output's without the last axis.
    TypeError
        If a chunk is not numeric, or the arrays' common dtype
        (``np.result_type``) is not floating point.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 8)) for _ in range(3))
    >>> first = ca.attention(q, k[:5], v[:5], return_lse=True)
    >>> rest = ca.attention(q, k[5:], v[5:], return_lse=True)
    >>> out, lse = ca.merge([first[0], rest[0]], [first[1], rest[1]])
    >>> bool(np.allclose(out, ca.attention(q, k, v)))
    True
    """
    chunks = []
    for name, arrays in (("outs", outs), ("lses", lses)):
        try:
            chunks.append([_array(a, f"{name}[{i}]") for i, a in enumerate(arrays)])
        except TypeError:
            raise TypeError(f"{name} must be an iterable of arrays, one per chunk; got "
                            f"{type(arrays).__name__}") from None
    chunk_outs, chunk_lses = chunks
    if len(chunk_outs) == 0 or len(chunk_outs) != len(chunk_lses):
        raise ValueError(
            f"merge needs one lse per output and at least one of each; got "
            f"{len(chunk_outs)} outputs and {len(chunk_lses)} lse arrays")
    for i, (o, x) in enumerate(zip(chunk_outs, chunk_lses)):
        for name, arr in ((f"outs[{i}]", o), (f"lses[{i}]", x)):
            if arr.dtype.kind not in "fiub":
                raise TypeError(f"merge needs floating-point arrays; {name} has dtype "
                                f"{arr.dtype}")
        if o.ndim < 2:
            raise ValueError(f"chunk {i}: the output needs rows and features, (..., T, d_v); "
                             f"got shape {o.shape}")
        if x.shape != o.shape[:-1]:
            raise ValueError(
                f"chunk {i}: lse of shape {x.shape} does not match output of shape "
                f"{o.shape} (expected lse shape {o.shape[:-1]})")
        if o.shape != chunk_outs[0].shape:
            raise ValueError(
                f"chunk {i}: output of shape {o.shape} differs from chunk 0's "
                f"{chunk_outs[0].shape}")
    dtype = np.result_type(*chunk_outs, *chunk_lses)
    if dtype.kind != "f":
        raise TypeError(f"merge needs floating-point arrays, got {dtype}")
    stacked_lse = np.stack(chunk_lses).astype(dtype, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.max(stacked_lse, axis=0)
        # chunks that saw no key weigh 0; rows where none did stay -inf
        shift = np.where(np.isneginf(top), 0, top)
        weights = np.where(np.isneginf(stacked_lse), 0, np.exp(stacked_lse - shift))
        total = np.sum(weights, axis=0)
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1)), top)
        scale = np.where(total > 0, weights / np.where(total > 0, total, 1), 0)
        out = np.zeros(chunk_outs[0].shape, dtype=dtype)
        for o, w in zip(chunk_outs, scale):
            # keys of weight 0 take no part, even where their output is NaN
            out += np.where(w[..., None] != 0, o * w[..., None], 0)
    # a NaN or +inf lse (a NaN row of attention) makes its row NaN, not a
    # zero row that would read as "no key seen"
    out[np.isnan(total)] = np.nan
    return out, lse
