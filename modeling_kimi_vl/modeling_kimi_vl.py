"""Kimi-VL on transformers 5.x: the MoonViT vision tower, the patch-merging projector, and transformers' native
DeepSeek-V3 language model, with module names that give exactly the key layout of the published checkpoints.

Data flow of one multimodal forward:

    pixel_values [L, 3, 14, 14], image_grid_hws [N, 2]      (all images' patches, concatenated in image order)
      -> MoonViTModel                   -> merged patches  [M, 4, vision hidden]   (M = sum rows*cols/4)
      -> KimiVLMultiModalProjector      -> image features  [M, text hidden]        (get_image_features: per image)
      -> written over the <|media_pad|> rows of the token embeddings, in order    (embed_inputs, get_placeholder_mask)
      -> DeepseekV3ForCausalLM          -> logits
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPooling, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import is_flash_attention_requested
from transformers.utils.output_capturing import capture_outputs

from .configuration_kimi_vl import KimiVLConfig, MoonViTConfig, check_mm_encoder_tp_mode, tokens_per_image
from .generation_kimi_vl import KimiVLStaticGenerationMixin
from .parallel_kimi_vl import (
    check_kimi_vl_tp_size,
    check_vision_tp_mode_unchanged,
    encode_images_data_parallel,
    local_part,
)
from .quantization_kimi_vl import register_weight_only_quantization
from .transformers_compat_modeling import CACHE_ARGUMENT

# `quant_method: kimi_vl_weight_only` becomes known to from_pretrained here, in the file that defines the model, not in
# the package's __init__.py: an exported repository ships this file without the __init__.py, and transformers'
# remote-code loader imports it (the auto_map's model class) before `from_pretrained` looks the config's
# quantization_config up (`get_hf_quantizer`), so a quantized repository loads with trust_remote_code=True alone.
register_weight_only_quantization()

# The released MoonViT fixes these in code rather than in its config.
MOONVIT_LAYER_NORM_EPS = 1e-5
MOONVIT_ROPE_THETA = 10000.0
# The original precomputes a 512 x 512 rotary table: patch rows and columns must stay below this.
MOONVIT_MAX_GRID_SIDE = 512
# Language-model queries of at most this many tokens attend over the MLA latent directly (the absorbed form); longer
# ones expand the latent through kv_b_proj. Measured on a 2-core CPU (one layer at Kimi-VL-A3B's sizes, 4K cached
# tokens, fp32; `python -m benchmarks.bench_long_context --crossover`): absorbed 17x faster for 1 query token, 2.8x for
# 64, 1.6x for 128, 1.1x for 256, 0.87x for 512. The limit keeps a margin below the crossover and bounds the scores the
# absorbed form materialises (heads x query x context; the expanded form hands that to SDPA's kernels).
ABSORBED_MAX_QUERY_LENGTH = 128


# ----------------------------------------------------------------------------------------------------------------------
# Host-side description of a packed batch of images
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedImages:
    """The image boundaries of a packed batch, built once per vision forward from host-side grids.

    Every layer receives this object, so no layer reads a device tensor back to the host: the grids are read once,
    by `read_image_grids`.
    """

    grid_hws: tuple[tuple[int, int], ...]  # (rows, cols) of patches per image
    lengths: tuple[int, ...]  # patches per image
    device: torch.device

    @classmethod
    def from_grids(cls, grid_hws, device: torch.device) -> "PackedImages":
        grid_hws = tuple((rows, cols) for rows, cols in grid_hws)
        return cls(grid_hws=grid_hws, lengths=tuple(rows * cols for rows, cols in grid_hws), device=device)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths, default=0)

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 `[N + 1]` on the compute device, for varlen kernels (made on first use: only flash attention needs
        it, and then every layer gets the same tensor)."""
        return torch.tensor([0, *self.lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device)


def read_image_grids(pixel_values: torch.Tensor, image_grid_hws: torch.Tensor, config: MoonViTConfig) -> list:
    """The validated `(rows, cols)` of every image as host ints: the one device->host read of a vision forward."""
    patch = config.patch_size
    if not isinstance(pixel_values, torch.Tensor) or not isinstance(image_grid_hws, (torch.Tensor, type(None))):
        raise TypeError(
            f"pixel_values and image_grid_hws must be tensors (the processor returns them with return_tensors='pt'), "
            f"got {type(pixel_values).__name__} and {type(image_grid_hws).__name__}."
        )
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, patch, patch):
        raise ValueError(
            f"pixel_values must have shape [num_patches, 3, {patch}, {patch}] (all images' patches, as the processor "
            f"returns them), got {tuple(pixel_values.shape)}."
        )
    if image_grid_hws is None:
        raise ValueError("pixel_values were given without image_grid_hws; the processor returns both.")
    if image_grid_hws.ndim != 2 or image_grid_hws.shape[-1] != 2:
        raise ValueError(f"image_grid_hws must have shape [num_images, 2], got {tuple(image_grid_hws.shape)}.")
    grid_hws = [(int(rows), int(cols)) for rows, cols in image_grid_hws.tolist()]
    validate_grids(grid_hws, pixel_values.shape[0], config.merge_kernel_size)
    return grid_hws


