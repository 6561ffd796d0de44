"""Start `app.py` with the tiny demo model on a free loopback port, in a subprocess, for the demo's tests."""

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from image_processing import SANITIZING_SUPPORTED

REPO_ROOT = Path(__file__).resolve().parents[1]
# Gradio's import, building the tiny checkpoint and loading it take ~15 s on a 2-core machine; this is generous.
STARTUP_TIMEOUT_S = 180


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_demo(work_dir: Path, *extra_args: str):
    """Yield the URL of a running demo (tiny model, its checkpoint cached under work_dir); stop it afterwards.

    The server's output goes to work_dir/server.log, which a failure quotes; Gradio stores uploads under
    work_dir/uploads.
    """
    if not SANITIZING_SUPPORTED:
        pytest.skip("the demo needs transformers' sanitize_control_tokens (5.24), which this transformers lacks")
    port = free_loopback_port()
    log_path = work_dir / "server.log"
    command = [
        sys.executable,
        str(REPO_ROOT / "app.py"),
        "--model",
        "tiny",
        "--port",
        str(port),
        "--cache-dir",
        str(work_dir / "cache"),
        *extra_args,
    ]
    with open(log_path, "w") as log:
        env = {**os.environ, "GRADIO_TEMP_DIR": str(work_dir / "uploads")}
        server = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _answers(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the demo did not start (exit code {server.poll()}):\n{log_path.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
