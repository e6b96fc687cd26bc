"""Checks and normalisation of a call's arrays and options, each raising a
ValueError or TypeError that names the argument, its shape or dtype.

Nothing here computes attention: the functions bring inputs to a compute
dtype and native byte order (copying only what the kernels cannot read),
and options to the plain values the driver takes.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

_SUPPORTED_DTYPES = (
    "float16, float32 and float64 (integer and bool inputs are computed as float64)"
)


def _as_integer(value: object) -> int | None:
    """value as a Python int if it is an integer (NumPy's too), else None; a
    bool is not taken for an integer."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check_flag(value: object, name: str) -> bool:
    """A bool option: a string or an array is refused, not read as its truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return bool(value)


def _native(arr: NDArray[Any]) -> NDArray[Any]:
    """arr in the machine's byte order: a big-endian array (np.load of a
    ">f4" file, FITS, HDF5, np.frombuffer) is converted, so the kernels
    never read swapped bytes as numbers."""
    if arr.dtype.isnative:
        return arr
    return arr.astype(arr.dtype.newbyteorder("="))


def _array(x: object, name: str) -> NDArray[Any]:
    """np.asarray(x), or an error that names the argument."""
    try:
        return np.asarray(x)
    except ValueError as exc:
        # e.g. a ragged nested list: NumPy's message does not say which argument
        raise ValueError(f"{name} is not a regular array: {exc}") from None


def _as_input(x: ArrayLike, name: str) -> NDArray[Any]:
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    arr = _array(x, name)
    if arr.dtype.kind not in "fiub" or arr.dtype.itemsize > 8:
        raise TypeError(
            f"{name} has dtype {arr.dtype}; cattention supports {_SUPPORTED_DTYPES}")
    arr = _native(arr)
    if arr.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., rows, features); "
            f"got shape {arr.shape}")
    return arr


def _compute_dtype(*arrays: NDArray[Any]) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(compute dtype, result dtype) for the inputs, by np.result_type."""
    common = np.result_type(*arrays)
    if common.kind in "iub":
        return np.dtype(np.float64), np.dtype(np.float64)
    if common == np.float16:
        return np.dtype(np.float32), np.dtype(np.float16)
    return common, common


def _broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """np.broadcast_shapes without its 32-dimension limit (arrays may have
    64); a ValueError when the shapes do not broadcast."""
    ndim = max((len(shape) for shape in shapes), default=0)
    result = [1] * ndim
    for shape in shapes:
        for axis, size in enumerate(shape, start=ndim - len(shape)):
            if size != 1:
                if result[axis] not in (1, size):
                    raise ValueError(f"shapes {', '.join(map(str, shapes))} do not broadcast")
                result[axis] = size
    return tuple(result)


def _output(shape: tuple[int, ...], dtype: np.dtype[Any], name: str) -> NDArray[Any]:
    """An uninitialised output array; one larger than any NumPy can
    allocate is refused naming it (NumPy's own message names nothing)."""
    try:
        return np.empty(shape, dtype=dtype)
    except ValueError:
        raise ValueError(f"{name} would hold {math.prod(shape)} {dtype} values: more bytes "
                         "than an array can hold") from None


def _readable_in_place(arr: NDArray[Any]) -> bool:
    """The kernels read arr where it is: aligned, and every stride a
    multiple of its itemsize (any other array they would read from a copy)."""
    return bool(arr.flags.aligned) and not any(s % arr.itemsize for s in arr.strides)


def _to_compute(arr: NDArray[Any], dtype: np.dtype[Any]) -> NDArray[Any]:
    """arr as dtype, copied only if the dtype differs or the kernel cannot read it."""
    if arr.dtype != dtype:
        return arr.astype(dtype)
    if not _readable_in_place(arr):
        # same bits, aligned and element-strided, so results are unchanged
        return np.array(arr, order="C")
    return arr


