"""What contiguous and paged KV caches share: the checks of their storage
(dtype, byte order, layout), of their int8 and fp8 scales and of the cache
lengths; the new rows as a cache stores them; and the append itself, with
the lengths given back if the computation that follows it fails."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

from .._native import driver
from .arrays import array, compute_dtype, is_bfloat16, is_fp8, is_half, readable_in_place
from .fp8 import checked_scale, quantize, to_codes
from .int8 import SCALE_RANGE, cache_rows, float32_scales, scales_in_range

_Array = NDArray[Any]


def check_storage(k: object, v: object, names: tuple[str, str], layout: str,
                  shared: str, what: str) -> tuple[_Array, _Array]:
    """Two caches (or sets of pages) of one float16, bfloat16, float32,
    float64, int8 or fp8 dtype, 4-D, native, readable where they are, sharing their first
    three axes (``layout`` names the axes, ``shared`` the first three)."""
    whole = "every page" if what == "pages" else "the whole cache"
    for name, cache in zip(names, (k, v)):
        if not isinstance(cache, np.ndarray) or cache.ndim != 4:
            raise ValueError(f"{name} must be a 4-D ndarray {layout}; got "
                             f"{getattr(cache, 'shape', type(cache).__name__)}")
        if (cache.dtype != np.int8 and not is_bfloat16(cache.dtype) and not is_fp8(cache.dtype)
                and (cache.dtype.kind != "f" or cache.dtype.itemsize not in (2, 4, 8))):
            raise TypeError(f"{name} has dtype {cache.dtype}; {what} must be float16, "
                            "bfloat16, float32, float64, int8 (with scales) or fp8 "
                            "(float8_e4m3fn, float8_e5m2)")
        if not cache.dtype.isnative:
            raise TypeError(
                f"{name} has non-native byte order ({cache.dtype.str}): reading it would "
                f"copy {whole} on every call; convert it once, e.g. "
                f"{name} = {name}.astype({name}.dtype.newbyteorder('='))")
        if not readable_in_place(cache):
            raise ValueError(f"{name} must be aligned with strides that are multiples of "
                             f"its itemsize (reading it otherwise would copy {whole} on "
                             "every call)")
    assert isinstance(k, np.ndarray) and isinstance(v, np.ndarray)
    if k.dtype != v.dtype:
        raise TypeError(f"{names[0]} ({k.dtype}) and {names[1]} ({v.dtype}) must "
                        "share one dtype")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{names[0]} {k.shape} and {names[1]} {v.shape} must share "
                         f"{shared}")
    return k, v


def check_int8_scales(k: _Array, k_scale: object, v_scale: object, q_dtype: np.dtype[Any],
                      what: str, axes: str) -> None:
    """int8 caches (or pages) come with float32 scale arrays of their first
    three axes, the scale of each row, read and written in place."""
    if q_dtype != np.float32 and not is_half(q_dtype):
        raise TypeError(f"int8 {what} need a float32 (or float16) q, or a bfloat16 one, "
                        f"got {q_dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"int8 {what} need {name}: a native float32 ndarray of shape "
                             f"{k.shape[:3]} {axes}, the scale of each row, written as rows "
                             "are appended")
        if (not isinstance(scale, np.ndarray) or scale.dtype != np.float32
                or not scale.dtype.isnative or scale.shape != k.shape[:3]):
            got = (f"{scale.shape} {scale.dtype}" if isinstance(scale, np.ndarray)
                   else type(scale).__name__)
            raise ValueError(f"{name} must be a native float32 ndarray of shape "
                             f"{k.shape[:3]} {axes}; got {got}")
        if not readable_in_place(scale):
            raise ValueError(f"{name} must be aligned with strides that are multiples of 4 "
                             "(reading it otherwise would copy it on every call)")


def check_fp8_scales(k: _Array, k_scale: Any, v_scale: Any, q_dtype: np.dtype[Any],
                     what: str, axes: str) -> None:
    """fp8 caches (or pages) come with a scale each for K and V (none: 1)
    that broadcasts to their first three axes: one per tensor, per
    (entry, head), or per row; an array of exactly those axes holds each
    row's scale, written as rows are appended."""
    if q_dtype != np.float32 and not is_half(q_dtype):
        raise TypeError(f"fp8 {what} need a float32, float16 or bfloat16 q, got {q_dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        checked_scale(scale, k.shape[:3], name, k.dtype)
        if fp8_rows_scaled(scale, k) and (
                scale.dtype != np.float32 or not scale.dtype.isnative
                or not readable_in_place(scale)):
            raise ValueError(f"{name} of shape {k.shape[:3]} {axes} (a scale per row, written "
                             "as rows are appended) must be a native, aligned float32 ndarray")


def check_scales(k: _Array, k_scale: Any, v_scale: Any, q_dtype: np.dtype[Any], what: str,
                 axes: str) -> list[tuple[str, Any]]:
    """The scales of int8 or fp8 caches (or pages, ``what``), checked, and
    those an append writes, by name: int8's, and fp8's given one per row;
    no scales go with float caches."""
    if k.dtype == np.int8:
        check_int8_scales(k, k_scale, v_scale, q_dtype, what, axes)
        return [("k_scale", k_scale), ("v_scale", v_scale)]
    if is_fp8(k.dtype):
        check_fp8_scales(k, k_scale, v_scale, q_dtype, what, axes)
        return [(name, scale) for name, scale in (("k_scale", k_scale), ("v_scale", v_scale))
                if fp8_rows_scaled(scale, k)]
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with int8 and fp8 {what}; these are "
                         f"{k.dtype}")
    return []


