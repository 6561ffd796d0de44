"""Reading and checking a Kimi-VL folder before anything is exported: the original hub layout, or a folder written by
transformers 5's `save_pretrained` (model and processor, e.g. a fine-tune saved by this project, or a model quantized
on load with this project's `KimiVLWeightOnlyConfig`).

Every problem found is collected, so one run reports all of them at once (a missing tokenizer AND a wrong tensor shape),
and nothing has been written when the error is raised.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.core_model_loading import revert_weight_conversion

from modeling_kimi_vl import KimiVLConfig, KimiVLForConditionalGeneration, KimiVLWeightOnlyConfig
from modeling_kimi_vl.quantization_kimi_vl import QUANT_METHOD, replace_with_weight_only_modules

from .weights import INDEX_NAME, SINGLE_FILE_NAME, TensorEntry, natural_key, read_header

CONFIG_NAME = "config.json"
PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"
# transformers 5's `processor.save_pretrained` writes the image processor's settings nested in this file instead.
PROCESSOR_CONFIG_NAME = "processor_config.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
TOKENIZER_MODEL_NAME = "tiktoken.model"
SPECIAL_TOKENS_MAP_NAME = "special_tokens_map.json"  # optional; older tokenizer saves have it
GENERATION_CONFIG_NAME = "generation_config.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"
# Long lists (a checkpoint of the wrong model) are cut to this many lines per kind of problem.
MAX_LISTED = 20
# safetensors' names of the integer dtypes quantized weights are stored in; every other tensor is floating point.
SAFETENSORS_INTEGER_DTYPES = {torch.int8: "I8", torch.uint8: "U8"}
SAFETENSORS_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Carried into the export byte for byte when the source has them (the tokenizer model must be there, see read_source).
CARRIED_FILE_NAMES = (TOKENIZER_MODEL_NAME, SPECIAL_TOKENS_MAP_NAME, GENERATION_CONFIG_NAME)
# Everything the export reads from the source: these names and the weight files (*.safetensors).
READ_FILE_NAMES = (
    CONFIG_NAME,
    TOKENIZER_CONFIG_NAME,
    PREPROCESSOR_CONFIG_NAME,
    PROCESSOR_CONFIG_NAME,
    CHAT_TEMPLATE_NAME,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    *CARRIED_FILE_NAMES,
)


class ExportInputError(ValueError):
    """The source folder cannot be exported; `problems` lists every reason found."""

    def __init__(self, folder: Path, problems: list[str]):
        self.folder = folder
        self.problems = problems
        listing = "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(f"cannot export {folder}: {len(problems)} problem(s) found, nothing was written:\n{listing}")


@dataclass(frozen=True)
class SourceCheckpoint:
    folder: Path
    config: dict
    tensors: list[TensorEntry]
    tokenizer_config: dict
    preprocessor_config: dict  # the image processor's settings, from whichever of the two files the folder has
    chat_template: str | None  # the checkpoint's own template, if it ships one
    carried_files: dict[str, bytes]  # name -> content, of the CARRIED_FILE_NAMES the source has; JSON ones checked
    quantization: KimiVLWeightOnlyConfig | None  # config.json's quantization_config, if the weights are quantized


def read_source(folder: Path) -> SourceCheckpoint:
    """Inventory `folder` and check it against the model its config describes; ExportInputError if anything is off."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportInputError(folder, [f"{folder} is not a folder"])
    unsafe = _unsafe_files(folder)
    if unsafe:  # refused before any of them is opened: a link could lead to a secret, a device or a pipe
        raise ExportInputError(folder, unsafe)
    problems: list[str] = []
    config = _read_json(folder / CONFIG_NAME, problems)
    tokenizer_config = _read_json(folder / TOKENIZER_CONFIG_NAME, problems)
    preprocessor_config = _read_image_processor_config(folder, problems)
    if not (folder / TOKENIZER_MODEL_NAME).is_file():
        problems.append(f"{TOKENIZER_MODEL_NAME} is missing (the tiktoken BPE ranks the tokenizer reads)")
    tensors = _read_weights(folder, problems)
    carried_files = _read_carried_files(folder, problems)
    model_config = _check_config(config, problems) if config is not None else None
    quantization = None
    if model_config is not None:
        understood, quantization = _check_quantization_config(config, problems)
        if understood and tensors:
            _check_tensors_against_model(model_config, quantization, tensors, problems)
    if problems:
        raise ExportInputError(folder, problems)
    return SourceCheckpoint(
        folder=folder,
        config=config,
        tensors=tensors,
        tokenizer_config=tokenizer_config,
        preprocessor_config=preprocessor_config,
        chat_template=_read_chat_template(folder, tokenizer_config),
        carried_files=carried_files,
        quantization=quantization,
    )


