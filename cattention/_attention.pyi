"""Types of the compiled driver (``_attention.pyx``).

Private to the package: ``_api`` validates and normalises every argument
before calling in, so the signatures state the preconditions the driver
relies on rather than everything a caller of ``cattention.attention`` may pass.
"""

from typing import Any, Literal, overload

import numpy as np
from numpy.typing import NDArray

DIRECT_QUERY_ROWS: int
MAX_NUM_THREADS: int

def get_simd() -> str: ...
def available_simd() -> list[str]: ...
def compiled_simd() -> list[str]: ...
def simd_tile() -> tuple[int, int, int]: ...
def set_simd(name: str) -> None: ...
def compiler() -> str: ...
def openmp_enabled() -> bool: ...
def openmp_version() -> int: ...
def openmp_runtime() -> str: ...
def max_threads() -> int: ...
def forked_after_parallel() -> bool: ...
def team_size(n_threads: int, serial_ns: float) -> int: ...
def attention_into(
    q: NDArray[np.floating[Any]],
    k: NDArray[np.floating[Any]],
    v: NDArray[np.floating[Any]] | None,
    mask: NDArray[np.bool_] | NDArray[np.floating[Any]] | None,
    batch_shape: tuple[int, ...],
    causal: bool,
    scale: float,
    out: NDArray[np.floating[Any]] | None,
    scores: NDArray[np.floating[Any]] | None,
    num_threads: int,
    lse: NDArray[np.floating[Any]] | None = None,
    kv_lengths: NDArray[np.intp] | None = None,
    query_period: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0,
    alibi_slopes: NDArray[np.float64] | None = None,
    sinks: NDArray[np.float64] | None = None,
    k_scale: NDArray[np.float32] | None = None,
    v_scale: NDArray[np.float32] | None = None,
) -> None: ...

def attention_entries_into(
    q: Any,
    k: Any,
    v: Any,
    entries: Any,
    causal: bool,
    scale: float,
    out: NDArray[np.floating[Any]],
    lse: NDArray[np.floating[Any]] | None,
    num_threads: int,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0,
) -> None: ...

# None: the call is not the common case and goes to the general path.
@overload
def attention_fast(
    q: object,
    k: object,
    v: object,
    causal_flag: object,
    scale: object,
    num_threads: object,
    scores_flag: Literal[False],
    thread_limit: int | None,
    grouped_flag: object = ...,
) -> NDArray[np.floating[Any]] | None: ...
@overload
def attention_fast(
    q: object,
    k: object,
    v: object,
    causal_flag: object,
    scale: object,
    num_threads: object,
    scores_flag: Literal[True],
    thread_limit: int | None,
    grouped_flag: object = ...,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]] | None: ...
@overload
def attention_fast(
    q: object,
    k: object,
    v: object,
    causal_flag: object,
    scale: object,
    num_threads: object,
    scores_flag: object,
    thread_limit: int | None,
    grouped_flag: object = ...,
) -> (
    NDArray[np.floating[Any]]
    | tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]
    | None
): ...

# None: the call is not the common serving step and goes to the general path.
def kvcache_fast(
    q: object,
    k_cache: object,
    v_cache: object,
    cache_lengths: object,
    k_new: object,
    v_new: object,
    causal_flag: object,
    scale: object,
    num_threads: object,
    thread_limit: int | None,
) -> NDArray[np.floating[Any]] | None: ...

# None: the call is not the common paged serving step and goes to the
# general path.
def paged_fast(
    q: object,
    k_pages: object,
    v_pages: object,
    block_table: object,
    cache_lengths: object,
    k_new: object,
    v_new: object,
    causal_flag: object,
    scale: object,
    num_threads: object,
    thread_limit: int | None,
) -> NDArray[np.floating[Any]] | None: ...
