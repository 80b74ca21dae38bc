"""rollout.mode=async on two GPUs (skipped with fewer, or without vLLM): a trainer rank on GPU 0 and a
vLLM engine rank on GPU 1 (a one-rank engine), the FP8 weights over NCCL. configs/tiny_gpu.yaml's model
and recipe (FP8 trainer, vLLM with FP8 W8A8 linears + FP8 KV, recalibrated q/k/v scales), 4 steps.

* staleness 0: each step generated with the trainer's newest weights, and the engine/trainer mismatch
  as small as the colocated run's on one GPU: weights that went wrong on the way (a missing tensor, a
  dtype, a stale version) would leave the engine's logprobs far from the trainer's.
* staleness 1: each step after the first generated with the weights of the step before.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_vllm import NEEDS_VLLM_GPU, REPO

pytestmark = [*NEEDS_VLLM_GPU, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

RUN = ["--config", str(REPO / "configs/tiny_gpu.yaml"), "train.steps=4", "train.val_every=2", "train.ckpt_every=0",
       "train.dynamic_sampling=none", "log.tensorboard=false", "log.dump_episodes_every=0", "fp8.linear_backend=cutlass",
       "rollout.gpu_memory_utilization=0.08"]
MISMATCH = "mismatch/token_mult_prob_error"


def train(tmp_path, name, nproc, *overrides) -> list[dict]:
    """train_grpo.py on the first nproc visible GPUs (torchrun for 2); its metrics."""
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                                 if nproc > 1 else [])
    cmd = [*launch, str(REPO / "train_grpo.py"), *RUN, f"train.out_dir={tmp_path}", f"train.run_name={name}", *overrides]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(visible.split(",")[:nproc])}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, (p.stdout + p.stderr)[-8000:]
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith("engine ")))  # serve's per-step lines
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def by_step(metrics, key):
    return [m[key] for m in metrics if key in m]


def test_async_on_two_gpus(tmp_path):
    colocated = train(tmp_path, "colocated", 1)
    fresh = train(tmp_path, "async0", 2, "rollout.mode=async", "rollout.max_staleness=0")
    lagged = train(tmp_path, "async1", 2, "rollout.mode=async")
    print(f"[async-gpu] {MISMATCH} per step: colocated {by_step(colocated, MISMATCH)}, async staleness 0 "
          f"{by_step(fresh, MISMATCH)}, staleness 1 {by_step(lagged, MISMATCH)}")
    print(f"[async-gpu] time/step: colocated {by_step(colocated, 'time/step')}, staleness 0 "
          f"{by_step(fresh, 'time/step')}, staleness 1 {by_step(lagged, 'time/step')}")
    assert by_step(fresh, "rollout/policy_version") == [0, 1, 2, 3]
    assert by_step(lagged, "rollout/policy_version") == [0, 0, 1, 2]
    assert by_step(lagged, "rollout/staleness") == [0, 1, 1, 1]
    ref = max(by_step(colocated, MISMATCH))
    assert max(by_step(fresh, MISMATCH)) < ref + 0.01, (by_step(fresh, MISMATCH), ref)
    assert "val/accuracy" in lagged[-1]  # the final validation ran on the last weights
