"""Log-sum-exp output and exact merging of attention over key chunks."""

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


def assert_lse_close(lse, ref):
    """float32 within 1e-6 relative (about 8 ulps), float64 within 1e-13,
    relative to max(1, |lse|); -inf exactly where the reference has it."""
    lse = np.asarray(lse)
    assert lse.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    finite = np.isfinite(ref)
    rtol = 1e-6 if lse.dtype == np.float32 else 1e-13
    err = np.abs(lse[finite].astype(np.float64) - ref[finite])
    assert np.all(err <= rtol * np.maximum(1.0, np.abs(ref[finite]))), err.max()


# T <= 8 takes the direct path (split keys when the batch is small); larger T
# the packed path; SCORES always the packed path.
@pytest.mark.parametrize("T,S", [(1, 1), (1, 4097), (3, 700), (8, 257), (97, 300), (300, 97)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("return_scores", [False, True], ids=["attn", "scores"])
def test_lse_matches_float64_logsumexp(dtype, T, S, causal, return_scores):
    q, k, v = make_qkv(31, (2, T, 16), (2, S, 16), (2, S, 5), dtype)
    result = ca.attention(q, k, v, causal=causal, return_scores=return_scores,
                          return_lse=True)
    assert len(result) == (3 if return_scores else 2)
    attn, lse = result[0], result[-1]
    assert lse.dtype == dtype and lse.shape == (2, T)
    assert_lse_close(lse, reference_lse(q, k, causal))
    assert_matches_reference(attn, result[1] if return_scores else None, q, k, v, causal)


def test_lse_with_masks_and_empty_rows(dtype):
    q, k, v = make_qkv(32, (6, 8), (9, 8), (9, 3), dtype)
    mask = np.ones((6, 9), dtype=bool)
    mask[2] = False                      # a row that sees nothing
    mask[4, ::2] = False
    attn, lse = ca.attention(q, k, v, mask=mask, return_lse=True)
    assert np.isneginf(lse[2]) and np.all(attn[2] == 0)
    assert_lse_close(lse, reference_lse(q, k, mask=mask))
    bias = np.where(mask, 0.5, -np.inf)
    _, lse_bias = ca.attention(q, k, v, mask=bias, return_lse=True)
    assert_lse_close(lse_bias, reference_lse(q, k, mask=bias))


def test_lse_float16_inputs_give_float32():
    q, k, v = make_qkv(33, (4, 8), (6, 8), (6, 8), np.float16)
    attn, lse = ca.attention(q, k, v, return_lse=True)
    assert attn.dtype == np.float16 and lse.dtype == np.float32


def _chunked(q, k, v, bounds, causal_mask=None):
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mask = None if causal_mask is None else causal_mask[..., lo:hi]
        out, lse = ca.attention(q, k[..., lo:hi, :], v[..., lo:hi, :], mask=mask,
                                return_lse=True)
        outs.append(out)
        lses.append(lse)
    return ca.merge(outs, lses)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("T", [1, 5, 40])
def test_split_and_merge_equals_one_call(dtype, seed, T):
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 600))
    q, k, v = make_qkv(100 + seed, (2, T, 12), (2, S, 12), (2, S, 7), dtype)
    # random chunk boundaries, repeated ones make empty chunks
    inner = np.sort(rng.integers(0, S + 1, size=int(rng.integers(0, 6))))
    bounds = [0, *inner.tolist(), S]
    # bottom-right causal mask, so chunks near the end are fully masked for
    # the first rows
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    causal_mask = j <= i + (S - T)
    out, lse = _chunked(q, k, v, bounds, causal_mask)
    assert out.dtype == dtype
    assert_matches_reference(out, None, q, k, v, causal=True)
    assert_lse_close(lse, reference_lse(q, k, causal=True))


def test_merge_fully_masked_chunk_contributes_nothing(dtype):
    q, k, v = make_qkv(40, (3, 4), (10, 4), (10, 2), dtype)
    mask = np.ones((3, 10), dtype=bool)
    mask[:, 6:] = False
    v_dirty = v.copy()
    v_dirty[6:] = np.nan                 # values of a chunk no row may see
    out, lse = _chunked(q, k, v_dirty, [0, 6, 10], mask)
    assert np.all(np.isfinite(out))
    assert_matches_reference(out, None, q, k, v, mask=mask)
    assert_lse_close(lse, reference_lse(q, k, mask=mask))


def test_merge_all_chunks_empty_gives_zero_rows():
    outs = [np.zeros((2, 3)), np.zeros((2, 3))]
    lses = [np.full(2, -np.inf), np.full(2, -np.inf)]
    out, lse = ca.merge(outs, lses)
    assert_bitwise_equal(out, np.zeros((2, 3)))
    assert np.all(np.isneginf(lse))


