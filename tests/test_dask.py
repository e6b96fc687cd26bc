"""cattention.dask: attention over Dask arrays on a real distributed cluster
(2 worker processes of 1 thread on loopback), the threaded and the
synchronous schedulers. Random chunkings of every axis against the float64
reference and against ca.attention on the whole arrays; bitwise the same
result for a chunking whatever runs it; the tasks that are no task; the
threads a task takes; refusals when the graph is built; a worker killed
mid-computation."""

import logging
import os
import signal
import time

import numpy as np
import pytest

dask = pytest.importorskip(
    "dask", reason="cattention.dask needs dask[array] and distributed (the 'dask' extra)")
da = pytest.importorskip("dask.array", reason="cattention.dask needs dask[array]")
distributed = pytest.importorskip(
    "distributed", reason="the cluster tests need distributed (the 'dask' extra)")

import cattention as ca                                     # noqa: E402
import cattention.dask as cad                               # noqa: E402
from cattention.dask import _tasks                          # noqa: E402
from reference import (assert_bitwise_equal, assert_matches_reference,  # noqa: E402
                       make_qkv)


@pytest.fixture(scope="module")
def client():
    """A LocalCluster of 2 worker processes with 1 thread each on loopback,
    for the module; shut down at its end."""
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
        dashboard_address=":0", silence_logs=logging.ERROR)
    with distributed.Client(cluster) as client:
        # the workers import the cattention under test
        assert set(client.run(lambda: ca.__file__).values()) == {ca.__file__}
        yield client
    cluster.close()


def _compute(arrays, scheduler, client=None):
    if scheduler == "distributed":
        return client.compute(arrays, sync=True)
    return dask.compute(*arrays, scheduler=scheduler)


def _random_chunks(rng, size, most=4):
    """Random chunk sizes summing to size (at most `most` chunks)."""
    if size <= 1:
        return (size,)
    n = int(rng.integers(1, min(most, size) + 1))
    cuts = np.sort(rng.choice(np.arange(1, size), size=n - 1, replace=False))
    return tuple(np.diff([0, *cuts, size]).tolist())


def _grouped(k, v, n_heads):
    group = n_heads // k.shape[-3]
    return np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)


# (q shape, K/V heads, S, options)
CASES = {
    "causal-T<S": ((2, 3, 45, 16), 3, 70, dict(causal=True)),
    "causal-T>S": ((2, 2, 70, 16), 2, 40, dict(causal=True)),
    "window": ((1, 2, 60, 16), 2, 60, dict(window=(9, 4))),
    "gqa-causal": ((2, 6, 40, 16), 2, 50, dict(causal=True, enable_gqa=True)),
    "alibi": ((2, 2, 33, 8), 2, 47, dict(causal=True, alibi_slopes=np.array([0.25, 0.05]))),
    "sinks-softcap": ((2, 2, 30, 8), 2, 55, dict(sinks=np.array([0.7, -0.4]), softcap=4.0)),
    "kv-lengths": ((3, 2, 20, 16), 2, 64, dict(causal=True, kv_lengths=np.array([64, 31, 0]))),
    "everything": ((2, 4, 37, 16), 2, 61, dict(
        causal=True, enable_gqa=True, window=(20, None), alibi_slopes=np.array([.1, .2, .3, .4]),
        sinks=np.array([[0.5, -1, 0.1, 2], [0, 0, 0, 0]]), kv_lengths=np.array([61, 44]))),
}


def _case_arrays(case, dtype, seed):
    q_shape, kv_heads, S, options = CASES[case]
    B, H, T, d = q_shape
    q, k, v = make_qkv(seed, q_shape, (B, kv_heads, S, d), (B, kv_heads, S, d), dtype)
    rng = np.random.default_rng(seed)
    chunked = []
    for x in (q, k, v):
        # features too (a task takes them whole: they are rechunked)
        chunks = tuple(_random_chunks(rng, n) for n in x.shape)
        chunked.append(da.from_array(x, chunks=chunks))
    return (q, k, v), chunked, dict(options)


