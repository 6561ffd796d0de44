"""The model against the original release: the tiny reference checkpoint's features, logits, greedy tokens and
key layout, plus the behaviour the original lacked (correct eager attention, training, dtypes, clear errors)."""

import json

import pytest
import torch
from helpers import PLACEHOLDER_ID, prompt_ids, random_images
from original_reference import original_resize
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from modeling_kimi_vl import KimiVLConfig, KimiVLForConditionalGeneration, MoonViTConfig, kimi_vl_a3b_config
from modeling_kimi_vl.modeling_kimi_vl import PackedImages, merge_patches, moonvit_rotary_angles

RTOL = 1e-4  # what the original code's own float32 arithmetic allows (fixture README)


def assert_close(actual, expected, rtol=RTOL):
    scale = expected.abs().max().clamp_min(1e-6)
    error = (actual - expected).abs().max() / scale
    assert error <= rtol, f"relative error {error:.3e} > {rtol}"


# ---------------------------------------------------------------------------------------------------------------------
# Loading and the original layout
# ---------------------------------------------------------------------------------------------------------------------


def test_loading_reports_no_missing_unexpected_or_mismatched_keys(reference_checkpoint):
    _, info = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert info["error_msgs"] == []


def test_auto_classes_resolve_kimi_vl(reference_checkpoint):
    assert isinstance(AutoConfig.from_pretrained(reference_checkpoint), KimiVLConfig)
    for auto_class in (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText):
        model = auto_class.from_pretrained(reference_checkpoint)
        assert isinstance(model, KimiVLForConditionalGeneration)


def test_config_reads_original_json_and_round_trips(reference_checkpoint, tmp_path):
    original = json.loads((reference_checkpoint / "config.json").read_text())
    config = KimiVLConfig.from_pretrained(reference_checkpoint)
    assert isinstance(config.vision_config, MoonViTConfig)
    assert type(config.text_config).__name__ == "DeepseekV3Config"
    # Keys written by the original's transformers version are carried, not rejected.
    assert config.text_config._attn_implementation_autoset is True
    assert config.text_config.topk_method == "noaux_tc"
    assert config.media_placeholder_token_id == original["media_placeholder_token_id"]
    for key, value in original["vision_config"].items():
        if not key.startswith("_"):
            assert getattr(config.vision_config, key) == value, key

    config.save_pretrained(tmp_path)
    reloaded = KimiVLConfig.from_pretrained(tmp_path)
    assert reloaded.to_dict() == config.to_dict()


def test_save_pretrained_writes_the_original_layout_bit_identical(reference_model, reference_checkpoint, tmp_path):
    reference_model.save_pretrained(tmp_path)
    with safe_open(reference_checkpoint / "model.safetensors", "pt") as source:
        source_tensors = {key: source.get_tensor(key) for key in source.keys()}
    saved_tensors = {}
    for shard in tmp_path.glob("*.safetensors"):
        with safe_open(shard, "pt") as saved:
            saved_tensors.update({key: saved.get_tensor(key) for key in saved.keys()})
    assert set(saved_tensors) == set(source_tensors)  # per-expert keys, no fused or renamed ones
    for key, tensor in source_tensors.items():
        assert saved_tensors[key].dtype == tensor.dtype, key
        assert torch.equal(saved_tensors[key], tensor), key


def test_real_kimi_vl_a3b_config_has_the_published_parameter_count():
    config = kimi_vl_a3b_config()
    assert config.text_config.n_routed_experts == 64 and config.vision_config.num_hidden_layers == 27
    with torch.device("meta"):
        model = KimiVLForConditionalGeneration(config)

    def count(module):
        return sum(parameter.numel() for parameter in module.parameters())

    # e_score_correction_bias is a buffer in transformers (a parameter in the original): 26 MoE layers x 64.
    router_biases = sum(buffer.numel() for name, buffer in model.named_buffers() if "e_score_correction_bias" in name)
    assert count(model.vision_tower) == 416_866_032
    assert count(model.multi_modal_projector) == 30_679_808
    assert count(model.language_model) + router_biases == 15_960_110_208
    assert count(model) + router_biases == 16_407_656_048


