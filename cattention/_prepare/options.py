"""The options every row of a call obeys (RowOptions), built once per call:
scale, causal alignment, sliding window, softcap, ALiBi slopes, sinks, and
the thread count. The scalar checks are the driver's own (``checks.pxd``,
shared with the compiled shortcuts); the per-entry arrays are broadcast
here."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Literal, Optional, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .arrays import array, broadcast_shapes, native, per_batch_entry


class ThreadLocalLimit(threading.local):
    """``local.limit``: the thread count that applies to a call from this
    Python thread with num_threads=None: limit_threads(), else
    set_num_threads(), else None (OpenMP's current setting).

    set_num_threads() sets the class attribute, seen by every Python thread;
    limit_threads() sets an instance attribute, local to the thread, which
    shadows it. One attribute read answers a call (the shortcuts read it)."""

    limit: Optional[int] = None


local = ThreadLocalLimit()

#: The precision levels of a bfloat16 or float16 result (``precision=``)
Precision = Literal["highest", "high", "medium"]


@dataclasses.dataclass
class RowOptions:
    """What every row of a call obeys: the Python side of the driver's
    RowOptions (``_driver/problem.pxd``), handed to the run unchanged."""

    causal: bool
    scale: float                           # multiplies q.k
    window: tuple[int, int] = (-1, -1)     # (left, right); -1: unbounded
    softcap: float = 0.0                   # 0: off
    threads: int = 1
    precision: int = 0                     # CA_PRECISION_* (kernels.h): 0 highest
    alibi: Optional[NDArray[np.float64]] = None   # a slope per batch entry
    sinks: Optional[NDArray[np.float64]] = None   # a logit per group of query_period rows
    # the cache calls' rotary tables of q's rows, (cos, sin, first,
    # interleaved) as rotary.Rotary.tables gives them; None: no rotation
    rotary: Optional[tuple[Any, ...]] = None


def row_options(*, causal: bool, scale: object, d_k: int, compute: np.dtype[Any],
                result: np.dtype[Any], window: Any, softcap: object, precision: object,
                num_threads: Optional[SupportsIndex]) -> RowOptions:
    """The scalar options, checked; the per-entry ones are set by the
    layout (per_entry_alibi, per_entry_sinks). The precision level applies
    to a 16-bit result (result.itemsize 2)."""
    in_float32 = compute == np.float32
    left, right = driver.check_window(window, causal)
    return RowOptions(causal, driver.check_scale(scale, d_k, in_float32), (left, right),
                      driver.check_softcap(softcap, in_float32),
                      driver.resolve_threads(num_threads, local.limit),
                      precision=driver.check_precision(precision, result.itemsize == 2))


def check_sink_values(sinks: NDArray[np.float64], compute: np.dtype[Any],
                      ) -> NDArray[np.float64]:
    """Sink logits, checked by the driver (checks.pxd); those below the
    compute dtype's range become -inf (no sink), in a copy."""
    sinks = np.array(sinks, dtype=np.float64, order="C")
    driver.check_sinks(sinks.reshape(-1), compute == np.float32)
    return sinks


def check_alibi_values(slopes: NDArray[np.float64], compute: np.dtype[Any]) -> None:
    """ALiBi slopes, checked by the driver (checks.pxd)."""
    driver.check_alibi_slopes(np.ascontiguousarray(slopes, dtype=np.float64).reshape(-1),
                              compute == np.float32)


_PER_HEAD_HINT = "expected (H,) or (B, H)"


def per_entry_sinks(sinks: ArrayLike, batch_shape: tuple[int, ...],
                    compute: np.dtype[Any]) -> NDArray[np.float64]:
    """One float64 sink logit per batch entry; -inf is no sink."""
    full = per_batch_entry(native(array(sinks, "sinks")), batch_shape, "sinks", "fiu",
                           "real numbers", np.float64, _PER_HEAD_HINT)
    return check_sink_values(full, compute)


def per_entry_alibi(alibi_slopes: ArrayLike, batch_shape: tuple[int, ...],
                    compute: np.dtype[Any]) -> NDArray[np.float64]:
    """One float64 slope per batch entry."""
    full = per_batch_entry(alibi_slopes, batch_shape, "alibi_slopes", "fiu",
                           "real numbers", np.float64, _PER_HEAD_HINT)
    check_alibi_values(full, compute)
    return full


def per_entry_key_positions(values: ArrayLike, batch_shape: tuple[int, ...], n_keys: int,
                            name: str) -> NDArray[np.intp]:
    """kv_lengths or kv_starts: a key position in [0, S], one intp per batch
    entry (checked by the driver, checks.pxd)."""
    given = np.asarray(values)
    full = per_batch_entry(given, batch_shape, name, "iu", "integers",
                           np.intp, "the dimensions before T")
    if given.dtype.kind == "u" and given.size and int(given.max()) > np.iinfo(np.intp).max:
        # beyond intp, where ``full`` wraps around: out of [0, S] whatever S
        raise ValueError(f"{name} must lie in [0, S] = [0, {n_keys}]; got values from "
                         f"{int(given.min())} to {int(given.max())}")
    driver.check_key_positions(full, n_keys, name)
    return full


#: The largest magnitude of a query_offset: positions of +-2^62 and windows
#: of up to 2^62 (checks.pxd's widest_window) keep visibility.pxd's sums
#: within 64 bits. Offsets that far from any key already make every row see
#: every key or none.
QUERY_OFFSET_LIMIT = 1 << 62


def per_entry_query_offset(values: ArrayLike,
                           batch_shape: tuple[int, ...]) -> NDArray[np.intp]:
    """query_offset: the key position of query row 0, one intp per batch
    entry; any integer of magnitude up to QUERY_OFFSET_LIMIT (negative, or
    past S: rows then see no key or every key)."""
    given = native(array(values, "query_offset"))
    if given.dtype == object and given.size and all(
            isinstance(x, int) and not isinstance(x, bool) for x in given.flat):
        # Python ints beyond 64 bits (NumPy keeps them as objects)
        raise ValueError(
            f"query_offset must lie in [-2**62, 2**62]; got values from {min(given.flat)} "
            f"to {max(given.flat)}")
    full = per_batch_entry(given, batch_shape, "query_offset", "iu", "integers",
                           np.intp, "the dimensions before T")
    # the range of the values given, in Python ints: a uint64 beyond intp
    # wraps around in ``full``
    if given.size and (int(given.min()) < -QUERY_OFFSET_LIMIT
                       or int(given.max()) > QUERY_OFFSET_LIMIT):
        raise ValueError(
            f"query_offset must lie in [-2**62, 2**62]; got values from "
            f"{int(given.min())} to {int(given.max())}")
    return full


_PER_SEQUENCE_VALUE = {"kv_lengths": "length", "kv_starts": "start",
                       "query_offset": "offset"}


def per_sequence(values: ArrayLike, q: NDArray[Any], k: NDArray[Any],
                 v: Optional[NDArray[Any]], mask: Optional[ArrayLike] = None,
                 name: str = "kv_lengths") -> NDArray[Any]:
    """kv_lengths or kv_starts with a 1-D array of length B taken as one
    value per sequence (the first batch axis), as ``cache_lengths`` is,
    whatever the other batch dimensions are: with inputs (B, H, T, d) and
    B == H a bare trailing-axis broadcast would silently read it per head.
    The batch dimensions are those of q, k, v and the mask (which may bring
    B alone)."""
    arr = native(array(values, name))
    operands = (q, k) if v is None else (q, k, v)
    leading = [a.shape[:-2] for a in operands]
    try:
        mask_shape = np.shape(mask) if mask is not None else ()
    except ValueError:
        mask_shape = ()    # not a regular array: reported as the mask's own error
    if len(mask_shape) > 2:
        leading.append(mask_shape[:-2])
    try:
        batch_shape = broadcast_shapes(*leading)
    except ValueError:
        try:
            # grouped heads (H != H_kv): the dimensions before the head axis
            # (the mask's too) broadcast, then q's heads
            before_heads = [a.shape[:-3] for a in operands]
            if len(mask_shape) > 3:
                before_heads.append(mask_shape[:-3])
            batch_shape = broadcast_shapes(*before_heads) + q.shape[-3:-2]
        except ValueError:
            # a mismatch, reported later
            batch_shape = q.shape[:-2]
    if arr.ndim != 1 or len(batch_shape) < 2 or arr.shape[0] == 1:
        return arr
    if arr.shape[0] != batch_shape[0]:
        raise ValueError(
            f"{name} of shape {arr.shape} is ambiguous for batch dimensions "
            f"{batch_shape}: a 1-D {name} holds one "
            f"{_PER_SEQUENCE_VALUE.get(name, 'value')} per sequence and must "
            f"have length B = {batch_shape[0]}; for other layouts pass an array that "
            f"broadcasts to {batch_shape}, e.g. shape {batch_shape[:1] + batch_shape[1:]} "
            f"or {(1,) + batch_shape[1:]}")
    return arr.reshape(arr.shape + (1,) * (len(batch_shape) - 1))
