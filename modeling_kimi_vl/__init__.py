"""Kimi-VL for transformers 5.x. Importing this package registers the classes with the Auto API."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
)

from .configuration_kimi_vl import KimiVLConfig, MoonViTConfig, kimi_vl_a3b_config
from .modeling_kimi_vl import KimiVLForConditionalGeneration, KimiVLPreTrainedModel, MoonViTModel
from .quantization_kimi_vl import KimiVLWeightOnlyConfig

AutoConfig.register(MoonViTConfig.model_type, MoonViTConfig, exist_ok=True)
AutoConfig.register(KimiVLConfig.model_type, KimiVLConfig, exist_ok=True)
AutoModel.register(MoonViTConfig, MoonViTModel, exist_ok=True)
for _auto_class in (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText):
    _auto_class.register(KimiVLConfig, KimiVLForConditionalGeneration, exist_ok=True)
# quantization_config={"quant_method": "kimi_vl_weight_only", ...} is registered by .modeling_kimi_vl, on import

__all__ = [
    "KimiVLConfig",
    "MoonViTConfig",
    "KimiVLForConditionalGeneration",
    "KimiVLPreTrainedModel",
    "KimiVLWeightOnlyConfig",
    "MoonViTModel",
    "kimi_vl_a3b_config",
]
