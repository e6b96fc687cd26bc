"""Serving layouts: packed variable-length prefill, a paged decode step, and
a continuous-batching generation loop, beside the padded and contiguous
equivalents and PyTorch SDPA on the padded batch (when torch is installed).

    python benchmarks/serving.py [--threads 1 2] [--rounds 7] [--clock wall]
                                 [--only varlen paged loop rotary]

All float32, medians of back-to-back rounds in one process. Nothing is
asserted: the tests check the results, this prints the times. --clock cpu
times the process's CPU time (of all its threads) instead of the wall
clock: steadier on a machine other work shares, where a wall-clock round
also counts the time the process waits for a core.

- varlen: 8 sequences of 50-1000 tokens, H = 32, d = 128, causal:
  attention_varlen, one attention call per sequence (no padding either),
  attention on the batch padded to the longest (with kv_lengths), and torch
  SDPA on the padded batch with a mask. GFLOP/s count the real tokens only.
- paged: one decode step (a new token appended, then attention), B = 16
  sequences of 256-4096 positions, H = 32, H_kv = 8, d = 128, page_size 16:
  attention_with_paged_kvcache, attention_with_kvcache on contiguous
  caches of the same contents, torch SDPA on the padded batch with a mask.
- loop: 32 requests of random prompt (32-1024) and output (16-256)
  lengths, at most 8 at a time, prompts prefilled in chunks of 256 while
  the others decode, one attention_with_paged_kvcache call per step (only
  the attention is timed): tokens (prompt and generated) per second.
- rotary: rotary embeddings on append, H = 32, H_kv = 8, d = 128: a decode
  step (1 new row, 4096 keys; float32 and float16 caches, and float32
  pages of 16) and a 512-token prefill into an empty cache. The call with
  rotary_cos / rotary_sin beside the same call on rows rotated before it
  (what rotary itself costs: the target is at most 1.1x), rotating in
  NumPy first then calling (the pass a caller saves), and torch SDPA after
  a separate rotary step in torch (the cache append included).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import cattention as ca

#: the clock every timing reads (main's --clock)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the peer is optional
    torch = None


def round_robin_medians(cases, rounds):
    """Median seconds of each case. The cattention cases are timed in turn
    each round, so that all see the same drift of the machine; a peer's
    cases (named "torch ...") after them, each in a block of its own, since
    its worker threads keep spinning after each call and would slow the
    call after it."""
    ours = [name for name in cases if not name.startswith("torch")]
    times = {name: [] for name in cases}
    with torch.inference_mode() if torch is not None else _nothing():
        for name in ours:
            cases[name]()
        for _ in range(rounds):
            for name in ours:
                start = clock()
                cases[name]()
                times[name].append(clock() - start)
        for name in cases:
            if name in ours:
                continue
            cases[name]()
            for _ in range(rounds):
                start = clock()
                cases[name]()
                times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def varlen(threads, rounds):
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 1001, 8)
    H, d = 32, 128
    total = int(lengths.sum())
    cu = np.concatenate([[0], np.cumsum(lengths)])
    q, k, v = (rng.standard_normal((total, H, d)).astype(np.float32) for _ in range(3))
    longest = int(lengths.max())
    # the padded batch as attention takes it: keys first with kv_lengths,
    # queries last (causal alignment is bottom-right, so a sequence's queries
    # are the last rows; the padding rows above them see no key)
    padded = np.zeros((3, len(lengths), H, longest, d), np.float32)
    for i, n in enumerate(lengths):
        padded[0, i, :, longest - n:] = np.swapaxes(q[cu[i]:cu[i + 1]], 0, 1)
        for j, x in ((1, k), (2, v)):
            padded[j, i, :, :n] = np.swapaxes(x[cu[i]:cu[i + 1]], 0, 1)
    pq, pk, pv = padded
    kv_lengths = lengths.astype(np.intp)
    real_flops = 4 * H * d * float(np.sum(lengths * (lengths + 1) / 2))
    cases = {
        "attention_varlen": lambda: ca.attention_varlen(q, k, v, cu, cu, causal=True,
                                                        num_threads=threads),
        "attention, one call per sequence": lambda: [
            ca.attention(*(np.swapaxes(x[cu[i]:cu[i + 1]], 0, 1) for x in (q, k, v)),
                         causal=True, num_threads=threads)
            for i in range(len(lengths))],
        "attention, padded + kv_lengths": lambda: ca.attention(
            pq, pk, pv, causal=True, kv_lengths=kv_lengths, num_threads=threads),
    }
    if torch is not None:
        torch.set_num_threads(threads)
        # query row r of sequence i is position r - (longest - n_i)
        rows = np.arange(longest)[None, :, None] - (longest - lengths)[:, None, None]
        keys = np.arange(longest)[None, None, :]
        mask = torch.from_numpy((keys <= rows) & (keys < lengths[:, None, None]))[:, None]
        tq, tk, tv = (torch.from_numpy(x) for x in padded)
        cases["torch SDPA, padded + mask"] = lambda: F.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=mask)
    print(f"\nvarlen prefill: lengths {sorted(lengths.tolist())} ({total} real tokens, "
          f"padded {len(lengths) * longest}), H={H}, d={d}, causal, {threads} thread(s)")
    medians = round_robin_medians(cases, rounds)
    base = None
    for name, t in medians.items():
        base = base or t
        print(f"  {name:34s} {t * 1e3:9.2f} ms  {real_flops / t / 1e9:7.1f} GFLOP/s (real)"
              f"  {t / base:5.2f}x")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def paged(threads, rounds):
    rng = np.random.default_rng(1)
    B, H, H_kv, d, page_size = 16, 32, 8, 128, 16
    lengths = np.sort(rng.integers(256, 4097, B))
    lengths[0], lengths[-1] = 256, 4096
    max_pages = 4096 // page_size + 1
    n_pages = B * max_pages
    table = rng.permutation(n_pages).reshape(B, max_pages)
    k_pages = rng.standard_normal((n_pages, H_kv, page_size, d)).astype(np.float32)
    v_pages = rng.standard_normal((n_pages, H_kv, page_size, d)).astype(np.float32)
    s_max = max_pages * page_size
    # the same contents in contiguous caches (B, H_kv, S_max, d)
    k_cache = np.swapaxes(k_pages[table], 1, 2).reshape(B, H_kv, s_max, d).copy()
    v_cache = np.swapaxes(v_pages[table], 1, 2).reshape(B, H_kv, s_max, d).copy()
    q = rng.standard_normal((B, H, 1, d)).astype(np.float32)
    new = rng.standard_normal((B, H_kv, 1, d)).astype(np.float32)
    start = lengths - 1   # each step appends at the same position again

    def paged_step():
        at = start.copy()
        ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, at, new, new,
                                        num_threads=threads)

    def contiguous_step():
        at = start.copy()
        ca.attention_with_kvcache(q, k_cache, v_cache, at, new, new, num_threads=threads)

    cases = {"attention_with_paged_kvcache": paged_step,
             "attention_with_kvcache (contiguous)": contiguous_step}
    if torch is not None:
        torch.set_num_threads(threads)
        longest = int(lengths.max())
        tq = torch.from_numpy(q)
        tk = torch.from_numpy(k_cache[:, :, :longest])
        tv = torch.from_numpy(v_cache[:, :, :longest])
        mask = torch.from_numpy(np.arange(longest)[None, :] < lengths[:, None])[:, None, None]
        cases["torch SDPA, padded + mask"] = lambda: F.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=mask, enable_gqa=True)
    kv_bytes = 2 * H_kv * d * 4 * float(lengths.sum())
    print(f"\npaged decode step: B={B}, lengths {lengths.min()}-{lengths.max()} "
          f"(sum {lengths.sum()}), H={H}, H_kv={H_kv}, d={d}, page_size {page_size}, "
          f"{threads} thread(s)")
    medians = round_robin_medians(cases, rounds)
    base = None
    for name, t in medians.items():
        base = base or t
        print(f"  {name:36s} {t * 1e3:9.2f} ms  {kv_bytes / t / 1e9:6.1f} GB/s of K/V"
              f"  {t / base:5.2f}x")


def loop(threads, rounds):
    del rounds
    rng = np.random.default_rng(2)
    H, H_kv, d, page_size, chunk, slots = 32, 8, 128, 16, 256, 8
    requests = [(int(rng.integers(32, 1025)), int(rng.integers(16, 257))) for _ in range(32)]
    max_pages = -(-(1024 + 256) // page_size)
    n_pages = slots * max_pages
    k_pages = np.zeros((n_pages, H_kv, page_size, d), np.float32)
    v_pages = np.zeros((n_pages, H_kv, page_size, d), np.float32)
    free = list(range(n_pages))
    table = np.full((slots, max_pages), -1, np.int64)
    lengths = np.zeros(slots, np.int64)
    active = [None] * slots
    waiting = list(requests)
    tokens = steps = 0
    elapsed = 0.0
    while waiting or any(a is not None for a in active):
        for s in range(slots):
            if active[s] is None and waiting:
                prompt, output = waiting.pop(0)
                active[s] = [prompt, prompt + output]
                lengths[s] = 0
        counts = np.zeros(slots, np.int64)
        for s, a in enumerate(active):
            if a is None:
                continue
            at = int(lengths[s])
            counts[s] = min(chunk, a[0] - at) if at < a[0] else 1
            for p in range(-(-at // page_size), -(-(at + counts[s]) // page_size)):
                table[s, p] = free.pop()
        total = int(counts.sum())
        cu = np.concatenate([[0], np.cumsum(counts)])
        q = rng.standard_normal((total, H, d)).astype(np.float32)
        kv = rng.standard_normal((total, H_kv, d)).astype(np.float32)
        start = clock()
        ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, kv, kv,
                                        cu_seqlens_q=cu, num_threads=threads)
        elapsed += clock() - start
        tokens += total
        steps += 1
        for s, a in enumerate(active):
            if a is not None and lengths[s] >= a[1]:
                free.extend(int(p) for p in table[s] if p >= 0)
                table[s] = -1
                lengths[s] = 0
                active[s] = None
    prompt_tokens = sum(p for p, _ in requests)
    print(f"\ncontinuous batching: 32 requests ({prompt_tokens} prompt tokens, "
          f"{tokens - prompt_tokens} generated), <= {slots} at a time, chunks of {chunk}, "
          f"H={H}, H_kv={H_kv}, d={d}, page_size {page_size}, {threads} thread(s)")
    print(f"  {steps} steps, attention {elapsed:.2f} s: {tokens / elapsed:,.0f} tokens/s "
          f"({(tokens - prompt_tokens) / elapsed:,.0f} generated tokens/s; "
          f"{elapsed / steps * 1e3:.2f} ms per step)")


def _rope_tables(n_positions, half):
    angles = np.arange(n_positions)[:, None] * 10000.0 ** (-np.arange(half) / half)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotate_numpy(x, cos, sin, positions):
    """x (B, H, T, d) rotated at positions (T,) in NumPy, the half split
    (cattention's documented formula, in float32)."""
    half = cos.shape[1]
    c, s = cos[positions], sin[positions]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], axis=-1)


