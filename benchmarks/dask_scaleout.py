"""Scale-out: cattention.dask on a distributed LocalCluster of 1 and 2
single-thread worker processes, against one ca.attention call with 1 and 2
threads on the same data.

    python benchmarks/dask_scaleout.py [--quick] [--chunks 4096 8192] [--rounds 1]
                                       [--only long docs] [--sync] [--no-cluster]

Two causal float32 workloads, H = 8, d = 64:
- long: one context of T = S = 65536 (--quick: 16384), chunked along the
  sequence (query and key chunks of each --chunks size, all heads in one
  chunk);
- docs: a batch of 64 documents of 4096 tokens (--quick: 16 of 2048), one
  document per chunk.

The inputs are made on the workers (dask's random generator) and kept
there, as data loaded by the workers would be, before the clock starts;
the result is kept on the workers too (persist), so the times hold the
attention, the merges and the transfers between workers, not the trip to
and from this process. The single calls run here on the same values
(gathered once), with no cluster running.

Printed per workload: the wall time of each; cluster / single at the same
number of cores (the target: within 1.15x with chunks of 4096 or more),
in wall time and in CPU time (the workers' and the scheduler's, which runs
in this process, against the single call's): on a machine shared with
other jobs the CPU time is the steadier figure, as a process's share of the
cores moves with the load. The idle cluster itself takes some CPU every
second (event loops, heartbeats, monitors), measured before the run: the
CPU ratio is also given without it, which a slow wall clock inflates;
the tasks of the attention's graph; and two overheads: the scheduler's
cost per task measured on empty tasks (a graph of as many no-op tasks),
and the wall time the workers were not computing (wall x workers minus the
compute time of every task, from the task stream) per task, which holds
the scheduler's latency, transfers and the idle end of the run. The
largest difference from the single call is printed too (the result is
the same to rounding). Medians of --rounds rounds; nothing is asserted.

--sync also computes each graph on Dask's synchronous scheduler in this
process, timed in process CPU against the single call on one thread: what
the chunking itself costs (the leaves' calls, the merges), without the
distributed runtime. --no-cluster leaves the cluster runs out (the inputs
are then made here, the same values).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

import cattention as ca

try:
    import dask
    import dask.array as da
    import distributed
    from distributed import get_task_stream, wait

    import cattention.dask as cad
except ImportError as exc:  # pragma: no cover - the extra is optional
    raise SystemExit(f"this benchmark needs the 'dask' extra (dask[array], distributed): "
                     f"{exc}")

HEADS, D = 8, 64


def workloads(quick):
    """name -> (shape of q, k and v, chunk sizes along T and S per case)."""
    long_t = 16384 if quick else 65536
    docs, doc_t = (16, 2048) if quick else (64, 4096)
    return {
        "long": ((1, HEADS, long_t, D), "sequence"),
        "docs": ((docs, HEADS, doc_t, D), "batch"),
    }


def cluster(n_workers):
    return distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1,
                                    processes=True, host="127.0.0.1", dashboard_address=":0",
                                    silence_logs=logging.ERROR)


def noop(x):
    return x


def empty_task_overhead(client, n_tasks, n_workers):
    """Seconds of worker time per task of a graph of no-op tasks: the
    scheduler's round trip, serialisation, the worker's bookkeeping."""
    futures = client.map(noop, range(n_tasks), pure=False)
    wait(futures)        # warm
    del futures
    start = time.perf_counter()
    futures = client.map(noop, range(n_tasks, 2 * n_tasks), pure=False)
    wait(futures)
    return (time.perf_counter() - start) * n_workers / n_tasks


def process_cpu():
    """CPU seconds (user + system) of this process, all its threads."""
    import psutil
    times = psutil.Process().cpu_times()
    return times.user + times.system


def attention_tasks(array, inputs):
    """Tasks of the attention's graph (not those that made the inputs)."""
    made = set()
    for x in inputs:
        made |= set(x.__dask_graph__().keys())
    return sum(1 for key in array.__dask_graph__().keys() if key not in made)


def cluster_cpu(client):
    """CPU seconds of the workers and of this process (client and
    scheduler)."""
    return sum(client.run(process_cpu).values()) + process_cpu()


