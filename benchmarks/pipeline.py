"""cattention inside a NumPy pipeline and a threaded service, run as users run it.

    python benchmarks/pipeline.py [--threads 1 2] [--settings] [--json PATH]

Three cases, each in a fresh process per thread count, in the default
environment (no settle pause between calls, nothing unset), with the thread
count given the way a user gives it (``OMP_NUM_THREADS`` and
``OPENBLAS_NUM_THREADS``):

* alternating pair: a decode call q (1, 8, 1, 128) over a (1, 8, 1024, 128)
  float32 cache alternating with a 256 x 256 float32 ``a @ a``; each timed
  alone (many calls in a row; the decode before any BLAS call) and in the
  alternation (median per call).
* transformer layer: x @ W_qkv, heads split by reshape/transpose views
  (no copies), causal attention, heads merged, @ W_o; B=4, T=256, D=512,
  H=8, float32. Once with cattention, once with plain NumPy attention
  (matmul, -inf mask, stable softmax, matmul), the two layers alternating.
* thread pool: 8 Python threads x 200 calls of (1, 8, 128, 128, 64) float32
  causal attention, mean time per call (wall time / calls), beside one
  caller making the same calls serially; with and without
  ``cattention.limit_threads(1)`` in each task.

``--settings`` also runs the first two cases under settings a user can
apply (``OMP_WAIT_POLICY``, ``OPENBLAS_THREAD_TIMEOUT``), for the table of
what each changes. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: Environment settings compared with --settings (None: the default environment).
SETTINGS = [
    None,
    "GOMP_SPINCOUNT=300000",   # libgomp's own default: how 0.1.0 ran
    "OMP_WAIT_POLICY=active",
    "OMP_WAIT_POLICY=passive",
    "OPENBLAS_THREAD_TIMEOUT=4",
]


def _median_alone(fn, calls=300):
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternating_pair(threads, rounds=3):
    import numpy as np

    import cattention as ca
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 1, 128), dtype=np.float32)
    k = rng.standard_normal((1, 8, 1024, 128), dtype=np.float32)
    v = rng.standard_normal((1, 8, 1024, 128), dtype=np.float32)
    a = rng.standard_normal((256, 256), dtype=np.float32)

    def decode():
        ca.attention(q, k, v)

    def matmul():
        a @ a

    # alone: each in calls of its own, the decode before any BLAS call (an
    # OpenBLAS worker spins for a while after every matmul and would slow it)
    decode_alone = statistics.median(_median_alone(decode) for _ in range(rounds))
    matmul_alone = statistics.median(_median_alone(matmul) for _ in range(rounds))
    in_decode, in_matmul = [], []
    for i in range(20 + 300 * rounds):
        start = time.perf_counter()
        matmul()
        middle = time.perf_counter()
        decode()
        end = time.perf_counter()
        if i >= 20:
            in_matmul.append(middle - start)
            in_decode.append(end - middle)
    return {"decode_alone_us": decode_alone * 1e6,
            "decode_alternating_us": statistics.median(in_decode) * 1e6,
            "matmul_alone_us": matmul_alone * 1e6,
            "matmul_alternating_us": statistics.median(in_matmul) * 1e6}


def transformer_layer(threads, rounds=30):
    import numpy as np

    import cattention as ca
    batch, n_tokens, width, n_heads = 4, 256, 512, 8
    d_head = width // n_heads
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, n_tokens, width), dtype=np.float32)
    w_qkv = (rng.standard_normal((width, 3 * width)) / np.sqrt(width)).astype(np.float32)
    w_out = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    causal_mask = np.tril(np.ones((n_tokens, n_tokens), dtype=bool))

    def numpy_attention(q, k, v):
        logits = (q @ k.swapaxes(-1, -2)) * np.float32(1 / np.sqrt(d_head))
        logits = np.where(causal_mask, logits, np.float32(-np.inf))
        logits -= logits.max(axis=-1, keepdims=True)
        weights = np.exp(logits)
        weights /= weights.sum(axis=-1, keepdims=True)
        return weights @ v

    def cattention_attention(q, k, v):
        return ca.attention(q, k, v, causal=True)

    def layer(attend):
        qkv = (x @ w_qkv).reshape(batch, n_tokens, 3, n_heads, d_head).transpose(2, 0, 3, 1, 4)
        heads = attend(qkv[0], qkv[1], qkv[2])
        return heads.transpose(0, 2, 1, 3).reshape(batch, n_tokens, width) @ w_out

    reference = layer(numpy_attention)
    error = float(np.max(np.abs(layer(cattention_attention) - reference)))
    with_numpy, with_ca = [], []
    for i in range(rounds + 3):
        start = time.perf_counter()
        layer(numpy_attention)
        middle = time.perf_counter()
        layer(cattention_attention)
        end = time.perf_counter()
        if i >= 3:
            with_numpy.append(middle - start)
            with_ca.append(end - middle)
    numpy_ms = statistics.median(with_numpy) * 1e3
    ca_ms = statistics.median(with_ca) * 1e3
    return {"layer_numpy_ms": numpy_ms, "layer_cattention_ms": ca_ms,
            "layer_speedup": numpy_ms / ca_ms, "layer_max_error": error}


def thread_pool(threads, n_workers=8, calls_per_worker=200):
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    import cattention as ca
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 8, 128, 64), dtype=np.float32) for _ in range(3))
    n_calls = n_workers * calls_per_worker

    def serial():
        for _ in range(n_calls):
            ca.attention(q, k, v, causal=True)

    def plain(_):
        for _ in range(calls_per_worker):
            ca.attention(q, k, v, causal=True)

    def limited(_):
        with ca.limit_threads(1):
            for _ in range(calls_per_worker):
                ca.attention(q, k, v, causal=True)

    results = {}
    for name, run in (("serial", None), ("pool", plain), ("pool_limit1", limited)):
        best = []
        for _ in range(3):
            start = time.perf_counter()
            if run is None:
                serial()
            else:
                with ThreadPoolExecutor(n_workers) as pool:
                    list(pool.map(run, range(n_workers)))
            best.append(time.perf_counter() - start)
        results[f"{name}_ms_per_call"] = statistics.median(best) / n_calls * 1e3
    return results


def _child(threads, cases):
    record = {"threads": threads}
    for case in cases:
        record.update({"pair": alternating_pair, "layer": transformer_layer,
                       "pool": thread_pool}[case](threads))
    print(json.dumps(record))


def run_case_process(threads, setting, cases):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    if setting is not None:
        name, value = setting.split("=", 1)
        env[name] = value
    out = subprocess.run([sys.executable, __file__, "--child", str(threads), *cases],
                         env=env, capture_output=True, text=True, check=True)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    record["setting"] = setting or "default"
    return record


def print_tables(records):
    print("| threads | setting | decode alone us | decode alternating us | ratio "
          "| matmul alone us | matmul alternating us | ratio | layer, NumPy attention ms "
          "| layer, cattention ms | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if "decode_alone_us" not in r:
            continue
        print(f"| {r['threads']} | {r['setting']} | {r['decode_alone_us']:.0f} "
              f"| {r['decode_alternating_us']:.0f} "
              f"| {r['decode_alternating_us'] / r['decode_alone_us']:.2f}x "
              f"| {r['matmul_alone_us']:.0f} | {r['matmul_alternating_us']:.0f} "
              f"| {r['matmul_alternating_us'] / r['matmul_alone_us']:.2f}x "
              f"| {r['layer_numpy_ms']:.1f} | {r['layer_cattention_ms']:.1f} "
              f"| {r['layer_speedup']:.2f}x |")
    pools = [r for r in records if "pool_ms_per_call" in r]
    if pools:
        print()
        print("| threads | one serial caller ms/call | 8 Python threads ms/call "
              "| 8 threads with limit_threads(1) ms/call |")
        print("|---|---|---|---|")
        for r in pools:
            print(f"| {r['threads']} | {r['serial_ms_per_call']:.3f} "
                  f"| {r['pool_ms_per_call']:.3f} | {r['pool_limit1_ms_per_call']:.3f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--settings", action="store_true",
                        help="also run under the environment settings a user can apply")
    parser.add_argument("--json", metavar="PATH", help="write the records to PATH")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("cases", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        _child(args.child, args.cases)
        return 0
    records = []
    for threads in args.threads:
        for setting in (SETTINGS if args.settings else [None]):
            if setting is not None and threads == 1:
                continue  # with one thread nothing spins
            records.append(run_case_process(threads, setting, ["pair", "layer"]))
        records.append(dict(run_case_process(threads, None, ["pool"]), setting="default"))
    print_tables(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
