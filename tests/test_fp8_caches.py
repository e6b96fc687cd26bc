"""fp8 KV caches and pages (ml_dtypes.float8_e4m3fn and float8_e5m2),
quantized on append: the stored bytes against the rule (fp8_rules.py,
reference.saturated_fp8_codes), then the float64 reference over what the
cache holds; packed sequences, scales of every shape, strides, a property
test, and the errors, each leaving caches and pages as they were."""


import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

import cattention as ca  # noqa: E402
from reference import (assert_bitwise_equal, assert_matches_reference)  # noqa: E402
from reference import saturated_fp8_codes as saturated_codes  # noqa: E402
from fp8_rules import (E4M3, E5M2, BF16, FORMATS, FORMAT_PAIRS, FMAX, LARGEST, N_SUBNORMALS,  # noqa: E402
                       NAN_CODES, INF_CODES, SCALE_BOUND, SCALE_KINDS, dequantize,
                       quantize_reference, fp8_operand, from_bytes, filled, finite_codes,
                       unit_codes, repeat_kv, feature_strided, both_named, check,
                       check_non_finite)

try:
    # the settings of the cache property tests (40 examples, 400 with
    # CATTENTION_HYPOTHESIS_PROFILE=long); without hypothesis only the
    # property test below is skipped
    from hypothesis import given
    from hypothesis import strategies as st
    from test_cache_properties import _SETTINGS
except (ImportError, pytest.skip.Exception):
    given = None


# ---- fp8 KV caches --------------------------------------------------------------

def cache_values(cache, scale):
    """What a cache holds, as float64: the codes times the scale broadcast
    against cache.shape[:3] (None: 1)."""
    if scale is None:
        return dequantize(cache)
    return dequantize(cache, np.broadcast_to(np.asarray(scale, np.float32), cache.shape[:3]))


def scale_at(scale, shape):
    """A scale (None, a float, an array) broadcast to shape, float32."""
    return np.broadcast_to(np.asarray(1.0 if scale is None else scale, np.float32), shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T_new", [1, 5])
def test_fp8_cache_quantizes_appended_rows_per_row(fmt, T_new, simd):
    """Per-row scale arrays: appended rows get their scale computed as
    quantize_kv_fp8's "row" and written; the cache reads them in place
    (positions past the lengths hold NaN codes: never read)."""
    rng = np.random.default_rng(20 + T_new)
    B, H, H_kv, S_max, d, d_v = 2, 4, 2, 40, 17, 8
    nan = NAN_CODES[fmt][0]
    k_cache = filled((B, H_kv, S_max, d), nan, fmt)
    v_cache = filled((B, H_kv, S_max, d_v), nan, fmt)
    k_scale = np.zeros((B, H_kv, S_max), np.float32)
    v_scale = np.zeros((B, H_kv, S_max), np.float32)
    k_cache[1, :, :3], k_scale[1, :, :3] = quantize_reference(
        rng.standard_normal((H_kv, 3, d)), fmt)
    v_cache[1, :, :3], v_scale[1, :, :3] = quantize_reference(
        rng.standard_normal((H_kv, 3, d_v)), fmt)
    lengths = np.array([0, 3])
    options = dict(window=(6, 0), softcap=3.0, sinks=np.array([0.5, -np.inf, 1.0, 0.0]))
    for step in range(3):
        before = lengths.copy()
        q = rng.standard_normal((B, H, T_new, d)).astype(np.float32)
        # rows of very different magnitudes
        k_new = (rng.standard_normal((B, H_kv, T_new, d))
                 * rng.lognormal(0, 1, (B, H_kv, T_new, 1))).astype(np.float32)
        v_new = (rng.standard_normal((B, H_kv, T_new, d_v))
                 * rng.lognormal(0, 1, (B, H_kv, T_new, 1))).astype(np.float32)
        attn, lse = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new,
                                              k_scale=k_scale, v_scale=v_scale, return_lse=True,
                                              **options)
        assert attn.dtype == np.float32
        assert lengths.tolist() == (before + T_new).tolist()
        for cache, scale, new in ((k_cache, k_scale, k_new), (v_cache, v_scale, v_new)):
            codes, row_scale = quantize_reference(new, fmt, "row")
            for b in range(B):
                at = slice(before[b], before[b] + T_new)
                np.testing.assert_array_equal(cache[b, :, at].view(np.uint8),
                                              codes[b].view(np.uint8))
                np.testing.assert_array_equal(scale[b, :, at], row_scale[b])
                assert np.all(cache[b, :, lengths[b]:].view(np.uint8) == nan)
                assert not scale[b, :, lengths[b]:].any()
        for b in range(B):
            n = lengths[b]
            kd = dequantize(k_cache[b, :, :n], k_scale[b, :, :n])
            vd = dequantize(v_cache[b, :, :n], v_scale[b, :, :n])
            assert_matches_reference(attn[b], None, q[b], repeat_kv(kd, 2), repeat_kv(vd, 2),
                                     True, lse=lse[b], f32_abs_cap=None, **options)


