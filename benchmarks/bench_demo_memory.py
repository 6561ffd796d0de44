"""Resident memory of the demo's queued handler over a multi-image conversation, against one image's decoded size.

The claim to check: the handler holds about one decoded image at a time, not the conversation's images, and hands the
memory back when a turn ends. `answer_turn` (kimi_vl_demo/engine.py, what the Gradio handler runs) answers a
conversation of TURNS turns
with IMAGES_PER_TURN large PNGs each (6000 x 6000, a few hundred KB each, well under Pillow's pixel limit), with the
tiny demo model on the CPU; its steps are run from a thread pool, as Gradio runs a handler. Per turn: the process's
peak resident memory during the turn (VmHWM, reset before the turn through /proc/self/clear_refs) and its resident
memory after it (VmRSS), both minus the resident memory before the first turn, and divided by one image's decoded size
(Pillow holds RGB at 4 bytes a pixel: 144 MB here).

Two variants, each in a fresh process: the demo as it is, and the demo without returning freed memory to the system
at the end of a turn (`engine.LIBC = None`: no malloc_trim), the baseline for that step. Linux only (/proc).

    python -m benchmarks.bench_demo_memory [--workdir FOLDER]
"""

import argparse
import json
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from PIL import Image

from benchmarks.common import (
    REPO_ROOT,
    child_command,
    process_status_bytes,
    reset_resident_peak,
    scratch_folder,
    write_result,
)
from kimi_vl_demo import engine as demo_engine
from kimi_vl_demo.checkpoints import Checkpoint, ensure_tiny_checkpoint
from kimi_vl_demo.conversation import user_turn
from kimi_vl_demo.engine import ChatEngine, GenerationSettings, answer_turn, release_memory
from kimi_vl_demo.inputs import InputLimits

SIDE = 6000
TURNS = 3
IMAGES_PER_TURN = 3
DECODED_BYTES = SIDE * SIDE * 4
VARIANTS = ("demo", "without malloc_trim")


def write_images(folder: Path) -> list[list[str]]:
    """TURNS lists of IMAGES_PER_TURN distinct PNGs: a gradient with a bright square, compressible like a drawing."""
    gradient = Image.linear_gradient("L").resize((SIDE, SIDE))
    turns = []
    for turn in range(TURNS):
        paths = []
        for index in range(IMAGES_PER_TURN):
            image = Image.merge("RGB", (gradient, gradient.transpose(Image.Transpose.ROTATE_90), gradient))
            offset = 500 * (turn * IMAGES_PER_TURN + index)
            image.paste((255, 255, 0), (offset, offset, offset + 400, offset + 400))
            path = folder / f"turn{turn}_image{index}.png"
            image.save(path, compress_level=1)
            paths.append(str(path))
        turns.append(paths)
    return turns


def measure(variant: str, workdir: Path) -> dict:
    """Run the conversation in this process; per turn its peak and final resident memory over the start, in MB."""
    if variant == "without malloc_trim":
        demo_engine.LIBC = None  # read by release_memory when a turn ends
    checkpoint = Checkpoint(ensure_tiny_checkpoint(workdir / "cache"), "tiny demo model", "tiny")
    limits = InputLimits(max_images=IMAGES_PER_TURN, max_image_mb=50.0, max_conversation_image_mb=512.0)
    engine = ChatEngine(checkpoint, "cpu", torch.float32, limits)
    settings = GenerationSettings(max_new_tokens=4, temperature=0.0, top_p=1.0)
    turns = json.loads((workdir / "images.json").read_text())
    history, prepared_images = [], {}
    release_memory()
    start = process_status_bytes("VmRSS")
    rows = []
    with ThreadPoolExecutor(max_workers=4) as pool:  # Gradio runs each step of a handler in a worker thread
        for paths in turns:
            history += user_turn({"text": "What is in these pictures?", "files": paths}, limits)
            reset_resident_peak()
            steps = answer_turn(engine, history, prepared_images, threading.Event(), settings)
            while (history := pool.submit(next, steps, None).result()) is not None:
                last = history
            history = last
            assert history[-1]["role"] == "assistant", history[-1]
            rows.append(
                {
                    "images_in_conversation": len(prepared_images),
                    "peak_mb": (process_status_bytes("VmHWM") - start) / 2**20,
                    "after_mb": (process_status_bytes("VmRSS") - start) / 2**20,
                }
            )
    return {"start_mb": start / 2**20, "turns": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="absent or empty; default: a temporary folder")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.workdir)))
        return

    with scratch_folder(args.workdir, prefix="kimi-vl-demo-memory-") as workdir:
        compare_variants(workdir)


def compare_variants(workdir: Path) -> None:
    """Both variants in fresh processes on the images written to `workdir`; prints the table and writes the JSON."""
    (workdir / "images.json").write_text(json.dumps(write_images(workdir)))
    decoded_mb = DECODED_BYTES / 2**20
    results = {}
    for variant in VARIANTS:
        command = child_command(__file__, "--variant", variant, "--workdir", str(workdir))
        output = subprocess.run(command, cwd=REPO_ROOT, check=True, capture_output=True, text=True).stdout
        measured = json.loads(output.strip().splitlines()[-1])
        for row in measured["turns"]:
            row["peak_per_decoded_image"] = round(row["peak_mb"] / decoded_mb, 2)
            row["after_per_decoded_image"] = round(row["after_mb"] / decoded_mb, 2)
            row["peak_mb"], row["after_mb"] = round(row["peak_mb"], 1), round(row["after_mb"], 1)
        results[variant] = measured

    print(f"one decoded {SIDE}x{SIDE} image: {decoded_mb:.0f} MB; memory over the start of the conversation, per turn")
    header = ("variant", "turn", "images", "peak MB", "x image", "after MB", "x image")
    print(f"{header[0]:22s} " + " ".join(f"{name:>{width}s}" for name, width in zip(header[1:], (4, 6, 8, 7, 9, 7))))
    for variant, measured in results.items():
        for turn, row in enumerate(measured["turns"], 1):
            print(
                f"{variant:22s} {turn:4d} {row['images_in_conversation']:6d} {row['peak_mb']:8.1f} "
                f"{row['peak_per_decoded_image']:7.2f} {row['after_mb']:9.1f} {row['after_per_decoded_image']:7.2f}"
            )
    first_image = Path(json.loads((workdir / "images.json").read_text())[0][0])
    path = write_result(
        "demo_memory",
        {
            "image": f"{SIDE}x{SIDE} PNG, {first_image.stat().st_size} bytes",
            "decoded_image_mb": round(decoded_mb, 1),
            "turns": TURNS,
            "images_per_turn": IMAGES_PER_TURN,
            "variants": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
