"""cattention.integrations.transformers on tiny random-weight models of
several families (nothing is downloaded): logits against transformers'
eager attention, greedy generation from left-padded batches (dynamic and
static caches), output_attentions, the mask structures, and the refusals.

The ground truth is each model in float64 with reference.py's attention
(NumPy, float64 throughout) over transformers' own dense masks, registered
here as one more attention implementation; never cattention. eager is not
that truth even in float64: it rounds the attention weights to float32
(softmax(..., dtype=torch.float32)), and on a left-padded batch it is NaN.
Our float64 model matches the truth to float64 rounding and eager to float32
rounding; our float32 model obeys the FlashAttention rule of reference.py
with eager float32 as the yardstick: error against the truth within 2x (RMS)
and 4x (worst element) eager's. Skipped without torch and transformers 5.4
(CI installs them: make test-transformers).
"""

import warnings

import numpy as np
import pytest

from reference import F32_RTOL_MAX, F32_RTOL_RMS, float32_ulp_atol, reference_attention, rms_err

try:
    import torch
    import transformers
except ImportError as error:
    pytest.skip(f"needs torch and transformers>=5.4 ({error}; make test-transformers installs "
                "them)", allow_module_level=True)
if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 4):
    pytest.skip(f"needs transformers>=5.4, found {transformers.__version__}",
                allow_module_level=True)

import cattention  # noqa: E402
import cattention.integrations.transformers as ca_hf  # noqa: E402
from transformers import masking_utils  # noqa: E402

IMPLEMENTATION = ca_hf.register()
REFERENCE = "cattention_tests_reference"


def _reference_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       softcap=None, s_aux=None, position_bias=None, **kwargs):
    """reference.py's float64 attention as a transformers attention function,
    over transformers' dense bool mask (K/V repeated for grouped heads)."""
    groups = query.shape[1] // key.shape[1]
    k = np.repeat(key.numpy(), groups, axis=1)
    v = np.repeat(value.numpy(), groups, axis=1)
    mask = attention_mask.numpy()
    if position_bias is not None:
        mask = np.where(mask, position_bias.numpy(), -np.inf)
    sinks = None if s_aux is None else s_aux.detach().numpy()
    attn, scores = reference_attention(query.numpy(), k, v, mask=mask, scale=scaling,
                                       softcap=softcap, sinks=sinks)
    return (torch.from_numpy(np.ascontiguousarray(attn.transpose(0, 2, 1, 3))),
            torch.from_numpy(scores))


def _reference_mask(**kwargs):
    # always dense, bool: transformers may skip a mask the sdpa kernel's flags say
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return masking_utils.sdpa_mask(**kwargs)


transformers.AttentionInterface.register(REFERENCE, _reference_forward)
transformers.AttentionMaskInterface.register(REFERENCE, _reference_mask)
WINDOW = 4          # sliding windows shorter than the prompts, so they cut
VOCAB = 128


def _sizes(**extra):
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    sizes.update(extra)
    return sizes


# name: (model class, config). Decoders cover grouped heads, a sliding window
# on every layer, per-layer alternation, softcap and sinks; the encoders
# padding masks, T5's position bias and cross-attention.
DECODERS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_sizes())),
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**_sizes(sliding_window=WINDOW))),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_sizes(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1))),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_sizes(
        sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=30.0))),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**_sizes(
        num_hidden_layers=3, sliding_window=WINDOW, sliding_window_pattern=3,
        layer_types=None))),
    # eager experts: the grouped matmul of the default ones has no float64
    "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(**_sizes(
        sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
        experts_implementation="eager"))),
}
ENCODERS = {
    "bert": lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96)),
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0)),
}
FAMILIES = {**DECODERS, **ENCODERS}
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float64, id="float64")]

_models = {}


