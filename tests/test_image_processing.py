"""KimiVLImageProcessor: exactness against the original algorithm, inputs, errors, config round trip."""

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from original_reference import original_pipeline
from PIL import Image
from transformers.image_utils import ChannelDimension
from transformers.utils.logging import warning_once

from image_processing import KimiVLImageProcessor, image_processing_kimi_vl
from image_processing.image_processing_kimi_vl import accepted_preprocess_kwargs


def _random_rgb(width, height, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _assert_same_as_original(images, **settings):
    processed = KimiVLImageProcessor(**settings)(images)
    expected_pixels, expected_grids = original_pipeline(images, **settings)
    assert torch.equal(processed["image_grid_hws"], expected_grids)
    assert processed["pixel_values"].dtype == torch.float32
    assert processed["image_grid_hws"].dtype == torch.int64
    torch.testing.assert_close(processed["pixel_values"], expected_pixels, rtol=0, atol=1e-6)
    return processed


# --- the shipped fixtures -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rgb_84x168", "rgb_420x280", "rgb_700x500", "rgba_90x60"])
def test_matches_fixture_for_every_image(name, reference_dir, improc_expected):
    processed = KimiVLImageProcessor(in_token_limit=4096, pad_input=True)(
        Image.open(reference_dir / "images" / f"{name}.png")
    )
    assert torch.equal(processed["image_grid_hws"], improc_expected[name].image_grid_hws)
    assert improc_expected[name].same_pixel_values(processed["pixel_values"])


def test_matches_fixture_batch_with_downscaling(reference_dir, expected):
    images = [Image.open(reference_dir / "images" / name) for name in ("rgb_84x168.png", "rgb_420x280.png")]
    processed = KimiVLImageProcessor(in_token_limit=64, pad_input=True)(images)
    assert torch.equal(processed["image_grid_hws"], expected["image_grid_hws"])
    torch.testing.assert_close(processed["pixel_values"], expected["pixel_values"], rtol=0, atol=1e-6)


# --- modes and geometry against the original's steps -----------------------------------------------------------


def _image_in_mode(mode, width, height, seed=1):
    rgb = _random_rgb(width, height, seed)
    if mode == "P_transparency":
        image = rgb.quantize(16)
        image.info["transparency"] = 0
        return image
    if mode == "P_bright_index0":
        image = rgb.quantize(8)
        palette = image.getpalette()
        image.putpalette([250, 240, 230] + palette[3:])  # padding uses index 0, which is not black here
        return image
    if mode == "RGBA":
        image = rgb.convert("RGBA")
        alpha = np.random.default_rng(seed).integers(0, 256, (height, width), dtype=np.uint8)
        alpha[: height // 2] = 0  # fully transparent pixels keep their colour when not resampled
        image.putalpha(Image.fromarray(alpha, "L"))
        return image
    return rgb.convert(mode)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "LA", "L", "CMYK", "P_transparency", "P_bright_index0", "1", "I"])
@pytest.mark.parametrize("size", [(1, 1), (37, 53), (130, 61)])
def test_modes_and_odd_sizes_match_original(mode, size):
    _assert_same_as_original([_image_in_mode(mode, *size)], in_token_limit=4096, pad_input=True)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "LA", "P_bright_index0", "CMYK"])
def test_downscaling_in_each_mode_matches_original(mode):
    # 257 x 150 has 18 * 10 = 180 patches > 64: resampled in the image's own mode, then padded.
    processed = _assert_same_as_original([_image_in_mode(mode, 257, 150)], in_token_limit=64, pad_input=True)
    rows, columns = processed["image_grid_hws"][0].tolist()
    assert (columns * 14, rows * 14) == (168, 112)  # int(257 * s) = 153 -> 168, int(150 * s) = 89 -> 112


@pytest.mark.parametrize("size", [(14, 14), (15, 29), (41, 30), (100, 71), (55, 200)])
def test_center_crop_without_padding_matches_original(size):
    _assert_same_as_original([_image_in_mode("RGBA", *size)], in_token_limit=4096, pad_input=False)


def test_cmyk_padding_is_white_and_rgba_padding_is_black():
    cmyk = KimiVLImageProcessor()(Image.new("CMYK", (10, 10), (0, 0, 0, 255)))["pixel_values"]
    rgba = KimiVLImageProcessor()(Image.new("RGBA", (10, 10), (255, 255, 255, 255)))["pixel_values"]
    # Patch 3 of the 2 x 2 grid is entirely padding: (0 - 0.5) / 0.5 = -1 is black, (1 - 0.5) / 0.5 = 1 white.
    assert torch.all(cmyk[3] == 1.0) and torch.all(cmyk[0, :, 0, 0] == -1.0)
    assert torch.all(rgba[3] == -1.0) and torch.all(rgba[0, :, 0, 0] == 1.0)


