"""Command line: ``python -m cattention [demo] | --version``.

``demo`` (the default) computes attention on a built-in workload, checks it
against a float64 NumPy reference and prints timings beside NumPy.
``demo --plot PATH`` instead runs attention over a built-in sentence, prints
which token each token attends to most and writes a heatmap of the weights
(needs matplotlib).
The benchmarks beside the peers live outside the package, in
``benchmarks/`` of the source tree (``make bench``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import __version__, attention, get_num_threads, plot_scores, show_config
from ._api.plot import load_demo_sentence


def _numpy_attention(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], causal: bool,
                     scale: float) -> NDArray[Any]:
    """Plain NumPy attention in the inputs' dtype (materialises T x S)."""
    logits = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    n_queries, n_keys = logits.shape[-2:]
    if causal:
        visible = np.arange(n_keys)[None, :] <= np.arange(n_queries)[:, None] + (n_keys - n_queries)
        logits = np.where(visible, logits, -np.inf)
    logits = logits - logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)
    weights /= weights.sum(axis=-1, keepdims=True)
    result: NDArray[Any] = weights @ v
    return result


#: Seconds the demo waits before timing cattention after NumPy's matmuls:
#: NumPy's OpenBLAS workers keep spinning on a core for about 0.1 s after
#: each call, and a 2-thread call timed among them ran at its one-thread
#: speed (the user guide's "Inside NumPy pipelines").
BLAS_SETTLE_SECONDS = 0.25


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def demo(batch: int, heads: int, n_queries: int, n_keys: int, dim: int, repeats: int) -> int:
    show_config()
    print()
    rng = np.random.default_rng(0)
    shape_q = (batch, heads, n_queries, dim)
    shape_kv = (batch, heads, n_keys, dim)
    threads = get_num_threads()
    print(f"workload: q {shape_q}, k/v {shape_kv}, median of {repeats} runs, "
          f"{threads} thread{'s' if threads != 1 else ''}")
    header = (f"{'dtype':8} {'causal':6} {'cattention ms':>14} {'NumPy ms':>10} "
              f"{'speedup':>8} {'GFLOP/s':>8} {'max err vs f64':>15}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for dtype in (np.float32, np.float64):
        q = rng.standard_normal(shape_q).astype(dtype)
        k = rng.standard_normal(shape_kv).astype(dtype)
        v = rng.standard_normal(shape_kv).astype(dtype)
        scale = 1.0 / np.sqrt(dim)
        for causal in (False, True):
            if threads > 1:
                # cattention's own speed, not that of its threads beside
                # the spinning BLAS workers of the NumPy calls just before
                time.sleep(BLAS_SETTLE_SECONDS)
            t_ours = _median_seconds(lambda: attention(q, k, v, causal=causal), repeats)
            ours = attention(q, k, v, causal=causal)
            t_numpy = _median_seconds(lambda: _numpy_attention(q, k, v, causal, scale), repeats)
            reference = _numpy_attention(q.astype(np.float64), k.astype(np.float64),
                                         v.astype(np.float64), causal, scale)
            error = float(np.max(np.abs(ours - reference)))
            flops = 4.0 * batch * heads * n_queries * n_keys * dim * (0.5 if causal else 1.0)
            print(f"{np.dtype(dtype).name:8} {str(causal):6} {t_ours * 1e3:14.2f} "
                  f"{t_numpy * 1e3:10.2f} {t_numpy / t_ours:7.2f}x "
                  f"{flops / t_ours / 1e9:8.1f} {error:15.2e}")
            limit = 1e-5 if dtype == np.float32 else 1e-12
            worst = max(worst, error / limit)
    ok = worst <= 1.0
    if threads > 1:
        print(f"(cattention timed after a {BLAS_SETTLE_SECONDS} s pause: NumPy's BLAS "
              "threads hold a core for about 0.1 s after each call; see the user guide, "
              "Inside NumPy pipelines)")
    print()
    print("check against float64 reference:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def sentence_demo(path: str, causal: bool) -> int:
    """Attention over the built-in sentence: print each token's strongest
    key and write the heatmap to ``path``. Returns the exit status."""
    sentence = load_demo_sentence()
    tokens = sentence.tokens
    _, scores = attention(sentence.q, sentence.k, sentence.v, causal=causal,
                          return_scores=True)
    # Drawn and saved before anything is printed, so an error (no matplotlib,
    # an unwritable path) is the only output instead of trailing a table.
    try:
        ax = plot_scores(scores, query_labels=tokens, key_labels=tokens)
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ax.set_title(f"attention weights ({'causal' if causal else 'not causal'})")
    try:
        ax.figure.savefig(path, dpi=150)
    except (OSError, ValueError) as exc:
        print(f"error: could not write {path}: {exc}", file=sys.stderr)
        return 1
    seen = ("each token sees itself and the tokens before it" if causal
            else "each token sees the whole sentence")
    print(f"sentence: {' '.join(tokens)}")
    print(f"causal={causal}: {seen}; one head, d = {sentence.q.shape[-1]}, float32")
    print()
    width = max(len(token) for token in tokens) + 6
    header = f"{'query':{width}}{'attends most to':{width + 4}}{'weight':>6}"
    print(header)
    print("-" * len(header))
    for token, row in zip(tokens, scores):
        top = int(np.argmax(row))
        print(f"{token:{width}}{f'{tokens[top]} (key {top})':{width + 4}}{row[top]:6.2f}")
    print()
    print(f"heatmap written to {path}")
    return 0


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (sizes and counts of the demo)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cattention",
        description="cattention: fast, exact scaled dot-product attention for the CPU")
    parser.add_argument("--version", action="version", version=f"cattention {__version__}")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("demo",
                         help="attention on a default workload, checked and timed (default)")
    run.add_argument("--batch", type=_positive_int, default=1)
    run.add_argument("--heads", type=_positive_int, default=8)
    run.add_argument("--queries", type=_positive_int, default=1024)
    run.add_argument("--keys", type=_positive_int, default=1024)
    run.add_argument("--dim", type=_positive_int, default=64)
    run.add_argument("--repeats", type=_positive_int, default=5)
    run.add_argument("--plot", metavar="PATH",
                     help="instead of the timing demo: attention over a built-in sentence, "
                          "a heatmap of the weights written to PATH (PNG, or .svg/.pdf; "
                          "needs matplotlib)")
    run.add_argument("--causal", action="store_true",
                     help="with --plot: each token sees only itself and earlier tokens")
    args = parser.parse_args(argv)
    if args.command is None:
        args = run.parse_args([], namespace=args)
    if args.plot is not None:
        if not args.plot:
            run.error("--plot needs a file path, e.g. --plot attention.png")
        # a path without a suffix gets the PNG that matplotlib writes, and is
        # reported as the file it is
        return sentence_demo(args.plot if os.path.splitext(args.plot)[1]
                             else args.plot + ".png", args.causal)
    if args.causal:
        run.error("--causal applies to --plot (the timing demo runs both variants)")
    # the largest array of the demo: the NumPy reference's float64 weights
    largest = 8 * args.batch * args.heads * args.queries * max(args.keys, args.dim)
    if largest > sys.maxsize:
        run.error(f"this workload does not fit in memory: its largest array would take "
                  f"{largest} bytes")
    try:
        return demo(args.batch, args.heads, args.queries, args.keys, args.dim, args.repeats)
    except MemoryError as exc:
        run.error(f"this workload does not fit in memory: {exc}")


if __name__ == "__main__":
    sys.exit(main())
