"""The original release's algorithms written out the obvious way, as references for the tests (exactness) and the
benchmarks (the baseline to beat). Test-only code: nothing here is shipped.

`original_pipeline` does what the released Kimi-VL image processor does, step by step, one image at a time, with PIL
and torch (torchvision's pad / to_tensor / normalize written out, since torchvision is not a dependency).
`original_resize` is the vision tower's position-table resize as the release does it on every forward.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps


def original_resize(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The release's position resize, called on every forward: 2-D bicubic interpolation of the whole table."""
    resized = F.interpolate(table.permute(2, 0, 1)[None], size=(rows, cols), mode="bicubic", align_corners=False)
    return resized[0].permute(1, 2, 0).flatten(0, 1)


def original_pipeline(
    images: list[Image.Image],
    in_token_limit: int = 4096,
    pad_input: bool = True,
    patch_size: int = 14,
    merge_kernel_size: tuple[int, int] = (2, 2),
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5),
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The released processor's algorithm, written the obvious way. Raises "Exceed pos emb" like it.

    Its padding step, `_torchvision_pad`, is a re-implementation of torchvision's pad semantics (torchvision is
    not a dependency), written independently from the processor's code path. The fixture outputs of the original
    code cover RGB and RGBA images only; agreement for other modes (L, P, CMYK, ...) rests on that
    re-implementation.
    """
    patches_per_image, grids = [], []
    for image in images:
        image = _original_rescale(image, in_token_limit, pad_input, patch_size, merge_kernel_size)
        tensor = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()
        tensor = tensor.to(torch.float32).div(255)
        mean = torch.tensor(image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(image_std, dtype=torch.float32)[:, None, None]
        tensor = (tensor - mean) / std
        channels, height, width = tensor.shape
        patches = tensor.reshape(channels, height // patch_size, patch_size, width // patch_size, patch_size)
        patches = patches.permute(1, 3, 0, 2, 4).contiguous().view(-1, channels, patch_size, patch_size)
        patches_per_image.append(patches)
        grids.append((height // patch_size, width // patch_size))
    return torch.cat(patches_per_image), torch.tensor(grids, dtype=torch.int64)


def _original_rescale(image, in_token_limit, pad_input, patch_size, merge_kernel_size):
    width, height = image.size
    if (width // patch_size) * (height // patch_size) > in_token_limit:
        scale = math.sqrt(in_token_limit / ((width // patch_size) * (height // patch_size)))
        image = image.resize((int(width * scale), int(height * scale)), Image.BICUBIC)
    if pad_input:
        width, height = image.size
        unit_h, unit_w = merge_kernel_size[0] * patch_size, merge_kernel_size[1] * patch_size
        pad_h = (unit_h - height % unit_h) % unit_h
        pad_w = (unit_w - width % unit_w) % unit_w
        image = _torchvision_pad(image, pad_w, pad_h)
    else:
        width, height = image.size
        new_width, new_height = width - width % patch_size, height - height % patch_size
        top = int(round((height - new_height) / 2.0))
        left = int(round((width - new_width) / 2.0))
        image = image.crop((left, top, left + new_width, top + new_height))
    width, height = image.size
    if width // patch_size >= 512 or height // patch_size >= 512:
        raise ValueError("Exceed pos emb")
    return image


def _torchvision_pad(image, pad_right, pad_bottom):
    """torchvision.transforms.functional.pad(image, (0, 0, right, bottom)) on a PIL image, fill 0.

    A re-implementation of torchvision's semantics, not torchvision itself: ImageOps.expand with a zero fill in
    every band of the image's mode, and for "P" images the palette kept. It is written independently from the
    processor's padding; the fixtures check it for RGB/RGBA only, other modes rest on this re-implementation.
    """
    bands = len(image.getbands())
    fill = 0 if bands == 1 else (0,) * bands
    padded = ImageOps.expand(image, border=(0, 0, pad_right, pad_bottom), fill=fill)
    if image.mode == "P":
        padded.putpalette(image.getpalette())
    return padded
