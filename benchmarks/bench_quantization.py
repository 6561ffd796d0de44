"""Weight-only int8 / int4 (modeling_kimi_vl/quantization_kimi_vl.py): weight bytes, loading memory, decode speed.

CPU sections (default: all three), results in benchmarks/results/bench_quantization_cpu.json:
  - weights: Kimi-VL-A3B built on the meta device (kimi_vl_a3b_config), its modules swapped for the quantized ones
             exactly as from_pretrained does; bytes per scheme (bf16, int8, int4 group 128), split into routed
             experts / rest of the language model / vision tower + projector, and whether weights + a 32K-token MLA
             latent cache + a stated allowance fit a 24 GiB card. Arithmetic on shapes, no weights allocated.
  - load:    peak memory of from_pretrained on a random-weights bf16 checkpoint of the same architecture (~1.6 GB),
             quantized to int8 on load, and of reloading the int8 checkpoint it saves. Each load runs in a fresh
             process; a thread samples its anonymous resident memory (RssAnon: what the process itself allocated,
             not the page cache of the memory-mapped checkpoint) every 2 ms. Reported: the peak above the level
             just before from_pretrained, as a ratio to the loaded model's bytes. VmHWM (which also counts the
             mapped checkpoint pages read so far) is recorded beside it.
  - decode:  plain generate() batch-1 decode step time, int8 against float32 (the model dtype on CPU), in one run,
             bench_generate.py's small config saved with random weights; timed by a streamer between the first and
             the last new token, repeats alternating between the two models.

GPU (--gpu, one CUDA device; results in bench_quantization_cuda_full.json): the full A3B config with random weights,
bf16 and int8 in turn in one process, static-path decode tokens/s at batch 1 and 8 and peak device memory; and, per
model, its last layer's routed experts called alone at decode sizes (batch 1 and 8, random routing), for int8 also with
the fused kernel switched off (the torch gather path), as time per call and as the chosen experts' stored bytes per
second (decode is memory-bound: the int8 target is about half of bf16's time).
`--gpu --size small --device cpu` runs the same logic on CPU with the small config (a check, not a measurement).

    python -m benchmarks.bench_quantization [--sections weights,load,decode] [--workdir FOLDER]
    python -m benchmarks.bench_quantization --gpu
"""

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

from benchmarks.bench_generate import (
    SMALL_CONFIG,
    benchmark_config,
    build_model,
    generate_function,
    random_model,
    timed_generation,
)
from benchmarks.common import (
    REPO_ROOT,
    child_command,
    mean_seconds,
    process_status_bytes,
    scratch_folder,
    write_result,
)

GIB = 2**30
CARD_BYTES = 24 * GIB  # a "24 GB" card (RTX 3090 / 4090: 24 GiB)
CACHE_TOKENS = 32 * 1024
# Held back from the card for the CUDA context, allocator slack and activations of a decode step (an assumption,
# stated in the result; the transient K/V expansion of one layer at 32K tokens is counted separately below).
RUNTIME_ALLOWANCE_BYTES = 1 * GIB
EXPERTS_CALL_REPEATS = 50  # calls of one layer's experts, each well under a millisecond on a GPU
INT4_GROUP_SIZE = 128  # divides every A3B input size (2048, 1408, 11264)
# The load benchmark's architecture: A3B-like MoE layers, narrower, 4 of them (~1.6 GB in bf16).
LOAD_TEXT_CONFIG = dict(hidden_size=1024, moe_intermediate_size=1024, n_routed_experts=64, num_hidden_layers=5,
                        first_k_dense_replace=1, intermediate_size=2048, num_experts_per_tok=6)  # fmt: skip


def parameter_bytes(model) -> dict[str, int]:
    parts = {"routed_experts": 0, "language_model_other": 0, "vision_and_projector": 0}
    for name, parameter in model.named_parameters():
        size = parameter.numel() * parameter.element_size()
        if ".mlp.experts." in name:
            parts["routed_experts"] += size
        elif name.startswith("language_model."):
            parts["language_model_other"] += size
        else:
            parts["vision_and_projector"] += size
    return {**parts, "total": sum(parts.values())}


def quantized_skeleton(config, scheme: str | None, dtype=torch.bfloat16):
    """The model on the meta device, with the quantizer's module swap applied (None: unquantized)."""
    from modeling_kimi_vl import KimiVLForConditionalGeneration, KimiVLWeightOnlyConfig
    from modeling_kimi_vl.quantization_kimi_vl import replace_with_weight_only_modules

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained(dtype=...) does while it builds the model
    try:
        with torch.device("meta"):
            model = KimiVLForConditionalGeneration(config)
        if scheme is not None:
            quantization = KimiVLWeightOnlyConfig(scheme, group_size=INT4_GROUP_SIZE)
            replace_with_weight_only_modules(model, quantization.make_scheme(), quantization.modules_to_not_convert)
    finally:
        torch.set_default_dtype(default_dtype)
    return model


