"""Property tests (hypothesis) of the cache calls of issue 43 against the
float64 reference: random caches and pages of every dtype, lengths, page
sizes, shuffled pages, grouped heads, new rows of their own count,
cache_batch_idx, ALiBi slopes per sequence, left padding, rotary
embeddings. CATTENTION_HYPOTHESIS_PROFILE=long (make reliability) takes ten
times the examples."""

import os

import numpy as np
import pytest

import cattention as ca
from reference import (assert_bfloat16_matches_reference, assert_matches_reference,
                       reference_rotary)
from test_cache_calls import (BFLOAT16, CACHE_DTYPES, _caches, _compute, _pages_from, _q_dtype,
                              _sequence, _values, ml_dtypes, rope_tables, rotate_first)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: examples per property: the "long" profile (make reliability) takes ten times more
EXAMPLES = 400 if os.environ.get("CATTENTION_HYPOTHESIS_PROFILE") == "long" else 40
_SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _reference_check(out, lse, q, keys, values, options, cache_dtype, q_dtype):
    """The float64 reference over the keys a row's sequence holds (as the
    cache stores them), by the float32 rule or the bfloat16 one."""
    if ml_dtypes is not None and q_dtype == ml_dtypes.bfloat16:
        assert_bfloat16_matches_reference(out, None, q.astype(np.float32),
                                          keys.astype(np.float32), values.astype(np.float32),
                                          lse=lse, **options)
    else:
        assert_matches_reference(out, None, q, keys, values, lse=lse, **options)