def tiny_model(name, dtype, implementation):
    """The family's model with fixed random weights, in dtype, eval mode,
    attending with implementation (built once per family and dtype)."""
    if (name, dtype) not in _models:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # ids past the tiny vocabulary, and the like
            _models[name, dtype] = FAMILIES[name]().to(dtype).eval()
    model = _models[name, dtype]
    model.set_attn_implementation(implementation)
    return model


PROMPTS = [list(range(3, 15)), [5, 9, 4, 7, 8, 3, 6], [11, 12, 13, 14, 10]]


def batch(prompts, side):
    """(input_ids, attention_mask, position_ids) of prompts padded on side;
    positions count real tokens only, as generate() gives them."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        span = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[row, span] = torch.tensor(prompt)
        mask[row, span] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


DECODER_INPUTS = torch.tensor([[0, 4, 6, 5], [0, 3, 3, 9], [0, 7, 8, 2]])


def forward(name, model, ids, mask, positions):
    """What the family's output is: the logits (decoders, T5) or the last
    hidden state (BERT)."""
    with torch.no_grad():
        if name == "bert":
            return model(input_ids=ids, attention_mask=mask).last_hidden_state
        if name == "t5":
            return model(input_ids=ids, attention_mask=mask,
                         decoder_input_ids=DECODER_INPUTS[:len(ids)]).logits
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


def padding_side(name):
    return "left" if name in DECODERS else "right"


def real_rows(name, output, mask):
    """The output rows of real tokens (a padding token's row is whatever an
    implementation makes of a row that sees nothing, and no real token
    reads it); T5's decoder rows are all real."""
    return output if name == "t5" else output[mask.bool()]


def assert_float32_rule(ours, eager32, reference):
    """ours (float32) within the FlashAttention rule of reference.py against
    the float64 reference, the float32 eager model's error the yardstick."""
    ours, eager32, reference = (np.asarray(x, dtype=np.float64) for x in (ours, eager32, reference))
    floor = float32_ulp_atol(reference)
    ours_rms, eager_rms = rms_err(ours, reference), rms_err(eager32, reference)
    ours_max = float(np.max(np.abs(ours - reference)))
    eager_max = float(np.max(np.abs(eager32 - reference)))
    assert ours_rms <= F32_RTOL_RMS * eager_rms + floor / np.sqrt(ours.size), (ours_rms, eager_rms)
    assert ours_max <= F32_RTOL_MAX * eager_max + floor, (ours_max, eager_max)


