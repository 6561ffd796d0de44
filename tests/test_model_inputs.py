"""Bad model inputs at prefill: an attention_mask that does not fit input_ids, and ids outside the vocabulary, are a
ValueError naming the numbers (on CUDA the embedding lookup would end the process with a device-side assert), checked
once per prompt and never in a decode step."""

import re

import pytest
import torch

from modeling_kimi_vl import KimiVLForConditionalGeneration

VOCAB_SIZE = 320  # the tiny reference checkpoint's


@pytest.fixture(scope="module")
def model(reference_checkpoint):
    """Its own copy of the tiny checkpoint: static generation keeps state on the model it runs on."""
    return KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, attn_implementation="sdpa").eval()


def _call(model, how, **inputs):
    if how == "forward":
        return model(**inputs)
    static = {"cache_implementation": "static"} if how == "static" else {}
    return model.generate(**inputs, max_new_tokens=3, do_sample=False, **static)


@pytest.mark.parametrize("how", ["forward", "generate", "static"])
def test_attention_mask_of_another_length_is_refused(model, how):
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    for mask_shape in [(2, 3), (2, 6), (1, 4)]:
        with pytest.raises(
            ValueError,
            match=rf"attention_mask has shape \({mask_shape[0]}, {mask_shape[1]}\) but the "
            r"prompt is 2 x 4 tokens",
        ):
            _call(model, how, input_ids=input_ids, attention_mask=torch.ones(mask_shape, dtype=torch.long))


@pytest.mark.parametrize("how", ["forward", "generate", "static"])
def test_ids_outside_the_vocabulary_are_refused(model, how):
    input_ids = torch.tensor([[5, VOCAB_SIZE, 7, -1], [9, 10, VOCAB_SIZE + 77, VOCAB_SIZE]])
    with pytest.raises(
        ValueError,
        match=rf"3 distinct id\(s\) outside the vocabulary \[0, {VOCAB_SIZE}\), e\.g\. "
        rf"\[-1, {VOCAB_SIZE}, {VOCAB_SIZE + 77}\]",
    ):
        _call(model, how, input_ids=input_ids, attention_mask=torch.ones_like(input_ids))


@pytest.mark.parametrize("how", ["forward", "generate", "static"])
def test_ids_of_another_rank_are_refused(model, how):
    for input_ids in (torch.tensor([5, 6, 7]), torch.tensor([[[5, 6, 7]]])):
        with pytest.raises(
            ValueError, match=re.escape(f"input_ids must have shape [batch, seq], got {tuple(input_ids.shape)}")
        ):
            _call(model, how, input_ids=input_ids)


def test_static_generation_refuses_an_empty_batch(model):
    with pytest.raises(
        ValueError, match=re.escape("needs at least one non-empty prompt in input_ids, got shape (0, 4)")
    ):
        model.generate(torch.zeros((0, 4), dtype=torch.long), max_new_tokens=2, cache_implementation="static")


@pytest.mark.parametrize("how", ["generate", "static"])
def test_prompt_is_checked_once_not_in_decode_steps(model, how, monkeypatch):
    checked = []
    check = model.check_prompt_inputs
    monkeypatch.setattr(model, "check_prompt_inputs", lambda *args: checked.append(args) or check(*args))
    input_ids = torch.tensor([[5, 6, 7, 8]])
    output = _call(model, how, input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    assert output.shape == (1, 7)  # three decode steps ran
    assert len(checked) == 1 and torch.equal(checked[0][0], input_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("how", ["forward", "generate", "static"])
def test_cuda_ids_outside_the_vocabulary_are_an_error_not_a_device_assert(reference_checkpoint, how):
    model = (
        KimiVLForConditionalGeneration.from_pretrained(reference_checkpoint, attn_implementation="sdpa").cuda().eval()
    )
    input_ids = torch.tensor([[5, VOCAB_SIZE + 1]], device="cuda")
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {VOCAB_SIZE}\)"):
        _call(model, how, input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    # The process and the device are still usable afterwards (a device-side assert would poison the context).
    output = _call(model, how, input_ids=input_ids.clamp(max=VOCAB_SIZE - 1))
    assert torch.isfinite(output.logits if how == "forward" else output.float()).all()