FIXED_KINDS = ["none", "tensor", "entry-head", "head"]


def fixed_scale(kind, rng, shape):
    """A scale that is not a per-row array: None, a float, one per
    (entry, head) (shape[:2] + (1,)), one per head (1, H_kv, 1)."""
    if kind == "none":
        return None
    if kind == "tensor":
        return 0.03125
    if kind == "entry-head":
        return rng.uniform(0.01, 0.05, shape[:2] + (1,)).astype(np.float32)
    return rng.uniform(0.01, 0.05, (1, shape[1], 1)).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", FIXED_KINDS)
@pytest.mark.parametrize("T", [1, 3])
def test_fp8_cache_with_fixed_scales_saturates_on_append(fmt, kind, T, simd):
    """Scales that are not per-row arrays stay as they are: appended rows are
    saturate(value / scale) rounded to nearest even (beyond fmax and +-inf
    to +-fmax, NaN to a NaN code). The saturated keys sit in feature 0,
    where q is 0; a NaN key makes its rows NaN, a NaN value its column."""
    rng = np.random.default_rng(21 + T)
    B, H, H_kv, S_max, d, d_v = 2, 4, 2, 30, 9, 5
    k_scale, v_scale = (fixed_scale(kind, rng, (B, H_kv)) for _ in range(2))
    k_cache = saturated_codes(rng.standard_normal((B, H_kv, S_max, d)),
                              scale_at(k_scale, (B, H_kv, S_max)), fmt)
    v_cache = saturated_codes(rng.standard_normal((B, H_kv, S_max, d_v)),
                              scale_at(v_scale, (B, H_kv, S_max)), fmt)
    lengths = np.array([5, 9])
    q = rng.standard_normal((B, H, T, d)).astype(np.float32)
    q[..., 0] = 0.0
    k_new = rng.standard_normal((B, H_kv, T, d)).astype(np.float32)
    v_new = rng.standard_normal((B, H_kv, T, d_v)).astype(np.float32)
    k_new[0, 1, 0, 0], k_new[1, 0, 0, 0] = 1e30, -np.inf
    k_new[1, 1, -1, 0], k_new[0, 0, 0, 0] = np.inf, -1e30
    v_new[0, 0, 0, :2] = [1e30, -np.inf]
    v_new[1, 0, -1, 3] = np.inf
    k_new[0, 0, -1, 0] = np.nan                            # entry 0, heads 0 and 1: NaN rows
    v_new[1, 1, -1, 2] = np.nan                            # entry 1, heads 2 and 3: a NaN column
    k_before, v_before = k_cache.copy(), v_cache.copy()
    after = lengths.copy()
    attn = ca.attention_with_kvcache(q, k_cache, v_cache, after, k_new, v_new,
                                     k_scale=k_scale, v_scale=v_scale)
    assert after.tolist() == [5 + T, 9 + T]
    for cache, old, scale, new in ((k_cache, k_before, k_scale, k_new),
                                   (v_cache, v_before, v_scale, v_new)):
        for b in range(B):
            at = slice(lengths[b], lengths[b] + T)
            want = saturated_codes(new[b], scale_at(scale, (B, H_kv, S_max))[b, :, at], fmt)
            got = cache[b, :, at]
            nan = np.isnan(want.astype(np.float32))
            np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
            np.testing.assert_array_equal(got.view(np.uint8)[~nan], want.view(np.uint8)[~nan])
            # the other positions as they were
            rest = np.ones(S_max, bool)
            rest[at] = False
            np.testing.assert_array_equal(cache[b][:, rest].view(np.uint8),
                                          old[b][:, rest].view(np.uint8))
    fmax = FMAX[fmt]
    assert float(k_cache[0, 1, 5, 0]) == fmax and float(k_cache[1, 0, 9, 0]) == -fmax
    assert np.all(v_cache[0, 0, 5, :2].astype(np.float64) == [fmax, -fmax])
    for b in range(B):
        n = after[b]
        kd = cache_values(k_cache, k_scale)[b, :, :n]
        vd = cache_values(v_cache, v_scale)[b, :, :n]
        check_non_finite(attn[b], q[b], repeat_kv(kd, 2), repeat_kv(vd, 2), True)


NEW_DTYPES = [np.float16, BF16, np.float32, np.float64]


