# cython: language_level=3, boundscheck=False, wraparound=False
# cython: cdivision=True, initializedcheck=False
"""Packing: query rows into the workspace (rotated at their positions when
the call has rotary tables), K^T into cache-line panels and V into padded
rows, block by block (float16 converted on the way), and the
handling of non-finite values in V (a NaN or Inf value row is kept out of
the SIMD P.V tile and added exactly where its weight is nonzero)."""

from cython cimport floating
from libc.stdint cimport uint8_t, uint16_t, uint32_t
from cattention._driver.kernel_table cimport (
    CA_PANEL_F32, CA_PANEL_F64, ca_bfloat16_to_float, ca_e4m3fn_to_float, ca_e5m2_to_float,
    ca_half_to_float)
from cattention._driver.problem cimport (
    K_BLOCK, STORE_BF16, STORE_COMPUTE, STORE_E4M3, STORE_F16, STORE_I8, Operand, Problem, is_fp8,
    key_extent,
    key_first, query_position, round_up)
from cattention._driver.rotary cimport rotate_row
from cattention._driver.operands cimport (
    contiguous_run, copy_rows, features_contiguous, row_offset, rows_in_place, scale_row_offset)
from cattention._driver.workspace cimport Workspace


cdef inline void pack_queries(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                              Py_ssize_t n_rows, floating *q_packed,
                              Py_ssize_t ld) noexcept nogil:
    """Query rows row0.. of entry b into q_packed (rows ld apart), features
    contiguous; float16 and bfloat16 queries converted on the way, queries
    of the compute dtype rotated at their positions when the call has
    rotary tables."""
    cdef const floating *q = <const floating *>pb.q.data + pb.q.batch_offset[b]
    cdef Py_ssize_t i, c
    cdef const floating *q_row
    if pb.q.storage != STORE_COMPUTE:
        copy_rows(pb, &pb.q, b, row0, n_rows, pb.d_k, q_packed, ld)
        return
    if pb.rotary != NULL:
        for i in range(n_rows):
            rotate_row(pb.rotary, <const char *>(q + (row0 + i) * pb.q.row_stride),
                       pb.q.col_stride, <char *>(q_packed + i * ld),
                       query_position(pb, b, row0 + i), pb.d_k, sizeof(floating))
        return
    for i in range(n_rows):
        q_row = q + (row0 + i) * pb.q.row_stride
        for c in range(pb.d_k):
            q_packed[i * ld + c] = q_row[c * pb.q.col_stride]


cdef inline const floating *query_rows(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                                       Py_ssize_t n_rows, floating *q_packed, Py_ssize_t ld,
                                       Py_ssize_t *ldq) noexcept nogil:
    """Query rows row0.. of entry b with contiguous features (row stride in
    *ldq): where the caller keeps them, or copied into q_packed (rows ld
    apart) when their features are strided or they are rotated. The score
    kernels read the same values either way; a copy would cost its own pass
    over Q (3% of a BERT-sized call)."""
    if (pb.q.storage == STORE_COMPUTE and (pb.q.col_stride == 1 or pb.d_k <= 1)
            and pb.rotary == NULL):
        ldq[0] = pb.q.row_stride
        return <const floating *>pb.q.data + pb.q.batch_offset[b] + row0 * pb.q.row_stride
    pack_queries(pb, b, row0, n_rows, q_packed, ld)
    ldq[0] = ld
    return q_packed


cdef inline Py_ssize_t bf16_padded_features(const Problem *pb) noexcept nogil:
    """Features of a bfloat16 tile row: d_k padded to the table's alignment."""
    cdef Py_ssize_t align = pb.kern.bf16_k_align
    return (pb.d_k + align - 1) // align * align


