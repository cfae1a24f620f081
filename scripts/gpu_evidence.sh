#!/usr/bin/env bash
# Runs the GPU evidence in one go on a CUDA machine: the requires_cuda tests and the
# component benchmarks, each writing JSON under $OUT (default ./out). Usage:
#   VOICE_OUT_PARITY_DIR=path/to/tiny-a bash scripts/gpu_evidence.sh [steps...]
# Steps: info tests llm flow t2w engine16 (default: all). The server tests need aiortc, which
# the GPU machine lacks, so "tests" names the files with requires_cuda tests one by one.
set -u -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export OUT PYTHONUNBUFFERED=1
steps=${*:-info tests llm flow t2w engine16}
failed=""
run() {
  local name=$1 limit=$2; shift 2; echo "=== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40 || failed="$failed $name"
}
for s in $steps; do
  case $s in
    info) run info 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"' ;;
    tests) run tests 240 python3 -m pytest -q -m requires_cuda -p no:cacheprovider \
             tests/test_transfer.py tests/test_graphs.py tests/test_llm.py tests/test_llm_step.py tests/test_decode_kernels.py \
             tests/test_flow_streaming.py tests/test_flow_estimator.py tests/test_flow_final.py tests/test_flow_kernels.py \
             tests/test_token2wav_graphs.py tests/test_engine.py ;;
    llm) run llm 120 python3 scripts/bench_llm_step.py --device cuda --dtype bfloat16 --batches 1,8,32 ;;
    flow) run flow 150 python3 scripts/flow_chunk_cost.py --full --device cuda ;;
    t2w) run t2w 150 python3 scripts/token2wav_chunk_cost.py --full --device cuda --flow-dtype bfloat16 --tokens 1500 ;;
    engine16) run engine16 240 python3 scripts/bench_engine_16.py --model random:0.5b --device cuda --streams 16 ;;
  esac
done
[ -z "$failed" ] || { echo "FAILED:$failed"; exit 1; }
