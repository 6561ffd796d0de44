"""Kimi-VL web demo: multimodal chat with streamed answers and a live view of a Thinking model's reasoning.

    python app.py                        # Kimi-VL-A3B-Instruct if cached or downloadable, else the tiny demo model
    python app.py --model tiny           # the built-in tiny model: random weights, so random answers; no download
    python app.py --model moonshotai/Kimi-VL-A3B-Thinking-2506 --device cuda
    python app.py --model tiny --ignore-eos  # every answer runs to Stop or the max new tokens setting

The page is served on 127.0.0.1 unless --host says otherwise; a public --share link is opt-in. The model serves one
generation at a time; other users wait in a bounded queue and see their position.

This file is the command line and the Gradio page: its layout (`build_page`), the handlers its events run
(`ChatHandlers`) and the wiring between them (`wire_events`). The logic those handlers call lives in kimi_vl_demo/
(input checks, the conversation, checkpoints, the engine, statistics), in plain functions that take no Gradio part.
"""

from __future__ import annotations

import argparse
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import torch

from kimi_vl_demo import log
from kimi_vl_demo.checkpoints import DEFAULT_MODEL, TINY_MODEL, Checkpoint, resolve_checkpoint
from kimi_vl_demo.conversation import PreparedImage, chatbot_messages, history_for_regenerate, user_turn
from kimi_vl_demo.engine import ChatEngine, GenerationSettings, answer_turn
from kimi_vl_demo.inputs import InputLimits
from modeling_kimi_vl import KimiVLWeightOnlyConfig

DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kimi-vl-hf"
# Uploads are kept in Gradio's cache while a conversation may still show them, then deleted: every hour, the files
# older than a day ((frequency, age) in seconds, Gradio's `delete_cache`).
UPLOAD_CACHE_CLEANUP = (3600, 24 * 3600)


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


@dataclass(frozen=True)
class ChatPage:
    """The page's components: the session's state and what users see and use."""

    history: gr.State  # the conversation (see kimi_vl_demo/conversation.py)
    prepared_images: gr.State  # its images as the model takes them (path -> PreparedImage), filled by `respond`
    stop_requested: gr.State  # the threading.Event of the latest request for an answer; None before the first
    chatbot: gr.Chatbot
    textbox: gr.MultimodalTextbox
    stop_button: gr.Button
    regenerate_button: gr.Button
    clear_button: gr.Button
    settings: tuple[gr.Slider, ...]  # max new tokens, temperature, top-p: the last inputs of `ChatHandlers.respond`

    @property
    def controls(self) -> list[gr.components.Component]:
        """The controls locked while an answer is being written, in the order of `lock_controls`' updates."""
        return [self.textbox, self.regenerate_button, self.clear_button]


def build_page(engine: ChatEngine) -> ChatPage:
    """Lay out the page's components (inside a gr.Blocks); the sliders start at the served model's defaults."""
    defaults = engine.default_settings
    gr.Markdown("# Kimi-VL\nAsk about one or more images: upload, paste or drag them into the box below.")
    gr.Markdown(banner_markdown(engine.checkpoint), elem_id="model-banner")
    history, prepared_images, stop_requested = gr.State([]), gr.State({}), gr.State(None)
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
    return ChatPage(
        history=history,
        prepared_images=prepared_images,
        stop_requested=stop_requested,
        chatbot=chatbot,
        textbox=textbox,
        stop_button=stop_button,
        regenerate_button=regenerate_button,
        clear_button=clear_button,
        settings=(max_new_tokens, temperature, top_p),
    )


def lock_controls(locked: bool, **textbox_changes) -> tuple:
    """Updates for the message box, Regenerate and Clear. While an answer is being written, only Stop stays usable:
    the history then has one writer at a time."""
    usable = not locked
    return (
        gr.update(interactive=usable, **textbox_changes),
        gr.update(interactive=usable),
        gr.update(interactive=usable),
    )


class ChatHandlers:
    """What the page's events run. The session's state comes in as inputs and goes back as outputs; the engine is the
    one thing the handlers share.

    Each request for an answer gets its own stop event (a gr.State, so one per browser session), created before the
    request joins the queue: Stop then also reaches an answer that is still waiting for its turn.
    """

    def __init__(self, engine: ChatEngine):
        self.engine = engine

    def add_message(self, message: dict, history: list[dict]):
        history = history + user_turn(message, self.engine.limits)
        return *lock_controls(True, value=None), history, chatbot_messages(history), threading.Event()

    def regenerate(self, history: list[dict]):
        history = history_for_regenerate(history)
        return *lock_controls(True), history, chatbot_messages(history), threading.Event()

    def respond(
        self,
        history: list[dict],
        prepared_images: dict[str, PreparedImage],
        stop_requested: threading.Event,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
    ):
        settings = GenerationSettings(int(max_new_tokens), float(temperature), float(top_p))
        for updated in answer_turn(self.engine, history, prepared_images, stop_requested, settings):
            yield updated, chatbot_messages(updated), prepared_images

    @staticmethod
    def unlock_controls() -> tuple:
        return lock_controls(False)

    @staticmethod
    def stop(stop_requested: threading.Event | None) -> None:
        if stop_requested is not None:  # None: nothing was asked in this session yet
            stop_requested.set()

    @staticmethod
    def clear():
        return [], [], {}


