# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""The checks of a call's options, compiled once for both ways in: the
general path (``_prepare``, through the extension's wrappers) and the
compiled shortcuts call these same functions, so an option is accepted or
refused, and a value resolved, by one piece of code. Each raises the
ValueError or TypeError that names the argument. Scalar options are checked
as given; per-entry ones (key positions, ALiBi slopes, sinks) once laid out
one value per batch entry, by whichever path laid them out."""

from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.float cimport DBL_MAX, FLT_MAX
from libc.math cimport INFINITY, fabs, isfinite, isnan, sqrt
from cattention._driver.kernel_table cimport (
    CA_PRECISION_HIGH, CA_PRECISION_HIGHEST, CA_PRECISION_MEDIUM, intp_t)
from cattention._driver.problem cimport MAX_THREADS

cdef extern from "<float.h>" nogil:
    const float FLT_TRUE_MIN    # C11: the smallest positive (subnormal) float
    const double DBL_TRUE_MIN

cdef extern from "openmp_shim.h" nogil:
    int omp_get_max_threads()


cdef inline Py_ssize_t widest_window() noexcept nogil:
    """A window side at or beyond this many positions sees every key (wider
    ones are clamped to it, so that it fits a C integer and the kernels'
    index sums cannot overflow)."""
    return (<Py_ssize_t>1) << 62


cdef inline bint check_flag(object value, str name) except -1:
    """A bool option: a string or an array is refused, not read as its truth
    value."""
    if value is True:
        return True
    if value is False:
        return False
    import numpy as np
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


cdef inline double real_value(object value, str name, str kind) except? -1:
    """A real number (an int or float, NumPy's too, never a bool) as a
    double; kind says what the TypeError asks for."""
    import numbers
    import numpy as np
    if type(value) is not float and (isinstance(value, (bool, np.bool_))
                                     or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be {kind}, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got a number too large for a "
                         "float") from None


cdef inline bint holds(double value, bint in_float32) noexcept nogil:
    """value is 0 or of a magnitude the compute dtype holds: the kernels
    multiply by the scale and divide by the softcap in that dtype, and a
    value beyond it would turn every logit into inf (then NaN) or 0."""
    if value == 0:
        return True
    if in_float32:
        return FLT_TRUE_MIN <= fabs(value) <= FLT_MAX
    return DBL_TRUE_MIN <= fabs(value) <= DBL_MAX


cdef inline int check_holds(double value, bint in_float32, str name) except -1:
    if holds(value, in_float32):
        return 0
    import numpy as np
    compute = np.dtype(np.float32 if in_float32 else np.float64)
    info = np.finfo(compute)
    raise ValueError(
        f"{name} {value!r} is not representable in {compute} (the compute dtype of "
        f"these inputs): its magnitude must lie in [{info.smallest_subnormal}, "
        f"{info.max}]")


cdef inline double check_scale(object scale, Py_ssize_t d_k, bint in_float32) except? -1:
    """The scale a call multiplies q.k by: 1 / sqrt(d_k) for None, else a
    finite real number the compute dtype holds."""
    cdef double value
    if scale is None:
        if d_k == 0:
            raise ValueError(
                "d_k is 0 (q and k have shape (..., T, 0) and (..., S, 0)), so the "
                "default scale 1/sqrt(d_k) is undefined; pass scale explicitly")
        return 1.0 / sqrt(<double>d_k)
    value = real_value(scale, "scale", "a real number")
    if not isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    check_holds(value, in_float32, "scale")
    return value


cdef inline double check_softcap(object softcap, bint in_float32) except? -1:
    """0 for None (no softcap), else a positive finite number the compute
    dtype holds."""
    cdef double value
    if softcap is None:
        return 0
    value = real_value(softcap, "softcap", "None or a positive number")
    if not (isfinite(value) and value > 0):
        raise ValueError(f"softcap must be a positive finite number, got {value}")
    check_holds(value, in_float32, "softcap")
    return value


cdef inline int check_precision(object precision, bint half_result) except -1:
    """The CA_PRECISION_* level of precision= ("highest", "high" or
    "medium"; None: "high") for a call whose result is 16-bit (bfloat16,
    float16); a float32 or float64 result takes the highest at every level
    (the value is checked all the same)."""
    cdef int level
    if precision is None:
        level = CA_PRECISION_HIGH
    elif not isinstance(precision, str):
        raise TypeError(f"precision must be 'highest', 'high', 'medium' or None, got "
                        f"{type(precision).__name__} {precision!r}")
    elif precision == "highest":
        level = CA_PRECISION_HIGHEST
    elif precision == "high":
        level = CA_PRECISION_HIGH
    elif precision == "medium":
        level = CA_PRECISION_MEDIUM
    else:
        raise ValueError(f"precision must be 'highest', 'high', 'medium' or None, got "
                         f"{precision!r}")
    return level if half_result else CA_PRECISION_HIGHEST


cdef inline object as_integer(object value):
    """value as a Python int if it is an integer (NumPy's too), else None; a
    bool is not taken for an integer."""
    import operator
    import numpy as np
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


cdef inline Py_ssize_t window_side(object side, str name) except -2:
    """One side of a window: -1 for None (unbounded), else a count >= 0."""
    if side is None:
        return -1
    value = as_integer(side)
    if value is None:
        raise TypeError(f"window {name} must be an integer or None, got {side!r}")
    if value < 0:
        raise ValueError(f"window {name} must be >= 0 (or None), got {value}")
    return widest_window() if value > widest_window() else value


cdef inline int check_window(object window, bint causal, Py_ssize_t *left,
                             Py_ssize_t *right) except -1:
    """(left, right) of a sliding window, -1 for an unbounded side; causal
    forces right to 0."""
    left[0] = -1
    right[0] = -1
    if window is not None:
        try:
            left_side, right_side = window
        except (TypeError, ValueError):
            raise TypeError(f"window must be None or a (left, right) pair, got "
                            f"{window!r}") from None
        left[0] = window_side(left_side, "left")
        right[0] = window_side(right_side, "right")
    if causal:
        right[0] = 0
    return 0


cdef inline Py_ssize_t check_num_threads(object n, str name) except -1:
    """A thread count: an integer (not a bool) in [1, MAX_THREADS]."""
    cdef long long value
    cdef int overflow = 0
    if type(n) is int:
        # read in C: a comparison of Python ints costs more than the check
        value = PyLong_AsLongLongAndOverflow(n, &overflow)
        if overflow == 0 and 1 <= value <= MAX_THREADS:
            return <Py_ssize_t>value
    count = as_integer(n)
    if count is None:
        raise ValueError(f"{name} must be a positive integer thread count, got {n!r}")
    if count < 1:
        raise ValueError(f"{name} must be a positive integer thread count, got {count}")
    if count > MAX_THREADS:
        raise ValueError(f"{name} must be at most {MAX_THREADS} (OpenMP's limit), got {count}")
    return count


cdef inline Py_ssize_t resolve_threads(object num_threads, object limit) except -1:
    """The threads of a call: num_threads, else the calling Python thread's
    limit (limit_threads, set_num_threads), else OpenMP's current maximum."""
    cdef int current
    if num_threads is not None:
        return check_num_threads(num_threads, "num_threads")
    if limit is not None:
        return <Py_ssize_t>limit
    current = omp_get_max_threads()
    return current if current >= 1 else 1


# ------------------------------------------------- per-entry option values

cdef inline int check_key_positions(const intp_t *values, Py_ssize_t n, Py_ssize_t n_keys,
                                    str name) except -1:
    """kv_lengths or kv_starts, one per batch entry: key positions in [0, S]."""
    cdef Py_ssize_t i
    cdef intp_t low, high
    if n == 0:
        return 0
    low = high = values[0]
    for i in range(1, n):
        if values[i] < low:
            low = values[i]
        if values[i] > high:
            high = values[i]
    if low < 0 or high > n_keys:
        raise ValueError(f"{name} must lie in [0, S] = [0, {n_keys}]; got values from "
                         f"{low} to {high}")
    return 0


cdef inline int check_alibi_slopes(const double *slopes, Py_ssize_t n,
                                   bint in_float32) except -1:
    """Finite slopes the compute dtype holds: the biases are logits of that
    dtype, and a slope beyond it makes every bias off the diagonal infinite
    (NaN rows). A slope within it times a long distance can still leave the
    dtype's range, as any logit can (a +inf logit makes its row NaN)."""
    cdef Py_ssize_t i
    cdef double limit = FLT_MAX if in_float32 else DBL_MAX
    cdef double largest = 0
    for i in range(n):
        if not isfinite(slopes[i]):
            raise ValueError("alibi_slopes must be finite")
        if fabs(slopes[i]) > largest:
            largest = fabs(slopes[i])
    if largest > limit:
        compute = "float32" if in_float32 else "float64"
        raise ValueError(
            f"alibi_slopes must lie in [-{limit:.4g}, {limit:.4g}] (the range of {compute}, "
            f"the compute dtype of these inputs); got {largest:.4g} in magnitude")
    return 0


cdef inline int check_sinks(double *sinks, Py_ssize_t n, bint in_float32) except -1:
    """Sink logits join each row's softmax and its log-sum-exp in the
    compute dtype: NaN, +inf or one above its range would be an infinite
    log-sum-exp, refused; one below it weighs nothing and becomes -inf (in
    place), no sink, so that every path gives the bits of no sink (the
    kernels tell a sink by its float64 value)."""
    cdef Py_ssize_t i
    cdef double limit = FLT_MAX if in_float32 else DBL_MAX
    cdef double largest = -INFINITY
    for i in range(n):
        if isnan(sinks[i]) or sinks[i] == INFINITY:
            raise ValueError("sinks must be finite, or -inf for no sink; got NaN or +inf")
        if sinks[i] > largest:
            largest = sinks[i]
    if largest > limit:
        compute = "float32" if in_float32 else "float64"
        raise ValueError(
            f"sinks must be at most {limit:.4g} (the largest {compute}, the compute dtype "
            f"of these inputs); got {largest:.4g}")
    for i in range(n):
        if sinks[i] < -limit:
            sinks[i] = -INFINITY
    return 0
