"""`push`: publish an exported folder to the Hub as one commit.

The token is whatever huggingface_hub finds by itself (`HF_TOKEN`, or the one `hf auth login` stored); nothing here
reads or accepts a token file.
"""

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .export import check_export_folder


class PushError(ValueError):
    """The folder or the repository id cannot be pushed; nothing was sent."""


@dataclass(frozen=True)
class UploadPlan:
    folder: Path
    files: list[tuple[str, int]]  # (name in the repository, size in bytes), sorted by name
    skipped: list[str]  # hidden entries (.cache, .DS_Store, ...), never uploaded

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def plan_upload(folder: str | Path) -> UploadPlan:
    """The files `push` would send; raises PushError unless `folder` is a complete export."""
    folder = Path(folder)
    problems = check_export_folder(folder)
    entries = sorted(folder.iterdir()) if folder.is_dir() else []
    not_files = [entry.name for entry in entries if not entry.name.startswith(".") and not entry.is_file()]
    problems += [f"{name} is not a regular file; an export is a flat folder of files" for name in not_files]
    if problems:
        listing = "\n".join(f"  - {problem}" for problem in problems)
        raise PushError(
            f"{folder} is not a complete export (make one with `python -m hub_upload export`); nothing was uploaded:\n"
            f"{listing}"
        )
    files = [
        (entry.name, entry.stat().st_size) for entry in entries if entry.is_file() and not entry.name.startswith(".")
    ]
    skipped = [entry.name for entry in entries if entry.name.startswith(".")]
    return UploadPlan(folder=folder, files=files, skipped=skipped)


def check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(f"invalid --repo-id {repo_id!r}: {error}") from None
    if "/" not in repo_id:
        raise PushError(
            f"invalid --repo-id {repo_id!r}: use ORG/NAME (or USER/NAME), e.g. my-org/Kimi-VL-A3B-Instruct-hf"
        )


def push_folder(
    plan: UploadPlan,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str = "Upload Kimi-VL export (transformers-native remote code)",
    api: HfApi | None = None,
):
    """Create the repository (and branch) if needed, then upload every planned file in a single commit."""
    check_repo_id(repo_id)
    api = api or HfApi()
    # Without --private the Hub applies its default (the namespace's setting) rather than forcing "public".
    api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, repo_type="model", branch=revision, exist_ok=True)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=plan.folder / name) for name, _ in plan.files]
    return api.create_commit(repo_id, operations, commit_message=commit_message, repo_type="model", revision=revision)


def format_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
