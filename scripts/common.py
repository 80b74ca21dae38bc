"""What the scripts share: a run's metrics, the GPU's name, train_grpo.py runs launched, timed and
stopped, their results files, the small GSM8K-format data and real model they run on, and the shipped
configs' short runs at full shape.

The scripts run as modules from the repo root (`python -m scripts.learn_gate ...`), import the library
by name, and import no script but this one (tests/unit/test_scripts_imports.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench.runner import device_name, fail  # noqa: F401 (the scripts' too: bad input, the GPU's name)

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str, t0: float) -> None:
    print(f"[gate +{time.time() - t0:.0f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- a run's metrics

def load_rows(path: Path) -> list[dict]:
    """A metrics.jsonl's rows (those with a step)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            pass
    return [r for r in rows if isinstance(r, dict) and "step" in r]


def tail_mean(rows: list[dict], key: str, n: int = 5) -> float | None:
    """Mean of a metric over the last n rows that log it (None if none do): how a run ends."""
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))][-n:]
    return sum(vals) / len(vals) if vals else None


# ----------------------------------------------------------------------------- the GPU

def gpu_name() -> str:
    """'H200' / 'H100' (the first GPU's name without 'NVIDIA' and the memory suffix), '' without one."""
    first = device_name().splitlines()[0]
    words = first.replace("NVIDIA", "").split() if first != "cpu" else []
    return words[0] if words else ""


# ----------------------------------------------------------------------------- one run at a time

MIN_RUN_S = 120  # --time-limit: no run starts with less left


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each run's process group (each run leads its own), SIGKILL what is left after 10 s."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        os.killpg(p.pid, signal.SIGTERM)
    end = time.time() + 10
    while time.time() < end and any(p.poll() is None for p in live):
        time.sleep(0.5)
    for p in live:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def run_logged(cmd: list[str], run_dir: Path, log: Path, timeout: float, env: dict | None = None
               ) -> tuple[list[dict], int]:
    """One train_grpo.py run: its run dir emptied first, stdout + stderr to `log`, its process group
    (the trainer and its engine's processes) stopped after `timeout` s (rc 124). -> (the metrics.jsonl
    rows it logged, rc)."""
    subprocess.run(["rm", "-rf", str(run_dir)])
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop([p])
            rc = 124
    return (load_rows(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []), rc


def run_timeout(name: str, timeout: float, time_limit: float, t_start: float) -> float | None:
    """A run's timeout under --time-limit S counted from t_start (0: none): at most what is left, or None
    (said on stdout) when less than MIN_RUN_S is left and the run should not start."""
    if not time_limit:
        return timeout
    timeout = min(timeout, t_start + time_limit - time.time())
    if timeout < MIN_RUN_S:
        print(f"{name}: not started, {timeout:.0f} s left of --time-limit {time_limit:.0f}", flush=True)
        return None
    return timeout


# ----------------------------------------------------------------------------- many runs on one GPU

# vLLM's start-up assertion when another process frees GPU memory while it profiles (a run finishing)
PROFILING_RACE = "Error in memory profiling"


def _engine_up(log: Path, metrics: Path) -> str | None:
    if metrics.is_file() and metrics.stat().st_size > 0:
        return "first step logged"
    if log.is_file() and "init engine" in log.read_text(errors="replace"):
        return "vLLM engine up"
    return None


def launch_all(args, work: Path, t0: float) -> dict[tuple[str, int], dict]:
    """The learning gate's launcher (scripts/learn_gate.py says how and why): start every (mode, seed) run,
    staggered and at most --max-concurrent at once; wait for them or the deadline. -> {(mode, seed): {"dir",
    "log", "cmd", "rc"}}. A mode whose overrides set rollout.mode=async runs a trainer rank and an engine
    rank under torchrun, on args.async_gpus. Optional: args.runs, the (mode, seed) runs to start, in order
    (default: every seed x mode); args.env, variables added to each run's environment (scripts/real_learn.py
    --gpus: one call per GPU, CUDA_VISIBLE_DEVICES)."""
    todo = list(getattr(args, "runs", None) or
                [(mode, seed) for seed in args.seeds for mode in args.modes])  # alternate modes: same contention
    runs, live = {}, []
    deadline = t0 + args.deadline_s
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(args.threads)), **getattr(args, "env", {})}
    retried = set()
    while todo:
        mode, seed = todo.pop(0)
        while len([p for p in live if p.poll() is None]) >= args.max_concurrent and time.time() < deadline:
            time.sleep(1)
        if time.time() > deadline - 30:
            log(f"no time left to start {mode} seed {seed}", t0)
            continue
        name = f"{mode}_s{seed}"
        two_ranks = "rollout.mode=async" in args.mode_overrides[mode]
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if two_ranks else []
        cmd = [sys.executable, *launch, str(ROOT / "train_grpo.py"), "--config", str(args.config), f"train.seed={seed}",
               f"train.out_dir={work}", f"train.run_name={name}", "log.tensorboard=false", "train.save_final=false",
               *args.run_overrides, *args.mode_overrides[mode], *args.extra]
        run_log = work / f"{name}.log"
        with open(run_log, "w") as f:
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**env, **({"CUDA_VISIBLE_DEVICES": args.async_gpus} if two_ranks and
                                                not args.cpu else {})})
        live.append(p)
        runs[(mode, seed)] = {"dir": work / name, "log": run_log, "cmd": " ".join(cmd[1:]), "proc": p}
        log(f"started {name} (pid {p.pid})", t0)
        if args.stagger:
            start, why = time.time(), None
            while why is None:
                why = _engine_up(run_log, work / name / "metrics.jsonl")
                if why is None and p.poll() is not None:
                    why = f"exited (rc {p.returncode})"
                elif why is None and time.time() - start > args.stagger_timeout_s:
                    why = "stagger timeout"
                elif why is None and time.time() > deadline:
                    why = "deadline"
                time.sleep(0.5 if why is None else 0)
            log(f"{name}: {why} after {time.time() - start:.0f}s", t0)
            if p.returncode and (mode, seed) not in retried and PROFILING_RACE in run_log.read_text(errors="replace"):
                retried.add((mode, seed))  # a neighbour freed memory during this engine's start-up: once more
                live.remove(p)
                todo.append((mode, seed))
                log(f"{name}: vLLM's start-up memory check saw a neighbour's memory change; retrying", t0)
    while any(p.poll() is None for p in live) and time.time() < deadline:
        time.sleep(1)
    late = [p for p in live if p.poll() is None]
    if late:
        log(f"deadline: stopping {len(late)} run(s)", t0)
        stop(late)
    for (mode, seed), r in runs.items():
        r["rc"] = r.pop("proc").returncode
        log(f"{mode}_s{seed}: rc {r['rc']}", t0)
    return runs


