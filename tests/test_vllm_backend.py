"""cattention.integrations.vllm's backend, one layer at a time (no engine):
its steps against the float64 reference of each request's keys (gathered
from the cache through the block table), beside vLLM's own CPU_ATTN op on
the same rows for the conventions (windows, ALiBi, softcap, sinks, encoder
attention), and its refusals. Skipped where vLLM is absent (make test-vllm
runs it in vLLM's environment)."""

from types import SimpleNamespace

import numpy as np
import pytest

from reference import (FP8_MAX, assert_bitwise_equal, assert_half_matches_reference,
                       assert_level_matches_reference, assert_matches_reference,
                       reference_attention, saturated_fp8_codes)

try:
    import torch
    import vllm  # noqa: F401
except ImportError as error:
    pytest.skip(f"needs vLLM's CPU build ({error}; make test-vllm runs these tests)",
                allow_module_level=True)

import ml_dtypes  # noqa: E402
from vllm import _custom_ops as vllm_ops  # noqa: E402

from cattention.integrations.vllm._backend import (CattentionBackend,  # noqa: E402
                                                   CattentionImpl, step_metadata)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}
#: vLLM's fp8 kv_cache_dtype values and the format each stores
FP8 = {"fp8": np.dtype(ml_dtypes.float8_e4m3fn), "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
       "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}


class Step:
    """A mixed step of vLLM's: requests with query rows (a prompt chunk, a
    decode, a whole prompt) at the end of their keys, in a paged cache whose
    blocks are shuffled and whose first block two requests share (a prefix
    cache hit). Every key row already written holds random values."""

    def __init__(self, seed, query_lens, seq_lens, n_heads, n_kv_heads, head_size,
                 block_size, dtype, shared_prefix=True, kv_cache_dtype="auto"):
        rng = np.random.default_rng(seed)
        self.query_lens = np.array(query_lens)
        self.seq_lens = np.array(seq_lens, dtype=np.int32)
        self.n_heads, self.n_kv_heads, self.head_size = n_heads, n_kv_heads, head_size
        self.block_size = block_size
        self.dtype = TORCH_DTYPES[dtype]
        blocks = -(-self.seq_lens // block_size)
        n_blocks = int(blocks.sum()) + 5
        ids = rng.permutation(n_blocks)
        table = np.full((len(seq_lens), int(blocks.max())), -1, np.int32)
        used = 0
        for b, n in enumerate(blocks):
            table[b, :n] = ids[used:used + n]
            used += n
        self.shared = shared_prefix and len(seq_lens) > 1 and min(seq_lens[:2]) > block_size
        if self.shared:
            table[1, 0] = table[0, 0]     # request 1 reads request 0's first block
        self.block_table = table
        # vLLM keeps an fp8 cache as bytes
        self.kv_cache = torch.zeros((n_blocks, n_kv_heads, block_size, 2 * head_size),
                                    dtype=torch.uint8 if kv_cache_dtype in FP8 else self.dtype)
        # each request's keys and values by position (request 1's first block
        # is request 0's)
        self.keys = [torch.from_numpy(rng.standard_normal((n, n_kv_heads, head_size))).to(
            self.dtype) for n in self.seq_lens]
        self.values = [torch.from_numpy(rng.standard_normal((n, n_kv_heads, head_size))).to(
            self.dtype) for n in self.seq_lens]
        if self.shared:
            self.keys[1][:block_size] = self.keys[0][:block_size]
            self.values[1][:block_size] = self.values[0][:block_size]
        total = int(self.query_lens.sum())
        self.query = torch.from_numpy(
            rng.standard_normal((total, n_heads, head_size))).to(self.dtype)
        self.query_start_loc = np.concatenate([[0], np.cumsum(self.query_lens)]).astype(
            np.int32)

    def slots(self, b, positions):
        page = self.block_table[b, positions // self.block_size]
        return page.astype(np.int64) * self.block_size + positions % self.block_size

    def rows_to_write(self):
        """Every key row, once (the shared block by its first request), with
        its slot, in one append."""
        keys, values, slots = [], [], []
        for b, n in enumerate(self.seq_lens):
            first = self.block_size if b == 1 and self.shared else 0
            positions = np.arange(first, n)
            keys.append(self.keys[b][first:])
            values.append(self.values[b][first:])
            slots.append(self.slots(b, positions))
        return (torch.cat(keys), torch.cat(values),
                torch.from_numpy(np.concatenate(slots)))

    def metadata(self, causal=True):
        return step_metadata(int(self.query_lens.sum()), self.query_start_loc, self.seq_lens,
                             self.block_table, causal)


def _impl(step, **options):
    return CattentionImpl(step.n_heads, step.head_size, options.pop("scale", 0.3),
                          step.n_kv_heads, **options)


def _run(step, impl, causal=True, threads=None, layer=None):
    """The step through the backend: its rows appended at their slots, then
    the layer's call; causal may be one flag per request; layer carries an
    fp8 cache's scales."""
    key, value, slots = step.rows_to_write()
    impl.do_kv_cache_update(layer, key, value, step.kv_cache, slots)
    output = torch.empty((step.query.shape[0], step.n_heads * step.head_size),
                         dtype=step.dtype)
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
    try:
        impl.forward(layer, step.query, key, value, step.kv_cache, step.metadata(causal),
                     output)
    finally:
        if threads is not None:
            torch.set_num_threads(before)
    return output.view(-1, step.n_heads, step.head_size)


def _as_numpy(tensor):
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _requests(step, output, causal=True, stored=None, **options):
    """Each request's output rows with what reference.py's float64
    attention takes for them: q, its keys and values in float64 (query
    rows the last of its positions), and its options; causal may be one
    flag per request, a window reaching both ways where a request is not
    causal; stored: (keys, values) as an fp8 cache holds them, in step's
    place."""
    keys, values = stored or (step.keys, step.values)
    group = step.n_heads // step.n_kv_heads
    got = _as_numpy(output)
    flags = np.broadcast_to(causal, step.seq_lens.shape)
    for b, n in enumerate(step.seq_lens):
        request_options = dict(options, causal=bool(flags[b]))
        if not flags[b] and "window" in options:
            request_options["window"] = (options["window"][0], options["window"][0])
        rows = slice(step.query_start_loc[b], step.query_start_loc[b + 1])
        q = np.swapaxes(_as_numpy(step.query[rows]).astype(np.float64), 0, 1)
        k = np.repeat(np.swapaxes(keys[b].to(torch.float64).numpy(), 0, 1), group, 0)
        v = np.repeat(np.swapaxes(values[b].to(torch.float64).numpy(), 0, 1), group, 0)
        yield np.swapaxes(got[rows], 0, 1), q, k, v, request_options


def _check_against_reference(step, output, causal=True, stored=None, **options):
    """Each request's rows (_requests) against reference.py's float64
    attention, by the rule of the step's dtype."""
    for attn, q, k, v, request_options in _requests(step, output, causal, stored, **options):
        if step.dtype == torch.float32:
            assert_matches_reference(attn, None, q.astype(np.float32), k, v,
                                     **request_options)
        else:
            assert_half_matches_reference(attn, None, q, k, v, **request_options)


MIXED = dict(query_lens=[37, 1, 1, 200], seq_lens=[300, 129, 1000, 200])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 112, 128, 160, 256])
def test_mixed_step_matches_reference(dtype, head_size):
    step = Step(head_size, **MIXED, n_heads=8, n_kv_heads=2, head_size=head_size,
                block_size=32, dtype=dtype)
    output = _run(step, _impl(step, scale=head_size ** -0.5))
    _check_against_reference(step, output, scale=head_size ** -0.5)


@pytest.mark.parametrize("block_size", [1, 16, 33, 128])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [5, 5, 5, 5], [37, 1, 1, 200]],
                         ids=["decode", "uniform", "mixed"])
