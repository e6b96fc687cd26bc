"""Thread counts: the process-wide setting, the per-Python-thread one, and
the check of a num_threads argument.

A call with ``num_threads=None`` uses :func:`limit_threads` of the calling
Python thread, else :func:`set_num_threads`, else OpenMP's current maximum.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, SupportsIndex

from . import _attention
from ._checks import _as_integer

__all__ = ["get_num_threads", "limit_threads", "set_num_threads"]


class _ThreadLocalLimit(threading.local):
    """``_local.limit``: the thread count that applies to a call from this
    Python thread with num_threads=None: limit_threads(), else
    set_num_threads(), else None (OpenMP's current setting).

    set_num_threads() sets the class attribute, seen by every Python thread;
    limit_threads() sets an instance attribute, local to the thread, which
    shadows it. One attribute read answers a call (its fast path reads it)."""

    limit: int | None = None


_local = _ThreadLocalLimit()


def _current_limit() -> int | None:
    """The thread count that applies to a call from this Python thread with
    num_threads=None (see _ThreadLocalLimit)."""
    return _local.limit


def set_num_threads(n: SupportsIndex | None) -> None:
    """Set the number of threads used by calls that pass ``num_threads=None``.

    The setting is process-wide; a call's own ``num_threads`` overrides it.
    Results are bitwise the same for any thread count, so it changes speed
    only.

    Parameters
    ----------
    n : int or None
        A positive thread count, or None to follow OpenMP's current setting
        again (``OMP_NUM_THREADS``, ``threadpoolctl`` limits).

    Raises
    ------
    ValueError
        If ``n`` is neither None nor a positive integer (a bool is refused).

    See Also
    --------
    get_num_threads

    Examples
    --------
    >>> import cattention as ca
    >>> ca.set_num_threads(2)
    >>> ca.get_num_threads()
    2
    >>> ca.set_num_threads(None)  # follow OpenMP again
    """
    _ThreadLocalLimit.limit = None if n is None else _check_num_threads(n, "n")


def get_num_threads() -> int:
    """Number of threads a call with ``num_threads=None`` would use (at most).

    A small problem may use fewer.

    Returns
    -------
    int
        The count given to :func:`set_num_threads`; without one, OpenMP's
        current maximum for a parallel region started by the calling thread
        (``OMP_NUM_THREADS``, ``threadpoolctl`` limits, else the number of
        cores), which is 1 for a build without OpenMP.

    See Also
    --------
    set_num_threads

    Examples
    --------
    >>> import cattention as ca
    >>> ca.get_num_threads() >= 1
    True
    >>> ca.set_num_threads(3)
    >>> ca.get_num_threads()
    3
    >>> ca.set_num_threads(None)
    """
    limit = _current_limit()
    if limit is not None:
        return 1 if _attention.forked_after_parallel() else limit
    return max(1, _attention.max_threads())


@contextlib.contextmanager
def limit_threads(n: SupportsIndex | None) -> Iterator[None]:
    """Set the thread count of calls made by the current Python thread, for
    the duration of a ``with`` block.

    A service that calls cattention from many Python threads (a thread pool,
    a web server's workers) should run each call on one OpenMP thread, or on
    a share of the cores: otherwise every caller starts a team of
    :func:`get_num_threads` threads and they compete for the same cores. The
    setting is local to the calling Python thread, overrides
    :func:`set_num_threads`, and is overridden by a call's own
    ``num_threads``. Blocks nest; the previous setting is restored on exit.

    Parameters
    ----------
    n : int or None
        A positive thread count, or None for no thread-local setting inside
        the block.

    Raises
    ------
    ValueError
        If ``n`` is neither None nor a positive integer.

    See Also
    --------
    set_num_threads, get_num_threads

    Examples
    --------
    >>> import cattention as ca
    >>> with ca.limit_threads(1):
    ...     ca.get_num_threads()
    1

    In a thread pool, each task runs under the limit:

    >>> from concurrent.futures import ThreadPoolExecutor
    >>> import numpy as np
    >>> q = np.ones((4, 16, 8), np.float32)
    >>> def task(x):
    ...     with ca.limit_threads(1):
    ...         return ca.attention(x, x, x)
    >>> with ThreadPoolExecutor(4) as pool:
    ...     results = list(pool.map(task, [q] * 8))
    >>> len(results)
    8
    """
    value = None if n is None else _check_num_threads(n, "n")
    # this Python thread's own attributes: "limit" is there only as a count
    # (never None), so absent means set_num_threads() applies
    own = vars(_local)
    previous = own.get("limit")
    _set_own_limit(own, value)
    try:
        yield
    finally:
        _set_own_limit(own, previous)


def _set_own_limit(own: dict[str, Any], value: int | None) -> None:
    if value is None:
        own.pop("limit", None)
    else:
        own["limit"] = value


def _check_num_threads(n: Any, name: str = "num_threads") -> int:
    value = _as_integer(n)
    if value is None:
        raise ValueError(f"{name} must be a positive integer thread count, got {n!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer thread count, got {value}")
    if value > _attention.MAX_NUM_THREADS:
        raise ValueError(f"{name} must be at most {_attention.MAX_NUM_THREADS} "
                         f"(OpenMP's limit), got {value}")
    return value
