"""Independent NumPy references for scaled dot-product attention, and test helpers.

Nothing in this module imports or calls ``cattention``: it is the yardstick the
library is measured against.

* :func:`reference_attention` is the float64 ground truth.  It is done densely:
  the full ``(..., T, S)`` logit matrix is built, invisible positions are set
  to ``-inf`` explicitly, the softmax subtracts the row maximum, and rows that
  see no key at all are defined to be zero (never NaN).
* :func:`numpy_attention_f32` is the same formula done plainly in float32.  Its
  error against the float64 reference is the yardstick of the tolerance rule
  for float32 results (see :func:`assert_matches_reference`).
"""

import re

import numpy as np

__all__ = [
    "reference_attention",
    "reference_attention_lse",
    "reference_lse",
    "numpy_attention_f32",
    "reference_rotary",
    "visible_positions",
    "max_abs_err",
    "assert_matches_reference",
    "assert_bitwise_equal",
    "assert_bfloat16_matches_reference",
    "assert_level_matches_reference",
    "LEVEL_WEIGHT_ERROR",
    "make_qkv",
    "FP8_MAX",
    "saturated_fp8_codes",
    "shapes_regex",
    "F32_ABS_CAP",
    "F32_RTOL_RMS",
    "F32_RTOL_MAX",
    "float32_ulp_atol",
    "rms_err",
    "F64_ABS_TOL",
]

# ---------------------------------------------------------------------------
# Tolerance rule constants
# ---------------------------------------------------------------------------

#: float32 results must be within this absolute error of the float64
#: reference on unit-scale (standard normal) data.
F32_ABS_CAP = 1e-5

#: The float32 rule.  "Within 2x the error of a plain float32 NumPy
#: implementation" (FlashAttention's yardstick) is applied to the RMS error,
#: the error of the method as a whole; the worst element must be within 4x
#: NumPy's worst element; both allow two float32 ulps at the output's
#: magnitude (for ATTN, whose elements combine rows of V, the worst element
#: gets two ulps at the magnitude of V, and the RMS those divided by the
#: square root of the number of elements, since the RMS of a handful of
#: rounding errors is itself noisy), and the worst element is also capped at
#: ``F32_ABS_CAP``.
#:
#: Why not 2x on the maximum alone: at parity with NumPy (median ratio 1.0
#: over 300 random seeds per shape), the ratio of two maxima of rounding noise
#: over a few hundred elements has a 99th percentile of 2.0-2.8, so a 2x
#: rule on maxima fails about 1% of correct results, while RMS ratios sit at
#: 0.6-0.8.  The ulp term keeps tiny outputs (4 elements, NumPy exact by luck)
#: from demanding bit-exactness, as flash-attention's ``fwd_atol`` does.
F32_RTOL_RMS = 2.0
F32_RTOL_MAX = 4.0


def float32_ulp_atol(ref):
    """Two float32 ulps at the largest finite magnitude of the reference (a
    NaN or inf in it, e.g. in a value the padding hides, has no magnitude)."""
    ref = np.asarray(ref, dtype=np.float64)
    finite = ref[np.isfinite(ref)]
    if finite.size == 0:
        return 0.0
    return 2.0 * float(np.spacing(np.float32(np.max(np.abs(finite)))))


def _logit_ulp_atol(q, k, scale, ref_scores):
    """Two float32 ulps of the largest scaled logit |scale * q.k|, times the
    largest weight: what one rounding of each logit moves a softmax weight."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    ref_scores = np.asarray(ref_scores, dtype=np.float64)
    if q.size == 0 or k.size == 0 or ref_scores.size == 0:
        return 0.0
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    logits = np.matmul(q, np.swapaxes(k, -1, -2))
    largest_logit = abs(float(scale)) * float(np.max(np.abs(logits)))
    return 2.0 * float(np.spacing(np.float32(largest_logit))) * float(np.max(np.abs(ref_scores)))


def _logit_sum_ulp_atol(q, k, scale):
    """Two float32 ulps of the largest |scale| * sum_c |q_c k_c|: the
    magnitude a logit's partial sums reach, and so the rounding scale of a
    float32 logit, which cancellation can leave far below it (an LSE is a
    logit plus the log of a sum: with one visible key, the logit itself)."""
    q = np.abs(np.asarray(q, dtype=np.float64))
    k = np.abs(np.asarray(k, dtype=np.float64))
    if q.size == 0 or k.size == 0:
        return 0.0
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    largest = abs(float(scale)) * float(np.max(np.matmul(q, np.swapaxes(k, -1, -2))))
    return 2.0 * float(np.spacing(np.float32(largest)))


def rms_err(a, b):
    """Root-mean-square difference computed in float64 (0 for empty arrays)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size == 0:
        return 0.0
    return float(np.sqrt(np.mean((a - b) ** 2)))


