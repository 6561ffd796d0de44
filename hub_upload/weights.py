"""Safetensors bookkeeping for the export: read headers without loading tensors, plan shards, stream tensors across.

Reading a header touches only the first bytes of a file, so a 32 GB checkpoint can be inventoried and checked before a
single tensor is read. Writing goes one output shard at a time: the tensors of that shard are read (`safe_open`, which
maps the source file), written, and dropped before the next shard starts, so memory stays near one shard.
"""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
# Hub convention: decimal units (5GB = 5e9 bytes); binary units are spelled KiB/MiB/GiB.
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it."""

    name: str
    dtype: str  # safetensors spelling: "BF16", "F32", ...
    shape: tuple[int, ...]
    nbytes: int
    file: Path


def parse_size(text: str) -> int:
    """`"5GB"` -> 5_000_000_000; also `"500MB"`, `"2GiB"`, `"12345"` (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or (unit and unit not in SIZE_UNITS):
        raise ValueError(
            f"invalid size {text!r}: use a number with an optional unit, one of {', '.join(SIZE_UNITS)} "
            "(e.g. 5GB, 500MB, 2GiB)."
        )
    size = int(float(match.group(1)) * SIZE_UNITS[unit or "B"])
    if size <= 0:
        raise ValueError(f"invalid size {text!r}: it must be positive.")
    return size


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file holds, from its JSON header. Raises ValueError for a file that is not one."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path.name} is not a safetensors file (only {len(prefix)} bytes).")
        (header_size,) = struct.unpack("<Q", prefix)
        file_size = path.stat().st_size
        if header_size > file_size - 8:
            raise ValueError(f"{path.name} is not a safetensors file (header size {header_size} > file size).")
        try:
            header = json.loads(handle.read(header_size))
        except ValueError as error:
            raise ValueError(f"{path.name} has an unreadable safetensors header ({error}).") from None
    data_size = file_size - 8 - header_size
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= data_size:
            raise ValueError(f"{path.name}: tensor {name} lies outside the file (truncated download?).")
        entries[name] = TensorEntry(name, info["dtype"], tuple(info["shape"]), end - start, path)
    return entries


def natural_key(name: str) -> list:
    """Sort key that puts `layers.2` before `layers.10`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plan_shards(entries: list[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Split tensors, in natural name order, into shards of at most `max_shard_bytes`, with huggingface_hub's planner
    (the one `save_pretrained` uses); only the sizes from the headers are needed, no tensor is read.

    The plan depends only on the tensors, never on how the source was sharded, so exporting an export reproduces it.
    A tensor larger than the limit gets a shard of its own.
    """
    by_name = {entry.name: entry for entry in sorted(entries, key=lambda entry: natural_key(entry.name))}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda entry: entry.nbytes,
        filename_pattern="model{suffix}.safetensors",  # the grouping is used; write_shards names the files
        max_shard_size=max_shard_bytes,
    )
    return [[by_name[name] for name in names] for names in split.filename_to_tensors.values()]


def write_shards(shards: list[list[TensorEntry]], out_dir: Path) -> dict:
    """Write the planned shards and return the index (`model.safetensors.index.json` content)."""
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        shard_name = SHARD_NAME.format(index=number, count=len(shards))
        tensors = {}
        for source_file in dict.fromkeys(entry.file for entry in shard):  # each source file opened once per shard
            with safe_open(source_file, framework="pt") as source:
                for entry in shard:
                    if entry.file == source_file:
                        tensors[entry.name] = source.get_tensor(entry.name)
        weight_map.update((entry.name, shard_name) for entry in shard)
        save_file(tensors, out_dir / shard_name, metadata={"format": "pt"})
        del tensors  # the next shard starts from nothing
    total_size = sum(entry.nbytes for shard in shards for entry in shard)
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