def test_mixed_sizes_in_one_call_equal_single_calls():
    images = [_random_rgb(30, 70, 1), _image_in_mode("P_transparency", 90, 40), _random_rgb(600, 500, 2)]
    processor = KimiVLImageProcessor(in_token_limit=256)
    batch = processor(images)
    singles = [processor(image) for image in images]
    assert torch.equal(batch["pixel_values"], torch.cat([single["pixel_values"] for single in singles]))
    assert torch.equal(batch["image_grid_hws"], torch.cat([single["image_grid_hws"] for single in singles]))
    _assert_same_as_original(images, in_token_limit=256)


def test_worked_example_from_spec():
    # 1024 x 1024 at limit 4096 -> 897 x 897 -> padded 924 x 924 -> 66 x 66 patches -> 1089 tokens.
    processor = KimiVLImageProcessor()
    assert processor.get_image_grid_hw(1024, 1024) == (66, 66)
    assert processor(Image.new("RGB", (1024, 1024)))["image_grid_hws"].tolist() == [[66, 66]]


@pytest.mark.parametrize("pad_input", [True, False])
def test_grid_arithmetic_agrees_with_processing(pad_input):
    processor = KimiVLImageProcessor(in_token_limit=100, pad_input=pad_input)
    rng = np.random.default_rng(3)
    for width, height in rng.integers(14, 400, (12, 2)).tolist():
        grid = processor(Image.new("RGB", (width, height)))["image_grid_hws"][0].tolist()
        assert list(processor.get_image_grid_hw(height, width)) == grid
        assert processor.get_number_of_image_patches(height, width) == grid[0] * grid[1]


# --- beyond the original: very long images -------------------------------------------------------------------


@pytest.mark.parametrize("pad_input, max_columns", [(True, 510), (False, 511)])
def test_too_many_patches_on_a_side_is_scaled_down_instead_of_failing(pad_input, max_columns):
    image = _random_rgb(8400, 30)  # 600 patches wide, under the token limit
    with pytest.raises(ValueError, match="Exceed pos emb"):
        original_pipeline([image], pad_input=pad_input)
    grid = KimiVLImageProcessor(pad_input=pad_input)(image)["image_grid_hws"][0].tolist()
    assert grid[1] == max_columns and grid[0] >= 1


def test_extremely_elongated_image_after_token_scaling_still_fits():
    image = Image.new("L", (140_000, 14))  # 10000 patches > 4096: scaled, then still 5000+ patches wide
    rows, columns = KimiVLImageProcessor()(image)["image_grid_hws"][0].tolist()
    assert columns == 510 and rows == 2


# --- input forms ----------------------------------------------------------------------------------------------


def test_numpy_and_torch_inputs_equal_pil():
    pil = _random_rgb(45, 33)
    array = np.asarray(pil)
    expected = KimiVLImageProcessor()(pil)["pixel_values"]
    as_uint8 = torch.from_numpy(array.copy()).permute(2, 0, 1)
    for image in (array, as_uint8, as_uint8.float() / 255):
        assert torch.equal(KimiVLImageProcessor()(image)["pixel_values"], expected)


def test_numpy_rgba_and_grey_inputs_equal_their_pil_modes():
    rgba = _image_in_mode("RGBA", 20, 30)
    grey = _image_in_mode("L", 20, 30)
    processor = KimiVLImageProcessor()
    assert torch.equal(processor(np.asarray(rgba))["pixel_values"], processor(rgba)["pixel_values"])
    assert torch.equal(processor(np.asarray(grey))["pixel_values"], processor(grey)["pixel_values"])


def test_file_paths_and_nested_lists(tmp_path):
    first, second = _random_rgb(40, 40, 1), _image_in_mode("RGBA", 60, 20)
    first.save(tmp_path / "a.png")
    second.save(tmp_path / "b.png")
    processor = KimiVLImageProcessor()
    from_paths = processor([[str(tmp_path / "a.png")], [tmp_path / "b.png"]])
    from_pil = processor([first, second])
    assert torch.equal(from_paths["pixel_values"], from_pil["pixel_values"])


