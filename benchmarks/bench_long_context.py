"""Decode cost against context length: expanded vs absorbed MLA attention, plain `generate()` vs the static path.

Variants, each timed per decode step (median of --steps steps after --warm-up steps) at every context and batch size:

  - expanded_plain: transformers' dynamic cache with the expanded MLA attention (every cached latent goes through
                    kv_b_proj at every step, as in transformers' DeepSeek-V3), reached with the documented switch
                    `KimiVLMLAAttention.absorb_max_query_length = 0`;
  - absorbed_plain: the same with the absorbed attention (the default);
  - static_auto:    the static path's decode step with the capacity it picks for the request (context + new tokens,
                    rounded up to 256 slots);
  - static_fixed:   the static path's decode step with a fixed `max_cache_len` (--fixed-slots: what a server sets once).

How a step is timed. The caches are filled directly with random latents of the right shapes (`[B, 1, L, 512]` and
`[B, 1, L, 64]` per layer) instead of running a prefill: an expanded fp32 prefill of 16K tokens would need ~16 GB for
its attention scores on CPU, and a decode step's cost does not depend on the values it reads. A plain step is what
`generate()`'s loop runs per token (the language model on one token per row with transformers' `DynamicCache`, which
appends the new latent, then argmax); a static step is `GenerationWorkspace.decode` (the step the static loop runs per
token; eager on CPU, a CUDA graph on GPU), then argmax, with the workspace set up as its prefill leaves it. Both grow
the context by one token per step, as generation does.

Presets:
  CPU (default): bench_generate.py's small model with Kimi-VL-A3B's attention sizes (hidden 2048, 16 heads,
      kv_lora_rank 512, rope 64, nope 128, v 128), 2 text layers (one dense, one MoE with 8 experts, top 2), fp32;
      contexts 64, 1K, 4K, 16K; batch 1; static_fixed with 32768 slots. At each context the four variants' steps are
      timed in turn (one step of each per round), so load from other work on a shared machine hits them alike; the
      peak resident memory above the loaded model comes from a fresh process per variant and context (the resident
      high-water mark, reset once the model is built).
  --gpu: the full Kimi-VL-A3B config with random bf16 weights on one CUDA device; contexts 1K, 8K, 32K; batches 1
      and 8; static_fixed with 65536 slots; one process (peak memory from the CUDA allocator), results written after
      every measurement, and measurements that would start after --budget-s seconds are skipped (and named in the
      JSON), so benchmarks/gpu_check.sh can bound its time. Batch-1 decode is also given as a share of the
      memory-bandwidth limit: bytes one step must read (the weights a decode step reads, as in bench_generate.py,
      plus the cached latent of every layer, (512 + 64) x context x 2 bytes) over the bandwidth of a large copy.

Reported per variant: ms/step per context and batch, the slope (ms per 1K tokens of context, least squares), speed
relative to expanded_plain and (static variants) to absorbed_plain, and peak memory.

`--crossover` instead times one attention layer at the A3B sizes over 4K cached tokens for query lengths 1 to 512,
expanded vs absorbed: the measurement behind `ABSORBED_MAX_QUERY_LENGTH` in modeling_kimi_vl.py.

    python -m benchmarks.bench_long_context              # results/bench_long_context_cpu.json
    python -m benchmarks.bench_long_context --crossover  # results/bench_long_context_crossover_cpu.json
    python -m benchmarks.bench_long_context --gpu        # results/bench_long_context_cuda.json
    python -m benchmarks.bench_long_context --gpu --device cpu --size small --dtype float32 --contexts 256,1024 \
        --fixed-slots 4096                               # the --gpu logic on CPU, with bench_generate's small model
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import time

import torch

from benchmarks.bench_generate import SMALL_CONFIG, copy_bandwidth, decode_weight_bytes, random_model
from benchmarks.bench_generate import build_model as build_generate_model
from benchmarks.common import (
    REPO_ROOT,
    child_command,
    process_status_bytes,
    reset_resident_peak,
    seconds_of_one_call,
    write_result,
)

VARIANTS = ("expanded_plain", "absorbed_plain", "static_auto", "static_fixed")
QUERY_LENGTHS = (1, 16, 32, 64, 128, 256, 512)
PRESETS = {
    "cpu": dict(size="a3b_attention", device="cpu", dtype="float32", contexts="64,1024,4096,16384", batches="1",
                fixed_slots=32768),
    "gpu": dict(size="full", device="cuda", dtype="bfloat16", contexts="1024,8192,32768", batches="1,8",
                fixed_slots=65536),
}  # fmt: skip


def build_model(size: str, device: str, dtype: torch.dtype):
    """ "a3b_attention": bench_generate.py's small model with Kimi-VL-A3B's attention sizes, 2 text layers and 8
    experts top 2 (the model of the issue's measurements); "full" / "small": bench_generate.py's models. Random
    weights."""
    from modeling_kimi_vl import KimiVLConfig

    if size != "a3b_attention":
        return build_generate_model(size, device, dtype)
    text_config = dict(
        SMALL_CONFIG["text_config"], hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=2,
        n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=65536,
    )  # fmt: skip
    config = KimiVLConfig(**dict(SMALL_CONFIG, text_config=text_config), attn_implementation="sdpa")
    return random_model(config, device, dtype)


def random_latents(model, batch_size: int, context: int):
    """Per layer: a normalised latent `[B, 1, L, kv_lora_rank]` and a rope key `[B, 1, L, rope]`."""
    text = model.config.text_config
    torch.manual_seed(context)
    shape = (batch_size, 1, context)
    options = dict(device=model.device, dtype=model.dtype)
    return [
        (torch.randn(*shape, text.kv_lora_rank, **options), torch.randn(*shape, text.qk_rope_head_dim, **options))
        for _ in range(text.num_hidden_layers)
    ]


def plain_stepper(model, latents, context: int):
    """One plain decode step per call: the language model on one token per row over a DynamicCache."""
    from transformers import DynamicCache

    from modeling_kimi_vl.transformers_compat_modeling import CACHE_ARGUMENT

    cache = DynamicCache(config=model.config.text_config)
    for layer_index, (latent, rope_key) in enumerate(latents):
        cache.update(latent, rope_key, layer_index)
    batch_size = latents[0][0].shape[0]
    tokens = torch.full((batch_size, 1), 5, device=model.device)
    positions = torch.full((batch_size, 1), context, device=model.device)

    def step():
        nonlocal tokens
        logits = model(input_ids=tokens, position_ids=positions, **{CACHE_ARGUMENT: cache}, use_cache=True,
                       logits_to_keep=1).logits  # fmt: skip
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        positions.add_(1)

    return step


def static_stepper(model, latents, context: int, num_slots: int):
    """One static decode step per call (`GenerationWorkspace.decode`; a CUDA graph where possible, captured on the
    first call of each read bucket), the workspace set up as its prefill leaves it after a `context`-token prompt."""
    batch_size = latents[0][0].shape[0]
    state = model._static_generation_state()
    with state.lock:
        use_graphs = model._cuda_graphs_unavailable_reason() is None
        workspace = state.workspace(model, batch_size, num_slots, use_graphs)
    # The workspace has the rows of the batch bucket (e.g. 4 for a batch of 3); the rows beyond the batch stay zero.
    bucket_rows = workspace.batch_size
    for layer, (latent, rope_key) in zip(workspace.cache.layers, latents):
        layer.lazy_initialization(
            latent[:1].expand(bucket_rows, -1, -1, -1), rope_key[:1].expand(bucket_rows, -1, -1, -1)
        )
        layer.keys[:batch_size, :, :context] = latent
        layer.values[:batch_size, :, :context] = rope_key
    workspace.key_valid.fill_(True)
    workspace.filled_slots = context
    workspace.decode_slot.fill_(context - 1)
    workspace.decode_positions.fill_(context - 1)
    tokens = torch.full((batch_size,), 5, device=model.device)

    def step():
        nonlocal tokens
        tokens = workspace.decode(tokens).argmax(-1)

    return step


def capacity(variant: str, context: int, new_tokens: int, fixed_slots: int) -> int | None:
    from modeling_kimi_vl.generation_kimi_vl import CACHE_SLOT_GRANULE
    from modeling_kimi_vl.static_steps_kimi_vl import round_up

    if variant == "static_fixed":
        return fixed_slots
    if variant == "static_auto":
        return round_up(context + new_tokens, CACHE_SLOT_GRANULE)
    return None


def prepare_step(model, variant: str, context: int, batch_size: int, args):
    """A callable that runs one decode step of `variant` (with the attention form it needs), and the static capacity
    it uses (None for plain)."""
    from modeling_kimi_vl.modeling_kimi_vl import ABSORBED_MAX_QUERY_LENGTH, KimiVLMLAAttention

    latents = random_latents(model, batch_size, context)
    slots = capacity(variant, context, args.warm_up + args.steps, args.fixed_slots)
    step = plain_stepper(model, latents, context) if slots is None else static_stepper(model, latents, context, slots)
    absorb_limit = 0 if variant == "expanded_plain" else ABSORBED_MAX_QUERY_LENGTH

    @torch.no_grad()
    def run():
        KimiVLMLAAttention.absorb_max_query_length = absorb_limit
        try:
            step()
        finally:
            KimiVLMLAAttention.absorb_max_query_length = ABSORBED_MAX_QUERY_LENGTH

    return run, slots


def timed_steps(runs: dict, args) -> dict[str, list[float]]:
    """Seconds per step of each callable in `runs`, taken in turn (one step of each, then the next round), so that load
    changes on a shared machine hit every variant alike. The first --warm-up rounds are not kept."""
    timings = {name: [] for name in runs}
    for round_index in range(args.warm_up + args.steps):
        for name, run in runs.items():
            seconds = seconds_of_one_call(run)
            if round_index >= args.warm_up:
                timings[name].append(seconds)
    return timings


def timing_record(seconds: list[float]) -> dict:
    return {"ms_per_step": 1000 * statistics.median(seconds),
            "ms_per_step_all": [round(1000 * value, 3) for value in seconds]}  # fmt: skip


def time_variant(model, variant: str, context: int, batch_size: int, args) -> dict:
    """One variant alone at one context and batch size: ms per decode step (median) and peak memory above the model:
    the CUDA allocator's peak, or on CPU the peak resident set after resetting the process's high-water mark (Linux's
    /proc/self/clear_refs), so that the model's own construction does not count."""
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        reset_resident_peak()
        baseline = process_status_bytes("VmRSS")
    run, slots = prepare_step(model, variant, context, batch_size, args)
    try:
        record = timing_record(timed_steps({variant: run}, args)[variant])
        peak = torch.cuda.max_memory_allocated() if cuda else process_status_bytes("VmHWM")
    finally:
        del run
        model.clear_static_generation()
    return {**record, "peak_memory_above_model_bytes": max(0, peak - baseline), "read_slots_capacity": slots}


def peak_memory_in_child(args, variant: str, context: int, batch_size: int) -> int:
    """CPU: the peak resident memory above the model of a fresh process running `variant` for a few steps."""
    command = child_command(__file__, "--child", variant, "--contexts", str(context), "--batches", str(batch_size),
                            "--steps", "2", "--warm-up", "1", "--fixed-slots", str(args.fixed_slots), "--size",
                            args.size, "--device", args.device, "--dtype", args.dtype)  # fmt: skip
    output = subprocess.run(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, check=True,
                            timeout=args.child_timeout)  # fmt: skip
    return json.loads(output.stdout.strip().splitlines()[-1])["peak_memory_above_model_bytes"]


def slope_ms_per_1k(contexts, milliseconds) -> float | None:
    """Least-squares slope of step time against context, in ms per 1000 tokens."""
    if len(contexts) < 2:
        return None
    mean_x, mean_y = statistics.fmean(contexts), statistics.fmean(milliseconds)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(contexts, milliseconds))
    return 1000 * covariance / sum((x - mean_x) ** 2 for x in contexts)


