"""A complete tiny Kimi-VL folder in the original hub layout, for trying every entry point without the 32 GB model.

    python -m modeling_kimi_vl.tiny_checkpoint DIR      # or: make tiny  (TINY_DIR, default tiny-kimi-vl/)

The model is the repository's reference fixture (`tests/fixtures/reference_tiny/tiny_ref`): weights made by the
original release code, in the original key layout, with outputs of that code kept beside them. The folder adds what
a hub download has and the fixture lacks: the tiny tokenizer (`image_processing/tiny_tokenizer.py`, 320 ids,
`<|media_pad|>` = 300 as the fixture expects), the chat template, `preprocessor_config.json` and a
`generation_config.json`. So tests, the README's snippets and the demo's tiny mode all run the same model.

The weights are random: answers are random text. Generation keeps to printable ASCII pieces and the end of turn
(`generation_config.suppress_tokens`), so that the random answers read as text instead of stray bytes and markers.

A development and test helper: it needs this repository's checkout (the fixture lives in tests/), and it is not
shipped with exported models.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from transformers import GenerationConfig

from image_processing import KimiVLImageProcessor, KimiVLTokenizer, write_tiny_tokenizer

REFERENCE_CHECKPOINT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference_tiny" / "tiny_ref"
WEIGHTS_NAME = "model.safetensors"
TINY_CONTEXT = 1024  # positions: a short chat with a few images
# An image of up to 256 patches becomes at most 64 tokens (+ merge padding), so a few images fit the tiny context.
TINY_IN_TOKEN_LIMIT = 256


def write_tiny_checkpoint(folder: str | Path) -> Path:
    """Write the tiny Kimi-VL folder at `folder` (which must not exist yet, or be empty) and return its path.

    The folder is written beside the target and renamed into place, so an interrupted run leaves nothing half-written;
    FileExistsError if `folder` holds anything.
    """
    folder = Path(folder)
    if not (REFERENCE_CHECKPOINT / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(
            f"the tiny model's weights are not at {REFERENCE_CHECKPOINT / WEIGHTS_NAME}; this helper needs the "
            "kimi-vl-hf repository checkout (the reference fixture lives in its tests/ folder)"
        )
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} already exists and is not an empty folder; choose a new path or remove it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.partial-"))
    try:
        _write_contents(scratch)
        scratch.chmod(0o755)  # mkdtemp makes it private; a model folder is readable by everyone, as a download is
        try:
            scratch.rename(folder)  # replaces an empty folder
        except OSError as error:
            if folder.is_dir() and any(folder.iterdir()):  # another writer (e.g. a concurrent demo) filled it first
                raise FileExistsError(f"{folder} was written by another process meanwhile") from error
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def _write_contents(folder: Path) -> None:
    shutil.copyfile(REFERENCE_CHECKPOINT / WEIGHTS_NAME, folder / WEIGHTS_NAME)
    write_tiny_tokenizer(folder)  # tiktoken.model, tokenizer_config.json, chat_template.jinja
    tokenizer = KimiVLTokenizer.from_pretrained(folder)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    # The fixture's config as the original code saved it, with two changes that alter no weight and no output: the
    # special-token ids of the tokenizer (the fixture was made before there was one and says 0/1/2), and a context of
    # TINY_CONTEXT positions instead of 512 (the rotary embedding does not depend on it), room for a chat with images.
    config = json.loads((REFERENCE_CHECKPOINT / "config.json").read_text())
    config["text_config"].update(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=TINY_CONTEXT,
    )
    config["pad_token_id"] = tokenizer.pad_token_id
    if config["media_placeholder_token_id"] != tokenizer.convert_tokens_to_ids("<|media_pad|>"):
        raise RuntimeError("the tiny tokenizer's <|media_pad|> is not the fixture's placeholder id")
    _write_json(folder / "config.json", config)

    # As on the hub: the processor class named in the image processor's config (AutoProcessor reads it there).
    image_processor = KimiVLImageProcessor(in_token_limit=TINY_IN_TOKEN_LIMIT)
    _write_json(
        folder / "preprocessor_config.json", {**image_processor.to_dict(), "processor_class": "KimiVLProcessor"}
    )

    pieces = [tokenizer.decode([token_id], skip_special_tokens=True) for token_id in range(len(tokenizer))]
    readable = {token_id for token_id, piece in enumerate(pieces) if piece and piece.isascii() and piece.isprintable()}
    generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_of_turn,  # a chat answer ends with <|im_end|>
        pad_token_id=tokenizer.pad_token_id,
        suppress_tokens=sorted(set(range(len(tokenizer))) - readable - {end_of_turn}),
    )
    generation_config.save_pretrained(folder)
    for path in folder.iterdir():
        path.chmod(0o644)


# What tells the tiny architecture apart from the real one (hidden 2048, vocab 163840, 27 vision blocks, ...).
_ARCHITECTURE_KEYS = {
    "text_config": ("hidden_size", "num_hidden_layers", "vocab_size"),
    "vision_config": ("hidden_size", "num_hidden_layers"),
}


def is_tiny_kimi_vl(folder: str | Path) -> bool:
    """Whether `folder` holds a model of the tiny architecture: this writer's folder, or one saved after fine-tuning it
    (the demo gives such a model its short answers and its "random weights" banner)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    reference = json.loads((REFERENCE_CHECKPOINT / "config.json").read_text())
    return isinstance(config, dict) and all(
        isinstance(config.get(part), dict) and config[part].get(key) == reference[part][key]
        for part, keys in _ARCHITECTURE_KEYS.items()
        for key in keys
    )


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m modeling_kimi_vl.tiny_checkpoint",
        description="Write a tiny Kimi-VL (random weights, so random answers) in the original hub layout.",
    )
    parser.add_argument("folder", type=Path, help="where to write it; must not exist yet, or be empty")
    args = parser.parse_args(argv)
    try:
        folder = write_tiny_checkpoint(args.folder)
    except (FileExistsError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote the tiny Kimi-VL to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
