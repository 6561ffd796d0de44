"""Helpers shared by the tests (imported by name: tests/ is on sys.path for pytest and for the scripts run from it):
the repository root, the tiny checkpoint's placeholder id, random images, prompts with placeholder runs, the
sanitising skip marker."""

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
