"""The repository stands on its own: a clone in an empty temporary folder (no shared/ or anything else beside it) runs
the tests that read the reference fixture and pass there, with this checkout's .venv (nothing is installed).

The clone holds the last commit, as a user's clone would: uncommitted changes are not in it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT

# Tests that read tests/fixtures/ through the conftest fixtures: the model against the original code's outputs, the
# image processor against the original's bytes, the tiny folder (written from the fixture), the release layout.
FIXTURE_TESTS = [
    "tests/test_modeling.py",
    "tests/test_image_processing.py::test_matches_fixture_for_every_image",
    "tests/test_image_processing.py::test_matches_fixture_batch_with_downscaling",
    "tests/test_tiny_checkpoint.py::test_tiny_model_is_the_reference_model",
    "tests/test_tiny_checkpoint.py::test_auto_classes_chat_template_and_generate",
    "tests/test_hub_upload.py::test_release_folder_loads_with_our_package_and_no_remote_code",
]


def git(*args: str, cwd: Path = REPO_ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_fixture_tests_pass_in_a_fresh_clone(tmp_path):
    try:
        commit = git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (e.g. an unpacked archive): there is nothing to clone")
    clone = tmp_path / "kimi-vl-hf"
    # A local clone copies the object store, so HEAD is there even when no branch points at it (CI's detached HEAD).
    git("clone", "--quiet", "--no-checkout", str(REPO_ROOT), str(clone))
    git("checkout", "--quiet", commit, cwd=clone)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kimi-vl-hf"]  # nothing beside it, no shared/

    # The clone's packages come first on the path, ahead of the editable install of this checkout.
    env = {**os.environ, "PYTHONPATH": str(clone)}
    imported_from = subprocess.run(
        [
            sys.executable,
            "-c",
            "import modeling_kimi_vl, image_processing, hub_upload, sys; "
            "print(*(m.__file__ for m in (modeling_kimi_vl, image_processing, hub_upload)), sep='\\n')",
        ],
        cwd=clone,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(Path(path).is_relative_to(clone) for path in imported_from), imported_from

    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *FIXTURE_TESTS],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in summary and not any(word in summary for word in ("skipped", "failed", "error")), summary
