"""Arrays in non-native byte order (np.load of a big-endian .npy, FITS, HDF5,
np.frombuffer(">f4")) give exactly the result of their native copies, or a
clear error where converting would copy a cache that is written in place."""

import numpy as np
import pytest

import cattention as ca
from reference import assert_bitwise_equal, assert_matches_reference, make_qkv

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def swapped(arr):
    """The same values stored in the other byte order."""
    arr = np.asarray(arr)
    return arr.astype(arr.dtype.newbyteorder("S"))


def test_swapped_helper_really_swaps():
    x = np.arange(3, dtype=np.float32)
    assert not swapped(x).dtype.isnative
    assert swapped(x).tobytes() != x.tobytes()
    np.testing.assert_array_equal(swapped(x), x)


@pytest.mark.parametrize("return_scores", [False, True], ids=["attn", "scores"])
@pytest.mark.parametrize("operand", ["q", "k", "v", "all"])
def test_q_k_v_in_other_byte_order(dtype, operand, return_scores):
    q, k, v = make_qkv(1, (2, 16, 8), (2, 16, 8), (2, 16, 8), dtype)
    native = ca.attention(q, k, v, return_scores=return_scores)
    args = {"q": q, "k": k, "v": v}
    for name in (["q", "k", "v"] if operand == "all" else [operand]):
        args[name] = swapped(args[name])
    result = ca.attention(args["q"], args["k"], args["v"], return_scores=return_scores)
    results = result if return_scores else (result,)
    for got, want in zip(results, native if return_scores else (native,)):
        assert got.dtype.isnative
        assert_bitwise_equal(got, want)
    # and the result is right, not merely consistent
    assert_matches_reference(results[0], results[1] if return_scores else None, q, k, v)


def test_issue_reproducer_big_endian_self_attention():
    q = np.random.default_rng(0).standard_normal((2, 16, 8)).astype(">f4")
    out = ca.attention(q, q, q)
    assert np.all(np.isfinite(out))
    assert_bitwise_equal(out, ca.attention(q.astype("<f4"), q.astype("<f4"),
                                           q.astype("<f4")))
    q64 = q.astype(">f8")
    assert_matches_reference(ca.attention(q64, q64, q64), None, q64, q64, q64)


def test_scores_and_lse_in_other_byte_order(dtype):
    q, k, v = make_qkv(2, (3, 5, 8), (3, 9, 8), (3, 9, 4), dtype)
    want = ca.attention(q, k, v, causal=True, return_scores=True, return_lse=True)
    got = ca.attention(swapped(q), swapped(k), swapped(v), causal=True,
                       return_scores=True, return_lse=True)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w)
    assert_bitwise_equal(ca.attention_scores(swapped(q), swapped(k)),
                         ca.attention_scores(q, k))


def test_float16_kv_in_other_byte_order():
    q, k, v = make_qkv(3, (2, 4, 3, 16), (2, 4, 40, 16), (2, 4, 40, 8), np.float32)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    want = ca.attention(q, k16, v16)
    assert_bitwise_equal(ca.attention(q, swapped(k16), swapped(v16)), want)
    assert_bitwise_equal(ca.attention(swapped(q), k16, swapped(v16)), want)


@pytest.mark.parametrize("kind", ["bool", "float32", "float64"])
def test_mask_in_other_byte_order(dtype, kind):
    q, k, v = make_qkv(4, (2, 6, 8), (2, 11, 8), (2, 11, 3), dtype)
    rng = np.random.default_rng(5)
    if kind == "bool":
        mask = rng.random((6, 11)) > 0.3
    else:
        mask = np.where(rng.random((6, 11)) > 0.3, rng.standard_normal((6, 11)),
                        -np.inf).astype(kind)
    want = ca.attention(q, k, v, mask=mask, return_scores=True)
    got = ca.attention(q, k, v, mask=swapped(mask), return_scores=True)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w)


@pytest.mark.parametrize("length_dtype", [">i4", ">i8", ">u2"])
def test_kv_lengths_in_other_byte_order(dtype, length_dtype):
    q, k, v = make_qkv(6, (3, 2, 4, 8), (3, 2, 20, 8), (3, 2, 20, 5), dtype)
    lengths = np.array([20, 3, 0])
    want = ca.attention(q, k, v, kv_lengths=lengths, return_lse=True)
    got = ca.attention(q, k, v, kv_lengths=lengths.astype(length_dtype), return_lse=True)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w)


