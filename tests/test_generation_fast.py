"""`generate(cache_implementation="static")`: the static latent cache with prefill/decode steps (CUDA graphs on GPU).

On CPU the very same steps run eagerly, so these tests pin the bucketed layout, masks, positions and the decoding loop
against plain `generate()`. The `test_cuda_*` tests run only where CUDA is available (benchmarks/gpu_check.sh).
"""

import contextlib
import copy
import threading

import pytest
import torch
from helpers import fixture_request, prompt_ids, random_images
from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from image_processing import KimiVLTokenizer
from modeling_kimi_vl import KimiVLForConditionalGeneration
from modeling_kimi_vl.static_cache_kimi_vl import StaticLatentLayer

PAD_ID = 0

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def batched_multi_image_request(device="cpu"):
    """Three left-padded prompts of different lengths: two images, none, one image (not a power-of-two batch)."""
    grids_per_prompt = [[(4, 6), (2, 2)], [], [(6, 4)]]
    prompts = [
        prompt_ids(grids, text=range(20 + i, 25 + 3 * i), after_each_image=(11, 12))
        for i, grids in enumerate(grids_per_prompt)
    ]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[PAD_ID] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    images = [random_images(grids, seed=i) for i, grids in enumerate(grids_per_prompt) if grids]
    request = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": torch.cat([pixel_values for pixel_values, _ in images]),
        "image_grid_hws": torch.cat([grids for _, grids in images]),
    }
    return {name: tensor.to(device) for name, tensor in request.items()}


@pytest.fixture
def model(reference_model):
    """The shared reference model with no static-generation state left over from another test."""
    reference_model.clear_static_generation()
    yield reference_model
    reference_model.clear_static_generation()


# ---------------------------------------------------------------------------------------------------------------------
# Greedy outputs equal plain generate()
# ---------------------------------------------------------------------------------------------------------------------


def test_greedy_on_the_reference_fixture_equals_plain_generate_and_the_original(model, expected):
    request = fixture_request(expected)
    max_new_tokens = expected["mm_generated"].shape[1] - request["input_ids"].shape[1]
    plain = model.generate(**request, max_new_tokens=max_new_tokens, do_sample=False)
    static = model.generate(**request, max_new_tokens=max_new_tokens, do_sample=False, cache_implementation="static")
    assert torch.equal(static, plain)
    assert torch.equal(static, expected["mm_generated"])


def test_batched_left_padded_multi_image_greedy_equals_plain_generate(model):
    request = batched_multi_image_request()
    plain = model.generate(**request, max_new_tokens=10, do_sample=False, pad_token_id=PAD_ID)
    static = model.generate(
        **request, max_new_tokens=10, do_sample=False, pad_token_id=PAD_ID, cache_implementation="static"
    )
    assert torch.equal(static, plain)
    # Three rows run in a workspace of batch bucket 4: the dummy row must not leak into the real ones.
    assert list(model._static_generation_state().workspaces) == [(4, 256)]


def test_several_eos_ids_stop_rows_independently_like_plain_generate(model):
    request = batched_multi_image_request()
    width = request["input_ids"].shape[1]
    free_run = model.generate(**request, max_new_tokens=10, do_sample=False, pad_token_id=PAD_ID)
    # Two stop ids that occur early in two different rows, so one row stops while the others go on.
    eos_ids = [int(free_run[0, width + 2]), int(free_run[2, width + 4])]
    assert eos_ids[0] != eos_ids[1]
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD_ID, eos_token_id=eos_ids)
    plain = model.generate(**request, **settings)
    static = model.generate(**request, **settings, cache_implementation="static")
    assert torch.equal(static, plain)
    assert (static[:, width:] == PAD_ID).any(), "one row must have finished early and been padded"


def test_eager_attention_gives_the_same_tokens(reference_checkpoint, expected):
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, attn_implementation="eager").eval()
    request = batched_multi_image_request()
    plain = model.generate(**request, max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID)
    static = model.generate(
        **request, max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID, cache_implementation="static"
    )
    assert torch.equal(static, plain)


