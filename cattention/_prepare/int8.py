"""int8 K/V: symmetric per-row quantization (``quantize_kv``), new rows as a
cache stores them, and the checks of int8 operands.

A KV cache stored as int8 with one float32 scale per row (per position and
head) has a quarter of the bytes of float32: decode, which reads the whole
cache every step, gets faster by what it no longer reads. The kernels
convert the rows to float32 block by block as they read them; no float copy
of the cache is made.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .arrays import array, is_bfloat16, is_half

#: The largest magnitude of a quantized value (symmetric: -127..127).
INT8_LEVELS = 127


def _largest_scale() -> np.float32:
    """The largest float32 scale of which 127 steps are finite in float32
    (float32 max / 127 rounds up, to one whose 127 steps are inf)."""
    scale = np.float32(float(np.finfo(np.float32).max) / INT8_LEVELS)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(INT8_LEVELS) * scale):
            scale = np.nextafter(scale, np.float32(0))
    return scale


#: The largest row scale: a larger one would dequantize a row beyond
#: float32, to inf.
INT8_MAX_SCALE = _largest_scale()


def scales_in_range(scale: NDArray[np.float32]) -> bool:
    """Every row scale in [0, INT8_MAX_SCALE] (NaN is not: it is the
    minimum and the maximum, and fails both comparisons). Two reductions,
    no temporaries: a KV cache's scales are checked on every append."""
    if not scale.size:
        return True
    return bool(scale.min() >= 0 and scale.max() <= INT8_MAX_SCALE)


#: What a scale outside that range is told.
SCALE_RANGE = f"finite, >= 0 and at most {INT8_MAX_SCALE:.3g} (float32's largest value / 127)"


def quantize_rows(x: ArrayLike, caller: str) -> tuple[NDArray[np.int8], NDArray[np.float32]]:
    """int8 values and float32 row scales of x (the rule quantize_kv
    documents); caller prefixes the errors ("quantize_kv", or the argument
    whose rows a cache quantizes as it appends them)."""
    values = float32_rows(x, caller)
    if not np.all(np.isfinite(values)):
        bad = np.argwhere(~np.all(np.isfinite(values), axis=-1))
        raise ValueError(f"{caller}: rows hold NaN or infinite values (first at row index "
                         f"{tuple(int(i) for i in bad[0])}); they cannot be quantized (values "
                         "beyond float32's range, 3.4e38, are infinite in float32)")
    peak = np.max(np.abs(values), axis=-1, initial=0)
    # (a peak near float32's largest value would round up to a scale whose
    # 127 steps overflow)
    scale = np.minimum((peak / np.float32(INT8_LEVELS)).astype(np.float32), INT8_MAX_SCALE)
    safe = np.where(scale > 0, scale, np.float32(1))
    with np.errstate(over="ignore", invalid="ignore"):
        levels = np.rint(values / safe[..., None])
    levels = np.clip(np.where(scale[..., None] > 0, levels, 0), -INT8_LEVELS, INT8_LEVELS)
    return levels.astype(np.int8), scale


def cache_rows(new: NDArray[Any], cache_dtype: np.dtype[Any], name: str,
               ) -> tuple[NDArray[Any], NDArray[np.float32] | None]:
    """New rows (argument ``name``) as a cache of ``cache_dtype`` stores them:
    int8 with their scales (quantize_kv), or in the float dtype, scales None.
    Values the cache cannot hold are refused: they could not be quantized,
    or a float16 cache would store them as inf."""
    if cache_dtype == np.int8:
        return quantize_rows(new, name)
    if new.dtype == cache_dtype:
        return new, None
    with np.errstate(over="ignore", invalid="ignore"):
        rows = new.astype(cache_dtype)
    overflow = np.isinf(rows)
    if overflow.any():
        overflow &= np.isfinite(new)
        if overflow.any():
            index = tuple(int(i) for i in np.argwhere(overflow)[0])
            # np.finfo knows bfloat16 only with later ml_dtypes than 0.5 (the
            # last for Python 3.9); ml_dtypes.finfo knows it in every version
            finfo = sys.modules["ml_dtypes"].finfo if is_bfloat16(cache_dtype) else np.finfo
            raise ValueError(f"{name}{list(index)} = {float(new[index])!r} is beyond the range "
                             f"of the {cache_dtype} cache (largest "
                             f"{float(finfo(cache_dtype).max)!r}): it would be stored as inf")
    return rows, None


def float32_rows(x: ArrayLike, caller: str) -> NDArray[np.float32]:
    """Rows to quantize (any real dtype, bfloat16 included) as float32:
    values beyond float32's range become infinite, for the caller to
    refuse or saturate."""
    arr = array(x, f"{caller}: x")
    if arr.dtype.kind not in "fiub" and not is_bfloat16(arr.dtype):
        raise TypeError(f"{caller} needs real values, got dtype {arr.dtype}")
    if arr.ndim < 1:
        raise ValueError(f"{caller} needs rows (an array with a last axis), got shape "
                         f"{arr.shape}")
    with np.errstate(over="ignore"):
        values: NDArray[np.float32] = arr.astype(np.float32)
    return values


def float32_scales(scale: ArrayLike, name: str) -> NDArray[np.float32]:
    """Scales (argument ``name``) as native, aligned float32 values, which
    the driver reads in place; their range is the caller's to check."""
    arr = array(scale, name)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be real numbers, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):
        # beyond float32's range becomes inf, which no range holds
        arr = arr.astype(np.float32, copy=False)
    if not arr.dtype.isnative or not arr.flags.aligned:
        arr = np.array(arr, dtype=np.float32)
    return arr


def int8_scale(operand: NDArray[Any], scale: ArrayLike | None, name: str,
               q_dtype: np.dtype[Any]) -> NDArray[np.float32] | None:
    """The row scales of an int8 K or V as an aligned float32 array of the
    operand's shape with a features axis of size 1 (so that every view taken
    of the operand can be taken of it), or None for an operand that is not a
    quantized one (float K/V; int8 K/V with an integer q and no scale, which
    are integers computed as float64 as before)."""
    scale_name = f"{name}_scale"
    if operand.dtype != np.int8 or (scale is None and q_dtype.kind in "iub"):
        # all-integer inputs without scales keep the integer rule: computed
        # as float64 (int8 K/V beside a float q are a quantized cache)
        if scale is not None:
            raise ValueError(f"{scale_name} is given but {name} has dtype {operand.dtype}; "
                             f"{scale_name} goes with an int8 or fp8 {name}")
        return None
    if scale is None:
        raise ValueError(f"{name} is int8 but {scale_name} is missing: pass the float32 "
                         f"scale of each row, shape {operand.shape[:-1]} "
                         "(cattention.quantize_kv returns it)")
    if q_dtype != np.float32 and not is_half(q_dtype):
        raise TypeError(f"int8 {name} needs a float32 (or float16) q, or a bfloat16 one, got "
                        f"q of dtype {q_dtype}; int8 caches are computed in float32")
    arr = float32_scales(scale, scale_name)
    if arr.shape != operand.shape[:-1]:
        raise ValueError(f"{scale_name} of shape {arr.shape} does not match {name} of shape "
                         f"{operand.shape}: it needs one scale per row, shape "
                         f"{operand.shape[:-1]}")
    if not scales_in_range(arr):
        raise ValueError(f"{scale_name} must be {SCALE_RANGE}")
    return arr[..., None]