def weights_section() -> dict:
    from modeling_kimi_vl import kimi_vl_a3b_config

    config = kimi_vl_a3b_config()
    text = config.text_config
    latent_per_token = text.num_hidden_layers * (text.kv_lora_rank + text.qk_rope_head_dim) * 2  # bf16
    cache_bytes = CACHE_TOKENS * latent_per_token
    # Decode reads the latent as it is (absorbed MLA), but a prefill longer than the absorbed form's limit expands the
    # whole prompt's latent through kv_b_proj, one layer at a time: a 32K-token prompt's keys and values.
    expansion_bytes = CACHE_TOKENS * text.num_attention_heads * (text.qk_nope_head_dim + text.qk_rope_head_dim
                                                                 + text.v_head_dim) * 2  # fmt: skip
    # A quantized prefill dequantizes one layer's experts, one projection at a time (gate_up is the larger), in bf16.
    dequantized_experts_bytes = text.n_routed_experts * 2 * text.moe_intermediate_size * text.hidden_size * 2
    schemes = {}
    for label, scheme in (("bf16", None), ("int8", "int8"), (f"int4_group{INT4_GROUP_SIZE}", "int4")):
        weights = parameter_bytes(quantized_skeleton(config, scheme))
        transient = expansion_bytes + (dequantized_experts_bytes if scheme else 0)
        needed = weights["total"] + cache_bytes + transient + RUNTIME_ALLOWANCE_BYTES
        schemes[label] = {**weights, "total_gib": round(weights["total"] / GIB, 2),
                          "prefill_transient_bytes": transient,
                          "with_32k_cache_and_allowance_gib": round(needed / GIB, 2),
                          "fits_24_gib": needed <= CARD_BYTES}  # fmt: skip
    return {
        "model": "Kimi-VL-A3B (kimi_vl_a3b_config), meta device",
        "latent_cache_32k_tokens_bytes": cache_bytes,
        "kv_expansion_one_layer_32k_tokens_bytes": expansion_bytes,
        "dequantized_experts_one_projection_bytes": dequantized_experts_bytes,
        "runtime_allowance_bytes": RUNTIME_ALLOWANCE_BYTES,
        "card_bytes": CARD_BYTES,
        "schemes": schemes,
    }


# ----------------------------------------------------------------------------------------------------------------------
# Loading memory (children)
# ----------------------------------------------------------------------------------------------------------------------


def child_make_source(path: Path) -> None:
    from modeling_kimi_vl import KimiVLConfig

    config = KimiVLConfig(**{**SMALL_CONFIG, "text_config": {**SMALL_CONFIG["text_config"], **LOAD_TEXT_CONFIG}})
    random_model(config, "cpu", torch.bfloat16).save_pretrained(path)


def child_load(path: Path, scheme: str | None, save_to: Path | None) -> None:
    """Load `path` (quantizing on load when `scheme` is given), print the memory record as one JSON line."""
    from modeling_kimi_vl import KimiVLForConditionalGeneration, KimiVLWeightOnlyConfig

    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(process_status_bytes("RssAnon"))
            time.sleep(0.002)

    kwargs = {} if scheme is None else {"quantization_config": KimiVLWeightOnlyConfig(scheme)}
    before = process_status_bytes("RssAnon")
    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    model = KimiVLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    high_water = process_status_bytes("VmHWM")
    record = {"seconds": round(seconds, 2), "anonymous_before_bytes": before,
              "anonymous_peak_bytes": max(samples + [process_status_bytes("RssAnon")]), "vm_hwm_bytes": high_water,
              "model_bytes": parameter_bytes(model)["total"], "samples": len(samples)}  # fmt: skip
    print(json.dumps(record), flush=True)
    if save_to is not None:
        model.save_pretrained(save_to)


def run_child(*arguments: str) -> dict | None:
    result = subprocess.run(child_command(__file__, "--child", *arguments), cwd=REPO_ROOT, capture_output=True,
                            text=True)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"child {arguments} failed:\n{result.stdout}\n{result.stderr}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def load_section(workdir: Path) -> dict:
    source, quantized = workdir / "bf16", workdir / "int8"
    run_child("make-source", str(source))
    source_bytes = sum(path.stat().st_size for path in source.glob("*.safetensors"))
    runs = {
        "bf16_checkpoint_quantized_to_int8_on_load": run_child("load", str(source), "int8", str(quantized)),
        "int8_checkpoint_reloaded": run_child("load", str(quantized)),
        "bf16_checkpoint_loaded_as_is (reference)": run_child("load", str(source)),
    }
    for record in runs.values():
        over = record["anonymous_peak_bytes"] - record["anonymous_before_bytes"]
        record["anonymous_peak_over_before_per_model_bytes"] = round(over / record["model_bytes"], 3)
    return {"source_checkpoint_bytes": source_bytes, "text_config_overrides": LOAD_TEXT_CONFIG, "runs": runs}


