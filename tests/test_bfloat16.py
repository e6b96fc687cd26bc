"""bfloat16 (ml_dtypes) end to end: every entry point takes it, computes in
float32 and rounds the result once; the result before that rounding meets
the float32 rule against the float64 reference of the upcast inputs (every
bfloat16 value is a float32 one). Promotion follows NumPy's with ml_dtypes."""

import subprocess
import sys

import numpy as np
import pytest

import cattention as ca
from reference import (assert_bfloat16_matches_reference, assert_bitwise_equal,
                       assert_matches_reference, make_qkv, reference_attention)

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16(*arrays):
    out = tuple(np.asarray(a).astype(BF16) for a in arrays)
    return out if len(out) > 1 else out[0]


def up(x):
    return np.asarray(x).astype(np.float32)


#: (options, shapes q, k, v): the options of attention, grouped heads, the
#: decode (direct) path with and without split keys, tails
CASES = {
    "plain": ({}, (2, 3, 37, 16), (2, 3, 50, 16), (2, 3, 50, 8)),
    "causal": (dict(causal=True), (2, 3, 97, 24), (2, 3, 130, 24), (2, 3, 130, 20)),
    "mask": (dict(mask="additive"), (2, 1, 17, 8), (2, 1, 33, 8), (2, 1, 33, 5)),
    "bool-mask": (dict(mask="bool", causal=True), (1, 2, 9, 16), (1, 2, 9, 16), (1, 2, 9, 16)),
    "window": (dict(window=(7, 3)), (1, 2, 40, 16), (1, 2, 60, 16), (1, 2, 60, 16)),
    "softcap-alibi": (dict(softcap=2.5, alibi_slopes=np.array([0.5, 0.25]), causal=True),
                      (1, 2, 30, 16), (1, 2, 30, 16), (1, 2, 30, 16)),
    "sinks": (dict(sinks=np.array([0.3, -1.0])), (1, 2, 5, 16), (1, 2, 80, 16), (1, 2, 80, 16)),
    "kv-lengths": (dict(kv_lengths=np.array([70, 3]), causal=True), (2, 2, 3, 32),
                   (2, 2, 80, 32), (2, 2, 80, 32)),
    "gqa": (dict(enable_gqa=True, causal=True), (1, 8, 20, 64), (1, 2, 40, 64), (1, 2, 40, 64)),
    "gqa-decode": (dict(enable_gqa=True), (2, 8, 1, 64), (2, 2, 300, 64), (2, 2, 300, 64)),
    "decode-split": ({}, (1, 2, 1, 64), (1, 2, 2048, 64), (1, 2, 2048, 64)),
    "decode-rows": ({}, (1, 3, 5, 17), (1, 3, 700, 17), (1, 3, 700, 9)),
}


def _case(name, seed=0):
    options, q_shape, k_shape, v_shape = CASES[name]
    options = dict(options)
    q, k, v = make_qkv(seed, q_shape, k_shape, v_shape, np.float32)
    rng = np.random.default_rng(seed + 1)
    T, S = q_shape[-2], k_shape[-2]
    if options.get("mask") == "additive":
        options["mask"] = np.where(rng.random((T, S)) > 0.3, rng.standard_normal((T, S)),
                                   -np.inf).astype(np.float32)
    elif options.get("mask") == "bool":
        options["mask"] = rng.random((T, S)) > 0.3
    return bf16(q, k, v), options


def _ungrouped(options, q, k, v):
    """The reference's options and K, V for a call's: grouped heads spelt
    out by repeating K and V (the reference has no grouped heads)."""
    options = dict(options)
    if "kv_lengths" in options:
        # one length per sequence (the first batch axis), as attention takes it
        options["kv_lengths"] = np.asarray(options["kv_lengths"])[:, None]
    if options.pop("enable_gqa", False):
        group = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    return options, k, v


@pytest.mark.parametrize("name", CASES)
def test_bfloat16_rounds_a_float32_accurate_result(simd, name):
    (q, k, v), options = _case(name)
    attn, lse = ca.attention(q, k, v, return_lse=True, **options)
    assert attn.dtype == BF16 and lse.dtype == np.float32
    ref_options, ref_k, ref_v = _ungrouped(options, q, k, v)
    assert_bfloat16_matches_reference(attn, None, q, ref_k, ref_v, lse=lse, **ref_options)
    if q.shape[-2] > 1:
        attn, scores = ca.attention(q, k, v, return_scores=True, **options)
        assert attn.dtype == scores.dtype == BF16
        assert_bfloat16_matches_reference(attn, scores, q, ref_k, ref_v, **ref_options)


