"""Multi-process Kimi-VL: the tensor-parallel style of the fused vision `wqkv`, the load-time checks of the TP size,
and the data-parallel vision encoder. The plans themselves are declared on the configs (`base_model_tp_plan`).

Under `torchrun --nproc_per_node N` with `from_pretrained(..., tp_plan="auto")` every rank sees the same inputs. The
language model is always tensor-parallel; the vision tower runs in one of two modes (`mm_encoder_tp_mode`):

- `"weight"`: the tower is tensor-parallel too (whole attention heads per rank, two all-reduces per block).
- `"data"`: the tower is replicated and each rank encodes a share of the images; the merged, pre-projector features
  are all-gathered once and put back in image order, so the projector and everything after it see exactly what a
  single process would.

Both modes return the same thing as the single-process model: the merged patches `[total merged tokens, 4, hidden]` in
image order.
"""

from collections.abc import Sequence

import torch
from accelerate import PartialState
from accelerate.utils import gather
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES, PackedColwiseParallel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .configuration_kimi_vl import KimiVLConfig, MoonViTConfig, tokens_per_image


def process_state() -> PartialState:
    """This process's rank and the world, from accelerate (which shares one state per process)."""
    # Without an accelerator, accelerate sees the (gloo) process group only when asked for CPU explicitly.
    return PartialState(cpu=not torch.accelerator.is_available())


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel parameter (transformers holds them as DTensors), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# ----------------------------------------------------------------------------------------------------------------------
# Tensor parallelism
# ----------------------------------------------------------------------------------------------------------------------


class PackedQKVColwiseParallel(PackedColwiseParallel):
    """Column-parallel fused `wqkv` whose output rows are all q heads, then all k heads, then all v heads.

    Each rank must get its heads' slice of q, of k AND of v; a contiguous split of the fused rows would give rank 0 all
    of q and part of k. `_StridedShard(0, split_factor=3)` is exactly that layout: the rows are cut into the 3 groups
    and each group is split across the ranks. The bias is fused the same way, so it gets the same placement (the parent
    class splits 1-D parameters contiguously, which suits an unfused bias only). Loading reads each rank's rows straight
    from the checkpoint, and `save_pretrained` gathers them back to the full layout.
    """

    def __init__(self):
        super().__init__(split_factor=3)

    def shard_param(self, module, param, mesh):
        meta = module._parameters.get(param)
        if meta is None or meta.ndim != 1:
            return super().shard_param(module, param, mesh)
        placement = _StridedShard(dim=0, split_factor=self.split_factor)  # the fused bias, laid out like the rows
        module._parameters[param] = nn.Parameter(
            distribute_tensor(meta, mesh, [placement], src_data_rank=None), requires_grad=meta.requires_grad
        )


# The style MoonViTConfig.base_model_tp_plan names for `wqkv`.
ALL_PARALLEL_STYLES.register("packed_qkv_colwise", PackedQKVColwiseParallel())


def check_vision_tp_size(vision_config: MoonViTConfig, tp_size: int, alone: bool) -> None:
    """Weight mode shards whole heads: the head count must divide by the TP size. `alone`: the tower is loaded
    without the language model (MoonViTModel), where weight mode is the only one."""
    heads = vision_config.num_attention_heads
    if heads % tp_size == 0:
        return
    if alone:
        what = "MoonViTModel with tensor parallelism"
        remedy = "Load it without tensor parallelism"
    else:
        what = "mm_encoder_tp_mode='weight'"
        remedy = (
            "Load with mm_encoder_tp_mode='data' (the tower is then replicated and each rank encodes a share of the "
            "images)"
        )
    raise ValueError(
        f"{what} splits the vision tower's {heads} attention heads across {tp_size} ranks, but {heads} is not "
        f"divisible by {tp_size}. {remedy}, or use a TP size that divides {heads}."
    )


def check_kimi_vl_tp_size(config: KimiVLConfig | MoonViTConfig, tp_size: int) -> None:
    """Reject, at load and before any weight is read, a TP size the model (or the vision tower loaded alone, which
    is always weight-sharded) cannot be split by."""
    if tp_size <= 1:
        return
    if isinstance(config, MoonViTConfig):
        check_vision_tp_size(config, tp_size, alone=True)
        return
    text_config = config.text_config
    for what, count in (
        ("attention heads", text_config.num_attention_heads),
        ("routed experts", text_config.n_routed_experts),
    ):
        if count % tp_size:
            raise ValueError(
                f"The language model's {count} {what} are not divisible by the tensor-parallel size {tp_size}; "
                f"use a TP size that divides {count}."
            )
    if config.mm_encoder_tp_mode == "weight":
        check_vision_tp_size(config.vision_config, tp_size, alone=False)
    else:
        # The encoder shares images among all processes, so they must all be ranks of this one TP group.
        world_size = process_state().num_processes
        if world_size != tp_size:
            raise ValueError(
                f"mm_encoder_tp_mode='data' shares the images among all {world_size} processes, but the tensor-"
                f"parallel group has {tp_size}: the encoder needs every process to see the same inputs. Use "
                f"tp_size={world_size} or mm_encoder_tp_mode='weight'."
            )