def fp8_rows_scaled(scale: object, cache: _Array) -> bool:
    """Whether an fp8 cache's scale is one per row (an array of the cache's
    first three axes): appended rows then get scales of their own."""
    return isinstance(scale, np.ndarray) and scale.shape == cache.shape[:3]


def fp8_divisor(name: str, scale: Any, cache: _Array,
                at: tuple[_Array, _Array, _Array]) -> _Array:
    """What new rows for an fp8 cache whose scales are fixed (not one per
    row, which an append writes) are divided by: the scale at each row's
    place, ``at`` the indices of the cache's first three axes (entry or
    page, head, position) of each row, broadcast as the rows are without
    their features axis."""
    if scale is None:
        return np.ones((), np.float32)
    if np.ndim(scale) == 0:
        # one scale (checked with the cache): it divides every row
        one = float32_scales(scale, name)
        if one == 0:
            raise ValueError(f"{name} is 0: new values are stored divided by it; give a "
                             "scale > 0")
        return one
    divisor = fp8_read_scale(scale, cache)[at]
    if np.any(divisor == 0):
        raise ValueError(f"{name} is 0 at places this call appends to: new values are "
                         "stored divided by it; give a scale > 0 there")
    return divisor[..., None]


def fp8_read_scale(scale: Any, cache: _Array) -> _Array:
    """An fp8 cache's scale, as check_scales has checked it (shape and
    range: not again, a scale per row is a pass over the scales), as the
    call reads it: float32 of the cache's first three axes, a view (1 where
    none is given)."""
    given = np.ones((), np.float32) if scale is None else float32_scales(scale, "scale")
    read: _Array = np.broadcast_to(given, cache.shape[:3])
    return read


