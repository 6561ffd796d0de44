"""Generation speed: plain `generate()` against the static-cache path (CUDA graphs on GPU), measured in one run.

Variants, each measured in its own child process (clean peak-memory counters; a compile that overruns can be stopped):
  - plain:      `model.generate(...)`, transformers' dynamic cache, eager;
  - hf_static:  `GenerationMixin.generate(model, ..., cache_implementation="static")`, i.e. transformers' own static
                cache, which on CUDA compiles the decode step (torch.compile "reduce-overhead"); skipped with a note
                when it does not finish within --compile-budget seconds;
  - ours:       `model.generate(..., cache_implementation="static")`, this project's path.

Per variant: decode tokens/s at each batch size (text prompt of --prompt-tokens, --new-tokens greedy tokens; the
rate is taken between the first and the last streamed token of one call, so prefill does not mix in), time to first
token for one image plus text (from the call to the first streamed token), and peak device memory. Ratios are taken
against `plain` of the same run; batch-1 decode is also given as a percentage of the memory-bandwidth limit: bytes
of weights one decode step reads (attention, dense and shared MLPs, top-k of the routed experts, norms, lm_head; bf16
on GPU) divided into the device bandwidth measured with a large copy.

    python -m benchmarks.bench_generate                 # CPU: small config, plain vs ours
    python -m benchmarks.bench_generate --gpu           # one GPU: full Kimi-VL-A3B config, random bf16 weights
    python -m benchmarks.bench_generate --gpu --size small --device cpu --variants plain,hf_static,ours
                                                        # the --gpu logic, tried on CPU with the small config
"""

import argparse
import json
import os
import statistics
import subprocess
import threading
import time

import torch
from transformers.generation.streamers import BaseStreamer

from benchmarks.common import REPO_ROOT, child_command, mean_seconds, write_result

VARIANTS = ("plain", "hf_static", "ours")

