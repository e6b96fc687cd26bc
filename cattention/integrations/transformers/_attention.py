"""The attention function registered with transformers' AttentionInterface.

transformers calls it in every attention layer with q ``(B, H, T, d)``, K/V
``(B, H_kv, S, d)`` (the layer's cache, when there is one), the mask its
registered mask function made (a MaskStructure, a dense tensor, or None)
and the layer's options. It reads the tensors where they are (NumPy views;
q is usually a transposed view of ``(B, T, H, d)``, which cattention reads
in place), computes into a ``(B, T, H, d)`` tensor, the layout the model's
output projection wants, and returns it with the weights when asked.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

import cattention

from ._masks import MaskStructure
from .._torch import FLOAT_DTYPES, as_array, as_tensor

_ALTERNATIVE = 'attn_implementation="sdpa" (or "eager")'


def _refuse_what_cattention_cannot_do(query: torch.Tensor, key: torch.Tensor,
                                      value: torch.Tensor, dropout: float,
                                      extra: Optional[torch.Tensor]) -> None:
    """cattention computes the forward pass of exact attention on the CPU:
    refuse gradients, dropout and other devices, naming what can."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad
                                    or (extra is not None and extra.requires_grad)):
        raise RuntimeError(
            "cattention computes the forward pass only and these tensors need gradients: "
            "run inference under torch.no_grad() or torch.inference_mode(), or train with "
            f"{_ALTERNATIVE}")
    if dropout:
        raise ValueError(f"cattention has no attention dropout (dropout={dropout}): call "
                         f"model.eval() for inference, or train with {_ALTERNATIVE}")
    if not (query.is_cpu and key.is_cpu and value.is_cpu):
        raise ValueError(
            f"cattention computes on the CPU; these tensors are on {query.device} "
            f"(q), {key.device} (k), {value.device} (v): use {_ALTERNATIVE} on other devices")
    if not query.dtype == key.dtype == value.dtype or query.dtype not in FLOAT_DTYPES:
        raise TypeError(f"cattention takes q, k and v of one dtype, float16, bfloat16, float32 "
                        f"or float64; they are {query.dtype}, {key.dtype} and {value.dtype}")


def _options_from_mask(module: torch.nn.Module, attention_mask: Any, is_causal: Optional[bool],
                       sliding_window: Optional[int], batch_size: int, n_queries: int,
                       n_keys: int) -> dict[str, Any]:
    """cattention's options for the mask transformers hands over."""
    if isinstance(attention_mask, MaskStructure):
        attention_mask.check_call(batch_size, n_queries, n_keys)
        return dict(attention_mask.options)
    if attention_mask is None:
        # no mask function ran (the model built none): the layer's own flags
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        options: dict[str, Any] = {"causal": causal}
        if sliding_window is not None:
            # transformers' sliding patterns: causal q - w < kv <= q, else |q - kv| <= w
            options["window"] = ((sliding_window - 1, 0) if causal
                                 else (sliding_window, sliding_window))
        return options
    if isinstance(attention_mask, torch.Tensor):
        # a pattern only a dense mask says (True: may attend; or additive)
        return {"causal": False, "mask": as_array(attention_mask, "attention_mask")}
    raise TypeError(f"attention_mask is a {type(attention_mask).__name__}; cattention takes "
                    "the masks of its registered mask function, tensors or None")


def _with_position_bias(options: dict[str, Any], position_bias: torch.Tensor) -> None:
    """Add a model's position bias (T5's relative positions) to the logits:
    it is an additive mask, combined with any dense mask already given."""
    bias = as_array(position_bias, "position_bias")
    given = options.get("mask")
    if given is None:
        options["mask"] = bias
    elif given.dtype == np.bool_:
        options["mask"] = np.where(given, bias, -np.inf).astype(bias.dtype)
    else:
        options["mask"] = given + bias


def attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
    is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
    softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
    position_bias: Optional[torch.Tensor] = None, output_attentions: bool = False,
    precision: Optional[str] = None, **kwargs: Any,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' attention function contract, computed by cattention.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (read for ``is_causal`` when no mask is given).
    query : torch.Tensor, shape (B, H, T, d_k)
    key : torch.Tensor, shape (B, H_kv, S, d_k)
    value : torch.Tensor, shape (B, H_kv, S, d_v)
        CPU tensors of one dtype: float16, bfloat16, float32 or float64. H a
        multiple of H_kv (grouped heads: K/V are never repeated).
    attention_mask : MaskStructure, torch.Tensor or None
        What the registered mask function made; a bool (True: may attend) or
        additive float tensor broadcastable to ``(B, H, T, S)``; or None.
    dropout : float
        Must be 0.
    scaling : float, optional
        Multiplies q.k (default ``1 / sqrt(d_k)``).
    is_causal, sliding_window : optional
        Used only when attention_mask is None (a structure or a tensor says
        both itself).
    softcap : float, optional
        Gemma 2's logit softcap.
    s_aux : torch.Tensor, shape (H,), optional
        gpt-oss's attention sinks, one logit per query head.
    position_bias : torch.Tensor, optional
        An additive bias broadcastable to ``(B, H, T, S)`` (T5).
    output_attentions : bool
        Also return the attention weights ``(B, H, T, S)``.
    precision : {"highest", "high", "medium"}, optional
        :func:`cattention.attention`'s ``precision=`` (``register`` binds it).

    Returns
    -------
    (attn, weights) : (torch.Tensor of shape (B, T, H, d_v), torch.Tensor or None)
    """
    _refuse_what_cattention_cannot_do(query, key, value, dropout, s_aux)
    batch_size = max(query.shape[0], key.shape[0])
    n_heads, n_queries = query.shape[1], query.shape[2]
    n_keys, d_v = key.shape[2], value.shape[3]
    options = _options_from_mask(module, attention_mask, is_causal, sliding_window,
                                 batch_size, n_queries, n_keys)
    if position_bias is not None:
        _with_position_bias(options, position_bias)
    if scaling is not None:
        options["scale"] = scaling
    if softcap is not None:
        options["softcap"] = softcap
    if s_aux is not None:
        # cattention takes real-number sinks, not bfloat16 ones: H values to convert
        sinks = s_aux.detach()
        options["sinks"] = as_array(sinks.float() if sinks.dtype == torch.bfloat16 else sinks,
                                    "s_aux")
    if n_heads != key.shape[1]:
        options["enable_gqa"] = True
    if precision is not None:
        options["precision"] = precision
    q, k, v = as_array(query, "query"), as_array(key, "key"), as_array(value, "value")
    # the layout the output projection reads; cattention writes (B, H, T, d)
    # through a transposed view of it
    attn = torch.empty((batch_size, n_queries, n_heads, d_v), dtype=query.dtype)
    out = as_array(attn, "output").transpose(0, 2, 1, 3)
    if not output_attentions:
        cattention.attention(q, k, v, out=out, **options)
        return attn, None
    # the weights are the fused SCORES output, not a second computation
    _, scores = cattention.attention(q, k, v, out=out, return_scores=True, **options)
    return attn, as_tensor(scores)
