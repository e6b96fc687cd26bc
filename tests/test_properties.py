"""Property tests (hypothesis) against the float64 reference.

The profile is chosen by CATTENTION_HYPOTHESIS_PROFILE: "ci" (the default,
250 examples per property) or "long" (3000; `make reliability`).
"""

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import cattention as ca  # noqa: E402
from reference import (  # noqa: E402
    assert_bfloat16_matches_reference,
    assert_bitwise_equal,
    assert_matches_reference,
    float32_ulp_atol,
    max_abs_err,
    numpy_attention_f32,
    reference_attention,
    rms_err,
    visible_positions,
)

try:
    import ml_dtypes
    #: the dtypes problems are drawn in; bfloat16 where ml_dtypes is there
    DTYPES = [np.float32, np.float64, ml_dtypes.bfloat16]
except ImportError:
    DTYPES = [np.float32, np.float64]

settings.register_profile(
    "ci", max_examples=250, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "long", max_examples=3000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("CATTENTION_HYPOTHESIS_PROFILE", "ci"))

# sizes around the kernels' block and tile edges (6-row tiles, 16-key panels,
# 96-row query blocks, 256-key blocks, 8-row direct path)
EDGE_SIZES = [0, 1, 2, 5, 6, 7, 8, 9, 15, 16, 17, 63, 64, 65, 95, 96, 97, 255, 256, 257]


