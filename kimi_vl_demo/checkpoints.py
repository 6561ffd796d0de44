"""Which checkpoint the demo serves, and loading its model.

The default hub model when it is cached or can be downloaded, else the tiny demo model, built locally on first use; a
model asked for by name or folder is served as asked or not at all. A folder may also hold a LoRA adapter
(examples/finetune.py), which loads merged into its base model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling_kimi_vl import KimiVLForConditionalGeneration, KimiVLWeightOnlyConfig
from modeling_kimi_vl.tiny_checkpoint import is_tiny_kimi_vl, write_tiny_checkpoint

from . import log

DEFAULT_MODEL = "moonshotai/Kimi-VL-A3B-Instruct"
TINY_MODEL = "tiny"
# peft writes this beside a LoRA adapter (examples/finetune.py without --merge); a model folder has config.json instead.
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    name: str
    kind: str  # "instruct", "thinking" or "tiny": a key of engine.DEFAULT_SETTINGS
    notice: str = ""  # why this checkpoint was chosen, when it is not the one asked for


# Bump when the tiny demo checkpoint changes, so that an old cached copy is not reused.
TINY_DEMO_VERSION = 2


def ensure_tiny_checkpoint(cache_dir: Path) -> Path:
    """The tiny Kimi-VL folder (the one `make tiny` writes) under cache_dir, written on first use. The writer renames a
    finished folder into place, so an interrupted or concurrent first run never leaves a half-written one behind."""
    target = cache_dir / f"tiny-demo-v{TINY_DEMO_VERSION}"
    if target.is_dir():
        return target
    log(f"writing the tiny demo model to {target} (first run only)")
    try:
        write_tiny_checkpoint(target)
    except FileExistsError:
        pass  # another run finished first
    return target


def model_kind(name: str) -> str:
    return "thinking" if "thinking" in name.lower() else "instruct"


def folder_kind(folder: Path) -> str:
    """The kind of a local model folder: "tiny" for the tiny architecture (e.g. `make tiny`'s folder), which gets the
    tiny model's settings, not the real one's; a LoRA adapter is of its base model's kind."""
    if (folder / ADAPTER_CONFIG).is_file():
        base = adapter_base_model(folder)
        return folder_kind(Path(base)) if Path(base).is_dir() else model_kind(base)
    return "tiny" if is_tiny_kimi_vl(folder) else model_kind(folder.name)


def resolve_checkpoint(model: str, cache_dir: Path) -> Checkpoint:
    """Find the checkpoint to serve. Only the default model falls back (to the tiny one) when it cannot be had; a model
    asked for by name that cannot be found is an error."""
    if model == TINY_MODEL:
        return Checkpoint(ensure_tiny_checkpoint(cache_dir), "tiny demo model", "tiny")
    if Path(model).is_dir():
        folder = Path(model)
        return Checkpoint(folder, folder.name, folder_kind(folder))

    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(model, local_files_only=True)
        log(f"{model}: found in the local hub cache")
    except Exception:  # noqa: BLE001 - any miss means "not cached"; the download below reports the real problem
        try:
            log(f"{model}: not in the local hub cache; trying to download it (the full model is tens of GB)")
            path = snapshot_download(model, etag_timeout=10)
        except Exception as error:  # noqa: BLE001 - offline, unknown repo, no permission: all end the same way here
            if model != DEFAULT_MODEL:
                raise SystemExit(f"Cannot load {model!r}: it is not a folder and the hub gave: {error}") from error
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            reason = (
                f"{DEFAULT_MODEL} is not in the local hub cache and the hub cannot be reached ({cause}), so the "
                "built-in tiny demo model is served instead."
            )
            log(reason)
            return Checkpoint(ensure_tiny_checkpoint(cache_dir), "tiny demo model", "tiny", notice=reason)
    return Checkpoint(Path(path), model, model_kind(model))


def load_model(
    path: Path, dtype: torch.dtype, device: str, quantize: str | None = None
) -> KimiVLForConditionalGeneration:
    """The model in `path`, its language model quantized as the weights load when `quantize` names a scheme
    (modeling_kimi_vl/quantization_kimi_vl.py). A LoRA adapter folder loads its base model (named in the adapter's
    config) with the adapter merged in, so it generates exactly as a merged checkpoint would, at the same speed."""
    if not (path / ADAPTER_CONFIG).is_file():
        quantization = {"quantization_config": KimiVLWeightOnlyConfig(quantize)} if quantize else {}
        return KimiVLForConditionalGeneration.from_pretrained(path, dtype=dtype, device_map=device, **quantization)
    if quantize:
        raise SystemExit(
            f"{path} is a LoRA adapter, which merges into full-precision weights only; quantize a merged model "
            "instead (examples/finetune.py --merge writes one), or leave out --quantize."
        )
    try:
        from peft import PeftModel
    except ImportError as error:
        raise SystemExit(f"{path} is a LoRA adapter; loading it needs peft: pip install -e '.[train]'") from error
    base = adapter_base_model(path)
    log(f"{path} is a LoRA adapter: loading its base model {base} and merging the adapter in")
    model = KimiVLForConditionalGeneration.from_pretrained(base, dtype=dtype, device_map=device)
    return PeftModel.from_pretrained(model, path).merge_and_unload()


def weights_source(path: Path) -> Path | str:
    """Where `load_model` reads the model's weights and config: the folder itself, or a LoRA adapter's base model."""
    return adapter_base_model(path) if (path / ADAPTER_CONFIG).is_file() else path


def adapter_base_model(folder: Path) -> str:
    """The hub id or folder of the model a LoRA adapter folder was trained on (peft's `base_model_name_or_path`)."""
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as error:
        raise SystemExit(f"{folder / ADAPTER_CONFIG} could not be read as peft's adapter config: {error}") from error
    if not isinstance(base, str) or not base:
        raise SystemExit(f"{folder / ADAPTER_CONFIG} does not name its base model (base_model_name_or_path).")
    return base
