"""Fuzz harness for the public API.

Arbitrary bytes choose shapes, dtypes, layouts, masks and option values; the
call must either return a result of the right shape that matches the float64
reference (where the inputs allow one), or raise ValueError, TypeError or
MemoryError. Anything else (another exception, a crash under the sanitizers,
a hang) is a bug.

    python tools/fuzz_attention.py -max_total_time=60     # coverage-guided (atheris)
    make fuzz                                             # that search, then its corpus sanitized

``check_input(data)`` is importable without atheris; the test suite runs it on
a bounded set of pseudo-random inputs.
"""

import os
import sys

import numpy as np

# the float64 reference lives with the tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

import cattention as ca  # noqa: E402
from reference import reference_attention  # noqa: E402

# mostly valid choices, with a few invalid ones among them, so that most
# calls get through validation and into the kernels
DTYPES = [np.float32, np.float64, np.float32, np.float64, np.float16, np.int32, np.bool_,
          np.complex64]
ALLOWED = (ValueError, TypeError, MemoryError)


class Bytes:
    """Deterministic choices drawn from a byte string (zeros when exhausted)."""

    def __init__(self, data):
        self.data = data
        self.pos = 0

    def byte(self):
        value = self.data[self.pos] if self.pos < len(self.data) else 0
        self.pos += 1
        return value

    def int(self, low, high):
        return low + self.byte() % (high - low + 1)

    def choice(self, options):
        return options[self.byte() % len(options)]


def _layout(arr, how):
    if arr.ndim < 2 or how == 0:
        return arr
    if how == 1:  # transposed storage
        return np.ascontiguousarray(np.swapaxes(arr, -1, -2)).swapaxes(-1, -2)
    if how == 2:  # negative row stride, same values
        return np.ascontiguousarray(arr[..., ::-1, :])[..., ::-1, :]
    if how == 3:  # read-only
        arr = arr.copy()
        arr.setflags(write=False)
        return arr
    return np.broadcast_to(arr[..., :1, :], arr.shape) if arr.shape[-2] else arr


def check_input(data):
    draw = Bytes(data)
    T, S = draw.int(0, 40), draw.int(0, 40)
    d_k, d_v = draw.int(0, 20), draw.int(0, 12)
    batch = draw.choice([(), (2,), (1, 3), (2, 1)])
    dtype = draw.choice(DTYPES)
    rng = np.random.default_rng(draw.int(0, 255))
    q, k, v = (rng.standard_normal(batch + shape).astype(dtype)
               for shape in ((T, d_k), (S, d_k), (S, d_v)))
    if draw.int(0, 7) == 0 and dtype in (np.float32, np.float64) and k.size:
        k.flat[draw.int(0, k.size - 1)] = draw.choice([np.nan, np.inf, -np.inf])
    q, k, v = (_layout(a, draw.int(0, 4)) for a in (q, k, v))
    if draw.int(0, 19) == 0:  # a bad shape on purpose
        k = k[..., : max(d_k - 1, 0)]
    kwargs = {"causal": bool(draw.int(0, 1))}
    mask_kind = draw.int(0, 3)
    if mask_kind == 1:
        kwargs["mask"] = rng.random((T, S)) > 0.3
    elif mask_kind == 2:
        kwargs["mask"] = np.where(rng.random((T, S)) > 0.3, 0.5, -np.inf)
    elif mask_kind == 3:
        kwargs["mask"] = rng.random((draw.int(0, 3), S)) > 0.5
    kwargs["scale"] = draw.choice([None, None, None, 0.0, -0.5, 2.0, 1, None, None, np.nan])
    if draw.int(0, 3) == 0:
        kwargs["window"] = draw.choice([(3, 0), (None, 2), (0, None), (7, 7), (1, 1), (-1, 1)])
    if draw.int(0, 3) == 0:
        kwargs["softcap"] = draw.choice([1.0, 20.0, 0.5, 3.0, -1.0])
    if draw.int(0, 4) == 0:
        kwargs["kv_lengths"] = draw.choice([0, S, S // 2, max(S - 1, 0), S + 1])
    kwargs["num_threads"] = draw.choice([None, 1, 2, 3, None, 2, 0])
    return_scores = bool(draw.int(0, 1))

    try:
        result = ca.attention(q, k, v, return_scores=return_scores, **kwargs)
    except ALLOWED:
        return
    attn = result[0] if return_scores else result
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    assert attn.shape[-2:] == (T, d_v), (attn.shape, T, d_v)
    assert attn.shape[:-2] == lead or "mask" in kwargs, (attn.shape, lead)
    # compare with the reference where it applies: plain options, finite data
    plain = all(kwargs.get(key) is None for key in ("window", "softcap", "kv_lengths"))
    floats = np.result_type(q, k, v).kind == "f"
    if plain and floats and d_k > 0 and all(np.all(np.isfinite(a)) for a in (q, k, v)):
        ref, _ = reference_attention(q, k, v, kwargs["causal"], kwargs.get("mask"),
                                     kwargs["scale"])
        tol = 1e-2 if attn.dtype == np.float16 else 1e-4 if attn.dtype == np.float32 else 1e-10
        scale_of_values = max(1.0, float(np.max(np.abs(v), initial=0)))
        assert np.max(np.abs(attn - ref), initial=0) <= tol * scale_of_values


def main():
    import atheris

    # coverage of the Python layer guides the search (the extension itself is
    # checked by the sanitizers under `make fuzz`)
    atheris.instrument_all()
    atheris.Setup(sys.argv, lambda data: check_input(bytes(data)))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
