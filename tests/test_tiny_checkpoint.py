"""The tiny Kimi-VL folder (`make tiny`, `python -m modeling_kimi_vl.tiny_checkpoint`): what it holds, that it is the
reference fixture's model, and that the README's entry points work on it: the Auto classes and the processor,
generation (plain and static), `hub_upload export` with verification (also of a transformers 5 `save_pretrained`
folder), and the demo."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import PLACEHOLDER_ID, REPO_ROOT
from transformers import AutoModelForImageTextToText, AutoProcessor

import image_processing  # noqa: F401 - registers the processor classes with the Auto API
import modeling_kimi_vl  # noqa: F401 - registers the model classes with the Auto API
from app import banner_markdown
from hub_upload import export_checkpoint
from hub_upload.source import ExportInputError, read_source
from kimi_vl_demo.checkpoints import TINY_MODEL, resolve_checkpoint
from modeling_kimi_vl.tiny_checkpoint import write_tiny_checkpoint

# The original hub layout, as the issue lists it.
HUB_LAYOUT_FILES = {
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tiktoken.model",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "chat_template.jinja",
}


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def modes(folder: Path) -> set[int]:
    return {stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}


@pytest.fixture(scope="module")
def tiny_model(tiny_kimi_vl_dir):
    return AutoModelForImageTextToText.from_pretrained(tiny_kimi_vl_dir).eval()


@pytest.fixture(scope="module")
def tiny_processor(tiny_kimi_vl_dir):
    return AutoProcessor.from_pretrained(tiny_kimi_vl_dir)


# --- writing it -------------------------------------------------------------------------------------------------------


def test_make_tiny_writes_the_hub_layout_deterministically(tiny_kimi_vl_dir, tmp_path):
    folder = tmp_path / "made"
    result = subprocess.run(["make", "-s", "tiny", f"TINY_DIR={folder}"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {path.name for path in folder.iterdir()} == HUB_LAYOUT_FILES
    assert file_bytes(folder) == file_bytes(tiny_kimi_vl_dir)  # same bytes on every run and machine
    assert modes(folder) == {0o644} and stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert [path.name for path in tmp_path.iterdir()] == ["made"]  # no partial folder left beside it

    again = subprocess.run(["make", "tiny", f"TINY_DIR={folder}"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout  # up to date: not rewritten


def test_writer_refuses_a_folder_that_holds_anything(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = subprocess.run(
        [sys.executable, "-m", "modeling_kimi_vl.tiny_checkpoint", str(tmp_path / "mine")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "already exists and is not an empty folder" in result.stderr
    assert [path.name for path in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert write_tiny_checkpoint(tmp_path / "empty-is-fine") == tmp_path / "empty-is-fine"


def test_make_tiny_rebuilds_only_a_tiny_model_and_leaves_any_other_folder_alone(tiny_kimi_vl_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    result = subprocess.run(["make", "-s", "tiny", f"TINY_DIR={mine}"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "already exists and is not an empty folder" in result.stderr
    assert [path.name for path in mine.iterdir()] == ["notes.txt"]

    made = tmp_path / "made"
    shutil.copytree(tiny_kimi_vl_dir, made)
    os.utime(made / "config.json", (0, 0))  # older than what it is made from: make rebuilds it
    result = subprocess.run(["make", "-s", "tiny", f"TINY_DIR={made}"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert file_bytes(made) == file_bytes(tiny_kimi_vl_dir) and (made / "config.json").stat().st_mtime > 0


def test_config_carries_the_tokenizers_ids(tiny_kimi_vl_dir, tiny_processor):
    config = json.loads((tiny_kimi_vl_dir / "config.json").read_text())
    tokenizer = tiny_processor.tokenizer
    assert config["media_placeholder_token_id"] == tokenizer.convert_tokens_to_ids("<|media_pad|>") == PLACEHOLDER_ID
    assert (config["text_config"]["bos_token_id"], config["text_config"]["eos_token_id"]) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    generation = json.loads((tiny_kimi_vl_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


# --- the model is the reference fixture -------------------------------------------------------------------------------


def test_tiny_model_is_the_reference_model(tiny_kimi_vl_dir, tiny_model, reference_checkpoint, expected):
    weights = "model.safetensors"
    assert (tiny_kimi_vl_dir / weights).read_bytes() == (reference_checkpoint / weights).read_bytes()
    with torch.no_grad():
        logits = tiny_model(
            input_ids=expected["mm_input_ids"],
            pixel_values=expected["pixel_values"],
            image_grid_hws=expected["image_grid_hws"],
        ).logits
    torch.testing.assert_close(logits, expected["mm_logits"], rtol=1e-4, atol=1e-5)


# --- the README's snippets, on the tiny folder ------------------------------------------------------------------------


def chat_inputs(processor, image_path: Path):
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(image_path)}, {"type": "text", "text": "What is this?"}],
        }
    ]
    return processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt"
    )


def test_auto_classes_chat_template_and_generate(tiny_model, tiny_processor, reference_dir):
    assert type(tiny_model).__name__ == "KimiVLForConditionalGeneration"
    assert type(tiny_processor).__name__ == "KimiVLProcessor"
    inputs = chat_inputs(tiny_processor, reference_dir / "images" / "rgb_700x500.png")
    rows, cols = inputs["image_grid_hws"][0].tolist()
    assert rows * cols <= 4 * 64 + 2 * (rows + cols)  # scaled to the tiny processor's 256-patch limit (+ padding)
    placeholder = tiny_model.config.media_placeholder_token_id
    assert int((inputs["input_ids"] == placeholder).sum()) == rows * cols // 4

    plain = tiny_model.generate(**inputs, max_new_tokens=16, do_sample=False)
    static = tiny_model.generate(**inputs, max_new_tokens=16, do_sample=False, cache_implementation="static")
    assert torch.equal(plain, static)
    new_tokens = plain[0, inputs["input_ids"].shape[1] :]
    assert len(new_tokens) > 0
    # The generation config keeps the random model to readable text and the end of turn.
    answer = tiny_processor.decode(new_tokens, skip_special_tokens=True)
    assert answer.isascii() and answer.isprintable(), answer
    end_of_turn = tiny_processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    special = set(tiny_processor.tokenizer.all_special_ids) - {end_of_turn}
    assert not special & set(new_tokens.tolist())


def test_exports_with_verification_readable_by_everyone(tiny_kimi_vl_dir, tmp_path):
    old_umask = os.umask(0o077)  # a private umask must not make a private export
    try:
        result = export_checkpoint(tiny_kimi_vl_dir, tmp_path / "export")
    finally:
        os.umask(old_umask)
    assert result.verified
    assert modes(result.folder) == {0o644} and stat.S_IMODE(result.folder.stat().st_mode) == 0o755
    exported = json.loads((result.folder / "preprocessor_config.json").read_text())
    assert (
        exported["in_token_limit"]
        == json.loads((tiny_kimi_vl_dir / "preprocessor_config.json").read_text())["in_token_limit"]
    )


def test_save_pretrained_folder_exports(tiny_model, tiny_processor, tmp_path):
    """A folder as transformers 5 saves it (processor_config.json, no preprocessor_config.json): a fine-tune's
    layout."""
    saved = tmp_path / "saved"
    tiny_model.save_pretrained(saved)
    tiny_processor.save_pretrained(saved)
    assert (saved / "processor_config.json").is_file() and not (saved / "preprocessor_config.json").exists()
    assert read_source(saved).preprocessor_config["in_token_limit"] == tiny_processor.image_processor.in_token_limit

    result = export_checkpoint(saved, tmp_path / "export")
    assert result.verified
    exported = json.loads((result.folder / "preprocessor_config.json").read_text())
    assert exported["processor_class"] == "KimiVLProcessor"
    assert exported["in_token_limit"] == tiny_processor.image_processor.in_token_limit


def test_missing_image_processor_settings_are_named(tiny_kimi_vl_dir, tmp_path):
    folder = tmp_path / "source"
    shutil.copytree(tiny_kimi_vl_dir, folder)
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(ExportInputError, match="preprocessor_config.json is missing .*processor_config.json"):
        read_source(folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "KimiVLProcessor"}))
    with pytest.raises(ExportInputError, match="processor_config.json has no image_processor object"):
        read_source(folder)


def test_demo_tiny_mode_serves_this_folder(tiny_kimi_vl_dir, tmp_path):
    """`python app.py --model tiny` serves this folder (the demo tests in test_app.py run it), and `--model DIR` on it
    gets the tiny model's settings and banner, not the real model's (whose 1024 new tokens would not fit)."""
    checkpoint = resolve_checkpoint(TINY_MODEL, tmp_path)
    assert checkpoint.kind == "tiny"
    assert file_bytes(checkpoint.path) == file_bytes(tiny_kimi_vl_dir)

    by_path = resolve_checkpoint(str(tiny_kimi_vl_dir), tmp_path)
    assert (by_path.path, by_path.kind) == (tiny_kimi_vl_dir, "tiny")
    assert "random" in banner_markdown(by_path)

    real_size = tmp_path / "Kimi-VL-A3B-Instruct"
    real_size.mkdir()
    config = json.loads((tiny_kimi_vl_dir / "config.json").read_text())
    config["text_config"].update(hidden_size=2048, vocab_size=163840)
    (real_size / "config.json").write_text(json.dumps(config))
    assert resolve_checkpoint(str(real_size), tmp_path).kind == "instruct"