def test_block_sizes_and_step_kinds(block_size, query_lens):
    step = Step(block_size, query_lens, [300, 129, 1000, 200], 4, 4, 64, block_size,
                "float32")
    output = _run(step, _impl(step))
    _check_against_reference(step, output, scale=0.3)


OPTIONS = {
    "window": dict(sliding_window=64),
    "softcap": dict(logits_soft_cap=3.0),
    "sinks": dict(sinks=torch.linspace(-2.0, 3.0, 8)),
    "alibi": dict(alibi_slopes=[2.0 ** (-i - 1) for i in range(8)]),
    "all": dict(sliding_window=100, logits_soft_cap=5.0, sinks=torch.full((8,), 0.5)),
}


def _reference_options(vllm_options):
    options = {}
    if "sliding_window" in vllm_options:
        options["window"] = (vllm_options["sliding_window"] - 1, 0)
    if "logits_soft_cap" in vllm_options:
        options["softcap"] = vllm_options["logits_soft_cap"]
    if "sinks" in vllm_options:
        options["sinks"] = vllm_options["sinks"].numpy().astype(np.float64)
    if "alibi_slopes" in vllm_options:
        options["alibi_slopes"] = np.array(vllm_options["alibi_slopes"])
    return options


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_match_reference(dtype, name):
    step = Step(7, **MIXED, n_heads=8, n_kv_heads=2, head_size=64, block_size=32,
                dtype=dtype)
    output = _run(step, _impl(step, **OPTIONS[name]))
    _check_against_reference(step, output, scale=0.3, **_reference_options(OPTIONS[name]))


