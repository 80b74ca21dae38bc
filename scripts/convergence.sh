#!/usr/bin/env bash
# The convergence study in one GPU call: SFT a small Llama, then the five ablation GRPO
# runs of configs/ablations/ (x seeds) as concurrent processes on ONE GPU, then plots + table.
#
#   bash scripts/convergence.sh                         # seed 0, 40 steps, everything stops by 520 s
#   bash scripts/convergence.sh --seeds 0,1 --steps 40 --deadline-s 540
#   PY=.venv/bin/python OUT=/tmp/out bash scripts/convergence.sh --configs bf16,fp8_tis
#
# Options:
#   --seeds 0,1          seeds (train.seed = rollout.seed = data.seed; the task split is fixed)
#   --steps N            train.steps of every run (default 40)
#   --deadline-s S       seconds from the start of this script (default 520); runs still going
#                        then get SIGTERM, their metrics.jsonl so far are kept
#   --sft-minutes M      SFT time budget (default 2.5)
#   --min-sft-acc A      if the SFT model's greedy accuracy on the task's val set is below A
#                        (default 0.1), the runs use the highest easier difficulty where it is
#                        >= A (sft.py never trains on any level's val set); 0 = never
#   --configs a,b        the study's configs in configs/ablations/ (base: ablations/base.yaml; default: all
#                        five, started in that order); the CPU ablations there (tiny_cpu_is*) are refused
#   --work DIR           SFT model and run dirs (default /tmp/conv)
#   --stagger-timeout-s  longest wait for a run's engine before starting the next (default 90)
#   --sft-args "..."     extra scripts/sft.py arguments
#   --extra "k=v ..."    extra train_grpo.py overrides for every run; a CPU smoke test:
#     --sft-args "--toy --device cpu --minutes 0.1" --extra "rollout.engine=hf train.device=cpu"
#
# Timeline (one H200): SFT ~3 min (scripts/sft.py --minutes 2.5, stops early once dev accuracy
# reaches --stop-acc) while a second process compiles and autotunes torchao's FP8 kernels into
# Triton's disk cache (fp8.torchao.keep_triton_autotuning), so the FP8 runs skip that ~100 s; then the runs
# start one after another: the next one only when the previous one's vLLM engine is up (its log
# says "init engine", or it logged a step, or --stagger-timeout-s passed), because vLLM's start-up
# memory profiling fails or misjudges when another process allocates or frees GPU memory at the
# same time. Memory per run: vLLM 0.08 of the GPU (rollout.gpu_memory_utilization) + trainer ~3-5 GB.
#
# Out ($OUT, flat): conv_<config>_s<seed>_metrics.jsonl, conv_<config>_s<seed>.log, conv_sft.log,
# conv_sft_metrics.json, conv_warm_fp8.log, convergence_*.png, convergence_table.md, conv_driver.log.
set -uo pipefail
set -m   # each background job in its own process group: signals reach the whole run
START=$(date +%s)
OUT=${OUT:-/tmp/conv_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # python -m scripts.sft, from whatever directory
export PYTHONUNBUFFERED=1 PY=${PY:-python3} TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

SEEDS=0; STEPS=40; DEADLINE=520; SFT_MIN=2.5; MIN_SFT_ACC=0.1; WORK=/tmp/conv; STAGGER_TIMEOUT=90; SFT_ARGS=""; EXTRA=""
STUDY=bf16,fp8_tis,fp8_nois,fp8kv_tis,fp8rollout_tis   # the study's configs (base: ablations/base.yaml)
CONFIGS=$STUDY   # started in this order: the last gets the fewest steps
while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) SEEDS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --deadline-s) DEADLINE=$2; shift 2 ;;
    --sft-minutes) SFT_MIN=$2; shift 2 ;;
    --min-sft-acc) MIN_SFT_ACC=$2; shift 2 ;;
    --configs) CONFIGS=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --stagger-timeout-s) STAGGER_TIMEOUT=$2; shift 2 ;;
    --sft-args) SFT_ARGS=$2; shift 2 ;;
    --extra) EXTRA=$2; shift 2 ;;
    *) echo "error: convergence.sh: unknown option $1 (see the header)" >&2; exit 2 ;;
  esac
