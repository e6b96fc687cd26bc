"""Attention variants against the float64 reference: grouped-query attention,
kv_lengths, the KV cache, float16 K/V, windows, softcap and ALiBi."""

import contextlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

import cattention as ca
from cattention._native import driver
from reference import (
    assert_bitwise_equal,
    assert_matches_reference,
    make_qkv,
    misaligned,
    reference_lse,
    shapes_regex,
)


def repeat_kv(x, group):
    """K or V with each head repeated for its group of query heads."""
    return np.repeat(x, group, axis=-3)


# (H, H_kv, T): equal heads; grouped decode (G * T <= 8: rows stacked per K/V
# head); a grouped prompt (query heads broadcast against their K/V head)
@pytest.mark.parametrize("heads,kv_heads,T", [(4, 4, 3), (8, 2, 1), (8, 2, 2), (4, 1, 5),
                                              (6, 3, 9), (8, 2, 40)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("return_scores", [False, True], ids=["attn", "scores"])
def test_gqa_compiled_path_matches_reference_and_general_path(
        compiled_path, general_path, dtype, heads, kv_heads, T, causal, return_scores):
    """enable_gqa=True runs the compiled path: its results match the float64
    reference and are bitwise those of the general path, for batch
    dimensions before the heads and a strided q."""
    taken = compiled_path("attention_shortcut")
    S = 70
    q, k, v = make_qkv(52, (2, heads, T, 16), (2, kv_heads, S, 16), (2, kv_heads, S, 5),
                       dtype)
    for q_in in (q, np.ascontiguousarray(q.swapaxes(-1, -2)).swapaxes(-1, -2)):
        got = ca.attention(q_in, k, v, causal=causal, enable_gqa=True,
                           return_scores=return_scores)
        with general_path("attention_shortcut"):
            expected = ca.attention(q_in, k, v, causal=causal, enable_gqa=True,
                                    return_scores=return_scores)
        assert taken[-1:] == [True]
        for a, b in zip(got if return_scores else (got,),
                        expected if return_scores else (expected,)):
            assert a.shape == b.shape
            assert_bitwise_equal(a, b)
        group = heads // kv_heads
        attn, scores = got if return_scores else (got, None)
        assert_matches_reference(attn, scores, q, repeat_kv(k, group), repeat_kv(v, group),
                                 causal)


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


# ---- per-sequence key lengths ----------------------------------------------

@pytest.mark.parametrize("T", [1, 4, 50])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kv_lengths_match_truncated_keys(dtype, T, causal):
    S = 300
    q, k, v = make_qkv(60, (4, 3, T, 16), (4, 3, S, 16), (4, 3, S, 6), dtype)
    lengths = np.array([S, 0, 17, 260])
    k_dirty, v_dirty = k.copy(), v.copy()
    for b, n in enumerate(lengths):
        k_dirty[b, :, n:] = np.nan      # padding past the valid keys
        v_dirty[b, :, n:] = np.inf
    attn, scores, lse = ca.attention(q, k_dirty, v_dirty, causal=causal,
                                     kv_lengths=lengths[:, None], return_scores=True,
                                     return_lse=True)
    for b, n in enumerate(lengths):
        sub = (q[b], k[b, :, :n], v[b, :, :n])
        if n == 0:
            assert np.all(attn[b] == 0) and np.all(scores[b] == 0)
            assert np.all(np.isneginf(lse[b]))
            continue
        assert_matches_reference(attn[b], scores[b][..., :n], *sub, causal)
        assert np.all(scores[b][..., n:] == 0)
        ref_attn = ca.attention(*sub, causal=causal)
        np.testing.assert_allclose(attn[b], ref_attn, rtol=0,
                                   atol=2e-6 if dtype == np.float32 else 1e-13)


def test_kv_lengths_broadcast_per_head_and_scalar(dtype):
    q, k, v = make_qkv(61, (2, 3, 4, 8), (2, 3, 20, 8), (2, 3, 20, 2), dtype)
    per_head = np.array([[5, 20, 1], [0, 9, 13]])
    attn = ca.attention(q, k, v, kv_lengths=per_head)
    for b in range(2):
        for h in range(3):
            n = per_head[b, h]
            expected = (np.zeros((4, 2)) if n == 0
                        else ca.attention(q[b, h], k[b, h, :n], v[b, h, :n]))
            np.testing.assert_allclose(attn[b, h], expected, rtol=0, atol=1e-6)
    assert_bitwise_equal(ca.attention(q, k, v, kv_lengths=20), ca.attention(q, k, v))
    scores = ca.attention_scores(q, k, kv_lengths=7, causal=True)
    assert np.all(scores[..., 7:] == 0)


def test_kv_lengths_per_sequence_with_grouped_heads_and_a_broadcast_q(dtype):
    """q broadcast over the sequences (batch axis 1), 4 query heads over 2
    K/V heads: a 1-D kv_lengths is still one length per sequence."""
    q, k, v = make_qkv(63, (1, 4, 2, 8), (3, 2, 10, 8), (3, 2, 10, 3), dtype)
    lengths = [3, 5, 10]
    attn = ca.attention(q, k, v, kv_lengths=lengths, enable_gqa=True)
    assert attn.shape == (3, 4, 2, 3)
    for b, n in enumerate(lengths):
        assert_matches_reference(attn[b], None, q[0], repeat_kv(k[b, :, :n], 2),
                                 repeat_kv(v[b, :, :n], 2), False)


def test_kv_lengths_of_heads_sharing_kv(dtype):
    """K/V broadcast over heads with a length per head (packed path): the
    shared copy holds the keys of the longest."""
    q, k, v = make_qkv(62, (2, 3, 50, 8), (2, 1, 600, 8), (2, 1, 600, 4), dtype)
    lengths = np.array([[5, 520, 1], [0, 260, 257]])
    attn, lse = ca.attention(q, k, v, kv_lengths=lengths, causal=True, return_lse=True)
    for b in range(2):
        for h in range(3):
            n = lengths[b, h]
            if n == 0:
                assert np.all(attn[b, h] == 0) and np.all(np.isneginf(lse[b, h]))
                continue
            assert_matches_reference(attn[b, h], None, q[b, h], k[b, 0, :n], v[b, 0, :n],
                                     True, lse=lse[b, h])


_UNREAD_KEYS_SCRIPT = """
import mmap, ctypes, sys, numpy as np, cattention as ca
S, d, valid, first_unread, last_unread = 4096, 64, *map(int, sys.argv[1:4])
window = (int(sys.argv[4]), 0) if len(sys.argv) > 4 else None
page = mmap.PAGESIZE
# K and V each in memory whose rows [first_unread, last_unread) may not be read
buffers = [mmap.mmap(-1, S * d * 4) for _ in range(2)]
libc = ctypes.CDLL(None)
for buf in buffers:
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf)) + first_unread * d * 4
    assert start % page == 0
    n_bytes = (last_unread - first_unread) * d * 4
    assert libc.mprotect(ctypes.c_void_p(start), n_bytes, 0) == 0
k, v = (np.frombuffer(buf, np.float32).reshape(1, 1, S, d) for buf in buffers)
rng = np.random.default_rng(0)
seen = slice(last_unread if first_unread == 0 else 0, valid)
k[..., seen, :] = rng.standard_normal((seen.stop - seen.start, d))
v[..., seen, :] = rng.standard_normal((seen.stop - seen.start, d))
q = rng.standard_normal((1, 1, 100, d)).astype(np.float32)
expected = ca.attention(q, k[..., seen, :].copy(), v[..., seen, :].copy(), causal=True,
                        window=window)
for threads in (1, 2):
    attn = ca.attention(q, k, v, kv_lengths=valid, causal=True, window=window,
                        num_threads=threads)
    assert np.allclose(attn, expected, rtol=0, atol=1e-6), threads
print("ok")
"""


@pytest.mark.parametrize("case", [
    # a short prompt in a long preallocated cache: keys past the lengths
    ("100", "256", "4096"),
    # a prompt chunk at the end of a long cache, with a sliding window of 200:
    # the blocks before every row's window
    ("1100", "0", "512", "200"),
], ids=["past-lengths", "before-window"])
def test_keys_no_row_sees_are_never_read(case):
    """The keys no row sees lie on pages that may not be read (a read kills
    the child)."""
    result = subprocess.run([sys.executable, "-c", _UNREAD_KEYS_SCRIPT, *case],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        result.returncode, result.stdout[-2000:], result.stderr[-2000:])


def test_kv_lengths_errors():
    q, k, v = np.ones((2, 3, 4, 8)), np.ones((2, 3, 5, 8)), np.ones((2, 3, 5, 2))
    with pytest.raises(ValueError, match=r"\[0, S\] = \[0, 5\]"):
        ca.attention(q, k, v, kv_lengths=6)
    with pytest.raises(ValueError, match=r"\[0, S\] = \[0, 5\]"):
        ca.attention(q, k, v, kv_lengths=np.array([[-1], [2]]))
    with pytest.raises(ValueError, match=r"kv_lengths of shape \(4,\).*\(2, 3\)"):
        ca.attention(q, k, v, kv_lengths=np.array([1, 2, 3, 4]))
    with pytest.raises(TypeError, match="integers"):
        ca.attention(q, k, v, kv_lengths=2.5)


# ---- decoding against a KV cache --------------------------------------------

def test_greedy_decode_loop_matches_full_recompute(dtype):
    """64 steps of decode through the cache equal causal attention over the
    whole sequence recomputed at each step (two sequences, GQA 4:2)."""
    rng = np.random.default_rng(70)
    batch, heads, kv_heads, d, max_keys, steps = 2, 4, 2, 16, 96, 64
    prompt = [5, 11]
    w = (rng.standard_normal((heads * d, 3 * d)) / np.sqrt(heads * d)).astype(dtype)
    k_cache = np.zeros((batch, kv_heads, max_keys, d), dtype)
    v_cache = np.zeros((batch, kv_heads, max_keys, d), dtype)
    lengths = np.zeros(batch, dtype=np.int64)
    history_k = [[] for _ in range(batch)]
    history_v = [[] for _ in range(batch)]
    # prompts of different lengths go in one sequence at a time
    for b, n in enumerate(prompt):
        qp, kp, vp = make_qkv(71 + b, (1, heads, n, d), (1, kv_heads, n, d),
                              (1, kv_heads, n, d), dtype)
        one = lengths[b:b + 1]
        ca.attention_with_kvcache(qp, k_cache[b:b + 1], v_cache[b:b + 1], one, kp, vp)
        lengths[b] = one[0]
        history_k[b].append(kp[0])
        history_v[b].append(vp[0])
    token = rng.standard_normal((batch, heads * d)).astype(dtype)
    for _ in range(steps):
        qkv = np.tanh(token @ w)                   # the next token from the last output
        q_t = qkv[:, :d].reshape(batch, 1, 1, d).repeat(heads, axis=1)
        q_t = q_t * np.linspace(0.5, 1.5, heads, dtype=dtype)[None, :, None, None]
        k_t = qkv[:, d:2 * d].reshape(batch, 1, 1, d).repeat(kv_heads, axis=1)
        v_t = qkv[:, 2 * d:].reshape(batch, 1, 1, d).repeat(kv_heads, axis=1)
        out = ca.attention_with_kvcache(q_t, k_cache, v_cache, lengths, k_t, v_t)
        for b in range(batch):
            history_k[b].append(k_t[b])
            history_v[b].append(v_t[b])
            k_full = np.concatenate(history_k[b], axis=1)
            v_full = np.concatenate(history_v[b], axis=1)
            assert lengths[b] == k_full.shape[1]
            assert_matches_reference(out[b], None, q_t[b], repeat_kv(k_full, 2),
                                     repeat_kv(v_full, 2), causal=True)
        token = out.reshape(batch, heads * d)
    assert lengths.tolist() == [prompt[0] + steps, prompt[1] + steps]


def test_kvcache_writes_in_place_without_copies():
    k_cache = np.zeros((2, 1, 8, 4), np.float32)
    v_cache = np.zeros((2, 1, 8, 4), np.float32)
    lengths = np.array([0, 3])
    k_new = np.ones((2, 1, 2, 4), np.float32)
    out = ca.attention_with_kvcache(np.ones((2, 2, 2, 4), np.float32), k_cache, v_cache,
                                    lengths, k_new, 2 * k_new)
    assert lengths.tolist() == [2, 5]
    assert np.all(k_cache[0, :, :2] == 1) and np.all(k_cache[0, :, 2:] == 0)
    assert np.all(v_cache[1, :, 3:5] == 2) and np.all(v_cache[1, :, :3] == 0)
    assert out.shape == (2, 2, 2, 4)


def test_kvcache_errors_leave_the_cache_untouched():
    k_cache = np.zeros((2, 1, 8, 4), np.float32)
    v_cache = np.zeros((2, 1, 8, 4), np.float32)
    lengths = np.array([5, 7])
    q = np.ones((2, 1, 2, 4), np.float32)
    new = np.ones((2, 1, 2, 4), np.float32)
    before = (k_cache.copy(), v_cache.copy(), lengths.copy())

    def unchanged():
        assert_bitwise_equal(k_cache, before[0])
        assert_bitwise_equal(v_cache, before[1])
        assert lengths.tolist() == before[2].tolist()

    with pytest.raises(ValueError, match=r"overflow.*S_max = 8"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, new)
    unchanged()
    lengths[:] = [1, 1]
    before = (k_cache.copy(), v_cache.copy(), lengths.copy())
    with pytest.raises(ValueError, match=shapes_regex((2, 1, 3, 4), (2, 1, 2, 4))):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, np.ones((2, 1, 3, 4)), new)
    unchanged()
    with pytest.raises(ValueError, match=r"q must have shape.*\(2, 1, 2, 5\)"):
        ca.attention_with_kvcache(np.ones((2, 1, 2, 5)), k_cache, v_cache, lengths, new, new)
    unchanged()
    with pytest.raises(TypeError, match="float64"):
        ca.attention_with_kvcache(q, k_cache.astype(np.float64), v_cache, lengths, new, new)
    with pytest.raises(TypeError, match="copy"):
        ca.attention_with_kvcache(q.astype(np.float64), k_cache, v_cache, lengths, new, new)
    unchanged()
    with pytest.raises(TypeError, match="int32"):
        ca.attention_with_kvcache(q, k_cache.astype(np.int32), v_cache.astype(np.int32),
                                  lengths, new, new)
    with pytest.raises(ValueError, match="together"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, None)
    with pytest.raises(ValueError, match=r"cache_lengths.*\(2,\)"):
        ca.attention_with_kvcache(q, k_cache, v_cache, [1, 1], new, new)
    unchanged()


# ---- float16 K/V (halved caches) ---------------------------------------------

@pytest.mark.parametrize("T", [1, 6, 120])
@pytest.mark.parametrize("return_scores", [False, True], ids=["attn", "scores"])
def test_float16_kv_matches_reference_of_rounded_values(T, return_scores):
    """float16 K/V with float32 q: computed in float32, output float32, equal
    to the float64 reference of the float16-rounded values, and bitwise equal
    to converting K/V to float32 first (they are converted block by block)."""
    q, k, v = make_qkv(80, (2, 4, T, 32), (2, 2, 600, 32), (2, 2, 600, 24), np.float32)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    result = ca.attention(q, k16, v16, enable_gqa=True, causal=True,
                          return_scores=return_scores)
    attn = result[0] if return_scores else result
    assert attn.dtype == np.float32
    k32, v32 = k16.astype(np.float32), v16.astype(np.float32)
    assert_matches_reference(attn, result[1] if return_scores else None, q,
                             repeat_kv(k32, 2), repeat_kv(v32, 2), causal=True)
    expected = ca.attention(q, k32, v32, enable_gqa=True, causal=True,
                            return_scores=return_scores)
    assert_bitwise_equal(attn, expected[0] if return_scores else expected)


def test_float16_kv_special_values_and_strides():
    q, k, v = make_qkv(81, (3, 8), (40, 8), (40, 5), np.float32)
    k16 = k.astype(np.float16)
    v16 = v.astype(np.float16)
    k16[3, 0] = np.float16(6e-5) / 8      # a subnormal half
    v16[5, 1] = np.float16(65504)         # the largest half
    mask = np.ones((3, 40), bool)
    mask[:, 7] = False
    v16[7] = np.inf                       # in a masked-out value: no effect
    k16[7] = np.nan
    got = ca.attention(q, k16, v16, mask=mask)
    k32, v32 = k16.astype(np.float32), v16.astype(np.float32)
    assert np.all(np.isfinite(got))
    # (65504 in V: not unit-scale data, so no absolute 1e-5 cap)
    assert_matches_reference(got, None, q, k32, np.where(np.isfinite(v32), v32, 0), mask=mask,
                             f32_abs_cap=None)
    # strided (transposed) float16 K/V give the same bits
    k_t = np.ascontiguousarray(k16.T).T
    v_t = np.ascontiguousarray(v16.T).T
    assert_bitwise_equal(ca.attention(q, k_t, v_t, mask=mask), got)
    assert_bitwise_equal(ca.attention(q[:1], k_t, v_t, mask=mask[:1]), got[:1])


@pytest.mark.parametrize("d_k,d_v", [(128, 72), (64, 64), (19, 33)])
def test_float16_kv_decode_reads_halves_in_place(simd, d_k, d_v):
    """Decode with float16 K/V reads the halves where they lie and converts
    them in registers: bitwise the result of converting K/V to float32
    first, over several key steps and chunks, grouped heads and lengths
    that end inside a step, with edge values among the keys and values."""
    rng = np.random.default_rng(83)
    q = rng.standard_normal((3, 8, 2, d_k)).astype(np.float32)
    k16 = rng.standard_normal((3, 2, 700, d_k)).astype(np.float16)
    v16 = rng.standard_normal((3, 2, 700, d_v)).astype(np.float16)
    k16[0, 0, 5, :3] = [np.float16(6e-8), -0.0, np.float16(65504) / 1024]
    v16[1, 1, 9, :2] = [np.float16(65504), np.float16(-6e-8)]
    lengths = np.array([700, 333, 41])
    for kv_lengths in (None, lengths):
        got = ca.attention(q, k16, v16, enable_gqa=True, kv_lengths=kv_lengths)
        expected = ca.attention(q, k16.astype(np.float32), v16.astype(np.float32),
                                enable_gqa=True, kv_lengths=kv_lengths)
        assert_bitwise_equal(got, expected)
        assert_bitwise_equal(
            ca.attention(q, k16, v16, enable_gqa=True, kv_lengths=kv_lengths, num_threads=2),
            expected)
    assert_matches_reference(got, None, q, repeat_kv(k16.astype(np.float32), 4),
                             repeat_kv(v16.astype(np.float32), 4), kv_lengths=lengths[:, None],
                             f32_abs_cap=None)   # 65504 in V: not unit-scale data


def test_kvcache_with_float16_caches():
    k_cache = np.zeros((2, 2, 64, 16), np.float16)
    v_cache = np.zeros((2, 2, 64, 16), np.float16)
    lengths = np.array([3, 0])
    rng = np.random.default_rng(82)
    prefix = rng.standard_normal((2, 2, 3, 16)).astype(np.float16)
    k_cache[0, :, :3] = prefix[0]
    v_cache[0, :, :3] = prefix[0]
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    new = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    out = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, new)
    assert out.dtype == np.float32 and lengths.tolist() == [4, 1]
    for b, n in enumerate(lengths):
        k32 = k_cache[b, :, :n].astype(np.float32)
        v32 = v_cache[b, :, :n].astype(np.float32)
        assert_matches_reference(out[b], None, q[b], repeat_kv(k32, 2), repeat_kv(v32, 2),
                                 causal=True)