def test_alibi_slopes_in_other_byte_order(dtype):
    q, k, v = make_qkv(7, (2, 4, 5, 8), (2, 4, 12, 8), (2, 4, 12, 3), dtype)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    want = ca.attention(q, k, v, causal=True, alibi_slopes=slopes)
    for order in (">f8", ">f4"):
        assert_bitwise_equal(
            ca.attention(q, k, v, causal=True, alibi_slopes=slopes.astype(order)),
            ca.attention(q, k, v, causal=True, alibi_slopes=slopes.astype(order[1:])))
    assert_bitwise_equal(
        ca.attention(q, k, v, causal=True, alibi_slopes=slopes.astype(">f8")), want)


def _cache_case(dtype, length_dtype=np.int64):
    rng = np.random.default_rng(8)
    k_cache = rng.standard_normal((2, 2, 16, 8)).astype(dtype)
    v_cache = rng.standard_normal((2, 2, 16, 4)).astype(dtype)
    lengths = np.array([3, 9], dtype=length_dtype)
    q = rng.standard_normal((2, 4, 2, 8)).astype(dtype)
    k_new = rng.standard_normal((2, 2, 2, 8)).astype(dtype)
    v_new = rng.standard_normal((2, 2, 2, 4)).astype(dtype)
    return q, k_cache, v_cache, lengths, k_new, v_new


def test_kvcache_q_new_and_lengths_in_other_byte_order(dtype):
    q, k_cache, v_cache, lengths, k_new, v_new = _cache_case(dtype)
    want = ca.attention_with_kvcache(q, k_cache.copy(), v_cache.copy(), lengths.copy(),
                                     k_new, v_new, return_lse=True)
    big_lengths = lengths.astype(">i8")
    k_written, v_written = k_cache.copy(), v_cache.copy()
    got = ca.attention_with_kvcache(swapped(q), k_written, v_written, big_lengths,
                                    swapped(k_new), swapped(v_new), return_lse=True)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w)
    # the big-endian lengths were advanced in place, as native ones are
    assert big_lengths.dtype.str == ">i8" and big_lengths.tolist() == [5, 11]
    assert np.array_equal(k_written[0, :, 3:5], k_new[0])


def test_kvcache_refuses_caches_in_other_byte_order():
    q, k_cache, v_cache, lengths, k_new, v_new = _cache_case(np.float32)
    for name, args in (("k_cache", (swapped(k_cache), v_cache)),
                       ("v_cache", (k_cache, swapped(v_cache)))):
        before = lengths.copy()
        with pytest.raises(TypeError, match=rf"{name} has non-native byte order.*copy"):
            ca.attention_with_kvcache(q, *args, lengths, k_new, v_new)
        assert lengths.tolist() == before.tolist()


def test_merge_inputs_in_other_byte_order(dtype):
    q, k, v = make_qkv(9, (2, 5, 8), (2, 12, 8), (2, 12, 3), dtype)
    first = ca.attention(q, k[:, :7], v[:, :7], return_lse=True)
    rest = ca.attention(q, k[:, 7:], v[:, 7:], return_lse=True)
    want = ca.merge([first[0], rest[0]], [first[1], rest[1]])
    got = ca.merge([swapped(first[0]), rest[0]], [first[1], swapped(rest[1])])
    for g, w in zip(got, want):
        assert g.dtype.isnative
        assert_bitwise_equal(g, w)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_mix_of_byte_orders_gives_the_native_result(data):
    """Every array argument of attention drawn in either byte order."""
    dtype = data.draw(st.sampled_from([np.float32, np.float64]))
    T = data.draw(st.sampled_from([1, 3, 17]))
    S = data.draw(st.sampled_from([1, 9, 40]))
    seed = data.draw(st.integers(0, 2**16))
    q, k, v = make_qkv(seed, (2, 3, T, 8), (2, 3, S, 8), (2, 3, S, 5), dtype)
    rng = np.random.default_rng(seed)
    mask = rng.random((T, S)) > 0.2 if data.draw(st.booleans()) else None
    lengths = rng.integers(0, S + 1, size=2) if data.draw(st.booleans()) else None
    slopes = rng.random(3) if data.draw(st.booleans()) else None
    native = dict(q=q, k=k, v=v, mask=mask, kv_lengths=lengths, alibi_slopes=slopes)
    mixed = {name: (swapped(arr) if arr is not None and data.draw(st.booleans(), label=name)
                    else arr)
             for name, arr in native.items()}
    causal = data.draw(st.booleans())
    want = ca.attention(native.pop("q"), native.pop("k"), native.pop("v"), causal=causal,
                        return_lse=True, **native)
    got = ca.attention(mixed.pop("q"), mixed.pop("k"), mixed.pop("v"), causal=causal,
                       return_lse=True, **mixed)
    for g, w in zip(got, want):
        assert_bitwise_equal(g, w)
