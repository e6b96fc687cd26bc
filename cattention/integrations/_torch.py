"""CPU torch tensors seen as NumPy arrays, and NumPy results seen as
tensors, without copies (for the integrations with torch runtimes:
transformers, vLLM).

``Tensor.numpy()`` shares the tensor's memory for the dtypes NumPy has.
bfloat16, which NumPy lacks, goes through the tensor's 16-bit pattern
(``view(torch.int16)``) and ml_dtypes' bfloat16, which stores the same bits:
both are the top half of a float32, so the view is the value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

# the dtypes of q, K and V that cattention computes (float16 and bfloat16 in
# float32); masks may also be bool
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHARED_DTYPES = (torch.float16, torch.float32, torch.float64, torch.bool)


def _bfloat16() -> np.dtype[Any]:
    try:
        import ml_dtypes
    except ImportError as error:
        raise ImportError(
            "bfloat16 tensors need ml_dtypes for their NumPy view: "
            'pip install "cattention[bfloat16]" (the transformers and vllm extras bring '
            "it)") from error
    bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bfloat16


def as_array(tensor: torch.Tensor, what: str) -> NDArray[Any]:
    """The tensor's memory as an ndarray of its shape and strides (no copy).

    Raises TypeError for a dtype cattention does not take (what names the
    argument in the message)."""
    dtype = tensor.dtype
    if dtype in _SHARED_DTYPES:
        return tensor.numpy()  # type: ignore[no-any-return]
    if dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_bfloat16())  # type: ignore[no-any-return]
    raise TypeError(f"cattention takes float16, bfloat16, float32 and float64 tensors "
                    f"(and bool masks); {what} is {dtype}")


def as_fp8_array(tensor: torch.Tensor, fp8: np.dtype[Any], what: str) -> NDArray[Any]:
    """An fp8 tensor's memory as an ndarray of the fp8 dtype (no copy): its
    bytes (torch.uint8, as vLLM keeps fp8 caches) or torch's own fp8 dtype
    of that format."""
    if tensor.dtype not in (torch.uint8, getattr(torch, fp8.name, torch.uint8)):
        raise TypeError(f"{what} must hold {fp8.name} codes, as torch.uint8 bytes or "
                        f"torch.{fp8.name}; got {tensor.dtype}")
    return tensor.view(torch.uint8).numpy().view(fp8)  # type: ignore[no-any-return]


def as_tensor(array: NDArray[Any]) -> torch.Tensor:
    """The ndarray's memory as a tensor (no copy); bfloat16 stays bfloat16."""
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:   # ml_dtypes.bfloat16
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_index_array(tensor: torch.Tensor, what: str) -> NDArray[Any]:
    """An int32 or int64 tensor (lengths, offsets, block tables, slots) as
    an ndarray sharing its memory."""
    if tensor.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{what} must be an int32 or int64 tensor; got {tensor.dtype}")
    return tensor.numpy()  # type: ignore[no-any-return]