def _read_json(path: Path, problems: list[str]) -> dict | None:
    if not path.is_file():
        problems.append(f"{path.name} is missing")
        return None
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        problems.append(f"{path.name} is not valid JSON ({error})")
        return None
    if not isinstance(content, dict):
        problems.append(f"{path.name} must hold a JSON object, found {type(content).__name__}")
        return None
    return content


def _read_image_processor_config(folder: Path, problems: list[str]) -> dict | None:
    """preprocessor_config.json (the hub layout), else the `image_processor` object of processor_config.json with the
    processor class beside it, as in the hub layout (transformers 5's `save_pretrained`)."""
    if (folder / PREPROCESSOR_CONFIG_NAME).is_file():
        return _read_json(folder / PREPROCESSOR_CONFIG_NAME, problems)
    if not (folder / PROCESSOR_CONFIG_NAME).is_file():
        problems.append(
            f"{PREPROCESSOR_CONFIG_NAME} is missing (the image processor's settings; a folder written by "
            f"transformers 5's save_pretrained has them in {PROCESSOR_CONFIG_NAME}, also missing)"
        )
        return None
    processor_config = _read_json(folder / PROCESSOR_CONFIG_NAME, problems)
    if processor_config is None:
        return None
    image_processor_config = processor_config.get("image_processor")
    if not isinstance(image_processor_config, dict):
        problems.append(
            f"{PROCESSOR_CONFIG_NAME} has no image_processor object (and there is no {PREPROCESSOR_CONFIG_NAME}); "
            "one of them must hold the image processor's settings"
        )
        return None
    processor_class = processor_config.get("processor_class")
    return {**image_processor_config, **({"processor_class": processor_class} if processor_class else {})}


def _read_weights(folder: Path, problems: list[str]) -> list[TensorEntry]:
    """All tensors of the checkpoint: from the index and the shards it names, or from the single model.safetensors."""
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        index = _read_json(index_path, problems)
        weight_map = index.get("weight_map") if index is not None else None
        if index is not None and not isinstance(weight_map, dict):
            problems.append(f"{INDEX_NAME} has no weight_map object")
        if not isinstance(weight_map, dict):
            return []
        if not weight_map:
            problems.append(f"{INDEX_NAME} lists no tensors (its weight_map is empty)")
            return []
        return _read_indexed_shards(folder, weight_map, problems)
    if (folder / SINGLE_FILE_NAME).is_file():
        header = _read_shard_header(folder / SINGLE_FILE_NAME, problems)
        if header is None:
            return []
        if not header:
            problems.append(f"{SINGLE_FILE_NAME} holds no tensors")
        return list(header.values())
    problems.append(f"no weights: neither {INDEX_NAME} nor {SINGLE_FILE_NAME} is in the folder")
    return []


def _read_indexed_shards(folder: Path, weight_map: dict, problems: list[str]) -> list[TensorEntry]:
    names_by_file: dict[str, set[str]] = {}
    for name, file_name in weight_map.items():
        names_by_file.setdefault(file_name, set()).add(name)
    tensors = []
    for file_name, names in sorted(names_by_file.items()):
        path = folder / file_name  # a plain file name: _unsafe_files refused any other before reading
        if not path.is_file():
            problems.append(
                f"{INDEX_NAME} names {file_name!r} ({len(names)} tensors), which is not a file in the folder"
            )
            continue
        header = _read_shard_header(path, problems)
        if header is None:
            continue
        absent = sorted(names - header.keys(), key=natural_key)
        _list_problems(problems, absent, f"{INDEX_NAME} places {{}} in {file_name}, which does not hold it")
        unlisted = sorted(header.keys() - names, key=natural_key)
        _list_problems(problems, unlisted, f"{file_name} holds {{}}, which {INDEX_NAME} does not list")
        tensors.extend(header[name] for name in names & header.keys())
    return tensors


