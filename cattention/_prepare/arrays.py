"""Operands: dtypes, byte order, shapes, compute dtypes, outputs and shared
memory, each refused with a ValueError or TypeError that names the
argument, its shape or dtype.

Nothing here computes attention: the functions bring inputs to a compute
dtype and native byte order (copying only what the kernels cannot read).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from .._native import driver

SUPPORTED_DTYPES = (
    "float16, bfloat16 (ml_dtypes), float32 and float64 (integer and bool inputs are "
    "computed as float64), and for k and v int8 and fp8 (ml_dtypes' float8_e4m3fn and "
    "float8_e5m2) with their scales"
)


# the type numbers of ml_dtypes' bfloat16 and fp8 formats once seen (a
# check by number is what every call of a serving step makes, many times)
_bfloat16_numbers: tuple[int, ...] = ()
_fp8_numbers: tuple[int, ...] = ()


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """dtype is ml_dtypes.bfloat16. Its type number is assigned when
    ml_dtypes is imported, so it is recognised by identity; an array of it
    exists only once ml_dtypes is imported, and cattention never imports it
    itself. The driver is told its number, for the shortcuts."""
    global _bfloat16_numbers
    if dtype.kind != "V" or dtype.itemsize != 2:
        return False
    if dtype.num in _bfloat16_numbers:
        return True
    if dtype.name != "bfloat16":
        return False
    ml_dtypes = sys.modules.get("ml_dtypes")
    if ml_dtypes is None or dtype != ml_dtypes.bfloat16:
        return False
    driver.register_bfloat16(dtype.num)
    _bfloat16_numbers = (dtype.num,)
    return True


#: The finite range of each fp8 format (ml_dtypes' names).
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}

def is_fp8(dtype: np.dtype[Any]) -> bool:
    """dtype is ml_dtypes.float8_e4m3fn or float8_e5m2 (recognised by
    identity once ml_dtypes is imported, as bfloat16 is; the driver is told
    their type numbers the first time)."""
    global _fp8_numbers
    if dtype.itemsize != 1:
        return False
    if dtype.num in _fp8_numbers:
        return True
    if dtype.name not in FP8_MAX:
        return False
    ml_dtypes = sys.modules.get("ml_dtypes")
    if ml_dtypes is None or dtype != getattr(ml_dtypes, dtype.name):
        return False
    _fp8_numbers = (np.dtype(ml_dtypes.float8_e4m3fn).num,
                    np.dtype(ml_dtypes.float8_e5m2).num)
    driver.register_fp8(*_fp8_numbers)
    return True


def is_half(dtype: np.dtype[Any]) -> bool:
    """float16 or bfloat16: stored in 16 bits, computed in float32."""
    return dtype == np.float16 or is_bfloat16(dtype)


def native(arr: NDArray[Any]) -> NDArray[Any]:
    """arr in the machine's byte order: a big-endian array (np.load of a
    ">f4" file, FITS, HDF5, np.frombuffer) is converted, so the kernels
    never read swapped bytes as numbers."""
    if arr.dtype.isnative:
        return arr
    return arr.astype(arr.dtype.newbyteorder("="))


def view_as(arr: NDArray[Any], shape: tuple[int, ...]) -> Optional[NDArray[Any]]:
    """A view of arr (of arr.size elements) in the given shape, or None
    where its strides have no view of that shape (a reshape would copy):
    the driver's rule, which the compiled shortcuts use too."""
    return driver.view_as(arr, tuple(shape))


#: NumPy before 1.24 makes a ragged nested list an object array of its
#: sequences (with a VisibleDeprecationWarning) where later ones raise
RAGGED_AS_OBJECTS = np.lib.NumpyVersion(np.__version__) < "1.24.0"