# ----------------------------------------------------------------------------------------------------------------------
# CPU decode
# ----------------------------------------------------------------------------------------------------------------------


def decode_section(workdir: Path, repeats: int, new_tokens: int, prompt_tokens: int) -> dict:
    from modeling_kimi_vl import KimiVLForConditionalGeneration, KimiVLWeightOnlyConfig

    source = workdir / "small_fp32"
    build_model("small", "cpu", torch.float32).save_pretrained(source)
    models = {
        "float32": KimiVLForConditionalGeneration.from_pretrained(source, attn_implementation="sdpa").eval(),
        "int8": KimiVLForConditionalGeneration.from_pretrained(
            source, attn_implementation="sdpa", quantization_config=KimiVLWeightOnlyConfig("int8")
        ).eval(),
    }
    generator = torch.Generator().manual_seed(1)
    request = {"input_ids": torch.randint(1, 7000, (1, prompt_tokens), generator=generator)}
    runs = {name: generate_function(model, "plain") for name, model in models.items()}
    for run in runs.values():  # warm-up
        timed_generation(run, request, new_tokens, "cpu")
    steps = {name: [] for name in runs}
    for _ in range(repeats):  # alternating, so that load changes on the shared machine hit both alike
        for name, run in runs.items():
            steps[name].append(timed_generation(run, request, new_tokens, "cpu")[1])
    step_seconds = {name: statistics.median(values) for name, values in steps.items()}
    return {
        "config": "bench_generate.py SMALL_CONFIG (hidden 512, 4 layers, 16 experts top-4), random weights",
        "batch_size": 1, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats,
        "weight_bytes": {name: parameter_bytes(model)["total"] for name, model in models.items()},
        "decode_step_seconds": step_seconds,
        "int8_speed_vs_float32": step_seconds["float32"] / step_seconds["int8"],
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# GPU: A3B decode, bf16 vs int8
# ----------------------------------------------------------------------------------------------------------------------


def random_int8_model(size: str, device: str, dtype: torch.dtype):
    """The model with random weights, built quantized: the swap on the meta device, then random int8 values with a
    scale giving about the float init's spread (bench_generate's build_model, with the quantized modules)."""
    config = benchmark_config(size)
    model = quantized_skeleton(config, "int8", dtype)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.initialize_weights()  # everything but the quantized weights, which it does not know
    std = config.text_config.initializer_range
    with torch.no_grad():
        for module in model.modules():
            for name in getattr(module, "quantized_parameters", ()):
                getattr(module, name).random_(-127, 128)
                getattr(module, f"{name}_scale").fill_(std / 73.3)  # std of uniform ints in [-127, 127] is 73.3
    return model.eval()


@contextlib.contextmanager
def fused_kernel_switched_off():
    """The quantized modules look `fused_kernel_runs_on` up in their module at call time: answer no while inside."""
    from modeling_kimi_vl import quantization_kimi_vl

    original = quantization_kimi_vl.fused_kernel_runs_on
    quantization_kimi_vl.fused_kernel_runs_on = lambda device: False
    try:
        yield
    finally:
        quantization_kimi_vl.fused_kernel_runs_on = original


def experts_section(model, device: str, repeats: int) -> dict:
    """The last layer's routed experts alone at decode sizes: seconds per call and stored bytes of the chosen experts
    per second. Routing is random (the same draw for every model)."""
    experts = model.language_model.model.layers[-1].mlp.experts
    config = model.config.text_config
    expert_bytes = sum(
        parameter.numel() * parameter.element_size() // config.n_routed_experts
        for parameter in experts.parameters()  # weights and scales, all with the experts as leading dimension
    )
    generator = torch.Generator().manual_seed(2)
    results = {}
    for batch_size in (1, 8):
        scores = torch.rand(batch_size, config.n_routed_experts, generator=generator)
        top_k_index = scores.topk(config.num_experts_per_tok, dim=-1).indices
        top_k_weights = torch.full(top_k_index.shape, 1 / config.num_experts_per_tok)
        hidden_states = torch.randn(batch_size, config.hidden_size, generator=generator).to(model.dtype)
        call_args = [tensor.to(device) for tensor in (hidden_states, top_k_index, top_k_weights)]
        chosen_bytes = top_k_index.unique().numel() * expert_bytes
        with torch.no_grad():
            seconds = mean_seconds(functools.partial(experts, *call_args), repeats)
        results[str(batch_size)] = {"seconds": seconds, "chosen_bytes_per_s": chosen_bytes / seconds}
    return results


def gpu_section(args, save) -> dict:
    """bf16 (float32 on CPU) then int8; `save(results)` after each, so a run stopped by its time limit keeps what it
    measured."""
    device = args.device
    results = {}
    baseline = "bf16" if device == "cuda" else "float32"  # float32: the CPU check of this logic
    for label in (baseline, "int8"):
        gc.collect()  # the previous model, its static-generation state and graphs
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        if label == baseline:
            model = build_model(args.size, device, dtype)
        else:
            model = random_int8_model(args.size, device, dtype)
        weights = parameter_bytes(model)["total"]
        run = generate_function(model, "ours")
        generator = torch.Generator().manual_seed(1)
        text_ids = torch.randint(1, 7000, (args.prompt_tokens,), generator=generator)
        rates = {}
        for batch_size in (1, 8):
            request = {"input_ids": text_ids.repeat(batch_size, 1).to(device)}
            timed_generation(run, request, args.new_tokens, device)  # warm-up: graph capture
            step = statistics.median(timed_generation(run, request, args.new_tokens, device)[1]
                                     for _ in range(args.repeats))  # fmt: skip
            rates[str(batch_size)] = batch_size / step
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        results[label] = {"weight_bytes": weights, "static_decode_tokens_per_s": rates, "peak_memory_bytes": peak,
                          "experts_call": experts_section(model, device, EXPERTS_CALL_REPEATS)}  # fmt: skip
        if label == "int8":
            with fused_kernel_switched_off():
                results["int8"]["experts_call_torch_path"] = experts_section(model, device, EXPERTS_CALL_REPEATS)
        save(results)
        del model, run
    results[f"int8_decode_speed_vs_{baseline}"] = {
        batch: rate / results[baseline]["static_decode_tokens_per_s"][batch]
        for batch, rate in results["int8"]["static_decode_tokens_per_s"].items()
    }
    results[f"int8_experts_call_time_vs_{baseline}"] = {
        path: {batch: timing["seconds"] / results[baseline]["experts_call"][batch]["seconds"]
               for batch, timing in results["int8"][path].items()}
        for path in ("experts_call", "experts_call_torch_path")
    }  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="weights,load,decode")
    parser.add_argument("--workdir", type=Path, help="absent or empty (about 3 GB); default: a temporary folder")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gpu", action="store_true", help="A3B bf16 vs int8 static decode on one CUDA device")
    parser.add_argument("--size", choices=["small", "full"], default="full")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # child mode: what to run, then its paths
    args = parser.parse_args()

    if args.child:
        kind, *rest = args.child
        if kind == "make-source":
            child_make_source(Path(rest[0]))
        else:
            child_load(Path(rest[0]), rest[1] if len(rest) > 1 else None, Path(rest[2]) if len(rest) > 2 else None)
        return

    if args.gpu:
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("--gpu needs a CUDA device; --device cpu --size small tries the logic on CPU")
        name = f"bench_quantization_{args.device}_{args.size}" + ("_gpu_preset" if args.device == "cpu" else "")
        settings = {"size": args.size, "device": args.device, "new_tokens": args.new_tokens,
                    "prompt_tokens": args.prompt_tokens, "repeats": args.repeats}  # fmt: skip
        result = gpu_section(args, save=lambda partial: write_result(name, {"settings": settings, **partial}))
        print(json.dumps(result, indent=2))
        print(write_result(name, {"settings": settings, **result}))
        return

    sections = [section for section in args.sections.split(",") if section]
    unknown = set(sections) - {"weights", "load", "decode"}
    if unknown:
        parser.error(f"--sections takes weights, load and decode; got {sorted(unknown)}")
    result = {"load_average_before": list(os.getloadavg())}
    with scratch_folder(args.workdir, prefix="kimi-vl-quant-bench-") as workdir:
        if "weights" in sections:
            result["weights"] = weights_section()
        if "load" in sections:
            result["load"] = load_section(workdir)
        if "decode" in sections:
            result["decode"] = decode_section(workdir, args.repeats, args.new_tokens, args.prompt_tokens)
    result["load_average_after"] = list(os.getloadavg())
    print(json.dumps(result, indent=2))
    print(write_result("bench_quantization_cpu", result))


if __name__ == "__main__":
    main()
