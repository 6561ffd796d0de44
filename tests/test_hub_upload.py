"""hub_upload: export the tiny reference checkpoint, load it through the Auto classes where only the exported files
provide our code, and publish it to a local stand-in for the Hub."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT
from hub_stand_in import HubStandIn
from huggingface_hub import ModelCard
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hub_upload.export as export_module
import hub_upload.verify as verify_module
from hub_upload import (
    ExportInputError,
    ExportVerificationError,
    PushError,
    check_export_folder,
    export_checkpoint,
    plan_upload,
    run_isolated,
)
from hub_upload.__main__ import main as cli_main
from hub_upload.model_card import ModelCardInfo, render_model_card
from hub_upload.push import check_repo_id
from hub_upload.remote_code import MODEL_AUTO_MAP, PREPROCESSOR_AUTO_MAP, TOKENIZER_AUTO_MAP
from hub_upload.weights import parse_size
from image_processing.tiny_tokenizer import write_tiny_tokenizer

# The hub's Instruct preprocessor_config.json, with its auto_map pointing at the original release's files.
INSTRUCT_PREPROCESSOR_CONFIG = {
    "auto_map": {
        "AutoImageProcessor": "image_processing_kimi_vl.KimiVLImageProcessor",
        "AutoProcessor": "processing_kimi_vl.KimiVLProcessor",
    },
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "KimiVLImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "in_token_limit": 4096,
    "merge_kernel_size": [2, 2],
    "num_pooled_tokens": 1024,
    "pad_input": True,
    "patch_size": 14,
    "processor_class": "KimiVLProcessor",
}
RELEASE_MODEL_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_vl.KimiVLConfig",
    "AutoModel": "modeling_kimi_vl.KimiVLForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_vl.KimiVLForConditionalGeneration",
}
RELEASE_TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]}
EXPORTED_DATA_FILES = {
    "config.json",
    "preprocessor_config.json",
    "tokenizer_config.json",
    "tiktoken.model",
    "chat_template.jinja",
    "generation_config.json",
    "README.md",
    "model.safetensors.index.json",
}
SHIPPED_CODE = {
    "configuration_kimi_vl.py",
    "modeling_kimi_vl.py",
    "image_processing_kimi_vl.py",
    "processing_kimi_vl.py",
    "tokenization_kimi_vl.py",
}


@pytest.fixture(scope="module")
def source(reference_checkpoint, tmp_path_factory) -> Path:
    """The tiny reference checkpoint in the original layout, completed with a test tokenizer and the Instruct
    preprocessor config."""
    folder = tmp_path_factory.mktemp("hub") / "source"
    shutil.copytree(reference_checkpoint, folder)
    for path in folder.iterdir():
        path.chmod(0o644)  # the fixture is read-only; the copies are modified by some tests
    write_tiny_tokenizer(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(INSTRUCT_PREPROCESSOR_CONFIG, indent=2))
    # As on the Hub: auto_maps and a tokenizer class that name the release's own code, and that code beside them.
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = RELEASE_MODEL_AUTO_MAP
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.update(auto_map=RELEASE_TOKENIZER_AUTO_MAP, tokenizer_class="TikTokenTokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (folder / "tokenization_moonshot.py").write_text("raise ImportError('the release code must not be shipped')\n")
    return folder


@pytest.fixture(scope="module")
def exported(source) -> Path:
    """The export of `source`, verified in a clean interpreter (the default)."""
    out = source.parent / "export"
    result = export_checkpoint(source, out)
    assert result.verified and result.folder == out
    return out


def copy_source(source: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "source"
    shutil.copytree(source, folder)
    return folder


def leftovers(folder: Path) -> list[str]:
    """Temporary folders an export left beside its target."""
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


def tensor_bytes(folder: Path) -> dict[str, bytes]:
    """Every tensor of a checkpoint folder as raw bytes (bit-level comparison, whatever the dtype)."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                tensors[name] = (
                    str(tensor.dtype),
                    tuple(tensor.shape),
                    tensor.contiguous().view(torch.uint8).numpy().tobytes(),
                )
    return tensors


# ----------------------------------------------------------------------------------------------------------------------
# Export: contents, parity in a clean interpreter, idempotence, sharding
# ----------------------------------------------------------------------------------------------------------------------


