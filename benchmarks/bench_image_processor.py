"""Throughput of KimiVLImageProcessor against a straightforward pipeline of the original's steps.

The baseline, `original_pipeline` (tests/original_reference.py), does what the released Kimi-VL image processor does,
step by step, one image at a time, with PIL and torch. The tests use it as the reference for exactness; here it is the
baseline for speed.

Run: .venv/bin/python -m benchmarks.bench_image_processor  (writes benchmarks/results/image_processor.json)
"""

import json
import os

import numpy as np
import torch
from PIL import Image

from benchmarks.common import mean_seconds, write_result
from tests.original_reference import original_pipeline


def benchmark_images() -> list[Image.Image]:
    """A fixed mix of typical VLM inputs: photos, screenshots, documents, a few needing downscaling."""
    rng = np.random.default_rng(0)
    sizes = [
        (224, 224),
        (336, 448),
        (640, 480),
        (800, 600),
        (1024, 768),
        (768, 1024),
        (500, 375),
        (1000, 700),
        (896, 896),
        (1200, 800),
        (300, 1100),
        (1920, 1080),
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
    baseline_s = mean_seconds(lambda: original_pipeline(images), repeats)
    fast_s = mean_seconds(lambda: processor(images), repeats)
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
        "statistic": f"mean of {repeats} runs after two warm-up runs (torch.utils.benchmark.Timer)",
        "outputs_identical": identical,
        "pillow": Image.__version__,
    }
    write_result("image_processor", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
