"""Packed variable-length attention (attention_varlen) against the float64
reference, each sequence computed alone on its own (padding-free) arrays."""

import numpy as np
import pytest

import cattention as ca
from reference import assert_bitwise_equal, assert_matches_reference


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _packed(rng, lengths, heads, d, dtype):
    return rng.standard_normal((int(np.sum(lengths)), heads, d)).astype(dtype)


def _check_each_sequence(attn, lse, q, k, v, cu_q, cu_k, group, causal=False, **options):
    """Every sequence against the reference on its own (H, T_i, d) arrays."""
    for i in range(len(cu_q) - 1):
        rows = slice(cu_q[i], cu_q[i + 1])
        keys = slice(cu_k[i], cu_k[i + 1])
        q_i = np.swapaxes(q[rows], 0, 1)
        k_i = np.repeat(np.swapaxes(k[keys], 0, 1), group, axis=0)
        v_i = np.repeat(np.swapaxes(v[keys], 0, 1), group, axis=0)
        assert_matches_reference(
            np.swapaxes(attn[rows], 0, 1), None, q_i, k_i, v_i, causal=causal,
            lse=None if lse is None else np.swapaxes(lse[rows], 0, 1), **options)


LENGTH_CASES = {
    "mixed": ([5, 0, 1, 17, 130, 2], [5, 3, 1, 17, 300, 0]),
    "prefill": ([97, 1, 200], [97, 1, 200]),
    "decode": ([1, 1, 1, 1], [40, 1, 700, 0]),
    "empty": ([0, 0], [0, 4]),
}


@pytest.mark.parametrize("case", sorted(LENGTH_CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (16, 1)], ids=str)
def test_varlen_matches_reference(simd, dtype, case, causal, heads):
    q_lengths, k_lengths = LENGTH_CASES[case]
    n_heads, n_kv_heads = heads
    rng = np.random.default_rng(len(q_lengths) + n_heads)
    q = _packed(rng, q_lengths, n_heads, 16, dtype)
    k = _packed(rng, k_lengths, n_kv_heads, 16, dtype)
    v = _packed(rng, k_lengths, n_kv_heads, 12, dtype)
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    attn, lse = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=causal,
                                    enable_gqa=n_heads != n_kv_heads, return_lse=True)
    assert attn.shape == (q.shape[0], n_heads, 12) and attn.dtype == dtype
    assert lse.shape == (q.shape[0], n_heads)
    _check_each_sequence(attn, lse, q, k, v, cu_q, cu_k, n_heads // n_kv_heads, causal)


@pytest.mark.parametrize("option", ["window", "softcap", "alibi", "sinks"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=str)
def test_varlen_options(simd, dtype, option, heads):
    n_heads, n_kv_heads = heads
    q_lengths, k_lengths = [1, 9, 1, 120, 3], [30, 9, 1, 260, 0]
    rng = np.random.default_rng(7)
    q = _packed(rng, q_lengths, n_heads, 8, dtype)
    k = _packed(rng, k_lengths, n_kv_heads, 8, dtype)
    v = _packed(rng, k_lengths, n_kv_heads, 8, dtype)
    kwargs = {
        "window": {"window": (5, 0)},
        "softcap": {"softcap": 2.0},
        "alibi": {"alibi_slopes": rng.uniform(0.01, 0.5, n_heads)},
        "sinks": {"sinks": np.where(np.arange(n_heads) % 3 == 0, -np.inf,
                                    rng.standard_normal(n_heads))},
    }[option]
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    attn, lse = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=True,
                                    enable_gqa=n_heads != n_kv_heads, return_lse=True,
                                    **kwargs)
    _check_each_sequence(attn, lse, q, k, v, cu_q, cu_k, n_heads // n_kv_heads, True,
                         **kwargs)


def test_varlen_float16_kv(simd):
    q_lengths, k_lengths = [1, 33, 4], [70, 33, 300]
    rng = np.random.default_rng(3)
    q = _packed(rng, q_lengths, 4, 16, np.float32)
    k = _packed(rng, k_lengths, 2, 16, np.float16)
    v = _packed(rng, k_lengths, 2, 16, np.float16)
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    attn = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=True, enable_gqa=True)
    assert attn.dtype == np.float32
    _check_each_sequence(attn, None, q, k.astype(np.float32), v.astype(np.float32),
                         cu_q, cu_k, 2, True)


