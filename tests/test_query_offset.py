"""query_offset: each batch entry's query row 0 at a given key position (a
chunk of a longer sequence at its global position) instead of the
bottom-right default, against the float64 reference (its own offset code),
with every option it composes with; chunks computed with it and merged are
attention over the whole sequence."""

import numpy as np
import pytest

import cattention as ca
from reference import (assert_bitwise_equal, assert_matches_reference, make_qkv,
                       reference_attention_lse)


def _grouped(k, v, n_heads):
    """K and V repeated to q's heads, for the reference (it has no groups)."""
    group = n_heads // k.shape[-3]
    return np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)


# (q shape, K/V heads, S, per-sequence offsets, options): the packed path
# (key blocks of 256, query blocks of 96), decode (direct path, stacked
# grouped rows), offsets before the keys, inside them and past them
OFFSET_CASES = {
    "causal": ((2, 2, 20, 16), 2, 40, [0, 35], dict(causal=True)),
    "causal-T>S": ((2, 2, 50, 16), 2, 30, [-12, 3], dict(causal=True)),
    "long": ((2, 1, 130, 16), 1, 600, [300, -50], dict(causal=True)),
    "past-the-keys": ((2, 2, 9, 8), 2, 30, [45, -40], dict(causal=True)),
    "window": ((2, 2, 20, 16), 2, 50, [10, 31], dict(window=(5, 3))),
    "window-causal-alibi": ((2, 2, 20, 16), 2, 50, [-4, 22],
                            dict(causal=True, window=(6, None),
                                 alibi_slopes=np.array([0.3, 0.7]))),
    "alibi": ((2, 2, 7, 8), 2, 30, [-9, 40], dict(alibi_slopes=np.array([0.2, 0.05]))),
    "lengths-starts": ((2, 2, 12, 16), 2, 40, [3, 20],
                       dict(causal=True, kv_lengths=np.array([30, 25]),
                            kv_starts=np.array([2, 0]))),
    "sinks-softcap": ((2, 2, 6, 8), 2, 25, [2, -3],
                      dict(causal=True, sinks=np.array([0.5, -1.0]), softcap=3.0)),
    "decode": ((2, 2, 1, 16), 2, 300, [150, 299], dict(causal=True)),
    "gqa-decode": ((2, 8, 2, 32), 2, 300, [100, 400], dict(enable_gqa=True, causal=True)),
    "gqa-prompt": ((2, 8, 12, 32), 2, 60, [30, 5], dict(enable_gqa=True, causal=True,
                                                       window=(7, 0))),
    "scores": ((2, 2, 9, 8), 2, 30, [5, -2], dict(return_scores=True, causal=True)),
}


@pytest.mark.parametrize("case", OFFSET_CASES)
def test_query_offset_matches_the_reference(simd, dtype, case):
    q_shape, kv_heads, S, offsets, options = OFFSET_CASES[case]
    options = dict(options)
    B, H, T, d = q_shape
    q, k, v = make_qkv(41, q_shape, (B, kv_heads, S, d), (B, kv_heads, S, d), dtype)
    offsets = np.array(offsets)
    return_scores = options.pop("return_scores", False)
    got = ca.attention(q, k, v, query_offset=offsets, return_lse=True,
                       return_scores=return_scores, **options)
    attn, lse = got[0], got[-1]
    ref_options = dict(options)
    ref_k, ref_v = k, v
    if ref_options.pop("enable_gqa", False):
        ref_k, ref_v = _grouped(k, v, H)
    for name in ("kv_lengths", "kv_starts"):
        if name in ref_options:
            ref_options[name] = ref_options[name][:, None]
    assert_matches_reference(attn, got[1] if return_scores else None, q, ref_k, ref_v,
                             query_offset=offsets[:, None], lse=lse, **ref_options)
    if return_scores:
        scores = ca.attention_scores(q, k, query_offset=offsets, **options)
        assert_bitwise_equal(scores, got[1])


