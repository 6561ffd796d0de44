"""Processor of Kimi-VL: chat template, image placeholder expansion, batching; and the Thinking-output splitter."""

import inspect
import re
from pathlib import Path
from typing import NamedTuple

from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessingKwargs, ProcessorMixin

from .image_processing_kimi_vl import KimiVLImageProcessor, KimiVLImageProcessorKwargs
from .tokenization_kimi_vl import KimiVLTokenizer
from .transformers_compat_processing import UNMARKED_PREFIX, refuse_unsupported_sanitizing

IMAGE_PLACEHOLDER = "<|media_pad|>"
# Every placeholder in a prompt; with sanitize_control_tokens, only the ones the chat template wrote (the ones in
# message text are marked by transformers' `apply_chat_template`, and encode as plain text).
PLACEHOLDER_RE = re.compile(re.escape(IMAGE_PLACEHOLDER))
TEMPLATE_PLACEHOLDER_RE = re.compile(UNMARKED_PREFIX + re.escape(IMAGE_PLACEHOLDER))
THINK_OPEN = "◁think▷"
THINK_CLOSE = "◁/think▷"

# The image processor's own settings (its __init__ parameters): `from_pretrained` routes these to it, not the tokenizer.
IMAGE_PROCESSOR_SETTINGS = frozenset(inspect.signature(KimiVLImageProcessor.__init__).parameters) - {"self", "kwargs"}


class KimiVLProcessorKwargs(ProcessingKwargs, total=False):
    images_kwargs: KimiVLImageProcessorKwargs
    # Pad batches by default. (`_defaults` is the spelling every 5.x release reads; 5.23 also reads class attributes.)
    _defaults = {"text_kwargs": {"padding": True}}


def _packaged_chat_template() -> str | None:
    """The chat template shipped beside this file (absent when only the .py files were copied, as remote code)."""
    path = Path(__file__).with_name("chat_template.jinja")
    return path.read_text() if path.is_file() else None


class KimiVLProcessor(ProcessorMixin):
    r"""
    Kimi-VL processor: a [`KimiVLImageProcessor`], a [`KimiVLTokenizer`] and the Kimi-VL chat template.

    `processor(text=..., images=...)` replaces the i-th `<|media_pad|>` in the text(s) by rows * cols /
    (merge rows * merge cols) copies for the i-th image, tokenizes (padding a batch; `padding_side="left"` for
    generation) and returns `input_ids`, `attention_mask`, `pixel_values` and `image_grid_hws`.

    `images` is one image, a flat list (matched to the placeholders in order, across prompts), or one list per
    prompt (each prompt must then have exactly as many placeholders as its list has images).

    Text given here is taken as a rendered prompt: control tokens in it (`<|im_end|>`, `<|media_pad|>`, ...) are
    control tokens. To put user text in a prompt, use `apply_chat_template(messages, tokenize=True,
    sanitize_control_tokens=True)`, which encodes the control tokens inside messages as plain text and keeps the
    template's own (transformers' option; it needs transformers 5.24). A tokenizer loaded with
    `split_special_tokens=True` encodes every control token as text, so it cannot be given images.
    """

    valid_processor_kwargs = KimiVLProcessorKwargs

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
        if tokenizer is None:
            raise ValueError(f"KimiVLProcessor needs a tokenizer that has the {IMAGE_PLACEHOLDER} token; got None.")
        image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
        # Tokenizers map unknown tokens to their unk id (or to None when they have none).
        if image_token_id is None or image_token_id == tokenizer.unk_token_id:
            raise ValueError(
                f"The tokenizer ({type(tokenizer).__name__}) has no {IMAGE_PLACEHOLDER} token; Kimi-VL needs it as "
                "the single id that image features replace. Use the model's own tokenizer (KimiVLTokenizer)."
            )
        super().__init__(image_processor, tokenizer, chat_template=chat_template or _packaged_chat_template())
        self.image_token = IMAGE_PLACEHOLDER
        self.image_token_id = image_token_id

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        # Load the concrete classes rather than going through the Auto API: remote-code copies need no registration,
        # and transformers 5.17 gates AutoImageProcessor behind torchvision, which we do not need.
        # Image-processor settings given here override the saved ones and go to the image processor only; the
        # other kwargs (Hub access, tokenizer options) go to the tokenizer, and the Hub ones to the file lookup too.
        setting_overrides = {name: kwargs.pop(name) for name in IMAGE_PROCESSOR_SETTINGS if name in kwargs}
        saved_settings = (processor_dict or {}).get("image_processor")
        if not isinstance(saved_settings, dict):  # 5.23 saves them inside processor_config.json; others beside it
            saved_settings, _ = KimiVLImageProcessor.get_image_processor_dict(pretrained_model_name_or_path, **kwargs)
        image_processor = KimiVLImageProcessor(**{**saved_settings, **setting_overrides})
        return [image_processor, KimiVLTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)]

    def apply_chat_template(self, conversation, *args, **kwargs):
        refuse_unsupported_sanitizing(kwargs)
        return super().apply_chat_template(conversation, *args, **kwargs)

    def __call__(self, images=None, text=None, **kwargs) -> BatchFeature:
        refuse_unsupported_sanitizing(kwargs)
        texts = _as_text_list(text)
        output_kwargs = self._merge_kwargs(
            KimiVLProcessorKwargs, tokenizer_init_kwargs=self.tokenizer.init_kwargs, **kwargs
        )
        sanitized = output_kwargs["text_kwargs"].get("sanitize_control_tokens", False)
        placeholder_re = TEMPLATE_PLACEHOLDER_RE if sanitized else PLACEHOLDER_RE
        placeholder_counts = [len(placeholder_re.findall(sample)) for sample in texts]
        if _is_per_prompt(images):
            _check_images_per_prompt(placeholder_counts, images)
            if sum(placeholder_counts) == 0:  # matched per prompt, so no prompt has images (e.g. `[[], []]`)
                images = None
        placeholder_count = sum(placeholder_counts)
        image_inputs = {}
        if images is not None:
            image_inputs = dict(self.image_processor(images, **output_kwargs["images_kwargs"]))
        image_count = 0 if images is None else len(image_inputs["image_grid_hws"])
        if placeholder_count != image_count:
            raise ValueError(
                f"The text has {placeholder_count} {IMAGE_PLACEHOLDER} placeholder(s) but {image_count} image(s) "
                "were given; each image needs exactly one placeholder (the chat template writes them)."
            )
        if image_count:
            texts = self._expand_placeholders(texts, image_inputs["image_grid_hws"].tolist(), placeholder_re)
        text_inputs = self.tokenizer(texts, **output_kwargs["text_kwargs"])
        # transformers' check that every placeholder became one image-token id (not so when truncated, or when the
        # tokenizer encodes special tokens as text).
        self._check_special_mm_tokens(texts, text_inputs, modalities=["image"])
        return_tensors = output_kwargs["text_kwargs"].get("return_tensors")
        return BatchFeature(data={**text_inputs, **image_inputs}, tensor_type=return_tensors)

    def tokens_per_image(self, grid_hw: list[int]) -> int:
        """Placeholder tokens for an image with this (rows, cols) patch grid: one per merge window."""
        rows, columns = grid_hw
        merge_rows, merge_columns = self.image_processor.merge_kernel_size
        if rows % merge_rows or columns % merge_columns:
            raise ValueError(
                f"An image has a {rows}x{columns} patch grid, not divisible by the {merge_rows}x{merge_columns} "
                "merge kernel; process images with pad_input=True."
            )
        return (rows // merge_rows) * (columns // merge_columns)

    def _expand_placeholders(self, texts: list[str], grids: list[list[int]], placeholder_re: re.Pattern) -> list[str]:
        counts = iter(self.tokens_per_image(grid) for grid in grids)
        expanded = []
        for sample in texts:
            pieces = placeholder_re.split(sample)
            # Between every two pieces there was one placeholder; it becomes that image's run of placeholders.
            runs = [IMAGE_PLACEHOLDER * next(counts) for _ in pieces[1:]]
            expanded.append("".join(piece + run for piece, run in zip(pieces, [*runs, ""])))
        return expanded

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "pixel_values", "image_grid_hws"]


