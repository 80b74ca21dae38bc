"""Tiny MoE end to end: the aux loss coefficient reaches the loss, router replay on a dense model is bad input."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_step(tmp_path, name, *overrides):
    r = subprocess.run([sys.executable, str(ROOT / "train_grpo.py"), "--config", str(ROOT / "configs/tiny_moe_cpu.yaml"),
                        "train.steps=1", "rollout.prompts_per_step=4", "rollout.n=4", "train.val_every=0",
                        "train.save_final=false", "train.ckpt_every=0", "log.tensorboard=false",
                        "log.dump_episodes_every=0", f"train.out_dir={tmp_path}", f"train.run_name={name}", *overrides],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    return r, (json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0]) if r.returncode == 0 else None)


def test_aux_loss_coefficient_changes_the_loss(tmp_path):
    r0, off = run_step(tmp_path, "off", "moe.aux_loss_coef=0")
    r1, on = run_step(tmp_path, "on", "moe.aux_loss_coef=0.5")
    assert r0.returncode == 0 and r1.returncode == 0, r0.stderr[-3000:] + r1.stderr[-3000:]
    assert "moe/aux_loss" not in off and on["moe/aux_loss"] > 0
    assert "moe/routing_mismatch" in off and "moe/routing_mismatch" in on
    assert on["mismatch/token_mult_prob_error"] == off["mismatch/token_mult_prob_error"]  # same rollout
    assert on["loss/total"] != off["loss/total"] or on["optim/grad_norm"] != off["optim/grad_norm"]
    assert on["optim/grad_norm"] != off["optim/grad_norm"]


def test_router_replay_on_a_dense_model_is_a_user_error(tmp_path):
    r, _ = run_step(tmp_path, "dense", "model.tiny.arch=llama", "model.tiny.num_experts=0")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: moe.router_replay")
    assert not (tmp_path / "dense").exists()  # nothing half-written
