"""Threading: results are bitwise independent of the thread count; config API."""

import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import cattention as ca
from reference import assert_bitwise_equal, make_qkv

# Large enough for several row blocks (and several key blocks) per batch entry.
T, S, D_K, D_V = 300, 517, 64, 40


def _run(q, k, v, **kw):
    attn, scores = ca.attention(q, k, v, return_scores=True, **kw)
    attn_only = ca.attention(q, k, v, **kw)
    scores_only = ca.attention_scores(q, k, **kw)
    return attn, scores, attn_only, scores_only


def _assert_all_bitwise(results_a, results_b):
    for a, b in zip(results_a, results_b):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(T, S), (S, T)], ids=["T<S", "T>S"])
def test_num_threads_keyword_bitwise(dtype, shape, causal):
    t, s = shape
    q, k, v = make_qkv(1, (t, D_K), (s, D_K), (s, D_V), dtype)
    one = _run(q, k, v, causal=causal, num_threads=1)
    for n in (2, 3, 7):  # 7 > cores and does not divide the row blocks evenly
        _assert_all_bitwise(_run(q, k, v, causal=causal, num_threads=n), one)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_num_threads_bitwise_batched_with_mask(dtype, causal):
    q, k, v = make_qkv(2, (3, 2, 150, 32), (1, 2, 211, 32), (3, 1, 211, 24), dtype)
    rng = np.random.default_rng(3)
    mask = rng.standard_normal((2, 150, 211)).astype(dtype)
    mask[rng.random(mask.shape) < 0.3] = -np.inf
    mask[:, 10] = -np.inf  # a fully masked row
    one = _run(q, k, v, mask=mask, causal=causal, num_threads=1)
    two = _run(q, k, v, mask=mask, causal=causal, num_threads=2)
    _assert_all_bitwise(two, one)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_set_num_threads_bitwise(dtype, causal):
    q, k, v = make_qkv(4, (2, T, D_K), (2, S, D_K), (2, S, D_V), dtype)
    ca.set_num_threads(1)
    one = _run(q, k, v, causal=causal)
    ca.set_num_threads(2)
    two = _run(q, k, v, causal=causal)
    _assert_all_bitwise(two, one)
    # and the keyword agrees with the global setting
    _assert_all_bitwise(_run(q, k, v, causal=causal, num_threads=1), one)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (3, 3), (8, 1)],
                         ids=["8-heads", "gqa-8/2", "3-heads", "kv-broadcast"])
def test_bitwise_across_the_schedules_of_heads(dtype, heads, causal):
    """One thread packs each K/V head and at once runs the query heads that
    read it (a broadcast K/V head: all of them); two threads do so with 8
    heads of one length (4 each); grouped heads, 3 heads, 3 threads and
    ragged kv_lengths beyond one thread pack every head first and spread
    the query blocks over the threads: the same bits on each."""
    n_heads, n_kv_heads = heads
    q, k, v = make_qkv(5, (n_heads, 200, 48), (n_kv_heads, 300, 48), (n_kv_heads, 300, 40),
                       dtype)
    if n_kv_heads == 1:
        k, v = np.broadcast_to(k, (n_heads, 300, 48)), np.broadcast_to(v, (n_heads, 300, 40))
    gqa = 1 < n_kv_heads < n_heads
    runs = [ca.attention(q, k, v, causal=causal, enable_gqa=gqa, return_lse=True,
                         num_threads=n) for n in (1, 2, 3)]
    kv_lengths = np.array([300, 120, 7] + [300] * (n_heads - 3))[:n_heads]
    ragged = [ca.attention(q, k, v, causal=causal, enable_gqa=gqa, kv_lengths=kv_lengths,
                           num_threads=n) for n in (1, 2, 3)]
    for other in runs[1:]:
        _assert_all_bitwise(other, runs[0])
    for other in ragged[1:]:
        assert_bitwise_equal(other, ragged[0])


def test_single_row_many_threads(dtype):
    q, k, v = make_qkv(5, (1, D_K), (S, D_K), (S, D_V), dtype)
    _assert_all_bitwise(_run(q, k, v, num_threads=4), _run(q, k, v, num_threads=1))


