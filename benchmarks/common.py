"""Helpers shared by the benchmarks: machine description, timing, and writing results as JSON."""

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# A fixed mixed batch of image grids (rows, cols) as the image processor makes them: portrait, landscape, small,
# square, panoramic. 1712 patches in all.
MIXED_GRIDS = [(24, 16), (16, 30), (8, 8), (20, 20), (6, 40), (12, 12)]


def machine_description() -> dict:
    """What the numbers were measured on; every result file names its machine."""
    description = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # Other work on a shared machine slows baseline and candidate alike, but it widens the spread.
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    if torch.cuda.is_available():
        description["gpu"] = torch.cuda.get_device_name()
    return description


def median_seconds(function, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `function()` over `repeats` runs, after `warmup` untimed runs."""
    for _ in range(warmup):
        function()
    timings = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def write_result(name: str, result: dict) -> Path:
    """Write `result` (plus the machine) to benchmarks/results/<name>.json and return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "machine": machine_description(), **result}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_timings(rows: list[tuple[str, float]], baseline: str) -> None:
    """A table of (variant, seconds) with each variant's speed relative to the `baseline` variant (>1: faster)."""
    baseline_seconds = dict(rows)[baseline]
    width = max(len(name) for name, _ in rows) + 2
    print(f"{'variant':{width}s} {'seconds':>9s}  speed vs {baseline}")
    for name, seconds in rows:
        print(f"{name:{width}s} {seconds:9.4f}  {baseline_seconds / seconds:.2f}x")
