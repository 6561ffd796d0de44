"""Weight-only int8 / int4 quantization (modeling_kimi_vl/quantization_kimi_vl.py) on the tiny reference checkpoint.

Error bound for int8 (how the test derives it, nothing hard-coded):
- Round to nearest with one scale s per output row puts every weight within s/2 of its float value
  (`test_every_weight_is_within_half_a_quantization_step`).
- A matrix W stored as W + E perturbs its output x W^T by x E^T, i.e. by at most its relative weight error
  rho = ||E|| / ||W|| in relative terms (for inputs not aligned with E). Behind RMS norms and residual connections,
  to first order the relative logit error is at most the sum of the rho of all quantized matrices (worst case: every
  perturbation adds up in the same direction). For int8 rho is about 1 / (127 * sqrt(12)) times max|w| / rms(w) of
  a row: about 0.5% at the tiny model's widths, so the bound is a few tens of percent over its ~30 matrices while the
  measured error is a few percent; a wrong scale or layout gives errors of order 100%.
Greedy tokens must equal the float32 ones at every step whose float32 margin (top-1 minus top-2 logit) is larger than
twice the largest logit deviation measured at that step, up to the first step where it is not.
"""

import json

import pytest
import torch
from helpers import fixture_logits
from safetensors import safe_open
from transformers import DistributedConfig

from modeling_kimi_vl import KimiVLForConditionalGeneration, KimiVLWeightOnlyConfig, quantization_kimi_vl
from modeling_kimi_vl.quantization_kimi_vl import WeightOnlyExperts, WeightOnlyLinear
from modeling_kimi_vl.transformers_compat_modeling import QUANTIZATION_MIN_TRANSFORMERS_VERSION, quantization_supported

SUPPORTED = quantization_supported()
# The tests that load no quantized model; on older transformers every other test is skipped.
RUN_ON_ANY_TRANSFORMERS = {
    "test_unsupported_scheme_and_group_size_are_refused",
    "test_older_transformers_refuses_with_the_version_it_needs",
}


def skip_on_older_transformers():
    if not SUPPORTED:
        pytest.skip(f"needs transformers>={QUANTIZATION_MIN_TRANSFORMERS_VERSION}")


@pytest.fixture(autouse=True)
def skip_quantized_loading_on_older_transformers(request):
    if request.node.originalname not in RUN_ON_ANY_TRANSFORMERS:
        skip_on_older_transformers()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TINY_GROUP_SIZE = 16  # divides the tiny model's input sizes (32, 64, 128)
NEW_TOKENS = 12


def load_quantized(checkpoint, scheme="int8", experts_implementation="grouped_mm", **kwargs):
    skip_on_older_transformers()  # also for the module-scoped fixtures, set up before the autouse one
    config = KimiVLWeightOnlyConfig(scheme, group_size=TINY_GROUP_SIZE)
    # grouped_mm is the default; transformers 5.24 refuses to set it explicitly on this composite model (as it does
    # for the float model), so it is only ever passed for the others.
    if experts_implementation != "grouped_mm":
        kwargs["experts_implementation"] = experts_implementation
    model = KimiVLForConditionalGeneration.from_pretrained(
        checkpoint, attn_implementation="sdpa", quantization_config=config, **kwargs
    )
    assert model.config.text_config._experts_implementation == experts_implementation
    return model.eval()


@pytest.fixture(scope="module")
def int8_model(reference_checkpoint):
    return load_quantized(reference_checkpoint, "int8")


@pytest.fixture(scope="module")
def int4_model(reference_checkpoint):
    return load_quantized(reference_checkpoint, "int4")


def quantized_matrices(model):
    """(name, module, parameter name) of every quantized weight."""
    return [
        (name, module, param)
        for name, module in model.named_modules()
        for param in getattr(module, "quantized_parameters", ())
    ]


def relative_weight_errors(float_model, quantized_model) -> dict[str, float]:
    float_params = dict(float_model.named_parameters())
    errors = {}
    for name, module, param in quantized_matrices(quantized_model):
        original = float_params[f"{name}.{param}"]
        restored = module.scheme.dequantize(getattr(module, param), getattr(module, f"{param}_scale"), original.dtype)
        errors[f"{name}.{param}"] = ((restored - original).norm() / original.norm()).item()
    return errors