def copy_runs(work: Path, out: Path, keys) -> list[Path]:
    """Each (mode, seed) run's WORK/<mode>_s<seed>/metrics.jsonl and WORK/<mode>_s<seed>.log into OUT as
    <mode>_s<seed>_metrics.jsonl and <mode>_s<seed>.log; the destination paths (present or not)."""
    copies = []
    out.mkdir(parents=True, exist_ok=True)
    for m, s in keys:
        for src, dst in ((work / f"{m}_s{s}" / "metrics.jsonl", out / f"{m}_s{s}_metrics.jsonl"),
                         (work / f"{m}_s{s}.log", out / f"{m}_s{s}.log")):
            if src.is_file() and src.resolve() != dst.resolve():
                dst.write_bytes(src.read_bytes())
            copies.append(dst)
    return copies


def write_results(out: Path, payload: dict, md: str, files: list[Path], name: str = "learn_gate",
                  archive: str = "learn_runs.tgz") -> None:
    """OUT/<name>.json, OUT/<name>.md, and OUT/<archive> holding both and those of `files` that exist."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / f"{name}.md").write_text(md.rstrip("\n") + "\n")
    with tarfile.open(out / archive, "w:gz") as tar:  # one file: the device returns few per call
        for f in [out / f"{name}.json", out / f"{name}.md", *files]:
            if f.is_file():
                tar.add(f, arcname=f.name)


# ----------------------------------------------------------------------------- data and a real model

def real_data(d: Path) -> list[str]:
    """Overrides that swap synthetic prompts for local real-format files, DIR/train.jsonl and DIR/test.jsonl
    (the config's instruction stays)."""
    for f in ("train.jsonl", "test.jsonl"):
        if not (d / f).is_file():
            print(f"error: --data {d}: no {f} there (the dataset's rows as JSON lines); pass a directory "
                  "holding train.jsonl and test.jsonl", file=sys.stderr)
            sys.exit(2)
    return ["data.source=jsonl", f"data.path={d / 'train.jsonl'}", f"data.val_split={d / 'test.jsonl'}",
            "data.max_prompt_tokens=512", "train.val_max_prompts=8",
            "model.tiny.vocab=" + "".join(map(chr, range(32, 127))) + "\n"]


def synthetic_gsm8k(d: Path) -> Path:
    """DIR with train.jsonl (60 rows) and test.jsonl (8) in GSM8K's fields: one-step word problems."""
    d.mkdir(parents=True, exist_ok=True)
    forms = [("Tom has {a} apples and buys {b} more. How many apples does he have now?", "+"),
             ("A shelf holds {a} books. Sara puts {b} more books on it. How many books are on the shelf?", "+"),
             ("Ben had {a} dollars and spent {b} dollars on lunch. How many dollars does he have left?", "-"),
             ("Each box holds {b} pens. How many pens are in {a} boxes?", "*")]
    rows = []
    for i in range(68):
        q, op = forms[i % len(forms)]
        a, b = 12 + (7 * i) % 40, 2 + (5 * i) % 11
        x = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"question": q.format(a=a, b=b), "answer": f"{a} {op} {b} = <<{a}{op}{b}={x}>>{x}\n#### {x}"})
    for name, part in (("train.jsonl", rows[8:]), ("test.jsonl", rows[:8])):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return d