def _prepare_mask(mask: ArrayLike, n_queries: int, n_keys: int,
                  dtype: np.dtype[Any]) -> NDArray[Any]:
    arr = _native(_array(mask, "mask"))
    given_shape = arr.shape
    if arr.dtype == np.bool_:
        pass
    elif arr.dtype.kind == "f":
        if arr.dtype not in (np.float32, np.float64):
            arr = arr.astype(dtype)
    else:
        raise TypeError(
            f"mask has dtype {arr.dtype}; it must be bool (True = may attend) or "
            "float (added to the scaled logits, -inf masks)")
    if arr.ndim < 2:
        arr = arr.reshape((1,) * (2 - arr.ndim) + arr.shape)
    if arr.shape[-2] not in (1, n_queries) or arr.shape[-1] not in (1, n_keys):
        raise ValueError(
            f"mask of shape {given_shape} does not broadcast to (..., T, S) = "
            f"(..., {n_queries}, {n_keys})")
    if not _readable_in_place(arr):
        arr = np.array(arr, order="C")
    return arr


def _as_float(value: numbers.Real, name: str) -> float:
    """float(value), or a ValueError naming the argument (an int beyond
    float64's range)."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got a number too large for a "
                         "float") from None


def _resolve_scale(scale: object, d_k: int) -> float:
    if scale is None:
        if d_k == 0:
            raise ValueError(
                "d_k is 0 (q and k have shape (..., T, 0) and (..., S, 0)), so the "
                "default scale 1/sqrt(d_k) is undefined; pass scale explicitly")
        return 1.0 / math.sqrt(d_k)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {scale!r}")
    value = _as_float(scale, "scale")
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def _check_fits(value: float, compute: np.dtype[Any], name: str) -> None:
    """The kernels multiply by the scale and divide by the softcap in the
    compute dtype: a value it cannot hold would turn every logit into inf
    (then NaN) or 0. (0 passes: a scale of 0, or no softcap.)"""
    if value == 0:
        return
    info = np.finfo(compute)
    if not float(info.smallest_subnormal) <= abs(value) <= float(info.max):
        raise ValueError(
            f"{name} {value!r} is not representable in {compute} (the compute dtype of "
            f"these inputs): its magnitude must lie in [{info.smallest_subnormal}, "
            f"{info.max}]")


#: A window side at or beyond this many positions sees every key.
_WIDEST_WINDOW = 2**62


def _check_window(window: Any, causal: bool) -> tuple[int, int]:
    """(left, right) as ints, -1 for an unbounded side; causal forces right 0."""
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"window must be None or a (left, right) pair, got {window!r}") from None
    bounds = []
    for name, side in (("left", left), ("right", right)):
        if side is None:
            bounds.append(-1)
            continue
        value = _as_integer(side)
        if value is None:
            raise TypeError(f"window {name} must be an integer or None, got {side!r}")
        if value < 0:
            raise ValueError(f"window {name} must be >= 0 (or None), got {value}")
        # a side wider than any sequence is unbounded; clamped so that it
        # fits a C integer and the kernels' index sums cannot overflow
        bounds.append(min(value, _WIDEST_WINDOW))
    if causal:
        bounds[1] = 0
    return bounds[0], bounds[1]


def _fit_sinks(sinks: NDArray[np.float64] | None,
               compute: np.dtype[Any]) -> NDArray[np.float64] | None:
    """Sink logits join each row's softmax and its log-sum-exp in the
    compute dtype: one above its range would be an infinite log-sum-exp,
    refused; one below it weighs nothing and becomes -inf, no sink, so that
    every path gives the bits of no sink (the kernels tell a sink by its
    float64 value)."""
    if sinks is None or not sinks.size:
        return sinks
    limit = float(np.finfo(compute).max)
    if float(sinks.max()) > limit:
        raise ValueError(
            f"sinks must be at most {limit:.4g} (the largest {compute}, the compute dtype "
            f"of these inputs); got {float(sinks.max()):.4g}")
    if float(sinks.min()) < -limit:
        sinks = np.where(sinks < -limit, -np.inf, sinks)
    return sinks


def _memory_owner(a: NDArray[Any]) -> NDArray[Any] | None:
    """The ndarray that allocated a's memory, or None when it came from
    another object (a buffer, a memory map), which may be shared."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None and a.flags.owndata else None


