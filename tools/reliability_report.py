"""The reliability figures in one table (`make reliability`).

Runs, in this order, and prints one table at the end:

* every hypothesis property of tests/test_properties.py under the "long"
  profile, counting the examples each ran and whether it failed;
* the worst error of random problems against the float32/float64 tolerance
  rule, as a ratio of the allowed bound (below 1 passes);
* 16 Python threads x 200 mixed calls against precomputed results;
* resident-memory growth over 20,000 calls on the success and error paths;
* the test suite under AddressSanitizer + UBSan (`make asan`): reports;
* the fuzz harness under the sanitizers (`make fuzz`): executions, crashes.

Usage: python tools/reliability_report.py [--fuzz-seconds N] [--skip-sanitizers]
"""

import argparse
import os
import re
import subprocess
import sys

os.environ.setdefault("CATTENTION_HYPOTHESIS_PROFILE", "long")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "tests")   # the properties and stress checks it runs
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import cattention as ca  # noqa: E402
import test_properties  # noqa: E402
from test_stress import rss_growth_kib, run_concurrent_calls  # noqa: E402
from reference import (  # noqa: E402
    F32_RTOL_MAX,
    F32_RTOL_RMS,
    float32_ulp_atol,
    make_qkv,
    max_abs_err,
    numpy_attention_f32,
    reference_attention,
    rms_err,
)

PROPERTIES = [
    "test_matches_reference",
    "test_scores_are_a_distribution_and_attn_is_scores_times_v",
    "test_bitwise_across_layouts_and_threads",
    "test_adding_a_vector_to_every_key_changes_nothing",
    "test_permuting_the_batch_permutes_the_output",
    "test_nan_in_never_attended_keys_and_values_has_no_effect",
]


def run_properties():
    """{name: (examples, failed)} under the long hypothesis profile."""
    results = {}
    for name in PROPERTIES:
        test = getattr(test_properties, name)
        calls = [0]
        inner = test.hypothesis.inner_test

        def counted(*args, _inner=inner, **kwargs):
            calls[0] += 1
            return _inner(*args, **kwargs)

        test.hypothesis.inner_test = counted
        try:
            test()
            failed = False
        except Exception:  # a falsifying example: reported in the table
            failed = True
        finally:
            test.hypothesis.inner_test = inner
        results[name] = (calls[0], failed)
    return results


def worst_error_ratios(n_problems=400):
    """{dtype: worst error / allowed bound} over random problems."""
    rng = np.random.default_rng(7)
    worst = {"float32": 0.0, "float64": 0.0}
    for i in range(n_problems):
        T, S = (int(x) for x in rng.integers(1, 300, size=2))
        d_k, d_v = (int(x) for x in rng.integers(1, 130, size=2))
        causal = bool(rng.integers(0, 2))
        for dtype in (np.float32, np.float64):
            q, k, v = make_qkv(1000 + i, (T, d_k), (S, d_k), (S, d_v), dtype)
            got = ca.attention(q, k, v, causal=causal)
            ref, _ = reference_attention(q, k, v, causal)
            if dtype == np.float32:
                yard, _ = numpy_attention_f32(q, k, v, causal)
                atol = float32_ulp_atol(ref)
                rms_bound = F32_RTOL_RMS * rms_err(yard, ref) + atol + (
                    float32_ulp_atol(v) / np.sqrt(got.size))
                max_bound = F32_RTOL_MAX * max_abs_err(yard, ref) + max(
                    atol, float32_ulp_atol(v))
                ratio = max(rms_err(got, ref) / rms_bound,
                            max_abs_err(got, ref) / max_bound,
                            max_abs_err(got, ref) / 1e-5)
            else:
                ratio = max_abs_err(got, ref) / 1e-12
            name = np.dtype(dtype).name
            worst[name] = max(worst[name], ratio)
    return worst


def run_make(target, extra=()):
    proc = subprocess.run(["make", target, *extra], cwd=ROOT, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def sanitizer_reports():
    code, output = run_make("asan")
    reports = len(re.findall(r"ERROR: AddressSanitizer|runtime error:", output))
    summary = re.findall(r"(\d+) passed", output)
    return code, reports, int(summary[-1]) if summary else 0


def fuzz_figures(seconds):
    code, output = run_make("fuzz", [f"FUZZ_SECONDS={seconds}"])
    # both halves of make fuzz (the search, then the sanitized runs) report
    executed = re.findall(r"stat::number_of_executed_units:\s+(\d+)", output)
    crashes = len(re.findall(r"==\d+==ERROR|Uncaught Python exception|runtime error:", output))
    return code, sum(int(n) for n in executed), crashes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-seconds", type=int, default=300)
    parser.add_argument("--skip-sanitizers", action="store_true",
                        help="leave out make asan and make fuzz")
    args = parser.parse_args()

    rows = []
    properties = run_properties()
    for name, (examples, failed) in properties.items():
        rows.append((f"property {name[5:]}", f"{examples} examples",
                     "FAILED" if failed else "0 failures"))
    for dtype, ratio in worst_error_ratios().items():
        rows.append((f"worst error / allowed, {dtype}", f"{ratio:.2f}",
                     "ok" if ratio <= 1 else "OVER"))
    mismatches, exceptions, hung = run_concurrent_calls(16, 200)
    rows.append(("16 threads x 200 calls", f"{mismatches} mismatches, {exceptions} "
                 f"exceptions, {hung} hung", "ok" if not (mismatches or exceptions or hung)
                 else "FAILED"))
    for path, kib in rss_growth_kib().items():
        rows.append((f"RSS growth, 20,000 calls, {path} path", f"{kib} KiB",
                     "ok" if kib < 1024 else "OVER"))
    if not args.skip_sanitizers:
        code, reports, passed = sanitizer_reports()
        rows.append(("make asan (ASan + UBSan)", f"{passed} tests passed, {reports} reports",
                     "ok" if code == 0 and reports == 0 else "FAILED"))
        code, executed, crashes = fuzz_figures(args.fuzz_seconds)
        rows.append((f"make fuzz ({args.fuzz_seconds} s, half under sanitizers)",
                     f"{executed} executions, {crashes} crashes",
                     "ok" if code == 0 and crashes == 0 else "FAILED"))

    width = max(len(r[0]) for r in rows)
    middle = max(len(r[1]) for r in rows)
    print()
    print(f"{'check':<{width}}  {'figure':<{middle}}  verdict")
    print("-" * (width + middle + 11))
    for check, figure, verdict in rows:
        print(f"{check:<{width}}  {figure:<{middle}}  {verdict}")
    return 0 if all(r[2] in ("ok", "0 failures") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