def _rotate_torch(x, cos, sin):
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], dim=-1)


def rotary(threads, rounds):
    rng = np.random.default_rng(3)
    H, H_kv, d, page_size = 32, 8, 128, 16
    n_positions = 8192
    cos, sin = _rope_tables(n_positions, d // 2)
    steps = [("decode, 4096 keys, float32 cache", 4095, 1, np.float32, False),
             ("decode, 4096 keys, float16 cache", 4095, 1, np.float16, False),
             ("decode, 4096 keys, float32 pages", 4095, 1, np.float32, True),
             ("prefill, 512 tokens, float32 cache", 0, 512, np.float32, False)]
    for title, start, T, cache_dtype, paged in steps:
        S_max = 4096 + 64
        k_cache = rng.standard_normal((1, H_kv, S_max, d)).astype(cache_dtype)
        v_cache = rng.standard_normal((1, H_kv, S_max, d)).astype(cache_dtype)
        q = rng.standard_normal((1, H, T, d)).astype(np.float32)
        k_new = rng.standard_normal((1, H_kv, T, d)).astype(np.float32)
        v_new = rng.standard_normal((1, H_kv, T, d)).astype(np.float32)
        positions = start + np.arange(T)
        q_rot, k_rot = (_rotate_numpy(x, cos, sin, positions) for x in (q, k_new))
        lengths = np.array([start])
        if paged:
            n_pages = S_max // page_size
            table = rng.permutation(n_pages)[None]
            # the same contents in shuffled pages
            k_store = np.empty((n_pages, H_kv, page_size, d), cache_dtype)
            v_store = np.empty_like(k_store)
            k_store[table[0]] = k_cache[0].reshape(H_kv, n_pages, page_size, d).swapaxes(0, 1)
            v_store[table[0]] = v_cache[0].reshape(H_kv, n_pages, page_size, d).swapaxes(0, 1)

            def call(q_, k_, **rope):
                ca.attention_with_paged_kvcache(q_, k_store, v_store, table, lengths.copy(),
                                                k_, v_new, num_threads=threads, **rope)
        else:
            def call(q_, k_, **rope):
                ca.attention_with_kvcache(q_, k_cache, v_cache, lengths.copy(), k_, v_new,
                                          num_threads=threads, **rope)

        cases = {
            "with rotary_cos, rotary_sin": lambda: call(q, k_new, rotary_cos=cos,
                                                        rotary_sin=sin),
            "without (rows rotated before)": lambda: call(q_rot, k_rot),
            "NumPy rotation, then the call": lambda: call(
                *(_rotate_numpy(x, cos, sin, positions) for x in (q, k_new))),
        }
        if torch is not None and not paged:
            torch.set_num_threads(threads)
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k_new, v_new))
            tk_cache = torch.from_numpy(k_cache.astype(np.float32))
            tv_cache = torch.from_numpy(v_cache.astype(np.float32))
            tcos = torch.from_numpy(cos[positions])
            tsin = torch.from_numpy(sin[positions])
            end = start + T

            def torch_step():
                tk_cache[:, :, start:end] = _rotate_torch(tk, tcos, tsin)
                tv_cache[:, :, start:end] = tv
                return F.scaled_dot_product_attention(
                    _rotate_torch(tq, tcos, tsin), tk_cache[:, :, :end], tv_cache[:, :, :end],
                    is_causal=T > 1, enable_gqa=True)
            cases["torch rotary, then SDPA"] = torch_step
        print(f"\nrotary on append, {title}: H={H}, H_kv={H_kv}, d={d}, rotary_dim {d}, "
              f"{threads} thread(s)")
        medians = round_robin_medians(cases, rounds)
        base = medians["without (rows rotated before)"]
        for name, t in medians.items():
            print(f"  {name:34s} {t * 1e3:9.3f} ms  {t / base:5.3f}x the call without")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--only", nargs="+", default=["varlen", "paged", "loop", "rotary"],
                        choices=["varlen", "paged", "loop", "rotary"])
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    for threads in args.threads:
        for name in args.only:
            {"varlen": varlen, "paged": paged, "loop": loop,
             "rotary": rotary}[name](threads, args.rounds)


if __name__ == "__main__":
    main()