# Same architecture, small enough for a 2-core CPU.
SMALL_CONFIG = dict(
    vision_config=dict(
        patch_size=14, init_pos_emb_height=16, init_pos_emb_width=16, num_attention_heads=4,
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, merge_kernel_size=[2, 2],
    ),
    text_config=dict(
        model_type="deepseek_v3", vocab_size=8192, hidden_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=1024,
        first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=16, moe_intermediate_size=256,
        num_experts_per_tok=4, n_shared_experts=2, topk_method="noaux_tc", scoring_func="sigmoid", n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446, rope_theta=800000.0, rope_scaling=None,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    media_placeholder_token_id=8000,
)  # fmt: skip
# Time-to-first-token image: 1024x1024 -> 66x66 patches -> 1089 tokens (spec section 6); the small config's position
# table is 16x16, so it gets a 16x16 grid (64 tokens).
TTFT_GRID = {"full": (66, 66), "small": (16, 16)}


def benchmark_config(size: str):
    """The full Kimi-VL-A3B config ("full") or SMALL_CONFIG ("small"), with sdpa attention."""
    from modeling_kimi_vl import KimiVLConfig, kimi_vl_a3b_config

    if size == "full":
        return kimi_vl_a3b_config(attn_implementation="sdpa")
    return KimiVLConfig(**SMALL_CONFIG, attn_implementation="sdpa")


def build_model(size: str, device: str, dtype: torch.dtype):
    """The `size` config with random weights, on `device` in `dtype`."""
    return random_model(benchmark_config(size), device, dtype)


def random_model(config, device: str, dtype: torch.dtype):
    """Random weights, created directly on the device: meta-device construction, then allocation and init there."""
    from modeling_kimi_vl import KimiVLForConditionalGeneration

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = KimiVLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.initialize_weights()  # normal_ weights, unit norms, and the rotary tables (buffers) recomputed
    return model.eval()


def decode_weight_bytes(model) -> int:
    """Bytes of weights one batch-1 decode step reads: the language model minus the embedding table (one row is
    read), with the routed experts counted at top_k / n_routed_experts."""
    text_config = model.config.text_config
    total = 0.0
    for name, parameter in model.language_model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            continue
        size = parameter.numel() * parameter.element_size()
        if ".mlp.experts." in name:
            size *= text_config.num_experts_per_tok / text_config.n_routed_experts
        total += size
    return int(total)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    elements = (1 << 30) if device == "cuda" else (1 << 26)
    source = torch.empty(elements, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    return 2 * source.nbytes / mean_seconds(lambda: target.copy_(source), repeats=10)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class TokenClock(BaseStreamer):
    """Streamer that notes when each put() arrives: the prompt (the call has started), then every new token batch.
    Decode speed and time to first token come from one call, so prefill and noise between calls do not mix in."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def timed_generation(run, request, new_tokens: int, device: str) -> tuple[float, float]:
    """(time to first token, decode seconds per step after it) of one greedy generation of `new_tokens`."""
    clock = TokenClock()
    synchronize(device)
    start = time.perf_counter()
    run(request, new_tokens, clock)
    first_token, last_token = clock.times[1], clock.times[-1]
    return first_token - start, (last_token - first_token) / (new_tokens - 1)


def generate_function(model, variant: str):
    """The call under test: `generate(**request)` with exactly n new tokens, greedy, timed by a streamer."""
    from transformers import GenerationMixin

    def run(request, new_tokens, streamer):
        settings = dict(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=streamer
        )
        if variant == "plain":
            return model.generate(**request, **settings)
        if variant == "hf_static":  # transformers' own generate, bypassing this model's routing of "static"
            return GenerationMixin.generate(model, **request, **settings, cache_implementation="static")
        return model.generate(**request, **settings, cache_implementation="static")

    return run


def measure_variant(args) -> None:
    """Child process: measure one variant and print one JSON line per measurement."""
    device, dtype = args.device, getattr(torch, args.dtype)

    def emit(record):
        print(json.dumps(record), flush=True)

    model = build_model(args.size, device, dtype)
    text_config = model.config.text_config
    emit({"kind": "model", "experts_implementation": text_config._experts_implementation,
          "decode_weight_bytes": decode_weight_bytes(model),
          "copy_bandwidth_bytes_per_s": copy_bandwidth(device)})  # fmt: skip
    run = generate_function(model, args.variant)
    generator = torch.Generator().manual_seed(1)
    # Ordinary text ids, below the placeholder id in both configs.
    text_ids = torch.randint(1, 7000, (args.prompt_tokens,), generator=generator)

    for batch_size in args.batches:
        request = {"input_ids": text_ids.repeat(batch_size, 1).to(device)}
        reset_peak_memory(device)
        start = time.perf_counter()
        timed_generation(run, request, args.new_tokens, device)  # warm-up: graph capture / compilation happen here
        warm_up_seconds = time.perf_counter() - start
        step_seconds = statistics.median(
            timed_generation(run, request, args.new_tokens, device)[1] for _ in range(args.repeats)
        )
        emit({"kind": "decode", "batch_size": batch_size, "warm_up_s": warm_up_seconds,
              "decode_tokens_per_s": batch_size / step_seconds, "peak_memory_bytes": peak_memory(device)})  # fmt: skip

    rows, cols = TTFT_GRID[args.size]
    half = args.prompt_tokens // 2
    image_tokens = [model.config.media_placeholder_token_id] * (rows * cols // 4)
    input_ids = torch.cat([text_ids[:half], torch.tensor(image_tokens), text_ids[half:]])
    request = {
        "input_ids": input_ids[None].to(device),
        "pixel_values": torch.randn(rows * cols, 3, 14, 14, generator=generator).to(device, dtype),
        "image_grid_hws": torch.tensor([[rows, cols]], device=device),
    }
    reset_peak_memory(device)
    timed_generation(run, request, 2, device)
    ttft = statistics.median(timed_generation(run, request, 2, device)[0] for _ in range(args.repeats))
    emit({"kind": "ttft", "grid": [rows, cols], "prompt_tokens": int(input_ids.numel()),
          "time_to_first_token_s": ttft, "peak_memory_bytes": peak_memory(device)})  # fmt: skip


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def run_child(args, variant: str, timeout: float) -> tuple[list[dict], str | None]:
    """Run one variant in a child process; returns its records and, if it did not finish, why."""
    command = child_command(__file__, "--variant", variant, "--size", args.size, "--device", args.device,
                            "--dtype", args.dtype, "--batches", ",".join(map(str, args.batches)),
                            "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens),
                            "--repeats", str(args.repeats))  # fmt: skip
    child = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    records = []
    # Only the records: anything else a library prints to stdout is skipped (a parse error would end the reader and
    # leave the child blocked on a full pipe).
    reader = threading.Thread(
        target=lambda: records.extend(json.loads(line) for line in child.stdout if line.startswith("{"))
    )
    reader.start()
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        reader.join()
        return records, f"stopped after {timeout:.0f} s"
    reader.join()
    if child.returncode != 0:
        return records, f"child exited with status {child.returncode} (its stderr is above)"
    return records, None


def summarize(variants: dict[str, dict]) -> dict:
    """Ratios against `plain`, and batch-1 decode of each variant against the bandwidth limit (the best copy
    bandwidth any child measured, over the bytes one decode step reads)."""
    measured = [result for result in variants.values() if "decode_weight_bytes" in result]
    bandwidth = max((result["copy_bandwidth_bytes_per_s"] for result in measured), default=None)
    limit = bandwidth / measured[0]["decode_weight_bytes"] if measured else None
    summary = {"bandwidth_limit_tokens_per_s": limit}
    baseline = variants.get("plain", {})
    for name, result in variants.items():
        entry = {}
        for batch_size, rate in result["decode_tokens_per_s"].items():
            baseline_rate = baseline.get("decode_tokens_per_s", {}).get(batch_size)
            if baseline_rate:
                entry[f"decode_speedup_vs_plain_batch_{batch_size}"] = rate / baseline_rate
        if result.get("time_to_first_token_s") and baseline.get("time_to_first_token_s"):
            entry["ttft_speedup_vs_plain"] = baseline["time_to_first_token_s"] / result["time_to_first_token_s"]
        if "1" in result["decode_tokens_per_s"] and limit:
            entry["batch_1_decode_percent_of_bandwidth_limit"] = 100 * result["decode_tokens_per_s"]["1"] / limit
        summary[name] = entry
    return summary


def collect(records: list[dict]) -> dict:
    result = {"decode_tokens_per_s": {}, "decode_warm_up_s": {}, "peak_memory_bytes": {}}
    for record in records:
        if record["kind"] == "model":
            result["experts_implementation"] = record["experts_implementation"]
            result["decode_weight_bytes"] = record["decode_weight_bytes"]
            result["copy_bandwidth_bytes_per_s"] = record["copy_bandwidth_bytes_per_s"]
        elif record["kind"] == "decode":
            key = str(record["batch_size"])
            result["decode_tokens_per_s"][key] = record["decode_tokens_per_s"]
            result["decode_warm_up_s"][key] = record["warm_up_s"]
            result["peak_memory_bytes"][f"decode_batch_{key}"] = record["peak_memory_bytes"]
        elif record["kind"] == "ttft":
            result["time_to_first_token_s"] = record["time_to_first_token_s"]
            result["ttft_prompt"] = {"grid": record["grid"], "tokens": record["prompt_tokens"]}
            result["peak_memory_bytes"]["ttft"] = record["peak_memory_bytes"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="GPU preset: full config, cuda, bf16, batches 1,8,32, "
                        "all three variants (each still overridable)")  # fmt: skip
    parser.add_argument("--size", choices=["small", "full"])
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", help="comma-separated batch sizes")
    parser.add_argument("--variants", help=f"comma-separated, from {','.join(VARIANTS)}")
    parser.add_argument("--new-tokens", type=int, default=33, help="tokens per timed generation (>= 2)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-budget", type=float, default=180.0,
                        help="seconds hf_static may take in all (compile included) before it is stopped")  # fmt: skip
    parser.add_argument("--child-timeout", type=float, default=1800.0,
                        help="seconds the plain and ours variants may take each before they are stopped")  # fmt: skip
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()

    preset = dict(size="full", device="cuda", dtype="bfloat16", batches="1,8,32", variants="plain,hf_static,ours")
    if not args.gpu:
        preset = dict(size="small", device="cpu", dtype="float32", batches="1,4", variants="plain,ours")
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batches = [int(batch) for batch in str(args.batches).split(",")]
    variants = [variant for variant in args.variants.split(",") if variant]
    if any(variant not in VARIANTS for variant in variants):
        parser.error(f"--variants must be taken from {VARIANTS}, got {variants}")
    if args.new_tokens < 2 or args.repeats < 1 or args.prompt_tokens < 2 or min(args.batches) < 1:
        parser.error("--new-tokens and --prompt-tokens must be at least 2, --repeats and batch sizes at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda (the --gpu preset) needs a CUDA device; use --device cpu to try the logic on CPU")

    if args.variant is not None:
        measure_variant(args)
        return

    results, notes = {}, {"load_average_before": list(os.getloadavg())}
    for variant in variants:
        timeout = args.compile_budget if variant == "hf_static" else args.child_timeout
        records, problem = run_child(args, variant, timeout)
        results[variant] = collect(records)
        if problem is not None:
            measured = sorted(results[variant]["decode_tokens_per_s"])
            notes[variant] = f"{problem}; measured so far: decode batches {measured}" + (
                ", TTFT" if "time_to_first_token_s" in results[variant] else ""
            )
    if "hf_static" in results and args.device == "cpu":
        notes.setdefault("hf_static", "transformers compiles the decode step only on accelerators: eager on CPU")

    notes["load_average_after"] = list(os.getloadavg())
    name = f"bench_generate_{args.device}_{args.size}" + ("_gpu_preset" if args.gpu and args.device == "cpu" else "")
    settings = {key: getattr(args, key) for key in ("size", "device", "dtype", "batches", "new_tokens",
                                                    "prompt_tokens", "repeats", "compile_budget",
                                                    "child_timeout")}  # fmt: skip
    summary = summarize(results)
    path = write_result(name, {"settings": settings, "variants": results, "summary": summary, "notes": notes})
    print(json.dumps({"summary": summary, "notes": notes}, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
