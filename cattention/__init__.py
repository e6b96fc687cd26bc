"""cattention: fast, exact scaled dot-product attention for the CPU.

    attn = cattention.attention(q, k, v, causal=True)
    attn, scores = cattention.attention(q, k, v, return_scores=True)
    cattention.plot_scores(scores[0, 0])    # heatmap of one head (needs matplotlib)

See ``attention`` for the conventions (bottom-right causal alignment, True
in a bool mask means "may attend", zero rows for rows that see no key).
"""

import os

import numpy as np

from . import _attention
from ._api import attention, attention_scores, get_num_threads, merge, set_num_threads
from ._kvcache import attention_with_kvcache
from ._plot import plot_scores
from ._version import __version__

__all__ = [
    "__version__",
    "attention",
    "attention_scores",
    "attention_with_kvcache",
    "get_include",
    "get_num_threads",
    "merge",
    "plot_scores",
    "set_num_threads",
    "show_config",
]


def get_include() -> str:
    """Directory of the C header that Cython code cimporting cattention's
    C-level API (``cattention/_attention.pxd``) compiles against.

    Returns
    -------
    str
        An absolute path, for ``include_dirs`` of the cimporting extension.

    Examples
    --------
    >>> import os, cattention
    >>> os.path.isfile(os.path.join(cattention.get_include(), "cattention.h"))
    True
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def show_config() -> None:
    """Print the build and run-time configuration, e.g. for a bug report.

    One line each: the cattention version; the compiler that built the
    extension; whether it was built with OpenMP (and which version) and the
    thread count a call would use (:func:`get_num_threads`); the OpenMP
    runtime library loaded (libgomp, libomp, or the copy inside a wheel); the
    SIMD kernel table in use and those this CPU can run; the NumPy version.

    Returns
    -------
    None
        The report goes to standard output.

    Examples
    --------
    >>> import cattention as ca
    >>> ca.show_config()  # doctest: +ELLIPSIS
    cattention ...
      compiler: ...
      OpenMP:   ... threads: ...
      runtime:  ...
      SIMD:     ... (available: ...)
      NumPy:    ...
    """
    openmp = (f"yes (OpenMP {_attention.openmp_version()}), "
              f"threads: {get_num_threads()}"
              if _attention.openmp_enabled()
              else "no (serial build), threads: 1")
    runtime = _attention.openmp_runtime() or "none"
    lines = [
        f"cattention {__version__}",
        f"  compiler: {_attention.compiler()}",
        f"  OpenMP:   {openmp}",
        f"  runtime:  {runtime}",
        f"  SIMD:     {_attention.get_simd()} "
        f"(available: {', '.join(_attention.available_simd())}; "
        "CATTENTION_SIMD selects one)",
        f"  NumPy:    {np.__version__}",
    ]
    print("\n".join(lines))
