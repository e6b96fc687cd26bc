"""Attention variants: grouped-query attention (enable_gqa)."""

import numpy as np
import pytest

import cattention as ca
from reference import (
    assert_bitwise_equal,
    assert_matches_reference,
    make_qkv,
    reference_lse,
    shapes_regex,
)


def repeat_kv(x, group):
    """K or V with each head repeated for its group of query heads."""
    return np.repeat(x, group, axis=-3)


# T = 1 and 5 take the direct path (K/V read in place), 100 the packed one
@pytest.mark.parametrize("T,S", [(1, 300), (5, 7), (100, 300), (37, 19)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_gqa_matches_reference_and_repeated_kv(dtype, T, S, causal, heads, kv_heads):
    group = heads // kv_heads
    q, k, v = make_qkv(50, (2, heads, T, 16), (2, kv_heads, S, 16), (2, kv_heads, S, 5), dtype)
    attn, scores, lse = ca.attention(q, k, v, causal=causal, enable_gqa=True,
                                     return_scores=True, return_lse=True)
    k_full, v_full = repeat_kv(k, group), repeat_kv(v, group)
    assert attn.shape == (2, heads, T, 5) and scores.shape == (2, heads, T, S)
    assert lse.shape == (2, heads, T)
    assert_matches_reference(attn, scores, q, k_full, v_full, causal)
    # the same K/V rows are read, so the result is bitwise that of repeating them
    assert_bitwise_equal(attn, ca.attention(q, k_full, v_full, causal=causal,
                                            return_scores=True)[0])
    assert_bitwise_equal(ca.attention(q, k, v, causal=causal, enable_gqa=True),
                         ca.attention(q, k_full, v_full, causal=causal))
    np.testing.assert_allclose(lse, reference_lse(q, k_full, causal),
                               rtol=1e-6 if dtype == np.float32 else 1e-13)


def test_gqa_with_per_head_masks(dtype):
    q, k, v = make_qkv(51, (2, 6, 4, 8), (2, 3, 9, 8), (2, 3, 9, 3), dtype)
    rng = np.random.default_rng(0)
    for mask_shape in [(6, 1, 9), (2, 6, 4, 9), (2, 1, 4, 9), (4, 9)]:
        mask = rng.random(mask_shape) > 0.3
        attn = ca.attention(q, k, v, mask=mask, enable_gqa=True)
        assert_matches_reference(attn, None, q, repeat_kv(k, 2), repeat_kv(v, 2), mask=mask)
    bias = np.where(rng.random((6, 4, 9)) > 0.3, 0.25, -np.inf)
    attn = ca.attention(q, k, v, mask=bias, enable_gqa=True)
    assert_matches_reference(attn, None, q, repeat_kv(k, 2), repeat_kv(v, 2), mask=bias)


def test_gqa_attention_scores(dtype):
    q, k, _ = make_qkv(52, (3, 4, 6, 8), (3, 2, 10, 8), (1, 1), dtype)
    scores = ca.attention_scores(q, k, causal=True, enable_gqa=True)
    assert_bitwise_equal(scores, ca.attention_scores(q, repeat_kv(k, 2), causal=True))


def test_gqa_errors():
    q = np.ones((2, 6, 3, 8))
    with pytest.raises(ValueError, match=shapes_regex((2, 6, 3, 8), (2, 4, 5, 8))):
        ca.attention(q, np.ones((2, 4, 5, 8)), np.ones((2, 4, 5, 2)), enable_gqa=True)
    with pytest.raises(ValueError, match=r"head axis.*\(3, 8\)"):
        ca.attention(np.ones((3, 8)), np.ones((5, 8)), np.ones((5, 2)), enable_gqa=True)
    with pytest.raises(ValueError, match=shapes_regex((2, 3, 5, 8), (2, 2, 5, 2))):
        ca.attention(q, np.ones((2, 3, 5, 8)), np.ones((2, 2, 5, 2)), enable_gqa=True)
    with pytest.raises(ValueError, match=r"mask of shape \(4, 3, 5\)"):
        ca.attention(q, np.ones((2, 3, 5, 8)), np.ones((2, 3, 5, 2)),
                     mask=np.ones((4, 3, 5), bool), enable_gqa=True)


def test_gqa_matches_torch_enable_gqa():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    q, k, v = make_qkv(53, (2, 8, 33, 16), (2, 2, 40, 16), (2, 2, 40, 16), np.float64)
    ours = ca.attention(q, k, v, enable_gqa=True)
    with torch.no_grad():
        theirs = F.scaled_dot_product_attention(
            torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
            enable_gqa=True).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
