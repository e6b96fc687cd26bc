"""Public: int8 K/V, symmetric per-row quantization of keys or values, and
fp8 K/V with scales per row, per head or per tensor."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .._prepare.fp8 import quantize
from .._prepare.int8 import quantize_rows

__all__ = ["quantize_kv", "quantize_kv_fp8"]


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


def quantize_kv_fp8(x: ArrayLike, dtype: Any = "float8_e4m3fn", scale: Any = "row",
                    ) -> tuple[NDArray[Any], NDArray[np.float32]]:
    """Store keys or values as fp8 codes with float32 scales.

    The codes are ``x / scale`` in float32, saturated to the format's finite
    range (448 for ``float8_e4m3fn``, 57344 for ``float8_e5m2``) and rounded
    to nearest even; the values they stand for are ``codes * scale``. With
    a scale chosen from the data, a row's (or head's, or the tensor's)
    largest magnitude becomes the format's largest value: the error of a
    value is at most half a step of the format at its magnitude (a relative
    2^-4 for E4M3FN, 2^-3 for E5M2, above their subnormal range), plus the
    float32 rounding of the product.

    Parameters
    ----------
    x : array_like, shape (..., d)
        Real values, e.g. K or V of shape (B, H_kv, S, d).
    dtype : str or dtype, default "float8_e4m3fn"
        ``ml_dtypes.float8_e4m3fn`` or ``ml_dtypes.float8_e5m2`` (or its
        name): E4M3FN has a mantissa bit more, E5M2 the range of float16.
    scale : {"row", "head", "tensor"} or array_like, default "row"
        ``"row"``: ``max|x_row| / largest`` per row, shape ``x.shape[:-1]``
        (an all-zero row has scale 0 and zeros). ``"head"``: one per entry
        and head, over the last two axes, shape ``x.shape[:-2] + (1,)``.
        ``"tensor"``: one, shape ``()`` (vLLM's per-tensor scale). Or the
        scales themselves: positive float32 values that broadcast to
        ``x.shape[:-1]`` (e.g. a checkpoint's); then NaN stays NaN and
        values beyond the range are stored as the largest code of their
        sign.

    Returns
    -------
    x_fp8 : ndarray of the fp8 dtype, shape (..., d)
    scale : ndarray of float32
        For :func:`cattention.attention` (``k_scale``, ``v_scale``) and
        the cache functions, which take any of these shapes.

    Raises
    ------
    TypeError
        If x is not real, or dtype is not an fp8 format.
    ValueError
        If x has no axis; if a scale is computed and x holds NaN or an
        infinity; if a given scale is not positive, finite and at most
        float32's largest value over the format's, or does not broadcast.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> x8, scale = ca.quantize_kv_fp8(np.array([[1.0, -0.5, 0.3], [0.0, 0.0, 0.0]]))
    >>> x8.astype(np.float32) * scale[:, None]
    array([[ 1.       , -0.5      ,  0.2857143],
           [ 0.       ,  0.       ,  0.       ]], dtype=float32)
    >>> ca.quantize_kv_fp8(np.ones((2, 4)), "float8_e5m2", scale="tensor")[1].shape
    ()
    """
    return quantize(x, dtype, scale, "quantize_kv_fp8")