#: float64 results must be within this absolute error of the reference
#: (outputs are O(1) for unit-scale data: SCORES in [0, 1], ATTN a convex
#: combination of standard normal values).
F64_ABS_TOL = 1e-12


# ---------------------------------------------------------------------------
# Reference implementation
# ---------------------------------------------------------------------------

def _as_compute_dtype(x, dtype):
    # C order whatever the caller's layout: np.matmul rounds a strided
    # float32 operand in its own loops, less accurately than the BLAS it
    # uses on contiguous ones, which would loosen the float32 yardstick
    x = np.asarray(x)
    if x.dtype.kind not in "biuf":
        raise TypeError(f"reference: unsupported dtype {x.dtype}")
    return x.astype(dtype, order="C")


def _batch_shape(q, k, v, mask):
    mask_batch = ()
    if mask is not None and np.ndim(mask) > 2:
        mask_batch = np.shape(mask)[:-2]
    return np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], mask_batch)


def visible_positions(T, S, causal=False, mask=None):
    """Boolean array (broadcastable to ``(..., T, S)``): may query t see key s?

    A float mask hides exactly the positions where it is ``-inf``.
    """
    visible = np.ones((T, S), dtype=bool)
    if causal:
        i = np.arange(T)[:, None]
        j = np.arange(S)[None, :]
        visible = j <= i + (S - T)  # bottom-right alignment
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            visible = visible & mask
        else:
            visible = visible & (mask != -np.inf)
    return visible


def _positions(batch, T, S, kv_lengths, query_offset=None):
    """(n_valid, pos): the valid key count of every batch entry, shape batch +
    (1, 1), and the key position of every query row, shape batch + (T, 1):
    bottom-right alignment, the queries are the last T of the valid keys;
    or, with query_offset, row t at position query_offset + t."""
    n_valid = np.broadcast_to(S if kv_lengths is None else np.asarray(kv_lengths),
                              batch).astype(np.int64)[..., None, None]
    if query_offset is None:
        pos = np.arange(T)[:, None] + (n_valid - T)
    else:
        # Python ints: positions near 2**62 plus a window must not wrap
        first = np.broadcast_to(np.asarray(query_offset, dtype=object), batch)[..., None, None]
        pos = np.arange(T).astype(object)[:, None] + first
    return n_valid, pos


def _visible_and_bias(batch, T, S, causal, mask, kv_lengths, window, alibi_slopes,
                      kv_starts=None, query_offset=None):
    """Visibility (batch + (T, S) bool) and the additive ALiBi term (float64
    or None), written out explicitly for every option."""
    n_valid, pos = _positions(batch, T, S, kv_lengths, query_offset)
    j = np.arange(S)[None, :]
    visible = np.broadcast_to(j < n_valid, batch + (T, S))
    if kv_starts is not None:
        # left padding: keys before the start do not exist; positions stay
        # those of the end of the valid range
        first = np.broadcast_to(np.asarray(kv_starts), batch).astype(np.int64)[..., None, None]
        visible = visible & (j >= first)
    if causal:
        visible = visible & (j <= pos)
    if window is not None:
        left, right = window
        if causal:
            right = 0
        if left is not None:
            visible = visible & (j >= pos - left)
        if right is not None:
            visible = visible & (j <= pos + right)
    if mask is not None:
        mask = np.asarray(mask)
        visible = visible & (mask if mask.dtype == np.bool_ else mask != -np.inf)
    alibi = None
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64), batch)
        alibi = -slopes[..., None, None] * np.abs(pos - j).astype(np.float64)
    visible = np.asarray(visible, dtype=bool)
    return np.broadcast_to(visible, batch + (T, S)), alibi