# ---- sliding windows, softcap, ALiBi -------------------------------------------

OPTION_CASES = {
    "window": dict(window=(7, 3)),
    "window-left-only": dict(window=(20, None)),
    "window-right-only": dict(window=(None, 0)),
    "softcap": dict(softcap=2.5),
    "alibi-H": dict(alibi=np.array([0.5, 0.25, 0.125, 0.0625])),
    "alibi-BH": dict(alibi=np.linspace(0.01, 0.4, 8).reshape(2, 4)),
    "combined": dict(window=(37, 5), softcap=1.5, alibi=np.array([0.1, 0.2, 0.3, 0.4]),
                     kv_lengths=np.array([[300], [123]])),
}


@pytest.mark.parametrize("option", list(OPTION_CASES))
@pytest.mark.parametrize("T,S", [(1, 300), (6, 300), (97, 300), (300, 97), (260, 300)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_options_match_the_reference(dtype, option, T, S, causal):
    kwargs = dict(OPTION_CASES[option])
    if "kv_lengths" in kwargs and S < 300:
        kwargs["kv_lengths"] = np.minimum(kwargs["kv_lengths"], S)
    q, k, v = make_qkv(90, (2, 4, T, 16), (2, 4, S, 16), (2, 4, S, 5), dtype)
    api = dict(window=kwargs.get("window"), softcap=kwargs.get("softcap"),
               alibi_slopes=kwargs.get("alibi"), kv_lengths=kwargs.get("kv_lengths"))
    with_scores = ca.attention(q, k, v, causal=causal, return_scores=True, return_lse=True,
                               **api)
    assert_matches_reference(with_scores[0], with_scores[1], q, k, v, causal,
                             lse=with_scores[2], **api)
    # the path without SCORES has the same semantics
    attn, lse = ca.attention(q, k, v, causal=causal, return_lse=True, **api)
    assert_matches_reference(attn, None, q, k, v, causal, lse=lse, **api)
    assert_bitwise_equal(ca.attention_scores(q, k, causal=causal, **api), with_scores[1])


def test_combined_options_with_gqa_and_mask(dtype):
    q, k, v = make_qkv(91, (2, 4, 33, 16), (2, 2, 70, 16), (2, 2, 70, 5), dtype)
    rng = np.random.default_rng(1)
    mask = rng.random((2, 4, 33, 70)) > 0.2
    kwargs = dict(window=(25, None), softcap=3.0, alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05]),
                  kv_lengths=np.array([[70], [41]]))
    got = ca.attention(q, k, v, causal=True, mask=mask, enable_gqa=True, return_scores=True,
                       return_lse=True, **kwargs)
    assert_matches_reference(got[0], got[1], q, repeat_kv(k, 2), repeat_kv(v, 2), True,
                             mask, lse=got[2], **kwargs)


