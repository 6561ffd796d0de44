"""Fast generation for Kimi-VL: a static cache of the MLA latent, with prefill and decode replayed from CUDA graphs.

`model.generate(..., cache_implementation="static")` comes here. transformers' `generate` still prepares the request
(generation config, special tokens, attention mask and position ids, max length, logits processors, stopping criteria,
the streamer's prompt) and then hands over to `KimiVLStaticGenerationMixin._static_decoding_loop`, passed to it as
`custom_generate`. The loop runs:

    images  -> vision tower + projector, merged into the prompt embeddings     (eager: shapes follow the images)
    prompt  -> prefill step of the (batch, length) bucket -> logits of the last prompt token
    repeat:    logits processors -> next tokens (argmax / multinomial) -> stopping criteria, streamer
               -> decode step of the (batch, read) bucket -> logits of the fed token

A step is one language-model forward over persistent buffers of fixed shape (a `StaticStep`): on CUDA it is captured
into a CUDA graph the first time it runs and replayed afterwards; elsewhere, or with `cuda_graphs=False`, the very same
function runs eagerly. All graphs of a model share one memory pool. Graphs are not kept forever: workspaces, and the
prefill and decode steps inside a workspace, are evicted least recently used first (MAX_WORKSPACES, MAX_PREFILL_STEPS,
MAX_DECODE_STEPS), and everything is dropped when graphs are switched on or off or when any parameter or buffer of the
model is replaced by another tensor (`.to()`, `load_state_dict(assign=True)`, quantizing a layer); an evicted step is
captured again when it is next needed.

Layout of one request inside its workspace (batch bucket B, cache capacity C slots):

    cache slot:  0 ........... T-1 | T ............ Lb-1 | Lb ............ C-1
    prefill:     prompt as given     | filler: written,     | not read
                 (left padding kept) | output unused        |
    decode:                          | generated token i is written at slot T+i (over the filler)

A prefill step of bucket Lb reads (and masks) only the cache slots [0, Lb): nothing later can be visible to a prompt
query. A decode step reads the filled slots rounded up to a read bucket (`decode_read_bucket`: 256, 384, 512, 768,
1024, ..., capped at C), so its cost follows the request's length, not the capacity: a large fixed `max_cache_len`
costs memory, not speed. Each read bucket has its own step (a graph on CUDA), chosen on the host from the number of
tokens fed so far, never from device values. With the absorbed MLA attention (modeling_kimi_vl.KimiVLMLAAttention) a
decode step reads each cached slot's latent once for all heads instead of expanding it through `kv_b_proj`.

Rows past the real batch are dummy prompts. The prompt keeps its own left padding, so every real token sits in the
same cache slot and has the same rotary position as in plain `generate()`; that is what keeps greedy outputs
identical. Which cache slots a query may see is derived from one `key_valid [B, C]` buffer (padding excluded) and the
query's own slot (causality); a query always sees itself, so no attention row is ever fully masked (an all-masked row
would give NaN, and 0 * NaN poisons every row that reads it).

A workspace's buffers are shared by every request that uses it, so static generation requests on one model run one
at a time: a per-model lock serialises them (concurrent callers wait, they never share buffers).

Under tensor parallelism all ranks receive identical inputs, so they pick the same buckets, evict the same steps and
capture (or replay) the same graphs in the same order: the sequence of collectives matches across ranks. The vision
tower never runs inside a capture (under encoder data parallelism, ranks see different images).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
from collections import OrderedDict

import torch
from transformers import DeepseekV3ForCausalLM, GenerationMixin
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.configuration_utils import GenerationMode

from .parallel_kimi_vl import local_part

# Experts implementations whose forward has no data-dependent shapes or host reads (the "eager" loop has both).
CAPTURABLE_EXPERTS_IMPLEMENTATIONS = ("batched_mm", "grouped_mm")
# Attention implementations that take the explicit 4-D mask the static layout needs.
SUPPORTED_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
# Cache capacities are rounded up to this many slots so that similar requests share a workspace (and its graphs).
CACHE_SLOT_GRANULE = 256
# Workspaces (a latent cache each, plus graphs) kept per model.
MAX_WORKSPACES = 8
# Prefill steps (one per prompt bucket, each a CUDA graph with its own output) kept per workspace.
MAX_PREFILL_STEPS = 8
# The smallest number of cache slots a decode step reads; larger read buckets grow geometrically from here up to the
# capacity (see decode_read_bucket).
MIN_DECODE_READ_SLOTS = 256
# Decode steps (one per read bucket) kept per workspace. A long request walks the read buckets in ascending order, so
# the bound holds all of them for any capacity up to 256 * 2**11 = 512K slots (23 buckets; Kimi-VL's 128K context
# takes 19): evicting one would make every request capture it again.
MAX_DECODE_STEPS = 24
# transformers 5.24 renamed the language model's cache argument from `past_key_values` to `cache` (the old name warns
# on every call until 5.40); pass it under the name the installed version takes.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(DeepseekV3ForCausalLM.forward).parameters else "past_key_values"
GENERATE_SIGNATURE = inspect.signature(GenerationMixin.generate)


def batch_bucket(batch_size: int) -> int:
    """1, 2, 4, 8, then multiples of 8: at most 2x padding for small batches, at most 7 dummy rows beyond."""
    if batch_size <= 8:
        return 1 << (batch_size - 1).bit_length()
    return -(-batch_size // 8) * 8


def decode_read_bucket(filled_slots: int, num_slots: int) -> int:
    """Slots a decode step reads when `filled_slots` hold tokens: the next of 2^k and 1.5 * 2^k (256, 384, 512, 768,
    1024, ...) from MIN_DECODE_READ_SLOTS, capped at the capacity. Beyond the first bucket it reads at most 1.5x the
    filled slots (a plain power of two would read 2x just past every power of two), with two steps per doubling."""
    power_of_two = 1 << (filled_slots - 1).bit_length()
    bucket = power_of_two * 3 // 4 if filled_slots <= power_of_two * 3 // 4 else power_of_two
    return min(num_slots, max(MIN_DECODE_READ_SLOTS, bucket))


def prompt_bucket(length: int) -> int:
    """16, 32, ..., 256, then multiples of 256: short prompts waste little absolute work, long ones under 256 tokens."""
    if length <= 256:
        return max(16, 1 << (length - 1).bit_length())
    return -(-length // 256) * 256


# ----------------------------------------------------------------------------------------------------------------------
# The cache: MLA latent only, written at slots chosen by the caller
# ----------------------------------------------------------------------------------------------------------------------


class StaticLatentLayer(CacheLayerMixin):
    """One layer's latent cache: keys `[batch, 1, slots, kv_lora_rank]` (the normalised compressed KV) and values
    `[batch, 1, slots, qk_rope_head_dim]` (the rotated shared key), exactly what transformers' DeepSeek-V3 attention
    hands to `Cache.update`. New states are written at `write_slots` of the owning cache; the leading `read_slots` of
    the buffers are returned and the attention mask hides those a query must not see. Allocated on the first update,
    from the states' own shapes (so a tensor-parallel shard sizes itself), which always happens in an eager run, never
    inside a capture.
    """

    def __init__(self, cache: StaticLatentCache):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch_size, num_heads = key_states.shape[:2]
        slots = self.cache.num_slots
        self.keys = key_states.new_zeros(batch_size, num_heads, slots, key_states.shape[-1])
        self.values = value_states.new_zeros(batch_size, num_heads, slots, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, self.cache.write_slots, key_states)
        self.values.index_copy_(2, self.cache.write_slots, value_states)
        # A Python int fixed per step, so a captured graph holds a view of fixed shape and address.
        read_slots = self.cache.read_slots
        return self.keys[:, :, :read_slots], self.values[:, :, :read_slots]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.read_slots, 0

    def get_seq_length(self) -> int:
        # The filled length lives on the device; the model never needs it (positions and masks are always passed).
        raise NotImplementedError("StaticLatentCache is driven by explicit slots; pass position_ids and a 4-D mask.")

    def get_max_length(self) -> int:
        return self.cache.num_slots


class StaticLatentCache(Cache):
    """A fixed-capacity latent cache driven by the step that runs the model: `write_slots` (a device tensor) are the
    slots it writes, `read_slots` (a Python int) how many leading slots attention reads. A prefill step of bucket Lb
    writes and reads slots [0, Lb); a decode step writes one slot and reads the leading slots of its read bucket."""

    def __init__(self, num_layers: int, num_slots: int):
        self.num_slots = num_slots
        self.write_slots: torch.Tensor | None = None
        self.read_slots = num_slots
        super().__init__(layers=[StaticLatentLayer(self) for _ in range(num_layers)])


def visible_keys_mask(key_valid: torch.Tensor, query_slots: torch.Tensor, attn_implementation: str, dtype):
    """4-D attention mask `[batch, 1, queries, slots]` over the slots of `key_valid` (`[batch, slots]`, the leading
    slots the step reads): a query sees the valid slots up to its own, and always itself.

    Built on the device from persistent buffers, so it can sit inside a captured step. `sdpa` takes it as booleans,
    `eager` as an additive float mask.
    """
    slots = torch.arange(key_valid.shape[1], device=key_valid.device)
    causal = slots[None, :] <= query_slots[:, None]  # [queries, slots]
    itself = slots[None, :] == query_slots[:, None]
    visible = causal[None] & (key_valid[:, None, :] | itself[None])  # [batch, queries, slots]
    visible = visible.unsqueeze(1)
    if attn_implementation == "eager":
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(dtype).min
        )
    return visible


# ----------------------------------------------------------------------------------------------------------------------
# Steps: one forward over persistent buffers, eager or replayed from a CUDA graph
# ----------------------------------------------------------------------------------------------------------------------


class StaticStep:
    """`forward()` reads only persistent buffers and returns a tensor. With a graph pool it is captured on its first
    call (after one eager warm-up run, which settles lazy allocations and kernel selection outside the capture) and
    replayed afterwards; the caller fills the buffers before each call. Runs are idempotent: the warm-up and the first
    replay write the same cache slots with the same values."""

    def __init__(self, forward, graph_pool=None):
        self.forward = forward
        self.graph_pool = graph_pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> torch.Tensor:
        if self.graph_pool is None:
            return self.forward()
        if self.graph is None:
            self.forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self.output = self.forward()
            self.graph = graph
        self.graph.replay()
        return self.output


class GenerationWorkspace:
    """Everything with a fixed address for requests of one batch bucket and one cache capacity: the latent cache,
    the input buffers of the steps, and the steps themselves (one prefill step per prompt bucket and one decode step
    per read bucket, at most MAX_PREFILL_STEPS and MAX_DECODE_STEPS of them, least recently used first out).

    The prefill inputs are one `[batch, slots, ...]` buffer each, which every prompt bucket reads a leading view of,
    so a new prompt bucket costs a graph, not new input buffers.
    """

    def __init__(self, model, batch_size: int, num_slots: int, graph_pool):
        text_config = model.language_model.config
        device = model.language_model.device
        self.model = model
        self.batch_size = batch_size
        self.num_slots = num_slots
        self.graph_pool = graph_pool
        self.cache = StaticLatentCache(text_config.num_hidden_layers, num_slots)
        self.key_valid = torch.zeros(batch_size, num_slots, dtype=torch.bool, device=device)
        # Prefill inputs: prompt embeddings and rotary positions (the bucket's tail is filler), the cache slot of each
        # prompt position, and the index of the last prompt token (a 1-D index for `logits_to_keep`). Sized for the
        # longest prompt the cache can take, every bucket reading a prefix: batch x slots x hidden, on top of the
        # latent cache's batch x slots x (kv_lora_rank + rope dim) per layer.
        self.prefill_embeds = torch.zeros(
            batch_size, num_slots, text_config.hidden_size, dtype=model.language_model.dtype, device=device
        )
        self.prefill_positions = torch.zeros(batch_size, num_slots, dtype=torch.long, device=device)
        self.prefill_slots = torch.arange(num_slots, device=device)
        self.prefill_last_index = torch.zeros(1, dtype=torch.long, device=device)
        self.prefill_steps: OrderedDict[int, StaticStep] = OrderedDict()
        # Decode inputs: the token fed at each row, its rotary position and its cache slot (shared by all rows). The
        # host keeps its own count of the filled slots, which picks the read bucket without reading the device.
        self.decode_input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.decode_positions = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.decode_slot = torch.zeros(1, dtype=torch.long, device=device)
        self.filled_slots = 0
        self.decode_steps: OrderedDict[int, StaticStep] = OrderedDict()

    def _run_language_model(self, read_slots: int, write_slots, position_ids, logits_index=None, **inputs):
        self.cache.read_slots = read_slots
        self.cache.write_slots = write_slots
        language_model = self.model.language_model
        # A query sits at the slot it writes.
        attention_mask = visible_keys_mask(
            self.key_valid[:, :read_slots],
            write_slots,
            language_model.config._attn_implementation,
            language_model.dtype,
        )
        outputs = language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_ARGUMENT: self.cache},
            use_cache=True,
            logits_to_keep=logits_index if logits_index is not None else 1,
            **inputs,
        )
        return outputs.logits[:, -1]

    def _step(self, steps: OrderedDict, key: int, limit: int, forward) -> StaticStep:
        """The step under `key` in `steps` (made from `forward` if missing), now the most recently used of them."""
        if key in steps:
            steps.move_to_end(key)
        else:
            steps[key] = StaticStep(forward, self.graph_pool)
            if len(steps) > limit:
                steps.popitem(last=False)
        return steps[key]

    def _prefill_step(self, length: int) -> StaticStep:
        def prefill_forward():
            return self._run_language_model(
                length,
                self.prefill_slots[:length],
                self.prefill_positions[:, :length],
                logits_index=self.prefill_last_index,
                inputs_embeds=self.prefill_embeds[:, :length],
            )

        return self._step(self.prefill_steps, length, MAX_PREFILL_STEPS, prefill_forward)

    def _decode_step(self, read_slots: int) -> StaticStep:
        def decode_forward():
            return self._run_language_model(
                read_slots, self.decode_slot, self.decode_positions, input_ids=self.decode_input_ids
            )

        return self._step(self.decode_steps, read_slots, MAX_DECODE_STEPS, decode_forward)

    def prefill(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        """Run the prompt (`[batch, T, hidden]`, left-padded, mask and positions as `generate` prepared them) and set
        up the decode buffers. Returns the logits of the last prompt token, `[batch, vocab]`."""
        batch_size, prompt_length = attention_mask.shape
        length = min(prompt_bucket(prompt_length), self.num_slots)
        step = self._prefill_step(length)
        self.prefill_embeds[:, :length].zero_()
        self.prefill_embeds[:batch_size, :prompt_length].copy_(inputs_embeds)
        self.prefill_positions[:, :length].zero_()
        self.prefill_positions[:batch_size, :prompt_length].copy_(position_ids)
        self.prefill_last_index.fill_(prompt_length - 1)
        # Prompt slots are valid where the mask says so (dummy rows: nowhere); every later slot will hold a generated
        # token by the time a query can see it.
        self.key_valid[:, :prompt_length] = False
        self.key_valid[:batch_size, :prompt_length] = attention_mask.bool()
        self.key_valid[:, prompt_length:] = True
        logits = step()[:batch_size]

        # The first decode step feeds slot T at the position after each row's last prompt token.
        self.filled_slots = prompt_length
        self.decode_slot.fill_(prompt_length - 1)
        self.decode_positions.zero_()
        self.decode_positions[:batch_size].copy_(position_ids[:, -1:])
        self.decode_input_ids.zero_()
        return logits

    def decode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (`[batch]`) and return the next logits, `[batch, vocab]`."""
        self.decode_input_ids[: input_ids.shape[0], 0].copy_(input_ids)
        self.decode_slot.add_(1)
        self.decode_positions.add_(1)
        self.filled_slots += 1
        step = self._decode_step(decode_read_bucket(self.filled_slots, self.num_slots))
        return step()[: input_ids.shape[0]]

    def warm_up_decode_steps(self) -> None:
        """Run (on CUDA: capture) the decode step of every read bucket up to the capacity, each with its query in the
        bucket's last slot. What it writes there is never seen: a request writes every slot before it can read it."""
        read_slots = decode_read_bucket(1, self.num_slots)
        while True:
            self.decode_slot.fill_(read_slots - 1)
            self._decode_step(read_slots)()
            if read_slots == self.num_slots:
                break
            read_slots = decode_read_bucket(read_slots + 1, self.num_slots)

    @property
    def num_graphs(self) -> int:
        return sum(step.captured for step in (*self.decode_steps.values(), *self.prefill_steps.values()))


