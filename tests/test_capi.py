"""The C-level API (cattention/cython_attention.pxd) from a downstream Cython
extension: tools/capi/downstream.pyx is built in a temporary directory
against the installed cattention and called from a prange over heads."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cattention as ca
from reference import assert_bitwise_equal, assert_matches_reference, make_qkv, reference_lse

pytest.importorskip("Cython")
CAPI_SOURCES = Path(__file__).resolve().parent.parent / "tools" / "capi"


@pytest.fixture(scope="module")
def downstream(tmp_path_factory):
    build_dir = tmp_path_factory.mktemp("downstream")
    for name in ("downstream.pyx", "setup.py"):
        shutil.copy(CAPI_SOURCES / name, build_dir / name)
    result = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                            cwd=build_dir, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    built = next(build_dir.glob("downstream*.so"))
    spec = importlib.util.spec_from_file_location("downstream", built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interleaved(seed, n_queries, n_keys, n_heads, d_k, d_v, dtype):
    """q, k, v in the (positions, heads, features) layout of a fused QKV
    projection, as C-contiguous arrays."""
    q, k, v = make_qkv(seed, (n_queries, n_heads, d_k), (n_keys, n_heads, d_k),
                       (n_keys, n_heads, d_v), dtype)
    return q, k, v


def heads_first(x):
    return np.swapaxes(x, 0, 1)


SHAPES = [(37, 300, 4, 16, 24), (1, 513, 3, 64, 64), (1, 4096, 3, 64, 64),
          (4, 2048, 2, 32, 16), (5, 5, 2, 8, 8), (300, 37, 3, 17, 9), (97, 1025, 2, 32, 40)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_float32_heads_in_prange(downstream, shape, causal):
    n_queries, n_keys, n_heads, d_k, d_v = shape
    q, k, v = interleaved(1, n_queries, n_keys, n_heads, d_k, d_v, np.float32)
    scale = 1.0 / np.sqrt(d_k)
    out = np.full((n_queries, n_heads, d_v), np.nan, np.float32)
    lse = np.full((n_heads, n_queries), np.nan, np.float32)
    assert downstream.heads_f32(q, k, v, out, lse, scale, causal, 2) == 0
    qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
    assert_matches_reference(heads_first(out), None, qh, kh, vh, causal=causal)
    np.testing.assert_allclose(lse, reference_lse(qh, kh, causal), rtol=0, atol=2e-5)
    # the same driver as the Python API on each head alone: the same bits
    for h in range(n_heads):
        expected, expected_lse = ca.attention(qh[h], kh[h], vh[h], causal=causal,
                                              return_lse=True)
        assert_bitwise_equal(out[:, h], expected)
        assert_bitwise_equal(lse[h], expected_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float64_with_scores(downstream, causal):
    n_queries, n_keys, n_heads, d_k, d_v = 70, 300, 3, 16, 8
    q, k, v = interleaved(2, n_queries, n_keys, n_heads, d_k, d_v, np.float64)
    out = np.full((n_queries, n_heads, d_v), np.nan)
    # a row stride past the row: the padding must stay untouched
    scores_padded = np.full((n_heads, n_queries, n_keys + 5), -7.0)
    assert downstream.heads_f64(q, k, v, out, scores_padded, 0.25, causal, 2) == 0
    qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
    scores = scores_padded[..., :n_keys]
    assert_matches_reference(heads_first(out), scores, qh, kh, vh, causal=causal, scale=0.25)
    assert np.all(scores_padded[..., n_keys:] == -7.0)
    expected, expected_scores = ca.attention(qh, kh, vh, causal=causal, scale=0.25,
                                             return_scores=True)
    assert_bitwise_equal(heads_first(out), expected)
    assert_bitwise_equal(scores, expected_scores)


@pytest.mark.parametrize("shape", [(200, 700, 4, 32, 32), (1, 4096, 2, 64, 64)], ids=str)
def test_thread_counts_give_the_same_bits(downstream, shape):
    n_queries, n_keys, n_heads, d_k, d_v = shape
    q, k, v = interleaved(3, n_queries, n_keys, n_heads, d_k, d_v, np.float32)
    results = []
    # threads of the caller's prange, and threads of each call
    for prange_threads, call_threads in ((1, 1), (2, 1), (3, 1), (1, 2), (1, 3)):
        out = np.empty((n_queries, n_heads, d_v), np.float32)
        lse = np.empty((n_heads, n_queries), np.float32)
        assert downstream.heads_f32(q, k, v, out, lse, 0.2, True, prange_threads,
                                    call_threads) == 0
        results.append(out)
    for out in results[1:]:
        assert_bitwise_equal(out, results[0])


@pytest.mark.parametrize("with_scales", [True, False], ids=["scales", "none"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("shape", [(1, 300, 4, 64, 64), (37, 300, 4, 16, 24)], ids=str)
def test_fp8_heads_in_prange(downstream, shape, fmt, with_scales):
    """attention_f32_fp8: fp8 codes (bytes) of K and V with a float32 scale
    per row, or none, against the float64 reference over codes times
    scales."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = np.dtype(getattr(ml_dtypes, fmt))
    n_queries, n_keys, n_heads, d_k, d_v = shape
    q, k, v = interleaved(4, n_queries, n_keys, n_heads, d_k, d_v, np.float32)
    # with scales: one per row (max |row| / the format's largest); without:
    # the codes hold the values themselves
    rule = "row" if with_scales else np.float32(1)
    k8, k_scale = ca.quantize_kv_fp8(heads_first(k), dtype, rule)
    v8, v_scale = ca.quantize_kv_fp8(heads_first(v), dtype, rule)
    # (heads, keys) rows of scales, as the downstream call reads them
    k_scale = np.ascontiguousarray(np.broadcast_to(k_scale, k8.shape[:-1]))
    v_scale = np.ascontiguousarray(np.broadcast_to(v_scale, v8.shape[:-1]))
    out = np.full((n_queries, n_heads, d_v), np.nan, np.float32)
    assert downstream.heads_f32_fp8(
        q, np.ascontiguousarray(heads_first(k8)).view(np.uint8), k_scale,
        np.ascontiguousarray(heads_first(v8)).view(np.uint8), v_scale, out,
        0 if fmt == "float8_e4m3fn" else 1, with_scales, 0.25, True, 2) == 0
    kd = k8.astype(np.float64) * k_scale[..., None]
    vd = v8.astype(np.float64) * v_scale[..., None]
    assert_matches_reference(heads_first(out), None, heads_first(q), kd, vd, causal=True,
                             scale=0.25)


