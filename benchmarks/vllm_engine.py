"""vLLM's engine (``LLM.generate``) with cattention's backend against
CPU_ATTN: a Llama-3.2-1B-shaped model (hidden 2048, 32 query / 8 K/V
heads, d 64, MLP 8192, vocabulary 128256; random weights, --layers of its
16), time to first token and decode time per token, with attention's share
of each.

    python benchmarks/vllm_engine.py [--layers 2] [--prompts 512 2048 8192]
        [--batches 1 4] [--dtypes float32 bfloat16] [--threads 1 2]
        [--repeats 3] [--tokens 16] [--rounds 1] [--max-batch-tokens 8192]

Each (dtype, threads) runs in one process per backend, the two backends
alternately (--rounds times); the engine core stays in the process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), on --threads threads (OMP_NUM_THREADS:
vLLM applies VLLM_CPU_OMP_THREADS_BIND only to workers of their own, and
an engine in the process keeps torch's count). Prefix caching is off
(every repeat prefills), block size and batching are vLLM's CPU defaults.
Time to first token: ``generate`` of one token; decode per token: the time
of 1 + --tokens tokens less that, over --tokens. Attention: the layers'
attention calls (the impl's forward and its cache append) timed inside the
same runs. A row whose 8192-token batch would not fit the KV space is
skipped. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB = 128256


def _make_model(folder: Path, layers: int) -> None:
    import torch
    import transformers as tf
    config = tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                            vocab_size=VOCAB, max_position_embeddings=16384,
                            tie_word_embeddings=True, rope_theta=500000.0)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


class _AttentionClock:
    """Seconds spent in the attention impl's forward and cache update."""

    def __init__(self, impl_class):
        self.seconds = 0.0
        for name in ("forward", "do_kv_cache_update"):
            original = getattr(impl_class, name)
            setattr(impl_class, name, self._timed(original))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def _worker(args) -> dict:
    import numpy as np
    if args.worker == "cattention":
        import cattention.integrations.vllm as ca_vllm
        ca_vllm.register()
        from cattention.integrations.vllm._backend import CattentionImpl as impl_class
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl_class
    import vllm
    from vllm.inputs import TokensPrompt
    clock = _AttentionClock(impl_class)
    longest = max(args.prompts) + args.tokens + 1
    llm = vllm.LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True,
                   enforce_eager=True, enable_prefix_caching=False, seed=0,
                   max_model_len=longest)
    # each engine step's time and the attention time inside it
    steps: list[tuple[float, float]] = []
    engine_step = llm.llm_engine.step

    def timed_step(*args, **kwargs):
        start, before = time.perf_counter(), clock.seconds
        try:
            return engine_step(*args, **kwargs)
        finally:
            steps.append((time.perf_counter() - start, clock.seconds - before))
    llm.llm_engine.step = timed_step
    rng = np.random.default_rng(0)
    results = {}
    for prompt in args.prompts:
        for batch in args.batches:
            if prompt * batch > args.max_batch_tokens:
                continue
            prompts = [TokensPrompt(prompt_token_ids=rng.integers(1, VOCAB, prompt).tolist())
                       for _ in range(batch)]

            def run(n_tokens):
                """(seconds, attention seconds) of each engine step of a generate."""
                params = vllm.SamplingParams(max_tokens=n_tokens, min_tokens=n_tokens,
                                             temperature=0, ignore_eos=True)
                del steps[:]
                llm.generate(prompts, params, use_tqdm=False)
                return list(steps)
            run(1)   # warm-up
            first = [run(1) for _ in range(args.repeats)]
            # the steps up to the first token (prefill, in chunks), then one
            # step per decoded token
            n_prefill = len(first[0])
            decode = [step for _ in range(args.repeats)
                      for step in run(1 + args.tokens)[n_prefill:]]
            results[f"{prompt}|{batch}"] = [
                statistics.median(sum(t for t, _ in r) for r in first),
                statistics.median(sum(a for _, a in r) for r in first),
                statistics.median(t for t, _ in decode),
                statistics.median(a for _, a in decode)]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-batch-tokens", type=int, default=8192,
                        help="skip rows whose batch prefills more tokens (the 8192 x 4 row "
                        "takes minutes per prefill on 2 cores)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "llama-1b-shaped"
        _make_model(model, args.layers)
        print(f"Llama-3.2-1B-shaped, {args.layers} layers, random weights; "
              f"{args.tokens} decode tokens; times in ms\n")
        print("| dtype | thr | prompt | batch | TTFT ours | TTFT CPU_ATTN | ratio | "
              "attention share ours / theirs | decode/token ours | CPU_ATTN | ratio | "
              "attention share ours / theirs |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for dtype in args.dtypes:
            for threads in args.threads:
                runs = {"cattention": [], "CPU_ATTN": []}
                for _ in range(args.rounds):
                    for backend in runs:
                        command = [sys.executable, __file__, "--worker", backend, "--model",
                                   str(model), "--dtype", dtype, "--repeats",
                                   str(args.repeats), "--tokens", str(args.tokens),
                                   "--prompts", *map(str, args.prompts),
                                   "--batches", *map(str, args.batches),
                                   "--max-batch-tokens", str(args.max_batch_tokens)]
                        # (the engine in this process does not apply vLLM's
                        # binding: torch takes its count from OMP_NUM_THREADS)
                        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                                   OMP_NUM_THREADS=str(threads),
                                   VLLM_LOGGING_LEVEL="ERROR",
                                   VLLM_CPU_KVCACHE_SPACE=os.environ.get(
                                       "VLLM_CPU_KVCACHE_SPACE", "6"))
                        done = subprocess.run(command, capture_output=True, text=True, env=env)
                        if done.returncode:
                            sys.exit(done.stderr[-3000:])
                        runs[backend].append(json.loads(done.stdout.strip().splitlines()[-1]))
                for key in runs["cattention"][0]:
                    ours = [statistics.median(r[key][i] for r in runs["cattention"])
                            for i in range(4)]
                    theirs = [statistics.median(r[key][i] for r in runs["CPU_ATTN"])
                              for i in range(4)]
                    prompt, batch = key.split("|")
                    print(f"| {dtype} | {threads} | {prompt} | {batch} | "
                          f"{ours[0] * 1e3:.0f} | {theirs[0] * 1e3:.0f} | "
                          f"{theirs[0] / ours[0]:.2f}x | "
                          f"{ours[1] / ours[0]:.0%} / {theirs[1] / theirs[0]:.0%} | "
                          f"{ours[2] * 1e3:.1f} | {theirs[2] * 1e3:.1f} | "
                          f"{theirs[2] / ours[2]:.2f}x | "
                          f"{ours[3] / ours[2]:.0%} / {theirs[3] / theirs[2]:.0%} |",
                          flush=True)


if __name__ == "__main__":
    main()