# ---------------------------------------------------------------------------
# get/set_num_threads
# ---------------------------------------------------------------------------

def test_get_num_threads_default():
    n = ca.get_num_threads()
    assert isinstance(n, int) and not isinstance(n, bool)
    assert n >= 1


@pytest.mark.parametrize("n", [1, 2, 3])
def test_set_get_roundtrip(n):
    ca.set_num_threads(n)
    assert ca.get_num_threads() == n


def test_set_num_threads_none_restores_default():
    default = ca.get_num_threads()  # the autouse fixture restored the default
    ca.set_num_threads(1 if default != 1 else 2)
    assert ca.get_num_threads() != default
    ca.set_num_threads(None)
    assert ca.get_num_threads() == default


def test_num_threads_keyword_does_not_change_global():
    ca.set_num_threads(2)
    q, k, v = make_qkv(6, (5, 4), (6, 4), (6, 3))
    ca.attention(q, k, v, num_threads=1)
    ca.attention_scores(q, k, num_threads=1)
    assert ca.get_num_threads() == 2


BAD_NUM_THREADS = [
    (0, ValueError),
    (-1, ValueError),
    (-8, ValueError),
    (2.5, (ValueError, TypeError)),
    ("x", (ValueError, TypeError)),
]


@pytest.mark.parametrize("value,exc", BAD_NUM_THREADS,
                         ids=[repr(v) for v, _ in BAD_NUM_THREADS])
def test_bad_num_threads_keyword(value, exc):
    q, k, v = make_qkv(7, (5, 4), (6, 4), (6, 3))
    with pytest.raises(exc, match=r"(?i)thread"):
        ca.attention(q, k, v, num_threads=value)
    with pytest.raises(exc, match=r"(?i)thread"):
        ca.attention_scores(q, k, num_threads=value)


@pytest.mark.parametrize("value,exc", BAD_NUM_THREADS,
                         ids=[repr(v) for v, _ in BAD_NUM_THREADS])
def test_bad_set_num_threads(value, exc):
    before = ca.get_num_threads()
    with pytest.raises(exc, match=r"(?i)thread"):
        ca.set_num_threads(value)
    assert ca.get_num_threads() == before


def test_numpy_integer_num_threads_accepted():
    q, k, v = make_qkv(8, (5, 4), (6, 4), (6, 3))
    assert_bitwise_equal(ca.attention(q, k, v, num_threads=np.int64(2)),
                         ca.attention(q, k, v, num_threads=1))
    ca.set_num_threads(np.int32(1))
    assert ca.get_num_threads() == 1


# ---------------------------------------------------------------------------
# show_config / __version__
# ---------------------------------------------------------------------------

def test_version_string():
    assert isinstance(ca.__version__, str) and ca.__version__


def test_show_config(capsys):
    ca.show_config()
    out = capsys.readouterr().out
    assert ca.__version__ in out
    assert "OpenMP" in out
    assert "SIMD" in out


def test_show_config_reports_runtime_and_threads(capsys):
    ca.set_num_threads(3)
    ca.show_config()
    out = capsys.readouterr().out
    assert re.search(r"threads: 3\b", out), out
    runtime = re.search(r"runtime: +(.*)", out).group(1).strip()
    if not ca._native.driver.openmp_enabled():
        assert runtime == "none"
        return
    threadpoolctl = pytest.importorskip("threadpoolctl")
    # threadpoolctl finds the OpenMP libraries loaded in the process on its own
    loaded = [os.path.realpath(info["filepath"])
              for info in threadpoolctl.threadpool_info() if info["user_api"] == "openmp"]
    assert os.path.realpath(runtime) in loaded, (runtime, loaded)


def test_show_config_reports_active_simd_level(capsys, simd):
    if simd is None:
        pytest.skip("private SIMD API unavailable (reported by test_private_simd_api)")
    ca.show_config()
    assert simd in capsys.readouterr().out


