"""Fast generation for Kimi-VL: a static cache of the MLA latent, with prefill and decode replayed from CUDA graphs.

`model.generate(..., cache_implementation="static")` comes here. transformers' `generate` still prepares the request
(generation config, special tokens, attention mask and position ids, max length, logits processors, stopping criteria,
the streamer's prompt) and then hands over to `KimiVLStaticGenerationMixin._static_decoding_loop`, passed to it as
`custom_generate`. The loop runs:

    images  -> vision tower + projector, merged into the prompt embeddings     (eager: shapes follow the images)
    prompt  -> prefill step of the (batch, length) bucket -> logits of the last prompt token
    repeat:    logits processors -> next tokens (argmax / multinomial) -> stopping criteria, streamer
               -> decode step of the (batch, read) bucket -> logits of the fed token

The pieces live in two sibling modules:
- static_cache_kimi_vl.py: the latent cache (fixed slots, written and read where the step says), its slot layout and
  the attention mask over it;
- static_steps_kimi_vl.py: the steps (eager, or captured as CUDA graphs and replayed), the buckets that pick them, the
  workspaces that hold a cache with its steps, their eviction, and the per-model lock.

This module is the mixin: it routes the request, checks it, sizes its cache, and runs the token loop. The vision tower
never runs inside a capture (under encoder data parallelism, ranks see different images).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from transformers import GenerationMixin
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.configuration_utils import GenerationMode

from .static_steps_kimi_vl import StaticGenerationState, round_up
from .transformers_compat_modeling import CACHE_ARGUMENT

# Experts implementations whose forward has no data-dependent shapes or host reads (the "eager" loop has both).
CAPTURABLE_EXPERTS_IMPLEMENTATIONS = ("batched_mm", "grouped_mm")
# Attention implementations that take the explicit 4-D mask the static layout needs.
SUPPORTED_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
# Cache capacities are rounded up to this many slots so that similar requests share a workspace (and its graphs).
CACHE_SLOT_GRANULE = 256
# transformers' own `generate` parameters, read by name from the installed release (their positional order is the
# same in every supported one; reading them by name keeps it so if it ever changes).
GENERATE_SIGNATURE = inspect.signature(GenerationMixin.generate)


class KimiVLStaticGenerationMixin:
    """Routes `generate(..., cache_implementation="static")` to the static-cache, CUDA-graph decoding loop. Everything
    else goes to transformers' `GenerationMixin.generate` unchanged."""

    def generate(self, inputs=None, generation_config=None, *args, **kwargs):
        # transformers' own parameters, in its positional order: read them by name without reordering anything.
        request = GENERATE_SIGNATURE.bind(self, inputs, generation_config, *args, **kwargs)
        extra_kwargs = request.arguments.get("kwargs", {})
        # Checked here, on the prompt as given: transformers' `generate` drops an all-ones attention_mask (whatever
        # its length) and derives positions from it before the model sees either.
        self.check_prompt_inputs(
            inputs if inputs is not None else extra_kwargs.get("input_ids"),
            extra_kwargs.get("attention_mask"),
            extra_kwargs.get("inputs_embeds"),
        )
        config = generation_config if generation_config is not None else self.generation_config
        cache_implementation = extra_kwargs.get("cache_implementation", config.cache_implementation)
        if cache_implementation != "static" or request.arguments.get("custom_generate") is not None:
            return super().generate(inputs, generation_config, *args, **kwargs)
        # `generate` passes a custom loop only the keyword arguments `_sample` does not take, so the streamer is bound
        # here (transformers still feeds it the prompt itself).
        request.arguments["custom_generate"] = functools.partial(
            type(self)._static_decoding_loop, streamer=request.arguments.get("streamer")
        )
        return super().generate(*request.args[1:], **request.kwargs)

    def warm_up_static_generation(self, batch_size: int, prompt_length: int, max_new_tokens: int = 2, **kwargs):
        """Build the workspace (and, on CUDA, capture the prefill graph, for prompts up to PREFILL_CHUNK_TOKENS, and the
        decode graph of every read bucket up to the capacity) that a text request of this shape will use, so the first
        real request does not pay for it. `kwargs` go to `generate` (e.g. `max_cache_len`, `cuda_graphs`); image
        requests of the same token length use the same graphs.

        Only one workspace is warmed: the one of capacity `prompt_length + max_new_tokens` rounded up to
        CACHE_SLOT_GRANULE slots, unless `max_cache_len` fixes the capacity. A later request whose length rounds up
        to another capacity uses (and on first use builds) another workspace, so a server should pass the same
        `max_cache_len` here and in its requests, and warm up each batch size and prompt length it expects."""
        input_ids = torch.zeros(batch_size, prompt_length, dtype=torch.long, device=self.device)
        self.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            cache_implementation="static",
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            warm_up_decode_steps=True,
            **kwargs,
        )

    def clear_static_generation(self) -> None:
        """Free the static caches, buffers and CUDA graphs kept for `cache_implementation="static"` (waits for a
        static generation request in flight on another thread)."""
        state = self._static_generation_state()
        with state.lock:
            state.clear()

    def _static_generation_state(self) -> StaticGenerationState:
        # setdefault: two threads calling generate on a fresh model get the same state (and lock).
        return self.__dict__.setdefault("_static_generation", StaticGenerationState())

    def _cuda_graphs_unavailable_reason(self) -> str | None:
        """Why this model cannot replay its language model from CUDA graphs, or None if it can."""
        text_config = self.language_model.config
        if self.language_model.device.type != "cuda":
            return f"CUDA graphs need a CUDA device; the language model is on {self.language_model.device}."
        devices = sorted({str(parameter.device) for parameter in self.language_model.parameters()})
        if len(devices) > 1:
            return (
                f"a CUDA graph captures the work of one device, and the language model is spread over {devices} "
                f"(device_map); load it onto one device for CUDA graphs."
            )
        if text_config._experts_implementation not in CAPTURABLE_EXPERTS_IMPLEMENTATIONS:
            return (
                f"experts_implementation={text_config._experts_implementation!r} routes tokens with data-dependent "
                f"shapes, which a CUDA graph cannot capture; load the model with experts_implementation set to one "
                f"of {CAPTURABLE_EXPERTS_IMPLEMENTATIONS}."
            )
        if text_config._experts_implementation == "grouped_mm" and torch.cuda.get_device_capability(
            self.language_model.device
        ) < (8, 0):
            return "grouped_mm needs compute capability 8.0 or newer; use experts_implementation='batched_mm'."
        return None

    def _static_decoding_loop(
        self,
        input_ids: torch.LongTensor,
        logits_processor,
        stopping_criteria,
        generation_config,
        streamer=None,
        cuda_graphs: bool | None = None,
        warm_up_decode_steps: bool = False,
        **model_kwargs,
    ):
        """The decoding loop of `generate(..., cache_implementation="static")`, run by `generate` once it has prepared
        the request. `cuda_graphs`: None replays graphs when possible, True requires them, False runs eagerly.
        `warm_up_decode_steps` (for `warm_up_static_generation`) also runs the decode step of every read bucket."""
        pixel_values = model_kwargs.pop("pixel_values", None)
        image_grid_hws = model_kwargs.pop("image_grid_hws", None)
        attention_mask = model_kwargs.pop("attention_mask", None)
        position_ids = model_kwargs.pop("position_ids", None)
        model_kwargs.pop("mm_token_type_ids", None)  # the processor's image-token marks: unused, as in `forward`
        # `generate` also prepared a transformers StaticCache (allocated lazily, so still empty): the workspace keeps
        # its own, whose address the graphs hold across calls.
        for prepared in (CACHE_ARGUMENT, "use_cache", "logits_to_keep"):
            model_kwargs.pop(prepared, None)
        unsupported = sorted(name for name, value in model_kwargs.items() if value is not None)
        if unsupported:
            raise ValueError(
                f"generate(cache_implementation='static') does not take {unsupported}; it takes input_ids, "
                "attention_mask, pixel_values and image_grid_hws."
            )
        self._check_static_request(input_ids, attention_mask, pixel_values, generation_config)

        reason = self._cuda_graphs_unavailable_reason()
        if cuda_graphs and reason is not None:
            raise ValueError(f"cuda_graphs=True, but {reason}")
        use_graphs = reason is None if cuda_graphs is None else cuda_graphs

        batch_size, prompt_length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        position_ids = position_ids.expand(batch_size, -1)
        num_slots = self._static_cache_slots(prompt_length, generation_config)
        # As plain `generate` does (GenerationMixin.prepare_inputs_for_generation): what the forward reads goes to the
        # model's device right before it runs, while the tokens, scores and stopping decisions stay on the device the
        # prompt was given on, and the sequences come back there (a prompt on the CPU works for a model on a GPU).
        image_inputs = {"pixel_values": pixel_values, "image_grid_hws": image_grid_hws}
        image_inputs = {name: None if value is None else value.to(self.device) for name, value in image_inputs.items()}
        state = self._static_generation_state()
        # Graphs are captured and replayed on the current CUDA device's streams: make it the model's, which need not be
        # the current one (device_map="cuda:1").
        on_model_device = torch.cuda.device(self.language_model.device) if use_graphs else contextlib.nullcontext()
        with state.lock, on_model_device:  # static requests on one model share the workspaces' buffers: one at a time
            workspace = state.workspace(self, batch_size, num_slots, use_graphs)
            inputs_embeds = self.embed_inputs(input_ids.to(self.device), **image_inputs)
            first_logits = workspace.prefill(
                inputs_embeds, attention_mask.to(self.device), position_ids.to(self.device)
            )
            output = self._static_token_loop(
                workspace, input_ids, first_logits, logits_processor, stopping_criteria, generation_config, streamer
            )
            if warm_up_decode_steps:
                workspace.warm_up_decode_steps()
            return output

    def _static_token_loop(
        self, workspace, input_ids, next_token_logits, logits_processor, stopping_criteria, generation_config, streamer
    ):
        """The same token selection and stopping logic as GenerationMixin._sample, with a decode step per token."""
        pad_token_id = generation_config._pad_token_tensor
        if pad_token_id is not None:  # `generate` puts it on the inputs' device, which may not be the tokens'
            pad_token_id = pad_token_id.to(input_ids.device)
        has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        return_dict = generation_config.return_dict_in_generate
        scores = () if return_dict and generation_config.output_scores else None
        raw_logits = () if return_dict and generation_config.output_logits else None
        unfinished_sequences = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        while True:
            next_token_logits = next_token_logits.to(copy=True, dtype=torch.float32, device=input_ids.device)
            next_token_scores = logits_processor(input_ids, next_token_logits)
            if scores is not None:
                scores += (next_token_scores,)
            if raw_logits is not None:
                raw_logits += (next_token_logits,)
            if generation_config.do_sample:
                probs = torch.nn.functional.softmax(next_token_scores, dim=-1)
                next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(next_token_scores, dim=-1)
            if has_eos_stopping_criteria:
                next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, scores)
            if streamer is not None:
                streamer.put(next_tokens.cpu())  # the streamer's own read: it hands tokens to the host
            # The one host read per step: stopping criteria (end-of-sequence ids, stop strings, a user's criteria)
            # decide on device values, and the loop must know on the host whether to run another step.
            if unfinished_sequences.max() == 0:
                break
            next_token_logits = workspace.decode(next_tokens.to(workspace.decode_input_ids.device))

        if streamer is not None:
            streamer.end()
        if return_dict:
            return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits)
        return input_ids

    def _check_static_request(self, input_ids, attention_mask, pixel_values, generation_config) -> None:
        """Reject what the static path cannot do, before anything runs."""
        if input_ids.numel() == 0:
            raise ValueError(
                "generate(cache_implementation='static') needs at least one non-empty prompt in input_ids, got shape "
                f"{tuple(input_ids.shape)}."
            )
        mode = generation_config.get_generation_mode()
        if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            raise ValueError(
                f"generate(cache_implementation='static') supports greedy search and sampling, not {mode.value}; "
                "use the default cache for it."
            )
        if generation_config.output_attentions or generation_config.output_hidden_states:
            raise ValueError(
                "generate(cache_implementation='static') cannot return attentions or hidden states (the steps run "
                "as CUDA graphs); use the default cache for them."
            )
        if pixel_values is not None and generation_config.num_return_sequences > 1:
            raise ValueError(
                "num_return_sequences > 1 with images is not supported by generate(cache_implementation='static'); "
                "repeat the prompt (and its images) in the batch instead."
            )
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            raise ValueError(
                "generate(cache_implementation='static') needs left padding: some rows of attention_mask end in "
                "padding. Tokenize with padding_side='left'."
            )
        attn_implementation = self.language_model.config._attn_implementation
        if attn_implementation not in SUPPORTED_ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"generate(cache_implementation='static') runs the language model with attn_implementation "
                f"{SUPPORTED_ATTENTION_IMPLEMENTATIONS}, not {attn_implementation!r}; call "
                "model.set_attn_implementation('sdpa') first."
            )

    def _static_cache_slots(self, prompt_length: int, generation_config) -> int:
        """Cache capacity for this request: `max_cache_len` if the generation config sets one (so that all requests
        share one workspace), else the request's length rounded up to `CACHE_SLOT_GRANULE`."""
        max_length = generation_config.max_length
        request = (
            f"the prompt ({prompt_length} tokens) plus max_new_tokens ({max_length - prompt_length}) is "
            f"{max_length} tokens"
        )
        max_positions = self.language_model.config.max_position_embeddings
        if max_length > max_positions:
            raise ValueError(f"{request}, more than the model's max_position_embeddings ({max_positions}).")
        max_cache_len = getattr(generation_config, "max_cache_len", None)
        if max_cache_len is not None:
            if max_length > max_cache_len:
                raise ValueError(f"{request}, more than the static cache holds (max_cache_len={max_cache_len}).")
            return max_cache_len
        return round_up(max_length, CACHE_SLOT_GRANULE)


__all__ = ["KimiVLStaticGenerationMixin"]
