"""The learning gate: the quickstart (configs/quickstart_gpu.yaml) over seeds, FP8 recipe vs BF16, PASS or FAIL.

    python -m scripts.learn_gate --out /tmp/gate                  # one GPU: SFT + 4 seeds x {fp8, bf16}, < 10 min
    bash scripts/gpu_check.sh learn                               # the same, logs and results -> $OUT
    python -m scripts.learn_gate --cpu --seeds 0,1 --steps 2      # the machinery on CPU (tiny_cpu; FAILs)
    python -m scripts.learn_gate --check DIR                      # the verdict on runs already in DIR
    python -m scripts.learn_gate --async --out /tmp/gate          # two GPUs: + 4 seeds of fp8_async (threshold 4)
    python -m scripts.learn_gate --seeds 0,1 --sweep lr1e-4:optim.lr=1e-4 --sweep lr1e-4_w20:optim.lr=1e-4,optim.warmup_steps=20
                                  # a sweep: the FP8 recipe with each variant's overrides; the table, no verdict

Thresholds (fixed; a change to them is a change to the gate, not to a run):
  1. each of >= 4 seeds reaches >= 0.7 greedy validation accuracy (val/accuracy, the end-of-run
     validation logged at step train.steps) by the quickstart's last step, in both the FP8 recipe
     (the config as shipped: FP8 trainer, FP8 rollout, FP8 KV cache) and BF16 (fp8.train=false
     fp8.rollout=false fp8.kv_cache=false); a run that did not finish counts as a failure;
  2. the FP8 runs' mean final accuracy is within 0.05 of the BF16 runs' mean (|difference| <= 0.05);
  3. no run ends with more than half of its groups at zero variance: reward/zero_std_groups (the
     share of the step's freshly drawn groups whose n rewards are all equal, so all advantages 0),
     averaged over the run's last 5 steps, <= 0.5. A group whose samples are all right counts too:
     a policy that answers every prompt one way has stopped exploring, right or wrong.
     reward/unsolved_groups (groups with no right sample) is reported beside it.
  4. with --async: the FP8 recipe with rollout.mode=async (mode fp8_async: one trainer rank and one
     engine rank under torchrun, max_staleness 1) meets 1 and 3, and its mean final accuracy is within
     0.05 of the fp8 runs' mean: one step of policy lag, corrected by the importance weight, costs no
     more than FP8 does.

The warm start: when the config's model is not built from model.tiny (name_or_path "tiny"), the gate
first trains it, `python -m scripts.sft --out WORK/sft_model --task-config CONFIG` with --sft's arguments
(the quickstart's recipe by default), next to `scripts.sft --warm-fp8` (fills Triton's cache for the FP8
runs), and every run starts from it; --sft-model DIR reuses a model instead. Its sft_metrics.json is copied
to --out as learn_sft_metrics.json.

How it runs on one GPU: the 8 runs are concurrent processes, each with a small vLLM share
(--gpu-share, rollout.sleep_mode=false so no engine frees memory mid-run), started strictly one
after another: the next starts once the previous one's vLLM engine is up (its log says "init
engine") or it logged a step, because an engine that starts while a neighbour frees GPU memory
trips vLLM's start-up memory profiling. FP8 and BF16 runs alternate (fp8 s0, bf16 s0, fp8 s1, ...)
so both see the same contention. Whatever still runs at --deadline-s is stopped (and fails).
With --async, each fp8_async run sees the GPUs --async-gpus names (default 1,0: its trainer rank on GPU 1,
its engine beside the other runs on GPU 0); on one H200 pair the 12 runs took ~9 minutes.

Writes into --out: learn_gate.json (thresholds, per-run rows, means, verdict, reasons, commands),
learn_gate.md (the per-seed table), <mode>_s<seed>_metrics.jsonl and <mode>_s<seed>.log per run
(scripts/plot_runs.py draws them), and learn_runs.tgz holding all of those. Exit 0 on PASS, 1 on
FAIL, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from scripts.common import ROOT, copy_runs, device_name, launch_all, load_rows, log, tail_mean, write_results

MIN_SEEDS = 4
MIN_VAL_ACCURACY = 0.7
MAX_MEAN_GAP = 0.05
MAX_ZERO_STD_GROUPS = 0.5
TAIL_STEPS = 5  # "ends with": the mean over the run's last TAIL_STEPS training steps
MODES = {"fp8": [], "bf16": ["fp8.train=false", "fp8.rollout=false", "fp8.kv_cache=false"]}
ASYNC = "fp8_async"  # --async: the FP8 recipe on a trainer rank and an engine rank (engines/remote.py)
ASYNC_OVERRIDES = ["rollout.mode=async"]
# the quickstart's warm start (configs/quickstart_gpu.yaml's header says why)
QUICKSTART_SFT = "--guess 0.6 --mix 3:0.1,4:0.3,5:0.6 --max-steps 800 --stop-acc 0 --minutes 6"


# ----------------------------------------------------------------------------- the verdict (tested on CPU)

def _tail_mean(rows: list[dict], key: str) -> float | None:
    return tail_mean(rows, key, TAIL_STEPS)


def summarize_run(rows: list[dict], steps: int) -> dict:
    """One run's metrics.jsonl rows -> its table row. final_val: the val/accuracy logged at step
    `steps` (the end-of-run validation), None if the run did not get there; start_val: at step 0, before
    any update (the warm start's, which differs between GPU hosts: compare gates by the gain too)."""
    train = [r for r in rows if "reward/mean" in r]
    final = [r["val/accuracy"] for r in rows if r.get("step") == steps and "val/accuracy" in r]
    start = [r["val/accuracy"] for r in rows if r.get("step") == 0 and "val/accuracy" in r]
    zero_grad = [r["step"] for r in train if r.get("optim/grad_norm") == 0]
    return {
        "final_val": float(final[-1]) if final else None,
        "start_val": float(start[0]) if start else None,
        "steps_logged": len(train),
        "unsolved_groups": _tail_mean(train, "reward/unsolved_groups"),
        "zero_std_groups": _tail_mean(train, "reward/zero_std_groups"),
        "distinct_answers": _tail_mean(train, "reward/distinct_answers"),
        "entropy": _tail_mean(train, "policy/entropy"),
        "first_zero_grad_step": zero_grad[0] if zero_grad else None,
        "time_step_s": _tail_mean(train, "time/step"),
    }


def verdict(runs: list[dict]) -> tuple[bool, list[str], dict]:
    """runs: rows {mode, seed, final_val, zero_std_groups, ...} -> (passed, reasons it failed, means).
    fp8_async rows (--async) are held to the same per-run thresholds and to fp8's mean."""
    reasons, means = [], {}
    for mode in [*MODES, *([ASYNC] if any(r["mode"] == ASYNC for r in runs) else [])]:
        mine = [r for r in runs if r["mode"] == mode]
        if len(mine) < MIN_SEEDS:
            reasons.append(f"{mode}: {len(mine)} seeds, the gate needs >= {MIN_SEEDS}")
        for r in mine:
            tag = f"{mode} seed {r['seed']}"
            if r["final_val"] is None:
                reasons.append(f"{tag}: did not finish ({r['steps_logged']} steps logged, no final validation)")
            elif r["final_val"] < MIN_VAL_ACCURACY:
                reasons.append(f"{tag}: final val/accuracy {r['final_val']:.2f} < {MIN_VAL_ACCURACY}")
            if r["zero_std_groups"] is not None and r["zero_std_groups"] > MAX_ZERO_STD_GROUPS:
                reasons.append(f"{tag}: ends with {r['zero_std_groups']:.2f} of its groups at zero variance "
                               f"> {MAX_ZERO_STD_GROUPS}")
        done = [r["final_val"] for r in mine if r["final_val"] is not None]
        means[mode] = sum(done) / len(done) if done else None
    for mode, base, key in (("fp8", "bf16", "gap"), (ASYNC, "fp8", "async_gap")):
        if mode not in means:
            continue
        if means[mode] is None or means[base] is None:
            reasons.append(f"no finished run in {mode} or in {base}: no means to compare")
            continue
        means[key] = gap = means[mode] - means[base]
        if abs(gap) > MAX_MEAN_GAP + 1e-9:  # (accuracies are multiples of 1/val size: no float noise at the edge)
            reasons.append(f"mean final accuracy {mode} {means[mode]:.3f} vs {base} {means[base]:.3f}: "
                           f"|gap| {abs(gap):.3f} > {MAX_MEAN_GAP}")
    return not reasons, reasons, means


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table(runs: list[dict], means: dict, modes=MODES) -> str:
    lines = ["| mode | seed | start val | final val | steps | unsolved groups | zero-std groups | distinct answers | "
             "entropy | first grad_norm 0 | s/step |", "|" + "---|" * 11]
    for r in sorted(runs, key=lambda r: (list(modes).index(r["mode"]), r["seed"])):
        lines.append(f"| {r['mode']} | {r['seed']} | {_fmt(r.get('start_val'))} | {_fmt(r['final_val'])} | "
                     f"{r['steps_logged']} | "
                     f"{_fmt(r['unsolved_groups'])} | {_fmt(r['zero_std_groups'])} | {_fmt(r['distinct_answers'])} | "
                     f"{_fmt(r['entropy'], '.3f')} | {_fmt(r['first_zero_grad_step'], 'd')} | "
                     f"{_fmt(r['time_step_s'], '.2f')} |")
    lines.append("")
    lines.append(" ".join(f"mean final val {m}: {_fmt(means.get(m), '.3f')};" for m in modes)
                 + (f" gap fp8 - bf16: {_fmt(means.get('gap'), '+.3f')}" if "gap" in means else "")
                 + (f"; gap fp8_async - fp8: {_fmt(means['async_gap'], '+.3f')}" if "async_gap" in means else ""))
    gains = {m: [r["final_val"] - r["start_val"] for r in runs if r["mode"] == m
                 and r["final_val"] is not None and r.get("start_val") is not None] for m in modes}
    lines.append(" ".join(f"mean gain over the run {m}: {sum(g) / len(g):+.3f};" for m, g in gains.items() if g))
    return "\n".join(lines)


def check(run_files: dict[tuple[str, int], Path], steps: int, sweep: bool = False
          ) -> tuple[bool, list[str], dict, list[dict]]:
    """{(mode, seed): metrics.jsonl path} -> (passed, reasons, means, per-run rows). A missing file is
    a run that logged nothing. sweep: no verdict, only the means (passed: every run finished)."""
    runs = [{"mode": mode, "seed": seed, **summarize_run(load_rows(p) if p.is_file() else [], steps)}
            for (mode, seed), p in sorted(run_files.items())]
    if not sweep:
        passed, reasons, means = verdict(runs)
        return passed, reasons, means, runs
    means = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        done = [r["final_val"] for r in runs if r["mode"] == mode and r["final_val"] is not None]
        means[mode] = sum(done) / len(done) if done else None
    unfinished = [f"{r['mode']} seed {r['seed']}: did not finish" for r in runs if r["final_val"] is None]
    return not unfinished, unfinished, means, runs


def warm_start(args, work: Path, out: Path, t0: float) -> Path | None:
    """Train the config's warm start into WORK/sft_model (scripts/sft.py with --sft's arguments) while
    a second process fills Triton's cache (GPU only). -> the model dir, or None if the SFT failed."""
    model, sft = work / "sft_model", [sys.executable, "-m", "scripts.sft"]
    cmd = [*sft, "--out", str(model), "--task-config", str(args.config), *args.sft.split()]
    log("warm start: " + " ".join(cmd[1:]), t0)
    with open(work / "sft.log", "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        warm = None if args.cpu else subprocess.Popen([*sft, "--warm-fp8", *args.sft.split()],
                                                      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        rc = p.wait()
        if warm is not None:
            warm.wait()
    metrics = model / "sft_metrics.json"
    if metrics.is_file():
        (out / "learn_sft_metrics.json").write_bytes(metrics.read_bytes())
    if rc != 0 or not metrics.is_file():
        log(f"warm start FAILED (rc {rc}); last lines of {work / 'sft.log'}:\n"
             + "\n".join((work / "sft.log").read_text(errors="replace").splitlines()[-15:]), t0)
        return None
    m = json.loads(metrics.read_text())
    log(f"warm start done: greedy val accuracy {m['val_accuracy']:.3f} ({m.get('val_guess_share', 0):.2f} bare "
         f"guesses), {m['steps']} steps, {m['total_s']:.0f}s", t0)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="the quickstart (default configs/quickstart_gpu.yaml; --cpu: configs/tiny_cpu.yaml)")
    p.add_argument("--seeds", default="0,1,2,3", help="train.seed of the runs (default 0,1,2,3)")
    p.add_argument("--modes", default="fp8,bf16", help="subset of fp8,bf16 (a subset always FAILs: debugging)")
    p.add_argument("--steps", type=int, default=0, help="train.steps override (0 = the config's; debugging)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/learn_gate"), help="results dir (default $OUT)")
    p.add_argument("--work", default="/tmp/learn_gate_runs", help="run dirs (emptied first)")
    p.add_argument("--deadline-s", type=float, default=570, help="stop runs still going this long after the start")
    p.add_argument("--max-concurrent", type=int, default=8)
    p.add_argument("--gpu-share", type=float, default=0.06, help="rollout.gpu_memory_utilization of each run")
    p.add_argument("--stagger-timeout-s", type=float, default=150, help="longest wait for an engine before the next start")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    p.add_argument("--sft", default=QUICKSTART_SFT, help=f"scripts/sft.py arguments of the warm start (default: {QUICKSTART_SFT})")
    p.add_argument("--sft-model", metavar="DIR", help="start every run from this model dir: no warm-start training")
    p.add_argument("--cpu", action="store_true", help="tiny_cpu on CPU, HF engine, 2 runs at a time, no stagger")
    p.add_argument("--check", metavar="DIR", help="no runs: the verdict on DIR/<mode>_s<seed>/metrics.jsonl")
    p.add_argument("--sweep", action="append", metavar="NAME:k=v,k=v", default=[],
                   help="instead of fp8/bf16: a variant of the FP8 recipe (repeat the option); no verdict")
    p.add_argument("--async", dest="async_", action="store_true",
                   help=f"also the FP8 recipe with rollout.mode=async ({ASYNC}: torchrun, a trainer and an engine rank)")
    p.add_argument("--async-gpus", default="1,0", help=f"CUDA_VISIBLE_DEVICES of each {ASYNC} run: trainer rank on "
                   "the first, engine rank on the second (default 1,0)")
    p.add_argument("extra", nargs="*", help="train_grpo.py overrides for every run (key.sub=value)")
    args = p.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s != ""]
    except ValueError:
        print(f"error: --seeds {args.seeds!r}: expected integers like 0,1,2,3", file=sys.stderr)
        return 2
    args.modes = [m for m in args.modes.split(",") if m]
    args.mode_overrides = MODES
    if args.sweep:
        try:
            args.mode_overrides = {name: [kv for kv in kvs.split(",") if kv] for name, kvs in
                                   (v.split(":", 1) for v in args.sweep)}
        except ValueError:
            print(f"error: --sweep {args.sweep}: expected NAME:key=value[,key=value...]", file=sys.stderr)
            return 2
        args.modes = list(args.mode_overrides)
    if args.async_:
        if args.sweep:
            print("error: --async with --sweep: the async runs are held to the fp8 runs, a sweep has none",
                  file=sys.stderr)
            return 2
        gpus = len(args.async_gpus.split(","))
        if not args.cpu and not args.check and gpus != 2:
            print(f"error: --async-gpus {args.async_gpus}: name two GPUs (the trainer rank's, then the engine rank's)",
                  file=sys.stderr)
            return 2
        args.mode_overrides = {**MODES, ASYNC: ASYNC_OVERRIDES}
        args.modes.append(ASYNC)
    bad = [m for m in args.modes if m not in args.mode_overrides]
    if bad or not args.seeds:
        print(f"error: --modes {','.join(bad)}: expected a subset of {','.join(MODES)} (and --seeds non-empty)",
              file=sys.stderr)
        return 2
    args.config = Path(args.config or ROOT / "configs" / ("tiny_cpu.yaml" if args.cpu else "quickstart_gpu.yaml")).resolve()
    if not args.config.is_file():
        print(f"error: --config {args.config}: no such file", file=sys.stderr)
        return 2
    if args.cpu:
        args.run_overrides = ["train.device=cpu", "rollout.engine=hf"]
        args.max_concurrent, args.stagger, args.threads = min(args.max_concurrent, 2), False, 1
    else:
        args.run_overrides = [f"rollout.gpu_memory_utilization={args.gpu_share}", "rollout.sleep_mode=false"]
        args.stagger = True
    if args.steps:
        args.run_overrides.append(f"train.steps={args.steps}")
    from config import load_config
    from errors import UserError
    try:  # a bad override fails here, once, not in 8 runs
        for mode in args.modes:
            cfg = load_config(args.config, [*args.run_overrides, *args.mode_overrides[mode], *args.extra])
            steps = cfg.train.steps
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.sft_model and not (Path(args.sft_model) / "config.json").is_file():
        print(f"error: --sft-model {args.sft_model}: not a model dir (no config.json); train one with "
              f"scripts/sft.py or leave the option out", file=sys.stderr)
        return 2
    needs_warm_start = not args.sft_model and cfg.model.name_or_path != "tiny"
    t0, out = time.time(), Path(args.out)
    if args.check:
        work, commands = Path(args.check), {}
    else:
        work = Path(args.work)
        if work.exists():
            import shutil
            shutil.rmtree(work)
        work.mkdir(parents=True)
        log(f"config {args.config.name}, {steps} steps, seeds {args.seeds}, modes {args.modes}, "
             f"deadline {args.deadline_s:.0f}s, out {out}", t0)
        out.mkdir(parents=True, exist_ok=True)
        model = args.sft_model or (warm_start(args, work, out, t0) if needs_warm_start else "tiny")
        if model is None:
            launched = {}
        else:
            if needs_warm_start or args.sft_model:
                args.run_overrides.append(f"model.name_or_path={model}")
            launched = launch_all(args, work, t0)
        commands = {f"{m}_s{s}": r["cmd"] for (m, s), r in launched.items()}
    files = {(m, s): work / f"{m}_s{s}" / "metrics.jsonl" for s in args.seeds for m in args.modes}
    passed, reasons, means, runs = check(files, steps, sweep=bool(args.sweep))
    if not args.check and model is None:
        passed, reasons = False, [f"the warm start failed: see {out / 'learn_sft.log'}", *reasons]
    word = ("finished" if passed else "UNFINISHED") if args.sweep else ("PASS" if passed else "FAIL")
    md = table(runs, means, args.modes) + "\n\n" + word + "".join(f"\n- {r}" for r in reasons)
    print(md, flush=True)
    copies = copy_runs(work, out, files)
    if (work / "sft.log").is_file():
        copies.append(out / "learn_sft.log")
        copies[-1].write_bytes((work / "sft.log").read_bytes())
    write_results(out, {
        "verdict": word, "reasons": reasons, "variants": args.mode_overrides, "means": means, "runs": runs,
        "thresholds": {"min_seeds": MIN_SEEDS, "min_val_accuracy": MIN_VAL_ACCURACY, "max_mean_gap": MAX_MEAN_GAP,
                       "max_zero_std_groups": MAX_ZERO_STD_GROUPS, "tail_steps": TAIL_STEPS},
        "config": str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT) else str(args.config),
        "steps": steps, "overrides": [*args.run_overrides, *args.extra], "commands": commands,
        "date": datetime.now().isoformat(timespec="seconds"), "wall_s": round(time.time() - t0, 1),
        "device": device_name(),
    }, md, copies)
    log(f"{word}; results in {out}", t0)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