def _vllm_step(step, scale, causal=True, sliding_window=None, logits_soft_cap=None,
               alibi_slopes=None, sinks=None, dynamic_causal=None, kv_cache_dtype="auto",
               k_scale=1.0, v_scale=1.0):
    """The same step through vLLM's CPU_ATTN op, on a cache in its layout."""
    isa = "vec" if step.head_size % 32 == 0 and step.block_size % 32 == 0 else "vec16"
    cache = torch.zeros((step.kv_cache.shape[0], step.n_kv_heads, 2 * step.block_size,
                         step.head_size), dtype=step.kv_cache.dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    key, value, slots = step.rows_to_write()
    quantized = dict(k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                        **quantized)
    seq_lens = torch.from_numpy(step.seq_lens)
    query_start_loc = torch.from_numpy(step.query_start_loc)
    window = -1 if sliding_window is None else sliding_window
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        len(step.seq_lens), step.n_heads, step.n_kv_heads, step.head_size, seq_lens,
        step.dtype, query_start_loc, causal, window, isa, True, dynamic_causal,
        kv_cache_dtype)
    output = torch.empty_like(step.query)
    vllm_ops.cpu_attention_with_kv_cache(
        step.query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal,
        None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32),
        window, torch.from_numpy(step.block_table), logits_soft_cap or 0.0, metadata, sinks,
        dynamic_causal, **quantized)
    return output


@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_agree_with_vllm_op(name):
    """vLLM's options mean what the backend makes of them: vLLM's op on the
    same rows gives the same result to float32 rounding."""
    step = Step(11, **MIXED, n_heads=8, n_kv_heads=2, head_size=64, block_size=32,
                dtype="float32")
    ours = _run(step, _impl(step, **OPTIONS[name]))
    theirs = _vllm_step(step, 0.3, **OPTIONS[name])
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", ["window", "softcap", "sinks"])
def test_non_causal_options_agree_with_vllm_op(name):
    """Cross-attention (the decoder's queries see every encoder row): a
    window reaches both ways, as in vLLM's op."""
    step = Step(12, **MIXED, n_heads=8, n_kv_heads=2, head_size=64, block_size=32,
                dtype="float32")
    ours = _run(step, _impl(step, **OPTIONS[name]), causal=False)
    theirs = _vllm_step(step, 0.3, causal=False, **OPTIONS[name])
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=2e-5)


def test_non_causal_alibi_is_flash_attentions():
    """Without causality ALiBi adds -slope * |i - j| (FlashAttention's
    convention, and the models' own, e.g. JinaBERT's), where vLLM's CPU op
    adds slope * (j - i), which grows towards later keys; the user guide
    says so."""
    step = Step(13, **MIXED, n_heads=8, n_kv_heads=2, head_size=64, block_size=32,
                dtype="float32")
    output = _run(step, _impl(step, **OPTIONS["alibi"]), causal=False)
    _check_against_reference(step, output, causal=False, scale=0.3,
                             **_reference_options(OPTIONS["alibi"]))


@pytest.mark.parametrize("name", ["plain", "window"])
def test_causal_flag_per_request(name):
    """vLLM's dynamic causal: each request causal or not by its own flag,
    against the reference and vLLM's op."""
    options = {} if name == "plain" else OPTIONS["window"]
    step = Step(14, **MIXED, n_heads=8, n_kv_heads=2, head_size=64, block_size=32,
                dtype="float32")
    flags = np.array([True, False, True, False])
    ours = _run(step, _impl(step, **options), causal=flags)
    theirs = _vllm_step(step, 0.3, causal=False,
                        dynamic_causal=torch.from_numpy(flags.astype(np.int32)),
                        **options)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=2e-5)
    _check_against_reference(step, ours, causal=flags, scale=0.3, **_reference_options(options))


@pytest.mark.parametrize("window, softcap", [(None, None), (16, None), (None, 2.0),
                                             (16, 2.0)])
