"""Shared test fixtures: the tiny reference checkpoint (made with the original release code) and its outputs, kept in
tests/fixtures/reference_tiny/ (see its README), and the complete tiny Kimi-VL folder built from it."""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REFERENCE_DIR = Path(__file__).resolve().parent / "fixtures" / "reference_tiny"


@dataclass(frozen=True)
class OriginalImageProcessorOutput:
    """What the original image processor gave for one fixture image: the grid, and the pixel values' shape and the
    SHA-256 of their float32 bytes (the values themselves are not stored; see the fixture's README)."""

    image_grid_hws: torch.Tensor
    pixel_values_shape: tuple[int, ...]
    pixel_values_sha256: str

    def same_pixel_values(self, pixel_values: torch.Tensor) -> bool:
        """Bit for bit the original's pixel values (float32, same shape, same bytes)."""
        if pixel_values.dtype != torch.float32 or tuple(pixel_values.shape) != self.pixel_values_shape:
            return False
        data = pixel_values.detach().cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()
        return hashlib.sha256(data).hexdigest() == self.pixel_values_sha256


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return REFERENCE_DIR


@pytest.fixture(scope="session")
def reference_checkpoint(reference_dir) -> Path:
    return reference_dir / "tiny_ref"


@pytest.fixture(scope="session")
def expected(reference_dir) -> dict[str, torch.Tensor]:
    """What the original code computed for the tiny checkpoint (see the fixture's README)."""
    return load_file(reference_dir / "expected.safetensors")


@pytest.fixture(scope="session")
def improc_expected(reference_dir) -> dict[str, OriginalImageProcessorOutput]:
    """Image name (no extension) -> the original image processor's output for it, with the Instruct settings."""
    entries = json.loads((reference_dir / "improc_expected.json").read_text())
    return {
        name: OriginalImageProcessorOutput(
            image_grid_hws=torch.tensor(entry["image_grid_hws"]),
            pixel_values_shape=tuple(entry["pixel_values_shape"]),
            pixel_values_sha256=entry["pixel_values_sha256"],
        )
        for name, entry in entries.items()
    }


@pytest.fixture(scope="session")
def reference_model(reference_checkpoint):
    """The tiny reference checkpoint loaded with our classes, float32, eval mode. Shared: do not modify it."""
    from modeling_kimi_vl import KimiVLForConditionalGeneration

    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny tokenizer's two files alone (tiktoken.model, tokenizer_config.json; see
    image_processing/tiny_tokenizer.py). Shared: do not modify it."""
    from image_processing import write_tiny_tokenizer

    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tiny_kimi_vl_dir(tmp_path_factory) -> Path:
    """The complete tiny Kimi-VL folder (`make tiny`): the reference weights with tokenizer, processor and generation
    configs, in the original hub layout. Shared: copy it before modifying anything in it."""
    from modeling_kimi_vl.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-kimi-vl")
