"""Peak memory of `python -m hub_upload export` against the shard size, on a synthetic ~1 GB checkpoint.

The claim to check: the export holds about one output shard in memory, not the model. A Kimi-VL config with the tiny
reference's shape but very wide dense MLPs (bf16, hidden 64, intermediate 2^19: 64 MB per linear, 15 of them) is
filled with random weights in the original layout (4 source shards + index, the tiny folder's tokenizer and processor
files), then exported twice with --no-verify:
with a shard size below the model size and with the default 5GB (one shard = the whole model). Each export runs in
its own process; its peak RSS is the kernel's high-water mark of that process (VmHWM, read as it exits; unlike wait4's
ru_maxrss it does not include the parent's memory inherited at fork). The baseline is the same command on the tiny
Kimi-VL folder (`make tiny`, 1.5 MB of weights): the cost of the imports. Reported: peak minus baseline, per largest
shard.

    python -m benchmarks.bench_hub_export_memory [--workdir FOLDER]
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import REPO_ROOT, scratch_folder, write_result
from hub_upload.source import expected_checkpoint_tensors
from hub_upload.weights import natural_key
from modeling_kimi_vl import KimiVLConfig
from modeling_kimi_vl.tiny_checkpoint import write_tiny_checkpoint

# What the wide checkpoint takes over from the tiny folder unchanged.
TOKENIZER_AND_PROCESSOR_FILES = (
    "tiktoken.model",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
)
WIDE_MLP = {"intermediate_size": 2**19, "num_hidden_layers": 5, "first_k_dense_replace": 5}
SOURCE_SHARDS = 4


def build_wide_source(folder: Path, tiny: Path) -> int:
    """A random bf16 checkpoint of the tiny folder's config with WIDE_MLP, in SOURCE_SHARDS files + index; returns its
    tensor bytes."""
    config = json.loads((tiny / "config.json").read_text())
    config["text_config"].update(WIDE_MLP)
    config["torch_dtype"] = "bfloat16"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shapes = {
        name: tensor.shape for name, tensor in expected_checkpoint_tensors(KimiVLConfig.from_dict(config)).items()
    }
    names = sorted(shapes, key=natural_key)
    weight_map, total = {}, 0
    for number in range(SOURCE_SHARDS):  # one source shard in memory at a time
        shard_name = f"model-{number + 1:05d}-of-{SOURCE_SHARDS:05d}.safetensors"
        tensors = {name: torch.randn(shapes[name], dtype=torch.bfloat16) for name in names[number::SOURCE_SHARDS]}
        save_file(tensors, folder / shard_name, metadata={"format": "pt"})
        weight_map.update((name, shard_name) for name in tensors)
        total += sum(tensor.nbytes for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in TOKENIZER_AND_PROCESSOR_FILES:
        shutil.copyfile(tiny / name, folder / name)
    return total


# Runs the CLI as `python -m hub_upload` would, then reports this process's RSS high-water mark on stderr.
RUN_CLI_AND_REPORT_PEAK = """
import runpy, sys
sys.argv = ["hub_upload", *sys.argv[1:]]
try:
    runpy.run_module("hub_upload", run_name="__main__")
finally:
    peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print("PEAK_KB", peak.split()[1], file=sys.stderr)
"""


def measure_export(source: Path, out: Path, max_shard_size: str) -> dict:
    """Run the export CLI in a fresh process; its wall time and peak RSS."""
    args = ["export", "--source", str(source), "--out", str(out), "--max-shard-size", max_shard_size]
    command = [sys.executable, "-c", RUN_CLI_AND_REPORT_PEAK, *args, "--no-verify", "--overwrite"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak_lines = [line for line in result.stderr.splitlines() if line.startswith("PEAK_KB")]
    if not peak_lines or "exported" not in result.stdout:
        raise RuntimeError(f"export failed:\n{result.stdout}\n{result.stderr}")
    largest_shard = max(path.stat().st_size for path in out.glob("*.safetensors"))
    return {
        "max_shard_size": max_shard_size,
        "seconds": round(seconds, 2),
        "peak_rss_mb": round(int(peak_lines[-1].split()[1]) / 1024, 1),
        "output_shards": len(list(out.glob("*.safetensors"))),
        "largest_output_shard_mb": round(largest_shard / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="absent or empty (about 2 GB); default: a temporary folder")
    args = parser.parse_args()
    with scratch_folder(args.workdir, prefix="kimi-vl-export-bench-") as workdir:
        measure_all(workdir)


def measure_all(workdir: Path) -> None:
    """The baseline and both wide exports in `workdir`; prints and writes the result."""
    tiny = write_tiny_checkpoint(workdir / "tiny")
    baseline = measure_export(tiny, workdir / "tiny_export", "5GB")

    wide = workdir / "wide"
    model_bytes = build_wide_source(wide, tiny)
    runs = [measure_export(wide, workdir / "wide_export", size) for size in ("128MB", "5GB")]
    for run in runs:
        run["peak_over_baseline_mb"] = round(run["peak_rss_mb"] - baseline["peak_rss_mb"], 1)
        run["over_baseline_per_largest_shard"] = round(run["peak_over_baseline_mb"] / run["largest_output_shard_mb"], 2)
    result = {"model_mb": round(model_bytes / 2**20, 1), "baseline_tiny_export": baseline, "runs": runs}
    print(json.dumps(result, indent=2))
    print(write_result("hub_export_memory", result))


if __name__ == "__main__":
    main()
