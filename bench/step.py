"""One end-to-end GRPO step at 8B shape: bf16 vs fp8 vs fp8kv, with the time breakdown.

    python -m bench.step                                    # bench/step_8b.yaml, all four modes
    python -m bench.step --modes bf16,fp8kv rollout.max_new_tokens=1024 --out /tmp/out
    python -m bench.step --merge gpu0/step.json gpu1/step.json     # modes run on two GPUs of one host
    python -m bench.step --config bench/step_8b_long.yaml --steps 2 --modes bf16,fp8kv   # 128 x 4096 tokens
    python -m bench.step --config bench/step_8b_long_h100.yaml --steps 2 --modes bf16    # same, 80 GB regime
    python -m bench.step --modes bf16,fp8kv_lp train.compile=inductor   # trainer layers torch.compile'd
    python -m bench.step --modes fp8kv_lp log.profile_step=1 log.profile_rollout=false   # + OUT/profile_<mode>_*.txt

Each mode is train_grpo.py itself (nothing here can drift from the recipe) with the mode's config
overrides, one child process per mode through bench/runner.py (vLLM: one engine per process), on
bench/step_8b.yaml: a random-weight Llama-3.1-8B-shape model, vLLM colocated with sleep mode,
fixed-length generation. Modes:
  bf16      BF16 trainer, BF16 rollout
  fp8       torchao block-FP8 trainer linears, vLLM block-FP8 W8A8 rollout (refit every step)
  fp8kv     fp8 + FP8 KV cache and FP8 attention in vLLM, q/k/v scales recalibrated every step
            (a separate forward over fp8.calib_samples rows after the update)
  fp8kv_lp  fp8kv with fp8.calib_pass=logprobs (amax captured in the old_logp forward: no extra pass)
Figures are medians over steps 1..N-1 of the trainer's own time/* metrics; step 0 (Triton autotune,
kept on disk for later processes; CUDA-graph capture) is first_step_s. OUT/step.json (default
runs/bench) is rewritten after every mode; trainer logs in OUT/step_<mode>.log.
"""

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from bench.runner import RESULTS, Job, add_ratio, markdown_table, merge_files, run_jobs, write_results

ROOT = Path(__file__).resolve().parents[1]

MODES = {
    "bf16": ["fp8.train=false", "fp8.rollout=false", "fp8.kv_cache=false"],
    "fp8": ["fp8.train=true", "fp8.rollout=true", "fp8.kv_cache=false"],
    "fp8kv": ["fp8.train=true", "fp8.rollout=true", "fp8.kv_cache=true", "fp8.recalibrate=true"],
    "fp8kv_lp": ["fp8.train=true", "fp8.rollout=true", "fp8.kv_cache=true", "fp8.recalibrate=true",
                 "fp8.calib_pass=logprobs"],
}
PARTS = ("rollout", "logprobs", "train", "recalibrate", "refit")
TABLE = ["mode", "step_s", "rollout_s", "logprobs_s", "train_s", "recalibrate_s", "refit_s", "sync_frac", "speedup",
         "first_step_s", "token_mult_prob_error", "gc_s", "mem_peak_gib", "alloc_retries"]


def summarize(metrics: list[dict], mode: str, workload: str) -> dict:
    """Median step figures over the timed steps (>= 1) of one run's metrics.jsonl records."""
    timed = [m for m in metrics if m.get("step", 0) >= 1 and "time/step" in m]
    if not timed:
        raise ValueError(f"{mode}: no timed step (>= 1) in metrics; run at least 2 steps")

    def med(key):
        return statistics.median(m.get(key, 0.0) for m in timed)

    row = {"workload": workload, "mode": mode, "step_s": med("time/step"),
           **{f"{p}_s": med(f"time/{p}") for p in PARTS},
           "tokens_per_s": med("perf/tokens_per_s"), "first_step_s": metrics[0]["time/step"],
           "token_mult_prob_error": med("mismatch/token_mult_prob_error"), "timed_steps": len(timed)}
    if "time/gc" in timed[0]:  # Python garbage collection pauses inside the step
        row["gc_s"] = med("time/gc")
    if "mem/peak_gib" in timed[0]:  # CUDA runs: device memory in use at its peak, and cudaMalloc retries
        row |= {"mem_peak_gib": med("mem/peak_gib"), "alloc_retries": med("mem/alloc_retries")}
    row["sync_frac"] = (row["recalibrate_s"] + row["refit_s"]) / row["step_s"]
    return row


