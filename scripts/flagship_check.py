"""The shipped 8B configs at full 8B shape on one GPU, as a user runs them, a few short steps each.

    python scripts/flagship_check.py --out /tmp/out                       # all five 8B configs
    python scripts/flagship_check.py --configs llama31_8b_fp8 --steps 3   # one of them
    python scripts/flagship_check.py --configs gsm8k --data /tmp/gsm8k    # a data config on local JSONL

Each config runs the real trainer (train_grpo.py) in its own process with only what a machine without
hub access needs swapped: random-init weights at the exact Llama-3.1-8B / Qwen3-8B shapes (all layers,
the real vocab), synthetic prompts, 8 prompts x 8 samples x 1024 generated tokens (ignore_eos), 2
optimizer steps of 32 samples per rollout step. Everything else is the shipped config: fp32 master
weights and the optimizer, gradient checkpointing, fp8.*, the loss, vLLM's memory share and sleep mode.
train.probe gives the rewards variance and logs probe/policy_gain. Prints one row per config: step
time by phase (last step; step 0 also autotunes and captures), mem/peak_gib next to nvidia-smi's peak
memory.used over the run, the share of weights the last optimizer step changed, the mismatch and the
probe. Writes OUT/flagship.json, OUT/flagship.md and each run's log.

--data DIR runs the data configs (gsm8k, math) on real-format files instead of synthetic prompts:
DIR/train.jsonl and DIR/test.jsonl in the dataset's own fields, through the config's loader, answer
extraction and reward, with a character tokenizer over printable ASCII (the random-init model has no
hub tokenizer, so no chat template: data.template=plain).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["llama31_8b_bf16", "llama31_8b_fp8", "qwen3_8b_bf16", "qwen3_8b_fp8", "qwen3_8b_fp8_kv"]
SHAPES = {  # the real models' dims (config.json of the hub checkpoints)
    "llama": "{arch: llama, hidden_size: 4096, intermediate_size: 14336, num_layers: 32, num_heads: 32, "
             "num_kv_heads: 8, head_dim: 128, vocab_size: 128256, max_position_embeddings: 8192}",
    "qwen3": "{arch: qwen3, hidden_size: 4096, intermediate_size: 12288, num_layers: 36, num_heads: 32, "
             "num_kv_heads: 8, head_dim: 128, vocab_size: 151936, max_position_embeddings: 8192}",
}
SHORT_RUN = ["model.name_or_path=tiny", "data.source=synthetic", "data.template=plain", "data.instruction=",
             "data.max_prompt_tokens=128", "rollout.prompts_per_step=8", "rollout.n=8",
             "rollout.max_new_tokens=1024", "rollout.ignore_eos=true", "train.mini_batch_size=32",
             "train.val_every=0", "train.ckpt_every=0", "train.save_final=false", "train.probe=true",
             "log.tensorboard=false", "log.dump_episodes_every=0"]
PHASES = ("rollout", "logprobs", "train", "recalibrate", "refit")


def smi_peak_watcher(path: Path) -> subprocess.Popen | None:
    """nvidia-smi's memory.used (MiB) every 200 ms into `path` (None without nvidia-smi)."""
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                 "-lms", "200"], stdout=open(path, "w"), stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        path.write_text("")
        return None


def real_data(d: Path) -> list[str]:
    """Overrides that swap SHORT_RUN's synthetic prompts for local real-format files (the config's
    instruction stays)."""
    for f in ("train.jsonl", "test.jsonl"):
        if not (d / f).is_file():
            print(f"error: --data {d}: no {f} there (the dataset's rows as JSON lines); pass a directory "
                  "holding train.jsonl and test.jsonl", file=sys.stderr)
            sys.exit(2)
    return ["data.source=jsonl", f"data.path={d / 'train.jsonl'}", f"data.val_split={d / 'test.jsonl'}",
            "data.max_prompt_tokens=512", "train.val_max_prompts=8",
            "model.tiny.vocab=" + "".join(map(chr, range(32, 127))) + "\n"]


def row(name: str, metrics: list[dict], smi_mib: list[int], wall: float, rc: int) -> dict:
    steps = [m for m in metrics if "time/step" in m]
    if not steps:
        return {"config": name, "ok": False, "rc": rc, "wall_s": round(wall, 1)}
    last = steps[-1]
    return {"config": name, "ok": rc == 0, "rc": rc, "steps": len(steps), "wall_s": round(wall, 1),
            "step0_s": round(steps[0]["time/step"], 1), "step_s": round(last["time/step"], 1),
            **{f"{p}_s": round(last[f"time/{p}"], 2) for p in PHASES if f"time/{p}" in last},
            "mem_peak_gib": round(max(m.get("mem/peak_gib", 0) for m in steps), 1),
            "smi_peak_gib": round(max(smi_mib, default=0) / 1024, 1),
            "changed_frac": min(m["optim/changed_frac"] for m in steps),
            "token_mult_prob_error": round(last["mismatch/token_mult_prob_error"], 4),
            "policy_gain": [m["probe/policy_gain"] for m in steps],
            "skipped_steps": sum(m.get("optim/skipped_steps", 0) for m in steps)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="/tmp/flagship")
    p.add_argument("--runs", default="/tmp/flagship_runs")
    p.add_argument("--timeout", type=float, default=420, help="seconds per config")
    p.add_argument("--data", help="DIR with train.jsonl + test.jsonl in the config's fields (see above)")
    p.add_argument("overrides", nargs="*", help="more section.key=value overrides for every config")
    args = p.parse_args()
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads((out / "flagship.json").read_text()) if (out / "flagship.json").is_file() else []
    short_run = SHORT_RUN if not args.data else \
        [o for o in SHORT_RUN if not o.startswith(("data.source", "data.instruction"))] + real_data(Path(args.data))
    for name in args.configs.split(","):
        cfg_path = ROOT / "configs" / f"{name}.yaml"
        family = "qwen3" if name.startswith("qwen3") else "llama"
        cmd = [sys.executable, str(ROOT / "train_grpo.py"), "--config", str(cfg_path), f"model.tiny={SHAPES[family]}",
               *short_run, f"train.steps={args.steps}", f"train.out_dir={runs}", f"train.run_name={name}",
               *args.overrides]
        subprocess.run(["rm", "-rf", str(runs / name)])
        smi = smi_peak_watcher(out / f"smi_{name}.txt")
        t0 = time.time()
        with open(out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        if smi is not None:
            smi.terminate()
        metrics_file = runs / name / "metrics.jsonl"
        metrics = [json.loads(x) for x in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
        mib = [int(x) for x in (out / f"smi_{name}.txt").read_text().split() if x.isdigit()]
        results = [r for r in results if r["config"] != name] + [row(name, metrics, mib, time.time() - t0, rc)]
        print(json.dumps(results[-1]), flush=True)
        (out / "flagship.json").write_text(json.dumps(results, indent=1))
    cols = ["config", "ok", "step_s", *[f"{p}_s" for p in PHASES], "mem_peak_gib", "smi_peak_gib", "changed_frac",
            "token_mult_prob_error", "policy_gain"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |" for r in results]
    (out / "flagship.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0 if all(r["ok"] and r.get("changed_frac", 0) >= 0.99 and min(r.get("policy_gain", [0])) > 0
                      for r in results) else 1)


if __name__ == "__main__":
    main()