def _refuse_shared_memory(written: list[tuple[str, Any]],
                          read: list[tuple[str, Any]]) -> None:
    """Arrays a call writes in place must not share memory with each other
    or with the arrays it reads: the result would depend on the order of the
    writes."""
    written_owners = [_memory_owner(a) for _, a in written if isinstance(a, np.ndarray)]
    read_owners = [_memory_owner(a) for _, a in read if isinstance(a, np.ndarray)]
    if all(o is not None for o in written_owners + read_owners):
        # each in an allocation of NumPy's own (the common case, fast): apart
        # unless a written array's allocation holds another array too (read
        # arrays may share theirs: k_new is v_new)
        written_ids = [id(o) for o in written_owners]
        if (len(set(written_ids)) == len(written_ids)
                and not set(written_ids) & {id(o) for o in read_owners}):
            return
    pairs = [(a, b) for i, a in enumerate(written) for b in written[i + 1:]]
    pairs += [(a, b) for a in written for b in read]
    for (name_a, a), (name_b, b) in pairs:
        if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
            continue
        # exact: views that interleave without overlapping (K and V of one
        # fused buffer) are not refused
        if np.shares_memory(a, b):
            raise ValueError(f"{name_a} and {name_b} share memory, but {name_a} is written "
                             "in place by this call; pass separate arrays (e.g. a copy of "
                             f"{name_b})")


def _check_softcap(softcap: object) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be None or a positive number, got {softcap!r}")
    value = _as_float(softcap, "softcap")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softcap must be a positive finite number, got {value}")
    return value


def _per_batch_entry(values: ArrayLike, batch_shape: tuple[int, ...], name: str, kinds: str,
                     kind_text: str, dtype: DTypeLike, hint: str) -> NDArray[Any]:
    """values broadcast to the batch shape: one per batch entry, C-contiguous."""
    arr = _array(values, name)
    if arr.dtype.kind not in kinds:
        raise TypeError(f"{name} must be {kind_text}, got dtype {arr.dtype}")
    try:
        full = np.broadcast_to(arr, batch_shape)
    except ValueError:
        raise ValueError(
            f"{name} of shape {arr.shape} does not broadcast to the batch "
            f"shape {batch_shape} ({hint})") from None
    return np.ascontiguousarray(full, dtype=dtype).reshape(-1)


def _prepare_sinks(sinks: ArrayLike, batch_shape: tuple[int, ...]) -> NDArray[np.float64]:
    """One float64 sink logit per batch entry; -inf is no sink."""
    full = _per_batch_entry(_native(_array(sinks, "sinks")), batch_shape, "sinks", "fiu",
                            "real numbers", np.float64, "expected (H,) or (B, H)")
    _check_sink_values(full)
    return full


def _check_sink_values(sinks: NDArray[np.float64]) -> None:
    if np.any(np.isnan(sinks)) or np.any(sinks == np.inf):
        raise ValueError("sinks must be finite, or -inf for no sink; got NaN or +inf")


def _prepare_alibi(alibi_slopes: ArrayLike, batch_shape: tuple[int, ...],
                   compute: np.dtype[Any]) -> NDArray[np.float64]:
    """One float64 slope per batch entry."""
    full = _per_batch_entry(alibi_slopes, batch_shape, "alibi_slopes", "fiu",
                            "real numbers", np.float64, "expected (H,) or (B, H)")
    _check_alibi_values(full, compute)
    return full


