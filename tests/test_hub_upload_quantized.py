"""hub_upload with quantized checkpoints: the tiny reference model quantized on load by this project's quantizer (int8,
int4) and saved, exported as a remote-code repository, and loaded in a clean interpreter where only the exported files
provide our code (from the folder, and from a Hub cache, as a download is), with logits bit-identical to the in-package
quantized model's; and the refusal of quantized folders the export cannot vouch for, before anything is written."""

import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT
from huggingface_hub import ModelCard
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_hub_upload import leftovers, tensor_bytes
from test_quantization import load_quantized
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

from hub_upload import (
    ExportInputError,
    ExportVerificationError,
    check_export_folder,
    export_checkpoint,
    run_isolated,
    verify_export,
)
from hub_upload.model_card import ModelCardInfo
from modeling_kimi_vl import KimiVLWeightOnlyConfig
from modeling_kimi_vl.quantization_kimi_vl import QUANT_METHOD, KimiVLWeightOnlyQuantizer
from modeling_kimi_vl.transformers_compat_modeling import QUANTIZATION_MIN_TRANSFORMERS_VERSION, quantization_supported

pytestmark = pytest.mark.skipif(
    not quantization_supported(), reason=f"needs transformers>={QUANTIZATION_MIN_TRANSFORMERS_VERSION}"
)

SCHEMES = ("int8", "int4")
AUTO_LOAD_SCRIPT = REPO_ROOT / "tests" / "isolated_auto_load.py"
AUTO_LOAD_NEW_TOKENS = 12  # what isolated_auto_load.py generates
BASE_MODEL = "moonshotai/Kimi-VL-A3B-Instruct"


@dataclass(frozen=True)
class QuantizedSource:
    scheme: str
    model: torch.nn.Module  # quantized on load from the reference checkpoint, in this process (our package)
    folder: Path  # the complete tiny folder with that model's save_pretrained written over its weights and config


@pytest.fixture(scope="module")
def quantized_sources(reference_checkpoint, tiny_kimi_vl_dir, tmp_path_factory) -> dict[str, QuantizedSource]:
    sources = {}
    for scheme in SCHEMES:
        model = load_quantized(reference_checkpoint, scheme)
        folder = tmp_path_factory.mktemp(f"quantized-{scheme}") / "source"
        shutil.copytree(tiny_kimi_vl_dir, folder)  # tokenizer, processor and chat template of a hub download
        model.save_pretrained(folder)  # config.json with quantization_config, model.safetensors, generation config
        sources[scheme] = QuantizedSource(scheme, model, folder)
    return sources


@pytest.fixture(scope="module", params=SCHEMES)
def quantized_export(request, quantized_sources) -> tuple[QuantizedSource, Path]:
    """(the source, its export), verified in a clean interpreter (the default)."""
    source = quantized_sources[request.param]
    out = source.folder.parent / "export"
    result = export_checkpoint(source.folder, out, card=ModelCardInfo(base_model=BASE_MODEL))
    assert result.verified
    return source, out


def multimodal_inputs(expected) -> dict[str, torch.Tensor]:
    """The fixture's image + text prompt, as isolated_auto_load.py runs it."""
    return {
        "input_ids": expected["mm_input_ids"],
        "pixel_values": expected["pixel_values"],
        "image_grid_hws": expected["image_grid_hws"],
    }


