"""The demo's engine: the processor and the model, answering one conversation turn at a time.

`ChatEngine.prepare` turns a conversation into model inputs (sizes checked first, pixels decoded last, each image once
per conversation), `ChatEngine.stream` generates with streaming, and `answer_turn` is the queued handler's whole turn:
prepare, stream, record how the answer ended and its statistics, and hand the turn's memory back.
"""

from __future__ import annotations

import ctypes
import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import StoppingCriteriaList, TextIteratorStreamer

from image_processing import SANITIZING_SUPPORTED, KimiVLProcessor
from modeling_kimi_vl import KimiVLConfig

from . import log
from .checkpoints import Checkpoint, load_model, weights_source
from .conversation import PreparedImage, awaits_answer, model_conversation, notice
from .inputs import InputError, InputLimits, check_context, check_image, load_image
from .stats import GenerationMonitor, ImageInfo, answer_status, format_stats


@dataclass(frozen=True)
class GenerationSettings:
    """The sampling settings of one answer (the page's sliders)."""

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


@dataclass
class PreparedPrompt:
    """A conversation as model inputs (tensors on the model's device), ready for `ChatEngine.stream`."""

    inputs: dict
    prompt_tokens: int
    new_images: list[ImageInfo] = field(default_factory=list)  # the images of the turn being answered


class ChatEngine:
    """The processor and the model of one checkpoint, serving one generation at a time."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        device: str,
        dtype: torch.dtype,
        limits: InputLimits,
        ignore_eos: bool = False,
        quantize: str | None = None,
        max_context: int | None = None,
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
        # The longest conversation (prompt plus new tokens) accepted; on CUDA also the static cache's capacity, whose
        # MLA latent is allocated in full (about 31 KB per token for Kimi-VL-A3B in bf16: 4 GB for its 128K context).
        # Checked from the config, before minutes of loading weights.
        config = KimiVLConfig.from_pretrained(weights_source(checkpoint.path))
        model_context = config.text_config.max_position_embeddings
        if max_context is not None and not 0 < max_context <= model_context:
            raise SystemExit(
                f"--max-context {max_context} is not between 1 and the model's context of {model_context} tokens."
            )
        self.context_length = model_context if max_context is None else max_context
        log(f"loading the processor from {checkpoint.path}")
        self.processor = KimiVLProcessor.from_pretrained(checkpoint.path)
        log(f"loading {checkpoint.name} onto {device} in {dtype}" + (f", {quantize} weights" if quantize else ""))
        self.model = load_model(checkpoint.path, dtype, device, quantize)
        self.model.eval()
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
        # Sizes as stored for images not decoded yet, upright for decoded ones: an EXIF orientation that turns an image
        # a quarter (decoding honours it) swaps its grid's rows and columns, which leaves its token count as it is.
        image_processor = self.processor.image_processor
        grids = [image_processor.get_image_grid_hw(height, width) for width, height in sizes]
        # What users type is data, never chat structure: control tokens in it are encoded as plain text, so that only
        # the template's own markers end turns or stand for images.
        text_ids = self.processor.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, sanitize_control_tokens=True
        )
        # The template writes one placeholder per image; each becomes that image's tokens: the prompt's final ids.
        input_ids = self.processor.expand_image_token_ids(text_ids, grids)
        check_context(len(input_ids), max_new_tokens, self.context_length)
        self.check_image_budget(grids)

        for path in image_paths:
            if path not in prepared_images:
                prepared_images[path] = self.prepare_image(path)
        images = [prepared_images[path] for path in image_paths]
        image_tokens = [self.processor.tokens_per_image(image.grid_hw) for image in images]
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
        # On CUDA the static path replays the language model from CUDA graphs. One fixed capacity (the whole context,
        # or --max-context) gives every request the same workspace and graphs; it costs memory (the MLA latent: ~4 GB
        # in bf16 for Kimi-VL-A3B's 128K), not speed, as decode reads only the filled slots. On CPU, plain generate()
        # measured at least as fast (benchmarks/bench_generate.py, README "Fast generation").
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


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (which has `malloc_trim`); None elsewhere (macOS, musl, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - an AttributeError here means: not glibc
    except (OSError, AttributeError):
        return None
    return libc


LIBC = _glibc()
