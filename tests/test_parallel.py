"""Multi-process Kimi-VL: tensor parallelism of the language model and the vision tower, and the data-parallel encoder.

The multi-process tests launch tests/parallel_worker.py once on 2 CPU processes (torchrun, gloo) and compare every
rank's tensor-parallel results with the single-process results the same rank computed.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modeling_kimi_vl import KimiVLConfig, KimiVLForConditionalGeneration
from modeling_kimi_vl.parallel_kimi_vl import (
    assign_images_to_ranks,
    check_kimi_vl_tp_size,
    encode_images_data_parallel,
)

WORLD_SIZE = 2
WORKER_TIMEOUT_S = 300  # the worker takes ~15 s on 2 cores; a hung collective fails the test instead of blocking CI
SCENARIOS = ["two_images", "one_image", "three_images", "text_only"]
IMAGE_SCENARIOS = [name for name in SCENARIOS if name != "text_only"]
STATIC_SCENARIOS = ["two_images", "text_only"]  # those the worker also runs with cache_implementation="static"
# The (rows, cols) of each image scenario's images, in order (tests/parallel_worker.py builds them).
SCENARIO_GRIDS = {"two_images": [(12, 6), (8, 10)], "one_image": [(12, 6)], "three_images": [(16, 12), (2, 2), (4, 6)]}


# ----------------------------------------------------------------------------------------------------------------------
# Assignment of images to ranks
# ----------------------------------------------------------------------------------------------------------------------


def test_assignment_reference_vectors():
    assert assign_images_to_ranks([1000, 100, 200, 50], 2) == [[0], [2, 1, 3]]
    assert [len(images) for images in assign_images_to_ranks([100, 200], 4)] == [1, 1, 0, 0]
    assert assign_images_to_ranks([], 3) == [[], [], []]


def test_assignment_loads_and_ties():
    loads = [1000, 100, 200, 50]
    images_per_rank = assign_images_to_ranks(loads, 2)
    assert [sum(loads[image] for image in images) for images in images_per_rank] == [1000, 350]
    # Equal loads keep input order and go to the lowest least-loaded rank.
    assert assign_images_to_ranks([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert assign_images_to_ranks([7], 1) == [[0]]
    with pytest.raises(ValueError, match="num_ranks must be at least 1"):
        assign_images_to_ranks([1], 0)


# ----------------------------------------------------------------------------------------------------------------------
# The composed plan and the load-time checks (single process)
# ----------------------------------------------------------------------------------------------------------------------

MLA_ENTRIES = {
    "language_model.model.layers.*.self_attn.q_proj": "colwise",
    "language_model.model.layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "language_model.model.layers.*.self_attn.kv_b_proj": "colwise",
    "language_model.model.layers.*.self_attn.o_proj": "rowwise",
}
VISION_ENTRIES = {
    "vision_tower.encoder.blocks.*.wqkv": "packed_qkv_colwise",
    "vision_tower.encoder.blocks.*.wo": "rowwise",
    "vision_tower.encoder.blocks.*.mlp.fc0": "colwise",
    "vision_tower.encoder.blocks.*.mlp.fc1": "rowwise",
}


@pytest.fixture(scope="module")
def tiny_config(reference_checkpoint) -> KimiVLConfig:
    return KimiVLConfig.from_pretrained(reference_checkpoint)


def test_plan_data_mode_shards_the_language_model_only(tiny_config):
    plan = KimiVLForConditionalGeneration(tiny_config)._tp_plan
    assert MLA_ENTRIES.items() <= plan.items()
    # What the nested DeepSeek-V3 brings: dense MLP, shared and routed experts, embeddings, lm_head.
    for name in (
        "language_model.model.layers.*.mlp.gate_proj",
        "language_model.model.layers.*.mlp.down_proj",
        "language_model.model.layers.*.mlp.shared_experts.up_proj",
        "language_model.model.layers.*.mlp.experts.gate_up_proj",
        "language_model.model.layers.*.mlp.experts",
        "language_model.lm_head",
    ):
        assert name in plan
    assert not [name for name in plan if not name.startswith("language_model.")]


def test_plan_weight_mode_adds_the_vision_tower(reference_checkpoint):
    # The mode is also a from_pretrained keyword.
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, mm_encoder_tp_mode="weight")
    assert model.config.mm_encoder_tp_mode == "weight"
    plan = model._tp_plan
    assert VISION_ENTRIES.items() <= plan.items() and MLA_ENTRIES.items() <= plan.items()
    assert not [name for name in plan if name.startswith("multi_modal_projector.")]


def test_plan_with_query_lora_shards_q_b_proj(tiny_config):
    config = tiny_config.__class__.from_dict(tiny_config.to_dict())
    config.text_config.q_lora_rank = 16
    model = KimiVLForConditionalGeneration(config)
    projections = dict(model.language_model.model.layers[0].self_attn.named_children())
    assert "q_b_proj" in projections and "q_proj" not in projections  # so only the q_b_proj rule applies
    plan = model._tp_plan
    assert plan["language_model.model.layers.*.self_attn.q_b_proj"] == "colwise"
    assert "language_model.model.layers.*.self_attn.q_a_proj" not in plan  # the query latent stays whole


def test_bad_mode_keyword_is_rejected(reference_checkpoint):
    with pytest.raises(ValueError, match="mm_encoder_tp_mode='tensor' is not supported"):
        KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, mm_encoder_tp_mode="tensor")


@pytest.mark.parametrize(
    ("tp_size", "mode", "message"),
    [
        (3, "data", "4 attention heads are not divisible by the tensor-parallel size 3"),
        (4, "data", "6 routed experts are not divisible by the tensor-parallel size 4"),
        (2, "weight", "vision tower's 3 attention heads across 2 ranks.*mm_encoder_tp_mode='data'"),
        (2, "data", "shares the images among all 1 processes, but the tensor-parallel group has 2"),
    ],
)
def test_tp_size_checks_name_the_numbers(tiny_config, tp_size, mode, message):
    config = tiny_config.__class__.from_dict({**tiny_config.to_dict(), "mm_encoder_tp_mode": mode})
    with pytest.raises(ValueError, match=message):
        check_kimi_vl_tp_size(config, tp_size)


def test_tp_size_check_of_the_vision_tower_alone_offers_no_data_mode(tiny_config):
    # MoonViTModel has no mm_encoder_tp_mode: it is always weight-sharded.
    with pytest.raises(ValueError, match="MoonViTModel with tensor parallelism splits the vision tower's 3") as error:
        check_kimi_vl_tp_size(tiny_config.vision_config, 2)
    assert "mm_encoder_tp_mode" not in str(error.value)


def test_tp_size_one_is_always_fine(tiny_config):
    check_kimi_vl_tp_size(tiny_config, 1)


# ----------------------------------------------------------------------------------------------------------------------
# The data-parallel encoder in one process
# ----------------------------------------------------------------------------------------------------------------------


def test_data_parallel_encoder_on_one_process_returns_one_tensor(reference_model, expected):
    grids = [tuple(grid) for grid in expected["image_grid_hws"].tolist()]
    with torch.no_grad():
        merged = encode_images_data_parallel(reference_model.vision_tower, expected["pixel_values"], grids)
        empty = encode_images_data_parallel(reference_model.vision_tower, expected["pixel_values"][:0], [])
    assert isinstance(merged, torch.Tensor)
    torch.testing.assert_close(merged, expected["vision_merged"], rtol=1e-4, atol=1e-5)
    assert empty.shape == (0, 4, 48) and empty.dtype == reference_model.vision_tower.dtype


@pytest.mark.parametrize("option", ["output_hidden_states", "output_attentions"])
def test_data_parallel_encoder_refuses_to_record_what_other_ranks_encode(reference_model, expected, option):
    grids = [tuple(grid) for grid in expected["image_grid_hws"].tolist()]
    with torch.no_grad(), pytest.raises(ValueError, match=f"{option} cannot be given with mm_encoder_tp_mode='data'"):
        encode_images_data_parallel(reference_model.vision_tower, expected["pixel_values"], grids, **{option: True})


def test_data_parallel_encoder_refuses_to_drop_gradients(reference_model, expected):
    grids = [tuple(grid) for grid in expected["image_grid_hws"].tolist()]
    with pytest.raises(RuntimeError, match="inference-only"):
        encode_images_data_parallel(reference_model.vision_tower, expected["pixel_values"], grids)


def test_data_parallel_encoder_refuses_cuda_graph_capture(reference_model, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    grids = [tuple(grid) for grid in expected["image_grid_hws"].tolist()]
    with pytest.raises(RuntimeError, match="cannot run inside a CUDA graph capture"):
        encode_images_data_parallel(reference_model.vision_tower, expected["pixel_values"], grids)


# ----------------------------------------------------------------------------------------------------------------------
# Two processes
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def even_heads_checkpoint(reference_checkpoint, tmp_path_factory) -> Path:
    """The reference weights with 4 vision heads instead of 3 (the fused weights have the same shapes), so that weight
    mode can split the heads over 2 ranks."""
    folder = tmp_path_factory.mktemp("even_heads")
    config = json.loads((reference_checkpoint / "config.json").read_text())
    config["vision_config"]["num_attention_heads"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").symlink_to(reference_checkpoint / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def worker_run(reference_dir, even_heads_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parallel")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}",
        str(Path(__file__).with_name("parallel_worker.py")),
        "--reference", str(reference_dir / "tiny_ref"), "--even-heads", str(even_heads_checkpoint),
        "--expected", str(reference_dir / "expected.safetensors"), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    # Own process group, so that a hang can be ended together with the workers torchrun started.
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"2-process run did not finish in {WORKER_TIMEOUT_S} s:\n{output.decode()[-4000:]}")
    if process.returncode != 0:
        pytest.fail(f"2-process run failed ({process.returncode}):\n{output.decode()[-4000:]}")
    return out


@pytest.fixture(scope="module")
def rank_results(worker_run) -> list[dict[str, torch.Tensor]]:
    return [load_file(worker_run / f"rank{rank}.safetensors") for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def rank_reports(worker_run) -> list[dict]:
    return [json.loads((worker_run / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


def assert_matches_single_process(results, single: str, parallel: str, scenario: str):
    torch.testing.assert_close(
        results[f"{parallel}.{scenario}.logits"], results[f"{single}.{scenario}.logits"], rtol=0, atol=1e-5
    )
    assert torch.equal(results[f"{parallel}.{scenario}.tokens"], results[f"{single}.{scenario}.tokens"])
    if scenario in IMAGE_SCENARIOS:
        torch.testing.assert_close(
            results[f"{parallel}.{scenario}.merged"], results[f"{single}.{scenario}.merged"], rtol=0, atol=1e-5
        )
        for image in range(len(SCENARIO_GRIDS[scenario])):
            key = f"{scenario}.image_features.{image}"
            torch.testing.assert_close(results[f"{parallel}.{key}"], results[f"{single}.{key}"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("scenario", IMAGE_SCENARIOS)
@pytest.mark.parametrize("run", ["reference.single", "reference.data", "even.single", "even.weight"])
def test_image_features_are_split_per_image_in_every_mode(rank_results, rank, scenario, run):
    """get_image_features(...).pooler_output: one tensor per image, in image order, rows*cols/4 tokens each."""
    results = rank_results[rank]
    grids = SCENARIO_GRIDS[scenario]
    per_image = [results[f"{run}.{scenario}.image_features.{image}"] for image in range(len(grids))]
    assert f"{run}.{scenario}.image_features.{len(grids)}" not in results
    assert [features.shape for features in per_image] == [(rows * cols // 4, 64) for rows, cols in grids]
    assert results[f"{run}.{scenario}.merged"].shape == (sum(rows * cols // 4 for rows, cols in grids), 4, 48)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_data_mode_matches_single_process(rank_results, rank, scenario):
    assert_matches_single_process(rank_results[rank], "reference.single", "reference.data", scenario)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_weight_mode_matches_single_process(rank_results, rank, scenario):
    assert_matches_single_process(rank_results[rank], "even.single", "even.weight", scenario)


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("scenario", STATIC_SCENARIOS)
@pytest.mark.parametrize(
    ("single", "parallel"), [("reference.single", "reference.data"), ("even.single", "even.weight")]
)
def test_static_generation_under_tensor_parallelism_equals_single_process_plain_generate(
    rank_results, rank, scenario, single, parallel
):
    results = rank_results[rank]
    plain = results[f"{single}.{scenario}.tokens"]
    assert torch.equal(results[f"{parallel}.{scenario}.static_tokens"], plain)
    assert torch.equal(results[f"{single}.{scenario}.static_tokens"], plain)
    # The absorbed attention (per-rank heads of kv_b_proj) gives the expanded form's tokens, on one process and on two.
    assert torch.equal(results[f"{parallel}.{scenario}.expanded_tokens"], plain)
    assert torch.equal(results[f"{single}.{scenario}.expanded_tokens"], plain)


@pytest.mark.parametrize("scenario", STATIC_SCENARIOS)
@pytest.mark.parametrize("parallel", ["reference.data", "even.weight"])
def test_static_generation_under_tensor_parallelism_takes_the_absorbed_form(rank_reports, scenario, parallel):
    for report in rank_reports:  # short prompts: prefill and every decode step attend over the latent
        assert report[f"{parallel}.{scenario}.static_expansions"] == 0


def test_single_process_reference_matches_the_fixture(rank_results, expected):
    # Anchors the comparisons above: the single-process side is the original code's output.
    single = rank_results[0]["reference.single.two_images.logits"]
    torch.testing.assert_close(single, expected["mm_logits"], rtol=1e-4, atol=1e-5)


def test_language_model_attention_is_sharded(rank_reports):
    for report in rank_reports:
        assert report["data.tp_size"] == WORLD_SIZE and report["data.mode"] == "data"
        assert report["data.q_proj_local_shape"] == [4 * 32 // WORLD_SIZE, 64]  # 4 heads x qk_head_dim 32, split


def test_data_mode_shares_images_largest_first(rank_reports):
    """What each rank's (replicated) tower encoded: LPT by patch count, and nothing on a rank without images."""
    rank0, rank1 = rank_reports
    assert rank0["data.wqkv_is_plain_parameter"] and rank1["data.wqkv_is_plain_parameter"]
    # two_images: 12x6 = 72 and 8x10 = 80 patches.
    assert rank0["reference.data.two_images.tower_grids"] == [[[8, 10]]]
    assert rank1["reference.data.two_images.tower_grids"] == [[[12, 6]]]
    # one_image: rank 1 has no image and does not run its tower, yet took part in the gather (its logits match).
    assert rank0["reference.data.one_image.tower_grids"] == [[[12, 6]]]
    assert rank1["reference.data.one_image.tower_grids"] == []
    # three_images: 192, 4 and 24 patches.
    assert rank0["reference.data.three_images.tower_grids"] == [[[16, 12]]]
    assert rank1["reference.data.three_images.tower_grids"] == [[[4, 6], [2, 2]]]
    assert rank0["reference.data.text_only.tower_grids"] == rank1["reference.data.text_only.tower_grids"] == []