def _check(q, k, v, out, lse, options):
    whole, whole_lse = ca.attention(q, k, v, return_lse=True, **options)
    assert out.dtype == whole.dtype and lse.dtype == whole_lse.dtype
    tol = 1e-12 if q.dtype == np.float64 else 3e-6
    np.testing.assert_allclose(out, whole, rtol=0, atol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(whole_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], whole_lse[np.isfinite(lse)],
                               rtol=0, atol=10 * tol)
    ref = dict(options)
    ref_k, ref_v = k, v
    if ref.pop("enable_gqa", False):
        ref_k, ref_v = _grouped(k, v, q.shape[-3])
    if "kv_lengths" in ref:
        ref["kv_lengths"] = ref["kv_lengths"][:, None]
    assert_matches_reference(out, None, q, ref_k, ref_v, lse=lse, **ref)


@pytest.mark.parametrize("scheduler", ["sync", "threads", "distributed"])
@pytest.mark.parametrize("case", CASES)
def test_random_chunkings_match_the_whole_call_and_the_reference(client, dtype, case,
                                                                 scheduler):
    seed = sorted(CASES).index(case) * 7 + (dtype == np.float32)
    (q, k, v), (dq, dk, dv), options = _case_arrays(case, dtype, seed)
    out, lse = cad.attention(dq, dk, dv, return_lse=True, split_every=3, **options)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and lse.shape == q.shape[:-1]
    assert out.chunks[-2] == dq.chunks[-2]
    got, got_lse = _compute([out, lse], scheduler, client)
    _check(q, k, v, got, got_lse, options)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_many_random_chunkings(seed):
    rng = np.random.default_rng(1000 + seed)
    case = sorted(CASES)[seed % len(CASES)]
    dtype = (np.float32, np.float64)[seed % 2]
    (q, k, v), (dq, dk, dv), options = _case_arrays(case, dtype, 1000 + seed)
    out, lse = cad.attention(dq, dk, dv, return_lse=True,
                             split_every=int(rng.integers(2, 5)), **options)
    got, got_lse = dask.compute(out, lse, scheduler="sync")
    _check(q, k, v, got, got_lse, options)


def test_bitwise_the_same_for_a_chunking_whatever_runs_it(client):
    (q, k, v), (dq, dk, dv), options = _case_arrays("everything", np.float32, 5)
    out = cad.attention(dq, dk, dv, split_every=2, **options)
    expected = out.compute(scheduler="sync")
    assert_bitwise_equal(client.compute(out, sync=True), expected)
    for workers in (1, 3):
        assert_bitwise_equal(out.compute(scheduler="threads", num_workers=workers), expected)
    for threads in (1, 2):
        again = cad.attention(dq, dk, dv, split_every=2, num_threads=threads, **options)
        assert_bitwise_equal(again.compute(scheduler="threads"), expected)
    # one chunk of everything is the whole call itself
    whole = cad.attention(q, k, v, **options).compute(scheduler="sync")
    assert_bitwise_equal(whole, ca.attention(q, k, v, **options))


def _leaves(array):
    """The (query chunk, key chunk) tasks of a graph: (row chunk, key chunk).
    (With return_lse=True: without it a query chunk's root task runs
    inside its output's.)"""
    graph = dict(array.__dask_graph__())
    return sorted((key[-2], key[-1]) for key in graph
                  if isinstance(key, tuple) and key[0].startswith("attention-chunks-")
                  and key[1] == "chunk")


