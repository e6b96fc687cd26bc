# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Parallel driver: blocks of query rows across OpenMP threads.

Each work item is one (batch entry, block of up to ``Q_BLOCK`` query rows) and
is computed by exactly one thread with block boundaries that depend only on
the problem shape, so the result is bitwise the same for any thread count.
Within an item, keys stream in blocks of ``K_BLOCK``: pack K^T, score tile,
mask, online softmax (running row maximum and sum, rescaling the accumulator
when the maximum grows), then the P.V tile. Nothing of size T x S exists
unless SCORES is requested, in which case the caller's SCORES array is the
scratch.

Everything below ``_attention`` runs without the GIL on raw pointers; the
Python layer (``_api.py``) has already validated shapes and dtypes, made the
inputs aligned, and allocated the outputs.
"""

import numpy as np
cimport numpy as cnp
from cython cimport floating
from cython.parallel cimport parallel, prange
from libc.math cimport INFINITY, exp
from libc.stdint cimport uint8_t
from libc.string cimport memset

cnp.import_array()

ctypedef cnp.intp_t intp_t


cdef extern from "kernels.h" nogil:
    ctypedef struct ca_kernels:
        const char *name
        Py_ssize_t key_pad_f32
        Py_ssize_t key_pad_f64
        Py_ssize_t col_pad_f32
        Py_ssize_t col_pad_f64
        void (*score_f32)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                          const float *kt, Py_ssize_t ldkt, Py_ssize_t n_cols,
                          Py_ssize_t d_k, float factor, float *s, Py_ssize_t lds) noexcept nogil
        void (*score_f64)(const double *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                          const double *kt, Py_ssize_t ldkt, Py_ssize_t n_cols,
                          Py_ssize_t d_k, double factor, double *s, Py_ssize_t lds) noexcept nogil
        void (*pv_f32)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                       const float *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                       Py_ssize_t n_vcols, float *acc, Py_ssize_t ldacc) noexcept nogil
        void (*pv_f64)(const double *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                       const double *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                       Py_ssize_t n_vcols, double *acc, Py_ssize_t ldacc) noexcept nogil
        float (*row_max_f32)(const float *x, Py_ssize_t n) noexcept nogil
        double (*row_max_f64)(const double *x, Py_ssize_t n) noexcept nogil
        float (*exp_sum_f32)(float *x, Py_ssize_t n, float shift) noexcept nogil
        double (*exp_sum_f64)(double *x, Py_ssize_t n, double shift) noexcept nogil

    const ca_kernels *ca_default_kernels()
    const ca_kernels *ca_kernels_by_name(const char *name)
    int ca_available_kernels(const char **names, int capacity)
    const char *ca_compiler_version()
    void *ca_aligned_alloc(size_t n_bytes)
    void ca_aligned_free(void *ptr)


cdef extern from "openmp_shim.h" nogil:
    int omp_get_max_threads()
    int CA_HAVE_OPENMP
    int CA_OPENMP_VERSION


cdef enum:
    # Rows per work item: a multiple of the 6-row register tile, small enough
    # that T = 1024 with a few heads still gives both threads many items.
    Q_BLOCK = 96
    # Keys per streamed block: K^T, V and the score tile of one block stay in L2.
    K_BLOCK = 256
    # Column padding of packed buffers: a multiple of every kernel's key_pad and
    # col_pad, so one workspace layout serves all instruction sets.
    PAD = 16

cdef enum MaskKind:
    MASK_NONE = 0
    MASK_BOOL = 1
    MASK_F32 = 2
    MASK_F64 = 3

cdef struct Operand:
    const char *data
    const intp_t *batch_offset   # element offset of each flattened batch entry
    Py_ssize_t row_stride        # elements
    Py_ssize_t col_stride        # elements


cdef struct Problem:
    Py_ssize_t n_batch
    Py_ssize_t n_queries
    Py_ssize_t n_keys
    Py_ssize_t d_k
    Py_ssize_t d_v
    Operand q
    Operand k
    Operand v
    Operand mask
    int mask_kind
    bint causal
    double scale                 # multiplies q.k


cdef struct Workspace:
    void *base
    intp_t *row_lo               # first visible key of each row in the item
    intp_t *row_hi               # one past the last visible key
    Py_ssize_t ld_k              # = max(d_k, 1)
    Py_ssize_t ld_s              # padded K_BLOCK
    Py_ssize_t ld_v              # d_v padded to PAD
    # typed pointers are cast from these offsets for float or double
    Py_ssize_t off_q, off_kt, off_s, off_v, off_acc, off_max, off_sum


cdef inline Py_ssize_t round_up(Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    return ((n + m - 1) // m) * m


cdef Workspace *workspace_new(const Problem *pb, size_t itemsize) noexcept nogil:
    """Lay out and allocate one thread's scratch; NULL if there is no memory."""
    cdef Py_ssize_t n_rows = Q_BLOCK if pb.n_queries > Q_BLOCK else pb.n_queries
    cdef Py_ssize_t n = 0
    cdef Workspace *ws = <Workspace *>ca_aligned_alloc(sizeof(Workspace))
    if ws == NULL:
        return NULL
    ws.ld_k = pb.d_k if pb.d_k > 0 else 1
    ws.ld_s = round_up(K_BLOCK, PAD)
    ws.ld_v = round_up(pb.d_v, PAD) if pb.d_v > 0 else PAD
    # each region starts on a 64-byte boundary (8 doubles / 16 floats)
    ws.off_q = n
    n += round_up(n_rows * ws.ld_k, 16)
    ws.off_kt = n
    n += round_up(ws.ld_k * ws.ld_s, 16)
    ws.off_s = n
    n += round_up(n_rows * ws.ld_s, 16)
    ws.off_v = n
    n += round_up(K_BLOCK * ws.ld_v, 16)
    ws.off_acc = n
    n += round_up(n_rows * ws.ld_v, 16)
    ws.off_max = n
    n += round_up(n_rows, 16)
    ws.off_sum = n
    n += round_up(n_rows, 16)
    ws.base = ca_aligned_alloc(n * itemsize + 2 * n_rows * sizeof(intp_t))
    if ws.base == NULL:
        ca_aligned_free(ws)
        return NULL
    ws.row_lo = <intp_t *>(<char *>ws.base + n * itemsize)
    ws.row_hi = ws.row_lo + n_rows
    return ws