def test_varlen_any_strides(simd, dtype):
    """Transposed and sliced views give the bits of their contiguous copies."""
    q_lengths, k_lengths = [3, 50, 1], [3, 80, 9]
    rng = np.random.default_rng(11)
    q = np.swapaxes(_packed(rng, q_lengths, 16, 4, dtype), 1, 2)      # (total, 4, 16)
    k = _packed(rng, k_lengths, 2, 32, dtype)[:, :, ::2]               # (total, 2, 16)
    v = np.asfortranarray(_packed(rng, k_lengths, 2, 8, dtype))
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    got = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=True, enable_gqa=True)
    want = ca.attention_varlen(np.ascontiguousarray(q), np.ascontiguousarray(k),
                               np.ascontiguousarray(v), cu_q, cu_k, causal=True,
                               enable_gqa=True)
    assert_bitwise_equal(got, want)
    _check_each_sequence(got, None, q, k, v, cu_q, cu_k, 2, True)


def test_varlen_threads_bitwise(dtype):
    q_lengths, k_lengths = [1, 300, 1, 40], [900, 300, 5, 1200]
    rng = np.random.default_rng(5)
    q = _packed(rng, q_lengths, 8, 32, dtype)
    k = _packed(rng, k_lengths, 2, 32, dtype)
    v = _packed(rng, k_lengths, 2, 32, dtype)
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    runs = [ca.attention_varlen(q, k, v, cu_q, cu_k, causal=True, enable_gqa=True,
                                return_lse=True, num_threads=n) for n in (1, 2, 3, 7)]
    for attn, lse in runs[1:]:
        assert_bitwise_equal(attn, runs[0][0])
        assert_bitwise_equal(lse, runs[0][1])


@pytest.mark.parametrize("bad, match", [
    ({"cu_seqlens_q": [1, 3]}, "cu_seqlens_q must start at 0 and end at total_q"),
    ({"cu_seqlens_q": [0, 2]}, "end at total_q"),
    ({"cu_seqlens_q": [0, 3, 2, 3]}, "non-decreasing|as many sequences"),
    ({"cu_seqlens_k": [0, 2.5, 5]}, "cu_seqlens_k must be an integer array"),
    ({"cu_seqlens_k": [[0, 5]]}, "cu_seqlens_k must be 1-D"),
    ({"cu_seqlens_k": [0, 1, 2, 5]}, "as many sequences"),
    ({"cu_seqlens_q": None}, "cu_seqlens_q must be an integer array, got None"),
])
def test_varlen_bad_lengths(bad, match):
    x = np.ones((3, 2, 4), np.float32)
    y = np.ones((5, 2, 4), np.float32)
    args = {"cu_seqlens_q": [0, 1, 3], "cu_seqlens_k": [0, 2, 5]}
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        ca.attention_varlen(x, y, y, args["cu_seqlens_q"], args["cu_seqlens_k"])


