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
import os
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import gradio as gr
import torch
from PIL import Image
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from image_processing import (
    KimiVLImageProcessor,
    KimiVLProcessor,
    KimiVLTokenizer,
    split_thinking,
    write_tiny_tokenizer,
)
from modeling_kimi_vl import KimiVLConfig, KimiVLForConditionalGeneration

DEFAULT_MODEL = "moonshotai/Kimi-VL-A3B-Instruct"
TINY_MODEL = "tiny"
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kimi-vl-hf"
SUPPORTED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


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


def check_image(path: str | Path, limits: InputLimits) -> None:
    """Cheap checks of one upload, without decoding its pixels: file size, a supported format, the pixel count, and
    the file's own integrity checks where the format has them (PNG's checksums). InputError says what is wrong."""
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


def check_images(paths: list[str], limits: InputLimits) -> None:
    """InputError for too many images in one message or for any image that `check_image` refuses."""
    if len(paths) > limits.max_images:
        raise InputError(f"This message has {len(paths)} images; at most {limits.max_images} are allowed per message.")
    for path in paths:
        check_image(path, limits)


def load_image(path: str | Path, limits: InputLimits) -> Image.Image:
    """Check, then fully decode one image; InputError if either fails (a truncated JPEG passes the checks)."""
    check_image(path, limits)
    path = Path(path)
    with image_errors(path), Image.open(path, formats=SUPPORTED_IMAGE_FORMATS) as opened:
        opened.load()
        return opened.copy()


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
TINY_DEMO_VERSION = 1


def tiny_demo_config(tokenizer) -> KimiVLConfig:
    """A tiny Kimi-VL with the layout of the real one (MoonViT, 2x2 merge, MLA, routed + shared experts)."""
    vision_config = {
        "patch_size": 14,
        "init_pos_emb_height": 6,
        "init_pos_emb_width": 6,
        "num_attention_heads": 3,
        "num_hidden_layers": 2,
        "hidden_size": 48,
        "intermediate_size": 80,
        "merge_kernel_size": [2, 2],
    }
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 6,
        "num_experts_per_tok": 3,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.446,
        "rope_theta": 800000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }
    return KimiVLConfig(
        vision_config=vision_config,
        text_config=text_config,
        media_placeholder_token_id=tokenizer.convert_tokens_to_ids("<|media_pad|>"),
        pad_token_id=tokenizer.pad_token_id,
    )


def write_tiny_checkpoint(folder: Path) -> None:
    write_tiny_tokenizer(folder)
    tokenizer = KimiVLTokenizer.from_pretrained(folder)
    processor = KimiVLProcessor(
        # 256 patches become at most 64 (+ padding) tokens per image: a few images fit the tiny 1024-token context.
        image_processor=KimiVLImageProcessor(in_token_limit=256),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(folder)
    torch.manual_seed(0)  # the same "random" model on every machine
    model = KimiVLForConditionalGeneration(tiny_demo_config(tokenizer))
    # Random weights pick any token; keep to printable ASCII and the end of turn, so that the random answers read as
    # text instead of stray bytes and markers.
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pieces = [tokenizer.decode([token_id], skip_special_tokens=True) for token_id in range(len(tokenizer))]
    readable = {token_id for token_id, piece in enumerate(pieces) if piece and piece.isascii() and piece.isprintable()}
    model.generation_config.suppress_tokens = sorted(set(range(len(tokenizer))) - readable - {end_of_turn})
    model.save_pretrained(folder)


def ensure_tiny_checkpoint(cache_dir: Path) -> Path:
    """The tiny demo checkpoint under cache_dir, built on first use and written atomically (a temporary folder renamed
    into place), so that an interrupted or concurrent first run never leaves a half-written checkpoint behind."""
    target = cache_dir / f"tiny-demo-v{TINY_DEMO_VERSION}"
    if target.is_dir():
        return target
    log(f"building the tiny demo checkpoint in {target} (first run only)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{target.name}-"))
    try:
        write_tiny_checkpoint(scratch)
        try:
            scratch.rename(target)
        except OSError:
            if not target.is_dir():  # not "another run finished first": a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def model_kind(name: str) -> str:
    return "thinking" if "thinking" in name.lower() else "instruct"


def resolve_checkpoint(model: str, cache_dir: Path) -> Checkpoint:
    """Find the checkpoint to serve. Only the default model falls back (to the tiny one) when it cannot be had; a model
    asked for by name that cannot be found is an error."""
    if model == TINY_MODEL:
        return Checkpoint(ensure_tiny_checkpoint(cache_dir), "tiny demo model", "tiny")
    if Path(model).is_dir():
        return Checkpoint(Path(model), Path(model).name, model_kind(Path(model).name))

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


# ---------------------------------------------------------------------------------------------------------------------
# The engine: processor + model, one generation at a time
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class PreparedPrompt:
    inputs: dict
    prompt_tokens: int
    new_images: list[ImageInfo] = field(default_factory=list)  # the images of the turn being answered


