"""One attention layer of a vLLM step: cattention's backend against vLLM's
CPU_ATTN op on the same paged cache sizes and step metadata, 32 query / 8
K/V heads, float32 and bfloat16, 1 and 2 threads.

    python benchmarks/vllm_op.py [--rounds 5] [--reps 7] [--threads 1 2]
                                 [--dtypes float32 bfloat16] [--d 64 128]
                                 [--kv-cache-dtype auto|fp8|fp8_e5m2]

Each round runs each backend in a process of its own (vLLM's op and
cattention carry OpenMP runtimes that would otherwise share the process),
alternately; a process times every case (the median of --reps calls) and
the table gives the median over rounds. Timed: the layer's attention call
with the step's metadata built (vLLM builds it once per step for all
layers): ``CattentionImpl.forward`` (its Python included) against
``cpu_attention_with_kv_cache``; the append of the step's new rows is a
row of its own (``paged_append`` against ``cpu_attn_reshape_and_cache``).
Block size 128 (vLLM's CPU default). With an fp8 --kv-cache-dtype both
caches hold fp8 codes (scales 1; CPU_ATTN's need AVX-512 or AMX). Nothing
is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

N_HEADS, N_KV_HEADS, BLOCK_SIZE = 32, 8, 128

# name -> [(query rows, keys)] per request
CASES = {
    "decode 8 x 2048": [(1, 2048)] * 8,
    "decode 1 x 8192": [(1, 8192)],
    "prefill 1024": [(1024, 1024)],
    "chunk 512 on 2048 + 4 decodes": [(512, 2048)] + [(1, 2048)] * 4,
}


def _step(case, d, dtype, seed=0):
    """Query rows, a cache of random rows in each layout, the metadata."""
    import numpy as np
    import torch
    requests = CASES[case]
    rng = np.random.default_rng(seed)
    torch_dtype = getattr(torch, dtype)
    seq_lens = np.array([keys for _, keys in requests], np.int32)
    query_lens = np.array([rows for rows, _ in requests], np.int32)
    blocks = -(-seq_lens // BLOCK_SIZE)
    n_blocks = int(blocks.sum())
    ids = rng.permutation(n_blocks).astype(np.int32)
    table = np.zeros((len(requests), int(blocks.max())), np.int32)
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = ids[start:start + n]
        start += n
    positions = [np.arange(n) for n in seq_lens]
    slots = np.concatenate([table[b, p // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                            + p % BLOCK_SIZE for b, p in enumerate(positions)])
    n_rows = slots.size
    key = torch.from_numpy(rng.standard_normal((n_rows, N_KV_HEADS, d), np.float32)).to(
        torch_dtype)
    value = torch.from_numpy(rng.standard_normal((n_rows, N_KV_HEADS, d), np.float32)).to(
        torch_dtype)
    total_q = int(query_lens.sum())
    query = torch.from_numpy(rng.standard_normal((total_q, N_HEADS, d), np.float32)).to(
        torch_dtype)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    # the step's own new rows: the last query_lens of each request
    new = np.concatenate([slots[int(seq_lens[:b].sum()) + n - q:int(seq_lens[:b].sum()) + n]
                          for b, (q, n) in enumerate(zip(query_lens, seq_lens))])
    return dict(query=query, key=key, value=value, slots=torch.from_numpy(slots),
                new_slots=torch.from_numpy(new), table=table, seq_lens=seq_lens,
                query_start_loc=query_start_loc, n_blocks=n_blocks, dtype=torch_dtype, d=d)


def _median_time(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cache_dtype(step, kv_cache_dtype):
    import torch
    return step["dtype"] if kv_cache_dtype == "auto" else torch.uint8


def _cattention_layer(step, d, kv_cache_dtype):
    from types import SimpleNamespace

    import torch
    from cattention.integrations.vllm._backend import CattentionImpl, step_metadata
    impl = CattentionImpl(N_HEADS, d, d ** -0.5, N_KV_HEADS, kv_cache_dtype=kv_cache_dtype)
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)   # vLLM's scales
    cache = torch.zeros((step["n_blocks"], N_KV_HEADS, BLOCK_SIZE, 2 * d),
                        dtype=_cache_dtype(step, kv_cache_dtype))
    impl.do_kv_cache_update(layer, step["key"], step["value"], cache, step["slots"])
    meta = step_metadata(step["query"].shape[0], step["query_start_loc"], step["seq_lens"],
                         step["table"], True)
    output = torch.empty((step["query"].shape[0], N_HEADS * d), dtype=step["dtype"])
    n_new = step["new_slots"].shape[0]
    new_key, new_value = step["key"][:n_new], step["value"][:n_new]

    def attend():
        impl.forward(layer, step["query"], None, None, cache, meta, output)

    def append():
        impl.do_kv_cache_update(layer, new_key, new_value, cache, step["new_slots"])
    return attend, append


def _vllm_layer(step, d, kv_cache_dtype):
    import torch
    from vllm import _custom_ops as ops
    isa = "vec" if d % 32 == 0 else "vec16"
    cache = torch.zeros((step["n_blocks"], N_KV_HEADS, 2 * BLOCK_SIZE, d),
                        dtype=_cache_dtype(step, kv_cache_dtype))
    key_cache, value_cache = cache.chunk(2, dim=2)
    quantized = dict(k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    ops.cpu_attn_reshape_and_cache(step["key"], step["value"], key_cache, value_cache,
                                   step["slots"], isa, **quantized)
    seq_lens = torch.from_numpy(step["seq_lens"])
    query_start_loc = torch.from_numpy(step["query_start_loc"])
    table = torch.from_numpy(step["table"])
    metadata = ops.cpu_attn_get_scheduler_metadata(
        len(step["seq_lens"]), N_HEADS, N_KV_HEADS, d, seq_lens, step["dtype"],
        query_start_loc, True, -1, isa, True, None, kv_cache_dtype)
    output = torch.empty_like(step["query"])
    n_new = step["new_slots"].shape[0]
    new_key, new_value = step["key"][:n_new], step["value"][:n_new]

    def attend():
        ops.cpu_attention_with_kv_cache(step["query"], key_cache, value_cache, output,
                                        query_start_loc, seq_lens, d ** -0.5, True, None, -1,
                                        table, 0.0, metadata, None, None, **quantized)

    def append():
        ops.cpu_attn_reshape_and_cache(new_key, new_value, key_cache, value_cache,
                                       step["new_slots"], isa, **quantized)
    return attend, append


def measure(backend, threads, dtypes, head_sizes, reps, kv_cache_dtype):
    """In this process: {case/d/dtype/threads/what: seconds}."""
    import torch
    results = {}
    layer = _cattention_layer if backend == "cattention" else _vllm_layer
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for dtype in dtypes:
            for d in head_sizes:
                for case in CASES:
                    attend, append = layer(_step(case, d, dtype), d, kv_cache_dtype)
                    cache = "" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} cache"
                    key = f"{case}|{d}|{dtype}{cache}|{n_threads}"
                    results[key + "|attention"] = _median_time(attend, reps)
                    results[key + "|append"] = _median_time(append, reps)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.threads, args.dtypes, args.d, args.reps,
                                 args.kv_cache_dtype)))
        return
    rounds = {"cattention": [], "CPU_ATTN": []}
    for _ in range(args.rounds):
        for backend in rounds:
            command = [sys.executable, __file__, "--worker", backend, "--reps", str(args.reps),
                       "--threads", *map(str, args.threads), "--dtypes", *args.dtypes,
                       "--d", *map(str, args.d), "--kv-cache-dtype", args.kv_cache_dtype]
            done = subprocess.run(command, capture_output=True, text=True,
                                  env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"))
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            rounds[backend].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("| case | d | dtype | threads | what | cattention ms | CPU_ATTN ms | CPU_ATTN / ours |")
    print("|---|---|---|---|---|---|---|---|")
    for key in rounds["cattention"][0]:
        ours = statistics.median(r[key] for r in rounds["cattention"])
        theirs = statistics.median(r[key] for r in rounds["CPU_ATTN"])
        case, d, dtype, threads, what = key.split("|")
        print(f"| {case} | {d} | {dtype} | {threads} | {what} | {ours * 1e3:.3f} | "
              f"{theirs * 1e3:.3f} | {theirs / ours:.2f}x |")


if __name__ == "__main__":
    main()