def test_pairs_that_see_no_key_are_no_tasks():
    q, k, v = make_qkv(6, (1, 1, 64, 8), (1, 1, 64, 8), (1, 1, 64, 8), np.float64)
    chunks = {-2: 16}
    # causal: the lower triangle of the 4 x 4 chunk pairs
    out, _ = cad.attention(q, k, v, causal=True, chunks=chunks, return_lse=True)
    assert _leaves(out) == [(t, s) for t in range(4) for s in range(t + 1)]
    # a window of 10 keys back: the diagonal and the pair before it
    out, _ = cad.attention(q, k, v, causal=True, window=(10, None), chunks=chunks,
                           return_lse=True)
    assert _leaves(out) == [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3)]
    # no key past the length (every entry): those chunks are not read
    out, _ = cad.attention(q, k, v, kv_lengths=20, chunks=chunks, return_lse=True)
    assert _leaves(out) == [(t, s) for t in range(4) for s in range(2)]
    # T > S under causal: the first rows see nothing; their chunk is one
    # task over zero keys, which reads no K/V chunk
    out, _ = cad.attention(q, k[..., :16, :], v[..., :16, :], causal=True, chunks=chunks,
                           return_lse=True)
    assert _leaves(out) == [(0, -1), (1, -1), (2, -1), (3, 0)]
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               ca.attention(q, k[..., :16, :], v[..., :16, :], causal=True),
                               rtol=0, atol=1e-12)


def test_the_merge_tree_follows_split_every():
    q, k, v = make_qkv(7, (1, 1, 8, 8), (1, 1, 80, 8), (1, 1, 80, 8), np.float64)
    for every, merges in ((2, 9), (3, 5), (8, 3), (10, 1)):
        out, _ = cad.attention(q, k, v, chunks={-2: 8}, split_every=every, return_lse=True)
        graph = dict(out.__dask_graph__())
        assert sum(1 for key in graph if isinstance(key, tuple)
                   and key[0].startswith("attention-chunks-") and key[1] == "merge") == merges
        np.testing.assert_allclose(out.compute(scheduler="sync"), ca.attention(q, k, v),
                                   rtol=0, atol=1e-12)


def test_grouped_heads_read_their_kv_chunk_in_place():
    """Query head chunks that straddle groups are split at the groups; the
    K/V chunks are the input's own when they line up (no rechunk, no copy
    in the graph), shared by the query chunks of their heads."""
    q, k, v = make_qkv(8, (1, 8, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8), np.float32)
    dk = da.from_array(k, chunks=(1, 1, 16, 8))
    dv = da.from_array(v, chunks=(1, 1, 16, 8))
    dq = da.from_array(q, chunks=(1, 2, 16, 8))       # 2 of the 4 heads of a group
    out = cad.attention(dq, dk, dv, enable_gqa=True, causal=True)
    assert out.chunks[1] == (2, 2, 2, 2)
    graph = dict(out.__dask_graph__())
    kv_keys = {key for key in graph if isinstance(key, tuple) and key[0] in (dk.name, dv.name)}
    assert len(kv_keys) == 4                           # the inputs' own chunks


    def keys_in(task):
        if isinstance(task, tuple) and task and task[0] in (dk.name, dv.name):
            return {task}
        if isinstance(task, (tuple, list)):
            return set().union(*(keys_in(t) for t in task))
        return set()

    # query head chunk h (heads 2h, 2h + 1) reads K/V chunk h // 2, as it is
    reads = {key[2]: keys_in(task) for key, task in graph.items()
             if isinstance(key, tuple) and key[0] == out.name}
    assert reads == {h: {(dk.name, 0, h // 2, 0, 0), (dv.name, 0, h // 2, 0, 0)}
                     for h in range(4)}
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               ca.attention(q, k, v, enable_gqa=True, causal=True), atol=1e-6)
    # straddling chunks: (3, 5) heads with groups of 4 become (3, 1, 4)
    dq = da.from_array(q, chunks=(1, (3, 5), 16, 8))
    out = cad.attention(dq, k, v, enable_gqa=True, causal=True, chunks=(1, 1, 16, 8))
    assert out.chunks[1] == (3, 1, 4)
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               ca.attention(q, k, v, enable_gqa=True, causal=True), atol=1e-6)


