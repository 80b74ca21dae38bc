#!/usr/bin/env bash
# The Hopper-host verification, in parts that each fit one device call (logs -> $OUT):
#   bash scripts/gpu_check.sh fp8      tests/gpu/test_fp8_gpu.py + bench/train.py linear
#   bash scripts/gpu_check.sh vllm     tests/gpu/test_vllm_engine.py
#   bash scripts/gpu_check.sh tests [PATH ARGS]  pytest PATH (default tests/gpu) -> $OUT/gpu_tests.log
#   bash scripts/gpu_check.sh align    bench/alignment.py
#   bash scripts/gpu_check.sh flagship [ARGS]  scripts/flagship_check.py: the shipped 8B configs at full shape, a few
#                                      steps each -> $OUT/flagship.{md,json}, logs in $OUT/flagship_runs.tgz
#   bash scripts/gpu_check.sh shipped [ARGS]  scripts/flagship_check.py --shipped: FP8 configs vs their BF16 twins at
#                                      their own workload (e.g. --configs llama31_8b_fp8 --timeout 560; --parallel: the
#                                      configs side by side, both pairs at once on 4 GPUs; --ranks 2: FSDP2 over 2
#                                      GPUs per config (80 GB cards); --async --steps 3: each config on 2 GPUs
#                                      synchronous and with rollout.mode=async -> $OUT/async_<gpu>.json; --merge
#                                      earlier flagship.json files) -> $OUT/shipped_<gpu>.json, flagship.{md,json},
#                                      logs + metrics in $OUT/shipped_runs.tgz
#   bash scripts/gpu_check.sh moe [all|bf16|fp8|fp8_kv[,...]] [ARGS]  scripts/flagship_check.py on the
#                                      qwen3_30b_a3b_* configs at Qwen3-30B-A3B width cut to 12 of 48 layers, 2 steps
#                                      each: one config runs with router replay on and off (2 runs), several
#                                      (default all) with replay on; runs cut at 420 s (a host's first FP8 run
#                                      autotunes what the seed below lacks), the call at STOP_S -> $OUT/moe.{md,json},
#                                      logs + metrics in $OUT/moe_runs.tgz (e.g. --moe-layers 8, --router-replay on,off)
#   bash scripts/gpu_check.sh moe_bench [all|align|rollout] [ARGS]  align: bench/alignment.py --moe (4 layers,
#                                      router replay off/on per engine/trainer pair, ~4 min) -> $OUT/alignment_moe.json;
#                                      rollout: bench/rollout.py --models qwen3-30b-a3b (12 layers; bf16, fp8kv, fp8,
#                                      ~2 min each, until STOP_S; ARGS go to it) -> $OUT/rollout.json; all (default):
#                                      both, which leaves the last rollout mode out of one call. Needs vLLM's MoE kernels: the offline
#                                      bundle built with make_bundle.sh --moe (as moe and tests/gpu/test_moe_gpu.py)
#   bash scripts/gpu_check.sh kvmismatch [ARGS]  scripts/kv_mismatch.py: trainer/engine mismatch of a real model
#                                      (--model DIR: SmolLM2 from `python -m scripts.real_model --gguf part1 ...`) on
#                                      configs/gsm8k.yaml scaled down, BF16 KV vs FP8 KV (fa3 / triton attention, scales
#                                      recalibrated or unit); no run starts with < 120 s left of STOP_S (--variants and
#                                      --merge finish the rest) -> $OUT/kv_mismatch.{md,json} (per-layer q/k/v amax too),
#                                      logs + metrics in $OUT/kv_mismatch_runs.tgz
#   bash scripts/gpu_check.sh reallearn [ARGS]  scripts/real_learn.py: SmolLM2 GRPO over seeds, BF16 vs FP8 KV (--model
#                                      DIR as kvmismatch; --gpus 0,1,2,3 on a 4-GPU host), deadline DEADLINE_S
#                                      -> $OUT/real_learn.{md,json}, metrics + logs in $OUT/real_learn_runs.tgz
#   bash scripts/gpu_check.sh resume [ARGS]  scripts/resume_check.py: an 8B config saved on --save-ranks GPUs and
#                                      resumed on --resume-ranks (of the visible ones) -> $OUT/resume_<N>to<M>.json + logs
#   bash scripts/gpu_check.sh decode [ARGS]  bench/decode_attention.py: paged decode attention kernels, FA3 BF16 vs FP8
#                                      KV (FA3, XQA, Triton) at batch 128 x 4096, scales updated inside CUDA graphs
#                                      -> $OUT/decode_attention.json
#   bash scripts/gpu_check.sh tiny     configs/tiny_gpu.yaml end to end
#   bash scripts/gpu_check.sh learn [ARGS]  scripts/learn_gate.py: the learning gate, its SFT warm start then
#                                      quickstart_gpu x 4 seeds x {FP8 recipe, BF16}, concurrent on the one GPU,
#                                      < 10 min; PASS/FAIL (exit code), $OUT/learn_gate.{json,md,log},
#                                      learn_sft_metrics.json, per-run metrics + logs in $OUT/learn_runs.tgz;
#                                      --async (2 GPUs): + 4 seeds of the FP8 recipe with rollout.mode=async
#   bash scripts/gpu_check.sh rollout  [ARGS]  bench/rollout.py: 8B-shape VLLMEngine throughput -> $OUT/rollout.json
#                                      (default Llama-3.1-8B, bf16/fp8kv/fp8; e.g. --models qwen3; stops at DEADLINE_S)
#   bash scripts/gpu_check.sh capacity [ARGS]  bench/rollout.py --capacity-only: Qwen3-8B KV capacity per mode
#                                      -> $OUT/rollout_capacity.json
#   bash scripts/gpu_check.sh stack [all|stack|linear] [ARGS]  bench/train.py (default all: decoder-layer stack,
#                                      then the linears) -> $OUT/train.json
#   bash scripts/gpu_check.sh step [ARGS]  bench/step.py (e.g. --config bench/step_8b_long.yaml --steps 2
#                                      --modes bf16) -> $OUT/step.json, trainer logs $OUT/step_<mode>.log
#   bash scripts/gpu_check.sh pass [ARGS]  bench/trainer_pass.py: the trainer's logprobs / train pass per
#                                      micro-batch at the step's shape -> $OUT/trainer_pass.json (RANKS=2: under
#                                      torchrun on 2 GPUs, FSDP2 as the trainer shards)
#   bash scripts/gpu_check.sh phase [ARGS]  bench/trainer_phase.py: the trainer's logprobs and train phases of a
#                                      step on a synthetic batch at a shipped config's workload (--engine: its
#                                      vLLM engine asleep beside them; --memory: what holds memory at the last
#                                      step's peak, per rank -> trainer_phase_memory.json) -> $OUT/trainer_phase.json
#                                      (RANKS=2 as pass)
#   bash scripts/gpu_check.sh host        bench/host_speed.py: one CPU thread's speed at the engine loop's kind of
#                                      work (Python, hashing, torch dispatch, CUDA launches) -> $OUT/host_speed.json
#   bash scripts/gpu_check.sh gemm [ARGS]  bench/gemm.py: the trainer's three FP8 GEMMs per projection, cuBLAS vs
#                                      DeepGEMM's dense GEMM vs BF16 -> $OUT/gemm.json
#   bash scripts/gpu_check.sh head [ARGS]  bench/head.py: the train pass's LM head + log-softmax, unfused (the configs'),
#                                      fused (train.fused_head) and compiled whole, ms and memory -> $OUT/head.json
#   bash scripts/gpu_check.sh attention [ARGS]  bench/attention.py: the trainer's SDPA at a shipped step's micro-batch
#                                      lengths, FlashAttention-2 vs cuDNN, cached and first call -> $OUT/attention.json
#   bash scripts/gpu_check.sh quant [--swiglu]  bench/quant.py: quant_dual (or fp8.fuse_swiglu's) launch
#                                      configurations -> $OUT/quant.json (quant_swiglu.json); --shape llama3b
#                                      --tokens 4224: each quantization call of a layer against a copy of its
#                                      bytes -> $OUT/quant_calls.json
#   bash scripts/gpu_check.sh peer [ARGS]  bench/peer.py: TRL's GRPOTrainer (trl, trl_compile, trl_liger) beside our
#                                      BF16 twin and FP8 recipe on one workload, one system per call (e.g. --model
#                                      llama3b --prepare, then --model llama3b --systems trl, trl_compile, ... in
#                                      consecutive calls on one warm host, or a queue of them; each stops at WAIT_S):
#                                      rows kept in $BG_DIR/peer across calls -> $OUT/peer_<gpu>.{json,md} with every
#                                      row so far (llama3b on an H100: peer_h100; llama8b on an H200: peer_h200), the
#                                      systems' logs in $OUT/peer_logs.tgz; each system stops at PEER_TIMEOUT_S if set
#                                      (for a queue: PEER_TIMEOUT_S=900 bash scripts/gpu_check.sh queue ...)
#   bash scripts/gpu_check.sh ckpt [ARGS]  bench/checkpoint.py: save/load time and peak host RSS of the
#                                      single-file full-gather checkpoint vs sharded DCP at 8B shape
#                                      (default: up to 8 of 32 layers, fp32 + AdamW) -> $OUT/checkpoint.json
#   bash scripts/gpu_check.sh jobs 'PART ARGS' ['GPUS=2,3 PART ARGS ; PART ARGS' ...]  the jobs at once, the i-th on
#                                      GPU i (or on GPUS); the parts of one job (' ; ' between them) one after another,
#                                      the k-th with its own $OUT/job<i>/<k>; each job packed into $OUT/job<i>.tgz when
#                                      it ends (a call cut early keeps the jobs done), all
#                                      cut at JOBS_LIMIT s (default WAIT_S; set it below the call's limit); rc per
#                                      part in $OUT/jobs.txt. ARGS are split on spaces (no quoting)
#   bash scripts/gpu_check.sh bg NAME PART [ARGS]  PART in the background, detached from the call (it goes on while
#                                      the host stays warm, i.e. while calls follow each other), files in $BG_DIR/NAME
#                                      (default ~/bg/NAME); for runs longer than one call
#   bash scripts/gpu_check.sh queue NAME 'PART ARGS' ['PART ARGS' ...]  the parts in the background like bg, in order,
#                                      each on the next free GPU of CUDA_VISIBLE_DEVICES (else all), one part per GPU
#                                      at a time; part k's files in $BG_DIR/NAME/job<k> (e.g. 5 shipped configs over 2
#                                      GPUs: start them in one call, collect them in the next ones). A part of a queue
#                                      or of a job may begin with VAR=VALUE words, set for it alone: one queue compares
#                                      settings read from the environment, e.g. 'pass ARGS' 'TORCHINDUCTOR_CPP_WRAPPER=1 pass ARGS'
#   bash scripts/gpu_check.sh collect NAME  wait for the bg job NAME (at most COLLECT_LIMIT s, default WAIT_S), pack its
#                                      files into $OUT/NAME.tgz; finished: its rc, and its folder removed. A queue:
#                                      each part that has finished packed into $OUT/NAME_job<k>.tgz as it ends, with
#                                      its rc; the folder removed once every part is collected
# Every part first seeds Triton's cache with bench/triton_autotune_h100.tgz (torchao's autotuning at the
# 8B step shapes, H100: ~190 s of a first FP8 step; the weight quantizers at Qwen3-8B's shards over 2 ranks, at the
# 3B peer shape and at the learning gate's quickstart),
# bench/triton_autotune_h200.tgz (the weight quantizers at the shipped 8B configs' one-GPU shapes that the
# first lacks, H200) and bench/triton_autotune_moe_h200.tgz
# (the expert GEMMs' quantizers at Qwen3-30B-A3B's shapes, H200: over 300 s of a first run; both H100 and H200
# are sm_90, so Triton's cache keys match across them) and leaves all autotuning results in
# $OUT/triton_autotune.tgz (refresh the shipped file from it when shapes or the bundle change).
# FlashInfer's JIT-built modules likewise from .gpu_cache/flashinfer_aot.tgz when it is there (below).
# Child logs of the rollout and align parts: $OUT/logs/. $OUT/smi.csv: nvidia-smi's utilization/clock/power log.
set -uo pipefail
# Time limits, in seconds from the start of the call. The GPU host gives one command 600 s; each part stops its
# own work earlier, leaving the time to write and pack its results before the host ends the call:
STOP_S=570      # --time-limit of moe, kvmismatch and moe_bench's rollout: then their runs' logs to pack
WAIT_S=560      # jobs and collect stop waiting (JOBS_LIMIT, COLLECT_LIMIT): then whole job folders to pack
DEADLINE_S=540  # rollout, capacity, reallearn: then the children to stop, results to write, runs to copy
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"; BG_DIR=${BG_DIR:-$HOME/bg}
export PYTHONUNBUFFERED=1 PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/env.log"
# several GPUs: how they are linked (NV# = NVLink, else PCIe paths), which multi-GPU step times depend on
[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 1 ] && nvidia-smi topo -m >>"$OUT/env.log" 2>&1
# fp8.torchao.keep_triton_autotuning's dir; with FP8_GRPO_CACHE_DIR, where caches.py points Triton
TRITON_DIR=${TRITON_CACHE_DIR:-${FP8_GRPO_CACHE_DIR:+$FP8_GRPO_CACHE_DIR/triton}}
TRITON_DIR=${TRITON_DIR:-$HOME/.triton/cache}
for seed in bench/triton_autotune_h100.tgz bench/triton_autotune_h200.tgz bench/triton_autotune_moe_h200.tgz; do
  mkdir -p "$TRITON_DIR" && tar -xzf $seed -C "$TRITON_DIR" && echo "seeded $TRITON_DIR with $seed" | tee -a "$OUT/env.log"
