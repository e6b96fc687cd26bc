"""cattention as the attention of Hugging Face transformers models (CPU
inference).

    import cattention.integrations.transformers as ca_hf
    ca_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cattention")

``register`` adds an attention function to transformers' AttentionInterface
and a mask function to its AttentionMaskInterface under one name, so
``attn_implementation=name`` works in ``from_pretrained``, ``from_config``
and ``set_attn_implementation``. The mask function hands each layer the
structure of its mask (causal, sliding window, each sequence's valid keys)
instead of a dense ``(B, 1, T, S)`` array for the patterns transformers
builds; the attention function computes on the tensors in place and writes
the ``(B, T, H, d)`` layout the model wants. Inference only: gradients,
dropout and non-CPU tensors are refused with the alternative named.

Needs torch and transformers 5.4 or later 5.x (``pip install "cattention[transformers]"``,
after installing PyTorch's CPU build); ``import cattention`` never imports
them.
"""

from __future__ import annotations

import functools
from typing import Optional

from ..._native import driver

_NEEDS = ("cattention.integrations.transformers needs torch and transformers>=5.4,<6: "
          "install PyTorch's CPU build, then pip install \"cattention[transformers]\"")
try:
    import torch  # noqa: F401
    import transformers
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(_NEEDS) from error
# 5.4 is the first whose mask functions are given q_length and the offsets
if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 4):
    raise ImportError(f"{_NEEDS}; found transformers {transformers.__version__}")

from ._attention import attention_forward  # noqa: E402 (after the checks above)
from ._masks import MaskStructure, structured_mask  # noqa: E402

__all__ = ["MaskStructure", "attention_forward", "register", "structured_mask"]


def register(name: str = "cattention", precision: Optional[str] = None) -> str:
    """Register cattention with transformers under ``name``.

    Parameters
    ----------
    name : str, default "cattention"
        The ``attn_implementation`` that selects it.
    precision : {"highest", "high", "medium"}, optional
        The ``precision=`` of :func:`cattention.attention` for bfloat16 and
        float16 models (default: cattention's, "high"); float32 models
        compute at the highest whatever is given. Register one name per
        level to choose per model.

    Returns
    -------
    str
        ``name``, for ``from_pretrained(..., attn_implementation=...)``.

    Examples
    --------
    >>> import cattention.integrations.transformers as ca_hf   # doctest: +SKIP
    >>> ca_hf.register()                                        # doctest: +SKIP
    'cattention'
    """
    driver.check_precision(precision, True)
    forward = (attention_forward if precision is None
               else functools.partial(attention_forward, precision=precision))
    transformers.AttentionInterface.register(name, forward)
    transformers.AttentionMaskInterface.register(name, structured_mask)
    return name