def _attention(q, k, v, causal, mask, scale, dtype, kv_lengths=None, window=None,
               softcap=None, alibi_slopes=None, sinks=None, kv_starts=None,
               query_offset=None):
    """(attn, scores, lse) in dtype. Per logit: scale * q.k, softcap, + ALiBi,
    + additive mask; keys outside causal / window / kv_lengths / bool mask
    take no part; a sink joins each row's softmax as one more logit with no
    value; a row that sees no key is zero (lse -inf, or the sink)."""
    q = _as_compute_dtype(q, dtype)
    k = _as_compute_dtype(k, dtype)
    v = _as_compute_dtype(v, dtype)
    if min(q.ndim, k.ndim, v.ndim) < 2:
        raise ValueError("reference: q, k, v need at least 2 dimensions")
    T, d_k = q.shape[-2:]
    S = k.shape[-2]
    d_v = v.shape[-1]
    if k.shape[-1] != d_k or v.shape[-2] != S:
        raise ValueError("reference: inconsistent shapes")
    if scale is None:
        if d_k == 0:
            raise ValueError("reference: d_k == 0 needs an explicit scale")
        scale = 1.0 / np.sqrt(d_k)
    scale = dtype(scale)

    batch = _batch_shape(q, k, v, mask)
    for option in (kv_lengths, alibi_slopes, sinks, kv_starts, query_offset):
        if option is not None:
            batch = np.broadcast_shapes(batch, np.shape(option))
    q = np.broadcast_to(q, batch + (T, d_k))
    k = np.broadcast_to(k, batch + (S, d_k))
    v = np.broadcast_to(v, batch + (S, d_v))

    visible, alibi = _visible_and_bias(batch, T, S, causal, mask, kv_lengths, window,
                                       alibi_slopes, kv_starts, query_offset)
    additive = None
    if mask is not None and np.asarray(mask).dtype != np.bool_:
        additive = np.asarray(mask).astype(dtype)

    with np.errstate(all="ignore"):
        logits = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
        if softcap is not None:
            logits = dtype(softcap) * np.tanh(logits / dtype(softcap))
        if alibi is not None:
            logits = logits + alibi.astype(dtype)
        if additive is not None:
            logits = logits + additive
        # Explicit -inf masking: also wipes NaN/Inf coming from masked keys.
        logits = np.where(visible, logits, dtype(-np.inf))

        row_any = visible.any(axis=-1, keepdims=True)
        row_max = logits.max(axis=-1, keepdims=True, initial=-np.inf)
        sink = None
        if sinks is not None:
            sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64),
                                   batch)[..., None, None].astype(dtype)
            sink = np.broadcast_to(sink, row_max.shape)
            row_max = np.maximum(row_max, sink)
        # the row's (finite) shift, 0 where it has nothing at all
        has_any = row_any if sink is None else row_any | (sink != -np.inf)
        row_max = np.where(has_any, row_max, dtype(0))
        e = np.where(visible, np.exp(logits - row_max), dtype(0))
        denom = e.sum(axis=-1, keepdims=True, dtype=dtype)
        if sink is not None:
            denom = denom + np.exp(sink - row_max)
        lse = np.where(has_any, row_max + np.log(np.where(has_any, denom, 1)),
                       -np.inf)[..., 0].astype(dtype)
        denom = np.where(row_any, denom, dtype(1))
        scores = np.where(row_any, e / denom, dtype(0)).astype(dtype)

        if np.all(np.isfinite(v)):
            attn = np.matmul(scores, v)
        else:
            # Non-finite values in V: contract over visible keys only, so a
            # NaN in a masked-out value cannot leak through 0 * NaN.
            attn = np.zeros(batch + (T, d_v), dtype=dtype)
            for idx in np.ndindex(*batch):
                for t in range(T):
                    sel = visible[idx + (t,)]
                    attn[idx + (t,)] = scores[idx + (t,)][sel] @ v[idx][sel]
    return attn.astype(dtype), scores, lse


