"""One Triton kernel for decode with weight-only int8 / int4 weights: multiply each row of a few rows by the weight of
the expert it chose, reading that weight as it is stored and dequantising it in registers.

Why a kernel: decode is memory-bound, so its speed is the bytes it reads. In plain torch, multiplying by int8 rows
picked with a device-side index takes a gather (a copy of the chosen experts), a cast to the compute dtype (twice
that size) and a batched matmul over the cast copy: more bytes than bf16 weights, not half. Here each program reads
one block of its expert's output rows once, int8 (or int4, two per byte) plus one scale per row (per group for int4),
multiplies in float32 and writes its slice of the output. Nothing else is read, nothing is allocated but the output,
and the launch depends only on shapes, so the static path captures it in CUDA graphs. Triton compiles the kernel at
its first launch for each specialisation (dtypes, scheme, a layer's sizes); a capture must not compile, and none does:
the static path runs every step eagerly once before capturing it (`static_steps_kimi_vl.StaticStep`).

It is a matrix-vector kernel (no tensor cores), meant for the few rows of decode: the caller keeps prefill-sized inputs
on the dequantise-then-matmul path (`quantization_kimi_vl.FUSED_MAX_PAIRS_PER_WEIGHT`). The launch puts pairs on the
fastest grid axis, so pairs that chose the same expert read each weight block at about the same time, and the repeats
come from L2 rather than memory.

Triton is optional (CUDA builds of torch bring it). The kernel runs on CUDA tensors, and on CPU tensors under Triton's
interpreter (`TRITON_INTERPRET=1` set before import), which is how the tests check it without a GPU. Where Triton is
installed but cannot build or launch it (no C compiler for its launcher, a GPU it does not support), the first call
warns and the device is marked, and the quantized layers take their torch paths there from then on.
"""

import contextlib
import warnings

import torch
from transformers.utils.import_utils import is_triton_available

# Tile of one program: BLOCK_ROWS output rows times BLOCK_COLS stored input columns (bytes, for both schemes). 128 bytes
# per row and step is a full cache line per row; 32 rows keep ~500 programs in flight at A3B's decode shapes.
BLOCK_ROWS = 32
BLOCK_COLS = 128