def test_the_amx_table_runs_where_the_cpu_has_it():
    """The simd fixture runs every test on each table this CPU runs; the AMX
    table only exists on AMX hardware, since the emulator of the AVX-512
    tests (bochscpu-python 0.4.0) raises #UD on tile instructions. Say so
    where it is absent; where present, every case above ran on it too."""
    from cattention._native import driver
    if "amx" not in driver.available_simd():
        pytest.skip("no AMX table here: the CPU (or the OS) has no AMX tiles, and the "
                    "emulator of the AVX-512 tests does not execute them; the AMX table's "
                    "tests run on AMX hardware")
    previous = driver.get_simd()
    driver.set_simd("amx")
    try:
        for name in ("plain", "causal", "gqa", "decode-rows"):
            (q, k, v), options = _case(name, seed=7)
            attn, lse = ca.attention(q, k, v, return_lse=True, **options)
            ref_options, ref_k, ref_v = _ungrouped(options, q, k, v)
            assert_bfloat16_matches_reference(attn, None, q, ref_k, ref_v, lse=lse,
                                              **ref_options)
    finally:
        driver.set_simd(previous)


def test_bfloat16_is_the_float32_computation_on_the_upcast_inputs_rounded_once():
    """Where no table computes bfloat16 itself (the portable, AVX2 and
    AVX-512 tables), a bfloat16 call is literally the float32 call on the
    upcast inputs, rounded to nearest even: bitwise."""
    from cattention._native import driver
    previous = driver.get_simd()
    try:
        for table in [t for t in driver.available_simd() if t in ("baseline", "avx2", "avx512")]:
            driver.set_simd(table)
            for name in ("plain", "causal", "gqa-decode", "decode-split", "sinks"):
                (q, k, v), options = _case(name, seed=3)
                got, scores = ca.attention(q, k, v, return_scores=True, **options)
                want, want_scores = ca.attention(up(q), up(k), up(v), return_scores=True,
                                                 **options)
                assert_bitwise_equal(got, want.astype(BF16))
                assert_bitwise_equal(scores, want_scores.astype(BF16))
                assert_bitwise_equal(ca.attention(q, k, v, **options),
                                     ca.attention(up(q), up(k), up(v), **options).astype(BF16))
    finally:
        driver.set_simd(previous)


@pytest.mark.parametrize("dtypes,result", [
    ((BF16, BF16, BF16), BF16),
    ((np.float32, BF16, BF16), np.float32),       # a halved cache beside a float32 q
    ((BF16, np.float32, np.float32), np.float32),
    ((BF16, np.float16, np.float16), np.float32),  # NumPy's promotion with ml_dtypes
    ((BF16, BF16, np.float64), np.float64),
    ((BF16, BF16, np.int16), np.float32),
])
def test_dtypes_follow_numpy_promotion(dtypes, result):
    q, k, v = make_qkv(5, (2, 7, 8), (2, 9, 8), (2, 9, 8), np.float32)
    arrays = [a.astype(d) for a, d in zip((q, k, v), dtypes)]
    out, lse = ca.attention(*arrays, return_lse=True)
    assert out.dtype == np.dtype(result)
    assert lse.dtype == (np.float64 if np.dtype(result) == np.float64 else np.float32)
    ref, _ = reference_attention(*(a.astype(np.float64) for a in arrays))
    tol = 1e-12 if np.dtype(result) == np.float64 else 8e-3 if result == BF16 else 1e-5
    assert np.max(np.abs(out.astype(np.float64) - ref)) <= tol


def test_strided_and_transposed_bfloat16_give_the_same_bits():
    (q, k, v), _ = _case("causal", seed=9)
    want = ca.attention(q, k, v, causal=True)
    q_t = np.ascontiguousarray(q.swapaxes(-1, -2)).swapaxes(-1, -2)
    k_wide = np.zeros(k.shape[:-1] + (2 * k.shape[-1],), BF16)
    k_wide[..., ::2] = k
    v_rev = np.ascontiguousarray(v[..., ::-1, :])[..., ::-1, :]
    assert_bitwise_equal(ca.attention(q_t, k_wide[..., ::2], v_rev, causal=True), want)
    # one thread or two, the same bits
    assert_bitwise_equal(ca.attention(q, k, v, causal=True, num_threads=1), want)


def test_a_bfloat16_mask_is_added_as_float32():
    (q, k, v), _ = _case("plain", seed=11)
    rng = np.random.default_rng(0)
    mask = np.where(rng.random((37, 50)) > 0.2, rng.standard_normal((37, 50)), -np.inf)
    got = ca.attention(q, k, v, mask=bf16(mask))
    want = ca.attention(q, k, v, mask=bf16(mask).astype(np.float32))
    assert_bitwise_equal(got, want)