cdef inline void workspace_delete(Workspace *ws) noexcept nogil:
    if ws != NULL:
        ca_aligned_free(ws.base)
        ca_aligned_free(ws)


cdef void pack_queries(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                       Py_ssize_t n_rows, floating *q_packed,
                       Py_ssize_t ld) noexcept nogil:
    cdef const floating *q = <const floating *>pb.q.data + pb.q.batch_offset[b]
    cdef Py_ssize_t i, c
    cdef const floating *q_row
    for i in range(n_rows):
        q_row = q + (row0 + i) * pb.q.row_stride
        for c in range(pb.d_k):
            q_packed[i * ld + c] = q_row[c * pb.q.col_stride]


cdef void pack_keys_transposed(const Problem *pb, Py_ssize_t b, Py_ssize_t key0,
                               Py_ssize_t n_keys, Py_ssize_t n_cols,
                               floating *kt, Py_ssize_t ld) noexcept nogil:
    """kt[c, j] = K[key0 + j, c]; columns n_keys..n_cols are zero."""
    cdef const floating *k = <const floating *>pb.k.data + pb.k.batch_offset[b]
    cdef Py_ssize_t j, c
    cdef const floating *k_row
    for j in range(n_keys):
        k_row = k + (key0 + j) * pb.k.row_stride
        for c in range(pb.d_k):
            kt[c * ld + j] = k_row[c * pb.k.col_stride]
    if n_cols > n_keys:
        for c in range(pb.d_k):
            memset(&kt[c * ld + n_keys], 0, (n_cols - n_keys) * sizeof(floating))