def weights_key(model) -> tuple:
    """(device, dtype, address) of every parameter and buffer of the model: the memory a captured graph reads. Any
    tensor replaced (`.to()`, `load_state_dict(assign=True)`, a quantized layer) changes it; values written in place
    into the same tensors do not (the graphs read the new values)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    # A tensor-parallel parameter is a DTensor, whose memory is its local shard.
    return tuple((tensor.device, tensor.dtype, tensor.data_ptr()) for tensor in map(local_part, tensors))


class StaticGenerationState:
    """Per-model registry of workspaces, keyed by (batch bucket, cache slots), the graph pool they share, and the lock
    that makes static generation requests on one model run one at a time (they share the workspaces' buffers).

    At most MAX_WORKSPACES are kept, least recently used first out: each holds a whole latent cache, and request
    lengths vary (a server that sets `max_cache_len` uses one capacity for all requests, so one workspace per batch
    bucket). Graphs hold the addresses of the tensors they read, so everything is dropped when any parameter or buffer
    of the model is replaced by another tensor (checked at every request, see `weights_key`) or when graphs are
    switched on or off.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.workspaces: OrderedDict[tuple[int, int], GenerationWorkspace] = OrderedDict()
        self.graph_pool = None
        self.weights_key = None

    def __deepcopy__(self, memo) -> StaticGenerationState:
        # A copy of the model has its own weights; the workspaces and graphs here belong to the original.
        return StaticGenerationState()

    def __reduce__(self):
        # Likewise for a pickled model (torch.save(model)): it starts without workspaces, graphs or a held lock.
        return (StaticGenerationState, ())

    def workspace(self, model, batch_size: int, num_slots: int, use_graphs: bool) -> GenerationWorkspace:
        """The workspace for this request, created if needed. Call with `lock` held."""
        key_of_weights = (weights_key(model), use_graphs)
        if key_of_weights != self.weights_key:
            self.clear()
            self.weights_key = key_of_weights
        key = (batch_bucket(batch_size), num_slots)
        if key in self.workspaces:
            self.workspaces.move_to_end(key)
        else:
            if use_graphs and self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            self.workspaces[key] = GenerationWorkspace(model, *key, self.graph_pool if use_graphs else None)
            if len(self.workspaces) > MAX_WORKSPACES:
                self.workspaces.popitem(last=False)
        return self.workspaces[key]

    def clear(self) -> None:
        """Drop all workspaces and graphs. Call with `lock` held."""
        self.workspaces.clear()
        self.graph_pool = None
        self.weights_key = None


# ----------------------------------------------------------------------------------------------------------------------
# The mixin
# ----------------------------------------------------------------------------------------------------------------------


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
        """Build the workspace (and, on CUDA, capture the prefill graph and the decode graph of every read bucket up to
        the capacity) that a text request of this shape will use, so the first real request does not pay for it.
        `kwargs` go to `generate` (e.g. `max_cache_len`, `cuda_graphs`); image requests of the same token length use
        the same graphs.

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
        state = self._static_generation_state()
        with state.lock:  # static requests on one model share the workspaces' buffers: one at a time
            workspace = state.workspace(self, batch_size, num_slots, use_graphs)
            inputs_embeds = self.embed_inputs(input_ids, pixel_values=pixel_values, image_grid_hws=image_grid_hws)
            first_logits = workspace.prefill(inputs_embeds, attention_mask, position_ids)
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
            next_token_logits = workspace.decode(next_tokens)

        if streamer is not None:
            streamer.end()
        if return_dict:
            return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits)
        return input_ids

    def _check_static_request(self, input_ids, attention_mask, pixel_values, generation_config) -> None:
        """Reject what the static path cannot do, before anything runs."""
        if input_ids.shape[1] == 0:
            raise ValueError("generate(cache_implementation='static') needs a non-empty prompt in input_ids.")
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
        return -(-max_length // CACHE_SLOT_GRANULE) * CACHE_SLOT_GRANULE


__all__ = ["KimiVLStaticGenerationMixin", "StaticLatentCache"]