def test_only_the_mla_latent_is_cached_sized_from_the_request(model, expected):
    request = fixture_request(expected)  # 57 prompt tokens + 40 new -> 97 slots, rounded up to 256
    model.generate(**request, max_new_tokens=40, do_sample=False, cache_implementation="static")
    (workspace,) = model._static_generation_state().workspaces.values()
    text_config = model.config.text_config
    assert len(workspace.cache.layers) == text_config.num_hidden_layers
    for layer in workspace.cache.layers:
        assert layer.keys.shape == (1, 1, 256, text_config.kv_lora_rank)
        assert layer.values.shape == (1, 1, 256, text_config.qk_rope_head_dim)


def step_identities(workspace) -> dict:
    """The step objects of a workspace and what they captured (graph and output; None when eager)."""
    steps = {
        **{f"decode {n}": step for n, step in workspace.decode_steps.items()},
        **{f"prefill {n}": step for n, step in workspace.prefill_steps.items()},
    }
    return {name: (step, step.graph, step.output) for name, step in steps.items()}


def same_objects(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(
        all(a is b for a, b in zip(first[name], second[name])) for name in first
    )


def test_workspace_is_reused_across_calls_and_after_warm_up(model, expected):
    request = fixture_request(expected)
    model.warm_up_static_generation(batch_size=1, prompt_length=request["input_ids"].shape[1])
    workspaces = dict(model._static_generation_state().workspaces)
    assert list(workspaces) == [(1, 256)]
    steps = step_identities(workspaces[1, 256])
    assert list(steps) == ["decode 256", "prefill 64"]
    first = model.generate(**request, max_new_tokens=12, do_sample=False, cache_implementation="static")
    second = model.generate(**request, max_new_tokens=12, do_sample=False, cache_implementation="static")
    assert torch.equal(first, second)
    assert model._static_generation_state().workspaces == workspaces
    assert same_objects(step_identities(workspaces[1, 256]), steps), "the warmed-up steps must be reused, not rebuilt"


def fixture_tokens_and_first_layer_masks(model, expected) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """3 static greedy tokens on the fixture's prompt in a 256-slot cache, and the shape of every attention mask the
    first layer was given."""
    masks = []
    attention = model.language_model.model.layers[0].self_attn
    hook = attention.register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(tuple(kwargs["attention_mask"].shape)), with_kwargs=True
    )
    try:
        output = model.generate(**fixture_request(expected), max_new_tokens=3, do_sample=False,
                                cache_implementation="static", max_cache_len=256)  # fmt: skip
    finally:
        hook.remove()
    return output, masks


