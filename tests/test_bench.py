"""The benchmark harness (``benchmarks/attention.py``) on tiny cases.

Checks the records' structure and the error column, never timings. torch is
made unimportable so the test is fast and covers the path without it.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from cattention._native import driver

# the benchmarks live beside the tests in the source tree, not in the package
BENCH_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "attention.py"
if not BENCH_PATH.is_file():
    pytest.skip("benchmarks/ is not here (tests run outside the source tree)",
                allow_module_level=True)
_spec = importlib.util.spec_from_file_location("bench_attention", BENCH_PATH)
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)

TINY_CASES = (
    _bench.Case(1, 2, 16, 16, 8),
    _bench.Case(1, 2, 16, 16, 8, causal=True),
    _bench.Case(2, 1, 5, 12, 4, causal=True),            # T != S: bottom-right causal
    _bench.Case(1, 3, 1, 32, 8),                          # decode
    _bench.Case(1, 2, 16, 16, 8, causal=True, dtype="float64"),
)

RECORD_KEYS = {"case", "kind", "shape", "causal", "dtype", "threads", "impl", "median_ms",
               "times_ms", "spread", "gflops", "gbps", "vs_ca", "vs_ca_scores", "max_abs_err"}


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.setattr(_bench, "_import_torch", lambda: None)
    # and no onnxruntime or OpenVINO either, installed or not
    monkeypatch.setattr(_bench, "_runtime_implementations", lambda *args: {})


def test_run_benchmark_records(no_torch):
    seen = []
    records = _bench.run_benchmark(cases=TINY_CASES, threads=[1], rounds=2,
                                   probe_elements=1 << 16, on_records=seen.extend,
                                   gemm_size=64, loop_seconds=0.005)
    assert seen == records
    probes = [r for r in records if r["kind"] == "probe"]
    assert [r["impl"] for r in probes[:2]] == [_bench.PROBE, _bench.GEMM_PROBE]
    assert probes[0]["gbps"] > 0
    assert probes[1]["gbps"] is None and probes[1]["gflops"] > 0
    # then the loops of the table in use (two on amx: its tiles, and the
    # avx512 FMA loop its float32 kernels run)
    table = driver.get_simd()
    loops = {r["simd"]: r for r in probes[2:]}
    assert all(r["impl"] == _bench.LOOP_PROBE for r in probes[2:])
    assert set(loops) == {_bench.loop_table(table, "float32"),
                          _bench.loop_table(table, _bench.BFLOAT16)}
    assert all(r["gflops"] > 0 and r["clock"] == "process_time" for r in loops.values())

    rows = [r for r in records if r["kind"] != "probe"]
    expected_impls = {_bench.CATTENTION, _bench.CATTENTION_SCORES, _bench.NUMPY}
    for case in TINY_CASES:
        mine = [r for r in rows if r["case"] == case.name and r["dtype"] == case.dtype]
        assert {r["impl"] for r in mine} == expected_impls  # no torch peers
        for r in mine:
            assert RECORD_KEYS <= r.keys()
            assert r["threads"] == 1
            assert len(r["times_ms"]) == 2 and r["median_ms"] > 0
            assert r["gflops"] > 0
            limit = 1e-5 if case.dtype == "float32" else 1e-12
            assert r["max_abs_err"] < limit, r
            if r["impl"] == _bench.CATTENTION:
                assert r["vs_ca"] == 1.0
            if r["impl"] == _bench.NUMPY:
                assert r["vs_ca_scores"] is not None
            assert r["simd"] == table
            # cattention's rate as a share of its table's loop, but for
            # decode (GB/s) and float64
            if r["impl"] == _bench.NUMPY or case.is_decode or case.dtype == "float64":
                assert "loop_fraction" not in r
            else:
                loop = loops[_bench.loop_table(table, "float32")]
                assert r["loop_table"] == loop["simd"]
                assert r["loop_fraction"] == pytest.approx(r["gflops"] / loop["gflops"])
        if case.is_decode:
            assert all(r["gbps"] > 0 and r["probe_fraction"] > 0 for r in mine)
            assert not any("gemm_fraction" in r for r in mine)
        elif case.dtype == "float32":
            # attention's rate over the GEMM probe's, as shown in the table
            for r in mine:
                assert r["gemm_fraction"] == pytest.approx(r["gflops"] / probes[1]["gflops"])
                assert f"({r['gemm_fraction']:.0%} gemm)" in _bench.format_records([r])
        else:
            assert not any("gemm_fraction" in r for r in mine)
    json.dumps(records)  # machine readable as is


def test_flops_and_causal_accounting():
    full = _bench.Case(1, 2, 16, 16, 8)
    causal = _bench.Case(1, 2, 16, 16, 8, causal=True)
    assert full.flops == 4 * 2 * 16 * 16 * 8
    assert causal.flops == full.flops / 2
    # T > S bottom-right: the first T - S rows see nothing
    assert _bench.Case(1, 1, 4, 2, 1, causal=True).visible_fraction == 3 / 8
    mask = _bench.visible_mask(3, 5)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_reference_matches_numpy_f32():
    case = _bench.Case(2, 2, 7, 9, 4, causal=True)
    q, k, v = _bench.make_inputs(case)
    ref = _bench.reference_attention(q, k, v, True, 0.5)
    out, weights = _bench.numpy_attention(q, k, v, True, 0.5)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-5)


def test_cli_filter_json_and_table(no_torch, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(_bench, "DEFAULT_CASES", TINY_CASES)
    monkeypatch.setattr(_bench, "PROBE_ELEMENTS", 1 << 16)
    monkeypatch.setattr(_bench, "GEMM_SIZE", 64)
    monkeypatch.setattr(_bench, "LOOP_SECONDS", 0.005)
    path = tmp_path / "bench.json"
    code = _bench.main(["--threads", "1", "--rounds", "1", "--cases", "decode",
                        "--no-memory", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "OPENBLAS_CORETYPE" in out and "torch:" in out
    assert "1x3x1x32x8 full" in out and "1x2x16x16x8" not in out
    assert "% probe" in out
    data = json.loads(path.read_text())
    assert {r["case"] for r in data["records"] if r["kind"] != "probe"} == {"1x3x1x32x8 full"}
    assert data["config"]["torch"] is None and data["memory"] is None
    assert data["settings"]["wake_s"] == _bench.WAKE_SECONDS
    assert data["settings"]["simd"] == [driver.get_simd()]


@pytest.mark.parametrize("wake", ["-0.1", "nan"])
def test_cli_refuses_a_wake_below_zero(wake):
    with pytest.raises(SystemExit, match="--wake must be 0 or more seconds"):
        _bench.main(["--wake", wake, "--cases", "decode"])


def test_settle_pause_keeps_the_cores_busy_for_wake_seconds(monkeypatch):
    woken = []
    monkeypatch.setattr(_bench, "_wake_cores", lambda n, seconds: woken.append((n, seconds)))
    monkeypatch.setattr(_bench.time, "sleep", lambda seconds: None)
    times = _bench.time_round_robin({"a": lambda: 1, "b": lambda: 2}, rounds=3,
                                    settle={"b": 0.2}, threads=2, wake=0.07)
    assert [len(t) for t in times.values()] == [3, 3]
    assert woken == [(2, 0.07)] * 3


def test_header_names_the_kernels_torch_runs(monkeypatch):
    from types import SimpleNamespace
    fake_cpu = SimpleNamespace(get_cpu_capability=lambda: "AVX2")
    fake_torch = SimpleNamespace(__version__="9.9.9+cpu",
                                 backends=SimpleNamespace(cpu=fake_cpu))
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    config = _bench.machine_config(fake_torch)
    assert config["torch_kernels"] == "AVX2"
    assert ("torch:   9.9.9+cpu (AVX2 kernels, matrix products by MKL's own choice)"
            in _bench.format_config(config))
    # MKL picks its instruction set apart from ATen's: the header says what it was asked
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    config = _bench.machine_config(fake_torch)
    assert ("torch:   9.9.9+cpu (AVX2 kernels, matrix products MKL_ENABLE_INSTRUCTIONS=AVX2)"
            in _bench.format_config(config))
    # a torch without the query still runs the benchmark, and says so
    old_torch = SimpleNamespace(__version__="1.13.0", backends=SimpleNamespace())
    assert _bench.machine_config(old_torch)["torch_kernels"] == "unknown"
    config = _bench.machine_config(None)
    assert config["torch_kernels"] is None
    assert "torch:   not installed" in _bench.format_config(config)


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(SystemExit, match="matplotlib"):
        _bench.plot_results([], "unused.png")


def test_background_load_accounting():
    assert _bench.background_cores(None, (1.0, 1.0), 10.0) is None
    assert _bench.background_cores((0.0, 0.0), (5.0, 1.0), 0.1) is None  # too short
    assert _bench.background_cores((0.0, 0.0), (5.0, 1.0), 2.0) == 2.0
    assert _bench.background_cores((0.0, 0.0), (1.0, 1.5), 2.0) == 0.0  # never negative


def test_generation_loop_record():
    result = _bench.measure_generation(1, shape=(4, 2, 8, 16, 5), kv_dtype="float16")
    assert result["shape"] == [4, 2, 8, 16, 5] and result["kv_dtype"] == "float16"
    assert result["cattention_tokens_per_s"] > 0 and result["numpy_tokens_per_s"] > 0
    assert "tokens/s" in _bench.format_generation(result)


# ---------------------------------------------------------------------------
# bfloat16 rows, the multiply-add loops, kernel tables
# ---------------------------------------------------------------------------

BF16_CASES = (
    _bench.Case(1, 2, 16, 16, 8, dtype=_bench.BFLOAT16),
    _bench.Case(1, 2, 16, 16, 8, causal=True, dtype=_bench.BFLOAT16),
    _bench.Case(1, 3, 1, 32, 8, dtype=_bench.BFLOAT16, kvcache=True),   # decode step
)

needs_bfloat16 = pytest.mark.skipif(_bench.bfloat16_dtype() is None,
                                    reason="ml_dtypes is not installed")


def test_default_cases_have_the_issues_bfloat16_rows():
    bf16 = {(c.batch, c.heads, c.n_queries, c.n_keys, c.dim, c.causal, c.kvcache)
            for c in _bench.DEFAULT_CASES if c.dtype == _bench.BFLOAT16}
    assert bf16 == {(1, 8, 1024, 1024, 64, False, False), (4, 32, 512, 512, 128, False, False),
                    (8, 12, 512, 512, 64, False, False), (1, 8, 2048, 2048, 64, True, False),
                    (1, 32, 1, 8192, 128, False, True)}
    causal = _bench.Case(1, 8, 2048, 2048, 64, causal=True, dtype=_bench.BFLOAT16)
    assert causal.flops == 4 * 8 * 2048 * 2048 * 64 / 2
    decode = _bench.Case(1, 32, 1, 8192, 128, dtype=_bench.BFLOAT16, kvcache=True)
    assert decode.kv_bytes() == 2 * 32 * 8192 * 128 * 2      # bfloat16: 2 bytes
    assert decode.kv_bytes("float32") == 2 * decode.kv_bytes()
    assert decode.name == "1x32x1x8192x128 full kvcache" and decode.matches(["bfloat16"])


@needs_bfloat16
def test_bfloat16_records(no_torch):
    records = _bench.run_benchmark(cases=BF16_CASES, threads=[1], rounds=2, probe_elements=0,
                                   gemm_size=0, loop_seconds=0.005)
    table = driver.get_simd()
    loops = {r["simd"]: r for r in records if r["impl"] == _bench.LOOP_PROBE}
    rows = [r for r in records if r["kind"] != "probe"]
    for case in BF16_CASES:
        mine = {r["impl"]: r for r in rows if r["case"] == case.name}
        # no peers that materialise the weights: cattention beside its float32
        # (and its medium precision on full attention, not on the decode step)
        medium = set() if case.kvcache else {_bench.CATTENTION_MEDIUM}
        assert set(mine) == {_bench.CATTENTION, _bench.CATTENTION_F32} | medium
        ours, f32 = mine[_bench.CATTENTION], mine[_bench.CATTENTION_F32]
        assert ours["dtype"] == f32["dtype"] == _bench.BFLOAT16
        # bfloat16 output: rounded once (about 2**-9 relative); float32 exact
        assert ours["max_abs_err"] < 1e-2 and f32["max_abs_err"] < 1e-5
        if medium:
            fast = mine[_bench.CATTENTION_MEDIUM]
            assert fast["max_abs_err"] < 1e-2 and fast["loop_table"] == table
        assert ours["vs_ca"] == 1.0
        assert f32["vs_ca"] == pytest.approx(f32["median_ms"] / ours["median_ms"])
        if case.is_decode:  # GB/s of the bytes each reads: float32 reads twice as many
            assert ours["gbps"] == pytest.approx(case.kv_bytes() / ours["median_ms"] / 1e6)
            assert f32["gbps"] == pytest.approx(2 * case.kv_bytes() / f32["median_ms"] / 1e6)
            assert "loop_fraction" not in ours
        else:  # bfloat16 on the table in use, float32 on its float32 table
            assert ours["loop_table"] == table
            assert f32["loop_table"] == _bench.loop_table(table, "float32")
            for r in (ours, f32):
                share = r["gflops"] / loops[r["loop_table"]]["gflops"]
                assert r["loop_fraction"] == pytest.approx(share)
    table_text = _bench.format_records(rows)
    assert "bf16" in table_text and "cattention-f32" in table_text
    json.dumps(records)


@needs_bfloat16
def test_kvcache_step_leaves_the_cache_as_it_was():
    case = BF16_CASES[2]
    q, k, v = _bench.make_inputs(case)
    before = k.copy()
    step = _bench.cattention_call(case, q, k, v, 1)
    first, second = step(), step()   # the lengths start again at S - 1 each call
    np.testing.assert_array_equal(first.view(np.uint16), second.view(np.uint16))
    np.testing.assert_array_equal(k.view(np.uint16), before.view(np.uint16))
    ref = _bench.reference_attention(q, k, v, False, 1 / np.sqrt(case.dim))
    assert np.max(np.abs(first.astype(np.float64) - ref)) < 1e-2


@needs_bfloat16
@pytest.mark.parametrize("peer", [_bench.TORCH_SDPA, _bench.OPENVINO])
def test_bfloat16_peers(peer):
    torch = pytest.importorskip("torch") if peer == _bench.TORCH_SDPA else None
    if peer == _bench.OPENVINO:
        pytest.importorskip("openvino")
    for case in BF16_CASES:
        q, k, v = _bench.make_inputs(case)
        impls = _bench.build_implementations(case, q, k, v, 1, torch)
        assert peer in impls
        out = _bench._as_numpy(impls[peer]())
        assert out.dtype == _bench.bfloat16_dtype()   # bfloat16 in, bfloat16 out
        ref = _bench.reference_attention(q, k, v, case.causal, 1 / np.sqrt(case.dim))
        assert np.max(np.abs(out.astype(np.float64) - ref)) < 3e-2, (peer, case.name)


@needs_bfloat16
def test_onnxruntime_bfloat16_runs_or_says_why():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    case = BF16_CASES[0]
    q, k, v = _bench.make_inputs(case)
    notes = {}
    impls = _bench._runtime_implementations(case, q, k, v, 0.5, 1, notes)
    # one or the other, never silently missing
    assert (_bench.ONNXRUNTIME in impls) != (_bench.ONNXRUNTIME in notes)
    if _bench.ONNXRUNTIME in notes:
        assert "no bfloat16" in notes[_bench.ONNXRUNTIME]


@pytest.mark.parametrize("op", _bench.ORT_BFLOAT16_OPERATORS)
@pytest.mark.parametrize("causal", [False, True])
def test_onnxruntime_runner_layouts(op, causal):
    """The graphs tried for bfloat16, checked in float32 (which every
    onnxruntime runs): layout, causal mask, I/O binding."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    case = _bench.Case(2, 3, 17, 17, 8, causal=causal)
    q, k, v = _bench.make_inputs(case)
    out = _bench.onnxruntime_runner(case, q, k, v, 1, op)()
    ref = _bench.reference_attention(q, k, v, causal, 1 / np.sqrt(case.dim))
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_note_rows_say_why(no_torch, monkeypatch):
    def runtimes(case, q, k, v, scale, threads, notes):
        notes[_bench.ONNXRUNTIME] = "no bfloat16 kernel here"
        return {}

    monkeypatch.setattr(_bench, "_runtime_implementations", runtimes)
    records = _bench.benchmark_case(TINY_CASES[0], 1, 1, None)
    note = records[-1]
    assert note["impl"] == _bench.ONNXRUNTIME and note["median_ms"] is None
    assert note["note"] == "no bfloat16 kernel here"
    assert "not run: no bfloat16 kernel here" in _bench.format_records(records)
    json.dumps(records)