def _read_shard_header(path: Path, problems: list[str]) -> dict[str, TensorEntry] | None:
    """The file's tensors, or None (with the reason added to `problems`) if its header cannot be read."""
    try:
        return read_header(path)
    except (ValueError, KeyError, TypeError) as error:
        problems.append(str(error) if isinstance(error, ValueError) else f"{path.name}: malformed header ({error!r})")
        return None


def _check_config(config: dict, problems: list[str]) -> KimiVLConfig | None:
    missing = [key for key in ("vision_config", "text_config") if not isinstance(config.get(key), dict)]
    for key in missing:
        problems.append(f"{CONFIG_NAME} has no {key} object; a Kimi-VL config nests the vision and the text config")
    if config.get("model_type") != KimiVLConfig.model_type:
        problems.append(
            f"{CONFIG_NAME} has model_type {config.get('model_type')!r}; expected {KimiVLConfig.model_type!r}"
        )
    if missing:
        return None
    try:
        return KimiVLConfig.from_dict(config)
    except (ValueError, TypeError) as error:
        problems.append(f"{CONFIG_NAME} does not describe a valid Kimi-VL model: {error}")
        return None


def _check_quantization_config(config: dict, problems: list[str]) -> tuple[bool, KimiVLWeightOnlyConfig | None]:
    """(whether the weights' format is understood, the quantization config if they are quantized).

    Understood: float weights (no quantization_config), and weights saved by this project's quantizer (a top-level
    `quantization_config` with `quant_method: kimi_vl_weight_only` and valid options, as save_pretrained writes it).
    Any other method (fp8, bitsandbytes, ...) stores tensors this export can neither check nor load in its
    verification, so it is refused, and its tensors are not listed one by one.
    """
    exportable = (
        f"only float checkpoints and checkpoints quantized by kimi-vl-hf's KimiVLWeightOnlyConfig "
        f"(quant_method {QUANT_METHOD!r}) can be exported"
    )
    if config["text_config"].get("quantization_config") is not None:
        problems.append(
            f"{CONFIG_NAME}'s text_config has a quantization_config, which kimi-vl-hf never writes: {exportable}"
        )
        return False, None
    quantization = config.get("quantization_config")
    if quantization is None:
        return True, None
    quant_method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if quant_method != QUANT_METHOD:
        problems.append(f"{CONFIG_NAME}'s quantization_config has quant_method {quant_method!r}: {exportable}")
        return False, None
    pattern_problems = _module_pattern_problems(quantization.get("modules_to_not_convert"))
    if pattern_problems:
        problems.extend(pattern_problems)
        return False, None
    try:
        return True, KimiVLWeightOnlyConfig.from_dict(quantization)
    except (ValueError, TypeError) as error:
        problems.append(f"{CONFIG_NAME}'s quantization_config is not a valid {QUANT_METHOD} config: {error}")
        return False, None


def _module_pattern_problems(modules) -> list[str]:
    """Why a quantization_config's `modules_to_not_convert` (None: the default list) cannot be matched against module
    names as transformers matches them (each entry a prefix, regex or suffix). Checked here because the config class
    takes any iterable (a string becomes its characters) and a bad regex fails only when a module is matched."""
    if modules is None:
        return []
    name = f"{CONFIG_NAME}'s quantization_config's modules_to_not_convert"
    problems = []
    if not isinstance(modules, list) or not all(isinstance(module, str) for module in modules):
        problems.append(f"{name} must be a list of module names (strings), got {modules!r}")
    for pattern in modules if isinstance(modules, list) else ():
        if not isinstance(pattern, str):
            continue
        try:
            re.compile(f"(?:{pattern})")  # as transformers' should_convert_module uses it
        except re.error as error:
            problems.append(f"{name}: {pattern!r} is not a valid regular expression ({error})")
    return problems