def test_prefill_reads_only_the_prompt_bucket_and_decode_the_whole_cache(model, expected, monkeypatch):
    # The fixture's prompt is 57 tokens: prompt bucket 64.
    read = []
    update = StaticLatentLayer.update

    def recording_update(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        read.append((keys.shape[2], values.shape[2]))
        return keys, values

    monkeypatch.setattr(StaticLatentLayer, "update", recording_update)
    output, masks = fixture_tokens_and_first_layer_masks(model, expected)
    assert torch.equal(output, expected["mm_generated"][:, : 57 + 3])
    assert masks == [(1, 1, 64, 64), (1, 1, 1, 256), (1, 1, 1, 256)]
    num_layers = model.config.text_config.num_hidden_layers
    assert read == [(64, 64)] * num_layers + [(256, 256)] * 2 * num_layers


def test_long_prompts_are_prefilled_in_chunks_that_read_the_slots_filled_so_far(model, expected, monkeypatch):
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.PREFILL_CHUNK_TOKENS", 16)
    output, masks = fixture_tokens_and_first_layer_masks(model, expected)  # 57 prompt tokens: chunks 16, 16, 16, 9
    assert torch.equal(output, expected["mm_generated"][:, : 57 + 3])
    assert masks == [(1, 1, 16, 16), (1, 1, 16, 32), (1, 1, 16, 48), (1, 1, 9, 57), (1, 1, 1, 256), (1, 1, 1, 256)]
    (workspace,) = model._static_generation_state().workspaces.values()
    assert workspace.prefill_embeds.shape[1] == 16 and not workspace.prefill_steps  # chunk-sized, no prefill graph


def test_chunked_prefill_of_a_left_padded_batch_equals_plain_generate(model, monkeypatch):
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.PREFILL_CHUNK_TOKENS", 4)
    request = batched_multi_image_request()
    # 17 positions: chunks of 4 (the last one 1), the shortest row's padding spanning the first two.
    assert request["input_ids"].shape[1] == 17 and not request["attention_mask"][1, :8].any()
    plain = model.generate(**request, max_new_tokens=10, do_sample=False, pad_token_id=PAD_ID)
    static = model.generate(
        **request, max_new_tokens=10, do_sample=False, pad_token_id=PAD_ID, cache_implementation="static"
    )
    assert torch.equal(static, plain)


def test_prompt_buckets_share_the_prefill_buffers_and_are_bounded_least_recently_used_first(model, monkeypatch):
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.MAX_PREFILL_STEPS", 2)
    settings = dict(max_new_tokens=2, do_sample=False, cache_implementation="static", max_cache_len=256)
    prompts = {length: torch.arange(20, 20 + length)[None] for length in (20, 40, 100)}  # buckets 32, 64, 128

    def run(length):
        output = model.generate(prompts[length], **settings)
        (workspace,) = model._static_generation_state().workspaces.values()
        return output, workspace

    _, workspace = run(100)
    embeds, positions = workspace.prefill_embeds, workspace.prefill_positions
    # Sized by the longest prompt bucket seen, not the 256-slot capacity.
    assert embeds.shape == (1, 128, model.config.text_config.hidden_size) and positions.shape == (1, 128)
    assert list(run(20)[1].prefill_steps) == [128, 32]
    assert list(run(40)[1].prefill_steps) == [32, 64]  # a third bucket evicts the least recent
    assert list(run(20)[1].prefill_steps) == [64, 32]  # reused, now the most recent
    evicted_again, workspace = run(100)
    assert list(workspace.prefill_steps) == [32, 128]
    assert workspace.prefill_embeds is embeds and workspace.prefill_positions is positions
    plain = model.generate(prompts[100], max_new_tokens=2, do_sample=False)
    assert torch.equal(evicted_again, plain)


def test_prefill_buffers_grow_with_the_longest_prompt_and_drop_the_steps_made_over_the_old_ones(model):
    settings = dict(max_new_tokens=2, do_sample=False, cache_implementation="static", max_cache_len=512)
    hidden_size = model.config.text_config.hidden_size
    model.generate(torch.arange(20, 40)[None], **settings)  # bucket 32
    (workspace,) = model._static_generation_state().workspaces.values()
    assert workspace.prefill_embeds.shape == (1, 32, hidden_size) and list(workspace.prefill_steps) == [32]
    prompt = torch.arange(20, 70)[None]  # bucket 64: at least double the held 32
    grown = model.generate(prompt, **settings)
    assert workspace.prefill_embeds.shape == (1, 64, hidden_size) and workspace.prefill_positions.shape == (1, 64)
    assert list(workspace.prefill_steps) == [64]  # the 32-bucket step read the old buffers: dropped
    assert torch.equal(grown, model.generate(prompt, max_new_tokens=2, do_sample=False))
    long_prompt = (torch.arange(400) % 250 + 20)[None]  # bucket 512 = the capacity: 400 prompt + 2 new tokens fit
    model.generate(long_prompt, **settings)
    assert workspace.prefill_embeds.shape == (1, 512, hidden_size)


def test_replacing_any_weight_tensor_drops_the_workspaces_writing_in_place_keeps_them(model, expected):
    request = fixture_request(expected)
    settings = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")

    def current_workspace():
        model.generate(**request, **settings)
        (workspace,) = model._static_generation_state().workspaces.values()
        return workspace

    first = current_workspace()
    o_proj = model.language_model.model.layers[1].self_attn.o_proj
    with torch.no_grad():
        o_proj.weight.mul_(1)  # new values, same tensor: the graphs read them
    assert current_workspace() is first
    # The same values in a new tensor (as load_state_dict(assign=True) or quantizing one layer does): graphs captured
    # against the old tensor would read freed memory.
    o_proj.load_state_dict({"weight": o_proj.weight.detach().clone()}, assign=True)
    second = current_workspace()
    assert second is not first
    # A buffer counts too.
    rotary = model.language_model.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq.clone()
    assert current_workspace() is not second
    prompt_length = request["input_ids"].shape[1]
    assert torch.equal(model.generate(**request, **settings), expected["mm_generated"][:, : prompt_length + 4])


def test_changing_the_attention_or_experts_implementation_drops_the_workspaces(model, expected):
    """Captured steps keep the kernels chosen at capture: another implementation needs new steps."""
    request = fixture_request(expected)
    settings = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    prompt_length = request["input_ids"].shape[1]

    def generate_and_workspace():
        tokens = model.generate(**request, **settings)
        assert torch.equal(tokens, expected["mm_generated"][:, : prompt_length + 4])
        (workspace,) = model._static_generation_state().workspaces.values()
        return workspace

    text_config = model.language_model.config
    attn_implementation, experts_implementation = text_config._attn_implementation, text_config._experts_implementation
    first = generate_and_workspace()
    assert generate_and_workspace() is first
    try:
        model.set_attn_implementation("eager" if attn_implementation == "sdpa" else "sdpa")
        second = generate_and_workspace()
        assert second is not first
        model.set_experts_implementation("batched_mm" if experts_implementation != "batched_mm" else "grouped_mm")
        assert generate_and_workspace() is not second
    finally:  # the model is shared with other tests
        model.set_attn_implementation(attn_implementation)
        model.set_experts_implementation(experts_implementation)


def test_workspaces_are_bounded_least_recently_used_first(model, monkeypatch):
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.MAX_WORKSPACES", 2)
    short, long = torch.arange(20, 40)[None], torch.arange(1, 261)[None]  # + 3 new tokens: 256 and 512 slots

    def run(input_ids):
        model.generate(input_ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
        return list(model._static_generation_state().workspaces)

    assert run(short) == [(1, 256)]
    assert run(long) == [(1, 256), (1, 512)]
    assert run(short) == [(1, 512), (1, 256)]  # reused, now the most recent
    assert run(short.repeat(2, 1)) == [(1, 256), (2, 256)]  # a third workspace evicts the least recent


# ---------------------------------------------------------------------------------------------------------------------
# Sampling, streaming, outputs
# ---------------------------------------------------------------------------------------------------------------------

SAMPLING = dict(do_sample=True, temperature=1.3, top_k=50, top_p=0.95, repetition_penalty=1.2, max_new_tokens=16)


def sample(model, request, seed, **settings):
    torch.manual_seed(seed)
    return model.generate(**request, pad_token_id=PAD_ID, **settings)


def test_sampling_is_reproducible_with_a_seed_and_follows_plain_generate(model):
    request = batched_multi_image_request()
    first = sample(model, request, seed=7, cache_implementation="static", **SAMPLING)
    again = sample(model, request, seed=7, cache_implementation="static", **SAMPLING)
    other_seed = sample(model, request, seed=8, cache_implementation="static", **SAMPLING)
    plain = sample(model, request, seed=7, **SAMPLING)
    assert torch.equal(first, again)
    assert not torch.equal(first, other_seed)
    # Same processors (temperature, top-k, top-p, repetition penalty) and the same random draws as plain generate().
    assert torch.equal(first, plain)


def test_sampling_with_top_k_1_is_greedy(model):
    request = batched_multi_image_request()
    greedy = model.generate(**request, max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID)
    top_1 = sample(model, request, seed=3, do_sample=True, top_k=1, max_new_tokens=8, cache_implementation="static")
    assert torch.equal(top_1, greedy)


def test_return_dict_carries_scores_and_logits(model, expected):
    output = model.generate(
        **fixture_request(expected), max_new_tokens=5, do_sample=False, cache_implementation="static",
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )  # fmt: skip
    assert len(output.scores) == len(output.logits) == 5
    new_tokens = output.sequences[0, -5:]
    assert torch.equal(torch.stack([scores[0].argmax() for scores in output.scores]), new_tokens)
    assert output.logits[0].shape == (1, model.config.text_config.vocab_size)


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        assert not self.ended
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_gets_the_prompt_then_each_token_then_end(model, expected):
    request = fixture_request(expected)
    streamer = RecordingStreamer()
    output = model.generate(
        **request, max_new_tokens=6, do_sample=False, cache_implementation="static", streamer=streamer
    )
    assert streamer.ended
    assert torch.equal(streamer.chunks[0], request["input_ids"])
    assert len(streamer.chunks) == 1 + 6
    assert torch.cat([chunk.view(-1) for chunk in streamer.chunks[1:]]).tolist() == output[0, -6:].tolist()


def test_transformers_positional_parameters_keep_their_places(model, expected):
    """generate(inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn, synced_gpus,
    assistant_model, streamer, ...), as in transformers."""
    request = fixture_request(expected)
    input_ids = request.pop("input_ids")
    banned = int(expected["mm_generated"][0, input_ids.shape[1] + 1])  # the second token greedy search would choose
    processors = LogitsProcessorList([SuppressTokensLogitsProcessor([banned])])
    plain = model.generate(input_ids, None, processors, **request, max_new_tokens=6, do_sample=False)
    streamer = RecordingStreamer()
    static = model.generate(input_ids, None, processors, None, None, None, None, streamer, **request,
                            max_new_tokens=6, do_sample=False, cache_implementation="static")  # fmt: skip
    assert torch.equal(static, plain)
    assert banned not in static[0, input_ids.shape[1] :].tolist()
    assert torch.cat([chunk.view(-1) for chunk in streamer.chunks[1:]]).tolist() == static[0, -6:].tolist()


class SignallingStreamer(RecordingStreamer):
    """Records, and calls `on_token(index)` after each generated token (the prompt is put first, before the loop)."""

    def __init__(self, on_token=None):
        super().__init__()
        self.prompt_received = threading.Event()
        self.on_token = on_token

    def put(self, value):
        super().put(value)
        if len(self.chunks) == 1:
            self.prompt_received.set()
        elif self.on_token is not None:
            self.on_token(len(self.chunks) - 2)


def test_concurrent_static_requests_on_one_model_run_one_at_a_time(model):
    """Request B starts while A is between decode steps, in the same workspace (batch bucket 4, 256 slots): B waits
    for A, and both return exactly what they return alone."""
    request_a = batched_multi_image_request()
    request_b = {"input_ids": torch.arange(30, 60).view(3, 10), "attention_mask": torch.ones(3, 10, dtype=torch.long)}
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID, cache_implementation="static")
    alone_a, alone_b = model.generate(**request_a, **settings), model.generate(**request_b, **settings)
    lock = model._static_generation_state().lock
    results, lock_held_in_a = {}, []
    streamer_b = SignallingStreamer()
    thread_b = threading.Thread(
        target=lambda: results.update(b=model.generate(**request_b, **settings, streamer=streamer_b))
    )

    def on_token_of_a(index):
        lock_held_in_a.append(lock.locked())
        if index == 1:  # A has prefilled and decoded once: let B in and wait until it is inside generate()
            thread_b.start()
            assert streamer_b.prompt_received.wait(timeout=120), "request B did not start"

    results["a"] = model.generate(**request_a, **settings, streamer=SignallingStreamer(on_token_of_a))
    thread_b.join(timeout=300)
    assert not thread_b.is_alive()
    assert lock_held_in_a == [True] * 8 and not lock.locked()
    assert torch.equal(results["a"], alone_a)
    assert torch.equal(results["b"], alone_b)


def test_a_copy_of_the_model_starts_without_workspaces(model, expected):
    request = fixture_request(expected)
    model.generate(**request, max_new_tokens=2, do_sample=False, cache_implementation="static")
    duplicate = copy.deepcopy(model)
    assert duplicate._static_generation_state().workspaces == {}
    output = duplicate.generate(**request, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(output, expected["mm_generated"][:, : request["input_ids"].shape[1] + 4])
    (workspace,) = duplicate._static_generation_state().workspaces.values()
    assert workspace.model is duplicate


def test_text_iterator_streamer_yields_the_generated_text(model, expected, tiny_tokenizer_dir):
    tokenizer = KimiVLTokenizer.from_pretrained(tiny_tokenizer_dir)
    request = fixture_request(expected)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}

    def run():
        result["output"] = model.generate(
            **request, max_new_tokens=10, do_sample=False, cache_implementation="static", streamer=streamer
        )

    thread = threading.Thread(target=run)
    thread.start()
    streamed = "".join(streamer)
    thread.join()
    prompt_length = request["input_ids"].shape[1]
    new_tokens = result["output"][0, prompt_length:]
    assert torch.equal(new_tokens, expected["mm_generated"][0, prompt_length : prompt_length + 10])
    assert streamed and streamed == tokenizer.decode(new_tokens)


# ---------------------------------------------------------------------------------------------------------------------
# Errors and the graphs switch
# ---------------------------------------------------------------------------------------------------------------------


def test_request_longer_than_max_positions_or_the_cache_is_a_clear_error(model, expected):
    request = fixture_request(expected)  # 57 tokens; the tiny model has 512 positions
    with pytest.raises(ValueError, match=r"57 tokens.*max_new_tokens \(500\).*max_position_embeddings \(512\)"):
        model.generate(**request, max_new_tokens=500, cache_implementation="static")
    with pytest.raises(ValueError, match=r"max_cache_len=64"):
        model.generate(**request, max_new_tokens=20, cache_implementation="static", max_cache_len=64)
    assert model._static_generation_state().workspaces == {}, "nothing may be allocated or run before the error"


def test_fixed_max_cache_len_is_used_as_the_capacity(model, expected):
    request = fixture_request(expected)
    output = model.generate(**request, max_new_tokens=12, do_sample=False, cache_implementation="static",
                            max_cache_len=100)  # fmt: skip
    assert torch.equal(output, expected["mm_generated"])
    assert list(model._static_generation_state().workspaces) == [(1, 100)]


def test_bad_requests_are_rejected_with_what_is_allowed(model, expected):
    request = batched_multi_image_request()
    right_padded = dict(request, attention_mask=request["attention_mask"].flip(-1))
    with pytest.raises(ValueError, match="left padding"):
        model.generate(**right_padded, max_new_tokens=4, cache_implementation="static", pad_token_id=PAD_ID)
    with pytest.raises(ValueError, match="greedy search and sampling, not beam_search"):
        model.generate(**fixture_request(expected), max_new_tokens=4, num_beams=2, cache_implementation="static")


def test_graphs_switch_on_cpu(model, expected):
    request = fixture_request(expected)
    with pytest.raises(ValueError, match="cuda_graphs=True, but CUDA graphs need a CUDA device"):
        model.generate(**request, max_new_tokens=4, cache_implementation="static", cuda_graphs=True)
    output = model.generate(
        **request, max_new_tokens=12, do_sample=False, cache_implementation="static", cuda_graphs=False
    )
    assert torch.equal(output, expected["mm_generated"])
    (workspace,) = model._static_generation_state().workspaces.values()
    assert workspace.num_graphs == 0


def test_other_cache_implementations_keep_plain_generate(model, expected):
    output = model.generate(**fixture_request(expected), max_new_tokens=12, do_sample=False)
    assert torch.equal(output, expected["mm_generated"])
    assert model._static_generation_state().workspaces == {}


# Reading a device tensor on the host inside a step would be a sync, which a CUDA graph capture refuses: the methods
# that read values, and the ops whose output shape depends on the values (the host must learn it).
HOST_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
DATA_DEPENDENT_OPS = ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select")


def is_boolean_mask(index) -> bool:
    indices = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def forbid_host_reads(monkeypatch):
    def refuse(name):
        raise AssertionError(f"{name} inside a step")

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, lambda self, *args, _name=name, **kwargs: refuse(f"Tensor.{_name}()"))
    for name in DATA_DEPENDENT_OPS:
        monkeypatch.setattr(torch, name, lambda *args, _name=name, **kwargs: refuse(f"torch.{_name}()"))
        monkeypatch.setattr(torch.Tensor, name, lambda *args, _name=name, **kwargs: refuse(f"Tensor.{_name}()"))
    where, getitem, setitem = torch.where, torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def guarded_where(condition, *args, **kwargs):
        if not args and not kwargs:
            refuse("torch.where(condition)")  # the one-argument form is nonzero
        return where(condition, *args, **kwargs)

    def guarded_getitem(self, index):
        if is_boolean_mask(index):
            refuse("boolean-mask indexing")
        return getitem(self, index)

    def guarded_setitem(self, index, value):
        if is_boolean_mask(index):
            refuse("boolean-mask assignment")
        return setitem(self, index, value)

    monkeypatch.setattr(torch, "where", guarded_where)
    monkeypatch.setattr(torch.Tensor, "__getitem__", guarded_getitem)
    monkeypatch.setattr(torch.Tensor, "__setitem__", guarded_setitem)


