#!/usr/bin/env bash
# Multi-GPU verification on one host with 2+ GPUs, in parts that each fit one device call (-> $OUT):
#   bash scripts/multi_gpu_check.sh dp     configs/tiny_gpu.yaml (FP8 trainer + vLLM FP8 + FP8 KV), 3 steps on 1
#                                          rank, then on 2 ranks (FSDP2, one vLLM engine per rank): the same
#                                          global batch must give close step-0 figures (rollouts are seeded per
#                                          sample; FP8 GEMMs group tokens differently, so "close", not equal)
#   bash scripts/multi_gpu_check.sh tp     the same on 2 ranks sharing one tensor-parallel vLLM engine
#                                          (rollout.tensor_parallel_size=2), compared with the 1-rank run of `dp`
#                                          ($OUT/mg_tiny_1rank_metrics.jsonl, else the committed one)
#   bash scripts/multi_gpu_check.sh step8b [OVERRIDES]  bench/step_8b.yaml (Llama-3.1-8B widths, 16 layers, bf16)
#                                          on 2 ranks, one engine per rank, then one TP=2 engine
set -uo pipefail
OUT=${OUT:-/tmp/mgpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PY=${PY:-python3}
RUNS=$(mktemp -d /tmp/mgpu_runs.XXXX)  # fresh run dirs: train_grpo.py refuses one that holds a run
TINY="--config configs/tiny_gpu.yaml train.steps=3 train.val_every=0 train.save_final=false log.tensorboard=false
      log.dump_episodes_every=0 train.out_dir=$RUNS"
RUN2="$PY -m torch.distributed.run --standalone --nproc_per_node 2 train_grpo.py"
compare() {  # compare METRICS_A METRICS_B LABEL_A LABEL_B
  $PY - "$@" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
for k in ("reward/mean", "optim/grad_norm", "loss/policy", "mismatch/token_mult_prob_error", "response/length_mean",
          "time/step", "time/rollout", "time/train"):
    print(f"{k:34s} {sys.argv[3]} {[round(m.get(k, float('nan')), 5) for m in a]}  "
          f"{sys.argv[4]} {[round(m.get(k, float('nan')), 5) for m in b]}")
PY
}
case "${1:-}" in
  dp)
    CUDA_VISIBLE_DEVICES=0 $PY train_grpo.py $TINY train.run_name=one > "$OUT/mg_tiny_1rank.log" 2>&1; echo "1 rank: exit $?"
    $RUN2 $TINY train.run_name=two > "$OUT/mg_tiny_2rank.log" 2>&1; echo "2 ranks: exit $?"
    cp "$RUNS/one/metrics.jsonl" "$OUT/mg_tiny_1rank_metrics.jsonl"; cp "$RUNS/two/metrics.jsonl" "$OUT/mg_tiny_2rank_metrics.jsonl"
    compare "$OUT/mg_tiny_1rank_metrics.jsonl" "$OUT/mg_tiny_2rank_metrics.jsonl" "1 rank" "2 ranks" ;;
  tp)
    $RUN2 $TINY rollout.tensor_parallel_size=2 train.run_name=tp2 > "$OUT/mg_tiny_tp2.log" 2>&1; echo "2 ranks, TP=2: exit $?"
    cp "$RUNS/tp2/metrics.jsonl" "$OUT/mg_tiny_tp2_metrics.jsonl"
    one="$OUT/mg_tiny_1rank_metrics.jsonl"; [ -f "$one" ] || one=docs/results_data/multi_gpu/mg_tiny_1rank_metrics.jsonl
    compare "$one" "$OUT/mg_tiny_tp2_metrics.jsonl" "1 rank" "2 ranks TP=2" ;;
  step8b)
    STEP="--config bench/step_8b.yaml model.tiny.num_layers=16 train.out_dir=$RUNS ${*:2}"
    for tp in 1 2; do
      $RUN2 $STEP rollout.tensor_parallel_size=$tp train.run_name=step8b_tp$tp > "$OUT/mg_step8b_2rank_tp$tp.log" 2>&1
      echo "8B-shape step on 2 ranks, TP=$tp: exit $?"
      cp "$RUNS/step8b_tp$tp/metrics.jsonl" "$OUT/mg_step8b_2rank_tp${tp}_metrics.jsonl"
    done
    compare "$OUT/mg_step8b_2rank_tp1_metrics.jsonl" "$OUT/mg_step8b_2rank_tp2_metrics.jsonl" "TP=1" "TP=2" ;;
  *) echo "usage: multi_gpu_check.sh dp|tp|step8b [OVERRIDES]" >&2; exit 2 ;;
esac
