#!/usr/bin/env bash
# GPU checks of the static-cache generation path, on one CUDA device (sized for an H200, under 8 minutes in all):
#   1. the CUDA-only tests: graph capture and replay, graph-on == graph-off == plain generate, capture refusal;
#   2. benchmarks/bench_generate.py --gpu: full Kimi-VL-A3B config with random bf16 weights, results JSON written to
#      benchmarks/results/bench_generate_cuda_full.json;
#   3. benchmarks/bench_quantization.py --gpu: the same config in bf16 and then weight-only int8, static-path decode
#      tokens/s at batch 1 and 8 and peak memory, in benchmarks/results/bench_quantization_cuda_full.json.
# Every stage has a hard time limit; a benchmark variant that overruns is stopped and noted in the JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
# Without `make venv` (e.g. a GPU machine with its own torch and transformers), import the packages from the checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA device visible")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)'

# The test_cuda_* tests skip without CUDA; with it they must run, so a skip here counts as a failure.
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_generation_fast.py tests/test_quantization.py -k test_cuda_ -rs \
    | tee /tmp/gpu_check_tests.log
if grep -q "skipped" /tmp/gpu_check_tests.log; then
    echo "gpu_check.sh: CUDA tests were skipped on a CUDA machine" >&2
    exit 1
fi

# plain and ours: ~1 minute each expected; hf_static gets the 3 minutes its torch.compile is allowed.
timeout 450 "$PY" benchmarks/bench_generate.py --gpu --compile-budget 180 --child-timeout 90 --repeats 3

# bf16 then int8 in one process, static path only (graphs captured once per batch size): ~1 minute expected.
timeout 150 "$PY" benchmarks/bench_quantization.py --gpu --repeats 2