# ---------------------------------------------------------------------------------------------------------------------
# What is stored
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, storage_dtype", [("int8", torch.int8), ("int4", torch.uint8)])
def test_every_expert_and_language_linear_is_stored_quantized(reference_checkpoint, scheme, storage_dtype):
    model = load_quantized(reference_checkpoint, scheme)
    language_model = model.language_model
    experts = [module for module in language_model.modules() if "Experts" in type(module).__name__]
    assert experts and all(isinstance(module, WeightOnlyExperts) for module in experts)
    for module in experts:
        for param in ("gate_up_proj", "down_proj"):
            assert getattr(module, param).dtype == storage_dtype
            assert getattr(module, f"{param}_scale").dtype == torch.float32  # the model dtype
    # Every linear of the language model is quantized except kv_b_proj (kept for absorbed MLA), lm_head included.
    float_linears = [name for name, module in language_model.named_modules() if type(module) is torch.nn.Linear]
    assert float_linears and all(name.endswith("kv_b_proj") for name in float_linears)
    assert isinstance(language_model.lm_head, WeightOnlyLinear)
    assert language_model.lm_head.weight.dtype == storage_dtype
    # The vision tower and projector stay in the model dtype.
    assert all(param.dtype == torch.float32 for param in model.vision_tower.parameters())
    assert all(param.dtype == torch.float32 for param in model.multi_modal_projector.parameters())
    bits = 8 if scheme == "int8" else 4
    for module in experts:  # gate, up and down of every expert, at `bits` per weight
        stored = sum(getattr(module, param).numel() * getattr(module, param).element_size()
                     for param in ("gate_up_proj", "down_proj"))  # fmt: skip
        assert stored * 8 == module.num_experts * 3 * module.intermediate_dim * module.hidden_dim * bits


def test_every_weight_is_within_half_a_quantization_step(reference_model, int8_model):
    float_params = dict(reference_model.named_parameters())
    for name, module, param in quantized_matrices(int8_model):
        scale = getattr(module, f"{param}_scale").unsqueeze(-1)
        error = (module.scheme.dequantize(getattr(module, param), scale.squeeze(-1), torch.float32)
                 - float_params[f"{name}.{param}"]).abs()  # fmt: skip
        assert (error <= scale / 2 * (1 + 1e-5)).all(), name


# ---------------------------------------------------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------------------------------------------------


def test_int8_logits_within_the_first_order_bound(reference_model, int8_model, expected):
    errors = relative_weight_errors(reference_model, int8_model)
    assert max(errors.values()) < 0.02  # each int8 matrix: about 1 / (127 * sqrt(12)) x (max / rms of a row)
    bound = sum(errors.values())
    reference, quantized = fixture_logits(reference_model, expected), fixture_logits(int8_model, expected)
    relative_error = ((quantized - reference).norm() / reference.norm()).item()
    assert 0 < relative_error < bound, (relative_error, bound)


def test_int4_logits_within_the_first_order_bound(reference_model, int4_model, expected):
    bound = sum(relative_weight_errors(reference_model, int4_model).values())
    reference, quantized = fixture_logits(reference_model, expected), fixture_logits(int4_model, expected)
    assert ((quantized - reference).norm() / reference.norm()).item() < bound