def first_step_times(metrics: list[dict]) -> dict:
    """time/<part> of the warm-up step (the first record) as first_<part>_s; {} if none."""
    return {f"first_{k.removeprefix('time/')}_s": v for k, v in (metrics or [{}])[0].items() if k.startswith("time/")}


def add_speedups(runs: list[dict]) -> list[dict]:
    return add_ratio(runs, "speedup", "step_s", lower_is_better=True)


def mode_job(mode: str, args, out: Path) -> Job:
    """The trainer process of one mode: train_grpo.py with the mode's overrides, its own run dir."""
    name = f"step_{mode}"
    run_dir = Path(args.runs) / name
    shutil.rmtree(run_dir, ignore_errors=True)  # this bench's scratch; train_grpo.py refuses a used run dir
    argv = [sys.executable, str(ROOT / "train_grpo.py"), "--config", args.config, *MODES[mode],
            f"train.steps={args.steps}", f"train.out_dir={args.runs}", f"train.run_name={name}", *args.overrides]
    print(f"[{mode}] {' '.join(argv[1:])}", flush=True)
    return Job(mode, argv, out / f"{name}.log", timeout=args.timeout, info={"run_dir": run_dir})


def mode_row(job: Job, workload: str, out: Path) -> dict:
    """The mode's row from its trainer's metrics.jsonl; its profile tables (log.profile_step) copied to OUT."""
    mode, run_dir = job.label, job.info["run_dir"]
    for table in sorted((run_dir / "profile").glob("*.txt")):  # (the .json traces stay: too big to ship)
        shutil.copy(table, out / f"profile_{mode}_{table.name}")
    path = run_dir / "metrics.jsonl"
    metrics = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rc = "timeout" if job.status == "timeout" else job.rc
    try:
        row = summarize(metrics, mode, workload)
    except ValueError as e:
        print(f"[{mode}] FAILED (exit {rc}): {e}", flush=True)
        row = {"workload": workload, "mode": mode, "error": f"exit {rc}: {e}", "wall_s": job.wall_s}
        return row | first_step_times(metrics)  # cut off after the warm-up step: keep where its time went
    row["wall_s"] = job.wall_s
    print(f"[{mode}] step {row['step_s']:.2f} s (rollout {row['rollout_s']:.2f}, logprobs {row['logprobs_s']:.2f}, "
          f"train {row['train_s']:.2f}, recal {row['recalibrate_s']:.3f}, refit {row['refit_s']:.3f}); "
          f"wall {job.wall_s:.0f} s", flush=True)
    return row


def workload_label(cfg, config_path: str) -> str:
    text = (f"{cfg.rollout.prompts_per_step}x{cfg.rollout.n} samples, <= {cfg.data.max_prompt_tokens}"
            f"->{cfg.rollout.max_new_tokens} tokens, {cfg.model.tiny.num_layers} layers, micro-batch "
            f"{cfg.train.micro_batch_size}")
    if cfg.train.compile != "none":  # compiled and eager runs are different workloads: ratios within each
        text += f", compile {cfg.train.compile}"
    return f"{text} ({config_path})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="section.key=value for train_grpo.py, e.g. rollout.n=16")
    p.add_argument("--config", default=str(ROOT / "bench" / "step_8b.yaml"))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=3, help="trainer steps per mode (step 0 is warm-up)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mode")
    p.add_argument("--out", default=None, help="results + logs dir (default runs/bench, untracked)")
    p.add_argument("--runs", default="/tmp/bench_step_runs", help="run dirs of the trainer processes")
    p.add_argument("--merge", nargs="+", metavar="STEP_JSON",
                   help="only combine step.json files (e.g. one per GPU of the same host) into OUT/step.json")
    args = p.parse_args()
    out = Path(args.out) if args.out else RESULTS
    if args.merge:
        _, runs = merge_files(args.merge, "step", out, add_speedups)
        print(markdown_table(runs, TABLE))
        return
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        sys.exit(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if args.steps < 2:
        sys.exit("--steps must be >= 2: step 0 is warm-up")
    from config import load_config

    cfg = load_config(args.config, [*MODES[modes[0]], *args.overrides])  # fail fast on typos
    workload = workload_label(cfg, args.config)
    out.mkdir(parents=True, exist_ok=True)
    runs = []

    def on_done(job: Job) -> None:
        runs.append(mode_row(job, workload, out))
        write_results("step", add_speedups(runs), out_dir=out)

    # one mode at a time, each on the whole GPU (vLLM colocated with the trainer)
    run_jobs([mode_job(m, args, out) for m in modes], on_done, poll_s=0.2, stream=None, tag="step")
    print(markdown_table(runs, TABLE))


if __name__ == "__main__":
    main()