def check_scales_hold(k_scale: _Array, v_scale: _Array) -> None:
    """The scales of an int8 cache that is appended to are all in range (a
    cache's rows are dequantized by them)."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not scales_in_range(scale):
            raise ValueError(f"{name} must be {SCALE_RANGE} everywhere (zeros where no "
                             "row is cached yet)")


def check_cache_lengths(cache_lengths: object, n_seq: int, capacity: int) -> _Array:
    """An integer ndarray of one length per sequence, >= 0, whose dtype holds
    every position (advancing it must not wrap around)."""
    if (not isinstance(cache_lengths, np.ndarray) or cache_lengths.dtype.kind not in "iu"
            or cache_lengths.shape != (n_seq,)):
        given = getattr(cache_lengths, "shape", type(cache_lengths).__name__)
        if isinstance(cache_lengths, np.ndarray):
            given = f"{given} {cache_lengths.dtype}"
        raise ValueError(f"cache_lengths must be an integer ndarray of shape ({n_seq},); "
                         f"got {given}")
    if np.iinfo(cache_lengths.dtype).max < capacity:
        holding = [name for name in ("int16", "uint16", "int32", "uint32", "int64", "uint64")
                   if np.iinfo(name).max >= capacity]
        raise TypeError(
            f"cache_lengths of dtype {cache_lengths.dtype} cannot hold S_max = {capacity} "
            f"(at most {np.iinfo(cache_lengths.dtype).max}), so advancing it could wrap "
            f"around; use one of {', '.join(holding)}")
    if cache_lengths.size and cache_lengths.min() < 0:
        raise ValueError(f"cache_lengths must be >= 0; got {cache_lengths.tolist()}")
    return cache_lengths


def store_compute(store_dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype a cache (or pages) of store_dtype is computed in: float16,
    bfloat16, int8 and fp8 in float32, float32 and float64 in their own."""
    if is_half(store_dtype) or store_dtype == np.int8 or is_fp8(store_dtype):
        return np.dtype(np.float32)
    return store_dtype