def test_fp8_unknown_format_is_refused(downstream):
    header = (Path(ca.get_include()) / "cattention.h").read_text()
    assert "#define CATTENTION_ERR_FORMAT 7" in header
    q = np.ones((2, 1, 4), np.float32)
    codes = np.zeros((2, 1, 4), np.uint8)
    out = np.full((2, 1, 4), -7.0, np.float32)
    scales = np.ones((1, 2), np.float32)
    assert downstream.heads_f32_fp8(q, codes, scales, codes, scales, out, 2, True, 1.0,
                                    False, 1) == 7
    assert np.all(out == -7)


@pytest.mark.parametrize("case, status", [
    ("ok", "CATTENTION_OK"),
    ("scores only", "CATTENTION_OK"),
    ("negative size", "CATTENTION_ERR_SIZE"),
    ("null query", "CATTENTION_ERR_POINTER"),
    ("null key", "CATTENTION_ERR_POINTER"),
    ("null value", "CATTENTION_ERR_POINTER"),
    ("no output", "CATTENTION_ERR_POINTER"),
    ("short output stride", "CATTENTION_ERR_STRIDE"),
    ("short scores stride", "CATTENTION_ERR_STRIDE"),
    ("nan scale", "CATTENTION_ERR_SCALE"),
    # a float32 call computes in float: 1e39 would make every logit inf (NaN
    # weights), 1e-46 would round to 0 (uniform weights)
    ("scale beyond float", "CATTENTION_ERR_SCALE"),
    ("scale below float", "CATTENTION_ERR_SCALE"),
    ("float64 scale beyond float", "CATTENTION_OK"),
    ("unknown flag", "CATTENTION_ERR_FLAGS"),
])
def test_status_codes(downstream, case, status):
    header = (Path(ca.get_include()) / "cattention.h").read_text()
    codes = {line.split()[1]: int(line.split()[2]) for line in header.splitlines()
             if line.startswith("#define CATTENTION_") and len(line.split()) >= 3
             and line.split()[2].isdigit()}
    code, untouched = downstream.status_of(case)
    assert code == codes[status]
    # a rejected call writes nothing; an accepted one writes its outputs
    assert untouched == (status != "CATTENTION_OK")


def test_pxd_and_header_ship_with_the_package():
    package = Path(ca.__file__).parent
    assert (package / "cython_attention.pxd").is_file()
    assert (package / "_driver" / "extension.pxd").is_file()  # the driver contract it cimports
    assert Path(ca.get_include()).is_absolute()
    assert (Path(ca.get_include()) / "cattention.h").is_file()
