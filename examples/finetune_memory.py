"""What fine-tuning Kimi-VL-A3B trains and needs in memory, computed from the real architecture on the meta device
(no weights, no download): trainable parameters of each adapter choice of examples/finetune.py, and per-device bytes
for weights, gradients and Adam states, plus an activation estimate per token.

    python -m examples.finetune_memory [--lora-rank 16] [--tokens 4096]

Data parallel (torchrun) keeps all of this on every device; only the activations depend on the batch.
"""

import argparse
from types import SimpleNamespace

import torch

from examples import finetune  # the adapter choices are finetune.py's own
from modeling_kimi_vl import KimiVLForConditionalGeneration, kimi_vl_a3b_config

GB = 1e9
# Adam keeps two float32 moments per trained parameter; trained parameters and their gradients are float32.
ADAM_BYTES, TRAINED_BYTES, GRADIENT_BYTES = 8, 4, 4


def choices(rank: int) -> dict[str, SimpleNamespace]:
    """examples/finetune.py's options for each row of the table, by the row's label."""

    def options(full=False, experts=False, projector=False):
        return SimpleNamespace(full=full, lora_rank=rank, lora_alpha=2 * rank, lora_experts=experts,
                               train_projector=projector)  # fmt: skip

    return {
        "LoRA (default)": options(),
        "LoRA + --train-projector": options(projector=True),
        "LoRA + --lora-experts": options(experts=True),
        "--full (language model)": options(full=True),
    }


def trainable_parameters(options: SimpleNamespace) -> tuple[int, int]:
    """(trainable, frozen) parameters of Kimi-VL-A3B prepared as examples/finetune.py does, built on the meta device."""
    with torch.device("meta"):
        model = finetune.prepare_model(KimiVLForConditionalGeneration(kimi_vl_a3b_config()), options)
    trainable, total = finetune.count_parameters(model)
    return trainable, total - trainable


def memory_row(trainable: int, frozen: int, full: bool) -> dict[str, float]:
    """Bytes per device as examples/finetune.py loads the model with --bf16: LoRA keeps the frozen weights in
    bfloat16 and the adapter in float32; --full keeps every weight in float32 (mixed precision)."""
    frozen_bytes = 4 if full else 2
    return {
        "weights": (frozen * frozen_bytes + trainable * TRAINED_BYTES) / GB,
        "gradients": trainable * GRADIENT_BYTES / GB,
        "adam": trainable * ADAM_BYTES / GB,
    }


def activation_bytes_per_token(config) -> dict[str, int]:
    """Estimate with --gradient-checkpointing: each decoder layer keeps its bf16 input for the backward pass (one layer
    at a time is recomputed on top of that), and the loss holds the logits in bf16, a float32 copy and the float32
    gradient of that copy (transformers upcasts logits for the cross-entropy)."""
    text = config.text_config
    return {
        "layer inputs": text.num_hidden_layers * text.hidden_size * 2,
        "logits and their gradient": text.vocab_size * (2 + 4 + 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per device per step for the estimate")
    args = parser.parse_args(argv)
    for name in ("lora_rank", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    config = kimi_vl_a3b_config()
    per_token = activation_bytes_per_token(config)
    activations = sum(per_token.values()) * args.tokens / GB
    print(f"LoRA rank {args.lora_rank}, --bf16\n")
    print("| choice | trained parameters | weights GB | gradients GB | Adam GB | sum GB | + activations GB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, options in choices(args.lora_rank).items():
        trainable, frozen = trainable_parameters(options)
        row = memory_row(trainable, frozen, options.full)
        total = sum(row.values())
        print(f"| {name} | {trainable:,} | {row['weights']:.1f} | {row['gradients']:.2f} | {row['adam']:.2f} | "
              f"{total:.1f} | {total + activations:.1f} |")  # fmt: skip
    listing = ", ".join(f"{part} {size / 1e3:.0f} KB" for part, size in per_token.items())
    print(
        f"\nactivations per token (estimate, gradient checkpointing): {listing}; "
        f"{activations:.1f} GB for {args.tokens} tokens per device"
    )


if __name__ == "__main__":
    main()