def array(x: object, name: str) -> NDArray[Any]:
    """np.asarray(x), or an error that names the argument."""
    try:
        arr = np.asarray(x)
    except ValueError as exc:
        # e.g. a ragged nested list: NumPy's message does not say which argument
        raise ValueError(f"{name} is not a regular array: {exc}") from None
    if (RAGGED_AS_OBJECTS and arr.dtype == object and not isinstance(x, np.ndarray)
            and any(isinstance(item, (list, tuple, np.ndarray)) for item in arr.flat)):
        # the sequences NumPy stopped at: their lengths differ
        raise ValueError(f"{name} is not a regular array: its nested sequences have an "
                         f"inhomogeneous shape after {arr.ndim} dimensions (the detected "
                         f"shape was {arr.shape})")
    return arr


def as_input(x: ArrayLike, name: str) -> NDArray[Any]:
    """An operand (q, k, v): a real array of at least 2 dimensions, in
    native byte order."""
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    arr = array(x, name)
    if is_fp8(arr.dtype):
        if name == "q":
            raise TypeError(f"q has dtype {arr.dtype}: fp8 is a K/V (cache) format; pass "
                            "q as float32, float16 or bfloat16")
    elif (arr.dtype.kind not in "fiub" or arr.dtype.itemsize > 8) and not is_bfloat16(arr.dtype):
        raise TypeError(
            f"{name} has dtype {arr.dtype}; cattention supports {SUPPORTED_DTYPES}")
    arr = native(arr)
    if arr.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., rows, features); "
            f"got shape {arr.shape}")
    return arr