def validate_grids(grid_hws, num_patches: int, merge_kernel_size) -> None:
    """Reject grids the model cannot encode faithfully, naming the offending numbers."""
    kernel_rows, kernel_cols = merge_kernel_size
    for index, (rows, cols) in enumerate(grid_hws):
        if rows <= 0 or cols <= 0:
            raise ValueError(f"image {index}: grid {rows}x{cols} is empty; every image needs at least one patch.")
        if rows % kernel_rows or cols % kernel_cols:
            raise ValueError(
                f"image {index}: grid {rows}x{cols} is not divisible by the merge kernel "
                f"{kernel_rows}x{kernel_cols}; the image processor pads images so that it always is."
            )
        if rows >= MOONVIT_MAX_GRID_SIDE or cols >= MOONVIT_MAX_GRID_SIDE:
            raise ValueError(
                f"image {index}: grid {rows}x{cols} reaches the {MOONVIT_MAX_GRID_SIDE} rotary positions MoonViT "
                f"supports per side; scale the image down (the image processor does this for you)."
            )
    expected = sum(rows * cols for rows, cols in grid_hws)
    if expected != num_patches:
        raise ValueError(
            f"pixel_values holds {num_patches} patches but image_grid_hws describes {expected} "
            f"({len(grid_hws)} images: {list(grid_hws)})."
        )


# ----------------------------------------------------------------------------------------------------------------------
# MoonViT
# ----------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def bicubic_resize_matrix(new_size: int, old_size: int, device: torch.device) -> torch.Tensor:
    """`[new_size, old_size]` float32 weights of PyTorch's 1-D bicubic resize (align_corners=False, border clamped).

    Resizing an identity image along one axis yields that axis's weights (the other axis keeps its size, where bicubic
    weights are exactly one-hot). Cached per sizes and device (at most 128 entries of at most 511 x 64 floats); built
    outside inference mode and autograd, so one matrix serves inference and training alike.
    """
    with torch.inference_mode(False), torch.no_grad():
        identity = torch.eye(old_size, device=device)[None, None]
        return F.interpolate(identity, size=(new_size, old_size), mode="bicubic", align_corners=False)[0, 0]


class MoonViTPositionEmbedding(nn.Module):
    """The learned (height, width, dim) position table, resized to each image's patch grid.

    The release resizes with PyTorch's bicubic interpolation (align_corners=False, no antialias) on every call. That
    resize is separable: along each axis it is a fixed matrix of cubic weights (`bicubic_resize_matrix`), so
    `resized = rows_matrix @ table @ cols_matrix^T`. The matrices depend only on the sizes, never on the weights, so
    caching them stays valid through training steps, reloads and in-place edits of the table; gradients flow to the
    table as usual. The products run in float32 (autocast off) and are rounded to the table's dtype once: equal to
    the float32 resize (2e-7 relative); in bf16 that can differ by one unit in the last place from a bf16 resize.
    """

    def __init__(self, height: int, width: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def forward(self, grid_hws) -> torch.Tensor:
        """Returns the position embedding of every patch, `[sum rows*cols, dim]`, images concatenated."""
        return torch.cat([self._table_for(rows, cols) for rows, cols in grid_hws])

    def _table_for(self, rows: int, cols: int) -> torch.Tensor:
        height, width, dim = self.weight.shape
        if (rows, cols) == (height, width):
            return self.weight.flatten(0, 1)
        device = self.weight.device
        rows_matrix = bicubic_resize_matrix(rows, height, device)  # [rows, height]
        cols_matrix = bicubic_resize_matrix(cols, width, device)  # [cols, width]
        with torch.autocast(device.type, enabled=False):
            resized = (rows_matrix @ self.weight.float().reshape(height, width * dim)).view(rows, width, dim)
            resized = cols_matrix @ resized  # [rows, cols, dim]
        return resized.to(self.weight.dtype).flatten(0, 1)


class MoonViTPatchEmbed(nn.Module):
    """Linear patch projection (a stride-14 convolution over each 14x14 patch) plus the absolute position table."""

    def __init__(self, config: MoonViTConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size)
        self.pos_emb = MoonViTPositionEmbedding(
            config.init_pos_emb_height, config.init_pos_emb_width, config.hidden_size
        )

    def forward(self, pixel_values: torch.Tensor, grid_hws) -> torch.Tensor:
        patches = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)  # [L, hidden]
        return patches + self.pos_emb(grid_hws)


