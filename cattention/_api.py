"""Public API: validation, dtype and broadcast normalisation, output allocation.

Nothing here loops over data. Inputs are checked and brought to one compute
dtype (float32 or float64), made aligned when they are not, and handed with
their strides to the Cython driver, which reads any layout (transposed,
negative or zero strides) without copying.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Literal, SupportsIndex, cast, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from . import _attention
from ._quantize import int8_scale

__all__ = [
    "attention",
    "attention_scores",
    "get_num_threads",
    "limit_threads",
    "merge",
    "set_num_threads",
]

_SUPPORTED_DTYPES = (
    "float16, float32 and float64 (integer and bool inputs are computed as float64)"
)

# Thread count set by set_num_threads(); None follows OpenMP's current setting.
_thread_limit: int | None = None

class _ThreadLocalLimit(threading.local):
    """Thread count of calls from one Python thread, set by limit_threads()."""

    # a class attribute: reading an unset one costs no AttributeError
    limit: int | None = None


_local = _ThreadLocalLimit()


def _current_limit() -> int | None:
    """The thread count that applies to a call from this Python thread with
    num_threads=None: limit_threads(), else set_num_threads(), else None."""
    limit = _local.limit
    return _thread_limit if limit is None else limit

_FloatArray = NDArray[np.floating[Any]]


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
    global _thread_limit
    _thread_limit = None if n is None else _check_num_threads(n)


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
    value = None if n is None else _check_num_threads(n)
    previous = _local.limit
    _local.limit = value
    try:
        yield
    finally:
        _local.limit = previous


def _check_num_threads(n: Any) -> int:
    if isinstance(n, (bool, np.bool_)):
        raise ValueError(f"num_threads must be a positive integer, got {n!r}")
    try:
        value = operator.index(n)
    except TypeError:
        raise ValueError(f"num_threads must be a positive integer, got {n!r}") from None
    if value < 1:
        raise ValueError(f"num_threads must be a positive integer, got {value}")
    if value > _attention.MAX_NUM_THREADS:
        raise ValueError(f"num_threads must be at most {_attention.MAX_NUM_THREADS} "
                         f"(OpenMP's limit), got {value}")
    return value


def _check_flag(value: object, name: str) -> bool:
    """A bool option: a string or an array is refused, not read as its truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return bool(value)


def _native(arr: NDArray[Any]) -> NDArray[Any]:
    """arr in the machine's byte order: a big-endian array (np.load of a
    ">f4" file, FITS, HDF5, np.frombuffer) is converted, so the kernels
    never read swapped bytes as numbers."""
    if arr.dtype.isnative:
        return arr
    return arr.astype(arr.dtype.newbyteorder("="))


def _as_input(x: ArrayLike, name: str) -> NDArray[Any]:
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    try:
        arr = np.asarray(x)
    except ValueError as exc:
        # e.g. a ragged nested list: NumPy's message does not say which argument
        raise ValueError(f"{name} is not a regular array: {exc}") from None
    if arr.dtype.kind not in "fiub" or arr.dtype.itemsize > 8:
        raise TypeError(
            f"{name} has dtype {arr.dtype}; cattention supports {_SUPPORTED_DTYPES}")
    arr = _native(arr)
    if arr.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., rows, features); "
            f"got shape {arr.shape}")
    return arr


def _compute_dtype(*arrays: NDArray[Any]) -> tuple[np.dtype[Any], np.dtype[Any]]:
    """(compute dtype, result dtype) for the inputs, by np.result_type."""
    common = np.result_type(*arrays)
    if common.kind in "iub":
        return np.dtype(np.float64), np.dtype(np.float64)
    if common == np.float16:
        return np.dtype(np.float32), np.dtype(np.float16)
    return common, common


def _to_compute(arr: NDArray[Any], dtype: np.dtype[Any]) -> NDArray[Any]:
    """arr as dtype, copied only if the dtype differs or the kernel cannot read it."""
    if arr.dtype != dtype:
        return arr.astype(dtype)
    if not arr.flags.aligned or any(s % arr.itemsize for s in arr.strides):
        # same bits, aligned and element-strided, so results are unchanged
        return np.array(arr, order="C")
    return arr


def _prepare_mask(mask: ArrayLike, n_queries: int, n_keys: int,
                  dtype: np.dtype[Any]) -> NDArray[Any]:
    arr = _native(np.asarray(mask))
    given_shape = arr.shape
    if arr.dtype == np.bool_:
        pass
    elif arr.dtype.kind == "f":
        if arr.dtype not in (np.float32, np.float64):
            arr = arr.astype(dtype)
    else:
        raise TypeError(
            f"mask has dtype {arr.dtype}; it must be bool (True = may attend) or "
            "float (added to the scaled logits, -inf masks)")
    if arr.ndim < 2:
        arr = arr.reshape((1,) * (2 - arr.ndim) + arr.shape)
    if arr.shape[-2] not in (1, n_queries) or arr.shape[-1] not in (1, n_keys):
        raise ValueError(
            f"mask of shape {given_shape} does not broadcast to (..., T, S) = "
            f"(..., {n_queries}, {n_keys})")
    if not arr.flags.aligned or any(s % arr.itemsize for s in arr.strides):
        arr = np.array(arr, order="C")
    return arr