def wire_events(page: ChatPage, handlers: ChatHandlers) -> None:
    """Connect the page's events to the handlers. Adding a question and Stop skip the queue; answers wait in it."""
    question_outputs = [*page.controls, page.history, page.chatbot, page.stop_requested]  # add_message, regenerate
    submitted = page.textbox.submit(
        handlers.add_message, [page.textbox, page.history], question_outputs, queue=False, api_name="add_message"
    )
    respond_after(submitted, page, handlers, api_name="respond")
    regenerated = page.regenerate_button.click(
        handlers.regenerate, page.history, question_outputs, queue=False, api_visibility="private"
    )
    respond_after(regenerated, page, handlers, api_name="regenerate_respond")
    page.stop_button.click(handlers.stop, page.stop_requested, None, queue=False, api_name="stop")
    page.clear_button.click(
        handlers.clear, None, [page.history, page.chatbot, page.prepared_images], queue=False, api_visibility="private"
    )


def respond_after(event, page: ChatPage, handlers: ChatHandlers, api_name: str) -> None:
    """Answer the question that `event` added, then unlock the controls, however the answer ended."""
    # Every generation shares one slot ("model"), so the model serves one at a time and the queue shows the others
    # their position.
    answered = event.then(
        handlers.respond,
        [page.history, page.prepared_images, page.stop_requested, *page.settings],
        [page.history, page.chatbot, page.prepared_images],
        concurrency_limit=1,
        concurrency_id="model",
        api_name=api_name,
    )
    answered.then(handlers.unlock_controls, None, page.controls, api_visibility="private")


def build_demo(engine: ChatEngine) -> gr.Blocks:
    with gr.Blocks(title="Kimi-VL demo", delete_cache=UPLOAD_CACHE_CLEANUP) as demo:
        wire_events(build_page(engine), ChatHandlers(engine))
    return demo


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"hub id or local folder (default {DEFAULT_MODEL}); '{TINY_MODEL}': the tiny demo model",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--share", action="store_true", help="also publish a temporary public gradio.live link")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument("--quantize", choices=KimiVLWeightOnlyConfig.SCHEMES,
                        help="load the language model's weights as int8 (per channel; Kimi-VL-A3B fits a 24 GB GPU) or "
                             "int4 (groups of 128 inputs)")  # fmt: skip
    parser.add_argument("--max-context", type=int,
                        help="longest conversation in tokens, new tokens included (default: the model's context, 128K "
                             "for Kimi-VL-A3B). On CUDA the cache holds this many tokens from the start: with int8 "
                             "weights on a 24 GB GPU use 32768")  # fmt: skip
    parser.add_argument("--max-image-mb", type=float, default=20.0, help="largest accepted image file (default 20)")
    parser.add_argument("--max-images", type=int, default=8, help="most images in one message (default 8)")
    parser.add_argument(
        "--max-conversation-image-mb",
        type=float,
        default=512.0,
        help="most memory the images of one conversation may take once prepared for the model; each "
        "image is decoded once and kept as pixel values for the following turns (default 512)",
    )
    parser.add_argument("--queue-size", type=int, default=16, help="most requests waiting for the model (default 16)")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="never end an answer at the end-of-turn token: every answer runs until Stop or the max new "
        "tokens setting (for measuring speed at a fixed length, and for the demo's Stop test)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help=f"where the tiny demo checkpoint is built (default {DEFAULT_CACHE_DIR})",
    )
    args = parser.parse_args(argv)
    for name in ("max_image_mb", "max_images", "max_conversation_image_mb", "queue_size"):
        if not 0 < getattr(args, name) < math.inf:  # also refuses the floats nan and inf, which are no limits
            parser.error(f"--{name.replace('_', '-')} must be a positive finite number, got {getattr(args, name)}")
    if args.max_context is not None and args.max_context <= 0:
        parser.error(f"--max-context must be a positive number of tokens, got {args.max_context}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but torch sees no CUDA device; use --device cpu or auto")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device == "cuda" else torch.float32)
    checkpoint = resolve_checkpoint(args.model, args.cache_dir)
    limits = InputLimits(args.max_images, args.max_image_mb, args.max_conversation_image_mb)
    engine = ChatEngine(checkpoint, device, dtype, limits, ignore_eos=args.ignore_eos, quantize=args.quantize,
                        max_context=args.max_context)  # fmt: skip
    log(f"ready: {checkpoint.name} ({checkpoint.kind}), context {engine.context_length} tokens")
    demo = build_demo(engine)
    demo.queue(max_size=args.queue_size)
    # Gradio refuses larger uploads itself (HTTP 413) before storing them; add_message names the limit for those that
    # arrive another way.
    max_upload_bytes = int(args.max_image_mb * 2**20)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, max_file_size=max_upload_bytes)


if __name__ == "__main__":
    main()
