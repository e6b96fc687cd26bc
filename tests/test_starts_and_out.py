"""kv_starts (left padding: each sequence's first valid key) and out= (ATTN
written into the caller's array, any strides) on every entry point that
takes them, against the float64 reference; errors write nothing."""

import numpy as np
import pytest

import cattention as ca
from reference import (assert_bitwise_equal, assert_matches_reference, make_qkv,
                       reference_attention)


def _grouped(k, v, n_heads):
    """K and V repeated to q's heads, for the reference (it has no groups)."""
    group = n_heads // k.shape[-3]
    return np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)


# (q shape, K/V heads, S, options): prompts and decode, grouped and not,
# the packed path with its key blocks of 256 (starts inside and past one)
STARTS_CASES = {
    "prompt": ((2, 2, 20, 16), 2, 40, dict(causal=True)),
    "long": ((2, 2, 100, 16), 2, 700, dict(causal=True)),
    "decode": ((2, 2, 1, 16), 2, 300, {}),
    "gqa-decode": ((2, 8, 1, 64), 2, 300, dict(enable_gqa=True)),
    "gqa-prompt": ((2, 8, 12, 32), 2, 60, dict(enable_gqa=True, causal=True)),
    "window-alibi": ((2, 2, 20, 16), 2, 50, dict(causal=True, window=(6, 0),
                                                 alibi_slopes=np.array([0.3, 0.7]))),
    "sinks-lengths": ((2, 2, 4, 16), 2, 60, dict(sinks=np.array([0.5, -1.0]),
                                                 kv_lengths=np.array([50, 30]))),
    "scores": ((2, 2, 9, 8), 2, 30, dict(return_scores=True, causal=True)),
}