cdef bint pack_values(const Problem *pb, Py_ssize_t b, Py_ssize_t key0,
                      Py_ssize_t n_keys, floating *v_packed,
                      Py_ssize_t ld) noexcept nogil:
    """Copy V rows key0..key0+n_keys (zero-padded to ld) with every NaN or Inf
    replaced by 0; True if there was any (add_nonfinite_values then adds them
    back for the rows that give their key a nonzero weight).

    A key of weight 0 then contributes fma(0, 0, acc) == acc, exactly what a
    finite value would contribute, so a NaN or Inf in a masked-out value
    changes no bit of the output."""
    cdef const floating *v = <const floating *>pb.v.data + pb.v.batch_offset[b]
    cdef Py_ssize_t j, c
    cdef const floating *v_row
    cdef floating x
    cdef bint nonfinite = False
    for j in range(n_keys):
        v_row = v + (key0 + j) * pb.v.row_stride
        for c in range(pb.d_v):
            x = v_row[c * pb.v.col_stride]
            # x - x is 0 for finite x and NaN for NaN or +-Inf
            if (x - x) != 0:
                nonfinite = True
                x = 0
            v_packed[j * ld + c] = x
        if ld > pb.d_v:
            memset(&v_packed[j * ld + pb.d_v], 0, (ld - pb.d_v) * sizeof(floating))
    return nonfinite


cdef void add_nonfinite_values(const Problem *pb, Py_ssize_t b, Py_ssize_t key0,
                               Py_ssize_t n_keys, const floating *p, Py_ssize_t ldp,
                               Py_ssize_t n_rows, floating *acc,
                               Py_ssize_t ldacc) noexcept nogil:
    """acc[i, c] += p[i, j] * V[key0 + j, c] for the NaN/Inf entries of V that
    pack_values zeroed, in rows where key j has a nonzero weight."""
    cdef const floating *v = <const floating *>pb.v.data + pb.v.batch_offset[b]
    cdef Py_ssize_t i, j, c
    cdef const floating *v_row
    cdef floating x
    for j in range(n_keys):
        v_row = v + (key0 + j) * pb.v.row_stride
        for c in range(pb.d_v):
            x = v_row[c * pb.v.col_stride]
            if (x - x) == 0:
                continue
            for i in range(n_rows):
                if p[i * ldp + j] != 0:
                    acc[i * ldacc + c] += p[i * ldp + j] * x


cdef void visible_ranges(const Problem *pb, Py_ssize_t row0, Py_ssize_t n_rows,
                         intp_t *row_lo, intp_t *row_hi) noexcept nogil:
    """Keys each query row may see before the explicit mask: [row_lo, row_hi)."""
    cdef Py_ssize_t i, hi
    # causal alignment is bottom-right: the queries are the last T positions
    cdef Py_ssize_t offset = pb.n_keys - pb.n_queries
    for i in range(n_rows):
        hi = pb.n_keys
        if pb.causal:
            hi = row0 + i + offset + 1
            if hi > pb.n_keys:
                hi = pb.n_keys
            if hi < 0:
                hi = 0
        row_lo[i] = 0
        row_hi[i] = hi


cdef void mask_scores(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                      Py_ssize_t n_rows, Py_ssize_t key0, Py_ssize_t n_keys,
                      const intp_t *row_lo, const intp_t *row_hi,
                      floating *s, Py_ssize_t lds) noexcept nogil:
    """Set invisible logits to -inf and add an additive mask, in place.

    Masked logits are overwritten, never added to, so a NaN or Inf computed
    from a masked-out key cannot survive."""
    cdef Py_ssize_t i, j, lo, hi
    cdef floating *s_row
    cdef const uint8_t *mask_bool
    cdef const float *mask_f32
    cdef const double *mask_f64
    cdef Py_ssize_t m_row, m_col = pb.mask.col_stride
    cdef double bias
    for i in range(n_rows):
        s_row = s + i * lds
        lo = row_lo[i] - key0
        hi = row_hi[i] - key0
        if lo < 0:
            lo = 0
        if hi > n_keys:
            hi = n_keys
        if hi < lo:
            hi = lo
        for j in range(lo):
            s_row[j] = -INFINITY
        for j in range(hi, n_keys):
            s_row[j] = -INFINITY
        if pb.mask_kind == MASK_NONE or hi == lo:
            continue
        m_row = pb.mask.batch_offset[b] + (row0 + i) * pb.mask.row_stride + key0 * m_col
        if pb.mask_kind == MASK_BOOL:
            mask_bool = <const uint8_t *>pb.mask.data + m_row
            for j in range(lo, hi):
                if not mask_bool[j * m_col]:
                    s_row[j] = -INFINITY
        elif pb.mask_kind == MASK_F32:
            mask_f32 = <const float *>pb.mask.data + m_row
            for j in range(lo, hi):
                bias = mask_f32[j * m_col]
                if bias == -INFINITY:
                    s_row[j] = -INFINITY
                else:
                    s_row[j] = s_row[j] + <floating>bias
        else:
            mask_f64 = <const double *>pb.mask.data + m_row
            for j in range(lo, hi):
                bias = mask_f64[j * m_col]
                if bias == -INFINITY:
                    s_row[j] = -INFINITY
                else:
                    s_row[j] = s_row[j] + <floating>bias


