"""Every entry of the AVX-512 kernel table, run on an emulated CPU
(tests/x86_emulator.py) on random inputs, every tail length, -inf, NaN and
float16 edge values, against the portable table run the same way.

Where the AVX-512 kernel performs the same operations in the same order as
the AVX2 one (every output element of the tiles, the element-wise kernels,
P.V of the decode path), it must also match the AVX2 table bit for bit; sums
that are split across lanes differ with the lane count and are held to a
rounding bound instead.

Run as a program (a fresh process: one emulator per process) it prints one
JSON object: {"checks": {name: [failure, ...]}, "counts": {...},
"dispatch": {...}}; the test module tests/test_avx512_emulated.py reads it.
The counts are emulated instructions per floating-point operation of the
score and P.V kernels; "dispatch" is what dispatch.c chooses on the
emulated CPU with and without the OS saving the ZMM state.
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import x86_emulator  # noqa: E402

PANEL = {np.float32: 16, np.float64: 8}
CODE = {np.float32: "f", np.float64: "d"}
SUFFIX = {np.float32: "f32", np.float64: "f64"}
EPS = {np.float32: np.finfo(np.float32).eps, np.float64: np.finfo(np.float64).eps}
#: failures kept per check: the first few say enough
MAX_FAILURES = 5
#: the fp8 format codes of scalar.h
FP8_FORMATS = {"e4m3fn": 0, "e5m2": 1}
#: codes that are NaN in both fp8 formats (S.1111.111), and E5M2's infinities
FP8_NAN = (0x7F, 0xFF)
E5M2_INF = (0x7C, 0xFC)
F32_MAX = float(np.finfo(np.float32).max)

CHECKS = [
    "score_f32", "score_f64", "pv_f32", "pv_f64", "row_max_f32", "row_max_f64",
    "exp_sum_f32", "exp_sum_f64", "score_direct_f32", "score_direct_f64",
    "pv_direct_f32", "pv_direct_f64", "half_rows_to_f32", "softcap_f32", "pack_kt_f32",
    "pack_v_f32", "int8_rows_to_f32", "score_direct_i8", "pv_direct_i8",
    "score_direct_f16", "pv_direct_f16", "divide_rows_f32", "divide_rows_f64",
    "bf16_rows_to_f32", "score_direct_bf16", "pv_direct_bf16",
    "fp8_rows_to_f32", "score_direct_fp8", "pv_direct_fp8",
]


def same_bits(a, b):
    """Equal bit for bit, except that any NaN equals any NaN."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return False
    width = {4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return np.array_equal(a[~nan_a].view(width), b[~nan_b].view(width))


def within(a, b, bound):
    """|a - b| <= bound where both are finite; NaN and infinities at the same
    places, with the same signs."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    finite = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(a[~finite & ~np.isnan(a)], b[~finite & ~np.isnan(b)]):
        return False
    bound = np.broadcast_to(np.asarray(bound, np.float64), a.shape)
    return bool(np.all(np.abs(a[finite] - b[finite]) <= bound[finite]))


def fp8_widened(codes, fmt):
    """fp8 codes (uint8) as float32, exactly, computed here rather than by
    the portable table: E5M2 is the upper byte of a binary16; E4M3FN has
    bias 7, subnormals of 2^-9, no infinities, NaN at S.1111.111."""
    codes = np.asarray(codes, np.uint8)
    if fmt == "e5m2":
        return (codes.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9,
                         (1 + mantissa / 8) * np.exp2(exponent.astype(np.float64) - 7))
    value = np.where(codes & 0x80, -magnitude, magnitude)
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


def fp8_finite_codes(fmt):
    """Every code of the format that is neither NaN nor infinite."""
    every = np.arange(256, dtype=np.uint8)
    return every[np.isfinite(fp8_widened(every, fmt))]


class Checks:
    def __init__(self, machine):
        self.m = machine
        self.rng = np.random.default_rng(20261201)
        self.failures = []

    def fail(self, message):
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(message)

    def call(self, table, entry, args, returns=None):
        return self.m.call(self.m.tables[table][entry], args, returns)

    def ptr(self, address):
        return ("i", address)

    # ---- packed tiles ----

    def packed_kt(self, k, dtype, stride_pad=16):
        """K (n_keys x d_k) in panels, as the driver packs it."""
        P = PANEL[dtype]
        n_keys, d_k = k.shape
        n_panels = -(-n_keys // P)
        stride = d_k * P + stride_pad
        flat = np.zeros(n_panels * stride, dtype)
        for p in range(n_panels):
            block = np.zeros((P, d_k), dtype)
            rows = k[p * P:(p + 1) * P]
            block[:len(rows)] = rows
            flat[p * stride:p * stride + d_k * P] = block.T.reshape(-1)
        return flat, stride

    def check_score(self, dtype):
        P = PANEL[dtype]
        # 130: two passes over the features (the kernels take 128 at a time
        # where the tile spans four panels)
        for d_k in (1, 5, 17, 130):
            # 1 to 5 panels: every column tail of a tile of up to 4 panels,
            # a whole tile, and a tile and a panel
            for n_cols in (P, 2 * P, 3 * P, 4 * P, 5 * P):
                for n_rows in list(range(1, 14)) + [24, 25]:
                    q = self.rng.standard_normal((n_rows, d_k + 3)).astype(dtype)
                    if n_rows == 7:
                        q[3, 0] = np.nan
                    k = self.rng.standard_normal((n_cols, d_k)).astype(dtype)
                    kt, stride = self.packed_kt(k, dtype)
                    factor = 0.37
                    lds = n_cols + 5
                    out = {}
                    for table in ("baseline", "avx2", "avx512"):
                        self.m.reset_arena()
                        q_at, kt_at = self.m.put(q), self.m.put(kt)
                        s_at, s = self.m.empty((n_rows, lds), dtype, fill=-7.0)
                        ahead = self.m.put(np.zeros(4096, np.uint8))
                        self.call(table, "score_" + SUFFIX[dtype], [
                            self.ptr(q_at), ("i", d_k + 3), ("i", n_rows), self.ptr(kt_at),
                            ("i", stride), ("i", n_cols), ("i", d_k), (CODE[dtype], factor),
                            self.ptr(s_at), ("i", lds), self.ptr(ahead), ("i", 4096)])
                        out[table] = s.copy()
                    magnitude = np.abs(q[:, :d_k]).astype(np.float64) @ np.abs(k.T) * factor
                    bound = np.zeros((n_rows, lds))
                    bound[:, :n_cols] = 2 * (d_k + 1) * EPS[dtype] * magnitude
                    where = f"d_k={d_k} n_cols={n_cols} n_rows={n_rows}"
                    if not within(out["avx512"], out["baseline"], bound):
                        self.fail(f"differs from baseline: {where}")
                    if not same_bits(out["avx512"], out["avx2"]):
                        self.fail(f"not bitwise AVX2's: {where}")

    def check_pv(self, dtype):
        P = PANEL[dtype]
        # 70 keys: a run of CA_SUM_KEYS (64) keys and a short one
        for n_keys in (1, 7, 33, 70):
            for n_vcols in (P, 2 * P, 3 * P, 4 * P, 5 * P):
                for n_rows in list(range(1, 14)) + [24, 25]:
                    p = self.rng.random((n_rows, n_keys + 2)).astype(dtype)
                    p[p < 0.2] = 0
                    v = self.rng.standard_normal((n_keys, n_vcols)).astype(dtype)
                    n_panels = n_vcols // P
                    stride = n_keys * P + 8
                    v_packed = np.zeros(n_panels * stride, dtype)
                    for c in range(n_panels):
                        v_packed[c * stride:c * stride + n_keys * P] = \
                            v[:, c * P:(c + 1) * P].reshape(-1)
                    ldacc = n_vcols + 3
                    acc0 = self.rng.standard_normal((n_rows, ldacc)).astype(dtype)
                    out = {}
                    for table in ("baseline", "avx2", "avx512"):
                        self.m.reset_arena()
                        p_at, v_at, acc_at = self.m.put(p), self.m.put(v_packed), self.m.put(acc0)
                        self.call(table, "pv_" + SUFFIX[dtype], [
                            self.ptr(p_at), ("i", n_keys + 2), ("i", n_rows), self.ptr(v_at),
                            ("i", stride), ("i", n_keys), ("i", n_vcols), self.ptr(acc_at),
                            ("i", ldacc), ("i", 0), ("i", 0)])
                        out[table] = self.m.read(acc_at, dtype, acc0.size).reshape(acc0.shape)
                    magnitude = np.abs(acc0).astype(np.float64)
                    magnitude[:, :n_vcols] += np.abs(p[:, :n_keys]) @ np.abs(v)
                    bound = 2 * (n_keys + 2) * EPS[dtype] * magnitude
                    where = f"n_keys={n_keys} n_vcols={n_vcols} n_rows={n_rows}"
                    if not within(out["avx512"], out["baseline"], bound):
                        self.fail(f"differs from baseline: {where}")
                    if not same_bits(out["avx512"], out["avx2"]):
                        self.fail(f"not bitwise AVX2's: {where}")

    # ---- softmax pieces ----

    def rows_with_edges(self, n, dtype):
        """Rows of length n: plain, with -inf entries, all -inf, with a NaN."""
        base = (self.rng.standard_normal(n) * 4).astype(dtype)
        rows = [base]
        if n:
            masked = base.copy()
            masked[self.rng.random(n) < 0.4] = -np.inf
            rows += [masked, np.full(n, -np.inf, dtype)]
            with_nan = base.copy()
            with_nan[self.rng.integers(n)] = np.nan
            rows.append(with_nan)
        return rows

    def check_row_max(self, dtype):
        for n in range(0, 41):
            for row in self.rows_with_edges(n, dtype):
                out = {}
                for table in ("baseline", "avx2", "avx512"):
                    self.m.reset_arena()
                    out[table] = self.call(table, "row_max_" + SUFFIX[dtype],
                                           [self.ptr(self.m.put(row)), ("i", n)],
                                           returns=CODE[dtype])
                got = np.array([out["avx512"]], dtype)
                if not same_bits(got, np.array([out["baseline"]], dtype)):
                    self.fail(f"n={n}: {out['avx512']} vs baseline {out['baseline']}")

    def check_exp_sum(self, dtype):
        # rows past four vectors of 16 lanes too: exp_sum takes four at a time
        for n in list(range(0, 41)) + [63, 64, 65, 79, 80, 81, 129]:
            for row in self.rows_with_edges(n, dtype):
                finite = row[np.isfinite(row)]
                shifts = [float(finite.max()) if finite.size else 0.0, float("nan")]
                for shift in shifts:
                    out, total = {}, {}
                    for table in ("baseline", "avx2", "avx512"):
                        self.m.reset_arena()
                        at = self.m.put(row)
                        total[table] = self.call(table, "exp_sum_" + SUFFIX[dtype],
                                                 [self.ptr(at), ("i", n), (CODE[dtype], shift)],
                                                 returns=CODE[dtype])
                        out[table] = self.m.read(at, dtype, n)
                    where = f"n={n} shift={shift}"
                    ulps = 4 * EPS[dtype]
                    if not within(out["avx512"], out["baseline"], ulps * np.abs(out["baseline"])):
                        self.fail(f"values differ from baseline: {where}")
                    if not same_bits(out["avx512"], out["avx2"]):
                        self.fail(f"values not bitwise AVX2's: {where}")
                    expected = np.array([total["baseline"]])
                    bound = (n + 4) * ulps * np.abs(out["baseline"]).sum()
                    if not within(np.array([total["avx512"]]), expected, bound):
                        self.fail(f"sum {total['avx512']} vs baseline {total['baseline']}: {where}")

    def check_divide_rows(self, dtype):
        """Every tail length beside whole vectors, strided rows, and divisors
        and values at the edges: bitwise the portable table's division, and
        nonzero returned exactly when a quotient is inf or NaN."""
        ldacc, ld_out = 48, 45
        # quotients by multiplies hold in a range of divisors and quotients
        # (kernels_simd_typed.h), the division beyond it: values and
        # divisors across both edges of those ranges
        b_range, q_range = (2.0 ** 20, 2.0 ** 40) if dtype == np.float32 else (2.0 ** 200,
                                                                               2.0 ** 400)
        outcomes = set()
        for n_cols in range(0, 41):
            n_rows = 5
            acc = self.rng.standard_normal((n_rows, ldacc)).astype(dtype)
            edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-300, 3e38, -5e-39],
                             np.float64).astype(dtype)
            # odd widths: the edges from the row's end, so that the tail
            # and the last whole vector meet an infinity too
            edges = edges if n_cols % 2 == 0 else edges[::-1]
            acc[1, :min(n_cols, edges.size)] = edges[:n_cols]
            if n_cols % 3 == 2:
                # quotients all finite (row 2's divisor is near the smallest
                # normal number, or below it)
                acc[1] = np.where(np.isfinite(acc[1]), acc[1], 0)
                acc[2] = np.clip(acc[2], -1, 1) * (1 if dtype == np.float32 else 1e-3)
            log_q = np.log2(q_range)
            acc[3:] *= np.exp2(self.rng.uniform(-1.2 * log_q, 1.2 * log_q, (2, ldacc)))
            divisor = np.array([1.0 + self.rng.random(), 3.0, 7e-39 if dtype == np.float32
                                else 1e-310, b_range * (1 - self.rng.random() / 4),
                                -b_range * (1 + self.rng.random())], dtype)
            out, nonfinite = {}, {}
            for table in ("baseline", "avx2", "avx512"):
                self.m.reset_arena()
                at_acc = self.m.put(acc)
                at_div = self.m.put(divisor)
                at_out = self.m.put(np.full((n_rows, ld_out), 5, dtype))
                nonfinite[table] = self.call(
                    table, "divide_rows_" + SUFFIX[dtype],
                    [self.ptr(at_acc), ("i", ldacc), ("i", n_rows), ("i", n_cols),
                     self.ptr(at_div), self.ptr(at_out), ("i", ld_out)], returns="i")
                out[table] = self.m.read(at_out, dtype, n_rows * ld_out).reshape(n_rows, ld_out)
            expected = np.full((n_rows, ld_out), 5, dtype)
            with np.errstate(over="ignore", invalid="ignore"):
                expected[:, :n_cols] = acc[:, :n_cols] / divisor[:, None]
            expected_nonfinite = not np.all(np.isfinite(expected[:, :n_cols]))
            outcomes.add(expected_nonfinite)
            for table in ("baseline", "avx2", "avx512"):
                if not same_bits(out[table], expected):
                    self.fail(f"{table} n_cols={n_cols}: not the division (or wrote past it)")
                if bool(nonfinite[table]) != expected_nonfinite:
                    self.fail(f"{table} n_cols={n_cols}: returned {nonfinite[table]} with "
                              f"{'some' if expected_nonfinite else 'no'} inf or NaN quotients")
        if outcomes != {False, True}:
            self.fail("the cases did not include calls with and without inf or NaN quotients")

    def check_softcap(self):
        for n in range(0, 41):
            x = (self.rng.standard_normal(n) * 6).astype(np.float32)
            edges = np.array([0.0, -0.0, 0.3, -0.49, 0.5, -0.51, 1e-30, np.inf, -np.inf,
                              np.nan, 80.0, -80.0, 3e38], np.float32)
            x[:min(n, edges.size)] = edges[:n]
            self.rng.shuffle(x)
            for cap in (2.5, 30.0):
                out = {}
                for table in ("baseline", "avx2", "avx512"):
                    self.m.reset_arena()
                    at = self.m.put(x)
                    self.call(table, "softcap_f32", [self.ptr(at), ("i", n), ("f", cap)])
                    out[table] = self.m.read(at, np.float32, n)
                where = f"n={n} cap={cap}"
                bound = 8 * EPS[np.float32] * cap
                if not within(out["avx512"], out["baseline"], bound):
                    self.fail(f"differs from baseline: {where}")
                # both vector codes cover the whole vectors of 16
                whole = n // 16 * 16
                if not same_bits(out["avx512"][:whole], out["avx2"][:whole]):
                    self.fail(f"not bitwise AVX2's: {where}")

    # ---- decode kernels ----

    def score_direct(self, table, name, q, k, d_k, factor, lds):
        """s from one call of a score_direct kernel on rows q (n_rows, d_k + 1)
        and k (n_keys, d_k + 3) of any stored type, into s (n_rows, lds)
        filled with 5 first."""
        n_rows, n_keys = q.shape[0], k.shape[0]
        self.m.reset_arena()
        q_at, k_at = self.m.put(q), self.m.put(k)
        s_at, s = self.m.empty((n_rows, lds), q.dtype, fill=5.0)
        ahead = self.m.put(np.zeros((n_keys, 64), np.uint8))
        self.call(table, name, [
            self.ptr(q_at), ("i", d_k + 1), ("i", n_rows), self.ptr(k_at), ("i", d_k + 3),
            ("i", n_keys), ("i", d_k), (CODE[q.dtype.type], factor), self.ptr(s_at),
            ("i", lds), self.ptr(ahead), ("i", 64), ("i", 64)])
        return s.copy()

    def pv_direct(self, table, name, p, v, d_v, acc0):
        """acc0 (n_rows, ldacc) after one call of a pv_direct kernel with the
        weights p (n_rows, n_keys) and values v (n_keys, d_v + 1) of any stored
        type."""
        n_rows, n_keys = p.shape
        self.m.reset_arena()
        p_at, v_at, acc_at = self.m.put(p), self.m.put(v), self.m.put(acc0)
        ahead = self.m.put(np.zeros((n_keys, 64), np.uint8))
        self.call(table, name, [
            self.ptr(p_at), ("i", n_keys), ("i", n_rows), self.ptr(v_at), ("i", d_v + 1),
            ("i", n_keys), ("i", d_v), self.ptr(acc_at), ("i", acc0.shape[1]),
            self.ptr(ahead), ("i", 64), ("i", 64)])
        return self.m.read(acc_at, acc0.dtype, acc0.size).reshape(acc0.shape)

    def check_score_direct(self, dtype):
        suffix = SUFFIX[dtype]
        # whole vectors up to 8 of them take the kernel's held-q path (rows
        # 1 and 3: one held row, a held pair and a row after it)
        for d_k in list(range(1, 36)) + [48, 64, 96, 128]:
            for n_keys in (1, 2, 3, 4, 5, 9):
                for n_rows in (1, 3):
                    q = self.rng.standard_normal((n_rows, d_k + 1)).astype(dtype)
                    k = self.rng.standard_normal((n_keys, d_k + 3)).astype(dtype)
                    factor = -0.61
                    lds = n_keys + 2
                    out = {table: self.score_direct(table, "score_direct_" + suffix, q, k,
                                                    d_k, factor, lds)
                           for table in ("baseline", "avx2", "avx512")}
                    bound = np.zeros((n_rows, lds))
                    bound[:, :n_keys] = (2 * (d_k + 2) * EPS[dtype] * abs(factor)
                                         * (np.abs(q[:, :d_k]) @ np.abs(k[:, :d_k].T)))
                    where = f"d_k={d_k} n_keys={n_keys} n_rows={n_rows}"
                    if not within(out["avx512"], out["baseline"], bound):
                        self.fail(f"differs from baseline: {where}")

    def half_rows(self, n_rows, n_cols):
        """float16 rows with the edge values: zeros of both signs,
        subnormals, the largest finite, infinities and NaN among normals."""
        rows = (self.rng.standard_normal((n_rows, n_cols)) * 4).astype(np.float16)
        edges = np.array([0.0, -0.0, 6e-8, -3e-5, 65504.0, -65504.0, np.inf, np.nan],
                         np.float16)
        flat = rows.reshape(-1)
        spots = self.rng.permutation(flat.size)[:min(flat.size // 4, edges.size)]
        flat[spots] = edges[:spots.size]
        return rows

    def bf16_rows(self, n_rows, n_cols):
        """bfloat16 rows (as uint16) with the edge values: zeros of both
        signs, subnormals, the largest finite, infinities and NaN."""
        values = (self.rng.standard_normal((n_rows, n_cols)) * 4).astype(np.float32)
        rows = (values.view(np.uint32) >> 16).astype(np.uint16)
        edges = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0x7FC0],
                         np.uint16)
        flat = rows.reshape(-1)
        spots = self.rng.permutation(flat.size)[:min(flat.size // 4, edges.size)]
        flat[spots] = edges[:spots.size]
        return rows

    @staticmethod
    def widened(rows, fmt):
        """float16 or bfloat16 rows as float32, exactly."""
        if fmt == "f16":
            return rows.astype(np.float32)
        return (rows.astype(np.uint32) << 16).view(np.float32)

    def rows_16(self, fmt, n_rows, n_cols):
        return self.half_rows(n_rows, n_cols) if fmt == "f16" else self.bf16_rows(n_rows, n_cols)

    def check_score_direct_16(self, fmt):
        # every table: float16 or bfloat16 keys read in place give the bits
        # of its own float32 kernel on the converted rows
        for d_k in list(range(1, 18)) + [31, 32, 33, 64, 127, 128]:
            for n_keys in (1, 3, 4, 5, 9):
                for n_rows in (1, 2, 3):
                    q = self.rng.standard_normal((n_rows, d_k + 1)).astype(np.float32)
                    k = self.rows_16(fmt, n_keys, d_k + 3)
                    factor = -0.61
                    lds = n_keys + 2
                    for table in ("baseline", "avx2", "avx512"):
                        out = {name: self.score_direct(table, name, q, k_in, d_k, factor, lds)
                               for name, k_in in ((f"score_direct_{fmt}", k),
                                                  ("score_direct_f32", self.widened(k, fmt)))}
                        if not same_bits(out[f"score_direct_{fmt}"], out["score_direct_f32"]):
                            self.fail(f"{table}: not the float32 kernel's bits on the "
                                      f"converted keys: d_k={d_k} n_keys={n_keys} "
                                      f"n_rows={n_rows}")

    def check_pv_direct_16(self, fmt):
        for d_v in list(range(1, 36)) + [127, 128, 129, 200]:
            for n_keys in (1, 5, 70):
                n_rows = 2
                p = self.rng.random((n_rows, n_keys)).astype(np.float32)
                p[p < 0.25] = 0
                v = self.rows_16(fmt, n_keys, d_v + 1)
                # a value row whose weights are all 0 takes no part, NaN or not
                p[:, 0] = 0
                v[0, :] = 0x7FC0 if fmt == "bf16" else np.nan
                ldacc = -(-d_v // 16) * 16 + 16
                acc0 = self.rng.standard_normal((n_rows, ldacc)).astype(np.float32)
                for table in ("baseline", "avx2", "avx512"):
                    out = {name: self.pv_direct(table, name, p, v_in, d_v, acc0)
                           for name, v_in in ((f"pv_direct_{fmt}", v),
                                              ("pv_direct_f32", self.widened(v, fmt)))}
                    if not same_bits(out[f"pv_direct_{fmt}"], out["pv_direct_f32"]):
                        self.fail(f"{table}: not the float32 kernel's bits on the converted "
                                  f"values: d_v={d_v} n_keys={n_keys}")

    def check_pv_direct(self, dtype):
        suffix = SUFFIX[dtype]
        for d_v in list(range(1, 36)) + [127, 128, 129, 200]:
            for n_keys in (1, 5, 70):
                n_rows = 2
                p = self.rng.random((n_rows, n_keys)).astype(dtype)
                p[p < 0.25] = 0
                v = self.rng.standard_normal((n_keys, d_v + 1)).astype(dtype)
                # a value row whose weights are all 0 takes no part, NaN or not
                p[:, 0] = 0
                v[0, :] = np.nan
                ldacc = -(-d_v // 16) * 16 + 16
                acc0 = self.rng.standard_normal((n_rows, ldacc)).astype(dtype)
                out = {table: self.pv_direct(table, "pv_direct_" + suffix, p, v, d_v, acc0)
                       for table in ("baseline", "avx2", "avx512")}
                used = slice(0, d_v)
                untouched = slice(-(-d_v // 16) * 16, ldacc)
                magnitude = np.abs(acc0[:, used]) + np.abs(p[:, 1:]) @ np.abs(v[1:, :d_v])
                bound = 2 * (n_keys + 2) * EPS[dtype] * magnitude
                where = f"d_v={d_v} n_keys={n_keys}"
                if not within(out["avx512"][:, used], out["baseline"][:, used], bound):
                    self.fail(f"differs from baseline: {where}")
                if not same_bits(out["avx512"][:, used], out["avx2"][:, used]):
                    self.fail(f"not bitwise AVX2's: {where}")
                if not same_bits(out["avx512"][:, untouched], acc0[:, untouched]):
                    self.fail(f"wrote past the rounded d_v: {where}")

    def check_score_direct_i8(self):
        for d_k in range(1, 36):
            for n_keys in (1, 3, 4, 5, 9):
                n_rows = 2
                q = self.rng.standard_normal((n_rows, d_k)).astype(np.float32)
                k = self.rng.integers(-128, 128, (n_keys, d_k + 2)).astype(np.int8)
                scale = (self.rng.random(2 * n_keys) * 0.05).astype(np.float32)
                factor = 0.7
                out = {}
                for table in ("baseline", "avx2", "avx512"):
                    self.m.reset_arena()
                    s_at, s = self.m.empty((n_rows, n_keys), np.float32)
                    self.call(table, "score_direct_i8", [
                        self.ptr(self.m.put(q)), ("i", d_k), ("i", n_rows),
                        self.ptr(self.m.put(k)), ("i", d_k + 2), ("i", n_keys), ("i", d_k),
                        ("f", factor), self.ptr(self.m.put(scale)), ("i", 2), self.ptr(s_at),
                        ("i", n_keys)])
                    out[table] = s.copy()
                magnitude = (np.abs(q) @ np.abs(k[:, :d_k].T.astype(np.float64))
                             * scale[::2] * factor)
                bound = 2 * (d_k + 3) * EPS[np.float32] * magnitude
                if not within(out["avx512"], out["baseline"], bound):
                    self.fail(f"differs from baseline: d_k={d_k} n_keys={n_keys}")

    def check_pv_direct_i8(self):
        for d_v in list(range(1, 36)) + [127, 128, 129, 200]:
            # 70 keys: a run of CA_SUM_KEYS summed from zero, then the rest
            for n_keys in (1, 6, 70):
                n_rows = 2
                p = self.rng.random((n_rows, n_keys)).astype(np.float32)
                p[p < 0.25] = 0
                v = self.rng.integers(-128, 128, (n_keys, d_v)).astype(np.int8)
                scale = (self.rng.random(n_keys) * 0.05).astype(np.float32)
                acc0 = self.rng.standard_normal((n_rows, d_v)).astype(np.float32)
                out = {}
                for table in ("baseline", "avx2", "avx512"):
                    self.m.reset_arena()
                    acc_at = self.m.put(acc0)
                    self.call(table, "pv_direct_i8", [
                        self.ptr(self.m.put(p)), ("i", n_keys), ("i", n_rows),
                        self.ptr(self.m.put(v)), ("i", d_v), ("i", n_keys), ("i", d_v),
                        self.ptr(self.m.put(scale)), ("i", 1), self.ptr(acc_at), ("i", d_v)])
                    out[table] = self.m.read(acc_at, np.float32, acc0.size).reshape(acc0.shape)
                magnitude = np.abs(acc0) + (np.abs(p) * scale) @ np.abs(v.astype(np.float64))
                bound = 2 * (n_keys + 3) * EPS[np.float32] * magnitude
                if not within(out["avx512"], out["baseline"], bound):
                    self.fail(f"differs from baseline: d_v={d_v} n_keys={n_keys}")

    # ---- fp8 K and V ----

    def fp8_rows(self, fmt, n_rows, n_cols):
        """Random finite codes of fmt, their magnitudes spread over the
        format's range (subnormals and zeros included)."""
        return self.rng.choice(fp8_finite_codes(fmt), (n_rows, n_cols)).astype(np.uint8)

    def check_score_direct_fp8(self):
        """s = (factor * q . widen(k_j)) * scale_j: every table against the
        portable one within a rounding bound, and the portable one against
        float64 sums of the exactly widened codes; NaN codes (and E5M2's
        infinities) give NaN and infinities in the same places; columns of
        s past n_keys kept; codes past d_k (NaN here) never read."""
        case = 0
        for fmt, code in FP8_FORMATS.items():
            for d_k in list(range(1, 36)) + [64, 127, 128]:
                for n_keys in (1, 3, 4, 5, 9):
                    for n_rows in (1, 2, 3):
                        case += 1
                        q = self.rng.standard_normal((n_rows, d_k + 1)).astype(np.float32)
                        k = self.fp8_rows(fmt, n_keys, d_k + 3)
                        k[:, d_k:] = 0x7F               # past d_k: never read
                        if n_keys >= 3 and case % 3 == 0:
                            k[1, self.rng.integers(d_k)] = FP8_NAN[case % 2]
                            if fmt == "e5m2":
                                k[2, self.rng.integers(d_k)] = E5M2_INF[case % 2]
                        scale_stride = 0 if case % 4 == 0 else 2
                        scale = (self.rng.random(max(1, scale_stride * n_keys)) * 0.05
                                 + 1e-3).astype(np.float32)
                        if n_keys == 9 and scale_stride:
                            scale[2 * scale_stride] = 0.0  # a key of scale 0
                        factor = -0.61
                        lds = n_keys + 2
                        with_ahead = case % 2 == 0
                        out = {}
                        for table in ("baseline", "avx2", "avx512"):
                            self.m.reset_arena()
                            q_at, k_at = self.m.put(q), self.m.put(k)
                            scale_at = self.m.put(scale)
                            s_at, s = self.m.empty((n_rows, lds), np.float32, fill=5.0)
                            ahead = self.m.put(np.zeros((n_keys, 64), np.uint8))
                            self.call(table, "score_direct_fp8", [
                                self.ptr(q_at), ("i", d_k + 1), ("i", n_rows), self.ptr(k_at),
                                ("i", d_k + 3), ("i", n_keys), ("i", d_k), ("i", code),
                                ("f", factor), self.ptr(scale_at), ("i", scale_stride),
                                self.ptr(s_at), ("i", lds),
                                self.ptr(ahead if with_ahead else 0), ("i", 64), ("i", 64)])
                            out[table] = s.copy()
                        wide = fp8_widened(k[:, :d_k], fmt).astype(np.float64)
                        key_scale = scale[::scale_stride][:n_keys] if scale_stride \
                            else np.repeat(scale[:1], n_keys)
                        key_scale = key_scale.astype(np.float64)
                        finite = np.where(np.isfinite(wide), wide, 0.0)
                        magnitude = (abs(factor) * (np.abs(q[:, :d_k]).astype(np.float64)
                                                    @ np.abs(finite.T)) * key_scale)
                        bound = np.zeros((n_rows, lds))
                        bound[:, :n_keys] = 2 * (d_k + 3) * EPS[np.float32] * magnitude
                        with np.errstate(invalid="ignore", over="ignore"):
                            exact = np.full((n_rows, lds), 5.0)
                            exact[:, :n_keys] = (factor * (q[:, :d_k].astype(np.float64)
                                                           @ wide.T)) * key_scale
                        where = (f"{fmt} d_k={d_k} n_keys={n_keys} n_rows={n_rows} "
                                 f"scale_stride={scale_stride}")
                        if not within(out["baseline"], exact, bound):
                            self.fail(f"baseline differs from float64 sums: {where}")
                        for table in ("avx2", "avx512"):
                            if not within(out[table], out["baseline"], bound):
                                self.fail(f"{table} differs from baseline: {where}")
                        for table in ("baseline", "avx2", "avx512"):
                            if not same_bits(out[table][:, n_keys:], np.full(
                                    (n_rows, 2), 5.0, np.float32)):
                                self.fail(f"{table} wrote past n_keys: {where}")

    def check_pv_direct_fp8(self):
        """acc += sum_j (p_j * scale_j) * widen(v_j), keys of weight 0
        skipped (a NaN row of weight 0, by p or by its scale, takes no part):
        every table against the portable one within a rounding bound, the
        portable one against float64 sums, AVX-512 bitwise AVX2 (the same
        chain of FMAs per column, see check_pv_direct), nothing written past
        d_v rounded up to 16."""
        case = 0
        for fmt, code in FP8_FORMATS.items():
            for d_v in list(range(1, 36)) + [127, 128, 129, 200]:
                # 70 keys: a run of CA_SUM_KEYS summed from zero, then the rest;
                # 9 rows: past the 8 rows of weights the wrapper holds
                for n_keys in (1, 6, 70):
                    for n_rows in (2, 8) + ((9,) if d_v in (33, 129) else ()):
                        case += 1
                        p = self.rng.random((n_rows, n_keys)).astype(np.float32)
                        p[p < 0.25] = 0
                        v = self.fp8_rows(fmt, n_keys, d_v + 1)
                        v[:, d_v] = 0x7F                # past d_v: never read
                        # a value row whose weights are all 0 takes no part
                        p[:, 0] = 0
                        v[0, :] = FP8_NAN[case % 2]
                        scale_stride = 0 if case % 3 == 0 else 1
                        scale = (self.rng.random(max(1, n_keys)) * 0.05
                                 + 1e-3).astype(np.float32)
                        if n_keys >= 6 and scale_stride:
                            # weight 0 by its scale: a NaN code there takes no part
                            scale[2] = 0.0
                            v[2, self.rng.integers(d_v)] = FP8_NAN[case % 2]
                            if fmt == "e5m2":
                                v[4, self.rng.integers(d_v)] = E5M2_INF[case % 2]
                        key_scale = scale[:n_keys] if scale_stride \
                            else np.repeat(scale[:1], n_keys)
                        rounded = -(-d_v // 16) * 16
                        ldacc = rounded + 16
                        acc0 = self.rng.standard_normal((n_rows, ldacc)).astype(np.float32)
                        with_ahead = case % 2 == 1
                        out = {}
                        for table in ("baseline", "avx2", "avx512"):
                            self.m.reset_arena()
                            p_at, v_at = self.m.put(p), self.m.put(v)
                            scale_at, acc_at = self.m.put(scale), self.m.put(acc0)
                            ahead = self.m.put(np.zeros((n_keys, 64), np.uint8))
                            self.call(table, "pv_direct_fp8", [
                                self.ptr(p_at), ("i", n_keys), ("i", n_rows), self.ptr(v_at),
                                ("i", d_v + 1), ("i", n_keys), ("i", d_v), ("i", code),
                                self.ptr(scale_at), ("i", scale_stride), self.ptr(acc_at),
                                ("i", ldacc), self.ptr(ahead if with_ahead else 0), ("i", 64),
                                ("i", 64)])
                            out[table] = self.m.read(acc_at, np.float32,
                                                     acc0.size).reshape(acc0.shape)
                        weight = (p * key_scale).astype(np.float64)     # float32 products
                        wide = fp8_widened(v[:, :d_v], fmt).astype(np.float64)
                        taking = weight != 0
                        with np.errstate(invalid="ignore", over="ignore"):
                            terms = np.where(taking[:, :, None],
                                             weight[:, :, None] * wide[None, :, :], 0.0)
                            finite = np.where(np.isfinite(wide), wide, 0.0)
                        used = slice(0, d_v)
                        exact = acc0[:, used].astype(np.float64) + terms.sum(axis=1)
                        magnitude = np.abs(acc0[:, used]) + np.abs(weight) @ np.abs(finite)
                        bound = 2 * (n_keys + 3) * EPS[np.float32] * magnitude
                        where = (f"{fmt} d_v={d_v} n_keys={n_keys} n_rows={n_rows} "
                                 f"scale_stride={scale_stride}")
                        if not within(out["baseline"][:, used], exact, bound):
                            self.fail(f"baseline differs from float64 sums: {where}")
                        for table in ("avx2", "avx512"):
                            if not within(out[table][:, used], out["baseline"][:, used], bound):
                                self.fail(f"{table} differs from baseline: {where}")
                        if not same_bits(out["avx512"][:, used], out["avx2"][:, used]):
                            self.fail(f"not bitwise AVX2's: {where}")
                        for table in ("baseline", "avx2", "avx512"):
                            if not same_bits(out[table][:, rounded:], acc0[:, rounded:]):
                                self.fail(f"{table} wrote past the rounded d_v: {where}")

    def check_fp8_rows(self):
        """Every code of both formats, then random rows of every tail length,
        contiguous and strided, times scales of every kind (zeros of both
        signs, subnormals, the largest the formats allow), one scale for all
        rows and one per row: bit for bit NumPy's float32 product of the
        exactly widened code and the scale, on every table."""
        every_code = np.arange(256, dtype=np.uint8)
        for fmt, code in FP8_FORMATS.items():
            largest = {"e4m3fn": 448.0, "e5m2": 57344.0}[fmt]
            scales = np.array([0.0371, -2.5, 0.0, -0.0, 1e-40, 1.4e-45, 2.0 ** -126, 1e-30,
                               np.float32(F32_MAX / largest), -np.float32(F32_MAX / largest),
                               3e33, 1.0, 0.5, 7.0, 1.7e-38, 2.0 ** -149], np.float32)
            cases = [(every_code.reshape(8, 32), 1, 32, stride) for stride in (0, 1)]
            for offset in range(0, scales.size, 8):
                # every code times every scale (rows of one code each)
                cases.append((np.tile(every_code, (8, 1)), 1, 256, 1, offset))
            for n_cols in range(1, 41):
                rows = self.rng.choice(every_code, (3, 2 * n_cols + 1)).astype(np.uint8)
                for src_col in (1, 2):
                    for stride in (0, 3):
                        cases.append((rows, src_col, n_cols, stride))
            for index, case in enumerate(cases):
                src, src_col, n_cols, stride = case[:4]
                n_rows = src.shape[0]
                if len(case) == 5:
                    row_scales = scales[case[4]:case[4] + n_rows]
                else:
                    row_scales = np.roll(scales, index)[:n_rows]
                scale = np.zeros(max(1, stride * n_rows), np.float32)
                if stride:
                    scale[::stride] = row_scales
                else:
                    scale[0] = row_scales[0]
                per_row = scale[::stride][:n_rows] if stride else np.repeat(scale[:1], n_rows)
                values = fp8_widened(src[:, :src_col * n_cols:src_col], fmt)
                with np.errstate(invalid="ignore", over="ignore"):
                    expected = np.full((n_rows, n_cols + 1), 9.0, np.float32)
                    expected[:, :n_cols] = values * per_row[:, None]
                where = f"{fmt} n_cols={n_cols} src_col={src_col} scale_stride={stride}"
                for table in ("baseline", "avx2", "avx512"):
                    self.m.reset_arena()
                    dst_at, dst = self.m.empty((n_rows, n_cols + 1), np.float32, fill=9.0)
                    self.call(table, "fp8_rows_to_f32", [
                        self.ptr(self.m.put(src)), ("i", src.shape[1]), ("i", src_col),
                        ("i", n_rows), ("i", n_cols), ("i", code),
                        self.ptr(self.m.put(scale)), ("i", stride), self.ptr(dst_at),
                        ("i", n_cols + 1)])
                    equal = ((dst.view(np.uint32) == expected.view(np.uint32))
                             | (np.isnan(dst) & np.isnan(expected)))
                    if not equal.all():
                        r, c = np.argwhere(~equal)[0]
                        byte = f"{src[r, c * src_col]:#04x}" if c < n_cols else "none"
                        self.fail(f"{table} not the exact product: {where}, first at "
                                  f"({r}, {c}): code {byte} scale {per_row[r]!r}: "
                                  f"{dst[r, c]!r} vs {expected[r, c]!r}")

    # ---- conversions and packing: exact ----

    def check_rows_16(self, name):
        every_half = np.arange(1 << 16, dtype=np.uint16)
        cases = [(every_half.reshape(2048, 32), 1, 32)]
        for n_cols in range(1, 41):
            rows = self.rng.choice(every_half, (3, 2 * n_cols + 1))
            cases += [(rows, 1, n_cols), (rows, 2, n_cols)]
        for src, src_col, n_cols in cases:
            n_rows = src.shape[0]
            out = {}
            for table in ("baseline", "avx512"):
                self.m.reset_arena()
                dst_at, dst = self.m.empty((n_rows, n_cols + 1), np.float32, fill=9.0)
                self.call(table, name, [
                    self.ptr(self.m.put(src)), ("i", src.shape[1]), ("i", src_col),
                    ("i", n_rows), ("i", n_cols), self.ptr(dst_at), ("i", n_cols + 1)])
                out[table] = dst.copy()
            if not same_bits(out["avx512"], out["baseline"]):
                self.fail(f"differs from baseline: n_cols={n_cols} src_col={src_col}")

    def check_int8_rows(self):
        every_byte = np.arange(-128, 128, dtype=np.int8)
        cases = [(every_byte.reshape(8, 32), 1, 32)]
        for n_cols in range(1, 41):
            rows = self.rng.choice(every_byte, (3, 2 * n_cols + 1))
            cases += [(rows, 1, n_cols), (rows, 2, n_cols)]
        for src, src_col, n_cols in cases:
            n_rows = src.shape[0]
            scale = np.array([0.0371, -2.5, 0.0, 1e-30, 3e36, 1.0, 0.5, 7.0] * 256,
                             np.float32)[:2 * n_rows]
            out = {}
            for table in ("baseline", "avx512"):
                self.m.reset_arena()
                dst_at, dst = self.m.empty((n_rows, n_cols), np.float32, fill=9.0)
                self.call(table, "int8_rows_to_f32", [
                    self.ptr(self.m.put(src)), ("i", src.shape[1]), ("i", src_col),
                    ("i", n_rows), ("i", n_cols), self.ptr(self.m.put(scale)), ("i", 2),
                    self.ptr(dst_at), ("i", n_cols)])
                out[table] = dst.copy()
            if not same_bits(out["avx512"], out["baseline"]):
                self.fail(f"differs from baseline: n_cols={n_cols} src_col={src_col}")

    def check_pack_kt(self):
        for n_keys in range(1, 41):
            for d_k in list(range(1, 19)) + [31, 32, 33]:
                if n_keys > 20 and d_k not in (1, 16, 17, 33):
                    continue
                k = self.rng.standard_normal((n_keys, d_k + 2)).astype(np.float32)
                stride = d_k * 16 + 4
                size = -(-n_keys // 16) * stride
                out = {}
                for table in ("baseline", "avx512"):
                    self.m.reset_arena()
                    kt_at, kt = self.m.empty((size,), np.float32, fill=-3.0)
                    self.call(table, "pack_kt_f32", [
                        self.ptr(self.m.put(k)), ("i", d_k + 2), ("i", n_keys), ("i", d_k),
                        self.ptr(kt_at), ("i", stride)])
                    out[table] = kt.copy()
                if not same_bits(out["avx512"], out["baseline"]):
                    self.fail(f"differs from baseline: n_keys={n_keys} d_k={d_k}")

    def check_pack_v(self):
        for n_keys in range(1, 21):
            for d_v in range(1, 41):
                v = self.rng.standard_normal((n_keys, d_v + 1)).astype(np.float32)
                if (n_keys + d_v) % 5 == 0:
                    v[self.rng.integers(n_keys), self.rng.integers(d_v)] = \
                        [np.nan, np.inf, -np.inf][d_v % 3]
                if d_v % 7 == 0:
                    v[:, d_v] = np.nan          # past d_v: never read
                n_panels = -(-d_v // 16)
                stride = n_keys * 16 + 4
                out, flags = {}, {}
                for table in ("baseline", "avx512"):
                    self.m.reset_arena()
                    dst_at, dst = self.m.empty((n_panels * stride,), np.float32, fill=-3.0)
                    flags[table] = self.call(table, "pack_v_f32", [
                        self.ptr(self.m.put(v)), ("i", d_v + 1), ("i", n_keys), ("i", d_v),
                        self.ptr(dst_at), ("i", stride)], returns="i")
                    out[table] = dst.copy()
                where = f"n_keys={n_keys} d_v={d_v}"
                if not same_bits(out["avx512"], out["baseline"]):
                    self.fail(f"differs from baseline: {where}")
                if bool(flags["avx512"]) != bool(flags["baseline"]):
                    self.fail(f"non-finite flag {flags['avx512']} vs {flags['baseline']}: {where}")

    def run(self, name):
        self.failures = []
        dtype = np.float64 if name.endswith("f64") else np.float32
        dispatch = {
            "score": lambda: self.check_score(dtype),
            "pv": lambda: self.check_pv(dtype),
            "row_max": lambda: self.check_row_max(dtype),
            "exp_sum": lambda: self.check_exp_sum(dtype),
            "divide_rows": lambda: self.check_divide_rows(dtype),
            "score_direct": lambda: self.check_score_direct(dtype),
            "pv_direct": lambda: self.check_pv_direct(dtype),
            "half_rows_to": lambda: self.check_rows_16("half_rows_to_f32"),
            "bf16_rows_to": lambda: self.check_rows_16("bf16_rows_to_f32"),
            "softcap": self.check_softcap,
            "pack_kt": self.check_pack_kt,
            "pack_v": self.check_pack_v,
            "int8_rows_to": self.check_int8_rows,
            "fp8_rows_to": self.check_fp8_rows,
        }
        if name in ("score_direct_f16", "score_direct_bf16"):
            self.check_score_direct_16(name.rsplit("_", 1)[1])
        elif name in ("pv_direct_f16", "pv_direct_bf16"):
            self.check_pv_direct_16(name.rsplit("_", 1)[1])
        elif name == "score_direct_i8":
            self.check_score_direct_i8()
        elif name == "pv_direct_i8":
            self.check_pv_direct_i8()
        elif name == "score_direct_fp8":
            self.check_score_direct_fp8()
        elif name == "pv_direct_fp8":
            self.check_pv_direct_fp8()
        else:
            dispatch[name.rsplit("_", 1)[0]]()
        return list(self.failures)


def dispatch_choices(machine):
    """What dispatch.c chooses on the emulated Skylake-X, with the OS saving
    the ZMM state (XCR0 = 0xE7) and without it (0x07, AVX only): the tables
    it calls runnable and the default one."""
    choices = {}
    for label, xcr0 in (("zmm_enabled", 0xE7), ("zmm_disabled", 0x07)):
        machine.reset_arena()
        names_at, _ = machine.empty((8,), np.uint64)
        n = machine.call(machine.symbols["ca_available_kernels"], [("i", names_at), ("i", 8)],
                         returns="i", xcr0=xcr0)
        pointers = machine.read(names_at, np.uint64, n)
        default = machine.call(machine.symbols["ca_default_kernels"], [], returns="p", xcr0=xcr0)
        by_address = {machine.symbols[symbol]: name
                      for name, symbol in x86_emulator.TABLES.items()}
        choices[label] = {"available": [machine.read_string(int(p)) for p in pointers],
                          "default": by_address.get(default, hex(default))}
    return choices


def instruction_counts(machine, rows=48, cols=128, depth=64):
    """Emulated instructions per floating-point operation of one score and
    one P.V call of rows x cols x depth, per table and dtype."""
    rng = np.random.default_rng(7)
    counts = {}
    for dtype in (np.float32, np.float64):
        P = PANEL[dtype]
        suffix = SUFFIX[dtype]
        flops = 2 * rows * cols * depth
        for table in ("avx2", "avx512"):
            machine.reset_arena()
            q_at = machine.put(rng.standard_normal((rows, depth)).astype(dtype))
            kt_at = machine.put(rng.standard_normal(cols * depth).astype(dtype))
            s_at, _ = machine.empty((rows, cols), dtype)
            _, n_score = machine.call(machine.tables[table]["score_" + suffix], [
                ("i", q_at), ("i", depth), ("i", rows), ("i", kt_at), ("i", depth * P),
                ("i", cols), ("i", depth), (CODE[dtype], 0.125), ("i", s_at), ("i", cols),
                ("i", 0), ("i", 0)], count=True)
            # P.V: rows x depth keys times depth x cols values
            p_at = machine.put(rng.random((rows, depth)).astype(dtype))
            v_at = machine.put(rng.standard_normal(depth * cols).astype(dtype))
            acc_at, _ = machine.empty((rows, cols), dtype)
            _, n_pv = machine.call(machine.tables[table]["pv_" + suffix], [
                ("i", p_at), ("i", depth), ("i", rows), ("i", v_at), ("i", depth * P),
                ("i", depth), ("i", cols), ("i", acc_at), ("i", cols), ("i", 0), ("i", 0)],
                count=True)
            counts[f"score_{suffix}/{table}"] = n_score / flops
            counts[f"pv_{suffix}/{table}"] = n_pv / flops
    return counts


def main():
    machine = x86_emulator.Machine()
    checks = Checks(machine)
    report = {"checks": {}, "counts": {}, "dispatch": {}, "cpuid7_ecx": None}
    for name in CHECKS:
        try:
            report["checks"][name] = checks.run(name)
        except x86_emulator.EmulationError as exc:
            report["checks"][name] = [f"emulation failed: {exc}"]
    report["counts"] = instruction_counts(machine)
    report["dispatch"] = dispatch_choices(machine)
    report["cpuid7_ecx"] = machine.call(machine.symbols["ca_image_cpuid7_ecx"], [], returns="i")
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    # skip interpreter teardown of the emulator's objects (see x86_emulator)
    import os
    os._exit(0)


if __name__ == "__main__":
    main()