def test_weight_mode_splits_whole_heads(rank_reports):
    for report in rank_reports:
        # 4 heads x 12 dims, 2 per rank, for each of q, k and v; the bias alike.
        assert report["weight.wqkv_local_shape"] == [3 * 48 // WORLD_SIZE, 48]
        assert report["weight.wqkv_bias_local_shape"] == [3 * 48 // WORLD_SIZE]
        # Every rank runs its shard of the tower on all the images.
        assert report["even.weight.three_images.tower_grids"] == [[[16, 12], [2, 2], [4, 6]]]


def test_weight_mode_refuses_heads_that_do_not_divide(rank_reports):
    for report in rank_reports:
        error = report["weight_3_heads.error"]
        assert error is not None, "loading 3 vision heads on 2 ranks in weight mode succeeded"
        assert "3 attention heads across 2 ranks" in error and "mm_encoder_tp_mode='data'" in error


@pytest.mark.parametrize("loaded, switched", [("data", "weight"), ("weight", "data")])
def test_switching_the_vision_mode_after_a_tensor_parallel_load_is_refused(rank_reports, loaded, switched):
    for report in rank_reports:
        error = report[f"{loaded}.switched_to_{switched}.error"]
        assert error is not None, f"a model loaded in {loaded} mode encoded images in {switched} mode"
        assert f"mm_encoder_tp_mode is {switched!r}" in error and f"loaded with {loaded!r}" in error
        assert f"mm_encoder_tp_mode={switched!r}" in error  # how to get the mode: load again with it


@pytest.mark.parametrize("saved", ["saved_data", "saved_weight"])
def test_save_from_tensor_parallel_model_is_the_original_layout(worker_run, reference_checkpoint, saved):
    source = load_file(reference_checkpoint / "model.safetensors")
    written = load_file(worker_run / saved / "model.safetensors")
    assert written.keys() == source.keys()
    for name, tensor in source.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name

    reloaded = KimiVLForConditionalGeneration.from_pretrained(worker_run / saved).state_dict()
    original = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint).state_dict()
    assert reloaded.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(reloaded[name], tensor), name