def reference_lse(q, k, causal=False, mask=None, scale=None, **options):
    """float64 log-sum-exp of each row's scaled, masked logits (-inf for a
    row that sees no key); options as for :func:`reference_attention`."""
    q = np.asarray(q)
    v = np.zeros(np.shape(k)[:-1] + (1,))
    return _attention(q, k, v, causal, mask, scale, np.float64, **options)[2]


def reference_attention(q, k, v, causal=False, mask=None, scale=None, **options):
    """float64 ground truth.  Returns ``(attn, scores)``, both float64.

    ``options``: ``kv_lengths``, ``kv_starts`` and ``query_offset``
    (broadcastable to the batch shape), ``window`` ((left, right), None for
    unbounded), ``softcap``, ``alibi_slopes`` and ``sinks`` (broadcastable to
    the batch shape), with the semantics of ``cattention.attention``."""
    return _attention(q, k, v, causal, mask, scale, np.float64, **options)[:2]


def reference_attention_lse(q, k, v, causal=False, mask=None, scale=None, **options):
    """float64 ``(attn, scores, lse)``."""
    return _attention(q, k, v, causal, mask, scale, np.float64, **options)


def numpy_attention_f32(q, k, v, causal=False, mask=None, scale=None, **options):
    """The same formula done plainly in float32.  Returns ``(attn, scores)``."""
    return _attention(q, k, v, causal, mask, scale, np.float32, **options)[:2]


def reference_rotary(x, cos, sin, positions, interleaved=False):
    """float64 rotary position embedding of x (..., d) at ``positions``
    (broadcastable to x.shape[:-1]): each rotated pair of features is a
    complex number multiplied by ``cos[p] + 1j * sin[p]`` (the rotation by
    the angle of position p), the pair being features (i, i + r/2)
    (GPT-NeoX) or (2i, 2i + 1) (interleaved, GPT-J) of the first
    ``r = 2 * cos.shape[1]``; the other features stay."""
    x = np.array(x, dtype=np.float64)
    cos = np.asarray(cos, dtype=np.float64)
    sin = np.asarray(sin, dtype=np.float64)
    half = cos.shape[1]
    at = np.broadcast_to(np.asarray(positions), x.shape[:-1])
    turn = cos[at] + 1j * sin[at]
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    pairs = (x[..., first] + 1j * x[..., second]) * turn
    x[..., first] = pairs.real
    x[..., second] = pairs.imag
    return x


# ---------------------------------------------------------------------------
# Helpers for tests (still no cattention in here)
# ---------------------------------------------------------------------------

