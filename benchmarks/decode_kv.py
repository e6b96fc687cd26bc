"""Memory-bound decode over float32, float16 and int8 K/V caches.

    python benchmarks/decode_kv.py [--shape 1 32 1 8192 128] [--threads 2] [--rounds 25]

One decode step, q (B, H, 1, d) over caches (B, H, S, d), timed back to back
(median of rounds), beside PyTorch SDPA on the float32 (dequantized) cache
when torch is installed. GB/s counts the bytes of K and V actually read
(int8: the int8 rows and their float32 scales). Nothing is asserted.
"""

import argparse
import statistics
import sys
import time

import numpy as np

import cattention as ca


def median_seconds(fn, rounds, calls):
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=5, default=[1, 32, 1, 8192, 128],
                        metavar=("B", "H", "T", "S", "d"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args(argv)
    B, H, T, S, d = args.shape
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, T, d)).astype(np.float32)
    k = rng.standard_normal((B, H, S, d)).astype(np.float32)
    v = rng.standard_normal((B, H, S, d)).astype(np.float32)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    (k8, ks), (v8, vs) = ca.quantize_kv(k), ca.quantize_kv(v)
    n = args.threads
    cases = {
        "float32": (lambda: ca.attention(q, k, v, num_threads=n), k.nbytes + v.nbytes),
        "float16": (lambda: ca.attention(q, k16, v16, num_threads=n), k16.nbytes + v16.nbytes),
        "int8": (lambda: ca.attention(q, k8, v8, k_scale=ks, v_scale=vs, num_threads=n),
                 k8.nbytes + v8.nbytes + ks.nbytes + vs.nbytes),
    }
    try:
        import torch
        torch.set_num_threads(n)
        kd = torch.from_numpy(k8.astype(np.float32) * ks[..., None])
        vd = torch.from_numpy(v8.astype(np.float32) * vs[..., None])
        tq = torch.from_numpy(q)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        cases["torch SDPA, float32 cache"] = (lambda: sdpa(tq, kd, vd), kd.numel() * 8)
    except ImportError:
        print("torch not installed: no PyTorch row", file=sys.stderr)
    print(f"decode q {(B, H, T, d)} over K/V {(B, H, S, d)}, {n} threads, median of "
          f"{args.rounds} rounds")
    print(f"{'K/V':28} {'ms':>8} {'GB/s read':>10} {'vs float32':>11}")
    base = None
    for name, (fn, n_bytes) in cases.items():
        seconds = median_seconds(fn, args.rounds, 5)
        base = base or seconds
        print(f"{name:28} {seconds * 1e3:8.3f} {n_bytes / seconds / 1e9:10.1f} "
              f"{base / seconds:10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
