"""Image processor for Kimi-VL (MoonViT).

Reproduces the released Kimi-VL image processor exactly (pixel values to float32 rounding, same grids):

1. If the image has more than `in_token_limit` patches, scale it by sqrt(limit / patches) with PIL bicubic,
   truncating the new size with `int()`.
2. With `pad_input`, pad right and bottom with zeros to a multiple of `merge_kernel_size * patch_size`, in the
   image's own mode (palette index 0 for "P", transparent black for "RGBA", white for "CMYK"); otherwise
   center-crop to a multiple of `patch_size`.
3. Convert to RGB, scale to [0, 1], normalise per channel with `image_mean` / `image_std`.
4. Cut into `patch_size` x `patch_size` patches, row-major.

Deliberate differences from the release (every 8-bit image it accepts is processed identically):
- It rejects images with 512 or more patches on a side ("Exceed pos emb"). Here such an image is scaled down
  (bicubic, once, from the input) so that its longest side fits in 511 patches (510 when padding to pairs).
- High-bit-depth greyscale images (PIL modes "I;16*", "I", "F", e.g. a 16-bit PNG) are scaled to 8 bits first; the
  release converts them with PIL's clipping, which turns a 16-bit photo white (see `_to_8_bit`).
- Files it opens itself are turned upright by their EXIF orientation, as a viewer shows them (and as transformers'
  `load_image` does); animated files give their first frame, with a one-time warning. A PIL image passed in is used
  as given.

Steps 1-2 run in PIL on the image's own mode, as in the original, because resampling and padding depend on
the mode (premultiplied alpha, palettes, CMYK). Steps 3-4 are vectorised over the whole batch: one strided
uint8 -> float32 copy per image straight into its slice of the output, then three in-place ops over the batch.
"""

import functools
import inspect
import math
import numbers
import os
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_utils import ChannelDimension
from transformers.processing_utils import ImagesKwargs
from transformers.utils import logging

logger = logging.get_logger(__name__)

SETTING_NAMES = ("in_token_limit", "pad_input", "patch_size", "merge_kernel_size", "image_mean", "image_std")

# MoonViT interpolates its position table up to 512 positions per side; the released processor refuses more.
MAX_PATCHES_PER_SIDE = 511


class KimiVLImageProcessorKwargs(ImagesKwargs, total=False):
    """Per-call options of `KimiVLImageProcessor` (each defaults to the processor's attribute of that name)."""

    in_token_limit: int
    pad_input: bool
    patch_size: int
    merge_kernel_size: list[int]


