"""Fine-tuning: the chat collator's labels, the LoRA run of examples/finetune.py on the tiny Kimi-VL, the saved
adapter, the merged model in the original layout, bad examples, and the demo loading an adapter."""

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT
from peft import PeftModel
from safetensors import safe_open
from transformers import Trainer

from examples import finetune, finetune_memory
from image_processing import ImageUrlCache, KimiVLDataCollator, KimiVLProcessor, load_chat_jsonl
from image_processing.data_collator_kimi_vl import IGNORE_INDEX
from modeling_kimi_vl import KimiVLForConditionalGeneration

IMAGE_TOKEN = "<|media_pad|>"
END = "<|im_end|>"


def user(*items):
    return {"role": "user", "content": list(items)}


def assistant(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def text(value):
    return {"type": "text", "text": value}


def image(path):
    return {"type": "image", "image": path}


# Training conversations; image paths are relative to the JSONL file's folder.
MULTI_TURN_MULTI_IMAGE = [
    user(image("images/tall.png"), image("images/wide.png"), text("Compare the two pictures.")),
    assistant("The first is taller than the second."),
    user(text("And the colours?")),
    assistant("Both are mostly red."),
]
TEXT_ONLY = [{"role": "system", "content": "Answer in one word."}, user(text("Name a colour.")), assistant("Blue.")]
THINKING = [user(image("images/small.png"), text("What is it?")), assistant("◁think▷It looks round.◁/think▷A ball.")]
CONVERSATIONS = [MULTI_TURN_MULTI_IMAGE, TEXT_ONLY, THINKING]


def answers(conversation) -> list[str]:
    return [message["content"][0]["text"] + END for message in conversation if message["role"] == "assistant"]


def write_jsonl(path: Path, conversations) -> Path:
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, reference_dir) -> Path:
    folder = tmp_path_factory.mktemp("finetune_data")
    (folder / "images").mkdir()
    for name, source in (("tall", "rgb_84x168"), ("wide", "rgba_90x60"), ("small", "rgb_84x168")):
        shutil.copyfile(reference_dir / "images" / f"{source}.png", folder / "images" / f"{name}.png")
    write_jsonl(folder / "train.jsonl", CONVERSATIONS)
    return folder


@pytest.fixture(scope="module")
def processor(tiny_kimi_vl_dir) -> KimiVLProcessor:
    return KimiVLProcessor.from_pretrained(tiny_kimi_vl_dir)


def labelled_runs(labels: list[int]) -> list[list[int]]:
    """The labelled tokens as maximal runs of consecutive positions."""
    runs, current = [], []
    for label in labels:
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(label)
    return runs + ([current] if current else [])


# ----------------------------------------------------------------------------------------------------------------------
# The collator
# ----------------------------------------------------------------------------------------------------------------------


def test_labels_cover_exactly_the_assistant_answers(processor, data_dir):
    examples, bad = load_chat_jsonl(data_dir / "train.jsonl", processor)
    assert bad == []
    batch = KimiVLDataCollator(processor)(examples)
    tokenizer = processor.tokenizer
    for row, conversation in enumerate(CONVERSATIONS):
        labels = batch["labels"][row].tolist()
        decoded = [tokenizer.decode(run) for run in labelled_runs(labels)]
        assert decoded == answers(conversation)  # every answer with its <|im_end|>, nothing else
        # The labelled tokens are the input tokens at those positions (the loss shifts them itself).
        input_ids = batch["input_ids"][row]
        labelled = batch["labels"][row] != IGNORE_INDEX
        assert torch.equal(batch["labels"][row][labelled], input_ids[labelled])