def test_show_config_says_how_bfloat16_is_computed(capsys, simd):
    """The bfloat16 line names the tile instructions of a table that has
    them and says the others convert; ml_dtypes is not imported by it."""
    if simd is None:
        pytest.skip("private SIMD API unavailable (reported by test_private_simd_api)")
    imported = "ml_dtypes" in sys.modules
    ca.show_config()
    line = re.search(r"bfloat16: +(.*)", capsys.readouterr().out).group(1)
    expected = {"amx": "TDPBF16PS", "avx512bf16": "VDPBF16PS"}.get(simd, "converted to float32")
    assert expected in line, (simd, line)
    assert ("ml_dtypes" in sys.modules) == imported


def test_omp_num_threads_is_honoured():
    """num_threads=None follows OpenMP's setting, read at call time."""
    if not ca._native.driver.openmp_enabled():
        pytest.skip("serial build")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", "import cattention as ca; print(ca.get_num_threads())"],
        env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_threadpoolctl_openmp_limit_is_honoured():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not ca._native.driver.openmp_enabled():
        pytest.skip("serial build")
    # the module must be loaded for threadpoolctl to find its OpenMP runtime
    ca.attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)))
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert ca.get_num_threads() == 1
    with threadpoolctl.threadpool_limits(2, user_api="openmp"):
        assert ca.get_num_threads() == 2