def _check_alibi_values(slopes: NDArray[np.float64], compute: np.dtype[Any]) -> None:
    """Finite slopes the compute dtype holds: the biases are logits of that
    dtype, and a slope beyond it makes every bias off the diagonal infinite
    (NaN rows). A slope within it times a long distance can still leave the
    dtype's range, as any logit can (a +inf logit makes its row NaN)."""
    if not np.all(np.isfinite(slopes)):
        raise ValueError("alibi_slopes must be finite")
    limit = float(np.finfo(compute).max)
    if slopes.size and float(np.abs(slopes).max()) > limit:
        raise ValueError(
            f"alibi_slopes must lie in [-{limit:.4g}, {limit:.4g}] (the range of {compute}, "
            f"the compute dtype of these inputs); got {float(np.abs(slopes).max()):.4g} in "
            "magnitude")


def _prepare_kv_lengths(kv_lengths: ArrayLike, batch_shape: tuple[int, ...],
                        n_keys: int) -> NDArray[np.intp]:
    """Valid key counts, one intp per batch entry."""
    given = np.asarray(kv_lengths)
    full = _per_batch_entry(given, batch_shape, "kv_lengths", "iu", "integers",
                            np.intp, "the dimensions before T")
    # the range of the values given, in Python ints: a uint64 beyond intp
    # wraps around in ``full``
    if full.size and (int(given.min()) < 0 or int(given.max()) > n_keys):
        raise ValueError(
            f"kv_lengths must lie in [0, S] = [0, {n_keys}]; got values from "
            f"{int(given.min())} to {int(given.max())}")
    return full


def _lengths_per_sequence(kv_lengths: ArrayLike, q: NDArray[Any], k: NDArray[Any],
                          v: NDArray[Any] | None, mask: ArrayLike | None = None,
                          ) -> NDArray[Any]:
    """kv_lengths with a 1-D array of length B taken as one length per
    sequence (the first batch axis), as ``cache_lengths`` is, whatever the
    other batch dimensions are: with inputs (B, H, T, d) and B == H a bare
    trailing-axis broadcast would silently read it per head. The batch
    dimensions are those of q, k, v and the mask (which may bring B alone)."""
    arr = _native(_array(kv_lengths, "kv_lengths"))
    operands = (q, k) if v is None else (q, k, v)
    leading = [a.shape[:-2] for a in operands]
    try:
        mask_shape = np.shape(mask) if mask is not None else ()
    except ValueError:
        mask_shape = ()    # not a regular array: reported as the mask's own error
    if len(mask_shape) > 2:
        leading.append(mask_shape[:-2])
    try:
        batch_shape = _broadcast_shapes(*leading)
    except ValueError:
        try:
            # grouped heads (H != H_kv): the dimensions before the head axis
            # (the mask's too) broadcast, then q's heads
            before_heads = [a.shape[:-3] for a in operands]
            if len(mask_shape) > 3:
                before_heads.append(mask_shape[:-3])
            batch_shape = _broadcast_shapes(*before_heads) + q.shape[-3:-2]
        except ValueError:
            # a mismatch, reported later
            batch_shape = q.shape[:-2]
    if arr.ndim != 1 or len(batch_shape) < 2 or arr.shape[0] == 1:
        return arr
    if arr.shape[0] != batch_shape[0]:
        raise ValueError(
            f"kv_lengths of shape {arr.shape} is ambiguous for batch dimensions "
            f"{batch_shape}: a 1-D kv_lengths holds one length per sequence and must "
            f"have length B = {batch_shape[0]}; for other layouts pass an array that "
            f"broadcasts to {batch_shape}, e.g. shape {batch_shape[:1] + batch_shape[1:]} "
            f"or {(1,) + batch_shape[1:]}")
    return arr.reshape(arr.shape + (1,) * (len(batch_shape) - 1))


def _gqa_hint(q: NDArray[Any], k: NDArray[Any]) -> str:
    """A hint when q has a multiple of k's heads but enable_gqa was not given."""
    if q.ndim >= 3 and k.ndim >= 3:
        n_heads, n_kv_heads = q.shape[-3], k.shape[-3]
        if 1 < n_kv_heads < n_heads and n_heads % n_kv_heads == 0:
            return (f"; q has {n_heads} heads and k {n_kv_heads} (axis -3): pass "
                    "enable_gqa=True for grouped-query attention")
    return ""