def test_softcap_applies_before_the_additive_mask():
    q, k, v = make_qkv(92, (1, 1, 3, 8), (1, 1, 6, 8), (1, 1, 6, 4), np.float64)
    bias = np.array([0.0, -1.0, 2.0, -np.inf, 0.5, -3.0])
    got = ca.attention(q, k, v, mask=bias, softcap=0.7, return_scores=True)
    assert_matches_reference(got[0], got[1], q, k, v, mask=bias, softcap=0.7)


def test_window_skips_invisible_key_blocks():
    """NaN in keys and values outside every query's window has no effect."""
    q, k, v = make_qkv(93, (1, 1, 600, 8), (1, 1, 3000, 8), (1, 1, 3000, 4), np.float32)
    k_dirty, v_dirty = k.copy(), v.copy()
    k_dirty[..., :2000, :] = np.nan      # the window reaches back 300 keys only
    v_dirty[..., :2000, :] = np.nan
    got = ca.attention(q, k_dirty, v_dirty, causal=True, window=(300, None))
    assert_bitwise_equal(got, ca.attention(q, k, v, causal=True, window=(300, None)))


def test_option_errors():
    q, k, v = np.ones((2, 4, 3, 8)), np.ones((2, 4, 5, 8)), np.ones((2, 4, 5, 2))
    with pytest.raises(TypeError, match="window"):
        ca.attention(q, k, v, window=3)
    with pytest.raises(ValueError, match="window left must be >= 0"):
        ca.attention(q, k, v, window=(-1, 2))
    with pytest.raises(TypeError, match="window right must be an integer"):
        ca.attention(q, k, v, window=(1, 2.5))
    with pytest.raises(ValueError, match="softcap must be a positive"):
        ca.attention(q, k, v, softcap=0)
    with pytest.raises(ValueError, match="softcap must be a positive"):
        ca.attention(q, k, v, softcap=float("inf"))
    with pytest.raises(TypeError, match="softcap"):
        ca.attention(q, k, v, softcap="1")
    with pytest.raises(ValueError, match=r"alibi_slopes of shape \(3,\).*\(2, 4\)"):
        ca.attention(q, k, v, alibi_slopes=np.ones(3))
    with pytest.raises(ValueError, match="finite"):
        ca.attention(q, k, v, alibi_slopes=np.full(4, np.nan))
    with pytest.raises(TypeError, match="alibi_slopes"):
        ca.attention(q, k, v, alibi_slopes=np.ones(4, dtype=complex))


