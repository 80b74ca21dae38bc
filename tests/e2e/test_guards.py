"""Run-time guards of the training loop, on tiny_cpu in-process (a few seconds per run).

* a non-finite loss (even with finite gradients) or grad norm skips the optimizer step, counts it
  (optim/skipped_steps) and leaves weights, optimizer and schedule untouched; train.max_bad_steps
  in a row abort with a message that names the knob and what to try;
* token_mult_prob_error above train.mismatch_warn warns, above train.mismatch_stop stops;
* groups whose rewards are all equal get zero advantage: zero loss and gradient, no NaN;
* prompts longer than data.max_prompt_tokens are dropped and counted.
"""

import dataclasses
import json
import math

import pytest
import torch

import rewards
import trainer
from checkpoint import load_checkpoint
from conftest import ROOT, TrainRun, read_metrics, run_train


def train(tmp_path, *overrides, exit_code: int = 0) -> TrainRun:
    """train_grpo.py (in-process) on a 4 prompts x 8 samples batch: one micro-batch, one optimizer step
    per step; it must exit with exit_code."""
    run = run_train("--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}", "train.run_name=r",
                    "log.tensorboard=false", "log.dump_episodes_every=0", "train.val_every=0",
                    "rollout.prompts_per_step=4", "train.micro_batch_size=32", *overrides)
    assert run.returncode == exit_code, run.stderr[-3000:]
    return run


def corrupt_loss(monkeypatch, by_step):
    """micro_batch_loss whose loss on step s (one call per step here) goes through by_step[s]."""
    real, calls = trainer.micro_batch_loss, []

    def micro_batch_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(None)
        return dataclasses.replace(out, loss=by_step.get(len(calls) - 1, lambda x: x)(out.loss))
    monkeypatch.setattr(trainer, "micro_batch_loss", micro_batch_loss)


def test_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    # step 1: a NaN loss whose gradients stay finite (only the loss check can see it);
    # step 2: NaN gradients (the grad-norm check)
    corrupt_loss(monkeypatch, {1: lambda x: x + math.nan, 2: lambda x: x * math.nan})
    run = train(tmp_path, "train.steps=4", "train.ckpt_every=1", "train.keep_ckpts=0")
    run_dir = run.run_dir
    m = read_metrics(run_dir)
    assert [r["optim/skipped_steps"] for r in m] == [0, 1, 1, 0]
    assert ["optim/grad_norm" in r for r in m] == [True, False, False, True]
    out = run.stdout
    assert "WARNING step 1: non-finite loss/grad norm, optimizer step skipped (1 in a row)" in out
    assert "WARNING step 2: non-finite loss/grad norm, optimizer step skipped (2 in a row)" in out
    # skipped steps changed nothing: weights, Adam state, lr schedule; the next step trains again
    s1, s3, s4 = (load_checkpoint(run_dir / "checkpoints" / f"step_{i:06d}") for i in (1, 3, 4))
    assert all(torch.equal(s1["model"][k], s3["model"][k]) for k in s1["model"])
    emb = "model.embed_tokens.weight"  # optimizer state is keyed by parameter name (distributed.full_state)
    assert s1["optimizer"]["state"][emb]["step"] == s3["optimizer"]["state"][emb]["step"] == 1
    assert s1["scheduler"] == s3["scheduler"] and s3["bad_steps"] == 2 and s4["bad_steps"] == 0
    assert not all(torch.equal(s3["model"][k], s4["model"][k]) for k in s3["model"])
    assert all(torch.isfinite(t).all() for t in s4["model"].values())


def test_consecutive_nonfinite_steps_abort(tmp_path, monkeypatch):
    corrupt_loss(monkeypatch, {s: lambda x: x * math.nan for s in range(10)})
    err = train(tmp_path, "train.steps=5", "train.max_bad_steps=2", exit_code=2).error
    assert err == ("error: 2 consecutive non-finite steps (train.max_bad_steps); lower optim.lr, check the data, "
                   "or try fp8.train=false to isolate FP8")
    assert len(read_metrics(tmp_path / "r")) == 1  # step 0 logged, step 1 aborted