def _resolve_scale(scale: object, d_k: int) -> float:
    if scale is None:
        if d_k == 0:
            raise ValueError(
                "d_k is 0 (q and k have shape (..., T, 0) and (..., S, 0)), so the "
                "default scale 1/sqrt(d_k) is undefined; pass scale explicitly")
        return 1.0 / math.sqrt(d_k)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {scale!r}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def _check_scale_fits(scale: float, compute: np.dtype[Any]) -> None:
    """The kernels multiply in the compute dtype: a scale it cannot hold
    would turn every logit into inf (then NaN) or 0."""
    info = np.finfo(compute)
    if scale != 0 and not (float(info.smallest_subnormal) <= abs(scale) <= float(info.max)):
        raise ValueError(
            f"scale {scale!r} is not representable in {compute} (the compute dtype of "
            f"these inputs): |scale| must be 0 or lie in [{info.smallest_subnormal}, "
            f"{info.max}]")


def _split_head_axis(arr: ArrayLike | None, n_heads: int, n_kv_heads: int, what: str,
                     q_batch: tuple[int, ...]) -> NDArray[Any] | None:
    """An array broadcast against q's leading dimensions (heads last), with
    its head axis split to (H_kv, G) or, if 1, widened to (1, 1)."""
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.ndim == 0:
        return arr
    if arr.shape[-1] == n_heads and n_heads != 1:
        return arr.reshape(arr.shape[:-1] + (n_kv_heads, n_heads // n_kv_heads))
    if arr.shape[-1] == 1:
        return arr[..., None]
    raise ValueError(
        f"{what} of shape {arr.shape} does not broadcast to the batch dimensions "
        f"{q_batch} of q")


def _group_query_heads(
        q: NDArray[Any], k: NDArray[Any], v: NDArray[Any] | None, mask: ArrayLike | None,
        kv_lengths: ArrayLike | None, alibi_slopes: ArrayLike | None = None,
        sinks: ArrayLike | None = None,
) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any] | None, NDArray[Any] | None,
           NDArray[Any] | None, NDArray[Any] | None, NDArray[Any] | None, int]:
    """Views for grouped-query attention: q (..., H, T, d) becomes
    (..., H_kv, G, T, d) and k, v (..., H_kv, S, d) become (..., H_kv, 1, S, d),
    so ordinary batch broadcasting pairs query head h with key/value head
    h // G, without copying K or V (they are packed once per K/V head)."""
    operands = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, arr in operands:
        if arr.ndim < 3:
            raise ValueError(
                "enable_gqa needs a head axis (-3) on q, k and v; "
                f"{name} has shape {arr.shape}")
    n_heads, n_kv_heads = q.shape[-3], k.shape[-3]
    if v is not None and v.shape[-3] != n_kv_heads:
        raise ValueError(
            f"enable_gqa: k and v must have the same number of heads (axis -3): "
            f"k has shape {k.shape}, v has shape {v.shape}")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(
            f"enable_gqa: the query heads ({n_heads}, q shape {q.shape}) must be a "
            f"multiple of the key/value heads ({n_kv_heads}, k shape {k.shape})")
    group = n_heads // n_kv_heads
    # splitting one axis in two, or adding a unit axis, never copies
    q = q.reshape(q.shape[:-3] + (n_kv_heads, group) + q.shape[-2:])
    k = k[..., None, :, :]
    if v is not None:
        v = v[..., None, :, :]
    if mask is not None:
        mask = np.asarray(mask)
        if mask.ndim >= 3 and mask.shape[-3] == n_heads and n_heads != 1:
            mask = mask.reshape(mask.shape[:-3] + (n_kv_heads, group) + mask.shape[-2:])
        elif mask.ndim >= 3:
            if mask.shape[-3] != 1:
                raise ValueError(
                    f"mask of shape {mask.shape} does not broadcast to the {n_heads} "
                    f"query heads of q (shape {q.shape[:-4] + (n_heads,) + q.shape[-2:]})")
            mask = mask[..., None, :, :]
    q_batch = q.shape[:-4] + (n_heads,)
    kv_lengths = _split_head_axis(kv_lengths, n_heads, n_kv_heads, "kv_lengths", q_batch)
    alibi_slopes = _split_head_axis(alibi_slopes, n_heads, n_kv_heads, "alibi_slopes",
                                    q_batch)
    sinks = _split_head_axis(sinks, n_heads, n_kv_heads, "sinks", q_batch)
    return q, k, v, mask, kv_lengths, alibi_slopes, sinks, n_heads