# ---- one length per sequence; cache lengths that cannot wrap -----------------

@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_1d_kv_lengths_are_per_sequence_even_when_B_equals_H(dtype, T, kv_heads):
    B = H = 4
    S = 12
    q, k, v = make_qkv(200, (B, H, T, 8), (B, kv_heads, S, 8), (B, kv_heads, S, 5), dtype)
    lengths = np.array([10, 6, 3, 1])
    gqa = kv_heads != H
    attn, scores = ca.attention(q, k, v, causal=True, kv_lengths=lengths,
                                enable_gqa=gqa, return_scores=True)
    group = H // kv_heads
    assert_matches_reference(attn, scores, q, repeat_kv(k, group), repeat_kv(v, group),
                             True, kv_lengths=lengths[:, None])
    # the same as the explicit (B, 1) layout, bit for bit
    explicit = ca.attention(q, k, v, causal=True, enable_gqa=gqa, return_scores=True,
                            kv_lengths=lengths[:, None])
    assert_bitwise_equal(attn, explicit[0])
    assert_bitwise_equal(scores, explicit[1])


def test_1d_kv_lengths_of_another_length_is_an_error_naming_the_shapes():
    q, k, v = np.ones((2, 3, 4, 8)), np.ones((2, 3, 5, 8)), np.ones((2, 3, 5, 2))
    with pytest.raises(ValueError, match=r"kv_lengths of shape \(3,\) is ambiguous.*"
                                         r"one length per sequence.*B = 2.*\(2, 3\)"):
        ca.attention(q, k, v, kv_lengths=np.array([1, 2, 3]))
    # one length for all, and 3-D inputs (no head axis), are unchanged
    assert_bitwise_equal(ca.attention(q, k, v, kv_lengths=np.array([4])),
                         ca.attention(q, k, v, kv_lengths=4))
    q3, k3, v3 = make_qkv(201, (3, 4, 8), (3, 5, 8), (3, 5, 2))
    out = ca.attention(q3, k3, v3, kv_lengths=np.array([5, 2, 1]))
    for b, n in enumerate([5, 2, 1]):
        assert_matches_reference(out[b], None, q3[b], k3[b, :n], v3[b, :n])