def test_return_tensors_np():
    processed = KimiVLImageProcessor()(_random_rgb(28, 28), return_tensors="np")
    assert isinstance(processed["pixel_values"], np.ndarray) and processed["pixel_values"].shape == (4, 3, 14, 14)


# --- errors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (Image.new("RGB", (0, 5)), r"Image 1 of 3 is empty \(0x5"),
        (np.zeros((0, 4, 3), np.uint8), r"Image 1 of 3 is empty"),
        (42, r"Image 1 of 3 is a int; expected a PIL image"),
        (np.zeros((4, 4, 3), np.float32), r"Image 1 of 3: numpy arrays must be uint8"),
        (torch.full((3, 4, 4), 2.0), r"Image 1 of 3: float tensors must hold values in \[0, 1\]"),
        (np.zeros((5, 8, 8), np.uint8), r"Image 1 of 3: arrays must be HxW, or HxWxC / CxHxW with C in 1, 3, 4"),
        (torch.zeros((3, 8, 3), dtype=torch.uint8), r"Image 1 of 3 has shape \(3, 8, 3\), which reads as channels-"),
    ],
)
def test_bad_inputs_name_their_position(bad, message):
    good = _random_rgb(20, 20)
    with pytest.raises((ValueError, TypeError), match=message):
        KimiVLImageProcessor()([good, bad, good])


def test_corrupt_and_non_image_files_name_their_position(tmp_path):
    buffer = io.BytesIO()
    _random_rgb(64, 64).save(buffer, format="PNG")
    (tmp_path / "truncated.png").write_bytes(buffer.getvalue()[:200])
    (tmp_path / "notes.txt").write_text("not an image")
    for name in ("truncated.png", "notes.txt", "missing.png"):
        with pytest.raises(ValueError, match=rf"Image 1 of 2 \('.*{name}'\) could not be read as an image"):
            KimiVLImageProcessor()([_random_rgb(20, 20), str(tmp_path / name)])


def test_empty_list_and_too_small_crop_are_explained():
    with pytest.raises(ValueError, match="No images were given"):
        KimiVLImageProcessor()([])
    with pytest.raises(ValueError, match=r"Image 0 of 1 could not be processed: it is 10x30 pixels.*patch_size=14"):
        KimiVLImageProcessor(pad_input=False)(Image.new("RGB", (10, 30)))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"in_token_limit": 0}, "in_token_limit"),
        ({"patch_size": 14.0}, "patch_size"),
        ({"merge_kernel_size": [2]}, "merge_kernel_size"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
        ({"image_mean": [0.5]}, "image_mean"),
        ({"merge_kernel_size": 2}, r"`merge_kernel_size` must be two positive integers \[rows, columns\], got 2"),
        ({"merge_kernel_size": [2, True]}, "merge_kernel_size"),
        ({"image_mean": "0.5"}, r"`image_mean` must be one number or three \(one per RGB channel\), got '0.5'"),
        ({"image_std": None}, r"`image_std` must be one number or three .*got None"),
        ({"image_std": [0.5, "x", 0.5]}, "image_std"),
        ({"image_std": 0}, "`image_std` values must be non-zero"),
    ],
)
def test_bad_settings_are_rejected(settings, message):
    with pytest.raises(ValueError, match=message):
        KimiVLImageProcessor(**settings)
    if None not in settings.values():  # per call, None means: keep the processor's own value
        with pytest.raises(ValueError, match=message):
            KimiVLImageProcessor()(_random_rgb(28, 28), **settings)


def test_one_number_mean_and_std_stand_for_all_three_channels():
    image = _random_rgb(60, 40)
    expanded = KimiVLImageProcessor(image_mean=[0.25] * 3, image_std=[0.75] * 3)(image)["pixel_values"]
    scalar = KimiVLImageProcessor(image_mean=0.25, image_std=0.75)
    assert (scalar.image_mean, scalar.image_std) == ([0.25] * 3, [0.75] * 3)
    assert torch.equal(scalar(image)["pixel_values"], expanded)
    assert torch.equal(KimiVLImageProcessor()(image, image_mean=0.25, image_std=0.75)["pixel_values"], expanded)


# --- config files and kwargs ----------------------------------------------------------------------------------

