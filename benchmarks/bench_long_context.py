"""Decode cost against context length: expanded vs absorbed MLA attention, plain `generate()` vs the static path.

A model with Kimi-VL-A3B's attention sizes (hidden 2048, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128),
2 text layers (one dense, one MoE with 8 experts, top 2), fp32 on CPU. Per context (64, 1K, 4K, 16K cached tokens):
decode ms/step, median of --steps steps after --warm-up steps, for

  - expanded_plain: transformers' dynamic cache with the expanded MLA attention (every cached latent goes through
                    kv_b_proj at every step: today's behaviour, reached with `absorb_max_query_length = 0`);
  - absorbed_plain: the same with the absorbed attention (the default);
  - static_auto:    the static path's decode step with the capacity it picks for the request (context + new tokens,
                    rounded up to 256 slots);
  - static_32k:     the static path's decode step with `max_cache_len=32768` (what a server sets once).

How a step is timed. The caches are filled directly with random latents of the right shapes (`[1, 1, L, 512]` and
`[1, 1, L, 64]` per layer) instead of running a prefill: an expanded fp32 prefill of 16K tokens would need ~16 GB for
its attention scores, and a decode step's cost does not depend on the values it reads. A plain step is what
`generate()`'s loop runs per token (the language model on one token with transformers' `DynamicCache`, which appends
the new latent, then argmax); a static step is `GenerationWorkspace.decode` (the step the static loop runs per token,
eager on CPU, then argmax), with the workspace set up as its prefill leaves it. Both grow the context by one token per
step, as generation does.

Reported per variant: ms/step per context, the slope (ms per 1K tokens of context, least-squares over the contexts),
the speed relative to expanded_plain, and the peak resident memory above the loaded model (each variant and context
runs in its own child process, so ru_maxrss is that run's own peak).

`--crossover` instead times one attention layer at these sizes over 4K cached tokens for query lengths 1 to 512,
expanded vs absorbed: the measurement behind `ABSORBED_MAX_QUERY_LENGTH` in modeling_kimi_vl.py.

    python benchmarks/bench_long_context.py              # writes results/bench_long_context_cpu.json
    python benchmarks/bench_long_context.py --crossover  # writes results/bench_long_context_crossover_cpu.json
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

VARIANTS = ("expanded_plain", "absorbed_plain", "static_auto", "static_32k")
CONTEXTS = (64, 1024, 4096, 16384)
QUERY_LENGTHS = (1, 16, 64, 128, 256, 512)
STATIC_32K_SLOTS = 32768


def build_model():
    """Kimi-VL-A3B's language-model attention sizes, 2 text layers, 8 experts top 2, small vocabulary, a 1-block
    vision tower (unused here), random fp32 weights."""
    from modeling_kimi_vl import KimiVLForConditionalGeneration, kimi_vl_a3b_config

    config = kimi_vl_a3b_config(attn_implementation="sdpa")
    config.vision_config.num_hidden_layers = 1
    text = config.text_config
    text.num_hidden_layers, text.n_routed_experts, text.num_experts_per_tok = 2, 8, 2
    text.vocab_size, text.intermediate_size = 8192, 5632
    torch.manual_seed(0)
    return KimiVLForConditionalGeneration(config).eval()


def random_latents(model, context: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: a normalised latent `[1, 1, L, kv_lora_rank]` and a rope key `[1, 1, L, rope]`."""
    text = model.config.text_config
    return [
        (
            torch.randn(1, 1, context, text.kv_lora_rank, generator=generator),
            torch.randn(1, 1, context, text.qk_rope_head_dim, generator=generator),
        )
        for _ in range(text.num_hidden_layers)
    ]


