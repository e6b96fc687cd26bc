"""quantize_kv_fp8 (ml_dtypes.float8_e4m3fn and float8_e5m2) against the
quantization rule written out in NumPy (fp8_rules.py): computed scales per
row, head and tensor, their error bound, given scales saturating, the
rounding bit for bit ml_dtypes' cast, the scales going into attention, and
the errors."""

import re

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

import cattention as ca  # noqa: E402
from reference import assert_matches_reference  # noqa: E402
from reference import saturated_fp8_codes as saturated_codes  # noqa: E402
from fp8_rules import (E4M3, F32_MAX, FMAX, FORMATS, MANTISSA_EMIN, SCALE_BOUND,  # noqa: E402
                       dequantize, finite_codes, quantize_reference, repeat_kv)


# ---- quantize_kv_fp8 --------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["row", "head", "tensor"])
@pytest.mark.parametrize("x_dtype", [np.float32, np.float64, np.float16], ids=str)
def test_quantize_kv_fp8_computed_scales(fmt, mode, x_dtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 5, 17)) * np.array([1, 10, 0.01])[:, None, None, None]
    x[1, 0, 2] = 0.0                                       # an all-zero row
    x[2, 1] = 0.0                                          # an all-zero head
    x = x.astype(x_dtype)
    codes, scale = ca.quantize_kv_fp8(x, dtype=fmt.name, scale=mode)
    want_codes, want_scale = quantize_reference(x, fmt, mode)
    assert codes.dtype == fmt and codes.shape == x.shape
    assert isinstance(scale, np.ndarray) and scale.dtype == np.float32
    assert scale.shape == {"row": (3, 2, 5), "head": (3, 2, 1), "tensor": ()}[mode]
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(codes.view(np.uint8), want_codes.view(np.uint8))
    values = np.abs(codes.astype(np.float64))
    if mode == "row":
        assert scale[1, 0, 2] == 0 and not values[1, 0, 2].any()
        nonzero = scale > 0
        # every row reaches +-fmax at its largest magnitude
        assert np.all(values.max(axis=-1)[nonzero] == FMAX[fmt])
    elif mode == "head":
        assert scale[2, 1, 0] == 0 and not values[2, 1].any()
        assert np.all(values.max(axis=(-2, -1))[scale[..., 0] > 0] == FMAX[fmt])
    else:
        assert values.max() == FMAX[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["row", "head", "tensor"])
def test_quantize_kv_fp8_error_bound(fmt, mode):
    """|x - code * scale| is at most half a step: |x| / 2^(m+1) for normal
    codes, scale * 2^(emin-m-1) in the subnormal range, plus the float32
    roundings of x and of x / scale."""
    rng = np.random.default_rng(2)
    x = rng.standard_t(3, size=(2, 4, 60, 33))
    # magnitudes from 1e-12 to 1: the subnormal codes of a head's or the tensor's scale
    x[0, 0, 1] = np.logspace(-12, 0, 33) * np.where(np.arange(33) % 2, 1, -1)
    x = x.astype(np.float32)
    codes, scale = ca.quantize_kv_fp8(x, dtype=fmt, scale=mode)
    m, emin = MANTISSA_EMIN[fmt]
    ax = np.abs(x.astype(np.float64))
    s = np.broadcast_to(np.asarray(scale, np.float64)[..., None], x.shape)
    eps = float(np.finfo(np.float32).eps)
    half_step = np.maximum(ax * 2.0 ** -(m + 1) * (1 + 2 * eps), s * 2.0 ** (emin - m - 1))
    bound = half_step + 2 * eps * ax
    err = np.abs(x - dequantize(codes, scale))
    assert np.all(err <= bound)
    # the subnormal range is reached (small values against a head's or the tensor's peak)
    if mode != "row":
        small = np.abs(codes.astype(np.float64))
        assert np.any((small > 0) & (small < 2.0 ** emin))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kv_fp8_takes_the_dtype_as_a_type_a_dtype_or_its_name(fmt):
    x = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)
    results = [ca.quantize_kv_fp8(x, dtype=spelling)
               for spelling in (fmt.type, fmt, fmt.name)]
    want_codes, want_scale = quantize_reference(x, fmt, "row")
    for codes, scale in results:
        assert codes.dtype == fmt
        np.testing.assert_array_equal(codes.view(np.uint8), want_codes.view(np.uint8))
        np.testing.assert_array_equal(scale, want_scale)


