"""KimiVLImageProcessor: exactness against the original algorithm, inputs, errors, config round trip."""

import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from image_processing import KimiVLImageProcessor
from image_processing.image_processing_kimi_vl import accepted_preprocess_kwargs


REPO = Path(__file__).resolve().parents[1]


def _load_original_pipeline():
    """The straightforward implementation of the original's steps, kept beside the benchmark that times it."""
    spec = importlib.util.spec_from_file_location("bench_image_processor", REPO / "benchmarks" / "bench_image_processor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.original_pipeline


original_pipeline = _load_original_pipeline()


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
    processed = KimiVLImageProcessor(in_token_limit=4096, pad_input=True)(Image.open(reference_dir / "images" / f"{name}.png"))
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
        (np.zeros((3, 8, 8), np.uint8), r"Image 1 of 3: numpy arrays must be HxW or HxWxC"),
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
