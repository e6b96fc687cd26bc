"""Options on the compiled shortcut of ``attention``: a call with softcap,
sinks, a window, ALiBi slopes, kv_lengths, kv_starts, grouped heads,
return_lse or out= takes the compiled path when its arrays are of the
common kinds, and gives bitwise the results of the general path (forced
here) and the float64 reference's to rounding. Arrays of other kinds
(lists, int8 lengths, misaligned slopes) are handed to the general path."""

import zlib

import numpy as np
import pytest

import cattention as ca
from reference import assert_bitwise_equal, assert_matches_reference, make_qkv

B, H, S, D = 2, 4, 37, 16
HEADS = [(4, 4), (4, 2)]      # (H, H_kv): equal heads, and grouped


def _options(name, rng, T):
    per_head = rng.uniform(0.05, 0.5, H)
    return {
        "softcap": dict(softcap=7.5),
        "sinks (H,)": dict(sinks=rng.standard_normal(H)),
        "sinks (B, H) float32": dict(sinks=rng.standard_normal((B, H)).astype(np.float32)),
        "window": dict(window=(9, 3)),
        "window causal": dict(window=(6, None), causal=True),
        "alibi (H,)": dict(alibi_slopes=per_head),
        "alibi (B, H)": dict(alibi_slopes=rng.uniform(0.05, 0.5, (B, H)), causal=True),
        "kv_lengths per sequence": dict(kv_lengths=np.array([S, 20])),
        "kv_lengths (B, H) int32": dict(
            kv_lengths=rng.integers(T, S + 1, (B, H)).astype(np.int32)),
        "kv_starts": dict(kv_starts=np.array([0, 11]), causal=True),
        "starts and lengths": dict(kv_starts=np.array([3, 5]), kv_lengths=np.array([30, S])),
        "everything": dict(softcap=20.0, sinks=rng.standard_normal(H), window=(12, 0),
                           causal=True, kv_lengths=np.array([S, 25]),
                           kv_starts=np.array([2, 0])),
        "a sink below the range": dict(sinks=np.array([-1e300, 0.5, -np.inf, 1.0])),
    }[name]


OPTION_NAMES = ["softcap", "sinks (H,)", "sinks (B, H) float32", "window", "window causal",
                "alibi (H,)", "alibi (B, H)", "kv_lengths per sequence",
                "kv_lengths (B, H) int32", "kv_starts", "starts and lengths", "everything",
                "a sink below the range"]


@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("T", [1, 2, 19], ids=["decode", "two rows", "prompt"])
def test_options_take_the_compiled_path_as_the_general_path(
        compiled_path, general_path, dtype, name, heads, T):
    n_heads, n_kv_heads = heads
    rng = np.random.default_rng(zlib.crc32(f"{name} {T}".encode()))
    options = _options(name, rng, T)
    q, k, v = make_qkv(17, (B, n_heads, T, D), (B, n_kv_heads, S, D),
                       (B, n_kv_heads, S, D + 3), dtype)
    taken = compiled_path("attention_shortcut")
    grouped = dict(enable_gqa=True) if n_kv_heads != n_heads else {}
    got = ca.attention(q, k, v, return_lse=True, **grouped, **options)
    assert taken == [True]
    with general_path("attention_shortcut"):
        expected = ca.attention(q, k, v, return_lse=True, **grouped, **options)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_bitwise_equal(a, b)
    group = n_heads // n_kv_heads
    reference_options = dict(options)
    causal = reference_options.pop("causal", False)
    if "kv_lengths" in reference_options and reference_options["kv_lengths"].ndim == 1:
        reference_options["kv_lengths"] = reference_options["kv_lengths"][:, None]
    if "kv_starts" in reference_options:
        reference_options["kv_starts"] = reference_options["kv_starts"][:, None]
    assert_matches_reference(got[0], None, q, np.repeat(k, group, axis=1),
                             np.repeat(v, group, axis=1), causal=causal, lse=got[1],
                             **reference_options)


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa"])
@pytest.mark.parametrize("T", [1, 5], ids=["decode", "prompt"])
def test_out_of_any_layout_takes_the_compiled_path(compiled_path, general_path, dtype, heads,
                                                   T):
    """out= as a model lays its output out, (B, T, H, d) seen as (B, H, T, d),
    or C-contiguous: written in place, the same bits as without out=."""
    n_heads, n_kv_heads = heads
    q, k, v = make_qkv(23, (B, n_heads, T, D), (B, n_kv_heads, S, D), (B, n_kv_heads, S, D),
                       dtype)
    grouped = dict(enable_gqa=True) if n_kv_heads != n_heads else {}
    with general_path("attention_shortcut"):
        expected = ca.attention(q, k, v, causal=True, softcap=9.0, **grouped)
    taken = compiled_path("attention_shortcut")
    for out in (np.full((B, n_heads, T, D), np.nan, dtype),
                np.full((B, T, n_heads, D), np.nan, dtype).transpose(0, 2, 1, 3)):
        result = ca.attention(q, k, v, causal=True, softcap=9.0, out=out, **grouped)
        assert result is out
        assert_bitwise_equal(out, expected)
    assert taken == [True, True]


