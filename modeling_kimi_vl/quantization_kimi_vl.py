"""Weight-only int8 / int4 quantization of Kimi-VL's language model, plugged into transformers' quantizer registry.

    model = KimiVLForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16,
                                                          quantization_config=KimiVLWeightOnlyConfig("int8"))

What is quantized: every `nn.Linear` of the language model (attention projections, dense and shared-expert MLPs,
`lm_head`) and the fused 3-D routed experts (`mlp.experts.gate_up_proj` / `down_proj`, 14.4 B of A3B's 16.4 B
parameters). transformers' own quantizers stop at `nn.Linear` (torchao's int8 weight-only leaves the experts and
`lm_head` alone), which is why this one exists. What stays in the model dtype, by default:

- the vision tower and projector: 0.4 B parameters that run once per image at prefill (compute-bound, nothing for
  decode to gain), and whose output feeds every image token;
- `kv_b_proj`: 2 M parameters per layer, kept as a plain matrix because absorbed-MLA attention reads it as one;
- the embedding table, the router (`mlp.gate`, float32 by design: it picks the experts) and the norms.

Schemes (symmetric, round to nearest, one scale in the model dtype per group):

- `int8`: one scale per output channel. Because the scale is per output row it factors out of the dot product,
  `x @ (q * s)^T = (x @ q^T) * s`, so the int8 values are used as they are and the scale is applied to the output.
- `int4`: one scale per `group_size` inputs of each output channel; two values packed per byte.

Loading: transformers materialises one checkpoint tensor at a time (one layer's merged experts for the fused
tensors), and the quantize op below turns it into `(weight, weight_scale)` before the next one is read, so peak memory
is the quantized model plus about one layer's experts in full precision (the per-expert tensors and their merge).
`save_pretrained` writes the quantized weights in the original per-expert key layout, the scales beside them (the
experts' as one `[experts, rows]` tensor per projection and layer) and the `quantization_config`; `from_pretrained` on
that folder loads them as they are.

Routed experts run through transformers' `experts_implementation` dispatch, with quantized kernels under the same
names. Decode-sized inputs (at most `FUSED_MAX_PAIRS_PER_WEIGHT` (token, expert) pairs per expert) read only the experts
the tokens chose: on CUDA through a Triton kernel that reads them as stored and dequantises in registers
(`fused_experts_kimi_vl.py`, so decode reads the int8 bytes once: about half of bf16), elsewhere by gathering the
chosen rows and casting them before a batched matmul. Larger inputs (prefill, where nearly every expert is hit anyway)
dequantise all experts once and run transformers' grouped matmul; the torch gather is kept while there are fewer pairs
than experts. The choice depends on shapes, the device and whether the inputs need a gradient (the kernel has no
backward), never on device values, so a captured step always takes the same branch, and no branch syncs with the host:
the static path captures them all in CUDA graphs. `eager` loops over the hit experts. Linear layers use the same
kernel for decode-sized inputs on CUDA (one "expert" that every row chose); larger inputs dequantize and run a dense
matmul (on CPU, int8 runs torch's `_weight_int8pack_mm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.core_model_loading import ConversionOps
from transformers.integrations.moe import ExpertsInterface, _grouped_mm, use_experts_implementation
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

from .fused_experts_kimi_vl import FusedKernelUnavailable, fused_kernel_runs_on, weight_only_rows_matmul
from .transformers_compat_modeling import QUANTIZATION_MIN_TRANSFORMERS_VERSION, quantization_supported

QUANT_METHOD = "kimi_vl_weight_only"
# Modules kept in the model dtype unless the config names its own list (see the module docstring for why).
DEFAULT_MODULES_TO_NOT_CONVERT = ("vision_tower", "multi_modal_projector", "kv_b_proj")
# Up to this many rows (or (token, expert) pairs) per stored weight, the fused kernel multiplies each by the rows of its
# own weight; above it, dequantizing the weights once and running a tensor-core matmul is cheaper. The arithmetic, in
# units of the stored weight's bytes: dequantizing reads 1, writes and reads back 2 (int8; int4: 1 + 4 + 4), and the
# matmul is then memory-bound. The kernel reads each weight once from memory (the other rows' reads of it come from
# L2, see fused_experts_kimi_vl.py) but does one fused multiply-add per weight and row on CUDA cores, about 1/7 unit of
# an H200's bandwidth time for int8: 8 rows ~ 2 units, under the dequantize path's 5. To be refined from the GPU
# benchmark (bench_quantization.py --gpu), which has not run yet.
FUSED_MAX_PAIRS_PER_WEIGHT = 8


# ----------------------------------------------------------------------------------------------------------------------
# Schemes: how a weight `[..., out, in]` is stored, and how it is multiplied
# ----------------------------------------------------------------------------------------------------------------------


def symmetric_scale(amax: torch.Tensor, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """`amax / levels`, rounded to the storage dtype first (the weights are then divided by exactly the stored
    scale), never zero (an all-zero row quantizes to zeros)."""
    return (amax / levels).to(dtype).clamp(min=torch.finfo(dtype).tiny)


class Int8Scheme:
    """int8 in [-127, 127], one scale per output channel: weight `[..., out, in]` int8, scale `[..., out]`."""

    name = "int8"
    storage_dtype = torch.int8
    bits = 8
    group_size = None  # one scale per output channel

    def packed_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return out_features, in_features

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        return (out_features,)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = symmetric_scale(weight.abs().amax(-1).float(), 127, weight.dtype)
        quantized = torch.round(weight.float() / scale.float().unsqueeze(-1)).clamp_(-127, 127)
        return quantized.to(torch.int8), scale

    def dequantize(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return qweight.to(dtype) * scale.to(dtype).unsqueeze(-1)

    def linear(self, inputs: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if inputs.device.type != "cpu":
            # torch's CUDA `_weight_int8pack_mm` is one untiled thread per output (uncoalesced weight reads), so for
            # inputs too large for the fused kernel the weight is dequantized once for a cuBLAS matmul (a choice made
            # from the kernels' structure: not measured yet, see README "Quantization").
            return F.linear(inputs, self.dequantize(qweight, scale, inputs.dtype))
        # The CPU kernel reads the int8 weight and scales the output; it takes 2-D inputs.
        flat = inputs.reshape(-1, inputs.shape[-1])
        out = torch._weight_int8pack_mm(flat.contiguous(), qweight, scale.to(flat.dtype))
        return out.view(*inputs.shape[:-1], qweight.shape[0])

    def expert_matmul(self, inputs: torch.Tensor, qweights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """`inputs [S, in]` times each row's own expert `qweights [S, out, in]` -> `[S, out]`. int8 values are exact
        in bf16/fp16/fp32, so the cast loses nothing; the per-row scale is applied to the output."""
        out = torch.bmm(qweights.to(inputs.dtype), inputs.unsqueeze(-1)).squeeze(-1)
        return out * scales.to(inputs.dtype)


class Int4Scheme:
    """int4 in [-8, 7], one scale per `group_size` inputs: weight `[..., out, in / 2]` uint8 (element 2j in the low
    nibble, 2j+1 in the high one), scale `[..., out, in / group_size]`."""

    name = "int4"
    storage_dtype = torch.uint8
    bits = 4

    def __init__(self, group_size: int):
        self.group_size = group_size

    def packed_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        self._check_divisible(in_features)
        return out_features, in_features // 2

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        self._check_divisible(in_features)
        return out_features, in_features // self.group_size

    def _check_divisible(self, in_features: int) -> None:
        if in_features % self.group_size:
            raise ValueError(
                f"int4 group_size={self.group_size} does not divide a layer's {in_features} input features; choose a "
                f"group_size that divides every quantized layer's input size (or exclude the layer)."
            )

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups = weight.float().unflatten(-1, (-1, self.group_size))
        scale = symmetric_scale(groups.abs().amax(-1), 7, weight.dtype)
        quantized = torch.round(groups / scale.float().unsqueeze(-1)).clamp_(-8, 7).flatten(-2)
        unsigned = (quantized + 8).to(torch.uint8)
        return unsigned[..., 0::2] | (unsigned[..., 1::2] << 4), scale

    def dequantize(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        unpacked = torch.stack([qweight & 15, qweight >> 4], dim=-1).flatten(-2).to(dtype) - 8
        return (unpacked.unflatten(-1, (-1, self.group_size)) * scale.to(dtype).unsqueeze(-1)).flatten(-2)

    def linear(self, inputs: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return F.linear(inputs, self.dequantize(qweight, scale, inputs.dtype))

    def expert_matmul(self, inputs: torch.Tensor, qweights: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        weights = self.dequantize(qweights, scales, inputs.dtype)
        return torch.bmm(weights, inputs.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------------------
# The configuration, registered with transformers' AutoQuantizationConfig
# ----------------------------------------------------------------------------------------------------------------------


class KimiVLWeightOnlyConfig(QuantizationConfigMixin):
    """Weight-only quantization of Kimi-VL's language model (linear layers, routed experts, `lm_head`).

    Args:
        scheme: `"int8"` (per output channel) or `"int4"` (group-wise, packed two per byte).
        group_size: inputs per int4 scale; must divide every quantized layer's input size (A3B: 2048 and 1408, so
            a divisor of 128 such as 128, 64 or 32). Ignored for int8.
        modules_to_not_convert: module names (prefixes, regexes or suffixes, as transformers matches them) kept in the
            model dtype. `None` keeps the vision tower, the projector and `kv_b_proj`.
    """

    SCHEMES = ("int8", "int4")

    def __init__(
        self,
        scheme: str = "int8",
        group_size: int = 128,
        modules_to_not_convert: list[str] | None = None,
        quant_method: str = QUANT_METHOD,
    ):
        # `quant_method` is how a saved config (or a `quantization_config` dict) names this class; any other key is a
        # misspelt or foreign option, which must not be dropped silently (the model would load with the defaults).
        if quant_method != QUANT_METHOD:
            raise ValueError(f"KimiVLWeightOnlyConfig is quant_method={QUANT_METHOD!r}, got {quant_method!r}.")
        if scheme not in self.SCHEMES:
            raise ValueError(f"Unsupported weight-only quantization scheme {scheme!r}; choose one of {self.SCHEMES}.")
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
            raise ValueError(f"group_size must be a positive even integer, got {group_size!r}.")
        self.quant_method = QUANT_METHOD
        self.scheme = scheme
        self.group_size = group_size
        if modules_to_not_convert is not None and (
            isinstance(modules_to_not_convert, str) or not all(isinstance(name, str) for name in modules_to_not_convert)
        ):
            raise ValueError(f"modules_to_not_convert must be a list of module names, got {modules_to_not_convert!r}.")
        self.modules_to_not_convert = (
            list(DEFAULT_MODULES_TO_NOT_CONVERT) if modules_to_not_convert is None else list(modules_to_not_convert)
        )

    def make_scheme(self) -> Int8Scheme | Int4Scheme:
        return Int8Scheme() if self.scheme == "int8" else Int4Scheme(self.group_size)

    def describe(self) -> str:
        """How the quantized weights are stored, in words (export checks and model cards)."""
        if self.scheme == "int8":
            return "int8 weight-only: int8 weights, one scale per output channel"
        return (
            f"int4 weight-only: two int4 values packed per byte (uint8, half as many columns as inputs), one scale per "
            f"{self.group_size} inputs of each output channel"
        )


# ----------------------------------------------------------------------------------------------------------------------
# Quantized modules
# ----------------------------------------------------------------------------------------------------------------------


def empty_quantized(leading: tuple[int, ...], out_features: int, in_features: int, scheme) -> tuple[nn.Parameter, ...]:
    """Uninitialised `(weight, weight_scale)` parameters of a quantized `[*leading, out, in]` weight (frozen: this is
    for inference). The scale takes the default dtype, which from_pretrained sets to the model dtype."""
    weight = torch.empty(*leading, *scheme.packed_shape(out_features, in_features), dtype=scheme.storage_dtype)
    scale = torch.empty(*leading, *scheme.scale_shape(out_features, in_features))
    return nn.Parameter(weight, requires_grad=False), nn.Parameter(scale, requires_grad=False)


class WeightOnlyLinear(nn.Module):
    """A bias-free `nn.Linear` stored quantized: `weight` (int8, or packed int4) and `weight_scale`."""

    quantized_parameters = ("weight",)

    def __init__(self, in_features: int, out_features: int, scheme):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.weight, self.weight_scale = empty_quantized((), out_features, in_features, scheme)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, inputs.shape[-1])
        if fused_kernel_takes(rows) and rows.shape[0] <= FUSED_MAX_PAIRS_PER_WEIGHT:
            # Decode: read the stored weight once, as one "expert" that every row chose.
            only_weight = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
            out = fused_rows_matmul_or_none(
                rows, self.weight[None], self.weight_scale[None], only_weight, 1, self.scheme.group_size
            )
            if out is not None:
                return out.view(*inputs.shape[:-1], self.out_features)
        return self.scheme.linear(inputs, self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


def fused_kernel_takes(inputs: torch.Tensor) -> bool:
    """Whether the fused kernel multiplies these inputs: on a device it runs on, unless they need a gradient (it has no
    backward; the torch paths have, so a loss still reaches what feeds the quantized layers)."""
    return fused_kernel_runs_on(inputs.device) and not (inputs.requires_grad and torch.is_grad_enabled())


def fused_rows_matmul_or_none(*args) -> torch.Tensor | None:
    """`weight_only_rows_matmul(*args)`, or None where the kernel cannot run (it warned, once): the caller's torch
    path then serves, on that device from then on."""
    try:
        return weight_only_rows_matmul(*args)
    except FusedKernelUnavailable:
        return None


def chosen_experts_matmul(
    scheme, inputs: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, expert_ids: torch.Tensor, repeats: int
) -> torch.Tensor:
    """Pair p multiplies input row `p // repeats` by the quantized expert `expert_ids[p]`; only chosen experts are
    read. `[pairs, out]`."""
    if fused_kernel_takes(inputs):
        out = fused_rows_matmul_or_none(inputs, qweight, scale, expert_ids, repeats, scheme.group_size)
        if out is not None:
            return out
    rows = inputs.repeat_interleave(repeats, dim=0) if repeats > 1 else inputs
    return scheme.expert_matmul(rows, qweight[expert_ids], scale[expert_ids])


def weight_only_batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """Each (token, expert) pair multiplies by its own expert's quantized rows: only the chosen experts are read.
    Without the fused kernel the rows are gathered (memory grows with the pairs, like transformers' `batched_mm`)."""
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)  # [S], S = tokens * top_k, token-major
    gate_up = chosen_experts_matmul(
        self.scheme, hidden_states, self.gate_up_proj, self.gate_up_proj_scale, expert_ids, num_top_k
    )
    down = chosen_experts_matmul(
        self.scheme, self._apply_gate(gate_up), self.down_proj, self.down_proj_scale, expert_ids, 1
    )
    weighted = down * top_k_weights.reshape(-1, 1).to(down.dtype)
    # Summed per token in a fixed order (deterministic, unlike index_add_ on CUDA).
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def reads_only_chosen_experts(num_pairs: int, num_experts: int, hidden_states: torch.Tensor) -> bool:
    """Whether multiplying by the chosen experts' rows beats dequantising every expert (from shapes, the device and
    whether a gradient is needed: never from device values)."""
    if fused_kernel_takes(hidden_states):
        return num_pairs <= FUSED_MAX_PAIRS_PER_WEIGHT * num_experts
    # The torch gather copies and casts every pair's rows: worth it only while there are fewer pairs than experts.
    return num_pairs < num_experts