HUB_PREPROCESSOR_CONFIG = {
    "auto_map": {
        "AutoImageProcessor": "image_processing_kimi_vl.KimiVLImageProcessor",
        "AutoProcessor": "processing_kimi_vl.KimiVLProcessor",
    },
    "in_token_limit": 4096,
    "patch_size": 14,
    "num_pooled_tokens": 1024,
    "merge_kernel_size": [2, 2],
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "pad_input": True,
    "image_processor_type": "KimiVLImageProcessor",
}


def test_loads_hub_config_unchanged_and_saves_an_equivalent_one(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(HUB_PREPROCESSOR_CONFIG))
    processor = KimiVLImageProcessor.from_pretrained(tmp_path)
    assert (processor.in_token_limit, processor.pad_input, processor.image_std) == (4096, True, [0.5] * 3)

    processor.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "preprocessor_config.json").read_text())
    assert saved == HUB_PREPROCESSOR_CONFIG
    reloaded = KimiVLImageProcessor.from_pretrained(tmp_path / "saved")
    assert reloaded.to_dict() == processor.to_dict()


def test_per_call_settings_override_attributes():
    image = _random_rgb(300, 300)
    processor = KimiVLImageProcessor()
    assert processor(image, in_token_limit=64)["image_grid_hws"].tolist() == [[10, 10]]  # 300 * 0.38 = 114 -> 140
    assert processor(image)["image_grid_hws"].tolist() == [[22, 22]]


def test_unknown_kwargs_are_dropped_and_accepted_set_is_computed_once_per_class():
    image = _random_rgb(28, 28)
    processor = KimiVLImageProcessor()
    accepted_preprocess_kwargs.cache_clear()
    outputs = [processor(image, device="cpu", do_resize=True, return_tensors="pt") for _ in range(3)]
    KimiVLImageProcessor(pad_input=False)(image, device="cpu")

    info = accepted_preprocess_kwargs.cache_info()
    assert (info.misses, info.hits) == (1, 3)
    assert "device" not in accepted_preprocess_kwargs(KimiVLImageProcessor)
    assert {"in_token_limit", "pad_input", "return_tensors"} <= accepted_preprocess_kwargs(KimiVLImageProcessor)
    assert all(torch.equal(out["pixel_values"], processor(image)["pixel_values"]) for out in outputs)


# --- careless and hostile input --------------------------------------------------------------------------------


def _grey_ramp(width=30, height=20, top=65535):
    """A greyscale ramp over 0..top (uint16 when top > 255), and its 8-bit equivalent (round(v * 255 / top))."""
    values = np.linspace(0, top, width * height).reshape(height, width)
    dtype = np.uint16 if top > 255 else np.uint8
    values = np.rint(values).astype(dtype)
    return values, np.rint(values.astype(np.float64) * 255 / top).astype(np.uint8)


def test_sixteen_bit_greyscale_is_scaled_to_eight_bits(tmp_path):
    values, eight_bit = _grey_ramp()
    expected = KimiVLImageProcessor()(Image.fromarray(eight_bit, "L"))["pixel_values"]
    sixteen = Image.fromarray(values)
    assert sixteen.mode == "I;16"
    sixteen.save(tmp_path / "ramp16.png")
    assert Image.open(tmp_path / "ramp16.png").mode == "I;16"  # a 16-bit PNG opens in this mode
    as_32_bit_int = sixteen.convert("I")  # 16-bit data held in PIL's 32-bit integer mode
    as_float = Image.fromarray(values.astype(np.float32) / 65535, "F")  # float in [0, 1]
    for image in (sixteen, str(tmp_path / "ramp16.png"), as_32_bit_int, as_float):
        assert torch.equal(KimiVLImageProcessor()(image)["pixel_values"], expected)
    # Not white, as the release's clipping conversion made it.
    assert KimiVLImageProcessor()(sixteen)["pixel_values"].min() == -1.0


def test_high_bit_depth_values_that_fit_no_scale_are_refused():
    negative = Image.fromarray(np.full((20, 20), -5, np.int32), "I")
    with pytest.raises(ValueError, match=r"Image 0 of 1 is a mode 'I' image with values in \[-5, -5\]"):
        KimiVLImageProcessor()(negative)
    with pytest.raises(ValueError, match=r"mode 'F' image with values in \[0.0, 300.0\].*\[0, 1.0\], \[0, 255.0\]"):
        KimiVLImageProcessor()(Image.fromarray(np.linspace(0, 300, 400, dtype=np.float32).reshape(20, 20), "F"))


