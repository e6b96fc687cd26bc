"""fp8 K/V: the two 8-bit float formats (ml_dtypes' ``float8_e4m3fn`` and
``float8_e5m2``), their scales, and values rounded into them
(``quantize_kv_fp8``, and new rows as an fp8 cache stores them).

An fp8 cache holds a quarter of float32's bytes, as int8 does, but each
code is a float of its own: a scale per tensor (vLLM's, per K and per V)
is enough where int8 needs one per row. The value a code stands for is
``code * scale``; the kernels widen the codes exactly as they read them,
and no float copy of the cache is made.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .arrays import FP8_MAX, broadcast_shapes, is_fp8, is_half
from .int8 import float32_rows, float32_scales, int8_scale

#: How quantize_kv_fp8 may choose scales.
SCALE_RULES = ("row", "head", "tensor")


def fp8_dtype(dtype: object, caller: str) -> np.dtype[Any]:
    """An fp8 format given as a dtype or its name."""
    if isinstance(dtype, str) and dtype in FP8_MAX:
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError(f"{caller}: fp8 formats come from ml_dtypes "
                              "(pip install ml_dtypes)") from None
        named: np.dtype[Any] = np.dtype(getattr(ml_dtypes, dtype))
        return named
    given: Optional[np.dtype[Any]]
    try:
        given = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        given = None
    if given is None or not is_fp8(given):
        raise TypeError(f"{caller}: dtype must be an fp8 format, ml_dtypes.float8_e4m3fn or "
                        f"float8_e5m2 (or its name); got {dtype!r}")
    return given


def _largest_scale(fmax: float) -> np.float32:
    """The largest float32 scale whose product with fmax is finite."""
    scale = np.float32(float(np.finfo(np.float32).max) / fmax)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(fmax) * scale):
            scale = np.nextafter(scale, np.float32(0))
    return scale


#: The largest scale of each format: a larger one would take its largest
#: codes beyond float32, to inf.
FP8_MAX_SCALE = {name: _largest_scale(fmax) for name, fmax in FP8_MAX.items()}


def scale_range(dtype: np.dtype[Any]) -> str:
    return (f"finite, >= 0 and at most {float(FP8_MAX_SCALE[dtype.name]):.4g} (float32's "
            f"largest value / {FP8_MAX[dtype.name]:g}, the largest {dtype.name})")


def checked_scale(scale: ArrayLike, shape: tuple[int, ...], name: str,
                  dtype: np.dtype[Any]) -> NDArray[np.float32]:
    """A scale given for rows of ``shape`` (an fp8 operand's shape without
    its features axis), as float32 broadcast to that shape (a view: a scale
    per tensor or per (entry, head) is never repeated in memory)."""
    arr = float32_scales(scale, name)
    if arr.ndim == 0:
        # one scale (vLLM's, every step of every layer): no shapes to match
        if not 0 <= arr <= FP8_MAX_SCALE[dtype.name]:
            raise ValueError(f"{name} must be {scale_range(dtype)}")
        one: NDArray[np.float32] = np.broadcast_to(arr, shape)
        return one
    try:
        broadcast_shapes(arr.shape, shape)
        fits = len(arr.shape) <= len(shape) and broadcast_shapes(arr.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name} of shape {arr.shape} does not broadcast to {shape}: give one "
                         f"scale (shape ()), one per entry and head (e.g. {shape[:-1] + (1,)}) "
                         f"or one per row {shape}")
    if arr.size and not (arr.min() >= 0 and arr.max() <= FP8_MAX_SCALE[dtype.name]):
        raise ValueError(f"{name} must be {scale_range(dtype)}")
    full: NDArray[np.float32] = np.broadcast_to(arr, shape)
    return full


def fp8_scale(operand: NDArray[Any], scale: Optional[ArrayLike], name: str,
              q_dtype: np.dtype[Any]) -> NDArray[np.float32]:
    """The scales of an fp8 K or V for the driver: float32 of the operand's
    shape with a features axis of size 1 (1 where none is given)."""
    if q_dtype != np.float32 and not is_half(q_dtype):
        raise TypeError(f"fp8 {name} ({operand.dtype}) needs a float32, float16 or bfloat16 "
                        f"q, got q of dtype {q_dtype}; fp8 K/V are computed in float32")
    if scale is None:
        return np.broadcast_to(np.ones((), np.float32), operand.shape[:-1] + (1,))
    return checked_scale(scale, operand.shape[:-1], f"{name}_scale", operand.dtype)[..., None]


def kv_scale(operand: NDArray[Any], scale: Optional[ArrayLike], name: str,
             q_dtype: np.dtype[Any]) -> Optional[NDArray[np.float32]]:
    """The scales of K or V as the driver reads them: fp8's (1 when none
    is given), int8's (int8_scale), or None for float K/V."""
    if is_fp8(operand.dtype):
        return fp8_scale(operand, scale, name, q_dtype)
    scales: Optional[NDArray[np.float32]] = int8_scale(operand, scale, name, q_dtype)
    return scales


