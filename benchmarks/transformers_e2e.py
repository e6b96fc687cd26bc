"""transformers end to end: "sdpa" vs "cattention" (and "eager") in a
Llama-3.2-1B-shaped model with random weights, llama-bench style.

    python benchmarks/transformers_e2e.py                 # the grid (make bench-transformers)
    python benchmarks/transformers_e2e.py --quick         # a smaller one, to try it
    python benchmarks/transformers_e2e.py --json out.json # the records too

The layers are Llama-3.2-1B's (hidden 2048, 32 query heads, 8 K/V heads,
head dim 64, MLP 8192, RoPE); --layers of them (default 4: the share of
attention in a layer, which sets every ratio here, does not depend on the
count) and a vocabulary of --vocab tokens (default 2048: the LM head and the
embedding are not what is measured; logits are taken for the last position
only, as generate does). --layers 16 --vocab 128256 is the whole 1B shape.

Each case: a prefill of --prompt tokens (pp) into a DynamicCache, then --gen
greedy decode steps (tg), as generate runs them (2-D attention mask grown
by one column a step, positions from it, logits of the last position),
timed whole; the attention functions alone are timed too (each
implementation's function wrapped with a clock: the time inside it, not
the mask building, which counts in the whole). Batch 1, and a batch of 4
prompts of different lengths padded on the left (generate's padding), where
cattention must build no dense mask: the count of dense masks it was given
is printed. float32 and bfloat16, 1 and 2 threads (torch's and cattention's).

Results are tokens/s (prompt tokens and generated tokens of the whole batch
per second), the best of --repeats runs taken in turns; "vs sdpa" is the
ratio of the rate (or of the attention time, inverted) to sdpa's. The
machine's load average is printed first: other work on the cores skews
every figure. So the one-thread rows also give the ratios by the CPU time
of the process ("cpu"), which time spent waiting for a core does not
count (memory and cache shared with other work still do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import transformers
from transformers import masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama import modeling_llama

import cattention
import cattention.integrations.transformers as ca_hf

IMPLEMENTATIONS = ("sdpa", "cattention", "eager")


@dataclass
class Clock:
    """Seconds spent inside an attention function, and what it was given."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    dense_masks: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.cpu_seconds, self.dense_masks, self.calls = 0.0, 0.0, 0, 0


CLOCK = Clock()


def _timed(function):
    def attention(module, query, key, value, attention_mask, **kwargs):
        CLOCK.calls += 1
        CLOCK.dense_masks += isinstance(attention_mask, torch.Tensor)
        started, started_cpu = time.perf_counter(), time.process_time()
        result = function(module, query, key, value, attention_mask, **kwargs)
        CLOCK.seconds += time.perf_counter() - started
        CLOCK.cpu_seconds += time.process_time() - started_cpu
        return result
    return attention


def register_timed_implementations() -> dict[str, str]:
    """Each implementation's attention function under a clock, beside its
    own mask function, registered as "timed-<name>"."""
    functions = {
        "sdpa": (sdpa_attention_forward, masking_utils.sdpa_mask),
        "eager": (modeling_llama.eager_attention_forward, masking_utils.eager_mask),
        "cattention": (ca_hf.attention_forward, ca_hf.structured_mask),
    }
    names = {}
    for name, (attention, mask) in functions.items():
        names[name] = f"timed-{name}"
        transformers.AttentionInterface.register(names[name], _timed(attention))
        transformers.AttentionMaskInterface.register(names[name], mask)
    return names


def llama_1b_shaped(layers: int, vocab: int, dtype: torch.dtype) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def prompts(batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): batch prompts, the first of length
    tokens and each next 1/8 shorter, padded on the left."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, length), generator=generator)
    mask = torch.ones((batch, length), dtype=torch.long)
    for row in range(batch):
        pad = row * length // 8
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


@dataclass
class Run:
    prefill_seconds: float
    prefill_attention_seconds: float
    decode_seconds: float
    decode_attention_seconds: float
    prefill_cpu_seconds: float          # CPU time of the process (see --help)
    prefill_attention_cpu_seconds: float
    decode_cpu_seconds: float
    dense_masks: int
    tokens: torch.Tensor = field(repr=False)