def test_bfloat16_out_takes_the_compiled_path(compiled_path, general_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v = (x.astype(bf16) for x in make_qkv(29, (B, 4, 1, D), (B, 2, S, D), (B, 2, S, D),
                                                   np.float32))
    with general_path("attention_shortcut"):
        expected = ca.attention(q, k, v, enable_gqa=True, sinks=np.zeros(4))
    taken = compiled_path("attention_shortcut")
    out = np.zeros((B, 1, 4, D), bf16).transpose(0, 2, 1, 3)
    assert ca.attention(q, k, v, enable_gqa=True, sinks=np.zeros(4), out=out) is out
    assert taken == [True]
    assert_bitwise_equal(out.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("options", [
    dict(kv_lengths=[37, 20]),                                  # a list
    dict(kv_lengths=np.array([37, 20], np.int8)),               # another integer type
    dict(sinks=np.zeros(4, np.float16)),                        # another float type
    dict(alibi_slopes=np.zeros((3, 4))),                        # does not broadcast
    dict(mask=np.ones((1, 1, 1, 37), bool)),                    # a mask
], ids=["list", "int8", "float16 sinks", "mismatched", "mask"])
def test_other_option_arrays_go_to_the_general_path(compiled_path, options):
    q, k, v = make_qkv(31, (B, H, 1, D), (B, H, S, D), (B, H, S, D), np.float32)
    taken = compiled_path("attention_shortcut")
    if "alibi_slopes" in options:
        with pytest.raises(ValueError, match="alibi_slopes of shape"):
            ca.attention(q, k, v, **options)
    else:
        ca.attention(q, k, v, **options)
    assert taken == [False]


@pytest.mark.parametrize("options,message", [
    (dict(kv_lengths=np.array([38, 2])), r"kv_lengths must lie in \[0, S\] = \[0, 37\]"),
    (dict(kv_starts=np.array([-1, 2])), r"kv_starts must lie in \[0, S\]"),
    (dict(sinks=np.array([0.0, np.nan, 0, 0])), "sinks must be finite"),
    (dict(sinks=np.array([0.0, 1e39, 0, 0], np.float64)), "sinks must be at most"),
    (dict(alibi_slopes=np.array([0.0, np.inf, 0, 0])), "alibi_slopes must be finite"),
    (dict(softcap=-1.0), "softcap must be a positive"),
    (dict(window=(-2, 0)), "window left must be >= 0"),
])
def test_option_values_are_refused_alike_either_way(general_path, options, message):
    """The compiled path refuses a bad value with the general path's error
    (one check serves both)."""
    q, k, v = make_qkv(37, (B, H, 1, D), (B, H, S, D), (B, H, S, D), np.float32)
    with pytest.raises(ValueError, match=message):
        ca.attention(q, k, v, **options)
    with general_path("attention_shortcut"), pytest.raises(ValueError, match=message):
        ca.attention(q, k, v, **options)


def test_out_sharing_memory_with_an_input_goes_to_the_general_path(compiled_path):
    q, k, v = make_qkv(41, (B, H, 3, D), (B, H, S, D), (B, H, S, D), np.float32)
    taken = compiled_path("attention_shortcut")
    with pytest.raises(ValueError, match="out and q share memory"):
        ca.attention(q, k, v, out=q)
    assert taken == [False]


CACHE_OPTIONS = {
    "window softcap": dict(window=(5, 0), softcap=11.0),
    "alibi (H,)": dict(alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4])),
    "sinks (H,) float32": dict(sinks=np.array([0.5, -1.0, -np.inf, 2.0], np.float32)),
    "kv_starts": dict(kv_starts=np.array([2, 0])),
    "lse": dict(return_lse=True),
    "everything": dict(window=(7, 0), softcap=15.0, sinks=np.zeros(4), return_lse=True,
                       kv_starts=np.array([1, 3])),
}


