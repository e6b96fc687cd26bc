"""A bounded run of the fuzz harness (tests/fuzz_attention.py) on
pseudo-random inputs; `make fuzz` runs it coverage-guided under the
sanitizers."""

import numpy as np

from fuzz_attention import check_input


def test_fuzz_harness_bounded_run():
    rng = np.random.default_rng(2024)
    for _ in range(1500):
        check_input(rng.integers(0, 256, size=int(rng.integers(0, 48)), dtype=np.uint8).tobytes())