def _is_per_prompt(images) -> bool:
    """Whether `images` is given as one list per prompt (a list holding lists) rather than one flat list."""
    return isinstance(images, (list, tuple)) and any(isinstance(item, (list, tuple)) for item in images)


def _check_images_per_prompt(placeholder_counts: list[int], images: list) -> None:
    """Each prompt's placeholders must match its own images; equal totals could still pair images with the wrong prompt."""
    if len(images) != len(placeholder_counts):
        raise ValueError(
            f"`images` has {len(images)} per-prompt lists but `text` has {len(placeholder_counts)} prompt(s); "
            "give one list of images per prompt (an empty list for a prompt without images)."
        )
    for index, (placeholder_count, prompt_images) in enumerate(zip(placeholder_counts, images)):
        image_count = len(prompt_images) if isinstance(prompt_images, (list, tuple)) else 1
        if placeholder_count != image_count:
            raise ValueError(
                f"Prompt {index} has {placeholder_count} {IMAGE_PLACEHOLDER} placeholder(s) but {image_count} "
                "image(s) were given for it; each image needs exactly one placeholder in its own prompt."
            )


def _as_text_list(text) -> list[str]:
    if isinstance(text, str):
        return [text]
    if isinstance(text, (list, tuple)) and text and all(isinstance(sample, str) for sample in text):
        return list(text)
    raise ValueError(f"`text` must be a string or a non-empty list of strings, got {type(text).__name__}: {text!r:.80}")


class ThinkingSplit(NamedTuple):
    reasoning: str
    answer: str
    finished_thinking: bool


def split_thinking(output: str) -> ThinkingSplit:
    """Split a Kimi-VL Thinking model's output `◁think▷ reasoning ◁/think▷ answer` into its parts.

    - No markers: no reasoning; everything is the answer.
    - Only the closing marker (the prompt already opened the block): the text before it is the reasoning.
    - An opening marker but no closing one (generation stopped while thinking): all of it is reasoning,
      the answer is empty and `finished_thinking` is False.
    Text before an opening marker, if any, is kept in front of the answer. Both parts are stripped.
    """
    before, opened, rest = output.partition(THINK_OPEN)
    if not opened:
        before, rest = "", output
    reasoning, closed, after = rest.partition(THINK_CLOSE)
    if closed:
        return ThinkingSplit(reasoning.strip(), (before + after).strip(), True)
    if opened:
        return ThinkingSplit(reasoning.strip(), before.strip(), False)
    return ThinkingSplit("", output.strip(), True)


__all__ = ["KimiVLProcessor", "KimiVLProcessorKwargs", "ThinkingSplit", "split_thinking"]
