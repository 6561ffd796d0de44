"""Processor of Kimi-VL: chat template, image placeholder expansion, batching; and the Thinking-output splitter."""

import inspect
from pathlib import Path
from typing import NamedTuple

from transformers.processing_utils import ProcessingKwargs, ProcessorMixin

from .image_processing_kimi_vl import KimiVLImageProcessor, KimiVLImageProcessorKwargs, flatten_images
from .tokenization_kimi_vl import KimiVLTokenizer
from .transformers_compat_processing import refuse_unsupported_sanitizing

IMAGE_PLACEHOLDER = "<|media_pad|>"
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
    generation) and returns `input_ids`, `attention_mask`, `pixel_values` and `image_grid_hws`; with
    `return_mm_token_type_ids=True` also `mm_token_type_ids` (1 at image tokens, 0 elsewhere), which the model
    accepts and does not need. The expansion is transformers' (`image_token` and the `replace_image_token` hook);
    `expand_image_token_ids` does the same on token ids that are already encoded.

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
        # transformers' placeholder machinery: `__call__` expands each `image_token` in the text by the hook
        # `replace_image_token`, checks the ids with `_check_special_mm_tokens` and marks `image_token_id` in
        # `mm_token_type_ids`; with sanitize_control_tokens (5.24), placeholders typed in messages are left as text.
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

    def prepare_inputs_layout(self, images=None, text=None, videos=None, audio=None, **kwargs):
        # transformers' version also opens image paths and URLs with its `load_image`; KimiVLImageProcessor opens
        # files itself (16-bit and EXIF aware, with errors that name the image), so images are passed on as given.
        if isinstance(text, str):
            text = [text]
        elif isinstance(text, (list, tuple)):
            text = list(text)
        return images, text, videos, audio

    def validate_inputs(self, images=None, text=None, videos=None, audio=None, **kwargs):
        """Each image has one placeholder (in its own prompt when images come one list per prompt).

        `text` is the prompts as `__call__` expands them: on transformers 5.24, without the placeholders that
        sanitize_control_tokens marked as typed by a user (those stay text); transformers 5.17 has no marking, and
        sanitizing is refused.
        """
        refuse_unsupported_sanitizing(kwargs)
        if not (isinstance(text, list) and text and all(isinstance(sample, str) for sample in text)):
            raise ValueError(
                f"`text` must be a string or a non-empty list of strings, got {type(text).__name__}: {text!r:.80}"
            )
        placeholder_counts = [sample.count(IMAGE_PLACEHOLDER) for sample in text]
        if _is_per_prompt(images):
            _check_images_per_prompt(placeholder_counts, images)
        image_count = 0 if images is None else len(flatten_images(images))
        if image_count and kwargs.get("split_special_tokens", self.tokenizer.split_special_tokens):
            raise ValueError(
                f"With split_special_tokens=True the tokenizer encodes {IMAGE_PLACEHOLDER} as text, so images cannot "
                "be given; leave it False (to encode user text as text, use apply_chat_template(..., "
                "sanitize_control_tokens=True), which keeps the template's placeholders)."
            )
        if sum(placeholder_counts) != image_count:
            raise ValueError(
                f"The text has {sum(placeholder_counts)} {IMAGE_PLACEHOLDER} placeholder(s) but {image_count} "
                "image(s) were given; each image needs exactly one placeholder (the chat template writes them)."
            )

    def _process_images(self, images, **kwargs):
        # One replacement per image the image processor made (its own flattening of the inputs, which takes HxW
        # arrays and mixed nesting where transformers' `make_flat_list_of_images` does not).
        if not flatten_images(images):  # an empty list, or one empty list per prompt (`[[], []]`): no images
            return {}, []
        image_inputs = self.image_processor(images, **kwargs)
        image_count = len(image_inputs["image_grid_hws"])
        return image_inputs, [self.replace_image_token(image_inputs, image_idx) for image_idx in range(image_count)]

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        """The text that stands for image `image_idx`: one placeholder per merge window of its patch grid."""
        return IMAGE_PLACEHOLDER * self.tokens_per_image(image_inputs["image_grid_hws"][image_idx].tolist())

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

    def expand_image_token_ids(self, input_ids: list[int], image_grid_hws) -> list[int]:
        """`input_ids` (one prompt, already encoded, e.g. by `apply_chat_template(..., sanitize_control_tokens=True,
        tokenize=True)`) with the i-th image token repeated `tokens_per_image` times for the i-th (rows, cols) grid
        of `image_grid_hws`: what `__call__` does to placeholders in text, for prompts kept as ids. Lists, numpy arrays
        and tensors are taken; the result is a list of ints."""
        # `tolist` gives Python ints for a tensor or an array, whose elements would stay 0-d tensors in the result.
        input_ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
        grids = [list(grid) for grid in image_grid_hws]
        if not all(isinstance(token_id, int) for token_id in input_ids):
            raise ValueError(
                f"`input_ids` must be the ids of one prompt, a flat sequence of ints; got {input_ids!r:.80}"
            )
        placeholder_count = input_ids.count(self.image_token_id)
        if placeholder_count != len(grids):
            raise ValueError(
                f"The ids have {placeholder_count} {IMAGE_PLACEHOLDER} placeholder(s) (id {self.image_token_id}) "
                f"but {len(grids)} image grid(s) were given; each image needs exactly one placeholder."
            )
        counts = iter(self.tokens_per_image(grid) for grid in grids)
        expanded = []
        for token_id in input_ids:
            expanded.extend([token_id] * next(counts) if token_id == self.image_token_id else [token_id])
        return expanded

    @property
    def model_input_names(self) -> list[str]:
        # input_ids first (Trainer and padding utilities read the first name as the main input); the default would
        # list the image processor's names first.
        return ["input_ids", "attention_mask", "pixel_values", "image_grid_hws"]


def _is_per_prompt(images) -> bool:
    """Whether `images` is given as one list per prompt (a list holding lists) rather than one flat list."""
    return isinstance(images, (list, tuple)) and any(isinstance(item, (list, tuple)) for item in images)


def _check_images_per_prompt(placeholder_counts: list[int], images: list) -> None:
    """Each prompt's placeholders must match its own images: equal totals could still pair images with the wrong
    prompt."""
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
