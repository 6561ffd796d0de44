"""The static latent cache of Kimi-VL's fast generation, and the attention mask over its slots.

The cache holds only what DeepSeek-V3's MLA attention hands to `Cache.update`: per layer, the compressed KV latent and
the rotated shared key. It has a fixed number of slots; the step that runs the model (static_steps_kimi_vl.py) says
which slots it writes and how many leading slots attention reads.

Layout of one request in a cache of C slots (prompt of T tokens, prefill bucket Lb):

    cache slot:  0 ........... T-1 | T ............ Lb-1 | Lb ............ C-1
    prefill:     prompt as given     | filler: written,     | not read
                 (left padding kept) | output unused        |
    decode:                          | generated token i is written at slot T+i (over the filler)

The prompt keeps its own left padding, so every real token sits in the same cache slot and has the same rotary
position as in plain `generate()`; that is what keeps greedy outputs identical. Which slots a query may see is derived
from one `key_valid [batch, slots]` buffer (padding excluded) and the query's own slot (causality); a query always sees
itself, so no attention row is ever fully masked (an all-masked row would give NaN, and 0 * NaN poisons every row that
reads it).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


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


__all__ = ["StaticLatentCache", "StaticLatentLayer", "visible_keys_mask"]
