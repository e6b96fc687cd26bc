"""Real vLLM engines on small random-weight models, for test_vllm_engine.py
and the engine benchmark: saves the models (``make``), or runs every
scenario on every model with one attention backend and writes what the
engine returned as JSON (``run``).

    python vllm_engine_runs.py make MODELS_DIR
    python vllm_engine_runs.py run MODELS_DIR {cattention,CPU_ATTN} OUT.json [MODEL,...]

Each backend runs in a process of its own (vLLM picks its attention once
per process); the engine core stays in that process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and the engines of the models follow one
another in it. Nothing is downloaded: models are made from configs with
seeded random weights, prompts are token ids (skip_tokenizer_init).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path

# the engines' cache in GiB, for every model of a run
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

VOCAB = 512
BLOCK_SIZE = 32
# chunks of at most this many tokens a step: the 300-token prompt is
# prefilled in chunks beside the others' decodes
MAX_BATCHED_TOKENS = 64
# models run again over fp8 caches (vLLM's per-tensor scales, 1 here):
# (model, dtype, kv_cache_dtype); CPU_ATTN's fp8 needs AVX-512 or AMX and a
# head size that is a multiple of 32
FP8_RUNS = (("llama", "float32", "fp8"), ("llama", "bfloat16", "fp8_e5m2"),
            ("qwen3", "bfloat16", "fp8_e4m3"))


def _configs():
    """name -> (transformers config, dtypes tested, kind). Weights drawn at
    initializer_range 0.1 so that the next token is seldom a near tie. A
    model run in a 16-bit dtype runs in float32 too: the yardstick of both
    backends' 16-bit error. (A random mixture of experts, gpt-oss's, routes
    differently on bfloat16 noise: its sinks are checked in float32.)"""
    import transformers as tf
    common = dict(vocab_size=VOCAB, max_position_embeddings=2048, initializer_range=0.1,
                  tie_word_embeddings=False)
    return {
        # grouped heads (8 q / 2 kv), d 64
        "llama": (tf.LlamaConfig(hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=2, **common),
                  ("float32", "bfloat16", "float16"), "generate"),
        # d 128 with q/k norms
        "qwen3": (tf.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                 **common), ("float32", "bfloat16"), "generate"),
        # a sliding window of 48 positions, d 32
        "mistral": (tf.MistralConfig(hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=2, num_attention_heads=8,
                                     num_key_value_heads=4, sliding_window=48, **common),
                    ("float32",), "generate"),
        # softcap, local (window 40) and global layers, d 80
        "gemma2": (tf.Gemma2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=80,
                                   sliding_window=40, attn_logit_softcapping=20.0,
                                   final_logit_softcapping=30.0, query_pre_attn_scalar=80,
                                   **(common | dict(tie_word_embeddings=True))),
                   ("float32", "bfloat16"), "generate"),
        # ALiBi, d 64
        "bloom": (tf.BloomConfig(hidden_size=256, n_layer=2, n_head=4, vocab_size=VOCAB,
                                 initializer_range=0.1), ("float32",), "generate"),
        # sinks, sliding and full layers, experts
        "gpt_oss": (tf.GptOssConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                    num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=32, layer_types=["sliding_attention",
                                                                    "full_attention"],
                                    **common), ("float32",), "generate"),
        # encoder-only: an embedding model, d 32
        "bert": (tf.BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=256,
                               max_position_embeddings=512, initializer_range=0.1),
                 ("float32",), "embed"),
    }


def make(models_dir: Path) -> None:
    import torch
    import transformers as tf
    for name, (config, _, kind) in _configs().items():
        torch.manual_seed(0)
        if kind == "embed":
            model = tf.BertModel(config)
            config.architectures = ["BertModel"]
            # vLLM's pooling runner wants a tokenizer even for token-id prompts
            vocab = models_dir / "bert-vocab.txt"
            vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                                       + [f"t{i}" for i in range(5, VOCAB)]))
            tf.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(models_dir / name)
        else:
            model = tf.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(models_dir / name)


def _prompt(seed: int, length: int) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(1, VOCAB, length).tolist()


def _generated(outputs) -> list[dict]:
    """Each request's tokens and, per step, its top-2 (token, logprob); and
    the logprob of each prompt token after the ones before it (teacher-
    forced: comparable between runs whatever they generate)."""
    runs = []
    for output in outputs:
        completion = output.outputs[0]
        steps = [sorted(((int(t), float(lp.logprob)) for t, lp in step.items()),
                        key=lambda pair: -pair[1])[:2] for step in completion.logprobs]
        prompt = [float(position[token].logprob) for token, position in
                  zip(output.prompt_token_ids[1:], (output.prompt_logprobs or [])[1:])]
        runs.append({"tokens": list(completion.token_ids), "top2": steps, "prompt": prompt})
    return runs


def _scenarios(llm, kind: str) -> dict:
    import vllm
    from vllm.inputs import TokensPrompt
    results: dict = {}
    if kind == "embed":
        prompts = [TokensPrompt(prompt_token_ids=_prompt(s, n))
                   for s, n in ((1, 7), (2, 120), (3, 300))]
        results["embed"] = [list(map(float, out.outputs.embedding))
                            for out in llm.embed(prompts, use_tqdm=False)]
        return results
    greedy = vllm.SamplingParams(max_tokens=8, temperature=0, logprobs=2)
    # a batch whose long prompt is prefilled in chunks beside decodes, with
    # each prompt token's logprob (which vLLM computes without the prefix
    # cache: the prefix scenarios below go without)
    batch = [TokensPrompt(prompt_token_ids=_prompt(s, n))
             for s, n in ((1, 17), (2, 100), (3, 300))]
    results["batch"] = _generated(llm.generate(
        batch, vllm.SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=0),
        use_tqdm=False))
    # a prompt, then one sharing its first 160 tokens (5 cached blocks)
    first = _prompt(4, 200)
    results["prefix_first"] = _generated(llm.generate(
        [TokensPrompt(prompt_token_ids=first)], greedy, use_tqdm=False))
    before = _prefix_hits(llm)
    results["prefix_second"] = _generated(llm.generate(
        [TokensPrompt(prompt_token_ids=first[:160] + _prompt(5, 40))], greedy,
        use_tqdm=False))
    results["prefix_hits"] = _prefix_hits(llm) - before
    return results


def _counter(llm, name: str) -> float:
    return sum(metric.value for metric in llm.get_metrics() if metric.name == name)


def _prefix_hits(llm) -> float:
    return _counter(llm, "vllm:prefix_cache_hits")


def _engine(model: Path, dtype: str, kind: str, **extra):
    import vllm
    options = dict(model=str(model), dtype=dtype, skip_tokenizer_init=True,
                   enforce_eager=True, max_model_len=1024, seed=0, disable_log_stats=False)
    if kind == "embed":
        options.update(runner="pooling", max_model_len=512, skip_tokenizer_init=False)
    else:
        options.update(block_size=BLOCK_SIZE, enable_prefix_caching=True,
                       max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=8)
    options.update(extra)
    return vllm.LLM(**options)


def _preemption(models_dir: Path) -> dict:
    """Four requests in a KV space for about two: vLLM preempts and
    recomputes, the backend reads the blocks it is given again."""
    import vllm
    from vllm.inputs import TokensPrompt
    llm = _engine(models_dir / "llama", "float32", "generate", num_gpu_blocks_override=12,
                  max_num_batched_tokens=256, max_model_len=320)
    try:
        prompts = [TokensPrompt(prompt_token_ids=_prompt(10 + s, 90)) for s in range(4)]
        params = vllm.SamplingParams(max_tokens=48, temperature=0, logprobs=2,
                                     prompt_logprobs=0)
        runs = _generated(llm.generate(prompts, params, use_tqdm=False))
        return {"runs": runs, "preemptions": _counter(llm, "vllm:num_preemptions")}
    finally:
        del llm
        gc.collect()


def run(models_dir: Path, backend: str, out: Path, only: str = "") -> None:
    if backend == "cattention":
        import cattention.integrations.vllm as ca_vllm
        ca_vllm.register()
    configs = _configs()
    engines = [(f"{name}/{dtype}", name, dtype, kind, {})
               for name, (_, dtypes, kind) in configs.items() for dtype in dtypes]
    engines += [(f"{name}/{dtype}/{kv}", name, dtype, configs[name][2], {"kv_cache_dtype": kv})
                for name, dtype, kv in FP8_RUNS]
    results: dict = {}
    for key, name, dtype, kind, extra in engines:
        if only and name not in only.split(","):
            continue
        try:
            llm = _engine(models_dir / name, dtype, kind, **extra)
        except Exception as error:   # what this vLLM build does not run on this CPU
            results[key] = {"error": "".join(traceback.format_exception_only(error))}
            continue
        try:
            results[key] = _scenarios(llm, kind)
            results[key]["backend"] = _backend_of(llm)
        finally:
            del llm
            gc.collect()
    if not only or "preemption" in only.split(","):
        results["preemption"] = _preemption(models_dir)
    out.write_text(json.dumps(results))


def _backend_of(llm) -> list[str]:
    """The attention implementation class of each layer the engine built."""
    def impls(model):
        from vllm.model_executor.layers.attention import Attention
        return sorted({type(m.impl).__name__ for m in model.modules()
                       if isinstance(m, Attention)})
    return llm.apply_model(impls)[0]


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "make":
        make(Path(args[0]))
    else:
        run(Path(args[0]), args[1], Path(args[2]), *args[3:])