@pytest.mark.parametrize("T,S", [(20, 40), (40, 20), (1, 300), (97, 97)])
def test_the_default_offset_is_bitwise_none(T, S):
    q, k, v = make_qkv(42, (2, 3, T, 16), (2, 3, S, 16), (2, 3, S, 16), np.float32)
    lengths = np.array([S, S // 2])
    for options in (dict(causal=True), dict(window=(5, 2), alibi_slopes=np.array([.1, .2, .3]))):
        assert_bitwise_equal(ca.attention(q, k, v, query_offset=S - T, **options),
                             ca.attention(q, k, v, **options))
        assert_bitwise_equal(
            ca.attention(q, k, v, kv_lengths=lengths, query_offset=lengths - T, **options),
            ca.attention(q, k, v, kv_lengths=lengths, **options))


def test_offsets_per_head_under_grouped_heads_and_per_entry_broadcast():
    """Offsets that differ within a group of query heads (no stacking of
    the group's rows), and a (B, H) array, against the reference."""
    q, k, v = make_qkv(43, (2, 4, 2, 16), (2, 2, 80, 16), (2, 2, 80, 16), np.float64)
    offsets = np.array([[0, 10, 20, 70], [5, 5, -1, 79]])
    out, lse = ca.attention(q, k, v, enable_gqa=True, causal=True, query_offset=offsets,
                            return_lse=True)
    ref_k, ref_v = _grouped(k, v, 4)
    assert_matches_reference(out, None, q, ref_k, ref_v, causal=True, query_offset=offsets,
                             lse=lse)
    # a scalar applies to every entry
    assert_bitwise_equal(ca.attention(q, k, v, enable_gqa=True, causal=True, query_offset=7),
                         ca.attention(q, k, v, enable_gqa=True, causal=True,
                                      query_offset=np.full((2, 4), 7)))


def test_rows_before_every_key_are_zero_and_rows_past_them_see_all():
    q, k, v = make_qkv(44, (2, 2, 30, 16), (2, 2, 50, 16), (2, 2, 50, 16), np.float32)
    out, lse = ca.attention(q, k, v, causal=True, query_offset=-30, return_lse=True)
    assert not out.any() and np.all(np.isneginf(lse))
    # a row at position -1 sees nothing, at 0 key 0 alone
    out = ca.attention(q, k, v, causal=True, query_offset=-1)
    assert not out[..., 0, :].any()
    np.testing.assert_array_equal(out[..., 1, :], v[..., 0, :])
    for far in (50, 10**6, 2**62):
        assert_bitwise_equal(ca.attention(q, k, v, causal=True, query_offset=far),
                             ca.attention(q, k, v))
    assert not ca.attention(q, k, v, causal=True, query_offset=-2**62).any()


@pytest.mark.parametrize("offset", [2**62, -2**62, 2**62 - 29])
def test_extreme_offsets_with_the_widest_windows_do_not_overflow(dtype, offset):
    """Positions near +-2^62 with windows of 2^62 (the widest, wider ones are
    clamped to it): every sum stays within 64 bits; ALiBi distances follow
    the reference's Python integers."""
    q, k, v = make_qkv(45, (1, 2, 30, 8), (1, 2, 40, 8), (1, 2, 40, 8), dtype)
    for window in ((2**62, 2**62), (2**63, 2**63), (None, 2**62), (2**62, 0)):
        for causal in (False, True):
            options = dict(causal=causal, window=window)
            out, lse = ca.attention(q, k, v, query_offset=offset, return_lse=True, **options)
            ref_window = tuple(min(w, 2**62) if w is not None else None for w in window)
            assert_matches_reference(out, None, q, k, v, causal=causal, window=ref_window,
                                     query_offset=offset, lse=lse)
    slopes = np.array([1e-19, 0.0])
    out = ca.attention(q, k, v, query_offset=offset, alibi_slopes=slopes)
    assert_matches_reference(out, None, q, k, v, query_offset=offset, alibi_slopes=slopes)


def _chunk_bounds(n, pieces, rng):
    cuts = np.sort(rng.choice(np.arange(1, n), size=pieces - 1, replace=False))
    return [0, *cuts.tolist(), n]


@pytest.mark.parametrize("T,S", [(64, 64), (50, 90), (90, 50), (300, 700)])
def test_chunks_with_their_offsets_merge_to_the_whole(dtype, T, S):
    """attention(q, k, v, causal=True), and with a window, ALiBi, sinks and
    lengths, equals its (query chunk, key chunk) pieces computed with
    query_offset and merged: what cattention.dask builds on."""
    rng = np.random.default_rng(46 + T + S)
    B, H, d = 2, 2, 16
    q, k, v = make_qkv(46, (B, H, T, d), (B, H, S, d), (B, H, S, d), dtype)
    lengths = np.array([S, S - S // 3])
    slopes = np.array([0.05, 0.2])
    sinks = np.array([0.3, -0.5])
    for options in (dict(), dict(window=(17, 5), alibi_slopes=slopes),
                    dict(sinks=sinks, kv_lengths=lengths), dict(window=(40, None))):
        whole, whole_lse = ca.attention(q, k, v, causal=True, return_lse=True, **options)
        valid = lengths if "kv_lengths" in options else np.array([S, S])
        t_cuts = _chunk_bounds(T, 3, rng)
        s_cuts = _chunk_bounds(S, 4, rng)
        rows = []
        for t0, t1 in zip(t_cuts, t_cuts[1:]):
            outs, lses = [], []
            for i, (s0, s1) in enumerate(zip(s_cuts, s_cuts[1:])):
                chunk = dict(options)
                if "kv_lengths" in chunk:
                    chunk["kv_lengths"] = np.clip(valid - s0, 0, s1 - s0)
                if "sinks" in chunk and i > 0:
                    del chunk["sinks"]       # the sink joins exactly one chunk
                o, lse = ca.attention(q[..., t0:t1, :], k[..., s0:s1, :], v[..., s0:s1, :],
                                      causal=True, return_lse=True,
                                      query_offset=t0 - s0 + (valid - T), **chunk)
                outs.append(o)
                lses.append(lse)
            rows.append(ca.merge(outs, lses))
        out = np.concatenate([r[0] for r in rows], axis=-2)
        lse = np.concatenate([r[1] for r in rows], axis=-1)
        tol = 1e-12 if dtype == np.float64 else 2e-6
        np.testing.assert_allclose(out, whole, rtol=0, atol=tol)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(whole_lse))
        finite = np.isfinite(whole_lse)
        np.testing.assert_allclose(lse[finite], whole_lse[finite], rtol=0, atol=tol * 10)
        ref_options = dict(options)
        if "kv_lengths" in ref_options:
            ref_options["kv_lengths"] = lengths[:, None]
        for name in ("alibi_slopes", "sinks"):
            if name in ref_options:
                ref_options[name] = ref_options[name][None, :]
        assert_matches_reference(out, None, q, k, v, causal=True, lse=lse, **ref_options)


def test_query_offset_composes_with_out_and_threads():
    q, k, v = make_qkv(47, (2, 3, 200, 32), (2, 3, 300, 32), (2, 3, 300, 32), np.float32)
    offsets = np.array([[-20, 0, 150], [299, 100, 7]])
    expected = ca.attention(q, k, v, causal=True, query_offset=offsets, num_threads=1)
    assert_bitwise_equal(ca.attention(q, k, v, causal=True, query_offset=offsets,
                                      num_threads=2), expected)
    buffer = np.empty((2, 200, 3, 32), np.float32)
    out = buffer.transpose(0, 2, 1, 3)
    assert ca.attention(q, k, v, causal=True, query_offset=offsets, out=out) is out
    assert_bitwise_equal(out, expected)
    attn, lse = reference_attention_lse(q, k, v, causal=True, query_offset=offsets)[::2]
    assert np.max(np.abs(out - attn)) < 1e-5


@pytest.mark.parametrize("offset,error,match", [
    (0.5, TypeError, r"query_offset must be integers, got dtype float64"),
    (np.array([1.0, 2.0]), TypeError, r"query_offset must be integers"),
    (True, TypeError, r"query_offset must be integers, got dtype bool"),
    ("3", TypeError, r"query_offset must be integers"),
    (2**62 + 1, ValueError, r"query_offset must lie in \[-2\*\*62, 2\*\*62\]"),
    (-2**62 - 1, ValueError, r"query_offset must lie in \[-2\*\*62, 2\*\*62\]"),
    (2**63, ValueError, r"query_offset must lie in \[-2\*\*62, 2\*\*62\]"),
    (np.array([2**64 - 1], np.uint64), ValueError, r"query_offset must lie in"),
    (2**80, ValueError, r"query_offset must lie in \[-2\*\*62, 2\*\*62\]"),
    (np.array([1, 2, 3]), ValueError, r"query_offset of shape \(3,\) is ambiguous"),
    (np.zeros((2, 3), int), ValueError, r"query_offset of shape \(2, 3\) does not broadcast"),
])
def test_bad_query_offsets_are_refused(offset, error, match):
    q, k, v = make_qkv(48, (2, 2, 3, 8), (2, 2, 10, 8), (2, 2, 10, 8), np.float32)
    with pytest.raises(error, match=match):
        ca.attention(q, k, v, causal=True, query_offset=offset)
    with pytest.raises(error, match=match):
        ca.attention_scores(q, k, query_offset=offset)


def test_a_refused_offset_writes_nothing_into_out():
    q, k, v = make_qkv(49, (2, 2, 3, 8), (2, 2, 10, 8), (2, 2, 10, 8), np.float32)
    out = np.full((2, 2, 3, 8), 7.0, np.float32)
    with pytest.raises(ValueError):
        ca.attention(q, k, v, query_offset=2**63, out=out)
    assert np.all(out == 7.0)


def _other_inputs(kind):
    """(q, k, v, options, reference K and V): a mask, float16 or int8 K/V,
    at offsets before, inside and past the keys."""
    rng = np.random.default_rng(50)
    q, k, v = make_qkv(50, (2, 2, 11, 16), (2, 2, 40, 16), (2, 2, 40, 16), np.float32)
    options = dict(causal=True)
    ref_k, ref_v = k, v
    if kind == "bool mask":
        options["mask"] = rng.random((11, 40)) > 0.3
    elif kind == "additive mask":
        options["mask"] = np.where(rng.random((11, 40)) > 0.3, rng.standard_normal((11, 40)),
                                   -np.inf)
    elif kind == "float16 kv":
        k, v = k.astype(np.float16), v.astype(np.float16)
        ref_k, ref_v = k.astype(np.float32), v.astype(np.float32)
    elif kind == "int8 kv":
        (k, k_scale), (v, v_scale) = ca.quantize_kv(k), ca.quantize_kv(v)
        options.update(k_scale=k_scale, v_scale=v_scale)
        ref_k = k.astype(np.float32) * k_scale[..., None]
        ref_v = v.astype(np.float32) * v_scale[..., None]
    return q, k, v, options, ref_k, ref_v


@pytest.mark.parametrize("kind", ["bool mask", "additive mask", "float16 kv", "int8 kv"])
def test_query_offset_with_masks_and_narrow_kv(kind):
    q, k, v, options, ref_k, ref_v = _other_inputs(kind)
    offsets = np.array([-5, 22])
    out, lse = ca.attention(q, k, v, query_offset=offsets, return_lse=True, **options)
    ref_options = {name: value for name, value in options.items()
                   if name not in ("k_scale", "v_scale")}
    assert_matches_reference(out, None, q, ref_k, ref_v, query_offset=offsets[:, None],
                             lse=lse, **ref_options)


def test_query_offset_with_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
    from reference import assert_bfloat16_matches_reference
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in
               make_qkv(51, (2, 2, 13, 16), (2, 2, 60, 16), (2, 2, 60, 16), np.float32))
    offsets = np.array([30, -3])
    out, lse = ca.attention(q, k, v, causal=True, window=(20, None), query_offset=offsets,
                            return_lse=True)
    assert_bfloat16_matches_reference(out, None, q, k, v, True, window=(20, None),
                                      query_offset=offsets[:, None], lse=lse)


def test_a_ragged_query_offset_is_named():
    x = np.ones((2, 1, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"^query_offset is not a regular array"):
        ca.attention(x, x, x, query_offset=[[1, 2], [3]])
