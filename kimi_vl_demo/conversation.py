"""The conversation a browser session keeps, as plain data, and what the model and the chat see of it.

The session holds two things (each in a gr.State):

- the history, a list of plain dicts:
    {"role": "user", "text": str, "images": [path, ...], "accepted": bool}   accepted=False: refused, never sent
    {"role": "assistant", "text": raw model output, "status": "streaming" | "done" | "stopped" | "length" | "failed",
     "stats_title": str, "stats": str}
    {"role": "notice", "text": str}                                            an error shown in the chat only
- the conversation's images as the model takes them: {path: PreparedImage}, filled by `ChatEngine.prepare`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from image_processing import split_thinking

from .inputs import InputError, InputLimits, check_images


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