def test_collated_ids_are_the_whole_conversation_tokenized_with_images(processor, data_dir):
    examples, _ = load_chat_jsonl(data_dir / "train.jsonl", processor)
    batch = KimiVLDataCollator(processor)(examples)
    image_paths = [str(data_dir / "images" / name) for name in ("tall.png", "wide.png", "small.png")]
    images_per_conversation = [image_paths[:2], [], image_paths[2:]]
    expected_grids = []
    for row, (conversation, images) in enumerate(zip(examples, images_per_conversation)):
        prompt = processor.apply_chat_template(conversation["messages"], tokenize=False)
        whole = processor(text=prompt, images=images or None, padding=False)
        ids = whole["input_ids"][0]
        length = len(ids)
        assert batch["input_ids"][row, :length].tolist() == ids
        # Right padding: [PAD] after the conversation, masked out and unlabelled.
        assert (batch["input_ids"][row, length:] == processor.tokenizer.pad_token_id).all()
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (batch["input_ids"].shape[1] - length)
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all()
        if images:
            expected_grids += whole["image_grid_hws"].tolist()
    assert batch["image_grid_hws"].tolist() == expected_grids
    placeholders = batch["input_ids"] == processor.image_token_id
    assert int(placeholders.sum()) == sum(rows * cols // 4 for rows, cols in expected_grids) > 0
    assert (batch["labels"][placeholders] == IGNORE_INDEX).all()
    assert batch["pixel_values"].shape[0] == sum(rows * cols for rows, cols in expected_grids)


def test_unreachable_image_url_is_a_bad_example(processor, tmp_path):
    unreachable = "http://127.0.0.1:9/no-image.png"  # the discard port: nothing listens there
    path = write_jsonl(tmp_path / "urls.jsonl", [[user(image(unreachable), text("?")), assistant("x")]])
    examples, bad = load_chat_jsonl(path, processor)
    assert examples == [] and [problem.line for problem in bad] == [1]
    assert f"image {unreachable!r} could not be fetched" in bad[0].reason


@pytest.fixture
def image_server(data_dir):
    """An HTTP server on this machine serving `data_dir`'s images, a login page at /login (status 200) and 404 for any
    other path, counting the requests of each path; yields (base URL, Counter of paths)."""
    requests = Counter()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests[self.path] += 1
            file = data_dir / self.path.lstrip("/")
            if self.path.startswith("/images/") and file.is_file():
                body = file.read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
            elif self.path == "/login":  # a page served with status 200 where an image was asked for
                body = b"<html>Please log in</html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
            else:
                body = b"not here"
                self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_image_urls_are_fetched_once_per_run_and_kept_as_bytes_on_disk(processor, data_dir, image_server, tmp_path):
    base, requests = image_server
    conversations = [
        [user(image(f"{base}/images/tall.png"), image(f"{base}/images/wide.png"), text("?")), assistant("Two.")],
        [user(image(f"{base}/images/tall.png"), text("?")), assistant("One.")],
    ]
    path = write_jsonl(tmp_path / "urls.jsonl", conversations)
    cache = ImageUrlCache(tmp_path / "out" / "image_cache", max_bytes=10**8)
    examples, bad = load_chat_jsonl(path, processor, image_cache=cache)  # the check before training fetches them
    assert bad == [] and len(examples) == 2
    collator = KimiVLDataCollator(processor, image_cache=cache)
    batches = [collator(examples) for _ in range(3)]  # three epochs
    assert requests == {"/images/tall.png": 1, "/images/wide.png": 1}
    # The bytes are on disk, as served: another process of the run (a new cache object on the folder) reads them.
    reopened = ImageUrlCache(tmp_path / "out" / "image_cache", max_bytes=10**8)
    assert reopened.read(f"{base}/images/wide.png") == (data_dir / "images" / "wide.png").read_bytes()
    assert requests == {"/images/tall.png": 1, "/images/wide.png": 1}
    # Read from the cache, the images are what a fetch gives.
    fetched = KimiVLDataCollator(processor)(examples)
    assert requests == {"/images/tall.png": 3, "/images/wide.png": 2}
    for batch in batches:
        assert torch.equal(batch["pixel_values"], fetched["pixel_values"])
        assert torch.equal(batch["input_ids"], fetched["input_ids"])


def test_the_image_cache_is_bounded(image_server, tmp_path):
    base, requests = image_server
    cache = ImageUrlCache(tmp_path / "image_cache", max_bytes=1)  # less than any image: each one pushes out the last
    for name in ("tall", "wide", "tall"):
        cache.read(f"{base}/images/{name}.png")
    assert requests == {"/images/tall.png": 2, "/images/wide.png": 1}


def test_a_failed_fetch_is_an_error_naming_the_example_and_is_not_cached(processor, image_server, tmp_path):
    base, requests = image_server
    missing = f"{base}/images/missing.png"
    path = write_jsonl(tmp_path / "urls.jsonl", [TEXT_ONLY, [user(image(missing), text("?")), assistant("x")]])
    cache = ImageUrlCache(tmp_path / "image_cache", max_bytes=10**8)
    examples, bad = load_chat_jsonl(path, processor, image_cache=cache)
    assert len(examples) == 1 and [problem.line for problem in bad] == [2]
    assert f"image {missing!r} could not be fetched" in bad[0].reason and "404" in bad[0].reason
    batch = [{"messages": TEXT_ONLY}, {"messages": [user(image(missing), text("?")), assistant("x")]}]
    with pytest.raises(ValueError, match=rf"example 1 of the batch: image {re.escape(repr(missing))} could not be"):
        KimiVLDataCollator(processor, image_cache=cache)(batch)
    assert requests == {"/images/missing.png": 2}  # the failure was not kept: asked again, fetched again


def test_a_body_over_the_fetch_limit_is_a_bad_example_read_no_further(processor, image_server, tmp_path, monkeypatch):
    base, _ = image_server
    monkeypatch.setattr("image_processing.data_collator_kimi_vl.MAX_FETCH_BYTES", 10)  # the served PNGs are larger
    url = f"{base}/images/tall.png"
    path = write_jsonl(tmp_path / "urls.jsonl", [[user(image(url), text("?")), assistant("x")]])
    cache = ImageUrlCache(tmp_path / "image_cache", max_bytes=10**8)
    examples, bad = load_chat_jsonl(path, processor, image_cache=cache)
    assert examples == [] and "larger than 10 bytes" in bad[0].reason


def test_the_image_cache_without_diskcache_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "diskcache", None)  # as when the `train` extra is not installed
    with pytest.raises(ImportError, match=re.escape('pip install -e ".[train]"')):
        ImageUrlCache(tmp_path / "image_cache", max_bytes=10**8)