def summarize(results: dict, args, model_facts: dict) -> dict:
    summary = {}
    for batch_size in args.batches:
        for variant, by_batch in results.items():
            measured = by_batch.get(str(batch_size), {})
            contexts = [context for context in args.contexts if str(context) in measured]
            entry = {"slope_ms_per_1k_tokens": slope_ms_per_1k(contexts, [measured[str(c)]["ms_per_step"]
                                                                          for c in contexts])}  # fmt: skip
            for baseline in ("expanded_plain", "absorbed_plain"):
                if baseline == variant or (baseline == "absorbed_plain" and not variant.startswith("static")):
                    continue
                reference = results.get(baseline, {}).get(str(batch_size), {})
                for context in contexts:
                    if str(context) in reference:
                        entry[f"speedup_vs_{baseline}_{context}"] = (
                            reference[str(context)]["ms_per_step"] / measured[str(context)]["ms_per_step"]
                        )
            if batch_size == 1 and "bandwidth_bytes_per_s" in model_facts:
                for context in contexts:
                    step_bytes = model_facts["decode_weight_bytes"] + model_facts["latent_bytes_per_token"] * context
                    limit_ms = 1000 * step_bytes / model_facts["bandwidth_bytes_per_s"]
                    entry[f"percent_of_bandwidth_limit_{context}"] = (
                        100 * limit_ms / measured[str(context)]["ms_per_step"]
                    )
            summary[f"{variant}_batch_{batch_size}"] = entry
        auto = results.get("static_auto", {}).get(str(batch_size), {})
        fixed = results.get("static_fixed", {}).get(str(batch_size), {})
        summary[f"static_fixed_over_static_auto_batch_{batch_size}"] = {
            str(c): fixed[str(c)]["ms_per_step"] / auto[str(c)]["ms_per_step"]
            for c in args.contexts if str(c) in auto and str(c) in fixed
        }  # fmt: skip
    return summary