def _check_window(window: Any, causal: bool) -> tuple[int, int]:
    """(left, right) as ints, -1 for an unbounded side; causal forces right 0."""
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"window must be None or a (left, right) pair, got {window!r}") from None
    bounds = []
    for name, side in (("left", left), ("right", right)):
        if side is None:
            bounds.append(-1)
            continue
        if isinstance(side, (bool, np.bool_)):
            raise TypeError(f"window {name} must be an integer or None, got {side!r}")
        try:
            value = operator.index(side)
        except TypeError:
            raise TypeError(f"window {name} must be an integer or None, got {side!r}") from None
        if value < 0:
            raise ValueError(f"window {name} must be >= 0 (or None), got {value}")
        bounds.append(value)
    if causal:
        bounds[1] = 0
    return bounds[0], bounds[1]


def _check_softcap(softcap: object) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be None or a positive number, got {softcap!r}")
    value = float(softcap)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softcap must be a positive finite number, got {value}")
    return value


def _per_batch_entry(values: ArrayLike, batch_shape: tuple[int, ...], name: str, kinds: str,
                     kind_text: str, dtype: DTypeLike, hint: str) -> NDArray[Any]:
    """values broadcast to the batch shape: one per batch entry, C-contiguous."""
    arr = np.asarray(values)
    if arr.dtype.kind not in kinds:
        raise TypeError(f"{name} must be {kind_text}, got dtype {arr.dtype}")
    try:
        full = np.broadcast_to(arr, batch_shape)
    except ValueError:
        raise ValueError(
            f"{name} of shape {arr.shape} does not broadcast to the batch "
            f"shape {batch_shape} ({hint})") from None
    return np.ascontiguousarray(full, dtype=dtype).reshape(-1)


def _prepare_sinks(sinks: ArrayLike, batch_shape: tuple[int, ...]) -> NDArray[np.float64]:
    """One float64 sink logit per batch entry; -inf is no sink."""
    full = _per_batch_entry(_native(np.asarray(sinks)), batch_shape, "sinks", "fiu",
                            "real numbers", np.float64, "expected (H,) or (B, H)")
    if np.any(np.isnan(full)) or np.any(full == np.inf):
        raise ValueError("sinks must be finite, or -inf for no sink; got NaN or +inf")
    return full


def _prepare_alibi(alibi_slopes: ArrayLike, batch_shape: tuple[int, ...]) -> NDArray[np.float64]:
    """One float64 slope per batch entry."""
    full = _per_batch_entry(alibi_slopes, batch_shape, "alibi_slopes", "fiu",
                            "real numbers", np.float64, "expected (H,) or (B, H)")
    if not np.all(np.isfinite(full)):
        raise ValueError("alibi_slopes must be finite")
    return full


def _prepare_kv_lengths(kv_lengths: ArrayLike, batch_shape: tuple[int, ...],
                        n_keys: int) -> NDArray[np.intp]:
    """Valid key counts, one intp per batch entry."""
    full = _per_batch_entry(kv_lengths, batch_shape, "kv_lengths", "iu", "integers",
                            np.intp, "the dimensions before T")
    if full.size and (full.min() < 0 or full.max() > n_keys):
        raise ValueError(
            f"kv_lengths must lie in [0, S] = [0, {n_keys}]; got values from "
            f"{full.min()} to {full.max()}")
    return full


def _lengths_per_sequence(kv_lengths: ArrayLike, q: NDArray[Any], k: NDArray[Any],
                          v: NDArray[Any] | None) -> NDArray[Any]:
    """kv_lengths with a 1-D array of length B taken as one length per
    sequence (the first batch axis), as ``cache_lengths`` is, whatever the
    other batch dimensions are: with inputs (B, H, T, d) and B == H a bare
    trailing-axis broadcast would silently read it per head."""
    arr = _native(np.asarray(kv_lengths))
    operands = (q, k) if v is None else (q, k, v)
    try:
        batch_shape = np.broadcast_shapes(*(a.shape[:-2] for a in operands))
    except ValueError:
        # grouped heads (H != H_kv) or a mismatch, reported later
        batch_shape = q.shape[:-2]
    if arr.ndim != 1 or len(batch_shape) < 2 or arr.shape[0] == 1:
        return arr
    if arr.shape[0] != batch_shape[0]:
        raise ValueError(
            f"kv_lengths of shape {arr.shape} is ambiguous for batch dimensions "
            f"{batch_shape}: a 1-D kv_lengths holds one length per sequence and must "
            f"have length B = {batch_shape[0]}; for other layouts pass an array that "
            f"broadcasts to {batch_shape}, e.g. shape {batch_shape[:1] + batch_shape[1:]} "
            f"or {(1,) + batch_shape[1:]}")
    return arr.reshape(arr.shape + (1,) * (len(batch_shape) - 1))


def _gqa_hint(q: NDArray[Any], k: NDArray[Any]) -> str:
    """A hint when q has a multiple of k's heads but enable_gqa was not given."""
    if q.ndim >= 3 and k.ndim >= 3:
        n_heads, n_kv_heads = q.shape[-3], k.shape[-3]
        if 1 < n_kv_heads < n_heads and n_heads % n_kv_heads == 0:
            return (f"; q has {n_heads} heads and k {n_kv_heads} (axis -3): pass "
                    "enable_gqa=True for grouped-query attention")
    return ""


