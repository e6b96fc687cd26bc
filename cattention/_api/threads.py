"""Public: thread counts, the process-wide setting and the per-Python-thread
one (the check of a count is the driver's, checks.pxd).

A call with ``num_threads=None`` uses :func:`limit_threads` of the calling
Python thread, else :func:`set_num_threads`, else OpenMP's current maximum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, SupportsIndex

from .._native import driver
from .._prepare.options import ThreadLocalLimit, local

__all__ = ["get_num_threads", "limit_threads", "set_num_threads"]


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
    ThreadLocalLimit.limit = None if n is None else driver.check_num_threads(n, "n")


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
    limit = local.limit
    if limit is not None:
        return 1 if driver.forked_after_parallel() else limit
    return max(1, driver.max_threads())


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
    value = None if n is None else driver.check_num_threads(n, "n")
    # this Python thread's own attributes: "limit" is there only as a count
    # (never None), so absent means set_num_threads() applies
    own = vars(local)
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