@pytest.mark.parametrize(
    "host_read",
    [
        lambda x: x.sum().item(),
        lambda x: torch.nonzero(x),
        lambda x: x.nonzero(),
        lambda x: torch.argwhere(x),
        lambda x: torch.unique(x),
        lambda x: x.unique(),
        lambda x: torch.masked_select(x, x > 0),
        lambda x: torch.where(x > 0),
        lambda x: x[x > 0],
        lambda x: x.__setitem__(x > 0, 0.0),
        lambda x: int(x[0]),
    ],
)
def test_the_host_read_guard_catches_each_form(monkeypatch, host_read):
    x = torch.randn(6)
    host_read(x)  # fine outside the guard
    with monkeypatch.context() as patched:
        forbid_host_reads(patched)
        torch.where(x > 0, x, 0.0)  # what a step may do: shapes that do not depend on the values
        x[torch.tensor([0, 2])], x[1:3]
        with pytest.raises(AssertionError, match="inside a step"):
            host_read(x)


def steps_of(model):
    (workspace,) = model._static_generation_state().workspaces.values()
    return [*workspace.prefill_steps.values(), *workspace.decode_steps.values()]


def test_steps_never_read_device_tensors_back_to_the_host(model, expected, monkeypatch):
    model.generate(**fixture_request(expected), max_new_tokens=3, do_sample=False, cache_implementation="static")
    steps = steps_of(model)
    assert len(steps) == 2
    with monkeypatch.context() as patched:
        forbid_host_reads(patched)
        for step in steps:
            step.forward()


