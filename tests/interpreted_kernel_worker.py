"""Runs the fused weight-only kernel (modeling_kimi_vl/fused_experts_kimi_vl.py) on CPU under Triton's interpreter;
launched by tests/test_fused_experts.py with TRITON_INTERPRET=1 set before anything imports Triton.

It writes what it computed to `<out>/results.safetensors` and what it counted to `<out>/report.json`; the test process
computes the references with plain torch (no interpreter) and compares. This script asserts nothing itself, so that
every difference is reported.

- `kernel.<case>`: the kernel's output for each of KERNEL_CASES (inputs made by `kernel_case_inputs`).
- `<scheme>.logits`: the tiny reference checkpoint quantized on load, logits on the fixture's prompts with the
  `batched_mm` experts (every pair through the kernel, prefill included).
- `<scheme>.plain` / `<scheme>.static`: greedy tokens of plain `generate()` and of the static path with the default
  `grouped_mm` experts (prefill dequantises, decode goes through the kernel, and so do the linear layers).
- report: kernel launches per scheme, for linear layers and for experts, so the test knows the model really went
  through the kernel.
"""

import argparse
import json
from pathlib import Path

import torch
from helpers import fixture_logits, fixture_request
from safetensors.torch import load_file, save_file

from modeling_kimi_vl import KimiVLForConditionalGeneration, KimiVLWeightOnlyConfig, quantization_kimi_vl
from modeling_kimi_vl.fused_experts_kimi_vl import fused_kernel_runs_on, weight_only_rows_matmul
from modeling_kimi_vl.quantization_kimi_vl import Int4Scheme, Int8Scheme

SCHEMES = {"int8": Int8Scheme(), "int4": Int4Scheme(16)}
TINY_GROUP_SIZE = 16
NEW_TOKENS = 6
# (scheme, experts, out_features, in_features, input rows, pairs per input row, dtype): sizes that are not multiples of
# the kernel's blocks, rows shared by several pairs (the experts' gate_up) or not (down), and the bf16 and fp16 compute
# dtypes.
KERNEL_CASES = {
    "int8_shared_rows": ("int8", 5, 70, 96, 3, 2, torch.float32),
    "int8_one_row_each": ("int8", 4, 33, 300, 4, 1, torch.float32),
    "int8_bf16": ("int8", 3, 64, 128, 2, 3, torch.bfloat16),
    "int8_fp16": ("int8", 3, 40, 200, 2, 3, torch.float16),
    "int4_shared_rows": ("int4", 5, 70, 96, 3, 2, torch.float32),
    "int4_one_row_each": ("int4", 4, 33, 320, 4, 1, torch.float32),
    "int4_bf16": ("int4", 3, 64, 128, 2, 3, torch.bfloat16),
    "int4_fp16": ("int4", 3, 40, 288, 2, 3, torch.float16),
}


def kernel_case_inputs(case: str) -> dict:
    """The inputs of one kernel case, the same in every process (seeded)."""
    scheme_name, experts, out_features, in_features, rows, repeats, dtype = KERNEL_CASES[case]
    generator = torch.Generator().manual_seed(sum(map(ord, case)))
    scheme = SCHEMES[scheme_name]
    qweight, scale = scheme.quantize(torch.randn(experts, out_features, in_features, generator=generator).to(dtype))
    return {
        "scheme": scheme,
        "inputs": torch.randn(rows, in_features, generator=generator).to(dtype),
        "qweight": qweight,
        "scale": scale,
        "expert_ids": torch.randint(0, experts, (rows * repeats,), generator=generator),
        "repeats": repeats,
    }


def load_quantized(checkpoint: Path, scheme: str, **kwargs):
    config = KimiVLWeightOnlyConfig(scheme, group_size=TINY_GROUP_SIZE)
    return KimiVLForConditionalGeneration.from_pretrained(
        checkpoint, attn_implementation="sdpa", quantization_config=config, **kwargs
    ).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--expected", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    expected = load_file(args.expected)
    results: dict[str, torch.Tensor] = {}
    report = {"kernel_runs_on_cpu": fused_kernel_runs_on(torch.device("cpu")), "launches": {}}

    for case in KERNEL_CASES:
        case_inputs = kernel_case_inputs(case)
        results[f"kernel.{case}"] = weight_only_rows_matmul(
            case_inputs["inputs"], case_inputs["qweight"], case_inputs["scale"], case_inputs["expert_ids"],
            case_inputs["repeats"], case_inputs["scheme"].group_size,
        )  # fmt: skip

    # Count the model's launches by kind: the quantized modules look the kernel up in their module at call time.
    launches = {}

    def counted(inputs, qweight, *rest):
        kind = "linear" if qweight.shape[0] == 1 else "experts"  # a linear goes in as one "expert"
        launches[kind] = launches.get(kind, 0) + 1
        return weight_only_rows_matmul(inputs, qweight, *rest)

    quantization_kimi_vl.weight_only_rows_matmul = counted
    for scheme in SCHEMES:
        launches.clear()
        results[f"{scheme}.logits"] = fixture_logits(
            load_quantized(args.checkpoint, scheme, experts_implementation="batched_mm"), expected
        )
        model = load_quantized(args.checkpoint, scheme)
        request = fixture_request(expected)
        results[f"{scheme}.plain"] = model.generate(**request, max_new_tokens=NEW_TOKENS, do_sample=False)
        results[f"{scheme}.static"] = model.generate(
            **request, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static"
        )
        report["launches"][scheme] = dict(launches)

    args.out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in results.items()}, args.out / "results.safetensors")
    (args.out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