def test_1d_kv_lengths_are_per_sequence_when_the_mask_brings_the_batch(dtype):
    """q, k, v of (H, T, d) with a mask of (B, H, T, S): B comes from the mask
    alone, and a 1-D kv_lengths of length B is still one length per
    sequence (with B == H it was read per head)."""
    q, k, v = make_qkv(202, (2, 3, 4), (2, 6, 4), (2, 6, 3), dtype)
    mask = np.ones((2, 2, 3, 6), bool)
    mask[1, 0, :, 0] = False
    out = ca.attention(q, k, v, mask=mask, kv_lengths=np.array([2, 6]))
    for b, n in enumerate([2, 6]):
        assert_matches_reference(out[b], None, q, k[:, :n], v[:, :n], mask=mask[b, :, :, :n])
    assert_bitwise_equal(out, ca.attention(q, k, v, mask=mask, kv_lengths=[[2], [6]]))
    with pytest.raises(ValueError, match=r"kv_lengths of shape \(3,\) is ambiguous"):
        ca.attention(q, k, v, mask=mask, kv_lengths=np.array([2, 6, 1]))
    # grouped heads (4 query heads, 2 K/V heads, B = 4 from the mask)
    q, k, v = make_qkv(203, (4, 3, 4), (2, 6, 4), (2, 6, 3), dtype)
    mask = np.ones((4, 4, 3, 6), bool)
    lengths = [1, 2, 3, 6]
    grouped = ca.attention(q, k, v, mask=mask, kv_lengths=np.array(lengths), enable_gqa=True)
    assert_bitwise_equal(grouped, ca.attention(q, k, v, mask=mask, enable_gqa=True,
                                               kv_lengths=np.array(lengths)[:, None]))
    for b, n in enumerate(lengths):
        assert_matches_reference(grouped[b], None, q, np.repeat(k[:, :n], 2, axis=0),
                                 np.repeat(v[:, :n], 2, axis=0), mask=mask[b, :, :, :n])


@pytest.mark.parametrize("entry", ["attention", "scores", "varlen", "paged"])
def test_alibi_slopes_beyond_the_compute_dtype_are_refused(entry):
    """A slope float32 cannot hold would make its biases infinite (NaN rows):
    refused on every entry with float32 inputs, as scale and softcap are;
    float64 inputs take it."""
    x = np.ones((2, 3, 4), np.float32)
    slopes = np.array([-1e39, 0.5])
    calls = {
        "attention": lambda a, s: ca.attention(a, a, a, alibi_slopes=s),
        "scores": lambda a, s: ca.attention_scores(a, a, alibi_slopes=s),
        "varlen": lambda a, s: ca.attention_varlen(
            a.transpose(1, 0, 2), a.transpose(1, 0, 2), a.transpose(1, 0, 2), [0, 3], [0, 3],
            alibi_slopes=s),
        "paged": lambda a, s: ca.attention_with_paged_kvcache(
            a[None], a[:, None], a[:, None], np.zeros((1, 1), np.intp), np.array([3]),
            alibi_slopes=s),
    }
    with pytest.raises(ValueError, match=r"alibi_slopes must lie in .* float32"):
        calls[entry](x, slopes)
    if entry != "paged":
        # float64 holds it: the biases are finite, the rows too
        assert np.all(np.isfinite(calls[entry](x.astype(np.float64), np.array([-1e-30, 1e39]))))


def _small_cache(max_keys, length_dtype, lengths):
    k_cache = np.zeros((2, 1, max_keys, 4), np.float32)
    v_cache = np.zeros((2, 1, max_keys, 4), np.float32)
    return k_cache, v_cache, np.array(lengths, dtype=length_dtype)


@pytest.mark.parametrize("length_dtype,max_keys", [(np.uint8, 300), (np.int8, 200),
                                                   (np.int16, 40000)])
def test_cache_lengths_dtype_must_hold_s_max(length_dtype, max_keys):
    k_cache, v_cache, lengths = _small_cache(max_keys, length_dtype, [100, 120])
    q = np.ones((2, 1, 1, 4), np.float32)
    new = np.ones((2, 1, 10, 4), np.float32)
    with pytest.raises(TypeError, match=rf"cache_lengths of dtype {np.dtype(length_dtype)} "
                                        rf"cannot hold S_max = {max_keys}.*int32"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, new)
    assert lengths.tolist() == [100, 120] and not k_cache.any()


