"""paged_append: rows written at an engine's slots, against the values
written one by one in NumPy (converted as the pages' dtype rounds them,
int8 as quantize_kv quantizes them), then read back by the paged call; and
its refusals, each leaving the pages as they were."""

import numpy as np
import pytest

import cattention as ca
from reference import assert_matches_reference

try:
    import ml_dtypes
    BFLOAT16 = [ml_dtypes.bfloat16]
except ImportError:
    BFLOAT16 = []


def _engine_cache(n_blocks, n_kv_heads, block_size, d, dtype):
    """An engine's cache tensor (n_blocks, H_kv, block_size, 2 d) whose
    (block, head) holds its K rows then its V rows, and the two pages views."""
    cache = np.zeros((n_blocks, n_kv_heads, block_size, 2 * d), dtype)
    item = cache.itemsize
    strides = (cache.strides[0], cache.strides[1], d * item, item)
    shape = (n_blocks, n_kv_heads, block_size, d)
    k_pages = np.lib.stride_tricks.as_strided(cache, shape, strides)
    first_v = cache.reshape(n_blocks, n_kv_heads, -1)[:, :, block_size * d:]
    return cache, k_pages, np.lib.stride_tricks.as_strided(first_v, shape, strides)


@pytest.mark.parametrize("page_dtype", [np.float32, np.float64, np.float16] + BFLOAT16)
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_rows_land_at_their_slots(page_dtype, block_size):
    rng = np.random.default_rng(block_size)
    n_blocks, n_kv_heads, d = 9, 3, 24
    _, k_pages, v_pages = _engine_cache(n_blocks, n_kv_heads, block_size, d, page_dtype)
    slots = rng.permutation(n_blocks * block_size)[:7]
    slots[2] = -1                                  # padding: not written
    k_new = rng.standard_normal((7, n_kv_heads, d)).astype(np.float32)
    v_new = rng.standard_normal((7, n_kv_heads, d)).astype(np.float32)
    ca.paged_append(k_pages, v_pages, slots, k_new, v_new)
    expected_k = np.zeros_like(k_pages)
    expected_v = np.zeros_like(v_pages)
    for row, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, :, slot % block_size] = k_new[row].astype(page_dtype)
            expected_v[slot // block_size, :, slot % block_size] = v_new[row].astype(page_dtype)
    np.testing.assert_array_equal(k_pages.view(np.uint8) if page_dtype in BFLOAT16 else k_pages,
                                  expected_k.view(np.uint8) if page_dtype in BFLOAT16
                                  else expected_k)
    np.testing.assert_array_equal(v_pages.astype(np.float64), expected_v.astype(np.float64))


def test_strided_rows_and_int32_slots():
    """New rows may be views (an engine's fused qkv projection)."""
    rng = np.random.default_rng(1)
    _, k_pages, v_pages = _engine_cache(4, 2, 8, 16, np.float32)
    qkv = rng.standard_normal((5, 3, 2, 16)).astype(np.float32)
    slots = np.array([3, 9, 31, 0, 17], np.int32)
    ca.paged_append(k_pages, v_pages, slots, qkv[:, 1], qkv[:, 2])
    np.testing.assert_array_equal(k_pages[31 // 8, :, 31 % 8], qkv[2, 1])
    np.testing.assert_array_equal(v_pages[17 // 8, :, 17 % 8], qkv[4, 2])


def test_int8_pages_quantize_as_quantize_kv():
    rng = np.random.default_rng(2)
    k_pages = np.zeros((3, 2, 4, 8), np.int8)
    v_pages = np.zeros((3, 2, 4, 8), np.int8)
    k_scale = np.zeros((3, 2, 4), np.float32)
    v_scale = np.zeros((3, 2, 4), np.float32)
    new = rng.standard_normal((2, 2, 8)).astype(np.float32)
    ca.paged_append(k_pages, v_pages, [5, 11], new, 2 * new, k_scale=k_scale, v_scale=v_scale)
    quantized, scale = ca.quantize_kv(new)
    np.testing.assert_array_equal(k_pages[1, :, 1], quantized[0])
    np.testing.assert_array_equal(k_scale[2, :, 3], scale[1])
    assert (v_scale[1, :, 1] > 0).all()


def test_appended_rows_are_what_the_paged_call_reads():
    """Prompt rows appended by slot, then a decode step's query over them,
    against the float64 reference of those rows."""
    rng = np.random.default_rng(3)
    _, k_pages, v_pages = _engine_cache(12, 2, 16, 32, np.float32)
    table = np.array([[7, 2, 10], [4, 0, -1]])
    lengths = np.array([40, 20])
    rows = {b: (rng.standard_normal((n, 2, 32)).astype(np.float32),
                rng.standard_normal((n, 2, 32)).astype(np.float32))
            for b, n in enumerate(lengths)}
    for b, (k, v) in rows.items():
        positions = np.arange(lengths[b])
        ca.paged_append(k_pages, v_pages, table[b, positions // 16] * 16 + positions % 16, k, v)
    q = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    attn = ca.attention_with_paged_kvcache(q, k_pages, v_pages, table, lengths.copy())
    for b, (k, v) in rows.items():
        assert_matches_reference(attn[b], None, q[b], np.repeat(k.swapaxes(0, 1), 2, 0),
                                 np.repeat(v.swapaxes(0, 1), 2, 0), causal=True)


def _arguments():
    k_pages = np.zeros((4, 2, 8, 16), np.float32)
    v_pages = np.zeros((4, 2, 8, 16), np.float32)
    rows = np.ones((3, 2, 16), np.float32)
    return dict(k_pages=k_pages, v_pages=v_pages, slot_mapping=np.array([1, 2, 3]),
                k_new=rows, v_new=rows.copy())


@pytest.mark.parametrize("change, error, message", [
    (dict(slot_mapping=np.array([1, 2, 32])), ValueError,
     r"slot_mapping\[2\] = 32 is past the last slot 31 \(4 pages of 8\)"),
    (dict(slot_mapping=np.array([1, 2, 2 ** 63], np.uint64)), ValueError,
     r"slot_mapping\[2\] = 9223372036854775808 is past the last slot 31"),
    (dict(k_new=None, v_new=None), ValueError, "needs the rows to write: k_new and v_new"),
    (dict(v_new=None), ValueError, "k_new and v_new must be given together"),
    (dict(slot_mapping=np.array([1, 5, 5])), ValueError,
     "slot 5 is given to more than one new row"),
    (dict(slot_mapping=np.array([[1, 2, 3]])), ValueError,
     r"slot_mapping must be a 1-D integer array.*shape \(1, 3\)"),
    (dict(slot_mapping=np.array([1.0, 2.0, 3.0])), ValueError, "dtype float64"),
    (dict(k_new=np.ones((3, 2, 8), np.float32)), ValueError,
     r"k_new must have shape \(3, 2, 16\) \(n_rows, H_kv, d\).*got \(3, 2, 8\)"),
    (dict(v_new=np.ones((2, 2, 16), np.float32)), ValueError,
     r"v_new must have shape \(3, 2, 16\)"),
    (dict(k_new=np.full((3, 2, 16), 1e300)), ValueError, "beyond the range"),
    (dict(k_new=np.ones((3, 2, 16), np.complex64)), TypeError,
     "k_new of dtype complex64 cannot be written into float32 pages"),
    (dict(v_pages=np.zeros((4, 2, 8, 16), np.float16)), TypeError,
     r"k_pages \(float32\) and v_pages \(float16\) must share one dtype"),
    (dict(k_scale=np.zeros((4, 2, 8), np.float32)), ValueError,
     "k_scale and v_scale go with int8 and fp8 pages"),
])
def test_refusals_write_nothing(change, error, message):
    arguments = _arguments() | change
    before = [arguments["k_pages"].copy(), arguments["v_pages"].copy()]
    with pytest.raises(error, match=message):
        ca.paged_append(**arguments)
    np.testing.assert_array_equal(arguments["k_pages"], before[0])
    np.testing.assert_array_equal(arguments["v_pages"], before[1])


def test_read_only_and_shared_memory_are_refused():
    arguments = _arguments()
    arguments["k_pages"].flags.writeable = False
    with pytest.raises(ValueError, match="must be writable"):
        ca.paged_append(**arguments)
    arguments = _arguments()
    with pytest.raises(ValueError, match="k_pages and k_new share memory"):
        ca.paged_append(**(arguments | dict(k_new=arguments["k_pages"][0, :, :3].swapaxes(
            0, 1))))
