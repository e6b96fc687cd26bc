"""The one import point of the compiled extension (``driver``), loaded so
that its OpenMP threads yield the cores soon.

After a parallel region GNU OpenMP's worker threads busy-wait for the next
one, by default for about 300,000 spins (milliseconds). Inside a NumPy
pipeline the next call is usually a BLAS call, whose own threads then find
their cores taken, and OpenBLAS's workers spin in turn and take ours, so
both calls wait for cores that are only spinning. With 1,000 spins (tens of
microseconds) our threads still catch back-to-back calls of ours, then
sleep; the measured figures are in BENCHMARKS.md. Every module reaches the extension through
this one, so the setting holds whichever is imported first.

libgomp reads ``GOMP_SPINCOUNT`` once, when it is loaded: it is set in the
environment just for the import of the extension (which loads the runtime)
and removed again, so that child processes and other OpenMP runtimes loaded
later see the environment as it was. A user who sets ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` keeps their choice. A wheel carries its own copy of
libgomp, so the setting reaches only cattention's threads; a source build
shares the system libgomp, and if another extension loaded it first, the
runtime keeps the policy it started with (``show_config()`` says which).
"""

from __future__ import annotations

import os
import sys

#: Spins of a GNU OpenMP worker before it sleeps, unless the user chose.
SPIN_COUNT = "1000"

_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _mapped_files() -> str:
    """The shared objects mapped into this process (Linux), else ""."""
    try:
        with open("/proc/self/maps") as maps:
            return maps.read()
    except OSError:
        return ""


def _load() -> str:
    """Import the extension; the wait policy its OpenMP threads follow."""
    user_choice = [f"{name}={os.environ[name]}" for name in _USER_SETTINGS
                   if name in os.environ]
    if user_choice:
        from ._driver import extension  # noqa: F401 (loaded, to be bound below)
        return f"{', '.join(user_choice)} (from the environment)"
    before = _mapped_files() if sys.platform.startswith("linux") else ""
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        from ._driver import extension
    finally:
        del os.environ["GOMP_SPINCOUNT"]
    runtime = extension.openmp_runtime()
    if not extension.openmp_enabled():
        return "none (serial build)"
    if "libgomp" not in os.path.basename(runtime):
        return f"the runtime's own ({os.path.basename(runtime) or 'unknown'})"
    if runtime and os.path.realpath(runtime) in before or (runtime and runtime in before):
        return ("the runtime's own: it was loaded before cattention "
                "(set GOMP_SPINCOUNT=1000 before starting Python)")
    return f"GOMP_SPINCOUNT={SPIN_COUNT}, then sleep (set by cattention)"


wait_policy = _load()
# bound here, after _load imported it with the wait policy above
from ._driver import extension as driver  # noqa: E402

__all__ = ["driver", "wait_policy"]
