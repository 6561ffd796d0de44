"""Throughput of KimiVLImageProcessor against a straightforward pipeline of the original's steps.

`original_pipeline` does what the released Kimi-VL image processor does, step by step, one image at a time,
with PIL and torch (torchvision's pad / to_tensor / normalize written out, since torchvision is not a
dependency). The tests use it as the reference for exactness; here it is the baseline for speed.

Run: .venv/bin/python benchmarks/bench_image_processor.py  (writes benchmarks/results/image_processor.json)
"""

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_seconds, write_result  # noqa: E402


def original_pipeline(
    images: list[Image.Image],
    in_token_limit: int = 4096,
    pad_input: bool = True,
    patch_size: int = 14,
    merge_kernel_size: tuple[int, int] = (2, 2),
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5),
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The released processor's algorithm, written the obvious way. Raises "Exceed pos emb" like it.

    Its padding step, `_torchvision_pad`, is a re-implementation of torchvision's pad semantics (torchvision is
    not a dependency), written independently from the processor's code path. The fixture outputs of the original
    code cover RGB and RGBA images only; agreement for other modes (L, P, CMYK, ...) rests on that
    re-implementation.
    """
    patches_per_image, grids = [], []
    for image in images:
        image = _original_rescale(image, in_token_limit, pad_input, patch_size, merge_kernel_size)
        tensor = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()
        tensor = tensor.to(torch.float32).div(255)
        mean = torch.tensor(image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(image_std, dtype=torch.float32)[:, None, None]
        tensor = (tensor - mean) / std
        channels, height, width = tensor.shape
        patches = tensor.reshape(channels, height // patch_size, patch_size, width // patch_size, patch_size)
        patches = patches.permute(1, 3, 0, 2, 4).contiguous().view(-1, channels, patch_size, patch_size)
        patches_per_image.append(patches)
        grids.append((height // patch_size, width // patch_size))
    return torch.cat(patches_per_image), torch.tensor(grids, dtype=torch.int64)


def _original_rescale(image, in_token_limit, pad_input, patch_size, merge_kernel_size):
    width, height = image.size
    if (width // patch_size) * (height // patch_size) > in_token_limit:
        scale = math.sqrt(in_token_limit / ((width // patch_size) * (height // patch_size)))
        image = image.resize((int(width * scale), int(height * scale)), Image.BICUBIC)
    if pad_input:
        width, height = image.size
        unit_h, unit_w = merge_kernel_size[0] * patch_size, merge_kernel_size[1] * patch_size
        pad_h = (unit_h - height % unit_h) % unit_h
        pad_w = (unit_w - width % unit_w) % unit_w
        image = _torchvision_pad(image, pad_w, pad_h)
    else:
        width, height = image.size
        new_width, new_height = width - width % patch_size, height - height % patch_size
        top = int(round((height - new_height) / 2.0))
        left = int(round((width - new_width) / 2.0))
        image = image.crop((left, top, left + new_width, top + new_height))
    width, height = image.size
    if width // patch_size >= 512 or height // patch_size >= 512:
        raise ValueError("Exceed pos emb")
    return image


def _torchvision_pad(image, pad_right, pad_bottom):
    """torchvision.transforms.functional.pad(image, (0, 0, right, bottom)) on a PIL image, fill 0.

    A re-implementation of torchvision's semantics, not torchvision itself: ImageOps.expand with a zero fill in
    every band of the image's mode, and for "P" images the palette kept. It is written independently from the
    processor's padding; the fixtures check it for RGB/RGBA only, other modes rest on this re-implementation.
    """
    bands = len(image.getbands())
    fill = 0 if bands == 1 else (0,) * bands
    padded = ImageOps.expand(image, border=(0, 0, pad_right, pad_bottom), fill=fill)
    if image.mode == "P":
        padded.putpalette(image.getpalette())
    return padded


def benchmark_images() -> list[Image.Image]:
    """A fixed mix of typical VLM inputs: photos, screenshots, documents, a few needing downscaling."""
    rng = np.random.default_rng(0)
    sizes = [
        (224, 224), (336, 448), (640, 480), (800, 600), (1024, 768), (768, 1024),
        (500, 375), (1000, 700), (896, 896), (1200, 800), (300, 1100), (1920, 1080),
    ]
    images = []
    for width, height in sizes:
        # Smooth content plus noise, so PNG-like statistics; values matter only for the identity check.
        gradient = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * np.ones((height, 1, 3), np.float32)
        noise = rng.integers(0, 64, (height, width, 3)).astype(np.float32)
        images.append(Image.fromarray(np.clip(gradient + noise, 0, 255).astype(np.uint8), "RGB"))
    return images


def main() -> None:
    from image_processing import KimiVLImageProcessor

    images = benchmark_images()
    processor = KimiVLImageProcessor()  # the released Instruct settings
    fast = processor(images)
    reference_pixels, reference_grids = original_pipeline(images)
    identical = torch.equal(fast["pixel_values"], reference_pixels) and torch.equal(
        fast["image_grid_hws"], reference_grids
    )
    if not identical:
        raise SystemExit("outputs differ from the original pipeline; not benchmarking")

    repeats = int(os.environ.get("BENCH_REPEATS", "7"))
    baseline_s = median_seconds(lambda: original_pipeline(images), repeats)
    fast_s = median_seconds(lambda: processor(images), repeats)
    result = {
        "description": "KimiVLImageProcessor vs straightforward PIL+torch pipeline of the original's steps",
        "images": len(images),
        "image_sizes": [list(image.size) for image in images],
        "patches": int(reference_pixels.shape[0]),
        "settings": {"in_token_limit": 4096, "pad_input": True, "mean_std": 0.5},
        "baseline_seconds_per_batch": round(baseline_s, 5),
        "processor_seconds_per_batch": round(fast_s, 5),
        "baseline_images_per_second": round(len(images) / baseline_s, 1),
        "processor_images_per_second": round(len(images) / fast_s, 1),
        "speedup": round(baseline_s / fast_s, 2),
        "statistic": f"median of {repeats} runs after one warm-up",
        "outputs_identical": identical,
        "pillow": Image.__version__,
    }
    write_result("image_processor", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
