"""Accuracy and semantics of cattention.attention / attention_scores."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cattention as ca
from reference import (
    F32_ABS_CAP,
    F64_ABS_TOL,
    assert_bitwise_equal,
    assert_matches_reference,
    make_qkv,
    max_abs_err,
    reference_attention,
    visible_positions,
)


def run_all(q, k, v, **kw):
    """Call every entry point; check they agree; return (attn, scores).

    * ``attention(return_scores=True)`` returns the tuple ``(ATTN, SCORES)``;
    * ``attention_scores`` equals those SCORES bitwise;
    * ``attention(return_scores=False)`` returns a bare array which is checked
      against the reference by the caller's tolerance rule as well (returned
      third for that purpose).
    """
    out = ca.attention(q, k, v, return_scores=True, **kw)
    assert isinstance(out, tuple) and len(out) == 2
    attn, scores = out
    scores_only = ca.attention_scores(q, k, **kw)
    assert_bitwise_equal(scores_only, scores)
    attn_only = ca.attention(q, k, v, **kw)
    assert isinstance(attn_only, np.ndarray)
    return attn, scores, attn_only


def check_against_reference(q, k, v, f32_abs_cap=F32_ABS_CAP,
                            f64_abs_tol=F64_ABS_TOL, **kw):
    attn, scores, attn_only = run_all(q, k, v, **kw)
    assert_matches_reference(attn, scores, q, k, v, f32_abs_cap=f32_abs_cap,
                             f64_abs_tol=f64_abs_tol, **kw)
    assert_matches_reference(attn_only, None, q, k, v, f32_abs_cap=f32_abs_cap,
                             f64_abs_tol=f64_abs_tol, **kw)
    return attn, scores


# ---------------------------------------------------------------------------
# Main accuracy tests (run on every SIMD path)
# ---------------------------------------------------------------------------

# (T, S, d_k, d_v): odd sizes, T != S both ways, every d_k in {1, 8, 59, 64,
# 128}, d_v != d_k (except one small control case), several row/key blocks.
ACCURACY_CASES = [
    (1, 1, 8, 3),
    (1, 17, 1, 4),
    (3, 1, 59, 64),
    (17, 113, 64, 59),
    (113, 17, 128, 8),
    (113, 203, 8, 128),
    (203, 1025, 59, 17),
    (1025, 203, 64, 1),
    (1023, 1025, 128, 64),
    (1025, 1023, 1, 8),
    (3, 1023, 64, 3),
    (1023, 3, 8, 59),
    (17, 17, 8, 8),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("T,S,d_k,d_v", ACCURACY_CASES,
                         ids=[f"T{c[0]}-S{c[1]}-dk{c[2]}-dv{c[3]}" for c in ACCURACY_CASES])
def test_accuracy_2d(simd, dtype, T, S, d_k, d_v, causal):
    q, k, v = make_qkv(1000 + T + S + d_k, (T, d_k), (S, d_k), (S, d_v), dtype)
    attn, scores = check_against_reference(q, k, v, causal=causal)
    assert attn.shape == (T, d_v)
    assert scores.shape == (T, S)


BATCHED_CASES = [
    # q shape, k shape, v shape, expected batch
    ((2, 3, 37, 16), (2, 3, 53, 16), (2, 3, 53, 24), (2, 3)),
    ((2, 3, 37, 16), (1, 3, 53, 16), (2, 1, 53, 24), (2, 3)),
    ((37, 16), (4, 53, 16), (4, 53, 9), (4,)),
    ((4, 37, 16), (53, 16), (53, 9), (4,)),
    ((5, 1, 60, 8), (1, 2, 29, 8), (29, 8 + 3), (5, 2)),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_shape,k_shape,v_shape,batch", BATCHED_CASES)
def test_accuracy_batched_broadcasting(simd, dtype, q_shape, k_shape, v_shape,
                                       batch, causal):
    q, k, v = make_qkv(7, q_shape, k_shape, v_shape, dtype)
    attn, scores = check_against_reference(q, k, v, causal=causal)
    T, S, d_v = q_shape[-2], k_shape[-2], v_shape[-1]
    assert attn.shape == batch + (T, d_v)
    assert scores.shape == batch + (T, S)


# Many short sequences, each with its own K/V (a BERT-like batch): the driver
# then packs and computes one batch entry at a time on each thread. Keys cross
# a key block in the second case, d_v is not a multiple of the panel width.
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(6, 5, 130, 97, 40, 24), (2, 9, 33, 300, 64, 17)],
                         ids=str)
def test_many_short_sequences(simd, dtype, shape, causal):
    B, H, T, S, d_k, d_v = shape
    q, k, v = make_qkv(8, (B, H, T, d_k), (B, H, S, d_k), (B, H, S, d_v), dtype)
    mask = np.ones((T, S), dtype=bool)
    mask[:, 3] = False
    check_against_reference(q, k, v, causal=causal, mask=mask)
    one = ca.attention(q, k, v, causal=causal, mask=mask, num_threads=1)
    # up to 3 threads each take whole batch entries; 8 threads are too many
    # for that (fewer than 4 entries each) and share K/V packed up front
    for n_threads in (2, 3, 8):
        assert_bitwise_equal(ca.attention(q, k, v, causal=causal, mask=mask,
                                          num_threads=n_threads), one)
    # a NaN in a value that no row attends to changes nothing
    v[1, 2, 3, 5] = np.nan
    assert_bitwise_equal(ca.attention(q, k, v, causal=causal, mask=mask), one)
    # one that rows do attend to reaches exactly those rows, in that column
    v[1, 2, 7, 5] = np.nan
    seen = ca.attention(q, k, v, causal=causal, mask=mask, num_threads=1)
    assert_bitwise_equal(ca.attention(q, k, v, causal=causal, mask=mask, num_threads=8),
                         seen)
    sees_key = visible_positions(T, S, causal, mask)[:, 7]
    assert np.array_equal(np.isnan(seen[1, 2, :, 5]), sees_key)
    assert not np.isnan(np.delete(seen[1, 2], 5, axis=-1)).any()


H, T_M, S_M, D_M, DV_M = 3, 17, 29, 16, 11
MASK_SHAPES = [
    # mask shape, batch shape of the output (q is (H, T, d))
    ((S_M,), (H,)),
    ((T_M, 1), (H,)),
    ((T_M, S_M), (H,)),
    ((1, T_M, S_M), (H,)),
    ((H, 1, S_M), (H,)),
    ((H, T_M, S_M), (H,)),
    ((2, 1, 1, S_M), (2, H)),  # mask leading dims widen the batch
]


def _random_mask(rng, shape, kind, dtype):
    if kind == "bool":
        return rng.random(shape) < 0.7
    mask = rng.standard_normal(shape).astype(dtype)
    mask[rng.random(shape) < 0.25] = -np.inf
    return mask


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("mask_shape,batch", MASK_SHAPES,
                         ids=[str(m[0]) for m in MASK_SHAPES])
def test_accuracy_masks(simd, dtype, kind, mask_shape, batch, causal):
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(12, (H, T_M, D_M), (H, S_M, D_M), (S_M, DV_M), dtype)
    mask = _random_mask(rng, mask_shape, kind, dtype)
    attn, scores = check_against_reference(q, k, v, mask=mask, causal=causal)
    assert attn.shape == batch + (T_M, DV_M)
    assert scores.shape == batch + (T_M, S_M)


def test_mask_batch_dims_broadcast_2d_inputs(dtype):
    """A 3-D mask on 2-D q, k, v gives a batched output."""
    q, k, v = make_qkv(3, (5, 8), (7, 8), (7, 6), dtype)
    mask = np.random.default_rng(4).random((4, 5, 7)) < 0.6
    attn, scores = check_against_reference(q, k, v, mask=mask)
    assert attn.shape == (4, 5, 6)
    assert scores.shape == (4, 5, 7)


@pytest.mark.parametrize("scale", [0.0, -0.5, -3.0, 2, np.float32(0.3), 1e-3],
                         ids=["zero", "neg0.5", "neg3", "int2", "np.float32", "tiny"])
def test_explicit_scale(simd, dtype, scale):
    q, k, v = make_qkv(21, (2, 31, 12), (2, 45, 12), (2, 45, 7), dtype)
    check_against_reference(q, k, v, scale=scale)
    check_against_reference(q, k, v, scale=scale, causal=True)


def test_scale_zero_gives_uniform_weights(dtype):
    q, k, v = make_qkv(22, (9, 4), (13, 4), (13, 5), dtype)
    attn, scores = ca.attention(q, k, v, scale=0.0, causal=True, return_scores=True)
    visible = visible_positions(9, 13, causal=True)
    expected = visible / visible.sum(axis=1, keepdims=True)
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(scores, expected, rtol=0, atol=tol)
    assert np.all(scores[~visible] == 0)


def test_default_scale_is_inverse_sqrt_dk(dtype):
    q, k, v = make_qkv(23, (10, 59), (14, 59), (14, 3), dtype)
    default = ca.attention(q, k, v)
    explicit = ca.attention(q, k, v, scale=1.0 / np.sqrt(59))
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(default, explicit, rtol=0, atol=tol)
    doubled = ca.attention(q, k, v, scale=2.0 / np.sqrt(59))
    assert max_abs_err(default, doubled) > 1e-3  # scale really is used


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_logits_stay_finite(simd, dtype, causal):
    """Q scaled by 300: logits of a few hundred, softmax must not overflow.

    The data is deliberately not unit scale, so the 1e-5 float32 cap is not
    applied (the float32 logit rounding error alone is ~300 x eps); the
    relative 2x-NumPy rule still is.  For float64 the 1e-12 bound is scaled
    by the logit magnitude (300) for the same reason.
    """
    q, k, v = make_qkv(31, (2, 67, 32), (2, 85, 32), (2, 85, 20), dtype)
    q = (q * 300).astype(dtype)
    attn, scores = check_against_reference(q, k, v, causal=causal,
                                           f32_abs_cap=None,
                                           f64_abs_tol=300 * F64_ABS_TOL)
    assert np.all(np.isfinite(attn)) and np.all(np.isfinite(scores))


# ---------------------------------------------------------------------------
# return_scores / attention_scores
# ---------------------------------------------------------------------------

def test_return_scores_tuple_order(dtype):
    # d_v (5) != S (9) so ATTN and SCORES cannot be confused by shape.
    q, k, v = make_qkv(41, (4, 3), (9, 3), (9, 5), dtype)
    result = ca.attention(q, k, v, return_scores=True)
    assert isinstance(result, tuple) and len(result) == 2
    attn, scores = result
    assert attn.shape == (4, 5) and scores.shape == (4, 9)
    assert attn.dtype == dtype and scores.dtype == dtype
    ref_attn, ref_scores = reference_attention(q, k, v)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(attn, ref_attn, rtol=0, atol=tol)
    np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=tol)


def test_return_scores_false_returns_array(dtype):
    q, k, v = make_qkv(42, (4, 3), (9, 3), (9, 5), dtype)
    attn = ca.attention(q, k, v)
    assert isinstance(attn, np.ndarray)
    assert attn.shape == (4, 5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_with_and_without_scores_agree(dtype, causal):
    q, k, v = make_qkv(43, (2, 130, 24), (2, 77, 24), (2, 77, 10), dtype)
    mask = np.random.default_rng(44).random((130, 77)) < 0.8
    with_scores, _ = ca.attention(q, k, v, causal=causal, mask=mask,
                                  return_scores=True)
    without = ca.attention(q, k, v, causal=causal, mask=mask)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(without, with_scores, rtol=0, atol=tol)
    assert_matches_reference(without, None, q, k, v, causal=causal, mask=mask)


@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_scores_bitwise_equal_to_returned_scores(simd, dtype, causal, kind):
    rng = np.random.default_rng(45)
    q, k, v = make_qkv(46, (3, 57, 20), (3, 91, 20), (3, 91, 13), dtype)
    mask = None if kind == "none" else _random_mask(rng, (57, 91), kind, dtype)
    _, scores = ca.attention(q, k, v, causal=causal, mask=mask, return_scores=True)
    assert_bitwise_equal(ca.attention_scores(q, k, causal=causal, mask=mask), scores)
    assert_bitwise_equal(
        ca.attention_scores(q, k, causal=causal, mask=mask, scale=0.7),
        ca.attention(q, k, v, causal=causal, mask=mask, scale=0.7,
                     return_scores=True)[1])


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_scores_rows_sum_to_one_and_zero_where_masked(dtype, kind):
    rng = np.random.default_rng(47)
    T, S = 40, 33
    q, k, v = make_qkv(48, (2, T, 16), (2, S, 16), (2, S, 8), dtype)
    mask = _random_mask(rng, (2, T, S), kind, dtype)
    mask[0, 5] = False if kind == "bool" else -np.inf  # one fully masked row
    attn, scores = ca.attention(q, k, v, mask=mask, causal=True, return_scores=True)
    visible = np.broadcast_to(visible_positions(T, S, True, mask), (2, T, S))
    assert np.all(scores[~visible] == 0)
    assert np.all(scores[visible] > 0)
    has_key = visible.any(axis=-1)
    assert not has_key[0, 5]
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(scores.sum(axis=-1), has_key.astype(float),
                               rtol=0, atol=tol)
    assert np.all(attn[~has_key] == 0)


# ---------------------------------------------------------------------------
# Causal masking
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("T,S", [(17, 17), (17, 113), (113, 17), (1, 17), (17, 1), (5, 5)])
def test_causal_pattern_bottom_right(dtype, T, S):
    q, k, v = make_qkv(51, (T, 8), (S, 8), (S, 6), dtype)
    attn, scores = ca.attention(q, k, v, causal=True, return_scores=True)
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    visible = j <= i + (S - T)
    assert np.all(scores[~visible] == 0)
    assert np.all(scores[visible] > 0)
    empty_rows = ~visible.any(axis=1)
    assert empty_rows.sum() == max(T - S, 0)  # first T - S rows see nothing
    assert np.all(attn[empty_rows] == 0) and np.all(scores[empty_rows] == 0)
    assert_matches_reference(attn, scores, q, k, v, causal=True)


def test_causal_last_query_sees_all_keys(dtype):
    q, k, v = make_qkv(52, (4, 8), (10, 8), (10, 3), dtype)
    causal = ca.attention(q, k, v, causal=True, return_scores=True)
    full = ca.attention(q[-1:], k, v, return_scores=True)
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(causal[0][-1:], full[0], rtol=0, atol=tol)
    np.testing.assert_allclose(causal[1][-1:], full[1], rtol=0, atol=tol)
    # first query (T=4 < S=10) sees keys 0..6 only
    assert np.all(causal[1][0, 7:] == 0) and np.all(causal[1][0, :7] > 0)


def test_causal_combines_with_mask(dtype):
    T, S = 12, 12
    q, k, v = make_qkv(53, (T, 8), (S, 8), (S, 4), dtype)
    mask = np.ones((T, S), dtype=bool)
    mask[:, 0] = False  # nobody may see key 0, so row 0 sees nothing at all
    attn, scores = ca.attention(q, k, v, causal=True, mask=mask, return_scores=True)
    assert np.all(attn[0] == 0) and np.all(scores[0] == 0)
    assert np.all(scores[:, 0] == 0)
    assert np.all(np.triu(scores, 1) == 0)
    assert_matches_reference(attn, scores, q, k, v, causal=True, mask=mask)


# ---------------------------------------------------------------------------
# Fully masked rows, non-finite values in masked keys
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows_are_zero(simd, dtype, kind):
    T, S = 23, 31
    q, k, v = make_qkv(61, (2, T, 8), (2, S, 8), (2, S, 5), dtype)
    rng = np.random.default_rng(62)
    mask = _random_mask(rng, (T, S), kind, dtype)
    hidden = False if kind == "bool" else -np.inf
    mask[[0, 7, T - 1]] = hidden
    attn, scores = ca.attention(q, k, v, mask=mask, return_scores=True)
    assert np.all(np.isfinite(attn)) and np.all(np.isfinite(scores))
    assert np.all(attn[:, [0, 7, T - 1]] == 0)
    assert np.all(scores[:, [0, 7, T - 1]] == 0)
    assert_matches_reference(attn, scores, q, k, v, mask=mask)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_everything_masked(dtype, kind):
    q, k, v = make_qkv(63, (6, 4), (9, 4), (9, 3), dtype)
    mask = np.zeros((9,), dtype=bool) if kind == "bool" else np.full((9,), -np.inf, dtype)
    attn, scores = ca.attention(q, k, v, mask=mask, return_scores=True)
    assert_bitwise_equal(attn, np.zeros((6, 3), dtype))
    assert_bitwise_equal(scores, np.zeros((6, 9), dtype))


BAD_VALUES = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["bool", "additive", "causal+bool"])
def test_nonfinite_in_masked_key_and_value_is_ignored(simd, dtype, kind, bad):
    """Keys hidden from every query: NaN/Inf there must not reach the output.

    The result must be bitwise identical to the run with finite values there.
    """
    T, S = 21, 34
    q, k, v = make_qkv(71, (2, T, 16), (2, S, 16), (2, S, 9), dtype)
    hidden_keys = [0, 13, S - 1]
    keep = np.ones(S, dtype=bool)
    keep[hidden_keys] = False
    mask = keep if kind != "additive" else np.where(keep, 0.0, -np.inf).astype(dtype)
    causal = kind.startswith("causal")

    clean = ca.attention(q, k, v, mask=mask, causal=causal, return_scores=True)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[:, hidden_keys, 3] = bad
    v_bad[:, hidden_keys, :] = bad
    dirty = ca.attention(q, k_bad, v_bad, mask=mask, causal=causal, return_scores=True)
    assert np.all(np.isfinite(dirty[0])) and np.all(np.isfinite(dirty[1]))
    assert_bitwise_equal(dirty[0], clean[0])
    assert_bitwise_equal(dirty[1], clean[1])
    assert_bitwise_equal(ca.attention_scores(q, k_bad, mask=mask, causal=causal),
                         clean[1])


@pytest.mark.parametrize("T,S", [(1, 300), (4, 600), (20, 300), (200, 600), (1, 5000),
                                 (20, 2600), (200, 2600), (4, 20000)])
@pytest.mark.parametrize("poison", ["inf", "overflowing-sum"])
def test_keys_of_zero_weight_before_the_row_maximum_take_no_part(simd, dtype, T, S, poison):
    """Keys whose weight is exactly 0 because a later key's logit is far
    larger (e^-1000 is 0 in either dtype) leave the output alone, even when
    the maximum arrives in a later key block or decode chunk than they do
    and their values hold an inf or sum beyond the dtype's range: the output
    is the last key's value, bitwise that of zeros in their place, on every
    path (with and without SCORES, threads, the KV cache, varlen, pages)."""
    rng = np.random.default_rng(74)
    q = np.ones((T, 1), dtype)
    k = np.zeros((S, 1), dtype)
    k[-1] = 1000.0
    clean = rng.standard_normal((S, 3)).astype(dtype)
    v = clean.copy()
    if poison == "inf":
        v[[0, S // 2], 1] = np.inf
    else:
        v[: S - 1] = np.finfo(dtype).max / 4
    clean[: S - 1] = 0
    expected = np.repeat(clean[-1:], T, axis=0)
    results = {
        "attention": ca.attention(q, k, v, scale=1.0),
        "two threads": ca.attention(q, k, v, scale=1.0, num_threads=2),
        "with SCORES": ca.attention(q, k, v, scale=1.0, return_scores=True)[0],
        "varlen": ca.attention_varlen(q[:, None], k[:, None], v[:, None], [0, T], [0, S],
                                      scale=1.0)[:, 0],
    }
    k_cache = np.zeros((1, 1, S + 8, 1), dtype)
    v_cache = np.zeros((1, 1, S + 8, 3), dtype)
    k_cache[0, 0, :S - T] = k[:S - T]
    v_cache[0, 0, :S - T] = v[:S - T]
    results["KV cache"] = ca.attention_with_kvcache(
        q[None, None], k_cache, v_cache, np.array([S - T]), k[None, None, S - T:],
        v[None, None, S - T:], causal=False, scale=1.0)[0, 0]
    n_pages = -(-S // 16)
    k_pages = np.zeros((n_pages, 1, 16, 1), dtype)
    v_pages = np.zeros((n_pages, 1, 16, 3), dtype)
    k_pages.reshape(-1, 1)[:S] = k
    v_pages.reshape(-1, 3)[:S] = v
    results["pages"] = ca.attention_with_paged_kvcache(
        q[None, None], k_pages, v_pages, np.arange(n_pages)[None], np.array([S]),
        causal=False, scale=1.0)[0, 0]
    for path, got in results.items():
        assert np.all(np.isfinite(got)), path
        assert_bitwise_equal(got, expected)


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_nonfinite_in_causally_hidden_key_is_ignored(simd, dtype, bad):
    """Key S-1 is hidden from every row but the last one under causal masking:
    all other rows must be bitwise identical to the finite run."""
    T = S = 45
    q, k, v = make_qkv(72, (T, 16), (S, 16), (S, 9), dtype)
    clean = ca.attention(q, k, v, causal=True, return_scores=True)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[S - 1, :] = bad
    v_bad[S - 1, :] = bad
    dirty = ca.attention(q, k_bad, v_bad, causal=True, return_scores=True)
    assert np.all(np.isfinite(dirty[0][:-1])) and np.all(np.isfinite(dirty[1][:-1]))
    assert_bitwise_equal(dirty[0][:-1], clean[0][:-1])
    assert_bitwise_equal(dirty[1][:-1], clean[1][:-1])


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_nonfinite_in_per_row_masked_key_is_ignored(simd, dtype, bad):
    """Key 4 is masked for even rows only: those rows must stay untouched."""
    T, S = 10, 12
    q, k, v = make_qkv(73, (T, 6), (S, 6), (S, 5), dtype)
    mask = np.ones((T, S), dtype=bool)
    mask[::2, 4] = False
    clean = ca.attention(q, k, v, mask=mask, return_scores=True)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[4] = bad
    v_bad[4] = bad
    dirty = ca.attention(q, k_bad, v_bad, mask=mask, return_scores=True)
    assert_bitwise_equal(dirty[0][::2], clean[0][::2])
    assert_bitwise_equal(dirty[1][::2], clean[1][::2])


# ---------------------------------------------------------------------------
# Empty sizes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_shape,k_shape,v_shape,attn_shape,scores_shape", [
    ((0, 8), (5, 8), (5, 3), (0, 3), (0, 5)),             # T == 0
    ((2, 0, 8), (2, 5, 8), (2, 5, 3), (2, 0, 3), (2, 0, 5)),
    ((0, 4, 8), (0, 5, 8), (0, 5, 3), (0, 4, 3), (0, 4, 5)),  # batch == 0
    ((0, 4, 8), (1, 5, 8), (5, 3), (0, 4, 3), (0, 4, 5)),     # broadcast to 0
    ((3, 0, 4, 8), (3, 1, 5, 8), (5, 3), (3, 0, 4, 3), (3, 0, 4, 5)),
    ((0, 0, 8), (0, 0, 8), (0, 0, 3), (0, 0, 3), (0, 0, 0)),
    ((4, 8), (5, 8), (5, 0), (4, 0), (4, 5)),             # d_v == 0
])
def test_empty_shapes(dtype, q_shape, k_shape, v_shape, attn_shape, scores_shape, causal):
    q, k, v = make_qkv(81, q_shape, k_shape, v_shape, dtype)
    attn, scores = ca.attention(q, k, v, causal=causal, return_scores=True)
    assert attn.shape == attn_shape and attn.dtype == dtype
    assert scores.shape == scores_shape and scores.dtype == dtype
    assert ca.attention(q, k, v, causal=causal).shape == attn_shape
    assert ca.attention_scores(q, k, causal=causal).shape == scores_shape
    assert_matches_reference(attn, scores, q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch", [(), (2,)], ids=["2d", "batched"])
def test_no_keys_gives_zero_rows(dtype, batch, causal):
    q, k, v = make_qkv(82, batch + (6, 8), batch + (0, 8), batch + (0, 3), dtype)
    attn, scores = ca.attention(q, k, v, causal=causal, return_scores=True)
    assert_bitwise_equal(attn, np.zeros(batch + (6, 3), dtype))
    assert scores.shape == batch + (6, 0) and scores.dtype == dtype
    assert_bitwise_equal(ca.attention(q, k, v, causal=causal),
                         np.zeros(batch + (6, 3), dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_dk_with_scale_is_uniform_over_visible_keys(dtype, causal):
    T, S = 5, 7
    q, k, v = make_qkv(83, (T, 0), (S, 0), (S, 4), dtype)
    attn, scores = ca.attention(q, k, v, scale=1.0, causal=causal, return_scores=True)
    visible = visible_positions(T, S, causal)
    expected = visible / visible.sum(axis=1, keepdims=True)
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(scores, expected, rtol=0, atol=tol)
    np.testing.assert_allclose(attn, expected @ v.astype(np.float64), rtol=0, atol=tol)
    assert_matches_reference(attn, scores, q, k, v, scale=1.0, causal=causal)


def test_zero_dk_without_scale_raises():
    q, k, v = make_qkv(84, (5, 0), (7, 0), (7, 4))
    with pytest.raises(ValueError, match=r"(?i)d_k|scale|\(5, 0\)|\(7, 0\)"):
        ca.attention(q, k, v)
    with pytest.raises(ValueError, match=r"(?i)d_k|scale|\(5, 0\)|\(7, 0\)"):
        ca.attention_scores(q, k)


# ---------------------------------------------------------------------------
# dtype rules
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_float_dtype_preserved(dt):
    q, k, v = make_qkv(91, (2, 5, 4), (2, 6, 4), (2, 6, 3), dt)
    attn, scores = ca.attention(q, k, v, return_scores=True)
    assert attn.dtype == dt and scores.dtype == dt
    assert ca.attention_scores(q, k).dtype == dt


def test_float16_in_float16_out():
    q, k, v = make_qkv(92, (2, 33, 16), (2, 47, 16), (2, 47, 8), np.float16)
    attn, scores = ca.attention(q, k, v, causal=True, return_scores=True)
    assert attn.dtype == np.float16 and scores.dtype == np.float16
    assert ca.attention_scores(q, k).dtype == np.float16
    ref_attn, ref_scores = reference_attention(q, k, v, causal=True)
    # float16 rounding of O(1) outputs: half an ulp is <= 2**-11 * |x| (< 2e-3)
    np.testing.assert_allclose(attn.astype(np.float64), ref_attn, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(scores.astype(np.float64), ref_scores, rtol=2e-3, atol=2e-3)


def test_float16_is_computed_in_float32():
    """'float16 computed in float32 and returned as float16' taken literally:
    equal to the float32 computation on the upcast inputs, rounded to float16."""
    q, k, v = make_qkv(93, (2, 33, 16), (2, 47, 16), (2, 47, 8), np.float16)
    attn, scores = ca.attention(q, k, v, causal=True, return_scores=True)
    attn32, scores32 = ca.attention(q.astype(np.float32), k.astype(np.float32),
                                    v.astype(np.float32), causal=True,
                                    return_scores=True)
    assert_bitwise_equal(attn, attn32.astype(np.float16))
    assert_bitwise_equal(scores, scores32.astype(np.float16))


@pytest.mark.parametrize("int_dtype", [np.int8, np.int32, np.int64, np.uint16, np.bool_])
def test_integer_and_bool_inputs_computed_as_float64(int_dtype):
    rng = np.random.default_rng(94)
    shapes = [(7, 5), (9, 5), (9, 4)]
    if int_dtype == np.bool_:
        q, k, v = (rng.random(s) < 0.5 for s in shapes)
    else:
        q, k, v = (rng.integers(0, 4, size=s).astype(int_dtype) for s in shapes)
    attn, scores = ca.attention(q, k, v, return_scores=True)
    assert attn.dtype == np.float64 and scores.dtype == np.float64
    expected = ca.attention(q.astype(np.float64), k.astype(np.float64),
                            v.astype(np.float64), return_scores=True)
    assert_bitwise_equal(attn, expected[0])
    assert_bitwise_equal(scores, expected[1])
    assert_matches_reference(attn, scores, q, k, v)


@pytest.mark.parametrize("dtypes", [
    (np.float32, np.float64, np.float32),
    (np.float64, np.float32, np.float32),
    (np.float32, np.float32, np.float64),
    (np.float16, np.float32, np.float16),
    (np.float16, np.float16, np.float64),
    (np.int64, np.float32, np.float32),
], ids=lambda d: "-".join(np.dtype(t).name for t in d))
def test_mixed_dtypes_follow_result_type(dtypes):
    q, k, v = (x.astype(t) for x, t in zip(
        make_qkv(95, (6, 5), (8, 5), (8, 3)), dtypes))
    expected_dtype = np.result_type(*dtypes)
    attn, scores = ca.attention(q, k, v, return_scores=True)
    assert attn.dtype == expected_dtype and scores.dtype == expected_dtype
    same = ca.attention(q.astype(expected_dtype), k.astype(expected_dtype),
                        v.astype(expected_dtype), return_scores=True)
    assert_bitwise_equal(attn, same[0])
    assert_bitwise_equal(scores, same[1])


# ---------------------------------------------------------------------------
# Private SIMD selection API
# ---------------------------------------------------------------------------

def test_private_simd_api():
    from cattention._native import driver as _attention
    for name in ("available_simd", "get_simd", "set_simd"):
        assert hasattr(_attention, name), f"cattention._attention.{name} is missing"
    levels = list(_attention.available_simd())
    assert "baseline" in levels
    assert _attention.get_simd() in levels


def test_compiled_tables_list_the_runnable_ones():
    from cattention._native import driver as _attention
    compiled = list(_attention.compiled_simd())
    assert compiled[0] == "baseline"
    assert set(_attention.available_simd()) <= set(compiled)
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "avx2" in compiled


def test_register_tile_fits_the_row_blocks(simd):
    """The driver's row blocks (Q_BLOCK = 96, ROW_GROUP = 24) are whole tiles
    of every table, and a tile is whole panels (16 floats, 8 doubles) wide."""
    from cattention._native import driver as _attention
    rows, cols_f32, cols_f64 = _attention.simd_tile()
    assert 24 % rows == 0 and 96 % rows == 0
    assert cols_f32 % 16 == 0 and cols_f64 % 8 == 0


def _cpu_has_avx2():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return re.search(r"^flags\s*:.*\bavx2\b", flags, re.M) is not None


@pytest.mark.skipif(not _cpu_has_avx2(), reason="CPU has no AVX2")
def test_avx2_path_available_on_avx2_cpu():
    """Otherwise the simd fixture would silently never cover the AVX2 code."""
    from cattention._native import driver as _attention
    assert "avx2" in list(_attention.available_simd())


def test_simd_paths_agree_closely(dtype):
    from cattention._native import driver as _attention
    levels = list(_attention.available_simd())
    q, k, v = make_qkv(96, (2, 150, 64), (2, 170, 64), (2, 170, 40), dtype)
    previous = _attention.get_simd()
    results = {}
    try:
        for name in levels:
            _attention.set_simd(name)
            results[name] = ca.attention(q, k, v, causal=True, return_scores=True)
    finally:
        _attention.set_simd(previous)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    base = results["baseline"]
    for name, (attn, scores) in results.items():
        np.testing.assert_allclose(attn, base[0], rtol=0, atol=tol, err_msg=name)
        np.testing.assert_allclose(scores, base[1], rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize("level", ["baseline", "avx2", "avx512", "neon"])
def test_env_var_selects_simd_path(level):
    from cattention._native import driver as _attention
    if level not in list(_attention.available_simd()):
        pytest.skip(f"SIMD level {level!r} not available on this machine/build")
    project_root = Path(ca.__file__).resolve().parent.parent
    env = dict(os.environ, CATTENTION_SIMD=level)
    out = subprocess.run(
        [sys.executable, "-c",
         "from cattention._native import driver as a; "
         "print(a.get_simd())"],
        cwd=project_root, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == level


@pytest.mark.parametrize("level", ["bogus", "AVX2", "avx512", "neon"])
def test_env_var_naming_no_runnable_table_warns(level):
    from cattention._native import driver as _attention
    if level in list(_attention.available_simd()):
        pytest.skip(f"SIMD level {level!r} runs here")
    project_root = Path(ca.__file__).resolve().parent.parent
    env = dict(os.environ, CATTENTION_SIMD=level)
    out = subprocess.run(
        [sys.executable, "-c",
         "from cattention._native import driver as a; import cattention; print(a.get_simd())"],
        cwd=project_root, env=env, capture_output=True, text=True, check=True)
    best = list(_attention.available_simd())[-1]
    assert out.stdout.strip() == best
    assert (f"RuntimeWarning: CATTENTION_SIMD={level!r} is not a kernel table this CPU runs"
            in out.stderr), out.stderr
    assert f"using {best}" in out.stderr


def test_a_weight_carries_the_rounding_of_its_logit(simd):
    """A case hypothesis found (T = 2, S = 8, d = 16): NumPy's float32 SCORES
    were exact by luck (max error 1.0e-08); the AVX2 kernels' 1.1e-07 is the
    rounding of logits up to |s| ~ 3 carried into weights up to 0.49, which
    the rule allows (two ulps of the largest logit times the largest weight)."""
    q = np.array([
        1.9919496774673462, 1.3376803398132324, 0.523771345615387, -3.120349407196045,
        0.4850623607635498, 0.172834113240242, -0.24472753703594208, 2.4570820331573486,
        0.2240559458732605, 0.4125085771083832, -0.39915794134140015,
        1.5946751832962036, -0.7316175103187561, -1.4779791831970215,
        2.5793004035949707, -0.906285285949707, 1.5968830585479736,
        -0.46404388546943665, -0.8083858489990234, 0.9074234962463379,
        1.6527982950210571, 0.5162172913551331, 0.3678731918334961, -0.3063812553882599,
        -0.6992169618606567, -0.8120422959327698, 0.2177475243806839,
        0.9890758395195007, 1.2167927026748657, -0.17616266012191772,
        0.6976449489593506, -1.0350122451782227], np.float32).reshape(2, 16)
    k = np.array([
        0.8626304864883423, 0.5884680151939392, 1.334626317024231, -0.7935688495635986,
        -1.1591179370880127, 0.8206729292869568, 0.6785596609115601,
        -1.2765986919403076, -0.3176874816417694, -0.5881325602531433,
        -0.17248858511447906, -0.8954845070838928, 0.6055958271026611,
        0.7953452467918396, -1.467462182044983, 0.6052664518356323, 1.0292654037475586,
        -0.508563220500946, 1.9940215349197388, -0.28515753149986267,
        -2.1134707927703857, 1.3447262048721313, 0.35901379585266113,
        0.02399861067533493, -0.045231711119413376, 1.1604175567626953,
        1.5089726448059082, 0.07986131310462952, -0.8883987069129944,
        -1.713676929473877, -1.1698137521743774, -0.16556444764137268,
        0.8614630103111267, 1.4185482263565063, -1.5604568719863892, 0.8060420155525208,
        -1.6064646244049072, 1.4526233673095703, 0.0346265509724617,
        -0.1548687368631363, 2.1206440925598145, 0.0862012729048729,
        -0.5097034573554993, -0.04309163987636566, -0.7094368934631348,
        -0.4490484297275543, -0.7620877027511597, -0.20797811448574066,
        -0.18108145892620087, 0.7958902716636658, 1.4196360111236572, 0.2618388235569,
        -0.4797680377960205, 2.226003646850586, -0.1347295194864273, 0.4059649705886841,
        -1.1382628679275513, -0.5209616422653198, 0.7821934223175049,
        -0.09099359065294266, -0.18544970452785492, 0.26307162642478943,
        0.6625242829322815, 1.584875464439392, 1.1760286092758179, -0.42478659749031067,
        -0.2609940469264984, -0.8990510106086731, -0.7471778392791748,
        0.5312150120735168, 1.1452233791351318, 1.1031121015548706, 0.7341982126235962,
        1.2046061754226685, -0.3741779625415802, -1.0575140714645386,
        0.04600889980792999, -0.5966677069664001, 0.14642877876758575,
        0.881919264793396, 1.7838917970657349, -0.12837836146354675,
        -0.5222272872924805, -1.6619192361831665, -0.7436778545379639,
        -0.017301740124821663, 1.638340711593628, -0.34309619665145874,
        -0.6031603217124939, -1.6188541650772095, 1.5187729597091675, 2.02380108833313,
        0.24523580074310303, -0.1802138388156891, 0.48170390725135803,
        0.25071075558662415, -0.0694061666727066, 0.7461274266242981,
        0.6126598715782166, 0.3730403482913971, 0.7287406325340271, -0.9665834903717041,
        -2.257875442504883, -0.31016623973846436, 0.2571898102760315,
        -0.16450078785419464, -0.18433614075183868, -2.882561445236206,
        -0.28273046016693115, 0.06914099305868149, 2.390012741088867,
        -0.6775206327438354, 0.2859739661216736, 1.1835482120513916,
        -2.3195178508758545, 1.5058706998825073, 0.5282747745513916,
        -0.2541165053844452, 0.8861145377159119, -0.48165979981422424,
        0.8846614360809326, 0.08529786765575409, 0.7171910405158997, 0.1903713196516037,
        -0.613012433052063, -0.12838347256183624, 1.2056710720062256,
        -0.2657107710838318], np.float32).reshape(8, 16)
    v = np.array([
        -0.996957004070282, -0.2099142074584961, -1.2903261184692383,
        -0.6535915732383728, -0.427206814289093, 1.4863406419754028, -2.37849760055542,
        -0.19850517809391022], np.float32).reshape(8, 1)
    attn, scores = ca.attention(q, k, v, return_scores=True)
    assert_matches_reference(attn, scores, q, k, v)