def expected_checkpoint_tensors(
    config: KimiVLConfig, quantization: KimiVLWeightOnlyConfig | None = None
) -> dict[str, torch.Tensor]:
    """Key -> meta tensor (shape, dtype) of every tensor a checkpoint of `config` holds, in the original (saved) key
    layout. Float tensors are float32 here; a checkpoint may hold them in any floating-point dtype.

    The model is built on the meta device (no memory); for a quantized checkpoint, the quantizer's own module swap
    gives its quantized weights (int8, or int4 packed in uint8) and their `*_scale` tensors. transformers' save-time
    conversion then turns the state dict into the checkpoint layout (e.g. the fused MoE expert tensors back into
    per-expert linears; the experts' scales stay one `[experts, ...]` tensor per projection), as save_pretrained does.
    """
    with torch.device("meta"):
        model = KimiVLForConditionalGeneration(config)
    if quantization is not None:
        replace_with_weight_only_modules(model, quantization.make_scheme(), quantization.modules_to_not_convert)
    return revert_weight_conversion(model, model.state_dict())


def _check_tensors_against_model(
    config: KimiVLConfig,
    quantization: KimiVLWeightOnlyConfig | None,
    tensors: list[TensorEntry],
    problems: list[str],
) -> None:
    try:
        expected = expected_checkpoint_tensors(config, quantization)
    except ValueError as error:  # an int4 group size that does not divide a layer's inputs
        problems.append(f"{CONFIG_NAME}'s quantization_config does not fit the model: {error}")
        return
    found = {entry.name: entry for entry in tensors}
    missing = sorted(expected.keys() - found.keys(), key=natural_key)
    _list_problems(problems, missing, "missing tensor {} (the config's model needs it)")
    unexpected = sorted(found.keys() - expected.keys(), key=natural_key)
    _list_problems(problems, unexpected, "unexpected tensor {} (the config's model has no such weight)")
    present = sorted(expected.keys() & found.keys(), key=natural_key)
    wrong_shape = [name for name in present if found[name].shape != tuple(expected[name].shape)]
    _list_problems(
        problems,
        [
            f"{name} in {found[name].file.name} has shape {list(found[name].shape)}, "
            f"the config needs {list(expected[name].shape)}"
            for name in wrong_shape
        ],
        "tensor {}",
    )
    wrong_dtype = [name for name in present if found[name].dtype not in _allowed_dtypes(expected[name])]
    _list_problems(
        problems,
        [
            f"{name} in {found[name].file.name} is {found[name].dtype}, "
            f"the config needs {' or '.join(_allowed_dtypes(expected[name]))}"
            for name in wrong_dtype
        ],
        "tensor {}",
    )
    # The quantized layout: the integer weights, and the scales the quantizer saves beside them as `<weight>_scale`,
    # expected by the config or found in the checkpoint (quantized where the config keeps the model dtype).
    in_layout = [
        name
        for name in (*missing, *wrong_shape, *wrong_dtype)
        if expected[name].dtype in SAFETENSORS_INTEGER_DTYPES or name.endswith("_scale")
    ] + [
        name
        for name in (*unexpected, *wrong_dtype)
        if found[name].dtype in SAFETENSORS_INTEGER_DTYPES.values() or name.endswith("_scale")
    ]
    if quantization is not None and in_layout:
        problems.append(
            f"the quantized tensors above do not fit {CONFIG_NAME}'s quantization_config, {quantization.describe()}; "
            "each weight's scales beside it as <weight>_scale (the routed experts': one gate_up_proj_scale and one "
            "down_proj_scale per layer); kept in the model dtype: the modules matching modules_to_not_convert "
            f"{quantization.modules_to_not_convert}"
        )


def _allowed_dtypes(expected: torch.Tensor) -> tuple[str, ...]:
    """The safetensors dtypes a checkpoint tensor may have: a quantized weight's exactly, any float for the rest."""
    integer = SAFETENSORS_INTEGER_DTYPES.get(expected.dtype)
    return (integer,) if integer is not None else SAFETENSORS_FLOAT_DTYPES