def to_codes(values: NDArray[Any], divisor: Union[NDArray[np.float32], np.float32],
             dtype: np.dtype[Any]) -> NDArray[Any]:
    """values / divisor in float32, saturated to the format's finite range
    and rounded to nearest even (ml_dtypes' cast of the float32 quotient);
    NaN stays NaN, +-inf becomes +-largest (as values beyond float32's
    range do)."""
    # one divisor (a scale per tensor, every step of a serving engine): the
    # compiled loop divides; several: NumPy divides, the loop by 1 (exact)
    one = np.ndim(divisor) == 0
    if one:
        quotients = np.ascontiguousarray(values, dtype=np.float32)
    else:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            quotients = np.ascontiguousarray(values.astype(np.float32) / divisor)
    codes: NDArray[Any] = np.empty(quotients.shape, dtype)
    # saturated (NaN kept) and rounded as ml_dtypes' cast rounds, compiled
    driver.float32_to_fp8(quotients, codes.view(np.uint8),
                          float(divisor) if one else 1.0, dtype.name == "float8_e4m3fn")
    return codes


def quantize(x: ArrayLike, dtype: object, rule: Union[str, ArrayLike], caller: str,
             ) -> tuple[NDArray[Any], NDArray[np.float32]]:
    """fp8 codes and float32 scales of x (the rule quantize_kv_fp8
    documents); caller prefixes the errors."""
    fmt = fp8_dtype(dtype, caller)
    values = float32_rows(x, caller)
    fmax = np.float32(FP8_MAX[fmt.name])
    if not isinstance(rule, str):
        divisor = checked_scale(rule, values.shape[:-1], f"{caller}: scale", fmt)
        if np.any(divisor == 0):
            raise ValueError(f"{caller}: scale must be > 0 (values / scale are stored)")
        # one scale: the compiled loop divides by it
        by = float32_scales(rule, caller) if np.ndim(rule) == 0 else divisor[..., None]
        return to_codes(values, by, fmt), np.array(rule, np.float32)
    if rule not in SCALE_RULES:
        raise ValueError(f"{caller}: scale must be one of {', '.join(map(repr, SCALE_RULES))} "
                         f"or the scales themselves; got {rule!r}")
    if not np.all(np.isfinite(values)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
        raise ValueError(f"{caller}: x holds NaN or infinite values (first at {bad}), which "
                         "no computed scale can hold (values beyond float32's range, 3.4e38, "
                         "are infinite in float32); pass a scale to store them saturated")
    magnitude = np.abs(values)
    if rule == "row":
        peak = np.max(magnitude, axis=-1, initial=0)
    elif rule == "head":
        if values.ndim < 2:
            raise ValueError(f"{caller}: scale='head' needs rows of entries (..., S, d), got "
                             f"shape {values.shape}")
        peak = np.max(magnitude, axis=(-2, -1), initial=0)[..., None]
    else:
        peak = np.max(magnitude, initial=0)
    scale = np.minimum((peak / fmax).astype(np.float32), FP8_MAX_SCALE[fmt.name])
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = to_codes(values, np.broadcast_to(safe, values.shape[:-1])[..., None], fmt)
    return codes, np.asarray(scale, np.float32)
