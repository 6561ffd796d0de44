"""Fine-tune Kimi-VL on chat conversations (JSONL, messages format) with transformers' Trainer: LoRA through peft
(default) or full fine-tuning of the language model.

    python -m examples.finetune --model moonshotai/Kimi-VL-A3B-Instruct --data train.jsonl --output out --bf16 \
        --gradient-checkpointing [--merge]
    torchrun --nproc_per_node 8 -m examples.finetune ...     # data parallel, one process per GPU

`--output` receives the adapter (peft's format) or the fully fine-tuned model, the processor files, the Trainer's
checkpoints (`checkpoint-N/`, resumed with `--resume`) and, when the data has image URLs, `image_cache/` (their fetched
bytes, read again by later runs into the same folder); `--merge` also writes `OUTPUT/merged/`: the base model with
the adapter folded in, in the original checkpoint layout (per-expert keys), ready for `python -m hub_upload export`.
"""

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments, set_seed

from hub_upload.weights import parse_size
from image_processing import ImageUrlCache, KimiVLDataCollator, KimiVLProcessor, load_chat_jsonl
from modeling_kimi_vl import KimiVLForConditionalGeneration

# The default adapter: LoRA on every linear layer of the language model's blocks (the MLA projections, the dense MLPs
# of the first layers and the shared experts of the MoE layers); the vision tower has none of these names.
LANGUAGE_MODEL_LAYER = r"language_model\.model\.layers\.\d+"
LORA_TARGET_MODULES = (
    rf"{LANGUAGE_MODEL_LAYER}\.(self_attn\.(q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj))"
)
# The routed experts are fused 3-D parameters in transformers 5 ([experts, out, in]), not nn.Linear modules: peft
# reaches them with `target_parameters` (one rank-r pair per expert).
ROUTED_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PROJECTOR = "multi_modal_projector"
VISION_TOWER = "vision_tower"
MERGED_FOLDER = "merged"
IMAGE_CACHE_FOLDER = "image_cache"  # in --output: the bytes of the data's image URLs, fetched once
DEFAULT_IMAGE_CACHE_SIZE = "10GB"
DEFAULT_LEARNING_RATE = {"lora": 2e-4, "full": 1e-5}
DEFAULT_LORA_RANK = 16
DEFAULT_LORA_ALPHA = 32
# TrainingArguments' gradient_checkpointing* are activation_checkpointing* in transformers 5.24 (the old names warn);
# older 5.x releases have only the old names.
CHECKPOINTING_ARGUMENT = next(
    name
    for name in ("activation_checkpointing", "gradient_checkpointing")
    if name in {field.name for field in dataclasses.fields(TrainingArguments)}
)


def lora_config(rank: int, alpha: int, routed_experts: bool = False, train_projector: bool = False) -> LoraConfig:
    """The documented Kimi-VL adapter. With `train_projector`, the projector is trained fully and saved with it."""
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,  # peft's parameter LoRA (routed experts) cannot apply dropout; the same for all
        target_modules=LORA_TARGET_MODULES,
        target_parameters=ROUTED_EXPERT_PARAMETERS if routed_experts else None,
        modules_to_save=[PROJECTOR] if train_projector else None,
    )


