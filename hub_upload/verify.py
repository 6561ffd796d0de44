"""Prove that an export stands on its own: load it in a fresh interpreter where only the exported files give our code.

The child runs `python -I -S` (no current directory, no PYTHONPATH, no user site, no `.pth` processing) from an empty
temporary directory, with `HF_HUB_OFFLINE=1` and an empty transformers modules cache. Its bootstrap first puts a finder
at the front of `sys.meta_path` that refuses to import our own top-level packages, then adds the interpreter's
site-packages back for torch and transformers. The finder is what isolates the child, however the project is installed:
a regular `pip install .` puts our packages in site-packages itself, an editable install hooks them in from there.
"""

import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

ISOLATED_CHECK_SCRIPT = Path(__file__).with_name("isolated_check.py")
# Our top-level packages; none of them may be importable in the child.
OWN_PACKAGES = ("modeling_kimi_vl", "image_processing", "hub_upload")
# Loading a full-size model on CPU takes minutes; the limit only keeps a hung child from blocking the export forever.
DEFAULT_VERIFY_TIMEOUT_S = 1800
# How much of a failing child's output the error repeats.
OUTPUT_TAIL_CHARS = 6000
# Runs first in the child (`python -I -S -c BOOTSTRAP script args...`), then runs the script as __main__.
BOOTSTRAP = """
import ctypes, importlib.abc, os, runpy, signal, sys

# Die with the parent: a parent killed outright (SIGKILL, out of memory) cannot stop this process itself. Linux only
# (prctl PR_SET_PDEATHSIG = 1); elsewhere the parent's own clean-up (timeout, interrupt, SIGTERM) is what stops it.
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
except (AttributeError, OSError, TypeError):  # no prctl in this C library, or no C library to open this way
    pass
else:
    if os.getppid() != int(os.environ["KIMI_VL_PARENT_PID"]):  # the parent was gone before the line above ran
        sys.exit("the process that started this check has ended")

class RefuseOwnPackages(importlib.abc.MetaPathFinder):
    forbidden = set(os.environ["KIMI_VL_FORBIDDEN_PACKAGES"].split(","))

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.forbidden:
            raise ModuleNotFoundError(
                f"No module named {name!r} (blocked: only the exported files may provide our code here)", name=name
            )
        return None

sys.meta_path.insert(0, RefuseOwnPackages())
sys.path.extend(os.environ["KIMI_VL_SITE_PACKAGES"].split(os.pathsep))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ExportVerificationError(RuntimeError):
    """The exported folder did not load or run through the Auto classes in a clean interpreter."""


def run_isolated(script: Path, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run `script` with `args` in a clean interpreter (see the module docstring); output is captured as text.
    Raises subprocess.TimeoutExpired (after killing the child) if it runs longer than `timeout` seconds; any other
    exception while it runs (KeyboardInterrupt, SIGTERM's Terminated) kills it too, and on Linux it dies with this
    process even when this one is killed outright."""
    with tempfile.TemporaryDirectory(prefix="kimi-vl-isolated-") as workdir:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_MODULES_CACHE": str(Path(workdir) / "modules"),
            "KIMI_VL_SITE_PACKAGES": os.pathsep.join(site.getsitepackages()),
            "KIMI_VL_FORBIDDEN_PACKAGES": ",".join(OWN_PACKAGES),
            "KIMI_VL_PARENT_PID": str(os.getpid()),
        }
        command = [sys.executable, "-I", "-S", "-c", BOOTSTRAP, str(Path(script).resolve()), *args]
        return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


def verify_export(folder: Path, timeout: float = DEFAULT_VERIFY_TIMEOUT_S) -> str:
    """Load `folder` with AutoConfig / AutoModelForCausalLM / AutoProcessor (trust_remote_code=True) and run a tiny
    multimodal forward and generation within `timeout` seconds; return the child's report line, raise
    ExportVerificationError on failure."""
    try:
        result = run_isolated(ISOLATED_CHECK_SCRIPT, str(Path(folder).resolve()), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ExportVerificationError(
            f"loading the exported folder in a clean interpreter did not finish within {timeout:g} s and was stopped; "
            "nothing was published. Raise --verify-timeout for a model this size, or skip the check with --no-verify."
        ) from None
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-OUTPUT_TAIL_CHARS:]
        raise ExportVerificationError(
            f"the exported folder did not load and run in a clean interpreter (exit code {result.returncode}); "
            f"nothing was published. Its output ends with:\n{output}"
        )
    return result.stdout.strip().splitlines()[-1]
