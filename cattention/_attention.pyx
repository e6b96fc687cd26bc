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

import math

import numpy as np
cimport numpy as cnp
from cython cimport floating
from cython.parallel cimport parallel, prange
from libc.float cimport FLT_MAX
from libc.math cimport INFINITY, exp, fabs, isfinite, log, sqrt
from libc.stdint cimport uint8_t, uint16_t
from libc.stdlib cimport free, labs, malloc
from libc.string cimport memset

cnp.import_array()

ctypedef cnp.intp_t intp_t


cdef extern from "kernels.h" nogil:
    ctypedef struct ca_kernels:
        const char *name
        void (*score_f32)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                          const float *kt, Py_ssize_t kt_panel_stride, Py_ssize_t n_cols,
                          Py_ssize_t d_k, float factor, float *s, Py_ssize_t lds,
                          const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        void (*score_f64)(const double *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                          const double *kt, Py_ssize_t kt_panel_stride, Py_ssize_t n_cols,
                          Py_ssize_t d_k, double factor, double *s, Py_ssize_t lds,
                          const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_f32)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                       const float *v, Py_ssize_t v_panel_stride, Py_ssize_t n_keys,
                       Py_ssize_t n_vcols, float *acc, Py_ssize_t ldacc,
                       const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_f64)(const double *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                       const double *v, Py_ssize_t v_panel_stride, Py_ssize_t n_keys,
                       Py_ssize_t n_vcols, double *acc, Py_ssize_t ldacc,
                       const void *ahead, Py_ssize_t ahead_bytes) noexcept nogil
        float (*row_max_f32)(const float *x, Py_ssize_t n) noexcept nogil
        double (*row_max_f64)(const double *x, Py_ssize_t n) noexcept nogil
        float (*exp_sum_f32)(float *x, Py_ssize_t n, float shift) noexcept nogil
        double (*exp_sum_f64)(double *x, Py_ssize_t n, double shift) noexcept nogil
        void (*score_direct_f32)(const float *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                                 const float *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                                 Py_ssize_t d_k, float factor, float *s,
                                 Py_ssize_t lds, const void *ahead,
                                 Py_ssize_t ahead_stride,
                                 Py_ssize_t ahead_bytes) noexcept nogil
        void (*score_direct_f64)(const double *q, Py_ssize_t ldq, Py_ssize_t n_rows,
                                 const double *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                                 Py_ssize_t d_k, double factor, double *s,
                                 Py_ssize_t lds, const void *ahead,
                                 Py_ssize_t ahead_stride,
                                 Py_ssize_t ahead_bytes) noexcept nogil
        void (*pv_direct_f32)(const float *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                              const float *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                              Py_ssize_t d_v, float *acc, Py_ssize_t ldacc,
                              const void *ahead, Py_ssize_t ahead_stride,
                              Py_ssize_t ahead_bytes) noexcept nogil
        void (*half_rows_to_f32)(const uint16_t *src, Py_ssize_t src_row, Py_ssize_t src_col,
                                 Py_ssize_t n_rows, Py_ssize_t n_cols, float *dst,
                                 Py_ssize_t ld_dst) noexcept nogil
        void (*softcap_f32)(float *x, Py_ssize_t n, float cap) noexcept nogil
        void (*pack_kt_f32)(const float *k, Py_ssize_t ldk, Py_ssize_t n_keys,
                            Py_ssize_t d_k, float *kt,
                            Py_ssize_t kt_panel_stride) noexcept nogil
        int (*pack_v_f32)(const float *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                          Py_ssize_t d_v, float *v_packed,
                          Py_ssize_t v_panel_stride) noexcept nogil
        void (*pv_direct_f64)(const double *p, Py_ssize_t ldp, Py_ssize_t n_rows,
                              const double *v, Py_ssize_t ldv, Py_ssize_t n_keys,
                              Py_ssize_t d_v, double *acc, Py_ssize_t ldacc,
                              const void *ahead, Py_ssize_t ahead_stride,
                              Py_ssize_t ahead_bytes) noexcept nogil

    enum: CA_PANEL_F32
    enum: CA_PANEL_F64
    float ca_half_to_float(uint16_t h)
    void ca_note_parallel_region()
    int ca_forked_after_parallel()
    void ca_softcap_f64(double *x, Py_ssize_t n, double cap)
    const ca_kernels *ca_default_kernels()
    const ca_kernels *ca_kernels_by_name(const char *name)
    int ca_available_kernels(const char **names, int capacity)
    const char *ca_compiler_version()
    enum: CA_SCRATCH_WORKSPACE
    enum: CA_SCRATCH_PACKED
    enum: CA_SCRATCH_PARTIAL
    void *ca_scratch_acquire(int slot, size_t n_bytes)
    void ca_scratch_release(int slot, void *ptr)


cdef extern from "<float.h>" nogil:
    const float FLT_TRUE_MIN   # C11: the smallest positive (subnormal) float


cdef extern from "team.h" nogil:
    double CA_TEAM_FLOPS_PER_NS
    double CA_TEAM_BYTES_PER_NS
    int ca_team_size(int n_threads, double serial_ns)
    void ca_team_call_ended()


cdef extern from "openmp_shim.h" nogil:
    int omp_get_max_threads()
    int CA_HAVE_OPENMP
    int CA_OPENMP_VERSION
    const char *ca_openmp_runtime()


cdef enum:
    # Rows per work item: a multiple of the 6-row register tile, small enough
    # that T = 1024 with a few heads still gives both threads many items.
    Q_BLOCK = 96
    # Keys per streamed block: K^T, V and the score tile of one block stay in L2.
    K_BLOCK = 256
    # Rows per score/P.V call on a block that some rows see only in part
    # (the causal diagonal): each group computes only the key panels its
    # last row sees. A multiple of the 6-row register tile.
    ROW_GROUP = 24
    # Row padding of packed V and accumulators: a multiple of both panel
    # widths, so one workspace layout serves float and double.
    PAD = 16
    # At most this many query rows (decode, speculative decode) take the
    # direct path: K and V are read where they are, not packed, and the keys
    # may be split across threads.
    DIRECT_ROWS = 8
    # The direct path steps through keys this many at a time: score, softmax
    # and P.V of one step touch K and V rows close together, so both stream
    # from memory at once (steps of a whole K_BLOCK read 128 KiB of K, then
    # of V, and ran 20-30% slower on a memory-bound decode). Divides K_BLOCK,
    # which split chunks are multiples of.
    DIRECT_KEYS = 32
    # The direct path splits the keys until there are this many work items...
    SPLIT_TARGET_ITEMS = 16
    # ...but never into chunks below this many keys (a multiple of K_BLOCK).
    SPLIT_MIN_KEYS = 512
    # Fewer floating-point operations than this per thread and another thread
    # costs more to start and join than it saves (a few microseconds).
    MIN_FLOPS_PER_THREAD = 1 << 18
    # At most this many query blocks per batch entry for a work item to be a
    # whole batch entry (see run_packed).
    PER_ENTRY_MAX_BLOCKS = 4
    # The largest thread count a call accepts (OpenMP's num_threads is an int).
    MAX_THREADS = 2147483647

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
    const intp_t *kv_length      # valid keys of each batch entry, or NULL (all S)
    Py_ssize_t query_period      # query rows are positions 0..period-1 repeated
                                 # (grouped-query heads stacked as rows); = T
    Py_ssize_t window_left       # sliding window: keys at most this far before
    Py_ssize_t window_right      # / after the query's position; -1: unbounded
    double softcap               # logits -> softcap * tanh(logits / softcap); 0: off
    const double *alibi_slope    # per batch entry: -slope * |position - j| added
                                 # to the logits, or NULL
    void *lse                    # (n_batch, T) log-sum-exp of each row, or NULL
    # row strides (elements) of ATTN (n_batch, T, d_v) and SCORES (n_batch, T,
    # S): d_v and S from Python, any row stride through the C-level API
    Py_ssize_t ld_out
    Py_ssize_t ld_scores
    # K^T and V are packed once per distinct K/V batch entry, shared by every
    # query block that reads them (a K/V broadcast over heads is packed once)
    Py_ssize_t n_kv              # distinct K/V batch entries
    const intp_t *kv_of_batch    # batch entry -> packed index
    const intp_t *kv_source      # packed index -> a batch entry holding it
    Py_ssize_t n_key_blocks
    Py_ssize_t block_keys        # key capacity of a packed block: K_BLOCK, or
                                 # S rounded up to PAD when S is smaller
    Py_ssize_t ld_k              # rows of a packed K^T block: max(d_k, 1)
    Py_ssize_t ld_v              # length of a packed V row: d_v padded to PAD
    void *packed_k               # blocks of ld_k x K_BLOCK, (kv, key block) order
    void *packed_v               # K_BLOCK rows of ld_v per (kv, key block)
    uint8_t *value_nonfinite     # per (kv, key block): V held NaN or Inf
    bint direct                  # few query rows: K and V read in place
    Py_ssize_t itemsize          # of the compute dtype
    bint kv_half                 # K and V are float16 (computed in float32),
                                 # converted block by block as they are read
    const ca_kernels *kern       # for the float16 conversion while packing
    # direct path: keys split into chunks of split_keys (a multiple of
    # K_BLOCK), fixed by the shape alone so results do not depend on threads
    Py_ssize_t n_splits
    Py_ssize_t split_keys


cdef struct Workspace:
    void *base
    intp_t *row_lo               # first visible key of each row in the item
    intp_t *row_hi               # one past the last visible key
    # typed pointers are cast from these offsets for float or double
    Py_ssize_t off_q, off_s, off_acc, off_max, off_sum
    # direct path only: K and V rows copied when their features are strided
    Py_ssize_t off_k_rows, off_v_rows
    # when a work item is a whole batch entry (run_entry): this thread's own
    # packed K^T and V blocks of the entry and their non-finite flags, which
    # stay in cache between packing and use; NULL: the problem's shared ones
    void *own_k
    void *own_v
    uint8_t *own_nonfinite


