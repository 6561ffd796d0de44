"""The README.md model card of an export: the Hub's metadata (license, source model) and usage instructions, built
with huggingface_hub's `ModelCard` / `ModelCardData`, which write the metadata as the YAML front matter the Hub
reads."""

from dataclasses import dataclass

from huggingface_hub import ModelCard, ModelCardData

from modeling_kimi_vl import KimiVLWeightOnlyConfig
from modeling_kimi_vl.transformers_compat_modeling import QUANTIZATION_MIN_TRANSFORMERS_VERSION

REPO_PLACEHOLDER = "ORG/NAME"
# huggingface_hub renders `card_data` as YAML between the front-matter markers; the body is inserted as is.
CARD_TEMPLATE = "---\n{{ card_data }}\n---\n\n{{ body }}"


# The float weights shard with tp_plan="auto"; the quantized ones do not (their section says so instead).
TENSOR_PARALLEL_SECTION = """## Tensor parallelism with torchrun

The language model (MoE experts and MLA attention) is sharded with transformers' tensor parallelism; the vision tower
runs data-parallel by default (`mm_encoder_tp_mode="data"` in the config; `"weight"` shards it too). Put the snippet
above in `generate.py`, load with `tp_plan="auto"` instead of `device_map="auto"`, and run one process per GPU:

```bash
torchrun --nproc_per_node 8 generate.py
```
"""


@dataclass(frozen=True)
class ModelCardInfo:
    license: str = "mit"  # the Kimi-VL release is MIT-licensed
    base_model: str | None = (
        None  # Hub id of the checkpoint the weights come from, e.g. moonshotai/Kimi-VL-A3B-Instruct
    )
    repo_id: str | None = None  # where the export will be published; used in the usage snippets


def render_model_card(config: dict, info: ModelCardInfo, quantization: KimiVLWeightOnlyConfig | None = None) -> str:
    """The card of an export of `config`'s checkpoint; `quantization`: the checkpoint's quantization_config, if its
    weights were saved quantized by this project's quantizer."""
    repo = info.repo_id or REPO_PLACEHOLDER
    card_data = ModelCardData(
        license=info.license,
        library_name="transformers",
        pipeline_tag="image-text-to-text",
        base_model=info.base_model,
        tags=["kimi_vl", "custom_code", *([quantization.scheme] if quantization else [])],
        # The Hub lists the repository under its base model's quantizations.
        **({"base_model_relation": "quantized"} if quantization and info.base_model else {}),
    )
    source = (
        f"[{info.base_model}](https://huggingface.co/{info.base_model})" if info.base_model else "a Kimi-VL checkpoint"
    )
    vision, text = config["vision_config"], config["text_config"]
    if quantization is None:
        weights = f"The weights of {source}, unchanged (same tensor names, shapes and bits, re-sharded)"
        min_transformers, device_map = "5.17", "auto"
    else:
        weights = (
            f"The weights of {source}, quantized to {quantization.scheme} weight-only by kimi-vl-hf's quantizer and "
            "kept as it saved them (same tensor names, shapes and bits, re-sharded; see Quantized weights below)"
        )
        min_transformers, device_map = QUANTIZATION_MIN_TRANSFORMERS_VERSION, "cuda"
    body = f"""# {repo.split("/")[-1]}

{weights}, packaged with the transformers-native Kimi-VL code of the kimi-vl-hf project. The code runs on
transformers 5.x (>= {min_transformers}): MoonViT vision tower ({vision.get("num_hidden_layers")} layers, hidden
{vision.get("hidden_size")}), patch-merging projector, and transformers' own DeepSeek-V3 language model
({text.get("num_hidden_layers")} layers, {text.get("n_routed_experts")} routed experts,
{text.get("num_experts_per_tok")} per token).

## Use with transformers

Needs `transformers>={min_transformers}`, `accelerate`, `tiktoken` and `pillow`; the code comes with the repository
(`trust_remote_code=True`).

```python
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoProcessor

repo = "{repo}"
model = AutoModelForCausalLM.from_pretrained(
    repo, trust_remote_code=True, dtype=torch.bfloat16, device_map="{device_map}"
)
processor = AutoProcessor.from_pretrained(repo, trust_remote_code=True)

messages = [{{"role": "user", "content": [{{"type": "image"}}, {{"type": "text", "text": "What is in this image?"}}]}}]
prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
inputs = processor(text=prompt, images=[Image.open("image.png")], return_tensors="pt").to(model.device)
output = model.generate(**inputs, max_new_tokens=256)
print(processor.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0])
```

{quantized_weights_section(quantization) if quantization else TENSOR_PARALLEL_SECTION}
## Demo

The kimi-vl-hf project ships a Gradio chat demo (streamed answers, a Thinking model's reasoning shown live). From a
clone of the project: `make demo DEMO_ARGS="--model {repo}"`, or `python app.py --model {repo} --device cuda`.

## Source and license

Weights: {source}, under the {info.license} license of the original release. Code: the kimi-vl-hf project, exported by
`python -m hub_upload export`.
"""
    return str(ModelCard.from_template(card_data, template_str=CARD_TEMPLATE, body=body))


def quantized_weights_section(quantization: KimiVLWeightOnlyConfig) -> str:
    kept = ", ".join(f"`{name}`" for name in quantization.modules_to_not_convert) or "nothing"
    return f"""## Quantized weights

{quantization.describe()} (`quantization_config` in `config.json`, `quant_method: {quantization.quant_method}`).
Quantized: the language model's linear layers (attention projections, dense and shared-expert MLPs, `lm_head`) and its
routed experts. Kept in the model dtype: the modules matching {kept}, the embedding table, the router and the norms.

`from_pretrained` loads the weights quantized, as they are: the repository's code registers the quantizer when
transformers imports it, so no `quantization_config` argument is needed. Needs
`transformers>={QUANTIZATION_MIN_TRANSFORMERS_VERSION}`. For inference only: the quantized weights are frozen, and
tensor parallelism (`tp_plan`) is refused, since the quantized tensors are not sharded.
"""
