"""Training data for Kimi-VL: chat conversations in the messages format -> padded batches with labels on the answers.

A conversation is rendered with the processor's chat template one assistant turn at a time: the text before a turn's
answer (everything up to `<|im_assistant|>assistant<|im_middle|>`) and the answer itself (its content and the turn's
closing `<|im_end|>`) are separate pieces. The pieces are cut where the template puts special tokens, which the
tokenizer never merges with neighbouring text, so tokenizing them one by one gives exactly the ids of the whole
conversation, and every id is known to be inside or outside an answer without searching decoded text.
"""

from __future__ import annotations

import functools
import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from jinja2 import TemplateError
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_utils import load_image

from .processing_kimi_vl import KimiVLProcessor

if TYPE_CHECKING:
    from diskcache import Cache

IGNORE_INDEX = -100  # the label the loss skips (transformers' convention)
URL_PREFIXES = ("http://", "https://")
FETCH_TIMEOUT_S = 60  # per image URL: a host that does not answer is a failed fetch, not a hung run
# The largest image body fetched: a URL that points at something larger is a failed fetch, read no further (a 16-bit
# 8K x 8K RGBA PNG, uncompressed, is 512 MiB).
MAX_FETCH_BYTES = 512 * 2**20


class ImageUrlCache:
    """An on-disk cache of fetched image bytes, keyed by URL, for `load_chat_jsonl` and `KimiVLDataCollator`: each URL
    is fetched once, then read from `folder` in every epoch, data-loader worker and process of a run (diskcache is
    process-safe). It holds at most about `max_bytes`: past that, the least recently used images are dropped (and
    fetched again when next needed). It keeps the bytes as fetched, and only those that decode as an image; never
    the decoded images. The folder is made at the first URL."""

    def __init__(self, folder: str | Path, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"the image cache needs a size of at least 1 byte, got {max_bytes}.")
        try:
            from diskcache import Cache  # the `train` extra; the rest of the package needs none
        except ImportError as error:  # said here, not as the reason every example with a URL is a bad one
            raise ImportError(
                'ImageUrlCache needs diskcache, which the `train` extra installs: pip install -e ".[train]"'
            ) from error
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self._cache_class = Cache

    def read(self, url: str) -> bytes:
        content = self._cache.get(url)
        if content is None:
            content = fetch_url(url)  # a failed fetch raises, so it is never cached
            # Nor is a body that is not an image (a login or error page served with status 200): every later read,
            # in this run and in the next ones into the same folder, would get it back instead of fetching again.
            decode_image(content)
            self._cache.set(url, content)
        return content

    @functools.cached_property
    def _cache(self) -> Cache:
        return self._cache_class(str(self.folder), size_limit=self.max_bytes, eviction_policy="least-recently-used")


def decode_image(content: bytes) -> Image.Image:
    """An image file's bytes, decoded as transformers' `load_image` decodes them (upright by EXIF orientation, RGB)."""
    return load_image(Image.open(BytesIO(content)))


def fetch_url(url: str) -> bytes:
    """The body of a GET of `url`; an error for no answer within FETCH_TIMEOUT_S, an HTTP error status, or a body over
    MAX_FETCH_BYTES (read no further than one byte past it)."""
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
        body = response.read(MAX_FETCH_BYTES + 1)
    if len(body) > MAX_FETCH_BYTES:
        raise ValueError(f"the body is larger than {MAX_FETCH_BYTES} bytes (MAX_FETCH_BYTES), too large for an image")
    return body


@dataclass
class EncodedChat:
    """One conversation as model inputs: `labels` equals `input_ids` on answer tokens and is IGNORE_INDEX elsewhere."""

    input_ids: list[int]
    labels: list[int]
    pixel_values: torch.Tensor | None  # [patches, 3, 14, 14] of this conversation's images, in order
    image_grid_hws: torch.Tensor | None  # [images, 2]


def chat_images(messages: Sequence[dict]) -> list:
    """The images of a conversation in the order of their placeholders: the `image` value of every image item."""
    images = []
    for message in messages:
        content = message.get("content")
        for item in content if isinstance(content, list) else []:
            if isinstance(item, dict) and item.get("type") == "image":
                if "image" not in item:
                    raise ValueError(
                        f"an image item of a {message.get('role')} turn has no 'image' key (got keys "
                        f'{sorted(item)}); write {{"type": "image", "image": "path/or/url"}}.'
                    )
                images.append(item["image"])
    return images