@st.composite
def problems(draw, allow_empty=True, dtypes=DTYPES):
    sizes = st.sampled_from([s for s in EDGE_SIZES if allow_empty or s > 0])
    T = draw(sizes)
    S = draw(sizes)
    d_k = draw(st.sampled_from([1, 3, 8, 16, 17]))
    d_v = draw(st.sampled_from([1, 5, 16, 20]))
    batch = draw(st.sampled_from([(), (1,), (2,), (2, 3)]))
    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from(["none", "bool", "additive"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(batch + (T, d_k)).astype(dtype)
    k = rng.standard_normal(batch + (S, d_k)).astype(dtype)
    v = rng.standard_normal(batch + (S, d_v)).astype(dtype)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((T, S)) > 0.3
    elif mask_kind == "additive":
        mask = np.where(rng.random((T, S)) > 0.3, rng.standard_normal((T, S)), -np.inf)
    return q, k, v, causal, mask


def layouts(arr, rng):
    """The same values in other memory layouts."""
    yield np.asfortranarray(arr)
    yield np.ascontiguousarray(arr[..., ::-1, :][..., ::-1, :])  # copy via reversed views
    reversed_copy = np.ascontiguousarray(arr[..., ::-1, :])
    yield reversed_copy[..., ::-1, :]                           # negative row stride
    wide = np.zeros(arr.shape[:-1] + (2 * arr.shape[-1] + 1,), arr.dtype)
    wide[..., 1::2] = arr
    yield wide[..., 1::2]                                        # strided features
    frozen = arr.copy()
    frozen.setflags(write=False)
    yield frozen
    raw = np.zeros(arr.nbytes + arr.itemsize + 1, np.uint8)
    off = 1                                                      # misaligned buffer
    view = np.frombuffer(raw.data, dtype=arr.dtype, count=arr.size, offset=off)
    view = view.reshape(arr.shape)
    raw[off:off + arr.nbytes] = np.frombuffer(np.ascontiguousarray(arr).tobytes(), np.uint8)
    yield view


@given(problems())
def test_matches_reference(problem):
    q, k, v, causal, mask = problem
    # bfloat16 results: one rounding of a result that meets the float32 rule
    check = (assert_matches_reference if q.dtype in (np.float32, np.float64)
             else assert_bfloat16_matches_reference)
    attn, scores = ca.attention(q, k, v, causal=causal, mask=mask, return_scores=True)
    check(attn, scores, q, k, v, causal, mask)
    check(ca.attention(q, k, v, causal=causal, mask=mask), None, q, k, v, causal, mask)


@pytest.mark.parametrize("seed", [770, 5531, 5700])
def test_long_rows_of_small_weights_stay_near_numpy(simd, seed):
    """Examples of `problems()` (float32, 2 x 65 queries, 256 keys, d_k = 8,
    d_v = 5, causal, additive mask) where summing each block's 256 products
    p_j v_j in one float32 chain left ATTN up to 1.23x the tolerance (4x
    NumPy's max error); the P.V tiles sum runs of 64 keys from zero."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 65, 8)).astype(np.float32)
    k = rng.standard_normal((2, 256, 8)).astype(np.float32)
    v = rng.standard_normal((2, 256, 5)).astype(np.float32)
    mask = np.where(rng.random((65, 256)) > 0.3, rng.standard_normal((65, 256)), -np.inf)
    attn, scores = ca.attention(q, k, v, causal=True, mask=mask, return_scores=True)
    assert_matches_reference(attn, scores, q, k, v, True, mask)
    assert_matches_reference(ca.attention(q, k, v, causal=True, mask=mask), None,
                             q, k, v, True, mask)


#: (batch, queries, keys, options) whose rows take hundreds of key blocks
#: or steps: the packed path, with SCORES, and the direct path in one chunk
#: (16 entries: no split) and in 2 chunks of 32,768 keys
LONG_ROWS = {
    "packed": (2, 64, 40_000, {}),
    "packed-causal": (1, 100, 40_000, {"causal": True}),
    "scores": (1, 64, 40_000, {"return_scores": True}),
    "direct": (16, 8, 16_384, {}),
    "direct-split": (8, 8, 65_536, {}),
}


@pytest.mark.parametrize("case", LONG_ROWS)
def test_long_rows_stay_near_numpy(simd, case):
    """Adding each key block's sum to one running float32 sum per row (and
    its P.V to one accumulator) leaned one way block after block: at 512
    steps of 32 keys ATTN had 4.4x NumPy's RMS error, at 40,000 keys of
    packed blocks 1.9x (inside the tolerance rule only by its two-ulp
    term). The rows' state now folds into totals (fold_period): 0.44-0.97x.
    So besides the rule, the RMS error must be within 1.5x NumPy's, with no
    ulp term (NumPy's error on these rows is itself a few ulps). V has mean
    1, so that a bias in a row's sum shows in each of its outputs."""
    batch, n_queries, n_keys, options = LONG_ROWS[case]
    rng = np.random.default_rng(17)
    d = 16
    q = rng.standard_normal((batch, n_queries, d), dtype=np.float32)
    k = rng.standard_normal((batch, n_keys, d), dtype=np.float32)
    v = rng.standard_normal((batch, n_keys, d), dtype=np.float32) + 1
    causal = options.get("causal", False)
    result = ca.attention(q, k, v, **options)
    attn, scores = result if isinstance(result, tuple) else (result, None)
    assert_matches_reference(attn, scores, q, k, v, causal)
    ref = reference_attention(q, k, v, causal)[0]
    numpy_rms = rms_err(numpy_attention_f32(q, k, v, causal)[0], ref)
    assert rms_err(attn, ref) <= 1.5 * numpy_rms, (
        f"ATTN RMS error {rms_err(attn, ref):.3g} > 1.5 x NumPy's {numpy_rms:.3g}")


#: properties whose tolerances are float32's or float64's (bfloat16 results
#: are checked by test_matches_reference and the bitwise properties)
FLOATS = [np.float32, np.float64]


@given(problems(dtypes=FLOATS))
def test_scores_are_a_distribution_and_attn_is_scores_times_v(problem):
    q, k, v, causal, mask = problem
    attn, scores = ca.attention(q, k, v, causal=causal, mask=mask, return_scores=True)
    T, S = q.shape[-2], k.shape[-2]
    visible = np.broadcast_to(visible_positions(T, S, causal, mask), scores.shape)
    assert np.all(scores >= 0)
    assert np.all(scores[~visible] == 0)
    sums = scores.sum(axis=-1)
    any_visible = visible.any(axis=-1)
    tol = 1e-5 if q.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(sums[any_visible], 1, rtol=0, atol=tol)
    assert np.all(sums[~any_visible] == 0)
    expected = scores.astype(np.float64) @ v.astype(np.float64)
    np.testing.assert_allclose(attn, expected, rtol=0, atol=10 * tol)


@given(problems(), st.data())
def test_bitwise_across_layouts_and_threads(problem, data):
    q, k, v, causal, mask = problem
    reference = ca.attention(q, k, v, causal=causal, mask=mask, return_scores=True)
    rng = np.random.default_rng(0)
    which = data.draw(st.sampled_from(["q", "k", "v"]))
    arrays = {"q": q, "k": k, "v": v}
    for alternative in layouts(arrays[which], rng):
        args = dict(arrays, **{which: alternative})
        got = ca.attention(args["q"], args["k"], args["v"], causal=causal, mask=mask,
                           return_scores=True)
        assert_bitwise_equal(got[0], reference[0])
        assert_bitwise_equal(got[1], reference[1])
    threads = data.draw(st.sampled_from([1, 2, 3]))
    got = ca.attention(q, k, v, causal=causal, mask=mask, return_scores=True,
                       num_threads=threads)
    assert_bitwise_equal(got[0], reference[0])


@given(problems(allow_empty=False, dtypes=FLOATS))
def test_adding_a_vector_to_every_key_changes_nothing(problem):
    """q.(k_j + c) = q.k_j + q.c: a per-row constant the softmax removes."""
    q, k, v, causal, mask = problem
    rng = np.random.default_rng(1)
    shift = rng.standard_normal(k.shape[-1]).astype(k.dtype)
    shifted = k + shift          # rounded in the input dtype, as any caller's
    got = ca.attention(q, shifted, v, causal=causal, mask=mask)
    exact, _ = reference_attention(q, k, v, causal, mask)
    # the yardstick: plain NumPy in the same dtype on the same shifted keys,
    # whose rounding moves the logits too
    yardstick, _ = (numpy_attention_f32 if q.dtype == np.float32 else reference_attention)(
        q, shifted, v, causal, mask)
    atol = float32_ulp_atol(v) if q.dtype == np.float32 else 1e-12
    assert rms_err(got, exact) <= 2 * rms_err(yardstick, exact) + atol
    assert max_abs_err(got, exact) <= 4 * max_abs_err(yardstick, exact) + atol


@given(problems(allow_empty=False))
def test_permuting_the_batch_permutes_the_output(problem):
    q, k, v, causal, mask = problem
    if q.ndim < 3 or q.shape[0] < 2:
        return
    order = np.arange(q.shape[0])[::-1]
    out = ca.attention(q, k, v, causal=causal, mask=mask)
    assert_bitwise_equal(ca.attention(q[order], k[order], v[order], causal=causal,
                                      mask=mask), out[order])


@given(problems(allow_empty=False), st.sampled_from([np.nan, np.inf, -np.inf]))
def test_nan_in_never_attended_keys_and_values_has_no_effect(problem, bad):
    q, k, v, causal, mask = problem
    T, S = q.shape[-2], k.shape[-2]
    visible = visible_positions(T, S, causal, mask)
    never = ~np.broadcast_to(visible, (T, S)).any(axis=0)
    if not never.any():
        return
    k_dirty, v_dirty = k.copy(), v.copy()
    k_dirty[..., never, :] = bad
    v_dirty[..., never, :] = bad
    clean = ca.attention(q, k, v, causal=causal, mask=mask, return_scores=True)
    dirty = ca.attention(q, k_dirty, v_dirty, causal=causal, mask=mask, return_scores=True)
    assert_bitwise_equal(dirty[0], clean[0])
    assert_bitwise_equal(dirty[1], clean[1])


@given(problems(), st.data())
def test_query_offset_matches_reference(problem, data):
    """Rows placed anywhere against the keys (before them, inside, past
    them), one offset per batch entry, with a window or none."""
    q, k, v, causal, mask = problem
    T, S = q.shape[-2], k.shape[-2]
    batch = q.shape[:-2]
    n = int(np.prod(batch))
    drawn = data.draw(st.lists(st.integers(-T - 3, S + 3), min_size=n, max_size=n))
    offsets = np.array(drawn).reshape(batch) if batch else drawn[0]
    window = data.draw(st.sampled_from([None, (3, None), (0, 2), (17, 5)]))
    check = (assert_matches_reference if q.dtype in (np.float32, np.float64)
             else assert_bfloat16_matches_reference)
    attn, scores = ca.attention(q, k, v, causal=causal, mask=mask, window=window,
                                query_offset=offsets, return_scores=True)
    check(attn, scores, q, k, v, causal, mask, window=window, query_offset=offsets)
