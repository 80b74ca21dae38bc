"""A shipped 8B config at full shape saves a checkpoint on N GPUs and resumes on M, as a user kills and resumes a run.

    python -m scripts.resume_check --save-ranks 2 --resume-ranks 1 --out /tmp/resume   # 2 -> 1
    python -m scripts.resume_check --save-ranks 1 --resume-ranks 1                     # 1 -> 1
    CUDA_VISIBLE_DEVICES=2,3 python -m scripts.resume_check ...                         # on chosen GPUs

The run is scripts/flagship_check.py's short run of --config (random-init weights at the real
shape, synthetic prompts, 8 prompts x 8 samples x 1024 tokens, probe off) for --steps steps, with a
checkpoint after the last (train.ckpt_every=--steps); then `train_grpo.py --resume` continues it for
one more step on --resume-ranks ranks (the first of the visible GPUs). Each phase runs through
`torch.distributed.run` (one process per rank). nvidia-smi's memory.used is sampled every 200 ms on
the phase's GPUs. Writes OUT/resume_<N>to<M>.json: per phase its exit code, wall time, the step
times and mem/peak_gib the trainer logged, nvidia-smi's peak per GPU, and the checkpoint's save or
load seconds (the trainer's "saved in" / "loaded in" lines); logs in OUT/resume_<N>to<M>_{save,resume}.log.
Exit 0 when both phases finished and the resumed run logged the step after the checkpoint.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.runner import visible_gpus
from scripts.common import ROOT, SHORT_RUN, full_shape, gpu_name, load_rows


def phase(label: str, args: list[str], gpus: list[str], out: Path, run_dir: Path, first_step: int = 0) -> dict:
    """Run train_grpo.py `args` on `gpus` (one rank each); its figures (of the steps from `first_step` on)."""
    smi_file = out / f"{label}_smi.txt"
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits", "-lms",
                            "200", "--id=" + ",".join(gpus)], stdout=open(smi_file, "w"), stderr=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={len(gpus)}",
           str(ROOT / "train_grpo.py"), *args]
    t0 = time.time()
    with open(out / f"{label}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ,
                            "CUDA_VISIBLE_DEVICES": ",".join(gpus)}).returncode
    wall = time.time() - t0
    smi.terminate()
    peaks: dict[str, int] = {}
    for line in smi_file.read_text().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            peaks[parts[0]] = max(peaks.get(parts[0], 0), int(parts[1]))
    text = (out / f"{label}.log").read_text(errors="replace")
    steps = load_rows(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    steps = [m for m in steps if "time/step" in m and m.get("step", 0) >= first_step]
    seconds = re.findall(r"(?:saved|loaded) in ([0-9.]+) s", text)
    return {"rc": rc, "ranks": len(gpus), "wall_s": round(wall, 1),
            "steps": [m.get("step") for m in steps], "step_s": [round(m["time/step"], 1) for m in steps],
            "mem_peak_gib": [round(m.get("mem/peak_gib", 0), 1) for m in steps],
            "smi_peak_gib": {g: round(v / 1024, 1) for g, v in sorted(peaks.items())},
            "ckpt_s": [float(s) for s in seconds], "error": [x for x in text.splitlines() if x.startswith("error:")]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="llama31_8b_fp8")
    p.add_argument("--save-ranks", type=int, default=2)
    p.add_argument("--resume-ranks", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="steps before the checkpoint")
    p.add_argument("--out", default="/tmp/resume_check")
    p.add_argument("--runs", default="/tmp/resume_runs")
    p.add_argument("overrides", nargs="*", help="more section.key=value overrides for both phases")
    args = p.parse_args()
    gpus = [g for g in visible_gpus() if g is not None]  # (bench.runner's: CUDA_VISIBLE_DEVICES, else all)
    if max(args.save_ranks, args.resume_ranks) > len(gpus):
        print(f"error: --save-ranks/--resume-ranks: {max(args.save_ranks, args.resume_ranks)} ranks, {len(gpus)} GPUs "
              "visible; lower them or set CUDA_VISIBLE_DEVICES", file=sys.stderr)
        sys.exit(2)
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"resume_{args.save_ranks}to{args.resume_ranks}"
    name = f"{args.config}_{tag}"
    subprocess.run(["rm", "-rf", str(runs / name)])
    short = [o for o in SHORT_RUN if not o.startswith("train.probe")] + ["train.probe=false"]
    first = ["--config", str(ROOT / "configs" / f"{args.config}.yaml"), *full_shape(args.config), *short,
             f"train.steps={args.steps}", f"train.out_dir={runs}", f"train.run_name={name}",
             f"train.ckpt_every={args.steps}", *args.overrides]
    result = {"config": args.config, "gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python -m scripts.resume_check", "--config", args.config, "--save-ranks",
                                   str(args.save_ranks), "--resume-ranks", str(args.resume_ranks), *args.overrides])}
    result["save"] = phase(f"{tag}_save", first, gpus[:args.save_ranks], out, runs / name)
    print(json.dumps(result["save"]), flush=True)
    (out / f"{tag}.json").write_text(json.dumps({**result, "ok": False}, indent=1))  # kept if the resume is cut off
    if result["save"]["rc"] == 0:
        result["resume"] = phase(f"{tag}_resume", ["--resume", str(runs / name), f"train.steps={args.steps + 1}",
                                                   *args.overrides], gpus[:args.resume_ranks], out, runs / name,
                                 args.steps)
        print(json.dumps(result["resume"]), flush=True)
    ok = result.get("resume", {}).get("rc") == 0 and args.steps in result["resume"]["steps"]
    result["ok"] = ok
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