def test_quantize_kv_fp8_defaults_to_e4m3fn_per_row():
    x = np.random.default_rng(4).standard_normal((2, 3, 8)).astype(np.float32)
    codes, scale = ca.quantize_kv_fp8(x)
    want_codes, want_scale = quantize_reference(x, E4M3, "row")
    assert codes.dtype == E4M3
    np.testing.assert_array_equal(codes.view(np.uint8), want_codes.view(np.uint8))
    np.testing.assert_array_equal(scale, want_scale)


GIVEN_SCALES = {
    "float": 0.25,
    "float32": np.float32(0.5),
    "per entry and head": np.array([[[0.25], [2.0], [0.0625]], [[1.0], [0.5], [4.0]]],
                                   np.float32),
    "per row": np.linspace(0.05, 3, 30).reshape(2, 3, 5).astype(np.float32),
    "per head, broadcast": np.array([[0.5], [1.0], [0.125]], np.float32),    # (3, 1)
    "list": [[[0.5]], [[1.5]]],                                             # (2, 1, 1)
    "float64 per row": np.linspace(0.05, 3, 30).reshape(2, 3, 5),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("given", GIVEN_SCALES)
def test_quantize_kv_fp8_with_given_scales_saturates(fmt, given):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 5, 11)) * 30
    x[0, 0, 0, :4] = [1e30, -1e30, np.inf, -np.inf]       # beyond fmax: +-fmax
    x[1, 2, 4, 3] = np.nan                                 # NaN stays NaN
    x[0, 1, 3, :3] = [1e-3, -2e-4, 3e-6]                   # the subnormal range, or zero
    scale_in = GIVEN_SCALES[given]
    codes, scale = ca.quantize_kv_fp8(x, dtype=fmt, scale=scale_in)
    assert isinstance(scale, np.ndarray) and scale.dtype == np.float32
    assert scale.shape == np.shape(scale_in)
    np.testing.assert_array_equal(scale, np.asarray(scale_in, np.float32))
    want = saturated_codes(x, np.asarray(scale_in, np.float32), fmt)
    nan = np.isnan(want.astype(np.float32))
    assert nan.sum() == 1
    np.testing.assert_array_equal(np.isnan(codes.astype(np.float32)), nan)
    np.testing.assert_array_equal(codes.view(np.uint8)[~nan], want.view(np.uint8)[~nan])
    fmax = FMAX[fmt]
    np.testing.assert_array_equal(codes[0, 0, 0, :4].astype(np.float64),
                                  [fmax, -fmax, fmax, -fmax])


