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
