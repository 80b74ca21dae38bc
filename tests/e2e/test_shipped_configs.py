"""Every YAML in configs/ trains on CPU with its own trainer settings.

Each config keeps what decides whether and how the trainer learns: model.dtype, the optimizer and its
lr, gradient checkpointing, every fp8.* switch (FP8 is emulated on CPU), train.compile, the loss. Swapped
for a CPU run: the model (a tiny one of the config's family, built from scratch), the data (synthetic),
the engine (HFEngine; rollout.mode=async configs run as they must, on 2 ranks) and the batch size (2 prompts x 8 samples, 2 optimizer steps of 2 micro-batches), 2 steps.
train.probe replaces the reward with one that has variance, so the advantages are non-zero, and checks
that the step moves >= 99% of the weights that got a gradient (bf16 weights under a round-to-nearest
optimizer at lr 3e-7 move ~0.5%) and moves the policy toward the rewarded samples.
"""

import json
import math
from pathlib import Path

import pytest

from config import load_config
from conftest import run_train
from test_distributed import torchrun

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def tiny_overrides(path: Path, out_dir: Path) -> list[str]:
    cfg = load_config(path)
    name = cfg.model.name_or_path.lower()
    family = cfg.model.tiny.arch if name == "tiny" else "qwen3_moe" if "-a3b" in name or "moe" in name else \
        "qwen3" if "qwen3" in name else "llama"
    experts = ["model.tiny.num_experts=4", "model.tiny.num_experts_per_tok=2", "model.tiny.moe_intermediate_size=128"] \
        if family == "qwen3_moe" else ["model.tiny.num_experts=0"]  # a tiny MoE stands in for a MoE model
    return [*experts,
        "model.name_or_path=tiny", f"model.tiny.arch={family}", "model.tiny.hidden_size=128",
        "model.tiny.intermediate_size=256", "model.tiny.num_layers=2", "model.tiny.num_heads=4",
        "model.tiny.num_kv_heads=2", "model.tiny.head_dim=32",
        "data.source=synthetic", "data.template=plain", "data.instruction=", "data.max_prompt_tokens=32",
        "data.synthetic.num_train=64", "data.synthetic.num_val=8",
        "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.n=8", "rollout.max_new_tokens=4",
        "train.steps=2", "train.device=cpu", "train.mini_batch_size=8", "train.micro_batch_size=4",
        "train.val_every=0", "train.ckpt_every=0", "train.save_final=false", "train.probe=true",
        f"train.out_dir={out_dir}", "train.run_name=run", "log.tensorboard=false", "log.dump_episodes_every=0"]


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT / "configs")) for p in CONFIGS])
def test_shipped_config_trains_on_cpu(path, tmp_path):
    shipped = load_config(path)
    if shipped.rollout.mode == "async":  # the engine in a process of its own: 2 ranks
        torchrun(tmp_path, 2, "--config", str(path), *tiny_overrides(path, tmp_path), fresh=tmp_path / "run")
        run_dir = tmp_path / "run"
    else:
        run = run_train("--config", str(path), *tiny_overrides(path, tmp_path))
        assert run.returncode == 0, run.stderr[-3000:]
        run_dir = run.run_dir
    cfg = load_config(run_dir / "config.yaml")
    for key in ("model.dtype", "model.gradient_checkpointing", "optim", "fp8", "loss", "train.compile"):
        section, _, field = key.partition(".")
        a, b = getattr(shipped, section), getattr(cfg, section)
        assert (getattr(a, field) == getattr(b, field)) if field else a == b, key  # its own trainer settings
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(math.isfinite(r["loss/total"]) and r["optim/skipped_steps"] == 0 for r in records)
    record = records[-1]  # step 0 runs at 1/warmup_steps of the lr, where even fp32 RMSNorm gains (1.0) stay put
    assert record["optim/changed_frac"] >= 0.99, record["optim/changed_frac"]
    assert record["probe/policy_gain"] > 0, record["probe/policy_gain"]
