#!/usr/bin/env bash
# Multi-GPU verification on one host with 2+ GPUs (logs and metrics -> $OUT):
#   1. configs/tiny_gpu.yaml (FP8 trainer + vLLM FP8 + FP8 KV) for 3 steps on 1 rank, then on 2 ranks
#      (FSDP2, one vLLM engine per rank): the same global batch must give the same step-0 figures
#      (rollouts are seeded per sample; FP8 GEMMs group tokens differently, so "close", not equal).
#   2. bench/step_8b.yaml (Llama-3.1-8B widths, 16 layers, bf16) on 2 ranks: the 8B-shape step runs.
set -uo pipefail
OUT=${OUT:-/tmp/mgpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PY=${PY:-python3} TRITON_CACHE_AUTOTUNING=1
RUNS=/tmp/mgpu_runs; rm -rf "$RUNS"
TINY="--config configs/tiny_gpu.yaml train.steps=3 train.val_every=0 train.save_final=false log.tensorboard=false
      log.dump_episodes_every=0 train.out_dir=$RUNS"
CUDA_VISIBLE_DEVICES=0 $PY train_grpo.py $TINY train.run_name=one > "$OUT/mg_tiny_1rank.log" 2>&1; echo "1 rank: exit $?"
$PY -m torch.distributed.run --standalone --nproc_per_node 2 train_grpo.py $TINY train.run_name=two \
  > "$OUT/mg_tiny_2rank.log" 2>&1; echo "2 ranks: exit $?"
cp "$RUNS/one/metrics.jsonl" "$OUT/mg_tiny_1rank_metrics.jsonl"; cp "$RUNS/two/metrics.jsonl" "$OUT/mg_tiny_2rank_metrics.jsonl"
$PY - "$RUNS" <<'PY'
import json, sys
one, two = ([json.loads(l) for l in open(f"{sys.argv[1]}/{n}/metrics.jsonl")] for n in ("one", "two"))
for k in ("reward/mean", "optim/grad_norm", "loss/policy", "mismatch/token_mult_prob_error", "response/length_mean",
          "time/step"):
    print(f"{k:34s} 1 rank {[round(m.get(k, float('nan')), 5) for m in one]}  2 ranks {[round(m.get(k, float('nan')), 5) for m in two]}")
PY
$PY -m torch.distributed.run --standalone --nproc_per_node 2 train_grpo.py --config bench/step_8b.yaml \
  model.tiny.num_layers=16 train.out_dir=$RUNS train.run_name=step8b > "$OUT/mg_step8b_2rank.log" 2>&1
echo "8B-shape step on 2 ranks: exit $?"; cp "$RUNS/step8b/metrics.jsonl" "$OUT/mg_step8b_2rank_metrics.jsonl"
grep -o '"time/step": [0-9.]*\|"time/rollout": [0-9.]*\|"time/train": [0-9.]*' "$OUT/mg_step8b_2rank_metrics.jsonl"
