"""The shipped 8B configs at full 8B shape on one GPU, as a user runs them, a few short steps each.

    python -m scripts.flagship_check --out /tmp/out                       # all five 8B configs
    python -m scripts.flagship_check --configs llama31_8b_fp8 --steps 3   # one of them
    python -m scripts.flagship_check --configs gsm8k --data /tmp/gsm8k    # a data config on local JSONL
    python -m scripts.flagship_check --configs moe --time-limit 570       # the three Qwen3-30B-A3B configs
    python -m scripts.flagship_check --configs qwen3_30b_a3b_fp8 --router-replay on,off   # replay on and off

Each config runs the real trainer (train_grpo.py) in its own process with only what a machine without
hub access needs swapped: random-init weights at the exact Llama-3.1-8B / Qwen3-8B shapes (all layers,
the real vocab), synthetic prompts, 8 prompts x 8 samples x 1024 generated tokens (ignore_eos), 2
optimizer steps of 32 samples per rollout step. Everything else is the shipped config: fp32 master
weights and the optimizer, gradient checkpointing, fp8.*, the loss, vLLM's memory share and sleep mode.
train.probe gives the rewards variance and logs probe/policy_gain. Prints one row per config: step
time by phase (last step; step 0 also autotunes and captures), mem/peak_gib next to nvidia-smi's peak
memory.used over the run and the start-up memory model's peaks (model_*_gib, from the run's log), the share
of weights the last optimizer step changed, the mismatch and the probe. Writes OUT/flagship.json,
OUT/flagship.md and each run's log.

--shipped runs the FP8 configs and their BF16 twins (SHIPPED_PAIRS) at their own workload: the config's
n (32), generation budget (3584 new tokens) and micro-batch, its number of optimizer steps per step (4)
with mini-batches scaled to --prompts prompts (default 12: 384 samples, as many as one device call
holds; since lengths differ, at most ~300k tokens are live at once, about BF16's KV share of 335-377k
on an H200, so the configs' own 64 prompts load the cache far more: bench/rollout.py measures the
rollout alone there), train.probe off (the users' setting), and response lengths drawn per sample
(rollout.ignore_eos_median): log-normal, median 1400 tokens, sigma 0.6, cut at the budget, so the
mean is ~1,640 tokens, a tail reaches the budget and ~6% are truncated, the shape of reasoning-RL
rollouts at a 4k budget (DAPO's and Skywork-OR1's 7B-8B runs report means of ~1-3k tokens with a few
percent clipped). Every config draws the same lengths (seeded by the step). Step 1 is timed (step 0
also compiles, autotunes and captures). Writes OUT/shipped_<gpu>.json: a row per pair,
{config, baseline, ratio = baseline step s / config step s, step_s, baseline_step_s, gpus, gpu,
workload, date, command, phases}. --merge F... adds the run rows of earlier flagship.json files
(one config per device call: a pair's runs need not share a call, but must share a host kind).

--parallel runs the configs side by side, one per visible GPU (a 4-GPU host runs both pairs at once:
`bash scripts/gpu_check.sh shipped --parallel`); each run watches its own GPUs' memory. --ranks N runs
each config on N GPUs through torchrun (FSDP2; 80 GB cards: `--ranks 2 --parallel` on 4 H100s runs a
pair at once, with the overrides the README gives for them); the rows' `gpus` say N, and a pair's
runs must share it.

--async (with --shipped, on 2 GPUs) runs each config of --configs twice at that workload: synchronous on
both GPUs (colocated, FSDP2, as --ranks 2) and as <config>_async (rollout.mode=async: a trainer rank on one
GPU, a vLLM engine rank on the other at --async-share of it, max_staleness 1), and writes OUT/async_<gpu>.json
with a row per config, ratio = synchronous step s / async step s (the same samples per step, so the
throughput ratio). Give --steps 3 or more: the async loop overlaps from its second step on.

--warm runs each config twice, one after the other, both with FP8_GRPO_CACHE_DIR=RUNS/cache (caches.py; emptied
first): <config> starts cold, with none of the compile, JIT and autotuning caches (the Triton seeds gpu_check.sh
lays down are elsewhere), and <config>_warm reuses every cache the first filled, as a second launch on the same
host or disk does. Every row's launch_to_step1_s is the run's wall time less its steps after step 0 (launch to
the end of step 0, the process's exit included); flagship.md sets each config's cold and warm ones side by side.

--data DIR runs the data configs (gsm8k, math) on real-format files instead of synthetic prompts:
DIR/train.jsonl and DIR/test.jsonl in the dataset's own fields, through the config's loader, answer
extraction and reward, with a character tokenizer over printable ASCII (the random-init model has no
hub tokenizer, so no chat template: data.template=plain).

The Qwen3-30B-A3B configs (--configs moe) run at the real width (hidden 2048, 32 heads, 4 KV heads,
head_dim 128, 128 experts of width 768, top-8, vocab 151936; bench/rollout.py MODELS) with the 48
layers cut to --moe-layers (default 12) so that trainer and engine share one H200: a layer holds
623.1M parameters (experts 128 x 3 x 2048 x 768 = 604.0M, attention 18.9M, router 0.26M),
embeddings + lm_head 622.3M, so 12 layers = 8.10B parameters, the 8B configs' size. The trainer keeps
4 B fp32 master weight + 4 B grad + 2 B AdamW8bit states per parameter = 81 GB (75.4 GiB) while
training, 6 B (49 GB) beside vLLM's 0.45 of the card (63 GiB: 16 GB BF16 weights, the rest KV) in the
rollout: the budget the 8B configs peaked at 116-122 GiB of 139.8 in. 16 layers (10.6B) would need
106 GB to train: too close. Every layer is sparse and alike under random init, so which 12 of the 48
does not matter. Their rows add moe/routing_mismatch (and _tokens: routing.py), the share of (response
token, layer) pairs whose trainer top-k differs from the engine's, logged with router replay on
(the configs' setting) and off (--router-replay on,off: a second run named <config>_noreplay with
moe.router_replay=false). --time-limit S starts no run with less than 120 s left and cuts the last
run's timeout to what is left (scripts/gpu_check.sh moe: 570, one device call).
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from bench.rollout import MOE_LAYERS, SHIPPED_LENGTHS, optimizer_steps
from bench.runner import visible_gpus
from caches import ENV as CACHE_ENV
from scripts.common import (ROOT, SHORT_RUN, family, full_shape, gpu_name, real_data, run_logged,
                            run_timeout)

CONFIGS = ["llama31_8b_bf16", "llama31_8b_fp8", "qwen3_8b_bf16", "qwen3_8b_fp8", "qwen3_8b_fp8_kv"]
MOE_CONFIGS = ["qwen3_30b_a3b_bf16", "qwen3_30b_a3b_fp8", "qwen3_30b_a3b_fp8_kv"]
CONFIG_SETS = {"8b": CONFIGS, "moe": MOE_CONFIGS}  # --configs moe: all three
SHIPPED_PAIRS = {"llama31_8b_fp8": "llama31_8b_bf16", "qwen3_8b_fp8_kv": "qwen3_8b_bf16", "qwen3_8b_fp8": "qwen3_8b_bf16"}
LENGTHS = SHIPPED_LENGTHS  # --shipped: the response lengths' log-normal (median tokens, sigma)
PHASES = ("rollout", "wake", "sleep", "assemble", "logprobs", "train", "recalibrate", "refit", "other")  # wake, sleep: within rollout


def shipped_run(config: str, prompts: int) -> list[str]:
    """--shipped: a config's own workload at `prompts` prompts (see above) as overrides."""
    from config import load_config
    cfg = load_config(ROOT / "configs" / f"{config}.yaml")
    r, t = cfg.rollout, cfg.train
    samples, opt_steps = prompts * r.n, optimizer_steps(cfg)
    if samples % opt_steps or (samples // opt_steps) % t.micro_batch_size:
        print(f"error: --prompts {prompts}: {samples} samples do not split into {opt_steps} optimizer steps of whole "
              f"micro-batches of {t.micro_batch_size} ({config}); pick a multiple of {opt_steps}", file=sys.stderr)
        sys.exit(2)
    return ["model.name_or_path=tiny", "data.source=synthetic", "data.template=plain", "data.instruction=",
            f"rollout.prompts_per_step={prompts}", "rollout.ignore_eos=true", f"rollout.ignore_eos_median={LENGTHS[0]}",
            f"rollout.ignore_eos_sigma={LENGTHS[1]}", f"train.mini_batch_size={samples // opt_steps}",
            "train.val_every=0", "train.ckpt_every=0", "train.save_final=false", "train.probe=false",
            "log.tensorboard=false", "log.dump_episodes_every=0"]


def workload(config: str, prompts: int, result: dict) -> str:
    """--shipped: the workload in words, with the step's measured response lengths."""
    from config import load_config
    r = load_config(ROOT / "configs" / f"{config}.yaml").rollout
    cut = 0.5 * math.erfc(math.log(r.max_new_tokens / LENGTHS[0]) / LENGTHS[1] / math.sqrt(2))  # P(draw > budget)
    return (f"{prompts} prompts x {r.n} samples, lengths log-normal (median {LENGTHS[0]}, sigma {LENGTHS[1]}) cut at "
            f"{r.max_new_tokens} ({cut:.1%} of the draw): mean {result.get('response_mean')} tokens; "
            f"random-init weights at full shape, synthetic prompts")


def shipped_rows(results: list[dict], pairs: dict[str, str] = SHIPPED_PAIRS) -> list[dict]:
    """A row per pair {config: baseline} (default SHIPPED_PAIRS) whose two runs both finished, on the same
    GPU kind; its command: the runs' (one, or both, joined by " ; ": run one after the other, they repeat it)."""
    by = {r["config"]: r for r in results if r.get("ok")}
    rows = []
    for config, baseline in pairs.items():
        a, b = by.get(config), by.get(baseline)
        if not a or not b or (a.get("gpu"), a.get("gpus", 1)) != (b.get("gpu"), b.get("gpus", 1)):
            continue
        rows.append({"config": config, "baseline": baseline, "ratio": round(b["step_s"] / a["step_s"], 3),
                     "step_s": a["step_s"], "baseline_step_s": b["step_s"], "gpus": a.get("gpus", 1),
                     "gpu": a.get("gpu", ""),
                     "workload": a.get("workload", ""), "date": a.get("date", ""),
                     "command": " ; ".join(dict.fromkeys(r.get("command", "") for r in (a, b))),
                     "phases": {c: {k: r[k] for k in r if k.endswith("_s") or k.endswith("_gib")} for c, r in
                                ((config, a), (baseline, b))},
                     **({"compiled_in_timed_step": late} if (late := timed_compiles({config: a, baseline: b}))
                        else {})})
    return rows


def timed_compiles(runs: dict[str, dict]) -> dict[str, int]:
    """{run: graphs its timed (last) step compiled} for the runs whose timed step compiled any: their step
    time includes compiling, so a ratio with them is not the configs' steady-state one."""
    late = {name: g[-1] - g[-2] for name, r in runs.items() if len(g := r.get("compiled_graphs", [])) > 1}
    return {name: n for name, n in late.items() if n > 0}


def smi_peak_watcher(path: Path, gpu: str | None = None) -> subprocess.Popen | None:
    """nvidia-smi's memory.used (MiB) every 200 ms into `path` (None without nvidia-smi), of GPU `gpu`, else
    of the GPUs in CUDA_VISIBLE_DEVICES if set (runs side by side on one host each watch their own)."""
    gpu = gpu or os.environ.get("CUDA_VISIBLE_DEVICES")
    only = ["--id=" + gpu] if gpu else []
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                 "-lms", "200", *only], stdout=open(path, "w"), stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        path.write_text("")
        return None


