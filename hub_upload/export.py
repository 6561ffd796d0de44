"""`export`: turn a Kimi-VL folder in the original layout into a self-contained trust_remote_code repository.

    read_source(source)        every input checked, all problems in one error; nothing written yet
    write into a temp folder   beside the target: weights re-sharded, configs with our auto_map, flat code, tokenizer
    check_export_folder        the structural checks `push` applies
    verify_export              a fresh interpreter that cannot import our packages loads it through the Auto classes
    publish                    rename into place; with --overwrite, the old target (an earlier export or an empty
                               folder, nothing else; an export holding files that no export writes only with
                               --delete-added-files as well) is first moved into an aside folder
                               `.NAME.kimi-vl-export-old-XXXXXXXX` (8 random hex digits) and deleted afterwards

Any failure or interrupt (KeyboardInterrupt included, and SIGTERM, which the command line turns into one) before the new
folder is in place removes the temp folder and leaves the target as it was. What can stay behind: a process killed
outright leaves its temp folder `.NAME.partial-XXXXXXXX` (8 random hex digits) with its lock file
`.NAME.partial-XXXXXXXX.lock` beside it, and one killed or interrupted inside `publish` can leave the old target in its
aside folder (whole if the new folder was not in place yet, partly deleted if it was; a killed one leaves the aside
folder's lock file too). The next export to the same target cleans up both first, touching no folder of any other name.
A temp folder is deleted unless a running export holds its lock (a `filelock.FileLock` on the lock file, which the
system releases when the process ends, however it ends). Each export takes that lock before it creates its temp folder,
so another export's clean-up never finds a running export's folder unlocked. (A process killed in the instant between
taking the lock and creating the folder, or between removing the folder and its lock file, leaves an empty lock file
behind, which every export leaves alone: none can tell it from the lock file of an export that is just starting. So does
an export on Windows whose lock file another export's clean-up had open when it tried to delete it.) Aside folders are
locked the same way, from before `publish` creates one until it is deleted, and only those whose lock nobody holds are
settled: if the target exists, the aside folder was already replaced and is deleted; if the target is missing, the old
folder goes back into place when it is a complete export (as `check_export_folder` says), and is otherwise left where it
is, named in a warning (until a later export, with the target then in place, deletes it as above).
"""

import contextlib
import glob
import json
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from .model_card import ModelCardInfo, render_model_card
from .remote_code import (
    CHAT_TEMPLATE_FILE,
    MODEL_AUTO_MAP,
    PREPROCESSOR_AUTO_MAP,
    TOKENIZER_AUTO_MAP,
    TOKENIZER_CLASS,
    flat_code_files,
)
from .source import (
    CARRIED_FILE_NAMES,
    CHAT_TEMPLATE_NAME,
    CONFIG_NAME,
    PREPROCESSOR_CONFIG_NAME,
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_MODEL_NAME,
    ExportInputError,
    SourceCheckpoint,
    is_plain_file_name,
    read_source,
)
from .verify import DEFAULT_VERIFY_TIMEOUT_S, verify_export
from .weights import INDEX_NAME, parse_size, plan_shards, read_header, write_shards

DEFAULT_MAX_SHARD_SIZE = "5GB"
ASIDE_SUFFIX_BYTES = 4  # random hex suffix of the folder an overwritten target is moved into: 8 digits
STAGING_SUFFIX_BYTES = 4  # random hex suffix of an export's temp folder: 8 digits
LOCK_SUFFIX = ".lock"  # a temp folder's lock file is its name with this added, beside it
MODEL_CARD_NAME = "README.md"
MAX_LISTED_ADDED = 10  # entries named in the refusal of an --overwrite that would delete files someone added
REQUIRED_EXPORT_FILES = (
    CONFIG_NAME,
    PREPROCESSOR_CONFIG_NAME,
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_MODEL_NAME,
    CHAT_TEMPLATE_NAME,
    INDEX_NAME,
    MODEL_CARD_NAME,
)


@dataclass(frozen=True)
class ExportResult:
    folder: Path
    files: list[str]
    num_shards: int
    verified: bool