def test_narrow_cache_lengths_that_hold_s_max_are_accepted_and_cannot_wrap():
    k_cache, v_cache, lengths = _small_cache(255, np.uint8, [240, 245])
    q = np.ones((2, 1, 1, 4), np.float32)
    new = np.ones((2, 1, 10, 4), np.float32)
    ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, new)
    assert lengths.dtype == np.uint8 and lengths.tolist() == [250, 255]
    with pytest.raises(ValueError, match=r"cache overflow"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, new)
    assert lengths.tolist() == [250, 255]


def test_negative_cache_lengths_have_their_own_message():
    k_cache, v_cache, lengths = _small_cache(16, np.int64, [3, -1])
    q = np.ones((2, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"cache_lengths must be >= 0; got \[3, -1\]"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths)
    with pytest.raises(ValueError, match=r"cache_lengths must be >= 0"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, np.ones((2, 1, 1, 4)),
                                  np.ones((2, 1, 1, 4)))


def test_3d_k_new_reports_the_expected_4d_shape():
    k_cache, v_cache, lengths = _small_cache(16, np.int64, [3, 1])
    q = np.ones((2, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"k_new must be 4-D \(B, H_kv, T_new, d\) = "
                                         r"\(2, 1, T_new, 4\); got shape \(2, 1, 4\)"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, np.ones((2, 1, 4)),
                                  np.ones((2, 1, 1, 4)))
    with pytest.raises(ValueError, match=r"v_new must be 4-D"):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, np.ones((2, 1, 1, 4)),
                                  np.ones((1, 4)))
    # of the cache dtype, as a serving step's rows are: 0-d and 1-d rows too
    for k_new in (np.float32(1.0), np.ones(4, np.float32), np.ones((2, 1, 4), np.float32)):
        with pytest.raises(ValueError, match=r"k_new must be 4-D"):
            ca.attention_with_kvcache(q, k_cache, v_cache, lengths, np.asarray(k_new),
                                      np.ones((2, 1, 1, 4), np.float32))
    assert lengths.tolist() == [3, 1]


# ---- decoding options: enable_gqa, window, softcap, ALiBi --------------------

KVCACHE_OPTIONS = {
    "window": dict(window=(5, None)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05])),
    "all": dict(window=(9, 0), softcap=2.0, alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05])),
}


@pytest.mark.parametrize("option", list(KVCACHE_OPTIONS))
@pytest.mark.parametrize("T_new", [1, 3])
@pytest.mark.parametrize("enable_gqa", [None, True])
def test_kvcache_options_match_the_reference(dtype, option, T_new, enable_gqa):
    rng = np.random.default_rng(210)
    B, H, H_kv, S_max, d = 2, 4, 2, 40, 8
    k_cache = rng.standard_normal((B, H_kv, S_max, d)).astype(dtype)
    v_cache = rng.standard_normal((B, H_kv, S_max, 6)).astype(dtype)
    lengths = np.array([17, 30])
    q = rng.standard_normal((B, H, T_new, d)).astype(dtype)
    k_new = rng.standard_normal((B, H_kv, T_new, d)).astype(dtype)
    v_new = rng.standard_normal((B, H_kv, T_new, 6)).astype(dtype)
    kwargs = KVCACHE_OPTIONS[option]
    attn, lse = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new,
                                          enable_gqa=enable_gqa, return_lse=True, **kwargs)
    assert lengths.tolist() == [17 + T_new, 30 + T_new]
    assert_matches_reference(attn, None, q, repeat_kv(k_cache, 2), repeat_kv(v_cache, 2),
                             True, lse=lse, kv_lengths=lengths[:, None], **kwargs)


def test_kvcache_enable_gqa_false_needs_equal_heads_and_writes_nothing():
    k_cache, v_cache, lengths = _small_cache(16, np.int64, [3, 1])
    new = np.ones((2, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"enable_gqa=False.*\(2, 2, 1, 4\).*2.*1"):
        ca.attention_with_kvcache(np.ones((2, 2, 1, 4), np.float32), k_cache, v_cache,
                                  lengths, new, new, enable_gqa=False)
    assert lengths.tolist() == [3, 1] and not k_cache.any()
    out = ca.attention_with_kvcache(np.ones((2, 1, 1, 4), np.float32), k_cache, v_cache,
                                    lengths, new, new, enable_gqa=False)
    assert out.shape == (2, 1, 1, 4) and lengths.tolist() == [4, 2]
    with pytest.raises(TypeError, match=r"enable_gqa must be a bool"):
        ca.attention_with_kvcache(np.ones((2, 1, 1, 4), np.float32), k_cache, v_cache,
                                  lengths, enable_gqa="yes")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(window=(-1, 0)), ValueError, r"window left must be >= 0"),
    (dict(softcap=0.0), ValueError, r"softcap must be a positive"),
    (dict(alibi_slopes=np.array([1.0, 2.0, 3.0])), ValueError, r"alibi_slopes of shape \(3,\)"),
    (dict(alibi_slopes=np.array([np.nan, 1.0])), ValueError, r"alibi_slopes must be finite"),
    (dict(alibi_slopes=np.array([-1e39, 1.0])), ValueError,
     r"alibi_slopes must lie in \[-3.403e\+38, 3.403e\+38\] \(the range of float32"),
    (dict(scale=1e300), ValueError, r"not representable in float32"),
    (dict(num_threads=0), ValueError, r"num_threads"),
    (dict(causal="yes"), TypeError, r"causal must be a bool"),
])
def test_kvcache_option_errors_write_nothing(kwargs, error, match):
    k_cache, v_cache, lengths = _small_cache(16, np.int64, [3, 1])
    q = np.ones((2, 2, 1, 4), np.float32)
    new = np.ones((2, 1, 1, 4), np.float32)
    with pytest.raises(error, match=match):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, new, **kwargs)
    assert lengths.tolist() == [3, 1] and not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("cache_dtype,change,error,match", [
    # read otherwise, the cache would be copied whole on every call
    (np.float32, dict(k_cache="misaligned"), ValueError,
     r"k_cache must be aligned with strides that are multiples of its itemsize"),
    (np.int8, dict(v_scale="misaligned"), ValueError,
     r"v_scale must be aligned with strides that are multiples of 4"),
    # a float16 cache would store it as inf (every later call: NaN)
    (np.float16, dict(k_new=1e5), ValueError,
     r"k_new\[1, 0, 1, 2\] = 100000\.0 is beyond the range of the float16 cache "
     r"\(largest 65504\.0\): it would be stored as inf"),
    (np.float32, dict(v_new=1e300), ValueError,
     r"v_new\[1, 0, 1, 2\] = 1e\+300 is beyond the range of the float32 cache"),
    # an int8 cache cannot quantize it
    (np.int8, dict(v_new=np.nan), ValueError,
     r"v_new: rows hold NaN or infinite values \(first at row index \(1, 0, 1\)\)"),
])
def test_kvcache_refuses_what_it_cannot_store_and_writes_nothing(cache_dtype, change, error,
                                                                 match):
    k_cache = np.zeros((2, 1, 16, 4), cache_dtype)
    v_cache = np.zeros((2, 1, 16, 4), cache_dtype)
    scales = {}
    if cache_dtype == np.int8:
        scales = dict(k_scale=np.zeros((2, 1, 16), np.float32),
                      v_scale=np.zeros((2, 1, 16), np.float32))
    lengths = np.array([3, 1])
    new = {"k_new": np.ones((2, 1, 2, 4)), "v_new": np.ones((2, 1, 2, 4))}
    for name, value in change.items():
        if value == "misaligned":
            if name in scales:
                scales[name] = misaligned(scales[name])
            else:
                k_cache = misaligned(k_cache)
        else:
            new[name][1, 0, 1, 2] = value
    before = [a.copy() for a in (k_cache, v_cache, lengths, *scales.values())]
    q = np.ones((2, 2, 1, 4), np.float16 if cache_dtype == np.float16 else np.float32)
    with pytest.raises(error, match=match):
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new["k_new"], new["v_new"],
                                  **scales)
    for a, b in zip(before, (k_cache, v_cache, lengths, *scales.values())):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("value,stored", [(1e5, None), (65520.0, None),
                                          (65519.99, 65504.0), (-65519.99, -65504.0)])