def _long_calls(q, k, v):
    """A long call of each entry point on float64 inputs (H, n, d)."""
    H, n, d = q.shape
    packed = [np.ascontiguousarray(np.swapaxes(x, 0, 1)) for x in (q, k, v)]   # (n, H, d)
    cu = np.array([0, 2 * n // 5, n])
    page_size = 16
    n_pages = n // page_size
    pages = [np.ascontiguousarray(x.reshape(H, n_pages, page_size, d).swapaxes(0, 1))
             for x in (k, v)]                                # (pages, H, 16, d)
    table = np.arange(n_pages).reshape(1, n_pages)
    return {
        "attention": lambda: ca.attention(q, k, v, num_threads=1),
        "attention_varlen": lambda: ca.attention_varlen(*packed, cu, cu, num_threads=1),
        "attention_with_paged_kvcache": lambda: ca.attention_with_paged_kvcache(
            q[None], pages[0], pages[1], table, np.array([n]), causal=False,
            num_threads=1),
    }


@pytest.mark.parametrize("entry", ["attention", "attention_varlen",
                                   "attention_with_paged_kvcache"])
def test_gil_is_released_during_the_computation(entry):
    """Another Python thread keeps running while a long call is in C.

    The main thread counts loop iterations while the worker is inside the
    call. Were the GIL held, the main thread could run only within about one
    switch interval around the call's start, a small fraction of a call that
    lasts many intervals; released, it runs for most of the call."""
    rng = np.random.default_rng(5)
    # 2048 positions: with 1024 the varlen call took 19 ms on an AVX-512
    # core, under the 20 switch intervals the test needs to tell
    q = rng.standard_normal((8, 2048, 64))
    k = rng.standard_normal((8, 2048, 64))
    v = rng.standard_normal((8, 2048, 64))
    in_call = threading.Event()
    done = threading.Event()
    span = {}

    call = _long_calls(q, k, v)[entry]

    def work():
        in_call.set()
        start = time.perf_counter()
        call()
        span["seconds"] = time.perf_counter() - start
        done.set()

    previous_switch = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        in_call.wait()
        ticks = 0
        loop_start = time.perf_counter()
        while not done.is_set():
            ticks += 1
        loop_seconds = time.perf_counter() - loop_start
        worker.join()
        switch = sys.getswitchinterval()
        rate = _loop_rate(done)
    finally:
        sys.setswitchinterval(previous_switch)
    assert span["seconds"] > 20 * switch, "call too short to tell"
    # Held, the GIL would let the loop run for about one switch interval
    # (a few percent of a call of 20 or more); released, the loop keeps most of its own pace
    # for the whole call (a quarter leaves room for a loaded machine).
    assert ticks / rate > 0.25 * min(span["seconds"], loop_seconds)


def _loop_rate(event, seconds=0.05):
    """Iterations per second of the same loop with no other thread running."""
    ticks = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            ticks += 1
            if not event.is_set():
                break
    return ticks / (time.perf_counter() - start)


# ---------------------------------------------------------------------------
# limit_threads: a thread count per calling Python thread
# ---------------------------------------------------------------------------

def test_limit_threads_is_local_to_the_calling_thread():
    ca.set_num_threads(2)
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def other():
        inside.wait()
        seen["other"] = ca.get_num_threads()
        release.set()

    worker = threading.Thread(target=other)
    worker.start()
    with ca.limit_threads(1):
        assert ca.get_num_threads() == 1
        inside.set()
        release.wait(10)
        with ca.limit_threads(3):
            assert ca.get_num_threads() == 3
        assert ca.get_num_threads() == 1
        with ca.limit_threads(None):
            assert ca.get_num_threads() == 2
    worker.join()
    assert seen["other"] == 2
    assert ca.get_num_threads() == 2


def test_set_num_threads_inside_limit_threads():
    """A thread's own limit shadows set_num_threads() while it lasts; with
    none of its own (limit_threads(None), or after the block) the newest
    process-wide count applies."""
    ca.set_num_threads(None)
    default = ca.get_num_threads()
    ca.set_num_threads(2)
    try:
        with ca.limit_threads(1):
            ca.set_num_threads(3)
            assert ca.get_num_threads() == 1
            with ca.limit_threads(None):
                assert ca.get_num_threads() == 3
                ca.set_num_threads(4)
                assert ca.get_num_threads() == 4
            assert ca.get_num_threads() == 1
        assert ca.get_num_threads() == 4
        ca.set_num_threads(None)
        with ca.limit_threads(2):
            assert ca.get_num_threads() == 2
        assert ca.get_num_threads() == default
    finally:
        ca.set_num_threads(None)


def test_limit_threads_restores_after_an_error():
    before = ca.get_num_threads()
    with pytest.raises(RuntimeError):
        with ca.limit_threads(1):
            raise RuntimeError("in the block")
    assert ca.get_num_threads() == before


@pytest.mark.parametrize("value,exc", [(0, ValueError), (-1, ValueError),
                                       (True, ValueError), ("2", ValueError)])
def test_limit_threads_refuses_bad_counts(value, exc):
    # named as the parameter is
    with pytest.raises(exc, match="^n must be a positive integer thread count"):
        with ca.limit_threads(value):
            pass


def test_limit_threads_results_are_bitwise_the_same(dtype):
    q, k, v = make_qkv(77, (4, T, D_K), (4, S, D_K), (4, S, D_V), dtype)
    expected = ca.attention(q, k, v, causal=True, num_threads=2)
    with ca.limit_threads(1):
        assert_bitwise_equal(ca.attention(q, k, v, causal=True), expected)
        # a call's own num_threads still wins
        assert_bitwise_equal(ca.attention(q, k, v, causal=True, num_threads=2), expected)


def test_limit_threads_in_a_thread_pool_gives_the_serial_results():
    from concurrent.futures import ThreadPoolExecutor
    inputs = [make_qkv(80 + i, (2, 40, 16), (2, 70, 16), (2, 70, 8), np.float32)
              for i in range(8)]
    expected = [ca.attention(*qkv, causal=True) for qkv in inputs]
    limits = []

    def task(qkv):
        with ca.limit_threads(1):
            limits.append(ca.get_num_threads())
            return ca.attention(*qkv, causal=True)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(task, inputs * 5))
    assert limits == [1] * 40
    for got, want in zip(results, expected * 5):
        assert_bitwise_equal(got, want)


# ---------------------------------------------------------------------------
# How idle OpenMP threads wait (cattention/_runtime.py)
# ---------------------------------------------------------------------------

def _import_in_child(env, code="ca.show_config()"):
    script = ("import os, cattention as ca; "
              "print('spincount-left:', os.environ.get('GOMP_SPINCOUNT')); " + code)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True).stdout