class ChatEngine:
    def __init__(
        self, checkpoint: Checkpoint, device: str, dtype: torch.dtype, limits: InputLimits, ignore_eos: bool = False
    ):
        self.checkpoint = checkpoint
        self.limits = limits
        # True: the end-of-turn token is never chosen, so every answer runs until Stop or the max new tokens setting.
        self.ignore_eos = ignore_eos
        log(f"loading the processor from {checkpoint.path}")
        self.processor = KimiVLProcessor.from_pretrained(checkpoint.path)
        log(f"loading {checkpoint.name} onto {device} in {dtype}")
        self.model = KimiVLForConditionalGeneration.from_pretrained(checkpoint.path, dtype=dtype, device_map=device)
        self.model.eval()
        self.context_length = self.model.config.text_config.max_position_embeddings
        self.end_of_turn_id = self.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        pad_token_id = self.processor.tokenizer.pad_token_id
        self.pad_token_id = self.end_of_turn_id if pad_token_id is None else pad_token_id
        # Generation runs in its own thread; this lock keeps it one at a time even if a finished request's thread
        # outlives its Gradio event (a closed browser tab, for instance).
        self.generation_lock = threading.Lock()

    @property
    def default_settings(self) -> GenerationSettings:
        return DEFAULT_SETTINGS[self.checkpoint.kind]

    def prepare(self, history: list[dict], max_new_tokens: int) -> PreparedPrompt:
        """Decode the conversation's images and tokenize it with them; InputError if it cannot be answered.

        Runs in the queued handler, one generation at a time; the decoded images live only as long as this call, and
        the prompt keeps the processor's pixel values, which it has downsized to the model's token budget per image.
        """
        messages, image_paths = model_conversation(history)
        images = [load_image(path, self.limits) for path in image_paths]
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        try:
            inputs = self.processor(text=prompt, images=images or None, return_tensors="pt")
        except ValueError as error:  # the processor names what it cannot handle, e.g. an extreme aspect ratio
            raise InputError(f"The images could not be prepared for the model: {error}") from error
        prompt_tokens = inputs["input_ids"].shape[1]
        check_context(prompt_tokens, max_new_tokens, self.context_length)

        new_paths = history[-1]["images"]
        grids = inputs["image_grid_hws"].tolist()[len(images) - len(new_paths) :] if new_paths else []
        merge_rows, merge_cols = self.model.config.vision_config.merge_kernel_size
        new_images = [
            ImageInfo(Path(path).name, image.width, image.height, rows, cols, rows * cols // (merge_rows * merge_cols))
            for path, image, (rows, cols) in zip(new_paths, images[len(images) - len(new_paths) :], grids)
        ]
        inputs = inputs.to(self.model.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        return PreparedPrompt(dict(inputs), prompt_tokens, new_images)

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
        history: list[dict], stop_requested: threading.Event, max_new_tokens: int, temperature: float, top_p: float
    ):
        if not awaits_answer(history):
            yield history, chatbot_messages(history)
            return
        answer = {"role": "assistant", "text": "", "status": "streaming", "stats_title": "", "stats": ""}
        if stop_requested.is_set():  # Stop was pressed while this request waited in the queue
            answer["status"] = "stopped"
            history.append(answer)
            yield history, chatbot_messages(history)
            return
        settings = GenerationSettings(int(max_new_tokens), float(temperature), float(top_p))
        try:
            prepared = engine.prepare(history, settings.max_new_tokens)
        except InputError as error:
            history[-1]["accepted"] = False
            history.append(notice(f"{error} The message was not sent; the conversation goes on without it."))
            yield history, chatbot_messages(history)
            return

        history.append(answer)
        monitor = GenerationMonitor(stop_requested)
        try:
            for text in engine.stream(prepared, settings, monitor):
                answer["text"] = text
                yield history, chatbot_messages(history)
            answer["status"] = answer_status(monitor, engine.end_of_turn_id)
        except RuntimeError as error:
            answer["status"] = "failed"
            history.append(notice(f"The model failed while answering: {error}. You can try again."))
        answer["stats_title"], answer["stats"] = format_stats(
            prepared.new_images, prepared.prompt_tokens, engine.context_length, monitor
        )
        yield history, chatbot_messages(history)

    def stop(stop_requested: threading.Event | None) -> None:
        if stop_requested is not None:  # None: nothing was asked in this session yet
            stop_requested.set()

    def regenerate(history: list[dict]):
        history = history_for_regenerate(history)
        return *lock_controls(True), history, chatbot_messages(history), threading.Event()

    def clear():
        return [], []

    with gr.Blocks(title="Kimi-VL demo") as demo:
        gr.Markdown("# Kimi-VL\nAsk about one or more images: upload, paste or drag them into the box below.")
        gr.Markdown(banner_markdown(engine.checkpoint), elem_id="model-banner")
        history = gr.State([])
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
                respond, [history, stop_requested, *settings], [history, chatbot],
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
        clear_button.click(clear, None, [history, chatbot], queue=False, api_visibility="private")
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
    parser.add_argument("--max-image-mb", type=float, default=20.0, help="largest accepted image file (default 20)")
    parser.add_argument("--max-images", type=int, default=8, help="most images in one message (default 8)")
    parser.add_argument("--queue-size", type=int, default=16, help="most requests waiting for the model (default 16)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="never end an answer at the end-of-turn token: every answer runs until Stop or the max new "
                             "tokens setting (for measuring speed at a fixed length, and for the demo's Stop test)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                        help=f"where the tiny demo checkpoint is built (default {DEFAULT_CACHE_DIR})")
    args = parser.parse_args(argv)
    for name in ("max_image_mb", "max_images", "queue_size"):
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
    limits = InputLimits(args.max_images, args.max_image_mb)
    engine = ChatEngine(checkpoint, device, dtype, limits, ignore_eos=args.ignore_eos)
    log(f"ready: {checkpoint.name} ({checkpoint.kind}), context {engine.context_length} tokens")
    demo = build_demo(engine)
    demo.queue(max_size=args.queue_size)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share)


if __name__ == "__main__":
    main()
