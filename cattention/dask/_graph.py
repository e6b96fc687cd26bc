"""The task graph of a Dask call: which (query chunk, key chunk) pairs are
tasks, and the fixed tree that merges each query chunk's partial results.

For each block of batch entries (one chunk on every batch axis) and each
query chunk [t0, t1):
  - a leaf per key chunk [s0, s1) that some row of some entry sees (under
    causal, a window or kv_lengths the others are not tasks at all), each
    ``ca.attention`` of the chunk pair with ``query_offset`` placing the
    rows at their global positions, ``return_lse=True``; the sinks go to
    the first leaf only; a query chunk that sees no key at all gets one
    leaf over zero keys (zero rows; the LSE of the sinks or -inf);
  - a tree of merges over the leaves in key order, ``split_every`` at a
    time, level by level: the tree, and so every rounding, follows from the
    chunking alone, not from the scheduler or the workers;
  - the output chunk (and its LSE), the root rounded once to the result
    dtype.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, Optional

import numpy as np

import dask.array as da
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from ._layout import Layout
from ._tasks import ChunkCall, chunk_attention, finish_lse, finish_out, merge_partials

Key = tuple[Hashable, ...]


def _starts(chunks: tuple[int, ...]) -> list[int]:
    """The first index of each chunk, and the end."""
    starts = [0]
    for size in chunks:
        starts.append(starts[-1] + int(size))
    return starts


def visible_key_chunks(layout: Layout, block: tuple[slice, ...], t0: int, t1: int,
                       key_bounds: list[int]) -> list[int]:
    """The key chunks that some row t0..t1-1 of some entry of the batch
    block sees: rows sit at t + n_valid - T (bottom-right, as in
    ca.attention), so the rows' visible keys are [lo(t0), hi(t1 - 1)), each
    end nondecreasing in the row. Kept where not sure: a leaf that sees no
    key merges as nothing (its LSE is -inf)."""
    if t1 <= t0:
        return []
    n_queries = layout.q.shape[-2]
    n_valid = layout.n_valid[block].reshape(-1)
    if n_valid.size == 0:
        return []
    offset = n_valid - n_queries
    left, right = layout.window
    if layout.causal:
        right = 0
    # within 64 bits: positions within T + S of 0, windows at most 2^62
    hi = n_valid.copy()
    if right >= 0:
        hi = np.minimum(hi, t1 - 1 + offset + right + 1)
    lo = np.zeros_like(n_valid)
    if left >= 0:
        lo = np.maximum(lo, t0 + offset - left)
    starts = np.array(key_bounds[:-1], np.int64)
    ends = np.array(key_bounds[1:], np.int64)
    # (entries, key chunks): does the entry's [lo, hi) meet the chunk
    meets = np.maximum(lo[:, None], starts) < np.minimum(hi[:, None], ends)
    return [int(j) for j in np.flatnonzero(meets.any(axis=0))]


def build(layout: Layout, *, return_lse: bool, split_every: int,
          num_threads: Optional[int]) -> tuple[da.Array, Optional[da.Array]]:
    """The lazy ATTN (and LSE) of a prepared call."""
    q, k, v = layout.q, layout.k, layout.v
    ndim = q.ndim
    n_batch_axes = ndim - 2
    head_axis = ndim - 3 if layout.enable_gqa else -1
    q_bounds = _starts(q.chunks[-2])
    key_bounds = _starts(k.chunks[-2])
    batch_starts = [_starts(c) for c in layout.batch_chunks]
    kv_head_bounds = list(layout.kv_head_bounds)
    left, right = layout.window
    window = None if left < 0 and right < 0 else (left if left >= 0 else None,
                                                    right if right >= 0 else None)
    token = tokenize(q, k, v, layout.causal, layout.scale, layout.window, layout.softcap,
                     layout.enable_gqa, layout.n_valid, layout.kv_lengths_given,
                     layout.alibi_slopes, layout.sinks, return_lse, split_every, num_threads)
    parts_name = f"attention-chunks-{token}"
    out_name = f"attention-{token}"
    lse_name = f"attention-lse-{token}"
    parts: dict[Key, Any] = {}
    outs: dict[Key, Any] = {}
    lses: dict[Key, Any] = {}

    for index in np.ndindex(*(len(c) for c in layout.batch_chunks)):
        block = tuple(slice(starts[i], starts[i + 1])
                      for starts, i in zip(batch_starts, index))
        # each operand's chunk on the batch axes: 0 where it has size 1
        q_index = tuple(0 if q.shape[a] == 1 else i for a, i in enumerate(index))
        kv_index = []
        kv_heads = None
        for a, i in enumerate(index):
            if a == head_axis:
                # the K/V chunk holding the query chunk's heads, and those
                # heads within it when it holds more
                first = block[a].start // layout.group
                stop = max(first, (block[a].stop - 1) // layout.group + 1)
                chunk = max(0, np.searchsorted(kv_head_bounds, first, side="right") - 1)
                chunk = min(chunk, len(k.chunks[a]) - 1)
                kv_index.append(int(chunk))
                base = kv_head_bounds[chunk]
                if (first - base, stop - base) != (0, k.chunks[a][chunk]):
                    kv_heads = slice(first - base, stop - base)
            else:
                kv_index.append(0 if k.shape[a] == 1 else i)
        v_index = tuple(kv_index[a] if a == head_axis else (0 if v.shape[a] == 1 else i)
                        for a, i in enumerate(index))
        n_valid = layout.n_valid[block]
        per_entry = {name: (arr[block] if arr is not None else None) for name, arr in
                     (("alibi", layout.alibi_slopes), ("sinks", layout.sinks))}
        for ti, (t0, t1) in enumerate(zip(q_bounds, q_bounds[1:])):
            seen = visible_key_chunks(layout, block, t0, t1, key_bounds)
            leaves: list[Key] = []
            q_key = (q.name, *q_index, ti, 0)
            for n, j in enumerate(seen or [None]):
                s0 = key_bounds[j] if j is not None else 0
                empty = None
                if j is None:
                    kv_batch = tuple(1 for _ in range(n_batch_axes))
                    if head_axis >= 0:
                        needed = (kv_heads.stop - kv_heads.start if kv_heads is not None
                                  else k.chunks[head_axis][kv_index[head_axis]])
                        kv_batch = tuple(needed if a == head_axis else 1
                                         for a in range(n_batch_axes))
                    empty = (kv_batch, q.shape[-1], v.shape[-1], k.dtype, v.dtype)
                call = ChunkCall(
                    causal=layout.causal, scale=layout.scale, window=window,
                    softcap=layout.softcap, enable_gqa=layout.enable_gqa,
                    kv_heads=kv_heads if j is not None else None,
                    query_offset=(t0 - s0) + (n_valid - q.shape[-2]),
                    kv_lengths=(np.clip(n_valid - s0, 0, key_bounds[j + 1] - s0)
                                if layout.kv_lengths_given and j is not None else None),
                    alibi_slopes=per_entry["alibi"],
                    sinks=per_entry["sinks"] if n == 0 else None,
                    empty_keys=empty, num_threads=num_threads)
                leaf = (parts_name, "chunk", *index, ti, -1 if j is None else j)
                if j is None:
                    parts[leaf] = (chunk_attention, q_key, None, None, call)
                else:
                    parts[leaf] = (chunk_attention, q_key, (k.name, *kv_index, j, 0),
                                   (v.name, *v_index, j, 0), call)
                leaves.append(leaf)
            root = _merge_tree(parts, parts_name, (*index, ti), leaves, split_every)
            if return_lse:
                outs[(out_name, *index, ti, 0)] = (finish_out, root, layout.result)
                lses[(lse_name, *index, ti)] = (finish_lse, root, layout.compute)
            else:
                # the root's task runs inside the output's: one task less
                # per query chunk, and its partial result never travels
                outs[(out_name, *index, ti, 0)] = (finish_out, parts.pop(root),
                                                   layout.result)

    graph = HighLevelGraph.from_collections(parts_name, parts, dependencies=[q, k, v])
    chunks = layout.batch_chunks + (q.chunks[-2],)
    out_graph = HighLevelGraph({**graph.layers, out_name: outs},
                               {**graph.dependencies,
                                out_name: {parts_name, q.name, k.name, v.name}})
    out = da.Array(out_graph, out_name, chunks + ((v.shape[-1],),), dtype=layout.result)
    if not return_lse:
        return out, None
    lse_graph = HighLevelGraph({**graph.layers, lse_name: lses},
                               {**graph.dependencies, lse_name: {parts_name}})
    return out, da.Array(lse_graph, lse_name, chunks, dtype=layout.compute)


def _merge_tree(parts: dict[Key, Any], name: str, where: tuple[int, ...],
                leaves: list[Key], split_every: int) -> Key:
    """Merge tasks over the leaves, split_every consecutive ones at a time,
    level by level, in key order; returns the root (a leaf alone is its own
    root)."""
    level = 0
    nodes = leaves
    while len(nodes) > 1:
        merged = []
        for g in range(math.ceil(len(nodes) / split_every)):
            group = nodes[g * split_every:(g + 1) * split_every]
            if len(group) == 1:
                merged.append(group[0])
                continue
            key = (name, "merge", level, *where, g)
            parts[key] = (merge_partials, *group)
            merged.append(key)
        nodes = merged
        level += 1
    return nodes[0]