def _list_problems(problems: list[str], items: list[str], template: str) -> None:
    problems.extend(template.format(item) for item in items[:MAX_LISTED])
    if len(items) > MAX_LISTED:
        problems.append(f"... and {len(items) - MAX_LISTED} more like the {MAX_LISTED} above")


def _read_chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    if (folder / CHAT_TEMPLATE_NAME).is_file():
        return (folder / CHAT_TEMPLATE_NAME).read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    return template if isinstance(template, str) else None


def _unsafe_files(folder: Path) -> list[str]:
    """The files the export would read that are not regular files inside `folder`, each named with the reason: the
    known names, every `*.safetensors`, and every file the index names, whatever its name ends with. An index that
    names a shard by anything but a plain file name ("../x", "/x", "sub/x") is refused too: shards sit beside it.

    A symbolic link may point elsewhere only in a huggingface_hub cache snapshot (`.../snapshots/REVISION/`), whose
    files link to the same repository's `blobs/` folder.
    """
    allowed = [folder.resolve()]
    if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
        allowed.append((folder.parent.parent / "blobs").resolve())
    read_names = {
        path.name for path in folder.iterdir() if path.name in READ_FILE_NAMES or path.suffix == ".safetensors"
    }
    problems = _link_problems(folder, read_names, allowed)
    index = folder / INDEX_NAME
    if not index.is_file() or _link_problems(folder, {INDEX_NAME}, allowed):  # an unsafe index is not opened
        return problems
    shard_names = _index_shard_names(index)
    problems += [
        f"{INDEX_NAME} names {name} as a shard, which is not a file name in the source folder (shards sit beside "
        "the index)"
        for name in sorted({repr(name) for name in shard_names if not is_plain_file_name(name)})
    ]
    plain = {name for name in shard_names if is_plain_file_name(name)}
    return problems + _link_problems(folder, plain - read_names, allowed)


def _link_problems(folder: Path, names: set[str], allowed: list[Path]) -> list[str]:
    """The reasons the named entries of `folder` that exist (dangling links included) must not be read."""
    problems = []
    for name in sorted(names):
        path = folder / name
        if not (path.exists() or path.is_symlink()):  # a missing shard is reported when the weights are read
            continue
        target = path.resolve()
        if not any(target.is_relative_to(root) for root in allowed):
            problems.append(f"{name} links to {target}, outside the source folder; copy the file in instead")
        elif not target.is_file():
            problems.append(f"{name} is not a regular file")
    return problems


def _index_shard_names(index: Path) -> list:
    """The values of the index's weight map (shard names, if it is sound), or none if it cannot be read as one:
    reading the weights then reports why."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, AttributeError):
        return []
    return list(weight_map.values()) if isinstance(weight_map, dict) else []


def is_plain_file_name(name) -> bool:
    """Whether an index's shard name names a file directly in the index's folder (no folder part, not . or ..)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and Path(name).name == name


def _read_carried_files(folder: Path, problems: list[str]) -> dict[str, bytes]:
    """The CARRIED_FILE_NAMES the source has, read whole; the JSON ones must parse, as transformers loads them."""
    carried = {}
    for name in CARRIED_FILE_NAMES:
        path = folder / name
        if not path.is_file():  # optional, or (the tokenizer model) reported missing by read_source
            continue
        if name.endswith(".json"):
            content = _read_json(path, problems)
            if content is not None and name == GENERATION_CONFIG_NAME:
                _check_generation_config(content, problems)
        carried[name] = path.read_bytes()
    return carried


def _check_generation_config(content: dict, problems: list[str]) -> None:
    # Loading a model reads this file with GenerationConfig, which validates the values; a file it cannot parse is
    # skipped without a word, so a broken one would pass a load test and be published.
    try:
        GenerationConfig.from_dict(content)
    except (ValueError, TypeError) as error:
        problems.append(f"{GENERATION_CONFIG_NAME} is not a valid generation config for transformers: {error}")