def test_a_page_served_in_place_of_an_image_is_a_bad_example_and_is_not_cached(processor, image_server, tmp_path):
    base, requests = image_server
    page = f"{base}/login"
    path = write_jsonl(tmp_path / "urls.jsonl", [[user(image(page), text("?")), assistant("x")]])
    cache = ImageUrlCache(tmp_path / "image_cache", max_bytes=10**8)
    for _ in range(2):
        examples, bad = load_chat_jsonl(path, processor, image_cache=cache)
        assert examples == [] and f"image {page!r} could not be fetched and read" in bad[0].reason
    assert requests == {"/login": 2}  # the page was not kept: asked again, fetched again


@pytest.mark.parametrize("examples", [[], [{"conversation": TEXT_ONLY}], [{"messages": "Hello"}], ["Hello"]])
def test_collator_says_what_a_batch_must_hold(processor, examples):
    with pytest.raises(ValueError, match=r"no examples|expected an object \{\"messages\": \["):
        KimiVLDataCollator(processor)(examples)


def test_collator_is_not_shipped_with_exported_models():
    from hub_upload.remote_code import flat_code_files

    assert "data_collator_kimi_vl.py" not in flat_code_files()
    assert "processing_kimi_vl.py" in flat_code_files()  # what it builds on is


def test_collator_never_truncates(processor):
    collator = KimiVLDataCollator(processor, max_length=20)
    with pytest.raises(ValueError, match=r"example 0 of the batch is \d+ tokens .* longer than the maximum length 20"):
        collator([{"messages": TEXT_ONLY}])


# ----------------------------------------------------------------------------------------------------------------------
# A short LoRA run with examples/finetune.py, shared by the tests below
# ----------------------------------------------------------------------------------------------------------------------

LORA_STEPS = 30


@dataclass
class LoraRun:
    trainer: Trainer  # the 30-step run
    trained_logits: torch.Tensor  # its model's logits on `batch`, before anything was merged
    batch: dict
    output: Path  # the adapter (saved again by the resumed run) and merged/
    resumed: Trainer  # `--resume --merge` on the same output: no steps left, so it saves and merges


@pytest.fixture(scope="module")
def lora_run(tiny_kimi_vl_dir, data_dir, processor, tmp_path_factory) -> LoraRun:
    output = tmp_path_factory.mktemp("lora") / "out"
    argv = [
        "--model", str(tiny_kimi_vl_dir), "--data", str(data_dir / "train.jsonl"), "--output", str(output),
        "--max-steps", str(LORA_STEPS), "--batch-size", "3", "--learning-rate", "1e-2", "--logging-steps", "1",
        "--lora-experts", "--train-projector",
    ]  # fmt: skip
    trainer = finetune.main(argv)
    batch = batch_of_all(processor, data_dir)
    trained_logits = logits_of(trainer.model, batch)
    # --merge folds the adapter into the model in place, so it runs here on a resumed run: that also checks that the
    # checkpoint restores the trained adapter.
    resumed = finetune.main([*argv, "--resume", "--merge"])
    return LoraRun(trainer, trained_logits, batch, output, resumed)


