"""Public: merge, the exact combination of attention computed over disjoint
key chunks (by their log-sum-exp)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._prepare.arrays import array

__all__ = ["merge"]


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
    ``lse_i`` is NaN or +inf (a NaN row of attention) is NaN.

    Every cattention call gives ``-inf`` for a row that sees no key: the
    log of its empty sum, so ``exp(lse_i - lse)`` weighs it 0 with no
    special case. FlashAttention's kernels give ``+inf`` for such a row
    (``-inf`` in their split-key partials), which this merge reads as a NaN
    row: map their chunks' LSE first, ``np.where(lse == np.inf, -np.inf,
    lse)``, so that both libraries' empty rows weigh nothing (their
    kernels give ``+inf`` to a row whose sum is NaN too; its output, NaN,
    then weighs nothing either). With attention
    sinks, pass ``sinks=`` to exactly one chunk's call: its log-sum-exp then
    carries the sink (even if that chunk sees no key), and the merge equals
    attention with the sinks over all keys. See :ref:`conventions-lse`.

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
            chunks.append([array(a, f"{name}[{i}]") for i, a in enumerate(arrays)])
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
        # one scratch array for every chunk's weighted output, so that a
        # merge of n chunks makes n passes of a multiply and an add over
        # the rows (a cattention.dask merge of 8 chunks of (8, 4096, 64)
        # went from 0.35 s to about a third of it), with the values of
        # out += where(w != 0, o * w, 0)
        term = np.empty_like(out)
        for o, w in zip(chunk_outs, scale):
            np.multiply(o, w[..., None], out=term)
            # keys of weight 0 take no part, even where their output is NaN
            unseen = w == 0
            if unseen.any():
                term[unseen] = 0
            out += term
    # a NaN or +inf lse (a NaN row of attention) makes its row NaN, not a
    # zero row that would read as "no key seen"
    out[np.isnan(total)] = np.nan
    return out, lse
