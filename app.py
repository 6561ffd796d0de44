"""Kimi-VL web demo: multimodal chat with streamed answers and a live view of a Thinking model's reasoning.

    python app.py                        # Kimi-VL-A3B-Instruct if cached or downloadable, else the tiny demo model
    python app.py --model tiny           # the built-in tiny model: random weights, so random answers; no download
    python app.py --model moonshotai/Kimi-VL-A3B-Thinking-2506 --device cuda
    python app.py --model tiny --ignore-eos  # every answer runs to Stop or the max new tokens setting

The page is served on 127.0.0.1 unless --host says otherwise; a public --share link is opt-in. The model serves one
generation at a time; other users wait in a bounded queue and see their position.

The logic lives in plain functions (image checks, prompt building, chat display, statistics) and in `ChatEngine`
(model and processor); `build_demo` only wires them to Gradio components.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import gradio as gr
import torch
from PIL import Image, ImageOps
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from image_processing import SANITIZING_SUPPORTED, KimiVLProcessor, split_thinking
from modeling_kimi_vl import KimiVLForConditionalGeneration, KimiVLWeightOnlyConfig
from modeling_kimi_vl.tiny_checkpoint import is_tiny_kimi_vl, write_tiny_checkpoint

DEFAULT_MODEL = "moonshotai/Kimi-VL-A3B-Instruct"
TINY_MODEL = "tiny"
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kimi-vl-hf"
SUPPORTED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# Uploads are kept in Gradio's cache while a conversation may still show them, then deleted: every hour, the files
# older than a day ((frequency, age) in seconds, Gradio's `delete_cache`).
UPLOAD_CACHE_CLEANUP = (3600, 24 * 3600)


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (which has `malloc_trim`); None elsewhere (macOS, musl, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - an AttributeError here means: not glibc
    except (OSError, AttributeError):
        return None
    return libc


LIBC = _glibc()


def log(message: str) -> None:
    print(f"[kimi-vl demo] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Generation settings: defaults per kind of model
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    temperature: float  # 0 means greedy decoding
    top_p: float


# Moonshot's model cards recommend temperature 0.2 for Instruct and 0.8 for Thinking; a Thinking model writes its
# reasoning before the answer, so it needs a much larger token budget. The tiny model's weights are random, so sampling
# would only add more randomness: it decodes greedily, which makes its answers (and the demo's tests) reproducible, and
# a short budget keeps its demo snappy.
DEFAULT_SETTINGS = {
    "instruct": GenerationSettings(max_new_tokens=1024, temperature=0.2, top_p=0.95),
    "thinking": GenerationSettings(max_new_tokens=4096, temperature=0.8, top_p=0.95),
    "tiny": GenerationSettings(max_new_tokens=48, temperature=0.0, top_p=0.95),
}


# ---------------------------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------------------------


class InputError(ValueError):
    """A problem with what the user sent; shown in the chat, after which the session goes on."""


@dataclass(frozen=True)
class InputLimits:
    max_images: int  # per message
    max_image_mb: float  # per image file
    max_conversation_image_mb: float  # the pixel values the model takes, for all images of one conversation


@contextmanager
def image_errors(path: Path) -> Iterator[None]:
    """Turn Pillow's errors for one upload into an InputError naming the file and the supported formats."""
    try:
        yield
    except InputError:  # already says what is wrong; not to be rewrapped as a ValueError below
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        detail = str(error).replace(f" '{path}'", "")  # the upload's temporary path means nothing to the user
        raise InputError(
            f"`{path.name}` could not be read as an image ({detail}). "
            f"Supported formats: {', '.join(SUPPORTED_IMAGE_FORMATS)}."
        ) from error