cdef inline const uint16_t *bf16_rows(const Operand *op, Py_ssize_t b, Py_ssize_t row0,
                                      Py_ssize_t n_rows, Py_ssize_t n_features,
                                      uint16_t *copy, Py_ssize_t ld_copy,
                                      Py_ssize_t *ld) noexcept nogil:
    """bfloat16 rows row0.. of entry b with contiguous features (row stride in
    *ld): where they lie (one page, contiguous features), else gathered into
    copy (rows ld_copy apart). Their bits, unconverted."""
    cdef Py_ssize_t j, c, at
    cdef const uint16_t *data = <const uint16_t *>op.data
    if contiguous_run(op, row0, n_rows) == n_rows and features_contiguous(op, n_features):
        ld[0] = op.row_stride
        return data + row_offset(op, b, row0)
    for j in range(n_rows):
        at = row_offset(op, b, row0 + j)
        for c in range(n_features):
            copy[j * ld_copy + c] = data[at + c * op.col_stride]
    ld[0] = ld_copy
    return copy


cdef inline const uint16_t *fp8_codes_as_bf16(const Operand *op, Py_ssize_t b,
                                              Py_ssize_t row0, Py_ssize_t n_rows,
                                              Py_ssize_t n_features, uint16_t *copy,
                                              Py_ssize_t ld_copy) noexcept nogil:
    """fp8 rows row0.. of entry b as the bfloat16 bits of their codes
    (unscaled) into copy (rows ld_copy apart): every E4M3FN and E5M2 value,
    NaN and infinities included, is a bfloat16, so the table's bfloat16
    tiles multiply the codes exactly and the row scales join the logits
    (score_tiles)."""
    cdef uint16_t as_bf16[256]
    cdef float value
    cdef Py_ssize_t j, c, at
    cdef const uint8_t *data = <const uint8_t *>op.data
    for c in range(256):
        value = (ca_e4m3fn_to_float(<uint8_t>c) if op.storage == STORE_E4M3
                 else ca_e5m2_to_float(<uint8_t>c))
        # the upper half of the float32: the whole value, exactly
        as_bf16[c] = (<uint32_t *>&value)[0] >> 16
    for j in range(n_rows):
        at = row_offset(op, b, row0 + j)
        for c in range(n_features):
            copy[j * ld_copy + c] = as_bf16[data[at + c * op.col_stride]]
    return copy


cdef inline const uint16_t *bf16_query_rows(const Problem *pb, Py_ssize_t b, Py_ssize_t row0,
                                            Py_ssize_t n_rows, uint16_t *q_packed,
                                            Py_ssize_t *ldq) noexcept nogil:
    """bfloat16 query rows for a table's bfloat16 tiles: copied, features
    padded with zeros to the table's alignment, into q_packed (ldq apart);
    tiles read whole blocks of rows, and a copy keeps them within it."""
    cdef Py_ssize_t ld = bf16_padded_features(pb)
    cdef const uint16_t *q = <const uint16_t *>pb.q.data
    cdef Py_ssize_t i, c, at
    for i in range(n_rows):
        at = row_offset(&pb.q, b, row0 + i)
        for c in range(pb.d_k):
            q_packed[i * ld + c] = q[at + c * pb.q.col_stride]
        for c in range(pb.d_k, ld):
            q_packed[i * ld + c] = 0
    ldq[0] = ld
    return q_packed


cdef inline Py_ssize_t panel_width(const floating *values) noexcept nogil:
    """Values per panel row for the dtype of ``values`` (a packed block, or
    the rows packed into one)."""
    if floating is float:
        return CA_PANEL_F32
    else:
        return CA_PANEL_F64