def _cache_step(seed, dtype, n_kv_heads, T, paged):
    rng = np.random.default_rng(seed)
    S_max, lengths = 24, np.array([9, 14])
    q = rng.standard_normal((B, 4, T, D)).astype(dtype)
    k_new = rng.standard_normal((B, n_kv_heads, T, D)).astype(dtype)
    v_new = rng.standard_normal((B, n_kv_heads, T, D)).astype(dtype)
    if not paged:
        k_cache = rng.standard_normal((B, n_kv_heads, S_max, D)).astype(dtype)
        v_cache = rng.standard_normal((B, n_kv_heads, S_max, D)).astype(dtype)
        return q, (k_cache, v_cache), lengths, k_new, v_new
    page_size = 4
    k_pages = rng.standard_normal((14, n_kv_heads, page_size, D)).astype(dtype)
    v_pages = rng.standard_normal((14, n_kv_heads, page_size, D)).astype(dtype)
    table = rng.permutation(14)[:12].reshape(B, 6)
    return q, (k_pages, v_pages, table), lengths, k_new, v_new


@pytest.mark.parametrize("name", list(CACHE_OPTIONS))
@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("paged", [False, True], ids=["kvcache", "paged"])
def test_cache_options_take_the_compiled_path_as_the_general_path(
        compiled_path, general_path, dtype, name, n_kv_heads, T, paged):
    """Cache steps with options and out= (a (B, T, H, d) layout): the
    compiled step gives the output, LSE, caches and lengths of the general
    path, bit for bit."""
    call = ca.attention_with_paged_kvcache if paged else ca.attention_with_kvcache
    entry = "paged_shortcut" if paged else "kvcache_shortcut"
    options = CACHE_OPTIONS[name]
    results = []
    for general in (False, True):
        q, storage, lengths, k_new, v_new = _cache_step(5, dtype, n_kv_heads, T, paged)
        out = np.full((B, T, 4, D), np.nan, dtype).transpose(0, 2, 1, 3)
        taken = compiled_path(entry)
        if general:
            with general_path(entry):
                got = call(q, *storage, lengths, k_new, v_new, out=out, **options)
        else:
            got = call(q, *storage, lengths, k_new, v_new, out=out, **options)
            assert taken == [True]
        got = got if isinstance(got, tuple) else (got,)
        assert got[0] is out
        results.append((got, storage[:2], lengths))
    (got, storage, lengths), (want, want_storage, want_lengths) = results
    for a, b in zip(got + storage + (lengths,), want + want_storage + (want_lengths,)):
        assert_bitwise_equal(a, b)
    assert lengths.tolist() == [9 + T, 14 + T]