def result_dtype(q_dtype: np.dtype[Any], store_dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype a cache call returns: the compute dtype, except that a
    16-bit q with a cache of its dtype, int8 or fp8 gives its dtype, as
    attention would (with float16 and bfloat16 mixed, NumPy's promotion
    gives float32)."""
    compute = store_compute(store_dtype)
    if compute != np.float32:
        return compute
    one_byte = store_dtype == np.int8 or is_fp8(store_dtype)
    return compute_dtype(q_dtype, q_dtype if one_byte else store_dtype)[1]


def check_sequence_starts(kv_starts: object, n_seq: int, capacity: int,
                          capacity_text: str) -> NDArray[np.intp]:
    """kv_starts of sequences of their own places: integers, one start per
    sequence (n_seq,), within the positions a sequence can hold."""
    starts = np.asarray(kv_starts)
    if starts.shape != (n_seq,) or starts.dtype.kind not in "iu":
        raise ValueError(f"kv_starts must be integers, one start per sequence, shape "
                         f"({n_seq},); got shape {starts.shape}, dtype {starts.dtype}")
    if n_seq and (int(starts.min()) < 0 or int(starts.max()) > capacity):
        raise ValueError(f"kv_starts must lie in [0, {capacity}] ({capacity_text}); got "
                         f"values from {int(starts.min())} to {int(starts.max())}")
    return starts.astype(np.intp)


def check_new_rows_dtype(name: str, new: _Array, cache_dtype: np.dtype[Any], what: str) -> None:
    """New rows a cache can take: float (quantized on append) for an int8
    or fp8 cache, else castable to its dtype."""
    if is_fp8(cache_dtype):
        if is_fp8(new.dtype) or (new.dtype.kind != "f" and not is_bfloat16(new.dtype)):
            raise TypeError(f"{name} of dtype {new.dtype} for "
                            f"{what_of(cache_dtype, what)}: pass float16, bfloat16, float32 "
                            "or float64 values, which are scaled and rounded into "
                            f"{cache_dtype} as they are appended")
    elif cache_dtype == np.int8:
        if (new.dtype.kind not in "fiu" and not is_bfloat16(new.dtype)) or new.dtype == np.int8:
            raise TypeError(f"{name} of dtype {new.dtype} for "
                            f"{'an int8 cache' if what == 'caches' else 'int8 pages'}: pass "
                            "float values, which are quantized as they are appended")
    elif is_bfloat16(cache_dtype) and not (is_bfloat16(new.dtype) or new.dtype in (
            np.float32, np.float64)):
        # float16 values (another 16-bit format) or integers would be rounded
        # into bfloat16 silently: the caller converts them on purpose
        raise TypeError(f"{name} of dtype {new.dtype} for "
                        f"{'a bfloat16 cache' if what == 'caches' else 'bfloat16 pages'}: "
                        "pass bfloat16, float32 or float64 values")
    elif not np.can_cast(new.dtype, cache_dtype, casting="same_kind"):
        raise TypeError(f"{name} of dtype {new.dtype} cannot be written into "
                        f"{what_of(cache_dtype, what)}")


def what_of(cache_dtype: np.dtype[Any], what: str) -> str:
    return f"a {cache_dtype} cache" if what == "caches" else f"{cache_dtype} {what}"


def new_rows(k_new: object, v_new: object) -> Optional[tuple[_Array, _Array]]:
    """k_new and v_new as arrays, both or neither."""
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is None:
        return None
    return array(k_new, "k_new"), array(v_new, "v_new")


@dataclasses.dataclass
class Write:
    """New rows of one cache array: row t of head h of sequence s at byte
    seq_offset[s] + t * rows.strides[row_axis] + h * rows.strides[head_axis]
    of rows, in the cache's dtype, for position start[s] + t."""

    cache: _Array
    rows: _Array
    seq_offset: NDArray[np.intp]
    row_axis: int
    head_axis: int


@dataclasses.dataclass
class Appends:
    """What a call writes into its cache: each Write, and the lengths
    before and after."""

    lengths: _Array                  # the caller's cache_lengths
    start: NDArray[np.intp]          # before the call
    n_new: NDArray[np.intp]          # rows each sequence appends
    writes: list[Write]
    # a paged cache's table, flattened; for a contiguous cache whose entries
    # are not the sequences' own (cache_batch_idx), the entry of each
    # sequence, as a table of one page of S_max rows each
    page_ids: Optional[NDArray[np.intp]] = None
    pages_per_seq: int = 0

    @contextlib.contextmanager
    def written(self) -> Iterator[None]:
        """Append, advance the lengths, and give the rows back (the lengths
        put back, the slots past them free again) if the computation in the
        block fails (its memory)."""
        if not self.writes:
            yield
            return
        for write in self.writes:
            driver.append_rows(write.cache, write.rows, write.seq_offset, write.row_axis,
                               write.head_axis, self.start, self.n_new, self.page_ids,
                               self.pages_per_seq)
        # (NumPy's assignment: the lengths may be of any integer dtype and
        # byte order; every value fits, as checked)
        self.lengths[...] = self.start + self.n_new
        try:
            yield
        except BaseException:
            self.lengths[...] = self.start
            raise


def as_stored(name: str, new: _Array, cache: _Array, scale: Optional[_Array],
              seq_index: NDArray[np.intp],
              at: Optional[tuple[_Array, _Array, _Array]] = None) -> list[Write]:
    """The Writes of new rows (``new``: (B, H_kv, T_new, d), or packed
    (total, H_kv, d) with sequence s from index seq_index[s] of its first
    axis) as the cache stores them: converted to its float dtype, or
    quantized (int8 rows, or fp8 rows with scales of their own, and their
    scales into the scale cache as rows of one feature; fp8 rows under
    fixed scales divided by the scale at their place: ``at``, as
    fp8_divisor takes it)."""
    row_scale: Optional[_Array]
    if is_fp8(cache.dtype) and fp8_rows_scaled(scale, cache):
        rows, row_scale = quantize(new, cache.dtype, "row", name)
    elif is_fp8(cache.dtype):
        assert at is not None
        rows = to_codes(new, fp8_divisor(f"{name[0]}_scale", scale, cache, at), cache.dtype)
        row_scale = None
    else:
        rows, row_scale = cache_rows(new, cache.dtype, name)
    row_axis = 2 if new.ndim == 4 else 0
    writes = [Write(cache, rows, np.ascontiguousarray(seq_index * rows.strides[0], np.intp),
                    row_axis, 1)]
    if row_scale is not None and scale is not None:
        writes.append(Write(scale[..., None], row_scale[..., None],
                            np.ascontiguousarray(seq_index * row_scale.strides[0], np.intp),
                            row_axis, 1))
    return writes