cdef inline void pack_keys_transposed(const Problem *pb, const floating *k, Py_ssize_t row_stride,
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


cdef inline bint pack_values(const Problem *pb, const floating *v, Py_ssize_t row_stride,
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
    cdef Py_ssize_t j, c, lane, n_full = d_v // P
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
    for lane in range(16):
        probe[lane] = 0
    for j in range(n_keys):
        v_row = v + j * row_stride
        for c in range(n_full):
            dst = v_packed + c * panel_stride + j * P
            if col_stride == 1:
                for lane in range(P):
                    x = v_row[c * P + lane]
                    probe[lane] += x - x
                    dst[lane] = x
            else:
                for lane in range(P):
                    x = v_row[(c * P + lane) * col_stride]
                    probe[lane] += x - x
                    dst[lane] = x
        if ld_v > n_full * P:
            dst = v_packed + n_full * panel_stride + j * P
            for lane in range(P):
                if n_full * P + lane < d_v:
                    x = v_row[(n_full * P + lane) * col_stride]
                    probe[lane] += x - x
                    dst[lane] = x
                else:
                    dst[lane] = 0
            # double panels are 8 wide and ld_v a multiple of 16: a panel
            # wholly past d_v is zero too (the P.V kernel reads it)
            for c in range(n_full + 1, ld_v // P):
                dst = v_packed + c * panel_stride + j * P
                for lane in range(P):
                    dst[lane] = 0
    x = 0
    for lane in range(P):
        x += probe[lane]
    if x == x:
        return False
    zero_nonfinite(pb, n_keys, v_packed)
    return True


cdef inline void zero_nonfinite(const Problem *pb, Py_ssize_t n_keys,
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


cdef inline void *packed_keys(const Problem *pb, const Workspace *ws,
                              Py_ssize_t block) noexcept nogil:
    """K^T of packed block ``block`` (= kv * n_key_blocks + key block), in
    the compute dtype (pb.itemsize bytes per value)."""
    if ws.own_k != NULL:
        return (<char *>ws.own_k
                + (block % pb.n_key_blocks) * pb.ld_k * pb.block_keys * pb.itemsize)
    return <char *>pb.packed_k + block * pb.ld_k * pb.block_keys * pb.itemsize


cdef inline void *packed_values(const Problem *pb, const Workspace *ws,
                                Py_ssize_t block) noexcept nogil:
    """V of packed block ``block``, likewise."""
    if ws.own_v != NULL:
        return (<char *>ws.own_v
                + (block % pb.n_key_blocks) * pb.block_keys * pb.ld_v * pb.itemsize)
    return <char *>pb.packed_v + block * pb.block_keys * pb.ld_v * pb.itemsize


cdef inline uint8_t *nonfinite_flag(const Problem *pb, const Workspace *ws,
                                    Py_ssize_t block) noexcept nogil:
    """Whether packed V block ``block`` held NaN or Inf."""
    if ws.own_nonfinite != NULL:
        return ws.own_nonfinite + block % pb.n_key_blocks
    return pb.value_nonfinite + block


cdef inline void pack_block(Problem *pb, Workspace *ws, Py_ssize_t block,
                            floating *kt) noexcept nogil:
    """Pack K^T (into kt: packed_keys of the block) and V of one (kv, key
    block) from the caller's arrays."""
    cdef Py_ssize_t kv = block // pb.n_key_blocks
    cdef Py_ssize_t key0 = (block % pb.n_key_blocks) * K_BLOCK
    cdef Py_ssize_t b = pb.kv_source[kv]
    # keys past the extent may not exist (a paged cache, the last packed
    # sequence): they are never read, and their columns never seen
    cdef Py_ssize_t n_keys = key_extent(pb, kv) - key0
    cdef Py_ssize_t ld_k_rows, ld_v_rows, col_k_rows, col_v_rows
    if n_keys > K_BLOCK:
        n_keys = K_BLOCK
    # nor are the blocks that end before every reader's window starts (a
    # block that straddles the start is packed whole: its masked keys are
    # read, with zero weights)
    if n_keys <= 0 or key0 + n_keys <= key_first(pb, kv):
        nonfinite_flag(pb, ws, block)[0] = 0
        return
    cdef const uint16_t *bf16
    if floating is float:
        if pb.bf16_score:
            # bfloat16 keys in the table's pair panels, their bits as they
            # are (fp8 keys: their codes as bfloat16)
            if is_fp8(pb.k.storage):
                ld_k_rows = pb.ld_k
                bf16 = fp8_codes_as_bf16(&pb.k, b, key0, n_keys, pb.d_k,
                                         <uint16_t *>(<floating *>ws.base + ws.off_k_rows),
                                         ld_k_rows)
            else:
                bf16 = bf16_rows(&pb.k, b, key0, n_keys, pb.d_k,
                                 <uint16_t *>(<floating *>ws.base + ws.off_k_rows), pb.ld_k,
                                 &ld_k_rows)
            pb.kern.pack_kt_bf16(bf16, ld_k_rows, n_keys, pb.d_k, <uint16_t *>kt,
                                 pb.ld_k * 2 * CA_PANEL_F32)
        if pb.bf16_pv:
            bf16 = bf16_rows(&pb.v, b, key0, n_keys, pb.d_v,
                             <uint16_t *>(<floating *>ws.base + ws.off_v_rows), pb.ld_v,
                             &ld_v_rows)
            nonfinite_flag(pb, ws, block)[0] = pb.kern.pack_v_bf16(
                bf16, ld_v_rows, n_keys, pb.d_v, <uint16_t *>packed_values(pb, ws, block),
                pb.block_keys * 2 * CA_PANEL_F32)
        if pb.bf16_score and pb.bf16_pv:
            return
    # strided rows are packed from where they are; rows gathered from
    # several pages or converted are contiguous copies
    cdef const floating *k_rows
    if not pb.bf16_score:
        k_rows = rows_in_place(pb, &pb.k, b, key0, n_keys, pb.d_k,
                               <floating *>ws.base + ws.off_k_rows, pb.ld_k, &ld_k_rows,
                               &col_k_rows)
        pack_keys_transposed(pb, k_rows, ld_k_rows, col_k_rows, n_keys, kt)
    if pb.bf16_pv:
        return
    cdef const floating *v_rows
    if pb.d_v > 0:
        v_rows = rows_in_place(pb, &pb.v, b, key0, n_keys, pb.d_v,
                               <floating *>ws.base + ws.off_v_rows, pb.ld_v, &ld_v_rows,
                               &col_v_rows)
        nonfinite_flag(pb, ws, block)[0] = pack_values(
            pb, v_rows, ld_v_rows, col_v_rows, n_keys,
            <floating *>packed_values(pb, ws, block))
    else:
        nonfinite_flag(pb, ws, block)[0] = 0


cdef inline void add_nonfinite_values(const Problem *pb, Py_ssize_t b, Py_ssize_t key0,
                                      Py_ssize_t n_keys, const floating *p, Py_ssize_t ldp,
                                      Py_ssize_t n_rows, floating *acc,
                                      Py_ssize_t ldacc) noexcept nogil:
    """acc[i, c] += p[i, j] * V[key0 + j, c] for the NaN/Inf entries of V that
    pack_values zeroed, in rows where key j has a nonzero weight."""
    cdef const floating *v = <const floating *>pb.v.data
    cdef const uint16_t *v_half = <const uint16_t *>pb.v.data
    cdef const uint8_t *v_code = <const uint8_t *>pb.v.data
    cdef Py_ssize_t i, j, c, at
    cdef floating x
    for j in range(n_keys):
        for c in range(pb.d_v):
            at = row_offset(&pb.v, b, key0 + j) + c * pb.v.col_stride
            if pb.v.storage == STORE_I8:
                continue  # int8 times a finite scale is finite
            if is_fp8(pb.v.storage):
                # as fp8_rows_to_f32 gave it: the code times its scale
                x = <floating>((ca_e4m3fn_to_float(v_code[at]) if pb.v.storage == STORE_E4M3
                                else ca_e5m2_to_float(v_code[at]))
                               * pb.v.scale[scale_row_offset(&pb.v, b, key0 + j)])
            elif pb.v.storage == STORE_F16:
                x = <floating>ca_half_to_float(v_half[at])
            elif pb.v.storage == STORE_BF16:
                x = <floating>ca_bfloat16_to_float(v_half[at])
            else:
                x = v[at]
            if (x - x) == 0:
                continue
            for i in range(n_rows):
                if p[i * ldp + j] != 0:
                    acc[i * ldacc + c] += p[i * ldp + j] * x
