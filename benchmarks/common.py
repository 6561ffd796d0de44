"""Helpers shared by the benchmarks: machine description, timing, and writing results as JSON."""

import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.benchmark import Timer, timer

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

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


def mean_seconds(function, repeats: int) -> float:
    """Mean wall time of one `function()` call over `repeats` calls, after Timer's two warm-up calls.

    torch.utils.benchmark.Timer synchronizes the accelerator around the timed block; it runs at one thread unless told,
    so it is given this process's thread count (what the code under test uses outside a benchmark)."""
    calls = Timer(stmt="function()", globals={"function": function}, num_threads=torch.get_num_threads())
    return calls.timeit(number=repeats).mean


def seconds_of_one_call(function) -> float:
    """Wall time of one `function()` call on Timer's clock (which synchronizes the accelerator). For benchmarks whose
    variants take turns call by call, so that load changes on a shared machine hit them alike; Timer itself times
    blocks of calls to one function."""
    start = timer()
    function()
    return timer() - start


def process_status_bytes(field: str) -> int:
    """A memory field of this process's /proc/self/status (Linux), in bytes: VmRSS (resident now), VmHWM (the resident
    high-water mark since the process started or `reset_resident_peak()`), RssAnon (anonymous resident memory)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return 1024 * int(line.split()[1])  # the kernel gives kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_resident_peak() -> None:
    """Reset this process's VmHWM to its current VmRSS (Linux's /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


@contextlib.contextmanager
def scratch_folder(path: Path | None, prefix: str):
    """A folder for a benchmark's files, deleted with everything in it at the end, however the benchmark ends: a new
    temporary folder (named with `prefix`), or `path` (a --workdir), which must be absent or empty so that no one
    else's files are deleted."""
    if path is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as folder:
            yield Path(folder)
        return
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise SystemExit(f"error: --workdir {path} must be absent or an empty folder (it is deleted at the end)")
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def child_command(benchmark_file: str, *arguments: str) -> list[str]:
    """The command that runs the benchmark in `benchmark_file` (its `__file__`) again in a fresh process, the way it is
    run by hand: `python -m benchmarks.<name>`. Run it with cwd=REPO_ROOT, where `-m` finds the package."""
    return [sys.executable, "-m", f"benchmarks.{Path(benchmark_file).stem}", *arguments]


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
