"""What the workers run: the attention of one (query chunk, key chunk) pair
with its log-sum-exp, the exact merge of such partial results, the final
cast, and the thread count each task takes.

Everything here is a module-level function of NumPy arrays (picklable for
distributed workers); nothing is of size T x S: a task holds its chunks of
q, K and V and its (T_chunk, d_v) result.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

from .._api.dense import attention
from .._api.merge import merge
from .._api.threads import get_num_threads
from .._prepare.arrays import is_half

_Array = NDArray[Any]
# a partial result: ATTN of some key chunks and the log-sum-exp of its rows
Partial = tuple[_Array, _Array]


def concurrent_tasks() -> int:
    """How many tasks the process running this one may run at once: the
    threads of a distributed worker; 1 on the calling thread (the
    synchronous scheduler); else dask's local thread pool, of
    ``dask.config`` ``num_workers`` threads or one per CPU (dask's
    default; a pool given ``num_workers=`` at compute() is not visible
    here, and one of the CPU count is assumed)."""
    try:
        from distributed import get_worker
        return max(1, int(get_worker().state.nthreads))
    except (ImportError, ValueError):
        pass    # not on a distributed worker
    if threading.current_thread() is threading.main_thread():
        return 1
    import dask
    from dask.system import CPU_COUNT
    workers = dask.config.get("num_workers", None)
    return max(1, int(workers) if workers else int(CPU_COUNT))


def task_threads(num_threads: Optional[int] = None) -> int:
    """The threads a task gives its cattention call: num_threads when the
    caller fixed it, else the process's cattention threads
    (:func:`cattention.get_num_threads`: OMP_NUM_THREADS, which a
    distributed nanny sets to 1 by default, or set_num_threads) shared
    among the tasks it may run at once (:func:`concurrent_tasks`), at
    least 1. So a worker's tasks together never start more threads than
    the process was given. Results do not depend on it: cattention's are
    bitwise the same for any thread count."""
    if num_threads is not None:
        return num_threads
    return max(1, get_num_threads() // concurrent_tasks())


@dataclasses.dataclass(frozen=True)
class ChunkCall:
    """The options of one (batch block, query chunk, key chunk) task:
    ``ca.attention``'s, with the chunk's global alignment."""

    causal: bool
    scale: float
    window: Optional[tuple[Optional[int], Optional[int]]]
    softcap: Optional[float]
    enable_gqa: bool
    kv_heads: Optional[slice]          # the K/V heads of the chunk that the
                                       # query heads read (grouped heads)
    query_offset: _Array               # per batch entry of the block
    kv_lengths: Optional[_Array]       # per batch entry, within the chunk
    alibi_slopes: Optional[_Array]
    sinks: Optional[_Array]            # only in the first task of a row chunk
    empty_keys: Optional[tuple[tuple[int, ...], int, int, Any, Any]]
                                       # no K/V chunk: (K/V batch shape, d_k,
                                       # d_v, k dtype, v dtype) of zero keys
    num_threads: Optional[int]


def chunk_attention(q: _Array, k: Optional[_Array], v: Optional[_Array],
                    call: ChunkCall) -> Partial:
    """ATTN and log-sum-exp of a query chunk against one key chunk, in the
    compute dtype (float16 and bfloat16 q are read as float32, so that the
    partial results are not rounded to 16 bits before they are merged).
    K and V are read where they lie; grouped heads take a view of theirs."""
    if call.empty_keys is not None:
        # every key chunk is invisible to these rows: zero rows, and an
        # lse of -inf or their sink, from the call over no key at all
        kv_batch, d_k, d_v, k_dtype, v_dtype = call.empty_keys
        k = np.empty(kv_batch + (0, d_k), k_dtype)
        v = np.empty(kv_batch + (0, d_v), v_dtype)
    assert k is not None and v is not None
    if call.kv_heads is not None:
        k = k[..., call.kv_heads, :, :]
        v = v[..., call.kv_heads, :, :]
    if is_half(q.dtype):
        q = q.astype(np.float32)
    out, lse = attention(q, k, v, causal=call.causal, scale=call.scale,
                         enable_gqa=call.enable_gqa, kv_lengths=call.kv_lengths,
                         window=call.window, softcap=call.softcap,
                         alibi_slopes=call.alibi_slopes, sinks=call.sinks,
                         query_offset=call.query_offset, return_lse=True,
                         num_threads=task_threads(call.num_threads))
    return out, lse


def merge_partials(*partials: Partial) -> Partial:
    """The exact log-sum-exp merge (:func:`cattention.merge`) of partial
    results over disjoint key chunks, in float64 whatever their dtype (the
    float64 log-sum-exp makes it so; the outputs are read as they are): the
    merge then adds a rounding of about 1e-16 per level of the tree, and
    the result is rounded to its dtype once, at the end (finish)."""
    return merge([o for o, _ in partials],
                 [x.astype(np.float64, copy=False) for _, x in partials])


def finish_out(partial: Partial, dtype: Any) -> _Array:
    """ATTN of a row chunk in the result dtype, rounded once."""
    return partial[0].astype(dtype, copy=False)


def finish_lse(partial: Partial, dtype: Any) -> _Array:
    """The log-sum-exp of a row chunk in ``ca.attention``'s dtype for it."""
    return partial[1].astype(dtype, copy=False)
