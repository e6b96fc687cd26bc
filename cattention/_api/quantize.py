"""Public: int8 K/V, symmetric per-row quantization of keys or values."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._prepare.int8 import quantize_rows

__all__ = ["quantize_kv"]


def quantize_kv(x: ArrayLike) -> tuple[NDArray[np.int8], NDArray[np.float32]]:
    """Quantize keys or values to int8, symmetrically per row (the last axis).

    ``scale = max|x_row| / 127`` (float32, of shape ``x.shape[:-1]``) and
    ``x_int8 = round(x / scale)`` clipped to [-127, 127]; an all-zero row has
    scale 0 and zeros. Dequantized, ``x_int8 * scale[..., None]`` differs
    from ``x`` by at most ``scale / 2`` per element (half a step), plus the
    float32 rounding of the product: relative to the row's largest
    magnitude, at most ``1 / 254`` (0.39%). A row whose largest magnitude
    is below 127 times float32's smallest normal number (about 1.5e-36) has
    a subnormal scale, of few significant bits: its error may exceed that
    bound by up to 1e-43 (a row below about 9e-44 quantizes to zeros).

    Parameters
    ----------
    x : array_like, shape (..., d)
        Real values, e.g. K or V of shape (B, H_kv, S, d).

    Returns
    -------
    x_int8 : ndarray of int8, shape (..., d)
    scale : ndarray of float32, shape (...)
        For :func:`cattention.attention` (``k_scale``, ``v_scale``) and
        :func:`cattention.attention_with_kvcache`.

    Raises
    ------
    TypeError
        If x is not real (complex, object, string).
    ValueError
        If x has no axis, or a row holds NaN, an infinity or a value float32
        cannot hold.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> x_int8, scale = ca.quantize_kv(np.array([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]]))
    >>> x_int8
    array([[127, -64,  32],
           [  0,   0,   0]], dtype=int8)
    >>> scale.dtype, bool(scale[0] == np.float32(1 / 127)), float(scale[1])
    (dtype('float32'), True, 0.0)
    """
    return quantize_rows(x, "quantize_kv")