def check_vision_tp_mode_unchanged(vision_tower: nn.Module, mode: str) -> None:
    """Refuse a `mm_encoder_tp_mode` other than the one a tensor-parallel model was loaded with: the load sharded the
    vision tower (weight mode) or left it whole (data mode), and changing the config afterwards changes neither. The
    tower's parameters say which: transformers holds the sharded ones as DTensors. Every rank decides the same, before
    any collective, so all raise together."""
    sharded = any(isinstance(parameter, DTensor) for parameter in vision_tower.parameters())
    loaded_mode = "weight" if sharded else "data"
    if mode != loaded_mode:
        raise ValueError(
            f"config.mm_encoder_tp_mode is {mode!r}, but this tensor-parallel model was loaded with {loaded_mode!r}, "
            f"so its vision tower is {'sharded across the ranks' if sharded else 'whole on every rank'}. The mode is "
            f"applied when the weights are loaded: set it back to {loaded_mode!r}, or load again with "
            f"from_pretrained(..., tp_plan='auto', mm_encoder_tp_mode={mode!r})."
        )


# ----------------------------------------------------------------------------------------------------------------------
# Data-parallel vision encoder
# ----------------------------------------------------------------------------------------------------------------------


def assign_images_to_ranks(loads: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Longest-processing-time-first: images by load (patch count), largest first, ties in input order; each goes to
    the rank with the least load so far, ties to the lowest rank. Returns each rank's image indices in the order they
    were given to it.

    >>> assign_images_to_ranks([1000, 100, 200, 50], 2)
    [[0], [2, 1, 3]]
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}.")
    images_per_rank = [[] for _ in range(num_ranks)]
    load_per_rank = [0] * num_ranks
    for image in sorted(range(len(loads)), key=lambda index: -loads[index]):  # sorted() is stable
        rank = min(range(num_ranks), key=load_per_rank.__getitem__)  # min() returns the first, i.e. lowest, rank
        images_per_rank[rank].append(image)
        load_per_rank[rank] += loads[image]
    return images_per_rank


def encode_images_data_parallel(
    vision_tower: nn.Module,
    pixel_values: torch.Tensor,
    grid_hws: Sequence[tuple[int, int]],
    **kwargs: Unpack[TransformersKwargs],
) -> torch.Tensor:
    """Encode the images across all processes; every process returns the full `[total merged tokens, 4, hidden]` in
    image order (the vision tower's `last_hidden_state`).

    `grid_hws` must be validated on every rank before this call, since a rank that failed alone would leave the
    others waiting in the gather. Every rank derives the same assignment from the same grids, so each knows every
    rank's token count without communicating: each pads to the largest count itself (accelerate's
    `pad_across_processes` would first all-gather the sizes and read them back to the host), and the only collective
    is one all-gather through accelerate's `gather`. `kwargs` are the tower's output options: recording hidden states
    or attentions is refused, since each rank sees only its own images.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "The data-parallel vision encoder cannot run inside a CUDA graph capture: ranks encode different images "
            "(some none), so their captured collectives would not match. Run the vision tower eagerly and capture "
            "only the language model."
        )
    if torch.is_grad_enabled() and any(param.requires_grad for param in vision_tower.parameters()):
        # The all-gather carries no gradient, and each rank's replicated tower would see only its own images' share.
        raise RuntimeError(
            "The data-parallel vision encoder is inference-only: call the model under torch.no_grad() (generate "
            "does), freeze the vision tower (requires_grad_(False)), or load with mm_encoder_tp_mode='weight' to "
            "train it."
        )
    recording = [
        option
        for option in ("output_hidden_states", "output_attentions")
        if kwargs.get(option, getattr(vision_tower.config, option, False))
    ]
    if recording:
        raise ValueError(
            f"{' and '.join(recording)} cannot be given with mm_encoder_tp_mode='data': each process encodes only its "
            "share of the images. Load with mm_encoder_tp_mode='weight', or run the vision tower in one process."
        )
    state = process_state()
    kernel_rows, kernel_cols = vision_tower.config.merge_kernel_size
    patches_per_image = [rows * cols for rows, cols in grid_hws]
    image_tokens = tokens_per_image(grid_hws, vision_tower.config)
    hidden = vision_tower.config.hidden_size
    if not grid_hws:
        return pixel_values.new_zeros((0, kernel_rows * kernel_cols, hidden), dtype=vision_tower.dtype)

    images_per_rank = assign_images_to_ranks(patches_per_image, state.num_processes)
    my_images = images_per_rank[state.process_index]
    if my_images:
        patch_slices = pixel_values.split(patches_per_image)
        my_pixels = torch.cat([patch_slices[image] for image in my_images])
        my_grid_hws = torch.tensor([grid_hws[image] for image in my_images], dtype=torch.long)  # on the host
        my_features = vision_tower(my_pixels, my_grid_hws, return_dict=True).last_hidden_state
    else:
        # Fewer images than ranks: take part in the gather with an empty tensor of the same rank and trailing shape.
        my_features = pixel_values.new_zeros((0, kernel_rows * kernel_cols, hidden), dtype=vision_tower.dtype)

    tokens_per_rank = [sum(image_tokens[image] for image in images) for images in images_per_rank]
    padded_tokens = max(tokens_per_rank)
    padding = my_features.new_zeros((padded_tokens - my_features.shape[0], *my_features.shape[1:]))
    gathered = gather(torch.cat([my_features, padding]))
    gathered = gathered.view(state.num_processes, padded_tokens, *my_features.shape[1:])

    features_per_image = [None] * len(grid_hws)
    for rank, images in enumerate(images_per_rank):
        rank_features = gathered[rank, : tokens_per_rank[rank]].split([image_tokens[image] for image in images])
        for image, features in zip(images, rank_features):
            features_per_image[image] = features
    return torch.cat(features_per_image)


__all__ = [
    "PackedQKVColwiseParallel",
    "assign_images_to_ranks",
    "check_kimi_vl_tp_size",
    "check_vision_tp_mode_unchanged",
    "check_vision_tp_size",
    "encode_images_data_parallel",
]
