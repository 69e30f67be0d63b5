#!/usr/bin/env bash
# The GPU check, meant to finish within 10 minutes on a machine with an NVIDIA GPU that
# is set up already (the first run installs CUDA vLLM, infra/requirements/lock-cuda.txt:
# several GB, from the network), starts the servers, then runs
#   1. the side-by-side benchmark: Tandoor's whole path against vLLM's own OpenAI
#      server, 1 and 32 streams (bench/gateway_vs_vllm.py);
#   2. the fairness phase of the load benchmark (bench/gateway_load.py);
#   3. the engine tests (dtype, model configuration, the worker against the real engine).
# Figures and test output go to $OUT (default .tandoor/gpu-check), one file per step.
#     bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.tandoor/gpu-check}"
mkdir -p "$out"

nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv | tee "$out/gpu.txt"
TANDOOR_ENGINE=cuda scripts/bootstrap.sh
source scripts/test_env.sh
tandoor infra up
trap 'tandoor infra down' EXIT

failed=()
step() {  # name, time limit (s), command...: a failed step is reported, the next runs
    local name=$1 limit=$2; shift 2
    echo "== $name ($(date +%T), at most ${limit} s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" || failed+=("$name")
}
step gateway_vs_vllm 240 python -m bench.gateway_vs_vllm --concurrency 1 32 --requests-per-stream 4
step fairness 180 python -m bench.gateway_load --phase fairness --probe-s 30 --flood-warmup-s 5
step engine_tests 150 pytest -q -p no:cacheprovider tests/unit/test_dtype.py \
    tests/unit/test_model_config.py tests/integration/test_worker.py \
    tests/integration/test_chat_template.py
echo "== done: figures in $out${failed[*]:+; FAILED: ${failed[*]}}"
[ ${#failed[@]} -eq 0 ]