def chat_pieces(processor: KimiVLProcessor, messages: Sequence[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive `(text, is_answer)` pieces; their concatenation is the whole text."""
    if not messages:
        raise ValueError("the conversation has no messages.")

    def render(turns, add_generation_prompt=False) -> str:
        return processor.apply_chat_template(list(turns), tokenize=False, add_generation_prompt=add_generation_prompt)

    pieces, rendered = [], ""
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if index == 0:
            raise ValueError("the conversation starts with an assistant turn; a user (or system) turn must come first.")
        prompt = render(messages[:index], add_generation_prompt=True)
        with_answer = render(messages[: index + 1])
        # Each turn's text must extend the previous one; a template that rewrites earlier turns cannot be cut this way.
        if not prompt.startswith(rendered) or not with_answer.startswith(prompt):
            raise ValueError(
                "the chat template does not render this conversation turn by turn; cannot find the answers."
            )
        pieces += [(prompt[len(rendered) :], False), (with_answer[len(prompt) :], True)]
        rendered = with_answer
    if not pieces:
        raise ValueError("the conversation has no assistant turn, so there is nothing to train on.")
    whole = render(messages)
    if len(whole) > len(rendered):  # turns after the last answer are context without labels
        pieces.append((whole[len(rendered) :], False))
    return pieces


def encode_chat(
    processor: KimiVLProcessor, messages: Sequence[dict], image_cache: ImageUrlCache | None = None
) -> EncodedChat:
    """Tokenize one conversation with its images (placeholders expanded by the processor) and label its answers.
    Image URLs are fetched, or read from `image_cache` (an `ImageUrlCache`) when it has them."""
    pieces = chat_pieces(processor, messages)
    images = [_fetch(image, image_cache) if _is_url(image) else image for image in chat_images(messages)]
    encoded = processor(text=[text for text, _ in pieces], images=images or None, padding=False)
    input_ids, labels = [], []
    for ids, (_, is_answer) in zip(encoded["input_ids"], pieces):
        input_ids += ids
        # Answers are labelled, except for image placeholders (an assistant turn may hold images too).
        labels += [token if is_answer and token != processor.image_token_id else IGNORE_INDEX for token in ids]
    return EncodedChat(input_ids, labels, encoded.get("pixel_values"), encoded.get("image_grid_hws"))


class KimiVLDataCollator:
    """Collate examples `{"messages": [...]}` into a right-padded training batch for Kimi-VL.

    The batch has `input_ids`, `attention_mask`, `labels` (token ids on every assistant answer including its
    `<|im_end|>`, IGNORE_INDEX on system and user turns, image placeholders and padding) and, when any example has
    images, `pixel_values` and `image_grid_hws` of all images in batch order. Image items hold a file path, an http(s)
    URL or a PIL image; URLs are fetched once per run when an `image_cache` (`ImageUrlCache`) is given, else at
    every use. A conversation longer than `max_length` tokens is an error, never truncated: a cut answer would teach
    the model to stop mid-sentence (check the data first, see `load_chat_jsonl`).
    """

    def __init__(
        self, processor: KimiVLProcessor, max_length: int | None = None, image_cache: ImageUrlCache | None = None
    ):
        if processor.tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer has no pad token; Kimi-VL's tokenizer defines [PAD].")
        self.processor = processor
        self.max_length = max_length
        self.image_cache = image_cache

    def __call__(self, examples: Sequence[dict]) -> BatchFeature:
        if not examples:
            raise ValueError("The batch has no examples; the collator needs at least one.")
        encoded = []
        for index, example in enumerate(examples):
            try:
                encoded.append(encode_chat(self.processor, messages_of(example), self.image_cache))
            except ValueError as error:
                raise ValueError(f"example {index} of the batch: {error}") from error
        for index, chat in enumerate(encoded):
            check_length(len(chat.input_ids), self.max_length, f"example {index} of the batch")
        width = max(len(chat.input_ids) for chat in encoded)
        pad_id = self.processor.tokenizer.pad_token_id

        def right_padded(rows: list[list[int]], value: int) -> torch.Tensor:
            return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)

        batch = {
            "input_ids": right_padded([chat.input_ids for chat in encoded], pad_id),
            "attention_mask": right_padded([[1] * len(chat.input_ids) for chat in encoded], 0),
            "labels": right_padded([chat.labels for chat in encoded], IGNORE_INDEX),
        }
        with_images = [chat for chat in encoded if chat.pixel_values is not None]
        if with_images:
            batch["pixel_values"] = torch.cat([chat.pixel_values for chat in with_images])
            batch["image_grid_hws"] = torch.cat([chat.image_grid_hws for chat in with_images])
        return BatchFeature(batch)


def check_length(length: int, max_length: int | None, what: str) -> None:
    if max_length is not None and length > max_length:
        raise ValueError(
            f"{what} is {length} tokens (images included), longer than the maximum length {max_length}; it is not "
            "truncated (that would cut an answer): raise the maximum length, shorten the conversation or use smaller "
            "images."
        )


# ----------------------------------------------------------------------------------------------------------------------
# JSONL files
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadExample:
    line: int  # 1-based line number in the JSONL file
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def load_chat_jsonl(
    path: str | Path,
    processor: KimiVLProcessor,
    max_length: int | None = None,
    image_cache: ImageUrlCache | None = None,
) -> tuple[list[dict], list[BadExample]]:
    """Read a JSONL file of `{"messages": [...]}` conversations and check every one before any training.

    Image paths are read relative to the file's folder (and stored absolute in the returned examples). Each example
    is encoded once, as the collator will encode it, so everything that would fail later is found now: malformed JSON,
    a missing or unreadable image, no assistant turn, a conversation longer than `max_length`. Image URLs are fetched
    into `image_cache` when one is given (the collator given the same cache then reads them from it). Returns the good
    examples and the bad ones with their line numbers; blank lines are skipped.
    """
    path = Path(path)
    examples, bad = [], []
    with path.open("rb") as lines:  # decoded line by line, so that a line that is not UTF-8 is one bad example
        for line_number, raw_line in enumerate(lines, start=1):
            try:
                # utf-8-sig: a byte-order mark at the start of the file (some Windows editors write one) is skipped.
                line = raw_line.decode("utf-8-sig" if line_number == 1 else "utf-8")
                if not line.strip():
                    continue
                example = _parse_example(line, path.parent)
                encoded = encode_chat(processor, example["messages"], image_cache)
                check_length(len(encoded.input_ids), max_length, "the conversation")
            except (ValueError, TypeError, TemplateError) as error:
                bad.append(BadExample(line_number, str(error)))
            else:
                examples.append(example)
    return examples, bad


def messages_of(example) -> list[dict]:
    """The messages of one example `{"messages": [...]}`; ValueError, showing the example, for any other shape."""
    messages = example.get("messages") if isinstance(example, dict) else None
    if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
        raise ValueError(
            f'expected an object {{"messages": [{{"role": ..., "content": ...}}, ...]}}, got {example!r:.100}'
        )
    return messages


def _parse_example(line: str, folder: Path) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error}).") from error
    return {"messages": [_with_resolved_images(message, folder) for message in messages_of(record)]}


def _with_resolved_images(message: dict, folder: Path) -> dict:
    """A copy of `message` whose local image paths are absolute (relative ones are read from `folder`) and exist."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    items = []
    for item in content:
        if isinstance(item, dict) and item.get("type") == "image" and isinstance(item.get("image"), str):
            image = item["image"]
            if not _is_url(image):
                resolved = folder / image
                if not resolved.is_file():
                    raise ValueError(f"image file {image!r} not found (looked for {resolved}).")
                item = {**item, "image": str(resolved)}
        items.append(item)
    return {**message, "content": items}


def _fetch(url: str, image_cache: ImageUrlCache | None):
    """The image at `url`, decoded by `decode_image`."""
    try:
        return decode_image(image_cache.read(url) if image_cache is not None else fetch_url(url))
    except Exception as error:  # noqa: BLE001 - network, HTTP and decoding failures all mean "no image from here"
        raise ValueError(f"image {url!r} could not be fetched and read: {error}") from error


def _is_url(image) -> bool:
    return isinstance(image, str) and image.startswith(URL_PREFIXES)


__all__ = [
    "IGNORE_INDEX",
    "BadExample",
    "EncodedChat",
    "ImageUrlCache",
    "KimiVLDataCollator",
    "chat_images",
    "chat_pieces",
    "encode_chat",
    "load_chat_jsonl",
]