def test_kvcache_float32_rows_into_float16_cache_round_or_are_refused(value, stored):
    """The serving step with float32 rows for a float16 cache: a value that
    rounds to inf is refused (naming it, with no warning first, nothing
    written); one just below rounds to float16's largest."""
    k_cache = np.zeros((2, 2, 16, 4), np.float16)
    v_cache = np.zeros((2, 2, 16, 4), np.float16)
    lengths = np.array([3, 1])
    q = np.ones((2, 4, 1, 4), np.float32)
    k_new = np.ones((2, 2, 1, 4), np.float32)
    k_new[1, 1, 0, 2] = value
    before = [a.copy() for a in (k_cache, v_cache, lengths)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if stored is None:
            with pytest.raises(ValueError, match=r"k_new\[1, 1, 0, 2\] = .* beyond the range "
                               r"of the float16 cache"):
                ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, k_new / 2)
            for a, b in zip(before, (k_cache, v_cache, lengths)):
                assert_bitwise_equal(a, b)
            return
        ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, k_new / 2)
    assert lengths.tolist() == [4, 2]
    assert k_cache[1, 1, 1, 2] == stored and v_cache[1, 1, 1, 2] == np.float16(value / 2)


def test_kvcache_failed_computation_gives_the_rows_back(monkeypatch):
    """A call that fails after its append (out of memory) puts cache_lengths
    back: the slots past them are free again."""
    k_cache, v_cache, lengths = _small_cache(16, np.int64, [3, 1])
    new = np.ones((2, 1, 2, 4), np.float32)
    # a broadcast q of 2**60 rows with d_k = 1 and d_v = 8: an output no
    # array can hold
    huge_q = np.lib.stride_tricks.as_strided(np.ones(1, np.float32), (2, 1, 2**59, 1),
                                             (0, 0, 0, 0))
    narrow_k = np.zeros((2, 1, 16, 1), np.float32)
    wide_v = np.zeros((2, 1, 16, 8), np.float32)
    with pytest.raises(ValueError, match="the output would hold .* more bytes than an array"):
        ca.attention_with_kvcache(huge_q, narrow_k, wide_v, lengths, new[..., :1],
                                  np.ones((2, 1, 2, 8), np.float32))
    assert lengths.tolist() == [3, 1]

    def out_of_memory(*args, **kwargs):
        raise MemoryError("cattention: could not allocate scratch memory")

    monkeypatch.setattr("cattention._prepare.dense.run", out_of_memory)
    monkeypatch.setattr(driver, "kvcache_shortcut", lambda *args: None)
    with pytest.raises(MemoryError):
        ca.attention_with_kvcache(np.ones((2, 2, 2, 4), np.float32), k_cache, v_cache,
                                  lengths, new, new)
    assert lengths.tolist() == [3, 1]


_FAILING_SCRATCH = """
import re, resource
import numpy as np
import cattention as ca
S = 1 << 21
k_cache = np.ones((1, 1, S, 8), np.float32)
v_cache = np.ones((1, 1, S, 8), np.float32)
lengths = np.array([S - 200], dtype=np.{length_dtype})
chunk = np.full((1, 1, 100, 8), 2, np.float32)
ca.attention(chunk, chunk, chunk, num_threads=1)
# room for small allocations, not for the chunk's 64 MiB of packed keys
status = open("/proc/self/status").read()
in_use = int(re.search(r"VmSize:\\s+(\\d+)", status).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (in_use + (16 << 20), resource.RLIM_INFINITY))
try:
    ca.attention_with_kvcache(chunk, k_cache, v_cache, lengths, chunk, chunk, num_threads=1)
    print("no error")
except MemoryError as error:
    print(type(error).__name__, int(lengths[0]), float(k_cache[0, 0, S - 150, 0]))
"""