def batch_of_all(processor, data_dir):
    examples, _ = load_chat_jsonl(data_dir / "train.jsonl", processor)
    return KimiVLDataCollator(processor)(examples)


def logits_of(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**{key: value for key, value in batch.items() if key != "labels"}).logits


def test_lora_run_halves_the_training_loss(lora_run):
    losses = [entry["loss"] for entry in lora_run.trainer.state.log_history if "loss" in entry]
    assert len(losses) == LORA_STEPS
    assert losses[-1] <= losses[0] / 2, losses


def test_default_adapter_targets_the_language_model_only(lora_run):
    model = lora_run.trainer.model
    names = [name for name, _ in model.named_modules() if name.endswith("lora_A.default")]
    for projection in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert any(f"self_attn.{projection}." in name for name in names)
    assert any(".mlp.gate_proj." in name for name in names)  # the dense MLPs of the first layers
    assert any(".mlp.shared_experts.down_proj." in name for name in names)
    assert any(".mlp.experts." in name for name in names)  # the fused routed experts (--lora-experts)
    assert not any("vision_tower" in name for name in names)
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert not any("vision_tower" in name for name in trained)
    assert any("multi_modal_projector.modules_to_save" in name for name in trained)  # --train-projector
    assert all("lora_" in name or "modules_to_save" in name for name in trained)


def test_saved_adapter_reloads_to_identical_logits(lora_run, tiny_kimi_vl_dir):
    assert lora_run.resumed.state.global_step == LORA_STEPS  # resumed at the end: no further step
    reloaded = PeftModel.from_pretrained(KimiVLForConditionalGeneration.from_pretrained(tiny_kimi_vl_dir),
                                         lora_run.output)  # fmt: skip
    assert torch.equal(logits_of(reloaded, lora_run.batch), lora_run.trained_logits)
    base = logits_of(KimiVLForConditionalGeneration.from_pretrained(tiny_kimi_vl_dir), lora_run.batch)
    assert not torch.allclose(base, lora_run.trained_logits, atol=1e-3)  # the adapter changed the model


def test_merged_model_is_in_the_original_layout_and_equals_the_adapter(lora_run, tiny_kimi_vl_dir, tmp_path):
    merged_dir = lora_run.output / finetune.MERGED_FOLDER
    merged, info = KimiVLForConditionalGeneration.from_pretrained(merged_dir, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    with safe_open(tiny_kimi_vl_dir / "model.safetensors", "pt") as original, \
            safe_open(merged_dir / "model.safetensors", "pt") as written:  # fmt: skip
        assert set(written.keys()) == set(original.keys())  # per-expert keys, no adapter names
        assert "language_model.model.layers.2.mlp.experts.0.gate_proj.weight" in written.keys()
    batch = lora_run.batch
    # Folding B @ A into the weights rounds differently from adding the LoRA branch's output: float32 noise only.
    torch.testing.assert_close(logits_of(merged, batch), lora_run.trained_logits, rtol=0, atol=1e-4)

    from hub_upload.export import export_checkpoint

    export_checkpoint(merged_dir, tmp_path / "export", verify=False)
    exported = KimiVLForConditionalGeneration.from_pretrained(tmp_path / "export")
    assert torch.equal(logits_of(exported, batch), logits_of(merged, batch))


def test_demo_loads_an_adapter_folder_merged(lora_run):
    from kimi_vl_demo.checkpoints import load_model

    model = load_model(lora_run.output, torch.float32, "cpu")
    assert isinstance(model, KimiVLForConditionalGeneration)
    merged = KimiVLForConditionalGeneration.from_pretrained(lora_run.output / finetune.MERGED_FOLDER)
    torch.testing.assert_close(logits_of(model, lora_run.batch), logits_of(merged, lora_run.batch), rtol=0, atol=1e-6)


def test_demo_serves_an_adapter_of_the_tiny_model_as_the_tiny_model(lora_run, tmp_path):
    from kimi_vl_demo.checkpoints import resolve_checkpoint

    # Its base model's kind: the tiny model's short greedy answers and its "random weights" banner.
    assert resolve_checkpoint(str(lora_run.output), tmp_path).kind == "tiny"


# ----------------------------------------------------------------------------------------------------------------------
# Bad examples
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_jsonl(data_dir) -> Path:
    (data_dir / "images" / "broken.png").write_bytes(b"not a png at all")
    long_answer = "word " * 300
    lines = [
        {"messages": TEXT_ONLY},  # line 1: good
        {"messages": [user(image("images/missing.png"), text("?")), assistant("x")]},  # 2
        {"messages": [user(image("images/broken.png"), text("?")), assistant("x")]},  # 3
        {"messages": [user(text("Hello?"))]},  # 4: no assistant turn
        {"messages": [user(text("Say a lot.")), assistant(long_answer)]},  # 5: too long
    ]
    path = data_dir / "bad.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{not json\n")  # 6
    return path