@pytest.mark.parametrize("threads", [1, 2])
def test_loop_rate_record(threads):
    table = driver.get_simd()
    record = _bench.measure_loop_rate(table, threads, seconds=0.005, rounds=2)
    assert record["impl"] == _bench.LOOP_PROBE and record["simd"] == table
    assert record["threads"] == threads and record["gflops"] > 0
    assert len(record["times_ms"]) == 2 and record["median_ms"] > 0
    assert "GFLOP/s" in _bench.format_records([record])


def test_loop_runs_on_every_thread_at_once(monkeypatch):
    from types import SimpleNamespace
    import threading
    callers = set()
    everyone = threading.Barrier(2, timeout=10)   # a serial run would time out

    def loop_flops(n_steps):
        callers.add(threading.get_ident())
        everyone.wait()
        return 10.0 * n_steps

    monkeypatch.setattr(_bench, "driver", SimpleNamespace(loop_flops=loop_flops))
    flops, cpu = _bench._run_loop(3, 2)
    assert flops == 60.0 and cpu >= 0 and len(callers) == 2


def test_loop_tables():
    assert _bench.loop_table("amx", _bench.BFLOAT16) == "amx"
    assert _bench.loop_table("amx", "float32") == "avx512"   # AMX takes no float32
    for table in ("baseline", "avx2", "avx512", "avx512bf16", "neon"):
        assert _bench.loop_table(table, _bench.BFLOAT16) == table
        assert _bench.loop_table(table, "float32") == table


