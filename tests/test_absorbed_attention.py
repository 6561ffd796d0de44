"""The absorbed MLA attention (modeling_kimi_vl.KimiVLMLAAttention): equal to transformers' expanded form, taken only
where it should be, and the static path's decode that reads only the filled slots (read buckets)."""

import contextlib

import pytest
import torch
from test_generation_fast import (  # noqa: F401  (the `model` fixture is used by name)
    PAD_ID,
    batched_multi_image_request,
    fixture_request,
    forbid_host_reads,
    model,
)
from torch import nn
from transformers import DynamicCache

from modeling_kimi_vl import KimiVLConfig, KimiVLForConditionalGeneration
from modeling_kimi_vl.modeling_kimi_vl import ABSORBED_MAX_QUERY_LENGTH, KimiVLMLAAttention
from modeling_kimi_vl.static_cache_kimi_vl import StaticLatentLayer
from modeling_kimi_vl.static_steps_kimi_vl import decode_read_bucket
from modeling_kimi_vl.transformers_compat_modeling import CACHE_ARGUMENT

RTOL = 1e-5


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return float((actual - reference).abs().max() / reference.abs().max())


def use_absorbed(monkeypatch, enabled: bool) -> None:
    """The documented switch, on the class (monkeypatch restores it): 0 keeps every query on the expanded form."""
    monkeypatch.setattr(KimiVLMLAAttention, "absorb_max_query_length", ABSORBED_MAX_QUERY_LENGTH if enabled else 0)


@contextlib.contextmanager
def counting_expansions(model):
    """Yields a counter of kv_b_proj calls (only the expanded form calls it; the absorbed one reads its weight)."""
    calls = [0]
    hooks = [
        layer.self_attn.kv_b_proj.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
        for layer in model.language_model.model.layers
    ]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def cached_forward(model, input_ids, attention_mask, split: int):
    """Logits of a prompt run in two pieces over one DynamicCache: tokens [0, split), then the rest (a multi-token
    query over a cache), then one more token (a decode step)."""
    cache = DynamicCache(config=model.config.text_config)
    with torch.no_grad():
        first = model(input_ids=input_ids[:, :split], attention_mask=attention_mask[:, :split],
                      **{CACHE_ARGUMENT: cache}, use_cache=True).logits  # fmt: skip
        rest = model(input_ids=input_ids[:, split:-1], attention_mask=attention_mask[:, :-1],
                     **{CACHE_ARGUMENT: cache}, use_cache=True).logits  # fmt: skip
        last = model(input_ids=input_ids[:, -1:], attention_mask=attention_mask,
                     **{CACHE_ARGUMENT: cache}, use_cache=True).logits  # fmt: skip
    return first, rest, last


def left_padded_text_batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 299, (3, 40), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :7] = 0
    attention_mask[2, :2] = 0
    return input_ids.masked_fill(attention_mask == 0, PAD_ID), attention_mask


def assert_forms_agree(model, monkeypatch, rtol=RTOL, split=24):
    """Absorbed vs expanded over a left-padded batch: prompt piece, multi-token query over the cache, decode step."""
    input_ids, attention_mask = left_padded_text_batch()
    with counting_expansions(model) as expansions:
        use_absorbed(monkeypatch, True)
        absorbed = cached_forward(model, input_ids, attention_mask, split)
        absorbed_expansions = expansions[0]
        use_absorbed(monkeypatch, False)
        expanded = cached_forward(model, input_ids, attention_mask, split)
    num_layers = model.config.text_config.num_hidden_layers
    assert absorbed_expansions == 0, "every piece is short enough for the absorbed form"
    assert expansions[0] == 3 * num_layers
    valid = attention_mask.bool()
    # Padding positions attend to nothing; their (unused) outputs differ between forms and are left out.
    pieces = (valid[:, :split], valid[:, split:-1], valid[:, -1:])
    for absorbed_logits, expanded_logits, keep in zip(absorbed, expanded, pieces):
        assert relative_error(absorbed_logits[keep], expanded_logits[keep]) < rtol


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_absorbed_equals_expanded_for_decode_and_short_queries(reference_checkpoint, attn_implementation, monkeypatch):
    model = KimiVLForConditionalGeneration.from_pretrained(
        reference_checkpoint, attn_implementation=attn_implementation
    ).eval()  # fmt: skip
    assert all(isinstance(layer.self_attn, KimiVLMLAAttention) for layer in model.language_model.model.layers)
    assert_forms_agree(model, monkeypatch)


def random_text_model(reference_checkpoint, **text_overrides):
    config = KimiVLConfig.from_pretrained(reference_checkpoint)
    for name, value in text_overrides.items():
        setattr(config.text_config, name, value)
    torch.manual_seed(0)
    return KimiVLForConditionalGeneration(config).eval()


