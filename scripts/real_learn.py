"""Does a real pretrained model learn with GRPO? SmolLM2-135M-Instruct over seeds, BF16 vs FP8 KV cache.

    # one host with 4 GPUs: 4 seeds x {fp8kv, bf16}, 2 runs per GPU
    python -m scripts.real_learn --model DIR --out OUT --gpus 0,1,2,3 --seeds 0,1,2,3 --steps 30 --deadline-s 540
    # one GPU (an H200): 3 seeds x {fp8kv, bf16}
    python -m scripts.real_learn --model DIR --out OUT --seeds 0,1,2 --steps 25 --deadline-s 540
    python -m scripts.real_learn --model tiny --gpus 0,1,2,3 --dry-run       # each run's GPU and overrides
    python -m scripts.real_learn --cpu --model tiny --config configs/tiny_cpu.yaml --seeds 0 --steps 2   # the machinery

The runs are scripts/learn_gate.py's (its launcher, in scripts/common.py: concurrent processes, each
with a small vLLM share, rollout.sleep_mode=false, staggered starts, whatever still runs at --deadline-s
stopped), on configs/gsm8k.yaml scaled down as scripts/kv_mismatch.py does (plain AdamW, eager trainer,
no checkpoints, no episode dumps), every run starting from the same pretrained model: no warm start. Two modes:

    fp8kv   fp8.kv_cache=true: the engine's KV cache and attention in FP8 (scales recalibrated per rollout)
    bf16    fp8.kv_cache=false
Both keep BF16 linears (fp8.train=false fp8.rollout=false): SmolLM2's hidden size 576 is not a multiple
of FP8's 128-blocks, so its linears would stay BF16 in the full recipe too.

Settings for speed (H200, 2026-11-26: 8 runs on one GPU at gsm8k.yaml's micro-batch of 4 took
17-23 s a step, 13-15 s of it in the trainer's 64 passes; the 8 engines started one after another,
the last at +366 s, and no run finished in 540 s):
  - train.micro_batch_size: the largest divisor of the step's samples up to --micro-batch (64): a few
    passes a step; train.mini_batch_size=0: one optimizer step per step.
  - model.gradient_checkpointing (--grad-ckpt auto): off when at most 2 runs share a GPU (~14 GiB of
    activations per trainer at 64 x ~90 tokens), on otherwise (~3.3 GiB).
  - --gpus 0,1,2,3: runs round-robin over the GPUs (each GPU gets both modes), CUDA_VISIBLE_DEVICES per
    run, one learn_gate launcher per GPU so the one-engine-start-at-a-time stagger holds per GPU.
    --max-concurrent counts per GPU. The ids are physical: each run's CUDA_VISIBLE_DEVICES replaces
    the caller's.
  - --kv-cache-gib (rollout.kv_cache_gib): each engine gets a fixed KV cache, so no start profiles free
    memory (a neighbour's allocation during that profile lost a run before) and all engines start at once
    instead of one after another (6 staggered starts took over 5 minutes on an H200).
Not yet measured with these settings.

Step 0's greedy validation is the same for every seed of a mode (one model, the same held-out
prompts, greedy): bf16 0.725, fp8kv 0.775 on the H200 (40 problems); seeds differ from step 0's
rollout on (train.seed seeds the sampling; the prompt order is data.seed's, the same for every run).
A mode whose step-0 accuracies differ across seeds is flagged under the table. Sampled reward rose
0.19 -> 0.35 over ~20 steps in the runs that got that far; mismatch/token_mult_prob_error 1.040
(bf16), 1.147-1.150 (fp8kv).

The task: "What is a + b?" with the answer in \\boxed{} (the config's chat template and reward), written
as GSM8K-format JSONL into WORK/data from --data-seed; the test rows are held-out problems. --task add1:
a, b in 0..9 (100 problems, 40 held out); add2: a in 10..49, b in 1..9 (360 problems, 64 held out).
Why this task (measured on CPU, HF engine, the converted SmolLM2, 16 prompts, <= 32-48 new tokens):
GRPO learns only from groups with both right and wrong samples. Scored strictly (the \\boxed{} only),
one-digit sums gave greedy 0.125 and sampled 0/64 at temperature 1 (5/64 at 0.7); with a worked
example of the format in the instruction, greedy 0.06 and sampled 0.03; sums of 2-digit numbers and
10..49 + 1..9 gave 0 greedy and <= 0.016 sampled (on the H200, 2-digit sums: ~0.5% sampled). The
model mostly computes the sum ("6 + 6 = 12") and then leaves \\boxed{} empty. So the reward also
reads the last number (data.reward_last_number=true, rewards.py's rule 4; it still takes a \\boxed{}
first): one-digit sums then give greedy 0.75 and sampled 0.25 at temperature 1 -- signal in
many groups, room to gain (output cut at --max-new-tokens is then scored by its text too). The rollout temperature stays 1.0: the trainer scores tokens under logits / temperature
(batch.token_logprobs), so another would be consistent, but 1.0 keeps the recipe's exploration and
its mismatch figures comparable with the other runs.

Greedy validation at step 0 and at the last step (train.val_every=--steps); the gain is the final
accuracy minus step 0's. Reported per run: both accuracies, the gain, the sampled reward's mean over
the first and the last 5 steps and over the run, the share of tokens the PPO clip and the IS truncation
took out of the gradient (loss/clip_frac, is/truncated_frac; the mean over steps), and
mismatch/token_mult_prob_error's median and max over steps; per mode the mean and standard deviation of
the gain, of the final accuracy and of the reward over the run; the gap fp8kv - bf16 of the first two
means. No PASS/FAIL: the learning gate's thresholds are the quickstart's. A run without its final
validation is listed as unfinished and left out of the means.

Writes into --out: real_learn.json (with each run's GPU), real_learn.md, <mode>_s<seed>_metrics.jsonl and .log per run, and
real_learn_runs.tgz holding all of those. Exit 0 when every run finished, 1 if one did not, 2 on bad
arguments (one line `error: ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from scripts.common import (ROOT, copy_runs, device_name, fail, launch_all, load_rows, log, model_dir,
                            write_results)

BF16_LINEARS = ["fp8.train=false", "fp8.rollout=false"]
MODES = {"fp8kv": [*BF16_LINEARS, "fp8.kv_cache=true"], "bf16": [*BF16_LINEARS, "fp8.kv_cache=false"]}
TASKS = {"add1": (range(0, 10), range(0, 10), 40), "add2": (range(10, 50), range(1, 10), 64)}  # a, b, held out
INSTRUCTION = "Put your final answer within \\boxed{}."
CPU = ["train.device=cpu", "rollout.engine=hf", "model.gradient_checkpointing=false", "fp8.cache_weights=false"]
MISMATCH = "mismatch/token_mult_prob_error"
TAIL = 5


def write_task(d: Path, task: str, seed: int, train_rows: int = 2000) -> Path:
    """DIR/train.jsonl and DIR/test.jsonl in GSM8K's fields for `task` (TASKS), from `seed`: the test rows
    are held-out problems (each once), the train rows drawn with repetition from the others."""
    a_range, b_range, held_out = TASKS[task]
    problems = [(a, b) for a in a_range for b in b_range]
    rng = random.Random(seed)
    rng.shuffle(problems)
    test, train = problems[:held_out], problems[held_out:]
    d.mkdir(parents=True, exist_ok=True)

    def row(a, b):
        return json.dumps({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
    (d / "train.jsonl").write_text("".join(row(*rng.choice(train)) for _ in range(train_rows)))
    (d / "test.jsonl").write_text("".join(row(a, b) for a, b in test))
    return d


def micro_batch(samples: int, cap: int) -> int:
    """train.micro_batch_size: the largest divisor of a step's samples that is <= cap (config.validate wants
    the mini-batch, here all of the step's samples, a multiple of it)."""
    return max(d for d in range(1, min(cap, samples) + 1) if samples % d == 0)