done
for c in ${CONFIGS//,/ }; do
  f="$ROOT/configs/ablations/$c.yaml"
  [ -f "$f" ] || { echo "error: --configs $c: no configs/ablations/$c.yaml; the study's are $STUDY" >&2; exit 2; }
  grep -qx 'base: base.yaml' "$f" || { echo "error: --configs $c: configs/ablations/$c.yaml is not one of the study's" \
    "(its base is not ablations/base.yaml; the study's are $STUDY); run it with train_grpo.py --config" >&2; exit 2; }
done

log() { echo "[conv +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/conv_driver.log"; }
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
nlines() { if [ -f "$1" ]; then wc -l < "$1"; else echo 0; fi; }
alive() { local p; for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
stop_jobs() {  # SIGTERM each job's process group (our own children only), SIGKILL what is left after 10 s
  local p
  for p in "$@"; do kill -0 "$p" 2>/dev/null && { kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p"; }; done
  for _ in $(seq 20); do alive "$@" || return 0; sleep 0.5; done
  for p in "$@"; do kill -0 "$p" 2>/dev/null && { kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p"; }; done
}

log "seeds=$SEEDS steps=$STEPS deadline=${DEADLINE}s configs=$CONFIGS work=$WORK PY=$PY"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$OUT/conv_driver.log"
rm -rf "$WORK/runs" "$WORK/sft_model"; mkdir -p "$WORK/runs"
rm -f "$OUT"/conv_*_metrics.jsonl  # a previous study's runs would be plotted with this one's

# ---- 1. SFT, with the FP8 kernel warm-up next to it
$PY -m scripts.sft --out "$WORK/sft_model" --minutes "$SFT_MIN" $SFT_ARGS > "$OUT/conv_sft.log" 2>&1 &
SFT_PID=$!
$PY -m scripts.sft --warm-fp8 $SFT_ARGS > "$OUT/conv_warm_fp8.log" 2>&1 &
WARM_PID=$!
while kill -0 "$SFT_PID" 2>/dev/null && [ "$(left)" -gt 0 ]; do sleep 2; done
if kill -0 "$SFT_PID" 2>/dev/null; then log "SFT still running at the deadline: stopping it"; stop_jobs "$SFT_PID"; fi
wait "$SFT_PID"; SFT_RC=$?
for _ in $(seq 60); do kill -0 "$WARM_PID" 2>/dev/null || break; sleep 1; done  # must not free memory later
stop_jobs "$WARM_PID"; wait "$WARM_PID" 2>/dev/null
tail -n 3 "$OUT/conv_warm_fp8.log" | sed 's/^/  /'
cp "$WORK/sft_model/sft_metrics.json" "$OUT/conv_sft_metrics.json" 2>/dev/null
if [ "$SFT_RC" -ne 0 ] || [ ! -f "$WORK/sft_model/config.json" ]; then
  log "SFT failed (rc $SFT_RC); see $OUT/conv_sft.log"; tail -n 20 "$OUT/conv_sft.log"; exit 1
fi
log "SFT done: $(grep -o 'greedy accuracy on the GRPO val set.*' "$OUT/conv_sft.log" | head -c 300)"
# Fallback: if the SFT model solves fewer than --min-sft-acc of the task's validation problems,
# GRPO has no signal; run the study one difficulty lower (the highest level the model can do;
# sft.py never trains on any level's validation set, so it stays held out).
LEVEL=$($PY - "$WORK/sft_model/sft_metrics.json" "$MIN_SFT_ACC" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
acc, task = {int(k): v for k, v in m["val_accuracy_by_difficulty"].items()}, m["task_difficulty"]
ok = [d for d in sorted(acc) if d <= task and acc[d] >= float(sys.argv[2])]
print(task if acc[task] >= float(sys.argv[2]) or not ok else max(ok))
PYEOF
)
TASK_LEVEL=$(grep -o '"task_difficulty": [0-9]*' "$WORK/sft_model/sft_metrics.json" | grep -o '[0-9]*$')
if [ -n "$LEVEL" ] && [ "$LEVEL" != "$TASK_LEVEL" ]; then
  log "WARNING: SFT accuracy at difficulty $TASK_LEVEL < $MIN_SFT_ACC: GRPO runs use data.synthetic.difficulty=$LEVEL"
  EXTRA="data.synthetic.difficulty=$LEVEL $EXTRA"
fi

# ---- 2. GRPO runs, staggered starts, one GPU
declare -A PIDS
for seed in ${SEEDS//,/ }; do
  for c in ${CONFIGS//,/ }; do
    name="${c}_s${seed}"
    if [ "$(left)" -le 30 ]; then log "no time left to start $name"; continue; fi
    # shellcheck disable=SC2086  # EXTRA is a list of overrides
    $PY "$ROOT/train_grpo.py" --config "$ROOT/configs/ablations/$c.yaml" model.name_or_path="$WORK/sft_model" \
      train.out_dir="$WORK/runs" train.run_name="$name" train.steps="$STEPS" \
      train.seed="$seed" rollout.seed="$seed" data.seed="$seed" $EXTRA > "$WORK/runs/$name.log" 2>&1 &
    PIDS[$name]=$!
    log "started $name (pid ${PIDS[$name]})"
    t0=$(date +%s)
    while true; do  # wait until its engine is up before the next start
      if grep -q "init engine" "$WORK/runs/$name.log" 2>/dev/null; then why="vLLM engine up"; break; fi
      if [ -s "$WORK/runs/$name/metrics.jsonl" ]; then why="first step logged"; break; fi
      if ! kill -0 "${PIDS[$name]}" 2>/dev/null; then why="exited"; break; fi
      if [ $(( $(date +%s) - t0 )) -ge "$STAGGER_TIMEOUT" ]; then why="stagger timeout"; break; fi
      if [ "$(left)" -le 0 ]; then why="deadline"; break; fi
      sleep 1
    done
    log "$name: $why after $(( $(date +%s) - t0 ))s"
  done
done

# ---- 3. wait for the runs or the deadline
while [ "$(left)" -gt 0 ]; do
  running=0
  for name in "${!PIDS[@]}"; do kill -0 "${PIDS[$name]}" 2>/dev/null && running=$((running + 1)); done
  [ "$running" -eq 0 ] && break
  sleep 2
done
declare -A STOPPED
for name in "${!PIDS[@]}"; do
  if kill -0 "${PIDS[$name]}" 2>/dev/null; then
    STOPPED[$name]=1
    log "deadline: stopping $name ($(nlines "$WORK/runs/$name/metrics.jsonl") steps logged)"
  fi
done
[ ${#PIDS[@]} -gt 0 ] && stop_jobs "${PIDS[@]}"
for name in "${!PIDS[@]}"; do
  wait "${PIDS[$name]}"; rc=$?
  log "$name: rc $rc, $(nlines "$WORK/runs/$name/metrics.jsonl") metrics lines"
  if [ "$rc" -ne 0 ] && [ -z "${STOPPED[$name]:-}" ]; then  # failed on its own: show why
    tr '\r' '\n' < "$WORK/runs/$name.log" | grep -v '^ *$' | tail -n 8 | cut -c1-300 | sed "s/^/  $name: /"
  fi
done

# ---- 4. collect (flat) and plot
for name in "${!PIDS[@]}"; do
  cp "$WORK/runs/$name/metrics.jsonl" "$OUT/conv_${name}_metrics.jsonl" 2>/dev/null
  cp "$WORK/runs/$name.log" "$OUT/conv_${name}.log" 2>/dev/null
  last=$(ls "$WORK/runs/$name/episodes/" 2>/dev/null | sort | tail -n 1)
  [ -n "$last" ] && cp "$WORK/runs/$name/episodes/$last" "$OUT/conv_${name}_episodes_${last}"
done
if ls "$OUT"/conv_*_metrics.jsonl >/dev/null 2>&1; then
  $PY -m scripts.plot_runs "$OUT"/conv_*_metrics.jsonl --out "$OUT" --prefix convergence 2>&1 | tee -a "$OUT/conv_driver.log"
else
  log "no metrics to plot"; exit 1
fi
log "done"
