"""One process of tests/test_finetune.py's data-parallel data check, launched through torchrun (gloo, CPU): every
process calls examples.finetune.read_all_data on the same JSONL and writes what it got (the examples, or the error it
stops with) to `<out>/rank<r>.json`. On every process but the main one, checking the data is made to fail loudly, so
the test also sees that only the main process checks it. This script asserts nothing itself."""

import argparse
import json
from pathlib import Path

import torch
from transformers import TrainingArguments

import examples.finetune as finetune
from image_processing import ImageUrlCache, KimiVLProcessor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processor", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--skip-bad", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    training_args = TrainingArguments(output_dir=str(args.out / "training"), use_cpu=True, report_to="none")
    rank = training_args.process_index
    if rank != 0:

        def checked_elsewhere(*call_args, **call_kwargs):
            raise AssertionError(f"process {rank} checked the data itself")

        finetune.load_chat_jsonl = checked_elsewhere
    processor = KimiVLProcessor.from_pretrained(args.processor)
    image_cache = ImageUrlCache(args.out / "image_cache", max_bytes=10**8)
    try:
        examples, _ = finetune.read_all_data(
            args.data, None, processor, 4096, args.skip_bad, image_cache, training_args
        )
        result = {"examples": examples}
    except SystemExit as error:
        result = {"error": str(error)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    # Both processes leave together, with the process group closed: one exiting while the other still holds gloo's
    # connection can abort it ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
