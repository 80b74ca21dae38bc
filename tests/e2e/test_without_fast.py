"""fp8/fast/ is speed only: a copy of the repo without it trains with its switches off.

The copy holds the tracked .py and .yaml files minus fp8/fast/ and tests/; train_grpo.py runs there
in a child process (nothing of this checkout on its path) for two tiny_cpu steps with the FP8 recipe
on both sides. The same copy with fp8.fuse_projections on fails on the missing package, which shows
the copy really lacks it.
"""

import os
import shutil
import subprocess
import sys

from conftest import ROOT, read_metrics

FAST_OFF = ["fp8.fuse_projections=false", "fp8.fuse_swiglu=false", "fp8.cache_weights=false"]
SHORT = ["train.steps=2", "train.val_every=0", "train.ckpt_every=0", "train.save_final=false",
         "log.tensorboard=false", "log.dump_episodes_every=0", "rollout.prompts_per_step=4",
         "train.micro_batch_size=32"]


def test_recipe_trains_without_fp8_fast(tmp_path):
    files = subprocess.run(["git", "ls-files", "*.py", "*.yaml"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    repo = tmp_path / "repo"
    for f in files:
        if not f.startswith(("tests/", "fp8/fast/")) and (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / f, repo / f)
    assert (repo / "fp8/linear.py").is_file() and not (repo / "fp8/fast").exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def train(*overrides):
        return subprocess.run([sys.executable, "train_grpo.py", "--config", "configs/tiny_cpu.yaml", *SHORT,
                               f"train.out_dir={tmp_path / 'runs'}", *overrides],
                              cwd=repo, env=env, capture_output=True, text=True, timeout=600)

    run = train(*FAST_OFF, "train.run_name=plain")
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = read_metrics(tmp_path / "runs" / "plain")
    assert [m["step"] for m in metrics] == [0, 1] and all("mismatch/token_mult_prob_error" in m for m in metrics)
    assert "fp8: trainer linears in block FP8: 14" in run.stdout and "fp8.fast" not in run.stdout

    fused = train("fp8.fuse_projections=true", "train.run_name=fused")
    assert fused.returncode != 0 and "cannot import name 'fast' from 'fp8'" in fused.stderr
