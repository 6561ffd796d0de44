"""One rank of the multi-process tests, launched by tests/test_parallel.py through torchrun (gloo, CPU).

For every scenario it computes the single-process result on this rank alone (no collectives), then the same with the
model loaded tensor-parallel across all ranks, and writes both to `<out>/rank<r>.safetensors`, plus what it observed
(load errors, what each rank's vision tower encoded, local weight shapes) to `<out>/rank<r>.json`. The test process
compares them; this script asserts nothing itself so that every difference is reported, not just the first.

Scenarios: "two_images" (the fixture's prompt), "one_image" (fewer images than ranks), "three_images" (very different
sizes), "text_only" (the fixture's text batch). For STATIC_SCENARIOS the greedy tokens of
`generate(cache_implementation="static")` are recorded too, and those of plain `generate()` with the expanded MLA
attention (the absorbed form switched off), with how often the static run expanded the latent through kv_b_proj.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from helpers import prompt_ids, random_images
from safetensors.torch import load_file, save_file
from transformers import DistributedConfig

from modeling_kimi_vl import KimiVLForConditionalGeneration
from modeling_kimi_vl.modeling_kimi_vl import ABSORBED_MAX_QUERY_LENGTH, KimiVLMLAAttention

NEW_TOKENS = 8
STATIC_SCENARIOS = ("two_images", "text_only")


def build_scenarios(expected: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    first_grid = tuple(expected["image_grid_hws"][0].tolist())
    first_patches = first_grid[0] * first_grid[1]
    # Patch counts 192, 4 and 24: on 2 ranks the largest goes alone to rank 0, the two small ones to rank 1.
    three_grids = [(16, 12), (2, 2), (4, 6)]
    three_pixel_values, three_grid_hws = random_images(three_grids)
    return {
        "two_images": {
            "input_ids": expected["mm_input_ids"],
            "pixel_values": expected["pixel_values"],
            "image_grid_hws": expected["image_grid_hws"],
        },
        "one_image": {
            "input_ids": torch.tensor([prompt_ids([first_grid])]),
            "pixel_values": expected["pixel_values"][:first_patches],
            "image_grid_hws": expected["image_grid_hws"][:1],
        },
        "three_images": {
            "input_ids": torch.tensor([prompt_ids(three_grids)]),
            "pixel_values": three_pixel_values,
            "image_grid_hws": three_grid_hws,
        },
        "text_only": {"input_ids": expected["txt_input_ids"]},
    }


@torch.no_grad()
def run_scenarios(model, scenarios, prefix: str, results: dict, report: dict) -> None:
    """Logits, greedy tokens and image features (the tower's merged patches, the projected features per image) of
    every scenario, and the grids this rank's vision tower encoded during each scenario's forward."""
    tower_grids = []

    def record_grids(tower, args):
        tower_grids.append(args[1].tolist())  # (pixel_values, image_grid_hws): the tower gets the grids on the host

    hook = model.vision_tower.register_forward_pre_hook(record_grids)
    for name, inputs in scenarios.items():
        tower_grids.clear()
        results[f"{prefix}.{name}.logits"] = model(**inputs).logits
        report[f"{prefix}.{name}.tower_grids"] = list(tower_grids)
        results[f"{prefix}.{name}.tokens"] = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        if name in STATIC_SCENARIOS:
            expansions = []

            def count_expansion(*args, expansions=expansions):
                expansions.append(1)

            hooks = [
                layer.self_attn.kv_b_proj.register_forward_hook(count_expansion)
                for layer in model.language_model.model.layers
            ]
            results[f"{prefix}.{name}.static_tokens"] = model.generate(
                **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static"
            )
            for hook in hooks:
                hook.remove()
            report[f"{prefix}.{name}.static_expansions"] = len(expansions)
            KimiVLMLAAttention.absorb_max_query_length = 0
            results[f"{prefix}.{name}.expanded_tokens"] = model.generate(
                **inputs, max_new_tokens=NEW_TOKENS, do_sample=False
            )
            KimiVLMLAAttention.absorb_max_query_length = ABSORBED_MAX_QUERY_LENGTH
        if "pixel_values" in inputs:
            features = model.get_image_features(inputs["pixel_values"], inputs["image_grid_hws"])
            results[f"{prefix}.{name}.merged"] = features.last_hidden_state
            for image, image_features in enumerate(features.pooler_output):
                results[f"{prefix}.{name}.image_features.{image}"] = image_features
    hook.remove()


def image_features_error_after_mode_switch(model, scenarios, mode: str) -> str | None:
    """The error of encoding images after setting `mm_encoder_tp_mode` on the loaded model (None if none); the
    loaded mode is put back."""
    loaded_mode = model.config.mm_encoder_tp_mode
    model.config.mm_encoder_tp_mode = mode
    inputs = scenarios["two_images"]
    try:
        with torch.no_grad():
            model.get_image_features(inputs["pixel_values"], inputs["image_grid_hws"])
        return None
    except ValueError as error:
        return str(error)
    finally:
        model.config.mm_encoder_tp_mode = loaded_mode


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", type=Path, required=True, help="the tiny reference checkpoint (3 vision heads)")
    parser.add_argument("--even-heads", type=Path, required=True, help="the same weights with 4 vision heads")
    parser.add_argument("--expected", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    expected = load_file(args.expected)
    scenarios = build_scenarios(expected)
    results, report = {}, {"world_size": int(os.environ["WORLD_SIZE"])}

    def load(path, **kwargs):
        return KimiVLForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa", **kwargs).eval()

    # Data mode (the default) on the reference checkpoint.
    run_scenarios(load(args.reference), scenarios, "reference.single", results, report)
    model = load(args.reference, tp_plan="auto")
    report["data.mode"] = model.config.mm_encoder_tp_mode
    report["data.tp_size"] = model.tp_size
    q_proj = model.language_model.model.layers[0].self_attn.q_proj
    report["data.q_proj_local_shape"] = list(q_proj.weight.to_local().shape)
    wqkv = model.vision_tower.encoder.blocks[0].wqkv
    report["data.wqkv_is_plain_parameter"] = type(wqkv.weight) is torch.nn.Parameter  # replicated, not a DTensor
    run_scenarios(model, scenarios, "reference.data", results, report)
    report["data.switched_to_weight.error"] = image_features_error_after_mode_switch(model, scenarios, "weight")
    model.save_pretrained(args.out / "saved_data")
    del model

    # Weight mode with 3 vision heads on 2 ranks must be refused at load.
    try:
        load(args.reference, tp_plan="auto", mm_encoder_tp_mode="weight")
        report["weight_3_heads.error"] = None
    except ValueError as error:
        report["weight_3_heads.error"] = str(error)

    # Weight mode on the 4-head checkpoint, loaded with the newer form of the TP request.
    run_scenarios(load(args.even_heads), scenarios, "even.single", results, report)
    model = load(args.even_heads, distributed_config=DistributedConfig(tp_size=2), mm_encoder_tp_mode="weight")
    wqkv = model.vision_tower.encoder.blocks[0].wqkv
    report["weight.wqkv_local_shape"] = list(wqkv.weight.to_local().shape)
    report["weight.wqkv_bias_local_shape"] = list(wqkv.bias.to_local().shape)
    run_scenarios(model, scenarios, "even.weight", results, report)
    report["weight.switched_to_data.error"] = image_features_error_after_mode_switch(model, scenarios, "data")
    model.save_pretrained(args.out / "saved_weight")

    save_file({name: tensor.contiguous() for name, tensor in results.items()}, args.out / f"rank{rank}.safetensors")
    (args.out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
