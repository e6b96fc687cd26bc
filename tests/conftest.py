"""Shared fixtures for the cattention test suite.

Helpers that are plain functions (reference implementation, tolerance rule,
bitwise comparison) live in ``reference.py``; this file only holds fixtures.
"""

import os

import numpy as np
import pytest

#: Placeholder parameter used when the private SIMD API cannot be queried.
#: The ``simd`` fixture then runs the tests once on the default path, and
#: ``test_core.py::test_private_simd_api`` fails to report the missing API.
NO_SIMD_API = "default (private SIMD API unavailable)"


def _simd_levels():
    try:
        from cattention._native import driver as _attention
        levels = list(_attention.available_simd())
    except Exception:  # not built yet, or private API missing
        return [NO_SIMD_API]
    return levels or [NO_SIMD_API]


def pytest_configure(config):
    # registered here as well as in pyproject.toml, so the suite runs the same
    # from a copy outside the source tree (against an installed wheel)
    config.addinivalue_line(
        "markers", "slow: long-running stress and fuzz profiles (make reliability)")


def pytest_report_header(config):
    try:
        import cattention
    except Exception as exc:  # pragma: no cover - only when unbuilt
        return f"cattention: not importable ({exc!r})"
    return (f"cattention {getattr(cattention, '__version__', '?')} "
            f"from {os.path.dirname(cattention.__file__)}, "
            f"SIMD levels under test: {_simd_levels()}")


@pytest.fixture(params=_simd_levels())
def simd(request):
    """Run the test once per available SIMD code path, restoring it afterwards."""
    name = request.param
    if name == NO_SIMD_API:
        yield None
        return
    from cattention._native import driver as _attention
    previous = _attention.get_simd()
    _attention.set_simd(name)
    try:
        assert _attention.get_simd() == name
        yield name
    finally:
        _attention.set_simd(previous)


@pytest.fixture(params=[np.float32, np.float64], ids=["float32", "float64"])
def dtype(request):
    return request.param


@pytest.fixture(autouse=True)
def restore_threads():
    """Put the global thread count back to its default after every test.

    ``set_num_threads(None)`` is the documented way to restore the default; if
    the implementation rejects it, fall back to the value seen before the test
    (``test_threads.py::test_set_num_threads_none_restores_default`` reports
    the missing feature).
    """
    import cattention as ca
    before = ca.get_num_threads()
    yield
    try:
        ca.set_num_threads(None)
    except (TypeError, ValueError):
        ca.set_num_threads(before)


@pytest.fixture
def general_path(monkeypatch):
    """general_path(name): a context in which the compiled entry ``name`` of
    the driver hands every call to the general path (so that a test can
    compare the two ways in on one call)."""
    import contextlib
    from cattention._native import driver as _attention

    @contextlib.contextmanager
    def forced(name):
        with monkeypatch.context() as patch:
            patch.setattr(_attention, name, lambda *args: None)
            yield
    return forced


@pytest.fixture
def compiled_path(monkeypatch):
    """compiled_path(name): a list that gets True for each call of the
    compiled entry ``name`` of the driver (cattention._native.driver) that took the call,
    False for each it handed to the general path."""
    from cattention._native import driver as _attention

    def record(name):
        taken = []
        compiled = getattr(_attention, name)

        def recording(*args):
            result = compiled(*args)
            taken.append(result is not None)
            return result

        monkeypatch.setattr(_attention, name, recording)
        return taken
    return record
