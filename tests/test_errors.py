"""Error paths: every bad input raises a precise exception with a useful message."""

import numpy as np
import pytest

import cattention as ca
from reference import assert_matches_reference, make_qkv, shapes_regex

SUPPORTED_DTYPES_RE = r"(?s)(?=.*float32)(?=.*float64)"


def _qkv(q_shape, k_shape, v_shape):
    return make_qkv(0, q_shape, k_shape, v_shape)


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("q_shape,k_shape,v_shape,bad", [
    ((8,), (5, 8), (5, 3), (8,)),
    ((3, 8), (8,), (5, 3), (8,)),
    ((3, 8), (5, 8), (5,), (5,)),
    ((), (5, 8), (5, 3), ()),
])
def test_ndim_below_two(q_shape, k_shape, v_shape, bad):
    q, k, v = _qkv(q_shape, k_shape, v_shape)
    with pytest.raises(ValueError, match=shapes_regex(bad)):
        ca.attention(q, k, v)
    if v_shape == (5, 3):  # attention_scores only sees q and k
        with pytest.raises(ValueError, match=shapes_regex(bad)):
            ca.attention_scores(q, k)


@pytest.mark.parametrize("q_shape,k_shape", [
    ((3, 8), (5, 7)),
    ((2, 3, 8), (2, 5, 9)),
    ((3, 1), (5, 8)),
])
def test_dk_mismatch_between_q_and_k(q_shape, k_shape):
    q, k, v = _qkv(q_shape, k_shape, k_shape[:-1] + (4,))
    with pytest.raises(ValueError, match=shapes_regex(q_shape, k_shape)):
        ca.attention(q, k, v)
    with pytest.raises(ValueError, match=shapes_regex(q_shape, k_shape)):
        ca.attention_scores(q, k)


@pytest.mark.parametrize("k_shape,v_shape", [
    ((5, 8), (6, 4)),
    ((2, 5, 8), (2, 4, 8)),
    ((5, 8), (0, 8)),
])
def test_s_mismatch_between_k_and_v(k_shape, v_shape):
    q, k, v = _qkv((3, 8), k_shape, v_shape)
    with pytest.raises(ValueError, match=shapes_regex(k_shape, v_shape)):
        ca.attention(q, k, v)
    with pytest.raises(ValueError, match=shapes_regex(k_shape, v_shape)):
        ca.attention(q, k, v, return_scores=True)


@pytest.mark.parametrize("q_shape,k_shape,v_shape,offenders", [
    ((2, 3, 8), (3, 5, 8), (3, 5, 4), [(2, 3, 8), (3, 5, 8)]),
    ((2, 3, 8), (2, 5, 8), (3, 5, 4), [(2, 5, 8), (3, 5, 4)]),
    ((4, 2, 3, 8), (3, 1, 5, 8), (5, 4), [(4, 2, 3, 8), (3, 1, 5, 8)]),
])
def test_unbroadcastable_batch(q_shape, k_shape, v_shape, offenders):
    q, k, v = _qkv(q_shape, k_shape, v_shape)
    with pytest.raises(ValueError, match=shapes_regex(*offenders)):
        ca.attention(q, k, v)


def test_unbroadcastable_batch_attention_scores():
    q, k, _ = _qkv((2, 3, 8), (3, 5, 8), (5, 4))
    with pytest.raises(ValueError, match=shapes_regex((2, 3, 8), (3, 5, 8))):
        ca.attention_scores(q, k)


@pytest.mark.parametrize("mask_shape", [
    (4, 5),        # T mismatch (T = 3)
    (3, 6),        # S mismatch (S = 5)
    (6,),          # S mismatch, 1-D
    (3, 3, 5),     # batch mismatch (batch = 2)
    (2, 1, 3, 4),
])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_unbroadcastable_mask(mask_shape, kind):
    q, k, v = _qkv((2, 3, 8), (2, 5, 8), (2, 5, 4))
    mask = np.ones(mask_shape, dtype=bool if kind == "bool" else np.float64)
    with pytest.raises(ValueError, match=shapes_regex(mask_shape)):
        ca.attention(q, k, v, mask=mask)
    with pytest.raises(ValueError, match=shapes_regex(mask_shape)):
        ca.attention_scores(q, k, mask=mask)


