"""The code an export ships: our runtime modules as flat files beside the weights, and the `auto_map`s that name them.

transformers' remote code loads `module.Class` from the repository root and follows `from .sibling import x` imports to
other files at the root. Our packages import siblings only that way, so their modules work unchanged when flattened;
`flat_code_files` checks that this still holds before anything is copied.
"""

import ast
from pathlib import Path

# Our packages sit beside this one, in a checkout as in site-packages.
PACKAGES_ROOT = Path(__file__).resolve().parents[1]
CODE_PACKAGES = (PACKAGES_ROOT / "modeling_kimi_vl", PACKAGES_ROOT / "image_processing")
# Modules of those packages that are not needed to load or run the model: package inits, test helpers, and the training
# data collator (fine-tuning runs from this project's installed packages; an exported repository is for inference).
NOT_SHIPPED = {"__init__.py", "tiny_tokenizer.py", "tiny_checkpoint.py", "data_collator_kimi_vl.py"}
CHAT_TEMPLATE_FILE = PACKAGES_ROOT / "image_processing" / "chat_template.jinja"

CONFIG_CLASS = "configuration_kimi_vl.KimiVLConfig"
MODEL_CLASS = "modeling_kimi_vl.KimiVLForConditionalGeneration"
IMAGE_PROCESSOR_CLASS = "image_processing_kimi_vl.KimiVLImageProcessor"
PROCESSOR_CLASS = "processing_kimi_vl.KimiVLProcessor"
TOKENIZER_CLASS = "tokenization_kimi_vl.KimiVLTokenizer"

MODEL_AUTO_MAP = {
    "AutoConfig": CONFIG_CLASS,
    "AutoModel": MODEL_CLASS,
    "AutoModelForCausalLM": MODEL_CLASS,
    "AutoModelForImageTextToText": MODEL_CLASS,
    "AutoImageProcessor": IMAGE_PROCESSOR_CLASS,
    "AutoProcessor": PROCESSOR_CLASS,
}
PREPROCESSOR_AUTO_MAP = {"AutoImageProcessor": IMAGE_PROCESSOR_CLASS, "AutoProcessor": PROCESSOR_CLASS}
# AutoTokenizer reads tokenizer_config.json's auto_map: a (slow, fast) pair; ours is a single Python tokenizer.
TOKENIZER_AUTO_MAP = {"AutoTokenizer": [TOKENIZER_CLASS, None]}
# Every class an auto_map names must live in a shipped file.
AUTO_MAP_CLASSES = (CONFIG_CLASS, MODEL_CLASS, IMAGE_PROCESSOR_CLASS, PROCESSOR_CLASS, TOKENIZER_CLASS)


class RemoteCodeError(RuntimeError):
    """Our own packages cannot be shipped as flat files (a development error, not a user one)."""


def flat_code_files() -> dict[str, Path]:
    """File name at the repository root -> source file, for every runtime module of our packages."""
    files: dict[str, Path] = {}
    problems = []
    for package in CODE_PACKAGES:
        for path in sorted(package.glob("*.py")):
            if path.name in NOT_SHIPPED:
                continue
            if path.name in files:
                problems.append(f"{path.name} exists in both {files[path.name].parent} and {package}")
            files[path.name] = path
    for path in files.values():
        problems.extend(_flat_import_problems(path, set(files)))
    for class_ref in AUTO_MAP_CLASSES:
        module = class_ref.split(".")[0] + ".py"
        if module not in files:
            problems.append(f"the auto_map names {class_ref} but {module} is not among the shipped files")
    if problems:
        raise RemoteCodeError("our code cannot be shipped as flat files:\n" + "\n".join(f"  - {p}" for p in problems))
    return files


def _flat_import_problems(path: Path, shipped: set[str]) -> list[str]:
    """Imports in `path` that would break once it sits flat beside the other shipped files."""
    problems = []
    own_packages = {package.name for package in CODE_PACKAGES}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            target = f"{node.module}.py" if node.module else None
            if node.level != 1 or target is None:
                problems.append(f"{path.name}:{node.lineno}: only `from .sibling import x` survives flattening")
            elif target not in shipped:
                problems.append(f"{path.name}:{node.lineno}: imports .{node.module}, which is not shipped")
        else:
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for module in modules:
                if module.split(".")[0] in own_packages:
                    problems.append(f"{path.name}:{node.lineno}: imports {module}, which does not exist on the Hub")
    return problems