def max_abs_err(a, b):
    """Max absolute difference computed in float64 (0 for empty arrays)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)))


def assert_matches_reference(attn, scores, q, k, v, causal=False, mask=None,
                             scale=None, f32_abs_cap=F32_ABS_CAP,
                             f64_abs_tol=F64_ABS_TOL, lse=None, **options):
    """Apply the tolerance rule to ATTN, to SCORES and to LSE (``scores`` and
    ``lse`` may be None), for any option of :func:`reference_attention`.

    float32: RMS error ``<= 2 *`` that of plain float32 NumPy, max error
    ``<= 4 *`` NumPy's, each ``+ float32_ulp_atol(ref)`` (the max error of
    ATTN also allows the rounding scale of V, that of SCORES the rounding of
    the largest logit times the largest weight); and max error
    ``<= f32_abs_cap``
    (pass ``f32_abs_cap=None`` for data that is deliberately not unit scale).
    float64: ``err <= f64_abs_tol``. LSE: ``-inf`` exactly where the
    reference's is, the rule on the finite entries, its ulp term at least
    that of the logits' partial sums (``_logit_sum_ulp_atol``).
    """
    ref_attn, ref_scores, ref_lse = _attention(q, k, v, causal, mask, scale, np.float64,
                                               **options)
    pairs = [("ATTN", attn, ref_attn, 0)]
    if scores is not None:
        pairs.append(("SCORES", scores, ref_scores, 1))
    if lse is not None:
        lse = np.asarray(lse)
        assert lse.shape == ref_lse.shape, f"LSE shape {lse.shape} != {ref_lse.shape}"
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        finite = np.isfinite(ref_lse)
        pairs.append(("LSE", lse[finite], ref_lse[finite], 2))

    dtype = np.asarray(attn).dtype
    if dtype == np.float32:
        np32 = _attention(q, k, v, causal, mask, scale, np.float32, **options)
        if lse is not None:
            np32 = (np32[0], np32[1], np32[2][np.isfinite(ref_lse)])
    for name, got, ref, i in pairs:
        got = np.asarray(got)
        assert got.dtype == dtype, f"{name} dtype {got.dtype} != ATTN dtype {dtype}"
        assert got.shape == ref.shape, f"{name} shape {got.shape} != {ref.shape}"
        assert np.all(np.isfinite(got)), f"{name} has non-finite values"
        err = max_abs_err(got, ref)
        if dtype == np.float32:
            atol = float32_ulp_atol(ref)
            rms, np_rms = rms_err(got, ref), rms_err(np32[i], ref)
            # with few elements the RMS is itself noisy: allow the rounding
            # scale of V (whose rows ATTN combines) divided by sqrt(n)
            if i == 2:
                # each LSE carries the rounding of its logits
                atol = max(atol, _logit_sum_ulp_atol(q, k, scale))
            rms_atol = atol
            if i == 0 and got.size:
                rms_atol += float32_ulp_atol(v) / np.sqrt(got.size)
            assert rms <= F32_RTOL_RMS * np_rms + rms_atol, (
                f"{name}: float32 RMS error {rms:.3g} > 2 x NumPy float32 RMS "
                f"error {np_rms:.3g} + {rms_atol:.3g}")
            np_err = max_abs_err(np32[i], ref)
            # ATTN combines rows of V: rounding errors scale with |V|, which
            # can be far above |ATTN| when many keys average out
            atol_max = max(atol, float32_ulp_atol(v)) if i == 0 else atol
            if i == 1:
                # a weight e^(s - max) / sum carries the rounding of its
                # logit s, relative to the weight: two ulps of the largest
                # logit times the largest weight (NumPy, which rounds its
                # logits too, can be exact by luck on a handful of them)
                atol_max = max(atol_max, _logit_ulp_atol(q, k, scale, ref))
            assert err <= F32_RTOL_MAX * np_err + atol_max, (
                f"{name}: float32 max error {err:.3g} > 4 x NumPy float32 max "
                f"error {np_err:.3g} + {atol_max:.3g}")
            if f32_abs_cap is not None:
                assert err <= f32_abs_cap, (
                    f"{name}: float32 error {err:.3g} > {f32_abs_cap:g}")
        elif dtype == np.float64:
            assert err <= f64_abs_tol, (
                f"{name}: float64 error {err:.3g} > {f64_abs_tol:g}")
        else:
            raise AssertionError(f"unexpected result dtype {dtype}")


def assert_bfloat16_matches_reference(attn, scores, q, k, v, causal=False, mask=None,
                                      scale=None, lse=None, **options):
    """bfloat16 results (ATTN, SCORES; either may be None) are each one
    rounding, to nearest even, of a float32 result that meets the float32
    rule against the float64 reference of the upcast inputs: every element
    lies between the bfloat16 roundings of ``ref - e`` and ``ref + e``, with
    e the float32 rule's allowed max error (4 x plain float32 NumPy's plus
    two float32 ulps); the float32 LSE meets that max error itself."""
    import ml_dtypes
    _assert_rounded_matches_reference(np.dtype(ml_dtypes.bfloat16), attn, scores, q, k, v,
                                      causal, mask, scale, lse, **options)


def assert_half_matches_reference(attn, scores, q, k, v, causal=False, mask=None,
                                  scale=None, lse=None, **options):
    """The rule of assert_bfloat16_matches_reference for results of either
    16-bit float dtype, bfloat16 or float16 (the dtype of ``attn``)."""
    _assert_rounded_matches_reference(np.asarray(attn).dtype, attn, scores, q, k, v, causal,
                                      mask, scale, lse, **options)


#: The precision levels of a 16-bit result and the relative error each
#: allows a weight of P in P.V before the one rounding (the conditioning
#: term ``LEVEL_WEIGHT_ERROR * sum_j w_j |v_j|``): none beyond the float32
#: rule at "highest"; 2^-15 at "high" (two bfloat16 parts of P hold a
#: weight to 2^-16, and as much again for a cheaper exp); bfloat16's unit
#: roundoff 2^-8 at "medium" (P rounded once to bfloat16).
LEVEL_WEIGHT_ERROR = {"highest": 0.0, "high": 2.0 ** -15, "medium": 2.0 ** -8}


def assert_level_matches_reference(attn, q, k, v, precision, causal=False, mask=None,
                                   scale=None, **options):
    """The rule of a 16-bit ATTN (bfloat16 or float16, the dtype of attn) at
    a precision level, against the float64 reference of the upcast inputs.
    With ``e`` the float32 rule's allowed max error (as in
    assert_bfloat16_matches_reference) and ``c = LEVEL_WEIGHT_ERROR[level] *
    sum_j w_j |v_j|`` (the reference's weights times |V|: the conditioning
    of a weighted sum whose weights are each that close):

    * "highest": each element is a rounding to nearest of a value within
      ``e`` of the reference (between the roundings of ``ref - e`` and
      ``ref + e``);
    * "high": faithful: each element is one of the two neighbours of a value
      within ``e + c`` of the reference (between the roundings down of
      ``ref - e - c`` and up of ``ref + e + c``);
    * "medium": a rounding to nearest of a value within ``e + c``."""
    import ml_dtypes
    half = np.asarray(attn).dtype
    assert half in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)), half
    up = [np.asarray(x).astype(np.float32) if np.asarray(x).dtype == half else x
          for x in (q, k, v)]
    mask = (np.asarray(mask).astype(np.float32)
            if mask is not None and np.asarray(mask).dtype == half else mask)
    ref = _attention(*up, causal, mask, scale, np.float64, **options)[0]
    np32 = _attention(*up, causal, mask, scale, np.float32, **options)[0]
    weighted_abs = _attention(up[0], up[1], np.abs(np.asarray(up[2], dtype=np.float64)),
                              causal, mask, scale, np.float64, **options)[0]
    e = (F32_RTOL_MAX * max_abs_err(np32, ref)
         + max(float32_ulp_atol(ref), float32_ulp_atol(up[2])))
    bound = e + LEVEL_WEIGHT_ERROR[precision] * weighted_abs
    got = np.asarray(attn)
    assert got.shape == ref.shape, f"ATTN shape {got.shape} != {ref.shape}"
    got64, outside = _outside_roundings(got, ref, bound, half, faithful=precision == "high")
    assert not outside.any(), (
        f"precision={precision!r}: {int(outside.sum())} of {got.size} {half} values "
        f"outside the level's rule (max error {max_abs_err(got64, ref):.3g}, float32 "
        f"rule {e:.3g}, conditioning term up to {float(np.max(bound - e, initial=0)):.3g})")


def _outside_roundings(got, ref, e, half, faithful=False):
    """got as float64, and where it is no rounding to dtype half of a value
    within e of ref: to nearest (between the roundings of ref - e and
    ref + e) or, faithful, to either neighbour (between the roundings down
    of ref - e and up of ref + e)."""
    if faithful:
        low, high = _round_down(ref - e, half), _round_up(ref + e, half)
    else:
        low = (ref - e).astype(half).astype(np.float64)
        high = (ref + e).astype(half).astype(np.float64)
    got64 = np.asarray(got).astype(np.float64)
    return got64, ~((low <= got64) & (got64 <= high))


def _round_down(x, half):
    """The largest value of dtype half at or below each float64 x."""
    nearest = x.astype(half)
    below = nearest.astype(np.float64) > x
    nearest[below] = np.nextafter(nearest[below], np.array(-np.inf, half))
    return nearest.astype(np.float64)


def _round_up(x, half):
    """The smallest value of dtype half at or above each float64 x."""
    nearest = x.astype(half)
    above = nearest.astype(np.float64) < x
    nearest[above] = np.nextafter(nearest[above], np.array(np.inf, half))
    return nearest.astype(np.float64)


def _assert_rounded_matches_reference(half, attn, scores, q, k, v, causal, mask, scale, lse,
                                      **options):
    import ml_dtypes
    assert half in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)), (
        f"{half} is not a 16-bit float dtype")

    def upcast(x):
        x = np.asarray(x)
        return x.astype(np.float32) if x.dtype in (ml_dtypes.bfloat16, np.float16) else x

    q, k, v = upcast(q), upcast(k), upcast(v)
    mask = upcast(mask) if mask is not None else None
    ref = _attention(q, k, v, causal, mask, scale, np.float64, **options)
    np32 = _attention(q, k, v, causal, mask, scale, np.float32, **options)
    for i, (name, got) in enumerate((("ATTN", attn), ("SCORES", scores))):
        if got is None:
            continue
        got = np.asarray(got)
        assert got.dtype == half, f"{name} dtype {got.dtype} is not {half}"
        assert got.shape == ref[i].shape, f"{name} shape {got.shape} != {ref[i].shape}"
        atol = max(float32_ulp_atol(ref[i]), float32_ulp_atol(v) if i == 0 else 0.0)
        if i == 1:
            atol = max(atol, _logit_ulp_atol(q, k, scale, ref[i]))
        e = F32_RTOL_MAX * max_abs_err(np32[i], ref[i]) + atol
        got64, outside = _outside_roundings(got, ref[i], e, half)
        assert not outside.any(), (
            f"{name}: {int(outside.sum())} of {got.size} {half} values are no rounding "
            f"of a float32 result within {e:.3g} of the reference (max error "
            f"{max_abs_err(got64, ref[i]):.3g})")
    if lse is not None:
        lse = np.asarray(lse)
        assert lse.dtype == np.float32, f"LSE dtype {lse.dtype} is not float32"
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref[2]))
        finite = np.isfinite(ref[2])
        e = F32_RTOL_MAX * max_abs_err(np32[2][finite], ref[2][finite]) + max(
            float32_ulp_atol(ref[2][finite]), _logit_sum_ulp_atol(q, k, scale))
        assert max_abs_err(lse[finite], ref[2][finite]) <= e


def assert_bitwise_equal(actual, expected):
    """Same dtype, same shape, same bits (so -0.0 != 0.0 and NaN == same NaN)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a = np.ascontiguousarray(actual).view(np.uint8)
    b = np.ascontiguousarray(expected).view(np.uint8)
    if not np.array_equal(a, b):
        diff = np.asarray(actual != expected)
        raise AssertionError(
            f"arrays differ bitwise in {int(diff.sum())} of {actual.size} "
            f"elements (max abs diff {max_abs_err(actual, expected):.3g})")


