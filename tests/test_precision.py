"""precision= levels of 16-bit results ("highest", "high" default,
"medium"), each against the float64 reference with its own rule
(reference.assert_level_matches_reference), on every entry point and
table; "medium" against PyTorch's bfloat16 error on the same inputs;
float32 and float64 results at the highest whatever is asked."""

import numpy as np
import pytest

import cattention as ca
from cattention._native import driver
from reference import (assert_bitwise_equal, assert_level_matches_reference, make_qkv,
                       reference_attention)

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
LEVELS = ("highest", "high", "medium")


def bf16(*arrays):
    return tuple(np.asarray(a).astype(BF16) for a in arrays)


#: (options, q, k, v shapes): prompt rows (the packed path, where the
#: levels differ), tails of rows, keys and columns, grouped heads
CASES = {
    "plain": ({}, (2, 3, 37, 16), (2, 3, 50, 16), (2, 3, 50, 8)),
    "causal-d64": (dict(causal=True), (1, 4, 130, 64), (1, 4, 130, 64), (1, 4, 130, 64)),
    "d128-long": ({}, (1, 2, 40, 128), (1, 2, 700, 128), (1, 2, 700, 128)),
    "d80-odd-keys": (dict(causal=True), (1, 2, 99, 80), (1, 2, 301, 80), (1, 2, 301, 80)),
    "dv-tail": ({}, (1, 2, 25, 24), (1, 2, 33, 24), (1, 2, 33, 40)),
    "window-softcap": (dict(window=(20, 5), softcap=3.0), (1, 2, 60, 32), (1, 2, 90, 32),
                       (1, 2, 90, 32)),
    "sinks-alibi": (dict(sinks=np.array([0.3, -1.0]), alibi_slopes=np.array([0.5, 0.25]),
                         causal=True), (1, 2, 40, 16), (1, 2, 80, 16), (1, 2, 80, 16)),
    "gqa": (dict(enable_gqa=True, causal=True), (1, 8, 20, 64), (1, 2, 40, 64),
            (1, 2, 40, 64)),
    "kv-lengths": (dict(kv_lengths=np.array([70, 3]), causal=True), (2, 2, 12, 32),
                   (2, 2, 80, 32), (2, 2, 80, 32)),
}


def _case(name, seed=0):
    options, q_shape, k_shape, v_shape = CASES[name]
    return bf16(*make_qkv(seed, q_shape, k_shape, v_shape, np.float32)), dict(options)


def _reference_options(options, k, v):
    """The reference's options, K and V for a call's (it has no grouped
    heads: K and V repeated; one length per sequence)."""
    options = dict(options)
    if "kv_lengths" in options:
        options["kv_lengths"] = np.asarray(options["kv_lengths"])[:, None]
    if options.pop("enable_gqa", False):
        return options, k, v, True
    return options, k, v, False


def _check(attn, q, k, v, level, options):
    options, k, v, grouped = _reference_options(options, k, v)
    if grouped:
        group = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    assert_level_matches_reference(attn, q, k, v, level, **options)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", CASES)
def test_attention_meets_its_level(simd, name, level):
    (q, k, v), options = _case(name)
    attn = ca.attention(q, k, v, precision=level, **options)
    assert attn.dtype == BF16
    _check(attn, q, k, v, level, options)


@pytest.mark.parametrize("level", LEVELS)
def test_tails_of_every_length(simd, level):
    """Keys 1..35 (odd pairs, partial runs of VDPBF16PS), rows 9..14 (the
    packed path's row tails) and value columns past a panel."""
    rng = np.random.default_rng(5)
    for n_keys in range(1, 36):
        n_rows = 9 + n_keys % 6
        q, k = bf16(rng.standard_normal((1, 1, n_rows, 20)),
                    rng.standard_normal((1, 1, n_keys, 20)))
        (v,) = bf16(rng.standard_normal((1, 1, n_keys, 17 + n_keys % 20)))
        attn = ca.attention(q, k, v, precision=level)
        assert_level_matches_reference(attn, q, k, v, level)


@pytest.mark.parametrize("level", LEVELS)
def test_masked_denormal_and_huge_inputs(simd, level):
    """-inf masks (whole rows hidden: zero rows), bfloat16 denormals in q, K
    and V, and values near bfloat16's largest in V (weights of those keys
    exactly 0 where masked)."""
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(8, (1, 2, 40, 32), (1, 2, 64, 32), (1, 2, 64, 32), np.float32)
    tiny = np.float32(2.0 ** -130)          # a bfloat16 denormal
    q[0, 0, :5] *= tiny
    k[0, 1, 10:20] *= tiny
    v[0, 0, 3:9] = tiny * rng.standard_normal((6, 32))
    v[0, 1, 30:33] = np.float32(3e38) * np.sign(rng.standard_normal((3, 32)))
    mask = np.where(rng.random((40, 64)) > 0.25, 0.0, -np.inf).astype(np.float32)
    mask[:, 30:33] = -np.inf                # the huge values are never weighed
    mask[7] = -np.inf                       # a row that sees no key
    q, k, v = bf16(q, k, v)
    attn = ca.attention(q, k, v, mask=mask, precision=level)
    assert np.all(attn[:, :, 7].astype(np.float32) == 0)
    assert_level_matches_reference(attn, q, k, v, level, mask=mask)