@pytest.mark.parametrize("new_dtype", NEW_DTYPES, ids=str)
@pytest.mark.parametrize("per_row", [True, False], ids=["row-scales", "fixed-scale"])
def test_fp8_cache_takes_new_rows_of_every_float_dtype(new_dtype, per_row):
    """float16, bfloat16, float32 and float64 rows, quantized from their
    float32 values; a 16-bit q (that of the rows) gives its own dtype."""
    rng = np.random.default_rng(22)
    fmt = E5M2 if per_row else E4M3
    B, H_kv, S_max, d = 2, 2, 16, 12
    k_cache, v_cache = unit_codes(rng, (B, H_kv, S_max, d), fmt), unit_codes(
        rng, (B, H_kv, S_max, d), fmt)
    if per_row:
        k_scale, v_scale = (np.ones((B, H_kv, S_max), np.float32) for _ in range(2))
    else:
        k_scale, v_scale = 0.125, np.array([[[0.25]], [[0.5]]], np.float32)
    q_dtype = new_dtype if new_dtype in (np.float16, BF16) else np.float32
    q = rng.standard_normal((B, 4, 2, d)).astype(q_dtype)
    k_new = (rng.standard_normal((B, H_kv, 2, d)) * 3).astype(new_dtype)
    v_new = (rng.standard_normal((B, H_kv, 2, d)) * 3).astype(new_dtype)
    lengths = np.array([4, 11])
    attn = ca.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new, v_new,
                                     k_scale=k_scale, v_scale=v_scale)
    assert attn.dtype == q_dtype
    for cache, scale, new in ((k_cache, k_scale, k_new), (v_cache, v_scale, v_new)):
        if per_row:
            want, want_scale = quantize_reference(new.astype(np.float32), fmt, "row")
        for b, start in enumerate((4, 11)):
            at = slice(start, start + 2)
            if per_row:
                np.testing.assert_array_equal(scale[b, :, at], want_scale[b])
                want_b = want[b]
            else:
                want_b = saturated_codes(new[b], scale_at(scale, (B, H_kv, S_max))[b, :, at],
                                         fmt)
            np.testing.assert_array_equal(cache[b, :, at].view(np.uint8), want_b.view(np.uint8))
    for b, n in enumerate(lengths):
        kd = cache_values(k_cache, k_scale)[b, :, :n]
        vd = cache_values(v_cache, v_scale)[b, :, :n]
        check(attn[b], None, q[b], repeat_kv(kd, 2), repeat_kv(vd, 2), True)


def _cache_arguments(rng):
    B, H_kv, S_max, d = 2, 2, 32, 16
    k_cache = from_bytes(rng.choice(finite_codes(E4M3), (B, H_kv, S_max, d)), E4M3)
    v_cache = from_bytes(rng.choice(finite_codes(E4M3), (B, H_kv, S_max, d)), E4M3)
    return dict(q=rng.standard_normal((B, 4, 1, d)).astype(np.float32), k_cache=k_cache,
                v_cache=v_cache, k_new=rng.standard_normal((B, H_kv, 1, d)).astype(np.float32),
                v_new=rng.standard_normal((B, H_kv, 1, d)).astype(np.float32),
                k_scale=rng.uniform(0.1, 1, (B, H_kv, S_max)).astype(np.float32),
                v_scale=rng.uniform(0.1, 1, (B, H_kv, S_max)).astype(np.float32))


CACHE_ERRORS = [
    (dict(k_new="int32"), TypeError, both_named("int32", "float8_e4m3fn")),
    (dict(v_new="int8"), TypeError, both_named("int8", "float8_e4m3fn")),
    (dict(v_new=E5M2), TypeError, both_named("float8_e5m2", "float8_e4m3fn")),
    (dict(k_new=E4M3), TypeError, "float8_e4m3fn"),
    (dict(q="float64"), TypeError, r"(?i)float8|fp8"),
    (dict(k_scale=0.0), ValueError, "scale"),              # a fixed 0 where rows go
    (dict(v_scale=np.array([[[0.5]], [[0.0]]], np.float32)), ValueError, "scale"),
    (dict(k_scale=-1.0), ValueError, "k_scale"),
    (dict(v_scale=np.float32(np.nan)), ValueError, "v_scale"),
    (dict(v_scale=2 * SCALE_BOUND[E4M3]), ValueError, "v_scale"),
    (dict(k_new="nan"), ValueError, r"(?i)nan|finite"),    # per-row scales: computed
    (dict(v_new="inf"), ValueError, r"(?i)inf|finite"),
]


