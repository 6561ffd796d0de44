"""Per-answer statistics: `GenerationMonitor` counts and times the new tokens as `generate` chooses them (and stops
it on request), `answer_status` says how an answer ended, and `format_stats` writes the statistics shown under it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria


@dataclass(frozen=True)
class ImageInfo:
    """One image of the answered turn, as its statistics describe it: its size in pixels, patches and tokens."""

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
