"""Every difference between transformers releases that the modeling package handles, each with the release that lets
it go.

The project supports transformers 5.17 and later 5.x releases (`pyproject.toml`). Each shim below says which minimum
version makes it unnecessary; when `pyproject.toml` raises the minimum to that version, the shim and its uses go.

The image_processing package keeps its own shims in `transformers_compat_processing.py`: both packages are shipped
to the Hub as flat files, and neither imports the other, so each has its own small compat module.

Nothing is needed for:
- config keys that other releases wrote into a saved `config.json` (`_attn_implementation_autoset`, `head_dim`,
  `qk_head_dim`, ...): every 5.x `PreTrainedConfig` keeps unknown keys as attributes, so they load and save as they
  came;
- `GenerationMixin.generate`'s parameters: their order is the same from 5.17 to 5.24, and the static-generation mixin
  reads them by name from the installed signature anyway (generation_kimi_vl.py).
"""

import inspect

import transformers
from packaging import version
from transformers import DeepseekV3ForCausalLM, PreTrainedConfig

# Goes with transformers >= 5.24. 5.24 renamed the language model's cache argument from `past_key_values` to `cache`
# (the old name warns on every call until 5.40); pass it under the name the installed version takes.
CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(DeepseekV3ForCausalLM.forward).parameters else "past_key_values"
)

# Goes with transformers >= 5.23 (then the check below always passes). Earlier releases (5.17 was checked) cast every
# checkpoint tensor to its parameter's dtype before a quantize op sees it, i.e. the float weights to int8; 5.23 and
# 5.24 pass them on in the model dtype.
QUANTIZATION_MIN_TRANSFORMERS_VERSION = "5.23"


def quantization_supported() -> bool:
    """Whether the installed transformers hands checkpoint weights to a quantize op in the model dtype."""
    return version.parse(transformers.__version__) >= version.parse(QUANTIZATION_MIN_TRANSFORMERS_VERSION)


def build_sub_configs(config: PreTrainedConfig) -> None:
    """Turn each sub-config of `config` given as a dict (or None, for the defaults) into its `sub_configs` class.

    Goes with transformers >= 5.24, whose `PreTrainedConfig.sub_configs_defaults` does this (5.17 and 5.18 do not have
    it)."""
    for key, config_class in config.sub_configs.items():
        sub_config = getattr(config, key)
        if not isinstance(sub_config, PreTrainedConfig):
            setattr(config, key, config_class(**(sub_config or {})))


__all__ = ["CACHE_ARGUMENT", "QUANTIZATION_MIN_TRANSFORMERS_VERSION", "build_sub_configs", "quantization_supported"]