def check_options(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any], *, causal: bool,
                  scale: float | None, window: Any, softcap: float | None,
                  alibi_slopes: ArrayLike | None,
                  num_threads: SupportsIndex | None, sinks: ArrayLike | None = None) -> None:
    """Raise as :func:`attention` would on these options, computing nothing:
    for callers that must refuse a call before they write (a KV cache)."""
    compute, _ = _compute_dtype(q, k, v)
    _check_scale_fits(_resolve_scale(scale, q.shape[-1]), compute)
    _check_window(window, causal)
    _check_softcap(softcap)
    if num_threads is not None:
        _check_num_threads(num_threads)
    if alibi_slopes is not None:
        _prepare_alibi(alibi_slopes, q.shape[:-2])
    if sinks is not None:
        _prepare_sinks(sinks, q.shape[:-2])


def _run(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, causal: bool,
         mask: ArrayLike | None, scale: float | None, want_out: bool, want_scores: bool,
         num_threads: SupportsIndex | None, want_lse: bool = False, enable_gqa: bool = False,
         kv_lengths: ArrayLike | None = None, query_period: int = 0,
         window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
         softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
         sinks: ArrayLike | None = None, sink_rows: NDArray[np.float64] | None = None,
         k_scale: ArrayLike | None = None, v_scale: ArrayLike | None = None,
         scales_ready: bool = False,
) -> tuple[_FloatArray | None, _FloatArray | None, _FloatArray | None]:
    q = _as_input(q, "q")
    k = _as_input(k, "k")
    if v is not None:
        v = _as_input(v, "v")
    if not scales_ready:
        # int8 K/V: the row scales as arrays of k's and v's shape with a
        # features axis of 1, so every view taken of k or v applies to them
        k_scale = int8_scale(k, k_scale, "k", q.dtype)
        if v is not None:
            v_scale = int8_scale(v, v_scale, "v", q.dtype)
        elif v_scale is not None:
            raise ValueError("v_scale is given without v")
    ks = cast("NDArray[np.float32] | None", k_scale)
    vs = cast("NDArray[np.float32] | None", v_scale)
    if kv_lengths is not None and query_period == 0:
        kv_lengths = _lengths_per_sequence(kv_lengths, q, k, v)
    if enable_gqa:
        q, k, v, mask, kv_lengths, alibi_slopes, sinks, n_heads = _group_query_heads(
            q, k, v, mask, kv_lengths, alibi_slopes, sinks)
        # the same views of the scales: (..., H_kv, 1, S, 1)
        ks = ks[..., None, :, :] if ks is not None else None
        vs = vs[..., None, :, :] if vs is not None else None
        group, n_queries = q.shape[-3], q.shape[-2]
        lengths_per_kv_head = kv_lengths is None or np.ndim(kv_lengths) == 0 or (
            np.shape(kv_lengths)[-1] == 1)
        if (group > 1 and group * n_queries <= _attention.DIRECT_QUERY_ROWS
                and mask is None and alibi_slopes is None and lengths_per_kv_head):
            # decode: the group's query rows are stacked as rows of one K/V
            # head, so its keys and values are read (and converted) once
            q = q.reshape(q.shape[:-3] + (group * n_queries, q.shape[-1]))
            k = k[..., 0, :, :]
            v = v[..., 0, :, :] if v is not None else None
            ks = ks[..., 0, :, :] if ks is not None else None
            vs = vs[..., 0, :, :] if vs is not None else None
            if kv_lengths is not None and np.ndim(kv_lengths) > 0:
                kv_lengths = np.asarray(kv_lengths)[..., 0]
            stacked_sinks = None
            if sinks is not None:
                # one sink per stacked group of n_queries rows: (batch entry, g)
                stacked_leading = [a.shape[:-2] for a in (q, k, v) if a is not None]
                try:
                    stacked_batch = np.broadcast_shapes(*stacked_leading)
                except ValueError:
                    stacked_batch = None  # reported by the call below
                if stacked_batch is not None:
                    stacked_sinks = _prepare_sinks(sinks, stacked_batch + (group,))
            out, scores, lse = _run(q, k, v, causal, None, scale, want_out, want_scores,
                                    num_threads, want_lse, kv_lengths=kv_lengths,
                                    query_period=n_queries, window=window,
                                    softcap=softcap, sink_rows=stacked_sinks,
                                    k_scale=ks, v_scale=vs, scales_ready=True)

            def split_rows(arr: _FloatArray | None, trailing: int) -> _FloatArray | None:
                # (..., H_kv, G * T, *rest) -> (..., H, T, *rest), a view
                if arr is None:
                    return None
                lead = arr.shape[:arr.ndim - trailing - 1]
                rest = arr.shape[arr.ndim - trailing:]
                return arr.reshape(lead[:-1] + (n_heads, n_queries) + rest)

            return split_rows(out, 1), split_rows(scores, 1), split_rows(lse, 0)
        out, scores, lse = _run(q, k, v, causal, mask, scale, want_out, want_scores,
                                num_threads, want_lse, kv_lengths=kv_lengths,
                                window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                sinks=sinks, k_scale=ks, v_scale=vs, scales_ready=True)

        def merge_heads(arr: _FloatArray | None, trailing: int) -> _FloatArray | None:
            # (..., H_kv, G, *trailing) -> (..., H, *trailing); C-contiguous, a view
            if arr is None:
                return None
            rest = arr.shape[arr.ndim - trailing:]
            return arr.reshape(arr.shape[:-2 - trailing] + (n_heads,) + rest)

        return merge_heads(out, 2), merge_heads(scores, 2), merge_heads(lse, 1)
    n_queries, d_k = q.shape[-2:]
    n_keys = k.shape[-2]
    if k.shape[-1] != d_k:
        raise ValueError(
            f"q and k must share d_k (their last dimension): q has shape {q.shape}, "
            f"k has shape {k.shape}")
    if v is not None and v.shape[-2] != n_keys:
        raise ValueError(
            f"k and v must have the same number of keys S (second-to-last "
            f"dimension): k has shape {k.shape}, v has shape {v.shape}")

    operands = (q, k) if v is None else (q, k, v)
    compute, result = _compute_dtype(*operands)
    if compute != np.float32 and (ks is not None or vs is not None):
        raise TypeError(f"int8 K/V are computed in float32, but these inputs compute in "
                        f"{compute} (q {q.dtype}, k {k.dtype}"
                        f"{f', v {v.dtype}' if v is not None else ''}); pass float32 q and "
                        "float32 (or float16, or int8) k and v")

    if mask is not None:
        mask = _prepare_mask(mask, n_queries, n_keys, compute)
    leading = [a.shape[:-2] for a in operands]
    if mask is not None:
        leading.append(mask.shape[:-2])
    try:
        batch_shape = np.broadcast_shapes(*leading)
    except ValueError:
        names = ["q", "k", "v"][: len(operands)] + (["mask"] if mask is not None else [])
        described = ", ".join(
            f"{name} {arr.shape}"
            for name, arr in zip(names, list(operands) + ([mask] if mask is not None else [])))
        raise ValueError(
            f"batch dimensions do not broadcast: {described} "
            f"(leading shapes {', '.join(str(s) for s in leading)})"
            f"{_gqa_hint(q, k)}") from None

    scale = _resolve_scale(scale, d_k)
    _check_scale_fits(scale, compute)
    threads = get_num_threads() if num_threads is None else _check_num_threads(num_threads)
    if kv_lengths is not None:
        kv_lengths = _prepare_kv_lengths(kv_lengths, batch_shape, n_keys)
    window_left, window_right = _check_window(window, causal)
    softcap = _check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = _prepare_alibi(alibi_slopes, batch_shape)
    if sink_rows is None and sinks is not None:
        sink_rows = _prepare_sinks(sinks, batch_shape)

    # float16 K and V (a halved KV cache) and int8 K or V (with row scales)
    # are read as they are and converted block by block in the kernels,
    # never copied to float32 whole
    floats = [a for a, s in ((k, ks), (v, vs)) if a is not None and s is None]
    kv_dtype = compute
    if compute == np.float32 and all(a.dtype == np.float16 for a in floats):
        kv_dtype = np.dtype(np.float16)
    q = _to_compute(q, compute)
    k = k if ks is not None else _to_compute(k, kv_dtype)
    if v is not None:
        v = v if vs is not None else _to_compute(v, kv_dtype)
    d_v = v.shape[-1] if v is not None else 0

    out = np.empty(batch_shape + (n_queries, d_v), dtype=compute) if want_out else None
    scores = (np.empty(batch_shape + (n_queries, n_keys), dtype=compute)
              if want_scores else None)
    lse = np.empty(batch_shape + (n_queries,), dtype=compute) if want_lse else None
    if n_queries > 0 and math.prod(batch_shape) > 0:
        _attention.attention_into(
            q, k, v, mask, batch_shape, bool(causal), scale, out, scores, threads, lse,
            kv_lengths, query_period, window_left, window_right, softcap, alibi_slopes,
            sink_rows, ks, vs)
    if result != compute:
        # float16 in: outputs back to float16, the log-sum-exp stays float32
        out = out.astype(result) if out is not None else None
        scores = scores.astype(result) if scores is not None else None
    return out, scores, lse


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: Literal[False] = False, return_lse: Literal[False] = False,
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: Literal[True], return_lse: Literal[False] = False,
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: Literal[False] = False, return_lse: Literal[True],
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: Literal[True], return_lse: Literal[True],
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]],
           NDArray[np.floating[Any]]]: ...