def weight_only_grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """Pairs sorted by expert, one grouped matmul per projection over the dequantized experts (prefill). Decode-sized
    inputs take the chosen-experts path instead (`reads_only_chosen_experts`)."""
    if reads_only_chosen_experts(top_k_index.numel(), self.num_experts, hidden_states):
        return weight_only_batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    dtype = hidden_states.dtype
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.shape[-1]
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    states = hidden_states[order // num_top_k]
    # histc, not bincount: no data-dependent output size (as transformers' grouped_mm; CPU histc needs floats).
    counts_input = expert_ids.float() if expert_ids.device.type in ("cpu", "mps") else expert_ids.int()
    tokens_per_expert = torch.histc(counts_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    gate_up_weight = self.scheme.dequantize(self.gate_up_proj, self.gate_up_proj_scale, dtype)
    gate_up = _grouped_mm(states, gate_up_weight.transpose(-2, -1), offs=offsets)
    del gate_up_weight  # one dequantized projection alive at a time
    down_weight = self.scheme.dequantize(self.down_proj, self.down_proj_scale, dtype)
    down = _grouped_mm(self._apply_gate(gate_up), down_weight.transpose(-2, -1), offs=offsets)
    weighted = down * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(down.dtype)
    unsorted = torch.empty_like(weighted).index_copy_(0, order, weighted)
    return unsorted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(dtype)


class WeightOnlyExpertsInterface(ExpertsInterface):
    """The quantized experts kernels, under the names `experts_implementation` already uses."""

    _global_mapping = {
        "batched_mm": weight_only_batched_mm_experts_forward,
        "grouped_mm": weight_only_grouped_mm_experts_forward,
    }


ALL_WEIGHT_ONLY_EXPERTS_FUNCTIONS = WeightOnlyExpertsInterface()


@use_experts_implementation(experts_interface=ALL_WEIGHT_ONLY_EXPERTS_FUNCTIONS)
class WeightOnlyExperts(nn.Module):
    """transformers' fused DeepSeek-V3 experts, stored quantized: `gate_up_proj [E, 2I, H]` and `down_proj
    [E, H, I]` (packed for int4) with `gate_up_proj_scale` / `down_proj_scale`. The forward dispatches on
    `config._experts_implementation` like the float experts; this `forward` is the `"eager"` one."""

    quantized_parameters = ("gate_up_proj", "down_proj")

    def __init__(self, config, scheme):
        super().__init__()
        self.scheme = scheme
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        experts = (self.num_experts,)
        self.gate_up_proj, self.gate_up_proj_scale = empty_quantized(
            experts, 2 * self.intermediate_dim, self.hidden_dim, scheme
        )
        self.down_proj, self.down_proj_scale = empty_quantized(experts, self.hidden_dim, self.intermediate_dim, scheme)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        dtype = hidden_states.dtype
        output = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():  # data-dependent: eager only
            token_index, top_k_position = torch.where(top_k_index == expert)
            gate_up = F.linear(
                hidden_states[token_index],
                self.scheme.dequantize(self.gate_up_proj[expert], self.gate_up_proj_scale[expert], dtype),
            )
            down = F.linear(
                self._apply_gate(gate_up),
                self.scheme.dequantize(self.down_proj[expert], self.down_proj_scale[expert], dtype),
            )
            output.index_add_(0, token_index, down * top_k_weights[token_index, top_k_position, None].to(dtype))
        return output


def replace_with_weight_only_modules(model: nn.Module, scheme, modules_to_not_convert: list[str]) -> int:
    """Swap the language model's bias-free `nn.Linear`s and fused experts for quantized ones, on the meta device
    (before any weight is read). Returns how many modules were swapped."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if not name.startswith("language_model.") or not should_convert_module(name, modules_to_not_convert):
            continue
        with torch.device("meta"):
            if isinstance(module, DeepseekV3Experts):
                new_module = WeightOnlyExperts(module.config, scheme)
            elif type(module) is nn.Linear and module.bias is None:  # DeepSeek-V3's linears have no bias
                new_module = WeightOnlyLinear(module.in_features, module.out_features, scheme)
            else:
                continue
        model.set_submodule(name, new_module)
        replaced += 1
    return replaced


# ----------------------------------------------------------------------------------------------------------------------
# The quantizer, registered with transformers' AutoHfQuantizer
# ----------------------------------------------------------------------------------------------------------------------


class WeightOnlyQuantize(ConversionOps):
    """Load-time op: one full-precision weight in, `{name: quantized, name + "_scale": scale}` out."""

    def __init__(self, hf_quantizer: KimiVLWeightOnlyQuantizer):
        self.scheme = hf_quantizer.scheme

    def convert(self, input_dict, **kwargs):
        ((name, value),) = input_dict.items()
        weight = value[0] if isinstance(value, list) else value
        if weight.ndim == 2:
            quantized, scale = self.scheme.quantize(weight)
            return {name: quantized, f"{name}_scale": scale}
        # Fused experts: one expert at a time into preallocated outputs, so the float32 temporaries stay one expert
        # big and are the same size every time (the allocator reuses them instead of fragmenting).
        out_features, in_features = weight.shape[1:]
        quantized = weight.new_empty(
            (weight.shape[0], *self.scheme.packed_shape(out_features, in_features)), dtype=self.scheme.storage_dtype
        )
        scale = weight.new_empty((weight.shape[0], *self.scheme.scale_shape(out_features, in_features)))
        for expert in range(weight.shape[0]):
            quantized[expert], scale[expert] = self.scheme.quantize(weight[expert])
        return {name: quantized, f"{name}_scale": scale}


class KimiVLWeightOnlyQuantizer(HfQuantizer):
    """Quantizes on load (from a float checkpoint) or loads a checkpoint this quantizer saved."""

    requires_calibration = False
    # Checkpoint names: a quantized `*.weight` comes with its `*.weight_scale` (per expert in the saved layout).
    serialized_names = {"weight": ["weight", "weight_scale"]}

    def __init__(self, quantization_config: KimiVLWeightOnlyConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.scheme = quantization_config.make_scheme()

    @property
    def quantized_element_size(self) -> float:
        return self.scheme.bits / 8

    def validate_environment(self, *args, **kwargs):
        if not quantization_supported():
            # A checkpoint stored quantized (config.json's quantization_config) has no float weights to fall back to.
            remedy = "" if self.pre_quantized else ", or load the model without quantization_config"
            raise ImportError(
                f"{QUANT_METHOD} quantization needs transformers>={QUANTIZATION_MIN_TRANSFORMERS_VERSION} (found "
                f"{transformers.__version__}): earlier releases cast each weight to int8 before it can be quantized. "
                f"Upgrade transformers{remedy}."
            )

    def _process_model_before_weight_loading(self, model, **kwargs):
        distributed_config = getattr(model.config, "distributed_config", None)
        if distributed_config is not None:
            raise ValueError(
                f"{QUANT_METHOD} quantization does not support tensor parallelism (a distributed_config / tp_plan was "
                "given): the quantized experts and linears are not sharded. Load without tensor parallelism (int8 "
                "Kimi-VL-A3B fits one 24 GB GPU), or load the model in bf16 with tp_plan='auto'."
            )
        replaced = replace_with_weight_only_modules(model, self.scheme, self.quantization_config.modules_to_not_convert)
        if replaced == 0:
            raise ValueError(
                f"{QUANT_METHOD}: no language-model linear layer or experts module left to quantize with "
                f"modules_to_not_convert={self.quantization_config.modules_to_not_convert}."
            )

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module, tensor_name = get_module_from_name(model, param_name)
        return tensor_name in getattr(module, "quantized_parameters", ())

    def get_quantize_ops(self):
        return WeightOnlyQuantize(self)

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register_weight_only_quantization() -> None:
    """Make `quant_method: kimi_vl_weight_only` known to from_pretrained. Called when modeling_kimi_vl.py is imported,
    which can happen more than once in a process: the package and an exported repository's copy of the file (a module
    transformers names after the repository), or that copy re-executed when its files change. The first registration
    stays (transformers' registry refuses a second) and serves models of every copy: its module swap matches
    transformers' own DeepseekV3Experts and nn.Linear, which all copies build on."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(KimiVLWeightOnlyConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(KimiVLWeightOnlyQuantizer)


__all__ = ["KimiVLWeightOnlyConfig", "KimiVLWeightOnlyQuantizer", "register_weight_only_quantization"]