def check_image(path: str | Path, limits: InputLimits) -> tuple[int, int]:
    """Cheap checks of one upload, without decoding its pixels: file size, a supported format, the pixel count, and
    the file's own integrity checks where the format has them (PNG's checksums). Returns the image's (width, height),
    read from its header; InputError says what is wrong."""
    path = Path(path)
    try:
        megabytes = path.stat().st_size / 2**20
    except OSError as error:  # e.g. an upload that the server's temporary folder no longer holds
        raise InputError(f"`{path.name}` could not be read ({error.strerror}); please attach it again.") from error
    if megabytes > limits.max_image_mb:
        raise InputError(
            f"`{path.name}` is {megabytes:.1f} MB; images may be at most {limits.max_image_mb:g} MB each."
        )
    with image_errors(path):
        # Only these decoders are tried: any other file, whatever its name, is "not an image".
        with Image.open(path, formats=SUPPORTED_IMAGE_FORMATS) as opened:
            # Opening reads only the header. Pillow refuses more than twice MAX_IMAGE_PIXELS itself but only warns
            # below that; a decompression bomb must not be decoded at all, so the size is checked here, first.
            # (Turning the warning into an error would need `warnings.catch_warnings`, which is not thread-safe.)
            pixels = opened.width * opened.height
            if Image.MAX_IMAGE_PIXELS is not None and pixels > Image.MAX_IMAGE_PIXELS:
                raise InputError(
                    f"`{path.name}` is {opened.width}×{opened.height} = {pixels} pixels; images may have at most "
                    f"{Image.MAX_IMAGE_PIXELS} pixels."
                )
            opened.verify()
            return opened.width, opened.height


def check_images(paths: list[str], limits: InputLimits) -> None:
    """InputError for too many images in one message or for any image that `check_image` refuses."""
    if len(paths) > limits.max_images:
        raise InputError(f"This message has {len(paths)} images; at most {limits.max_images} are allowed per message.")
    for path in paths:
        check_image(path, limits)


def load_image(path: str | Path, limits: InputLimits) -> Image.Image:
    """Check, then fully decode one image (the first frame of an animation), upright as its EXIF orientation says, as
    the image processor opens files; InputError if either fails (a truncated JPEG passes the checks)."""
    check_image(path, limits)
    path = Path(path)
    with image_errors(path), Image.open(path, formats=SUPPORTED_IMAGE_FORMATS) as opened:
        opened.load()  # the pixels now live in memory; closing the file (leaving the block) keeps them
        ImageOps.exif_transpose(opened, in_place=True)  # a phone photo stored sideways is shown upright
    return opened