def test_release_folder_loads_with_our_package_and_no_remote_code(source, reference_dir, improc_expected):
    """The original hub layout (auto_maps naming the release's files, a TikTokenTokenizer class) loads through the
    Auto classes with our registered classes, never running the release's code (here it would raise)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from modeling_kimi_vl import KimiVLForConditionalGeneration

    model = AutoModelForImageTextToText.from_pretrained(source).eval()
    processor = AutoProcessor.from_pretrained(source)
    assert isinstance(model, KimiVLForConditionalGeneration)
    assert type(processor).__name__ == "KimiVLProcessor" and type(processor.tokenizer).__name__ == "KimiVLTokenizer"

    image_path = reference_dir / "images" / "rgb_420x280.png"
    messages = [
        {"role": "user", "content": [{"type": "image", "image": str(image_path)}, {"type": "text", "text": "hi"}]}
    ]
    inputs = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt"
    )
    assert improc_expected["rgb_420x280"].same_pixel_values(inputs["pixel_values"])
    rows, cols = improc_expected["rgb_420x280"].image_grid_hws[0].tolist()
    assert int((inputs["input_ids"] == model.config.media_placeholder_token_id).sum()) == rows * cols // 4
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()


def test_export_contents(exported, source):
    files = {path.name for path in exported.iterdir()}
    assert SHIPPED_CODE <= files
    assert not {"__init__.py", "tiny_tokenizer.py", "tokenization_moonshot.py"} & files
    assert EXPORTED_DATA_FILES <= files
    assert json.loads((exported / "config.json").read_text())["auto_map"] == MODEL_AUTO_MAP
    assert json.loads((exported / "preprocessor_config.json").read_text())["auto_map"] == PREPROCESSOR_AUTO_MAP
    tokenizer_config = json.loads((exported / "tokenizer_config.json").read_text())
    assert (
        tokenizer_config["auto_map"] == TOKENIZER_AUTO_MAP and tokenizer_config["tokenizer_class"] == "KimiVLTokenizer"
    )
    assert (exported / "tiktoken.model").read_bytes() == (source / "tiktoken.model").read_bytes()
    # The code is flat: sibling imports only, never our package names.
    for name in SHIPPED_CODE:
        code = (exported / name).read_text()
        assert "from modeling_kimi_vl" not in code and "from image_processing" not in code
    card = ModelCard.load(exported / "README.md")  # YAML front matter, as the Hub reads it
    assert (card.data.license, card.data.library_name, card.data.pipeline_tag) == (
        "mit",
        "transformers",
        "image-text-to-text",
    )
    assert card.data.tags == ["kimi_vl", "custom_code"]
    assert "trust_remote_code=True" in card.text and "torchrun" in card.text
    assert tensor_bytes(exported) == tensor_bytes(source)
    assert check_export_folder(exported) == []


def test_model_card_metadata_names_the_source_model_and_license(exported):
    config = json.loads((exported / "config.json").read_text())
    info = ModelCardInfo(license="other", base_model="moonshotai/Kimi-VL-A3B-Instruct", repo_id="me/kimi-vl")
    card = ModelCard(render_model_card(config, info))
    assert (card.data.license, card.data.base_model) == ("other", "moonshotai/Kimi-VL-A3B-Instruct")
    assert 'repo = "me/kimi-vl"' in card.text
    assert "[moonshotai/Kimi-VL-A3B-Instruct](https://huggingface.co/moonshotai/Kimi-VL-A3B-Instruct)" in card.text


def test_export_loads_in_clean_interpreter_and_matches_fixture(exported, reference_dir, expected, tmp_path):
    output = tmp_path / "outputs.safetensors"
    expected_path = reference_dir / "expected.safetensors"
    result = run_isolated(REPO_ROOT / "tests" / "isolated_auto_load.py", str(exported), str(expected_path), str(output))
    assert result.returncode == 0, result.stdout + result.stderr
    with safe_open(output, framework="pt") as handle:
        classes = json.loads(handle.metadata()["classes"])
    # Every class came from the exported files (transformers' remote-code modules), and they are ours.
    assert all(name.startswith("transformers_modules.") for name in classes.values()), classes
    expected_classes = {
        "config": "configuration_kimi_vl.KimiVLConfig",
        "model": "modeling_kimi_vl.KimiVLForConditionalGeneration",
        "processor": "processing_kimi_vl.KimiVLProcessor",
        "processor.image_processor": "image_processing_kimi_vl.KimiVLImageProcessor",
        "processor.tokenizer": "tokenization_kimi_vl.KimiVLTokenizer",
        "image_processor": "image_processing_kimi_vl.KimiVLImageProcessor",
        "tokenizer": "tokenization_kimi_vl.KimiVLTokenizer",
    }
    assert {role: name.split(".", 3)[-1] for role, name in classes.items()} == expected_classes
    outputs = load_file(output)
    # 1e-4 relative to the logits' scale: what the original code's own float32 arithmetic allows.
    scale = expected["mm_logits"].abs().max().item()
    torch.testing.assert_close(outputs["mm_logits"], expected["mm_logits"], rtol=1e-4, atol=1e-4 * scale)
    assert torch.equal(outputs["mm_generated"], expected["mm_generated"])


def test_clean_interpreter_cannot_import_our_packages(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import importlib.util, sys\nprint(importlib.util.find_spec('torch') is not None)\nimport modeling_kimi_vl\n"
    )
    result = run_isolated(script)
    assert result.stdout.strip() == "True"  # site-packages are there ...
    assert "No module named 'modeling_kimi_vl'" in result.stderr  # ... our editable install is not


def test_clean_interpreter_refuses_our_packages_from_a_regular_install(exported, tmp_path, monkeypatch):
    """After `pip install .` our packages sit in site-packages itself, which the child needs for torch: they must still
    not be importable there, and the export must still verify."""
    installed = tmp_path / "site-packages"
    installed.mkdir()
    for package in verify_module.OWN_PACKAGES:
        (installed / package).symlink_to(REPO_ROOT / package, target_is_directory=True)
    site_packages = [*verify_module.site.getsitepackages(), str(installed)]
    monkeypatch.setattr(verify_module.site, "getsitepackages", lambda: site_packages)
    script = tmp_path / "probe.py"
    script.write_text(
        "import importlib, importlib.machinery, sys\n"
        "for name in sys.argv[1:]:\n"
        "    # sys.path alone would find the installed copy ...\n"
        "    print(importlib.machinery.PathFinder.find_spec(name).origin)\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as error:  # ... but the import is refused\n"
        "        print(error.name)\n"
    )
    result = run_isolated(script, *verify_module.OWN_PACKAGES)
    assert result.returncode == 0, result.stderr
    expected = [line for name in verify_module.OWN_PACKAGES for line in (str(installed / name / "__init__.py"), name)]
    assert result.stdout.splitlines() == expected
    report = json.loads(verify_module.verify_export(exported))
    assert report["classes"]["model"].startswith("transformers_modules.")


def test_verification_that_hangs_is_stopped(source, tmp_path, monkeypatch, capsys):
    hanging = tmp_path / "hanging.py"
    hanging.write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setattr(verify_module, "ISOLATED_CHECK_SCRIPT", hanging)
    out = tmp_path / "out"
    assert cli_main(["export", "--source", str(source), "--out", str(out), "--verify-timeout", "2"]) == 2
    assert "did not finish within 2 s and was stopped; nothing was published" in capsys.readouterr().err
    assert not out.exists() and leftovers(tmp_path) == []


def export_process(source: Path, out: Path, tmp_path: Path) -> subprocess.Popen:
    """`python -m hub_upload export` in its own process, as a user runs it, except that its verification child never
    finishes by itself (it sleeps), so that only the export's handling can end it."""
    hanging = tmp_path / "hanging.py"
    hanging.write_text("import time\ntime.sleep(600)\n")
    driver = (
        "import sys\nfrom pathlib import Path\nimport hub_upload.verify\n"
        f"hub_upload.verify.ISOLATED_CHECK_SCRIPT = Path({str(hanging)!r})\n"
        "from hub_upload.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    command = [sys.executable, "-c", driver, "export", "--source", str(source), "--out", str(out)]
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while listed
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_if_running(pid: int) -> None:
    """Leave no process behind when a test fails."""
    if is_running(pid):
        os.kill(pid, signal.SIGKILL)


def wait_until(condition, what: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting after {limit_s} s: {what}"
        time.sleep(0.1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_stops_an_export_like_ctrl_c(source, tmp_path):
    out = tmp_path / "out"
    export = export_process(source, out, tmp_path)
    wait_until(lambda: children(export.pid) or export.poll() is not None, "the verification child to start")
    [verifier] = children(export.pid)
    try:
        export.send_signal(signal.SIGTERM)
        _, stderr = export.communicate(timeout=120)
        assert export.returncode == 128 + signal.SIGTERM, stderr
        assert "error: stopped by SIGTERM before the export finished" in stderr
        assert not is_running(verifier)  # stopped by the export on its way out
        assert not out.exists() and leftovers(tmp_path) == []  # the temporary folder (a copy of the weights) is gone
    finally:
        stop_if_running(verifier)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_the_verification_child_dies_with_an_export_killed_outright(source, tmp_path):
    export = export_process(source, tmp_path / "out", tmp_path)
    wait_until(lambda: children(export.pid) or export.poll() is not None, "the verification child to start")
    [verifier] = children(export.pid)
    try:
        export.kill()  # SIGKILL: nothing in the export runs any more
        export.communicate()
        wait_until(lambda: not is_running(verifier), "the orphaned verification child to end")
    finally:
        stop_if_running(verifier)
    # Nothing could remove its temp folder (a full copy of the weights) and the folder's lock file ...
    abandoned, abandoned_lock = leftovers(tmp_path)
    assert abandoned.startswith(".out.partial-") and abandoned_lock == abandoned + ".lock"
    export_checkpoint(source, tmp_path / "out", verify=False)
    assert leftovers(tmp_path) == []  # ... until the next export into the same target


def test_the_temp_folder_of_a_running_export_is_left_alone(source, tmp_path):
    running = tmp_path / ".out.partial-abcd1234"
    lock = export_module._folder_lock(running)
    lock.acquire()  # as the export holding it does, from before the folder exists until it ends
    running.mkdir()
    try:
        export_checkpoint(source, tmp_path / "out", verify=False)
        assert leftovers(tmp_path) == [running.name, running.name + ".lock"]
    finally:
        lock.release()
    export_checkpoint(source, tmp_path / "out", verify=False, overwrite=True)
    assert leftovers(tmp_path) == []


def test_a_temp_folder_is_locked_from_the_moment_it_exists(source, tmp_path, monkeypatch):
    """Another export's clean-up that runs right after this export created its temp folder leaves the folder alone."""
    out = tmp_path / "out"
    make_folder = os.mkdir
    cleaned_up_after = []

    def make_folder_then_clean_up(path, *args, **kwargs):
        make_folder(path, *args, **kwargs)
        if Path(path).name.startswith(".out.partial-"):
            export_module._remove_abandoned_staging(out)  # as a concurrent export into `out` starts
            cleaned_up_after.append(Path(path).name)

    monkeypatch.setattr(os, "mkdir", make_folder_then_clean_up)
    export_checkpoint(source, out, verify=False)
    assert cleaned_up_after and check_export_folder(out) == [] and leftovers(tmp_path) == []


def test_a_lock_file_that_cannot_be_deleted_does_not_fail_the_export(source, tmp_path, monkeypatch):
    """Windows refuses to delete a file another process has open, as a concurrent export's clean-up may have the lock
    file while it tries the lock: the export is published all the same, and only the empty lock file stays."""
    unlink = Path.unlink

    def refuse_lock_files(path, *args, **kwargs):
        if path.name.endswith(".lock"):
            raise PermissionError(13, "The process cannot access the file because it is being used", str(path))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refuse_lock_files)
    export_checkpoint(source, tmp_path / "out", verify=False)
    assert check_export_folder(tmp_path / "out") == []
    [lock_file] = leftovers(tmp_path)
    assert re.fullmatch(r"\.out\.partial-[0-9a-f]{8}\.lock", lock_file)


def test_reexport_is_idempotent(exported, tmp_path):
    again = tmp_path / "again"
    export_checkpoint(exported, again, verify=False)
    names = sorted(path.name for path in exported.iterdir())
    assert sorted(path.name for path in again.iterdir()) == names
    for name in names:
        assert (again / name).read_bytes() == (exported / name).read_bytes(), name


def test_small_shards_hold_identical_tensors(source, tmp_path):
    out = tmp_path / "sharded"
    result = export_checkpoint(source, out, max_shard_size="200KB", verify=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(path.name for path in out.glob("*.safetensors"))
    assert result.num_shards == len(shards) > 3
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == (source / "model.safetensors").stat().st_size - _header_bytes(
        source / "model.safetensors"
    )
    for shard in shards:
        with safe_open(out / shard, framework="pt") as handle:
            names = list(handle.keys())
            sizes = [handle.get_tensor(name).nbytes for name in names]
        assert sum(sizes) <= parse_size("200KB") or len(names) == 1
        assert all(index["weight_map"][name] == shard for name in names)
    assert tensor_bytes(out) == tensor_bytes(source)


def _header_bytes(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: every problem reported at once, nothing written
# ----------------------------------------------------------------------------------------------------------------------


def _rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def _drop_vision_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    del config["vision_config"]
    (folder / "config.json").write_text(json.dumps(config))


def _index_names_absent_shard(folder: Path) -> None:
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        names = list(handle.keys())
    weight_map = {name: "model.safetensors" for name in names}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


BAD_SOURCES = {
    "no weights": (lambda folder: (folder / "model.safetensors").unlink(), ["no weights"]),
    "index names an absent file": (
        _index_names_absent_shard,
        ["names 'model-00002-of-00002.safetensors'", "which model.safetensors.index.json does not list"],
    ),
    "config without vision_config": (_drop_vision_config, ["config.json has no vision_config"]),
    "wrong shape": (
        lambda folder: _rewrite_weights(
            folder, lambda t: t.update({"multi_modal_projector.linear_2.bias": torch.zeros(63)})
        ),
        ["multi_modal_projector.linear_2.bias in model.safetensors has shape [63], the config needs [64]"],
    ),
    "missing and unexpected tensors": (
        lambda folder: _rewrite_weights(
            folder,
            lambda t: t.update({"vision_tower.extra.weight": t.pop("vision_tower.encoder.final_layernorm.bias")}),
        ),
        ["missing tensor vision_tower.encoder.final_layernorm.bias", "unexpected tensor vision_tower.extra.weight"],
    ),
    "no tokenizer": (
        lambda folder: [(folder / name).unlink() for name in ("tiktoken.model", "tokenizer_config.json")],
        ["tiktoken.model is missing", "tokenizer_config.json is missing"],
    ),
    "index lists no tensors": (
        lambda folder: (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}})),
        ["model.safetensors.index.json lists no tensors"],
    ),
    "checkpoint without tensors": (
        lambda folder: save_file({}, folder / "model.safetensors"),
        ["model.safetensors holds no tensors"],
    ),
    "generation config that is not JSON": (
        lambda folder: (folder / "generation_config.json").write_text('{"max_new_tokens": 8,'),
        ["generation_config.json is not valid JSON"],
    ),
    "generation config that transformers refuses": (
        lambda folder: (folder / "generation_config.json").write_text('{"max_new_tokens": -1}'),
        ["generation_config.json is not a valid generation config for transformers: `max_new_tokens` must be"],
    ),
    "special tokens map that is not an object": (
        lambda folder: (folder / "special_tokens_map.json").write_text('["<|im_end|>"]'),
        ["special_tokens_map.json must hold a JSON object, found list"],
    ),
    "truncated shard": (
        lambda folder: (folder / "model.safetensors").write_bytes(
            (folder / "model.safetensors").read_bytes()[:100_000]
        ),
        ["lies outside the file"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source_is_refused_before_writing(case, source, tmp_path):
    folder = copy_source(source, tmp_path)
    break_source, messages = BAD_SOURCES[case]
    break_source(folder)
    with pytest.raises(ExportInputError) as caught:
        export_checkpoint(folder, tmp_path / "out", verify=False)
    for message in messages:
        assert message in str(caught.value)
    assert "nothing was written" in str(caught.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_files_that_are_not_regular_files_inside_the_source_are_refused_unread(source, tmp_path):
    folder = copy_source(source, tmp_path)
    secret = tmp_path / "secrets.json"
    secret.write_text('{"token": "hf_secret"}')
    (folder / "special_tokens_map.json").symlink_to(secret)
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").symlink_to(os.path.relpath(secret, folder))  # relative links resolve too
    (folder / "generation_config.json").unlink()
    os.mkfifo(folder / "generation_config.json")  # reading it would wait forever
    with pytest.raises(ExportInputError) as caught:
        export_checkpoint(folder, tmp_path / "out", verify=False)
    assert caught.value.problems == [
        "generation_config.json is not a regular file",
        f"special_tokens_map.json links to {secret}, outside the source folder; copy the file in instead",
        f"tokenizer_config.json links to {secret}, outside the source folder; copy the file in instead",
    ]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def _index_over(folder: Path, shards: list[object]) -> None:
    """An index that places the checkpoint's tensors, in turn, in each of `shards` (any JSON values)."""
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        names = list(handle.keys())
    weight_map = {name: shards[position % len(shards)] for position, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_every_shard_the_index_names_is_checked_whatever_its_suffix(source, tmp_path):
    folder = copy_source(source, tmp_path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"not for the hub")
    (folder / "weights.bin").symlink_to(secret)
    os.mkfifo(folder / "more.st")  # reading it would wait forever
    _index_over(folder, ["weights.bin", "more.st"])
    with pytest.raises(ExportInputError) as caught:
        export_checkpoint(folder, tmp_path / "out", verify=False)
    assert caught.value.problems == [
        "more.st is not a regular file",
        f"weights.bin links to {secret}, outside the source folder; copy the file in instead",
    ]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_an_index_naming_a_shard_outside_the_folder_is_refused_unread(source, tmp_path):
    folder = copy_source(source, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(folder / "model.safetensors", outside)  # a valid shard: only its place is wrong
    _index_over(folder, ["../outside.safetensors", str(outside), "sub/model.safetensors", "..", 7])
    with pytest.raises(ExportInputError) as caught:
        export_checkpoint(folder, tmp_path / "out", verify=False)
    refused = [repr(name) for name in ("../outside.safetensors", str(outside), "sub/model.safetensors", "..")]
    refused.append("7")
    assert caught.value.problems == [
        f"model.safetensors.index.json names {name} as a shard, which is not a file name in the source folder "
        "(shards sit beside the index)"
        for name in sorted(refused)
    ]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_an_index_whose_shards_end_otherwise_exports_them(source, tmp_path):
    folder = copy_source(source, tmp_path)
    _index_over(folder, ["weights.bin"])
    (folder / "model.safetensors").rename(folder / "weights.bin")
    export_checkpoint(folder, tmp_path / "out", verify=False)
    assert tensor_bytes(tmp_path / "out") == tensor_bytes(source)


def test_a_hub_cache_snapshot_whose_files_link_to_its_blobs_exports_as_the_folder_does(exported, source, tmp_path):
    """huggingface_hub's cache keeps a revision's files in snapshots/REVISION/ as links to the repository's blobs/."""
    repository = tmp_path / "models--moonshotai--Kimi-VL-A3B-Instruct"
    snapshot = repository / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repository / "blobs").mkdir()
    for path in source.iterdir():
        blob = repository / "blobs" / f"blob-{path.name}"
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    out = tmp_path / "out"
    export_checkpoint(snapshot, out, verify=False)
    assert sorted(path.name for path in out.iterdir()) == sorted(path.name for path in exported.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (exported / path.name).read_bytes(), path.name


def test_all_problems_in_one_error(source, tmp_path):
    folder = copy_source(source, tmp_path)
    _drop_vision_config(folder)
    (folder / "tiktoken.model").unlink()
    (folder / "preprocessor_config.json").write_text("{not json")
    (tmp_path / "out").mkdir()
    with pytest.raises(ExportInputError) as caught:
        export_checkpoint(folder, tmp_path / "out", verify=False)
    assert len(caught.value.problems) == 4, caught.value.problems
    assert list((tmp_path / "out").iterdir()) == []


def test_overwrite_replaces_only_an_earlier_export_or_an_empty_folder(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not an export")
    with pytest.raises(ExportInputError, match="already exists; pass --overwrite"):
        export_checkpoint(source, out, verify=False)
    with pytest.raises(ExportInputError, match="holds files but is not a complete export") as caught:
        export_checkpoint(source, out, verify=False, overwrite=True)
    assert "config.json is missing" in str(caught.value) and "replaces only an earlier export" in str(caught.value)
    assert [path.name for path in out.iterdir()] == ["notes.txt"]

    (out / "notes.txt").unlink()
    export_checkpoint(source, out, verify=False, overwrite=True)
    assert check_export_folder(out) == []
    assert leftovers(tmp_path) == []


def test_a_target_that_another_export_publishes_meanwhile_is_not_replaced_without_overwrite(
    exported, source, tmp_path, monkeypatch
):
    out = tmp_path / "out"

    def another_export_publishes(folder, timeout):  # while this export verifies its temp folder
        shutil.copytree(exported, out)
        (out / "theirs.txt").write_text("the other export's")

    monkeypatch.setattr(export_module, "verify_export", another_export_publishes)
    with pytest.raises(ExportInputError, match="appeared while this export ran; pass --overwrite"):
        export_checkpoint(source, out)
    assert (out / "theirs.txt").read_text() == "the other export's"
    assert leftovers(tmp_path) == []


def test_overwrite_of_an_export_that_someone_added_files_to_lists_them_and_needs_the_explicit_flag(
    source, exported, tmp_path, capsys
):
    out = tmp_path / "out"
    shutil.copytree(exported, out)
    (out / "NOTES.md").write_text("what we found")
    (out / "eval_results").mkdir()
    (out / "eval_results" / "mmmu.json").write_text("{}")
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert cli_main(["export", "--source", str(source), "--out", str(out), "--overwrite", "--no-verify"]) == 2
    error = capsys.readouterr().err
    assert "also holds 2 entries that no export writes (NOTES.md, eval_results/)" in error
    assert "pass --delete-added-files as well to delete them" in error
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before

    args = ["export", "--source", str(source), "--out", str(out), "--overwrite", "--delete-added-files", "--no-verify"]
    assert cli_main(args) == 0
    assert not (out / "NOTES.md").exists() and not (out / "eval_results").exists()
    assert check_export_folder(out) == [] and leftovers(tmp_path) == []


def test_next_export_settles_what_a_killed_publish_left(exported, source, tmp_path):
    out = tmp_path / "out"
    # Killed after the old target was moved aside, before the new one was in place: the old one goes back.
    shutil.copytree(exported, tmp_path / ".out.kimi-vl-export-old-0123abcd" / "out")
    (tmp_path / ".out.kimi-vl-export-old-0123abcd" / "out" / "previous.txt").write_text("previous export")
    with pytest.raises(ExportInputError, match="already exists; pass --overwrite"):
        export_checkpoint(source, out, verify=False)
    assert (out / "previous.txt").exists() and check_export_folder(out) == [] and leftovers(tmp_path) == []
    # Killed while deleting the old target, the new one in place: what is left of the old one goes.
    (tmp_path / ".out.kimi-vl-export-old-4567ef89" / "out").mkdir(parents=True)
    (tmp_path / ".out.kimi-vl-export-old-4567ef89" / "out" / "config.json").write_text("{}")
    # (previous.txt, which marks the old export, is a file no export writes: deleting it needs delete_added_files.)
    export_checkpoint(source, out, verify=False, overwrite=True, delete_added_files=True)
    assert not (out / "previous.txt").exists() and check_export_folder(out) == [] and leftovers(tmp_path) == []


def test_publish_names_its_aside_folder_as_the_settling_expects(exported, source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(exported, out)
    # Killed just before deleting the replaced target: its aside folder stays, in the one name form that is settled.
    monkeypatch.setattr(export_module.shutil, "rmtree", lambda path, ignore_errors=False: None)
    export_checkpoint(source, out, verify=False, overwrite=True)
    [aside] = leftovers(tmp_path)
    assert re.fullmatch(r"\.out\.kimi-vl-export-old-[0-9a-f]{8}", aside)
    monkeypatch.undo()
    export_checkpoint(source, out, verify=False, overwrite=True)
    assert leftovers(tmp_path) == []


def test_the_aside_folder_of_a_running_publish_is_left_alone(exported, source, tmp_path):
    """An export whose publish has moved the old target aside and not yet put the new one in place (or is deleting the
    old one) holds the aside folder's lock: another export into the same target neither moves it back nor deletes it."""
    out, aside = tmp_path / "out", tmp_path / ".out.kimi-vl-export-old-0123abcd"
    lock = export_module._folder_lock(aside)
    lock.acquire()  # as the publishing export does, from before the folder exists until it is gone
    shutil.copytree(exported, aside / "out")
    try:
        export_checkpoint(source, out, verify=False)  # out is missing, as in the middle of that publish
        assert check_export_folder(out) == [] and check_export_folder(aside / "out") == []
        export_checkpoint(source, out, verify=False, overwrite=True)  # out is in place, as while the old one is deleted
        assert check_export_folder(aside / "out") == []
        assert leftovers(tmp_path) == [aside.name, aside.name + ".lock"]
    finally:
        lock.release()
    export_checkpoint(source, out, verify=False, overwrite=True)
    assert leftovers(tmp_path) == []


def test_an_aside_folder_that_is_not_a_complete_export_is_not_put_back(exported, source, tmp_path):
    out, aside = tmp_path / "out", tmp_path / ".out.kimi-vl-export-old-0123abcd"
    shutil.copytree(exported, aside / "out")
    (aside / "out" / "config.json").unlink()
    with pytest.warns(
        UserWarning, match=rf"{re.escape(str(aside))} is left by an interrupted export .*\(config.json is missing\)"
    ):
        export_checkpoint(source, out, verify=False)
    assert check_export_folder(out) == []  # a new export; the incomplete old one stays where it was
    assert leftovers(tmp_path) == [aside.name] and (aside / "out" / "model.safetensors.index.json").is_file()


def test_folders_named_like_but_not_as_the_export_names_its_aside_folders_are_left_alone(exported, source, tmp_path):
    out = tmp_path / "out"
    names = [".out.old-backup", ".out.kimi-vl-export-old-backup", ".out.kimi-vl-export-old-0123abcd9"]
    for name in names:  # each holds a complete export, which the settling would put back if it were one of its own
        shutil.copytree(exported, tmp_path / name / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and none of them is even named in a warning
        export_checkpoint(source, out, verify=False)
        export_checkpoint(source, out, verify=False, overwrite=True)
    assert leftovers(tmp_path) == sorted(names)
    assert all(check_export_folder(tmp_path / name / "out") == [] for name in names)


def test_output_inside_source_is_refused(source, tmp_path):
    folder = copy_source(source, tmp_path)
    for out in (folder, folder / "export"):
        with pytest.raises(ExportInputError, match="overlaps --source"):
            export_checkpoint(folder, out, overwrite=True, verify=False)
    assert sorted(path.name for path in folder.iterdir()) == sorted(path.name for path in source.iterdir())


@pytest.mark.parametrize("failure", [KeyboardInterrupt, ExportVerificationError])
def test_interrupted_or_failed_export_leaves_target_as_it_was(failure, exported, source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(exported, out)
    (out / "previous.txt").write_text("previous export")
    previous = sorted(path.name for path in out.iterdir())

    def fail(folder, timeout):
        assert (folder / "config.json").exists()  # the temp folder was being filled when it failed
        raise failure("interrupted")

    monkeypatch.setattr(export_module, "verify_export", fail)
    with pytest.raises(failure):
        export_checkpoint(source, out, overwrite=True, delete_added_files=True)
    assert sorted(path.name for path in out.iterdir()) == previous
    assert leftovers(tmp_path) == []


def test_interrupt_while_writing_weights(source, tmp_path, monkeypatch):
    def interrupted_save(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr("hub_upload.weights.save_file", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(source, tmp_path / "out", verify=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_cli_errors(source, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        cli_main(["export", "--source", str(source), "--out", str(tmp_path / "out"), "--max-shard-size", "5 parsecs"])
    assert caught.value.code == 2 and "invalid size '5 parsecs'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        cli_main(["export", "--source", str(source), "--out", str(tmp_path / "out"), "--verify-timeout", "0"])
    assert caught.value.code == 2 and "invalid time '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        cli_main(["export", "--source", str(source), "--out", str(tmp_path / "out"), "--delete-added-files"])
    assert caught.value.code == 2 and "pass --overwrite with it" in capsys.readouterr().err
    assert cli_main(["export", "--source", str(tmp_path / "absent"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli_main(["push", "--folder", str(source), "--repo-id", "org/name", "--dry-run"]) == 2
    assert "is not a complete export" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------------------
# Push, against a local stand-in for the Hub API
# ----------------------------------------------------------------------------------------------------------------------


def run_cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hub_upload", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )


def test_push_uploads_the_export_in_one_commit(exported, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(exported, folder)
    (folder / ".cache").mkdir()  # hidden entries are never uploaded
    with HubStandIn() as hub:
        # The token comes from huggingface_hub's usual sources; HF_TOKEN is one of them.
        # HF_HUB_OFFLINE=0: a CI that forbids downloads must still let the client talk to the local stand-in.
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": "hf_stand_in_token",
            "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_OFFLINE": "0",
        }
        args = ["--folder", str(folder), "--repo-id", "my-org/kimi-vl-tiny", "--private", "--revision", "dev"]
        result = run_cli("push", *args, env=env)
    assert result.returncode == 0, result.stderr
    assert [path for _, path, _ in hub.requests] == [
        "/api/repos/create",
        "/api/models/my-org/kimi-vl-tiny/branch/dev",
        "/api/validate-yaml",
        "/api/models/my-org/kimi-vl-tiny/preupload/dev",
        "/api/models/my-org/kimi-vl-tiny/commit/dev",
    ]
    assert all(auth == "Bearer hf_stand_in_token" for _, _, auth in hub.requests)
    assert hub.created_repos == [
        {"name": "kimi-vl-tiny", "organization": "my-org", "visibility": "private", "type": "model"}
    ]
    (commit,) = hub.commits
    assert (commit.repo_id, commit.revision) == ("my-org/kimi-vl-tiny", "dev")
    expected_files = {path.name: path.read_bytes() for path in exported.iterdir()}
    assert commit.files == expected_files
    assert f"committed {1:040x}" in result.stdout


def test_push_dry_run_sends_nothing(exported):
    with HubStandIn() as hub:
        args = ["--folder", str(exported), "--repo-id", "my-org/kimi-vl-tiny", "--dry-run"]
        result = run_cli("push", *args, env={"HF_ENDPOINT": hub.url})
    assert result.returncode == 0, result.stderr
    assert hub.requests == []
    files = sorted(exported.iterdir())
    assert f"would upload {len(files)} files" in result.stdout
    listed = {line.split()[-1]: line.split()[:2] for line in result.stdout.splitlines()[1:]}
    assert sorted(listed) == [path.name for path in files]
    config_size = (exported / "config.json").stat().st_size
    expected_size = [f"{config_size / 1000:.2f}", "KB"] if config_size >= 1000 else [str(config_size), "B"]
    assert listed["config.json"] == expected_size


@pytest.mark.parametrize(
    "weight_map, problem",
    [
        (["model-00001-of-00001.safetensors"], "has no weight_map object"),
        ({"a.weight": ["model-00001-of-00001.safetensors"]}, "names ['model-00001-of-00001.safetensors'] as a shard"),
        ({"a.weight": "../model-00001-of-00001.safetensors"}, "names '../model-00001-of-00001.safetensors' as a shard"),
    ],
)
def test_a_folder_whose_index_is_malformed_is_not_an_export(exported, tmp_path, weight_map, problem):
    """push, and --overwrite of the folder, are refused with the reason (an export's shards sit beside its index)."""
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    (broken / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert any(problem in line for line in check_export_folder(broken)), check_export_folder(broken)
    with pytest.raises(PushError, match=re.escape(problem)):
        plan_upload(broken)
    with pytest.raises(ExportInputError, match="is not a complete export"):
        export_checkpoint(exported, broken, verify=False, overwrite=True)


def test_push_refuses_incomplete_exports(exported, source, tmp_path):
    with pytest.raises(PushError, match="is not a folder"):
        plan_upload(source.parent / "nothing-here")
    # The original layout is not an export: no auto_map of ours, no index.
    with pytest.raises(PushError) as caught:
        plan_upload(source)
    assert "config.json has auto_map" in str(caught.value) and "model.safetensors.index.json is missing" in str(
        caught.value
    )
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    next(broken.glob("model-*.safetensors")).unlink()
    (broken / "modeling_kimi_vl.py").unlink()
    with pytest.raises(PushError) as caught:
        plan_upload(broken)
    assert "which is missing" in str(caught.value) and "modeling_kimi_vl.py" in str(caught.value)
    with pytest.raises(PushError, match="use ORG/NAME"):
        check_repo_id("no-namespace")


def test_the_command_line_reports_a_file_system_refusal_without_a_traceback(source, tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    out = tmp_path / "a_file" / "out"  # its parent is a file: the export cannot make its temp folder there
    assert cli_main(["export", "--source", str(source), "--out", str(out), "--no-verify"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "a_file" in error and "Traceback" not in error