@st.composite
def kvcache_steps(draw):
    cache_dtype = draw(st.sampled_from(CACHE_DTYPES))
    n_entries = draw(st.integers(1, 4))
    batch_idx = draw(st.one_of(st.none(), st.permutations(range(n_entries)).flatmap(
        lambda p: st.integers(1, n_entries).map(lambda b: list(p[:b])))))
    B = n_entries if batch_idx is None else len(batch_idx)
    H_kv = draw(st.sampled_from([1, 2]))
    H = H_kv * draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([2, 8, 17]))
    S_max = draw(st.sampled_from([5, 33, 300]))
    T_new = draw(st.integers(0, min(S_max, 6)))
    lengths = draw(st.lists(st.integers(0, S_max - T_new), min_size=B, max_size=B))
    T = draw(st.integers(1, 1 + min(lengths) + T_new)) if min(lengths) + T_new else 1
    rotary = draw(st.booleans()) and min(lengths) + T_new >= T
    half = draw(st.integers(1, d // 2)) if rotary else 0
    return dict(cache_dtype=cache_dtype, n_entries=n_entries, batch_idx=batch_idx, B=B,
                H=H, H_kv=H_kv, d=d, S_max=S_max, T=T, T_new=T_new,
                lengths=np.array(lengths), rotary=rotary, half=half,
                interleaved=draw(st.booleans()), causal=draw(st.booleans()),
                seed=draw(st.integers(0, 2**32 - 1)))


@_SETTINGS
@given(kvcache_steps())
def test_property_kvcache_steps_match_the_reference(case):
    """Random caches of every dtype, lengths, grouped heads, T and T_new,
    rotary or not, cache_batch_idx or not: the stored rows and the result
    against the float64 reference."""
    rng = np.random.default_rng(case["seed"])
    cache_dtype, B, H, H_kv, d = (case[k] for k in ("cache_dtype", "B", "H", "H_kv", "d"))
    T, T_new, lengths = case["T"], case["T_new"], case["lengths"]
    k_cache, v_cache, scales = _caches(rng, cache_dtype, (case["n_entries"], H_kv,
                                                          case["S_max"], d),
                                       (case["n_entries"], H_kv, case["S_max"], 3))
    compute = _compute(cache_dtype)
    q_dtype = _q_dtype(cache_dtype)
    q = rng.standard_normal((B, H, T, d)).astype(q_dtype)
    k_new = rng.standard_normal((B, H_kv, T_new, d)).astype(compute)
    v_new = rng.standard_normal((B, H_kv, T_new, 3)).astype(compute)
    options = {}
    if case["rotary"]:
        cos, sin = rope_tables(case["S_max"] + 2, case["half"], compute)
        options = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=case["interleaved"])
    given_lengths = lengths.copy()
    out, lse = ca.attention_with_kvcache(q, k_cache, v_cache, given_lengths, k_new, v_new,
                                         causal=case["causal"], return_lse=True,
                                         cache_batch_idx=case["batch_idx"], **options,
                                         **scales)
    entries = case["batch_idx"] if case["batch_idx"] is not None else range(B)
    for b, entry in enumerate(entries):
        n = int(given_lengths[b])
        assert n == lengths[b] + T_new
        k_scale, v_scale = (scales["k_scale"][entry], scales["v_scale"][entry]) if scales \
            else (None, None)
        keys = _values(k_cache[entry], k_scale)[:, :n]
        values = _values(v_cache[entry], v_scale)[:, :n]
        new_keys = k_new[b].astype(np.float64)
        q_b = q[b].astype(np.float64)
        if case["rotary"]:
            new_keys = reference_rotary(new_keys, cos, sin, np.arange(lengths[b], n),
                                        case["interleaved"])
            q_at = np.arange(n - T, n)
            q_b = (reference_rotary(q_b, cos, sin, q_at, case["interleaved"])
                   if q_dtype == compute else
                   # a 16-bit q is rotated, then rounded to its dtype: that rounding
                   # is the caller's, the formula the one checked on the keys
                   rotate_first(q[b], cos, sin, q_at, case["interleaved"], compute
                                ).astype(q_dtype))
        # the new rows as stored: the reference's, rounded once
        assert np.all(np.abs(keys[:, lengths[b]:] - new_keys)
                      <= _stored_tolerance(cache_dtype, new_keys))
        group = H // H_kv
        _reference_check(out[b], lse[b], q_b, np.repeat(keys, group, axis=0),
                         np.repeat(values, group, axis=0), dict(causal=case["causal"]),
                         cache_dtype, q_dtype)


def _stored_tolerance(cache_dtype, x):
    """How far a row x (float64) may be from what a cache of cache_dtype
    stores of it after float32 (float64) arithmetic: one rounding to the
    cache dtype, a quantization step for int8."""
    if cache_dtype == "int8":
        return np.abs(x).max(axis=-1, keepdims=True) / 127
    if ml_dtypes is not None and cache_dtype == ml_dtypes.bfloat16:
        eps = 2.0 ** -8
    else:
        eps = float(np.finfo(cache_dtype).eps)
    return 4 * eps * np.maximum(np.abs(x), 1)


@st.composite
def paged_steps(draw):
    n_seq = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from([1, 2, 3, 7, 16]))
    max_pages = draw(st.integers(1, 6))
    capacity = max_pages * page_size
    packed = draw(st.booleans())
    if packed:
        new_counts = draw(st.lists(st.integers(0, min(capacity, 5)), min_size=n_seq,
                                   max_size=n_seq))
    else:
        new_counts = [draw(st.integers(0, min(capacity, 5)))] * n_seq
    lengths = [draw(st.integers(0, capacity - n)) for n in new_counts]
    rotary = draw(st.booleans())
    # queries: at most the positions each sequence has after the append (a
    # rotated row needs a position), at least one row in a padded q
    if packed:
        q_counts = [draw(st.integers(0, min(4, n + m))) for n, m in zip(lengths, new_counts)]
    else:
        most = min(n + m for n, m in zip(lengths, new_counts)) if rotary else 4
        q_counts = [draw(st.integers(1, max(1, min(4, most))))] * n_seq
        rotary = rotary and q_counts[0] <= most
    H_kv = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([4, 9, 16]))
    return dict(n_seq=n_seq, page_size=page_size, max_pages=max_pages, packed=packed,
                new_counts=np.array(new_counts), lengths=np.array(lengths),
                q_counts=np.array(q_counts), H_kv=H_kv, H=H_kv * draw(st.sampled_from([1, 3])),
                d=d, cache_dtype=draw(st.sampled_from(CACHE_DTYPES)), rotary=rotary,
                half=draw(st.integers(1, d // 2)), interleaved=draw(st.booleans()),
                alibi=draw(st.sampled_from([None, "per head", "per sequence"])),
                starts=draw(st.booleans()), causal=draw(st.booleans()),
                seed=draw(st.integers(0, 2**32 - 1)))


@_SETTINGS
@given(paged_steps())
def test_property_paged_steps_match_the_reference(case):
    """Random shuffled pages of every dtype and size, lengths, new rows of
    their own count (packed with cu_seqlens_k_new, or padded), grouped
    heads, ALiBi slopes per head or per sequence, left padding, rotary or
    not: the stored rows and the result against the float64 reference."""
    rng = np.random.default_rng(case["seed"])
    n_seq, H, H_kv, d = case["n_seq"], case["H"], case["H_kv"], case["d"]
    cache_dtype, page_size = case["cache_dtype"], case["page_size"]
    lengths, q_counts, new_counts = case["lengths"], case["q_counts"], case["new_counts"]
    compute = _compute(cache_dtype)
    q_dtype = _q_dtype(cache_dtype)
    k_pages, v_pages, scales, table = _pages_from(rng, n_seq, H_kv, page_size,
                                                  case["max_pages"], d, cache_dtype)
    kwargs = dict(causal=case["causal"], return_lse=True, **scales)
    if case["packed"]:
        cu_q = np.concatenate([[0], np.cumsum(q_counts)])
        cu_new = np.concatenate([[0], np.cumsum(new_counts)])
        q = rng.standard_normal((cu_q[-1], H, d)).astype(q_dtype)
        new = rng.standard_normal((cu_new[-1], H_kv, d)).astype(compute)
        kwargs.update(cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new)
        q_of = [np.swapaxes(q[cu_q[b]:cu_q[b + 1]], 0, 1) for b in range(n_seq)]
        new_of = [np.swapaxes(new[cu_new[b]:cu_new[b + 1]], 0, 1) for b in range(n_seq)]
    else:
        q = rng.standard_normal((n_seq, H, q_counts[0], d)).astype(q_dtype)
        new = rng.standard_normal((n_seq, H_kv, new_counts[0], d)).astype(compute)
        q_of, new_of = list(q), list(new)
    slopes = None
    if case["alibi"] is not None:
        slopes = rng.uniform(0.01, 0.5, (n_seq, H) if case["alibi"] == "per sequence" else H)
        kwargs["alibi_slopes"] = slopes
    starts = None
    if case["starts"]:
        starts = np.array([int(rng.integers(0, n + m + 1)) for n, m in zip(lengths, new_counts)])
        kwargs["kv_starts"] = starts
    if case["rotary"]:
        capacity = case["max_pages"] * page_size
        cos, sin = rope_tables(capacity, case["half"], compute)
        kwargs.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=case["interleaved"])
    given_lengths = lengths.copy()
    out, lse = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, given_lengths, new,
                                               new, **kwargs)
    assert given_lengths.tolist() == (lengths + new_counts).tolist()
    for b in range(n_seq):
        n = int(given_lengths[b])
        k_scale, v_scale = (scales["k_scale"], scales["v_scale"]) if scales else (None, None)
        keys = _sequence(k_pages, table, b, n, k_scale)
        values = _sequence(v_pages, table, b, n, v_scale)
        new_keys = new_of[b].astype(np.float64)
        q_b = q_of[b].astype(np.float64)
        if case["rotary"]:
            q_at = np.arange(n - q_counts[b], n)
            new_keys = reference_rotary(new_keys, cos, sin, np.arange(lengths[b], n),
                                        case["interleaved"])
            q_b = (reference_rotary(q_b, cos, sin, q_at, case["interleaved"])
                   if q_dtype == compute else
                   rotate_first(q_of[b], cos, sin, q_at, case["interleaved"], compute
                                ).astype(q_dtype))
        assert np.all(np.abs(keys[:, lengths[b]:] - new_keys)
                      <= _stored_tolerance(cache_dtype, new_keys))
        if not q_counts[b]:
            continue
        group = H // H_kv
        options = dict(causal=case["causal"])
        if slopes is not None:
            options["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
        if starts is not None:
            options["kv_starts"] = starts[b]
        out_b = out[b] if not case["packed"] else np.swapaxes(out[cu_q[b]:cu_q[b + 1]], 0, 1)
        lse_b = lse[b] if not case["packed"] else np.swapaxes(lse[cu_q[b]:cu_q[b + 1]], 0, 1)
        _reference_check(out_b, lse_b, q_b, np.repeat(keys, group, axis=0),
                         np.repeat(values, group, axis=0), options, cache_dtype, q_dtype)


@st.composite
def varlen_batches(draw):
    n_seq = draw(st.integers(1, 4))
    k_lengths = draw(st.lists(st.integers(0, 40), min_size=n_seq, max_size=n_seq))
    # rows past a causal sequence's keys see none of them (sinks only)
    q_lengths = [draw(st.integers(0, min(6, n + 2))) for n in k_lengths]
    H_kv = draw(st.sampled_from([1, 2]))
    return dict(k_lengths=np.array(k_lengths), q_lengths=np.array(q_lengths), H_kv=H_kv,
                H=H_kv * draw(st.sampled_from([1, 2, 3])), d=draw(st.sampled_from([3, 8, 16])),
                d_v=draw(st.sampled_from([2, 8])),
                dtype=draw(st.sampled_from([np.float32, np.float64] + BFLOAT16)),
                alibi=draw(st.sampled_from(["per head", "per sequence"])),
                sinks=draw(st.sampled_from([None, "per head", "per sequence"])),
                causal=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


@_SETTINGS
@given(varlen_batches())
def test_property_varlen_alibi_per_sequence_matches_the_reference(case):
    """Packed sequences of random lengths (rows past a causal sequence's
    keys included), grouped heads, float32, float64 and bfloat16 inputs,
    ALiBi slopes (and sinks) per head or one row per sequence: each
    sequence against the float64 reference with its own row of slopes."""
    rng = np.random.default_rng(case["seed"])
    H, H_kv, d, d_v = (case[k] for k in ("H", "H_kv", "d", "d_v"))
    n_seq = len(case["k_lengths"])
    cu_q = np.concatenate([[0], np.cumsum(case["q_lengths"])])
    cu_k = np.concatenate([[0], np.cumsum(case["k_lengths"])])
    dtype = case["dtype"]
    q = rng.standard_normal((cu_q[-1], H, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], H_kv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], H_kv, d_v)).astype(dtype)

    def per(kind, draw):
        return draw((n_seq, H)) if kind == "per sequence" else draw(H)

    slopes = per(case["alibi"], lambda shape: rng.uniform(0.01, 0.6, shape))
    sinks = (per(case["sinks"], lambda shape: rng.standard_normal(shape))
             if case["sinks"] is not None else None)
    out, lse = ca.attention_varlen(q, k, v, cu_q, cu_k, causal=case["causal"],
                                   enable_gqa=H != H_kv, alibi_slopes=slopes, sinks=sinks,
                                   return_lse=True)
    group = H // H_kv
    for i in range(n_seq):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if cu_q[i] == cu_q[i + 1]:
            continue
        options = dict(causal=case["causal"],
                       alibi_slopes=slopes[i] if slopes.ndim == 2 else slopes)
        if sinks is not None:
            options["sinks"] = sinks[i] if sinks.ndim == 2 else sinks
        _reference_check(np.swapaxes(out[rows], 0, 1), np.swapaxes(lse[rows], 0, 1),
                         np.swapaxes(q[rows], 0, 1),
                         np.repeat(np.swapaxes(k[keys], 0, 1), group, axis=0),
                         np.repeat(np.swapaxes(v[keys], 0, 1), group, axis=0), options,
                         None, dtype)