def export_checkpoint(
    source: str | Path,
    out: str | Path,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    delete_added_files: bool = False,
    verify: bool = True,
    verify_timeout: float = DEFAULT_VERIFY_TIMEOUT_S,
    card: ModelCardInfo | None = None,
) -> ExportResult:
    source, out = Path(source).resolve(), Path(out).resolve()
    card = card or ModelCardInfo()
    max_shard_bytes = parse_size(str(max_shard_size))
    code_files = flat_code_files()

    _remove_abandoned_staging(out)
    _settle_interrupted_publish(out)
    problems = _output_problems(source, out, overwrite, delete_added_files, code_files)
    try:
        checkpoint = read_source(source)
    except ExportInputError as error:
        problems = error.problems + problems
    if problems:
        raise ExportInputError(source, problems)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f"{_staging_prefix(out)}{secrets.token_hex(STAGING_SUFFIX_BYTES)}"
    staging_lock = _create_locked_folder(staging)  # until the export ends: not abandoned
    try:
        num_shards = _write_export(checkpoint, staging, max_shard_bytes, code_files, card)
        for path in staging.iterdir():
            path.chmod(0o644)  # readable by everyone, as a download is, whatever the umask or the source's modes
        structural_problems = check_export_folder(staging)
        if structural_problems:  # our own writer disagrees with our own checker: a bug, never a user error
            raise RuntimeError("the export is inconsistent:\n" + "\n".join(structural_problems))
        if verify:
            verify_export(staging, timeout=verify_timeout)
        files = sorted(path.name for path in staging.iterdir())
        if out.exists() and not overwrite:  # another export into `out` finished while this one ran
            raise ExportInputError(
                source, [f"--out {out} appeared while this export ran; pass --overwrite to replace it"]
            )
        _publish(staging, out)
    except BaseException:  # KeyboardInterrupt included: never leave a half-written folder behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _release_and_remove(staging_lock)
    return ExportResult(folder=out, files=files, num_shards=num_shards, verified=verify)


def _output_problems(
    source: Path, out: Path, overwrite: bool, delete_added_files: bool, code_files: dict[str, Path]
) -> list[str]:
    if out == source or out.is_relative_to(source) or source.is_relative_to(out):
        return [f"--out {out} overlaps --source {source}; export into a separate folder"]
    if out.exists() and not out.is_dir():
        return [f"--out {out} exists and is not a folder"]
    if out.exists() and not overwrite:
        return [f"--out {out} already exists; pass --overwrite to replace it"]
    if out.exists() and any(out.iterdir()):
        not_an_export = check_export_folder(out)
        if not_an_export:
            return [
                f"--out {out} holds files but is not a complete export ({'; '.join(not_an_export[:3])}); --overwrite "
                "replaces only an earlier export or an empty folder, so it is left alone: choose another --out"
            ]
        added = _added_entries(out, code_files)
        if added and not delete_added_files:
            listed = ", ".join(added[:MAX_LISTED_ADDED]) + (", ..." if len(added) > MAX_LISTED_ADDED else "")
            return [
                f"--out {out} is an earlier export, but it also holds {len(added)} entries that no export writes "
                f"({listed}), which --overwrite would delete; move them elsewhere first, or pass --delete-added-files "
                "as well to delete them"
            ]
    return []