def long_context(args) -> None:
    started = time.perf_counter()
    notes = {"load_average_before": list(os.getloadavg())}
    results = {variant: {} for variant in args.variants}
    model = build_model(args.size, args.device, getattr(torch, args.dtype))
    text = model.config.text_config
    model_facts = {
        "decode_weight_bytes": decode_weight_bytes(model),
        "latent_bytes_per_token": text.num_hidden_layers * (text.kv_lora_rank + text.qk_rope_head_dim)
        * model.dtype.itemsize,
        "experts_implementation": text._experts_implementation,
    }  # fmt: skip
    if args.gpu:
        model_facts["bandwidth_bytes_per_s"] = copy_bandwidth(args.device)
    name = f"bench_long_context_{args.device}" + ("" if args.size in ("full", "a3b_attention") else f"_{args.size}")
    settings = {key: getattr(args, key) for key in ("size", "device", "dtype", "contexts", "batches", "steps",
                                                    "warm_up", "fixed_slots", "budget_s")}  # fmt: skip
    settings["caches"] = "filled directly with random latents (no prefill); see the docstring"
    skipped = []

    def write():
        notes["load_average_after"] = list(os.getloadavg())
        notes["skipped_over_budget"] = skipped
        return write_result(name, {"settings": settings, "model": model_facts, "variants": results,
                                   "summary": summarize(results, args, model_facts), "notes": notes})  # fmt: skip

    for batch_size in args.batches:
        for context in args.contexts:
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                skipped.extend(f"{variant} context {context} batch {batch_size}" for variant in args.variants)
                continue
            if args.gpu:  # a dedicated device: one variant after the other, each with the allocator's own peak
                records = {name: time_variant(model, name, context, batch_size, args) for name in args.variants}
            else:  # a shared CPU: the variants' steps in turn; peak memory from a fresh process per variant
                runs = {name: prepare_step(model, name, context, batch_size, args)[0] for name in args.variants}
                timings = timed_steps(runs, args)
                del runs
                model.clear_static_generation()
                records = {
                    variant: {**timing_record(timings[variant]),
                              "peak_memory_above_model_bytes": peak_memory_in_child(args, variant, context, batch_size),
                              "read_slots_capacity": capacity(variant, context, args.warm_up + args.steps,
                                                              args.fixed_slots)}
                    for variant in args.variants
                }  # fmt: skip
            for variant, record in records.items():
                results[variant].setdefault(str(batch_size), {})[str(context)] = record
                print(f"batch {batch_size}  context {context:6d}  {variant:15s} {record['ms_per_step']:9.2f} ms/step",
                      flush=True)  # fmt: skip
            write()
    path = write()
    print(json.dumps(summarize(results, args, model_facts), indent=2))
    print(f"written to {path}")