def assert_like_truth(ours, eager, truth):
    """float64: the truth to float64 rounding, eager to float32's; float32:
    the FlashAttention rule with eager (float32) as the yardstick."""
    if ours.dtype == torch.float64:
        np.testing.assert_allclose(ours.numpy(), truth.numpy(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(ours.numpy(), eager.numpy(), rtol=0, atol=1e-5)
    else:
        assert_float32_rule(ours.numpy(), eager.numpy(), truth.numpy())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_eager(name, dtype):
    ids, mask, positions = batch(PROMPTS[:2], padding_side(name))
    ids[1, -len(PROMPTS[1]):] = torch.tensor(PROMPTS[1])   # both rows unpadded
    mask[:] = 1
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    truth = forward(name, tiny_model(name, torch.float64, REFERENCE), ids, mask, positions)
    eager = forward(name, tiny_model(name, dtype, "eager"), ids, mask, positions)
    ours = forward(name, tiny_model(name, dtype, IMPLEMENTATION), ids, mask, positions)
    assert ours.dtype == dtype
    assert_like_truth(ours, eager, truth)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_padded_batch_matches_eager(name, dtype):
    """A padded batch (left for decoders, right for encoders), on the rows of
    real tokens. eager float64 is NaN on a left-padded batch (its mask's
    float64 minimum plus a logit overflows to -inf, a padding row of -inf
    is NaN, and the next layer spreads it), so there it is eager float32."""
    ids, mask, positions = batch(PROMPTS, padding_side(name))
    truth = forward(name, tiny_model(name, torch.float64, REFERENCE), ids, mask, positions)
    eager = forward(name, tiny_model(name, torch.float32, "eager"), ids, mask, positions)
    ours = forward(name, tiny_model(name, dtype, IMPLEMENTATION), ids, mask, positions)
    ours, eager, truth = (real_rows(name, x, mask) for x in (ours, eager, truth))
    if dtype == torch.float64:
        np.testing.assert_allclose(ours.numpy(), truth.numpy(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(ours.numpy(), eager.numpy(), rtol=0, atol=1e-5)
    else:
        assert_float32_rule(ours.numpy(), eager.numpy(), truth.numpy())


@pytest.mark.parametrize("name", FAMILIES)
def test_padded_rows_are_each_prompt_alone(name):
    """Each real token of a padded batch gets the output of its prompt run
    alone, unpadded (both float64)."""
    ids, mask, positions = batch(PROMPTS, padding_side(name))
    ours = forward(name, tiny_model(name, torch.float64, IMPLEMENTATION), ids, mask, positions)
    truth = []
    for row, prompt in enumerate(PROMPTS):
        one_ids, one_mask, one_positions = batch([prompt], padding_side(name))
        if name == "t5":   # with the row's own decoder inputs
            with torch.no_grad():
                truth.append(tiny_model(name, torch.float64, REFERENCE)(
                    input_ids=one_ids, attention_mask=one_mask,
                    decoder_input_ids=DECODER_INPUTS[row:row + 1]).logits)
        else:
            truth.append(forward(name, tiny_model(name, torch.float64, REFERENCE),
                                 one_ids, one_mask, one_positions)[0])
    np.testing.assert_allclose(real_rows(name, ours, mask).numpy(), torch.cat(truth).numpy(),
                               rtol=0, atol=1e-12)


def generate(model, prompts, cache):
    ids, mask, _ = batch(prompts, "left")
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                              do_sample=False, pad_token_id=0, eos_token_id=None,
                              cache_implementation=cache)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generate_from_left_padded_prompts(name, dtype, cache):
    """The same tokens as eager (float32) or the truth (float64: eager is NaN
    there) from a left-padded batch of 3 prompts, with a dynamic and a static
    cache."""
    yardstick = tiny_model(name, dtype, "eager" if dtype == torch.float32 else REFERENCE)
    expected = generate(yardstick, PROMPTS, cache)
    tokens = generate(tiny_model(name, dtype, IMPLEMENTATION), PROMPTS, cache)
    assert torch.equal(tokens, expected)


def test_t5_generates_eager_tokens():
    ids, mask, _ = batch(PROMPTS, "right")
    results = []
    for implementation in ("eager", IMPLEMENTATION):
        with torch.no_grad():
            results.append(tiny_model("t5", torch.float32, implementation).generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    assert torch.equal(*results)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "bert"])
def test_output_attentions_are_the_weights(name):
    """output_attentions=True gives each layer's weights (the fused SCORES
    output): those of the truth on the rows of real tokens; a row's weights
    sum to 1 less its sink's share."""
    ids, mask, positions = batch(PROMPTS, padding_side(name))
    outputs = []
    for implementation in (IMPLEMENTATION, REFERENCE):
        model = tiny_model(name, torch.float64, implementation)
        with torch.no_grad():
            outputs.append(model(input_ids=ids, attention_mask=mask, output_attentions=True,
                                 **({} if name == "bert" else {"position_ids": positions})))
    ours, truth = (output.attentions for output in outputs)
    assert len(ours) == len(truth) > 0
    real = mask.bool()
    for layer, (weights, expected) in enumerate(zip(ours, truth)):
        assert weights.shape == expected.shape == (3, 4) + (ids.shape[1],) * 2
        rows, expected_rows = weights.transpose(1, 2)[real], expected.transpose(1, 2)[real]
        np.testing.assert_allclose(rows.numpy(), expected_rows.numpy(), rtol=0, atol=1e-12)
        if name != "gpt_oss":
            np.testing.assert_allclose(rows.sum(-1).numpy(), 1.0, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_half_precision_models_within_their_rounding(name, dtype):
    """bfloat16 and float16 models run on views of their tensors (no float32
    copies; gpt-oss's sinks too): logits within 2x eager's RMS error."""
    if dtype == torch.bfloat16:
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            pytest.skip("bfloat16 tensors need ml_dtypes for their NumPy view (the "
                        "transformers extra installs it)")
    ids, mask, positions = batch(PROMPTS, "left")
    truth = forward(name, tiny_model(name, torch.float64, REFERENCE), ids, mask, positions)
    eager = forward(name, tiny_model(name, dtype, "eager"), ids, mask, positions)
    ours = forward(name, tiny_model(name, dtype, IMPLEMENTATION), ids, mask, positions)
    assert ours.dtype == dtype
    ours, eager, truth = (real_rows(name, x, mask).double() for x in (ours, eager, truth))
    assert rms_err(ours.numpy(), truth.numpy()) <= F32_RTOL_RMS * rms_err(eager.numpy(),
                                                                          truth.numpy())


def test_left_padded_generate_builds_no_dense_mask(monkeypatch):
    """A left-padded batch through a model with sliding and full layers:
    every mask is a structure, transformers never builds a dense one, and
    cattention is never given mask=."""
    def no_dense_mask(**kwargs):
        raise AssertionError("a dense mask was built")

    calls = []
    attention = cattention.attention

    def recording_attention(*args, **kwargs):
        calls.append(kwargs)
        return attention(*args, **kwargs)

    monkeypatch.setattr(masking_utils, "sdpa_mask", no_dense_mask)
    monkeypatch.setattr(cattention, "attention", recording_attention)
    for cache in ("dynamic", "static"):
        generate(tiny_model("gemma2", torch.float32, IMPLEMENTATION), PROMPTS, cache)
    assert calls and not any("mask" in options for options in calls)
    starts = [options["kv_starts"] for options in calls if "kv_starts" in options]
    assert starts and all(list(s) == [0, 5, 7] for s in starts)
    assert any("window" in options for options in calls)


def test_mask_structure_is_transformers_mask():
    """Each structure the mask function makes sees, on the rows of real
    tokens, exactly the keys of transformers' dense mask for the same call:
    reference.py's float64 attention under the structure's options equals
    it under the dense mask."""
    rng = np.random.default_rng(1)
    causal, bidirectional = (masking_utils.causal_mask_function,
                             masking_utils.bidirectional_mask_function)
    sliding = masking_utils.sliding_window_causal_mask_function(3)
    sliding_both = masking_utils.sliding_window_bidirectional_mask_function(2)
    padding = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1],     # left
                            [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                            [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],     # right
                            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    calls = [   # (mask function, local size, q_length, kv_length, q_offset, kv_offset, mask)
        (causal, None, 10, 10, 0, 0, padding),            # prefill
        (causal, None, 1, 10, 9, 0, padding),             # decode
        (causal, None, 3, 12, 7, 0, padding),             # static cache: slots past the mask
        (sliding, 3, 10, 10, 0, 0, padding),
        (sliding, 3, 1, 3, 9, 7, padding),                # a sliding cache's last keys
        (bidirectional, None, 10, 10, 0, 0, padding[:3]),
        (bidirectional, None, 4, 10, 0, 0, padding[:3]),  # cross-attention
        (sliding_both, 2, 10, 10, 0, 0, padding[:2]),
        (causal, None, 6, 6, 0, 0, None),
    ]
    for function, local_size, q_length, kv_length, q_offset, kv_offset, padding_mask in calls:
        arguments = dict(batch_size=4 if padding_mask is None else len(padding_mask),
                         q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=function,
                         attention_mask=padding_mask, local_size=local_size)
        structure = ca_hf.structured_mask(**arguments)
        assert isinstance(structure, ca_hf.MaskStructure), arguments
        dense = _reference_mask(**arguments).numpy()
        size = structure.batch_size
        q = rng.standard_normal((size, 2, q_length, 8))
        k = rng.standard_normal((size, 2, kv_length, 8))
        v = rng.standard_normal((size, 2, kv_length, 8))
        expected, _ = reference_attention(q, k, v, mask=dense)
        # a 1-D kv_starts or kv_lengths is one per sequence (cattention's
        # rule); reference.py broadcasts by NumPy's, so give it (B, 1)
        options = {name: (value[:, None] if isinstance(value, np.ndarray) else value)
                   for name, value in structure.options.items()}
        got, _ = reference_attention(q, k, v, **options)
        # rows of real tokens; a padding row sees nothing in one and
        # whatever padding is past it in the other
        real = np.ones((size, q_length), bool)
        if padding_mask is not None:
            positions = np.arange(q_offset, q_offset + q_length)
            within = positions < padding_mask.shape[1]
            real[:, within] = padding_mask.numpy()[:, positions[within]]
        real &= dense.any(axis=-1)[:, 0]
        np.testing.assert_array_equal(got.transpose(0, 2, 1, 3)[real],
                                      expected.transpose(0, 2, 1, 3)[real])


def test_other_masks_stay_dense_and_match():
    """Patterns a structure cannot say get transformers' dense mask, passed
    to cattention as mask=: a padding mask with a hole, and sequences packed
    in one row (position ids that restart, no attention mask)."""
    holes = torch.tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    dense = ca_hf.structured_mask(batch_size=1, q_length=6, kv_length=6,
                                  attention_mask=holes)
    assert isinstance(dense, torch.Tensor) and dense.shape == (1, 1, 6, 6)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11]])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    outputs = [forward("llama", tiny_model("llama", torch.float64, implementation), ids, None,
                       positions) for implementation in (IMPLEMENTATION, REFERENCE)]
    np.testing.assert_allclose(outputs[0].numpy(), outputs[1].numpy(), rtol=0, atol=1e-12)