def test_encoder_only_matches_reference(window, softcap):
    """Encoder-only layers (embedding models): each request attends to its
    own rows both ways, nothing cached; a window reaches both sides; softcap
    as in decoders."""
    rng = np.random.default_rng(5)
    query_start_loc = np.array([0, 50, 51, 170], np.int32)
    total, n_heads, n_kv_heads, d = 170, 4, 2, 64
    q, k, v = (torch.from_numpy(rng.standard_normal((total, h, d)).astype(np.float32))
               for h in (n_heads, n_kv_heads, n_kv_heads))
    impl = CattentionImpl(n_heads, d, 0.125, n_kv_heads, sliding_window=window,
                          logits_soft_cap=softcap, attn_type="encoder_only")
    output = torch.empty((total, n_heads * d))
    meta = step_metadata(total, query_start_loc, np.diff(query_start_loc), None, False)
    impl.forward(None, q, k, v, torch.empty(0), meta, output)
    got = output.view(total, n_heads, d).numpy()
    options = {} if window is None else {"window": (window - 1, window - 1)}
    if softcap is not None:
        options["softcap"] = softcap
    for b in range(3):
        rows = slice(query_start_loc[b], query_start_loc[b + 1])
        qb, kb, vb = (np.swapaxes(x[rows].numpy(), 0, 1) for x in (q, k, v))
        kb, vb = np.repeat(kb, 2, 0).astype(np.float64), np.repeat(vb, 2, 0).astype(
            np.float64)
        assert_matches_reference(np.swapaxes(got[rows], 0, 1), None, qb, kb, vb, scale=0.125,
                                 **options)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_any_thread_count_is_bitwise_the_same(kv_cache_dtype):
    step = Step(3, **MIXED, n_heads=8, n_kv_heads=2, head_size=128, block_size=32,
                dtype="float32", kv_cache_dtype=kv_cache_dtype)
    impl, layer = _impl(step, kv_cache_dtype=kv_cache_dtype), _scales(0.5, 0.5)
    one = _run(step, impl, threads=1, layer=layer).clone()
    for threads in (2, 3):
        assert_bitwise_equal(_run(step, impl, threads=threads, layer=layer).numpy(),
                             one.numpy())