def moonvit_rotary_angles(grid_hws, head_dim: int, device: torch.device) -> torch.Tensor:
    """Rotation angles of MoonViT's 2-D rotary embedding, `[L, head_dim // 2]` float32.

    The head dim is viewed as head_dim/2 adjacent pairs. With frequencies f_i = theta^(-4i/head_dim): pair 2i turns by
    col * f_i and pair 2i+1 by row * f_i (the column drives the even pairs, as in the released code).
    """
    freqs = MOONVIT_ROPE_THETA ** (
        -torch.arange(0, head_dim, 4, dtype=torch.float32, device=device)[: head_dim // 4] / head_dim
    )
    positions = [torch.arange(rows * cols, device=device) for rows, cols in grid_hws]
    rows = torch.cat([index // cols for index, (_, cols) in zip(positions, grid_hws)]).float()
    cols = torch.cat([index % cols for index, (_, cols) in zip(positions, grid_hws)]).float()
    angles = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1)  # [L, head_dim/4, 2]
    return angles.flatten(1)


def apply_moonvit_rotary(states: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate `[L, heads, head_dim]` by the complex `rotation [L, head_dim/2]`, in float32 whatever the model dtype."""
    pairs = torch.view_as_complex(states.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation.unsqueeze(1)).flatten(-2).type_as(states)


def eager_attention_forward(module, query, key, value, attention_mask, scaling: float, **kwargs):
    """Reference attention over `[batch, heads, seq, head_dim]`, for `attn_implementation="eager"`."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class MoonViTPackedAttention(nn.Module):
    """Non-causal attention of every image with itself over the packed batch: block-diagonal, never across images.

    It has no parameters (the projections are the block's `wqkv` and `wo`, where the checkpoints have them); it is a
    module of its own so that `output_attentions=True` records its weights with transformers' output hooks. Returns the
    output `[1, L, heads, head_dim]` and the weights: per image `[1, heads, n_i, n_i]` where the kernel gives them
    (eager), else None.
    """

    def __init__(self, config: MoonViTConfig):
        super().__init__()
        self.config = config
        self.scaling = (config.hidden_size // config.num_attention_heads) ** -0.5
        self.is_causal = False

    def forward(self, query, key, value, packed: PackedImages):
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        if is_flash_attention_requested(self.config):
            # Varlen kernel over the packed sequence: one call, image boundaries from cu_seqlens.
            return attention_interface(
                self, query, key, value, attention_mask=None, scaling=self.scaling, is_causal=False,
                cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens,
                max_length_q=packed.max_seqlen, max_length_k=packed.max_seqlen,
            )  # fmt: skip
        # Dense kernels run image by image: exactly the block-diagonal attention, without an L x L mask in memory
        # (L reaches 16k patches). Splits use host-side lengths, so no device sync happens here.
        per_image = zip(*(states.split(packed.lengths, dim=2) for states in (query, key, value)))
        outputs, weights = zip(
            *(
                attention_interface(self, q, k, v, attention_mask=None, scaling=self.scaling, is_causal=False)
                for q, k, v in per_image
            )
        )
        return torch.cat(outputs, dim=1), None if weights[0] is None else weights


class MoonViTMLP(nn.Module):
    def __init__(self, config: MoonViTConfig):
        super().__init__()
        self.fc0 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc1 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(hidden_states), approximate="tanh"))


class MoonViTEncoderLayer(GradientCheckpointingLayer):
    """Pre-norm transformer block. Attention stays within each image (non-causal, block-diagonal over the batch).

    `wqkv` rows are all q heads, then all k heads, then all v heads; the head count is read from the projection's
    output so that a tensor-parallel shard (whole heads per rank) runs the same code.
    """

    def __init__(self, config: MoonViTConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.norm0 = nn.LayerNorm(config.hidden_size, eps=MOONVIT_LAYER_NORM_EPS)
        self.wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.packed_attention = MoonViTPackedAttention(config)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=MOONVIT_LAYER_NORM_EPS)
        self.mlp = MoonViTMLP(config)

    def forward(self, hidden_states: torch.Tensor, rotation: torch.Tensor, packed: PackedImages) -> torch.Tensor:
        hidden_states = hidden_states + self.attention(self.norm0(hidden_states), rotation, packed)
        return hidden_states + self.mlp(self.norm1(hidden_states))

    def attention(self, hidden_states: torch.Tensor, rotation: torch.Tensor, packed: PackedImages) -> torch.Tensor:
        num_patches = hidden_states.shape[0]
        query, key, value = self.wqkv(hidden_states).view(num_patches, 3, -1, self.head_dim).unbind(1)
        query, key = apply_moonvit_rotary(query, rotation), apply_moonvit_rotary(key, rotation)
        # transformers' attention functions take [batch, heads, seq, head_dim]; the packed images are one "batch row".
        query, key, value = (states.transpose(0, 1).unsqueeze(0) for states in (query, key, value))
        attn_output, _ = self.packed_attention(query, key, value, packed)
        return self.wo(attn_output.reshape(num_patches, -1))


class MoonViTEncoder(nn.Module):
    def __init__(self, config: MoonViTConfig):
        super().__init__()
        self.blocks = nn.ModuleList([MoonViTEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=MOONVIT_LAYER_NORM_EPS)

    def forward(self, hidden_states: torch.Tensor, rotation: torch.Tensor, packed: PackedImages) -> torch.Tensor:
        for block in self.blocks:
            hidden_states = block(hidden_states, rotation, packed)
        return self.final_layernorm(hidden_states)


def merge_patches(hidden_states: torch.Tensor, grid_hws, merge_kernel_size) -> torch.Tensor:
    """Group each image's kernel_rows x kernel_cols neighbourhoods: `[L, C] -> [L / k, k, C]`.

    Merged tokens come in row-major order; inside one, the sources are top-left, top-right, bottom-left, bottom-right.
    """
    kernel_rows, kernel_cols = merge_kernel_size
    hidden = hidden_states.shape[-1]
    merged = []
    for (rows, cols), image in zip(grid_hws, hidden_states.split([r * c for r, c in grid_hws])):
        image = image.view(rows // kernel_rows, kernel_rows, cols // kernel_cols, kernel_cols, hidden)
        merged.append(image.permute(0, 2, 1, 3, 4).reshape(-1, kernel_rows * kernel_cols, hidden))
    return torch.cat(merged)


class KimiVLPreTrainedModel(PreTrainedModel):
    """What the vision tower and the full model share: the attention backends, gradient checkpointing, weight
    initialisation, and the load-time check of the tensor-parallel size."""

    config: KimiVLConfig
    base_model_prefix = ""
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["MoonViTEncoderLayer", "DeepseekV3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MoonViTPositionEmbedding):
            nn.init.normal_(module.weight, std=self.config.initializer_range)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers decides this by looking for `@use_experts_implementation` in the model class's own source file;
        # the routed experts here are DeepSeek-V3's, which carry it, in the nested language model.
        return True

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, *mesh_args):
        # from_pretrained calls this once, after building the model and before sharding or reading any weight.
        if distributed_config is not None:
            check_kimi_vl_tp_size(model.config, distributed_config.tp_size or 1)
        return super().maybe_distribute_model(model, distributed_config, *mesh_args)


class MoonViTModel(KimiVLPreTrainedModel):
    """The vision tower: `pixel_values [L, 3, p, p]` + grids -> merged patches `[sum rows*cols/4, 4, hidden]`."""

    config: MoonViTConfig
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    _no_split_modules = ["MoonViTEncoderLayer"]
    _can_record_outputs = {"hidden_states": MoonViTEncoderLayer, "attentions": MoonViTPackedAttention}

    def __init__(self, config: MoonViTConfig):
        super().__init__(config)
        self.patch_embed = MoonViTPatchEmbed(config)
        self.encoder = MoonViTEncoder(config)
        self.post_init()

    # The recorded last hidden state stays the last block's output: `last_hidden_state` is merged, a different shape.
    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self, pixel_values: torch.Tensor, image_grid_hws: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
    ) -> BaseModelOutput:
        r"""
        pixel_values (`torch.FloatTensor` of shape `[total patches, 3, patch, patch]`):
            All images' patches, concatenated in image order, as the processor returns them.
        image_grid_hws (`torch.LongTensor` of shape `[num_images, 2]`):
            Patch rows and columns of each image.

        Returns a `BaseModelOutput`: `last_hidden_state` holds the merged patches `[sum rows*cols/4, 4, hidden]` in
        image order (`[0, 4, hidden]` for no images). With `output_hidden_states=True`, `hidden_states` holds the patch
        embeddings and every block's output, `[total patches, hidden]` each; with `output_attentions=True` and the
        eager implementation, `attentions` holds every block's weights, per image `[1, heads, n_i, n_i]`.
        """
        grid_hws = read_image_grids(pixel_values, image_grid_hws, self.config)
        kernel_rows, kernel_cols = self.config.merge_kernel_size
        if not grid_hws:
            merged = pixel_values.new_zeros((0, kernel_rows * kernel_cols, self.config.hidden_size), dtype=self.dtype)
            return BaseModelOutput(last_hidden_state=merged)
        packed = PackedImages.from_grids(grid_hws, pixel_values.device)
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        angles = moonvit_rotary_angles(packed.grid_hws, head_dim, pixel_values.device)
        rotation = torch.polar(torch.ones_like(angles), angles)
        hidden_states = self.patch_embed(pixel_values, packed.grid_hws)
        hidden_states = self.encoder(hidden_states, rotation, packed)
        merged = merge_patches(hidden_states, packed.grid_hws, self.config.merge_kernel_size)
        return BaseModelOutput(last_hidden_state=merged)


# ----------------------------------------------------------------------------------------------------------------------
# Projector and the full model
# ----------------------------------------------------------------------------------------------------------------------


class KimiVLMultiModalProjector(nn.Module):
    """LayerNorm on each of the merged sub-tokens, flatten them, then a two-layer MLP into the text hidden size."""

    def __init__(self, config: KimiVLConfig):
        super().__init__()
        vision_hidden = config.vision_config.hidden_size
        kernel_rows, kernel_cols = config.vision_config.merge_kernel_size
        merged_hidden = vision_hidden * kernel_rows * kernel_cols
        self.pre_norm = nn.LayerNorm(vision_hidden, eps=MOONVIT_LAYER_NORM_EPS)
        self.linear_1 = nn.Linear(merged_hidden, merged_hidden)
        self.linear_2 = nn.Linear(merged_hidden, config.text_config.hidden_size)

    def forward(self, merged_patches: torch.Tensor) -> torch.Tensor:
        hidden_states = self.pre_norm(merged_patches).flatten(1)
        return self.linear_2(F.gelu(self.linear_1(hidden_states)))


# ----------------------------------------------------------------------------------------------------------------------
# Language model: MLA attention that attends over the cached latent for short queries
# ----------------------------------------------------------------------------------------------------------------------


class KimiVLMLAAttention(DeepseekV3Attention):
    """transformers' DeepSeek-V3 MLA attention (same parameters, same cache contents), plus the absorbed form for short
    queries without gradients: decode steps, and multi-token queries up to `absorb_max_query_length` tokens.

    The cache holds, per token, the normalised latent `c` (`[B, 1, L, kv_lora_rank]`) and the rotated shared rope key
    `k_pe` (`[B, 1, L, rope]`). The expanded form (the parent's) turns every cached token into per-head keys and values
    through `kv_b_proj` at every step: work and temporaries of heads x context x (nope + v). The absorbed form moves
    `kv_b_proj` to the query and output side instead, which is exact algebra:

        q_lat[h] = q_nope[h] @ W_UK[h]                       W_UK[h] = kv_b_proj rows of head h's key   [nope, R]
        scores   = (q_lat . c + q_pe . k_pe) * scaling       one key "head" of width R + rope, shared by all heads
        out[h]   = (softmax(scores) @ c) @ W_UV[h]^T          W_UV[h] = kv_b_proj rows of head h's value [v, R]

    The heads are laid out as query rows of that single key head, so one batched matmul reads each cached token once
    for all heads, and nothing of size heads x context x head_dim is formed. `W_UK`/`W_UV` are views of
    `kv_b_proj.weight` taken at every call (nothing derived is kept, so a new or edited weight takes effect at once);
    under tensor parallelism each rank's local weight holds whole heads, and those are the heads its queries have.

    The expanded form stays for long queries (prefill is compute-bound and cheaper expanded), for gradients (training
    keeps transformers' path), for attention implementations other than "eager"/"sdpa" (their masks have other forms),
    and when `kv_b_proj` is not a plain `nn.Linear` (a LoRA adapter or a quantized layer holds more than `.weight`).
    `absorb_max_query_length = 0` on a module (or the class) switches the absorbed form off (for comparisons).
    """

    absorb_max_query_length = ABSORBED_MAX_QUERY_LENGTH

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        # transformers >= 5.24 passes the cache as `cache`, earlier releases as `past_key_values`.
        cache = kwargs.pop(CACHE_ARGUMENT, None)
        if not self.uses_absorbed_form(hidden_states):
            return super().forward(
                hidden_states, position_embeddings, attention_mask, **{CACHE_ARGUMENT: cache}, **kwargs
            )

        # The projections, rotary embedding and cache update are the parent's, step for step (it has no seam to reuse
        # them without also expanding the latent): the cache receives exactly what the expanded form stores.
        batch_size, query_length = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_states = q_states.view(batch_size, query_length, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_nope, k_rot = torch.split(
            self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_nope = self.kv_a_layernorm(kv_nope).view(batch_size, 1, query_length, self.kv_lora_rank)
        k_rot = k_rot.view(batch_size, 1, query_length, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        rotate = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        if cache is not None:
            kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx)

        attn_output, attn_weights = self.absorbed_attention(q_nope, q_rot, kv_nope, k_rot, attention_mask)
        attn_output = attn_output.transpose(1, 2).reshape(batch_size, query_length, -1)
        return self.o_proj(attn_output), attn_weights

    def uses_absorbed_form(self, hidden_states: torch.Tensor) -> bool:
        """Decided from shapes, modes and types only (host-side facts: the same on every rank, no device reads)."""
        return (
            hidden_states.shape[1] <= self.absorb_max_query_length
            and not torch.is_grad_enabled()
            and not (self.training and self.attention_dropout > 0)
            and self.config._attn_implementation in ("eager", "sdpa")
            and type(self.kv_b_proj) is nn.Linear
        )

    def absorbed_attention(self, q_nope, q_rot, latent, k_rot, attention_mask):
        """Queries `q_nope [B, H, q, nope]`, `q_rot [B, H, q, rope]` over the latent `[B, 1, L, R]` and rope keys
        `[B, 1, L, rope]`; returns per-head outputs `[B, H, q, v]` and the attention probabilities `[B, H, q, L]` (as
        the eager parent does; None for sdpa, like transformers' sdpa)."""
        batch_size, num_heads, query_length, _ = q_nope.shape
        key_length = latent.shape[2]
        kv_b_weight = local_part(self.kv_b_proj.weight).view(num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        w_uk, w_uv = kv_b_weight.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        # The scaling is applied to the (small) queries before the products, as SDPA does: smaller intermediates in
        # fp16/bf16, and the same mathematical scale as the parent (1/sqrt(nope + rope), times yarn's mscale^2).
        q_latent = torch.matmul(q_nope * self.scaling, w_uk)  # [B, H, q, R]
        q_rope = q_rot * self.scaling
        latent, k_rot = latent.squeeze(1), k_rot.squeeze(1)  # [B, L, R], [B, L, rope]: the one shared key head
        scores = torch.baddbmm(
            torch.bmm(q_rope.reshape(batch_size, -1, self.qk_rope_head_dim), k_rot.transpose(1, 2)),
            q_latent.reshape(batch_size, -1, q_latent.shape[-1]),
            latent.transpose(1, 2),
        ).view(batch_size, num_heads, query_length, key_length)
        # Masks are [B, 1, q, >= L]: they broadcast over the heads, which are the rows of `scores` per query.
        if attention_mask is None:
            if query_length > 1:  # what sdpa's is_causal means when transformers leaves the mask out (q == L)
                causal = torch.ones(query_length, key_length, dtype=torch.bool, device=scores.device)
                scores = scores.masked_fill(~causal.tril(key_length - query_length), torch.finfo(scores.dtype).min)
        elif attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask[..., :key_length], torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask[..., :key_length]
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(latent.dtype)
        latent_output = torch.bmm(probabilities.view(batch_size, -1, key_length), latent)  # [B, H*q, R]
        output = torch.matmul(latent_output.view(batch_size, num_heads, query_length, -1), w_uv.transpose(1, 2))
        return output, probabilities if self.config._attn_implementation == "eager" else None


class KimiVLForConditionalGeneration(KimiVLPreTrainedModel, KimiVLStaticGenerationMixin, GenerationMixin):
    """Kimi-VL for image-text-to-text generation. Submodules are named as in the release, so its checkpoints load
    unchanged: `vision_tower.*`, `multi_modal_projector.*`, `language_model.{model,lm_head}.*`."""

    def __init__(self, config: KimiVLConfig):
        super().__init__(config)
        self.vision_tower = MoonViTModel(config.vision_config)
        self.multi_modal_projector = KimiVLMultiModalProjector(config)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        for layer in self.language_model.model.layers:  # same parameter names: checkpoints and TP plans unchanged
            layer.self_attn = KimiVLMLAAttention(config.text_config, layer.self_attn.layer_idx)
        self.post_init()

    def init_parallel_plans(self) -> None:
        """post_init composes the tensor-parallel plan from the declared ones: `KimiVLConfig.base_model_tp_plan` (the
        MLA attention) and the nested models' (`vision_tower.*` from `MoonViTConfig`, `language_model.*` from
        `DeepseekV3Config`). In data mode the vision tower stays whole: every rank runs all of it on its share of the
        images. The projector is always replicated."""
        super().init_parallel_plans()
        # from_pretrained(..., mm_encoder_tp_mode=...) sets the attribute after the config validated itself.
        if check_mm_encoder_tp_mode(self.config.mm_encoder_tp_mode) == "data":
            plan = self._tp_plan.items()
            self._tp_plan = {name: style for name, style in plan if not name.startswith("vision_tower.")}

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_output_embeddings(value)

    def get_decoder(self) -> nn.Module:
        return self.language_model.get_decoder()

    @can_return_tuple
    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_hws: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
    ) -> BaseModelOutputWithPooling:
        r"""
        The images through the vision tower and the projector, the same in every parallel mode.

        Returns a `BaseModelOutputWithPooling`: `last_hidden_state` holds the vision tower's merged patches
        `[total image tokens, 4, vision hidden]`, `pooler_output` the projected features split per image, a tuple of
        `[rows*cols/4, text hidden]` in image order; `hidden_states` / `attentions` are the tower's, when asked for.
        """
        # Read to the host once and checked on every rank before any rank encodes: in data mode, one rank failing
        # alone would leave the others waiting in the gather.
        grid_hws = read_image_grids(pixel_values, image_grid_hws, self.config.vision_config)
        # The mode is read here, at every call: a value set on the config after loading is checked against the load.
        mode = check_mm_encoder_tp_mode(self.config.mm_encoder_tp_mode)
        tensor_parallel = (self.tp_size or 1) > 1
        if tensor_parallel:
            check_vision_tp_mode_unchanged(self.vision_tower, mode)
        if mode == "data" and tensor_parallel:
            merged = encode_images_data_parallel(self.vision_tower, pixel_values, grid_hws, **kwargs)
            vision_outputs = BaseModelOutput(last_hidden_state=merged)  # the tower's output, without recordings
        else:
            # A host copy of the grids: the tower reads it without another device sync.
            host_grid_hws = torch.tensor(grid_hws, dtype=torch.long).view(-1, 2)
            vision_outputs = self.vision_tower(pixel_values, host_grid_hws, return_dict=True, **kwargs)
        merged = vision_outputs.last_hidden_state
        image_features = self.multi_modal_projector(merged.to(self.multi_modal_projector.linear_1.weight.dtype))
        return BaseModelOutputWithPooling(
            last_hidden_state=merged,
            pooler_output=image_features.split(tokens_per_image(grid_hws, self.config.vision_config)),
            hidden_states=vision_outputs.hidden_states,
            attentions=vision_outputs.attentions,
        )

    def get_placeholder_mask(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.FloatTensor,
        image_features: torch.FloatTensor | None = None,
    ) -> torch.BoolTensor:
        """Boolean `[batch, seq, 1]` mask of the `<|media_pad|>` positions, from the ids (or from the embeddings when
        there are no ids). With `image_features [tokens, hidden]`, checks that there is one placeholder per token."""
        placeholder_id = self.config.media_placeholder_token_id
        if input_ids is not None:
            mask = input_ids == placeholder_id
        else:
            placeholder_embedding = self.get_input_embeddings()(
                torch.tensor(placeholder_id, dtype=torch.long, device=inputs_embeds.device)
            )
            mask = (inputs_embeds == placeholder_embedding).all(-1)
        if image_features is not None:
            num_placeholders = int(mask.sum())  # one host read per prefill; a mismatch must not pass silently
            if num_placeholders != image_features.shape[0]:
                raise ValueError(
                    f"The prompt has {num_placeholders} image placeholder tokens (id {placeholder_id}) but the images "
                    f"give {image_features.shape[0]} features; each image needs rows*cols/4 placeholders (the "
                    "processor expands them)."
                )
        return mask.unsqueeze(-1)

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """`generate` repeats every batch-major input `expand_size` times (num_return_sequences, num_beams). The
        images are packed over all prompts instead, so repeating them row by row would interleave patches of
        different images: repeat each prompt's block of images as a whole."""
        images = {key: model_kwargs.pop(key) for key in ("pixel_values", "image_grid_hws") if key in model_kwargs}
        if expand_size > 1 and images.get("pixel_values") is not None:
            # With inputs_embeds, generate passes input_ids as an empty [batch, 0] tensor.
            prompt_ids = input_ids if input_ids is not None and input_ids.shape[-1] > 0 else None
            images["pixel_values"], images["image_grid_hws"] = self._repeat_images_per_prompt(
                prompt_ids, model_kwargs.get("inputs_embeds"), images["pixel_values"], images["image_grid_hws"],
                expand_size,
            )  # fmt: skip
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size=expand_size, is_encoder_decoder=is_encoder_decoder, input_ids=input_ids, **model_kwargs
        )
        return input_ids, {**model_kwargs, **images}

    def _repeat_images_per_prompt(self, input_ids, inputs_embeds, pixel_values, image_grid_hws, expand_size: int):
        grid_hws = read_image_grids(pixel_values, image_grid_hws, self.config.vision_config)
        image_tokens = tokens_per_image(grid_hws, self.config.vision_config)
        placeholders_per_prompt = self.get_placeholder_mask(input_ids, inputs_embeds).sum((1, 2)).tolist()
        # The images belong to the prompts in order: each prompt takes images until its placeholders are filled.
        images_per_prompt, next_image = [], 0
        for prompt, placeholders in enumerate(placeholders_per_prompt):
            first_image, filled = next_image, 0
            while filled < placeholders and next_image < len(grid_hws):
                filled += image_tokens[next_image]
                next_image += 1
            if filled != placeholders:
                raise ValueError(
                    f"Prompt {prompt} has {placeholders} image placeholder tokens, but the images in order give it "
                    f"{filled}; each image needs rows*cols/4 placeholders (the processor expands them)."
                )
            images_per_prompt.append(range(first_image, next_image))
        if next_image != len(grid_hws):
            raise ValueError(
                f"{len(grid_hws)} images were given but the prompts' placeholders account for {next_image}."
            )
        patches = pixel_values.split([rows * cols for rows, cols in grid_hws])
        order = [image for images in images_per_prompt for _ in range(expand_size) for image in images]
        return torch.cat([patches[image] for image in order]), image_grid_hws[order]

    def check_prompt_inputs(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.FloatTensor | None = None,
    ) -> None:
        """Reject a prompt the language model cannot take, naming the numbers, before anything runs.

        Ids outside the vocabulary would fail inside the embedding lookup (on CUDA as a device-side assert, which
        ends the process); inputs of another rank, or a 2-D attention mask of another shape, would fail later with
        an unrelated message or mask the wrong tokens.
        Never called in a cached decode step (the id range costs one host read): `generate` calls it once, on the
        prompt as given (plain and static paths), and `forward` when it gets no cache, i.e. a whole sequence
        (`model(**inputs)`, training, or each step of `generate(use_cache=False)`, which reruns the whole sequence).
        """
        for name, tensor, ndim, layout in (("input_ids", input_ids, 2, "[batch, seq]"),
                                           ("inputs_embeds", inputs_embeds, 3, "[batch, seq, hidden]")):  # fmt: skip
            if tensor is not None and tensor.ndim != ndim:
                raise ValueError(f"{name} must have shape {layout}, got {tuple(tensor.shape)}.")
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens is None:
            return
        if attention_mask is not None and attention_mask.ndim == 2 and attention_mask.shape != tokens.shape[:2]:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the prompt is {tokens.shape[0]} x "
                f"{tokens.shape[1]} tokens; it needs one entry per token of input_ids (or inputs_embeds)."
            )
        if input_ids is None or input_ids.numel() == 0:
            return
        vocab_size = self.config.text_config.vocab_size
        low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # the one host read
        if low < 0 or high >= vocab_size:
            outside = input_ids[(input_ids < 0) | (input_ids >= vocab_size)].unique()
            raise ValueError(
                f"input_ids hold {outside.numel()} distinct id(s) outside the vocabulary [0, {vocab_size}), e.g. "
                f"{outside[:5].tolist()}; use the model's own tokenizer."
            )

    def embed_inputs(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.FloatTensor | None = None,
        pixel_values: torch.FloatTensor | None = None,
        image_grid_hws: torch.LongTensor | None = None,
    ) -> torch.FloatTensor:
        """Token embeddings with the image features written over the placeholders: the language model's input."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            # This is where the image features are written over the placeholders, in order (batch-major, then sequence).
            features_per_image = self.get_image_features(pixel_values, image_grid_hws, return_dict=True).pooler_output
            image_features = torch.cat([inputs_embeds.new_zeros((0, inputs_embeds.shape[-1])), *features_per_image])
            mask = self.get_placeholder_mask(input_ids, inputs_embeds, image_features)
            inputs_embeds = inputs_embeds.masked_scatter(mask, image_features.to(inputs_embeds.dtype))
        return inputs_embeds

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        pixel_values: torch.FloatTensor | None = None,
        image_grid_hws: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_token_type_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        pixel_values (`torch.FloatTensor` of shape `[total patches, 3, patch, patch]`):
            All images' patches, concatenated in image order, as the processor returns them. Only used at prefill.
        image_grid_hws (`torch.LongTensor` of shape `[num_images, 2]`):
            Patch rows and columns of each image. Ignored when there are no `pixel_values` (decode steps).
        labels (`torch.LongTensor` of shape `[batch, seq]`):
            Next-token targets aligned with `input_ids` (shifted inside the loss); `-100` is ignored.
        mm_token_type_ids (`torch.LongTensor` of shape `[batch, seq]`):
            What the processor returns with `return_mm_token_type_ids=True` (1 at image tokens). Accepted so that
            processor outputs go to `forward` and `generate` unchanged, and unused: positions are 1-D and image
            tokens attend causally, like text.
        past_key_values (`Cache`):
            The language model's cache (transformers >= 5.24 also accepts it under its new name, `cache`).
        """
        # generate() on transformers >= 5.24 hands the cache over as `cache`; earlier releases as `past_key_values`.
        cache = kwargs.pop(CACHE_ARGUMENT, past_key_values)
        if cache is None:  # a whole sequence; `generate` checks its prompt itself and decodes with a cache
            self.check_prompt_inputs(input_ids, attention_mask, inputs_embeds)
        inputs_embeds = self.embed_inputs(input_ids, inputs_embeds, pixel_values, image_grid_hws)
        return self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_ARGUMENT: cache},
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


__all__ = [
    "MoonViTModel",
    "KimiVLPreTrainedModel",
    "KimiVLForConditionalGeneration",
    "KimiVLMLAAttention",
    "PackedImages",
    "read_image_grids",
]