def plain_stepper(model, latents, context: int):
    """One plain decode step per call: the language model on one token over a DynamicCache, as generate() runs it."""
    from transformers import DynamicCache

    from modeling_kimi_vl.generation_kimi_vl import CACHE_ARGUMENT

    cache = DynamicCache(config=model.config.text_config)
    for layer_index, (latent, rope_key) in enumerate(latents):
        cache.update(latent, rope_key, layer_index)
    token = torch.tensor([[5]])
    position = [context]

    def step():
        nonlocal token
        logits = model(
            input_ids=token,
            position_ids=torch.tensor([position]),
            **{CACHE_ARGUMENT: cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        position[0] += 1

    return step


def static_stepper(model, latents, context: int, num_slots: int, new_tokens: int):
    """One static decode step per call (`GenerationWorkspace.decode`), the workspace set up as its prefill leaves it
    after a `context`-token prompt, with the random latents in the prompt's slots."""
    state = model._static_generation_state()
    with state.lock:
        workspace = state.workspace(model, 1, num_slots, use_graphs=False)
    for layer, (latent, rope_key) in zip(workspace.cache.layers, latents):
        layer.lazy_initialization(latent, rope_key)
        layer.keys[:, :, :context] = latent
        layer.values[:, :, :context] = rope_key
    workspace.key_valid.fill_(True)
    workspace.filled_slots = context
    workspace.decode_slot.fill_(context - 1)
    workspace.decode_positions.fill_(context - 1)
    token = torch.tensor([5])

    def step():
        nonlocal token
        token = workspace.decode(token).argmax(-1)

    return step


def measure(args) -> None:
    """Child process: one variant at one context; prints one JSON line."""
    from modeling_kimi_vl.generation_kimi_vl import CACHE_SLOT_GRANULE
    from modeling_kimi_vl.modeling_kimi_vl import KimiVLMLAAttention

    model = build_model()
    if args.variant == "expanded_plain":
        KimiVLMLAAttention.absorb_max_query_length = 0
    latents = random_latents(model, args.context, torch.Generator().manual_seed(args.context))
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    new_tokens = args.warm_up + args.steps
    if args.variant.endswith("_plain"):
        step = plain_stepper(model, latents, args.context)
    else:
        auto_slots = -(-(args.context + new_tokens) // CACHE_SLOT_GRANULE) * CACHE_SLOT_GRANULE
        num_slots = STATIC_32K_SLOTS if args.variant == "static_32k" else auto_slots
        step = static_stepper(model, latents, args.context, num_slots, new_tokens)
    del latents
    timings = []
    with torch.no_grad():
        for index in range(new_tokens):
            start = time.perf_counter()
            step()
            if index >= args.warm_up:
                timings.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({
        "ms_per_step": 1000 * statistics.median(timings),
        "ms_per_step_all": [round(1000 * t, 3) for t in timings],
        "peak_memory_above_model_bytes": 1024 * max(0, peak_rss - baseline_rss),
    }), flush=True)  # fmt: skip


def run_child(args, variant: str, context: int) -> dict:
    command = [sys.executable, __file__, "--variant", variant, "--context", str(context),
               "--steps", str(args.steps), "--warm-up", str(args.warm_up)]  # fmt: skip
    output = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, timeout=args.child_timeout)
    return json.loads(output.stdout.strip().splitlines()[-1])


def slope_ms_per_1k(contexts, milliseconds) -> float:
    """Least-squares slope of step time against context, in ms per 1000 tokens."""
    mean_x, mean_y = statistics.fmean(contexts), statistics.fmean(milliseconds)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(contexts, milliseconds))
    return 1000 * covariance / sum((x - mean_x) ** 2 for x in contexts)


def long_context(args) -> None:
    notes = {"load_average_before": list(os.getloadavg())}
    results = {variant: {"ms_per_step": {}, "ms_per_step_all": {}, "peak_memory_above_model_bytes": {}}
               for variant in args.variants}  # fmt: skip
    # Context by context, all variants back to back: load changes on a shared machine hit a ratio's both sides alike.
    for context in args.contexts:
        for variant in args.variants:
            record = run_child(args, variant, context)
            for key, value in record.items():
                results[variant][key][str(context)] = value
            print(f"context {context:6d}  {variant:15s} {record['ms_per_step']:9.2f} ms/step", flush=True)
    notes["load_average_after"] = list(os.getloadavg())
    summary = {}
    for variant, result in results.items():
        steps = [result["ms_per_step"][str(context)] for context in args.contexts]
        entry = {"slope_ms_per_1k_tokens": slope_ms_per_1k(args.contexts, steps)}
        if "expanded_plain" in results:
            for context in args.contexts:
                key = str(context)
                entry[f"speedup_vs_expanded_plain_{key}"] = (
                    results["expanded_plain"]["ms_per_step"][key] / result["ms_per_step"][key]
                )
        if "absorbed_plain" in results and variant.startswith("static"):
            for context in args.contexts:
                key = str(context)
                entry[f"speedup_vs_absorbed_plain_{key}"] = (
                    results["absorbed_plain"]["ms_per_step"][key] / result["ms_per_step"][key]
                )
        summary[variant] = entry
    if {"static_auto", "static_32k"} <= results.keys():
        summary["static_32k_over_static_auto"] = {
            str(context): results["static_32k"]["ms_per_step"][str(context)]
            / results["static_auto"]["ms_per_step"][str(context)]
            for context in args.contexts
        }
    settings = {"contexts": args.contexts, "steps": args.steps, "warm_up": args.warm_up, "dtype": "float32",
                "model": "A3B attention sizes, 2 text layers, 8 experts top 2, vocab 8192",
                "caches": "filled directly with random latents (no prefill)"}  # fmt: skip
    path = write_result("bench_long_context_cpu", {"settings": settings, "variants": results, "summary": summary,
                                                   "notes": notes})  # fmt: skip
    print(json.dumps(summary, indent=2))
    print(f"written to {path}")