@pytest.mark.parametrize("change,error,match", CACHE_ERRORS)
def test_fp8_cache_errors_write_nothing(change, error, match):
    args = _cache_arguments(np.random.default_rng(23))
    for name, value in change.items():
        if isinstance(value, str) and value in ("nan", "inf"):
            args[name] = args[name].copy()
            args[name][1, 0, 0, 3] = np.nan if value == "nan" else np.inf
        elif isinstance(value, (str, np.dtype)):
            args[name] = args[name].astype(value)
        else:
            args[name] = value
    lengths = np.array([3, 1])
    before = {name: args[name].copy() for name in ("k_cache", "v_cache")}
    scales_before = {name: np.copy(args[name]) for name in ("k_scale", "v_scale")}
    with pytest.raises(error, match=match):
        ca.attention_with_kvcache(args["q"], args["k_cache"], args["v_cache"], lengths,
                                  args["k_new"], args["v_new"], k_scale=args["k_scale"],
                                  v_scale=args["v_scale"])
    assert lengths.tolist() == [3, 1]
    for name, old in before.items():
        np.testing.assert_array_equal(args[name].view(np.uint8), old.view(np.uint8))
    for name, old in scales_before.items():
        np.testing.assert_array_equal(np.asarray(args[name]), old)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_fp8_cache_with_strided_features_gives_the_contiguous_bits(fmt, which, simd):
    rng = np.random.default_rng(24)
    q = rng.standard_normal((2, 2, 1, 17)).astype(np.float32)
    k, ks = fp8_operand(rng, (2, 2, 64, 17), fmt, "row")
    v, vs = fp8_operand(rng, (2, 2, 64, 16), fmt, "row")
    lengths = np.array([40, 64])
    expected = ca.attention_with_kvcache(q, k.copy(), v.copy(), lengths.copy(), k_scale=ks.copy(),
                                         v_scale=vs.copy())
    k_cache = feature_strided(k) if "k" in which else k.copy()
    v_cache = feature_strided(v) if "v" in which else v.copy()
    attn = ca.attention_with_kvcache(q, k_cache, v_cache, lengths.copy(), k_scale=ks.copy(),
                                     v_scale=vs.copy())
    assert_bitwise_equal(attn, expected)
    for b, n in enumerate(lengths):
        assert_matches_reference(attn[b], None, q[b], dequantize(k[b, :, :n], ks[b, :, :n]),
                                 dequantize(v[b, :, :n], vs[b, :, :n]), True)


# ---- fp8 pages ---------------------------------------------------------------------