def test_absorbed_keeps_the_yarn_softmax_scale_and_the_query_lora(reference_checkpoint, monkeypatch):
    """Yarn rope scaling multiplies the softmax scale by mscale^2, and q_lora_rank routes the query through
    q_a_proj/q_b_proj: both must give what the expanded form gives."""
    rope_parameters = {"rope_type": "yarn", "rope_theta": 800000.0, "factor": 8.0,
                       "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                       "mscale_all_dim": 1.0}  # fmt: skip
    model = random_text_model(reference_checkpoint, rope_parameters=rope_parameters, q_lora_rank=12)
    attention = model.language_model.model.layers[0].self_attn
    assert attention.scaling != pytest.approx(attention.qk_head_dim**-0.5), "yarn must change the scale here"
    assert attention.q_a_proj is not None
    assert_forms_agree(model, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_absorbed_in_half_precision_is_as_accurate_as_expanded(reference_checkpoint, dtype, monkeypatch):
    """Against float32 logits, the absorbed form's rounding error is no worse than the expanded form's (each measured
    ~1e-2 in bf16, ~2e-3 in fp16 here)."""
    reference = cached_forward(KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint).eval(),
                               *left_padded_text_batch(), split=24)  # fmt: skip
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, dtype=dtype).eval()
    errors = {}
    for form in ("absorbed", "expanded"):
        use_absorbed(monkeypatch, form == "absorbed")
        logits = cached_forward(model, *left_padded_text_batch(), split=24)
        valid = left_padded_text_batch()[1].bool()
        pieces = (valid[:, :24], valid[:, 24:-1], valid[:, -1:])
        errors[form] = [relative_error(half[keep].float(), full[keep]) for half, full, keep in
                        zip(logits, reference, pieces)]  # fmt: skip
    for absorbed_error, expanded_error in zip(errors["absorbed"], errors["expanded"]):
        assert absorbed_error < 1.5 * expanded_error


def test_greedy_tokens_are_those_of_the_expanded_form_and_the_fixture(model, expected, monkeypatch):
    request = fixture_request(expected)
    new_tokens = expected["mm_generated"].shape[1] - request["input_ids"].shape[1]
    batched = batched_multi_image_request()
    outputs = {}
    for form in ("absorbed", "expanded"):
        use_absorbed(monkeypatch, form == "absorbed")
        for path in ("plain", "static"):
            settings = dict(do_sample=False, pad_token_id=PAD_ID)
            if path == "static":
                settings["cache_implementation"] = "static"
            outputs[form, path] = (
                model.generate(**request, max_new_tokens=new_tokens, **settings),
                model.generate(**batched, max_new_tokens=10, **settings),
            )
    for fixture_tokens, batched_tokens in outputs.values():
        assert torch.equal(fixture_tokens, expected["mm_generated"])
        assert torch.equal(batched_tokens, outputs["expanded", "plain"][1])


def test_expanded_form_is_kept_for_gradients_long_queries_and_wrapped_projections(reference_checkpoint):
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint).eval()
    num_layers = model.config.text_config.num_hidden_layers
    short, long = torch.arange(3, 3 + 8)[None], torch.arange(3, 3 + ABSORBED_MAX_QUERY_LENGTH + 1)[None]

    def expansions_of(input_ids, grad: bool) -> int:
        with counting_expansions(model) as expansions, torch.set_grad_enabled(grad):
            model(input_ids=input_ids)
        return expansions[0]

    assert expansions_of(short, grad=False) == 0
    assert expansions_of(long, grad=False) == num_layers
    assert expansions_of(short, grad=True) == num_layers  # training keeps transformers' path

    class WrappedLinear(nn.Linear):  # what a LoRA adapter or a quantized layer looks like: more than `.weight`
        pass

    attention = model.language_model.model.layers[0].self_attn
    wrapped = WrappedLinear(attention.kv_b_proj.in_features, attention.kv_b_proj.out_features, bias=False)
    wrapped.load_state_dict(attention.kv_b_proj.state_dict())
    attention.kv_b_proj = wrapped
    assert expansions_of(short, grad=False) == 1


def test_absorbed_form_reads_the_current_weight(reference_checkpoint, monkeypatch):
    """Nothing derived from kv_b_proj is kept: an in-place edit changes the absorbed output like the expanded one."""
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint).eval()
    input_ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        before = model(input_ids=input_ids).logits
        for layer in model.language_model.model.layers:
            layer.self_attn.kv_b_proj.weight.mul_(1.5)
        absorbed = model(input_ids=input_ids).logits
        use_absorbed(monkeypatch, False)
        expanded = model(input_ids=input_ids).logits
    assert relative_error(absorbed, before) > 1e-3
    assert relative_error(absorbed, expanded) < RTOL


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_training_with_gradient_checkpointing_gets_the_gradients_of_the_expanded_form(reference_checkpoint):
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids = torch.arange(3, 15)[None]
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    kv_b_proj = model.language_model.model.layers[0].self_attn.kv_b_proj
    assert kv_b_proj.weight.grad is not None and kv_b_proj.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------------------