cdef inline Py_ssize_t round_up(Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    return ((n + m - 1) // m) * m


cdef Workspace *workspace_new(const Problem *pb, size_t itemsize) noexcept nogil:
    """Lay out and allocate one thread's scratch; NULL if there is no memory."""
    cdef Py_ssize_t n_rows = Q_BLOCK if pb.n_queries > Q_BLOCK else pb.n_queries
    cdef Py_ssize_t n = 0
    cdef Workspace header
    cdef Workspace *ws = &header
    # each region starts on a 64-byte boundary (8 doubles / 16 floats)
    ws.off_q = n
    n += round_up(n_rows * pb.ld_k, 16)
    ws.off_s = n
    n += round_up(n_rows * K_BLOCK, 16)
    ws.off_acc = n
    n += round_up(n_rows * pb.ld_v, 16)
    ws.off_max = n
    n += round_up(n_rows, 16)
    ws.off_sum = n
    n += round_up(n_rows, 16)
    ws.off_k_rows = n
    ws.off_v_rows = n
    if n_rows <= DIRECT_ROWS or pb.kv_half:
        n += round_up(K_BLOCK * pb.ld_k, 16)
        ws.off_v_rows = n
        n += round_up(K_BLOCK * pb.ld_v, 16)
    # one buffer: the Workspace itself, then the regions from the next
    # 64-byte boundary
    cdef size_t header_bytes = round_up(sizeof(Workspace), 64)
    cdef char *memory = <char *>ca_scratch_acquire(
        CA_SCRATCH_WORKSPACE, header_bytes + n * itemsize + 2 * n_rows * sizeof(intp_t))
    if memory == NULL:
        return NULL
    ws.base = memory + header_bytes
    ws.own_k = NULL
    ws.own_v = NULL
    ws.own_nonfinite = NULL
    ws.row_lo = <intp_t *>(<char *>ws.base + n * itemsize)
    ws.row_hi = ws.row_lo + n_rows
    (<Workspace *>memory)[0] = header
    return <Workspace *>memory


cdef inline void workspace_delete(Workspace *ws) noexcept nogil:
    if ws != NULL and ws.own_k != NULL:
        ca_scratch_release(CA_SCRATCH_PACKED, ws.own_k)
    ca_scratch_release(CA_SCRATCH_WORKSPACE, ws)


cdef inline size_t packed_k_bytes(const Problem *pb, Py_ssize_t n_blocks,
                                  size_t itemsize) noexcept nogil:
    """Bytes of n_blocks packed K^T blocks, rounded to a cache line (the
    V blocks follow them, then a flag per block)."""
    return round_up(n_blocks * pb.ld_k * pb.block_keys * itemsize, 64)


cdef inline size_t packed_v_bytes(const Problem *pb, Py_ssize_t n_blocks,
                                  size_t itemsize) noexcept nogil:
    return round_up(n_blocks * pb.block_keys * pb.ld_v * itemsize, 64)


cdef Workspace *workspace_new_per_entry(const Problem *pb, size_t itemsize) noexcept nogil:
    """A workspace with room for the packed K/V blocks of one batch entry."""
    cdef Workspace *ws = workspace_new(pb, itemsize)
    cdef size_t k_bytes = packed_k_bytes(pb, pb.n_key_blocks, itemsize)
    cdef size_t v_bytes = packed_v_bytes(pb, pb.n_key_blocks, itemsize)
    cdef char *own
    if ws == NULL:
        return NULL
    own = <char *>ca_scratch_acquire(CA_SCRATCH_PACKED, k_bytes + v_bytes + pb.n_key_blocks)
    if own == NULL:
        workspace_delete(ws)
        return NULL
    ws.own_k = own
    ws.own_v = own + k_bytes
    ws.own_nonfinite = <uint8_t *>(own + k_bytes + v_bytes)
    return ws


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


cdef inline Py_ssize_t panel_width(floating *dtype_tag) noexcept nogil:
    if floating is float:
        return CA_PANEL_F32
    else:
        return CA_PANEL_F64


cdef void pack_keys_transposed(const Problem *pb, const floating *k, Py_ssize_t row_stride,
                               Py_ssize_t col_stride, Py_ssize_t n_keys,
                               floating *kt) noexcept nogil:
    """The n_keys rows at k, transposed into panels (see kernels.h): key j,
    feature c at kt[(j // P) * ld_k * P + c * P + j % P]; keys up to the
    panel's end are 0."""
    # sizes and strides in locals: stores through kt could alias *pb, so the
    # compiler would otherwise reload them for every element
    cdef Py_ssize_t P = panel_width(kt)
    cdef Py_ssize_t d_k = pb.d_k
    cdef Py_ssize_t panel_size = pb.ld_k * P
    cdef Py_ssize_t j, c
    cdef const floating *k_row
    cdef floating *panel
    if floating is float:
        if col_stride == 1 or d_k <= 1:
            pb.kern.pack_kt_f32(k, row_stride, n_keys, d_k, kt, panel_size)
            return
    for j in range(n_keys):
        k_row = k + j * row_stride
        panel = kt + (j // P) * panel_size + j % P
        if col_stride == 1:
            for c in range(d_k):
                panel[c * P] = k_row[c]
        else:
            for c in range(d_k):
                panel[c * P] = k_row[c * col_stride]
    for j in range(n_keys, round_up(n_keys, P)):
        panel = kt + (j // P) * panel_size + j % P
        for c in range(d_k):
            panel[c * P] = 0


cdef bint pack_values(const Problem *pb, const floating *v, Py_ssize_t row_stride,
                      Py_ssize_t col_stride, Py_ssize_t n_keys,
                      floating *v_packed) noexcept nogil:
    """The n_keys rows at v in panels (see kernels.h): key j, column c at
    v_packed[(c // P) * block_keys * P + j * P + c % P], zero past d_v.

    Every NaN or Inf is replaced by 0; returns True if there was any
    (add_nonfinite_values then adds them back for the rows that give their
    key a nonzero weight). A key of weight 0 thus contributes
    fma(0, 0, acc) == acc, exactly what a finite value would, so a NaN or Inf
    in a masked-out value changes no bit of the output."""
    cdef Py_ssize_t P = panel_width(v_packed)
    cdef Py_ssize_t d_v = pb.d_v
    cdef Py_ssize_t ld_v = pb.ld_v
    cdef Py_ssize_t panel_stride = pb.block_keys * P
    cdef Py_ssize_t j, c, l, n_full = d_v // P
    cdef const floating *v_row
    cdef floating *dst
    cdef floating x
    # x - x is 0 for finite x and NaN for NaN or +-Inf, so these sums turn
    # NaN exactly when some value is not finite; one per lane of a panel,
    # which leaves the compiler free to vectorise (a branch would not)
    cdef floating probe[16]
    if floating is float:
        if col_stride == 1 or d_v <= 1:
            if pb.kern.pack_v_f32(v, row_stride, n_keys, d_v, v_packed, panel_stride):
                zero_nonfinite(pb, n_keys, v_packed)
                return True
            return False
    for l in range(16):
        probe[l] = 0
    for j in range(n_keys):
        v_row = v + j * row_stride
        for c in range(n_full):
            dst = v_packed + c * panel_stride + j * P
            if col_stride == 1:
                for l in range(P):
                    x = v_row[c * P + l]
                    probe[l] += x - x
                    dst[l] = x
            else:
                for l in range(P):
                    x = v_row[(c * P + l) * col_stride]
                    probe[l] += x - x
                    dst[l] = x
        if ld_v > n_full * P:
            dst = v_packed + n_full * panel_stride + j * P
            for l in range(P):
                if n_full * P + l < d_v:
                    x = v_row[(n_full * P + l) * col_stride]
                    probe[l] += x - x
                    dst[l] = x
                else:
                    dst[l] = 0
            # double panels are 8 wide and ld_v a multiple of 16: a panel
            # wholly past d_v is zero too (the P.V kernel reads it)
            for c in range(n_full + 1, ld_v // P):
                dst = v_packed + c * panel_stride + j * P
                for l in range(P):
                    dst[l] = 0
    x = 0
    for l in range(P):
        x += probe[l]
    if x == x:
        return False
    zero_nonfinite(pb, n_keys, v_packed)
    return True


cdef void zero_nonfinite(const Problem *pb, Py_ssize_t n_keys,
                         floating *v_packed) noexcept nogil:
    """Every NaN or Inf of a packed V block set to 0 (rare)."""
    cdef Py_ssize_t P = panel_width(v_packed)
    cdef Py_ssize_t panel_stride = pb.block_keys * P
    cdef Py_ssize_t j, c
    cdef floating *dst
    for j in range(n_keys):
        for c in range(pb.ld_v):
            dst = v_packed + (c // P) * panel_stride + j * P + c % P
            if (dst[0] - dst[0]) != 0:
                dst[0] = 0


cdef inline floating *packed_keys(const Problem *pb, const Workspace *ws,
                                  Py_ssize_t block, floating *dtype_tag) noexcept nogil:
    """K^T of packed block ``block`` (= kv * n_key_blocks + key block)."""
    if ws.own_k != NULL:
        return <floating *>ws.own_k + (block % pb.n_key_blocks) * pb.ld_k * pb.block_keys
    return <floating *>pb.packed_k + block * pb.ld_k * pb.block_keys


cdef inline floating *packed_values(const Problem *pb, const Workspace *ws,
                                    Py_ssize_t block, floating *dtype_tag) noexcept nogil:
    if ws.own_v != NULL:
        return <floating *>ws.own_v + (block % pb.n_key_blocks) * pb.block_keys * pb.ld_v
    return <floating *>pb.packed_v + block * pb.block_keys * pb.ld_v


cdef inline uint8_t *nonfinite_flag(const Problem *pb, const Workspace *ws,
                                    Py_ssize_t block) noexcept nogil:
    """Whether packed V block ``block`` held NaN or Inf."""
    if ws.own_nonfinite != NULL:
        return ws.own_nonfinite + block % pb.n_key_blocks
    return pb.value_nonfinite + block


cdef void pack_block(Problem *pb, Workspace *ws, Py_ssize_t block,
                     floating *dtype_tag) noexcept nogil:
    """Pack K^T and V of one (kv, key block) from the caller's arrays."""
    cdef Py_ssize_t kv = block // pb.n_key_blocks
    cdef Py_ssize_t key0 = (block % pb.n_key_blocks) * K_BLOCK
    cdef Py_ssize_t b = pb.kv_source[kv]
    cdef Py_ssize_t n_keys = pb.n_keys - key0 if pb.n_keys - key0 < K_BLOCK else K_BLOCK
    cdef Py_ssize_t ld_k_rows, ld_v_rows
    cdef const floating *k_rows = rows_in_place(pb, &pb.k, b, key0, n_keys, pb.d_k,
                                                <floating *>ws.base + ws.off_k_rows,
                                                pb.ld_k, &ld_k_rows, True)
    pack_keys_transposed(pb, k_rows, ld_k_rows, 1 if pb.kv_half else pb.k.col_stride,
                         n_keys, packed_keys(pb, ws, block, dtype_tag))
    cdef const floating *v_rows
    if pb.d_v > 0:
        v_rows = rows_in_place(pb, &pb.v, b, key0, n_keys, pb.d_v,
                               <floating *>ws.base + ws.off_v_rows, pb.ld_v, &ld_v_rows, True)
        nonfinite_flag(pb, ws, block)[0] = pack_values(
            pb, v_rows, ld_v_rows, 1 if pb.kv_half else pb.v.col_stride, n_keys,
            packed_values(pb, ws, block, dtype_tag))
    else:
        nonfinite_flag(pb, ws, block)[0] = 0


cdef void add_nonfinite_values(const Problem *pb, Py_ssize_t b, Py_ssize_t key0,
                               Py_ssize_t n_keys, const floating *p, Py_ssize_t ldp,
                               Py_ssize_t n_rows, floating *acc,
                               Py_ssize_t ldacc) noexcept nogil:
    """acc[i, c] += p[i, j] * V[key0 + j, c] for the NaN/Inf entries of V that
    pack_values zeroed, in rows where key j has a nonzero weight."""
    cdef const floating *v = <const floating *>pb.v.data + pb.v.batch_offset[b]
    cdef const uint16_t *v_half = <const uint16_t *>pb.v.data + pb.v.batch_offset[b]
    cdef Py_ssize_t i, j, c, at
    cdef floating x
    for j in range(n_keys):
        for c in range(pb.d_v):
            at = (key0 + j) * pb.v.row_stride + c * pb.v.col_stride
            x = <floating>ca_half_to_float(v_half[at]) if pb.kv_half else v[at]
            if (x - x) == 0:
                continue
            for i in range(n_rows):
                if p[i * ldp + j] != 0:
                    acc[i * ldacc + c] += p[i * ldp + j] * x


cdef void visible_ranges(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                         Py_ssize_t n_rows, intp_t *row_lo, intp_t *row_hi) noexcept nogil:
    """Keys each query row of batch entry b may see before the explicit mask:
    [row_lo, row_hi). Only the first kv_length[b] keys exist when lengths are
    given (right padding, as in a batched KV cache)."""
    cdef Py_ssize_t i, lo, hi, position
    cdef Py_ssize_t n_valid = pb.kv_length[b] if pb.kv_length != NULL else pb.n_keys
    # alignment is bottom-right: the queries are the last T positions of the
    # valid keys, so query row r sits at key position r + (n_valid - T)
    cdef Py_ssize_t offset = n_valid - pb.query_period
    for i in range(n_rows):
        position = (row0 + i) % pb.query_period + offset
        lo = 0
        hi = n_valid
        if pb.causal and position + 1 < hi:
            hi = position + 1
        if pb.window_right >= 0 and position + pb.window_right + 1 < hi:
            hi = position + pb.window_right + 1
        if pb.window_left >= 0 and position - pb.window_left > lo:
            lo = position - pb.window_left
        if hi < 0:
            hi = 0
        if lo > hi:
            lo = hi
        row_lo[i] = lo
        row_hi[i] = hi


cdef void mask_scores(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                      Py_ssize_t n_rows, Py_ssize_t key0, Py_ssize_t n_keys,
                      const intp_t *row_lo, const intp_t *row_hi,
                      floating *s, Py_ssize_t lds) noexcept nogil:
    """Turn scaled logits into final ones, in place: softcap, then ALiBi, then
    the mask; invisible logits become -inf.

    Masked logits are overwritten, never added to, so a NaN or Inf computed
    from a masked-out key cannot survive. The softcap comes before the mask
    (the order ONNX settled on: capping after an additive mask would lift
    masked logits back towards the others)."""
    cdef Py_ssize_t i, j, lo, hi, position
    cdef double slope
    cdef floating *s_row
    cdef const uint8_t *mask_bool
    cdef const float *mask_f32
    cdef const double *mask_f64
    cdef Py_ssize_t m_row, m_col = pb.mask.col_stride
    cdef double bias
    for i in range(n_rows):
        s_row = s + i * lds
        # the row's visible keys within this block, clipped to it (a window
        # can start past the block's end)
        lo = row_lo[i] - key0
        hi = row_hi[i] - key0
        if lo < 0:
            lo = 0
        if lo > n_keys:
            lo = n_keys
        if hi > n_keys:
            hi = n_keys
        if hi < lo:
            hi = lo
        for j in range(lo):
            s_row[j] = -INFINITY
        for j in range(hi, n_keys):
            s_row[j] = -INFINITY
        if hi == lo:
            continue
        if pb.softcap > 0:
            kernel_softcap(pb.kern, s_row + lo, hi - lo, pb.softcap)
        if pb.alibi_slope != NULL:
            slope = pb.alibi_slope[b]
            position = (row0 + i) % pb.query_period + (
                (pb.kv_length[b] if pb.kv_length != NULL else pb.n_keys) - pb.query_period)
            for j in range(lo, hi):
                s_row[j] = s_row[j] - <floating>(slope * labs(position - (key0 + j)))
        if pb.mask_kind == MASK_NONE:
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


cdef inline void kernel_softcap(const ca_kernels *kern, floating *x, Py_ssize_t n,
                                double cap) noexcept nogil:
    if floating is float:
        kern.softcap_f32(x, n, <float>cap)
    else:
        ca_softcap_f64(x, n, cap)


cdef inline void kernel_score(const ca_kernels *kern, const floating *q, Py_ssize_t ldq,
                              Py_ssize_t n_rows, const floating *kt, Py_ssize_t kt_panel_stride,
                              Py_ssize_t n_cols, Py_ssize_t d_k, double factor,
                              floating *s, Py_ssize_t lds, const void *ahead=NULL,
                              Py_ssize_t ahead_bytes=0) noexcept nogil:
    if floating is float:
        kern.score_f32(q, ldq, n_rows, kt, kt_panel_stride, n_cols, d_k, <float>factor, s, lds,
                       ahead, ahead_bytes)
    else:
        kern.score_f64(q, ldq, n_rows, kt, kt_panel_stride, n_cols, d_k, factor, s, lds,
                       ahead, ahead_bytes)


cdef inline void kernel_pv(const ca_kernels *kern, const floating *p,
                           Py_ssize_t ldp, Py_ssize_t n_rows, const floating *v,
                           Py_ssize_t v_panel_stride, Py_ssize_t n_keys, Py_ssize_t n_vcols,
                           floating *acc, Py_ssize_t ldacc, const void *ahead=NULL,
                           Py_ssize_t ahead_bytes=0) noexcept nogil:
    if floating is float:
        kern.pv_f32(p, ldp, n_rows, v, v_panel_stride, n_keys, n_vcols, acc, ldacc,
                    ahead, ahead_bytes)
    else:
        kern.pv_f64(p, ldp, n_rows, v, v_panel_stride, n_keys, n_vcols, acc, ldacc,
                    ahead, ahead_bytes)


cdef inline void kernel_score_direct(const ca_kernels *kern, const floating *q,
                                     Py_ssize_t ldq, Py_ssize_t n_rows, const floating *k,
                                     Py_ssize_t ldk, Py_ssize_t n_keys, Py_ssize_t d_k,
                                     double factor, floating *s, Py_ssize_t lds,
                                     const void *ahead, Py_ssize_t ahead_stride,
                                     Py_ssize_t ahead_bytes) noexcept nogil:
    if floating is float:
        kern.score_direct_f32(q, ldq, n_rows, k, ldk, n_keys, d_k, <float>factor, s, lds,
                              ahead, ahead_stride, ahead_bytes)
    else:
        kern.score_direct_f64(q, ldq, n_rows, k, ldk, n_keys, d_k, factor, s, lds,
                              ahead, ahead_stride, ahead_bytes)


cdef inline void kernel_pv_direct(const ca_kernels *kern, const floating *p, Py_ssize_t ldp,
                                  Py_ssize_t n_rows, const floating *v, Py_ssize_t ldv,
                                  Py_ssize_t n_keys, Py_ssize_t d_v, floating *acc,
                                  Py_ssize_t ldacc, const void *ahead, Py_ssize_t ahead_stride,
                                  Py_ssize_t ahead_bytes) noexcept nogil:
    if floating is float:
        kern.pv_direct_f32(p, ldp, n_rows, v, ldv, n_keys, d_v, acc, ldacc,
                           ahead, ahead_stride, ahead_bytes)
    else:
        kern.pv_direct_f64(p, ldp, n_rows, v, ldv, n_keys, d_v, acc, ldacc,
                           ahead, ahead_stride, ahead_bytes)


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


cdef void begin_rows(const Problem *pb, Workspace *ws, Py_ssize_t b, Py_ssize_t row0,
                     Py_ssize_t n_rows, floating *dtype_tag, Py_ssize_t *first_key,
                     Py_ssize_t *last_key) noexcept nogil:
    """Visible key ranges of the rows, the range over all of them, and a
    fresh online-softmax state (row maximum -inf, sum 0, accumulator 0)."""
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef Py_ssize_t i
    visible_ranges(pb, b, row0, n_rows, ws.row_lo, ws.row_hi)
    first_key[0] = pb.n_keys
    last_key[0] = 0
    for i in range(n_rows):
        if ws.row_hi[i] > ws.row_lo[i]:
            if ws.row_lo[i] < first_key[0]:
                first_key[0] = ws.row_lo[i]
            if ws.row_hi[i] > last_key[0]:
                last_key[0] = ws.row_hi[i]
        row_max[i] = -INFINITY
        row_sum[i] = 0
    memset(acc, 0, n_rows * pb.ld_v * sizeof(floating))


cdef void softmax_block(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                        Py_ssize_t n_rows, Py_ssize_t n_keys,
                        floating *s) noexcept nogil:
    """Online softmax over one key block of masked logits s (rows K_BLOCK
    apart): update each row's maximum and sum, rescale its accumulator when
    the maximum grows, and leave the block's weights e^(s - max) in s."""
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef Py_ssize_t i, c
    cdef floating tile_max, alpha
    cdef floating *s_row
    cdef floating *acc_row
    for i in range(n_rows):
        s_row = s + i * K_BLOCK
        tile_max = kernel_row_max(kern, s_row, n_keys)
        if tile_max == -INFINITY:
            # nothing visible in this block: weights exactly zero
            memset(s_row, 0, n_keys * sizeof(floating))
            continue
        if tile_max != tile_max:
            # a NaN logit where a key is visible: the row is NaN, as in the
            # reference (and stays NaN through later blocks)
            row_max[i] = tile_max
        elif tile_max > row_max[i]:
            if row_max[i] != -INFINITY:
                alpha = <floating>exp(row_max[i] - tile_max)
                row_sum[i] *= alpha
                acc_row = acc + i * pb.ld_v
                for c in range(pb.d_v):
                    acc_row[c] *= alpha
            row_max[i] = tile_max
        row_sum[i] += kernel_exp_sum(kern, s_row, n_keys, row_max[i])


cdef inline void store_lse(const Problem *pb, Py_ssize_t row, floating row_max,
                           floating row_sum) noexcept nogil:
    """log-sum-exp of a row's scaled, masked logits (-inf when it sees no key)."""
    cdef floating *lse = <floating *>pb.lse
    if lse != NULL:
        lse[row] = row_max if row_max == -INFINITY else row_max + <floating>log(row_sum)


cdef void finish_rows(const Problem *pb, Workspace *ws, Py_ssize_t n_rows,
                      floating *out, Py_ssize_t ld_out, Py_ssize_t first_row) noexcept nogil:
    """out[i, :d_v] = acc[i] / sum[i]; zeros for a row that sees no key.
    Also the rows' log-sum-exp when asked, at first_row (= b * T + row0)."""
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef Py_ssize_t i, c
    cdef floating *out_row
    cdef floating *acc_row
    for i in range(n_rows):
        store_lse(pb, first_row + i, row_max[i], row_sum[i])
        out_row = out + i * ld_out
        if row_max[i] == -INFINITY:
            # a row that sees no key gives zeros, not 0/0
            memset(out_row, 0, pb.d_v * sizeof(floating))
        else:
            acc_row = acc + i * pb.ld_v
            for c in range(pb.d_v):
                out_row[c] = acc_row[c] / row_sum[i]


cdef void attend_item(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                      Py_ssize_t b, Py_ssize_t row0, Py_ssize_t n_rows,
                      floating *out) noexcept nogil:
    """ATTN for one block of query rows, streaming packed key blocks."""
    cdef floating *q_packed = <floating *>ws.base + ws.off_q
    cdef floating *s = <floating *>ws.base + ws.off_s
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef Py_ssize_t first_packed = pb.kv_of_batch[b] * pb.n_key_blocks
    cdef Py_ssize_t P = panel_width(q_packed)
    cdef Py_ssize_t key0, n_keys, first_key, last_key, block, group0, group_rows, i
    # keys seen by each group of ROW_GROUP rows (Q_BLOCK / ROW_GROUP <= 16)
    cdef Py_ssize_t group_keys[16]
    cdef Py_ssize_t n_groups, group
    cdef const floating *kt
    cdef const floating *v_packed
    cdef const floating *next_kt
    cdef const floating *next_v
    cdef Py_ssize_t k_block_bytes = pb.ld_k * pb.block_keys * sizeof(floating)
    cdef Py_ssize_t v_block_bytes = pb.block_keys * pb.ld_v * sizeof(floating)

    begin_rows(pb, ws, b, row0, n_rows, q_packed, &first_key, &last_key)
    if last_key > first_key:
        pack_queries(pb, b, row0, n_rows, q_packed, pb.ld_k)
        # key blocks sit on fixed multiples of K_BLOCK whatever the rows see
        key0 = (first_key // K_BLOCK) * K_BLOCK
        while key0 < last_key:
            n_keys = pb.n_keys - key0 if pb.n_keys - key0 < K_BLOCK else K_BLOCK
            if n_keys > last_key - key0:
                n_keys = last_key - key0
            block = first_packed + key0 // K_BLOCK
            kt = packed_keys(pb, ws, block, s)
            v_packed = packed_values(pb, ws, block, s)
            # the next block's K^T and V are fetched into L2 during this one
            next_kt = NULL
            next_v = NULL
            if key0 + K_BLOCK < last_key:
                next_kt = packed_keys(pb, ws, block + 1, s)
                next_v = packed_values(pb, ws, block + 1, s)
            # keys each group of rows can see in this block: on the causal
            # diagonal the upper rows skip the panels only lower rows see
            n_groups = (n_rows + ROW_GROUP - 1) // ROW_GROUP
            for group in range(n_groups):
                group_keys[group] = 0
            for i in range(n_rows):
                if ws.row_hi[i] - key0 > group_keys[i // ROW_GROUP]:
                    group_keys[i // ROW_GROUP] = ws.row_hi[i] - key0
            for group in range(n_groups):
                if group_keys[group] > n_keys:
                    group_keys[group] = n_keys
            if group_keys[0] == n_keys:
                # the first rows see the whole block, so all do: one call
                kernel_score(kern, q_packed, pb.ld_k, n_rows, kt, pb.ld_k * P,
                             round_up(n_keys, P), pb.d_k, pb.scale, s, K_BLOCK,
                             next_kt, k_block_bytes)
            else:
                for i in range(n_groups):
                    group0 = i * ROW_GROUP
                    group_rows = min(ROW_GROUP, n_rows - group0)
                    if group_keys[i] > 0:
                        kernel_score(kern, q_packed + group0 * pb.ld_k, pb.ld_k, group_rows,
                                     kt, pb.ld_k * P, round_up(group_keys[i], P), pb.d_k,
                                     pb.scale, s + group0 * K_BLOCK, K_BLOCK)
            # columns a group skipped lie past its rows' visible range, so
            # masking overwrites them with -inf before anything reads them
            mask_scores(pb, b, row0, n_rows, key0, n_keys, ws.row_lo, ws.row_hi, s, K_BLOCK)
            softmax_block(pb, kern, ws, n_rows, n_keys, s)
            if group_keys[0] == n_keys:
                kernel_pv(kern, s, K_BLOCK, n_rows, v_packed, pb.block_keys * P, n_keys,
                          pb.ld_v, acc, pb.ld_v, next_v, v_block_bytes)
            else:
                for i in range(n_groups):
                    group0 = i * ROW_GROUP
                    group_rows = min(ROW_GROUP, n_rows - group0)
                    if group_keys[i] > 0:
                        kernel_pv(kern, s + group0 * K_BLOCK, K_BLOCK, group_rows, v_packed,
                                  pb.block_keys * P, group_keys[i], pb.ld_v,
                                  acc + group0 * pb.ld_v, pb.ld_v)
            if nonfinite_flag(pb, ws, block)[0]:
                add_nonfinite_values(pb, b, key0, n_keys, s, K_BLOCK, n_rows, acc, pb.ld_v)
            key0 += K_BLOCK
    finish_rows(pb, ws, n_rows, out + (b * pb.n_queries + row0) * pb.ld_out, pb.ld_out,
                b * pb.n_queries + row0)


cdef const floating *rows_in_place(const Problem *pb, const Operand *op, Py_ssize_t b,
                                   Py_ssize_t key0, Py_ssize_t n_keys,
                                   Py_ssize_t n_features, floating *copy,
                                   Py_ssize_t ld_copy, Py_ssize_t *ld,
                                   bint strided_ok) noexcept nogil:
    """Rows key0.. of K or V as compute-dtype values with contiguous features
    (row stride in *ld): where the caller keeps them, or copied into ``copy``
    when they are float16 (converted) or, unless strided_ok, strided. The
    kernels see the same values either way, so every layout gives the same
    bits."""
    cdef const floating *base = <const floating *>op.data + op.batch_offset[b]
    cdef const floating *row
    cdef Py_ssize_t j, c
    if pb.kv_half:
        if floating is float:
            pb.kern.half_rows_to_f32(<const uint16_t *>op.data + op.batch_offset[b]
                                     + key0 * op.row_stride, op.row_stride,
                                     op.col_stride, n_keys, n_features, copy, ld_copy)
        ld[0] = ld_copy
        return copy
    if strided_ok or op.col_stride == 1 or n_features <= 1:
        ld[0] = op.row_stride
        return base + key0 * op.row_stride
    for j in range(n_keys):
        row = base + (key0 + j) * op.row_stride
        for c in range(n_features):
            copy[j * ld_copy + c] = row[c * op.col_stride]
    ld[0] = ld_copy
    return copy


cdef inline const char *contiguous_rows(const Problem *pb, const Operand *op,
                                        Py_ssize_t b, Py_ssize_t key0,
                                        Py_ssize_t n_features) noexcept nogil:
    """Address of row key0 of K or V when its features are contiguous, else
    NULL (for prefetching: rows are kv_itemsize * row_stride bytes apart)."""
    if op.col_stride == 1 or n_features <= 1:
        return (<const char *>op.data
                + (op.batch_offset[b] + key0 * op.row_stride) * kv_itemsize(pb))
    return NULL


cdef inline Py_ssize_t kv_itemsize(const Problem *pb) noexcept nogil:
    return 2 if pb.kv_half else pb.itemsize


cdef void attend_direct(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                        Py_ssize_t b, Py_ssize_t split, floating *out,
                        floating *partial) noexcept nogil:
    """ATTN of all (few) query rows of batch entry b over key chunk ``split``,
    K and V read in place. With one chunk the result goes to out; otherwise
    the chunk's row maximum, sum and accumulator go to ``partial`` for
    merge_splits."""
    cdef floating *q_rows = <floating *>ws.base + ws.off_q
    cdef floating *s = <floating *>ws.base + ws.off_s
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef floating *row_sum = <floating *>ws.base + ws.off_sum
    cdef Py_ssize_t n_rows = pb.n_queries
    cdef Py_ssize_t chunk_lo = split * pb.split_keys
    cdef Py_ssize_t chunk_hi = chunk_lo + pb.split_keys
    cdef Py_ssize_t key0, n_keys, first_key, last_key, ld_k_rows, ld_v_rows, i, c
    cdef Py_ssize_t next_keys
    cdef const floating *k_rows
    cdef const floating *v_rows
    cdef floating *state

    begin_rows(pb, ws, b, 0, n_rows, s, &first_key, &last_key)
    if first_key < chunk_lo:
        first_key = chunk_lo
    if last_key > chunk_hi:
        last_key = chunk_hi
    if last_key > first_key:
        pack_queries(pb, b, 0, n_rows, q_rows, pb.ld_k)
        key0 = (first_key // DIRECT_KEYS) * DIRECT_KEYS
        while key0 < last_key:
            n_keys = pb.n_keys - key0 if pb.n_keys - key0 < DIRECT_KEYS else DIRECT_KEYS
            k_rows = rows_in_place(pb, &pb.k, b, key0, n_keys, pb.d_k,
                                   <floating *>ws.base + ws.off_k_rows, pb.ld_k, &ld_k_rows,
                                   False)
            # while one kernel streams its operand, it prefetches the block the
            # other reads next (contiguous rows only), keeping two streams busy
            next_keys = last_key - key0 - DIRECT_KEYS
            if next_keys > DIRECT_KEYS:
                next_keys = DIRECT_KEYS
            kernel_score_direct(kern, q_rows, pb.ld_k, n_rows, k_rows, ld_k_rows, n_keys,
                                pb.d_k, pb.scale, s, K_BLOCK,
                                contiguous_rows(pb, &pb.v, b, key0, pb.d_v),
                                pb.v.row_stride * kv_itemsize(pb), pb.d_v * kv_itemsize(pb))
            mask_scores(pb, b, 0, n_rows, key0, n_keys, ws.row_lo, ws.row_hi, s, K_BLOCK)
            softmax_block(pb, kern, ws, n_rows, n_keys, s)
            v_rows = rows_in_place(pb, &pb.v, b, key0, n_keys, pb.d_v,
                                   <floating *>ws.base + ws.off_v_rows, pb.ld_v, &ld_v_rows,
                                   False)
            # (x86 drops a prefetch past the end of K without a fault)
            kernel_pv_direct(kern, s, K_BLOCK, n_rows, v_rows, ld_v_rows, n_keys, pb.d_v,
                             acc, pb.ld_v,
                             contiguous_rows(pb, &pb.k, b, key0 + DIRECT_KEYS, pb.d_k)
                             if next_keys > 0 else NULL,
                             pb.k.row_stride * kv_itemsize(pb), pb.d_k * kv_itemsize(pb))
            key0 += DIRECT_KEYS
    if pb.n_splits == 1:
        finish_rows(pb, ws, n_rows, out + b * n_rows * pb.ld_out, pb.ld_out, b * n_rows)
        return
    # per row: maximum, sum, then the unnormalised accumulator
    state = partial + (b * pb.n_splits + split) * n_rows * (pb.d_v + 2)
    for i in range(n_rows):
        state[0] = row_max[i]
        state[1] = row_sum[i]
        for c in range(pb.d_v):
            state[2 + c] = acc[i * pb.ld_v + c]
        state += pb.d_v + 2


cdef void merge_splits(const Problem *pb, Py_ssize_t b, const floating *partial,
                       floating *out) noexcept nogil:
    """Combine the key chunks of batch entry b in chunk order (so the result
    does not depend on which thread did which chunk):
    max = max_i max_i, sum = sum_i sum_i e^(max_i - max),
    out = sum_i acc_i e^(max_i - max) / sum."""
    cdef Py_ssize_t n_rows = pb.n_queries
    cdef Py_ssize_t stride = n_rows * (pb.d_v + 2)
    cdef const floating *first = partial + b * pb.n_splits * stride
    cdef const floating *state
    cdef floating *out_row
    cdef Py_ssize_t i, split, c
    cdef floating total_max, total_sum, weight
    for i in range(n_rows):
        out_row = out + (b * n_rows + i) * pb.ld_out
        total_max = -INFINITY
        for split in range(pb.n_splits):
            state = first + split * stride + i * (pb.d_v + 2)
            if state[0] > total_max or state[0] != state[0]:
                total_max = state[0]
                if total_max != total_max:
                    break
        if total_max == -INFINITY:
            store_lse(pb, b * n_rows + i, total_max, 0)
            memset(out_row, 0, pb.d_v * sizeof(floating))
            continue
        memset(out_row, 0, pb.d_v * sizeof(floating))
        total_sum = 0
        for split in range(pb.n_splits):
            state = first + split * stride + i * (pb.d_v + 2)
            if state[0] == -INFINITY:
                continue
            weight = <floating>exp(state[0] - total_max)
            total_sum += state[1] * weight
            for c in range(pb.d_v):
                out_row[c] += state[2 + c] * weight
        for c in range(pb.d_v):
            out_row[c] = out_row[c] / total_sum
        store_lse(pb, b * n_rows + i, total_max, total_sum)


cdef void attend_item_with_scores(const Problem *pb, const ca_kernels *kern,
                                  Workspace *ws, Py_ssize_t b, Py_ssize_t row0,
                                  Py_ssize_t n_rows, floating *out,
                                  floating *scores) noexcept nogil:
    """SCORES and (if out is not NULL) ATTN for one block of query rows.

    The rows of the caller's SCORES array are the scratch: logits are written
    there, then turned into weights in place, then multiplied by V."""
    cdef floating *q_packed = <floating *>ws.base + ws.off_q
    cdef floating *s = <floating *>ws.base + ws.off_s
    cdef const floating *kt
    cdef const floating *v_packed
    cdef Py_ssize_t first_packed = pb.kv_of_batch[b] * pb.n_key_blocks
    cdef floating *acc = <floating *>ws.base + ws.off_acc
    cdef floating *row_max = <floating *>ws.base + ws.off_max
    cdef Py_ssize_t P = panel_width(q_packed)
    cdef Py_ssize_t n_keys_total = pb.n_keys
    cdef Py_ssize_t ld_scores = pb.ld_scores
    cdef Py_ssize_t i, j, c, key0, n_keys, first_key, last_key, first_block
    cdef floating tile_max, row_total
    cdef floating *s_row
    cdef floating *scores_row
    cdef floating *scores_block = scores + (b * pb.n_queries + row0) * ld_scores
    cdef const floating *k_rows
    cdef const floating *v_rows
    cdef Py_ssize_t ld_rows, ld_tile
    cdef floating *tile
    cdef bint in_place

    visible_ranges(pb, b, row0, n_rows, ws.row_lo, ws.row_hi)
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
        for i in range(n_rows):
            store_lse(pb, b * pb.n_queries + row0 + i, row_max[i], 0)
        for i in range(n_rows):
            memset(scores_block + i * ld_scores, 0, n_keys_total * sizeof(floating))
            if out != NULL:
                memset(out + (b * pb.n_queries + row0 + i) * pb.ld_out, 0,
                       pb.d_v * sizeof(floating))
        return

    first_block = (first_key // K_BLOCK) * K_BLOCK
    pack_queries(pb, b, row0, n_rows, q_packed, pb.ld_k)
    # pass 1: masked logits into SCORES, keys nobody sees as zeros
    for i in range(n_rows):
        scores_row = scores_block + i * ld_scores
        memset(scores_row, 0, first_block * sizeof(floating))
        if last_key < n_keys_total:
            memset(scores_row + last_key, 0, (n_keys_total - last_key) * sizeof(floating))
    key0 = first_block
    while key0 < last_key:
        n_keys = n_keys_total - key0 if n_keys_total - key0 < K_BLOCK else K_BLOCK
        if key0 + n_keys > last_key:
            n_keys = last_key - key0
        # logits go straight into SCORES, unless the kernel would write
        # past the block (a last block whose keys are not whole panels)
        in_place = pb.direct or n_keys % P == 0
        if in_place:
            tile = scores_block + key0
            ld_tile = ld_scores
        else:
            tile = s
            ld_tile = K_BLOCK
        if pb.direct:
            # few rows: keys read in place, as on the direct path
            k_rows = rows_in_place(pb, &pb.k, b, key0, n_keys, pb.d_k,
                                   <floating *>ws.base + ws.off_k_rows, pb.ld_k, &ld_rows,
                                   False)
            kernel_score_direct(kern, q_packed, pb.ld_k, n_rows, k_rows, ld_rows, n_keys,
                                pb.d_k, pb.scale, tile, ld_tile, NULL, 0, 0)
        else:
            kt = packed_keys(pb, ws, first_packed + key0 // K_BLOCK, q_packed)
            kernel_score(kern, q_packed, pb.ld_k, n_rows, kt, pb.ld_k * P,
                         round_up(n_keys, P), pb.d_k, pb.scale, tile, ld_tile)
        mask_scores(pb, b, row0, n_rows, key0, n_keys, ws.row_lo, ws.row_hi, tile, ld_tile)
        for i in range(n_rows):
            s_row = tile + i * ld_tile
            if not in_place:
                scores_row = scores_block + i * ld_scores + key0
                for j in range(n_keys):
                    scores_row[j] = s_row[j]
            tile_max = kernel_row_max(kern, s_row, n_keys)
            if tile_max > row_max[i] or tile_max != tile_max:
                row_max[i] = tile_max
        key0 += K_BLOCK

    # pass 2: weights in place over the keys this item can see
    for i in range(n_rows):
        scores_row = scores_block + i * ld_scores
        if row_max[i] == -INFINITY:
            store_lse(pb, b * pb.n_queries + row0 + i, row_max[i], 0)
            memset(scores_row + first_block, 0, (last_key - first_block) * sizeof(floating))
            continue
        row_total = kernel_exp_sum(kern, scores_row + first_block,
                                    last_key - first_block, row_max[i])
        store_lse(pb, b * pb.n_queries + row0 + i, row_max[i], row_total)
        for j in range(first_block, last_key):
            scores_row[j] = scores_row[j] / row_total

    if out == NULL:
        return

    # pass 3: ATTN = SCORES . V
    memset(acc, 0, n_rows * pb.ld_v * sizeof(floating))
    key0 = first_block
    while key0 < last_key:
        n_keys = last_key - key0 if last_key - key0 < K_BLOCK else K_BLOCK
        if pb.direct:
            v_rows = rows_in_place(pb, &pb.v, b, key0, n_keys, pb.d_v,
                                   <floating *>ws.base + ws.off_v_rows, pb.ld_v, &ld_rows,
                                   False)
            kernel_pv_direct(kern, scores_block + key0, ld_scores, n_rows, v_rows,
                             ld_rows, n_keys, pb.d_v, acc, pb.ld_v, NULL, 0, 0)
        else:
            v_packed = packed_values(pb, ws, first_packed + key0 // K_BLOCK, q_packed)
            kernel_pv(kern, scores_block + key0, ld_scores, n_rows,
                      v_packed, pb.block_keys * P, n_keys, pb.ld_v, acc, pb.ld_v)
            if nonfinite_flag(pb, ws, first_packed + key0 // K_BLOCK)[0]:
                add_nonfinite_values(pb, b, key0, n_keys, scores_block + key0, ld_scores,
                                     n_rows, acc, pb.ld_v)
        key0 += K_BLOCK
    for i in range(n_rows):
        for c in range(pb.d_v):
            out[(b * pb.n_queries + row0 + i) * pb.ld_out + c] = acc[i * pb.ld_v + c]


cdef inline void run_item(const Problem *pb, const ca_kernels *kern, Workspace *ws,
                          Py_ssize_t item, Py_ssize_t n_blocks, floating *out,
                          floating *scores) noexcept nogil:
    # One batch entry's query blocks follow each other, so the entry's
    # packed K/V stay in cache from one to the next (up to 9% faster, at 1
    # or 2 threads, than taking the entries in turn). Within an entry the
    # last query blocks, which see the most keys under a causal mask, come
    # first, so the dynamic schedule ends with cheap ones.
    cdef Py_ssize_t block = n_blocks - 1 - item % n_blocks
    cdef Py_ssize_t b = item // n_blocks
    cdef Py_ssize_t row0 = block * Q_BLOCK
    cdef Py_ssize_t n_rows = pb.n_queries - row0
    if n_rows > Q_BLOCK:
        n_rows = Q_BLOCK
    if scores != NULL:
        attend_item_with_scores(pb, kern, ws, b, row0, n_rows, out, scores)
    else:
        attend_item(pb, kern, ws, b, row0, n_rows, out)


cdef void run_entry(Problem *pb, const ca_kernels *kern, Workspace *ws,
                    Py_ssize_t b, Py_ssize_t n_blocks, floating *out,
                    floating *scores) noexcept nogil:
    """Pack the K/V of batch entry b (its own: n_kv == n_batch), then compute
    all its query blocks, in the order run_item gives them."""
    cdef Py_ssize_t kv_block, item
    for kv_block in range(pb.n_key_blocks):
        pack_block(pb, ws, pb.kv_of_batch[b] * pb.n_key_blocks + kv_block, out)
    for item in range(b * n_blocks, (b + 1) * n_blocks):
        run_item(pb, kern, ws, item, n_blocks, out, scores)


cdef int run_problem(Problem *pb, const ca_kernels *kern, int n_threads,
                     floating *out, floating *scores) noexcept nogil:
    """Returns 0, or -1 if memory ran out."""
    cdef double flops = (2.0 * pb.n_batch * pb.n_queries * pb.n_keys
                         * (pb.d_k + pb.d_v + 1))
    if ca_forked_after_parallel():
        # GNU OpenMP would wait forever for the parent's threads (see kernels.h)
        n_threads = 1
    if n_threads > 1 and flops < n_threads * <double>MIN_FLOPS_PER_THREAD:
        n_threads = <int>(flops / MIN_FLOPS_PER_THREAD)
        if n_threads < 1:
            n_threads = 1
    pb.itemsize = sizeof(floating)
    pb.kern = kern
    # the path depends on the shape alone, never on the layout or threads
    pb.direct = pb.n_queries <= DIRECT_ROWS
    cdef double kv_bytes = 0
    cdef int status
    if n_threads > 1:
        if pb.direct:
            # a decode step streams its K and V from memory
            kv_bytes = (<double>pb.n_kv * pb.n_keys * (pb.d_k + pb.d_v)
                        * (2 if pb.kv_half else sizeof(floating)))
        n_threads = ca_team_size(
            n_threads, flops * (sizeof(floating) // 4) / CA_TEAM_FLOPS_PER_NS
            + kv_bytes / CA_TEAM_BYTES_PER_NS)
    if scores == NULL and pb.direct:
        status = run_direct(pb, kern, n_threads, out)
    else:
        status = run_packed(pb, kern, n_threads, out, scores)
    ca_team_call_ended()
    return status


cdef int run_direct(Problem *pb, const ca_kernels *kern, int n_threads,
                    floating *out) noexcept nogil:
    """Few query rows: items are (batch entry, key chunk), K/V read in place."""
    cdef Py_ssize_t n_splits = 1
    cdef Py_ssize_t n_items, item, b
    cdef Workspace *ws = NULL
    cdef floating *partial = NULL
    cdef int status = 0
    cdef int *status_ptr = &status
    cdef int n_workers = n_threads
    if pb.n_batch < SPLIT_TARGET_ITEMS:
        n_splits = (SPLIT_TARGET_ITEMS + pb.n_batch - 1) // pb.n_batch
        if n_splits > (pb.n_keys + SPLIT_MIN_KEYS - 1) // SPLIT_MIN_KEYS:
            n_splits = (pb.n_keys + SPLIT_MIN_KEYS - 1) // SPLIT_MIN_KEYS
        if n_splits < 1:
            n_splits = 1
    pb.split_keys = round_up((pb.n_keys + n_splits - 1) // n_splits, K_BLOCK)
    if pb.split_keys == 0:
        pb.split_keys = K_BLOCK
    pb.n_splits = (pb.n_keys + pb.split_keys - 1) // pb.split_keys
    if pb.n_splits < 1:
        pb.n_splits = 1
    n_items = pb.n_batch * pb.n_splits
    if n_workers > n_items:
        n_workers = <int>n_items
    if pb.n_splits > 1:
        partial = <floating *>ca_scratch_acquire(
            CA_SCRATCH_PARTIAL, n_items * pb.n_queries * (pb.d_v + 2) * sizeof(floating))
        if partial == NULL:
            return -1
    if n_workers <= 1:
        ws = workspace_new(pb, sizeof(floating))
        if ws == NULL:
            status = -1
        else:
            for item in range(n_items):
                attend_direct(pb, kern, ws, item // pb.n_splits, item % pb.n_splits,
                              out, partial)
            workspace_delete(ws)
        if status == 0 and pb.n_splits > 1:
            for b in range(pb.n_batch):
                merge_splits(pb, b, partial, out)
    else:
        ca_note_parallel_region()
        with parallel(num_threads=n_workers):
            ws = workspace_new(pb, sizeof(floating))
            if ws == NULL:
                status_ptr[0] = -1
            for item in prange(n_items, schedule='dynamic'):
                if ws != NULL:
                    attend_direct(pb, kern, ws, item // pb.n_splits, item % pb.n_splits,
                                  out, partial)
            workspace_delete(ws)
            if pb.n_splits > 1:
                for b in prange(pb.n_batch, schedule='static'):
                    if status_ptr[0] == 0:
                        merge_splits(pb, b, partial, out)
    ca_scratch_release(CA_SCRATCH_PARTIAL, partial)
    return status


cdef int run_packed(Problem *pb, const ca_kernels *kern, int n_threads,
                    floating *out, floating *scores) noexcept nogil:
    """Pack K/V once, then blocks of query rows across threads."""
    cdef Py_ssize_t n_blocks = (pb.n_queries + Q_BLOCK - 1) // Q_BLOCK
    cdef Py_ssize_t n_items = n_blocks * pb.n_batch
    # with few query rows K and V are read in place, not packed
    cdef Py_ssize_t n_packed = 0 if pb.direct else pb.n_kv * pb.n_key_blocks
    cdef Py_ssize_t item, block, b
    cdef Workspace *ws = NULL
    cdef int status = 0
    cdef int *status_ptr = &status
    cdef size_t itemsize = sizeof(floating)
    cdef int n_workers = n_threads
    if n_items == 0:
        return 0
    if n_workers > n_items:
        n_workers = <int>n_items
    # Few query blocks per batch entry, each with its own K/V (many short
    # sequences, as in a BERT batch): a work item is a whole batch entry,
    # which packs its K/V and at once computes its query blocks while the
    # packed blocks are still in cache. Otherwise everything is packed
    # first, then query blocks are spread over the threads.
    cdef bint per_entry = (n_packed > 0 and pb.n_kv == pb.n_batch
                           and n_blocks <= PER_ENTRY_MAX_BLOCKS
                           and pb.n_batch >= 4 * n_workers)
    if per_entry:
        # each thread packs into its own blocks (run_entry)
        n_packed = 0
    cdef size_t k_bytes = packed_k_bytes(pb, n_packed, itemsize)
    cdef size_t v_bytes = packed_v_bytes(pb, n_packed, itemsize)
    cdef char *packed = NULL
    if not per_entry:
        packed = <char *>ca_scratch_acquire(CA_SCRATCH_PACKED, k_bytes + v_bytes + n_packed)
        if packed == NULL:
            return -1
    pb.packed_k = packed
    pb.packed_v = packed + k_bytes
    pb.value_nonfinite = <uint8_t *>(packed + k_bytes + v_bytes)
    if per_entry and n_workers <= 1:
        ws = workspace_new_per_entry(pb, itemsize)
        if ws == NULL:
            status = -1
        else:
            for b in range(pb.n_batch):
                run_entry(pb, kern, ws, b, n_blocks, out, scores)
            workspace_delete(ws)
    elif n_workers <= 1:
        ws = workspace_new(pb, itemsize)
        if ws == NULL:
            status = -1
        else:
            for block in range(n_packed):
                pack_block(pb, ws, block, out)
            for item in range(n_items):
                run_item(pb, kern, ws, item, n_blocks, out, scores)
            workspace_delete(ws)
    elif per_entry:
        ca_note_parallel_region()
        with parallel(num_threads=n_workers):
            ws = workspace_new_per_entry(pb, itemsize)
            if ws == NULL:
                status_ptr[0] = -1
            for b in prange(pb.n_batch, schedule='dynamic'):
                if ws != NULL:
                    run_entry(pb, kern, ws, b, n_blocks, out, scores)
            workspace_delete(ws)
    else:
        ca_note_parallel_region()
        with parallel(num_threads=n_workers):
            # assigned inside the parallel block, so private to each thread
            ws = workspace_new(pb, itemsize)
            if ws == NULL:
                status_ptr[0] = -1
            for block in prange(n_packed, schedule='static'):
                if ws != NULL:
                    pack_block(pb, ws, block, out)
            # (the end of a prange is a barrier: every block is packed here)
            for item in prange(n_items, schedule='dynamic'):
                if ws != NULL:
                    run_item(pb, kern, ws, item, n_blocks, out, scores)
            workspace_delete(ws)
    ca_scratch_release(CA_SCRATCH_PACKED, packed)
    return status


# ------------------------------------------------------- the Problem builder

cdef void problem_init(Problem *pb, Py_ssize_t n_batch, Py_ssize_t n_queries,
                       Py_ssize_t n_keys, Py_ssize_t d_k, Py_ssize_t d_v,
                       bint causal, double scale) noexcept nogil:
    """The one way a Problem starts: every field zero, then the defaults of
    an unmasked problem (no lengths, no window, no softcap, no ALiBi, no LSE,
    contiguous ATTN and SCORES rows). Callers then set operands and options
    and call problem_finish."""
    memset(pb, 0, sizeof(Problem))
    pb.n_batch = n_batch
    pb.n_queries = n_queries
    pb.n_keys = n_keys
    pb.d_k = d_k
    pb.d_v = d_v
    pb.causal = causal
    pb.scale = scale
    pb.mask_kind = MASK_NONE
    pb.query_period = n_queries
    pb.window_left = -1
    pb.window_right = -1
    pb.ld_out = d_v
    pb.ld_scores = n_keys
    pb.n_kv = n_batch


cdef void problem_finish(Problem *pb) noexcept nogil:
    """Derived sizes: the packed K/V layout."""
    pb.ld_k = pb.d_k if pb.d_k > 0 else 1
    pb.ld_v = round_up(pb.d_v, PAD) if pb.d_v > 0 else PAD
    pb.n_key_blocks = (pb.n_keys + K_BLOCK - 1) // K_BLOCK
    pb.block_keys = K_BLOCK if pb.n_keys >= K_BLOCK else round_up(pb.n_keys, PAD)


# ------------------------------------------------ C-level API (_attention.pxd)

cdef inline bint missing(const void *data, Py_ssize_t n_rows,
                         Py_ssize_t n_features) noexcept nogil:
    return data == NULL and n_rows > 0 and n_features > 0


cdef int c_level_attention(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                           Py_ssize_t d_v,
                           const floating *q, Py_ssize_t q_row_stride,
                           const floating *k, Py_ssize_t k_row_stride,
                           const floating *v, Py_ssize_t v_row_stride,
                           double scale, int flags,
                           floating *out, Py_ssize_t out_row_stride,
                           floating *scores, Py_ssize_t scores_row_stride,
                           floating *lse, int n_threads) noexcept nogil:
    """One head through the same driver as the Python API (batch of one)."""
    cdef intp_t zero[1]
    cdef Problem pb
    if n_queries < 0 or n_keys < 0 or d_k < 0 or d_v < 0:
        return CATTENTION_ERR_SIZE
    if flags & ~CATTENTION_CAUSAL:
        return CATTENTION_ERR_FLAGS
    if not isfinite(scale):
        return CATTENTION_ERR_SCALE
    if out == NULL and scores == NULL:
        return CATTENTION_ERR_POINTER
    if (missing(q, n_queries, d_k) or missing(k, n_keys, d_k)
            or (out != NULL and (missing(v, n_keys, d_v) or missing(out, n_queries, d_v)))):
        return CATTENTION_ERR_POINTER
    if (out != NULL and out_row_stride < d_v) or (scores != NULL
                                                   and scores_row_stride < n_keys):
        return CATTENTION_ERR_STRIDE
    if n_queries == 0:
        return CATTENTION_OK
    zero[0] = 0
    problem_init(&pb, 1, n_queries, n_keys, d_k, d_v if out != NULL else 0,
                 (flags & CATTENTION_CAUSAL) != 0, scale)
    set_operand(&pb.q, q, zero, q_row_stride, 1)
    set_operand(&pb.k, k, zero, k_row_stride, 1)
    if out != NULL:
        set_operand(&pb.v, v, zero, v_row_stride, 1)
    else:
        pb.v = pb.k
    pb.lse = lse
    pb.ld_out = out_row_stride
    pb.ld_scores = scores_row_stride
    pb.kv_of_batch = zero
    pb.kv_source = zero
    problem_finish(&pb)
    if n_threads < 1:
        n_threads = 1
    if run_problem(&pb, _kernels, n_threads, out, scores) != 0:
        return CATTENTION_ERR_NO_MEMORY
    return CATTENTION_OK


cdef int attention_f32(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                       Py_ssize_t d_v,
                       const float *q, Py_ssize_t q_row_stride,
                       const float *k, Py_ssize_t k_row_stride,
                       const float *v, Py_ssize_t v_row_stride,
                       double scale, int flags,
                       float *out, Py_ssize_t out_row_stride,
                       float *scores, Py_ssize_t scores_row_stride,
                       float *lse, int n_threads) noexcept nogil:
    return c_level_attention(n_queries, n_keys, d_k, d_v, q, q_row_stride, k, k_row_stride,
                             v, v_row_stride, scale, flags, out, out_row_stride,
                             scores, scores_row_stride, lse, n_threads)


cdef int attention_f64(Py_ssize_t n_queries, Py_ssize_t n_keys, Py_ssize_t d_k,
                       Py_ssize_t d_v,
                       const double *q, Py_ssize_t q_row_stride,
                       const double *k, Py_ssize_t k_row_stride,
                       const double *v, Py_ssize_t v_row_stride,
                       double scale, int flags,
                       double *out, Py_ssize_t out_row_stride,
                       double *scores, Py_ssize_t scores_row_stride,
                       double *lse, int n_threads) noexcept nogil:
    return c_level_attention(n_queries, n_keys, d_k, d_v, q, q_row_stride, k, k_row_stride,
                             v, v_row_stride, scale, flags, out, out_row_stride,
                             scores, scores_row_stride, lse, n_threads)


# ---------------------------------------------------------------- Python side

cdef const ca_kernels *_kernels = ca_default_kernels()


# Query rows up to which K and V are read in place rather than packed; the
# Python layer stacks grouped-query heads as rows within this many.
DIRECT_QUERY_ROWS = DIRECT_ROWS
MAX_NUM_THREADS = MAX_THREADS


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


def openmp_runtime():
    """Path of the loaded OpenMP runtime library ("" for a serial build or
    when the platform cannot tell)."""
    return (<bytes>ca_openmp_runtime()).decode(errors="replace")


def max_threads():
    """OpenMP's current maximum for a parallel region started by this thread,
    or 1 in a child forked after a parallel region (calls run serially there)."""
    if ca_forked_after_parallel():
        return 1
    return omp_get_max_threads()


def team_size(int n_threads, double serial_ns):
    """Threads a call of estimated one-thread time serial_ns (in ns) allowed
    n_threads would start now (src/team.h); for tests."""
    return ca_team_size(n_threads, serial_ns)


def forked_after_parallel():
    """True in a child process forked after a parallel region had run."""
    return bool(ca_forked_after_parallel())




# ------------------------------------------- from NumPy arrays to a Problem

cdef inline void set_operand(Operand *op, const void *data, const intp_t *batch_offset,
                             Py_ssize_t row_stride, Py_ssize_t col_stride) noexcept nogil:
    op.data = <const char *>data
    op.batch_offset = batch_offset
    op.row_stride = row_stride
    op.col_stride = col_stride


cdef void set_array_operand(Operand *op, cnp.ndarray arr, const intp_t *offsets):
    """An operand of the last two axes of arr, in elements; a size-1 axis
    steps by 0, as broadcasting does."""
    cdef Py_ssize_t itemsize = cnp.PyArray_ITEMSIZE(arr)
    cdef int ndim = cnp.PyArray_NDIM(arr)
    set_operand(op, cnp.PyArray_DATA(arr), offsets,
                cnp.PyArray_STRIDE(arr, ndim - 2) // itemsize
                if cnp.PyArray_DIM(arr, ndim - 2) != 1 else 0,
                cnp.PyArray_STRIDE(arr, ndim - 1) // itemsize
                if cnp.PyArray_DIM(arr, ndim - 1) != 1 else 0)


cdef inline Py_ssize_t batch_stride(cnp.ndarray arr, Py_ssize_t d, Py_ssize_t n_batch_dims):
    """Element stride of arr along batch dimension d of the broadcast batch
    (aligned on the right), 0 where arr lacks it or has size 1."""
    cdef Py_ssize_t a = d - (n_batch_dims - (cnp.PyArray_NDIM(arr) - 2))
    if a < 0 or cnp.PyArray_DIM(arr, a) == 1:
        return 0
    return cnp.PyArray_STRIDE(arr, a) // cnp.PyArray_ITEMSIZE(arr)


cdef void fill_batch_offsets(cnp.ndarray arr, Py_ssize_t n_batch_dims,
                             const Py_ssize_t *batch_shape, intp_t *out):
    """Element offset of each entry of the broadcast batch, in C order.

    A dimension arr lacks or has of size 1 advances by 0, so shared K/V are
    never copied."""
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, i, offset
    cdef Py_ssize_t stride[64]
    cdef Py_ssize_t index[64]
    for d in range(n_batch_dims):
        n_batch *= batch_shape[d]
        stride[d] = batch_stride(arr, d, n_batch_dims)
        index[d] = 0
    offset = 0
    for i in range(n_batch):
        out[i] = offset
        # odometer step over the batch index, last dimension fastest
        d = n_batch_dims - 1
        while d >= 0:
            index[d] += 1
            offset += stride[d]
            if index[d] < batch_shape[d]:
                break
            offset -= stride[d] * batch_shape[d]
            index[d] = 0
            d -= 1


cdef Py_ssize_t fill_shared_kv(cnp.ndarray k, cnp.ndarray v, Py_ssize_t n_batch_dims,
                               const Py_ssize_t *batch_shape, intp_t *kv_of_batch,
                               intp_t *kv_source):
    """Batch entries that read the same K and V (a K/V broadcast over heads)
    share one packed copy: kv_of_batch[b] is entry b's packed index, numbered
    in order of first appearance, kv_source[i] the first entry of index i
    (kv_source must hold -1 on entry). Returns the number of packed copies.
    A batch dimension along which neither K nor V advances is shared; v may
    be None (SCORES alone)."""
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t n_kv = 1
    cdef Py_ssize_t d, b, kv
    cdef Py_ssize_t kv_stride[64]   # packed-index stride of each batch dimension
    cdef Py_ssize_t index[64]
    for d in range(n_batch_dims - 1, -1, -1):
        n_batch *= batch_shape[d]
        if batch_stride(k, d, n_batch_dims) == 0 and (
                v is None or batch_stride(v, d, n_batch_dims) == 0):
            kv_stride[d] = 0
        else:
            kv_stride[d] = n_kv
            n_kv *= batch_shape[d]
        index[d] = 0
    kv = 0
    for b in range(n_batch):
        kv_of_batch[b] = kv
        if kv_source[kv] < 0:
            kv_source[kv] = b
        d = n_batch_dims - 1
        while d >= 0:
            index[d] += 1
            kv += kv_stride[d]
            if index[d] < batch_shape[d]:
                break
            kv -= kv_stride[d] * batch_shape[d]
            index[d] = 0
            d -= 1
    return n_kv


cdef intp_t *problem_from_arrays(Problem *pb, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                                 cnp.ndarray mask, Py_ssize_t n_batch_dims,
                                 const Py_ssize_t *batch_shape, bint causal,
                                 double scale) except? NULL:
    """problem_init and the operands of arrays whose leading dimensions
    broadcast to batch_shape (v and mask may be None). Returns the batch
    index the Problem points into (offsets of every operand, the shared K/V
    numbering), for the caller to free() after the call."""
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t d, b
    for d in range(n_batch_dims):
        n_batch *= batch_shape[d]
    problem_init(pb, n_batch, cnp.PyArray_DIM(q, q.ndim - 2), cnp.PyArray_DIM(k, k.ndim - 2),
                 cnp.PyArray_DIM(q, q.ndim - 1),
                 cnp.PyArray_DIM(v, v.ndim - 1) if v is not None else 0, causal, scale)
    # q, k, v, mask offsets; kv_of_batch; kv_source (n_kv <= n_batch)
    cdef intp_t *index = <intp_t *>malloc(6 * max(n_batch, 1) * sizeof(intp_t))
    if index == NULL:
        raise MemoryError()
    cdef intp_t *kv_of_batch = index + 4 * n_batch
    cdef intp_t *kv_source = index + 5 * n_batch
    fill_batch_offsets(q, n_batch_dims, batch_shape, index)
    set_array_operand(&pb.q, q, index)
    fill_batch_offsets(k, n_batch_dims, batch_shape, index + n_batch)
    set_array_operand(&pb.k, k, index + n_batch)
    if v is not None:
        fill_batch_offsets(v, n_batch_dims, batch_shape, index + 2 * n_batch)
        set_array_operand(&pb.v, v, index + 2 * n_batch)
    else:
        pb.v = pb.k
    if mask is not None:
        fill_batch_offsets(mask, n_batch_dims, batch_shape, index + 3 * n_batch)
        set_array_operand(&pb.mask, mask, index + 3 * n_batch)
        if cnp.PyArray_TYPE(mask) == cnp.NPY_BOOL:
            pb.mask_kind = MASK_BOOL
        elif cnp.PyArray_TYPE(mask) == cnp.NPY_FLOAT32:
            pb.mask_kind = MASK_F32
        else:
            pb.mask_kind = MASK_F64
    # float16 K and V (with float32 q): read and converted block by block
    pb.kv_half = cnp.PyArray_TYPE(k) == cnp.NPY_FLOAT16
    for b in range(n_batch):
        kv_source[b] = -1
    pb.n_kv = fill_shared_kv(k, v, n_batch_dims, batch_shape, kv_of_batch, kv_source)
    pb.kv_of_batch = kv_of_batch
    pb.kv_source = kv_source
    problem_finish(pb)
    return index


cdef int run_any(Problem *pb, const ca_kernels *kern, Py_ssize_t n_threads,
                 cnp.ndarray out, cnp.ndarray scores):
    """Run with the GIL released on float or double outputs (either may be None)."""
    cdef int status
    cdef int threads = <int>n_threads if n_threads < 1 << 30 else 1 << 30
    cdef float *out_f32 = NULL
    cdef float *scores_f32 = NULL
    cdef double *out_f64 = NULL
    cdef double *scores_f64 = NULL
    cdef cnp.ndarray any_output = out if out is not None else scores
    if cnp.PyArray_TYPE(any_output) == cnp.NPY_FLOAT64:
        if out is not None:
            out_f64 = <double *>cnp.PyArray_DATA(out)
        if scores is not None:
            scores_f64 = <double *>cnp.PyArray_DATA(scores)
        with nogil:
            status = run_problem(pb, kern, threads, out_f64, scores_f64)
    else:
        if out is not None:
            out_f32 = <float *>cnp.PyArray_DATA(out)
        if scores is not None:
            scores_f32 = <float *>cnp.PyArray_DATA(scores)
        with nogil:
            status = run_problem(pb, kern, threads, out_f32, scores_f32)
    return status


def attention_into(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask,
                   tuple batch_shape, bint causal, double scale,
                   cnp.ndarray out, cnp.ndarray scores, int num_threads,
                   cnp.ndarray lse=None, cnp.ndarray kv_lengths=None,
                   Py_ssize_t query_period=0, Py_ssize_t window_left=-1,
                   Py_ssize_t window_right=-1, double softcap=0,
                   cnp.ndarray alibi_slopes=None):
    """Compute into preallocated C-contiguous ``out`` (n_batch, T, d_v) and/or
    ``scores`` (n_batch, T, S) of the compute dtype; either may be None.

    Preconditions (checked by the caller): q, k, v share the compute dtype
    (or k and v are both float16 with a float32 q), are in native byte
    order, aligned, their strides are multiples of the itemsize, their
    leading dimensions broadcast to ``batch_shape``; ``mask`` is None or an
    aligned native bool/float32/float64 array of ndim >= 2 broadcastable to
    batch + (T, S). ``v`` may be None when ``out`` is None. ``lse``, if
    given, is a C-contiguous (n_batch, T) array of the compute dtype for the
    rows' log-sum-exp. ``kv_lengths``, if given, is a C-contiguous intp array
    of n_batch valid key counts in [0, S]. ``query_period`` > 0 says the T
    rows of q are ``T // query_period`` stacked groups of query_period
    positions (grouped-query heads), for causal alignment. ``window_left`` /
    ``window_right`` bound a sliding window (-1: unbounded), ``softcap`` > 0
    caps logits, ``alibi_slopes`` is a C-contiguous float64 array of n_batch
    slopes."""
    cdef Problem pb
    cdef Py_ssize_t n_batch_dims = len(batch_shape)
    cdef Py_ssize_t shape[64]
    cdef Py_ssize_t d
    for d in range(n_batch_dims):
        shape[d] = batch_shape[d]
    cdef intp_t *index = problem_from_arrays(&pb, q, k, v, mask, n_batch_dims, shape,
                                             causal, scale)
    cdef int status
    pb.lse = cnp.PyArray_DATA(lse) if lse is not None else NULL
    if query_period > 0:
        pb.query_period = query_period
    pb.window_left = window_left
    pb.window_right = window_right
    pb.softcap = softcap
    pb.alibi_slope = (<const double *>cnp.PyArray_DATA(alibi_slopes)
                      if alibi_slopes is not None else NULL)
    pb.kv_length = (<const intp_t *>cnp.PyArray_DATA(kv_lengths)
                    if kv_lengths is not None else NULL)
    try:
        status = run_any(&pb, _kernels, num_threads, out, scores)
    finally:
        free(index)
    if status != 0:
        raise MemoryError("cattention: could not allocate scratch memory")


cdef inline bint usable_input(cnp.ndarray arr, int type_num) noexcept:
    """Aligned, in native byte order, of type_num, every stride a multiple
    of the itemsize."""
    cdef int d
    cdef Py_ssize_t itemsize
    if (cnp.PyArray_TYPE(arr) != type_num or not cnp.PyArray_ISALIGNED(arr)
            or not cnp.PyArray_ISNOTSWAPPED(arr)):
        return False
    itemsize = cnp.PyArray_ITEMSIZE(arr)
    for d in range(cnp.PyArray_NDIM(arr)):
        if cnp.PyArray_STRIDE(arr, d) % itemsize != 0:
            return False
    return True


def attention_fast(object q, object k, object v, bint causal, object scale,
                   object num_threads, bint return_scores, object thread_limit):
    """``attention`` for the common case with no Python-level overhead, or
    None when the general path (``_api._run``) must handle the call.

    Common: q, k, v are ndarrays of one dtype (float32 or float64) and one
    ndim, with equal leading dimensions, in native byte order, aligned,
    element-multiple strides, nonempty, no mask, and scale/num_threads of
    plain types. Anything else, including every error, goes to the general
    path. The Problem is built by the same problem_from_arrays."""
    if type(q) is not np.ndarray or type(k) is not np.ndarray or type(v) is not np.ndarray:
        return None
    cdef cnp.ndarray qa = <cnp.ndarray>q
    cdef cnp.ndarray ka = <cnp.ndarray>k
    cdef cnp.ndarray va = <cnp.ndarray>v
    cdef int type_num = cnp.PyArray_TYPE(qa)
    cdef int ndim = cnp.PyArray_NDIM(qa)
    cdef int d
    cdef Py_ssize_t n_batch = 1
    cdef Py_ssize_t shape[64]
    cdef double scale_value
    cdef Py_ssize_t threads
    if type_num != cnp.NPY_FLOAT32 and type_num != cnp.NPY_FLOAT64:
        return None
    if ndim < 2 or cnp.PyArray_NDIM(ka) != ndim or cnp.PyArray_NDIM(va) != ndim:
        return None
    if not (usable_input(qa, type_num) and usable_input(ka, type_num)
            and usable_input(va, type_num)):
        return None
    for d in range(ndim - 2):
        shape[d] = cnp.PyArray_DIM(qa, d)
        if cnp.PyArray_DIM(ka, d) != shape[d] or cnp.PyArray_DIM(va, d) != shape[d]:
            return None
        n_batch *= shape[d]
    cdef Py_ssize_t n_queries = cnp.PyArray_DIM(qa, ndim - 2)
    cdef Py_ssize_t d_k = cnp.PyArray_DIM(qa, ndim - 1)
    cdef Py_ssize_t n_keys = cnp.PyArray_DIM(ka, ndim - 2)
    cdef Py_ssize_t d_v = cnp.PyArray_DIM(va, ndim - 1)
    if (cnp.PyArray_DIM(ka, ndim - 1) != d_k or cnp.PyArray_DIM(va, ndim - 2) != n_keys
            or n_batch == 0 or n_queries == 0):
        return None
    if scale is None:
        if d_k == 0:
            return None
        scale_value = 1.0 / sqrt(<double>d_k)
    elif type(scale) is float:
        scale_value = scale
        if not isfinite(scale_value):
            return None
        # a scale float32 cannot hold is refused on the general path
        if type_num == cnp.NPY_FLOAT32 and scale_value != 0 and not (
                FLT_TRUE_MIN <= fabs(scale_value) <= FLT_MAX):
            return None
    else:
        return None
    if num_threads is None:
        threads = thread_limit if thread_limit is not None else omp_get_max_threads()
    elif type(num_threads) is int and 1 <= num_threads <= MAX_THREADS:
        threads = num_threads
    else:
        return None
    if threads < 1:
        threads = 1

    shape[ndim - 2] = n_queries
    shape[ndim - 1] = d_v
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(ndim, <cnp.npy_intp *>shape, type_num, 0)
    cdef cnp.ndarray scores = None
    if return_scores:
        shape[ndim - 1] = n_keys
        scores = cnp.PyArray_EMPTY(ndim, <cnp.npy_intp *>shape, type_num, 0)
    cdef Problem pb
    cdef int status
    cdef intp_t *index = problem_from_arrays(&pb, qa, ka, va, None, ndim - 2, shape,
                                             causal, scale_value)
    try:
        status = run_any(&pb, _kernels, threads, out, scores)
    finally:
        free(index)
    if status != 0:
        raise MemoryError("cattention: could not allocate scratch memory")
    if return_scores:
        return out, scores
    return out