def test_mismatch_warns_then_stops(tmp_path):
    # FP8 KV cache in the engine only: token_mult_prob_error ~1.008 > 1.001 on the first step
    run = train(tmp_path, "train.steps=3", "fp8.kv_cache=true", "train.mismatch_warn=1.001",
                "train.mismatch_stop=1.001", exit_code=2)
    assert "WARNING step 0: mismatch/token_mult_prob_error=1.0" in run.stdout
    assert "> train.mismatch_warn=1.001: rollout and trainer disagree" in run.stdout
    err = run.error
    assert err.startswith("error: step 0: mismatch/token_mult_prob_error=1.0") and "> train.mismatch_stop=1.001" in err
    assert "raise train.mismatch_stop" in err


def test_equal_rewards_overlong_prompts_and_warn_only(tmp_path, monkeypatch):
    rows = [{"problem": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
    rows += [{"problem": f"{d}+" * 20 + "1=", "answer": "0"} for d in (1, 2, 3)]  # 43 chars > max_prompt_tokens=32
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setitem(rewards.REWARDS, "math", lambda completion, answer, **context: 0.0)  # every group: zero std
    run = train(tmp_path, "train.steps=2", "data.source=jsonl", f"data.path={tmp_path / 'd.jsonl'}",
                "data.val_size=0", "train.mismatch_warn=0.5")
    run_dir, out = run.run_dir, run.stdout
    assert "data: 36 train prompts (3 dropped as overlong)" in out
    assert "WARNING step 1: mismatch/token_mult_prob_error" in out  # warned, kept going
    for r in read_metrics(run_dir):
        assert r["reward/zero_std_groups"] == 1.0 and r["reward/mean"] == 0.0
        assert r["loss/policy"] == 0.0 and r["optim/grad_norm"] == 0.0 and r["optim/skipped_steps"] == 0
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r


def test_fresh_run_refuses_a_dir_that_holds_a_run(tmp_path):
    run_dir = train(tmp_path, "train.steps=1").run_dir
    before = (run_dir / "metrics.jsonl").read_text()
    assert train(tmp_path, "train.steps=1", exit_code=2).error == (  # same train.run_name
        f"error: train.run_name: {run_dir} holds a run already: continue it with --resume {run_dir}, or pick "
        "another train.run_name")
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing appended
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "metrics.jsonl").touch()  # a run SIGKILLed before its first step: not ours to reuse
    assert train(tmp_path, "train.steps=1", "train.run_name=started", exit_code=2).error == (
        f"error: train.run_name: {tmp_path / 'started'} exists (and has no complete checkpoint, so it cannot be "
        "resumed): pick another train.run_name, or delete that directory")
    assert (tmp_path / "started" / "metrics.jsonl").is_file()  # left as it was


def test_grad_norm_logged_before_and_after_clipping(tmp_path):
    """optim/grad_norm is the norm before clipping, optim/grad_norm_clipped after it; max_grad_norm=null
    clips nothing."""
    clipped = read_metrics(train(tmp_path, "train.steps=1", "optim.max_grad_norm=1e-3").run_dir)[0]
    assert clipped["optim/grad_norm"] > 1e-2 and clipped["optim/grad_norm_clipped"] == pytest.approx(1e-3, rel=1e-3)
    free = read_metrics(train(tmp_path, "train.steps=1", "optim.max_grad_norm=null", "train.run_name=free").run_dir)[0]
    assert free["optim/grad_norm_clipped"] == free["optim/grad_norm"] == clipped["optim/grad_norm"]


def test_advantage_settings_come_from_the_config(tmp_path):
    """advantage.normalize_std=false gives A = r - mean of the group (Dr. GRPO); the default divides by
    the group's std + advantage.eps. Read back from the episode dump of every sample of step 0."""
    def advantages(name, *overrides):
        train(tmp_path, "train.steps=1", f"train.run_name={name}", "rollout.prompts_per_step=8",
              "log.dump_episodes_every=1", "log.dump_episodes_n=64", *overrides)
        rows = [json.loads(line) for line in (tmp_path / name / "episodes" / "step_000000.jsonl").read_text().splitlines()]
        assert len(rows) == 64
        return (torch.tensor([r["reward"] for r in rows]).view(8, 8),
                torch.tensor([r["advantage"] for r in rows]).view(8, 8))

    r, a = advantages("centered", "advantage.normalize_std=false")
    assert (r.std(1) > 0).any()  # some group has signal, so the two settings differ
    torch.testing.assert_close(a, r - r.mean(1, keepdim=True))
    r, a = advantages("normalized", "advantage.eps=0.5")
    torch.testing.assert_close(a, (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 0.5))