def test_simd_option():
    available = driver.available_simd()
    assert _bench.parse_simd(None) == [driver.get_simd()]
    assert _bench.parse_simd("all") == available
    assert _bench.parse_simd(f"{available[0]}, {available[0]}") == available[:1]
    with pytest.raises(SystemExit, match="'sse9' is not a kernel table this CPU runs"):
        _bench.parse_simd(f"{available[0]},sse9")


def test_a_pass_per_kernel_table(no_torch, monkeypatch):
    in_use = driver.get_simd()
    tables = list(dict.fromkeys([driver.available_simd()[0], in_use]))
    ran_on = []
    real = _bench.benchmark_case

    def spy(*args, **kwargs):
        ran_on.append(driver.get_simd())
        return real(*args, **kwargs)

    monkeypatch.setattr(_bench, "benchmark_case", spy)
    records = _bench.run_benchmark(cases=TINY_CASES[:1], threads=[1], rounds=1,
                                   probe_elements=0, gemm_size=0, loop_seconds=0.005,
                                   simd=tables)
    assert ran_on == tables and driver.get_simd() == in_use   # restored
    rows = [r for r in records if r["impl"] == _bench.CATTENTION]
    assert [r["simd"] for r in rows] == tables
    assert all(r["loop_table"] == _bench.loop_table(t, "float32")
               for r, t in zip(rows, tables))
    text = _bench.format_records([r for r in records if r["kind"] != "probe"])
    assert all(t in text for t in tables)


