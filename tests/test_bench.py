"""The benchmark harness (``benchmarks/attention.py``) on tiny cases.

Checks the records' structure and the error column, never timings. torch is
made unimportable so the test is fast and covers the path without it.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

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
                                   gemm_size=64)
    assert seen == records
    probes = [r for r in records if r["kind"] == "probe"]
    assert [r["impl"] for r in probes] == [_bench.PROBE, _bench.GEMM_PROBE]
    assert probes[0]["gbps"] > 0
    assert probes[1]["gbps"] is None and probes[1]["gflops"] > 0

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