def test_attn_implementation_names_it():
    config = transformers.LlamaConfig(**_sizes())
    model = transformers.AutoModelForCausalLM.from_config(config,
                                                          attn_implementation=IMPLEMENTATION)
    assert model.config._attn_implementation == IMPLEMENTATION
    assert ca_hf.register("cattention_again") == "cattention_again"
    assert transformers.AttentionInterface()["cattention_again"] is ca_hf.attention_forward


class _Layer(torch.nn.Module):
    is_causal = True


def _qkv(dtype=torch.float32, grad=False):
    torch.manual_seed(0)
    return [torch.randn(shape, dtype=dtype, requires_grad=grad)
            for shape in ((1, 4, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8))]


def test_refuses_gradients():
    with pytest.raises(RuntimeError, match=r"forward pass only.*torch\.no_grad.*sdpa"):
        ca_hf.attention_forward(_Layer(), *_qkv(grad=True), None)
    model = tiny_model("llama", torch.float32, IMPLEMENTATION)
    ids, mask, _ = batch(PROMPTS, "left")
    with pytest.raises(RuntimeError, match="forward pass only"):
        model(input_ids=ids, attention_mask=mask)     # gradients on: refused
    with torch.no_grad():
        ca_hf.attention_forward(_Layer(), *_qkv(grad=True), None)   # none needed: runs


