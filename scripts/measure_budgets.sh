#!/bin/bash
# The memory-budget rows of docs/benchmarks.md ("Memory budget"): voice-out bench at budgets of
# 22, 8 and 4 GiB and the default, then the GPU tests of the plan, on cuda:0, random:0.5b, bf16,
# within LIMIT seconds in all (a run that would not fit is skipped). Results in $OUT (default
# ./budget-out): one JSON and one log per budget.
#   LIMIT=600 OUT=budget-out bash scripts/measure_budgets.sh
set -u
OUT=${OUT:-budget-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD CUDA_VISIBLE_DEVICES=0
START=$(date +%s)
LIMIT=${LIMIT:-325}
left() { echo $(( LIMIT - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt
export TRITON_CACHE_DIR=$(mktemp -d)   # empty: the first start compiles every kernel
bench() {  # label, then bench arguments
  label=$1; shift; t=$(left); [ "$t" -lt 45 ] && { echo "skip $label ($t s left)"; return; }
  s0=$(date +%s)
  timeout $t python -m voice_out.cli bench --model random:0.5b --device cuda \
     --scenarios ttfa,capacity,memory --reps 10 --ramp-s 1 --out $OUT/$label.json "$@" > $OUT/$label.log 2>&1
  echo "$label rc=$? in $(( $(date +%s) - s0 )) s, at $(( $(date +%s) - START )) s"
}
bench b22 --gpu-memory 22 --streams 16,32
bench b8 --gpu-memory 8 --streams 16
bench b4 --gpu-memory 4 --streams 4
t=$(left); if [ "$t" -gt 60 ]; then t=$(( t > 110 ? 110 : t ))
  timeout $t python -m pytest tests/test_plan_gpu.py -q -x -p no:cacheprovider -rA > $OUT/test_plan_gpu.log 2>&1; echo "gpu tests rc=$?"
fi
bench default --streams 16,48
for f in $OUT/*.log; do echo "== $f"; grep -h "plan:\|Error\|error\|startup\.\|gpu.mem\|ttfa.whole_text\|capacity: [0-9]* streams:\|passed\|failed" $f | cut -c1-400 | head -30; done