def model_dir(model: str | None) -> str:
    """--model: a HF model dir (checked), 'tiny', or None = scripts/real_model.py's dir (made if it can be)."""
    if model is None:
        p = subprocess.run([sys.executable, "-m", "scripts.real_model"], cwd=ROOT, capture_output=True, text=True)
        if p.returncode:
            fail("--model: scripts/real_model.py could not make SmolLM2 here ("
                 + (p.stderr.strip().splitlines() or ["no output"])[-1] + "); convert it with "
                 "`python -m scripts.real_model --gguf part1 part2 ...` and pass --model DIR")
        return p.stdout.strip().splitlines()[-1]
    if model != "tiny" and not (Path(model) / "config.json").is_file():
        fail(f"--model {model}: not a HF model dir (no config.json); make one with "
             "`python -m scripts.real_model` (it prints the dir) or pass 'tiny'")
    return model


# ----------------------------------------------------------------------------- the shipped configs at full shape

SHAPES = {  # the real models' dims (config.json of the hub checkpoints)
    "llama": "{arch: llama, hidden_size: 4096, intermediate_size: 14336, num_layers: 32, num_heads: 32, "
             "num_kv_heads: 8, head_dim: 128, vocab_size: 128256, max_position_embeddings: 8192}",
    "qwen3": "{arch: qwen3, hidden_size: 4096, intermediate_size: 12288, num_layers: 36, num_heads: 32, "
             "num_kv_heads: 8, head_dim: 128, vocab_size: 151936, max_position_embeddings: 8192}",
}
# a shipped config's short run (scripts/flagship_check.py): synthetic prompts, 8 prompts x 8 samples x 1024
# generated tokens, 2 optimizer steps of 32 samples per step, the probe on
SHORT_RUN = ["model.name_or_path=tiny", "data.source=synthetic", "data.template=plain", "data.instruction=",
             "data.max_prompt_tokens=128", "rollout.prompts_per_step=8", "rollout.n=8",
             "rollout.max_new_tokens=1024", "rollout.ignore_eos=true", "train.mini_batch_size=32",
             "train.val_every=0", "train.ckpt_every=0", "train.save_final=false", "train.probe=true",
             "log.tensorboard=false", "log.dump_episodes_every=0"]


def family(config: str) -> str:
    """The model family of a shipped config name: llama, qwen3 or qwen3_moe."""
    return "qwen3_moe" if config.startswith("qwen3_30b_a3b") else "qwen3" if config.startswith("qwen3") else "llama"


def full_shape(config: str, moe_layers: int | None = None) -> list[str]:
    """model.tiny overrides that build a shipped config's model from scratch (random init) at its real model's
    shape; the Qwen3-30B-A3B configs' 48 layers cut to moe_layers (default bench/rollout.py's MOE_LAYERS)."""
    if family(config) != "qwen3_moe":
        return [f"model.tiny={SHAPES[family(config)]}"]
    from bench.rollout import tiny_flow  # (imports torch: only where a MoE config runs)

    return [f"model.tiny={tiny_flow('qwen3-30b-a3b', moe_layers)}"]