def crossover(args) -> None:
    """One attention layer, 4K cached tokens, queries of 1..512 tokens: expanded vs absorbed ms per call."""
    from transformers import DynamicCache

    from modeling_kimi_vl.transformers_compat_modeling import CACHE_ARGUMENT

    model = build_model("a3b_attention", "cpu", torch.float32)
    attention = model.language_model.model.layers[1].self_attn
    rotary = model.language_model.model.rotary_emb
    text = model.config.text_config
    context = 4096
    ((latent, rope_key),) = random_latents(model, 1, context)[:1]
    rows, notes = {}, {"load_average_before": list(os.getloadavg())}
    for query_length in args.query_lengths:
        hidden = torch.randn(1, query_length, text.hidden_size)
        positions = torch.arange(context, context + query_length)[None]
        position_embeddings = rotary(hidden, positions)
        keys = torch.arange(context + query_length)
        mask = (keys[None, :] <= positions[0][:, None])[None, None]  # [1, 1, q, L + q], sdpa's boolean form
        timings = {"expanded": [], "absorbed": []}
        # The two forms alternate call by call, so that load changes on a shared machine hit both alike.
        for _ in range(args.warm_up + args.steps):
            for form, limit in (("expanded", 0), ("absorbed", query_length)):
                attention.absorb_max_query_length = limit
                cache = DynamicCache(config=text)
                cache.update(latent, rope_key, 1)
                with torch.no_grad():
                    call = functools.partial(attention, hidden, position_embeddings, mask, **{CACHE_ARGUMENT: cache})
                    timings[form].append(seconds_of_one_call(call))
        row = {f"{form}_ms": 1000 * statistics.median(values[args.warm_up :]) for form, values in timings.items()}
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
    parser.add_argument("--gpu", action="store_true", help="GPU preset (each setting still overridable)")
    parser.add_argument("--crossover", action="store_true", help="time one attention layer over query lengths")
    parser.add_argument("--size", choices=["a3b_attention", "small", "full"])
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--contexts", help="comma-separated numbers of cached tokens")
    parser.add_argument("--batches", help="comma-separated batch sizes")
    parser.add_argument("--fixed-slots", type=int, help="max_cache_len of the static_fixed variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    parser.add_argument("--query-lengths", default=",".join(map(str, QUERY_LENGTHS)), help="for --crossover")
    parser.add_argument("--steps", type=int, default=7, help="timed steps (the median is reported)")
    parser.add_argument("--warm-up", type=int, default=2, help="untimed steps first")
    parser.add_argument("--budget-s", type=float, help="skip measurements that would start after this many seconds")
    parser.add_argument("--child-timeout", type=float, default=900.0, help="CPU: seconds per measurement")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)  # one CPU measurement
    args = parser.parse_args()

    for name, value in PRESETS["gpu" if args.gpu else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.contexts = [int(context) for context in args.contexts.split(",")]
    args.batches = [int(batch) for batch in args.batches.split(",")]
    args.variants = [variant for variant in args.variants.split(",") if variant]
    args.query_lengths = [int(length) for length in args.query_lengths.split(",")]
    if any(variant not in VARIANTS for variant in args.variants):
        parser.error(f"--variants must be taken from {VARIANTS}, got {args.variants}")
    if args.steps < 1 or args.warm_up < 0 or min(args.batches) < 1 or min(args.contexts) < 1:
        parser.error("--steps, batch sizes and contexts must be at least 1, --warm-up at least 0")
    if max(args.contexts) + args.steps + args.warm_up > args.fixed_slots:
        parser.error(f"--fixed-slots {args.fixed_slots} cannot hold the largest context plus the steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda (the --gpu preset) needs a CUDA device; use --device cpu to try the logic on CPU")

    if args.child is not None:
        model = build_model(args.size, args.device, getattr(torch, args.dtype))
        print(json.dumps(time_variant(model, args.child, args.contexts[0], args.batches[0], args)), flush=True)
    elif args.crossover:
        crossover(args)
    else:
        long_context(args)


if __name__ == "__main__":
    main()
