"""The steps of Kimi-VL's fast generation and the workspaces that hold them.

A step is one language-model forward over persistent buffers of fixed shape (a `StaticStep`): on CUDA it is captured
into a CUDA graph the first time it runs and replayed afterwards; elsewhere, or with `cuda_graphs=False`, the very same
function runs eagerly. A `GenerationWorkspace` holds, for one batch bucket and one cache capacity, the latent cache
(static_cache_kimi_vl.py), the steps' input buffers and the steps: one prefill step per prompt bucket and one decode
step per read bucket. `StaticGenerationState` is a model's registry of workspaces.

A prefill step of bucket Lb reads (and masks) only the cache slots [0, Lb): nothing later can be visible to a prompt
query. Prompts longer than PREFILL_CHUNK_TOKENS are prefilled eagerly in chunks of that many tokens, each reading the
slots filled so far: the attention mask and the activations grow with the chunk, not with the prompt squared.

A decode step reads the filled slots rounded up to a read bucket (`decode_read_bucket`: 256, 384, 512, 768, 1024, ...,
capped at the capacity), so its cost follows the request's length, not the capacity: a large fixed
`max_cache_len` costs memory, not speed. Each read bucket has its own step (a graph on CUDA), chosen on the host from
the number of tokens fed so far, never from device values. With the absorbed MLA attention
(modeling_kimi_vl.KimiVLMLAAttention) a decode step reads each cached slot's latent once for all heads instead of
expanding it through `kv_b_proj`. Rows past the real batch are dummy prompts.

All graphs of a model share one memory pool. Graphs are not kept forever: workspaces, and the prefill and decode steps
inside a workspace, are evicted least recently used first (MAX_WORKSPACES, MAX_PREFILL_STEPS, MAX_DECODE_STEPS), and
everything is dropped when graphs are switched on or off or when any parameter or buffer of the model is replaced by
another tensor (`.to()`, `load_state_dict(assign=True)`, quantizing a layer); an evicted step is captured again when
it is next needed.

A workspace's buffers are shared by every request that uses it, so static generation requests on one model run one
at a time: a per-model lock serialises them (concurrent callers wait, they never share buffers).

Under tensor parallelism all ranks receive identical inputs, so they pick the same buckets, evict the same steps and
capture (or replay) the same graphs in the same order: the sequence of collectives matches across ranks.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import OrderedDict

import torch

from .parallel_kimi_vl import local_part
from .static_cache_kimi_vl import StaticLatentCache, visible_keys_mask
from .transformers_compat_modeling import CACHE_ARGUMENT

# Workspaces (a latent cache each, plus graphs) kept per model.
MAX_WORKSPACES = 8
# Prefill steps (one per prompt bucket, each a CUDA graph with its own output) kept per workspace.
MAX_PREFILL_STEPS = 8
# Longer prompts are prefilled in chunks of this many tokens, eagerly. In one piece, a prompt's attention mask is
# prompt x prompt (a 32K-token prompt: 1 GiB of booleans, and twice that as the additive mask SDPA makes of it) and its
# MoE activations grow with it; in chunks both are chunk-sized. Such prefill is compute-bound, so replaying it from a
# CUDA graph would gain nothing, and one graph per chunk offset would be many.
PREFILL_CHUNK_TOKENS = 4096
# The smallest number of cache slots a decode step reads; larger read buckets grow geometrically from here up to the
# capacity (see decode_read_bucket).
MIN_DECODE_READ_SLOTS = 256
# Decode steps (one per read bucket) kept per workspace. A long request walks the read buckets in ascending order, so
# the bound holds all of them for any capacity up to 256 * 2**11 = 512K slots (23 buckets; Kimi-VL's 128K context
# takes 19): evicting one would make every request capture it again.
MAX_DECODE_STEPS = 24


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `value` (both positive integers)."""
    return -(-value // multiple) * multiple


def batch_bucket(batch_size: int) -> int:
    """1, 2, 4, 8, then multiples of 8: at most 2x padding for small batches, at most 7 dummy rows beyond."""
    if batch_size <= 8:
        return 1 << (batch_size - 1).bit_length()
    return round_up(batch_size, 8)


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
    return round_up(length, 256)


@functools.cache
def capture_stream(device_index: int) -> torch.cuda.Stream:
    """The side stream of every capture on one CUDA device. `torch.cuda.graph`'s default is one stream per process,
    made on whichever device captured first: a capture for a model on another device would switch to that device and
    record none of the model's work. One stream per device also lets the captures share the pool's memory."""
    return torch.cuda.Stream(device_index)


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
            with torch.cuda.graph(graph, pool=self.graph_pool, stream=capture_stream(torch.cuda.current_device())):
                self.output = self.forward()
            self.graph = graph
        self.graph.replay()
        return self.output


class GenerationWorkspace:
    """Everything with a fixed address for requests of one batch bucket and one cache capacity: the latent cache,
    the input buffers of the steps, and the steps themselves (one prefill step per prompt bucket and one decode step
    per read bucket, at most MAX_PREFILL_STEPS and MAX_DECODE_STEPS of them, least recently used first out).

    The prefill inputs are one `[batch, length, ...]` buffer each, which every prompt bucket (and every chunk of a long
    prompt) reads a leading view of, so a new prompt bucket costs a graph, not new input buffers. Their length follows
    the longest prompt bucket seen, up to PREFILL_CHUNK_TOKENS, not the capacity (a server-sized `max_cache_len` would
    otherwise hold batch x capacity x hidden for embeddings no prompt fills): they grow, at least doubling, when a
    longer prompt comes, and the prefill steps captured over the old buffers are dropped then.
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
        # prompt position, and the index of the last prompt token (a 1-D index for `logits_to_keep`). Allocated by the
        # first prefill and grown by `_reserve_prefill_inputs`; every bucket reads a prefix.
        self.prefill_embeds = torch.zeros(
            batch_size, 0, text_config.hidden_size, dtype=model.language_model.dtype, device=device
        )
        self.prefill_positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self.prefill_slots = torch.arange(0, device=device)
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

    def _reserve_prefill_inputs(self, length: int) -> None:
        """Make the prefill input buffers hold at least `length` positions (doubling, up to a chunk or the capacity).
        The prefill steps made so far read the old buffers (a captured graph keeps their addresses): they go too."""
        held = self.prefill_slots.shape[0]
        if length <= held:
            return
        size = min(self.num_slots, max(length, min(2 * held, PREFILL_CHUNK_TOKENS)))
        self.prefill_steps.clear()
        self.prefill_embeds = self.prefill_embeds.new_zeros(self.batch_size, size, self.prefill_embeds.shape[-1])
        self.prefill_positions = self.prefill_positions.new_zeros(self.batch_size, size)
        self.prefill_slots = torch.arange(size, device=self.prefill_slots.device)

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

    def _fill_prefill_inputs(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, length: int) -> None:
        """The leading `length` positions of the prefill buffers: the given prompt positions, then filler (zeros),
        and zeros for the dummy rows."""
        batch_size, given = position_ids.shape
        self.prefill_embeds[:, :length].zero_()
        self.prefill_embeds[:batch_size, :given].copy_(inputs_embeds)
        self.prefill_positions[:, :length].zero_()
        self.prefill_positions[:batch_size, :given].copy_(position_ids)

    def _prefill_in_one_step(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        prompt_length = position_ids.shape[1]
        length = min(prompt_bucket(prompt_length), self.num_slots)
        self._reserve_prefill_inputs(length)
        step = self._prefill_step(length)
        self._fill_prefill_inputs(inputs_embeds, position_ids, length)
        self.prefill_last_index.fill_(prompt_length - 1)
        return step()

    def _prefill_in_chunks(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Eagerly, PREFILL_CHUNK_TOKENS prompt positions at a time: each chunk writes its own slots and reads all the
        slots filled so far (the mask keeps it causal)."""
        prompt_length = position_ids.shape[1]
        self._reserve_prefill_inputs(PREFILL_CHUNK_TOKENS)
        for start in range(0, prompt_length, PREFILL_CHUNK_TOKENS):
            end = min(start + PREFILL_CHUNK_TOKENS, prompt_length)
            self._fill_prefill_inputs(inputs_embeds[:, start:end], position_ids[:, start:end], end - start)
            self.prefill_last_index.fill_(end - 1 - start)
            logits = self._run_language_model(
                end,
                self.prefill_slots[: end - start] + start,
                self.prefill_positions[:, : end - start],
                logits_index=self.prefill_last_index,
                inputs_embeds=self.prefill_embeds[:, : end - start],
            )
        return logits

    def prefill(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        """Run the prompt (`[batch, T, hidden]`, left-padded, mask and positions as `generate` prepared them) and set
        up the decode buffers. Returns the logits of the last prompt token, `[batch, vocab]`."""
        batch_size, prompt_length = attention_mask.shape
        # Prompt slots are valid where the mask says so (dummy rows: nowhere); every later slot will hold a generated
        # token by the time a query can see it.
        self.key_valid[:, :prompt_length] = False
        self.key_valid[:batch_size, :prompt_length] = attention_mask.bool()
        self.key_valid[:, prompt_length:] = True
        if prompt_length <= PREFILL_CHUNK_TOKENS:
            logits = self._prefill_in_one_step(inputs_embeds, position_ids)[:batch_size]
        else:
            logits = self._prefill_in_chunks(inputs_embeds, position_ids)[:batch_size]

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
    bucket). Graphs hold the addresses of the tensors they read and the kernels chosen when they were captured, so
    everything is dropped when any parameter or buffer of the model is replaced by another tensor (checked at every
    request, see `weights_key`), when the attention or experts implementation changes (`set_attn_implementation`,
    `set_experts_implementation`), or when graphs are switched on or off.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.workspaces: OrderedDict[tuple[int, int], GenerationWorkspace] = OrderedDict()
        self.graph_pool = None
        self.captured_against = None  # what the kept steps were built for: weights, graphs, kernels

    def __deepcopy__(self, memo) -> StaticGenerationState:
        # A copy of the model has its own weights; the workspaces and graphs here belong to the original.
        return StaticGenerationState()

    def __reduce__(self):
        # Likewise for a pickled model (torch.save(model)): it starts without workspaces, graphs or a held lock.
        return (StaticGenerationState, ())

    def workspace(self, model, batch_size: int, num_slots: int, use_graphs: bool) -> GenerationWorkspace:
        """The workspace for this request, created if needed. Call with `lock` held."""
        text_config = model.language_model.config
        captured_against = (
            weights_key(model),
            use_graphs,
            text_config._attn_implementation,
            text_config._experts_implementation,
        )
        if captured_against != self.captured_against:
            self.clear()
            self.captured_against = captured_against
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
        self.captured_against = None


__all__ = [
    "GenerationWorkspace",
    "StaticGenerationState",
    "StaticStep",
    "batch_bucket",
    "decode_read_bucket",
    "prompt_bucket",
    "round_up",
]