def test_attention_varlen_takes_bfloat16(simd):
    rng = np.random.default_rng(4)
    lengths = [5, 0, 17, 1]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    total = int(cu[-1])
    q, k, v = bf16(*(rng.standard_normal((total, 4, 16)) for _ in range(3)))
    out, lse = ca.attention_varlen(q, k[:, ::2], v[:, ::2], cu, cu, causal=True,
                                   enable_gqa=True, return_lse=True)
    assert out.dtype == BF16 and lse.dtype == np.float32
    for b in range(len(lengths)):
        rows = slice(cu[b], cu[b + 1])
        if lengths[b] == 0:
            continue
        qb = q[rows].transpose(1, 0, 2)
        kb = np.repeat(k[rows, ::2].transpose(1, 0, 2), 2, axis=0)
        vb = np.repeat(v[rows, ::2].transpose(1, 0, 2), 2, axis=0)
        assert_bfloat16_matches_reference(out[rows].transpose(1, 0, 2), None, qb, kb, vb,
                                          causal=True, lse=lse[rows].T)


@pytest.mark.parametrize("q_dtype", [BF16, np.float32], ids=["bf16-q", "f32-q"])
@pytest.mark.parametrize("new_dtype", [BF16, np.float32, np.float64])
def test_a_bfloat16_cache_appends_and_attends(simd, q_dtype, new_dtype):
    rng = np.random.default_rng(6)
    B, H, H_kv, S_max, d, T = 2, 4, 2, 64, 16, 3
    k_cache = bf16(rng.standard_normal((B, H_kv, S_max, d)))
    v_cache = bf16(rng.standard_normal((B, H_kv, S_max, d)))
    lengths = np.array([10, 40])
    q = rng.standard_normal((B, H, T, d)).astype(q_dtype)
    k_new = rng.standard_normal((B, H_kv, T, d)).astype(new_dtype)
    v_new = rng.standard_normal((B, H_kv, T, d)).astype(new_dtype)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    out = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new)
    assert out.dtype == np.dtype(np.float32 if q_dtype == np.float32 else BF16)
    assert lengths.tolist() == [13, 43]
    for b, start in enumerate([10, 40]):
        # the new rows rounded once into the cache, the rest untouched
        assert_bitwise_equal(k_cache[b, :, start:start + T], k_new[b].astype(BF16))
        assert_bitwise_equal(v_cache[b, :, start:start + T], v_new[b].astype(BF16))
        assert_bitwise_equal(k_cache[b, :, :start], k_before[b, :, :start])
        keys = np.repeat(k_cache[b, :, :start + T], 2, axis=0)
        values = np.repeat(v_cache[b, :, :start + T], 2, axis=0)
        if q_dtype == np.float32:
            assert_matches_reference(out[b], None, q[b], up(keys), up(values), causal=True)
        else:
            assert_bfloat16_matches_reference(out[b], None, q[b], keys, values, causal=True)
    del v_before


def test_bfloat16_prompt_rows_through_the_cache_calls(simd):
    """A bfloat16 prompt (more rows than the decode path takes) through
    attention_with_kvcache and the paged call: the rows the driver rounds
    as it finishes them meet the bfloat16 rule, land in out= of either
    layout with the same bits, and the paged call gives the contiguous
    one's bits."""
    rng = np.random.default_rng(16)
    B, H, H_kv, S_max, d, T = 2, 4, 2, 96, 16, 21
    k_cache, v_cache = bf16(rng.standard_normal((B, H_kv, S_max, d)),
                            rng.standard_normal((B, H_kv, S_max, d)))
    lengths = np.array([30, 70])
    q, k_new, v_new = bf16(rng.standard_normal((B, H, T, d)),
                           rng.standard_normal((B, H_kv, T, d)),
                           rng.standard_normal((B, H_kv, T, d)))
    cache = k_cache.copy(), v_cache.copy()
    out = ca.attention_with_kvcache(q, cache[0], cache[1], lengths.copy(), k_new, v_new)
    assert out.dtype == BF16 and out.shape == (B, H, T, d)
    for b, start in enumerate(lengths):
        keys = np.repeat(cache[0][b, :, :start + T], 2, axis=0)
        values = np.repeat(cache[1][b, :, :start + T], 2, axis=0)
        assert_bfloat16_matches_reference(out[b], None, q[b], keys, values, causal=True)
    for given in (np.empty((B, H, T, d), BF16), np.empty((B, T, H, d), BF16).transpose(0, 2, 1, 3)):
        cache = k_cache.copy(), v_cache.copy()
        got = ca.attention_with_kvcache(q, cache[0], cache[1], lengths.copy(), k_new, v_new,
                                        out=given)
        assert got is given
        assert_bitwise_equal(got, out)
    # the same sequences in pages of 16 rows, pages in reverse order
    page = 16
    n_pages = S_max // page
    k_pages = np.empty((B * n_pages, H_kv, page, d), BF16)
    v_pages = np.empty_like(k_pages)
    table = np.arange(B * n_pages)[::-1].reshape(B, n_pages).copy()
    for b in range(B):
        for p in range(n_pages):
            k_pages[table[b, p]] = k_cache[b, :, p * page:(p + 1) * page]
            v_pages[table[b, p]] = v_cache[b, :, p * page:(p + 1) * page]
    paged = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                            k_new, v_new)
    assert_bitwise_equal(paged, out)


