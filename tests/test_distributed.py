"""Multi-process data parallel on CPU (gloo + FSDP2): 2 ranks reproduce the 1-rank run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import UserError, load_config

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "log.tensorboard=false", "train.val_every=2",
          "train.steps=3", "rollout.prompts_per_step=8", "train.micro_batch_size=16", "train.device=cpu"]


def launch(tmp_path, name, nproc, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "train_grpo.py"), *COMMON, f"train.out_dir={tmp_path}", f"train.run_name={name}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def by_step(metrics, key):
    return [m[key] for m in metrics if key in m]


def test_two_ranks_reproduce_one_rank(tmp_path):
    """Same global batch split over 2 FSDP2 ranks: same rollouts (per-sample seeds), same rewards,
    and the same gradients (norm to fp32 rounding) step after step; checkpoints hold full tensors."""
    extra = ["fp8.train=false", "fp8.rollout=false"]
    one, two = launch(tmp_path, "one", 1, extra), launch(tmp_path, "two", 2, extra)
    for key in ("reward/mean", "response/length_mean", "val/accuracy"):
        assert by_step(one, key) == by_step(two, key), key
    torch.testing.assert_close(by_step(two, "optim/grad_norm"), by_step(one, "optim/grad_norm"), rtol=1e-5, atol=0)
    torch.testing.assert_close(by_step(two, "mismatch/kl"), by_step(one, "mismatch/kl"), rtol=0, atol=1e-6)
    a = torch.load(tmp_path / "one/checkpoints/step_000003/state.pt", weights_only=False)
    b = torch.load(tmp_path / "two/checkpoints/step_000003/state.pt", weights_only=False)
    assert a["model"].keys() == b["model"].keys() and b["world"] == 2
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-4, atol=1e-6)


def test_two_ranks_with_fp8_emulation_stay_close(tmp_path):
    """FP8 on: the 1x128 gradient tiles of the weight-gradient GEMM run along tokens, so they group
    different tokens when the batch is split: same rollouts, gradients equal only to FP8 precision."""
    one, two = launch(tmp_path, "one", 1), launch(tmp_path, "two", 2)
    assert by_step(one, "reward/mean")[0] == by_step(two, "reward/mean")[0]
    torch.testing.assert_close(by_step(two, "optim/grad_norm")[0], by_step(one, "optim/grad_norm")[0],
                               rtol=0.02, atol=0)


def test_prompts_must_split_into_whole_groups(monkeypatch):
    import distributed

    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config(None, ["rollout.prompts_per_step=8", "train.device=cpu"])
    with pytest.raises(UserError, match="prompts_per_step=8 is not divisible by the 3 ranks"):
        distributed.init(cfg)
    cfg = load_config(None, ["rollout.prompts_per_step=9", "train.mini_batch_size=8", "train.micro_batch_size=4", "train.device=cpu"])
    with pytest.raises(UserError, match="mini_batch_size=8 is not divisible by the 3 ranks"):
        distributed.init(cfg)
