"""Time two builds of cattention against each other in one run.

    python tools/compare_builds.py BEFORE_TREE AFTER_TREE [--threads 1 2] [--rounds 15]
        [--pairs 3]

Each tree is a source checkout with its extension built in place. One worker
process per tree imports that tree's cattention; every case is timed
round-robin (before, after, before, ...), one worker computing at a time, so
both see the same machine state. Prints the median per case and the ratio
after / before (below 1: the after build is faster). Nothing is asserted.

A process's own memory placement moves its times by several percent for
its whole life (one build against itself gave 0.935 on the BERT-like case
over 41 rounds), so the rounds are split over --pairs fresh pairs of
workers; the ratio is the median of the pairs' ratios, and the range of
those is printed beside it: a difference inside that range is not one.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

#: (B, H, T, S, d, causal, dtype, kv_heads, kv_dtype, window): the cases of
#: benchmarks/attention.py; then two cases named by a string
CASES = [
    (1, 8, 1024, 1024, 64, False, "float32", 0, "", 0),
    (1, 8, 1024, 1024, 64, True, "float32", 0, "", 0),
    (1, 8, 2048, 2048, 64, False, "float32", 0, "", 0),
    (1, 8, 2048, 2048, 64, True, "float32", 0, "", 0),
    (1, 4, 4096, 4096, 64, True, "float32", 0, "", 0),
    (1, 8, 1024, 1024, 128, True, "float32", 0, "", 0),
    (1, 8, 2048, 2048, 128, False, "float32", 0, "", 0),
    (4, 32, 512, 512, 128, False, "float32", 0, "", 0),
    (4, 32, 512, 512, 128, True, "float32", 0, "", 0),
    (8, 12, 512, 512, 64, False, "float32", 0, "", 0),
    (1, 32, 2048, 2048, 128, True, "float32", 0, "", 0),
    (8, 12, 128, 128, 64, False, "float32", 0, "", 0),
    (1, 32, 1, 4096, 128, False, "float32", 0, "", 0),
    (1, 32, 1, 1024, 128, False, "float32", 0, "", 0),
    # the decode call of benchmarks/pipeline.py (K and V in L3)
    (1, 8, 1, 1024, 128, False, "float32", 0, "", 0),
    (1, 32, 1, 4096, 128, False, "float32", 8, "", 0),
    (1, 32, 1, 4096, 128, False, "float32", 8, "float16", 0),
    (1, 32, 1, 4096, 128, False, "float32", 8, "int8", 0),
    (1, 1, 8, 8, 8, False, "float32", 0, "", 0),
    (1, 2, 8192, 8192, 64, True, "float32", 0, "", 1024),
    (1, 8, 1024, 1024, 64, False, "float64", 0, "", 0),
    (1, 8, 1024, 1024, 64, True, "float64", 0, "", 0),
    # the decode step of benchmarks/serving.py (B = 16 sequences of 256-4096
    # positions, H = 32, H_kv = 8, d = 128) on shuffled pages of 16 rows,
    # and on contiguous caches of the same contents
    "paged",
    "contiguous",
    # a small model's decode step, where the call's own overhead shows: B = 1,
    # H = 14, H_kv = 2, d = 64, 300 of 1024 positions filled
    "small contiguous",
]

WORKER = r"""
import json, sys, time
import numpy as np
import cattention as ca
inputs = {}


