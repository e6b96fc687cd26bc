"""Rotary position embeddings (RoPE) of the cache calls: the tables
checked, the position of every row of q and of the new keys, and the
rotation (compiled, rotary.pxd): of the new keys into scratch before they
are stored, of q's rows as the driver reads them (16-bit q into scratch,
then rounded to their dtype). All checks come before anything is written.

A row at position p is rotated over its first ``rotary_dim = 2 * half``
features, with ``c = cos[p, i]`` and ``s = sin[p, i]`` for ``i < half``::

    x1 * c - x2 * s,    x2 * c + x1 * s

taking ``(x1, x2) = (x[i], x[i + half])`` (GPT-NeoX's half split, the
default) or ``(x[2i], x[2i + 1])`` (interleaved, GPT-J's); the other
features are kept. The rows and the tables are taken in the compute dtype
(float32, or float64 for float64 caches), where each product and sum is
rounded (never fused), then rounded once to where the row goes: q to its
own dtype, a new key to the cache's (or quantized for an int8 cache). So a
call with the tables gives bitwise the call without them on rows rotated
first in NumPy by that formula.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._native import driver
from .arrays import array, is_bfloat16, is_half, readable_in_place

_Array = NDArray[Any]


@dataclasses.dataclass
class Rotary:
    """The checked tables of a call, (n_positions, half) each, as given
    (any dtype the compute dtype holds exactly, any layout or byte order:
    only the rows a call needs are read, and converted)."""

    cos: _Array
    sin: _Array
    interleaved: bool
    compute: np.dtype[Any]

    @property
    def n_positions(self) -> int:
        return int(self.cos.shape[0])

    def tables(self, positions: NDArray[np.intp]) -> tuple[_Array, _Array, int, bool]:
        """(cos, sin, first, interleaved) as the driver reads them for
        these positions (checked): the tables themselves when they are of
        the compute dtype and readable in place, else the rows from the
        first position used to the last, converted (exactly), first being
        the position of their row 0."""
        if all(t.dtype == self.compute and readable_in_place(t) for t in (self.cos, self.sin)):
            return self.cos, self.sin, 0, self.interleaved
        first = int(positions.min()) if positions.size else 0
        last = int(positions.max()) if positions.size else -1
        return (np.ascontiguousarray(self.cos[first:last + 1], dtype=self.compute),
                np.ascontiguousarray(self.sin[first:last + 1], dtype=self.compute), first,
                self.interleaved)

    def rotate(self, x: _Array, positions: NDArray[np.intp], sequences: NDArray[np.intp],
               name: str) -> _Array:
        """x, (A, H, T, d) with positions (A, T), or packed (N, H, d) with
        positions (N,), rotated into a new C-contiguous array of the compute
        dtype; ``sequences`` (positions' shape) names the sequence of each
        row in the error a position outside the tables gives."""
        self.check_positions(positions, sequences, name)
        packed = x.ndim == 3
        rows = x[:, :, None, :] if packed else x
        if rows.dtype != self.compute:
            rows = rows.astype(self.compute)
        elif not readable_in_place(rows):
            rows = np.array(rows, order="C")
        cos, sin, first, _ = self.tables(positions)
        out = driver.rotate_rows(rows, cos, sin, first,
                                 np.ascontiguousarray(positions, dtype=np.intp).reshape(-1),
                                 self.interleaved)
        return out[:, :, 0, :] if packed else out

    def check_positions(self, positions: NDArray[np.intp], sequences: NDArray[np.intp],
                        name: str) -> None:
        if not positions.size:
            return
        lowest, highest = int(positions.min()), int(positions.max())
        if lowest < 0:
            at = np.unravel_index(int(np.argmin(positions)), positions.shape)
            raise ValueError(
                f"rotary: a row of {name} of sequence {int(sequences[at])} sits at position "
                f"{lowest}: q has more rows than the sequence has positions after the "
                "append (cache_lengths + new rows), and rotary positions start at 0")
        if highest >= self.n_positions:
            at = np.unravel_index(int(np.argmax(positions)), positions.shape)
            raise ValueError(
                f"rotary_cos and rotary_sin hold {self.n_positions} positions (axis 0 of "
                f"shape {self.cos.shape}), but {name} of sequence {int(sequences[at])} "
                f"needs position {highest} (max_position must exceed every position a "
                "call rotates)")


def check_rotary(rotary_cos: Optional[ArrayLike], rotary_sin: Optional[ArrayLike],
                 rotary_interleaved: object, d_k: int,
                 compute: np.dtype[Any]) -> Optional[Rotary]:
    """The tables, both or neither: 2-D (max_position, rotary_dim / 2) of one
    shape, rotary_dim within d_k, floating point that the compute dtype holds
    exactly (float16, bfloat16, float32; float64 too for float64 inputs)."""
    interleaved = driver.check_flag(rotary_interleaved, "rotary_interleaved")
    if rotary_cos is None and rotary_sin is None:
        if interleaved:
            raise ValueError("rotary_interleaved=True is given without rotary_cos and "
                             "rotary_sin")
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    tables = []
    for name, given in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        table = array(given, name)
        if not (table.dtype.kind == "f" or is_bfloat16(table.dtype)):
            raise TypeError(f"{name} must be floating point (float16, bfloat16, float32 or "
                            f"float64); got dtype {table.dtype}")
        if not is_half(table.dtype) and table.dtype.itemsize > compute.itemsize:
            raise TypeError(
                f"{name} has dtype {table.dtype}, but these inputs compute in {compute}, "
                f"where the rotation is computed: pass {compute} tables (a wider table "
                "would be rounded on every call)")
        if table.ndim != 2:
            raise ValueError(f"{name} must be 2-D (max_position, rotary_dim / 2); got shape "
                             f"{table.shape}")
        tables.append(table)
    cos, sin = tables
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_cos {cos.shape} and rotary_sin {sin.shape} must share one "
                         "shape (max_position, rotary_dim / 2)")
    half = cos.shape[1]
    if half < 1 or 2 * half > d_k:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * half} must lie in "
                         f"[2, d_k = {d_k}] (rotary_cos has shape {cos.shape})")
    return Rotary(cos, sin, interleaved, compute)


def rotate_queries(q: _Array, rotary: Rotary, positions: NDArray[np.intp],
                   sequences: NDArray[np.intp]) -> tuple[_Array, Optional[tuple[Any, ...]]]:
    """(q, the tables the driver rotates q's rows with as it reads them):
    a q of the compute dtype (or one the call converts to it) is rotated
    so, with no copy of its rows; a float16 or bfloat16 q is rotated here,
    then rounded to its dtype (once, to nearest even), which the call reads
    as it reads any such q. The positions are checked either way."""
    if is_half(q.dtype):
        out = rotary.rotate(q, positions, sequences, "q")
        return out.astype(q.dtype), None
    rotary.check_positions(positions, sequences, "q")
    return q, rotary.tables(positions)