def prepare_model(model: KimiVLForConditionalGeneration, args: argparse.Namespace):
    """The model to train: an adapter on the frozen model, or the model with its vision tower frozen (and the
    projector unless `--train-projector`)."""
    if args.full:
        for name, parameter in model.named_parameters():
            frozen = name.startswith(VISION_TOWER) or (name.startswith(PROJECTOR) and not args.train_projector)
            parameter.requires_grad_(not frozen)
        return model
    config = lora_config(args.lora_rank, args.lora_alpha, args.lora_experts, args.train_projector)
    model = get_peft_model(model, config)  # LoRA weights are float32 (peft's default) whatever the base's dtype
    # peft copies the projector (--train-projector) in the base's dtype: train it in float32 as well. (Not peft's
    # cast_mixed_precision_params: it would also cast the router weights the model keeps in float32 to bfloat16.)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    return model


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters of the model as built (peft's trainable copy of the projector, with
    --train-projector, counts beside the frozen original)."""
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    return trainable, sum(parameter.numel() for parameter in model.parameters())


def read_data(
    path: Path, processor: KimiVLProcessor, max_length: int, skip_bad: bool, image_cache: ImageUrlCache
) -> list[dict]:
    """The examples of a JSONL file; SystemExit listing the bad ones unless --skip-bad-examples."""
    if not path.is_file():
        raise SystemExit(f"error: {path} is not a file (expected JSONL, one conversation per line).")
    examples, bad = load_chat_jsonl(path, processor, max_length, image_cache)
    if bad and not skip_bad:
        listing = "\n".join(f"  {path}:{problem}" for problem in bad)
        raise SystemExit(
            f"error: {len(bad)} bad example(s) in {path}; nothing was trained (--skip-bad-examples skips them):\n"
            f"{listing}"
        )
    if bad:
        print(f"skipped {len(bad)} bad example(s) of {len(bad) + len(examples)} in {path}:", file=sys.stderr)
        print("\n".join(f"  {path}:{problem}" for problem in bad), file=sys.stderr)
    if not examples:
        raise SystemExit(f"error: {path} has no usable example.")
    return examples


def training_arguments(args: argparse.Namespace, has_eval: bool) -> TrainingArguments:
    method = "full" if args.full else "lora"
    checkpointing = {
        CHECKPOINTING_ARGUMENT: True,
        f"{CHECKPOINTING_ARGUMENT}_kwargs": {"use_reentrant": False},  # frozen embeddings: no input needs a gradient
    }
    return TrainingArguments(
        output_dir=str(args.output),
        max_steps=args.max_steps if args.max_steps is not None else -1,
        num_train_epochs=args.epochs if args.epochs is not None else 1,
        learning_rate=args.learning_rate if args.learning_rate is not None else DEFAULT_LEARNING_RATE[method],
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation,
        **(checkpointing if args.gradient_checkpointing else {}),
        bf16=args.bf16,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=args.save_steps,
        seed=args.seed,
        # The dataset holds conversations, not model inputs: the collator needs every key of an example.
        remove_unused_columns=False,
        label_names=["labels"],  # a peft model's forward hides `labels` from the Trainer's signature inspection
        report_to="none",
        # Said explicitly on a machine without an accelerator: only then does the Trainer run torchrun's processes
        # as data-parallel CPU ranks (gloo) and accept --bf16 (CPU autocast).
        use_cpu=not torch.accelerator.is_available(),
        dataloader_num_workers=args.dataloader_workers,
    )


def save_merged(model, processor: KimiVLProcessor, folder: Path) -> Path:
    """Fold the adapter into the base weights and save in the original layout with the processor's files."""
    merged = model.merge_and_unload()
    # A projector trained in float32 on a bfloat16 base (--bf16 --train-projector) goes back to the base's dtype.
    merged.multi_modal_projector.to(merged.get_input_embeddings().weight.dtype)
    merged.save_pretrained(folder)  # converts the fused experts back to the original per-expert keys
    save_processor_in_original_layout(processor, folder)
    return folder