def crossover(args) -> None:
    """One attention layer, 4K cached tokens, queries of 1..512 tokens: expanded vs absorbed ms per call."""
    from transformers import DynamicCache

    from modeling_kimi_vl.generation_kimi_vl import CACHE_ARGUMENT

    model = build_model()
    attention = model.language_model.model.layers[1].self_attn
    rotary = model.language_model.model.rotary_emb
    text = model.config.text_config
    context = 4096
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 1, context, text.kv_lora_rank, generator=generator)
    rope_key = torch.randn(1, 1, context, text.qk_rope_head_dim, generator=generator)
    rows = {}
    notes = {"load_average_before": list(os.getloadavg())}
    for query_length in args.query_lengths:
        hidden = torch.randn(1, query_length, text.hidden_size, generator=generator)
        positions = torch.arange(context, context + query_length)[None]
        position_embeddings = rotary(hidden, positions)
        keys = torch.arange(context + query_length)
        mask = (keys[None, :] <= positions[0][:, None])[None, None]  # [1, 1, q, L + q], sdpa's boolean form
        row = {}
        for form, limit in (("expanded", 0), ("absorbed", query_length)):
            attention.absorb_max_query_length = limit
            timings = []
            for _ in range(args.warm_up + args.steps):
                cache = DynamicCache(config=text)
                cache.update(latent, rope_key, 1)
                start = time.perf_counter()
                with torch.no_grad():
                    attention(hidden, position_embeddings, mask, **{CACHE_ARGUMENT: cache})
                timings.append(time.perf_counter() - start)
            row[f"{form}_ms"] = 1000 * statistics.median(timings[args.warm_up :])
        row["absorbed_speedup"] = row["expanded_ms"] / row["absorbed_ms"]
        rows[str(query_length)] = row
        print(f"query {query_length:4d}: expanded {row['expanded_ms']:8.2f} ms  absorbed {row['absorbed_ms']:8.2f} ms"
              f"  absorbed speed-up {row['absorbed_speedup']:.2f}x", flush=True)  # fmt: skip
    notes["load_average_after"] = list(os.getloadavg())
    path = write_result("bench_long_context_crossover_cpu", {
        "settings": {"context": context, "layer": "one MLA attention layer, A3B sizes, fp32, sdpa masks",
                     "steps": args.steps, "warm_up": args.warm_up},
        "query_lengths": rows, "notes": notes})  # fmt: skip
    print(f"written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crossover", action="store_true", help="time one attention layer over query lengths")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated cached tokens")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    parser.add_argument("--query-lengths", default=",".join(map(str, QUERY_LENGTHS)), help="for --crossover")
    parser.add_argument("--steps", type=int, default=7, help="timed steps (the median is reported)")
    parser.add_argument("--warm-up", type=int, default=2, help="untimed steps first")
    parser.add_argument("--child-timeout", type=float, default=900.0, help="seconds per variant and context")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--context", type=int, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    args.contexts = [int(context) for context in args.contexts.split(",")]
    args.variants = [variant for variant in args.variants.split(",") if variant]
    args.query_lengths = [int(length) for length in args.query_lengths.split(",")]
    if any(variant not in VARIANTS for variant in args.variants):
        parser.error(f"--variants must be taken from {VARIANTS}, got {args.variants}")
    if args.steps < 1 or args.warm_up < 0 or min(args.contexts) < 1 or max(args.contexts) + 64 > STATIC_32K_SLOTS:
        parser.error(f"--steps must be >= 1, --warm-up >= 0, contexts between 1 and {STATIC_32K_SLOTS - 64}")
    if args.variant is not None:
        measure(args)
    elif args.crossover:
        crossover(args)
    else:
        long_context(args)


if __name__ == "__main__":
    main()
