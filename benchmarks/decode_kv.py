"""Decode and prefill over KV caches of every dtype cattention reads:
float32, float16, bfloat16, int8 (scales per row) and fp8 (E4M3FN, E5M2;
a scale per tensor, as vLLM keeps).

    python benchmarks/decode_kv.py [--threads 1 2] [--rounds 15] [--no-prefill]

Decode cases: one step, q (B, H, 1, 128) over caches (B, H_kv, S, 128),
(1, 32 : 32, 8192) and grouped heads (8 sequences, 32 : 8, 2048): the whole
cache is read every step. Prefill: 1024 new rows over (1, 8, 1024, 128),
causal, q in bfloat16 (a bfloat16 model's prompt over its cache). Every
case of a table runs in one process, round-robin (medians of rounds), so
the ratios compare like with like. GB/s count the bytes of K and V read
(int8: and their scales); "of read loop" is that rate over the machine's
read loop on the same number of threads (each thread reading its share of
a 512 MiB buffer once). PyTorch SDPA on the float32 cache is a row of its
own when torch is installed. Nothing is asserted.
"""

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import cattention as ca
from cattention._native import driver

DECODE_SHAPES = {"(1, 32, 1, 8192, 128)": (1, 32, 32, 8192),
                 "8 x 2048 keys, 32:8 heads": (8, 32, 8, 2048)}
D = 128


def read_loop_rate(n_threads, rounds):
    """GB/s of the read loop on n_threads threads, each over its share of a
    512 MiB buffer (far beyond any cache)."""
    words = np.ones(512 * 2 ** 20 // 8, np.uint64)
    shares = np.array_split(words, n_threads)
    with ThreadPoolExecutor(n_threads) as pool:
        def once():
            list(pool.map(driver.read_loop, shares))
        return words.nbytes / median_seconds([once], rounds, 1)[0] / 1e9


def median_seconds(fns, rounds, calls):
    """Each function's median time per call over rounds, the functions
    taking turns within each round."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls)
    return [statistics.median(samples) for samples in times]


def caches(rng, shape):
    """name -> (k, v, options, bytes read) for every cache dtype, from the
    same unit-normal values."""
    import ml_dtypes
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    out = {"float32": (k, v, {}, k.nbytes * 2)}
    for name, dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
        out[name] = (k.astype(dtype), v.astype(dtype), {}, k.nbytes)
    (k8, ks), (v8, vs) = ca.quantize_kv(k), ca.quantize_kv(v)
    out["int8, row scales"] = (k8, v8, {"k_scale": ks, "v_scale": vs},
                               k8.nbytes * 2 + ks.nbytes * 2)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        (kf, kfs), (vf, vfs) = (ca.quantize_kv_fp8(x, name, "tensor") for x in (k, v))
        out[f"fp8 {name[7:]}, tensor scale"] = (kf, vf, {"k_scale": kfs, "v_scale": vfs},
                                                kf.nbytes * 2)
    return out


def torch_row(q, k, v, group, threads):
    """PyTorch SDPA on the float32 cache, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(tq, tk, tv, enable_gqa=group > 1)


def decode_table(label, shape, threads, rounds, loop_rate):
    batch, n_heads, n_kv_heads, n_keys = shape
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, n_heads, 1, D), dtype=np.float32)
    kv = caches(rng, (batch, n_kv_heads, n_keys, D))
    rows = {name: ((lambda k=k, v=v, o=o: ca.attention(q, k, v, enable_gqa=True,
                                                       num_threads=threads, **o)),
                   n_bytes) for name, (k, v, o, n_bytes) in kv.items()}
    peer = torch_row(q, kv["float32"][0], kv["float32"][1], n_heads // n_kv_heads, threads)
    if peer is not None:
        rows["PyTorch SDPA, float32 cache"] = (peer, kv["float32"][3])
    seconds = dict(zip(rows, median_seconds([fn for fn, _ in rows.values()], rounds, 3)))
    print(f"\ndecode {label}, {threads} thread(s), medians of {rounds} rounds; read loop "
          f"{loop_rate:.1f} GB/s")
    print("| K/V cache | ms | GB/s read | of read loop | vs float32 | vs bfloat16 |")
    print("|---|---|---|---|---|---|")
    for name, (_, n_bytes) in rows.items():
        rate = n_bytes / seconds[name] / 1e9
        print(f"| {name} | {seconds[name] * 1e3:.2f} | {rate:.1f} | {rate / loop_rate:.0%} | "
              f"{seconds['float32'] / seconds[name]:.2f}x | "
              f"{seconds['bfloat16'] / seconds[name]:.2f}x |")


def prefill_table(threads, rounds):
    import ml_dtypes
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 32, 1024, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
    kv = caches(rng, (1, 8, 1024, D))
    names = ["bfloat16", "fp8 e4m3fn, tensor scale", "fp8 e5m2, tensor scale"]
    fns = [(lambda k=kv[n][0], v=kv[n][1], o=kv[n][2]:
            ca.attention(q, k, v, causal=True, enable_gqa=True, num_threads=threads, **o))
           for n in names]
    seconds = dict(zip(names, median_seconds(fns, rounds, 1)))
    print(f"\nprefill: q bfloat16 (1, 32, 1024, 128) over K/V (1, 8, 1024, 128), causal, "
          f"{threads} thread(s), medians of {rounds} rounds")
    print("| K/V cache | ms | vs bfloat16 cache |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} | {seconds[name] * 1e3:.2f} | "
              f"{seconds['bfloat16'] / seconds[name]:.2f}x |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-prefill", action="store_true")
    args = parser.parse_args(argv)
    print(f"cattention {ca.__version__}, kernel table {driver.get_simd()}")
    for threads in args.threads:
        loop_rate = read_loop_rate(threads, args.rounds)
        for label, shape in DECODE_SHAPES.items():
            decode_table(label, shape, threads, args.rounds, loop_rate)
        if not args.no_prefill:
            prefill_table(threads, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