#: the largest finite value of each fp8 format, by dtype name
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def saturated_fp8_codes(x, scale, fmt):
    """The fp8 codes of x with a scale (broadcast against x.shape[:-1]):
    x / scale computed in float32, saturated to [-fmax, fmax] (NaN stays
    NaN, +-inf becomes +-fmax), rounded to nearest even by ml_dtypes' cast
    to the format fmt."""
    fmax = np.float32(FP8_MAX[np.dtype(fmt).name])
    with np.errstate(all="ignore"):
        y = np.asarray(x).astype(np.float32) / np.asarray(scale, np.float32)[..., None]
    return np.clip(y, -fmax, fmax).astype(fmt)


def make_qkv(seed, q_shape, k_shape, v_shape, dtype=np.float64):
    """Seeded standard normal q, k, v of the given shapes and dtype."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype)
                 for shape in (q_shape, k_shape, v_shape))


def misaligned(array):
    """A copy of array one byte past an aligned address: misaligned for
    any itemsize above 1."""
    raw = np.zeros(array.nbytes + 1, np.uint8)
    view = raw[1:].view(array.dtype).reshape(array.shape)
    view[...] = array
    return view


def shapes_regex(*shapes):
    """Regex matching a message that mentions every given shape, e.g. '(3, 8)'."""
    return "(?s)" + "".join(
        f"(?=.*{re.escape(str(tuple(s)))})" for s in shapes)
