"""Concurrency, fork, memory growth and very large problems."""

import multiprocessing
import os
import sys
import threading
import time

import numpy as np
import pytest

import cattention as ca
from reference import make_qkv


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return None


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc for memory figures")

CONCURRENT_CASES = [
    ((2, 3, 5, 16), (2, 3, 40, 16), (2, 3, 40, 8), np.float32, False),
    ((1, 4, 1, 64), (1, 4, 700, 64), (1, 4, 700, 64), np.float32, False),
    ((3, 100, 32), (3, 130, 32), (3, 130, 16), np.float64, True),
    ((17, 9), (23, 9), (23, 4), np.float64, False),
    ((2, 200, 16), (2, 300, 16), (2, 300, 16), np.float32, True),
]


def run_concurrent_calls(n_threads=16, n_calls=200):
    """n_threads Python threads x n_calls mixed calls, started together, each
    result compared bitwise with one computed beforehand: (mismatches,
    exceptions, threads still running after the time limit)."""
    inputs = [make_qkv(200 + i, *shapes[:3], shapes[3]) + (shapes[4],)
              for i, shapes in enumerate(CONCURRENT_CASES)]
    expected = [ca.attention(q, k, v, causal=causal).tobytes() for q, k, v, causal in inputs]
    barrier = threading.Barrier(n_threads)
    counts = {"mismatches": 0, "exceptions": 0}
    lock = threading.Lock()

    def worker(index):
        barrier.wait()
        for call in range(n_calls):
            case = (index + call) % len(inputs)
            q, k, v, causal = inputs[case]
            try:
                got = ca.attention(q, k, v, causal=causal, num_threads=1 + call % 2)
                key = "mismatches" if got.tobytes() != expected[case] else None
            except Exception:
                key = "exceptions"
            if key is not None:
                with lock:
                    counts[key] += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(n_threads)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return counts["mismatches"], counts["exceptions"], sum(t.is_alive() for t in threads)


def test_many_python_threads_at_once():
    """16 threads x 200 calls, mixed shapes and dtypes, started together:
    every result bitwise equal to one computed beforehand, no exception, no
    hang."""
    assert run_concurrent_calls(16, 200) == (0, 0, 0)


def _child_attention(queue, threads):
    q, k, v = make_qkv(210, (2, 300, 32), (2, 400, 32), (2, 400, 32), np.float32)
    queue.put(ca.attention(q, k, v, causal=True, num_threads=threads).tobytes())


@pytest.mark.parametrize("threads", [1, 2])
def test_call_in_a_forked_child(threads):
    """After the parent has run parallel regions, a forked child computes the
    same result and does not hang: GNU OpenMP cannot start threads there, so
    cattention runs on one thread in such a child (documented)."""
    q, k, v = make_qkv(210, (2, 300, 32), (2, 400, 32), (2, 400, 32), np.float32)
    expected = ca.attention(q, k, v, causal=True, num_threads=2).tobytes()
    # a call large enough to run a parallel region even when it is not
    # back to back with another (cattention/_runtime.py, src/team.h)
    big = np.ones((8, 512, 64), np.float32)
    ca.attention(big, big, big, num_threads=2)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_attention, args=(queue, threads), daemon=True)
    child.start()
    try:
        # read before joining: the child cannot exit until its result is read
        got = queue.get(timeout=60)
    except Exception:
        child.kill()
        pytest.fail("the child hung or failed")
    child.join(10)
    assert child.exitcode == 0
    assert got == expected


def rss_growth_kib(n_calls=20000):
    """{"success" | "error": resident-set growth in KiB over n_calls calls,
    after 2,000 calls of warm-up}."""
    q, k, v = make_qkv(220, (2, 8, 16), (2, 24, 16), (2, 24, 8), np.float32)
    bad_k = np.ones((2, 24, 15), np.float32)

    def success():
        ca.attention(q, k, v, causal=True, return_scores=True)

    def failure():
        try:
            ca.attention(q, bad_k, v)
        except ValueError:
            pass

    growth = {}
    for name, run in (("success", success), ("error", failure)):
        for _ in range(2000):
            run()
        before = _rss_kib()
        for _ in range(n_calls):
            run()
        growth[name] = _rss_kib() - before
    return growth


@pytest.mark.skipif(os.environ.get("CATTENTION_SANITIZED") == "1",
                    reason="AddressSanitizer quarantines freed memory, so RSS grows")
def test_resident_memory_does_not_grow():
    """20,000 calls after warm-up, on the success and the error path: the
    resident set grows by less than 1 MiB."""
    for path, grown in rss_growth_kib(20000).items():
        assert grown < 1024, f"{path} path: RSS grew by {grown} KiB"


def test_scores_too_large_raise_memory_error_before_allocating():
    q = np.ones((1 << 20, 4), np.float32)
    with pytest.raises(MemoryError):
        ca.attention_scores(q, q)


def test_more_than_2_to_the_32_pairs_without_scores():
    """T = S = 70,000 causal (T * S > 2^32) with q = 0: every visible key has
    the same weight, so row i is the mean of v[0..i] = i / 2 for v[j] = j."""
    n = 70_000
    q = np.zeros((n, 1), np.float32)
    k = np.ones((n, 1), np.float32)
    v = np.arange(n, dtype=np.float32)[:, None]
    out = ca.attention(q, k, v, causal=True)
    expected = np.arange(n, dtype=np.float64) / 2
    np.testing.assert_allclose(out[:, 0], expected, rtol=2e-6, atol=1e-3)