@pytest.mark.parametrize("case", STARTS_CASES)
def test_kv_starts_match_the_reference(simd, dtype, case):
    q_shape, kv_heads, S, options = STARTS_CASES[case]
    options = dict(options)
    B, H, T, d = q_shape
    q, k, v = make_qkv(31, q_shape, (B, kv_heads, S, d), (B, kv_heads, S, d), dtype)
    # the second sequence's first keys are padding: NaN there takes no part
    starts = np.array([0, S // 3 if S > 2 else 1])
    k[1, :, :starts[1]] = np.nan
    v[1, :, :starts[1]] = np.nan
    return_scores = options.pop("return_scores", False)
    got = ca.attention(q, k, v, kv_starts=starts, return_lse=True,
                       return_scores=return_scores, **options)
    attn, lse = got[0], got[-1]
    ref_options = dict(options)
    ref_k, ref_v = k, v
    if ref_options.pop("enable_gqa", False):
        ref_k, ref_v = _grouped(k, v, H)
    if "kv_lengths" in ref_options:
        ref_options["kv_lengths"] = ref_options["kv_lengths"][:, None]
    assert_matches_reference(attn, got[1] if return_scores else None, q, ref_k, ref_v,
                             kv_starts=starts[:, None], lse=lse, **ref_options)


def test_kv_starts_are_the_padding_mask_and_per_head_starts_too():
    q, k, v = make_qkv(32, (3, 2, 6, 8), (3, 2, 20, 8), (3, 2, 20, 8), np.float32)
    starts = np.array([[0, 4], [7, 7], [19, 20]])     # per (sequence, head)
    mask = np.arange(20) >= starts[..., None, None]
    got = ca.attention(q, k, v, causal=True, kv_starts=starts)
    assert_bitwise_equal(got, ca.attention(q, k, v, causal=True, mask=mask))
    # a start at the end: the rows see no key and are zero
    assert not got[2, 1].any()


def test_kv_starts_past_the_lengths_leave_rows_that_see_no_key():
    q, k, v = make_qkv(33, (2, 1, 3, 8), (2, 1, 10, 8), (2, 1, 10, 8), np.float64)
    out, lse = ca.attention(q, k, v, kv_starts=np.array([6, 0]), kv_lengths=np.array([4, 10]),
                            return_lse=True)
    assert not out[0].any() and np.all(np.isneginf(lse[0]))
    ref, _ = reference_attention(q[1], k[1], v[1])
    np.testing.assert_allclose(out[1], ref, atol=1e-12)


@pytest.mark.parametrize("kv_starts,error,match", [
    (np.array([0, 11]), ValueError, r"kv_starts must lie in \[0, S\] = \[0, 10\]"),
    (np.array([-1, 0]), ValueError, r"kv_starts must lie in \[0, S\]"),
    (np.array([0.5, 1.0]), TypeError, r"kv_starts must be integers"),
    (np.array([1, 2, 3]), ValueError, r"kv_starts of shape \(3,\) is ambiguous"),
])
def test_bad_kv_starts_are_refused(kv_starts, error, match):
    q, k, v = make_qkv(34, (2, 2, 3, 8), (2, 2, 10, 8), (2, 2, 10, 8), np.float32)
    with pytest.raises(error, match=match):
        ca.attention(q, k, v, kv_starts=kv_starts)


def test_kv_starts_in_a_kv_cache_and_in_pages(simd):
    rng = np.random.default_rng(35)
    B, H, H_kv, d, T = 2, 4, 2, 16, 3
    k_cache = rng.standard_normal((B, H_kv, 64, d)).astype(np.float32)
    v_cache = rng.standard_normal((B, H_kv, 64, d)).astype(np.float32)
    q = rng.standard_normal((B, H, T, d)).astype(np.float32)
    new = rng.standard_normal((B, H_kv, T, d)).astype(np.float32)
    starts = np.array([5, 0])
    lengths = np.array([20, 9])
    out = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, new, kv_starts=starts)
    for b in range(B):
        n = int(lengths[b])
        keys, values = _grouped(k_cache[b, :, :n], v_cache[b, :, :n], H)
        assert_matches_reference(out[b], None, q[b], keys[:, starts[b]:], values[:, starts[b]:],
                                 causal=True)
    # the same keys in shuffled pages of 4 rows, padded and packed queries
    page_size = 4
    table = rng.permutation(2 * 16).reshape(2, 16)
    k_pages = np.zeros((32, H_kv, page_size, d), np.float32)
    v_pages = np.zeros((32, H_kv, page_size, d), np.float32)
    for b in range(B):
        pos = np.arange(64)
        k_pages[table[b, pos // page_size], :, pos % page_size] = k_cache[b].transpose(1, 0, 2)
        v_pages[table[b, pos // page_size], :, pos % page_size] = v_cache[b].transpose(1, 0, 2)
    paged = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                            kv_starts=starts)
    np.testing.assert_allclose(paged, out, atol=2e-6)
    packed = ca.attention_with_paged_kvcache(
        q.transpose(0, 2, 1, 3).reshape(B * T, H, d), k_pages, v_pages, table, lengths.copy(),
        kv_starts=starts, cu_seqlens_q=np.array([0, T, 2 * T]))
    assert_bitwise_equal(packed.reshape(B, T, H, d).transpose(0, 2, 1, 3),
                         np.ascontiguousarray(paged))


# ---------------------------------------------------------------- out=

def _model_layout_out(shape, dtype):
    """out= as models want ATTN: a (B, T, H, d) array seen as (B, H, T, d)."""
    B, H, T, d = shape
    return np.full((B, T, H, d), 7, dtype).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("case", [
    ((2, 4, 9, 16), 4, {}),
    ((2, 8, 1, 64), 2, dict(enable_gqa=True)),       # stacked decode rows
    ((2, 8, 3, 32), 2, dict(enable_gqa=True)),       # stacked, T > 1
    ((2, 8, 20, 32), 2, dict(enable_gqa=True, causal=True, kv_starts=np.array([0, 5]))),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_out_is_written_and_bitwise_the_call_without_it(simd, case, dtype):
    q_shape, kv_heads, options = case
    B, H, T, d = q_shape
    q, k, v = make_qkv(36, q_shape, (B, kv_heads, 40, d), (B, kv_heads, 40, d), dtype)
    want = ca.attention(q, k, v, **options)
    for out in (_model_layout_out(q_shape, dtype), np.empty(q_shape, dtype),
                np.empty(q_shape + (2,), dtype)[..., 0]):
        got = ca.attention(q, k, v, out=out, **options)
        assert got is out
        assert_bitwise_equal(out, want)


def test_out_on_the_other_entry_points(simd):
    rng = np.random.default_rng(37)
    B, H, H_kv, d, T = 2, 4, 2, 16, 2
    k_cache = rng.standard_normal((B, H_kv, 32, d)).astype(np.float32)
    q = rng.standard_normal((B, H, T, d)).astype(np.float32)
    lengths = np.array([7, 30])
    want = ca.attention_with_kvcache(q, k_cache, k_cache.copy(), lengths.copy())
    out = _model_layout_out(q.shape, np.float32)
    got = ca.attention_with_kvcache(q, k_cache, k_cache.copy(), lengths.copy(), out=out)
    assert got is out
    assert_bitwise_equal(out, want)
    table = np.arange(16).reshape(2, 8)
    pages = k_cache.reshape(B, H_kv, 8, 4, d).transpose(0, 2, 1, 3, 4).reshape(16, H_kv, 4, d)
    want = ca.attention_with_paged_kvcache(q, pages, pages.copy(), table, lengths.copy())
    out = _model_layout_out(q.shape, np.float32)
    assert ca.attention_with_paged_kvcache(q, pages, pages.copy(), table, lengths.copy(),
                                           out=out) is out
    assert_bitwise_equal(out, want)
    x = rng.standard_normal((9, H, d)).astype(np.float32)
    cu = np.array([0, 4, 9])
    want = ca.attention_varlen(x, x, x, cu, cu, causal=True)
    out = np.empty((H, 9, d), np.float32).transpose(1, 0, 2)
    assert ca.attention_varlen(x, x, x, cu, cu, causal=True, out=out) is out
    assert_bitwise_equal(out, want)


def test_bfloat16_out_takes_the_rounded_result():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (a.astype(ml_dtypes.bfloat16)
               for a in make_qkv(38, (1, 2, 5, 16), (1, 2, 9, 16), (1, 2, 9, 16), np.float32))
    want = ca.attention(q, k, v)
    out = _model_layout_out(q.shape, ml_dtypes.bfloat16)
    assert ca.attention(q, k, v, out=out) is out
    assert_bitwise_equal(out, want)


@pytest.mark.parametrize("make_out,error,match", [
    (lambda q: np.empty((2, 2, 5, 7), np.float32), ValueError, r"out has shape \(2, 2, 5, 7\)"),
    (lambda q: np.empty(q.shape, np.float64), TypeError, r"out has dtype float64; the result "
                                                         r"has dtype float32"),
    (lambda q: q, ValueError, r"out and q share memory"),
    (lambda q: np.broadcast_to(np.empty((1, 2, 5, 8), np.float32), q.shape), ValueError,
     r"read-only|zero stride"),
    (lambda q: [[0.0]], TypeError, r"out must be a NumPy array"),
])
def test_bad_out_is_refused_before_anything_is_written(make_out, error, match):
    q, k, v = make_qkv(39, (2, 2, 5, 8), (2, 2, 9, 8), (2, 2, 9, 8), np.float32)
    before = q.copy()
    with pytest.raises(error, match=match):
        ca.attention(q, k, v, out=make_out(q))
    assert_bitwise_equal(q, before)


def test_out_may_not_be_the_cache_it_appends_to():
    k_cache = np.zeros((1, 1, 8, 4), np.float32)
    v_cache = np.zeros((1, 1, 8, 4), np.float32)
    lengths = np.array([2])
    new = np.ones((1, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"out and k_cache share memory"):
        ca.attention_with_kvcache(new, k_cache, v_cache, lengths, new, new,
                                  out=k_cache[:, :, :1])
    assert lengths.tolist() == [2] and not k_cache.any()