@dataclass(frozen=True)
class _Geometry:
    """The settings that decide an image's output size."""

    patch_size: int
    in_token_limit: int
    pad_input: bool
    merge_kernel_size: tuple[int, int]

    @property
    def side_units(self) -> tuple[int, int]:
        """Pixel multiples (width, height) that the final image must be: padding rounds up, cropping down."""
        if self.pad_input:
            return self.merge_kernel_size[1] * self.patch_size, self.merge_kernel_size[0] * self.patch_size
        return self.patch_size, self.patch_size

    def final_side(self, side: int, unit: int) -> int:
        # Padding rounds up to a whole unit, cropping down. The package's only round-up, written out: the modeling
        # package's `round_up` is not importable here (the two packages ship as separate sets of flat files).
        if self.pad_input:
            return -(-side // unit) * unit
        return side - side % unit

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """Size the image is resampled to before padding or cropping (its own size when no resampling)."""
        p = self.patch_size
        patches = (width // p) * (height // p)
        if patches > self.in_token_limit:
            scale = math.sqrt(self.in_token_limit / patches)
            # The original truncates here; the fixtures depend on it.
            width, height = int(width * scale), int(height * scale)
        return self._fit_position_table(width, height)

    def _fit_position_table(self, width: int, height: int) -> tuple[int, int]:
        unit_w, unit_h = self.side_units
        max_w = (MAX_PATCHES_PER_SIDE * self.patch_size // unit_w) * unit_w
        max_h = (MAX_PATCHES_PER_SIDE * self.patch_size // unit_h) * unit_h
        if self.final_side(width, unit_w) <= max_w and self.final_side(height, unit_h) <= max_h:
            return width, height
        scale = min(max_w / width, max_h / height)
        return max(1, min(max_w, int(width * scale))), max(1, min(max_h, int(height * scale)))

    def final_size(self, width: int, height: int) -> tuple[int, int]:
        """Pixel size after resampling and padding/cropping; a multiple of the patch size on both sides."""
        width, height = self.resized_size(width, height)
        unit_w, unit_h = self.side_units
        return self.final_side(width, unit_w), self.final_side(height, unit_h)

    def grid_hw(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of patches for an input of this pixel size."""
        final_w, final_h = self.final_size(width, height)
        return final_h // self.patch_size, final_w // self.patch_size


@functools.cache
def accepted_preprocess_kwargs(processor_class: type) -> frozenset:
    """The keyword arguments a processor class's `_preprocess` takes, worked out once per class.

    Callers such as serving frameworks and `ProcessorMixin` pass generic options (`device=`, `do_resize=`, ...)
    to every image processor; looking the accepted set up on each call would cost a signature inspection per
    batch, so it is cached here by class.
    """
    parameters = inspect.signature(processor_class._preprocess).parameters
    return frozenset(name for name, parameter in parameters.items() if parameter.kind is parameter.KEYWORD_ONLY)


class KimiVLImageProcessor(BaseImageProcessor):
    r"""
    Image processor of Kimi-VL: native-resolution 14x14 patches with a token budget.

    Defaults are the released Kimi-VL-A3B-Instruct `preprocessor_config.json` (the released class's own
    defaults, CLIP mean/std and `pad_input=False`, are always overridden by that file).

    Args:
        in_token_limit (`int`, defaults to 4096): images with more patches than this are scaled down.
        patch_size (`int`, defaults to 14): side of a square patch in pixels.
        pad_input (`bool`, defaults to `True`): pad to whole merge windows; if `False`, center-crop to patches.
        image_mean, image_std (3 floats or one float for all channels, default 0.5 each): per-channel normalisation.
        merge_kernel_size (2 ints, defaults to `[2, 2]`): patches merged into one text token (rows, columns).
        num_pooled_tokens (`int`, defaults to 1024): kept from the released config for round-tripping; unused.

    Accepts PIL images, file paths, numpy uint8 arrays and torch tensors (uint8, or float in [0, 1], rounded to the
    nearest 1/255) of shape `HxW`, `HxWxC` or `CxHxW` with C in 1, 3, 4, and lists (or lists of lists) of these, of
    mixed sizes. The channel axis is read from the shape; where both layouts fit (e.g. 3x8x3), pass
    `input_data_format` ("channels_first" / "channels_last"), as with transformers' image processors.
    Returns `pixel_values` `[sum of patches, 3, patch, patch]` float32 and `image_grid_hws` `[images, 2]` int64.
    """

    model_input_names = ["pixel_values", "image_grid_hws"]
    valid_kwargs = KimiVLImageProcessorKwargs

    def __init__(
        self,
        in_token_limit: int = 4096,
        patch_size: int = 14,
        pad_input: bool = True,
        image_mean: float | list[float] = (0.5, 0.5, 0.5),
        image_std: float | list[float] = (0.5, 0.5, 0.5),
        merge_kernel_size: list[int] = (2, 2),
        num_pooled_tokens: int = 1024,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.in_token_limit = in_token_limit
        self.patch_size = patch_size
        self.pad_input = pad_input
        self.image_mean = image_mean
        self.image_std = image_std
        self.merge_kernel_size = merge_kernel_size
        self.num_pooled_tokens = num_pooled_tokens
        # Validate, and keep the normalised forms (lists; a scalar mean or std expanded to the three channels).
        for name, value in self._settings().items():
            setattr(self, name, value)

    def preprocess(self, images, **kwargs) -> BatchFeature:
        """Process one image or a list of images; see the class docstring for inputs and outputs."""
        accepted = accepted_preprocess_kwargs(type(self))
        ignored = sorted(name for name in kwargs if name not in accepted)
        if ignored:
            logger.warning_once(f"{type(self).__name__} ignores these keyword arguments: {', '.join(ignored)}")
        options = {name: value for name, value in kwargs.items() if name in accepted}
        return self._preprocess(images, **options)

    def _preprocess(
        self,
        images,
        *,
        in_token_limit: int | None = None,
        pad_input: bool | None = None,
        patch_size: int | None = None,
        merge_kernel_size: list[int] | None = None,
        image_mean: float | list[float] | None = None,
        image_std: float | list[float] | None = None,
        input_data_format: ChannelDimension | str | None = None,
        return_tensors: str | None = None,
    ) -> BatchFeature:
        settings = self._settings(
            in_token_limit=in_token_limit,
            pad_input=pad_input,
            patch_size=patch_size,
            merge_kernel_size=merge_kernel_size,
            image_mean=image_mean,
            image_std=image_std,
        )
        geometry = _geometry_from(settings)

        channel_format = _channel_format(input_data_format)
        pil_images = as_pil_images(images, channel_format)
        rgb_images = []
        for index, image in enumerate(pil_images):
            try:
                rgb_images.append(_fit_to_patches(image, geometry))
            except (OSError, ValueError) as error:  # PIL reports corrupt or unsupported data as these
                raise ValueError(f"Image {index} of {len(pil_images)} could not be processed: {error}") from error

        pixel_values, image_grid_hws = _patchify(rgb_images, geometry.patch_size)
        _normalize_in_place(pixel_values, settings["image_mean"], settings["image_std"])
        return BatchFeature(
            data={"pixel_values": pixel_values, "image_grid_hws": image_grid_hws}, tensor_type=return_tensors
        )

    def _settings(self, **overrides) -> dict:
        """This processor's settings with the given per-call values (None means: keep the attribute), validated
        and normalised by `_checked_settings`."""
        settings = {
            name: getattr(self, name) if overrides.get(name) is None else overrides[name] for name in SETTING_NAMES
        }
        return _checked_settings(settings)

    def get_image_grid_hw(self, height: int, width: int, images_kwargs: dict | None = None) -> tuple[int, int]:
        """(rows, columns) of patches for an image of `height` x `width` pixels, without processing it."""
        settings = self._settings(
            **{name: value for name, value in (images_kwargs or {}).items() if name in SETTING_NAMES}
        )
        return _geometry_from(settings).grid_hw(width, height)

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Number of patches for an image of this size (the hook serving engines use to size placeholders)."""
        rows, columns = self.get_image_grid_hw(height, width, images_kwargs)
        return rows * columns


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _checked_settings(settings: dict) -> dict:
    """Reject settings the algorithm cannot run with, saying which value is wrong and what is allowed.

    Returns the settings with `merge_kernel_size`, `image_mean` and `image_std` as lists, a single number for
    `image_mean` / `image_std` standing for all three channels (transformers types them `float | list[float]`).
    """
    settings = dict(settings)
    for name in ("in_token_limit", "patch_size"):
        if not _is_positive_int(settings[name]):
            raise ValueError(f"`{name}` must be a positive integer, got {settings[name]!r}.")
    if not isinstance(settings["pad_input"], bool):
        raise ValueError(f"`pad_input` must be True or False, got {settings['pad_input']!r}.")
    kernel = settings["merge_kernel_size"]
    if not (isinstance(kernel, (list, tuple)) and len(kernel) == 2 and all(_is_positive_int(k) for k in kernel)):
        raise ValueError(f"`merge_kernel_size` must be two positive integers [rows, columns], got {kernel!r}.")
    settings["merge_kernel_size"] = list(kernel)
    for name in ("image_mean", "image_std"):
        values = [settings[name]] * 3 if _is_real(settings[name]) else settings[name]
        if not (isinstance(values, (list, tuple)) and len(values) == 3 and all(_is_real(v) for v in values)):
            raise ValueError(f"`{name}` must be one number or three (one per RGB channel), got {settings[name]!r}.")
        settings[name] = [float(value) for value in values]
    if any(value == 0 for value in settings["image_std"]):
        raise ValueError(f"`image_std` values must be non-zero, got {settings['image_std']!r}.")
    return settings


def _geometry_from(settings: dict) -> _Geometry:
    return _Geometry(
        patch_size=settings["patch_size"],
        in_token_limit=settings["in_token_limit"],
        pad_input=settings["pad_input"],
        merge_kernel_size=tuple(settings["merge_kernel_size"]),
    )


def _channel_format(input_data_format) -> ChannelDimension | None:
    if input_data_format is None:
        return None
    try:
        return ChannelDimension(input_data_format)
    except ValueError as error:
        raise ValueError(
            f"`input_data_format` must be 'channels_first' or 'channels_last' (or None to read it from the shape), "
            f"got {input_data_format!r}."
        ) from error


def as_pil_images(images, channel_format: ChannelDimension | None = None) -> list[Image.Image]:
    """Flatten the accepted input forms into a list of PIL images, naming the position of anything invalid.

    `channel_format` is the layout of numpy and torch inputs (None: read from each one's shape).
    """
    flat = flatten_images(images)
    if not flat:
        raise ValueError("No images were given: expected an image or a non-empty list of images.")
    return [_as_pil_image(image, index, len(flat), channel_format) for index, image in enumerate(flat)]


def flatten_images(images) -> list:
    """A single image, a list of images, or a list of lists of images (one list per prompt), in order."""
    if not isinstance(images, (list, tuple)):
        return [images]
    return [image for item in images for image in (item if isinstance(item, (list, tuple)) else [item])]


def _as_pil_image(image, index: int, count: int, channel_format: ChannelDimension | None) -> Image.Image:
    where = f"Image {index} of {count}"
    if isinstance(image, (str, os.PathLike)):
        image = _open_image_file(image, where)
    elif isinstance(image, np.ndarray):
        image = _image_from_array(image, channel_format, where)
    elif isinstance(image, torch.Tensor):
        image = _image_from_array(_uint8_from_tensor(image, where), channel_format, where)
    elif not isinstance(image, Image.Image):
        raise TypeError(
            f"{where} is a {type(image).__name__}; expected a PIL image, a file path, a numpy uint8 array "
            "or a torch tensor."
        )
    if image.width == 0 or image.height == 0:
        raise ValueError(f"{where} is empty ({image.width}x{image.height} pixels).")
    return _to_8_bit(image, where) if image.mode in HIGH_BIT_DEPTH_RANGES else image


def _open_image_file(path, where: str) -> Image.Image:
    """Decode a file's first frame, upright by its EXIF orientation, and close the file."""
    try:
        with Image.open(path) as image:
            if getattr(image, "is_animated", False):
                logger.warning_once(
                    "KimiVLImageProcessor uses the first frame of animated image files (GIF, APNG, WebP, ...)."
                )
            image.load()
            # As a viewer shows it (and as transformers' load_image does): a phone photo stored sideways with an
            # orientation tag comes out upright. In place: no copy of the pixels when there is nothing to turn.
            ImageOps.exif_transpose(image, in_place=True)
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"{where} ({os.fspath(path)!r}) could not be read as an image: {error}") from error
    return image


# Greyscale modes of more than 8 bits, each with the ranges [0, top] its values may be on, smallest first; an image
# is scaled from the first range that holds all its values (see `_to_8_bit`).
EIGHT_BIT_TOP = 255
HIGH_BIT_DEPTH_RANGES = {
    **{mode: (65535,) for mode in ("I;16", "I;16L", "I;16B", "I;16N")},
    "I": (EIGHT_BIT_TOP, 65535, 2**31 - 1),  # PIL's own conversions to "I" give 0..255; 16-bit files give 0..65535
    "F": (1.0, float(EIGHT_BIT_TOP)),  # [0, 1] as float tensors and transformers take floats; 0..255 as PIL's "F"
}


def _to_8_bit(image: Image.Image, where: str) -> Image.Image:
    """The image on the 0..255 scale: an "L" image scaled from the first of its mode's ranges that fits its values.

    A 16-bit image (e.g. a 16-bit PNG) is scaled from 0..65535, where the release's clipping conversion made it
    white. An image whose values already lie on the 0..255 scale is returned as it is, so it is processed exactly as
    the release does. Negative values and NaN fit no range and are errors, as are values above the largest range.
    """
    values = np.asarray(image)  # uint16, int32 or float32
    low, high = values.min().item(), values.max().item()
    ranges = HIGH_BIT_DEPTH_RANGES[image.mode]
    top = next((top for top in ranges if high <= top), None)
    if top is None or not low >= 0:  # `not >=` is also True for NaN
        raise ValueError(
            f"{where} is a mode {image.mode!r} image with values in [{low}, {high}]; this mode is scaled to 8 bits "
            f"from one of the ranges {', '.join(f'[0, {top}]' for top in ranges)}."
        )
    if top == EIGHT_BIT_TOP:
        return image
    scaled = values.astype(np.float32)  # the one full-size temporary
    scaled *= EIGHT_BIT_TOP / top
    return Image.fromarray(np.rint(scaled, out=scaled).astype(np.uint8), mode="L")


_MODE_FOR_CHANNELS = {1: "L", 3: "RGB", 4: "RGBA"}


def _uint8_from_tensor(tensor: torch.Tensor, where: str) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point():
        low, high = torch.aminmax(tensor) if tensor.numel() else (0.0, 0.0)  # an empty one fails the shape checks
        if not (0.0 <= low and high <= 1.0):
            raise ValueError(f"{where}: float tensors must hold values in [0, 1], got [{float(low)}, {float(high)}].")
        # Rounding (not truncation) so that uint8 / 255 comes back as the same uint8.
        tensor = (tensor.float() * 255).round().to(torch.uint8)
    elif tensor.dtype != torch.uint8:
        raise ValueError(f"{where}: torch tensors must be uint8 or float in [0, 1], got {tensor.dtype}.")
    return tensor.numpy()


def _image_from_array(array: np.ndarray, channel_format: ChannelDimension | None, where: str) -> Image.Image:
    """A PIL image from an HxW, HxWxC or CxHxW uint8 array (C in 1, 3, 4), the layout given or read from the shape."""
    if array.dtype != np.uint8:
        raise ValueError(f"{where}: numpy arrays must be uint8 (0-255), got dtype {array.dtype}.")
    shape = array.shape
    if array.ndim == 3:
        layout = channel_format or _channel_format_from_shape(array.shape, where)
        array = np.moveaxis(array, 0, -1) if layout == ChannelDimension.FIRST else array
    elif array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in _MODE_FOR_CHANNELS:
        raise ValueError(
            f"{where}: arrays must be HxW, or HxWxC / CxHxW with C in 1, 3, 4; got shape {shape}"
            + (f" read as {channel_format.value}." if channel_format else ".")
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"{where} is empty (shape {shape}).")
    channels = array.shape[2]
    pixels = array[:, :, 0] if channels == 1 else array
    return Image.fromarray(np.ascontiguousarray(pixels), mode=_MODE_FOR_CHANNELS[channels])


def _channel_format_from_shape(shape: tuple[int, ...], where: str) -> ChannelDimension:
    first, last = shape[0] in _MODE_FOR_CHANNELS, shape[-1] in _MODE_FOR_CHANNELS
    if first and last:
        # transformers guesses channels-first here with a warning; a wrong guess is a silently wrong image.
        raise ValueError(
            f"{where} has shape {tuple(shape)}, which reads as channels-first or channels-last; pass "
            "input_data_format='channels_first' or 'channels_last'."
        )
    return ChannelDimension.FIRST if first else ChannelDimension.LAST


def _fit_to_patches(image: Image.Image, geometry: _Geometry) -> Image.Image:
    """Resample, pad or crop in the image's own mode, then convert to RGB (the original's order)."""
    new_size = geometry.resized_size(image.width, image.height)
    if new_size != image.size:
        image = image.resize(new_size, Image.Resampling.BICUBIC)
    unit_w, unit_h = geometry.side_units
    final_w, final_h = geometry.final_side(image.width, unit_w), geometry.final_side(image.height, unit_h)
    if final_w == 0 or final_h == 0:
        raise ValueError(
            f"it is {image.width}x{image.height} pixels; with pad_input=False both sides must be at least "
            f"patch_size={geometry.patch_size}."
        )
    if geometry.pad_input:
        image = _pad_right_bottom(image, final_w, final_h)
    else:
        image = _center_crop(image, final_w, final_h)
    return image if image.mode == "RGB" else image.convert("RGB")


def _pad_right_bottom(image: Image.Image, width: int, height: int) -> Image.Image:
    if image.size == (width, height):
        return image
    bands = len(image.getbands())
    zero = 0 if bands == 1 else (0,) * bands  # zero in every band of the image's own mode
    return ImageOps.expand(image, border=(0, 0, width - image.width, height - image.height), fill=zero)


def _center_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    if image.size == (width, height):
        return image
    # Python's round() (half to even) on the half-difference, as the original's torchvision center_crop does.
    top = int(round((image.height - height) / 2.0))
    left = int(round((image.width - width) / 2.0))
    return image.crop((left, top, left + width, top + height))


def _patchify(rgb_images: list[Image.Image], patch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each image's patches (row-major, each 3 x p x p) into one float32 tensor, still in 0-255."""
    grids = [(image.height // patch_size, image.width // patch_size) for image in rgb_images]
    total = sum(rows * columns for rows, columns in grids)
    pixel_values = torch.empty((total, 3, patch_size, patch_size), dtype=torch.float32)
    start = 0
    for image, (rows, columns) in zip(rgb_images, grids):
        pixels = torch.from_numpy(np.array(image))  # (H, W, 3) uint8, a private writable copy
        patches = pixels.view(rows, patch_size, columns, patch_size, 3).permute(0, 2, 4, 1, 3)
        count = rows * columns
        pixel_values[start : start + count].view(rows, columns, 3, patch_size, patch_size).copy_(patches)
        start += count
    return pixel_values, torch.tensor(grids, dtype=torch.int64).view(-1, 2)


def _normalize_in_place(pixel_values: torch.Tensor, mean: list[float], std: list[float]) -> None:
    # Same float32 operations in the same order as the original (to_tensor's /255, then normalize's
    # subtract and divide), so the values are bit-identical.
    mean_tensor = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    std_tensor = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    pixel_values.div_(255).sub_(mean_tensor).div_(std_tensor)


__all__ = ["KimiVLImageProcessor", "KimiVLImageProcessorKwargs", "accepted_preprocess_kwargs"]