# ---------------------------------------------------------------------------------------------------------------------
# Numbers of the original
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_vision_tower_and_projector_match_reference(reference_model, expected):
    merged = reference_model.vision_tower(expected["pixel_values"], expected["image_grid_hws"]).last_hidden_state
    assert merged.shape == expected["vision_merged"].shape
    assert_close(merged, expected["vision_merged"])
    features = reference_model.get_image_features(expected["pixel_values"], expected["image_grid_hws"])
    assert torch.equal(features.last_hidden_state, merged)
    tokens_per_image = [rows * cols // 4 for rows, cols in expected["image_grid_hws"].tolist()]
    assert [image.shape[0] for image in features.pooler_output] == tokens_per_image  # one tensor per image, in order
    assert_close(torch.cat(features.pooler_output), expected["projected"])


@torch.no_grad()
def test_single_image_in_a_batch_equals_it_alone(reference_model, expected):
    first = expected["single_vision_merged"]
    rows, cols = expected["image_grid_hws"][0].tolist()
    alone = reference_model.vision_tower(expected["pixel_values"][: rows * cols], expected["image_grid_hws"][:1])
    alone = alone.last_hidden_state
    assert_close(alone, first)
    batched = reference_model.vision_tower(expected["pixel_values"], expected["image_grid_hws"]).last_hidden_state
    assert_close(batched[: first.shape[0]], first)


@torch.no_grad()
def test_multimodal_and_text_logits_match_reference(reference_model, expected):
    multimodal = reference_model(
        input_ids=expected["mm_input_ids"],
        pixel_values=expected["pixel_values"],
        image_grid_hws=expected["image_grid_hws"],
    )
    assert_close(multimodal.logits, expected["mm_logits"])
    text = reference_model(input_ids=expected["txt_input_ids"])
    assert_close(text.logits, expected["txt_logits"])


@torch.no_grad()
def test_model_configured_for_tuples_still_encodes_images(reference_checkpoint, expected):
    """`return_dict=False` (the convention for tracing and export) changes what the model returns, not how it reads its
    own submodules' outputs."""
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, return_dict=False).eval()
    model.config.vision_config.return_dict = False
    images = {"pixel_values": expected["pixel_values"], "image_grid_hws": expected["image_grid_hws"]}
    (logits,) = model(input_ids=expected["mm_input_ids"], **images, use_cache=False)
    assert_close(logits, expected["mm_logits"])
    merged, features_per_image = model.get_image_features(**images)
    assert_close(torch.cat(features_per_image), expected["projected"])
    assert_close(merged, expected["vision_merged"])
    new_tokens = expected["mm_generated"].shape[1] - expected["mm_input_ids"].shape[1]
    for cache_implementation in (None, "static"):
        generated = model.generate(input_ids=expected["mm_input_ids"], **images, max_new_tokens=new_tokens,
                                   do_sample=False, cache_implementation=cache_implementation)  # fmt: skip
        assert torch.equal(generated, expected["mm_generated"])


@torch.no_grad()
def test_inputs_embeds_path_equals_input_ids_path(reference_model, expected):
    inputs_embeds = reference_model.get_input_embeddings()(expected["mm_input_ids"])
    via_embeds = reference_model(
        inputs_embeds=inputs_embeds, pixel_values=expected["pixel_values"], image_grid_hws=expected["image_grid_hws"]
    )
    assert_close(via_embeds.logits, expected["mm_logits"])


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_greedy_generate_matches_reference(reference_model, expected, cache_implementation):
    prompt_length = expected["mm_input_ids"].shape[1]
    generated = reference_model.generate(
        input_ids=expected["mm_input_ids"],
        pixel_values=expected["pixel_values"],
        image_grid_hws=expected["image_grid_hws"],
        max_new_tokens=expected["mm_generated"].shape[1] - prompt_length,
        do_sample=False,
        cache_implementation=cache_implementation,
    )
    assert torch.equal(generated, expected["mm_generated"])