def test_eager_experts_read_the_host_so_they_cannot_be_captured(reference_checkpoint, expected, monkeypatch):
    """The counter-check of the test above: the data-dependent experts loop is caught by the same guard."""
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, experts_implementation="eager")
    model.eval().generate(**fixture_request(expected), max_new_tokens=3, cache_implementation="static")
    with monkeypatch.context() as patched:
        forbid_host_reads(patched)
        with pytest.raises(AssertionError, match="inside a step"):
            steps_of(model)[-1].forward()


# ---------------------------------------------------------------------------------------------------------------------
# CUDA: graph capture and replay (benchmarks/gpu_check.sh runs these on a GPU machine)
# ---------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def synchronizing_is_an_error():
    """Every CUDA operation that would make the host wait for the device raises inside this block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_cuda
@pytest.mark.parametrize(
    ("dtype", "experts_implementation"), [(torch.float32, "batched_mm"), (torch.bfloat16, "grouped_mm")]
)
def test_cuda_graph_replay_equals_eager_steps_and_plain_generate(reference_checkpoint, dtype, experts_implementation):
    model = KimiVLForConditionalGeneration.from_pretrained(
        reference_checkpoint, dtype=dtype, experts_implementation=experts_implementation
    ).to("cuda").eval()  # fmt: skip
    request = batched_multi_image_request("cuda")
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID, cache_implementation="static")
    graphs = model.generate(**request, **settings, cuda_graphs=True)
    workspace = next(iter(model._static_generation_state().workspaces.values()))
    assert workspace.num_graphs == 2  # one prefill bucket, one decode step
    replayed = model.generate(**request, **settings, cuda_graphs=True)
    assert workspace.num_graphs == 2, "the second call must replay, not capture again"
    steps = [*workspace.prefill_steps.values(), *workspace.decode_steps.values()]
    outputs = [step.output for step in steps]
    with synchronizing_is_an_error():
        for step in steps:
            step()  # a replay: no host read, no sync
    torch.cuda.synchronize()
    assert all(step.output is output for step, output in zip(steps, outputs)), "a replay reuses the captured output"
    eager = model.generate(**request, **settings, cuda_graphs=False)
    assert torch.equal(graphs, replayed)
    assert torch.equal(graphs, eager)
    if dtype == torch.float32:
        plain = model.generate(**request, max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID)
        assert torch.equal(graphs, plain)


@requires_cuda
def test_cuda_chunked_prefill_runs_eagerly_beside_the_decode_graphs(reference_checkpoint, monkeypatch):
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.PREFILL_CHUNK_TOKENS", 4)
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, experts_implementation="batched_mm")
    model = model.to("cuda").eval()
    request = batched_multi_image_request("cuda")
    graphs = model.generate(**request, max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID,
                            cache_implementation="static", cuda_graphs=True)  # fmt: skip
    workspace = next(iter(model._static_generation_state().workspaces.values()))
    assert not workspace.prefill_steps and workspace.num_graphs == 1  # the decode step's graph only
    plain = model.generate(**request, max_new_tokens=8, do_sample=False, pad_token_id=PAD_ID)
    assert torch.equal(graphs, plain)


@requires_cuda
def test_cuda_static_generation_takes_a_prompt_on_the_cpu_as_plain_generate_does(reference_checkpoint):
    """The forward's inputs go to the model's device, the tokens stay where the prompt was given (GenerationMixin)."""
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, experts_implementation="batched_mm")
    model = model.to("cuda").eval()
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID)
    on_the_model = model.generate(**batched_multi_image_request("cuda"), **settings)
    for cuda_graphs in (True, False):
        static = model.generate(
            **batched_multi_image_request("cpu"), **settings, cache_implementation="static", cuda_graphs=cuda_graphs
        )
        assert static.device.type == "cpu"
        assert torch.equal(static, on_the_model.cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_graphs_of_a_model_off_the_current_device_and_none_for_a_split_model(reference_checkpoint):
    """A model on cuda:1 while cuda:0 is current captures and replays on cuda:1 (after a capture on cuda:0 in the same
    process); cuda_graphs=True is refused for a language model spread over both devices."""
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD_ID, cache_implementation="static")
    request = batched_multi_image_request("cpu")
    on_first = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, experts_implementation="batched_mm")
    on_first = on_first.to("cuda:0").eval()
    plain = on_first.generate(**batched_multi_image_request("cuda:0"), max_new_tokens=12, do_sample=False,
                              pad_token_id=PAD_ID).cpu()  # fmt: skip
    assert torch.equal(on_first.generate(**request, **settings, cuda_graphs=True), plain)
    on_second = copy.deepcopy(on_first).to("cuda:1")
    with torch.cuda.device(0):
        first = on_second.generate(**request, **settings, cuda_graphs=True)
        replayed = on_second.generate(**request, **settings, cuda_graphs=True)
    assert torch.equal(first, plain) and torch.equal(replayed, plain)
    on_second.language_model.model.layers[-1].to("cuda:0")  # now spread over both devices
    with pytest.raises(ValueError, match="spread over"):
        on_second.generate(**request, **settings, cuda_graphs=True)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_of_every_read_bucket_equal_eager_steps(reference_checkpoint, expected, dtype, monkeypatch):
    """80 new tokens from a 57-token prompt with read buckets from 32: decode graphs for 64, 96, 128 and 192 slots,
    each captured once and replayed without a sync, giving the eager steps' tokens (and plain generate()'s in fp32)."""
    monkeypatch.setattr("modeling_kimi_vl.static_steps_kimi_vl.MIN_DECODE_READ_SLOTS", 32)
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, dtype=dtype).to("cuda").eval()
    request = fixture_request(expected, "cuda")
    settings = dict(max_new_tokens=80, do_sample=False, cache_implementation="static")
    graphs = model.generate(**request, **settings, cuda_graphs=True)
    (workspace,) = model._static_generation_state().workspaces.values()
    assert list(workspace.decode_steps) == [64, 96, 128, 192] and workspace.num_graphs == 5
    assert torch.equal(model.generate(**request, **settings, cuda_graphs=True), graphs)
    assert workspace.num_graphs == 5, "the second call must replay, not capture again"
    with synchronizing_is_an_error():
        for step in workspace.decode_steps.values():
            step()
    torch.cuda.synchronize()
    assert torch.equal(model.generate(**request, **settings, cuda_graphs=False), graphs)
    if dtype == torch.float32:
        assert torch.equal(model.generate(**request, max_new_tokens=80, do_sample=False), graphs)


@requires_cuda
def test_cuda_eager_experts_cannot_be_captured(reference_checkpoint, expected):
    model = KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, experts_implementation="eager")
    model = model.to("cuda").eval()
    request = fixture_request(expected, "cuda")
    with pytest.raises(ValueError, match="data-dependent"):
        model.generate(**request, max_new_tokens=4, cache_implementation="static", cuda_graphs=True)
    # Left to choose, the model falls back to the same steps without graphs.
    output = model.generate(**request, max_new_tokens=12, do_sample=False, cache_implementation="static")
    assert torch.equal(output.cpu(), expected["mm_generated"])


def test_a_model_pickles_after_static_generation(reference_model, expected):
    """torch.save(model) after static generation: the copy starts without workspaces, graphs or a held lock."""
    import copy
    import pickle

    reference_model.generate(
        input_ids=expected["txt_input_ids"][:1], max_new_tokens=2, do_sample=False, cache_implementation="static"
    )
    restored = pickle.loads(pickle.dumps(reference_model))
    assert restored._static_generation_state().workspaces == {}
    assert copy.deepcopy(reference_model)._static_generation_state().workspaces == {}
    generated = restored.generate(
        input_ids=expected["txt_input_ids"][:1], max_new_tokens=2, do_sample=False, cache_implementation="static"
    )
    assert generated.shape == (1, expected["txt_input_ids"].shape[1] + 2)