# ---------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------

BAD_DTYPE_MAKERS = {
    "complex64": lambda x: x.astype(np.complex64),
    "complex128": lambda x: x.astype(np.complex128),
    "object": lambda x: x.astype(object),
    "str": lambda x: x.astype(str),
    "bytes": lambda x: x.astype(np.bytes_),
}


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", list(BAD_DTYPE_MAKERS))
def test_unsupported_dtype(bad, which):
    arrays = dict(zip("qkv", _qkv((3, 4), (5, 4), (5, 2))))
    arrays[which] = BAD_DTYPE_MAKERS[bad](arrays[which])
    with pytest.raises(TypeError, match=SUPPORTED_DTYPES_RE):
        ca.attention(arrays["q"], arrays["k"], arrays["v"])
    if which != "v":
        with pytest.raises(TypeError, match=SUPPORTED_DTYPES_RE):
            ca.attention_scores(arrays["q"], arrays["k"])


@pytest.mark.parametrize("mask_dtype", [np.int8, np.int32, np.int64, np.uint8])
def test_integer_mask_is_type_error(mask_dtype):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    mask = np.ones((3, 5), dtype=mask_dtype)
    with pytest.raises(TypeError, match=r"(?i)mask"):
        ca.attention(q, k, v, mask=mask)
    with pytest.raises(TypeError, match=r"(?i)mask"):
        ca.attention_scores(q, k, mask=mask)


# ---------------------------------------------------------------------------
# scale
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [np.inf, -np.inf, np.nan, np.float32(np.nan)],
                         ids=["inf", "-inf", "nan", "float32-nan"])
def test_non_finite_scale(scale):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(ValueError, match=r"(?i)scale"):
        ca.attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match=r"(?i)scale"):
        ca.attention_scores(q, k, scale=scale)


def test_zero_dk_without_scale():
    q, k, v = _qkv((3, 0), (5, 0), (5, 2))
    with pytest.raises(ValueError, match=r"(?i)d_k|scale"):
        ca.attention(q, k, v)


# ---------------------------------------------------------------------------
# Signature
# ---------------------------------------------------------------------------

def test_options_are_keyword_only():
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(TypeError, match=r"(?i)positional|argument"):
        ca.attention(q, k, v, True)
    with pytest.raises(TypeError, match=r"(?i)positional|argument"):
        ca.attention_scores(q, k, True)


def test_unknown_keyword():
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(TypeError, match=r"(?i)keyword|argument|casual"):
        ca.attention(q, k, v, casual=True)


