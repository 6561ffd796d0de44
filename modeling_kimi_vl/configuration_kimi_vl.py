"""Configuration of Kimi-VL: a MoonViT vision tower, a patch-merging projector and a DeepSeek-V3 language model.

Both classes read the published `config.json` files unchanged. Keys that other transformers versions added when they
saved a config (`_attn_implementation_autoset`, `head_dim`, `qk_head_dim`, ...) are accepted and carried along (every
5.x `PreTrainedConfig` keeps unknown keys; the shims for version differences are in transformers_compat_modeling.py).
"""

from transformers import PreTrainedConfig
from transformers.models.deepseek_v3 import DeepseekV3Config

from .transformers_compat_modeling import build_sub_configs

VISION_ENCODER_TP_MODES = ("weight", "data")


def check_mm_encoder_tp_mode(mode: str) -> str:
    if mode not in VISION_ENCODER_TP_MODES:
        raise ValueError(f"mm_encoder_tp_mode={mode!r} is not supported; use one of {VISION_ENCODER_TP_MODES}.")
    return mode


class MoonViTConfig(PreTrainedConfig):
    r"""
    MoonViT, the native-resolution vision encoder of Kimi-VL.

    The layer-norm epsilon (1e-5), the MLP activation (tanh-approximated GELU) and the 2-D rotary base (10000) are
    fixed by the released code, not configurable, so they are not fields here.

    patch_size (`int`): side of the square patches the image processor cuts (14).
    init_pos_emb_height / init_pos_emb_width (`int`): size of the learned position table (64 x 64), resized to each
        image's patch grid.
    merge_kernel_size (`list[int]`): patches merged into one language-model token, (rows, cols) = (2, 2).
    """

    model_type = "moonvit"
    base_config_key = "vision_config"
    # Weight mode (`mm_encoder_tp_mode="weight"`, or the tower loaded alone): whole attention heads per rank. `wqkv`
    # rows are all q heads, then all k, then all v, so it needs the strided split "packed_qkv_colwise" (registered in
    # parallel_kimi_vl.py). Norms, patch embedding, position table, rotary angles and the patch merger stay replicated.
    base_model_tp_plan = {
        "encoder.blocks.*.wqkv": "packed_qkv_colwise",
        "encoder.blocks.*.wo": "rowwise",
        "encoder.blocks.*.mlp.fc0": "colwise",
        "encoder.blocks.*.mlp.fc1": "rowwise",
    }

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    merge_kernel_size: tuple[int, int] | list[int] = (2, 2)
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"MoonViT hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})."
            )
        if (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError(
                f"MoonViT head dim ({self.hidden_size // self.num_attention_heads}) must be divisible by 4: the 2-D "
                "rotary embedding gives a quarter of it to rows and a quarter to columns."
            )
        self.merge_kernel_size = list(self.merge_kernel_size)
        super().__post_init__(**kwargs)


def tokens_per_image(grid_hws, config: MoonViTConfig) -> list[int]:
    """Language-model tokens of each image: its merged patches, rows*cols/4. (Here, beside the config it reads, so
    that the model and the data-parallel encoder in parallel_kimi_vl.py, which the model imports, can both use it.)"""
    kernel_rows, kernel_cols = config.merge_kernel_size
    return [rows * cols // (kernel_rows * kernel_cols) for rows, cols in grid_hws]


class KimiVLConfig(PreTrainedConfig):
    r"""
    Kimi-VL: `vision_config` is a [`MoonViTConfig`], `text_config` transformers' own [`DeepseekV3Config`].

    media_placeholder_token_id (`int`): the `<|media_pad|>` id; each image fills rows*cols/4 of these positions.
    ignore_index (`int`): kept from the released config; the loss ignores label -100 (transformers' convention).
    mm_encoder_tp_mode (`str`): how the vision tower runs under tensor parallelism: `"data"` (replicated, each rank
        encodes a share of the images) or `"weight"` (the tower's linears are sharded like the language model's).
    """

    model_type = "kimi_vl"
    sub_configs = {"vision_config": MoonViTConfig, "text_config": DeepseekV3Config}
    # What the nested models' own plans leave out (the vision tower brings `vision_tower.*` from MoonViTConfig,
    # DeepSeek-V3 its MLP, experts and lm_head): the MLA attention, split by heads. The query projection and
    # `kv_b_proj` (the per-head expansion of the shared latent) are column-wise, `o_proj` row-wise;
    # `kv_a_proj_with_mqa` produces the latent every head reads, so it stays whole, its style only summing the rotary
    # part's gradient across ranks. As in transformers' DeepSeek-V2 plan, the query projection is `q_proj` without a
    # query LoRA (the published checkpoints) and `q_b_proj` with one; the rule whose module does not exist matches none.
    base_model_tp_plan = {
        "language_model.model.layers.*.self_attn.q_proj": "colwise",
        "language_model.model.layers.*.self_attn.q_b_proj": "colwise",
        "language_model.model.layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "language_model.model.layers.*.self_attn.kv_b_proj": "colwise",
        "language_model.model.layers.*.self_attn.o_proj": "rowwise",
    }

    vision_config: dict | PreTrainedConfig | None = None
    text_config: dict | PreTrainedConfig | None = None
    ignore_index: int = -100
    media_placeholder_token_id: int = 163605
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = False
    mm_encoder_tp_mode: str = "data"

    def __post_init__(self, **kwargs):
        build_sub_configs(self)
        check_mm_encoder_tp_mode(self.mm_encoder_tp_mode)
        super().__post_init__(**kwargs)


def kimi_vl_a3b_config(**kwargs) -> KimiVLConfig:
    """The architecture of the published Kimi-VL-A3B checkpoints (Instruct, Thinking, Thinking-2506): 16,407,656,048
    parameters. For building the model without its files, e.g. on the meta device or with random weights for a
    benchmark; `kwargs` override top-level fields (such as `attn_implementation`)."""
    vision_config = dict(
        patch_size=14, init_pos_emb_height=64, init_pos_emb_width=64, num_attention_heads=16,
        num_hidden_layers=27, hidden_size=1152, intermediate_size=4304, merge_kernel_size=[2, 2],
    )  # fmt: skip
    text_config = dict(
        vocab_size=163840, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=11264, first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=64,
        moe_intermediate_size=1408, num_experts_per_tok=6, n_shared_experts=2, topk_method="noaux_tc",
        scoring_func="sigmoid", n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446,
        rope_theta=800000.0, rope_scaling=None, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, hidden_act="silu",
    )  # fmt: skip
    return KimiVLConfig(
        vision_config=vision_config, text_config=text_config, media_placeholder_token_id=163605, **kwargs
    )


__all__ = [
    "MoonViTConfig",
    "KimiVLConfig",
    "VISION_ENCODER_TP_MODES",
    "check_mm_encoder_tp_mode",
    "kimi_vl_a3b_config",
    "tokens_per_image",
]