def run_once(model, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> Run:
    """A prefill, then steps greedy decode steps, as generate() runs them."""
    with warnings.catch_warnings():
        # past_key_values= is deprecated for cache= in recent 5.x; earlier
        # ones take only past_key_values=
        warnings.simplefilter("ignore", FutureWarning)
        return _run_once(model, ids, mask, steps)


def _run_once(model, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> Run:
    cache = transformers.DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    CLOCK.reset()
    started, started_cpu = time.perf_counter(), time.process_time()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    prefill, prefill_cpu = time.perf_counter() - started, time.process_time() - started_cpu
    prefill_attention, prefill_attention_cpu = CLOCK.seconds, CLOCK.cpu_seconds
    dense = CLOCK.dense_masks
    CLOCK.reset()
    tokens = []
    started, started_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        positions = positions[:, -1:] + 1
        logits = model(input_ids=token, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    decode, decode_cpu = time.perf_counter() - started, time.process_time() - started_cpu
    return Run(prefill, prefill_attention, decode, CLOCK.seconds, prefill_cpu,
               prefill_attention_cpu, decode_cpu, dense + CLOCK.dense_masks,
               torch.cat(tokens, dim=-1) if tokens else torch.empty(0))


def measure(model, names: dict[str, str], implementations, ids, mask, steps: int,
            repeats: int) -> dict[str, dict]:
    """Each implementation's figures, the best of repeats runs. The runs
    take turns (one of each, repeats times), so a change in the machine's
    load while measuring falls on all of them alike."""
    runs: dict[str, list[Run]] = {name: [] for name in implementations}
    with torch.inference_mode():
        for name in implementations:                    # warm-up: threads, caches
            model.set_attn_implementation(names[name])
            run_once(model, ids[:, -64:], mask[:, -64:], 4)
        for _ in range(repeats):
            for name in implementations:
                model.set_attn_implementation(names[name])
                runs[name].append(run_once(model, ids, mask, steps))
    batch, length = ids.shape
    # the best of the runs: on a shared machine a slower run is the one
    # another program slowed
    return {name: {
        "pp_tokens_per_s": batch * length / min(r.prefill_seconds for r in done),
        "pp_attention_ms": 1e3 * min(r.prefill_attention_seconds for r in done),
        "pp_ms": 1e3 * min(r.prefill_seconds for r in done),
        "tg_tokens_per_s": batch * steps / min(r.decode_seconds for r in done),
        "tg_attention_ms_per_step": 1e3 * min(r.decode_attention_seconds for r in done)
        / max(steps, 1),
        "pp_cpu_tokens_per_s": batch * length / min(r.prefill_cpu_seconds for r in done),
        "pp_attention_cpu_ms": 1e3 * min(r.prefill_attention_cpu_seconds for r in done),
        "tg_cpu_tokens_per_s": batch * steps / min(r.decode_cpu_seconds for r in done),
        "dense_masks": max(r.dense_masks for r in done),
        "tokens": done[0].tokens.tolist(),
    } for name, done in runs.items()}


def _microseconds(call, calls: int = 5000) -> float:
    """The 5th percentile of calls timed one by one: a call that another
    program's work did not slow, on a machine that has such work."""
    for _ in range(200):
        call()
    times = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - started)
    times.sort()
    return times[len(times) // 20] / 1e3


def per_call_costs(n_keys: int = 1024) -> dict[str, float]:
    """One layer call at decode size (1 query row, n_keys keys, 8:2 heads,
    d = 64, float32, one thread), in microseconds:
    cattention.attention on the arrays, the adapter's attention function on
    the tensors (the difference is what the adapter adds), and transformers'
    sdpa function; plain causal and with a left-padded start."""
    class Layer(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 4

    layer = Layer()
    torch.manual_seed(0)
    query = torch.randn(1, 1, 8, 64).transpose(1, 2)     # a view of (B, T, H, d), as models make
    key, value = torch.randn(1, 2, n_keys, 64), torch.randn(1, 2, n_keys, 64)
    q, k, v = query.numpy(), key.numpy(), value.numpy()
    out = torch.empty(1, 1, 8, 64).numpy().transpose(0, 2, 1, 3)
    padding = torch.ones(1, n_keys, dtype=torch.bool)
    padding[:, :7] = False
    costs = {}
    with torch.inference_mode():
        for label, padded in (("causal", None), ("left-padded", padding)):
            structure = ca_hf.structured_mask(batch_size=1, q_length=1, kv_length=n_keys,
                                              q_offset=n_keys - 1, attention_mask=padded)
            dense = masking_utils.sdpa_mask(batch_size=1, q_length=1, kv_length=n_keys,
                                            q_offset=n_keys - 1, attention_mask=padded)
            options = dict(structure.options, enable_gqa=True, scale=0.125)
            costs[f"cattention.attention, {label}"] = _microseconds(
                lambda: cattention.attention(q, k, v, **options))
            costs[f"cattention.attention out=, {label}"] = _microseconds(
                lambda: cattention.attention(q, k, v, out=out, **options))
            costs[f"adapter, {label}"] = _microseconds(
                lambda: ca_hf.attention_forward(layer, query, key, value, structure,
                                                scaling=0.125))
            costs[f"sdpa function, {label}"] = _microseconds(
                lambda: sdpa_attention_forward(layer, query, key, value, dense, scaling=0.125))
    return costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS),
                        choices=IMPLEMENTATIONS)
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, a 128-token prompt, 16 steps, 1 repeat")
    parser.add_argument("--json", help="also write the records to this file")
    parser.add_argument("--per-call-only", action="store_true",
                        help="only the cost of one layer call at decode size")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.prompt, args.gen, args.repeats = 2, 128, 16, 1

    names = register_timed_implementations()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"cattention {cattention.__version__}; Llama-3.2-1B-shaped layers x {args.layers}, "
          f"vocab {args.vocab}, pp{args.prompt} then tg{args.gen}, best of {args.repeats}")
    torch.set_num_threads(1)
    cattention.set_num_threads(1)
    print("one layer call at decode size (1 x 1024 keys, 8:2 heads, d 64, float32, 1 thread):")
    costs = per_call_costs()
    for label, microseconds in costs.items():
        print(f"  {label:40s} {microseconds:7.1f} us")
    for label in ("causal", "left-padded"):
        # the adapter's call is the one with out=
        added = costs[f"adapter, {label}"] - costs[f"cattention.attention out=, {label}"]
        print(f"  {label}: the adapter adds {added:.1f} us to the cattention.attention call "
              "it makes")
    if args.per_call_only:
        return 0
    header = (f"{'dtype':9s} {'thr':>3s} {'batch':>5s} {'impl':10s} {'pp t/s':>8s} "
              f"{'pp attn ms':>10s} {'tg t/s':>7s} {'tg attn ms/step':>15s} {'dense':>5s} "
              f"{'vs sdpa: pp':>11s} {'pp attn':>7s} {'tg':>5s} {'cpu: pp':>7s} {'pp attn':>7s} "
              f"{'tg':>5s}")
    print(header)
    records = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model = llama_1b_shaped(args.layers, args.vocab, dtype)
        for threads in args.threads:
            torch.set_num_threads(threads)
            cattention.set_num_threads(threads)
            for batch in args.batches:
                ids, mask = prompts(batch, args.prompt, args.vocab)
                by_name = measure(model, names, args.implementations, ids, mask, args.gen,
                                  args.repeats)
                base = by_name.get("sdpa")
                for name, result in by_name.items():
                    ratios = [""] * 6
                    if base is not None and name != "sdpa":
                        ratios[:3] = [
                            result["pp_tokens_per_s"] / base["pp_tokens_per_s"],
                            base["pp_attention_ms"] / result["pp_attention_ms"],
                            result["tg_tokens_per_s"] / base["tg_tokens_per_s"]]
                        if threads == 1:
                            ratios[3:] = [
                                result["pp_cpu_tokens_per_s"] / base["pp_cpu_tokens_per_s"],
                                base["pp_attention_cpu_ms"] / result["pp_attention_cpu_ms"],
                                result["tg_cpu_tokens_per_s"] / base["tg_cpu_tokens_per_s"]]
                    shown = [f"{ratio:.2f}x" if ratio else "" for ratio in ratios]
                    print(f"{dtype_name:9s} {threads:3d} {batch:5d} {name:10s} "
                          f"{result['pp_tokens_per_s']:8.1f} {result['pp_attention_ms']:10.1f} "
                          f"{result['tg_tokens_per_s']:7.2f} "
                          f"{result['tg_attention_ms_per_step']:15.3f} "
                          f"{result['dense_masks']:5d} {shown[0]:>11s} {shown[1]:>7s} "
                          f"{shown[2]:>5s} {shown[3]:>7s} {shown[4]:>7s} {shown[5]:>5s}",
                          flush=True)
                    records.append({"dtype": dtype_name, "threads": threads, "batch": batch,
                                    "impl": name, "layers": args.layers, "prompt": args.prompt,
                                    "gen": args.gen, **result})
                if base is not None and "cattention" in by_name and (
                        base["tokens"] != by_name["cattention"]["tokens"]):
                    print("  (greedy tokens differ from sdpa's: near-ties of random weights)",
                          flush=True)
        del model
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(records, stream, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