cdef inline void kernel_score(const ca_kernels *kern, const floating *q, Py_ssize_t ldq,
                              Py_ssize_t n_rows, const floating *kt, Py_ssize_t ldkt,
                              Py_ssize_t n_cols, Py_ssize_t d_k, double factor,
                              floating *s, Py_ssize_t lds) noexcept nogil:
    if floating is float:
        kern.score_f32(q, ldq, n_rows, kt, ldkt, n_cols, d_k, <float>factor, s, lds)
    else:
        kern.score_f64(q, ldq, n_rows, kt, ldkt, n_cols, d_k, factor, s, lds)


cdef inline void kernel_pv(const ca_kernels *kern, const floating *p,
                           Py_ssize_t ldp, Py_ssize_t n_rows, const floating *v,
                           Py_ssize_t ldv, Py_ssize_t n_keys, Py_ssize_t n_vcols,
                           floating *acc, Py_ssize_t ldacc) noexcept nogil:
    if floating is float:
        kern.pv_f32(p, ldp, n_rows, v, ldv, n_keys, n_vcols, acc, ldacc)
    else:
        kern.pv_f64(p, ldp, n_rows, v, ldv, n_keys, n_vcols, acc, ldacc)


cdef inline floating kernel_row_max(const ca_kernels *kern, const floating *x,
                                    Py_ssize_t n) noexcept nogil:
    if floating is float:
        return kern.row_max_f32(x, n)
    else:
        return kern.row_max_f64(x, n)


cdef inline floating kernel_exp_sum(const ca_kernels *kern, floating *x, Py_ssize_t n,
                                     floating shift) noexcept nogil:
    if floating is float:
        return kern.exp_sum_f32(x, n, shift)
    else:
        return kern.exp_sum_f64(x, n, shift)


cdef inline Py_ssize_t kernel_key_pad(const ca_kernels *kern, floating *dummy) noexcept nogil:
    if floating is float:
        return kern.key_pad_f32
    else:
        return kern.key_pad_f64