def test_short_spin_is_set_for_the_import_only():
    if not ca._native.driver.openmp_enabled():
        pytest.skip("serial build")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = _import_in_child(env)
    # the environment is as it was after the import: children and other runtimes see it
    assert "spincount-left: None" in out
    if "libgomp" in ca._native.driver.openmp_runtime():
        assert re.search(r"waiting: +GOMP_SPINCOUNT=1000, then sleep \(set by cattention\)",
                         out), out


@pytest.mark.parametrize("setting", ["OMP_WAIT_POLICY=active", "GOMP_SPINCOUNT=5"])
def test_a_user_wait_policy_is_kept(setting):
    if not ca._native.driver.openmp_enabled():
        pytest.skip("serial build")
    name, value = setting.split("=")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env[name] = value
    out = _import_in_child(env)
    assert re.search(rf"waiting: +{re.escape(setting)} \(from the environment\)", out), out
    if name == "GOMP_SPINCOUNT":
        assert "spincount-left: 5" in out


def test_forked_child_reports_the_one_thread_it_uses():
    if not ca._native.driver.openmp_enabled():
        pytest.skip("serial build")
    code = """
import os, sys, io, contextlib
import numpy as np, cattention as ca
x = np.ones((8, 512, 64), np.float32)
ca.attention(x, x, x, num_threads=2)           # a parallel region in the parent (large
                                               # enough to use both threads at once)
ca.set_num_threads(2)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ca.show_config()
    os.write(w, f"{ca.get_num_threads()}|{buf.getvalue()}".encode())
    os._exit(0)
os.close(w)
data = os.read(r, 65536).decode()
os.waitpid(pid, 0)
print(ca.get_num_threads(), data)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    parent, child = out.split(" ", 1)
    assert parent == "2"
    child_threads, config = child.split("|", 1)
    assert child_threads == "1"
    assert re.search(r"threads: 1 \(a child forked after a parallel region", config), config


def test_a_team_never_outgrows_the_cpus():
    """num_threads above the CPUs this process may run on starts no more
    threads than there are CPUs (thousands of threads can exhaust the
    address space, and the OpenMP runtime aborts the process then)."""
    if not ca._native.driver.openmp_enabled():
        pytest.skip("serial build")
    code = """
import os, numpy as np, cattention as ca
def threads():
    return int(next(l for l in open("/proc/self/status") if l.startswith("Threads:")).split()[1])
x = np.ones((1, 64, 512, 64), np.float32)
before = threads()
expected = ca.attention(x, x, x, num_threads=1)
out = ca.attention(x, x, x, num_threads=64)
assert np.array_equal(out, expected)
print(threads() - before, len(os.sched_getaffinity(0)))
"""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    started, n_cpus = map(int, out.split())
    # the workers of one team: the calling thread is one of its members
    assert started <= n_cpus - 1, (started, n_cpus)


# ---------------------------------------------------------------------------
# Team size between other libraries' calls (src/team.h)
# ---------------------------------------------------------------------------

def test_small_calls_after_a_pause_run_on_one_thread_and_large_ones_in_parallel():
    team_size = ca._native.driver.team_size
    x = np.ones((2, 8, 8), np.float32)
    # a call given 2 threads, whatever the default (OMP_NUM_THREADS=1 makes
    # it 1, and a call of one thread leaves the team's clock alone)
    ca.attention(x, x, x, num_threads=2)
    # back to back with a call: the workers are still awake
    assert team_size(2, 1e3) == 2
    time.sleep(0.01)
    # after a pause (another library's call): one thread, unless the work is large
    assert team_size(2, 1e3) == 1
    assert team_size(2, 1e5) == 1
    assert team_size(2, 1e7) == 2
    assert team_size(1, 1e7) == 1


def test_calls_after_a_pause_give_the_same_bits(dtype):
    q, k, v = make_qkv(90, (8, 1, 64), (8, 1024, 64), (8, 1024, 64), dtype)
    expected = ca.attention(q, k, v, num_threads=1)
    for _ in range(3):
        time.sleep(0.005)
        assert_bitwise_equal(ca.attention(q, k, v, num_threads=2), expected)
        assert_bitwise_equal(ca.attention(q, k, v, num_threads=2), expected)
