"""Every difference between transformers releases that the image_processing package handles, each with the release
that lets it go.

The project supports transformers 5.17 and later 5.x releases (`pyproject.toml`). Each shim below says which minimum
version makes it unnecessary; when `pyproject.toml` raises the minimum to that version, the shim and its uses go.

The modeling package keeps its own shims in `transformers_compat_modeling.py`: both packages are shipped to the Hub as
flat files, and neither imports the other, so each has its own small compat module.
"""

import inspect

import transformers
from transformers import AutoImageProcessor, PreTrainedTokenizer

# Goes with transformers >= 5.24 (5.17 and 5.18 do not have it). `apply_chat_template(...,
# sanitize_control_tokens=True)` is transformers' own; older releases would hand the flag to the template as an unused
# variable and return unsanitised ids, so `refuse_unsupported_sanitizing` turns that into an error instead.
SANITIZING_SUPPORTED = (
    "sanitize_control_tokens" in inspect.signature(PreTrainedTokenizer.apply_chat_template).parameters
)


def refuse_unsupported_sanitizing(kwargs: dict) -> None:
    """Raise if `sanitize_control_tokens=True` is asked of a transformers release that cannot honour it."""
    if kwargs.get("sanitize_control_tokens") and not SANITIZING_SUPPORTED:
        raise NotImplementedError(
            f"sanitize_control_tokens=True needs transformers' control-token sanitising, which transformers "
            f"{transformers.__version__} does not have (5.24 has it); upgrade transformers. Without it, control "
            "tokens typed into messages would be encoded as control tokens."
        )


def register_auto_image_processor(config_class: type, image_processor_class: type) -> None:
    """Map `config_class` to `image_processor_class` in AutoImageProcessor, where this transformers allows it.

    Goes with transformers >= 5.18: 5.17's AutoImageProcessor refuses to work at all without torchvision, which this
    project does not install (`image_processor_class.from_pretrained` and the processor work without it)."""
    try:
        AutoImageProcessor.register(config_class, slow_image_processor_class=image_processor_class, exist_ok=True)
    except ImportError:
        pass


__all__ = ["SANITIZING_SUPPORTED", "refuse_unsupported_sanitizing", "register_auto_image_processor"]