# Static decode reads the filled slots rounded up to a read bucket
# ---------------------------------------------------------------------------------------------------------------------


def test_read_buckets_grow_geometrically_from_the_minimum_and_stop_at_the_capacity():
    filled = (1, 256, 257, 384, 385, 512, 513, 768, 769, 3000, 3072, 3073, 4096)
    assert [decode_read_bucket(n, 4096) for n in filled] == [
        256, 256, 384, 384, 512, 512, 768, 768, 1024, 3072, 3072, 4096, 4096,
    ]  # fmt: skip
    assert all(decode_read_bucket(n, 1 << 20) <= 1.5 * n for n in range(257, 70000))
    assert decode_read_bucket(90, 100) == 100 and decode_read_bucket(300, 1000) == 384


def test_decode_read_bucket_grows_across_boundaries_with_the_same_tokens(model, expected, monkeypatch):
    """From a 57-token prompt, 80 new tokens fill slots 58..137: with read buckets from 32, the decode steps read 64,
    96, 128, then 192 slots (four boundaries crossed, the capacity being 256), each bucket with its own step, and the
    tokens equal plain generate()."""
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.MIN_DECODE_READ_SLOTS", 32)
    request = fixture_request(expected)
    prompt_length, new_tokens = request["input_ids"].shape[1], 80
    reads = []
    update = StaticLatentLayer.update

    def recording_update(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        if self is self.cache.layers[0]:
            reads.append(keys.shape[2])
        return keys, values

    monkeypatch.setattr(StaticLatentLayer, "update", recording_update)
    static = model.generate(**request, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    plain = model.generate(**request, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(static, plain)
    (workspace,) = model._static_generation_state().workspaces.values()
    assert workspace.num_slots == 256
    # Prefill reads its prompt bucket (64); decode step i (after new token i + 1) has prompt_length + i + 1 filled.
    decode_reads = reads[1:]
    assert len(decode_reads) == new_tokens - 1
    filled = [prompt_length + 1 + step for step in range(new_tokens - 1)]
    assert decode_reads == [next(bucket for bucket in (64, 96, 128, 192) if n <= bucket) for n in filled]
    assert list(workspace.decode_steps) == [64, 96, 128, 192]


def test_warm_up_runs_the_decode_step_of_every_read_bucket(model, monkeypatch):
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.MIN_DECODE_READ_SLOTS", 32)
    model.warm_up_static_generation(batch_size=2, prompt_length=20, max_cache_len=200)
    (workspace,) = model._static_generation_state().workspaces.values()
    assert list(workspace.decode_steps) == [32, 48, 64, 96, 128, 192, 200]
    # The warm-up's writes are never seen: a request afterwards gives what plain generate() gives.
    input_ids = torch.arange(40, 80).view(2, 20)
    static = model.generate(input_ids, max_new_tokens=30, do_sample=False, cache_implementation="static",
                            max_cache_len=200)  # fmt: skip
    assert torch.equal(static, model.generate(input_ids, max_new_tokens=30, do_sample=False))


def test_decode_steps_are_bounded_least_recently_used_first(model, expected, monkeypatch):
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.MIN_DECODE_READ_SLOTS", 32)
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.MAX_DECODE_STEPS", 2)
    request = fixture_request(expected)
    output = model.generate(**request, max_new_tokens=80, do_sample=False, cache_implementation="static")
    (workspace,) = model._static_generation_state().workspaces.values()
    assert list(workspace.decode_steps) == [128, 192]
    assert torch.equal(output, model.generate(**request, max_new_tokens=80, do_sample=False))


def test_decode_steps_of_every_read_bucket_never_read_the_host(model, expected, monkeypatch):
    """The host-read guard of test_generation_fast.py over every decode step (four read buckets) and the prefill,
    with the absorbed attention inside them."""
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.MIN_DECODE_READ_SLOTS", 32)
    model.generate(**fixture_request(expected), max_new_tokens=80, do_sample=False, cache_implementation="static")
    (workspace,) = model._static_generation_state().workspaces.values()
    steps = [*workspace.prefill_steps.values(), *workspace.decode_steps.values()]
    assert len(workspace.decode_steps) == 4
    with counting_expansions(model) as expansions, monkeypatch.context() as patched, torch.no_grad():
        forbid_host_reads(patched)
        for step in steps:  # as generate() runs them: without gradients
            step.forward()
    assert expansions[0] == 0, "prefill (64 tokens) and decode steps all take the absorbed form"
