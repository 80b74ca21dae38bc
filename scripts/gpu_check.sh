#!/usr/bin/env bash
# The Hopper-host verification, in parts that each fit one device call (logs -> $OUT):
#   bash scripts/gpu_check.sh fp8      tests/gpu/test_fp8_gpu.py + bench/train.py linear
#   bash scripts/gpu_check.sh vllm     tests/gpu/test_vllm_engine.py
#   bash scripts/gpu_check.sh align    bench/alignment.py
#   bash scripts/gpu_check.sh tiny     configs/tiny_gpu.yaml end to end
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/env.log"
case "$1" in
  fp8)   $PY -m pytest tests/gpu/test_fp8_gpu.py -v -rs 2>&1 | tee "$OUT/gpu_tests_fp8.log"
         $PY bench/train.py linear --out "$OUT" 2>&1 | tee "$OUT/bench_linear.log" ;;
  vllm)  $PY -m pytest tests/gpu/test_vllm_engine.py -v -rs 2>&1 | tee "$OUT/gpu_tests_vllm.log" ;;
  align) $PY bench/alignment.py --out "$OUT" 2>&1 | tee "$OUT/alignment.log" ;;
  tiny)  $PY train_grpo.py --config configs/tiny_gpu.yaml train.out_dir=/tmp/runs train.run_name=tiny_gpu \
           "${@:2}" 2>&1 | tee "$OUT/tiny_gpu.log"
         cp /tmp/runs/tiny_gpu/metrics.jsonl "$OUT/tiny_gpu_metrics.jsonl" ;;
  *) echo "usage: gpu_check.sh fp8|vllm|align|tiny" >&2; exit 2 ;;
esac
