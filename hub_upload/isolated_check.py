"""Standalone script: load an exported folder through the Auto classes and run a tiny multimodal forward.

`hub_upload.verify` runs it in a clean interpreter where our packages are not importable; it imports only torch,
PIL and transformers. Usage: `isolated_check.py FOLDER`. Prints one JSON line on success, exits non-zero on failure.
"""

import json
import sys

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor

NEW_TOKENS = 2


def main(folder: str) -> None:
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    loaded = {"config": type(config), "model": type(model), "processor": type(processor)}
    loaded["tokenizer"] = type(processor.tokenizer)
    loaded["image_processor"] = type(processor.image_processor)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        # transformers loads weights of a quant_method it does not know as float ones, with only a warning: the
        # exported code must have registered the quantizer before from_pretrained looked for it.
        if getattr(model, "hf_quantizer", None) is None:
            sys.exit(f"config.json has a quantization_config ({quantization}) but the model loaded without a quantizer")
        loaded["quantizer"] = type(model.hf_quantizer)
    not_remote = {
        role: cls.__module__ for role, cls in loaded.items() if not cls.__module__.startswith("transformers_modules")
    }
    if not_remote:
        sys.exit(f"these classes did not come from the exported files: {not_remote}")

    # A small, non-uniform image: 56 x 84 pixels, i.e. a 4 x 6 patch grid, 6 image tokens.
    pixels = np.random.default_rng(0).integers(0, 256, size=(56, 84, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=[Image.fromarray(pixels)], return_tensors="pt")
    with torch.inference_mode():
        logits = model(**inputs).logits
        generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    if not torch.isfinite(logits).all():
        sys.exit("the forward pass produced non-finite logits")
    if generated.shape[-1] != inputs["input_ids"].shape[-1] + NEW_TOKENS:
        sys.exit(f"generate returned {generated.shape[-1]} tokens for a {inputs['input_ids'].shape[-1]}-token prompt")
    report = {
        "classes": {role: f"{cls.__module__}.{cls.__qualname__}" for role, cls in loaded.items()},
        "prompt_tokens": inputs["input_ids"].shape[-1],
        "logits_shape": list(logits.shape),
        "generated": generated[0, -NEW_TOKENS:].tolist(),
        "quantization": quantization,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: isolated_check.py FOLDER")
    main(sys.argv[1])