def runs_per_gpu(args) -> int:
    return -(-len(args.seeds) * len(args.modes) // max(len(args.gpus), 1))


def grad_ckpt(args) -> bool:
    """--grad-ckpt auto: on when more than 2 runs share a GPU (module docstring: memory), else off."""
    return args.grad_ckpt == "on" or (args.grad_ckpt == "auto" and runs_per_gpu(args) > 2)


def assign_gpus(runs: list[tuple[str, int]], gpus: list[str]) -> dict[tuple[str, int], str | None]:
    """Run -> GPU id: round-robin over `gpus` in launch order, each round shifted by one GPU, so that with
    an even number of GPUs each still gets both modes (plain round-robin would put every fp8kv run on the
    even GPUs). No --gpus: None for all (the runs inherit the environment's GPU)."""
    g = len(gpus)
    return {r: (gpus[(k + k // g) % g] if g else None) for k, r in enumerate(runs)}


def run_overrides(args, data: Path) -> list[str]:
    """configs/gsm8k.yaml scaled down to the task, for every run."""
    run = [f"model.name_or_path={args.model}", "data.source=jsonl", f"data.path={data / 'train.jsonl'}",
           f"data.val_split={data / 'test.jsonl'}", "data.prompt_field=question", "data.answer_field=answer",
           "data.answer_regex=#### (.*)", f"data.instruction={INSTRUCTION}", "data.reward_last_number=true",
           "data.max_prompt_tokens=128",
           f"rollout.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
           f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.max_model_len=0", "optim.name=adamw",
           f"optim.lr={args.lr}", "optim.warmup_steps=0", "train.mini_batch_size=0", "train.compile=none",
           f"train.micro_batch_size={micro_batch(args.prompts * args.n, args.micro_batch)}",
           f"model.gradient_checkpointing={str(grad_ckpt(args)).lower()}",
           f"train.steps={args.steps}", f"train.val_every={args.steps}", f"train.val_max_prompts={TASKS[args.task][2]}",
           "train.ckpt_every=0", "train.save_final=false", "train.probe=false", "log.tensorboard=false",
           "log.dump_episodes_every=0"]
    if args.model == "tiny":  # a char tokenizer: no chat template, and the task's characters in its vocabulary
        run += ["data.template=plain", "model.tiny.vocab=" + "".join(map(chr, range(32, 127))) + "\n"]
    return run + (CPU if args.cpu else [f"rollout.gpu_memory_utilization={args.gpu_share}", "rollout.sleep_mode=false",
                                        f"rollout.kv_cache_gib={args.kv_cache_gib}"])


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict], steps: int) -> dict:
    """One run's metrics.jsonl rows -> its table row."""
    train = [r for r in rows if "reward/mean" in r]
    val = {r["step"]: float(r["val/accuracy"]) for r in rows if "val/accuracy" in r}
    v0, vend = val.get(0), val.get(steps)
    tmpe = [r[MISMATCH] for r in train if MISMATCH in r]
    return {"val_step0": v0, "val_final": vend, "gain": None if v0 is None or vend is None else vend - v0,
            "steps_logged": len(train), "finished": vend is not None,
            "reward_first5": _mean([r["reward/mean"] for r in train[:TAIL]]),
            "reward_last5": _mean([r["reward/mean"] for r in train[-TAIL:]]),
            "reward_run": _mean([r["reward/mean"] for r in train]),
            # what the policy loss left out, mean over steps: the PPO clip's share of tokens, and TIS's capped share
            "clip_frac": _mean([r["loss/clip_frac"] for r in train if "loss/clip_frac" in r]),
            "truncated_frac": _mean([r["is/truncated_frac"] for r in train if "is/truncated_frac" in r]),
            # over steps: the median, and the max apart (one token's outlier can lift a step's mean by 100x)
            "token_mult_prob_error": statistics.median(tmpe) if tmpe else None,
            "token_mult_prob_error_max": max(tmpe, default=None)}


def aggregate(runs: list[dict], modes: list[str]) -> dict:
    """Per mode: n finished, mean and std (sample, n-1) of gain and of final accuracy; the fp8kv - bf16 gaps."""
    out = {}
    for mode in modes:
        done = [r for r in runs if r["mode"] == mode and r["finished"]]
        out[mode] = {"finished": len(done), "of": len([r for r in runs if r["mode"] == mode]),
                     # greedy, the same model, prompts and engine seed: one value per mode, seeds alike
                     "val_step0_values": sorted({r["val_step0"] for r in runs if r["mode"] == mode
                                                 and r["val_step0"] is not None})}
        for key in ("gain", "val_final", "reward_run"):
            xs = [r[key] for r in done if r[key] is not None]
            out[mode][f"{key}_mean"] = _mean(xs)
            out[mode][f"{key}_std"] = statistics.stdev(xs) if len(xs) > 1 else None
    if {"fp8kv", "bf16"} <= set(out):
        for key in ("gain", "val_final"):
            a, b = out["fp8kv"][f"{key}_mean"], out["bf16"][f"{key}_mean"]
            out[f"gap_{key}"] = None if a is None or b is None else a - b
    return out


def _f(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def markdown(runs: list[dict], agg: dict, modes: list[str]) -> str:
    lines = ["| mode | seed | val step 0 | val final | gain | steps | reward first 5 | reward last 5 | reward, run | "
             "clip / truncated | token_mult_prob_error median (max) over steps |", "|" + "---|" * 11]
    for r in sorted(runs, key=lambda r: (modes.index(r["mode"]), r["seed"])):
        lines.append(f"| {r['mode']} | {r['seed']} | {_f(r['val_step0'])} | {_f(r['val_final'])} | "
                     f"{_f(r['gain'], '+.3f')} | {r['steps_logged']}{'' if r['finished'] else ' (unfinished)'} | "
                     f"{_f(r['reward_first5'])} | {_f(r['reward_last5'])} | {_f(r.get('reward_run'))} | "
                     f"{_f(r.get('clip_frac'), '.4f')} / {_f(r.get('truncated_frac'), '.4f')} | "
                     f"{_f(r['token_mult_prob_error'], '.4f')} ({_f(r.get('token_mult_prob_error_max'), '.4g')}) |")
    lines += ["", "| mode | finished | gain mean | gain std | final val mean | final val std | reward over the run, "
              "mean ± std |", "|" + "---|" * 7]
    for m in modes:
        a = agg[m]
        lines.append(f"| {m} | {a['finished']}/{a['of']} | {_f(a['gain_mean'], '+.3f')} | {_f(a['gain_std'])} | "
                     f"{_f(a['val_final_mean'])} | {_f(a['val_final_std'])} | "
                     f"{_f(a.get('reward_run_mean'))} ± {_f(a.get('reward_run_std'))} |")
    differ = [f"{m} {', '.join(map(_f, agg[m]['val_step0_values']))}" for m in modes
              if len(agg[m]["val_step0_values"]) > 1]
    if differ:
        lines += ["", "step-0 validation differs across seeds (expected one value per mode): " + "; ".join(differ)]
    if "gap_gain" in agg:
        lines += ["", f"fp8kv - bf16: gain {_f(agg['gap_gain'], '+.3f')}, final val {_f(agg['gap_val_final'], '+.3f')}"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF model dir, or 'tiny' (the config's model.tiny) (default: scripts/real_model.py's)")
    p.add_argument("--config", default=str(ROOT / "configs" / "gsm8k.yaml"))
    p.add_argument("--task", default="add1", help=f"one of {', '.join(TASKS)} (default add1)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the task's train/test files")
    p.add_argument("--seeds", default="0,1,2,3", help="train.seed of the runs")
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/real_learn"))
    p.add_argument("--work", default="/tmp/real_learn_runs", help="run dirs (emptied first)")
    p.add_argument("--deadline-s", type=float, default=570, help="stop runs still going this long after the start")
    p.add_argument("--gpu-share", type=float, default=0.06, help="rollout.gpu_memory_utilization of each run")
    p.add_argument("--kv-cache-gib", type=float, default=1.5,
                   help="rollout.kv_cache_gib of each run: a fixed KV cache, so an engine's start skips vLLM's\n"
                   "free-memory profile, which a neighbour's allocation can fail, and starts need no stagger\n"
                   "(1.5 GiB holds a step's 32 x 8 sequences of 176 tokens at SmolLM2's 22.5 KiB a token);\n"
                   "0: sized by --gpu-share, starts staggered one at a time")
    p.add_argument("--gpus", default="", help="GPU ids, like 0,1,2,3: runs round-robin over them (CUDA_VISIBLE_DEVICES\n"
                   "per run), engine starts staggered per GPU (default: one GPU, the environment's)")
    p.add_argument("--micro-batch", type=int, default=64,
                   help="train.micro_batch_size cap: the largest divisor of --prompts x --n up to it (default 64)")
    p.add_argument("--grad-ckpt", default="auto", choices=["auto", "on", "off"],
                   help="model.gradient_checkpointing; auto: on when more than 2 runs share a GPU")
    p.add_argument("--max-concurrent", type=int, default=8, help="runs at once per GPU")
    p.add_argument("--stagger-timeout-s", type=float, default=150)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    p.add_argument("--cpu", action="store_true", help="train.device=cpu, HF engine, 2 runs at a time (per --gpus\n"
                   "group), no stagger")
    p.add_argument("--dry-run", action="store_true", help="print each run's GPU and the overrides; start nothing")
    p.add_argument("--from-work", action="store_true", help="launch nothing: write the results from the run dirs\n"
                   "already under --work (runs whose call ended before their summary was written)")
    p.add_argument("overrides", nargs="*", help="more section.key=value overrides for every run")
    return p


def check_args(args) -> None:
    """Bad input -> `error: ...`, exit 2, before any run starts."""
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        fail(f"--seeds {args.seeds!r}: expected integers like 0,1,2,3")
    if not args.seeds:
        fail("--seeds: give at least one seed, like 0,1,2,3")
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in MODES for m in args.modes):
        fail(f"--modes {','.join(args.modes)}: expected a subset of {','.join(MODES)}")
    if args.task not in TASKS:
        fail(f"--task {args.task}: expected one of {', '.join(TASKS)}")
    for name in ("steps", "prompts", "n", "max_new_tokens"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not args.lr > 0:
        fail(f"--lr {args.lr}: must be > 0")
    if args.kv_cache_gib < 0:
        fail(f"--kv-cache-gib {args.kv_cache_gib}: must be >= 0 (0 = sized by --gpu-share)")
    if args.micro_batch < 1:
        fail(f"--micro-batch {args.micro_batch}: must be >= 1")
    args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if any(not g.isdigit() for g in args.gpus) or len(set(args.gpus)) < len(args.gpus):
        fail(f"--gpus {','.join(args.gpus)}: expected distinct GPU ids like 0,1,2,3")
    if not Path(args.config).is_file():
        fail(f"--config {args.config}: no such file; give a YAML config such as configs/gsm8k.yaml")
    if args.from_work:
        if not (Path(args.work) / "data").is_dir():
            fail(f"--from-work: {args.work} holds no runs (no data/ dir); give --work the runs' dir")
        return  # the runs' model is in their config.yaml
    args.model = model_dir(args.model)


def launch(args, run: list[str], work: Path, gpu_of: dict, t0: float) -> dict:
    """common.launch_all once per GPU (its runs in launch order, CUDA_VISIBLE_DEVICES), concurrently:
    each call staggers its own engine starts (a start only races a neighbour on the same GPU) and
    stops what still runs at the deadline. Without --gpus: one call, the environment's GPU."""
    groups: dict[str | None, list] = {}
    for r, g in gpu_of.items():
        groups.setdefault(g, []).append(r)
    launched, calls = {}, []
    for g, runs in groups.items():
        # learn_gate's launcher: train.seed, out dir and run name per run; then run_overrides, the mode's, extra
        gate = argparse.Namespace(seeds=args.seeds, modes=args.modes, runs=runs, deadline_s=args.deadline_s,
                                  threads=args.threads, env={} if g is None else {"CUDA_VISIBLE_DEVICES": g},
                                  max_concurrent=min(args.max_concurrent, 2) if args.cpu else args.max_concurrent,
                                  stagger=not args.cpu and not args.kv_cache_gib,
                                  stagger_timeout_s=args.stagger_timeout_s,
                                  config=Path(args.config).resolve(), run_overrides=run, mode_overrides=MODES,
                                  extra=args.overrides)
        calls.append(gate)
    if len(calls) == 1:
        return launch_all(calls[0], work, t0)
    work.mkdir(parents=True, exist_ok=True)
    threads = [threading.Thread(target=lambda c=c: launched.update(launch_all(c, work, t0))) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return launched


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    out, work, t0 = Path(args.out), Path(args.work), time.time()
    if args.from_work:
        data = work / "data"
    else:
        if work.exists():
            shutil.rmtree(work)
        data = write_task(work / "data", args.task, args.data_seed)
    from config import load_config
    from errors import UserError
    run = run_overrides(args, data)
    try:  # a bad override fails here, once, not in every run
        for m in args.modes:
            load_config(args.config, [*run, *MODES[m], *args.overrides])
    except UserError as e:
        fail(str(e))
    gpu_of = assign_gpus([(m, s) for s in args.seeds for m in args.modes], args.gpus)
    if args.dry_run and not args.from_work:
        for (m, s), g in gpu_of.items():
            print(f"{m}_s{s}: " + ("(the environment's GPU)" if g is None else f"CUDA_VISIBLE_DEVICES={g}"))
        print("overrides: " + " ".join([*run, *args.overrides]))
        for m in args.modes:
            print(f"{m}: " + " ".join(MODES[m]))
        return 0
    log(f"real_learn: model {args.model}, task {args.task}, {args.steps} steps, seeds {args.seeds}, "
         f"modes {args.modes}, GPUs {args.gpus or 'the environment'}, deadline {args.deadline_s:.0f}s, out {out}", t0)
    launched = {} if args.from_work else launch(args, run, work, gpu_of, t0)
    runs = []
    for s in args.seeds:
        for m in args.modes:
            metrics = work / f"{m}_s{s}" / "metrics.jsonl"
            runs.append({"mode": m, "seed": s, **summarize(load_rows(metrics) if metrics.is_file() else [], args.steps),
                         "rc": launched.get((m, s), {}).get("rc", "not recorded" if args.from_work else "not started"),
                         "gpu": gpu_of[(m, s)]})
    files = copy_runs(work, out, [(r["mode"], r["seed"]) for r in runs])
    agg = aggregate(runs, args.modes)
    md = markdown(runs, agg, args.modes)
    unfinished = [f"{r['mode']} seed {r['seed']}" for r in runs if not r["finished"]]
    if unfinished:
        md += "\nunfinished (no final validation by the deadline or the run failed): " + ", ".join(unfinished) + "\n"
    print(md, flush=True)
    write_results(out, {
        "model": args.model, "config": args.config, "task": args.task, "data_seed": args.data_seed,
        "instruction": INSTRUCTION, "modes": {m: MODES[m] for m in args.modes},
        "settings": {k: getattr(args, k) for k in ("steps", "prompts", "n", "max_new_tokens", "lr", "gpu_share",
                                                   "gpus", "micro_batch", "grad_ckpt", "deadline_s", "cpu")},
        "overrides": [*run, *args.overrides], "runs": runs, "summary": agg, "unfinished": unfinished,
        "commands": {f"{m}_s{s}": r["cmd"] for (m, s), r in launched.items()},
        "device": "not recorded (--from-work)" if args.from_work else device_name(),
        "date": datetime.now().isoformat(timespec="seconds"),
        "wall_s": None if args.from_work else round(time.time() - t0, 1)},
        md, files, name="real_learn", archive="real_learn_runs.tgz")
    log(f"results in {out}", t0)
    return 1 if unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