def compute_dtype(*arrays: Any) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(compute dtype, result dtype) for the inputs (arrays or dtypes), by
    np.result_type; fp8 K/V take no part (computed in float32, they leave
    the result to q, as int8 K/V do)."""
    if any(is_fp8(np.result_type(x)) for x in arrays):
        arrays = tuple(x for x in arrays if not is_fp8(np.result_type(x)))
    try:
        common = np.result_type(*arrays)
    except TypeError:
        # ml_dtypes 0.5 (the last release for Python 3.9) promotes bfloat16
        # with neither float16 nor integers wider than 8 bits, where 0.7 does;
        # taking bfloat16 as float32 then gives 0.7's result for every mix
        # with NumPy's float, integer and bool types
        dtypes = [np.result_type(x) for x in arrays]
        if not any(is_bfloat16(dtype) for dtype in dtypes):
            raise
        common = np.result_type(*(np.float32 if is_bfloat16(dtype) else dtype for dtype in dtypes))
    if common.kind in "iub":
        return np.dtype(np.float64), np.dtype(np.float64)
    if is_half(common):
        return np.dtype(np.float32), common
    return common, common


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
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


def output(shape: tuple[int, ...], dtype: np.dtype[Any], name: str) -> NDArray[Any]:
    """An uninitialised output array; one larger than any NumPy can
    allocate is refused naming it (NumPy's own message names nothing)."""
    try:
        return np.empty(shape, dtype=dtype)
    except ValueError:
        raise ValueError(f"{name} would hold {math.prod(shape)} {dtype} values: more bytes "
                         "than an array can hold") from None


def check_out(out: object, shape: tuple[int, ...], dtype: np.dtype[Any],
              read: list[tuple[str, Any]]) -> NDArray[Any]:
    """out= (NumPy's convention): an ndarray of the result's shape and dtype,
    any strides, writable, sharing no memory with what the call reads; a
    call refused writes nothing."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"out has shape {out.shape}; the result has shape {shape}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}; the result has dtype {dtype} (out= "
                        "takes the result's dtype, as NumPy's ufuncs do with casting)")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    # a broadcast out would take several rows in one place
    if any(s == 0 for s, n in zip(out.strides, out.shape) if n > 1):
        raise ValueError("out has a zero stride (a broadcast view): its rows would overlap")
    for name, arr in read:
        if isinstance(arr, np.ndarray) and np.shares_memory(out, arr):
            raise ValueError(f"out and {name} share memory; the call reads {name} while it "
                             "writes out: pass a separate array")
    return out


def writes_in_place(out: NDArray[Any]) -> bool:
    """The driver writes ATTN into out as it lies: aligned, native, every
    stride a non-negative multiple of the itemsize, features contiguous."""
    last = out.strides[-1] if out.ndim else out.itemsize
    return (bool(out.flags.aligned) and out.dtype.isnative
            and all(s >= 0 and s % out.itemsize == 0 for s in out.strides)
            and (last == out.itemsize or out.shape[-1] <= 1))


def readable_in_place(arr: NDArray[Any]) -> bool:
    """The kernels read arr where it is: aligned, and every stride a
    multiple of its itemsize (any other array they would read from a copy)."""
    return bool(arr.flags.aligned) and not any(s % arr.itemsize for s in arr.strides)


def to_result(values: NDArray[Any], dtype: np.dtype[Any],
              into: Optional[NDArray[Any]] = None) -> NDArray[Any]:
    """values (a result in the compute dtype) as ``dtype``, rounded once to
    nearest even, into ``into`` when given: bfloat16 by the driver's
    compiled rounding (bit for bit ml_dtypes', at memory speed), the rest by
    NumPy's cast."""
    if is_bfloat16(dtype) and values.dtype == np.float32:
        return driver.round_to_bfloat16(values, into)
    if into is not None:
        np.copyto(into, values, casting="same_kind")
        return into
    return values.astype(dtype)


def to_compute(arr: NDArray[Any], dtype: np.dtype[Any]) -> NDArray[Any]:
    """arr as dtype, copied only if the dtype differs or the kernel cannot read
    it; float16 and bfloat16 arrays computed in float32 stay as they are
    (the driver converts their rows as it reads them)."""
    if arr.dtype != dtype and not (dtype == np.float32 and is_half(arr.dtype)):
        return arr.astype(dtype)
    if not readable_in_place(arr):
        # same bits, aligned and element-strided, so results are unchanged
        return np.array(arr, order="C")
    return arr


def prepare_mask(mask: ArrayLike, n_queries: int, n_keys: int,
                 dtype: np.dtype[Any]) -> NDArray[Any]:
    """A bool or float mask the driver reads in place, broadcastable to
    (..., T, S)."""
    arr = native(array(mask, "mask"))
    given_shape = arr.shape
    if arr.dtype == np.bool_:
        pass
    elif arr.dtype.kind == "f" or is_bfloat16(arr.dtype):
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
    if not readable_in_place(arr):
        arr = np.array(arr, order="C")
    return arr


def per_batch_entry(values: ArrayLike, batch_shape: tuple[int, ...], name: str, kinds: str,
                    kind_text: str, dtype: DTypeLike, hint: str) -> NDArray[Any]:
    """values broadcast to the batch shape: one per batch entry, C-contiguous."""
    arr = array(values, name)
    if arr.dtype.kind not in kinds:
        raise TypeError(f"{name} must be {kind_text}, got dtype {arr.dtype}")
    try:
        full = np.broadcast_to(arr, batch_shape)
    except ValueError:
        raise ValueError(
            f"{name} of shape {arr.shape} does not broadcast to the batch "
            f"shape {batch_shape} ({hint})") from None
    return np.ascontiguousarray(full, dtype=dtype).reshape(-1)


def _memory_owner(a: NDArray[Any]) -> Optional[NDArray[Any]]:
    """The ndarray that allocated a's memory, or None when it came from
    another object (a buffer, a memory map), which may be shared."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None and a.flags.owndata else None


def refuse_shared_memory(written: list[tuple[str, Any]],
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


def gqa_hint(q: NDArray[Any], k: NDArray[Any]) -> str:
    """A hint when q has a multiple of k's heads but enable_gqa was not given."""
    if q.ndim >= 3 and k.ndim >= 3:
        n_heads, n_kv_heads = q.shape[-3], k.shape[-3]
        if 1 < n_kv_heads < n_heads and n_heads % n_kv_heads == 0:
            return (f"; q has {n_heads} heads and k {n_kv_heads} (axis -3): pass "
                    "enable_gqa=True for grouped-query attention")
    return ""