def test_int8_greedy_tokens_equal_float_where_the_margin_allows(reference_model, int8_model, expected):
    prompts = [expected["mm_input_ids"], *expected["txt_input_ids"].split(1)]
    images = [{"pixel_values": expected["pixel_values"], "image_grid_hws": expected["image_grid_hws"]}, {}, {}]
    checked_steps = 0
    for prompt, image_inputs in zip(prompts, images):
        reference = reference_model.generate(
            input_ids=prompt, **image_inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        float_tokens = reference.sequences[0, prompt.shape[1] :]
        top2 = torch.stack(reference.scores)[:, 0].topk(2, dim=-1).values
        margins = top2[:, 0] - top2[:, 1]
        # The logit deviation along the float32 path (teacher-forced: one forward over prompt + generated tokens).
        with torch.no_grad():
            positions = slice(prompt.shape[1] - 1, -1)
            float_logits = reference_model(input_ids=reference.sequences, **image_inputs).logits[0, positions]
            int8_logits = int8_model(input_ids=reference.sequences, **image_inputs).logits[0, positions]
        deviations = (int8_logits - float_logits).abs().amax(-1)  # per step
        allowed = int((margins > 2 * deviations).long().cumprod(0).sum())  # steps before the first close call
        int8_tokens = int8_model.generate(input_ids=prompt, **image_inputs, max_new_tokens=NEW_TOKENS,
                                          do_sample=False)[0, prompt.shape[1]:]  # fmt: skip
        assert torch.equal(int8_tokens[:allowed], float_tokens[:allowed])
        checked_steps += allowed
    assert checked_steps > 0  # the fixture's prompts leave room for some: the test checked something


# ---------------------------------------------------------------------------------------------------------------------
# Experts implementations and the static path
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_experts_implementations_agree(reference_checkpoint, expected, scheme):
    logits = {
        implementation: fixture_logits(
            load_quantized(reference_checkpoint, scheme, experts_implementation=implementation), expected
        )  # fmt: skip
        for implementation in ("eager", "batched_mm", "grouped_mm")
    }
    torch.testing.assert_close(logits["batched_mm"], logits["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits["grouped_mm"], logits["eager"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts_implementation", ["batched_mm", "grouped_mm"])
def test_quantized_experts_do_not_read_device_tensors_back_to_the_host(
    reference_checkpoint, monkeypatch, experts_implementation
):
    """A host read inside the experts would be a device sync on GPU and would break CUDA-graph capture."""
    model = load_quantized(reference_checkpoint, experts_implementation=experts_implementation)
    experts = model.language_model.model.layers[-1].mlp.experts
    hidden_states = torch.randn(16, experts.hidden_dim)
    top_k_weights = torch.rand(16, 3)
    for tokens in (1, 16):  # fewer pairs than experts (gathered) and more (grouped over all experts)
        top_k_index = torch.randint(0, experts.num_experts, (tokens, 3))
        inside = []
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero"):
            original = getattr(torch.Tensor, name)

            def guarded(self, *args, _original=original, _name=name, _inside=inside, **kwargs):
                if _inside:
                    raise AssertionError(f"Tensor.{_name}() called inside the quantized experts")
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, guarded)
        inside.append(True)
        try:
            with torch.no_grad():
                experts(hidden_states[:tokens], top_k_index, top_k_weights[:tokens])
        finally:
            inside.clear()
            monkeypatch.undo()


class FusedKernelLaunched(Exception):
    """Raised where the fused kernel would be launched (it cannot run on the CPU of this process)."""


@pytest.mark.parametrize("experts_implementation", ["batched_mm", "grouped_mm"])
def test_inputs_that_need_a_gradient_bypass_the_fused_kernel(reference_checkpoint, monkeypatch, experts_implementation):
    """The fused kernel has no backward. Where it runs, decode-sized inputs that need a gradient take the torch path,
    so a loss reaches what feeds the quantized layers; the same inputs without a gradient go to the kernel. (int4: its
    torch path is differentiable on CPU too; int8 linears run `_weight_int8pack_mm` there, which has no backward.)"""
    model = load_quantized(reference_checkpoint, "int4", experts_implementation=experts_implementation)
    layer = model.language_model.model.layers[-1]
    assert isinstance(layer.mlp.experts, WeightOnlyExperts) and isinstance(layer.mlp.shared_experts.up_proj,
                                                                           WeightOnlyLinear)  # fmt: skip

    def launch(*args):
        raise FusedKernelLaunched

    monkeypatch.setattr(quantization_kimi_vl, "fused_kernel_runs_on", lambda device: True)
    monkeypatch.setattr(quantization_kimi_vl, "weight_only_rows_matmul", launch)
    hidden_states = torch.randn(2, 1, model.config.text_config.hidden_size, requires_grad=True)
    layer.mlp(hidden_states).square().sum().backward()
    assert hidden_states.grad is not None and hidden_states.grad.abs().sum() > 0
    with torch.no_grad():
        with pytest.raises(FusedKernelLaunched):
            layer.mlp(hidden_states)  # the routed experts run first
        with pytest.raises(FusedKernelLaunched):
            layer.mlp.shared_experts.up_proj(hidden_states)


@pytest.mark.parametrize("experts_implementation", ["batched_mm", "grouped_mm"])
def test_static_generation_equals_plain_generate_when_quantized(reference_checkpoint, expected, experts_implementation):
    model = load_quantized(reference_checkpoint, experts_implementation=experts_implementation)
    requests = [
        {"input_ids": expected["mm_input_ids"], "pixel_values": expected["pixel_values"],
         "image_grid_hws": expected["image_grid_hws"]},
        {"input_ids": expected["txt_input_ids"]},
    ]  # fmt: skip
    for request in requests:
        plain = model.generate(**request, max_new_tokens=8, do_sample=False)
        static = model.generate(**request, max_new_tokens=8, do_sample=False, cache_implementation="static")
        assert torch.equal(static, plain)


@requires_cuda
@pytest.mark.parametrize(
    ("dtype", "experts_implementation"), [(torch.float32, "batched_mm"), (torch.bfloat16, "grouped_mm")]
)
def test_cuda_graphs_replay_the_quantized_steps(reference_checkpoint, expected, dtype, experts_implementation):
    """Quantized on load on the GPU; the static path's CUDA graphs give the eager steps' tokens (and plain generate's
    in float32)."""
    model = load_quantized(reference_checkpoint, experts_implementation=experts_implementation, dtype=dtype,
                           device_map="cuda")  # fmt: skip
    assert model.language_model.lm_head.weight.device.type == "cuda"
    request = {"input_ids": expected["txt_input_ids"].cuda()}
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static")
    graphs = model.generate(**request, **settings, cuda_graphs=True)
    assert torch.equal(model.generate(**request, **settings, cuda_graphs=True), graphs)  # replayed
    assert torch.equal(model.generate(**request, **settings, cuda_graphs=False), graphs)
    if dtype == torch.float32:
        assert torch.equal(model.generate(**request, max_new_tokens=12, do_sample=False, pad_token_id=0), graphs)


# ---------------------------------------------------------------------------------------------------------------------
# Save and reload
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, storage_dtype", [("int8", "I8"), ("int4", "U8")])
def test_save_and_reload_gives_identical_logits(reference_checkpoint, expected, tmp_path, scheme, storage_dtype):
    model = load_quantized(reference_checkpoint, scheme)
    model.save_pretrained(tmp_path)
    saved_config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved_config["quant_method"] == "kimi_vl_weight_only" and saved_config["scheme"] == scheme
    with safe_open(tmp_path / "model.safetensors", "pt") as checkpoint:
        dtypes = {name: checkpoint.get_slice(name).get_dtype() for name in checkpoint.keys()}
    # The original per-expert key layout, stored quantized, with the scales beside the weights.
    expert_weight = "language_model.model.layers.3.mlp.experts.5.gate_proj.weight"
    assert dtypes[expert_weight] == storage_dtype
    assert dtypes["language_model.lm_head.weight"] == storage_dtype
    assert "language_model.lm_head.weight_scale" in dtypes
    assert "language_model.model.layers.3.mlp.experts.gate_up_proj_scale" in dtypes

    reloaded = KimiVLForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert isinstance(reloaded.language_model.model.layers[3].mlp.experts, WeightOnlyExperts)
    for (name, param), (reloaded_name, reloaded_param) in zip(model.state_dict().items(),
                                                              reloaded.state_dict().items()):  # fmt: skip
        assert name == reloaded_name and param.dtype == reloaded_param.dtype and torch.equal(param, reloaded_param)
    assert torch.equal(fixture_logits(reloaded, expected), fixture_logits(model, expected))


# ---------------------------------------------------------------------------------------------------------------------
# Bad combinations
# ---------------------------------------------------------------------------------------------------------------------


def test_unsupported_scheme_and_group_size_are_refused():
    with pytest.raises(ValueError, match=r"Unsupported weight-only quantization scheme 'int3'.*'int8', 'int4'"):
        KimiVLWeightOnlyConfig("int3")
    with pytest.raises(ValueError, match="group_size must be a positive even integer, got 7"):
        KimiVLWeightOnlyConfig("int4", group_size=7)
    with pytest.raises(ValueError, match="modules_to_not_convert must be a list of module names, got 'lm_head'"):
        KimiVLWeightOnlyConfig("int8", modules_to_not_convert="lm_head")  # not its characters


def test_a_misspelt_option_is_refused_not_dropped(reference_checkpoint):
    # Dropped, it would quantize with the default group size instead of the one asked for.
    quantization_config = {"quant_method": "kimi_vl_weight_only", "scheme": "int4", "groupsize": 32}
    with pytest.raises(TypeError, match="unexpected keyword argument 'groupsize'"):
        KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, quantization_config=quantization_config)
    with pytest.raises(ValueError, match="quant_method='kimi_vl_weight_only', got 'int8'"):
        KimiVLWeightOnlyConfig(quant_method="int8")


