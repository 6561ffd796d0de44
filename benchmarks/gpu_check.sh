#!/usr/bin/env bash
# GPU checks of the fast generation paths, on one CUDA device (sized for an H200):
#   1. the CUDA-only tests: graph capture and replay (every read bucket), graph-on == graph-off == plain generate,
#      capture refusal, the quantized static path under graphs, the compiled fused weight-only kernel, a prompt given
#      on the CPU to a model on the GPU;
#   2. benchmarks.bench_long_context --gpu: full Kimi-VL-A3B config with random bf16 weights, decode ms/step at
#      contexts 1K, 8K and 32K, batch 1 and 8: expanded vs absorbed MLA attention on plain generate(), and the static
#      path (CUDA graphs) with automatic and fixed capacity; batch-1 decode as a share of the bandwidth limit counting
#      the weights and the cached latent. Results: benchmarks/results/bench_long_context_cuda.json (written after
#      every measurement, so a stage stopped by its limit keeps what it measured);
#   3. benchmarks.bench_generate --gpu: decode tokens/s at batch 1/8/32 and time to first token against plain
#      generate() and transformers' static+compile. Results: benchmarks/results/bench_generate_cuda_full.json;
#   4. benchmarks.bench_quantization --gpu: the same config in bf16 and then weight-only int8, static-path decode
#      tokens/s at batch 1 and 8 and peak memory, and one layer's experts alone (int8 fused kernel and torch path vs
#      bf16). Results: benchmarks/results/bench_quantization_cuda_full.json.
# Under 8 minutes by design: every stage has a hard limit and the limits add up to 480 s (90 + 90 + 210 + 90). A
# benchmark variant that overruns is stopped and named in its JSON; measurements that would start after a stage's
# budget are skipped and named too. A stage that fails or overruns does not stop the later ones (a GPU session may
# get one try): the script goes on, names every failed stage at the end and then exits with status 1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
# Without `make venv` (e.g. a GPU machine with its own torch and transformers), import the packages from the checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA device visible")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)'

failed_stages=()
# Runs one stage; a failure (or its timeout's status 124) is noted and the next stage still runs.
stage() {
    local name=$1
    shift
    echo "=== gpu_check.sh: $name" >&2
    local status=0
    "$@" || status=$?
    if ((status)); then
        echo "gpu_check.sh: stage '$name' failed (exit status $status; 124 means over its time limit)" >&2
        failed_stages+=("$name")
    fi
}

# The test_cuda_* tests skip without CUDA; with it they must run, so a skip here counts as a failure.
cuda_tests() {
    timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_generation_fast.py tests/test_quantization.py \
        tests/test_fused_experts.py -k test_cuda_ -rs | tee /tmp/gpu_check_tests.log || return
    if grep -q "skipped" /tmp/gpu_check_tests.log; then
        echo "gpu_check.sh: CUDA tests were skipped on a CUDA machine" >&2
        return 1
    fi
}
stage "CUDA tests" cuda_tests

# Long context: stops starting measurements after 60 s; the hard limit leaves room for the one in flight.
stage "bench_long_context" timeout 90 "$PY" -m benchmarks.bench_long_context --gpu --budget-s 60

# plain and ours: under a minute each (55 s each at most); hf_static gets 80 s for its torch.compile.
stage "bench_generate" timeout 210 "$PY" -m benchmarks.bench_generate --gpu --compile-budget 80 --child-timeout 55 \
    --repeats 3

# bf16 then int8 in one process, static path only (graphs captured once per batch size): ~1 minute expected.
stage "bench_quantization" timeout 90 "$PY" -m benchmarks.bench_quantization --gpu --repeats 2

if ((${#failed_stages[@]})); then
    echo "gpu_check.sh: failed stages: ${failed_stages[*]}" >&2
    exit 1
fi
echo "gpu_check.sh: all stages passed" >&2