BAD_LINES = {
    2: "image file 'images/missing.png' not found",
    3: "could not be read as an image",
    4: "no assistant turn",
    5: "longer than the maximum length 256",
    6: "not valid JSON",
}


def test_bad_examples_are_reported_with_line_numbers(processor, bad_jsonl):
    examples, bad = load_chat_jsonl(bad_jsonl, processor, max_length=256)
    assert examples == [{"messages": TEXT_ONLY}]
    assert [problem.line for problem in bad] == sorted(BAD_LINES)
    for problem in bad:
        assert BAD_LINES[problem.line] in problem.reason


def test_a_byte_order_mark_is_not_a_bad_example(processor, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_text(json.dumps({"messages": TEXT_ONLY}) + "\n", encoding="utf-8-sig")
    assert load_chat_jsonl(path, processor) == ([{"messages": TEXT_ONLY}], [])


def test_a_line_that_is_not_utf8_is_one_bad_example(processor, tmp_path):
    good = json.dumps({"messages": TEXT_ONLY}).encode()
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good + b"\n" + "Caf\u00e9".encode("latin-1") + b"\n\n" + good + b"\n")
    examples, bad = load_chat_jsonl(path, processor)
    assert examples == [{"messages": TEXT_ONLY}] * 2
    assert [problem.line for problem in bad] == [2] and "utf-8" in bad[0].reason


