"""The fused weight-only kernel (modeling_kimi_vl/fused_experts_kimi_vl.py), checked on CPU under Triton's interpreter.

tests/interpreted_kernel_worker.py runs the kernel in a process started with TRITON_INTERPRET=1 (the interpreter is
chosen when the kernel is defined, so it cannot be switched on inside this process); this module computes the
references with plain torch and compares. On a CUDA machine, tests/test_quantization.py's CUDA tests run the compiled
kernel inside the model and its CUDA graphs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import fixture_logits, fixture_request
from interpreted_kernel_worker import KERNEL_CASES, NEW_TOKENS, kernel_case_inputs
from interpreted_kernel_worker import load_quantized as load_quantized_like_the_worker
from safetensors.torch import load_file

from modeling_kimi_vl.fused_experts_kimi_vl import fused_kernel_runs_on, weight_only_rows_matmul
from modeling_kimi_vl.transformers_compat_modeling import quantization_supported

pytest.importorskip("triton", reason="the fused kernel needs Triton (installed with the test extra)")
pytestmark = pytest.mark.skipif(not quantization_supported(), reason="quantized loading needs a newer transformers")
WORKER_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def worker_run(reference_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interpreted")
    command = [
        sys.executable, str(Path(__file__).with_name("interpreted_kernel_worker.py")),
        "--checkpoint", str(reference_dir / "tiny_ref"), "--expected", str(reference_dir / "expected.safetensors"),
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    if completed.returncode != 0:
        pytest.fail(f"interpreted kernel run failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return out


@pytest.fixture(scope="module")
def results(worker_run) -> dict[str, torch.Tensor]:
    return load_file(worker_run / "results.safetensors")


@pytest.fixture(scope="module")
def report(worker_run) -> dict:
    return json.loads((worker_run / "report.json").read_text())


def test_this_process_does_not_use_the_kernel_on_cpu():
    """Without the interpreter the CPU keeps the torch path: the references below are computed without the kernel."""
    assert not fused_kernel_runs_on(torch.device("cpu"))


def test_the_kernel_module_imports_with_a_triton_that_has_no_knobs():
    """torch 2.6 and 2.7's CUDA builds bring Triton 3.2 / 3.3, which have no `triton.knobs` (3.4's): the model package
    still imports, and the compiled kernel serves CUDA tensors."""
    script = (
        "import triton; del triton.knobs; from modeling_kimi_vl.fused_experts_kimi_vl import KERNEL_DEVICE_TYPES; "
        "print(KERNEL_DEVICE_TYPES)"
    )
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip() == "('cuda',)"


def assert_equals_dequantize_then_matmul(out: torch.Tensor, case: str):
    case_inputs = kernel_case_inputs(case)
    scheme, inputs, repeats = case_inputs["scheme"], case_inputs["inputs"], case_inputs["repeats"]
    expert_ids = case_inputs["expert_ids"]
    weights = scheme.dequantize(case_inputs["qweight"][expert_ids], case_inputs["scale"][expert_ids], torch.float32)
    rows = inputs.float().repeat_interleave(repeats, dim=0)
    reference = torch.bmm(weights, rows.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == inputs.dtype and out.shape == reference.shape
    # float32 accumulation in both: only the summation order differs. bf16 and fp16 outputs are rounded once (at most
    # 2^-8 relative).
    tolerance = 1e-5 if inputs.dtype == torch.float32 else 2**-8
    torch.testing.assert_close(
        out.cpu().float(), reference, rtol=tolerance, atol=tolerance * reference.abs().max().item()
    )


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_interpreted_kernel_equals_dequantize_then_matmul(results, case):
    assert_equals_dequantize_then_matmul(results[f"kernel.{case}"], case)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_cuda_compiled_kernel_equals_dequantize_then_matmul(case):
    case_inputs = kernel_case_inputs(case)
    on_device = {name: value.cuda() if torch.is_tensor(value) else value for name, value in case_inputs.items()}
    out = weight_only_rows_matmul(
        on_device["inputs"], on_device["qweight"], on_device["scale"], on_device["expert_ids"], on_device["repeats"],
        on_device["scheme"].group_size,
    )  # fmt: skip
    assert_equals_dequantize_then_matmul(out, case)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_quantized_model_went_through_the_kernel(report, scheme):
    assert report["kernel_runs_on_cpu"]
    assert report["launches"][scheme].get("experts", 0) > 0
    assert report["launches"][scheme].get("linear", 0) > 0  # decode steps' linear layers


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_model_with_the_kernel_equals_the_torch_path(reference_checkpoint, expected, results, scheme):
    """Logits (every pair through the kernel) and greedy tokens, plain and static, equal the torch path's."""
    torch_path_batched = load_quantized_like_the_worker(
        reference_checkpoint, scheme, experts_implementation="batched_mm"
    )
    torch.testing.assert_close(
        results[f"{scheme}.logits"], fixture_logits(torch_path_batched, expected), rtol=1e-5, atol=1e-5
    )
    torch_path = load_quantized_like_the_worker(reference_checkpoint, scheme)
    plain = torch_path.generate(**fixture_request(expected), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(results[f"{scheme}.plain"], plain)
    assert torch.equal(results[f"{scheme}.static"], plain)


class KernelWithoutACompiler:
    """Stands for the Triton kernel: launching it fails as Triton does where it finds no C compiler."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

        return launch


def test_a_kernel_that_cannot_compile_leaves_the_torch_paths_with_one_warning(
    reference_checkpoint, expected, monkeypatch
):
    """Triton installed but unable to build the kernel (no C compiler for its launcher, a GPU it does not support):
    the quantized layers warn once and compute on their torch paths, then and from then on."""
    from modeling_kimi_vl import fused_experts_kimi_vl

    # batched_mm: every (token, expert) pair of the prompts would go through the kernel.
    model = load_quantized_like_the_worker(reference_checkpoint, "int8", experts_implementation="batched_mm")
    torch_path = fixture_logits(model, expected)
    monkeypatch.setattr(fused_experts_kimi_vl, "KERNEL_DEVICE_TYPES", ("cpu",))  # as if this CPU were a GPU
    monkeypatch.setattr(fused_experts_kimi_vl, "FAILED_DEVICES", set())
    monkeypatch.setattr(fused_experts_kimi_vl, "_weight_only_rows_kernel", KernelWithoutACompiler())
    with pytest.warns(UserWarning, match="cannot run on cpu .*Failed to find C compiler") as warned:
        fallen_back = fixture_logits(model, expected)
    assert len(warned) == 1
    assert not fused_kernel_runs_on(torch.device("cpu"))
    torch.testing.assert_close(fallen_back, torch_path, rtol=1e-5, atol=1e-5)