if is_triton_available():
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    @triton.jit
    def _weight_only_rows_kernel(
        inputs_ptr,  # [input_rows, in_features], the compute dtype
        weight_ptr,  # [experts, out_features, stored columns]: int8, or uint8 with two int4 values (low nibble first)
        scale_ptr,  # int8: [experts, out_features]; int4: [experts, out_features, in_features // group_size]
        expert_ids_ptr,  # [pairs]
        out_ptr,  # [pairs, out_features], the compute dtype
        out_features,
        in_features,
        pairs_per_input_row,  # pair p multiplies input row p // pairs_per_input_row
        group_size,  # int4 only
        INT4: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
    ):
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < out_features
        expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
        weight_rows = expert * out_features + rows.to(tl.int64)  # row index into [experts * out_features, ...]
        inputs_row = inputs_ptr + (pair // pairs_per_input_row).to(tl.int64) * in_features
        # Products are summed per tile position and reduced across the tile once, after the loop (a reduction per
        # step would shuffle between threads at every step).
        products = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
        if INT4:
            stored_columns = in_features // 2
            groups = in_features // group_size
            for start in range(0, stored_columns, BLOCK_COLS):
                columns = start + tl.arange(0, BLOCK_COLS)
                column_mask = columns < stored_columns
                mask = row_mask[:, None] & column_mask[None, :]
                packed = tl.load(
                    weight_ptr + weight_rows[:, None] * stored_columns + columns[None, :], mask=mask, other=0
                ).to(tl.int32)
                low = ((packed & 15) - 8).to(tl.float32)  # input 2j
                high = ((packed >> 4) - 8).to(tl.float32)  # input 2j + 1, same group (group_size is even)
                even = tl.load(inputs_row + 2 * columns, mask=column_mask, other=0.0).to(tl.float32)
                odd = tl.load(inputs_row + 2 * columns + 1, mask=column_mask, other=0.0).to(tl.float32)
                scale = tl.load(
                    scale_ptr + weight_rows[:, None] * groups + (2 * columns[None, :]) // group_size,
                    mask=mask,
                    other=0.0,
                ).to(tl.float32)
                products += (low * even[None, :] + high * odd[None, :]) * scale
            accumulator = tl.sum(products, axis=1)
        else:
            for start in range(0, in_features, BLOCK_COLS):
                columns = start + tl.arange(0, BLOCK_COLS)
                column_mask = columns < in_features
                mask = row_mask[:, None] & column_mask[None, :]
                weight = tl.load(weight_ptr + weight_rows[:, None] * in_features + columns[None, :], mask=mask, other=0)
                values = tl.load(inputs_row + columns, mask=column_mask, other=0.0).to(tl.float32)
                products += weight.to(tl.float32) * values[None, :]
            # One scale per output row factors out of the dot product.
            scale = tl.load(scale_ptr + weight_rows, mask=row_mask, other=0.0).to(tl.float32)
            accumulator = tl.sum(products, axis=1) * scale
        out_row = out_ptr + pair.to(tl.int64) * out_features
        tl.store(out_row + rows, accumulator.to(out_ptr.dtype.element_ty), mask=row_mask)

    # `triton.jit` chose when it made the kernel: under the interpreter (TRITON_INTERPRET=1) it runs on CPU tensors,
    # and only there. Asked of the kernel itself, which every Triton release answers the same way (`triton.knobs`,
    # which holds the setting, is 3.4's: torch 2.6 and 2.7 bring 3.2 and 3.3).
    KERNEL_DEVICE_TYPES = ("cpu",) if isinstance(_weight_only_rows_kernel, InterpretedFunction) else ("cuda",)
else:
    KERNEL_DEVICE_TYPES = ()


# Devices where the kernel failed to compile or launch (Triton without a C compiler for its launcher, a GPU it does not
# support): it is not tried there again, and the quantized layers take their torch paths.
FAILED_DEVICES: set[torch.device] = set()


class FusedKernelUnavailable(RuntimeError):
    """The kernel cannot run on this device; a warning gave Triton's reason once."""


def fused_kernel_runs_on(device: torch.device) -> bool:
    return device.type in KERNEL_DEVICE_TYPES and device not in FAILED_DEVICES


def weight_only_rows_matmul(
    inputs: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    expert_ids: torch.Tensor,
    pairs_per_input_row: int,
    group_size: int | None,
) -> torch.Tensor:
    """`out[p] = inputs[p // pairs_per_input_row] @ dequantized(qweight[expert_ids[p]]).T` for every pair p.

    `inputs [rows, in]`; `qweight [experts, out, in]` int8 with `scale [experts, out]`, or `qweight [experts, out,
    in / 2]` packed int4 with `scale [experts, out, in / group_size]` (`group_size` given for int4 only);
    `expert_ids [pairs]`. Returns `[pairs, out]` in the inputs' dtype.
    """
    int4 = group_size is not None
    num_pairs = expert_ids.numel()
    out_features = qweight.shape[-2]
    in_features = qweight.shape[-1] * (2 if int4 else 1)
    if inputs.shape[-1] != in_features or num_pairs != inputs.shape[0] * pairs_per_input_row:
        raise ValueError(
            f"weight_only_rows_matmul: inputs {tuple(inputs.shape)} x {pairs_per_input_row} pair(s) per row do not "
            f"match {num_pairs} expert ids and a weight of {in_features} input features."
        )
    out = inputs.new_empty(num_pairs, out_features)
    if num_pairs == 0:
        return out
    grid = (num_pairs, triton.cdiv(out_features, BLOCK_ROWS))
    # Triton launches on the current CUDA device's current stream, not on the tensors' device: a model spread over
    # GPUs (device_map) runs layers on other devices than the current one.
    on_inputs_device = torch.cuda.device(inputs.device) if inputs.device.type == "cuda" else contextlib.nullcontext()
    try:
        with on_inputs_device:
            _weight_only_rows_kernel[grid](
                inputs.contiguous(),
                qweight.contiguous(),
                scale.contiguous(),
                expert_ids.contiguous(),
                out,
                out_features,
                in_features,
                pairs_per_input_row,
                group_size or 0,
                INT4=int4,
                BLOCK_ROWS=BLOCK_ROWS,
                BLOCK_COLS=BLOCK_COLS,
            )
    except Exception as error:  # Triton's compile and launch errors share no base class
        FAILED_DEVICES.add(inputs.device)
        warnings.warn(
            f"The fused weight-only kernel cannot run on {inputs.device} ({type(error).__name__}: {error}); quantized "
            "layers there use their torch paths from now on (correct, but decode reads more memory).",
            stacklevel=2,
        )
        raise FusedKernelUnavailable(f"the fused weight-only kernel cannot run on {inputs.device}") from error
    return out
