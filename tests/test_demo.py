"""``python -m cattention`` (``make run``): the demo's table times what it says.

NumPy's OpenBLAS workers keep spinning on a core for about 0.1 s after every
matmul; a cattention call timed right after NumPy's reference ran at its
one-thread speed while the table said 2 threads. The demo therefore waits
before timing cattention when it uses more than one thread, and says so.
"""

import pytest

import cattention as ca
import cattention.__main__ as cli


@pytest.fixture
def events(monkeypatch):
    """The demo's sleeps, cattention calls and NumPy calls, in order."""
    log = []
    real_attention, real_numpy = cli.attention, cli._numpy_attention

    def attention(*args, **kwargs):
        log.append(("attention", None))
        return real_attention(*args, **kwargs)

    def numpy_attention(*args):
        log.append(("numpy", None))
        return real_numpy(*args)

    monkeypatch.setattr(cli, "attention", attention)
    monkeypatch.setattr(cli, "_numpy_attention", numpy_attention)
    monkeypatch.setattr(cli.time, "sleep", lambda seconds: log.append(("sleep", seconds)))
    return log


def run(threads, capsys):
    with ca.limit_threads(threads):
        status = cli.main(["demo", "--queries", "24", "--keys", "40", "--dim", "8",
                           "--repeats", "2"])
    return status, capsys.readouterr().out


def test_with_threads_cattention_is_timed_after_the_blas_workers_settle(events, capsys):
    status, out = run(2, capsys)
    assert status == 0 and "2 threads" in out
    assert "cattention timed after a 0.25 s pause" in out
    # every cattention call that follows a NumPy call has a pause of at
    # least 0.1 s (the workers' spin) in between
    last_numpy, paused, checked = None, 0.0, 0
    for kind, seconds in events:
        if kind == "numpy":
            last_numpy, paused = True, 0.0
        elif kind == "sleep":
            paused += seconds
        elif last_numpy:
            assert paused >= 0.1, events
            last_numpy = None
            checked += 1
    assert checked == 3   # the three cases after the first (which follows none)
    assert sum(kind == "attention" for kind, _ in events) == 4 * 4   # warm-up, 2 timed, check


def test_on_one_thread_there_is_no_pause(events, capsys):
    status, out = run(1, capsys)
    assert status == 0 and "2 runs, 1 thread\n" in out
    assert not [e for e in events if e[0] == "sleep"]
    assert "pause" not in out