def test_refuses_dropout():
    with torch.no_grad(), pytest.raises(ValueError, match=r"dropout=0\.1.*model\.eval\(\)"):
        ca_hf.attention_forward(_Layer(), *_qkv(), None, dropout=0.1)


def test_refuses_other_devices_and_dtypes():
    q, k, v = _qkv()
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"on the CPU.*meta.*sdpa"):
            ca_hf.attention_forward(_Layer(), q.to("meta"), k, v, None)
        with pytest.raises(TypeError, match="torch.float32, torch.float64 and torch.float32"):
            ca_hf.attention_forward(_Layer(), q, k.double(), v, None)
        with pytest.raises(TypeError, match="torch.int64"):
            ca_hf.attention_forward(_Layer(), q.long(), k.long(), v.long(), None)
        structure = ca_hf.structured_mask(batch_size=1, q_length=5, kv_length=5)
        with pytest.raises(ValueError, match="made for batch 1, 5 queries and 5 keys"):
            ca_hf.attention_forward(_Layer(), q, k, v, structure)


def test_output_is_the_layout_models_want():
    """(B, T, H, d), contiguous: the model's reshape to (B, T, H * d) is a view."""
    q, k, v = _qkv()
    with torch.no_grad():
        attn, weights = ca_hf.attention_forward(_Layer(), q, k, v, None, scaling=0.5)
    assert weights is None and attn.shape == (1, 3, 4, 8) and attn.is_contiguous()
    groups = 2
    expected, _ = reference_attention(q.numpy(), np.repeat(k.numpy(), groups, axis=1),
                                      np.repeat(v.numpy(), groups, axis=1), causal=True,
                                      scale=0.5)
    np.testing.assert_allclose(attn.numpy(), expected.transpose(0, 2, 1, 3), rtol=0, atol=1e-6)