def row(name: str, metrics: list[dict], smi_mib: list[int], wall: float, rc: int) -> dict:
    steps = [m for m in metrics if "time/step" in m]
    if not steps:
        return {"config": name, "ok": False, "rc": rc, "wall_s": round(wall, 1)}
    last = steps[-1]
    moe = {k.split("/", 1)[1]: round(last[k], 4) for k in ("moe/routing_mismatch", "moe/routing_mismatch_tokens")
           if k in last}
    return {"config": name, "ok": rc == 0, "rc": rc, "steps": len(steps), "wall_s": round(wall, 1),
            "step0_s": round(steps[0]["time/step"], 1), "step_s": round(last["time/step"], 2),
            "launch_to_step1_s": round(wall - sum(m["time/step"] for m in steps[1:]), 1),
            **{f"{p}_s": round(last[f"time/{p}"], 2) for p in PHASES if f"time/{p}" in last},
            "mem_peak_gib": round(max(m.get("mem/peak_gib", 0) for m in steps), 1),
            "rollout_peak_gib": round(max(m.get("mem/rollout_peak_gib", 0) for m in steps), 1),
            "trainer_peak_gib": round(max(m.get("mem/trainer_peak_gib", 0) for m in steps), 1),
            **{k: round(last[m], r) for k, m, r in (("response_mean", "response/length_mean", 1),
                                                     ("truncated", "response/truncated_frac", 3),
                                                     ("tokens_per_s", "perf/tokens_per_s", None),
                                                     ("micro_batches", "perf/micro_batches", None)) if m in last},
            "smi_peak_gib": round(max(smi_mib, default=0) / 1024, 1),
            # None where no step had a gradient to move (all advantages 0: a step of random weights may)
            "changed_frac": min((m["optim/changed_frac"] for m in steps if "optim/changed_frac" in m), default=None),
            "update_ratio_max": round(max(m.get("optim/update_ratio_max", 0) for m in steps), 3),
            "token_mult_prob_error": round(last["mismatch/token_mult_prob_error"], 4), **moe,
            "preemptions": sum(m.get("rollout/preemptions", 0) for m in steps),
            "policy_gain": [m["probe/policy_gain"] for m in steps if "probe/policy_gain" in m],
            "skipped_steps": sum(m.get("optim/skipped_steps", 0) for m in steps),
            # dynamo graphs compiled by the end of each step, summed over the ranks: a timed step that added
            # some spent part of its time compiling (and under FSDP2 the other ranks waited for it)
            **({"compiled_graphs": [m["compile/graphs"] for m in steps]} if "compile/graphs" in last else {})}