def as_hub_cache(export: Path, cache: Path, repo_id: str) -> None:
    """Put `export` into a huggingface_hub cache as revision main of `repo_id`, as a download leaves it: loading
    `repo_id` offline then takes transformers' Hub path (each code file fetched and its imports checked on its own)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = f"{1:040x}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(export, repo / "snapshots" / commit)


# ----------------------------------------------------------------------------------------------------------------------
# Export and load as remote code
# ----------------------------------------------------------------------------------------------------------------------


def test_quantized_export_carries_the_quantization_and_its_card_says_how_to_load_it(quantized_export):
    source, export = quantized_export
    config = json.loads((export / "config.json").read_text())
    source_config = json.loads((source.folder / "config.json").read_text())
    assert config["quantization_config"] == source_config["quantization_config"]
    assert config["quantization_config"]["scheme"] == source.scheme
    assert tensor_bytes(export) == tensor_bytes(source.folder)  # the quantized tensors as saved, bit for bit
    assert check_export_folder(export) == []
    card = ModelCard.load(export / "README.md")
    assert source.scheme in card.data.tags and card.data.base_model_relation == "quantized"
    quantization = KimiVLWeightOnlyConfig.from_dict(config["quantization_config"])
    assert quantization.describe() in card.text
    assert f"transformers>={QUANTIZATION_MIN_TRANSFORMERS_VERSION}" in card.text
    assert "no `quantization_config` argument is needed" in card.text
    assert "torchrun" not in card.text and "tensor parallelism (`tp_plan`) is refused" in card.text


@pytest.mark.parametrize("where", ["folder", "hub cache"])
def test_quantized_export_loads_as_remote_code_with_the_in_package_logits(
    quantized_export, where, reference_dir, expected, tmp_path, monkeypatch
):
    source, export = quantized_export
    target = str(export)
    if where == "hub cache":
        target = f"my-org/kimi-vl-{source.scheme}"
        as_hub_cache(export, tmp_path / "hub", target)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # the clean interpreter inherits the environment
    output = tmp_path / "outputs.safetensors"
    result = run_isolated(AUTO_LOAD_SCRIPT, target, str(reference_dir / "expected.safetensors"), str(output))
    assert result.returncode == 0, result.stdout + result.stderr
    with safe_open(output, framework="pt") as handle:
        classes = json.loads(handle.metadata()["classes"])
    # Loaded quantized, by the quantizer of the exported files: transformers' remote-code modules registered it.
    assert all(name.startswith("transformers_modules.") for name in classes.values()), classes
    assert classes["quantizer"].endswith(".quantization_kimi_vl.KimiVLWeightOnlyQuantizer")

    inputs = multimodal_inputs(expected)
    with torch.no_grad():
        logits = source.model(**inputs).logits
    generated = source.model.generate(**inputs, max_new_tokens=AUTO_LOAD_NEW_TOKENS, do_sample=False)
    outputs = load_file(output)
    assert torch.equal(outputs["mm_logits"], logits)  # same code, weights, device and dtype: bit for bit
    assert torch.equal(outputs["mm_generated"], generated)


def test_the_exported_model_class_loads_quantized_beside_the_package(quantized_export, expected):
    """In a process that imported our package first (whose Auto registrations then take precedence over remote code),
    the exported files' model class, imported explicitly, loads quantized with the package's quantizer, the one
    registered first."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    source, export = quantized_export
    model_class = get_class_from_dynamic_module("modeling_kimi_vl.KimiVLForConditionalGeneration", export)
    assert model_class.__module__.startswith("transformers_modules.")
    model = model_class.from_pretrained(export, attn_implementation="sdpa").eval()
    assert type(model.hf_quantizer) is KimiVLWeightOnlyQuantizer
    inputs = multimodal_inputs(expected)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, source.model(**inputs).logits)


def test_verification_refuses_a_quantized_export_that_loads_unquantized(quantized_sources, tmp_path):
    """Without the registration, transformers loads int8 weights (shaped like float ones) as float with a warning:
    the verification must catch it rather than pass a repository that computes garbage."""
    export = tmp_path / "export"
    export_checkpoint(quantized_sources["int8"].folder, export, verify=False)
    modeling = export / "modeling_kimi_vl.py"
    code = modeling.read_text()
    assert code.count("\nregister_weight_only_quantization()\n") == 1
    modeling.write_text(code.replace("\nregister_weight_only_quantization()\n", "\n"))
    with pytest.raises(ExportVerificationError, match="has a quantization_config .* loaded without a quantizer"):
        verify_export(export)


def test_registration_is_idempotent_and_keeps_the_first():
    """modeling_kimi_vl.py registers the quantizer on import; a second copy of the code (an exported repository's,
    loaded beside the package, or re-executed) must neither fail nor replace it."""
    registered = (AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD], AUTO_QUANTIZER_MAPPING[QUANT_METHOD])
    assert registered == (KimiVLWeightOnlyConfig, KimiVLWeightOnlyQuantizer)
    path = REPO_ROOT / "modeling_kimi_vl" / "quantization_kimi_vl.py"
    spec = importlib.util.spec_from_file_location("modeling_kimi_vl.second_copy_of_quantization", path)
    second_copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(second_copy)
    assert second_copy.KimiVLWeightOnlyQuantizer is not KimiVLWeightOnlyQuantizer
    second_copy.register_weight_only_quantization()
    assert (AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD], AUTO_QUANTIZER_MAPPING[QUANT_METHOD]) == registered


# ----------------------------------------------------------------------------------------------------------------------
# Quantized folders that are refused, before anything is written
# ----------------------------------------------------------------------------------------------------------------------


def _edit_config(edit):
    def apply(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))

    return apply


