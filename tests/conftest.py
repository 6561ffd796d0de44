"""Shared test fixtures: the tiny reference checkpoint (made with the original release code) and its outputs."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[1]
# The CI clone has shared/ beside it, like a developer checkout; KIMI_VL_SHARED points elsewhere if needed.
SHARED_DIR = Path(os.environ.get("KIMI_VL_SHARED", REPO_ROOT.parent / "shared"))
REFERENCE_DIR = SHARED_DIR / "fixtures" / "reference_tiny"
REFERENCE_CHECKPOINT = REFERENCE_DIR / "tiny_ref"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not REFERENCE_CHECKPOINT.is_dir():
        pytest.fail(f"reference fixture not found at {REFERENCE_DIR}; set KIMI_VL_SHARED to the shared/ folder")
    return REFERENCE_DIR


@pytest.fixture(scope="session")
def reference_checkpoint(reference_dir) -> Path:
    return reference_dir / "tiny_ref"


@pytest.fixture(scope="session")
def expected(reference_dir) -> dict[str, torch.Tensor]:
    """What the original code computed for the tiny checkpoint (see the fixture's README)."""
    return load_file(reference_dir / "expected.safetensors")


@pytest.fixture(scope="session")
def reference_model(reference_checkpoint):
    """The tiny reference checkpoint loaded with our classes, float32, eval mode. Shared: do not modify it."""
    from modeling_kimi_vl import KimiVLForConditionalGeneration

    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, attn_implementation="sdpa")
    return model.eval()