def test_a_bfloat16_cache_refuses_float16_and_integer_rows():
    k_cache = np.zeros((1, 1, 8, 4), BF16)
    v_cache = np.zeros((1, 1, 8, 4), BF16)
    q = np.ones((1, 1, 1, 4), BF16)
    for dtype in (np.float16, np.int8, np.int32):
        new = np.ones((1, 1, 1, 4), dtype)
        lengths = np.array([2])
        with pytest.raises(TypeError, match=rf"k_new of dtype {np.dtype(dtype)} for a "
                                            r"bfloat16 cache"):
            ca.attention_with_kvcache(q, k_cache, v_cache, lengths, new, new)
        assert lengths.tolist() == [2] and not k_cache.any()
    pages = np.zeros((2, 1, 4, 4), BF16)
    with pytest.raises(TypeError, match=r"k_new of dtype float16 for bfloat16 pages"):
        ca.attention_with_paged_kvcache(q, pages, pages.copy(), np.array([[0, 1]]),
                                        np.array([2]), np.ones((1, 1, 1, 4), np.float16),
                                        np.ones((1, 1, 1, 4), np.float16))


def test_a_value_beyond_bfloat16_is_refused_before_anything_is_written():
    k_cache = np.zeros((1, 1, 8, 4), BF16)
    new = np.ones((1, 1, 1, 4), np.float64)
    new[0, 0, 0, 2] = 1e39
    lengths = np.array([0])
    with pytest.raises(ValueError, match=r"beyond the range of the bfloat16 cache"):
        ca.attention_with_kvcache(np.ones((1, 1, 1, 4), BF16), k_cache, k_cache.copy(),
                                  lengths, new, new)
    assert lengths.tolist() == [0] and not k_cache.any()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_bfloat16_pages(simd, packed):
    rng = np.random.default_rng(8)
    n_pages, H, H_kv, page_size, d = 12, 4, 2, 4, 16
    k_pages = bf16(rng.standard_normal((n_pages, H_kv, page_size, d)))
    v_pages = bf16(rng.standard_normal((n_pages, H_kv, page_size, d)))
    table = rng.permutation(n_pages).reshape(2, 6)
    lengths = np.array([5, 13])
    T = 2
    q = bf16(rng.standard_normal((2, H, T, d)))
    new = bf16(rng.standard_normal((2, H_kv, T, d)))
    if packed:
        q_in = q.transpose(0, 2, 1, 3).reshape(2 * T, H, d)
        new_in = new.transpose(0, 2, 1, 3).reshape(2 * T, H_kv, d)
        out = ca.attention_with_paged_kvcache(q_in, k_pages, v_pages, table, lengths, new_in,
                                              new_in, cu_seqlens_q=np.array([0, T, 2 * T]))
        out = out.reshape(2, T, H, d).transpose(0, 2, 1, 3)
    else:
        out = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths, new, new)
    assert out.dtype == BF16
    for b, n in enumerate(lengths.tolist()):
        pos = np.arange(n)
        keys = k_pages[table[b, pos // page_size], :, pos % page_size].transpose(1, 0, 2)
        values = v_pages[table[b, pos // page_size], :, pos % page_size].transpose(1, 0, 2)
        assert_bitwise_equal(keys[:, -T:], new[b])
        assert_bfloat16_matches_reference(out[b], None, q[b], np.repeat(keys, 2, axis=0),
                                          np.repeat(values, 2, axis=0), causal=True)


def test_int8_kv_beside_a_bfloat16_q():
    rng = np.random.default_rng(12)
    q = bf16(rng.standard_normal((1, 2, 3, 16)))
    (k, k_scale), (v, v_scale) = (ca.quantize_kv(rng.standard_normal((1, 2, 40, 16)))
                                  for _ in range(2))
    out = ca.attention(q, k, v, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == BF16
    want = ca.attention(up(q), k, v, k_scale=k_scale, v_scale=v_scale)
    assert_bitwise_equal(out, want.astype(BF16))


def test_the_compiled_shortcuts_take_bfloat16(compiled_path):
    taken = compiled_path("attention_shortcut")
    (q, k, v), _ = _case("gqa-decode")
    ca.attention(q, k, v, enable_gqa=True)
    assert taken == [True]
    taken = compiled_path("kvcache_shortcut")
    k_cache = np.zeros((2, 2, 16, 64), BF16)
    out = ca.attention_with_kvcache(q, k_cache, k_cache.copy(), np.array([1, 2]),
                                    k[:, :, :1], v[:, :, :1])
    assert taken == [True] and out.dtype == BF16


def test_cattention_works_without_ml_dtypes():
    code = ("import sys; sys.modules['ml_dtypes'] = None\n"
            "import numpy as np, cattention as ca\n"
            "x = np.ones((2, 3, 4), np.float32)\n"
            "print(ca.attention(x, x, x).dtype)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "float32"


def test_results_round_to_bfloat16_as_ml_dtypes_does():
    """The driver rounds float32 results to bfloat16 itself (a compiled loop,
    not ml_dtypes' cast): bit for bit ml_dtypes' rounding on every upper half
    with the lower halves that decide it (ties to even either way, just
    below and above a tie), so NaN payloads, subnormals, infinities and
    overflow to infinity included; into out= of either layout too."""
    from cattention._native import driver
    driver.register_bfloat16(BF16.num)
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    lower = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000], dtype=np.uint32)
    values = (upper[:, None] | lower[None, :]).view(np.float32)
    with np.errstate(invalid="ignore"):
        want = values.astype(BF16)
    assert_bitwise_equal(driver.round_to_bfloat16(values).view(np.uint16),
                         want.view(np.uint16))
    into = np.empty(values.shape, BF16)
    assert driver.round_to_bfloat16(values, into) is into
    assert_bitwise_equal(into.view(np.uint16), want.view(np.uint16))
    strided = np.empty((values.shape[1], values.shape[0]), BF16).T
    assert driver.round_to_bfloat16(values, strided) is strided
    assert_bitwise_equal(strided.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("n_queries,n_keys", [(9, 3), (9, 700), (40, 300)])
def test_bfloat16_values_near_the_largest_float_give_their_weighted_mean(simd, n_queries,
                                                                          n_keys):
    """As test_errors' float32 case, on the prompt path whose rows are
    rounded into the bfloat16 ATTN as they are finished: the weighted sum of
    values of 2e38 passes float32's range, the row is redone scaled, and
    comes out the rounding of the weighted mean; a row that sees an infinite
    value is inf; the other head keeps the bits of unit-scale values."""
    rng = np.random.default_rng(n_keys)
    q, k, v = bf16(rng.standard_normal((2, n_queries, 8)), rng.standard_normal((2, n_keys, 8)),
                   rng.standard_normal((2, n_keys, 3)))
    unit_scale = v.copy()
    v[0, :, 0] = bf16(2e38 * (0.75 + 0.25 * rng.random(n_keys)))
    q[0] = 0    # every weight of head 0 is 1: its sum of weighted values passes float32's range
    mask = np.ones((n_queries, n_keys), bool)
    mask[:-1, -1] = False
    v[0, -1, 0] = np.inf
    for out in (ca.attention(q, k, v, mask=mask),
                ca.attention(q, k, v, mask=mask, out=np.empty((2, n_queries, 3), BF16))):
        assert out.dtype == BF16
        assert np.isinf(out[0, -1, 0]) and np.all(np.isfinite(out[0, :-1]))
        assert_bfloat16_matches_reference(out[:, :-1], None, q[:, :-1], k[:, :-1], v[:, :-1])
        assert_bitwise_equal(out[1], ca.attention(q, k, unit_scale, mask=mask)[1])
    # without a mask (the compiled shortcut) and without the infinite value
    v[0, -1, 0] = v[0, 0, 0]
    for out in (ca.attention(q, k, v), ca.attention(q, k, v, out=np.empty((2, n_queries, 3), BF16)),
                ca.attention(q, k, v, out=np.empty((n_queries, 2, 3), BF16).transpose(1, 0, 2))):
        assert out.dtype == BF16 and np.all(np.isfinite(out))
        assert_bfloat16_matches_reference(out, None, q, k, v)
        assert_bitwise_equal(out[1], ca.attention(q, k, unit_scale)[1])
