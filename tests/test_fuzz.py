"""A bounded run of the fuzz harness (tools/fuzz_attention.py) on
pseudo-random inputs; `make fuzz` runs it coverage-guided under the
sanitizers."""

import numpy as np

import sys
from pathlib import Path

# the harness is a tool beside the tests (tools/fuzz_attention.py)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from fuzz_attention import check_input  # noqa: E402


def test_fuzz_harness_bounded_run():
    rng = np.random.default_rng(2024)
    for _ in range(1500):
        check_input(rng.integers(0, 256, size=int(rng.integers(0, 48)), dtype=np.uint8).tobytes())