def serving_step(kind):
    rng = np.random.default_rng(1)
    if kind == "small contiguous":
        k, v = (rng.standard_normal((1, 2, 1024, 64)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((1, 14, 1, 64)).astype(np.float32)
        new = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
        lengths = np.array([299])
        return lambda threads: ca.attention_with_kvcache(
            q, k, v, lengths.copy(), new, new, num_threads=threads)
    B, H, H_kv, d, page_size = 16, 32, 8, 128, 16
    lengths = np.sort(rng.integers(256, 4097, B))
    lengths[0], lengths[-1] = 256, 4096
    max_pages = 4096 // page_size + 1
    table = rng.permutation(B * max_pages).reshape(B, max_pages)
    k = rng.standard_normal((B * max_pages, H_kv, page_size, d)).astype(np.float32)
    v = rng.standard_normal((B * max_pages, H_kv, page_size, d)).astype(np.float32)
    q = rng.standard_normal((B, H, 1, d)).astype(np.float32)
    new = rng.standard_normal((B, H_kv, 1, d)).astype(np.float32)
    if kind == "paged":
        return lambda threads: ca.attention_with_paged_kvcache(
            q, k, v, table, lengths - 1, new, new, num_threads=threads)
    s_max = max_pages * page_size
    k, v = (np.swapaxes(x[table], 1, 2).reshape(B, H_kv, s_max, d).copy() for x in (k, v))
    return lambda threads: ca.attention_with_kvcache(
        q, k, v, lengths - 1, new, new, num_threads=threads)


for line in sys.stdin:
    request = json.loads(line)
    if isinstance(request["case"], str):
        if request["case"] == "paged" and not hasattr(ca, "attention_with_paged_kvcache"):
            print("null", flush=True)   # an older build without paged caches
            continue
        if request["case"] not in inputs:
            inputs = {request["case"]: serving_step(request["case"])}
        step = inputs[request["case"]]
        step(request["threads"])
        start = time.perf_counter()
        for _ in range(request["calls"]):
            step(request["threads"])
        print(json.dumps((time.perf_counter() - start) / request["calls"]), flush=True)
        continue
    B, H, T, S, d, causal, dtype, kv_heads, kv_dtype, window = request["case"]
    key = tuple(request["case"])
    if kv_dtype == "int8" and not hasattr(ca, "quantize_kv"):
        print("null", flush=True)   # an older build without int8 K/V
        continue
    if key not in inputs:
        rng = np.random.default_rng(0)
        kvh = kv_heads or H
        q = rng.standard_normal((B, H, T, d)).astype(dtype)
        options = dict(causal=causal, enable_gqa=bool(kv_heads))
        if kv_dtype == "int8":
            (k, options["k_scale"]), (v, options["v_scale"]) = (
                ca.quantize_kv(rng.standard_normal((B, kvh, S, d)).astype(dtype))
                for _ in range(2))
        else:
            k = rng.standard_normal((B, kvh, S, d)).astype(kv_dtype or dtype)
            v = rng.standard_normal((B, kvh, S, d)).astype(kv_dtype or dtype)
        if window:
            options["window"] = (window, 0)
        inputs = {key: (q, k, v, options)}
    q, k, v, options = inputs[key]
    calls = request["calls"]
    ca.attention(q, k, v, num_threads=request["threads"], **options)
    start = time.perf_counter()
    for _ in range(calls):
        ca.attention(q, k, v, num_threads=request["threads"], **options)
    print(json.dumps((time.perf_counter() - start) / calls), flush=True)
"""


def label_of(case):
    if isinstance(case, str):
        return f"serving decode step, {case}"
    B, H, T, S, d, causal, dtype, kv_heads, kv_dtype, window = case
    return (f"{B}x{H}x{T}x{S}x{d} {'causal' if causal else 'full'} {dtype}"
            + (f" gqa{H}/{kv_heads}" if kv_heads else "")
            + (f" kv-{kv_dtype}" if kv_dtype else "")
            + (f" window{window}" if window else ""))


def start_worker(tree, threads):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS=str(threads))
    return subprocess.Popen([sys.executable, "-c", WORKER], cwd=os.path.abspath(tree), env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(worker, case, threads, calls):
    worker.stdin.write(json.dumps({"case": case, "threads": threads, "calls": calls}) + "\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15,
                        help="rounds per case, split over the pairs of workers")
    parser.add_argument("--pairs", type=int, default=3,
                        help="fresh pairs of worker processes (default 3)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--cases", metavar="SUBSTR", nargs="+",
                        help="only the cases whose label contains one of these")
    args = parser.parse_args(argv)
    cases = [c for c in CASES
             if not args.cases or any(p in label_of(c) for p in args.cases)]
    rounds_per_pair = max(1, -(-args.rounds // args.pairs))
    rows = []
    skipped = set()   # cases one of the builds cannot run
    print(f"{'case (B, H, T, S, d)':44} {'thr':>3} {'before ms':>10} {'after ms':>10} "
          f"{'after/before':>12} {'pairs range':>12}")
    for threads in args.threads:
        times = {label_of(c): ([], []) for c in cases}
        pair_ratios = {label_of(c): [] for c in cases}
        for _ in range(args.pairs):
            workers = [start_worker(args.before, threads), start_worker(args.after, threads)]
            try:
                for case in cases:
                    probe = ask(workers[0], case, threads, 1)
                    if probe is None or ask(workers[1], case, threads, 1) is None:
                        skipped.add(label_of(case))
                        continue
                    calls = max(1, min(2000, int(0.02 / max(probe, 1e-7))))
                    pair = ([], [])
                    for r in range(rounds_per_pair):
                        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                            pair[i].append(ask(workers[i], case, threads, calls))
                    label = label_of(case)
                    for i in (0, 1):
                        times[label][i].extend(pair[i])
                    pair_ratios[label].append(statistics.median(pair[1])
                                              / statistics.median(pair[0]))
            finally:
                for w in workers:
                    w.stdin.close()
                    w.wait()
        for case in cases:
            label = label_of(case)
            if label in skipped:
                print(f"{label:44} {threads:3} (not in both builds)")
                continue
            before, after = (statistics.median(t) for t in times[label])
            ratio = statistics.median(pair_ratios[label])
            low, high = min(pair_ratios[label]), max(pair_ratios[label])
            rows.append({"case": label, "threads": threads, "before_ms": before * 1e3,
                         "after_ms": after * 1e3, "ratio": ratio,
                         "pair_ratios": pair_ratios[label]})
            print(f"{label:44} {threads:3} {before * 1e3:10.4g} {after * 1e3:10.4g} "
                  f"{ratio:12.3f} {low:6.3f}-{high:.3f}", flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"median after/before {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
