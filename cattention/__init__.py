"""cattention: fast, exact scaled dot-product attention for the CPU.

    attn = cattention.attention(q, k, v, causal=True)
    attn, scores = cattention.attention(q, k, v, return_scores=True)
    cattention.plot_scores(scores[0, 0])    # heatmap of one head (needs matplotlib)

See ``attention`` for the conventions (bottom-right causal alignment, True
in a bool mask means "may attend", zero rows for rows that see no key).
"""

import os as _os

import numpy as _np

# first: the extension is loaded with the OpenMP wait policy of _runtime
from ._runtime import wait_policy as _wait_policy
from . import _attention  # noqa: E402 (loaded above)
from ._api import (attention, attention_scores, get_num_threads, limit_threads, merge,
                   set_num_threads)
from ._kvcache import attention_with_kvcache
from ._paged import attention_with_paged_kvcache
from ._varlen import attention_varlen
from ._plot import plot_scores
from ._quantize import quantize_kv
from ._version import __version__

__all__ = [
    "__version__",
    "attention",
    "attention_scores",
    "attention_varlen",
    "attention_with_kvcache",
    "attention_with_paged_kvcache",
    "get_include",
    "get_num_threads",
    "limit_threads",
    "merge",
    "plot_scores",
    "quantize_kv",
    "set_num_threads",
    "show_config",
]


def _warn_of_an_unusable_simd_request() -> None:
    """CATTENTION_SIMD naming a table that is not compiled in or that this
    CPU cannot run leaves the best one in use: say so, once, at import."""
    requested = _os.environ.get("CATTENTION_SIMD", "")
    available = list(_attention.available_simd())
    if requested and requested not in available:
        import warnings
        warnings.warn(f"CATTENTION_SIMD={requested!r} is not a kernel table this CPU runs "
                      f"({', '.join(available)}); using {_attention.get_simd()}",
                      RuntimeWarning, stacklevel=2)


_warn_of_an_unusable_simd_request()


def get_include() -> str:
    """Directory of the C header that Cython code cimporting cattention's
    C-level API (``cattention/cython_attention.pxd``) compiles against.

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
    return _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "include")


def show_config() -> None:
    """Print the build and run-time configuration, e.g. for a bug report.

    One line each: the cattention version; the compiler that built the
    extension; whether it was built with OpenMP (and which version) and the
    thread count a call would use (:func:`get_num_threads`); the OpenMP
    runtime library loaded (libgomp, libomp, or the copy inside a wheel); how
    its idle threads wait (see "Threads" in the README); the SIMD kernel table
    in use, those compiled in and those this CPU can run; the NumPy version.

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
      waiting:  ...
      SIMD:     ... (compiled: ...; available: ...)
      NumPy:    ...
    """
    if not _attention.openmp_enabled():
        openmp = "no (serial build), threads: 1"
    elif _attention.forked_after_parallel():
        openmp = (f"yes (OpenMP {_attention.openmp_version()}), threads: 1 (a child "
                  "forked after a parallel region: calls run serially)")
    else:
        openmp = f"yes (OpenMP {_attention.openmp_version()}), threads: {get_num_threads()}"
    runtime = _attention.openmp_runtime() or "none"
    lines = [
        f"cattention {__version__}",
        f"  compiler: {_attention.compiler()}",
        f"  OpenMP:   {openmp}",
        f"  runtime:  {runtime}",
        f"  waiting:  {_wait_policy}",
        f"  SIMD:     {_attention.get_simd()} "
        f"(compiled: {', '.join(_attention.compiled_simd())}; "
        f"available: {', '.join(_attention.available_simd())}; "
        "CATTENTION_SIMD selects one)",
        f"  NumPy:    {_np.__version__}",
    ]
    print("\n".join(lines))