def check_context(prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
    if prompt_tokens + max_new_tokens > context_length:
        raise InputError(
            f"The conversation is {prompt_tokens} tokens long; with up to {max_new_tokens} new tokens it would not fit "
            f"the model's context of {context_length} tokens. Clear the chat, send fewer or smaller images, or lower "
            "'Max new tokens'."
        )


# ---------------------------------------------------------------------------------------------------------------------
# The conversation. The history is a list of plain dicts (kept in a gr.State):
#   {"role": "user", "text": str, "images": [path, ...], "accepted": bool}   accepted=False: refused, never sent
#   {"role": "assistant", "text": raw model output, "status": "streaming" | "done" | "stopped" | "length" | "failed",
#    "stats_title": str, "stats": str}
#   {"role": "notice", "text": str}                                            an error shown in the chat only
# ---------------------------------------------------------------------------------------------------------------------


def user_turn(message: dict, limits: InputLimits) -> list[dict]:
    """History entries for one submitted MultimodalTextbox value ({"text": ..., "files": [...]})."""
    text = (message.get("text") or "").strip()
    images = [str(path) for path in message.get("files") or []]
    turn = {"role": "user", "text": text, "images": images, "accepted": False}
    if not text and not images:
        return [turn, notice("The message is empty: type a question, add an image, or both.")]
    try:
        # Only checked here, not decoded: this runs outside the queue, and the session state (kept for an hour after
        # the tab closes) holds paths, not pixels. `ChatEngine.prepare` decodes the images, one generation at a time.
        check_images(images, limits)
    except InputError as error:
        return [turn, notice(f"{error} The message was not sent; the conversation goes on without it.")]
    turn["accepted"] = True
    return [turn]


def notice(text: str) -> dict:
    return {"role": "notice", "text": text}


def awaits_answer(history: list[dict]) -> bool:
    return bool(history) and history[-1]["role"] == "user" and history[-1]["accepted"]


def history_for_regenerate(history: list[dict]) -> list[dict]:
    """The history up to and including the last accepted user turn, whose answer is then generated again."""
    for index in range(len(history) - 1, -1, -1):
        if history[index]["role"] == "user" and history[index]["accepted"]:
            return history[: index + 1]
    return history + [notice("There is no question to answer again yet.")]


def model_conversation(history: list[dict]) -> tuple[list[dict], list[str]]:
    """The chat-template messages and the image paths (in prompt order) of everything the model has seen or will see.

    Refused turns and notices are left out. Only the answer of an earlier turn goes back to the model, not its
    reasoning: the reasoning would fill the context and the answer already carries its conclusion.
    """
    messages, image_paths = [], []
    for entry in history:
        if entry["role"] == "user" and entry["accepted"]:
            content = [{"type": "image"} for _ in entry["images"]]
            if entry["text"]:
                content.append({"type": "text", "text": entry["text"]})
            messages.append({"role": "user", "content": content})
            image_paths.extend(entry["images"])
        elif entry["role"] == "assistant":
            answer = split_thinking(entry["text"]).answer
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages, image_paths


def chatbot_messages(history: list[dict]) -> list[dict]:
    """What the Chatbot shows for the history: images and text of user turns; reasoning (collapsible, open while it
    streams), answer and statistics of assistant turns; notices."""
    shown = []
    for entry in history:
        if entry["role"] == "user" and entry["accepted"]:
            shown.extend({"role": "user", "content": {"path": path}} for path in entry["images"])
            if entry["text"]:
                shown.append({"role": "user", "content": entry["text"]})
        elif entry["role"] == "user":  # refused: its files may not even be images, so they are named, not shown
            attached = ", ".join(f"`{Path(path).name}`" for path in entry["images"])
            parts = [entry["text"], f"(attached: {attached})" if attached else ""]
            shown.append({"role": "user", "content": "\n\n".join(part for part in parts if part)})
        elif entry["role"] == "assistant":
            shown.extend(assistant_messages(entry))
        else:
            shown.append({"role": "assistant", "content": f"⚠ {entry['text']}"})
    return shown


# How an answer that did not end by itself says so.
ENDING_NOTES = {"stopped": " *(stopped)*", "length": " *(cut at the max new tokens setting)*", "failed": " *(failed)*"}


def assistant_messages(entry: dict) -> list[dict]:
    thinking, answer, finished_thinking = split_thinking(entry["text"])
    still_thinking = entry["status"] == "streaming" and not finished_thinking
    shown = []
    if thinking:
        shown.append(
            {
                "role": "assistant",
                "content": thinking,
                "metadata": {"title": "Thinking", "status": "pending" if still_thinking else "done"},
            }
        )
    if answer or not thinking:
        shown.append({"role": "assistant", "content": (answer or "…") + ENDING_NOTES.get(entry["status"], "")})
    if entry.get("stats"):
        shown.append(
            {
                "role": "assistant",
                "content": entry["stats"],
                "metadata": {"title": entry["stats_title"], "status": "done"},
            }
        )
    return shown


# ---------------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageInfo:
    name: str
    width: int
    height: int
    grid_rows: int
    grid_cols: int
    tokens: int


class GenerationMonitor(StoppingCriteria):
    """Counts and times the new tokens, remembers the last one, and stops generation once `stop_requested` is set.

    `generate` calls a stopping criterion once per new token, right after choosing it, which makes it the one place
    that sees every token without decoding anything. The demo generates one sequence at a time (batch size 1).
    """

    def __init__(self, stop_requested: threading.Event):
        self.stop_requested = stop_requested
        self.started_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.last_token_id: int | None = None
        self.new_tokens = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.last_token_id = int(input_ids[0, -1])
        self.new_tokens += 1
        stop = self.stop_requested.is_set()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def answer_status(monitor: GenerationMonitor, end_of_turn_id: int) -> str:
    """How a generation that did not fail ended: by itself (its last token ends the turn, even when that token was
    the last one allowed), on Stop, or else at the max new tokens setting."""
    if monitor.last_token_id == end_of_turn_id:
        return "done"
    return "stopped" if monitor.stop_requested.is_set() else "length"


def format_stats(
    images: list[ImageInfo], prompt_tokens: int, context_length: int, monitor: GenerationMonitor
) -> tuple[str, str]:
    """(title, markdown body) of an answer's statistics: per image the grid and tokens, per answer the speed."""
    lines = [
        f"- image `{info.name}`: {info.width}×{info.height} px → {info.grid_rows}×{info.grid_cols} patches → "
        f"{info.tokens} tokens"
        for info in images
    ]
    lines.append(f"- prompt: {prompt_tokens} tokens (context {context_length})")
    image_summary = "".join(f"; image {info.grid_rows}×{info.grid_cols} → {info.tokens} tokens" for info in images)
    if monitor.new_tokens == 0:
        return f"Stats: no tokens generated{image_summary}", "\n".join(lines)
    first_token_s = monitor.first_token_at - monitor.started_at
    total_s = monitor.last_token_at - monitor.started_at
    decode_s = monitor.last_token_at - monitor.first_token_at
    # The first token includes the prefill (and the images); the rate a reader feels is the decode rate after it.
    if monitor.new_tokens > 1 and decode_s > 0:
        rate = (monitor.new_tokens - 1) / decode_s
    else:
        rate = monitor.new_tokens / total_s
    lines.append(
        f"- answer: {monitor.new_tokens} tokens in {total_s:.2f} s; first token after {first_token_s:.2f} s, "
        f"then {rate:.1f} tokens/s"
    )
    return f"Stats: {monitor.new_tokens} tokens, {rate:.1f} tokens/s{image_summary}", "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints: the hub model when it can be had, else the tiny demo model built locally
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    name: str
    kind: str  # a key of DEFAULT_SETTINGS
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


def resolve_checkpoint(model: str, cache_dir: Path) -> Checkpoint:
    """Find the checkpoint to serve. Only the default model falls back (to the tiny one) when it cannot be had; a model
    asked for by name that cannot be found is an error."""
    if model == TINY_MODEL:
        return Checkpoint(ensure_tiny_checkpoint(cache_dir), "tiny demo model", "tiny")
    if Path(model).is_dir():
        folder = Path(model)  # e.g. `make tiny`'s folder: the tiny model's settings, not the real one's
        return Checkpoint(folder, folder.name, "tiny" if is_tiny_kimi_vl(folder) else model_kind(folder.name))

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


# peft writes this beside a LoRA adapter (examples/finetune.py without --merge); a model folder has config.json instead.
ADAPTER_CONFIG = "adapter_config.json"


def load_model(path: Path, dtype: torch.dtype, device: str, quantize: str | None = None) -> KimiVLForConditionalGeneration:
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
        from peft import PeftConfig, PeftModel
    except ImportError as error:
        raise SystemExit(f"{path} is a LoRA adapter; loading it needs peft: pip install -e '.[train]'") from error
    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    log(f"{path} is a LoRA adapter: loading its base model {base} and merging the adapter in")
    model = KimiVLForConditionalGeneration.from_pretrained(base, dtype=dtype, device_map=device)
    return PeftModel.from_pretrained(model, path).merge_and_unload()


# ---------------------------------------------------------------------------------------------------------------------
# The engine: processor + model, one generation at a time
# ---------------------------------------------------------------------------------------------------------------------


def expand_image_placeholders(text_ids: list[int], placeholder_id: int, image_tokens: list[int]) -> list[int]:
    """The prompt's token ids with each image's one placeholder repeated to that image's token count, in image order
    (what the processor does to `<|media_pad|>` in text, here on ids that are already sanitised)."""
    counts = iter(image_tokens)
    expanded = []
    for token_id in text_ids:
        expanded.extend([token_id] * next(counts) if token_id == placeholder_id else [token_id])
    return expanded


@dataclass
class PreparedPrompt:
    inputs: dict
    prompt_tokens: int
    new_images: list[ImageInfo] = field(default_factory=list)  # the images of the turn being answered


@dataclass(frozen=True)
class PreparedImage:
    """One image as the model takes it. Each image is decoded once per conversation, into this; the full-size decode
    is dropped at once, and these are kept (in the session's state) for the turns that follow."""

    pixel_values: torch.Tensor  # [patches, 3, patch, patch], in the model's dtype, on the CPU
    grid_hw: tuple[int, int]
    width: int
    height: int

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height


class ChatEngine:
    def __init__(
        self,
        checkpoint: Checkpoint,
        device: str,
        dtype: torch.dtype,
        limits: InputLimits,
        ignore_eos: bool = False,
        quantize: str | None = None,
    ):
        if not SANITIZING_SUPPORTED:  # every prompt is built with it: the demo would fail on the first question
            raise RuntimeError(
                "The demo encodes control tokens that users type as plain text, with transformers' "
                "apply_chat_template(sanitize_control_tokens=True), which this transformers release does not have "
                "(5.24 has it): pip install -U 'transformers>=5.24'"
            )
        self.checkpoint = checkpoint
        self.limits = limits
        # True: the end-of-turn token is never chosen, so every answer runs until Stop or the max new tokens setting.
        self.ignore_eos = ignore_eos
        log(f"loading the processor from {checkpoint.path}")
        self.processor = KimiVLProcessor.from_pretrained(checkpoint.path)
        log(f"loading {checkpoint.name} onto {device} in {dtype}" + (f", {quantize} weights" if quantize else ""))
        self.model = load_model(checkpoint.path, dtype, device, quantize)
        self.model.eval()
        self.context_length = self.model.config.text_config.max_position_embeddings
        self.end_of_turn_id = self.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.image_placeholder_id = self.model.config.media_placeholder_token_id
        pad_token_id = self.processor.tokenizer.pad_token_id
        self.pad_token_id = self.end_of_turn_id if pad_token_id is None else pad_token_id
        # Generation runs in its own thread; this lock keeps it one at a time even if a finished request's thread
        # outlives its Gradio event (a closed browser tab, for instance).
        self.generation_lock = threading.Lock()

    @property
    def default_settings(self) -> GenerationSettings:
        return DEFAULT_SETTINGS[self.checkpoint.kind]

    def prepare(
        self, history: list[dict], max_new_tokens: int, prepared_images: dict[str, PreparedImage]
    ) -> PreparedPrompt:
        """Tokenize the conversation with its images; InputError if it cannot be answered.

        Sizes first, pixels last: the prompt's length and the conversation's image budget are worked out from the
        image files' headers, with the image processor's own resize rule, and checked before any image is decoded.
        Then each image not in `prepared_images` (this conversation's images, kept from earlier turns) is decoded
        and turned into pixel values, one image at a time, and added to it; images no longer in the conversation are
        dropped from it. Runs in the queued handler, one generation at a time.
        """
        messages, image_paths = model_conversation(history)
        # Turns dropped by Regenerate, or refused after their images were decoded, take their images with them.
        for path in prepared_images.keys() - set(image_paths):
            del prepared_images[path]
        sizes = [
            prepared_images[path].size if path in prepared_images else check_image(path, self.limits)
            for path in image_paths
        ]
        # As stored: an EXIF orientation that turns an image a quarter (decoding honours it) swaps its grid's rows and
        # columns, which leaves its token count as it is.
        image_processor = self.processor.image_processor
        grids = [image_processor.get_image_grid_hw(height, width) for width, height in sizes]
        image_tokens = [self.processor.tokens_per_image(grid) for grid in grids]
        # What users type is data, never chat structure: control tokens in it are encoded as plain text, so that only
        # the template's own markers end turns or stand for images.
        text_ids = self.processor.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, sanitize_control_tokens=True
        )
        if text_ids.count(self.image_placeholder_id) != len(image_paths):  # the template writes one per image
            raise RuntimeError(f"the prompt has {text_ids.count(self.image_placeholder_id)} image placeholders for "
                               f"{len(image_paths)} images")
        # Each image's one placeholder in the text becomes its image tokens.
        prompt_tokens = len(text_ids) - len(image_paths) + sum(image_tokens)
        check_context(prompt_tokens, max_new_tokens, self.context_length)
        self.check_image_budget(grids)

        for path in image_paths:
            if path not in prepared_images:
                prepared_images[path] = self.prepare_image(path)
        images = [prepared_images[path] for path in image_paths]
        image_tokens = [self.processor.tokens_per_image(image.grid_hw) for image in images]
        input_ids = expand_image_placeholders(text_ids, self.image_placeholder_id, image_tokens)
        inputs = {"input_ids": [input_ids], "attention_mask": [[1] * len(input_ids)]}
        if images:
            inputs["pixel_values"] = torch.cat([image.pixel_values for image in images])
            inputs["image_grid_hws"] = [image.grid_hw for image in images]
        first_new = len(image_paths) - len(history[-1]["images"])  # the turn being answered comes last
        new_images = [
            ImageInfo(Path(path).name, image.width, image.height, *image.grid_hw, tokens)
            for path, image, tokens in zip(image_paths[first_new:], images[first_new:], image_tokens[first_new:])
        ]
        inputs = {name: torch.as_tensor(value).to(self.model.device) for name, value in inputs.items()}
        return PreparedPrompt(inputs, len(input_ids), new_images)

    def check_image_budget(self, grids: list[tuple[int, int]]) -> None:
        """InputError if the conversation's images, as pixel values, would take more than the per-conversation limit:
        they are kept for the whole conversation, so the limit bounds what one conversation holds."""
        patch_size = self.processor.image_processor.patch_size
        bytes_per_patch = 3 * patch_size * patch_size * self.model.dtype.itemsize
        megabytes = sum(rows * cols for rows, cols in grids) * bytes_per_patch / 2**20
        if megabytes > self.limits.max_conversation_image_mb:
            raise InputError(
                f"The {len(grids)} images of this conversation would take {megabytes:.1f} MB once prepared for the "
                f"model; a conversation may hold at most {self.limits.max_conversation_image_mb:g} MB of images. "
                "Clear the chat to start a new conversation, or send fewer images."
            )

    def prepare_image(self, path: str) -> PreparedImage:
        """Decode one image and turn it into the model's pixel values; the decoded image is released on return."""
        image = load_image(path, self.limits)
        width, height = image.size
        try:
            processed = self.processor.image_processor(image, return_tensors="pt")
        except ValueError as error:  # the processor names what it cannot handle, e.g. an extreme aspect ratio
            raise InputError(f"`{Path(path).name}` could not be prepared for the model: {error}") from error
        finally:
            image.close()  # frees the full-size pixels now, not whenever the garbage collector runs
        [grid_hw] = processed["image_grid_hws"].tolist()
        pixel_values = processed["pixel_values"].to(self.model.dtype)
        return PreparedImage(pixel_values, tuple(grid_hw), width, height)

    def stream(
        self, prepared: PreparedPrompt, settings: GenerationSettings, monitor: GenerationMonitor
    ) -> Iterator[str]:
        """Yield the answer so far, growing as tokens arrive; `monitor.stop_requested` ends it early."""
        streamer = TextIteratorStreamer(self.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
        sampling = (
            {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p}
            if settings.temperature > 0
            else {"do_sample": False}
        )
        # On CUDA the static path replays the language model from CUDA graphs. One fixed capacity (the whole context)
        # gives every request the same workspace and graphs; it costs memory (the MLA latent: ~4 GB in bf16 for
        # Kimi-VL-A3B's 128K), not speed, as decode reads only the filled slots. On CPU, plain generate() measured at
        # least as fast (benchmarks/bench_generate.py, README "Fast generation").
        cache = (
            {"cache_implementation": "static", "max_cache_len": self.context_length}
            if self.model.device.type == "cuda"
            else {}
        )
        failures: list[BaseException] = []

        def generate() -> None:
            try:
                with self.generation_lock, torch.inference_mode():
                    self.model.generate(
                        **prepared.inputs,
                        **sampling,
                        **cache,
                        max_new_tokens=settings.max_new_tokens,
                        min_new_tokens=settings.max_new_tokens if self.ignore_eos else None,
                        eos_token_id=self.end_of_turn_id,
                        pad_token_id=self.pad_token_id,
                        stopping_criteria=StoppingCriteriaList([monitor]),
                        streamer=streamer,
                    )
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread below
                failures.append(error)
                streamer.end()  # else the loop below waits forever for text that will not come

        thread = threading.Thread(target=generate, name="kimi-vl-generate", daemon=True)
        thread.start()
        text = ""
        try:
            for piece in streamer:
                text += piece
                yield text
        except GeneratorExit:
            monitor.stop_requested.set()  # the consumer went away: do not generate for nobody
            raise
        finally:
            thread.join()
        if failures:
            raise RuntimeError(f"generation failed: {failures[0]}") from failures[0]


def answer_turn(
    engine: ChatEngine,
    history: list[dict],
    prepared_images: dict[str, PreparedImage],
    stop_requested: threading.Event,
    settings: GenerationSettings,
) -> Iterator[list[dict]]:
    """The queued handler's work: answer the last user turn of `history` (changed in place), yielding it as the answer
    grows. `prepared_images` is the conversation's images as the model takes them (see `ChatEngine.prepare`). When the
    turn ends, however it ends, the memory it used is handed back."""
    if not awaits_answer(history):
        yield history
        return
    answer = {"role": "assistant", "text": "", "status": "streaming", "stats_title": "", "stats": ""}
    if stop_requested.is_set():  # Stop was pressed while this request waited in the queue
        answer["status"] = "stopped"
        history.append(answer)
        yield history
        return
    prepared = None
    try:
        try:
            prepared = engine.prepare(history, settings.max_new_tokens, prepared_images)
        except InputError as error:
            history[-1]["accepted"] = False
            history.append(notice(f"{error} The message was not sent; the conversation goes on without it."))
            yield history
            return

        history.append(answer)
        monitor = GenerationMonitor(stop_requested)
        try:
            for text in engine.stream(prepared, settings, monitor):
                answer["text"] = text
                yield history
            answer["status"] = answer_status(monitor, engine.end_of_turn_id)
        except RuntimeError as error:
            answer["status"] = "failed"
            history.append(notice(f"The model failed while answering: {error}. You can try again."))
        answer["stats_title"], answer["stats"] = format_stats(
            prepared.new_images, prepared.prompt_tokens, engine.context_length, monitor
        )
        yield history
    finally:
        prepared = None  # the turn's model inputs (a copy of its pixel values, on the model's device)
        release_memory()


def release_memory() -> None:
    """Hand memory that a finished turn freed back to the system. Decoded images and the turn's tensors are freed
    when their last reference goes, but the C allocator keeps freed blocks for reuse: without trimming, resident
    memory stays near the turn's peak (measured in benchmarks/bench_demo_memory.py)."""
    gc.collect()  # reference cycles (e.g. through a traceback of a failed turn) that still hold tensors
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if LIBC is not None:
        LIBC.malloc_trim(0)


# ---------------------------------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------------------------------


def banner_markdown(checkpoint: Checkpoint) -> str:
    if checkpoint.kind != "tiny":
        reasoning = " Its reasoning appears in a collapsible *Thinking* block above each answer."
        return f"Serving **{checkpoint.name}**." + (reasoning if checkpoint.kind == "thinking" else "")
    why = f" {checkpoint.notice}" if checkpoint.notice else ""
    return (
        "⚠ **Tiny demo model with random weights: its answers are random text.**" + why + " It shows how the demo "
        "works (uploads, streaming, statistics) without the real checkpoint; run `python app.py --model "
        f"{DEFAULT_MODEL}` where the hub or a local copy is available for real answers."
    )


def build_demo(engine: ChatEngine) -> gr.Blocks:
    defaults = engine.default_settings
    # While an answer is being written, only Stop stays usable: the history then has one writer at a time.
    def lock_controls(locked: bool, **textbox_changes) -> tuple:
        """Updates for the message box, Regenerate and Clear."""
        usable = not locked
        return (
            gr.update(interactive=usable, **textbox_changes),
            gr.update(interactive=usable),
            gr.update(interactive=usable),
        )

    # Each request for an answer gets its own stop event (a gr.State, so one per browser session), created before the
    # request joins the queue: Stop then also reaches an answer that is still waiting for its turn.
    def add_message(message: dict, history: list[dict]):
        history = history + user_turn(message, engine.limits)
        return *lock_controls(True, value=None), history, chatbot_messages(history), threading.Event()

    def respond(
        history: list[dict],
        prepared_images: dict[str, PreparedImage],
        stop_requested: threading.Event,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
    ):
        settings = GenerationSettings(int(max_new_tokens), float(temperature), float(top_p))
        for history in answer_turn(engine, history, prepared_images, stop_requested, settings):
            yield history, chatbot_messages(history), prepared_images

    def stop(stop_requested: threading.Event | None) -> None:
        if stop_requested is not None:  # None: nothing was asked in this session yet
            stop_requested.set()

    def regenerate(history: list[dict]):
        history = history_for_regenerate(history)
        return *lock_controls(True), history, chatbot_messages(history), threading.Event()

    def clear():
        return [], [], {}

    with gr.Blocks(title="Kimi-VL demo", delete_cache=UPLOAD_CACHE_CLEANUP) as demo:
        gr.Markdown("# Kimi-VL\nAsk about one or more images: upload, paste or drag them into the box below.")
        gr.Markdown(banner_markdown(engine.checkpoint), elem_id="model-banner")
        history = gr.State([])
        # The conversation's images as the model takes them (path -> PreparedImage), filled by the queued handler.
        prepared_images = gr.State({})
        stop_requested = gr.State(None)
        chatbot = gr.Chatbot(label="Chat", height=520, elem_id="chat")
        textbox = gr.MultimodalTextbox(
            placeholder="Ask something about your images…",
            file_types=["image"],
            file_count="multiple",
            show_label=False,
            autofocus=True,
            elem_id="message",
        )
        with gr.Row():
            stop_button = gr.Button("Stop", variant="stop")
            regenerate_button = gr.Button("Regenerate")
            clear_button = gr.Button("Clear")
        with gr.Accordion("Generation settings", open=False):
            max_new_tokens = gr.Slider(
                1, min(engine.context_length, 32768), value=defaults.max_new_tokens, step=1, label="Max new tokens"
            )
            temperature = gr.Slider(0.0, 2.0, value=defaults.temperature, step=0.05, label="Temperature (0: greedy)")
            top_p = gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p")
        settings = [max_new_tokens, temperature, top_p]

        controls = [textbox, regenerate_button, clear_button]

        def then_respond(event, api_name):
            # Every generation shares one slot ("model"), so the model serves one at a time and the queue shows the
            # others their position.
            answered = event.then(
                respond, [history, prepared_images, stop_requested, *settings], [history, chatbot, prepared_images],
                concurrency_limit=1, concurrency_id="model", api_name=api_name,
            )
            answered.then(lambda: lock_controls(False), None, controls, api_visibility="private")

        submitted = textbox.submit(
            add_message, [textbox, history], [*controls, history, chatbot, stop_requested], queue=False,
            api_name="add_message",
        )
        then_respond(submitted, api_name="respond")
        regenerated = regenerate_button.click(
            regenerate, history, [*controls, history, chatbot, stop_requested], queue=False, api_visibility="private"
        )
        then_respond(regenerated, api_name="regenerate_respond")
        stop_button.click(stop, stop_requested, None, queue=False, api_name="stop")
        clear_button.click(clear, None, [history, chatbot, prepared_images], queue=False, api_visibility="private")
    return demo


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"hub id or local folder (default {DEFAULT_MODEL}); '{TINY_MODEL}': the tiny demo model")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="also publish a temporary public gradio.live link")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--quantize", choices=KimiVLWeightOnlyConfig.SCHEMES,
                        help="load the language model's weights as int8 (per channel; Kimi-VL-A3B fits a 24 GB GPU) or "
                             "int4 (groups of 128 inputs)")  # fmt: skip
    parser.add_argument("--max-image-mb", type=float, default=20.0, help="largest accepted image file (default 20)")
    parser.add_argument("--max-images", type=int, default=8, help="most images in one message (default 8)")
    parser.add_argument("--max-conversation-image-mb", type=float, default=512.0,
                        help="most memory the images of one conversation may take once prepared for the model; each "
                             "image is decoded once and kept as pixel values for the following turns (default 512)")
    parser.add_argument("--queue-size", type=int, default=16, help="most requests waiting for the model (default 16)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="never end an answer at the end-of-turn token: every answer runs until Stop or the max new "
                             "tokens setting (for measuring speed at a fixed length, and for the demo's Stop test)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help=f"where the tiny demo checkpoint is built (default {DEFAULT_CACHE_DIR})")
    args = parser.parse_args(argv)
    for name in ("max_image_mb", "max_images", "max_conversation_image_mb", "queue_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but torch sees no CUDA device; use --device cpu or auto")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device == "cuda" else torch.float32)
    checkpoint = resolve_checkpoint(args.model, args.cache_dir)
    limits = InputLimits(args.max_images, args.max_image_mb, args.max_conversation_image_mb)
    engine = ChatEngine(checkpoint, device, dtype, limits, ignore_eos=args.ignore_eos, quantize=args.quantize)
    log(f"ready: {checkpoint.name} ({checkpoint.kind}), context {engine.context_length} tokens")
    demo = build_demo(engine)
    demo.queue(max_size=args.queue_size)
    # Gradio refuses larger uploads itself (HTTP 413) before storing them; add_message names the limit for those that
    # arrive another way.
    max_upload_bytes = int(args.max_image_mb * 2**20)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, max_file_size=max_upload_bytes)


if __name__ == "__main__":
    main()