# ---------------------------------------------------------------------------
# Arguments that are not arrays, options of the wrong kind
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_none_operand_names_it(which):
    arrays = dict(zip("qkv", _qkv((3, 4), (5, 4), (5, 2))))
    arrays[which] = None
    with pytest.raises((TypeError, ValueError), match=rf"^{which} must be an array, got None"
                       if which != "v" else r"v is required"):
        ca.attention(arrays["q"], arrays["k"], arrays["v"])
    if which != "v":
        with pytest.raises(TypeError, match=rf"^{which} must be an array, got None"):
            ca.attention_scores(arrays["q"], arrays["k"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_ragged_list_names_the_argument(which):
    arrays = dict(zip("qkv", _qkv((3, 4), (5, 4), (5, 2))))
    arrays[which] = [[1.0, 2.0], [3.0]]
    with pytest.raises(ValueError, match=rf"^{which} is not a regular array"):
        ca.attention(arrays["q"], arrays["k"], arrays["v"])


@pytest.mark.parametrize("value", [np.array([True, False]), "no", "", 1, 0, None, 1.0],
                         ids=["array", "str-no", "str-empty", "int1", "int0", "None",
                              "float"])
@pytest.mark.parametrize("flag", ["causal", "return_scores", "return_lse", "enable_gqa"])
def test_flags_must_be_bools(flag, value):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
        ca.attention(q, k, v, **{flag: value})
    if flag in ("causal", "enable_gqa"):
        with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
            ca.attention_scores(q, k, **{flag: value})


def test_numpy_bools_are_bools():
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    assert_equal = np.testing.assert_array_equal
    assert_equal(ca.attention(q, k, v, causal=np.True_), ca.attention(q, k, v, causal=True))


@pytest.mark.parametrize("n", [2**31, 2**63, 10**30])
def test_huge_num_threads_names_the_argument(n):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    with pytest.raises(ValueError, match=r"^num_threads must be at most 2147483647"):
        ca.attention(q, k, v, num_threads=n)
    with pytest.raises(ValueError, match=r"^num_threads must be at most"):
        ca.set_num_threads(n)
    with pytest.raises(ValueError, match=r"^num_threads must be at most"):
        with ca.limit_threads(n):
            pass


@pytest.mark.parametrize("scale", [1e300, -1e39, 1e-50, 3.5e38])
def test_scale_float32_cannot_hold_is_refused(scale):
    q, k, v = _qkv((3, 4), (5, 4), (5, 2))
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"scale .* not representable in float32"):
        ca.attention(q32, k32, v32, scale=scale)
    with pytest.raises(ValueError, match=r"scale .* not representable in float32"):
        ca.attention_scores(q32, k32, scale=scale)
    # float64 inputs hold it, and give a number where the docs promise one
    out = ca.attention(q, k, v, scale=1e-50 if scale == 1e-50 else 1e30)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("n_queries", [1, 9])
def test_dot_product_beyond_float32_is_a_nan_row_as_documented(n_queries):
    # q.k = 5.8e38 overflows float32 before the scale (1/8) would bring it
    # to 7.2e37: the docs say such a row is NaN; rows with finite dot
    # products are not touched by it
    q = np.zeros((n_queries, 64), np.float32)
    q[0] = 3e18
    k = np.zeros((3, 64), np.float32)
    k[0] = 3e18
    v = np.arange(9, dtype=np.float32).reshape(3, 3)
    out = ca.attention(q, k, v)
    assert np.all(np.isnan(out[0]))
    assert_matches_reference(out[1:], None, q[1:], k, v)
    # the same logits from dot products float32 holds are a number
    out = ca.attention(q / np.float32(8), k, v, scale=1.0)
    assert_matches_reference(out, None, q / np.float32(8), k, v, scale=1.0)


@pytest.mark.parametrize("scale", [0.0, -0.0, 3.0e38, -3.0e38, 1.5e-45, -2.0])
def test_scale_at_float32_limits_is_accepted(scale):
    q, k, v = (x.astype(np.float32) for x in _qkv((3, 4), (5, 4), (5, 2)))
    if abs(scale) > 1:
        # logits must stay finite in float32 (documented): zero queries keep them 0
        q = np.zeros_like(q)
    out = ca.attention(q, k, v, scale=scale)
    assert_matches_reference(out, None, q, k, v, scale=scale)


def test_fewer_kv_heads_without_enable_gqa_hints_at_it():
    q, k, v = _qkv((2, 8, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3))
    with pytest.raises(ValueError, match=r"batch dimensions.*pass enable_gqa=True"):
        ca.attention(q, k, v)
    with pytest.raises(ValueError, match=r"pass enable_gqa=True"):
        ca.attention_scores(q, k)
    # a real mismatch gets no hint
    q, k, v = _qkv((2, 8, 3, 4), (2, 3, 5, 4), (2, 3, 5, 3))
    with pytest.raises(ValueError, match=r"batch dimensions") as info:
        ca.attention(q, k, v)
    assert "enable_gqa" not in str(info.value)
