"""The tiny Llama both vLLM GPU tests run (test_vllm_engine.py, test_export_gpu.py): hidden 1024,
2 layers, 8 heads x 128 (every decoder linear block-FP8 eligible), eager vLLM at 0.3 of the GPU.
Each test adds its rollout.sleep_mode. bf16 weights (the engine's dtype) and no optimizer step: the lr is
only set to pass config's check that bf16 updates survive.

run_mode: how every GPU test file runs its checks (vLLM allows one engine per process)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# a test module's `pytestmark`: its tests skip cleanly without a CUDA GPU or vLLM
NEEDS_VLLM_GPU = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
                  pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

TINY = ["rollout.engine=vllm", "model.dtype=bfloat16", "optim.lr=1e-4", "data.max_prompt_tokens=16", "rollout.max_new_tokens=24",
        "rollout.gpu_memory_utilization=0.3", "rollout.enforce_eager=true",
        "fp8.linear_backend=cutlass", "model.tiny.hidden_size=1024", "model.tiny.intermediate_size=2816",
        "model.tiny.num_layers=2", "model.tiny.num_heads=8", "model.tiny.num_kv_heads=8", "model.tiny.head_dim=128"]
PROMPTS = ["1+1=", "23+4=", "7*8=", "(9-3)=", "hello", "x", "42?", "a b c"]
MAX_NEW = 24


def run_mode(test_file: str, mode: str, tag: str) -> None:
    """`python test_file mode` from the repo root in its own process; prints its `[tag]` lines and
    fails with the tail of its output unless it exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, test_file, mode], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=1200)
    print("\n".join(line for line in r.stdout.splitlines() if line.startswith(f"[{tag}]")))
    assert r.returncode == 0, f"mode {mode} failed:\n{(r.stdout + r.stderr)[-12000:]}"