def test_cache_views_are_read_in_place():
    """The K and V pages are views of vLLM's cache tensor: rows written by
    the append are in the tensor, at K's and V's places of their block."""
    step = Step(1, [1], [70], 2, 2, 16, 32, "float32", shared_prefix=False)
    impl = _impl(step)
    key, value, slots = step.rows_to_write()
    impl.do_kv_cache_update(None, key, value, step.kv_cache, slots)
    k_pages, v_pages = impl.pages(step.kv_cache)
    assert np.shares_memory(k_pages, step.kv_cache.numpy())
    block = step.block_table[0, 69 // 32]
    flat = step.kv_cache.view(step.kv_cache.shape[0], 2, -1).numpy()
    np.testing.assert_array_equal(flat[block, 0, 32 * 16 + 5 * 16:32 * 16 + 6 * 16],
                                  value[69, 0].numpy())
    np.testing.assert_array_equal(k_pages[block, 1, 5], key[69, 1].numpy())


def test_a_cache_it_cannot_view_is_refused():
    """Pages are views of the cache tensor: one whose (block, head) is not
    one run of rows, or of another head size, is refused, nothing written."""
    impl = CattentionImpl(2, 16, 0.25, 2)
    rows = torch.ones((1, 2, 16))
    strided = torch.zeros((4, 2, 8, 64))[..., ::2]
    with pytest.raises(ValueError, match="is not contiguous"):
        impl.do_kv_cache_update(None, rows, rows, strided, torch.tensor([3]))
    assert not strided.any()
    with pytest.raises(ValueError, match=r"a KV cache of shape \(4, 2, 8, 24\) for 2 K/V heads "
                                         "of size 16"):
        impl.do_kv_cache_update(None, rows, rows, torch.zeros((4, 2, 8, 24)), torch.tensor([3]))


# ---- fp8 caches: vLLM's bytes, its per-tensor scales ----------------------

def _scales(k_scale, v_scale):
    """What the backend reads of vLLM's attention layer: its scales."""
    return SimpleNamespace(_k_scale_float=k_scale, _v_scale_float=v_scale)


def _fp8_stored(step, kv_cache_dtype, k_scale, v_scale):
    """Each request's keys and values as its fp8 cache must hold them:
    checks the cache's bytes at the rows' slots against the rule
    (reference.saturated_fp8_codes: value / scale in float32, saturated,
    rounded to nearest even), and gives the values the codes stand for
    (code * scale, float64), in the shape of step.keys and step.values."""
    fmt = FP8[kv_cache_dtype]
    # a (block, head) holds block_size rows of K, then block_size rows of V
    halves = step.kv_cache.numpy().view(fmt).reshape(
        -1, step.n_kv_heads, 2, step.block_size, step.head_size)
    keys, values = [], []
    for b, n in enumerate(step.seq_lens):
        slots = step.slots(b, np.arange(n))
        at = (slots // step.block_size, slice(None))
        for given, half, scale, into in ((step.keys[b], 0, k_scale, keys),
                                         (step.values[b], 1, v_scale, values)):
            codes = saturated_fp8_codes(given.to(torch.float32).numpy(), np.float32(scale), fmt)
            stored = halves[at + (half, slots % step.block_size)]
            np.testing.assert_array_equal(stored.view(np.uint8), codes.view(np.uint8),
                                          err_msg=f"request {b}")
            into.append(torch.from_numpy(codes.astype(np.float64) * np.float32(scale)))
    return keys, values


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_fp8_cache_holds_rounded_rows_and_matches_reference(dtype, kv_cache_dtype, head_size):
    """New rows go into the cache's bytes as value / scale rounded to the
    format; the step matches the reference over the values the codes stand
    for."""
    step = Step(21, **MIXED, n_heads=8, n_kv_heads=2, head_size=head_size, block_size=32,
                dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    output = _run(step, _impl(step, kv_cache_dtype=kv_cache_dtype), layer=_scales(0.5, 0.125))
    _check_against_reference(step, output, scale=0.3,
                             stored=_fp8_stored(step, kv_cache_dtype, 0.5, 0.125))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_rows_beyond_the_format_are_saturated(kv_cache_dtype):
    """Scales that put a tenth of the values beyond the format's largest:
    those are stored as +-largest, never NaN or inf."""
    fmax = FP8_MAX[FP8[kv_cache_dtype].name]
    step = Step(22, **MIXED, n_heads=4, n_kv_heads=2, head_size=64, block_size=32,
                dtype="float32", kv_cache_dtype=kv_cache_dtype)
    scale = 1.6 / fmax
    output = _run(step, _impl(step, kv_cache_dtype=kv_cache_dtype), layer=_scales(scale, scale))
    keys, values = _fp8_stored(step, kv_cache_dtype, scale, scale)
    largest = fmax * float(np.float32(scale))
    saturated = np.mean([np.mean(np.abs(k.numpy()) == largest) for k in keys])
    assert 0.05 < saturated < 0.2, saturated
    _check_against_reference(step, output, scale=0.3, stored=(keys, values))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_fp8_options_match_reference(name):
    step = Step(23, **MIXED, n_heads=8, n_kv_heads=2, head_size=64, block_size=32,
                dtype="bfloat16", kv_cache_dtype="fp8")
    output = _run(step, _impl(step, kv_cache_dtype="fp8", **OPTIONS[name]),
                  layer=_scales(0.25, 1.0))
    _check_against_reference(step, output, scale=0.3, stored=_fp8_stored(step, "fp8", 0.25, 1.0),
                             **_reference_options(OPTIONS[name]))


def _error_of_unquantized(step, output):
    """The RMS error of a step's output against the float64 reference over
    the keys and values before any quantization."""
    errors = [np.ravel(attn.astype(np.float64) - reference_attention(q, k, v, **options)[0])
              for attn, q, k, v, options in _requests(step, output, scale=0.3)]
    return float(np.sqrt(np.mean(np.square(np.concatenate(errors)))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", list(FP8))
def test_fp8_errs_less_than_cpu_attns_fp8(dtype, kv_cache_dtype):
    """vLLM's scales mean the same to both backends: against the reference
    over the values before quantization, the backend's error is at most
    vLLM's op's on an fp8 cache of the same scales (measured: half of it,
    rows rounded to nearest where vLLM's op truncates)."""
    step = Step(24, **MIXED, n_heads=8, n_kv_heads=2, head_size=64, block_size=32,
                dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    try:
        theirs = _vllm_step(step, 0.3, kv_cache_dtype=kv_cache_dtype, k_scale=0.5,
                            v_scale=0.125)
    except (NotImplementedError, RuntimeError) as error:
        pytest.skip(f"vLLM's op has no fp8 cache on this CPU: {error}")
    ours = _run(step, _impl(step, kv_cache_dtype=kv_cache_dtype), layer=_scales(0.5, 0.125))
    ours_error, theirs_error = _error_of_unquantized(step, ours), _error_of_unquantized(
        step, theirs)
    assert 0 < ours_error <= theirs_error, (ours_error, theirs_error)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_inc", "fp8_ds_mla", "int8"])
def test_caches_it_cannot_read_are_refused_at_start(kv_cache_dtype):
    with pytest.raises(NotImplementedError,
                       match=f"does not serve kv_cache_dtype='{kv_cache_dtype}'.*'fp8_e5m2'"):
        CattentionImpl(8, 64, 0.125, 2, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("arguments, message", [
    (dict(num_heads=8, num_kv_heads=3), "8 query heads are not a multiple of 3"),
    (dict(sinks=torch.zeros(4)), r"sinks of shape \(4,\) for 8 query heads"),
    (dict(alibi_slopes=[1.0, 2.0]), "2 ALiBi slopes for 8 query heads"),
])
def test_layers_the_backend_cannot_serve_are_refused(arguments, message):
    options = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2) | arguments
    with pytest.raises(ValueError, match=message):
        CattentionImpl(**options)


def test_backend_declares_what_it_serves():
    assert CattentionBackend.get_name() == "CPU_ATTN"
    assert not CattentionBackend.forward_includes_kv_cache_update
    for dtype in TORCH_DTYPES.values():
        assert CattentionBackend.supports_dtype(dtype)
    for attn_type in ("decoder", "encoder", "encoder_only", "encoder_decoder"):
        assert CattentionBackend.supports_attn_type(attn_type)
    for head_size in (32, 80, 96, 112, 160, 256):
        assert CattentionBackend.supports_head_size(head_size)


@pytest.fixture
def cpu_attn_slot():
    """CPU_ATTN's class path, put back after the test."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    before = AttentionBackendEnum.CPU_ATTN.get_path()
    yield AttentionBackendEnum.CPU_ATTN
    register_backend(AttentionBackendEnum.CPU_ATTN, before)


@pytest.mark.parametrize("value, registered", [("1", True), ("0", False), ("", False),
                                               (None, False)])
def test_plugin_registers_only_when_asked(monkeypatch, cpu_attn_slot, value, registered):
    import cattention.integrations.vllm as ca_vllm
    before = cpu_attn_slot.get_path()
    if value is None:
        monkeypatch.delenv("CATTENTION_VLLM", raising=False)
    else:
        monkeypatch.setenv("CATTENTION_VLLM", value)
    ca_vllm.plugin()
    assert cpu_attn_slot.get_path() == (ca_vllm.BACKEND if registered else before)


def test_plugin_refuses_other_values(monkeypatch, cpu_attn_slot):
    import cattention.integrations.vllm as ca_vllm
    monkeypatch.setenv("CATTENTION_VLLM", "yes")
    with pytest.raises(ValueError, match="CATTENTION_VLLM='yes': set it to 1"):
        ca_vllm.plugin()


def test_plugin_is_vllms_general_plugin():
    from importlib.metadata import entry_points
    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "cattention"]
    assert [e.value for e in found] == ["cattention.integrations.vllm:plugin"]


@pytest.mark.parametrize("level", ["highest", "high", "medium"])
def test_precision_from_the_environment(monkeypatch, level):
    """CATTENTION_PRECISION, read as a layer is made, is the level of its
    bfloat16 calls: each request of a mixed step meets the level's rule.
    (CPU_ATTN's vec kernel, which this machine kind runs, keeps P in
    float32; its amx kernel rounds P to bfloat16, as "medium" does.)"""
    monkeypatch.setenv("CATTENTION_PRECISION", level)
    step = Step(11, **MIXED, n_heads=8, n_kv_heads=2, head_size=64, block_size=32,
                dtype="bfloat16")
    impl = _impl(step)
    assert impl.precision == level
    output = _run(step, impl)
    for attn, q, k, v, options in _requests(step, output, scale=0.3):
        assert_level_matches_reference(attn, q, k, v, level, **options)


def test_a_bad_precision_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("CATTENTION_PRECISION", "fast")
    with pytest.raises(ValueError, match="CATTENTION_PRECISION='fast'"):
        CattentionImpl(8, 64, 0.125, 2)
    monkeypatch.setenv("CATTENTION_PRECISION", "")
    assert CattentionImpl(8, 64, 0.125, 2).precision is None