def test_int4_group_size_must_divide_every_layer(reference_checkpoint):
    config = KimiVLWeightOnlyConfig("int4", group_size=48)  # the tiny model has 32/64/128 input features
    with pytest.raises(ValueError, match="group_size=48 does not divide a layer's"):
        KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, quantization_config=config)


def test_excluding_every_quantizable_module_is_refused(reference_checkpoint):
    config = KimiVLWeightOnlyConfig(modules_to_not_convert=["language_model"])
    with pytest.raises(ValueError, match="no language-model linear layer or experts module left to quantize"):
        KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, quantization_config=config)


def test_tensor_parallel_loading_is_refused(reference_checkpoint):
    with pytest.raises(ValueError, match="does not support tensor parallelism"):
        KimiVLForConditionalGeneration.from_pretrained(
            reference_checkpoint, quantization_config=KimiVLWeightOnlyConfig(),
            distributed_config=DistributedConfig(tp_size=1),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------------------------------------


def test_demo_loads_the_model_with_int8_weights_when_asked(tmp_path):
    from app import parse_args
    from kimi_vl_demo.checkpoints import resolve_checkpoint
    from kimi_vl_demo.engine import ChatEngine
    from kimi_vl_demo.inputs import InputLimits

    args = parse_args(["--model", "tiny", "--quantize", "int8", "--cache-dir", str(tmp_path)])
    checkpoint = resolve_checkpoint(args.model, args.cache_dir)
    limits = InputLimits(args.max_images, args.max_image_mb, args.max_conversation_image_mb)
    engine = ChatEngine(checkpoint, "cpu", torch.float32, limits, quantize=args.quantize)
    assert isinstance(engine.model.language_model.model.layers[-1].mlp.experts, WeightOnlyExperts)
    assert engine.model.language_model.lm_head.weight.dtype == torch.int8
    inputs = engine.processor(text="Hello there", return_tensors="pt")
    output = engine.model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=engine.pad_token_id)
    assert output.shape[1] == inputs["input_ids"].shape[1] + 4
    with pytest.raises(SystemExit):
        parse_args(["--quantize", "int2"])


@pytest.mark.skipif(SUPPORTED, reason=f"transformers>={QUANTIZATION_MIN_TRANSFORMERS_VERSION} supports quantization")
def test_older_transformers_refuses_with_the_version_it_needs(reference_checkpoint):
    with pytest.raises(ImportError, match=rf"needs transformers>={QUANTIZATION_MIN_TRANSFORMERS_VERSION} \(found"):
        KimiVLForConditionalGeneration.from_pretrained(
            reference_checkpoint, quantization_config=KimiVLWeightOnlyConfig()
        )