def save_processor_in_original_layout(processor: KimiVLProcessor, folder: Path) -> None:
    """The processor's files as a hub download of Kimi-VL has them (preprocessor_config.json, tiktoken.model,
    tokenizer_config.json, chat_template.jinja), which `hub_upload export` and older transformers read."""
    processor.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="hub id or local folder of a Kimi-VL checkpoint")
    parser.add_argument("--data", type=Path, required=True, help="training conversations, JSONL (see the README)")
    parser.add_argument("--eval-data", type=Path, help="evaluation conversations, JSONL; evaluated every --save-steps")
    parser.add_argument("--output", type=Path, required=True, help="folder for the result and the checkpoints")
    method = parser.add_mutually_exclusive_group()
    method.add_argument("--lora", action="store_true", help="train a LoRA adapter (default)")
    method.add_argument("--full", action="store_true", help="train all language model weights (vision tower frozen)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=int, help="optimizer steps to run (overrides --epochs)")
    length.add_argument("--epochs", type=float, help="passes over the data (default 1)")
    parser.add_argument(
        "--learning-rate",
        type=float,
        help=f"default {DEFAULT_LEARNING_RATE['lora']} (LoRA), {DEFAULT_LEARNING_RATE['full']} (full)",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="conversations per device per step (default 1)")
    parser.add_argument("--gradient-accumulation", type=int, default=1, help="steps accumulated per update")
    parser.add_argument(
        "--max-length",
        type=int,
        help="longest conversation in tokens, images included (default: the model's context); "
        "longer ones are bad examples, never truncated",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 mixed precision; with LoRA the frozen base weights are also stored in bfloat16",
    )
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    # The LoRA options default to None so that one given with --full can be told from its default and refused.
    lora = parser.add_argument_group("LoRA options (not with --full)")
    lora_options = [
        lora.add_argument("--lora-rank", type=int, help=f"default {DEFAULT_LORA_RANK}"),
        lora.add_argument("--lora-alpha", type=int, help=f"default {DEFAULT_LORA_ALPHA}"),
        lora.add_argument("--lora-experts", action="store_true", default=None, help="LoRA on the routed experts too"),
        lora.add_argument(
            "--merge", action="store_true", default=None, help="also write OUTPUT/merged/, original layout"
        ),
    ]
    parser.add_argument("--train-projector", action="store_true", help="also train the image projector fully")
    parser.add_argument(
        "--skip-bad-examples",
        action="store_true",
        help="skip bad examples (reported with their line numbers) instead of stopping",
    )
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output")
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--save-steps", type=int, default=500, help="checkpoint (and evaluation) interval")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dataloader-workers", type=int, default=0, help="processes preparing batches (images)")
    parser.add_argument(
        "--image-cache-size",
        default=DEFAULT_IMAGE_CACHE_SIZE,
        help=f"most disk space for the fetched bytes of image URLs, kept in OUTPUT/{IMAGE_CACHE_FOLDER}/ so that each "
        "is fetched once (also across runs into the same --output); the least recently used go past it "
        f"(default {DEFAULT_IMAGE_CACHE_SIZE})",
    )
    args = parser.parse_args(argv)
    given_lora_options = [option.option_strings[0] for option in lora_options if getattr(args, option.dest) is not None]
    if args.full and given_lora_options:
        parser.error(
            f"{', '.join(given_lora_options)}: LoRA option(s), which --full (training the whole language model, "
            "saved whole) does not use; leave them out or leave out --full"
        )
    args.lora_rank = DEFAULT_LORA_RANK if args.lora_rank is None else args.lora_rank
    args.lora_alpha = DEFAULT_LORA_ALPHA if args.lora_alpha is None else args.lora_alpha
    args.lora_experts, args.merge = bool(args.lora_experts), bool(args.merge)
    for name in (
        "max_steps",
        "batch_size",
        "gradient_accumulation",
        "max_length",
        "lora_rank",
        "lora_alpha",
        "logging_steps",
        "save_steps",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.epochs is not None and not (args.epochs > 0 and math.isfinite(args.epochs)):
        parser.error(f"--epochs must be a positive number, got {args.epochs}")
    if args.learning_rate is not None and not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        parser.error(f"--learning-rate must be a positive number, got {args.learning_rate}")
    if args.dataloader_workers < 0:
        parser.error(f"--dataloader-workers must be at least 0, got {args.dataloader_workers}")
    try:
        args.image_cache_bytes = parse_size(args.image_cache_size)
    except ValueError as error:
        parser.error(f"--image-cache-size: {error}")
    if args.resume and not any(args.output.glob("checkpoint-*")):
        parser.error(f"--resume: {args.output} has no checkpoint-* folder to resume from")
    return args


def read_all_data(
    data: Path,
    eval_data: Path | None,
    processor: KimiVLProcessor,
    max_length: int,
    skip_bad: bool,
    image_cache: ImageUrlCache,
    training_args: TrainingArguments,
) -> tuple[list[dict], list[dict] | None]:
    """The training and evaluation examples, checked by the main process alone (which also fetches their image URLs
    into the cache) and handed to the other data-parallel processes, so that every process trains on the same examples
    or stops with the same error. Were each to check the data itself, a URL that fails for one process only would give
    it a dataset of another length (the processes would then wait on each other at the end of an epoch), and an error
    in one would leave the others waiting at their next collective."""
    outcome = None
    if training_args.process_index == 0:
        try:
            examples = read_data(data, processor, max_length, skip_bad, image_cache)
            eval_examples = read_data(eval_data, processor, max_length, skip_bad, image_cache) if eval_data else None
            outcome = (examples, eval_examples, None)
        except SystemExit as error:
            outcome = (None, None, str(error))
    if training_args.world_size > 1:
        shared = [outcome]
        torch.distributed.broadcast_object_list(shared, src=0)
        (outcome,) = shared
    examples, eval_examples, error = outcome
    if error is not None:
        raise SystemExit(error)
    return examples, eval_examples


def main(argv: list[str] | None = None) -> Trainer:
    args = parse_args(argv)
    set_seed(args.seed)  # before the adapter's random initialisation (the Trainer seeds only its own steps)
    # A local base is recorded by absolute path in the adapter's config, so the adapter loads from anywhere.
    model_path = str(Path(args.model).resolve()) if Path(args.model).is_dir() else args.model
    processor = KimiVLProcessor.from_pretrained(model_path)
    # Frozen base weights need no float32 master copy: with LoRA and --bf16 they are stored in bfloat16 (the adapter
    # stays float32, peft's default); trained weights stay float32 and bf16 is autocast.
    dtype = torch.bfloat16 if args.bf16 and not args.full else torch.float32
    model = KimiVLForConditionalGeneration.from_pretrained(model_path, dtype=dtype)
    max_length = args.max_length or model.config.text_config.max_position_embeddings
    training_args = training_arguments(args, has_eval=args.eval_data is not None)

    # The check of the data fetches its image URLs into the cache: the collator reads them from there, in every
    # process and epoch.
    image_cache = ImageUrlCache(args.output / IMAGE_CACHE_FOLDER, args.image_cache_bytes)
    train_examples, eval_examples = read_all_data(
        args.data, args.eval_data, processor, max_length, args.skip_bad_examples, image_cache, training_args
    )

    model = prepare_model(model, args)
    trainable, total = count_parameters(model)
    print(f"training {trainable:,} of {total:,} parameters ({100 * trainable / total:.3f}%)", file=sys.stderr)
    trainer = Trainer(
        model=model,
        args=training_args,
        data_collator=KimiVLDataCollator(processor, max_length, image_cache),
        train_dataset=train_examples,
        eval_dataset=eval_examples,
        processing_class=processor,
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model()  # the adapter (peft's format) or the full model, with the processor
    if trainer.is_world_process_zero():
        save_processor_in_original_layout(processor, args.output)
        if args.merge:
            folder = save_merged(trainer.model, processor, args.output / MERGED_FOLDER)
            print(f"merged model written to {folder}", file=sys.stderr)
    return trainer


if __name__ == "__main__":
    main()