MODEL_PEAKS = re.compile(r"peak: trainer phase ([\d.]+), rollout phase ([\d.]+)"
                         r"(?: \(\+ ([\d.]+) in the first refit's step\))?")


def memory_model(log: Path) -> dict:
    """The start-up memory model's peaks in a run's log (memory.describe, GiB per rank), to set beside the
    measured ones: the trainer phase, and the rollout phase + the first refit (step 0's); {} where absent."""
    m = MODEL_PEAKS.search(log.read_text(errors="replace")) if log.is_file() else None
    return {} if m is None else {"model_trainer_peak_gib": float(m[1]),
                                 "model_step0_rollout_peak_gib": round(float(m[2]) + float(m[3] or 0), 1)}


def plan(configs: str, router_replay: list[str], async_share: float | None = None,
         warm: bool = False) -> list[tuple[str, str, list[str]]]:
    """(run name, config, its extra overrides) per run: the configs of --configs ("moe" / "8b" expand to
    their sets), each MoE config once per --router-replay value ("off": <config>_noreplay); with
    async_share (--async) each config again as <config>_async; with warm (--warm) each run again right after
    it as <name>_warm."""
    names = [n for c in configs.split(",") if c.strip() for n in CONFIG_SETS.get(c.strip(), [c.strip()])]
    runs = []
    for name in names:
        if async_share is not None:
            runs += [(name, name, []), (f"{name}_async", name, ["rollout.mode=async",
                                                               f"rollout.gpu_memory_utilization={async_share}"])]
        elif family(name) != "qwen3_moe":
            runs.append((name, name, []))
        else:
            runs += [(name if replay == "on" else f"{name}_noreplay", name,
                      [f"moe.router_replay={'true' if replay == 'on' else 'false'}"]) for replay in router_replay]
    return [r for run in runs for r in ([run, (f"{run[0]}_warm", *run[1:])] if warm else [run])]


