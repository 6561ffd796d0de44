"""Kimi-VL processing for transformers 5.x: image processor, tokenizer, processor and chat template.

Importing this package registers the classes with AutoImageProcessor, AutoTokenizer and AutoProcessor for the
config class of model_type "kimi_vl" when one can be found (see `register_auto_classes`).
"""

import importlib

from transformers import AutoProcessor, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .data_collator_kimi_vl import BadExample, ImageUrlCache, KimiVLDataCollator, encode_chat, load_chat_jsonl
from .image_processing_kimi_vl import KimiVLImageProcessor
from .processing_kimi_vl import KimiVLProcessor, ThinkingSplit, split_thinking
from .tiny_tokenizer import write_tiny_tokenizer
from .tokenization_kimi_vl import KimiVLTokenizer
from .transformers_compat_processing import SANITIZING_SUPPORTED, register_auto_image_processor

MODEL_TYPE = "kimi_vl"


def _kimi_vl_config_class():
    """The config class registered for "kimi_vl", else this repository's, else None (e.g. not installed)."""
    if MODEL_TYPE in CONFIG_MAPPING:
        return CONFIG_MAPPING[MODEL_TYPE]
    try:
        return importlib.import_module("modeling_kimi_vl.configuration_kimi_vl").KimiVLConfig
    except (ImportError, AttributeError):
        return None


def register_auto_classes(config_class=None) -> bool:
    """Map `config_class` (default: the "kimi_vl" config) to these classes in the Auto API; False if none found."""
    config_class = config_class or _kimi_vl_config_class()
    if config_class is None:
        return False
    AutoTokenizer.register(config_class, slow_tokenizer_class=KimiVLTokenizer, exist_ok=True)
    AutoProcessor.register(config_class, KimiVLProcessor, exist_ok=True)
    register_auto_image_processor(config_class, KimiVLImageProcessor)
    return True


register_auto_classes()

__all__ = [
    "BadExample",
    "ImageUrlCache",
    "KimiVLDataCollator",
    "KimiVLImageProcessor",
    "KimiVLProcessor",
    "KimiVLTokenizer",
    "SANITIZING_SUPPORTED",
    "ThinkingSplit",
    "encode_chat",
    "load_chat_jsonl",
    "register_auto_classes",
    "split_thinking",
    "write_tiny_tokenizer",
]
