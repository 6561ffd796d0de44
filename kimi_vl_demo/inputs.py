"""What users send, checked: per-message and per-image limits, cheap checks of an upload from its header (no pixels
decoded), the full decode for the model, and whether a prompt fits the model's context. A refusal is an InputError
whose message says what was wrong and what is allowed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

SUPPORTED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


class InputError(ValueError):
    """A problem with what the user sent; shown in the chat, after which the session goes on."""


@dataclass(frozen=True)
class InputLimits:
    max_images: int  # per message
    max_image_mb: float  # per image file
    max_conversation_image_mb: float  # the pixel values the model takes, for all images of one conversation


@contextmanager
def image_errors(path: Path) -> Iterator[None]:
    """Turn Pillow's errors for one upload into an InputError naming the file and the supported formats."""
    try:
        yield
    except InputError:  # already says what is wrong; not to be rewrapped as a ValueError below
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        detail = str(error).replace(f" '{path}'", "")  # the upload's temporary path means nothing to the user
        raise InputError(
            f"`{path.name}` could not be read as an image ({detail}). "
            f"Supported formats: {', '.join(SUPPORTED_IMAGE_FORMATS)}."
        ) from error


def check_image(path: str | Path, limits: InputLimits) -> tuple[int, int]:
    """Cheap checks of one upload, without decoding its pixels: file size, a supported format, the pixel count, and
    the file's own integrity checks where the format has them (PNG's checksums). Returns the image's (width, height),
    read from its header; InputError says what is wrong."""
    path = Path(path)
    try:
        megabytes = path.stat().st_size / 2**20
    except OSError as error:  # e.g. an upload that the server's temporary folder no longer holds
        raise InputError(f"`{path.name}` could not be read ({error.strerror}); please attach it again.") from error
    if megabytes > limits.max_image_mb:
        raise InputError(f"`{path.name}` is {megabytes:.1f} MB; images may be at most {limits.max_image_mb:g} MB each.")
    with image_errors(path):
        # Only these decoders are tried: any other file, whatever its name, is "not an image".
        with Image.open(path, formats=SUPPORTED_IMAGE_FORMATS) as opened:
            # Opening reads only the header. Pillow refuses more than twice MAX_IMAGE_PIXELS itself but only warns
            # below that; a decompression bomb must not be decoded at all, so the size is checked here, first.
            # (Turning the warning into an error would need `warnings.catch_warnings`, which is not thread-safe.)
            pixels = opened.width * opened.height
            if Image.MAX_IMAGE_PIXELS is not None and pixels > Image.MAX_IMAGE_PIXELS:
                raise InputError(
                    f"`{path.name}` is {opened.width}×{opened.height} = {pixels} pixels; images may have at most "
                    f"{Image.MAX_IMAGE_PIXELS} pixels."
                )
            opened.verify()
            return opened.width, opened.height


def check_images(paths: list[str], limits: InputLimits) -> None:
    """InputError for too many images in one message or for any image that `check_image` refuses."""
    if len(paths) > limits.max_images:
        raise InputError(f"This message has {len(paths)} images; at most {limits.max_images} are allowed per message.")
    for path in paths:
        check_image(path, limits)


def load_image(path: str | Path, limits: InputLimits) -> Image.Image:
    """Check, then fully decode one image (the first frame of an animation), upright as its EXIF orientation says, as
    the image processor opens files; InputError if either fails (a truncated JPEG passes the checks)."""
    check_image(path, limits)
    path = Path(path)
    with image_errors(path), Image.open(path, formats=SUPPORTED_IMAGE_FORMATS) as opened:
        opened.load()  # the pixels now live in memory; closing the file (leaving the block) keeps them
        ImageOps.exif_transpose(opened, in_place=True)  # a phone photo stored sideways is shown upright
    return opened


def check_context(prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
    if prompt_tokens + max_new_tokens > context_length:
        raise InputError(
            f"The conversation is {prompt_tokens} tokens long; with up to {max_new_tokens} new tokens it would not fit "
            f"the demo's context of {context_length} tokens. Clear the chat, send fewer or smaller images, or lower "
            "'Max new tokens'."
        )