def test_script_stops_before_training_listing_every_bad_example(tiny_kimi_vl_dir, bad_jsonl, tmp_path):
    argv = ["--model", str(tiny_kimi_vl_dir), "--data", str(bad_jsonl), "--output", str(tmp_path / "out"),
            "--max-length", "256", "--max-steps", "1"]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        finetune.main(argv)
    message = str(stopped.value)
    assert "5 bad example(s)" in message and "nothing was trained" in message
    for line, reason in BAD_LINES.items():
        assert f"bad.jsonl:line {line}: " in message and reason in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--learning-rate", "-0.0001", "--learning-rate must be a positive number"),
        ("--learning-rate", "nan", "--learning-rate must be a positive number"),
        ("--dataloader-workers", "-1", "--dataloader-workers must be at least 0"),
        ("--lora-alpha", "0", "--lora-alpha must be at least 1"),
    ],
)
def test_bad_options_are_refused_before_anything_is_loaded(option, value, message, tmp_path, capsys):
    argv = ["--model", str(tmp_path / "absent"), "--data", str(tmp_path / "absent.jsonl"), "--output",
            str(tmp_path / "out"), option, value]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        finetune.parse_args(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_lora_options_with_full_are_an_error_naming_them(tmp_path, capsys):
    argv = ["--model", str(tmp_path / "absent"), "--data", str(tmp_path / "absent.jsonl"), "--output",
            str(tmp_path / "out"), "--full", "--lora-rank", "8", "--lora-experts", "--merge"]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        finetune.parse_args(argv)
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and "--lora-rank, --lora-experts, --merge: LoRA option(s)" in error
    assert "--lora-alpha" not in error.splitlines()[-1]  # only the options given are named


def test_lora_options_take_their_defaults_when_not_given(tmp_path):
    argv = ["--model", str(tmp_path / "absent"), "--data", str(tmp_path / "absent.jsonl"), "--output",
            str(tmp_path / "out")]  # fmt: skip
    args = finetune.parse_args(argv)
    assert (args.lora_rank, args.lora_alpha, args.lora_experts, args.merge) == (16, 32, False, False)


def test_script_skips_bad_examples_when_asked(tiny_kimi_vl_dir, bad_jsonl, tmp_path, capsys):
    output = tmp_path / "out"
    argv = ["--model", str(tiny_kimi_vl_dir), "--data", str(bad_jsonl), "--output", str(output),
            "--max-length", "256", "--max-steps", "1", "--skip-bad-examples"]  # fmt: skip
    trainer = finetune.main(argv)
    assert "skipped 5 bad example(s) of 6" in capsys.readouterr().err
    assert len(trainer.train_dataset) == 1
    assert (output / "adapter_model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------------------------------
# The README's parameter counts for the real A3B architecture (examples/finetune_memory.py, meta device)
# ----------------------------------------------------------------------------------------------------------------------


def test_a3b_adapter_sizes_match_the_architecture():
    from modeling_kimi_vl import kimi_vl_a3b_config

    rank = 16
    text = kimi_vl_a3b_config().text_config
    hidden, heads = text.hidden_size, text.num_attention_heads

    def lora(in_features, out_features):
        return rank * (in_features + out_features)

    attention = (
        lora(hidden, heads * (text.qk_nope_head_dim + text.qk_rope_head_dim))  # q_proj
        + lora(hidden, text.kv_lora_rank + text.qk_rope_head_dim)  # kv_a_proj_with_mqa
        + lora(text.kv_lora_rank, heads * (text.qk_nope_head_dim + text.v_head_dim))  # kv_b_proj
        + lora(heads * text.v_head_dim, hidden)  # o_proj
    )

    def mlp(intermediate):
        return 2 * lora(hidden, intermediate) + lora(intermediate, hidden)

    moe_layers = text.num_hidden_layers - text.first_k_dense_replace
    expected = (
        text.num_hidden_layers * attention
        + text.first_k_dense_replace * mlp(text.intermediate_size)
        + moe_layers * mlp(text.n_shared_experts * text.moe_intermediate_size)
    )
    # One rank-r pair per routed expert on each fused tensor: gate_up [E, 2I, H] and down [E, H, I].
    experts = (
        moe_layers
        * text.n_routed_experts
        * (lora(hidden, 2 * text.moe_intermediate_size) + lora(text.moe_intermediate_size, hidden))
    )
    options = finetune_memory.choices(rank)
    assert finetune_memory.trainable_parameters(options["LoRA (default)"])[0] == expected
    assert finetune_memory.trainable_parameters(options["LoRA + --lora-experts"])[0] == expected + experts


@pytest.mark.parametrize("option", ["--lora-rank", "--tokens"])
def test_memory_table_refuses_a_count_below_one(option, capsys):
    with pytest.raises(SystemExit) as stopped:
        finetune_memory.main([option, "0"])
    assert stopped.value.code == 2 and f"{option} must be at least 1, got 0" in capsys.readouterr().err


def test_full_fine_tuning_trains_the_language_model_and_saves_the_original_layout(tiny_kimi_vl_dir, data_dir, tmp_path):
    output = tmp_path / "full"
    finetune.main(["--model", str(tiny_kimi_vl_dir), "--data", str(data_dir / "train.jsonl"), "--output", str(output),
                   "--full", "--max-steps", "2", "--batch-size", "3", "--learning-rate", "1e-3"])  # fmt: skip
    trained, info = KimiVLForConditionalGeneration.from_pretrained(output, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    base = KimiVLForConditionalGeneration.from_pretrained(tiny_kimi_vl_dir)
    before, after = base.state_dict(), trained.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert any(name.startswith("language_model.") for name in changed)
    assert not any(name.startswith(("vision_tower.", "multi_modal_projector.")) for name in changed)  # frozen
    with safe_open(tiny_kimi_vl_dir / "model.safetensors", "pt") as original, \
            safe_open(output / "model.safetensors", "pt") as written:  # fmt: skip
        assert set(written.keys()) == set(original.keys())


def run_data_check_on_two_processes(processor_dir: Path, data: Path, out: Path, skip_bad: bool) -> list[dict]:
    """tests/finetune_data_worker.py on 2 torchrun processes (gloo, CPU); what each got: examples or an error."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(Path(__file__).with_name("finetune_data_worker.py")),
        "--processor", str(processor_dir), "--data", str(data), "--out", str(out),
        *(["--skip-bad"] if skip_bad else []),
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("skip_bad", [False, True])
def test_data_parallel_processes_get_the_main_process_check_of_the_data(tiny_kimi_vl_dir, tmp_path, skip_bad):
    """Only the main process checks the data; the others get its examples, or its error, and never wait for it."""
    data = write_jsonl(tmp_path / "train.jsonl", [TEXT_ONLY, TEXT_ONLY])
    with data.open("a") as file:
        file.write("{not json\n")  # line 3: a bad example
    main, other = run_data_check_on_two_processes(tiny_kimi_vl_dir, data, tmp_path / "run", skip_bad)
    assert other == main  # the same examples or the same error, and no process checked the data but the main one
    if skip_bad:
        assert len(main["examples"]) == 2
    else:
        assert "1 bad example(s)" in main["error"] and "train.jsonl:line 3:" in main["error"]