def test_layout_of_arrays_and_tensors_is_given_or_unambiguous():
    pil = _random_rgb(30, 4)  # 4 rows: as HxWxC (4, 30, 3) it also reads as a 4-channel CxHxW image
    expected = KimiVLImageProcessor()(pil)["pixel_values"]
    hwc = torch.from_numpy(np.asarray(pil).copy())
    with pytest.raises(ValueError, match=r"shape \(4, 30, 3\), which reads as channels-first or channels-last"):
        KimiVLImageProcessor()(hwc)
    chw = hwc.permute(2, 0, 1)
    for image, layout in [
        (hwc, "channels_last"),
        (hwc.numpy(), "channels_last"),
        (chw, "channels_first"),
        (chw.numpy(), ChannelDimension.FIRST),
    ]:
        assert torch.equal(KimiVLImageProcessor()(image, input_data_format=layout)["pixel_values"], expected)
    # Unambiguous shapes need no input_data_format, in either layout, as numpy arrays and as torch tensors.
    tall = _random_rgb(30, 20)
    array = np.asarray(tall)
    expected = KimiVLImageProcessor()(tall)["pixel_values"]
    as_tensor = torch.from_numpy(array.copy())
    for image in (array, np.moveaxis(array, -1, 0), as_tensor, as_tensor.permute(2, 0, 1)):
        assert torch.equal(KimiVLImageProcessor()(image)["pixel_values"], expected)
    with pytest.raises(ValueError, match=r"`input_data_format` must be 'channels_first' or 'channels_last'"):
        KimiVLImageProcessor()(array, input_data_format="hwc")
    with pytest.raises(ValueError, match=r"got shape \(20, 30, 3\) read as channels_first"):
        KimiVLImageProcessor()(array, input_data_format="channels_first")


def _sideways_photo(path):
    """A 40x20 image stored as such, with EXIF orientation 6: viewers show it rotated, 20 wide and 40 high."""
    image = _random_rgb(40, 20, seed=3)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    image.save(path, exif=exif)
    return image


def test_files_are_opened_upright_and_pil_images_are_used_as_given(tmp_path):
    stored = _sideways_photo(tmp_path / "phone.png")
    processor = KimiVLImageProcessor()
    from_file = processor(str(tmp_path / "phone.png"))
    upright = stored.transpose(Image.Transpose.ROTATE_270)
    assert from_file["image_grid_hws"].tolist() == [[4, 2]]  # 40 high, 20 wide (padded to 56 x 28)
    assert torch.equal(from_file["pixel_values"], processor(upright)["pixel_values"])
    # A PIL image passed in is used as given, even when it carries an orientation tag.
    opened = Image.open(tmp_path / "phone.png")
    assert processor(opened)["image_grid_hws"].tolist() == [[2, 4]]


def _open_descriptors_of(path) -> list[str]:
    fd_dir = Path("/proc/self/fd")
    return [fd for fd in os.listdir(fd_dir) if os.path.realpath(fd_dir / fd) == os.path.realpath(path)]


def test_animated_files_give_their_first_frame_once_warned_and_are_closed(tmp_path, monkeypatch):
    frames = [Image.new("RGB", (28, 28), colour) for colour in ("red", "blue", "green")]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:], duration=50, loop=0)
    frames[0].save(tmp_path / "anim.png", save_all=True, append_images=frames[1:], duration=50)  # APNG
    warnings = []
    warning_once.cache_clear()
    monkeypatch.setattr(image_processing_kimi_vl.logger, "warning", lambda message, *args: warnings.append(message))
    processor = KimiVLImageProcessor()
    first_frame = processor(frames[0])["pixel_values"]
    for name in ("anim.gif", "anim.png", "anim.gif"):
        assert torch.equal(processor(str(tmp_path / name))["pixel_values"], first_frame)
        assert _open_descriptors_of(tmp_path / name) == []
    assert warnings == ["KimiVLImageProcessor uses the first frame of animated image files (GIF, APNG, WebP, ...)."]


def test_a_file_that_fails_to_decode_is_closed(tmp_path):
    buffer = io.BytesIO()
    _random_rgb(64, 64).save(buffer, format="PNG")
    (tmp_path / "truncated.png").write_bytes(buffer.getvalue()[:200])
    with pytest.raises(ValueError, match="could not be read as an image") as raised:
        KimiVLImageProcessor()(str(tmp_path / "truncated.png"))
    assert raised.value is not None  # the error (and its traceback) is still held, as a server logging it would
    assert _open_descriptors_of(tmp_path / "truncated.png") == []