def test_layouts_broadcast_and_dtypes_follow_ca_attention():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((3, 2, 20, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 30, 8)).astype(np.float32)   # shared by the batch
    v = rng.standard_normal((30, 4)).astype(np.float32)         # 2-D, broadcast
    dq = da.from_array(q, chunks=(1, 2, 7, 8))
    out = cad.attention(dq, k, v, chunks={-2: 7}, causal=True)
    assert out.chunks[:3] == ((1, 1, 1), (2,), (7, 7, 6))
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               ca.attention(q, k, v, causal=True), atol=2e-6)
    # mismatched chunks of a shared axis: K and V take q's
    dq = da.from_array(q, chunks=(2, 1, 10, 8))
    dk = da.from_array(np.broadcast_to(k, (3, 2, 30, 8)), chunks=(1, 2, 9, 8))
    dv = da.from_array(rng.standard_normal((3, 2, 30, 4)), chunks=(3, 1, 30, 2))
    out = cad.attention(dq, dk, dv)
    assert out.chunks == ((2, 1), (1, 1), (10, 10), (4,)) and out.dtype == np.float64
    np.testing.assert_allclose(out.compute(scheduler="sync"),
                               ca.attention(q, np.broadcast_to(k, (3, 2, 30, 8)),
                                            dv.compute()), atol=1e-6)
    # float16 in, float16 out: merged in float64, rounded once
    q16, k16, v16 = (x.astype(np.float16) for x in make_qkv(10, (2, 40, 16), (2, 50, 16),
                                                          (2, 50, 16)))
    out = cad.attention(q16, k16, v16, chunks={-2: 13}, causal=True, return_lse=True)
    got, lse = dask.compute(*out, scheduler="sync")
    whole, whole_lse = ca.attention(q16, k16, v16, causal=True, return_lse=True)
    assert got.dtype == np.float16 and lse.dtype == np.float32
    assert np.all(np.abs(got.astype(np.float64) - whole) <= np.spacing(np.abs(whole)))


def test_each_task_shares_the_workers_threads(monkeypatch):
    """The rule: a task's cattention threads are the process's
    (get_num_threads) divided by the tasks it may run at once, at least 1."""
    assert cad.concurrent_tasks() == 1                # the calling thread
    ca.set_num_threads(4)
    assert cad.task_threads() == 4 and cad.task_threads(3) == 3
    seen = []
    real = _tasks.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["num_threads"])
        return real(*args, **kwargs)

    monkeypatch.setattr(_tasks, "attention", spy)
    q, k, v = make_qkv(11, (2, 2, 24, 8), (2, 2, 24, 8), (2, 2, 24, 8), np.float32)
    out = cad.attention(q, k, v, chunks={-2: 8}, causal=True)
    out.compute(scheduler="sync")
    assert set(seen) == {4}
    seen.clear()
    with dask.config.set(num_workers=2):
        out.compute(scheduler="threads")
    assert set(seen) == {2}
    seen.clear()
    with dask.config.set(num_workers=8):
        out.compute(scheduler="threads")
    assert set(seen) == {1}
    # a distributed worker of 2 threads in this process: 4 // 2 each
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address=":0", silence_logs=logging.ERROR) as cl, \
            distributed.Client(cl) as local:
        assert local.submit(cad.concurrent_tasks, pure=False).result() == 2
        assert local.submit(cad.task_threads, pure=False).result() == 2
        seen.clear()
        local.compute(out, sync=True)
        assert set(seen) == {2}


def test_worker_processes_take_one_thread_a_task(client):
    # the nanny gives each worker process OMP_NUM_THREADS=1 (distributed's
    # default), and each runs 1 task at a time
    assert set(client.run(cad.task_threads).values()) == {1}
    assert set(client.run(cad.concurrent_tasks).values()) == {1}


