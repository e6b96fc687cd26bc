"""Memory layouts: any strides, alignment or flags give BITWISE the contiguous result."""

import numpy as np
import pytest

import cattention as ca
from reference import assert_bitwise_equal, make_qkv

# ---------------------------------------------------------------------------
# Layout makers.  Each takes a C-contiguous array x and returns
# (expected_values, odd_layout): two arrays holding the same values, the first
# C-contiguous, the second in the layout under test.
# ---------------------------------------------------------------------------


def transposed(x):
    """Last two axes swapped in memory (the ``np.ascontiguousarray(x.T).T`` trick)."""
    y = np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)
    assert not y.flags.c_contiguous or min(x.shape[-2:]) <= 1
    return x, y


def fortran(x):
    y = np.asfortranarray(x)
    return x, y


def stepped(x):
    """A view taking every 2nd (last axis) / 3rd (other axes) element of a bigger buffer."""
    steps = (3,) * (x.ndim - 1) + (2,)
    big = np.full(tuple(n * s + 1 for n, s in zip(x.shape, steps)), np.nan
                  if x.dtype.kind == "f" else 0, dtype=x.dtype)
    y = big[tuple(slice(1, None, s) for s in steps)]
    y[...] = x
    return x, y


def reversed_(x):
    """Negative strides on every axis: x[::-1, ::-1] of a reversed copy."""
    flip = (slice(None, None, -1),) * x.ndim
    y = np.ascontiguousarray(x[flip])[flip]
    assert all(s < 0 for s, n in zip(y.strides, y.shape) if n > 1)
    return x, y


def reversed_rows(x):
    """Negative stride on the row axis only."""
    y = np.ascontiguousarray(x[..., ::-1, :])[..., ::-1, :]
    return x, y


def readonly(x):
    y = x.copy()
    y.setflags(write=False)
    return x, y


def broadcast_batch(x):
    """Leading axis with stride 0 (np.broadcast_to of a single batch entry)."""
    y = np.broadcast_to(x[:1], x.shape)
    return np.ascontiguousarray(y), y


def broadcast_rows(x):
    """Row axis with stride 0: every row the same."""
    y = np.broadcast_to(x[..., :1, :], x.shape)
    return np.ascontiguousarray(y), y


def broadcast_cols(x):
    """Last axis with stride 0: every column the same."""
    y = np.broadcast_to(x[..., :1], x.shape)
    return np.ascontiguousarray(y), y


def _from_buffer(x, offset, writable=True):
    raw = np.zeros(x.nbytes + offset + 16, dtype=np.uint8)
    raw[offset:offset + x.nbytes] = np.frombuffer(x.tobytes(), dtype=np.uint8)
    buf = raw if writable else raw.tobytes()
    y = np.frombuffer(buf, dtype=x.dtype, count=x.size, offset=offset).reshape(x.shape)
    return y


def misaligned_1(x):
    """Byte offset 1: misaligned for every multi-byte dtype."""
    y = _from_buffer(x, 1)
    assert x.dtype.itemsize == 1 or not y.flags.aligned
    return x, y