@pytest.mark.parametrize("level", LEVELS)
def test_cache_and_packed_entry_points(simd, level):
    """attention_with_kvcache (prompt rows appended), the paged cache, and
    packed variable-length sequences, each at the level against the
    reference of its keys."""
    rng = np.random.default_rng(3)
    H, H_kv, d = 4, 2, 32
    k_cache, v_cache = bf16(rng.standard_normal((2, H_kv, 96, d)),
                            rng.standard_normal((2, H_kv, 96, d)))
    lengths = np.array([30, 5])
    q, k_new, v_new = bf16(rng.standard_normal((2, H, 20, d)),
                           rng.standard_normal((2, H_kv, 20, d)),
                           rng.standard_normal((2, H_kv, 20, d)))
    attn = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new, causal=True,
                                     precision=level)
    for b in range(2):
        n = int(lengths[b])
        k_b = np.repeat(k_cache[b:b + 1, :, :n], H // H_kv, axis=1)
        v_b = np.repeat(v_cache[b:b + 1, :, :n], H // H_kv, axis=1)
        assert_level_matches_reference(attn[b:b + 1], q[b:b + 1], k_b, v_b, level, causal=True)

    page, n_pages = 16, 12
    k_pages, v_pages = bf16(rng.standard_normal((n_pages, H_kv, page, d)),
                            rng.standard_normal((n_pages, H_kv, page, d)))
    table = np.array([[3, 7, 1, 9], [0, 5, 11, 2]])
    seq = np.array([50, 37])
    q_p = bf16(rng.standard_normal((2, H, 12, d)))[0]
    attn = ca.attention_with_paged_kvcache(q_p, k_pages, v_pages, table, seq, causal=True,
                                           precision=level)
    for b in range(2):
        rows = np.concatenate([np.arange(page) + p * page for p in range(4)])[:seq[b]]
        gathered = [pages[table[b]].transpose(1, 0, 2, 3).reshape(H_kv, -1, d)[:, rows % (4 * page)]
                    for pages in (k_pages, v_pages)]
        k_b, v_b = (np.repeat(x[None], H // H_kv, axis=1) for x in gathered)
        assert_level_matches_reference(attn[b:b + 1], q_p[b:b + 1], k_b, v_b, level,
                                       causal=True)

    cu = np.array([0, 13, 40])
    x_q, x_k, x_v = bf16(rng.standard_normal((40, H, d)), rng.standard_normal((40, H_kv, d)),
                         rng.standard_normal((40, H_kv, d)))
    attn = ca.attention_varlen(x_q, x_k, x_v, cu, cu, causal=True, enable_gqa=True,
                               precision=level)
    for lo, hi in zip(cu[:-1], cu[1:]):
        sequence = [np.repeat(x[lo:hi].transpose(1, 0, 2)[None], H // x.shape[1], axis=1)
                    for x in (x_q, x_k, x_v)]
        assert_level_matches_reference(attn[lo:hi].transpose(1, 0, 2)[None], *sequence, level,
                                       causal=True)


@pytest.mark.parametrize("level", LEVELS)
def test_bitwise_the_same_for_any_thread_count(simd, level):
    (q, k, v), options = _case("causal-d64")
    one = ca.attention(q, k, v, precision=level, num_threads=1, **options)
    for threads in (2, 3, 5):
        assert_bitwise_equal(ca.attention(q, k, v, precision=level, num_threads=threads,
                                          **options), one)


def test_high_is_the_default_for_16_bit_results(simd):
    (q, k, v), options = _case("d80-odd-keys")
    assert_bitwise_equal(ca.attention(q, k, v, **options),
                         ca.attention(q, k, v, precision="high", **options))
    halves = [x.astype(np.float16) for x in (q, k, v)]
    assert_bitwise_equal(ca.attention(*halves, **options),
                         ca.attention(*halves, precision="high", **options))


@pytest.mark.parametrize("level", LEVELS)
def test_float16_results_meet_their_level(simd, level):
    (q, k, v), options = _case("d128-long")
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    attn = ca.attention(q, k, v, precision=level, **options)
    assert attn.dtype == np.float16
    assert_level_matches_reference(attn, q, k, v, level, **options)


@pytest.mark.parametrize("level", LEVELS)
def test_float32_and_float64_results_take_the_highest(simd, dtype, level):
    """Whatever is asked, a float32 or float64 result is the default's,
    bit for bit (also over a bfloat16 cache, whose result is float32)."""
    q, k, v = make_qkv(2, (1, 2, 50, 64), (1, 2, 90, 64), (1, 2, 90, 64), dtype)
    assert_bitwise_equal(ca.attention(q, k, v, causal=True, precision=level),
                         ca.attention(q, k, v, causal=True))
    q32 = q.astype(np.float32)
    kb, vb = bf16(k, v)
    assert_bitwise_equal(ca.attention(q32, kb, vb, precision=level), ca.attention(q32, kb, vb))


@pytest.mark.parametrize("bad, error", [("low", ValueError), ("HIGH", ValueError),
                                        (1, TypeError), (b"high", TypeError)])
def test_a_bad_level_is_refused_naming_it(bad, error):
    (q, k, v), _ = _case("plain")
    calls = [
        lambda: ca.attention(q, k, v, precision=bad),
        lambda: ca.attention(q.astype(np.float32), k, v, precision=bad),
        lambda: ca.attention_with_kvcache(q, np.zeros((2, 3, 60, 16), BF16),
                                          np.zeros((2, 3, 60, 8), BF16), np.array([0, 0]),
                                          precision=bad),
        lambda: ca.attention_varlen(q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2),
                                    v[0].transpose(1, 0, 2), np.array([0, 37]),
                                    np.array([0, 50]), precision=bad),
    ]
    for call in calls:
        with pytest.raises(error, match="precision"):
            call()


def test_show_config_says_what_each_level_runs(simd, capsys):
    ca.show_config()
    line = [x for x in capsys.readouterr().out.splitlines() if "precision:" in x]
    assert len(line) == 1
    parts = driver.bf16_pv_parts()
    words = {0: "float32 weights", 1: "P rounded to bfloat16"}
    for level, n in zip(LEVELS, parts):
        assert f"{level}: {words.get(n, f'P in {n} bfloat16 parts')}" in line[0]


#: cases of the comparison with PyTorch's bfloat16 SDPA: (shape, causal)
TORCH_CASES = [((2, 3, 37, 16), False), ((1, 4, 300, 64), True), ((1, 2, 700, 128), False),
               ((1, 2, 100, 80), True), ((1, 8, 512, 64), False), ((2, 2, 257, 256), True)]


def test_medium_error_is_no_larger_than_pytorch_bfloat16(simd):
    """Over the cases, the largest error and the RMS error (of every element
    pooled) against the float64 reference are at most those of PyTorch's
    scaled_dot_product_attention on the same bfloat16 tensors."""
    torch = pytest.importorskip("torch")
    ours, theirs = [], []
    for seed, (shape, causal) in enumerate(TORCH_CASES):
        q, k, v = bf16(*make_qkv(seed, shape, shape, shape, np.float32))
        ref = reference_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)[0]
        tensors = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
                   for x in (q, k, v)]
        with torch.no_grad():
            peer = torch.nn.functional.scaled_dot_product_attention(*tensors, is_causal=causal)
        ours.append((ca.attention(q, k, v, causal=causal, precision="medium")
                     .astype(np.float64) - ref).ravel())
        theirs.append((peer.float().numpy().astype(np.float64) - ref).ravel())
    ours, theirs = np.concatenate(ours), np.concatenate(theirs)
    assert np.max(np.abs(ours)) <= np.max(np.abs(theirs))
    assert np.sqrt(np.mean(ours ** 2)) <= np.sqrt(np.mean(theirs ** 2))


@pytest.mark.parametrize("level", LEVELS)
def test_attn_beside_scores_meets_its_level(simd, level):
    """With SCORES, ATTN is SCORES . V at the level (SCORES themselves are
    the float32 weights rounded once)."""
    (q, k, v), options = _case("causal-d64")
    attn, scores = ca.attention(q, k, v, return_scores=True, precision=level, **options)
    _check(attn, q, k, v, level, options)
    assert_bitwise_equal(scores, ca.attention(q, k, v, return_scores=True, **options)[1])


def test_property_every_level_meets_its_rule():
    """Drawn problems (sizes at the tile and block edges, masks, causal,
    batches; test_properties' strategy) at a drawn level and thread count:
    the level's rule, and bitwise the one-thread result."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st
    from test_properties import problems

    @hypothesis.given(problems(allow_empty=False, dtypes=[BF16]), st.sampled_from(LEVELS),
                      st.sampled_from([2, 3]))
    def check(problem, level, threads):
        q, k, v, causal, mask = problem
        attn = ca.attention(q, k, v, causal=causal, mask=mask, precision=level,
                            num_threads=1)
        assert_level_matches_reference(attn, q, k, v, level, causal=causal, mask=mask)
        assert_bitwise_equal(ca.attention(q, k, v, causal=causal, mask=mask, precision=level,
                                          num_threads=threads), attn)

    check()


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_rule_sees_a_wrong_value(level):
    """The rules are not vacuous: one value moved by three ulps of its
    dtype (past the neighbours the conditioning term allows on
    well-conditioned rows) fails each of them."""
    (q, k, v), options = _case("plain")
    attn = ca.attention(q, k, v, precision="highest", **options)
    wrong = attn.copy()
    flat = wrong.reshape(-1)
    at = int(np.argmax(np.abs(flat.astype(np.float32))))
    for _ in range(3):
        flat[at] = np.nextafter(flat[at], np.array(np.inf, BF16))
    with pytest.raises(AssertionError, match="outside the level's rule"):
        assert_level_matches_reference(wrong, q, k, v, level, **options)