@pytest.mark.parametrize("mode", ["row", "head", "tensor"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_kv_fp8_refuses_non_finite_values_with_computed_scales(mode, bad):
    x = np.ones((2, 3, 4), np.float32)
    x[1, 2, 3] = bad
    with pytest.raises(ValueError, match=r"(?i)nan|infinite|finite"):
        ca.quantize_kv_fp8(x, scale=mode)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", ["negative", "nan", "inf", "beyond the bound", "shape"])
def test_quantize_kv_fp8_refuses_bad_scales(fmt, bad):
    x = np.ones((2, 3, 5, 4), np.float32)
    scale = {"negative": np.float32(-0.5), "nan": np.float32(np.nan), "inf": np.inf,
             "beyond the bound": np.float32(2 * SCALE_BOUND[fmt]),
             "shape": np.ones(4, np.float32)}[bad]
    with pytest.raises(ValueError, match="scale"):
        ca.quantize_kv_fp8(x, dtype=fmt, scale=scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("given", ["one scale", "a scale per row"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_quantize_kv_fp8_rounds_every_float32_as_ml_dtypes(fmt, given, scale):
    """Rounding to nearest even, bit for bit ml_dtypes' cast of the float32
    quotient: float32 values across every exponent (a bit pattern in 4099),
    every code's value, every midpoint between neighbouring codes and the
    floats either side of it, NaN of both signs, both zeros, and values
    beyond the range (saturated first); divided by one scale or by a scale
    per row (of the same value)."""
    every = np.arange(0, 2 ** 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = np.sort(finite_codes(fmt).view(fmt).astype(np.float32))
    midpoints = ((values[1:].astype(np.float64) + values[:-1]) / 2).astype(np.float32)
    x = np.concatenate([every, values, midpoints, np.nextafter(midpoints, np.float32(np.inf)),
                        np.nextafter(midpoints, np.float32(-np.inf)),
                        np.array([np.nan, -np.nan, 0.0, -0.0], np.float32)])
    divisor = np.float32(scale)
    scales = divisor if given == "one scale" else np.full(x.size, divisor)
    codes, _ = ca.quantize_kv_fp8(x[:, None], fmt, scale=scales)
    fmax = np.float32(FMAX[fmt])
    with np.errstate(invalid="ignore", over="ignore"):
        expected = np.clip(x / divisor, -fmax, fmax).astype(fmt)[:, None]
    np.testing.assert_array_equal(codes.view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kv_fp8_takes_a_scale_up_to_the_bound(fmt):
    """float32's largest value / fmax (as float32) is a scale: fmax codes
    times it stay finite in float32, and attention over them is finite."""
    bound = np.float32(SCALE_BOUND[fmt])
    assert np.isfinite(np.float32(FMAX[fmt]) * bound)
    x = np.full((1, 1, 4, 8), F32_MAX, np.float32)
    codes, scale = ca.quantize_kv_fp8(x, dtype=fmt, scale=bound)
    assert np.all(codes.astype(np.float64) == FMAX[fmt])
    # a row at float32's largest value, its scale computed
    k = np.ones((1, 1, 4, 8), np.float32)
    k[0, 0, 1, 3] = F32_MAX
    k_codes, k_scale = ca.quantize_kv_fp8(k, dtype=fmt)
    values = dequantize(k_codes, k_scale)
    assert np.all(np.isfinite(values.astype(np.float32)))
    assert values[0, 0, 1, 3] == pytest.approx(F32_MAX, rel=1e-6)
    for T in (1, 9):
        q = np.full((1, 1, T, 8), 1e-38, np.float32)
        v = np.arange(32, dtype=np.float32).reshape(1, 1, 4, 8)
        attn = ca.attention(q, k_codes, v, k_scale=k_scale, scale=1.0)
        assert_matches_reference(attn, None, q, values, v, scale=1.0)


@pytest.mark.parametrize("dtype,name", [
    ("float8_e4m3", "float8_e4m3"), (ml_dtypes.float8_e4m3fnuz, "float8_e4m3fnuz"),
    ("e4m3", "e4m3"), (np.int8, "int8"), ("float16", "float16"), (np.float32, "float32")])
def test_quantize_kv_fp8_refuses_other_dtypes(dtype, name):
    with pytest.raises((TypeError, ValueError),
                       match=rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"):
        ca.quantize_kv_fp8(np.ones((2, 4), np.float32), dtype=dtype)


@pytest.mark.parametrize("mode", ["rows", "per_tensor", ""])
def test_quantize_kv_fp8_refuses_other_scale_strings(mode):
    with pytest.raises(ValueError, match=rf"scale|'{mode}'"):
        ca.quantize_kv_fp8(np.ones((2, 4), np.float32), scale=mode)


@pytest.mark.parametrize("mode", ["row", "head", "tensor"])
def test_quantize_kv_fp8_scales_go_into_attention(mode):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 4, 3, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, 50, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 50, 8)).astype(np.float32)
    (k8, ks), (v8, vs) = (ca.quantize_kv_fp8(k, scale=mode),
                          ca.quantize_kv_fp8(v, dtype="float8_e5m2", scale=mode))
    attn = ca.attention(q, k8, v8, k_scale=ks, v_scale=vs, enable_gqa=True)
    assert_matches_reference(attn, None, q, repeat_kv(dequantize(k8, ks), 2),
                             repeat_kv(dequantize(v8, vs), 2))