def paged_values(pages, scale, table, b, n):
    """Sequence b's first n positions (H_kv, n, d) of pages, as float64."""
    page_size = pages.shape[2]
    p = np.arange(n)
    rows = cache_values(pages, scale)[table[b, p // page_size], :, p % page_size]
    return np.swapaxes(rows, 0, 1)


def check_paged_sequence(attn, q, k_pages, v_pages, k_scale, v_scale, table, b, n,
                         **options):
    """Sequence b's rows of a paged call against the float64 reference over
    the n keys its pages hold (paged_values), query heads grouped on the
    pages' K/V heads, bottom-right causal."""
    group = q.shape[1] // k_pages.shape[1]
    assert_matches_reference(attn[b], None, q[b],
                             repeat_kv(paged_values(k_pages, k_scale, table, b, n), group),
                             repeat_kv(paged_values(v_pages, v_scale, table, b, n), group),
                             True, f32_abs_cap=None, **options)


def slots_of(table, b, positions, page_size):
    positions = np.asarray(positions)
    return table[b, positions // page_size] * page_size + positions % page_size


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_fp8_pages_quantize_appended_rows_per_row(fmt, page_size, simd):
    """paged_append with per-row scale arrays, then the paged call reading
    them and appending more in the call (decode and a 3-row step)."""
    rng = np.random.default_rng(25 + page_size)
    n_seq, H, H_kv, d, d_v = 2, 4, 2, 17, 8
    max_pages = -(-46 // page_size)
    n_pages = n_seq * max_pages + 2
    table = rng.permutation(n_pages)[:n_seq * max_pages].reshape(n_seq, max_pages)
    nan = NAN_CODES[fmt][-1]
    k_pages = filled((n_pages, H_kv, page_size, d), nan, fmt)
    v_pages = filled((n_pages, H_kv, page_size, d_v), nan, fmt)
    k_scale = np.zeros((n_pages, H_kv, page_size), np.float32)
    v_scale = np.zeros((n_pages, H_kv, page_size), np.float32)
    lengths = np.array([40, 23])
    for b, n in enumerate(lengths):
        k_rows = (rng.standard_normal((n, H_kv, d))
                  * rng.lognormal(0, 1, (n, H_kv, 1))).astype(np.float32)
        v_rows = rng.standard_normal((n, H_kv, d_v)).astype(np.float32)
        slots = slots_of(table, b, np.arange(n), page_size)
        ca.paged_append(k_pages, v_pages, slots, k_rows, v_rows, k_scale=k_scale,
                        v_scale=v_scale)
        for pages, scale, rows in ((k_pages, k_scale, k_rows), (v_pages, v_scale, v_rows)):
            codes, row_scale = quantize_reference(rows, fmt, "row")
            got = pages[slots // page_size, :, slots % page_size]
            np.testing.assert_array_equal(got.view(np.uint8), codes.view(np.uint8))
            np.testing.assert_array_equal(scale[slots // page_size, :, slots % page_size],
                                          row_scale)
    q = rng.standard_normal((n_seq, H, 1, d)).astype(np.float32)
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                           k_scale=k_scale, v_scale=v_scale)
    for b, n in enumerate(lengths):
        check_paged_sequence(attn, q, k_pages, v_pages, k_scale, v_scale, table, b, n)
    # a 3-row step appended by the call itself, with a window
    q = rng.standard_normal((n_seq, H, 3, d)).astype(np.float32)
    k_new = rng.standard_normal((n_seq, H_kv, 3, d)).astype(np.float32)
    v_new = rng.standard_normal((n_seq, H_kv, 3, d_v)).astype(np.float32)
    after = lengths.copy()
    attn, lse = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, after, k_new, v_new,
                                                k_scale=k_scale, v_scale=v_scale, window=(9, 0),
                                                return_lse=True)
    assert after.tolist() == (lengths + 3).tolist()
    for b, n in enumerate(after):
        slots = slots_of(table, b, np.arange(lengths[b], n), page_size)
        codes, row_scale = quantize_reference(k_new[b].swapaxes(0, 1), fmt, "row")
        np.testing.assert_array_equal(
            k_pages[slots // page_size, :, slots % page_size].view(np.uint8),
            codes.view(np.uint8))
        np.testing.assert_array_equal(v_scale[slots // page_size, :, slots % page_size],
                                      quantize_reference(v_new[b].swapaxes(0, 1), fmt)[1])
        check_paged_sequence(attn, q, k_pages, v_pages, k_scale, v_scale, table, b, n,
                             lse=lse[b], window=(9, 0))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["none", "tensor", "page-head", "head"])
def test_fp8_paged_append_with_fixed_scales_saturates(fmt, kind, simd):
    """Fixed scales on pages: saturate(value / scale) at each slot; a scale of
    0 on a page nothing is written to is no error; padding slots are
    skipped; the paged call reads what was written."""
    rng = np.random.default_rng(26)
    n_pages, H_kv, page_size, d = 6, 2, 5, 9
    table = np.array([[4, 1], [0, 5]])
    scale = {"none": None, "tensor": 0.0625,
             "page-head": rng.uniform(0.02, 0.1, (n_pages, H_kv, 1)).astype(np.float32),
             "head": np.array([[[0.05]], [[0.1]]], np.float32).reshape(1, 2, 1)}[kind]
    if kind == "page-head":
        # one per (page, head): each appended row divided by the scale at its
        # position; page 3, never written, may have 0
        scale[3] = 0.0
    nan = NAN_CODES[fmt][0]
    k_pages, v_pages = filled((n_pages, H_kv, page_size, d), nan, fmt), filled(
        (n_pages, H_kv, page_size, d), nan, fmt)
    lengths = np.array([8, 6])
    slots = np.concatenate([slots_of(table, 0, np.arange(8), page_size), [-1],
                            slots_of(table, 1, np.arange(6), page_size), [2 * page_size + 1]])
    n_rows = len(slots)
    k_rows = rng.standard_normal((n_rows, H_kv, d)).astype(np.float32)
    v_rows = rng.standard_normal((n_rows, H_kv, d)).astype(np.float32)
    k_rows[[0, 3, 10, 12], 0, 0] = [1e30, -1e30, np.inf, -np.inf]     # feature 0: q is 0 there
    v_rows[[1, 4, 11], 1, 2] = [1e30, -np.inf, np.inf]
    k_rows[-1, 0, 3], v_rows[-1, 1, 1] = np.nan, np.nan    # to spare page 2
    k_before, v_before = k_pages.copy(), v_pages.copy()
    ca.paged_append(k_pages, v_pages, slots, k_rows, v_rows, k_scale=scale, v_scale=scale)
    written = slots >= 0
    s = slots[written]
    for pages, old, rows in ((k_pages, k_before, k_rows), (v_pages, v_before, v_rows)):
        want = saturated_codes(rows[written], scale_at(scale, pages.shape[:3])[
            s // page_size, :, s % page_size], fmt)
        got = pages[s // page_size, :, s % page_size]
        nan_codes = np.isnan(want.astype(np.float32))
        assert nan_codes.sum() == 1
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan_codes)
        np.testing.assert_array_equal(got.view(np.uint8)[~nan_codes],
                                      want.view(np.uint8)[~nan_codes])
        untouched = np.ones(pages.shape[:3], bool)
        untouched[s // page_size, :, s % page_size] = False
        np.testing.assert_array_equal(pages.view(np.uint8)[untouched],
                                      old.view(np.uint8)[untouched])
    fmax = FMAX[fmt]
    assert [float(k_pages[4, 0, i, 0]) for i in (0, 3)] == [fmax, -fmax]
    q = rng.standard_normal((2, 4, 2, d)).astype(np.float32)
    q[..., 0] = 0.0
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                           k_scale=scale, v_scale=scale)
    for b, n in enumerate(lengths):
        check_paged_sequence(attn, q, k_pages, v_pages, scale, scale, table, b, n)


def _paged_arguments(rng):
    k_pages = from_bytes(rng.choice(finite_codes(E4M3), (4, 2, 8, 16)), E4M3)
    v_pages = from_bytes(rng.choice(finite_codes(E4M3), (4, 2, 8, 16)), E4M3)
    return dict(k_pages=k_pages, v_pages=v_pages, slot_mapping=np.array([1, 9, 30]),
                k_new=rng.standard_normal((3, 2, 16)).astype(np.float32),
                v_new=rng.standard_normal((3, 2, 16)).astype(np.float32),
                k_scale=rng.uniform(0.1, 1, (4, 2, 8)).astype(np.float32),
                v_scale=rng.uniform(0.1, 1, (4, 2, 8)).astype(np.float32))


PAGED_ERRORS = [
    (dict(k_new="int32"), TypeError, both_named("int32", "float8_e4m3fn")),
    (dict(v_new=E5M2), TypeError, both_named("float8_e5m2", "float8_e4m3fn")),
    (dict(k_scale=np.array([[[1.0], [0.0]]], np.float32)), ValueError, "scale"),  # head 1: 0
    (dict(v_scale=0.0), ValueError, "scale"),
    (dict(k_scale=-0.5), ValueError, "k_scale"),
    (dict(v_scale=np.inf), ValueError, "v_scale"),
    (dict(k_new="nan"), ValueError, r"(?i)nan|finite"),    # per-row scales: computed
]


@pytest.mark.parametrize("change,error,match", PAGED_ERRORS)
def test_fp8_paged_append_errors_write_nothing(change, error, match):
    args = _paged_arguments(np.random.default_rng(27))
    for name, value in change.items():
        if isinstance(value, str) and value == "nan":
            args[name] = args[name].copy()
            args[name][2, 1, 5] = np.nan
        elif isinstance(value, (str, np.dtype)):
            args[name] = args[name].astype(value)
        else:
            args[name] = value
    before = {name: args[name].copy() for name in ("k_pages", "v_pages")}
    scales_before = {name: np.copy(args[name]) for name in ("k_scale", "v_scale")}
    with pytest.raises(error, match=match):
        ca.paged_append(**args)
    for name, old in before.items():
        np.testing.assert_array_equal(args[name].view(np.uint8), old.view(np.uint8))
    for name, old in scales_before.items():
        np.testing.assert_array_equal(np.asarray(args[name]), old)


def test_fp8_paged_call_refuses_a_float64_q_and_writes_nothing():
    args = _paged_arguments(np.random.default_rng(28))
    lengths = np.array([3, 5])
    before = args["k_pages"].copy()
    with pytest.raises(TypeError, match=r"(?i)float8|fp8"):
        ca.attention_with_paged_kvcache(np.ones((2, 2, 1, 16)), args["k_pages"],
                                        args["v_pages"], np.array([[0, 1], [2, 3]]), lengths,
                                        np.ones((2, 2, 1, 16), np.float32),
                                        np.ones((2, 2, 1, 16), np.float32),
                                        k_scale=args["k_scale"], v_scale=args["v_scale"])
    assert lengths.tolist() == [3, 5]
    np.testing.assert_array_equal(args["k_pages"].view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", ["kv", "k", "v"])
def test_fp8_pages_with_strided_features_give_the_contiguous_bits(fmt, which, simd):
    rng = np.random.default_rng(29)
    k, ks = fp8_operand(rng, (6, 2, 16, 16), fmt, "row")
    v, vs = fp8_operand(rng, (6, 2, 16, 16), fmt, "head")
    q = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    table = np.array([[3, 1, 0], [5, 2, 4]])
    lengths = np.array([40, 33])
    expected = ca.attention_with_paged_kvcache(q, k.copy(), v.copy(), table, lengths.copy(),
                                               k_scale=ks.copy(), v_scale=vs.copy())
    k_pages = feature_strided(k) if "k" in which else k.copy()
    v_pages = feature_strided(v) if "v" in which else v.copy()
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy(),
                                           k_scale=ks.copy(), v_scale=vs.copy())
    assert_bitwise_equal(attn, expected)
    for b, n in enumerate(lengths):
        assert_matches_reference(attn[b], None, q[b], paged_values(k, ks, table, b, n),
                                 paged_values(v, vs, table, b, n), True)


# ---- packed sequences (attention_varlen) -------------------------------------------

def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def packed_operand(rng, shape, fmt, kind):
    """Codes (total, H_kv, d) and a scale broadcastable to (total, H_kv):
    None, a float, one per K/V head (H_kv,), one per row (total, H_kv)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "none":
        return saturated_codes(x, np.float32(1), fmt), None
    if kind == "head":
        scale = (np.abs(x).max(axis=(0, 2)) / np.float32(FMAX[fmt])).astype(np.float32)
        return saturated_codes(x, scale, fmt), scale
    codes, scale = quantize_reference(x, fmt, kind)
    return codes, (float(scale) if kind == "tensor" else scale)


@pytest.mark.parametrize("k_fmt,v_fmt", FORMAT_PAIRS[:3])
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_fp8_varlen_matches_the_reference(k_fmt, v_fmt, kind, simd):
    rng = np.random.default_rng(30 + SCALE_KINDS.index(kind))
    q_lengths, k_lengths = [1, 9, 1, 40, 3, 0], [30, 9, 1, 203, 0, 5]
    H, H_kv, d, d_v = 4, 2, 17, 3
    cu_q, cu_k = _cu(q_lengths), _cu(k_lengths)
    q = rng.standard_normal((cu_q[-1], H, d)).astype(np.float32)
    k, ks = packed_operand(rng, (cu_k[-1], H_kv, d), k_fmt, kind)
    v, vs = packed_operand(rng, (cu_k[-1], H_kv, d_v), v_fmt, kind)
    attn, lse = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=True, enable_gqa=True,
                                    k_scale=ks, v_scale=vs, return_lse=True)
    assert attn.shape == (cu_q[-1], H, d_v) and attn.dtype == np.float32
    kd, vd = dequantize(k, ks), dequantize(v, vs)
    for i in range(len(q_lengths)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        assert_matches_reference(np.swapaxes(attn[rows], 0, 1), None,
                                 np.swapaxes(q[rows], 0, 1),
                                 repeat_kv(np.swapaxes(kd[keys], 0, 1), 2),
                                 repeat_kv(np.swapaxes(vd[keys], 0, 1), 2), True,
                                 lse=np.swapaxes(lse[rows], 0, 1))


def test_fp8_varlen_refuses_bad_scales():
    rng = np.random.default_rng(31)
    q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    k = unit_codes(rng, (5, 2, 8), E4M3)
    with pytest.raises(ValueError, match="k_scale"):
        ca.attention_varlen(q, k, k, [0, 1, 3], [0, 2, 5], k_scale=-1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="v_scale"):
        ca.attention_varlen(q, k, k, [0, 1, 3], [0, 2, 5], v_scale=np.ones((4, 2), np.float32))
    with pytest.raises(TypeError, match=r"(?i)float8|fp8"):
        ca.attention_varlen(q.astype(np.float64), k, k, [0, 1, 3], [0, 2, 5])


# ---- property: random fp8 caches against the reference ------------------------------

def _property_codes(rng, shape, fmt, large):
    """Random codes: mostly unit values, with zeros, subnormals and (when
    large) +-fmax and any finite code."""
    sign = (rng.integers(0, 2, shape) << 7).astype(np.uint8)
    unit = unit_codes(rng, shape, fmt).view(np.uint8)
    sub = sign | rng.integers(1, N_SUBNORMALS[fmt] + 1, shape).astype(np.uint8)
    pick = rng.random(shape)
    b = np.where(pick < 0.1, sign, np.where(pick < 0.25, sub, unit))
    if large:
        b = np.where(pick > 0.95, sign | LARGEST[fmt],
                     np.where(pick > 0.9, rng.choice(finite_codes(fmt), shape), b))
    return b.astype(np.uint8)


def _property_scale(rng, kind, values, lengths):
    """A scale of the kind for codes (B, H_kv, S_max, d) that brings them to
    O(1): None, a float, (B, H_kv, 1), or a per-row array (B, H_kv, S_max)
    with zeros past the lengths and on a few rows."""
    peak = np.abs(values)
    if kind == "none":
        return None
    if kind == "tensor":
        return float(np.float32(rng.uniform(0.5, 2) / max(peak.max(), 1e-3)))
    if kind == "head":
        m = peak.max(axis=(2, 3), keepdims=True)[..., 0]
        return (rng.uniform(0.5, 2, m.shape) / np.maximum(m, 1e-3)).astype(np.float32)
    m = peak.max(axis=3)
    scale = (rng.uniform(0.5, 2, m.shape) / np.maximum(m, 1e-3)).astype(np.float32)
    scale[rng.random(scale.shape) < 0.05] = 0.0
    for b, n in enumerate(lengths):
        scale[b, :, n:] = 0.0
    return scale


if given is not None:
    @st.composite
    def fp8_cache_steps(draw):
        S_max = draw(st.sampled_from([1, 7, 33, 97]))
        B = draw(st.integers(1, 3))
        T_new = draw(st.integers(0, min(S_max, 3)))
        H_kv = draw(st.sampled_from([1, 2]))
        return dict(fmt=draw(st.sampled_from([E4M3, E5M2])), B=B, H_kv=H_kv,
                    H=H_kv * draw(st.sampled_from([1, 2, 3])),
                    d=draw(st.sampled_from([1, 3, 8, 17, 33])),
                    d_v=draw(st.sampled_from([1, 5, 16])), S_max=S_max, T_new=T_new,
                    T=draw(st.integers(1, 9)),
                    lengths=draw(st.lists(st.integers(0, S_max - T_new), min_size=B,
                                          max_size=B)),
                    k_kind=draw(st.sampled_from(SCALE_KINDS)),
                    v_kind=draw(st.sampled_from(SCALE_KINDS)),
                    q_dtype=draw(st.sampled_from([np.float32, np.float16, BF16])),
                    new_dtype=draw(st.sampled_from(NEW_DTYPES)),
                    causal=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))

    @_SETTINGS
    @given(fp8_cache_steps())
    def test_property_fp8_caches_match_the_reference(case):
        """Random fp8 caches (unit codes, zeros, subnormals, +-fmax, any
        finite code; NaN and infinity codes past the lengths), scales of a
        random shape for K and for V, new rows of any float dtype: the bytes
        appended against the rule, the rest of the caches untouched, the
        result against the float64 reference over what the caches hold."""
        rng = np.random.default_rng(case["seed"])
        fmt, B, H, H_kv = case["fmt"], case["B"], case["H"], case["H_kv"]
        d, d_v, S_max, T, T_new = (case[k] for k in ("d", "d_v", "S_max", "T", "T_new"))
        lengths = np.array(case["lengths"])
        caches, scales = [], []
        # past the lengths: NaN and infinity codes, which nothing may read
        tail = np.broadcast_to(np.arange(S_max) >= lengths[:, None, None], (B, H_kv, S_max))
        junk = np.array(NAN_CODES[fmt] + (INF_CODES if fmt == E5M2 else ()), np.uint8)
        for width, kind, is_v in ((d, case["k_kind"], False), (d_v, case["v_kind"], True)):
            # K without a scale keeps to unit codes, zeros and subnormals
            b = _property_codes(rng, (B, H_kv, S_max, width), fmt, large=kind != "none" or is_v)
            b[tail] = rng.choice(junk, (int(tail.sum()), width))
            cache = from_bytes(b, fmt)
            values = np.where(tail[..., None], 0.0, dequantize(cache))
            caches.append(cache)
            scales.append(_property_scale(rng, kind, values, lengths))
        (k_cache, v_cache), (k_scale, v_scale) = caches, scales
        q = rng.standard_normal((B, H, T, d)).astype(case["q_dtype"])
        new = [(rng.standard_normal((B, H_kv, T_new, w))
                * rng.choice([0.5, 1, 4], (B, H_kv, T_new, 1))).astype(case["new_dtype"])
               for w in (d, d_v)]
        before = [c.copy() for c in caches]
        given_lengths = lengths.copy()
        out, lse = ca.attention_with_kvcache(q, k_cache, v_cache, given_lengths, *new,
                                             k_scale=k_scale, v_scale=v_scale,
                                             causal=case["causal"], return_lse=True)
        assert out.dtype == case["q_dtype"]
        assert given_lengths.tolist() == (lengths + T_new).tolist()
        for cache, old, scale, rows in zip(caches, before, scales, new):
            per_row = isinstance(scale, np.ndarray) and scale.shape == cache.shape[:3]
            for b in range(B):
                at = slice(lengths[b], lengths[b] + T_new)
                if per_row:
                    want, want_scale = quantize_reference(rows[b], fmt, "row")
                    np.testing.assert_array_equal(scale[b, :, at], want_scale)
                else:
                    want = saturated_codes(rows[b], scale_at(scale, cache.shape[:3])[b, :, at],
                                           fmt)
                np.testing.assert_array_equal(cache[b, :, at].view(np.uint8),
                                              want.view(np.uint8))
                rest = np.ones(S_max, bool)
                rest[at] = False
                np.testing.assert_array_equal(cache[b][:, rest].view(np.uint8),
                                              old[b][:, rest].view(np.uint8))
        group = H // H_kv
        for b in range(B):
            n = given_lengths[b]
            kd = cache_values(k_cache, k_scale)[b, :, :n]
            vd = cache_values(v_cache, v_scale)[b, :, :n]
            check(out[b], None, q[b], repeat_kv(kd, group), repeat_kv(vd, group),
                  case["causal"], lse=lse[b], f32_abs_cap=None)
else:
    def test_property_fp8_caches_match_the_reference():
        pytest.skip("hypothesis is not installed")