cdef void attend_item(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                      Py_ssize_t b, Py_ssize_t row0, Py_ssize_t n_rows,
                      floating *out) noexcept nogil:
    """ATTN for one block of query rows, streaming key blocks (no SCORES)."""
    cdef floating *q_packed = <floating *>ws.base + ws.off_q
    cdef floating *kt = <floating *>ws.base + ws.off_kt
    cdef floating *s = <floating *>ws.base + ws.off_s
    cdef floating *v_packed = <floating *>ws.base + ws.off_v
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef Py_ssize_t key_pad = kernel_key_pad(kern, q_packed)
    cdef Py_ssize_t i, c, key0, n_keys, first_key, last_key
    cdef floating tile_max, alpha
    cdef floating *s_row
    cdef floating *acc_row
    cdef floating *out_row
    cdef bint nonfinite

    visible_ranges(pb, row0, n_rows, ws.row_lo, ws.row_hi)
    first_key = pb.n_keys
    last_key = 0
    for i in range(n_rows):
        if ws.row_hi[i] > ws.row_lo[i]:
            if ws.row_lo[i] < first_key:
                first_key = ws.row_lo[i]
            if ws.row_hi[i] > last_key:
                last_key = ws.row_hi[i]
        row_max[i] = -INFINITY
        row_sum[i] = 0
    memset(acc, 0, n_rows * ws.ld_v * sizeof(floating))

    if last_key > first_key:
        pack_queries(pb, b, row0, n_rows, q_packed, ws.ld_k)
        # key blocks sit on fixed multiples of K_BLOCK whatever the rows see
        key0 = (first_key // K_BLOCK) * K_BLOCK
        while key0 < last_key:
            n_keys = pb.n_keys - key0 if pb.n_keys - key0 < K_BLOCK else K_BLOCK
            pack_keys_transposed(pb, b, key0, n_keys, round_up(n_keys, key_pad), kt, ws.ld_s)
            kernel_score(kern, q_packed, ws.ld_k, n_rows, kt, ws.ld_s,
                         round_up(n_keys, key_pad), pb.d_k, pb.scale, s, ws.ld_s)
            mask_scores(pb, b, row0, n_rows, key0, n_keys, ws.row_lo, ws.row_hi, s, ws.ld_s)
            for i in range(n_rows):
                s_row = s + i * ws.ld_s
                tile_max = kernel_row_max(kern, s_row, n_keys)
                if tile_max == -INFINITY:
                    # nothing visible in this block: weights exactly zero
                    memset(s_row, 0, n_keys * sizeof(floating))
                    continue
                if tile_max != tile_max:
                    # a NaN logit where a key is visible: the row is NaN, as
                    # in the reference (and stays NaN through later blocks)
                    row_max[i] = tile_max
                elif tile_max > row_max[i]:
                    if row_max[i] != -INFINITY:
                        alpha = <floating>exp(row_max[i] - tile_max)
                        row_sum[i] *= alpha
                        acc_row = acc + i * ws.ld_v
                        for c in range(pb.d_v):
                            acc_row[c] *= alpha
                    row_max[i] = tile_max
                row_sum[i] += kernel_exp_sum(kern, s_row, n_keys, row_max[i])
            nonfinite = pack_values(pb, b, key0, n_keys, v_packed, ws.ld_v)
            kernel_pv(kern, s, ws.ld_s, n_rows, v_packed, ws.ld_v, n_keys,
                      ws.ld_v, acc, ws.ld_v)
            if nonfinite:
                add_nonfinite_values(pb, b, key0, n_keys, s, ws.ld_s, n_rows, acc, ws.ld_v)
            key0 += K_BLOCK

    for i in range(n_rows):
        out_row = out + ((b * pb.n_queries) + row0 + i) * pb.d_v
        if row_max[i] == -INFINITY:
            # a row that sees no key gives zeros, not 0/0
            memset(out_row, 0, pb.d_v * sizeof(floating))
        else:
            acc_row = acc + i * ws.ld_v
            for c in range(pb.d_v):
                out_row[c] = acc_row[c] / row_sum[i]


cdef void attend_item_with_scores(const Problem *pb, const ca_kernels *kern,
                                  Workspace *ws, Py_ssize_t b, Py_ssize_t row0,
                                  Py_ssize_t n_rows, floating *out,
                                  floating *scores) noexcept nogil:
    """SCORES and (if out is not NULL) ATTN for one block of query rows.

    The rows of the caller's SCORES array are the scratch: logits are written
    there, then turned into weights in place, then multiplied by V."""
    cdef floating *q_packed = <floating *>ws.base + ws.off_q
    cdef floating *kt = <floating *>ws.base + ws.off_kt
    cdef floating *s = <floating *>ws.base + ws.off_s
    cdef floating *v_packed = <floating *>ws.base + ws.off_v
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef Py_ssize_t key_pad = kernel_key_pad(kern, q_packed)
    cdef Py_ssize_t n_keys_total = pb.n_keys
    cdef Py_ssize_t i, j, c, key0, n_keys, first_key, last_key, first_block
    cdef floating tile_max, row_total
    cdef floating *s_row
    cdef floating *scores_row
    cdef floating *scores_block = scores + (b * pb.n_queries + row0) * n_keys_total
    cdef bint nonfinite

    visible_ranges(pb, row0, n_rows, ws.row_lo, ws.row_hi)
    first_key = n_keys_total
    last_key = 0
    for i in range(n_rows):
        if ws.row_hi[i] > ws.row_lo[i]:
            if ws.row_lo[i] < first_key:
                first_key = ws.row_lo[i]
            if ws.row_hi[i] > last_key:
                last_key = ws.row_hi[i]
        row_max[i] = -INFINITY

    if last_key <= first_key:
        memset(scores_block, 0, n_rows * n_keys_total * sizeof(floating))
        if out != NULL:
            memset(out + (b * pb.n_queries + row0) * pb.d_v, 0,
                   n_rows * pb.d_v * sizeof(floating))
        return

    first_block = (first_key // K_BLOCK) * K_BLOCK
    pack_queries(pb, b, row0, n_rows, q_packed, ws.ld_k)
    # pass 1: masked logits into SCORES, keys nobody sees as zeros
    for i in range(n_rows):
        scores_row = scores_block + i * n_keys_total
        memset(scores_row, 0, first_block * sizeof(floating))
        if last_key < n_keys_total:
            memset(scores_row + last_key, 0, (n_keys_total - last_key) * sizeof(floating))
    key0 = first_block
    while key0 < last_key:
        n_keys = n_keys_total - key0 if n_keys_total - key0 < K_BLOCK else K_BLOCK
        if key0 + n_keys > last_key:
            n_keys = last_key - key0
        pack_keys_transposed(pb, b, key0, n_keys, round_up(n_keys, key_pad), kt, ws.ld_s)
        kernel_score(kern, q_packed, ws.ld_k, n_rows, kt, ws.ld_s,
                     round_up(n_keys, key_pad), pb.d_k, pb.scale, s, ws.ld_s)
        mask_scores(pb, b, row0, n_rows, key0, n_keys, ws.row_lo, ws.row_hi, s, ws.ld_s)
        for i in range(n_rows):
            s_row = s + i * ws.ld_s
            scores_row = scores_block + i * n_keys_total + key0
            for j in range(n_keys):
                scores_row[j] = s_row[j]
            tile_max = kernel_row_max(kern, s_row, n_keys)
            if tile_max > row_max[i] or tile_max != tile_max:
                row_max[i] = tile_max
        key0 += K_BLOCK

    # pass 2: weights in place over the keys this item can see
    for i in range(n_rows):
        scores_row = scores_block + i * n_keys_total
        if row_max[i] == -INFINITY:
            memset(scores_row + first_block, 0, (last_key - first_block) * sizeof(floating))
            continue
        row_total = kernel_exp_sum(kern, scores_row + first_block,
                                    last_key - first_block, row_max[i])
        for j in range(first_block, last_key):
            scores_row[j] = scores_row[j] / row_total

    if out == NULL:
        return

    # pass 3: ATTN = SCORES . V
    memset(acc, 0, n_rows * ws.ld_v * sizeof(floating))
    key0 = first_block
    while key0 < last_key:
        n_keys = last_key - key0 if last_key - key0 < K_BLOCK else K_BLOCK
        nonfinite = pack_values(pb, b, key0, n_keys, v_packed, ws.ld_v)
        kernel_pv(kern, scores_block + key0, n_keys_total, n_rows,
                  v_packed, ws.ld_v, n_keys, ws.ld_v, acc, ws.ld_v)
        if nonfinite:
            add_nonfinite_values(pb, b, key0, n_keys, scores_block + key0, n_keys_total,
                                 n_rows, acc, ws.ld_v)
        key0 += K_BLOCK
    for i in range(n_rows):
        for c in range(pb.d_v):
            out[(b * pb.n_queries + row0 + i) * pb.d_v + c] = acc[i * ws.ld_v + c]


cdef inline void run_item(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                          Py_ssize_t item, Py_ssize_t n_blocks, floating *out,
                          floating *scores) noexcept nogil:
    # the last query blocks see the most keys under a causal mask: hand them
    # out first so the dynamic schedule ends with the cheap ones
    cdef Py_ssize_t block = n_blocks - 1 - item // pb.n_batch
    cdef Py_ssize_t b = item % pb.n_batch
    cdef Py_ssize_t row0 = block * Q_BLOCK
    cdef Py_ssize_t n_rows = pb.n_queries - row0
    if n_rows > Q_BLOCK:
        n_rows = Q_BLOCK
    if scores != NULL:
        attend_item_with_scores(pb, kern, ws, b, row0, n_rows, out, scores)
    else:
        attend_item(pb, kern, ws, b, row0, n_rows, out)


cdef int run_problem(const Problem *pb, const ca_kernels *kern, int n_threads,
                     floating *out, floating *scores) noexcept nogil:
    """All work items; returns 0, or -1 if a thread's scratch could not be had."""
    cdef Py_ssize_t n_blocks = (pb.n_queries + Q_BLOCK - 1) // Q_BLOCK
    cdef Py_ssize_t n_items = n_blocks * pb.n_batch
    cdef Py_ssize_t item
    cdef Workspace *ws = NULL
    cdef int status = 0
    cdef int *status_ptr = &status
    cdef size_t itemsize = sizeof(floating)
    if n_items == 0:
        return 0
    if n_threads > n_items:
        n_threads = <int>n_items
    if n_threads <= 1:
        ws = workspace_new(pb, itemsize)
        if ws == NULL:
            return -1
        for item in range(n_items):
            run_item(pb, kern, ws, item, n_blocks, out, scores)
        workspace_delete(ws)
        return 0
    with parallel(num_threads=n_threads):
        # assigned inside the parallel block, so private to each thread
        ws = workspace_new(pb, itemsize)
        if ws == NULL:
            status_ptr[0] = -1
        for item in prange(n_items, schedule='dynamic'):
            if ws != NULL:
                run_item(pb, kern, ws, item, n_blocks, out, scores)
        workspace_delete(ws)
    return status


# ---------------------------------------------------------------- Python side

cdef const ca_kernels *_kernels = ca_default_kernels()


def get_simd():
    """Name of the kernel table in use."""
    return (<bytes>_kernels.name).decode()


def available_simd():
    """Names of the kernel tables this CPU can run, best last."""
    cdef const char *names[8]
    cdef int n = ca_available_kernels(names, 8)
    return [(<bytes>names[i]).decode() for i in range(n)]


def set_simd(name):
    """Use the kernel table called ``name`` (for tests and benchmarks).

    Not thread-safe against concurrent calls; raises ValueError if this CPU
    cannot run it."""
    global _kernels
    cdef bytes encoded = str(name).encode()
    cdef const ca_kernels *kern = ca_kernels_by_name(encoded)
    if kern == NULL:
        raise ValueError(
            f"SIMD level {name!r} is not available on this CPU; "
            f"available: {available_simd()}")
    _kernels = kern


def compiler():
    return (<bytes>ca_compiler_version()).decode()


def openmp_enabled():
    return bool(CA_HAVE_OPENMP)


def openmp_version():
    return int(CA_OPENMP_VERSION)


def max_threads():
    """OpenMP's current maximum for a parallel region started by this thread."""
    return omp_get_max_threads()


cdef cnp.ndarray batch_offsets(cnp.ndarray arr, tuple batch_shape):
    """Element offset of each entry of the broadcast batch, in C order.

    ``arr``'s leading dimensions broadcast against ``batch_shape`` (aligned on
    the right); a dimension of size 1 or a missing one advances by 0, so
    shared K/V are never copied."""
    cdef Py_ssize_t n_batch_dims = len(batch_shape)
    cdef Py_ssize_t arr_batch_dims = cnp.PyArray_NDIM(arr) - 2
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(arr)
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, a, i, offset
    cdef Py_ssize_t shape[64]
    cdef Py_ssize_t stride[64]
    cdef Py_ssize_t index[64]
    for d in range(n_batch_dims):
        shape[d] = batch_shape[d]
        n_batch *= shape[d]
        a = d - (n_batch_dims - arr_batch_dims)
        if a >= 0 and cnp.PyArray_DIM(arr, a) != 1:
            stride[d] = cnp.PyArray_STRIDE(arr, a) // itemsize
        else:
            stride[d] = 0
        index[d] = 0
    cdef cnp.ndarray result = np.empty(n_batch, dtype=np.intp)
    cdef intp_t *out = <intp_t *>cnp.PyArray_DATA(result)
    offset = 0
    for i in range(n_batch):
        out[i] = offset
        # odometer step over the batch index, last dimension fastest
        d = n_batch_dims - 1
        while d >= 0:
            index[d] += 1
            offset += stride[d]
            if index[d] < shape[d]:
                break
            offset -= stride[d] * shape[d]
            index[d] = 0
            d -= 1
    return result


cdef void fill_operand(Operand *op, cnp.ndarray arr, cnp.ndarray offsets):
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(arr)
    cdef int ndim = cnp.PyArray_NDIM(arr)
    op.data = <const char *>cnp.PyArray_DATA(arr)
    op.batch_offset = <const intp_t *>cnp.PyArray_DATA(offsets)
    op.row_stride = cnp.PyArray_STRIDE(arr, ndim - 2) // itemsize if cnp.PyArray_DIM(arr, ndim - 2) != 1 else 0
    op.col_stride = cnp.PyArray_STRIDE(arr, ndim - 1) // itemsize if cnp.PyArray_DIM(arr, ndim - 1) != 1 else 0


def attention_into(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask,
                   tuple batch_shape, bint causal, double scale,
                   cnp.ndarray out, cnp.ndarray scores, int num_threads):
    """Compute into preallocated C-contiguous ``out`` (n_batch, T, d_v) and/or
    ``scores`` (n_batch, T, S) of the compute dtype; either may be None.

    Preconditions (checked by the caller): q, k, v share the compute dtype,
    are aligned, their strides are multiples of the itemsize, their leading
    dimensions broadcast to ``batch_shape``; ``mask`` is None or an aligned
    bool/float32/float64 array of ndim >= 2 broadcastable to batch + (T, S).
    ``v`` may be None when ``out`` is None."""
    cdef Problem pb
    cdef cnp.ndarray q_off = batch_offsets(q, batch_shape)
    cdef cnp.ndarray k_off = batch_offsets(k, batch_shape)
    cdef cnp.ndarray v_off = None
    cdef cnp.ndarray mask_off = None
    cdef cnp.ndarray mask_arr
    cdef int status
    cdef const ca_kernels *kern = _kernels
    cdef bint is_double = q.dtype == np.float64

    pb.n_batch = q_off.shape[0]
    pb.n_queries = cnp.PyArray_DIM(q, q.ndim - 2)
    pb.d_k = cnp.PyArray_DIM(q, q.ndim - 1)
    pb.n_keys = cnp.PyArray_DIM(k, k.ndim - 2)
    pb.causal = causal
    pb.scale = scale
    fill_operand(&pb.q, q, q_off)
    fill_operand(&pb.k, k, k_off)
    if v is not None:
        v_off = batch_offsets(v, batch_shape)
        fill_operand(&pb.v, v, v_off)
        pb.d_v = cnp.PyArray_DIM(v, v.ndim - 1)
    else:
        pb.v = pb.k
        pb.d_v = 0
    pb.mask_kind = MASK_NONE
    pb.mask = pb.q
    if mask is not None:
        mask_arr = <cnp.ndarray>mask
        mask_off = batch_offsets(mask_arr, batch_shape)
        fill_operand(&pb.mask, mask_arr, mask_off)
        if mask_arr.dtype == np.bool_:
            pb.mask_kind = MASK_BOOL
        elif mask_arr.dtype == np.float32:
            pb.mask_kind = MASK_F32
        else:
            pb.mask_kind = MASK_F64

    cdef float *out_f32 = NULL
    cdef float *scores_f32 = NULL
    cdef double *out_f64 = NULL
    cdef double *scores_f64 = NULL
    if is_double:
        if out is not None:
            out_f64 = <double *>cnp.PyArray_DATA(out)
        if scores is not None:
            scores_f64 = <double *>cnp.PyArray_DATA(scores)
        with nogil:
            status = run_problem(&pb, kern, num_threads, out_f64, scores_f64)
    else:
        if out is not None:
            out_f32 = <float *>cnp.PyArray_DATA(out)
        if scores is not None:
            scores_f32 = <float *>cnp.PyArray_DATA(scores)
        with nogil:
            status = run_problem(&pb, kern, num_threads, out_f32, scores_f32)
    if status != 0:
        raise MemoryError("cattention: could not allocate per-thread scratch")
