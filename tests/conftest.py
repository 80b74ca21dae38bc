"""Shared fixtures: one short tiny_cpu run that resume and export tests compare against."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tiny_cpu with the whole recipe (FP8 trainer + W8A8 engine + FP8 KV with recalibrated scales) on a
# small batch: ~0.2 s per step after ~8 s of start-up on 2 cores. Validation every 3 steps,
# a checkpoint every 2 (keep 2).
TINY_RUN = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "log.tensorboard=false", "log.dump_episodes_every=0",
            "train.val_every=3", "train.ckpt_every=2", "rollout.prompts_per_step=4", "train.micro_batch_size=32",
            "fp8.kv_cache=true"]
TINY_STEPS = 8


def train_cmd(*args) -> list[str]:
    return [sys.executable, str(ROOT / "train_grpo.py"), *args]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """Run dir of an uninterrupted TINY_STEPS-step run (checkpoints at steps 6 and 8)."""
    out = tmp_path_factory.mktemp("tiny_run")
    p = subprocess.run(train_cmd(*TINY_RUN, f"train.out_dir={out}", "train.run_name=ref", f"train.steps={TINY_STEPS}"),
                       cwd=out, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return out / "ref"