def _same_error(call_numpy, call_dask):
    with pytest.raises((TypeError, ValueError)) as expected:
        call_numpy()
    with pytest.raises(expected.type) as got:
        call_dask()
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("bad", [
    dict(k_shape=(2, 2, 30, 9)), dict(v_shape=(2, 2, 31, 8)), dict(q_shape=(3, 2, 20, 8)),
    dict(enable_gqa=True, q_shape=(2, 3, 20, 8)), dict(kv_lengths=[31, 0]),
    dict(kv_lengths=[1.5, 2]), dict(window=(-1, 2)), dict(window=3), dict(scale=np.inf),
    dict(softcap=0.0), dict(alibi_slopes=[np.nan, 1]), dict(sinks=[np.inf, 0]),
    dict(sinks=np.zeros(3)), dict(causal="yes"), dict(return_lse=1), dict(num_threads=0),
    dict(dtype=np.complex64), dict(dtype=np.int8), dict(q_shape=(20,)),
])
def test_everything_ca_attention_refuses_is_refused_at_graph_construction(bad):
    bad = dict(bad)
    shapes = {name: bad.pop(f"{name}_shape", default) for name, default in
              (("q", (2, 2, 20, 8)), ("k", (2, 2, 30, 8)), ("v", (2, 2, 30, 8)))}
    dtype = bad.pop("dtype", np.float32)
    q, k, v = (np.ones(shapes[name], dtype if name == "k" else np.float32) for name in "qkv")
    _same_error(lambda: ca.attention(q, k, v, **bad),
                lambda: cad.attention(q, k, v, chunks={-2: 7}, **bad))


def test_refusals_of_its_own():
    q = da.ones((2, 20, 8), chunks=(1, 5, 8))
    unknown = q[q[:, 0, 0] > 0]
    with pytest.raises(ValueError, match=r"q has unknown chunk sizes \(NaN\) on axes \[0\]"):
        cad.attention(unknown, q, q)
    with pytest.raises(ValueError, match=r"chunks=\(3, 3\) does not fit k of shape"):
        cad.attention(q, np.ones((2, 20, 8)), q, chunks=(3, 3))
    for every, error in ((1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="split_every must be"):
            cad.attention(q, q, q, split_every=every)
    with pytest.raises(TypeError, match="k must be an array, got None"):
        cad.attention(q, None, q)


def _output_holders(name, dask_scheduler=None):
    """On the scheduler: the worker holding each finished chunk of the
    array called name."""
    return [ts.who_has and next(iter(ts.who_has)).address for key, ts in
            dask_scheduler.tasks.items()
            if isinstance(key, tuple) and key[0] == name and ts.state == "memory"]


def test_a_worker_killed_mid_computation_leaves_the_result_exact(client):
    # made by the workers from seeds (the graph carries no data)
    rng = da.random.default_rng(12)
    dq, dk, dv = (rng.standard_normal((1, 2, 4096, 64), chunks=(1, 1, 256, 64))
                  for _ in range(3))
    out = cad.attention(dq, dk, dv, causal=True)
    expected = out.compute(scheduler="sync")
    pids = client.run(os.getpid)
    future = client.compute(out)
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and not future.done() and time.monotonic() < deadline:
        held = [w for w in client.run_on_scheduler(_output_holders, out.name) if w in pids]
        if len(held) >= 4:
            # the worker holding most finished chunks: they are lost with it
            # and computed again, with everything they came from
            victim = max(set(held), key=held.count)
        else:
            time.sleep(0.01)
    assert victim is not None and not future.done(), "no time to kill a worker"
    os.kill(pids[victim], signal.SIGKILL)
    result = future.result(timeout=120)
    assert_bitwise_equal(result, expected)
    client.wait_for_workers(2, timeout=60)
    assert pids[victim] not in client.run(os.getpid).values()