def test_varlen_bad_shapes():
    x = np.ones((3, 4, 8), np.float32)
    cu = [0, 3]
    with pytest.raises(ValueError, match=r"q must be 3-D .* got shape \(3, 8\)"):
        ca.attention_varlen(x[:, 0], x, x, cu, cu)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        ca.attention_varlen(x, x[:, :2], x[:, :2], cu, cu)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        ca.attention_varlen(x, x[:, :3], x[:, :3], cu, cu, enable_gqa=True)
    with pytest.raises(ValueError, match="share d_k"):
        ca.attention_varlen(x, x[:, :, :4], x, cu, cu)
    with pytest.raises(ValueError, match=r"k \(3, 4, 8\) and v \(2, 4, 8\) must share"):
        ca.attention_varlen(x, x, x[:2], cu, cu)
    with pytest.raises(ValueError, match=r"alibi_slopes must hold one real number per "
                                         r"query head, shape \(4,\)"):
        ca.attention_varlen(x, x, x, cu, cu, alibi_slopes=[0.1, 0.2])
    with pytest.raises(ValueError, match="sinks must be finite"):
        ca.attention_varlen(x, x, x, cu, cu, sinks=[0, 0, np.nan, 0])
    # the type error attention gives
    for name in ("alibi_slopes", "sinks"):
        with pytest.raises(TypeError, match=rf"^{name} must be real numbers, got dtype complex"):
            ca.attention_varlen(x, x, x, cu, cu, **{name: np.full(4, 1j)})
    # beside a float q, int8 K/V are quantized ones: without their scales, refused
    for k, v, name in ((x.astype(np.int8), x, "k"), (x, x.astype(np.int8), "v")):
        with pytest.raises(ValueError, match=rf"^{name} is int8 but {name}_scale is missing"):
            ca.attention_varlen(x, k, v, cu, cu)
    # all-integer inputs are integers, as for attention
    ints = x.astype(np.int8)
    np.testing.assert_array_equal(
        ca.attention_varlen(ints, ints, ints, cu, cu),
        np.swapaxes(ca.attention(*(np.swapaxes(ints, 0, 1),) * 3), 0, 1))


def test_varlen_byte_order_and_dtypes_give_the_native_bits(dtype):
    """Big-endian operands and lengths give bitwise the native result;
    float16 q, k, v compute in float32 and return float16."""
    q_lengths, k_lengths = [4, 1, 30], [9, 20, 30]
    rng = np.random.default_rng(13)
    q = _packed(rng, q_lengths, 4, 8, dtype)
    k = _packed(rng, k_lengths, 2, 8, dtype)
    v = _packed(rng, k_lengths, 2, 8, dtype)
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    want, want_lse = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=True, enable_gqa=True,
                                         return_lse=True, sinks=[0.5, -np.inf, 1.0, 0.0])
    swapped = [x.astype(x.dtype.newbyteorder(">")) for x in (q, k, v)]
    got, got_lse = ca.attention_varlen(
        *swapped, cu_q.astype(">i8"), cu_k.astype(">i4"), causal=True, enable_gqa=True,
        return_lse=True, sinks=np.array([0.5, -np.inf, 1.0, 0.0], ">f8"))
    assert_bitwise_equal(got, want)
    assert_bitwise_equal(got_lse, want_lse)
    half = [x.astype(np.float16) for x in (q, k, v)]
    got16 = ca.attention_varlen(*half, cu_q, cu_k, causal=True, enable_gqa=True)
    assert got16.dtype == np.float16
    assert_bitwise_equal(got16, ca.attention_varlen(
        *(x.astype(np.float32) for x in half), cu_q, cu_k, causal=True,
        enable_gqa=True).astype(np.float16))


@pytest.mark.parametrize("seed", range(10, 20))
def test_a_decode_row_beside_a_prompt_keeps_its_accuracy(simd, seed):
    """A 1-row sequence packed beside a 9-row one takes the packed path
    (alone it would take the direct one), whose score tiles summed all
    d_k = 256 products of a dot product in one float32 chain: with logits
    at 4x the default scale the row failed the tolerance rule on 17 of
    these 30 seed-tables. The tiles sum runs of 64 features from zero."""
    rng = np.random.default_rng(seed)
    heads, d_k, d_v = 2, 256, 64
    q = _packed(rng, [9, 1], heads, d_k, np.float32)
    k = _packed(rng, [300, 300], heads, d_k, np.float32)
    v = _packed(rng, [300, 300], heads, d_v, np.float32)
    scale = 4 / np.sqrt(d_k)
    attn = ca.attention_varlen(q, k, v, _cu([9, 1]), _cu([300, 300]), scale=scale)
    _check_each_sequence(attn, None, q, k, v, _cu([9, 1]), _cu([300, 300]), 1,
                         scale=scale)