def _added_entries(export: Path, code_files: dict[str, Path]) -> list[str]:
    """Entries of a complete export that no export writes: what someone added (notes, evaluation results, a clone's
    .git), folders marked with a trailing /. Files named as an export names its files count as the export's."""
    written = {*REQUIRED_EXPORT_FILES, *CARRIED_FILE_NAMES, *code_files}
    written.update(json.loads((export / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"].values())
    return sorted(
        entry.name + ("/" if entry.is_dir() else "") for entry in export.iterdir() if entry.name not in written
    )


def _write_export(
    checkpoint: SourceCheckpoint, folder: Path, max_shard_bytes: int, code_files: dict[str, Path], card: ModelCardInfo
) -> int:
    shards = plan_shards(checkpoint.tensors, max_shard_bytes)
    index = write_shards(shards, folder)
    _write_json(folder / INDEX_NAME, index)

    _write_json(folder / CONFIG_NAME, {**checkpoint.config, "auto_map": MODEL_AUTO_MAP})
    _write_json(
        folder / PREPROCESSOR_CONFIG_NAME, {**checkpoint.preprocessor_config, "auto_map": PREPROCESSOR_AUTO_MAP}
    )
    # The template moves to chat_template.jinja; the class is ours (the release names its TikTokenTokenizer).
    tokenizer_config = {key: value for key, value in checkpoint.tokenizer_config.items() if key != "chat_template"}
    tokenizer_config.update(auto_map=TOKENIZER_AUTO_MAP, tokenizer_class=TOKENIZER_CLASS.split(".")[-1])
    _write_json(folder / TOKENIZER_CONFIG_NAME, tokenizer_config)
    # Carried over byte for byte, as read_source read and checked them (the tokenizer model, optional JSON files).
    for name, content in checkpoint.carried_files.items():
        (folder / name).write_bytes(content)
    # The checkpoint's own template wins (a fine-tune may have changed it); otherwise ours, which matches the release.
    chat_template = checkpoint.chat_template or CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    (folder / CHAT_TEMPLATE_NAME).write_text(chat_template, encoding="utf-8")

    for name, path in code_files.items():
        shutil.copyfile(path, folder / name)
    (folder / MODEL_CARD_NAME).write_text(
        render_model_card(checkpoint.config, card, checkpoint.quantization), encoding="utf-8"
    )
    return len(shards)


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _publish(staging: Path, out: Path) -> None:
    """Move the finished folder to `out`. An existing `out` is renamed aside first and deleted only afterwards, so a
    failure in between puts it back (a killed process leaves it aside for `_settle_interrupted_publish`). The aside
    folder is locked as a temp folder is, until it is gone: another export's settling leaves it alone meanwhile."""
    if not out.exists():
        os.rename(staging, out)
        return
    aside = out.parent / f"{_aside_prefix(out)}{secrets.token_hex(ASIDE_SUFFIX_BYTES)}"
    aside_lock = _create_locked_folder(aside)
    try:
        os.rename(out, aside / out.name)
        try:
            os.rename(staging, out)
        except BaseException:
            os.rename(aside / out.name, out)
            raise
        shutil.rmtree(aside)
    finally:
        _release_and_remove(aside_lock)


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def _folder_lock(folder: Path) -> FileLock:
    """The lock of an export's temp or aside folder: its lock file beside it, taken without waiting (`Timeout` if
    held)."""
    return FileLock(folder.with_name(folder.name + LOCK_SUFFIX), timeout=0)


def _create_locked_folder(folder: Path) -> FileLock:
    """Create the temp or aside folder `folder` and return its lock, held. The lock is taken before the folder exists,
    so that another export's clean-up (`_remove_abandoned_staging`, `_settle_interrupted_publish`), which handles only
    the folders whose lock nobody holds, never sees it free."""
    lock = _folder_lock(folder)
    lock.acquire()  # a name in use already (by a 1 in 4 billion chance) fails here or in mkdir, before anything else
    try:
        folder.mkdir()
        folder.chmod(0o755)  # an ordinary folder, readable by everyone as a download is, whatever the umask
    except BaseException:
        _release_and_remove(lock)
        raise
    return lock


def _release_and_remove(lock: FileLock) -> None:
    """Release a temp or aside folder's lock and delete its file (filelock keeps the file on Unix, for other waiters;
    nobody waits for these locks), once the folder is gone. A lock file that cannot be deleted stays, empty: Windows
    refuses while another export's clean-up has it open, and the export (published, or failing with its own error)
    must not fail on it."""
    lock.release()
    with contextlib.suppress(OSError):
        Path(lock.lock_file).unlink(missing_ok=True)


def _remove_abandoned_staging(out: Path) -> None:
    """Delete the temp folders of exports into `out` that were killed outright (see the module docstring), with their
    lock files: those of exactly the form the export names them whose lock no running export holds."""
    for staging in _abandoned_folders(out, _staging_prefix(out), STAGING_SUFFIX_BYTES):
        shutil.rmtree(staging)


def _abandoned_folders(out: Path, prefix: str, suffix_bytes: int) -> Iterator[Path]:
    """The folders beside `out` named `prefix` + `suffix_bytes` random bytes in hex (exactly as an export names its
    temp or aside folders; links and anything else are left alone) whose lock no running export holds. Each is
    yielded with its lock held, which is released, and its file deleted, when the caller is done with it."""
    name = re.compile(re.escape(prefix) + f"[0-9a-f]{{{2 * suffix_bytes}}}")
    for folder in sorted(out.parent.glob(glob.escape(prefix) + "*")):
        if not name.fullmatch(folder.name) or not folder.is_dir() or folder.is_symlink():
            continue
        lock = _folder_lock(folder)
        try:
            lock.acquire()
        except Timeout:  # a running export's
            continue
        try:
            if folder.is_dir():  # not removed by its export, or by another's clean-up, in the meantime
                yield folder
        finally:
            _release_and_remove(lock)


def _aside_prefix(out: Path) -> str:
    return f".{out.name}.kimi-vl-export-old-"


def _settle_interrupted_publish(out: Path) -> None:
    """Finish what a `_publish` into `out` that was killed left behind, in aside folders named exactly as `_publish`
    names them (any other folder, whatever its name, is left alone).

    Such a folder holds the old target: whole if the process died before the new one was in place, partly deleted
    if it died while deleting it. With `out` in place, the aside folder had been replaced and is deleted. With `out`
    missing, its old folder goes back into place if it is a complete export; if not, nothing is moved or deleted and a
    warning names the folder (a later export, with `out` then in place, deletes it as above).
    """
    for aside in _abandoned_folders(out, _aside_prefix(out), ASIDE_SUFFIX_BYTES):
        _settle_aside_folder(aside, out)


def _settle_aside_folder(aside: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(aside)
        return
    problems = check_export_folder(aside / out.name)
    if problems:
        warnings.warn(
            f"{aside} is left by an interrupted export into {out} but does not hold a complete export "
            f"({'; '.join(problems[:3])}), so it was not put back and is left as it is; move out what you need "
            f"before the next export into {out}, which deletes it once {out} exists",
            stacklevel=4,
        )
        return
    os.rename(aside / out.name, out)
    shutil.rmtree(aside)


def check_export_folder(folder: str | Path) -> list[str]:
    """What makes `folder` not a complete export (empty if it is one). Cheap: reads JSON files and weight headers."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    problems = [f"{name} is missing" for name in REQUIRED_EXPORT_FILES if not (folder / name).is_file()]
    for name, expected_auto_map in (
        (CONFIG_NAME, MODEL_AUTO_MAP),
        (PREPROCESSOR_CONFIG_NAME, PREPROCESSOR_AUTO_MAP),
        (TOKENIZER_CONFIG_NAME, TOKENIZER_AUTO_MAP),
    ):
        problems.extend(_auto_map_problems(folder / name, expected_auto_map))
    problems.extend(_weight_problems(folder))
    return problems


def _auto_map_problems(path: Path, expected_auto_map: dict) -> list[str]:
    if not path.is_file():
        return []
    try:
        auto_map = json.loads(path.read_text(encoding="utf-8")).get("auto_map")
    except (ValueError, AttributeError):
        return [f"{path.name} is not a JSON object"]
    if auto_map != expected_auto_map:
        return [f"{path.name} has auto_map {auto_map!r}; an export has {expected_auto_map!r}"]
    class_refs = [ref for refs in expected_auto_map.values() for ref in (refs if isinstance(refs, list) else [refs])]
    modules = sorted({ref.split(".")[0] for ref in class_refs if ref})
    return [
        f"{path.name}'s auto_map needs {module}.py, which is missing"
        for module in modules
        if not (path.parent / f"{module}.py").is_file()
    ]


def _weight_problems(folder: Path) -> list[str]:
    if not (folder / INDEX_NAME).is_file():
        return []
    try:
        weight_map = json.loads((folder / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError):
        return [f"{INDEX_NAME} has no weight_map"]
    if not isinstance(weight_map, dict):
        return [f"{INDEX_NAME} has no weight_map object"]
    if not weight_map:
        return [f"{INDEX_NAME} lists no tensors"]
    not_file_names = sorted({repr(name) for name in weight_map.values() if not is_plain_file_name(name)})
    if not_file_names:  # an export's shards sit beside its index; nothing elsewhere is read
        return [f"{INDEX_NAME} names {name} as a shard, which is not a file name beside it" for name in not_file_names]
    problems = []
    for file_name in sorted(set(weight_map.values())):
        if not (folder / file_name).is_file():
            problems.append(f"{INDEX_NAME} names {file_name}, which is missing")
            continue
        try:
            held = set(read_header(folder / file_name))
        except ValueError as error:
            problems.append(str(error))
            continue
        listed = {name for name, file in weight_map.items() if file == file_name}
        if held != listed:
            problems.append(
                f"{file_name} holds {len(held)} tensors, {len(held ^ listed)} of them not as {INDEX_NAME} says"
            )
    return problems
