"""Standalone script for tests/test_hub_upload.py, run by `hub_upload.run_isolated` (our packages not importable).

Usage: isolated_auto_load.py EXPORT_FOLDER EXPECTED_SAFETENSORS OUTPUT_SAFETENSORS

Loads the export through the Auto classes with trust_remote_code=True, runs the fixture's multimodal inputs, and saves
the logits and the greedy tokens for the parent to compare. Also records which modules the classes came from.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoProcessor, AutoTokenizer

NEW_TOKENS = 12


def main(folder: str, expected_path: str, output_path: str) -> None:
    expected = load_file(expected_path)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="sdpa").eval()
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    image_processor = AutoImageProcessor.from_pretrained(folder, trust_remote_code=True)
    inputs = {
        "input_ids": expected["mm_input_ids"],
        "pixel_values": expected["pixel_values"],
        "image_grid_hws": expected["image_grid_hws"],
    }
    with torch.inference_mode():
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    classes = {
        "config": type(config),
        "model": type(model),
        "processor": type(processor),
        "processor.image_processor": type(processor.image_processor),
        "processor.tokenizer": type(processor.tokenizer),
        "image_processor": type(image_processor),
        "tokenizer": type(tokenizer),
    }
    # A quantized export: its quantizer must come from the exported files too (and be there at all: transformers would
    # load weights of a quant_method it does not know as float ones, with a warning).
    if getattr(model, "hf_quantizer", None) is not None:
        classes["quantizer"] = type(model.hf_quantizer)
    metadata = {"classes": json.dumps({role: f"{cls.__module__}.{cls.__qualname__}" for role, cls in classes.items()})}
    save_file(
        {"mm_logits": logits.contiguous(), "mm_generated": generated.contiguous()}, output_path, metadata=metadata
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