def run_cluster(shape, chunks, n_workers, rounds):
    """What a LocalCluster of n_workers single-thread workers does with the
    workload: medians of wall and CPU seconds, the CPU the cluster takes
    per second when idle, tasks, transfers, the overheads per task, the
    result and the inputs."""
    with cluster(n_workers) as local, distributed.Client(local) as client:
        client.wait_for_workers(n_workers)
        q, k, v = client.persist(make_inputs(shape, chunks))
        wait([q, k, v])
        # event loops, heartbeats and monitors of the idle cluster: this
        # much CPU per second of wall time, whatever runs
        cpu = cluster_cpu(client)
        time.sleep(3)
        background = (cluster_cpu(client) - cpu) / 3
        out = cad.attention(q, k, v, causal=True)
        n_tasks = attention_tasks(out, (q, k, v))
        walls, cpus, idle, transfers = [], [], [], []
        for _ in range(rounds):
            with get_task_stream(client) as stream:
                cpu = cluster_cpu(client)
                start = time.perf_counter()
                result = client.persist(out)
                wait(result)
                wall = time.perf_counter() - start
                cpus.append(cluster_cpu(client) - cpu)
            steps = [s for task in stream.data for s in task["startstops"]]
            busy = sum(s["stop"] - s["start"] for s in steps if s["action"] == "compute")
            moved = [s["stop"] - s["start"] for s in steps if s["action"] == "transfer"]
            walls.append(wall)
            idle.append((wall * n_workers - busy) / n_tasks)
            transfers.append((len(moved), sum(moved)))
            del result
        overhead = empty_task_overhead(client, max(n_tasks, 200), n_workers)
        result = client.persist(out).compute()
        inputs = [x.compute() for x in (q, k, v)]
    return dict(wall=statistics.median(walls), cpu=statistics.median(cpus),
                background=background, tasks=n_tasks, transfers=transfers[len(walls) // 2],
                empty=overhead, idle=statistics.median(idle), result=result, inputs=inputs)


def make_inputs(shape, chunks):
    """q, k and v as lazy Dask arrays: the same values whatever the chunks
    (made in chunks of one document or 4096 positions, then rechunked)."""
    rng = da.random.default_rng(0)
    made = (1, HEADS, min(shape[2], 4096), D)
    return [rng.standard_normal(shape, dtype=np.float32, chunks=made).rechunk(chunks)
            for _ in range(3)]


def run_sync(inputs, chunks, rounds):
    """The graph over NumPy inputs, computed on the synchronous scheduler in
    this process, each task on one thread, its chunks kept as they are
    (persist, as on the cluster: no concatenation into one array): medians
    of wall and process CPU seconds, and the result."""
    out = cad.attention(*inputs, causal=True, chunks=chunks, num_threads=1)
    walls, cpus = [], []
    kept = None
    for _ in range(rounds):
        del kept
        cpu = process_cpu()
        start = time.perf_counter()
        (kept,) = dask.persist(out, scheduler="sync")
        walls.append(time.perf_counter() - start)
        cpus.append(process_cpu() - cpu)
    return statistics.median(walls), statistics.median(cpus), kept.compute(scheduler="sync")


def run_single(q, k, v, threads, rounds):
    ca.attention(q[:1, :1, :256], k[:1, :1, :256], v[:1, :1, :256], causal=True,
                 num_threads=threads)
    times, cpus = [], []
    out = None
    for _ in range(rounds):
        cpu = process_cpu()
        start = time.perf_counter()
        out = ca.attention(q, k, v, causal=True, num_threads=threads)
        times.append(time.perf_counter() - start)
        cpus.append(process_cpu() - cpu)
    return statistics.median(times), statistics.median(cpus), out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (about 1/16 the work)")
    parser.add_argument("--chunks", type=int, nargs="+", default=None,
                        help="chunk sizes along the sequence for 'long' (default 4096 8192; "
                        "--quick: 2048 4096)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", nargs="+", choices=["long", "docs"], default=["long", "docs"])
    parser.add_argument("--sync", action="store_true",
                        help="also time each graph on the synchronous scheduler in this process")
    parser.add_argument("--no-cluster", action="store_true", help="no LocalCluster runs")
    args = parser.parse_args()
    chunk_sizes = args.chunks or ([2048, 4096] if args.quick else [4096, 8192])
    print(f"cattention {ca.__version__}, dask {dask.__version__}, distributed "
          f"{distributed.__version__}; float32, causal, H = {HEADS}, d = {D}; "
          f"medians of {args.rounds} round(s)")
    for name, (shape, split) in workloads(args.quick).items():
        if name not in args.only:
            continue
        flops = 2 * shape[0] * shape[1] * shape[2] * (shape[2] + 1) / 2 * 2 * D
        print(f"\n{name}: q, k, v {shape} ({flops / 1e12:.2f} TFLOP causal)")
        if split == "sequence":
            cases = [(c, (1, HEADS, c, D)) for c in chunk_sizes]
        else:
            cases = [(shape[2], (1, HEADS, shape[2], D))]
        single = {}
        inputs = None

        def singles():
            for threads in (1, 2):
                single[threads] = run_single(*inputs, threads, args.rounds)
                print(f"  one ca.attention call, {threads} thread(s): "
                      f"{single[threads][0]:8.2f} s (CPU {single[threads][1]:.2f} s)")

        for chunk, chunks in cases:
            for n_workers in () if args.no_cluster else (1, 2):
                run = run_cluster(shape, chunks, n_workers, args.rounds)
                if inputs is None:
                    inputs = run["inputs"]
                    singles()
                base_wall, base_cpu, reference = single[n_workers]
                wall, cpu = run["wall"], run["cpu"]
                own = run["background"] * wall
                diff = float(np.max(np.abs(run["result"] - reference)))
                print(f"  chunks of {chunk:5d}, {n_workers} worker(s): {wall:8.2f} s = "
                      f"{wall / base_wall:.3f}x the call at {n_workers} thread(s); CPU "
                      f"{cpu:.2f} s = {cpu / base_cpu:.3f}x, {(cpu - own) / base_cpu:.3f}x "
                      f"without the idle cluster's {run['background'] * 100:.0f}% of a core")
                print(f"      {run['tasks']} tasks, {run['transfers'][0]} transfers "
                      f"({run['transfers'][1]:.2f} s); per task: empty task "
                      f"{run['empty'] * 1e3:.2f} ms, not computing {run['idle'] * 1e3:.1f} ms; "
                      f"max |diff| {diff:.2g}")
            if args.sync:
                if inputs is None:
                    inputs = [x.compute(scheduler="sync") for x in make_inputs(shape, chunks)]
                    singles()
                base_wall, base_cpu, reference = single[1]
                wall, cpu, result = run_sync(inputs, chunks, args.rounds)
                diff = float(np.max(np.abs(result - reference)))
                print(f"  chunks of {chunk:5d}, synchronous scheduler here: {wall:8.2f} s, CPU "
                      f"{cpu:.2f} s = {cpu / base_cpu:.3f}x the call's at 1 thread; "
                      f"max |diff| {diff:.2g}")


if __name__ == "__main__":
    main()
