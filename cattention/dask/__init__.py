"""cattention over Dask arrays: attention of batches and of sequences too
long for one machine, computed chunk by chunk on Dask's schedulers (a
distributed cluster, threads, or one thread), exactly.

    import cattention.dask as cad
    out = cad.attention(q, k, v, causal=True)        # q, k, v: dask arrays
    out.compute()

Needs the optional extra ``dask`` (``dask[array]`` and ``distributed``);
cattention itself never imports this module. See docs/scale-out.md for how
the graph grows with the machines, what moves between them, and how to
choose chunks.

    _layout.py   the checks (ca.attention's own), chunkings brought into line
    _graph.py    which chunk pairs are tasks, the merge tree, the graph
    _tasks.py    what the workers run, and the threads each task takes
"""

from __future__ import annotations

from typing import Any, Optional, SupportsIndex, Union

try:
    import dask.array as _da
except ImportError as exc:      # pragma: no cover - only without the extra
    raise ImportError(
        "cattention.dask needs Dask: pip install 'dask[array]' distributed (the 'dask' "
        "extra of cattention)") from exc

from numpy.typing import ArrayLike

from ._graph import build
from ._layout import prepare
from ._tasks import concurrent_tasks, task_threads

__all__ = ["attention", "concurrent_tasks", "task_threads"]


def attention(
    q: Any, k: Any, v: Any, *, causal: bool = False, scale: Optional[float] = None,
    enable_gqa: bool = False, kv_lengths: Optional[ArrayLike] = None,
    window: Optional[tuple[Optional[SupportsIndex], Optional[SupportsIndex]]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, return_lse: bool = False, chunks: Any = None,
    split_every: SupportsIndex = 8, num_threads: Optional[SupportsIndex] = None,
) -> Union[_da.Array, tuple[_da.Array, _da.Array]]:
    """Scaled dot-product attention of Dask arrays, as a lazy Dask array.

    The layouts, options and conventions are :func:`cattention.attention`'s
    (bottom-right causal alignment, zero rows for rows that see no key,
    broadcast batch dimensions, grouped heads, the dtype rules), and so are
    the refusals: every argument it refuses is refused here, when the graph
    is built, never on a worker.

    The work is split by the chunks of the inputs. Chunks of the batch
    axes (batch, heads) are independent calls, and so are chunks of the
    query axis T. Chunks of the key axis S are computed per (query chunk,
    key chunk) with their log-sum-exp at their global positions (the
    ``query_offset`` of :func:`cattention.attention`) and combined by a
    fixed tree of exact log-sum-exp merges (:func:`cattention.merge`),
    ``split_every`` at a time. Under ``causal``, ``window`` or
    ``kv_lengths`` a (query chunk, key chunk) pair that sees no key is no
    task at all. K and V chunks are read by every task that needs them,
    never copied per task; under grouped heads the query heads of a K/V
    chunk read it (or a view of its heads) in place.

    Parameters
    ----------
    q, k, v : dask.array.Array or array_like
        ``(..., T, d_k)``, ``(..., S, d_k)``, ``(..., S, d_v)`` as for
        :func:`cattention.attention`. Other arrays (NumPy's) are wrapped with
        ``chunks``. Chunk sizes must be known (not NaN).
    causal, scale, enable_gqa, kv_lengths, window, softcap, alibi_slopes, sinks
        As in :func:`cattention.attention`; ``kv_lengths``, ``alibi_slopes``
        and ``sinks`` are small NumPy arrays (or lists, scalars). The sinks
        join the softmax of each row once (in the first key chunk's task
        of its query chunk); ALiBi distances and windows use global
        positions.
    return_lse : bool, default False
        Also return the log-sum-exp of each row, a lazy ``(..., T)`` array.
    chunks : optional
        The chunks of inputs that are not Dask arrays, in any form
        ``dask.array.from_array`` takes (an int, a tuple, a dict of axes,
        whose negative axes count from the end, "auto"); None: one chunk.
    split_every : int, default 8
        Partial results merged per task of the tree (at least 2).
    num_threads : int, optional
        Threads of each task's cattention call. Default: the rule of
        :func:`task_threads`, the worker process's cattention threads
        shared among the tasks it runs at once.

    Returns
    -------
    out : dask.array.Array, shape (..., T, d_v)
        Chunked as q on the batch axes (the broadcast batch shape) and on
        T, one chunk of d_v; the dtype of :func:`cattention.attention`.
    lse : dask.array.Array, shape (..., T)
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError, ValueError
        Whatever :func:`cattention.attention` raises for these arguments
        (checked on their shapes and dtypes, without data), chunk sizes
        that are unknown, ``chunks`` that do not fit a NumPy input, or a
        ``split_every`` that is not an integer of at least 2.

    Notes
    -----
    Chunkings are brought into line: K and V take q's chunks on the batch
    axes they share (V takes K's chunks of S), features are one chunk, and
    under grouped heads a query chunk that straddles groups of query heads
    is split at the group boundaries, K/V taking the matching head chunks.

    Exactness: the result is the log-sum-exp merge of the chunk pairs'
    exact attention, merged in float64 and rounded once to its dtype, so it
    equals ``cattention.attention`` on the whole arrays to rounding (the
    tests hold float64 results to 1e-12 of the float64 reference, float32
    ones to cattention's float32 tolerance rule). It is bitwise the same
    for a given chunking, whatever the scheduler, the number of workers or
    threads, or the order tasks ran in.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> import cattention.dask as cad
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 64, 16)) for _ in range(3))
    >>> out = cad.attention(q, k, v, causal=True, chunks={-2: 16})
    >>> out.numblocks
    (1, 1, 4, 1)
    >>> result = out.compute(scheduler="sync")
    >>> bool(np.allclose(result, ca.attention(q, k, v, causal=True), rtol=0, atol=1e-12))
    True
    """
    from .._native import driver
    every = _split_every(split_every)
    layout = prepare(q, k, v, chunks=chunks, causal=causal, scale=scale,
                     enable_gqa=enable_gqa, kv_lengths=kv_lengths, window=window,
                     softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                     return_lse=return_lse, num_threads=num_threads)
    threads = None if num_threads is None else driver.check_num_threads(num_threads)
    out, lse = build(layout, return_lse=bool(return_lse), split_every=every,
                     num_threads=threads)
    return (out, lse) if lse is not None else out


def _split_every(value: object) -> int:
    """An integer (not a bool) of at least 2: partial results per merge."""
    import operator
    import numpy as np
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        every = operator.index(value)   # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"split_every must be an integer, got {value!r}") from None
    if every < 2:
        raise ValueError(f"split_every must be at least 2, got {every}")
    return every
