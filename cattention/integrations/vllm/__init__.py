"""cattention as vLLM's attention on CPU (the V1 engine's ``CPU_ATTN``).

    CATTENTION_VLLM=1 vllm serve MODEL                  # every vLLM process
    CATTENTION_VLLM=1 python -c "import vllm; vllm.LLM(MODEL)..."

``pip install "cattention[vllm]"`` installs vLLM's CPU build beside
cattention and an entry point of vLLM's ``vllm.general_plugins`` group,
which every vLLM process (the API server, the engine core, the workers)
runs at start. With ``CATTENTION_VLLM=1`` in the environment it puts
cattention's backend in place of ``CPU_ATTN``, the one attention backend
vLLM's CPU platform hands out whatever backend is asked for, and the first
layer says so in vLLM's log (the kernel table, the threads); without it
the plugin registers nothing and vLLM runs as it does without cattention.
In a process of your own, :func:`register` does the same explicitly, before
the engine is made.

The backend keeps its own cache layout: each block of each K/V head holds
its keys, then its values, row by row, the pages
:func:`cattention.attention_with_paged_kvcache` reads in place. New rows
are written at vLLM's ``slot_mapping`` by :func:`cattention.paged_append`;
each layer's step (prompt chunks beside decodes, prefix-cache hits) is one
packed paged call on the threads vLLM gives the layer (torch's thread
count). What the backend cannot serve is refused when the engine starts.

``CATTENTION_PRECISION`` (``highest``, ``high`` or ``medium``; unset:
cattention's default, ``high``) sets the ``precision=`` of bfloat16 and
float16 models' attention in every process, as the log line says.
"""

from __future__ import annotations

import os

_NEEDS = ("cattention.integrations.vllm needs vLLM's CPU build: "
          "pip install \"cattention[vllm]\"")
try:
    import vllm  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(_NEEDS) from error

__all__ = ["BACKEND", "ENVIRONMENT_VARIABLE", "plugin", "register"]

#: The class vLLM is given for ``CPU_ATTN``.
BACKEND = "cattention.integrations.vllm._backend.CattentionBackend"
#: Set to 1 for the plugin to register the backend in every vLLM process.
ENVIRONMENT_VARIABLE = "CATTENTION_VLLM"


def register() -> str:
    """Make cattention vLLM's CPU attention in this process.

    vLLM's CPU platform picks ``CPU_ATTN`` for every model, so the backend
    takes that slot. Call it before the engine is made; an engine in other
    processes needs the environment variable instead (the plugin).

    Returns
    -------
    str
        The backend's class path.

    Examples
    --------
    >>> import cattention.integrations.vllm as ca_vllm       # doctest: +SKIP
    >>> ca_vllm.register()                                   # doctest: +SKIP
    'cattention.integrations.vllm._backend.CattentionBackend'
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    return BACKEND


def plugin() -> None:
    """vLLM's ``general_plugins`` entry point: :func:`register` when
    ``CATTENTION_VLLM=1``, nothing when it is unset or 0 (vLLM may load
    plugins more than once; registering again is harmless)."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if value == "1":
        register()
    elif value not in ("", "0"):
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: set it to 1 for cattention's "
                         "attention in vLLM, or to 0 (or unset it) for vLLM's own")