def command(config: str, run_name: str, extra: list[str], short_run: list[str], steps: int, runs: Path,
            moe_layers: int, overrides: list[str], ranks: int = 1) -> list[str]:
    """train_grpo.py's command line for one run: the shipped config at its family's shape, SHORT_RUN; on
    `ranks` GPUs through torchrun (FSDP2) when more than one."""
    launch = [sys.executable] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launch, str(ROOT / "train_grpo.py"), "--config", str(ROOT / "configs" / f"{config}.yaml"),
            *full_shape(config, moe_layers), *short_run, f"train.steps={steps}", f"train.out_dir={runs}",
            f"train.run_name={run_name}", *extra, *overrides]


def gpu_slots(gpus: list[str | None], ranks: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES values of runs side by side, `ranks` GPUs each ([None]: no GPU ids known)."""
    if gpus == [None]:
        return [None]
    return [",".join(gpus[i:i + ranks]) for i in range(0, len(gpus) - ranks + 1, ranks)]


def parse_replay(text: str) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out or set(out) - {"on", "off"}:
        raise argparse.ArgumentTypeError(f"--router-replay {text!r}: a comma list of on, off")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of config names, or the sets 8b, moe")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="/tmp/flagship")
    p.add_argument("--runs", default="/tmp/flagship_runs")
    p.add_argument("--timeout", type=float, help="seconds per config (default 420; --shipped 560: its 8B runs take "
                   "~480-510 s on one H200 with engine start and step 0's compile)")
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds for all runs (0 = none; see above)")
    p.add_argument("--data", help="DIR with train.jsonl + test.jsonl in the config's fields (see above)")
    p.add_argument("--moe-layers", type=int, default=MOE_LAYERS, help="decoder layers of the Qwen3-30B-A3B shape")
    p.add_argument("--router-replay", type=parse_replay, default=["on"],
                   help="MoE configs: on, off or on,off (a run per value)")
    p.add_argument("--shipped", action="store_true", help="FP8 configs vs BF16 twins at their own workload (above)")
    p.add_argument("--prompts", type=int, default=12, help="--shipped: prompts per step")
    p.add_argument("--merge", nargs="+", default=[], metavar="FILE", help="--shipped: earlier flagship.json files")
    p.add_argument("--parallel", action="store_true",
                   help="runs side by side, each on its own --ranks of the visible GPUs (CUDA_VISIBLE_DEVICES, else all)")
    p.add_argument("--ranks", type=int, default=1, help="GPUs per run (torchrun, FSDP2), e.g. 2 on 80 GB cards")
    p.add_argument("--async", dest="async_", action="store_true",
                   help="--shipped on 2 GPUs: each config synchronous and as rollout.mode=async (above)")
    p.add_argument("--async-share", type=float, default=0.9, help="--async: the engine rank's vLLM share of its GPU")
    p.add_argument("--warm", action="store_true", help="each config cold, then again warm from the caches the "
                   "first run filled (FP8_GRPO_CACHE_DIR=RUNS/cache): time to step 1 both ways (above)")
    p.add_argument("overrides", nargs="*", help="more section.key=value overrides for every config")
    return p


def main():
    args = build_parser().parse_args()
    t_start = time.time()
    out, runs = Path(args.out), Path(args.runs)
    if args.shipped and args.configs == build_parser().get_default("configs"):
        args.configs = ",".join(dict.fromkeys(c for pair in SHIPPED_PAIRS.items() for c in pair))
    async_share = args.async_share if args.async_ else None
    todo = plan(args.configs, args.router_replay, async_share, args.warm)
    for _, config, _ in todo:
        if not (ROOT / "configs" / f"{config}.yaml").is_file():
            print(f"error: --configs: no configs/{config}.yaml; give shipped config names or 8b, moe", file=sys.stderr)
            sys.exit(2)
    if args.ranks < 1:
        print(f"error: --ranks {args.ranks}: GPUs per run, >= 1", file=sys.stderr)
        sys.exit(2)
    if args.async_ and (not args.shipped or args.ranks not in (1, 2)):
        print("error: --async compares a config's synchronous and async runs at its own workload on 2 GPUs: give "
              "--shipped (and --ranks 2 or none)", file=sys.stderr)
        sys.exit(2)
    if args.async_:
        args.ranks = 2
    cache = os.environ.get(CACHE_ENV)
    if args.warm and (args.parallel or args.async_ or cache):
        why = (f"{CACHE_ENV} is set ({cache}): the first run would not start cold; unset it" if cache
               else "a warm run follows its cold one: leave out --parallel and --async")
        print(f"error: --warm: {why}", file=sys.stderr)
        sys.exit(2)
    for f in args.merge:
        if not Path(f).is_file():
            hint = "; give overrides before --merge, which takes every word after it" if "=" in f else ""
            print(f"error: --merge {f}: no such file (a flagship.json of an earlier run){hint}", file=sys.stderr)
            sys.exit(2)
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads((out / "flagship.json").read_text()) if (out / "flagship.json").is_file() else []
    for f in args.merge:
        merged = json.loads(Path(f).read_text())
        results = [r for r in results if r["config"] not in {m["config"] for m in merged}] + merged
    gpu = gpu_name()
    short_run = SHORT_RUN if not args.data else \
        [o for o in SHORT_RUN if not o.startswith(("data.source", "data.instruction"))] + real_data(Path(args.data))
    slots = gpu_slots(visible_gpus(), args.ranks) if args.parallel else [None]
    if not slots:
        print(f"error: --parallel --ranks {args.ranks}: fewer GPUs visible ({len(visible_gpus())}); lower --ranks",
              file=sys.stderr)
        sys.exit(2)

    def run_one(name: str, config: str, extra: list[str]) -> dict:
        """One run on a free GPU slot (None: this process's GPUs); its row."""
        slot = slots.pop(0)
        try:
            timeout = run_timeout(name, args.timeout or (560 if args.shipped else 420), args.time_limit, t_start)
            if timeout is None:
                return {"config": name, "ok": False, "rc": "not started (--time-limit)"}
            run_short = shipped_run(config, args.prompts) if args.shipped else short_run
            cmd = command(config, name, extra, run_short, args.steps, runs, args.moe_layers, args.overrides,
                          args.ranks)
            smi = smi_peak_watcher(out / f"smi_{name}.txt", slot)
            env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": slot} if slot is not None else {}),
                   **({CACHE_ENV: str(runs / "cache")} if args.warm else {})}
            t0 = time.time()
            metrics, rc = run_logged(cmd, runs / name, out / f"{name}.log", timeout, env)
            if smi is not None:
                smi.terminate()
        finally:
            slots.append(slot)
        mib = [int(x) for x in (out / f"smi_{name}.txt").read_text().split() if x.isdigit()]
        result = {**row(name, metrics, mib, time.time() - t0, rc), **memory_model(out / f"{name}.log"), "gpu": gpu,
                  "gpus": args.ranks}
        if args.shipped:
            result.update(workload=workload(config, args.prompts, result), date=time.strftime("%Y-%m-%d"),
                          command=" ".join(["bash scripts/gpu_check.sh shipped --prompts", str(args.prompts),
                                            *(["--parallel"] if args.parallel else []),
                                            *(["--async --steps", str(args.steps)] if args.async_ else
                                              ["--ranks", str(args.ranks)] if args.ranks > 1 else []),
                                            "--configs", config if args.async_ else name, *args.overrides]))
        print(json.dumps(result), flush=True)
        return result

    if args.warm:
        shutil.rmtree(runs / "cache", ignore_errors=True)
    with ThreadPoolExecutor(max_workers=len(slots)) as pool:  # one run per GPU at a time
        futures = [pool.submit(run_one, *run) for run in todo]
        for future in as_completed(futures):
            result = future.result()
            results = [r for r in results if r["config"] != result["config"]] + [result]
            (out / "flagship.json").write_text(json.dumps(results, indent=1))
    (out / "flagship.json").write_text(json.dumps(results, indent=1))
    moe_cols = ["routing_mismatch", "routing_mismatch_tokens"] if any("routing_mismatch" in r for r in results) else []
    cols = ["config", "ok", "step_s", *[f"{p}_s" for p in PHASES], "mem_peak_gib", "smi_peak_gib", "trainer_peak_gib",
            "model_trainer_peak_gib", "changed_frac", "update_ratio_max", "token_mult_prob_error", "preemptions",
            *moe_cols, "policy_gain"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |" for r in results]
    if args.warm:
        by_name = {r["config"]: r for r in results}
        lines += ["", "| run | launch to step 1, cold s | warm s | step 0, cold s | warm s |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {cold.get('launch_to_step1_s', '-')} | {warm.get('launch_to_step1_s', '-')} | "
                  f"{cold.get('step0_s', '-')} | {warm.get('step0_s', '-')} |"
                  for name, _, _ in todo
                  if (cold := by_name.get(name)) is not None and (warm := by_name.get(f"{name}_warm")) is not None]
    if args.shipped:
        pairs = shipped_rows(results, {f"{c}_async": c for _, c, _ in plan(args.configs, [], async_share)}
                             if args.async_ else SHIPPED_PAIRS)
        name = "async" if args.async_ else "shipped"
        (out / f"{name}_{(pairs[0]['gpu'] if pairs else gpu or 'cpu').lower()}.json").write_text(json.dumps(pairs, indent=1))
        lines += ["", "| config | baseline | ratio | step s | baseline step s |", "|---|---|---|---|---|"]
        lines += [f"| {p['config']} | {p['baseline']} | {p['ratio']} | {p['step_s']} | {p['baseline_step_s']} |"
                  for p in pairs]
        lines += [f"\nWARNING: graphs compiled in the timed step ({', '.join(f'{k} {v}' for k, v in late.items())}):"
                  " its time includes compiling; run more steps (--steps)" for p in pairs
                  if (late := p.get("compiled_in_timed_step"))]
    (out / "flagship.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0 if all(r["ok"] and (r.get("changed_frac") or 0) >= 0.99 and min(r.get("policy_gain") or [1]) > 0
                      and r.get("update_ratio_max", 0) <= 2.0
                      for r in results) else 1)


if __name__ == "__main__":
    main()