@needs_bfloat16
def test_cli_bfloat16_rows_per_table(no_torch, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(_bench, "DEFAULT_CASES", TINY_CASES + BF16_CASES)
    monkeypatch.setattr(_bench, "PROBE_ELEMENTS", 1 << 16)
    monkeypatch.setattr(_bench, "GEMM_SIZE", 64)
    monkeypatch.setattr(_bench, "LOOP_SECONDS", 0.005)
    tables = list(dict.fromkeys([driver.available_simd()[0], driver.get_simd()]))
    path = tmp_path / "bench.json"
    code = _bench.main(["--threads", "1", "--rounds", "1", "--cases", "bfloat16",
                        "--simd", ",".join(tables), "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "of loop" in out and "cattention-f32" in out
    data = json.loads(path.read_text())
    assert data["settings"]["simd"] == tables
    rows = [r for r in data["records"] if r["kind"] != "probe"]
    assert {r["case"] for r in rows} == {c.name for c in BF16_CASES}
    assert {(r["simd"], r["impl"]) for r in rows} == {
        (t, i) for t in tables
        for i in (_bench.CATTENTION, _bench.CATTENTION_F32, _bench.CATTENTION_MEDIUM)}


def test_bfloat16_cases_left_out_without_ml_dtypes(no_torch, monkeypatch, capsys):
    monkeypatch.setattr(_bench, "DEFAULT_CASES", TINY_CASES[:1] + BF16_CASES[:1])
    monkeypatch.setattr(_bench, "bfloat16_dtype", lambda: None)
    monkeypatch.setattr(_bench, "PROBE_ELEMENTS", 1 << 16)
    monkeypatch.setattr(_bench, "GEMM_SIZE", 64)
    monkeypatch.setattr(_bench, "LOOP_SECONDS", 0.005)
    assert _bench.main(["--threads", "1", "--rounds", "1", "--no-memory",
                        "--cases", "16x16x8 full"]) == 0
    out = capsys.readouterr().out
    assert "1 bfloat16 case(s) left out: ml_dtypes is not installed" in out
    table = out.split("-----\n")[-1]
    assert "1x2x16x16x8 full" in table and _bench.CATTENTION_F32 not in table
