"""The AVX-512 kernel table, verified without AVX-512 hardware: every kernel
runs on an emulated Skylake-X (Bochs, through bochscpu-python, a test
requirement) against the portable table and, where the arithmetic is the
same, the AVX2 table (tests/emulated_kernel_checks.py, in a process of its
own). A missing emulator fails these tests rather than skipping them: an
AVX-512 table nobody ran is not a tested one.

The emulator also counts instructions: per floating-point operation, the
score and P.V kernels of the AVX-512 table (6 x 64 register tiles) must
need at most 0.55 of what the AVX2 ones (6 x 16) need, the sign that the
wider tiles are in use.
"""

import json
import platform
import subprocess
import sys

import pytest

import emulated_kernel_checks

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")),
    reason="the x86 emulator and the x86 kernels need an x86-64 Linux host")


@pytest.fixture(scope="module")
def report():
    try:
        emulated_kernel_checks.x86_emulator.import_bochscpu()
    except ImportError as exc:
        if "__isoc23" not in str(exc):      # the old-glibc case is handled in the worker
            pytest.fail(f"bochscpu-python==0.4.0 (a test requirement) is needed: {exc}")
    # the timeout stops a kernel that never returns (the emulator cannot be
    # interrupted from another thread); the checks take a few seconds
    run = subprocess.run([sys.executable, emulated_kernel_checks.__file__],
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        pytest.fail(f"the emulated checks did not run:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_emulated_cpu_is_skylake_x(report):
    """The model without AVX512_VBMI (CPUID.7.0:ECX bit 1), so that a kernel
    using more than F, CD, BW, DQ and VL would fault."""
    assert report["cpuid7_ecx"] & (1 << 1) == 0


@pytest.mark.parametrize("kernel", emulated_kernel_checks.CHECKS)
def test_avx512_kernel_matches_portable(report, kernel):
    failures = report["checks"][kernel]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kernel", ["score_f32", "pv_f32", "score_f64", "pv_f64"])
def test_avx512_tiles_need_fewer_instructions(report, kernel):
    avx2 = report["counts"][f"{kernel}/avx2"]
    avx512 = report["counts"][f"{kernel}/avx512"]
    assert avx512 <= 0.55 * avx2, (
        f"{kernel}: {avx512:.4f} instructions per flop on AVX-512, {avx2:.4f} on AVX2")


def test_dispatch_picks_avx512_only_with_zmm_state(report):
    """CPUID of the emulated Skylake-X reports AVX-512; XGETBV decides."""
    enabled, disabled = report["dispatch"]["zmm_enabled"], report["dispatch"]["zmm_disabled"]
    assert enabled == {"available": ["baseline", "avx2", "avx512"], "default": "avx512"}
    assert disabled == {"available": ["baseline", "avx2"], "default": "avx2"}


def test_avx512_table_is_compiled_in():
    from cattention._native import driver as _attention
    assert "avx512" in list(_attention.compiled_simd())
