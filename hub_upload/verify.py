"""Prove that an export stands on its own: load it in a fresh interpreter where only the exported files give our code.

The child runs `python -I -S` (no current directory, no PYTHONPATH, no user site, no `.pth` processing: our editable
install is a `.pth` hook, so it is not active there) from an empty temporary directory, with the interpreter's
site-packages added back by hand for torch and transformers, `HF_HUB_OFFLINE=1`, and an empty transformers modules
cache. A bootstrap asserts that none of our packages can be imported before it hands over to the script.
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
# How much of a failing child's output the error repeats.
OUTPUT_TAIL_CHARS = 6000
# Runs first in the child (`python -I -S -c BOOTSTRAP script args...`), then runs the script as __main__.
BOOTSTRAP = """
import importlib.util, os, runpy, sys
sys.path.extend(os.environ["KIMI_VL_SITE_PACKAGES"].split(os.pathsep))
specs = {name: importlib.util.find_spec(name) for name in os.environ["KIMI_VL_FORBIDDEN_PACKAGES"].split(",")}
importable = {name: spec.origin for name, spec in specs.items() if spec is not None}
if importable:
    sys.exit(f"isolation failed: {importable} can be imported here, so loading would not prove the export stands alone")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ExportVerificationError(RuntimeError):
    """The exported folder did not load or run through the Auto classes in a clean interpreter."""


def run_isolated(script: Path, *args: str) -> subprocess.CompletedProcess:
    """Run `script` with `args` in a clean interpreter (see the module docstring); output is captured as text."""
    with tempfile.TemporaryDirectory(prefix="kimi-vl-isolated-") as workdir:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_MODULES_CACHE": str(Path(workdir) / "modules"),
            "KIMI_VL_SITE_PACKAGES": os.pathsep.join(site.getsitepackages()),
            "KIMI_VL_FORBIDDEN_PACKAGES": ",".join(OWN_PACKAGES),
        }
        command = [sys.executable, "-I", "-S", "-c", BOOTSTRAP, str(Path(script).resolve()), *args]
        return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)


def verify_export(folder: Path) -> str:
    """Load `folder` with AutoConfig / AutoModelForCausalLM / AutoProcessor (trust_remote_code=True) and run a tiny
    multimodal forward and generation; return the child's report line, raise ExportVerificationError on failure."""
    result = run_isolated(ISOLATED_CHECK_SCRIPT, str(Path(folder).resolve()))
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-OUTPUT_TAIL_CHARS:]
        raise ExportVerificationError(
            f"the exported folder did not load and run in a clean interpreter (exit code {result.returncode}); "
            f"nothing was published. Its output ends with:\n{output}"
        )
    return result.stdout.strip().splitlines()[-1]
