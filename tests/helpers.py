"""Helpers shared by the tests (imported by name: tests/ is on sys.path for pytest and for the scripts run from it):
the repository root, the tiny checkpoint's placeholder id, random images, prompts with placeholder runs, the
fixture's requests and logits, the sanitising skip marker."""

from pathlib import Path

import pytest
import torch

from image_processing import SANITIZING_SUPPORTED

REPO_ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER_ID = 300  # <|media_pad|> of the tiny checkpoint

# transformers' sanitize_control_tokens (5.24; not in 5.17 and 5.18, where the tokenizer refuses it: tested).
needs_sanitizing = pytest.mark.skipif(
    not SANITIZING_SUPPORTED, reason="this transformers has no sanitize_control_tokens"
)


def random_images(grids, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values and image_grid_hws for images with the given (rows, cols) patch grids."""
    generator = torch.Generator().manual_seed(seed)
    num_patches = sum(rows * cols for rows, cols in grids)
    pixel_values = torch.randn(num_patches, 3, 14, 14, generator=generator)
    return pixel_values, torch.tensor(grids, dtype=torch.long)


def prompt_ids(grids, text=(5, 6, 7), after_each_image=None) -> list[int]:
    """Token ids: `text`, then per image its run of rows*cols/4 placeholders followed by `after_each_image` (by
    default `text` again)."""
    after = list(text if after_each_image is None else after_each_image)
    ids = list(text)
    for rows, cols in grids:
        ids += [PLACEHOLDER_ID] * (rows * cols // 4) + after
    return ids


def fixture_request(expected: dict[str, torch.Tensor], device="cpu") -> dict[str, torch.Tensor]:
    """The reference fixture's multimodal prompt with its images, as model inputs."""
    return {
        "input_ids": expected["mm_input_ids"].to(device),
        "pixel_values": expected["pixel_values"].to(device),
        "image_grid_hws": expected["image_grid_hws"].to(device),
    }


def fixture_logits(model, expected: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits on the fixture's multimodal prompt and on its text batch, as one `[positions, vocab]`."""
    with torch.no_grad():
        multimodal = model(**fixture_request(expected)).logits
        text = model(input_ids=expected["txt_input_ids"]).logits
    return torch.cat([multimodal.flatten(0, 1), text.flatten(0, 1)])