done
# FlashInfer's JIT modules (XQA decode, FP8 prefill: minutes of nvcc at a fresh host's first FP8 KV engine)
# from $FLASHINFER_SEED (default .gpu_cache/flashinfer_aot.tgz, carried to the host; made by an earlier one),
# placed where FlashInfer loads prebuilt (AOT) modules, so none is compiled again; used only if its KEY
# (the flashinfer and torch versions, the GPU's compute capability) matches. A host that compiles a module
# the seed lacks packs the seed's and its own into $OUT/flashinfer_aot.tgz on exit: keep it as the next seed.
FI_PKG=$($PY -c 'import importlib.util as u; s = u.find_spec("flashinfer"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null)
FI_KEY="$($PY -c 'import importlib.metadata as m; print("flashinfer", m.version("flashinfer-python"), "torch", m.version("torch"))' 2>/dev/null) sm $(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1)"
FI_SEED=${FLASHINFER_SEED:-.gpu_cache/flashinfer_aot.tgz}
FI_JIT=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
if [ -n "$FI_PKG" ] && [ -f "$FI_SEED" ]; then
  if [ "$(tar -xzOf "$FI_SEED" ./KEY 2>/dev/null)" = "$FI_KEY" ]; then
    mkdir -p "$FI_PKG/data/aot" && tar -xzf "$FI_SEED" -C "$FI_PKG/data/aot" --exclude ./KEY \
      && echo "seeded FlashInfer's AOT modules with $FI_SEED: $(tar -tzf "$FI_SEED" | grep -c '\.so$') module(s)" | tee -a "$OUT/env.log"
  else
    echo "$FI_SEED: made for $(tar -xzOf "$FI_SEED" ./KEY 2>/dev/null), this host has $FI_KEY: not used" | tee -a "$OUT/env.log"
  fi
fi
save_flashinfer_modules() {  # the seed's modules and any this host compiled, if it compiled one the seed lacks
  local tmp so name new=0
  [ -n "$FI_PKG" ] && [ -d "$FI_JIT" ] || return 0
  tmp=$(mktemp -d); echo "$FI_KEY" >"$tmp/KEY"
  for so in "$FI_PKG"/data/aot/*/*.so $(find "$FI_JIT" -path '*/cached_ops/*' -name '*.so' 2>/dev/null); do
    name=$(basename "$(dirname "$so")")
    [ -f "$so" ] && [ "$(basename "$so")" = "$name.so" ] || continue
    [ -f "$FI_PKG/data/aot/$name/$name.so" ] || new=1
    mkdir -p "$tmp/$name" && cp "$so" "$tmp/$name/"
  done
  if [ $new = 1 ]; then
    tar -czf "$OUT/flashinfer_aot.tgz" -C "$tmp" . \
      && echo "FlashInfer modules: $(ls "$tmp" | grep -vc KEY) in $OUT/flashinfer_aot.tgz (the next seed)" | tee -a "$OUT/env.log"
  fi
  rm -rf "$tmp"
}
# GPU utilization, SM clock, power, temperature and clock-limit reasons once a second (throttling?)
SMI=timestamp,utilization.gpu,clocks.sm,power.draw,temperature.gpu
( nvidia-smi --query-gpu=$SMI,clocks_event_reasons.active --format=csv -l 1 \
  || nvidia-smi --query-gpu=$SMI --format=csv -l 1 ) >"$OUT/smi.csv" 2>&1 &
SMI_PID=$!
save_autotuning() {  # on exit, whatever the part did
  pkill -P $SMI_PID 2>/dev/null; kill $SMI_PID 2>/dev/null
  (cd "$TRITON_DIR" && find . -name '*.autotune.json' | sed 's|^\./||' | tar -czf "$OUT/triton_autotune.tgz" -T -)
  echo "autotune results: $(tar -tzf "$OUT/triton_autotune.tgz" | wc -l) files in $TRITON_DIR" | tee -a "$OUT/env.log"
  save_flashinfer_modules
}
trap save_autotuning EXIT
part_cmd() {  # "VAR=VALUE ... PART ARGS" -> PART_CMD=(env VAR=VALUE ... bash gpu_check.sh PART ARGS)
  local words; read -ra words <<<"$1"; PART_CMD=(env)
  while [[ ${words[0]:-} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do PART_CMD+=("${words[0]}"); words=("${words[@]:1}"); done
  PART_CMD+=(bash "$0" "${words[@]}")
}
case "$1" in
  fp8)   $PY -m pytest tests/gpu/test_fp8_gpu.py -v -rs 2>&1 | tee "$OUT/gpu_tests_fp8.log"
         $PY -m bench.train linear --out "$OUT" 2>&1 | tee "$OUT/bench_linear.log" ;;
  vllm)  $PY -m pytest tests/gpu/test_vllm_engine.py -v -rs 2>&1 | tee "$OUT/gpu_tests_vllm.log" ;;
  tests) $PY -m pytest "${2:-tests/gpu}" "${@:3}" -v -s -rs 2>&1 | tee "$OUT/gpu_tests.log"; exit "${PIPESTATUS[0]}" ;;
  align) $PY -m bench.alignment --out "$OUT" 2>&1 | tee "$OUT/alignment.log" ;;
  tiny)  rm -rf /tmp/runs/tiny_gpu  # train_grpo.py refuses a run dir that holds a run
         $PY train_grpo.py --config configs/tiny_gpu.yaml train.out_dir=/tmp/runs train.run_name=tiny_gpu \
           "${@:2}" 2>&1 | tee "$OUT/tiny_gpu.log"
         cp /tmp/runs/tiny_gpu/metrics.jsonl "$OUT/tiny_gpu_metrics.jsonl" ;;
  flagship) $PY -m scripts.flagship_check --out "$OUT/flagship" "${@:2}" 2>&1 | tee "$OUT/flagship.log"
         rc=${PIPESTATUS[0]}; cp "$OUT"/flagship/flagship.{md,json} "$OUT"/ 2>/dev/null
         tar -czf "$OUT/flagship_runs.tgz" -C "$OUT" flagship --remove-files; exit $rc ;;
  shipped) $PY -m scripts.flagship_check --shipped --out "$OUT/shipped" --runs "$OUT/shipped/runs" "${@:2}" 2>&1 \
           | tee "$OUT/shipped.log"
         rc=${PIPESTATUS[0]}; cp "$OUT"/shipped/{flagship.md,flagship.json,shipped_*.json,async_*.json} "$OUT"/ 2>/dev/null
         tar -czf "$OUT/shipped_runs.tgz" -C "$OUT" shipped --remove-files; exit $rc ;;
  moe)   sel=${2:-all}; [ "$sel" = all ] && sel=bf16,fp8,fp8_kv
         replay=on; [[ "$sel" == *,* ]] || replay=on,off  # one config: both rows
         $PY -m scripts.flagship_check --configs "$(echo "$sel" | sed 's/[^,]*/qwen3_30b_a3b_&/g')" \
           --router-replay $replay --timeout 420 --time-limit $STOP_S --out "$OUT/moe" --runs "$OUT/moe/runs" "${@:3}" \
           2>&1 | tee "$OUT/moe.log"
         rc=${PIPESTATUS[0]}; cp "$OUT"/moe/flagship.md "$OUT"/moe.md 2>/dev/null
         cp "$OUT"/moe/flagship.json "$OUT"/moe.json 2>/dev/null
         tar -czf "$OUT/moe_runs.tgz" -C "$OUT" moe --remove-files; exit $rc ;;
  moe_bench) part=all; case "${2:-}" in all|align|rollout) part=$2; set -- "$1" "${@:3}" ;; esac
         [ "$part" = rollout ] || $PY -m bench.alignment --moe --out "$OUT" 2>&1 | tee "$OUT/alignment_moe.log"
         [ "$part" = align ] || $PY -m bench.rollout --models qwen3-30b-a3b --out "$OUT" --time-limit $((STOP_S - SECONDS > 10 ? STOP_S - SECONDS : 10)) \
           --workloads '512x256->1024' "${@:2}" 2>&1 | tee "$OUT/bench_rollout_moe.log" ;;
  kvmismatch) $PY -m scripts.kv_mismatch --out "$OUT/kv_mismatch" --time-limit $STOP_S "${@:2}" 2>&1 \
           | tee "$OUT/kv_mismatch.log"
         rc=${PIPESTATUS[0]}; cp "$OUT"/kv_mismatch/kv_mismatch.{md,json} "$OUT"/ 2>/dev/null
         tar -czf "$OUT/kv_mismatch_runs.tgz" -C "$OUT" kv_mismatch --remove-files; exit $rc ;;
  reallearn) $PY -m scripts.real_learn --out "$OUT/real_learn" --deadline-s $DEADLINE_S "${@:2}" 2>&1 | tee "$OUT/real_learn.log"
         rc=${PIPESTATUS[0]}; cp "$OUT"/real_learn/real_learn.{md,json} "$OUT"/real_learn/real_learn_runs.tgz "$OUT"/ 2>/dev/null
         rm -rf "$OUT/real_learn"; exit $rc ;;
  resume) $PY -m scripts.resume_check --out "$OUT" --runs /tmp/resume_runs_$$ "${@:2}" 2>&1 | tee "$OUT/resume.log"
         rc=${PIPESTATUS[0]}; rm -rf /tmp/resume_runs_$$; exit $rc ;;
  decode) $PY -m bench.decode_attention --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/decode_attention.log" ;;
  learn) $PY -m scripts.learn_gate --out "$OUT/learn_gate" "${@:2}" 2>&1 | tee "$OUT/learn_gate.log"
         rc=${PIPESTATUS[0]}  # the per-run files are in learn_runs.tgz: loose, they pass the host's 8-file limit
         cp "$OUT"/learn_gate/learn_gate.{md,json} "$OUT"/learn_gate/learn_runs.tgz "$OUT"/ 2>/dev/null
         cp "$OUT"/learn_gate/learn_sft_metrics.json "$OUT"/ 2>/dev/null; rm -rf "$OUT/learn_gate"; exit $rc ;;
  rollout)  $PY -m bench.rollout --out "$OUT" --time-limit $DEADLINE_S "${@:2}" 2>&1 | tee "$OUT/bench_rollout.log" ;;
  capacity) $PY -m bench.rollout --capacity-only --out "$OUT" --time-limit $DEADLINE_S "${@:2}" 2>&1 \
              | tee "$OUT/bench_capacity.log" ;;
  stack)    $PY -m bench.train "${2:-all}" --out "$OUT" "${@:3}" 2>&1 | tee "$OUT/bench_stack.log" ;;
  step)     $PY -m bench.step --out "$OUT" "${@:2}" 2>&1 | tee -a "$OUT/bench_step.log" ;;
  host)     $PY -m bench.host_speed | tee "$OUT/host_speed.json" ;;
  gemm)     $PY -m bench.gemm --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/bench_gemm.log" ;;
  head)     $PY -m bench.head --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/bench_head.log" ;;
  attention) $PY -m bench.attention --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/bench_attention.log" ;;
  pass|phase) launch=(-m "bench.trainer_$1"); [ "${RANKS:-1}" -gt 1 ] \
              && launch=(-m torch.distributed.run --standalone --nproc_per_node "$RANKS" -m "bench.trainer_$1")
            $PY "${launch[@]}" --out "$OUT" "${@:2}" 2>&1 | grep -v '^Autotuning kernel' | tee "$OUT/trainer_$1.log" ;;
  quant)    $PY -m bench.quant --out "$OUT" "${@:2}" 2>&1 | tee -a "$OUT/quant.log" ;;
  peer)     mkdir -p "$BG_DIR/peer"  # the rows of earlier calls on this host stay beside the new ones
            # PEER_TIMEOUT_S: a queued part is held to no call's limit; a host with slow cores needs ~10 min for FP8's row
            $PY -m bench.peer --out "$BG_DIR/peer" --timeout "${PEER_TIMEOUT_S:-$((WAIT_S - SECONDS))}" "${@:2}" 2>&1 \
              | tee -a "$OUT/peer.log"
            rc=${PIPESTATUS[0]}  # bench.peer's exit status is the part's (a queue's rc file shows a refused flag)
            cp "$BG_DIR"/peer/peer_*.json "$BG_DIR"/peer/peer_*.md "$BG_DIR"/peer/peer_*_profile.txt "$OUT"/ 2>/dev/null
            tar czf "$OUT/peer_logs.tgz" -C "$BG_DIR" peer; exit "$rc" ;;
  ckpt)     $PY -m bench.checkpoint --out "$OUT" "${@:2}" 2>&1 | tee -a "$OUT/checkpoint.log" ;;
  jobs) limit=${JOBS_LIMIT:-$WAIT_S}; end=$(( $(date +%s) + limit )); i=0; pids=()
         for spec in "${@:2}"; do
           gpus=$i; if [[ $spec == GPUS=* ]]; then gpus=${spec%% *}; gpus=${gpus#GPUS=}; spec=${spec#* }; fi
           mkdir -p "$OUT/job$i"
           ( k=0; while [ -n "$spec" ]; do part=${spec%% ; *}; [ "$part" = "$spec" ] && spec= || spec=${spec#* ; }
               mkdir -p "$OUT/job$i/$k"
               part_cmd "$part"
               OUT="$OUT/job$i/$k" CUDA_VISIBLE_DEVICES=$gpus timeout -k 5 $(( end - $(date +%s) )) "${PART_CMD[@]}" \
                 >"$OUT/job$i/$k/job.log" 2>&1
               echo "job$i.$k ($part) on GPU $gpus: rc=$? after $(( $(date +%s) - end + limit )) s" | tee -a "$OUT/jobs.txt"
               k=$((k + 1)); done
             # packed as soon as the job ends: a call that runs past its limit keeps the jobs already done
             tar --exclude=triton_autotune.tgz -czf "$OUT/job$i.tgz" -C "$OUT" "job$i" && rm -rf "$OUT/job$i" ) &
           pids+=($!); i=$((i + 1))
         done
         wait "${pids[@]}" ;;  # the jobs only: a bare wait would also wait for the nvidia-smi logger
  bg)   [ $# -ge 3 ] || { echo "usage: gpu_check.sh bg NAME PART [ARGS]" >&2; exit 2; }
         dir=$BG_DIR/$2; rm -rf "$dir"; mkdir -p "$dir"
         OUT="$dir" setsid bash -c 'bash "$0" "$@" >"$OUT/job.log" 2>&1; echo $? >"$OUT/rc"' "$0" "${@:3}" \
           </dev/null >/dev/null 2>&1 &
         echo $! >"$dir/pid"; echo "$2: started in the background (pid $!), files in $dir" ;;
  queue) [ $# -ge 3 ] || { echo "usage: gpu_check.sh queue NAME 'PART ARGS' ..." >&2; exit 2; }
         dir=$BG_DIR/$2; rm -rf "$dir"; mkdir -p "$dir"; printf '%s\n' "${@:3}" >"$dir/jobs"; echo 0 >"$dir/next"
         gpus=${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)}
         for g in ${gpus//,/ }; do  # one worker per GPU, each taking the next part (mkdir: the lock)
           OUT="$dir/worker$g" setsid bash "$0" _worker "$dir" "$g" </dev/null >/dev/null 2>&1 &
         done
         echo "$2: $(( $# - 2 )) parts queued on GPUs $gpus, files in $dir" ;;
  _worker) dir=$2; mapfile -t jobs <"$dir/jobs"
         while :; do
           until mkdir "$dir/lock" 2>/dev/null; do sleep 1; done
           k=$(cat "$dir/next"); echo $((k + 1)) >"$dir/next"; rmdir "$dir/lock"
           [ "$k" -lt "${#jobs[@]}" ] || break
           mkdir -p "$dir/job$k"; echo "$3" >"$dir/job$k/gpu"
           part_cmd "${jobs[$k]}"
           OUT="$dir/job$k" CUDA_VISIBLE_DEVICES=$3 "${PART_CMD[@]}" >"$dir/job$k/job.log" 2>&1
           echo $? >"$dir/job$k/rc"
         done ;;
  collect) [ $# -eq 2 ] && [ -d "$BG_DIR/$2" ] || { echo "usage: gpu_check.sh collect NAME (a bg job's name)" >&2; exit 2; }
         dir=$BG_DIR/$2; end=$(( $(date +%s) + ${COLLECT_LIMIT:-$WAIT_S} ))
         if [ -f "$dir/jobs" ]; then  # a queue
           mapfile -t jobs <"$dir/jobs"
           while :; do
             for k in "${!jobs[@]}"; do
               [ -f "$dir/job$k/rc" ] && [ ! -f "$dir/job$k/collected" ] || continue
               tar --exclude=triton_autotune.tgz -czf "$OUT/$2_job$k.tgz" -C "$dir" "job$k" && touch "$dir/job$k/collected"
               echo "$2 job$k (${jobs[$k]}) on GPU $(cat "$dir/job$k/gpu"): rc=$(cat "$dir/job$k/rc")"
             done
             n=$(ls -d "$dir"/job*/collected 2>/dev/null | wc -l)
             if [ "$n" -eq "${#jobs[@]}" ]; then echo "$2: all ${#jobs[@]} parts collected"; rm -rf "$dir"; break; fi
             if [ "$(date +%s)" -ge $end ]; then echo "$2: $n of ${#jobs[@]} parts collected; collect it again"; break; fi
             sleep 5
           done
           exit 0
         fi
         while [ ! -f "$dir/rc" ] && [ "$(date +%s)" -lt $end ]; do sleep 5; done
         tar --exclude=triton_autotune.tgz -czf "$OUT/$2.tgz" -C "$BG_DIR" "$2"
         if [ -f "$dir/rc" ]; then echo "$2: finished, rc=$(cat "$dir/rc")"; rm -rf "$dir"
         else echo "$2: still running at COLLECT_LIMIT; its files so far in $OUT/$2.tgz; collect it again"; fi ;;
  *) echo "usage: gpu_check.sh fp8|vllm|tests|align|flagship|shipped|moe|moe_bench|kvmismatch|reallearn|resume|decode|learn|tiny|jobs|bg|queue|collect|rollout|capacity|stack|step|gemm|head|pass|phase|attention|quant|peer|host|ckpt" >&2; exit 2 ;;
esac