def test_benchmark_harness_on_a_tiny_model(monkeypatch):
    """benchmarks/transformers_e2e.py's measurement on a tiny model: the
    records, the attention clocks, and no dense mask for cattention on the
    left-padded batch where sdpa gets one per layer call."""
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "transformers_e2e.py"
    if not path.is_file():
        pytest.skip("benchmarks/ is not here (tests run outside the source tree)")
    spec = importlib.util.spec_from_file_location("bench_transformers_e2e", path)
    bench = importlib.util.module_from_spec(spec)
    # its dataclasses look their module up while being defined
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    names = bench.register_timed_implementations()
    model = tiny_model("llama", torch.float64, IMPLEMENTATION)
    ids, mask = bench.prompts(4, 16, VOCAB)
    assert mask[:, 0].tolist() == [1, 0, 0, 0] and mask[:, -1].all()
    results = bench.measure(model, names, bench.IMPLEMENTATIONS, ids, mask, steps=3, repeats=1)
    assert set(results) == set(bench.IMPLEMENTATIONS)
    for result in results.values():
        assert result["pp_tokens_per_s"] > 0 and result["tg_tokens_per_s"] > 0
        assert result["pp_attention_ms"] > 0 and len(result["tokens"][0]) == 3
    assert results["cattention"]["dense_masks"] == 0
    assert results["sdpa"]["dense_masks"] > 0
    assert results["cattention"]["tokens"] == results["sdpa"]["tokens"]


def test_register_binds_a_precision_level(monkeypatch):
    """register(precision=) hands the level to every call under its name
    (bfloat16 logits within the rule of the default's); a bad level is
    refused at register, naming it."""
    import cattention
    fast = ca_hf.register("cattention_medium", precision="medium")
    assert transformers.AttentionInterface()[fast] is not ca_hf.attention_forward
    with pytest.raises(ValueError, match="precision"):
        ca_hf.register("cattention_bad", precision="fastest")
    seen = []
    attention = cattention.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("precision"))
        return attention(*args, **kwargs)

    monkeypatch.setattr(cattention, "attention", spy)
    pytest.importorskip("ml_dtypes")
    ids, mask, positions = batch(PROMPTS, "left")
    truth = forward("llama", tiny_model("llama", torch.float64, REFERENCE), ids, mask, positions)
    eager = forward("llama", tiny_model("llama", torch.bfloat16, "eager"), ids, mask, positions)
    ours = forward("llama", tiny_model("llama", torch.bfloat16, fast), ids, mask, positions)
    assert seen and set(seen) == {"medium"}
    ours, eager, truth = (real_rows("llama", x, mask).double() for x in (ours, eager, truth))
    assert rms_err(ours.numpy(), truth.numpy()) <= F32_RTOL_RMS * rms_err(eager.numpy(),
                                                                          truth.numpy())