def misaligned_half(x):
    """Byte offset of half the item size (4 for float64: misaligned)."""
    y = _from_buffer(x, max(x.dtype.itemsize // 2, 1))
    assert x.dtype.itemsize == 1 or not y.flags.aligned
    return x, y


def misaligned_readonly(x):
    """Misaligned and read-only (np.frombuffer on bytes) at once."""
    y = _from_buffer(x, 3, writable=False)
    assert not y.flags.writeable
    assert x.dtype.itemsize == 1 or not y.flags.aligned
    return x, y


def misaligned_stepped(x):
    """Misaligned base pointer plus non-unit, non-multiple-of-itemsize-friendly steps."""
    _, stepped_view = stepped(x)
    base = stepped_view.base if stepped_view.base is not None else stepped_view
    raw = _from_buffer(np.ascontiguousarray(base), 1)
    steps = (3,) * (x.ndim - 1) + (2,)
    y = raw[tuple(slice(1, None, s) for s in steps)]
    assert x.dtype.itemsize == 1 or not y.flags.aligned
    return x, y


LAYOUTS = {
    "transposed": transposed,
    "fortran": fortran,
    "stepped": stepped,
    "reversed": reversed_,
    "reversed_rows": reversed_rows,
    "readonly": readonly,
    "broadcast_batch": broadcast_batch,
    "broadcast_rows": broadcast_rows,
    "broadcast_cols": broadcast_cols,
    "misaligned_1": misaligned_1,
    "misaligned_half": misaligned_half,
    "misaligned_readonly": misaligned_readonly,
    "misaligned_stepped": misaligned_stepped,
}

B, T, S, D_K, D_V = 2, 19, 23, 12, 7


def _inputs(dtype, seed=5):
    q, k, v = make_qkv(seed, (B, T, D_K), (B, S, D_K), (B, S, D_V), dtype)
    rng = np.random.default_rng(seed + 1)
    mask = rng.standard_normal((B, T, S)).astype(dtype)
    mask[rng.random((B, T, S)) < 0.2] = -np.inf
    return {"q": q, "k": k, "v": v, "mask": mask}


def _run(arrays, causal):
    attn, scores = ca.attention(arrays["q"], arrays["k"], arrays["v"],
                                mask=arrays["mask"], causal=causal,
                                return_scores=True)
    attn_only = ca.attention(arrays["q"], arrays["k"], arrays["v"],
                             mask=arrays["mask"], causal=causal)
    scores_only = ca.attention_scores(arrays["q"], arrays["k"],
                                      mask=arrays["mask"], causal=causal)
    return attn, scores, attn_only, scores_only


def _apply(layout, arrays, targets):
    expected, odd = dict(arrays), dict(arrays)
    for name in targets:
        expected[name], odd[name] = LAYOUTS[layout](arrays[name])
    return expected, odd


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("target", ["q", "k", "v", "mask", "all"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_bitwise_equal_to_contiguous(dtype, layout, target, causal):
    arrays = _inputs(dtype)
    targets = ["q", "k", "v", "mask"] if target == "all" else [target]
    expected, odd = _apply(layout, arrays, targets)
    snapshot = {name: odd[name].copy() for name in targets}

    for got, want in zip(_run(odd, causal), _run(expected, causal)):
        assert_bitwise_equal(got, want)
    for name in targets:  # inputs are never written to
        assert_bitwise_equal(odd[name], snapshot[name])


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "broadcast_batch"])
def test_layout_2d_inputs(dtype, layout):
    arrays = {name: x[0] for name, x in _inputs(dtype, seed=9).items()}
    expected, odd = _apply(layout, arrays, ["q", "k", "v", "mask"])
    for got, want in zip(_run(odd, True), _run(expected, True)):
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_bool_mask(layout):
    arrays = _inputs(np.float64, seed=13)
    arrays["mask"] = np.random.default_rng(14).random((B, T, S)) < 0.7
    expected, odd = _apply(layout, arrays, ["mask"])
    for got, want in zip(_run(odd, False), _run(expected, False)):
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("in_dtype", [np.float16, np.int32],
                         ids=["float16", "int32"])
def test_layout_converted_dtypes(layout, in_dtype):
    """Inputs that must be converted (float16 -> float32, int -> float64)."""
    arrays = _inputs(np.float64, seed=17)
    for name in ("q", "k", "v"):
        x = arrays[name]
        arrays[name] = (x * 3).astype(in_dtype) if in_dtype == np.int32 else x.astype(in_dtype)
    arrays["mask"] = np.random.default_rng(18).random((B, T, S)) < 0.7
    expected, odd = _apply(layout, arrays, ["q", "k", "v"])
    for got, want in zip(_run(odd, True), _run(expected, True)):
        assert_bitwise_equal(got, want)


def test_broadcast_view_equals_leading_dim_broadcasting(dtype):
    """k/v broadcast by np.broadcast_to vs passed with a size-1 batch dim."""
    q, k, v = make_qkv(21, (3, T, D_K), (1, S, D_K), (1, S, D_V), dtype)
    attn_a, scores_a = ca.attention(q, k, v, return_scores=True)
    attn_b, scores_b = ca.attention(q, np.broadcast_to(k, (3, S, D_K)),
                                    np.broadcast_to(v, (3, S, D_V)),
                                    return_scores=True)
    assert_bitwise_equal(attn_a, attn_b)
    assert_bitwise_equal(scores_a, scores_b)


def test_outputs_are_fresh_writable_arrays(dtype):
    arrays = _inputs(dtype)
    attn, scores = ca.attention(arrays["q"], arrays["k"], arrays["v"],
                                return_scores=True)
    for out in (attn, scores):
        assert out.flags.writeable
        for x in arrays.values():
            assert not np.shares_memory(out, x)