@overload
def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: bool = False, return_lse: bool = False,
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]: ...


def attention(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
    causal: bool = False, mask: ArrayLike | None = None, scale: float | None = None,
    return_scores: bool = False, return_lse: bool = False,
    enable_gqa: bool = False, kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    v_scale: ArrayLike | None = None, num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]:
    """Scaled dot-product attention.

    Computes ``SCORES = softmax(Q K^T * scale + mask)`` row by row and
    ``ATTN = SCORES V``, exactly (float32 and float64 agree with a float64
    reference to rounding), in parallel over blocks of query rows.

    Parameters
    ----------
    q : array_like, shape (..., T, d_k)
        Queries: float16, float32 or float64, or integer or bool (computed
        as float64); see Notes for mixed dtypes.
    k : array_like, shape (..., S, d_k)
        Keys, of the same kinds of dtype.
    v : array_like, shape (..., S, d_v)
        Values, likewise; d_v may differ from d_k.
    causal : bool, default False
        Query ``i`` sees key ``j`` only if ``j <= i + (S - T)``: the queries
        are the *last* T positions of the key sequence ("bottom-right"
        alignment, what a KV cache needs; PyTorch's ``causal_lower_right``).
        For T == S this is ``j <= i``. When T > S the first T - S rows see no
        key and are zero.
    mask : array_like, optional
        Broadcastable to ``(..., T, S)``. A bool mask where **True means
        "may attend"**, or a float mask **added to the scaled logits**
        (``-inf`` masks). Combines with ``causal``. Its leading dimensions
        take part in batch broadcasting.
    scale : float, optional
        Multiplies ``Q K^T``; default ``1 / sqrt(d_k)``. Any finite value
        the compute dtype holds (for float32, 0 or a magnitude between
        1.4e-45 and 3.4e38), including 0 and negatives. The scaled logits
        must be finite in the compute dtype: a row with a logit beyond its
        range (float32: 3.4e38) is NaN.
    return_scores : bool, default False
        Also return SCORES.
    return_lse : bool, default False
        Also return the log-sum-exp of each row's scaled, masked logits,
        the row's sink included when ``sinks`` is given (``-inf`` for a row
        that sees no key and has no sink). Attention over disjoint key
        chunks combines exactly with :func:`merge` using it.
    enable_gqa : bool, default False
        Grouped-query attention: q has H query heads on axis -3 and k, v
        have H_kv heads there, H a multiple of H_kv; query head h uses
        key/value head ``h // (H // H_kv)`` (PyTorch's ``enable_gqa``). K and
        V are never copied or repeated. A mask's head axis may be H or 1.
    kv_lengths : array_like of int, optional
        Valid key counts: a scalar; a 1-D array of length B, one length per
        sequence (the first batch axis: for ``(B, H, T, d)`` inputs it
        applies to every head of sequence b, as ``cache_lengths`` does; any
        other 1-D length is an error when there are several batch
        dimensions); or an array broadcastable to the batch shape (the
        dimensions before T, e.g. ``(B, H)`` for one length per head).
        Batch entry b has only its first ``kv_lengths[b]`` keys (right
        padding, as in a batched KV cache); the others take no part. With
        ``causal=True`` the alignment uses the valid length: key j is visible
        to query i iff ``j <= i + (kv_lengths[b] - T)``. Values in [0, S].
    window : (int or None, int or None), optional
        Sliding-window (local) attention: key j is visible to query i iff
        ``i + off - left <= j <= i + off + right`` with ``off = S - T`` (or
        ``kv_lengths[b] - T``); None on a side means unbounded. ``causal``
        implies ``right = 0``. Cost scales with the window, not with S.
    softcap : float, optional
        Logits become ``softcap * tanh(logits / softcap)`` after scaling and
        before ALiBi and the mask.
    alibi_slopes : array_like, shape (H,) or (B, H), optional
        Adds ``-slope * |i + off - j|`` to the logits (FlashAttention's
        convention), the slope of each query head.
    k_scale, v_scale : array_like, optional
        With an int8 k or v (a quantized cache, see :func:`quantize_kv`):
        the float32 scale of each row, of shape ``k.shape[:-1]`` /
        ``v.shape[:-1]``. The result is attention over ``k * k_scale[...,
        None]`` (and likewise v), computed in float32 as the rows are read,
        never from a float copy. int8 K/V need a float32 (or float16) q;
        with a float q an int8 K or V without its scale is an error (with an
        integer q and no scales, integer inputs are computed as float64).
    sinks : array_like, shape (H,) or (B, H), optional
        Attention sinks (gpt-oss): one logit per query head that joins each
        row's softmax with no value, ``p_j = e^(s_j - m) / (e^(sink - m) +
        sum_i e^(s_i - m))`` with m the maximum over the row's visible
        logits and the sink, so SCORES rows sum to ``1 - p_sink``. Broadcast
        like ``alibi_slopes``; ``-inf`` is no sink (bitwise). A row that
        sees no key is zero. The log-sum-exp includes the sink, so chunks
        combine with :func:`merge` when exactly one chunk is given the
        sinks.
    num_threads : int, optional
        Threads for this call; default ``get_num_threads()`` (which
        :func:`limit_threads` sets for the calling Python thread).

    Returns
    -------
    attn : ndarray, shape (..., T, d_v)
        float32, float64 or float16, by the dtype rules in the Notes.
    scores : ndarray, shape (..., T, S)
        Only with ``return_scores=True``; the dtype of ``attn``. Each row
        sums to 1, or is all zero if the row sees no key.
    lse : ndarray, shape (..., T)
        Only with ``return_lse=True``; float32 for float32 (and float16)
        inputs, float64 for float64.

    The result is ``attn``, ``(attn, scores)``, ``(attn, lse)`` or
    ``(attn, scores, lse)``.

    Raises
    ------
    TypeError
        An input that is None or of unsupported dtype (complex, object,
        string, wider than 64 bits), a mask neither bool nor float, or an
        option of the wrong type (``causal``, ``return_scores``,
        ``return_lse`` or ``enable_gqa`` not a bool, ``scale`` or
        ``softcap`` not a real number, ``window`` not a pair of integers or
        None, ``kv_lengths`` not integers, ``alibi_slopes`` not real).
    ValueError
        Shapes that do not match or broadcast (d_k of q and k, S of k and v,
        the batch dimensions, the mask, the heads under ``enable_gqa``, the
        batch shape for ``kv_lengths`` or ``alibi_slopes``, a 1-D
        ``kv_lengths`` whose length is not B), an input of fewer than 2
        dimensions or not a regular array (a ragged list), an option out of
        range (``scale`` non-finite or beyond the compute dtype,
        ``num_threads`` not an integer in [1, 2**31 - 1], a negative window
        side, ``kv_lengths`` outside [0, S], ``softcap`` <= 0, non-finite
        ``alibi_slopes``), or d_k == 0 with no ``scale``.
    MemoryError
        If per-thread scratch memory cannot be allocated.

    Notes
    -----
    Leading (batch) dimensions of q, k, v and mask broadcast by NumPy's
    rules; a K/V with leading dimensions of size 1 is shared, not copied.
    Any strides are accepted (transposed, negative, zero, read-only), and
    so is either byte order (a big-endian array from a file is converted);
    each gives bitwise the same result as a native contiguous copy. Results
    are also bitwise the same for any thread count. The GIL is released
    while computing.

    dtypes: float32 and float64 are computed in their own precision; mixed
    inputs follow ``np.result_type``; integer and bool inputs are computed as
    float64; float16 is computed in float32 and returned as float16.

    Rows that can see no key (fully masked, T > S under ``causal``, S == 0)
    are zero in ATTN and SCORES. Masked keys take no part at all: a NaN or
    Inf in a masked-out key or value cannot reach the output. More generally
    a key whose weight is exactly zero never touches the output.

    Memory: without SCORES nothing of size T x S is allocated; the extra
    memory is per-thread scratch of about
    ``(96 * (d_k + 256 + 2 * d_v) + 256 * (d_k + d_v))`` elements. With SCORES
    the SCORES array itself is the scratch.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 8), dtype=np.float32)
    >>> k = rng.standard_normal((2, 6, 8), dtype=np.float32)
    >>> v = rng.standard_normal((2, 6, 3), dtype=np.float32)
    >>> out, scores = ca.attention(q, k, v, causal=True, return_scores=True)
    >>> out.shape, scores.shape
    ((2, 4, 3), (2, 4, 6))
    >>> bool(np.allclose(scores.sum(axis=-1), 1))
    True
    """
    if (mask is None and return_lse is False and enable_gqa is False and kv_lengths is None
            and window is None and softcap is None and alibi_slopes is None and sinks is None
            and k_scale is None and v_scale is None
            and type(causal) is bool and type(return_scores) is bool):
        fast = _attention.attention_fast(
            q, k, v, causal, scale, num_threads, return_scores, _current_limit())
        if fast is not None:
            return fast
    causal = _check_flag(causal, "causal")
    return_scores = _check_flag(return_scores, "return_scores")
    return_lse = _check_flag(return_lse, "return_lse")
    enable_gqa = _check_flag(enable_gqa, "enable_gqa")
    if v is None:
        raise ValueError("v is required; use attention_scores(q, k) for SCORES alone")
    out, scores, lse = _run(q, k, v, causal, mask, scale, True, bool(return_scores),
                            num_threads, bool(return_lse), bool(enable_gqa), kv_lengths,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                            sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    result = (out,) + ((scores,) if return_scores else ()) + ((lse,) if return_lse else ())
    # _run fills every array it is asked for
    return cast("NDArray[np.floating[Any]] | tuple[NDArray[np.floating[Any]], ...]",
                result if len(result) > 1 else out)


def attention_scores(
    q: ArrayLike, k: ArrayLike, *, causal: bool = False, mask: ArrayLike | None = None,
    scale: float | None = None, enable_gqa: bool = False,
    kv_lengths: ArrayLike | None = None,
    window: tuple[SupportsIndex | None, SupportsIndex | None] | None = None,
    softcap: float | None = None, alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None, k_scale: ArrayLike | None = None,
    num_threads: SupportsIndex | None = None,
) -> NDArray[np.floating[Any]]:
    """The attention weights ``softmax(Q K^T * scale + mask)`` alone.

    Same conventions as :func:`attention` (causal alignment, mask meaning,
    dtypes, broadcasting, zero rows for rows that see no key).

    Parameters
    ----------
    q : array_like, shape (..., T, d_k)
    k : array_like, shape (..., S, d_k)
        Queries and keys, of the dtypes :func:`attention` accepts.
    causal, mask, scale, enable_gqa, kv_lengths, window, softcap, alibi_slopes, sinks
    k_scale, num_threads
        As in :func:`attention`.

    Returns
    -------
    scores : ndarray, shape (..., T, S)
        Each row sums to 1, or is all zero if the row sees no key. float32,
        float64 or float16, by the dtype rules of :func:`attention`.

    Raises
    ------
    TypeError, ValueError, MemoryError
        As in :func:`attention`.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> q = np.ones((2, 4))
    >>> ca.attention_scores(q, q, causal=True)
    array([[1. , 0. ],
           [0.5, 0.5]])
    """
    _, scores, _ = _run(q, k, None, _check_flag(causal, "causal"), mask, scale, False,
                        True, num_threads, enable_gqa=_check_flag(enable_gqa, "enable_gqa"),
                        kv_lengths=kv_lengths,
                        window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, k_scale=k_scale)
    return cast("NDArray[np.floating[Any]]", scores)


def merge(
    outs: Iterable[ArrayLike], lses: Iterable[ArrayLike],
) -> tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]]:
    """Combine attention computed over disjoint key chunks into the result
    over all keys.

    With ``lse = logsumexp_i lse_i`` the result is
    ``out = sum_i outs[i] * exp(lses[i] - lse)``: exactly attention over the
    union of the chunks, up to rounding. Chunks that see no key
    (``lse_i = -inf``) contribute nothing; if no chunk sees a key the row is
    zero with ``lse = -inf``, as from :func:`attention`. With attention
    sinks, pass ``sinks=`` to exactly one chunk's call: its log-sum-exp then
    carries the sink (even if that chunk sees no key), and the merge equals
    attention with the sinks over all keys.

    Parameters
    ----------
    outs : sequence of array_like, each of shape (..., T, d_v)
        ``attention(q, k_i, v_i, return_lse=True)[0]`` for each chunk i;
        floating point.
    lses : sequence of array_like, each of shape (..., T)
        The matching log-sum-exp values.

    Returns
    -------
    out : ndarray, shape (..., T, d_v)
    lse : ndarray, shape (..., T)
        Both of ``np.result_type(*outs, *lses)``.

    Raises
    ------
    ValueError
        If there are no chunks, a different number of outputs and lse
        arrays, outputs of different shapes, or an lse whose shape is not
        its output's without the last axis.
    TypeError
        If the arrays are not all floating point.

    Examples
    --------
    >>> import numpy as np
    >>> import cattention as ca
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 8)) for _ in range(3))
    >>> first = ca.attention(q, k[:5], v[:5], return_lse=True)
    >>> rest = ca.attention(q, k[5:], v[5:], return_lse=True)
    >>> out, lse = ca.merge([first[0], rest[0]], [first[1], rest[1]])
    >>> bool(np.allclose(out, ca.attention(q, k, v)))
    True
    """
    chunk_outs = [np.asarray(o) for o in outs]
    chunk_lses = [np.asarray(x) for x in lses]
    if len(chunk_outs) == 0 or len(chunk_outs) != len(chunk_lses):
        raise ValueError(
            f"merge needs one lse per output and at least one of each; got "
            f"{len(chunk_outs)} outputs and {len(chunk_lses)} lse arrays")
    for i, (o, x) in enumerate(zip(chunk_outs, chunk_lses)):
        if o.ndim < 2 or x.shape != o.shape[:-1]:
            raise ValueError(
                f"chunk {i}: lse of shape {x.shape} does not match output of shape "
                f"{o.shape} (expected lse shape {o.shape[:-1]})")
        if o.shape != chunk_outs[0].shape:
            raise ValueError(
                f"chunk {i}: output of shape {o.shape} differs from chunk 0's "
                f"{chunk_outs[0].shape}")
    dtype = np.result_type(*chunk_outs, *chunk_lses)
    if dtype.kind != "f":
        raise TypeError(f"merge needs floating-point arrays, got {dtype}")
    stacked_lse = np.stack(chunk_lses).astype(dtype, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.max(stacked_lse, axis=0)
        # chunks that saw no key weigh 0; rows where none did stay -inf
        shift = np.where(np.isneginf(top), 0, top)
        weights = np.where(np.isneginf(stacked_lse), 0, np.exp(stacked_lse - shift))
        total = np.sum(weights, axis=0)
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1)), top)
        scale = np.where(total > 0, weights / np.where(total > 0, total, 1), 0)
        out = np.zeros(chunk_outs[0].shape, dtype=dtype)
        for o, w in zip(chunk_outs, scale):
            # keys of weight 0 take no part, even where their output is NaN
            out += np.where(w[..., None] != 0, o * w[..., None], 0)
    return out, lse
