"""cattention: fast, exact scaled dot-product attention for the CPU.

    attn = cattention.attention(q, k, v, causal=True)
    attn, scores = cattention.attention(q, k, v, return_scores=True)
    cattention.plot_scores(scores[0, 0])    # heatmap of one head (needs matplotlib)

The conventions every call shares (bottom-right causal alignment, True in a
bool mask means "may attend", zero rows for rows that see no key, dtypes,
broadcasting) are set out once, on the Conventions page of the user guide
(docs/user-guide/conventions.rst; ``make docs`` builds the site).
"""

import os as _os

import numpy as _np

from ._native import driver as _driver, wait_policy as _wait_policy
from ._api.dense import attention, attention_scores
from ._api.kvcache import attention_with_kvcache
from ._api.merge import merge
from ._api.paged import attention_with_paged_kvcache, paged_append
from ._api.plot import plot_scores
from ._api.quantize import quantize_kv, quantize_kv_fp8
from ._api.threads import get_num_threads, limit_threads, set_num_threads
from ._api.varlen import attention_varlen
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
    "paged_append",
    "plot_scores",
    "quantize_kv",
    "quantize_kv_fp8",
    "set_num_threads",
    "show_config",
]


def _warn_of_an_unusable_simd_request() -> None:
    """CATTENTION_SIMD naming a table that is not compiled in or that this
    CPU cannot run leaves the best one in use: say so, once, at import."""
    requested = _os.environ.get("CATTENTION_SIMD", "")
    available = list(_driver.available_simd())
    if requested and requested not in available:
        import warnings
        warnings.warn(f"CATTENTION_SIMD={requested!r} is not a kernel table this CPU runs "
                      f"({', '.join(available)}); using {_driver.get_simd()}",
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


_BFLOAT16_CONVERTED = ("converted to float32 as rows are read (this table has no "
                       "bfloat16 instructions)")
_BFLOAT16_BY_TABLE = {
    "amx": ("AMX tiles: Q.K^T (TDPBF16PS) and P.V (P split into three bfloat16 parts) "
            "on every layout's prompt rows; decode (at most 8 rows) reads K and V as "
            "float32"),
    "avx512bf16": ("Q.K^T with VDPBF16PS on every layout's prompt rows; P.V (VDPBF16PS "
                   "at the medium precision) and decode in float32"),
}


def _precision_levels() -> str:
    """What P.V of a bfloat16 result's prompt rows takes at each precision
    level on the table in use (its bf16_pv_parts)."""
    def weights(parts: int) -> str:
        if parts == 0:
            return "float32 weights"
        if parts == 1:
            return "P rounded to bfloat16"
        return f"P in {parts} bfloat16 parts"
    return "; ".join(f"{level}: {weights(parts)}" for level, parts in
                     zip(("highest", "high", "medium"), _driver.bf16_pv_parts()))


def _ml_dtypes_version() -> str:
    """ml_dtypes' version, read from its metadata (cattention never imports
    it: bfloat16 arrays come from code that does)."""
    from importlib import metadata
    try:
        return metadata.version("ml_dtypes")
    except metadata.PackageNotFoundError:
        return "not installed (bfloat16 arrays need it)"


def show_config() -> None:
    """Print the build and run-time configuration, e.g. for a bug report.

    One line each: the cattention version; the compiler that built the
    extension; whether it was built with OpenMP (and which version) and the
    thread count a call would use (:func:`get_num_threads`); the OpenMP
    runtime library loaded (libgomp, libomp, or the copy inside a wheel); how
    its idle threads wait (see "Inside NumPy pipelines" in the user guide);
    the SIMD kernel table in use, those compiled in and those this CPU can
    run (and why one it has the instructions for is not; see "SIMD tables"
    in the user guide); how that table computes bfloat16 inputs, and P.V at
    each ``precision=`` level (see :ref:`precision`); the NumPy
    version (and ml_dtypes', which bfloat16 arrays need).

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
      bfloat16: ...
      precision: highest: ...
      NumPy:    ...
    """
    if not _driver.openmp_enabled():
        openmp = "no (serial build), threads: 1"
    elif _driver.forked_after_parallel():
        openmp = (f"yes (OpenMP {_driver.openmp_version()}), threads: 1 (a child "
                  "forked after a parallel region: calls run serially)")
    else:
        openmp = f"yes (OpenMP {_driver.openmp_version()}), threads: {get_num_threads()}"
    runtime = _driver.openmp_runtime() or "none"
    lines = [
        f"cattention {__version__}",
        f"  compiler: {_driver.compiler()}",
        f"  OpenMP:   {openmp}",
        f"  runtime:  {runtime}",
        f"  waiting:  {_wait_policy}",
        f"  SIMD:     {_driver.get_simd()} "
        f"(compiled: {', '.join(_driver.compiled_simd())}; "
        f"available: {', '.join(_driver.available_simd())}; "
        "CATTENTION_SIMD selects one)",
    ]
    if _driver.simd_note():
        lines.append(f"            ({_driver.simd_note()})")
    lines += [
        f"  bfloat16: {_BFLOAT16_BY_TABLE.get(_driver.get_simd(), _BFLOAT16_CONVERTED)}",
        f"  precision: {_precision_levels()} (precision=; default high for bfloat16 "
        "and float16 results, float32 and float64 ones always highest)",
        f"  NumPy:    {_np.__version__}; ml_dtypes: {_ml_dtypes_version()}",
    ]
    print("\n".join(lines))