@pytest.mark.parametrize("length_dtype", ["int64", "int32"])
def test_kvcache_step_failing_for_scratch_gives_the_rows_back(length_dtype):
    """The serving step's compiled path too: a step whose scratch cannot be
    allocated raises MemoryError with cache_lengths put back (the new rows
    were written to the slots past them)."""
    result = subprocess.run([sys.executable, "-c", _FAILING_SCRATCH.format(
        length_dtype=length_dtype)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["MemoryError", str((1 << 21) - 200), "2.0"]


def _serving_case(seed, dtype, cache_dtype, new_dtype, heads, kv_heads, T, lengths,
                  length_dtype, max_keys=40, d_k=16, d_v=8):
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    k_cache = rng.standard_normal((batch, kv_heads, max_keys, d_k)).astype(cache_dtype)
    v_cache = rng.standard_normal((batch, kv_heads, max_keys, d_v)).astype(cache_dtype)
    q = rng.standard_normal((batch, heads, T, d_k)).astype(dtype)
    k_new = rng.standard_normal((batch, kv_heads, T, d_k)).astype(new_dtype)
    v_new = rng.standard_normal((batch, kv_heads, T, d_v)).astype(new_dtype)
    return q, k_cache, v_cache, np.array(lengths, dtype=length_dtype), k_new, v_new


# (H, H_kv, T): ungrouped; grouped decode (rows stacked per K/V head: G * T
# <= 8); a grouped prompt chunk (query heads broadcast against their K/V head)
@pytest.mark.parametrize("heads,kv_heads,T", [(2, 2, 1), (2, 2, 3), (8, 2, 1), (8, 2, 2),
                                              (4, 1, 5), (6, 3, 9)])
@pytest.mark.parametrize("types", [("float32", "float32", "float32"),
                                   ("float64", "float64", "float64"),
                                   ("float32", "float16", "float32"),
                                   ("float32", "float16", "float16")],
                         ids=["f32", "f64", "f16-cache", "f16-cache-f16-new"])
@pytest.mark.parametrize("append", [True, False], ids=["append", "read"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_kvcache_serving_step_matches_reference_and_general_path(
        compiled_path, general_path, heads, kv_heads, T, types, append, causal):
    """The serving step (float caches, no options) runs a compiled path of
    its own: its output matches the float64 reference, and its output,
    caches and lengths are bitwise those of the general path."""
    dtype, cache_dtype, new_dtype = types
    taken = compiled_path("kvcache_shortcut")
    for seed, (lengths, length_dtype) in enumerate([([7, 0, 30], np.int64),
                                                   ([31, 12], np.int32)]):
        if not append:
            lengths = [max(n, T) for n in lengths]
        q, k_cache, v_cache, cache_lengths, k_new, v_new = _serving_case(
            900 + seed, dtype, cache_dtype, new_dtype, heads, kv_heads, T, lengths,
            length_dtype)
        step = (k_new, v_new) if append else ()
        general = [a.copy() for a in (k_cache, v_cache, cache_lengths)]
        out = ca.attention_with_kvcache(q, k_cache, v_cache, cache_lengths, *step,
                                        causal=causal)
        with general_path("kvcache_shortcut"):
            expected = ca.attention_with_kvcache(q, *general, *step, causal=causal)
        assert taken == [True] * (seed + 1)
        assert out.dtype == np.dtype(dtype) and out.shape == expected.shape
        assert_bitwise_equal(out, expected)
        for got, want in zip((k_cache, v_cache, cache_lengths), general):
            assert got.dtype == want.dtype
            assert_bitwise_equal(got, want)
        group = heads // kv_heads
        for b, n in enumerate(cache_lengths.tolist()):
            assert n == lengths[b] + (T if append else 0)
            k_seen = k_cache[b, :, :n].astype(dtype)
            v_seen = v_cache[b, :, :n].astype(dtype)
            assert_matches_reference(out[b], None, q[b], repeat_kv(k_seen, group),
                                     repeat_kv(v_seen, group), causal=causal)


def test_kvcache_serving_step_leaves_self_overlapping_caches_to_the_general_path(
        general_path):
    """A writable cache whose rows overlap (an as_strided view) is written
    element by element in NumPy's order, as the general path writes it, not
    row by row: the cache ends the same either way."""
    def step(general):
        buffer = np.arange(200, dtype=np.float32)
        k_cache = np.lib.stride_tricks.as_strided(buffer, (1, 1, 16, 4),
                                                  (800, 800, 4, 4))[:, :, ::-1]
        v_cache = np.zeros((1, 1, 16, 4), np.float32)
        k_new = (np.arange(8, dtype=np.float32) + 1000).reshape(1, 1, 2, 4)
        with general_path("kvcache_shortcut") if general else contextlib.nullcontext():
            out = ca.attention_with_kvcache(np.ones((1, 1, 1, 4), np.float32), k_cache,
                                            v_cache, np.array([3]), k_new,
                                            np.ones((1, 1, 2, 4), np.float32))
        return out, buffer

    fast, general = step(False), step(True)
    assert_bitwise_equal(fast[0], general[0])
    assert_bitwise_equal(fast[1], general[1])


def test_kvcache_serving_step_takes_strided_views_and_threads_alike():
    """Strided q and caches (views into larger buffers), new rows from a
    transposed buffer, 1 and 2 threads: the bits of contiguous copies."""
    q, k_cache, v_cache, lengths, k_new, v_new = _serving_case(
        910, np.float32, np.float32, np.float32, 8, 2, 1, [5, 17], np.int64)
    expected_caches = [a.copy() for a in (k_cache, v_cache, lengths)]
    expected = ca.attention_with_kvcache(q, *expected_caches, k_new, v_new)
    q_wide = np.zeros(q.shape[:-1] + (2 * q.shape[-1],), np.float32)
    q_wide[..., ::2] = q
    for threads in (1, 2):
        k_buffer = np.zeros(k_cache.shape[:-1] + (3 * k_cache.shape[-1],), np.float32)
        v_buffer = np.zeros((2,) + v_cache.shape, np.float32)
        k_strided, v_strided = k_buffer[..., 1::3], v_buffer[1]
        k_strided[...] = k_cache
        v_strided[...] = v_cache
        step_lengths = lengths.copy()
        k_new_t = np.ascontiguousarray(np.swapaxes(k_new, 2, 3)).swapaxes(2, 3)
        out = ca.attention_with_kvcache(q_wide[..., ::2], k_strided, v_strided,
                                        step_lengths, k_new_t, v_new, num_threads=threads)
        assert_bitwise_equal(out, expected)
        assert_bitwise_equal(k_strided, expected_caches[0])
        assert_bitwise_equal(v_strided, expected_caches[1])
        assert step_lengths.tolist() == expected_caches[2].tolist()
        assert np.all(k_buffer[..., 0::3] == 0) and np.all(v_buffer[0] == 0)