def test_batched_left_padded_multi_image_generate_equals_one_by_one(reference_model):
    grids_per_prompt = [[(4, 6), (2, 2)], [], [(6, 4)]]
    prompts = [prompt_ids(grids, text=(5 + i, 6, 7)) for i, grids in enumerate(grids_per_prompt)]
    images = [random_images(grids, seed=i) if grids else (None, None) for i, grids in enumerate(grids_per_prompt)]

    one_by_one = []
    for ids, (pixel_values, grid_hws) in zip(prompts, images):
        output = reference_model.generate(
            input_ids=torch.tensor([ids]), pixel_values=pixel_values, image_grid_hws=grid_hws,
            max_new_tokens=6, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        one_by_one.append(output[0, len(ids) :].tolist())

    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    pixel_values = torch.cat([pv for pv, _ in images if pv is not None])
    grid_hws = torch.cat([grids for _, grids in images if grids is not None])
    batched = reference_model.generate(
        input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values, image_grid_hws=grid_hws,
        max_new_tokens=6, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    assert batched[:, width:].tolist() == one_by_one


# ---------------------------------------------------------------------------------------------------------------------
# Vision attention implementations and the host-sync contract
# ---------------------------------------------------------------------------------------------------------------------


def vision_tower_with(reference_checkpoint, attn_implementation):
    model = KimiVLForConditionalGeneration.from_pretrained(
        reference_checkpoint, attn_implementation=attn_implementation
    )
    return model.vision_tower.eval()


@torch.no_grad()
def test_eager_attention_is_block_diagonal_like_sdpa(reference_checkpoint, reference_model):
    """The original's eager path let images attend to each other; ours must equal sdpa and per-image runs."""
    eager = vision_tower_with(reference_checkpoint, "eager")
    assert eager.config._attn_implementation == "eager"
    grids = [(4, 6), (8, 2), (2, 2)]
    pixel_values, grid_hws = random_images(grids)
    batched = eager(pixel_values, grid_hws).last_hidden_state
    assert_close(batched, reference_model.vision_tower(pixel_values, grid_hws).last_hidden_state)
    per_image = pixel_values.split([r * c for r, c in grids])
    alone = [eager(pv, grid_hws[i : i + 1]).last_hidden_state for i, pv in enumerate(per_image)]
    assert_close(batched, torch.cat(alone))


@torch.no_grad()
def test_varlen_attention_gets_host_metadata_once_per_forward(reference_checkpoint, reference_model, monkeypatch):
    """flash_attention_2 receives cu_seqlens / max_seqlen (a Python int) from the single host-side computation."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def reference_varlen(module, query, key, value, attention_mask, scaling, cu_seq_lens_q, max_length_q, **kwargs):
        calls.append((cu_seq_lens_q, max_length_q))
        assert isinstance(max_length_q, int) and cu_seq_lens_q.dtype == torch.int32
        bounds = cu_seq_lens_q.tolist()  # test-side check only
        outputs = [
            torch.nn.functional.scaled_dot_product_attention(
                query[..., start:end, :], key[..., start:end, :], value[..., start:end, :], scale=scaling
            )
            for start, end in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(outputs, dim=2).transpose(1, 2), None

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", reference_varlen)
    tower = vision_tower_with(reference_checkpoint, "sdpa")
    monkeypatch.setattr(tower.config, "_attn_implementation_internal", "flash_attention_2", raising=False)
    assert tower.config._attn_implementation == "flash_attention_2"

    grids = [(4, 6), (2, 2)]
    pixel_values, grid_hws = random_images(grids)
    output = tower(pixel_values, grid_hws).last_hidden_state
    assert_close(output, reference_model.vision_tower(pixel_values, grid_hws).last_hidden_state)
    assert len(calls) == tower.config.num_hidden_layers
    assert all(cu is calls[0][0] for cu, _ in calls)  # the same tensor object: computed once, handed to every layer
    assert calls[0][0].tolist() == [0, 24, 28] and calls[0][1] == 24


@torch.no_grad()
def test_vision_blocks_do_not_read_device_tensors_back_to_the_host(reference_model, monkeypatch):
    """Any .item()/.tolist()/bool()/int() of a tensor inside an encoder block would be a device->host sync on GPU."""
    inside_block = []

    def forbid(name):
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, **kwargs):
            if inside_block:
                raise AssertionError(f"Tensor.{name}() called inside a vision block")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero"):
        forbid(name)

    def enter(*_):
        inside_block.append(True)

    def leave(*_):
        inside_block.pop()

    handles = []
    for block in reference_model.vision_tower.encoder.blocks:
        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    try:
        pixel_values, grid_hws = random_images([(4, 6), (2, 4), (6, 2)])
        reference_model.vision_tower(pixel_values, grid_hws)
    finally:
        for handle in handles:
            handle.remove()
    assert not inside_block


# ---------------------------------------------------------------------------------------------------------------------
# Recorded outputs (feature extraction)
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_vision_tower_records_hidden_states_of_every_block_plus_the_embeddings(reference_checkpoint):
    # A model of its own: recording installs transformers' output hooks, which pickling (tested on the shared
    # reference_model) does not take.
    tower = vision_tower_with(reference_checkpoint, "sdpa")
    grids = [(4, 6), (2, 2)]
    pixel_values, grid_hws = random_images(grids)
    output = tower(pixel_values, grid_hws, output_hidden_states=True)
    assert len(output.hidden_states) == tower.config.num_hidden_layers + 1
    assert all(states.shape == (28, tower.config.hidden_size) for states in output.hidden_states)
    assert torch.equal(output.hidden_states[0], tower.patch_embed(pixel_values, grids))
    blocks = tower.encoder.blocks
    angles = moonvit_rotary_angles(grids, tower.config.hidden_size // tower.config.num_attention_heads, "cpu")
    rotation = torch.polar(torch.ones_like(angles), angles)
    packed = PackedImages.from_grids(grids, pixel_values.device)
    for index, block in enumerate(blocks):  # each entry is its block's output on the previous entry
        assert_close(output.hidden_states[index + 1], block(output.hidden_states[index], rotation, packed), rtol=1e-6)
    # last_hidden_state stays the merged patches, made from the last block's output through the final norm.
    final = merge_patches(tower.encoder.final_layernorm(output.hidden_states[-1]), grids, (2, 2))
    assert torch.equal(output.last_hidden_state, final)
    assert torch.equal(output.last_hidden_state, tower(pixel_values, grid_hws).last_hidden_state)
    assert tower(pixel_values, grid_hws).hidden_states is None  # recorded only when asked


@torch.no_grad()
def test_eager_vision_tower_records_attention_per_image_and_get_image_features_passes_them_on(reference_checkpoint):
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, attn_implementation="eager").eval()
    grids = [(4, 6), (2, 2)]
    pixel_values, grid_hws = random_images(grids)
    features = model.get_image_features(pixel_values, grid_hws, output_attentions=True, output_hidden_states=True)
    heads = model.config.vision_config.num_attention_heads
    assert len(features.attentions) == model.config.vision_config.num_hidden_layers
    for per_image in features.attentions:
        assert [weights.shape for weights in per_image] == [(1, heads, 24, 24), (1, heads, 4, 4)]
        for weights in per_image:
            torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    assert len(features.hidden_states) == model.config.vision_config.num_hidden_layers + 1
    plain = model.get_image_features(pixel_values, grid_hws)
    assert plain.attentions is None and plain.hidden_states is None
    assert torch.equal(features.last_hidden_state, plain.last_hidden_state)


# ---------------------------------------------------------------------------------------------------------------------
# Position-table resize
# ---------------------------------------------------------------------------------------------------------------------


def test_position_resize_equals_bicubic_interpolation(reference_checkpoint):
    pos_emb = vision_tower_with(reference_checkpoint, "sdpa").patch_embed.pos_emb
    height, width = pos_emb.weight.shape[:2]
    with torch.no_grad():
        for rows, cols in [(4, 6), (2, 2), (12, 6), (6, 6), (40, 2), (6, 10), (100, 300)]:
            assert_close(pos_emb([(rows, cols)]), original_resize(pos_emb.weight, rows, cols), rtol=1e-6)
        assert torch.equal(pos_emb([(height, width)]), pos_emb.weight.flatten(0, 1))  # no resize: the table itself


def test_position_resize_matrices_are_cached_and_serve_training_after_inference(reference_checkpoint):
    from modeling_kimi_vl.modeling_kimi_vl import bicubic_resize_matrix

    pos_emb = vision_tower_with(reference_checkpoint, "sdpa").patch_embed.pos_emb
    bicubic_resize_matrix.cache_clear()
    with torch.inference_mode():  # e.g. a serving pipeline or an eval loop builds the matrices first
        inference_table = pos_emb([(4, 10)])
    assert bicubic_resize_matrix.cache_info().currsize == 2  # one per axis
    assert bicubic_resize_matrix.cache_info().maxsize is not None  # bounded

    pos_emb.train()
    table = pos_emb([(4, 10)])  # the same cached matrices, now in a training step
    assert bicubic_resize_matrix.cache_info().hits == 2
    table.sum().backward()
    assert pos_emb.weight.grad is not None and pos_emb.weight.grad.abs().sum() > 0
    assert torch.equal(table.detach(), inference_table)


def test_position_resize_runs_in_float32_under_autocast(reference_checkpoint):
    pos_emb = vision_tower_with(reference_checkpoint, "sdpa").patch_embed.pos_emb
    with torch.no_grad():
        plain = pos_emb([(12, 6)])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = pos_emb([(12, 6)])
    assert torch.equal(autocast, plain)


@pytest.mark.parametrize("write", ["load_state_dict", "data_copy"])
def test_position_embedding_follows_weight_changes(reference_checkpoint, write):
    """Nothing derived from the weights is cached, so every way of writing new weights shows at once."""
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint).eval()
    pixel_values, grid_hws = random_images([(4, 6)])
    new_table = model.vision_tower.patch_embed.pos_emb.weight.detach() + 0.5
    with torch.no_grad():
        before = model.vision_tower(pixel_values, grid_hws).last_hidden_state
        if write == "load_state_dict":
            model.vision_tower.load_state_dict({"patch_embed.pos_emb.weight": new_table}, strict=False)
        else:  # bypasses the version counter, as weight-sync code in RL loops does
            model.vision_tower.patch_embed.pos_emb.weight.data.copy_(new_table)
        after = model.vision_tower(pixel_values, grid_hws).last_hidden_state
        fresh = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint).eval()
        fresh.vision_tower.load_state_dict({"patch_embed.pos_emb.weight": new_table}, strict=False)
        expected_after = fresh.vision_tower(pixel_values, grid_hws).last_hidden_state
    assert not torch.allclose(before, after)
    assert torch.equal(after, expected_after)


# ---------------------------------------------------------------------------------------------------------------------
# Training and dtypes
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_training_backward_through_vision_projector_and_moe(reference_checkpoint, gradient_checkpointing):
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint)
    model.train()
    if gradient_checkpointing:
        # The name every 5.x release knows (5.23 also calls it activation_checkpointing_enable).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert model.vision_tower.encoder.blocks[0].gradient_checkpointing
    grids = [(4, 6), (2, 2)]
    pixel_values, grid_hws = random_images(grids)
    input_ids = torch.tensor([prompt_ids(grids)])
    labels = input_ids.clone()
    labels[input_ids == PLACEHOLDER_ID] = -100
    output = model(input_ids=input_ids, pixel_values=pixel_values, image_grid_hws=grid_hws, labels=labels)
    assert torch.isfinite(output.loss)
    output.loss.backward()
    blocks = model.vision_tower.encoder.blocks
    for parameter in (
        model.vision_tower.patch_embed.pos_emb.weight,
        blocks[0].wqkv.weight,
        model.multi_modal_projector.linear_1.weight,
        model.language_model.model.layers[-1].mlp.experts.gate_up_proj,
        model.language_model.model.layers[-1].mlp.gate.weight,
    ):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


def test_loss_ignores_minus_100_labels(reference_model, expected):
    input_ids = expected["txt_input_ids"]
    labels = input_ids.clone()
    with torch.no_grad():
        full = reference_model(input_ids=input_ids, labels=labels).loss
        labels[:, :6] = -100
        partial = reference_model(input_ids=input_ids, labels=labels).loss
        logits = reference_model(input_ids=input_ids).logits
    # Position t predicts label t+1: with labels 0..5 ignored, predictions 5..T-2 count.
    manual = torch.nn.functional.cross_entropy(logits[:, 5:-1].flatten(0, 1), input_ids[:, 6:].flatten())
    assert torch.allclose(partial, manual, rtol=1e-5)
    assert not torch.allclose(full, partial)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_runs(reference_checkpoint, expected, dtype):
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, dtype=dtype).eval()
    assert model.vision_tower.encoder.blocks[0].wqkv.weight.dtype == dtype
    with torch.no_grad():
        output = model(
            input_ids=expected["mm_input_ids"],
            pixel_values=expected["pixel_values"].to(dtype),
            image_grid_hws=expected["image_grid_hws"],
        )
    assert output.logits.dtype == dtype and torch.isfinite(output.logits).all()
    assert_close(output.logits.float(), expected["mm_logits"], rtol=0.1)


def test_rotary_math_runs_in_float32():
    from modeling_kimi_vl.modeling_kimi_vl import apply_moonvit_rotary, moonvit_rotary_angles

    angles = moonvit_rotary_angles([(300, 2)], head_dim=8, device=torch.device("cpu"))
    rotation = torch.polar(torch.ones_like(angles), angles)
    states = torch.randn(600, 1, 8)
    in_bf16 = apply_moonvit_rotary(states.bfloat16(), rotation)
    in_fp32 = apply_moonvit_rotary(states, rotation)
    assert in_bf16.dtype == torch.bfloat16
    # Rotating in float32 then rounding once: within one bf16 rounding of the exact result, even at row 299.
    assert torch.allclose(in_bf16.float(), in_fp32, atol=2e-2, rtol=1e-2)
    # Pair 0 turns by the column, pair 1 by the row (patch 5 is row 2, col 1 in a 300 x 2 grid).
    assert torch.allclose(angles[5, :2], torch.tensor([1.0, 2.0]))


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_placeholder_mask_from_ids_equals_the_one_from_embeddings(reference_model):
    input_ids = torch.tensor([prompt_ids([(4, 6)]), [5] * 3 + [PLACEHOLDER_ID] * 6 + [6] * 3])
    from_ids = reference_model.get_placeholder_mask(input_ids, None)
    assert from_ids.shape == (2, 12, 1) and from_ids.dtype == torch.bool
    assert from_ids.squeeze(-1).tolist() == (input_ids == PLACEHOLDER_ID).tolist()
    inputs_embeds = reference_model.get_input_embeddings()(input_ids)
    assert torch.equal(reference_model.get_placeholder_mask(None, inputs_embeds), from_ids)
    features = torch.zeros(12, inputs_embeds.shape[-1])
    assert torch.equal(reference_model.get_placeholder_mask(input_ids, inputs_embeds, features), from_ids)
    with pytest.raises(ValueError, match="12 image placeholder tokens .* give 11 features"):
        reference_model.get_placeholder_mask(None, inputs_embeds, features[:11])


def test_placeholder_count_mismatch_names_both_numbers(reference_model):
    pixel_values, grid_hws = random_images([(4, 6)])
    input_ids = torch.tensor([[5] + [300] * 5 + [6]])
    with pytest.raises(ValueError, match=r"5 image placeholder tokens.*6 features"):
        reference_model(input_ids=input_ids, pixel_values=pixel_values, image_grid_hws=grid_hws)


@pytest.mark.parametrize(
    ("grids", "num_patches", "message"),
    [
        ([(4, 6)], 20, r"20 patches but image_grid_hws describes 24"),
        ([(3, 6)], 18, r"grid 3x6 is not divisible by the merge kernel 2x2"),
        ([(512, 2)], 1024, r"grid 512x2 reaches the 512 rotary positions"),
    ],
)
def test_bad_grids_raise_clear_errors(reference_model, grids, num_patches, message):
    pixel_values = torch.zeros(num_patches, 3, 14, 14)
    with pytest.raises(ValueError, match=message):
        reference_model.get_image_features(pixel_values, torch.tensor(grids))


def test_pixel_values_without_grids_is_an_error(reference_model):
    with pytest.raises(ValueError, match="without image_grid_hws"):
        reference_model(input_ids=torch.tensor([[300] * 6]), pixel_values=torch.zeros(24, 3, 14, 14))


def test_images_not_given_as_tensors_are_an_error(reference_model):
    pixel_values, grid_hws = random_images([(2, 2)])
    input_ids = torch.tensor([[5, 300, 6]])
    with pytest.raises(TypeError, match="must be tensors .* got Tensor and list"):
        reference_model(input_ids=input_ids, pixel_values=pixel_values, image_grid_hws=grid_hws.tolist())
    with pytest.raises(TypeError, match="must be tensors .* got list and Tensor"):
        reference_model(input_ids=input_ids, pixel_values=pixel_values.tolist(), image_grid_hws=grid_hws)


def test_num_return_sequences_repeats_each_prompts_images(reference_model):
    """generate() expands the batch for num_return_sequences; the packed images must follow their prompt."""
    grids_per_prompt = [[(4, 6), (2, 2)], [(6, 4)]]
    prompts = [prompt_ids(grids, text=(5 + i, 6, 7)) for i, grids in enumerate(grids_per_prompt)]
    images = [random_images(grids, seed=i) for i, grids in enumerate(grids_per_prompt)]
    width = max(map(len, prompts))
    inputs = dict(
        input_ids=torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts]),
        attention_mask=torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts]),
        pixel_values=torch.cat([pixel_values for pixel_values, _ in images]),
        image_grid_hws=torch.cat([grids for _, grids in images]),
    )
    greedy = reference_model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=0)
    # Sampling with top_k=1 is greedy, whatever the seed: every returned sequence equals its prompt's greedy one.
    sampled = reference_model.generate(
        **inputs, max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=3, pad_token_id=0
    )
    assert torch.equal(sampled, greedy.repeat_interleave(3, dim=0))


@torch.no_grad()
def test_no_images_give_empty_features_as_in_data_parallel_mode(reference_model, expected):
    pixel_values, grid_hws = torch.zeros(0, 3, 14, 14), torch.zeros(0, 2, dtype=torch.long)
    assert reference_model.vision_tower(pixel_values, grid_hws).last_hidden_state.shape == (0, 4, 48)
    features = reference_model.get_image_features(pixel_values, grid_hws)
    assert features.last_hidden_state.shape == (0, 4, 48) and features.pooler_output == ()
    text_only = reference_model(input_ids=expected["txt_input_ids"], pixel_values=pixel_values, image_grid_hws=grid_hws)
    assert_close(text_only.logits, expected["txt_logits"])


def test_pixel_values_of_the_wrong_shape_are_explained(reference_model):
    with pytest.raises(ValueError, match=r"must have shape \[num_patches, 3, 14, 14\].*\(24, 588\)"):
        reference_model.get_image_features(torch.zeros(24, 588), torch.tensor([[4, 6]]))


def test_num_return_sequences_with_inputs_embeds_repeats_images_too(reference_model):
    grids = [(4, 6)]
    pixel_values, grid_hws = random_images(grids)
    input_ids = torch.tensor([prompt_ids(grids)])
    settings = dict(max_new_tokens=4, do_sample=True, top_k=1, num_return_sequences=2, pad_token_id=0)
    via_ids = reference_model.generate(
        input_ids=input_ids, pixel_values=pixel_values, image_grid_hws=grid_hws, **settings
    )
    inputs_embeds = reference_model.get_input_embeddings()(input_ids)
    via_embeds = reference_model.generate(
        inputs_embeds=inputs_embeds, pixel_values=pixel_values, image_grid_hws=grid_hws, **settings
    )
    assert torch.equal(via_embeds, via_ids[:, input_ids.shape[1] :])  # with embeddings, generate returns new tokens


def test_expanded_generation_validates_the_grids(reference_model):
    pixel_values, _ = random_images([(4, 6)])
    input_ids = torch.tensor([prompt_ids([(4, 6)])])
    with pytest.raises(ValueError, match="24 patches but image_grid_hws describes 16"):
        reference_model.generate(
            input_ids=input_ids, pixel_values=pixel_values, image_grid_hws=torch.tensor([[4, 4]]),
            max_new_tokens=2, do_sample=True, num_return_sequences=2, pad_token_id=0,
        )  # fmt: skip


def test_experts_implementation_can_be_chosen_at_load_and_after(reference_checkpoint, expected):
    """transformers lets a model choose `grouped_mm` only when it finds the experts decorator in the model class's own
    source file; Kimi-VL's experts are DeepSeek-V3's, nested. Choosing at load and afterwards must both reach them."""
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, experts_implementation="grouped_mm")
    assert model.language_model.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        grouped = model(input_ids=expected["txt_input_ids"]).logits
        model.set_experts_implementation("eager")
        assert model.language_model.config._experts_implementation == "eager"
        eager = model(input_ids=expected["txt_input_ids"]).logits
        model.set_experts_implementation("grouped_mm")
        assert model.language_model.config._experts_implementation == "grouped_mm"
    torch.testing.assert_close(grouped, eager, rtol=1e-5, atol=1e-5)