def _edit_weights(edit):
    def apply(folder: Path) -> None:
        tensors = load_file(folder / "model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "model.safetensors")

    return apply


def _move_quantization_into_text_config(config: dict) -> None:
    config["text_config"]["quantization_config"] = config.pop("quantization_config")


LM_HEAD = "language_model.lm_head.weight"
EXPERT = "language_model.model.layers.3.mlp.experts.0.gate_proj.weight"  # [32, 64] in float
LAYOUT = "the quantized tensors above do not fit config.json's quantization_config, "
INT8_LAYOUT = LAYOUT + "int8 weight-only: int8 weights, one scale per output channel;"
# (scheme of the source, how to break it, what the refusal must say, what it must not say)
BAD_QUANTIZED_SOURCES = {
    "foreign quantization method": (
        "int8",
        _edit_config(lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})),
        [
            "config.json's quantization_config has quant_method 'fp8': only float checkpoints and checkpoints",
            "quantized by kimi-vl-hf's KimiVLWeightOnlyConfig (quant_method 'kimi_vl_weight_only') can be exported",
        ],
        "tensor",  # the tensors of a format it does not know are not listed one by one
    ),
    "quantization config in text_config": (
        "int8",
        _edit_config(_move_quantization_into_text_config),
        ["config.json's text_config has a quantization_config, which kimi-vl-hf never writes"],
        "tensor",
    ),
    "unknown scheme": (
        "int4",
        _edit_config(lambda c: c["quantization_config"].update(scheme="int3")),
        ["not a valid kimi_vl_weight_only config: Unsupported weight-only quantization scheme 'int3'"],
        "tensor",
    ),
    "modules_to_not_convert not a list": (
        "int8",
        _edit_config(lambda c: c["quantization_config"].update(modules_to_not_convert="vision_tower")),
        ["quantization_config's modules_to_not_convert must be a list of module names (strings), got 'vision_tower'"],
        "tensor",
    ),
    "modules_to_not_convert with a bad pattern": (
        "int8",
        _edit_config(lambda c: c["quantization_config"].update(modules_to_not_convert=["vision_tower", "[", 7])),
        [
            "quantization_config's modules_to_not_convert must be a list of module names (strings), got "
            "['vision_tower', '[', 7]",
            "'[' is not a valid regular expression",
        ],
        "tensor",
    ),
    "group size that does not divide the layers": (
        "int4",
        _edit_config(lambda c: c["quantization_config"].update(group_size=48)),
        ["quantization_config does not fit the model: int4 group_size=48 does not divide"],
        "tensor",
    ),
    "missing scale": (
        "int8",
        _edit_weights(lambda t: t.pop(f"{LM_HEAD}_scale")),
        [f"missing tensor {LM_HEAD}_scale (the config's model needs it)", INT8_LAYOUT],
        "unexpected",
    ),
    "scales of another group size": (
        "int4",
        _edit_config(lambda c: c["quantization_config"].update(group_size=32)),  # the tensors have groups of 16
        [
            f"{LM_HEAD}_scale in model.safetensors has shape [320, 4], the config needs [320, 2]",
            "language_model.model.layers.2.mlp.experts.gate_up_proj_scale in model.safetensors has shape [6, 64, 4], "
            "the config needs [6, 64, 2]",
            "one scale per 32 inputs of each output channel;",
        ],
        LM_HEAD + " in",  # the packed weights themselves are right
    ),
    "quantized weights of a module the config keeps in the model dtype": (
        "int8",
        _edit_config(lambda c: c["quantization_config"]["modules_to_not_convert"].append("lm_head")),
        [
            f"unexpected tensor {LM_HEAD}_scale (the config's model has no such weight)",
            f"{LM_HEAD} in model.safetensors is I8, the config needs F64 or F32 or F16 or BF16",
            INT8_LAYOUT,
            "kept in the model dtype: the modules matching modules_to_not_convert ['vision_tower', "
            "'multi_modal_projector', 'kv_b_proj', 'lm_head']",
        ],
        "missing",
    ),
    "int4 weight not packed": (
        "int4",
        _edit_weights(lambda t: t.update({EXPERT: torch.zeros(32, 64, dtype=torch.uint8)})),
        [
            f"{EXPERT} in model.safetensors has shape [32, 64], the config needs [32, 32]",
            LAYOUT + "int4 weight-only: two int4 values packed per byte",
        ],
        "_scale in model.safetensors",  # the scales are right
    ),
    "float weight where int8 is stored": (
        "int8",
        _edit_weights(lambda t: t.update({LM_HEAD: t[LM_HEAD].float()})),  # same shape: only the dtype tells
        [f"{LM_HEAD} in model.safetensors is F32, the config needs I8", INT8_LAYOUT],
        "shape",
    ),
    "quantized weights without their quantization_config": (
        "int8",
        _edit_config(lambda c: c.pop("quantization_config")),
        [f"unexpected tensor {LM_HEAD}_scale", f"{LM_HEAD} in model.safetensors is I8, the config needs F64 or F32"],
        "weight-only",
    ),
}


@pytest.mark.parametrize("case", list(BAD_QUANTIZED_SOURCES))
def test_bad_quantized_source_is_refused_before_writing(case, quantized_sources, tmp_path):
    scheme, break_source, messages, not_said = BAD_QUANTIZED_SOURCES[case]
    folder = tmp_path / "source"
    shutil.copytree(quantized_sources[scheme].folder, folder)
    break_source(folder)
    with pytest.raises(ExportInputError) as caught:
        export_checkpoint(folder, tmp_path / "out", verify=False)
    for message in messages:
        assert message in str(caught.value)
    assert not_said not in str(caught.value).split("nothing was written:")[1]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