def test_merge_of_a_nan_row_is_nan(dtype):
    """A NaN in a visible mask entry makes a row of attention NaN (with a NaN
    log-sum-exp); merging chunks of it gives that NaN row, as attention over
    the union does, not the zeros of a row that sees no key. The other rows
    match the reference; an lse of +inf gives a NaN row too."""
    q, k, v = make_qkv(42, (3, 4), (8, 4), (8, 3), dtype)
    mask = np.zeros((3, 8), dtype)
    mask[0, 1] = np.nan
    whole = ca.attention(q, k, v, mask=mask)
    assert np.all(np.isnan(whole[0]))
    out, lse = _chunked(q, k, v, [0, 4, 8], mask)
    assert np.all(np.isnan(out[0])) and np.isnan(lse[0])
    assert_matches_reference(out[1:], None, q[1:], k, v, mask=mask[1:])
    out, lse = ca.merge([np.ones((2, 3), dtype), np.ones((2, 3), dtype)],
                        [np.array([np.inf, 0.0], dtype), np.zeros(2, dtype)])
    assert np.all(np.isnan(out[0])) and np.all(out[1] == 1)


def test_merge_single_chunk_is_identity(dtype):
    q, k, v = make_qkv(41, (5, 8), (9, 8), (9, 3), dtype)
    out, lse = ca.attention(q, k, v, return_lse=True)
    merged, merged_lse = ca.merge([out], [lse])
    np.testing.assert_allclose(merged, out, rtol=0, atol=4 * np.finfo(dtype).eps)
    assert_bitwise_equal(merged_lse, lse)


def test_merge_errors():
    with pytest.raises(ValueError, match="one lse per output"):
        ca.merge([np.zeros((2, 3))], [])
    with pytest.raises(ValueError, match="one lse per output"):
        ca.merge([], [])
    with pytest.raises(ValueError, match=shapes_regex((2, 3), (3,))):
        ca.merge([np.zeros((2, 3))], [np.zeros(3)])
    with pytest.raises(ValueError, match=shapes_regex((2, 3), (4, 3))):
        ca.merge([np.zeros((2, 3)), np.zeros((4, 3))], [np.zeros(2), np.zeros(4)])
    with pytest.raises(TypeError, match="floating-point"):
        ca.merge([np.zeros((2, 3), dtype=int)], [np.zeros(2, dtype=int)])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_decode_is_bitwise_across_threads(dtype, threads):
    # one batch entry, long keys: the keys are split into chunks and merged
    q, k, v = make_qkv(42, (1, 1, 64), (1, 5000, 64), (1, 5000, 64), dtype)
    ref = ca.attention(q, k, v, num_threads=1, return_lse=True)
    got = ca.attention(q, k, v, num_threads=threads, return_lse=True)
    assert_bitwise_equal(got[0], ref[0])
    assert_bitwise_equal(got[1], ref[1])


# A decode item steps the batch entries whose K/V rows lie side by side (heads
# interleaved in a (B, S, H, d) cache, grouped query heads reading one K/V)
# through the keys together: entries of one item may see different key
# ranges, and every layout and thread count gives the same bits.
@pytest.mark.parametrize("T,H_kv", [(1, 6), (3, 6), (5, 2)], ids=["decode", "T3", "T5-gqa"])
def test_decode_entries_read_together(dtype, T, H_kv):
    B, H, S, d = 2, 6, 300, 24
    rng = np.random.default_rng(35)
    q = rng.standard_normal((B, H, T, d)).astype(dtype)
    # (B, S, H_kv, d) memory, seen as (B, H_kv, S, d): heads of a token adjacent
    k = rng.standard_normal((B, S, H_kv, d)).astype(dtype).transpose(0, 2, 1, 3)
    v = rng.standard_normal((B, S, H_kv, d)).astype(dtype).transpose(0, 2, 1, 3)
    kv_lengths = np.array([[300, 0, 31, 257, 64, 1], [5, 300, 299, 40, 33, 128]])
    options = dict(kv_lengths=kv_lengths, window=(100, 0), enable_gqa=H_kv < H)
    k_full = np.repeat(k, H // H_kv, axis=1)
    v_full = np.repeat(v, H // H_kv, axis=1)
    results = []
    for threads in (1, 2):
        attn, lse = ca.attention(q, k, v, causal=True, return_lse=True,
                                 num_threads=threads, **options)
        results.append((attn, lse))
        assert_matches_reference(attn, None, q, k_full, v_full, causal=True, lse=lse,
                                 kv_lengths=kv_lengths, window=(100, 0))
    # head 1 of sequence 0 has no keys: zero rows, LSE -inf
    assert np.isneginf(results[0][1][0, 1]).all() and np.all(results[0][0][0, 1] == 0)
    contiguous = ca.attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v),
                              causal=True, return_lse=True, **options)
    for attn, lse in results[1:] + [contiguous]:
        assert_bitwise_equal(attn, results[0][0])
        assert_bitwise_equal(lse, results[0][1])
