"""Checkpoints and exact resume.

* checkpoint.py: atomic saves, keep-K, a crashed save's temp dir never counts.
* A run SIGKILLed mid-training and resumed with `--resume` logs, for every step, exactly the
  metrics (losses, rewards, mismatch, grad norm, lr, kv scales, val accuracy) of an uninterrupted
  run; only time/ and perf/ differ.
* A run SIGKILLed in the middle of writing a checkpoint (GRPO_CKPT_FAULT, see checkpoint.py)
  resumes from the previous complete checkpoint, just as exactly.

metrics.jsonl on resume: records of steps >= the checkpoint's step, which the interrupted run
logged after saving it, are dropped (RunLogger.truncate) and logged again by the resumed run, so
the file holds one record per step.
"""

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from checkpoint import checkpoints, damage, latest_checkpoint, load_checkpoint, load_latest, save_checkpoint
from conftest import TINY_RUN, TINY_STEPS, read_metrics, run_train, train_cmd
from errors import UserError

VOLATILE = ("time/", "perf/")  # wall-clock figures: the only keys allowed to differ


def by_step(run_dir) -> dict[int, dict]:
    """{step: record without time/perf keys}; asserts one record per step."""
    records = read_metrics(run_dir)
    steps = [m["step"] for m in records]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps not unique and ordered: {steps}"
    return {m["step"]: {k: v for k, v in m.items() if not k.startswith(VOLATILE)} for m in records}


def assert_same_run(got_dir, want_dir):
    got, want = by_step(got_dir), by_step(want_dir)
    assert list(got) == list(want) == list(range(TINY_STEPS + 1))
    for step in want:
        assert got[step] == want[step], f"step {step} differs after resume"
    assert "mismatch/token_mult_prob_error" in want[5] and "loss/policy" in want[5] and "val/accuracy" in want[6]


def resume(run_dir):
    p = subprocess.run(train_cmd("--resume", str(run_dir), f"train.steps={TINY_STEPS}"), cwd=run_dir.parent,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


# ---------------------------------------------------------------------------- checkpoint.py


def small_model(seed=0):
    """A 2-layer MLP and its AdamW, stepped twice (Adam moments exist)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_atomic_save_keep_k_and_temp_dirs_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    model, optimizer = small_model()
    for step in (2, 4, 6):
        save_checkpoint(root, step, {"step": step}, model, optimizer, keep=2)
    assert [s for s, _ in checkpoints(root)] == [4, 6]  # last K kept
    assert sorted(p.name for p in (root / "step_000006").iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    # a crashed save of step 8 (temp dir with a torn shard) and a dir without meta.pt never count
    (root / ".tmp-step_000008").mkdir()
    (root / ".tmp-step_000008" / "__0_0.distcp").write_bytes(b"torn")
    (root / "step_000010").mkdir()
    (root / "step_000010" / ".metadata").write_bytes(b"")
    assert latest_checkpoint(root) == root / "step_000006"
    # numeric order, not string order, past 6 digits
    save_checkpoint(root, 1_000_000, {"step": 1_000_000}, model, optimizer, keep=0)
    assert latest_checkpoint(root).name == "step_1000000"
    assert not list(root.glob(".tmp-*")), "the next save removes a crashed save's temp dir"
    # re-saving a step replaces it with the new state
    save_checkpoint(root, 6, {"step": 6, "again": True}, model, optimizer, keep=0)
    state = load_checkpoint(root / "step_000006")
    assert state["again"] is True and state["world"] == 1 and len(state["rng"]) == 1
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v), k
    for n, p in model.named_parameters():
        assert torch.equal(state["optimizer"]["state"][n]["exp_avg_sq"], optimizer.state[p]["exp_avg_sq"]), n
    assert "optimizer" not in load_checkpoint(root / "step_000006", optimizer=False)
    assert latest_checkpoint(tmp_path / "missing") is None


def test_saving_before_any_optimizer_step_changes_nothing(tmp_path):
    """get_state_dict initialises an empty optimizer's state (an Adam step at lr 0): a save before the
    first optimizer step (every step so far skipped as non-finite) leaves it empty, and so does a
    resume from that checkpoint, so the first real step is Adam's step 1 either way."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_checkpoint(tmp_path, 1, {"step": 1}, model, optimizer)
    assert not optimizer.state and optimizer.param_groups[0]["lr"] == 1e-2
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_latest(tmp_path, fresh, fresh_opt)
    assert not fresh_opt.state and all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_save_after_resume_drops_later_checkpoints(tmp_path):
    """Resumed from step 2 because step 4 did not load, the run saves step 3: step 4 belongs to the
    run before the resume and goes (with keep=1 it would otherwise outlive the new step 3)."""
    model, optimizer = small_model()
    for step in (2, 4):
        save_checkpoint(tmp_path, step, {"step": step}, model, optimizer, keep=2)
    garble(tmp_path / "step_000004", "truncated shard")
    assert load_latest(tmp_path, model, optimizer, log=lambda line: None)[0].name == "step_000002"
    save_checkpoint(tmp_path, 3, {"step": 3}, model, optimizer, keep=1)
    assert [s for s, _ in checkpoints(tmp_path)] == [3]


def garble(ckpt, how):
    """Damage a committed checkpoint as a disk or a copy can: cut a shard file short, or overwrite
    DCP's index / meta.pt with junk."""
    if how == "truncated shard":
        shard = ckpt / "__0_0.distcp"
        os.truncate(shard, shard.stat().st_size // 2)
    else:
        (ckpt / {"garbled index": ".metadata", "garbled meta": "meta.pt"}[how]).write_bytes(b"\x00junk" * 10)


@pytest.mark.parametrize("how", ["truncated shard", "garbled index", "garbled meta"])
def test_corrupt_newest_checkpoint_falls_back_to_the_older(tmp_path, how):
    """The newest checkpoint does not load: one line names it and why, and the older one (kept by
    keep) loads, exactly; none loading is a one-line UserError naming each."""
    root = tmp_path / "checkpoints"
    model, optimizer = small_model()
    save_checkpoint(root, 2, {"step": 2}, model, optimizer)
    want = load_checkpoint(root / "step_000002")
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    save_checkpoint(root, 3, {"step": 3}, model, optimizer)
    garble(root / "step_000003", how)

    lines = []
    fresh, fresh_opt = small_model(seed=1)
    path, meta = load_latest(root, fresh, fresh_opt, log=lines.append)
    assert path == root / "step_000002" and meta["step"] == 2
    assert len(lines) == 1 and lines[0].startswith(f"skipping checkpoint {root / 'step_000003'}: it does not load (")
    assert "\n" not in lines[0]
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want["model"][k]), k
    for n, p in fresh.named_parameters():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh_opt.state[p][k], want["optimizer"]["state"][n][k]), (n, k)

    garble(root / "step_000002", "truncated shard")
    with pytest.raises(UserError) as e:
        load_latest(root, *small_model(), log=lines.append)
    msg = str(e.value)
    assert msg.startswith(f"no checkpoint in {root} loads (step_000003: ") and "; step_000002: " in msg
    assert "\n" not in msg and msg.endswith("start a new run without --resume")


def test_intact_checkpoint_that_does_not_load_stops_the_resume(tmp_path):
    """A checkpoint with intact files that does not load into this run (here: a layer of another width)
    is not called broken and no older one is tried: the traceback, then a UserError naming it, the
    reason and that its files are intact. damage() finds each kind of damage the fallback is for."""
    root = tmp_path / "checkpoints"
    model, optimizer = small_model()
    for step in (2, 3):
        save_checkpoint(root, step, {"step": step}, model, optimizer)
    assert damage(root / "step_000003") is None
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    lines = []
    with pytest.raises(UserError) as e:
        load_latest(root, other, torch.optim.AdamW(other.parameters()), log=lines.append)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {root / 'step_000003'} does not load into this run (") and "\n" not in msg
    assert "though its files are intact" in msg
    assert len(lines) == 1 and lines[0].startswith(f"loading checkpoint {root / 'step_000003'} failed:\nTraceback")
    assert not any(line.startswith("skipping") for line in lines)

    for how in ("truncated shard", "garbled index", "garbled meta"):
        path = tmp_path / how.replace(" ", "_")
        save_checkpoint(path, 1, {"step": 1}, model, optimizer)
        garble(path / "step_000001", how)
        assert damage(path / "step_000001"), how
    (root / "step_000002" / "__0_0.distcp").unlink()
    assert damage(root / "step_000002").startswith("__0_0.distcp is missing, its index needs ")


def test_full_precision_states_load_into_8bit_ones_in_place(tmp_path):
    """torchao keeps the AdamW moments of a tensor with < 4096 values per rank in full precision, so a
    2-rank checkpoint holds plain moments where a 1-rank 8-bit AdamW has 8-bit ones. They load into
    the live 8-bit states, equal to 8-bit precision. On a GPU they are staged through CPU copies
    (torchao's plain-to-8-bit copy needs both on one device; DCP reads into CPU); here, on CPU, that
    staging is the identity, so this checks the values and the in-place load, not the device."""
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import OptimState8bit

    def stepped(make):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 16, bias=False))
        optimizer = make(model.parameters())
        model(torch.randn(3, 64)).square().sum().backward()
        optimizer.step()
        return model, optimizer
    saved, saved_opt = stepped(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    save_checkpoint(tmp_path, 1, {"step": 1}, saved, saved_opt)
    model, optimizer = stepped(lambda ps: AdamW8bit(ps, lr=1e-3))
    state = optimizer.state[model[0].weight]  # 64 x 64 = 4096 values: 8-bit
    live = {k: state[k] for k in ("exp_avg", "exp_avg_sq")}
    assert all(isinstance(t, OptimState8bit) for t in live.values())
    load_latest(tmp_path, model, optimizer)
    for k, t in live.items():
        assert optimizer.state[model[0].weight][k] is t, k
        want = saved_opt.state[saved[0].weight][k]
        assert (t.dequantize() - want).abs().max() <= 0.02 * want.abs().max(), k


CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "1.06 GiB is free.")


@pytest.mark.parametrize("wrapped", [False, True])
def test_out_of_memory_while_loading_is_no_broken_checkpoint(tmp_path, monkeypatch, wrapped):
    """An OOM while the newest checkpoint loads (raised as is, or as one rank's failure inside DCP's
    CheckpointException) stops the resume with one line naming that checkpoint, the memory asked for
    and the fix; it does not fall back to an older checkpoint nor call the run unloadable. A damaged
    newest checkpoint still falls back (test_corrupt_newest_checkpoint_falls_back_to_the_older)."""
    import checkpoint

    root = tmp_path / "checkpoints"
    model, optimizer = small_model()
    for step in (2, 3):
        save_checkpoint(root, step, {"step": step}, model, optimizer)

    def out_of_memory(*args, **kwargs):
        oom = torch.OutOfMemoryError(CUDA_OOM)
        raise checkpoint.dcp.api.CheckpointException("load", {0: (oom, None)}) if wrapped else oom

    monkeypatch.setattr(checkpoint.dcp, "load", out_of_memory)
    lines = []
    with pytest.raises(UserError) as e:
        load_latest(root, *small_model(seed=1), log=lines.append)
    msg = str(e.value)
    assert not lines, "no checkpoint is skipped"
    assert msg.startswith(f"checkpoint {root / 'step_000003'} does not fit in device memory (asked for 2.00 GiB more; ")
    assert "not damaged" in msg and "--nproc_per_node" in msg and "rollout.gpu_memory_utilization" in msg
    assert "\n" not in msg and "step_000002" not in msg and "start a new run" not in msg


def test_out_of_memory_on_resume_exits_2_naming_the_checkpoint(tiny_run, tmp_path, monkeypatch):
    """The same through `train_grpo.py --resume`: `error: ...` on stderr, exit code 2, the run dir kept."""
    import shutil

    import checkpoint

    run_dir = tmp_path / "oom"
    shutil.copytree(tiny_run, run_dir)
    monkeypatch.setattr(checkpoint.dcp, "load", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError(CUDA_OOM)))
    p = run_train("--resume", str(run_dir), cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr.strip().splitlines()[-1]
    assert err.startswith(f"error: checkpoint {run_dir / 'checkpoints' / 'step_000008'} does not fit in device memory")
    assert "skipping checkpoint" not in p.stdout and run_dir.is_dir()


def test_metrics_truncated_on_resume(tmp_path):
    from observe import RunLogger

    lines = [json.dumps({"step": s, "x": s}) for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "x"')  # torn last line
    logger = RunLogger(tmp_path, enabled=True, tensorboard=False)
    logger.truncate(3)
    logger.log(3, {"x": 30})
    logger.close()
    assert read_metrics(tmp_path) == [{"step": 0, "x": 0}, {"step": 1, "x": 1}, {"step": 2, "x": 2},
                                      {"step": 3, "x": 30}]


# ---------------------------------------------------------------------------- end to end


def test_sigkill_mid_training_then_resume_is_exact(tiny_run, tmp_path):
    run_dir = tmp_path / "killed"
    log = open(tmp_path / "killed.log", "w")
    p = subprocess.Popen(train_cmd(*TINY_RUN, f"train.out_dir={tmp_path}", "train.run_name=killed",
                                   "train.steps=1000"), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    ckpt_step, deadline = None, time.time() + 600
    try:
        while p.poll() is None and time.time() < deadline:  # wait for a checkpoint and a step logged past it
            ckpt = latest_checkpoint(run_dir / "checkpoints")
            if ckpt is not None:
                ckpt_step = int(ckpt.name.removeprefix("step_"))
                logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                          if line.endswith("}")]
                if logged and logged[-1] >= ckpt_step:
                    break
            time.sleep(0.02)
        assert p.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
        log.close()
    assert p.returncode == -signal.SIGKILL
    assert 2 <= ckpt_step < TINY_STEPS, ckpt_step
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert max(json.loads(line)["step"] for line in lines if line.endswith("}")) >= ckpt_step  # logged past it

    ckpt_step = int(latest_checkpoint(run_dir / "checkpoints").name.removeprefix("step_"))  # it may have saved again
    assert ckpt_step < TINY_STEPS, ckpt_step
    out = resume(run_dir)
    assert f"resumed from {run_dir / 'checkpoints'}/step_{ckpt_step:06d} at step {ckpt_step}" in out
    assert_same_run(run_dir, tiny_run)


def test_sigkill_mid_save_never_leaves_a_checkpoint_and_resume_is_exact(tiny_run, tmp_path):
    run_dir, root = tmp_path / "crash", tmp_path / "crash" / "checkpoints"
    p = subprocess.run(train_cmd(*TINY_RUN, f"train.out_dir={tmp_path}", "train.run_name=crash",
                                 f"train.steps={TINY_STEPS}"), cwd=tmp_path, capture_output=True, text=True,
                       timeout=900, env={**os.environ, "GRPO_CKPT_FAULT": "4"})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    partial = root / ".tmp-step_000004"
    assert (partial / "__0_0.distcp").is_file() and not (partial / "meta.pt").exists()
    assert not (root / "step_000004").exists() and latest_checkpoint(root) == root / "step_000002"

    out = resume(run_dir)
    assert f"resumed from {root}/step_000002 at step 2" in out
    assert not list(root.glob(".tmp-*")), "the crashed save's temp dir was not cleaned up"
    assert [s for s, _ in checkpoints(root)] == [6, 8]
    assert_same_run(run_dir, tiny_run)
    state = load_checkpoint(root / "step_000008")
    assert state["step"] == 8 and state["kv_scales"] and state["sampler"]["position"] == 8 * 4


def test_corrupt_newest_checkpoint_resumes_from_the_older_exactly(tiny_run, tmp_path):
    """The finished run's newest checkpoint (step 8) is cut short on disk: --resume says it skips it,
    resumes from step 6 (kept by keep_ckpts=2) and redoes steps 6-7 exactly, saving step 8 anew."""
    import shutil

    run_dir = tmp_path / "corrupt"
    shutil.copytree(tiny_run, run_dir)
    root = run_dir / "checkpoints"
    garble(root / "step_000008", "truncated shard")
    out = resume(run_dir)
    skipped = [line for line in out.splitlines() if line.startswith("skipping checkpoint")]
    assert len(skipped) == 1, out
    assert skipped[0].startswith(f"skipping checkpoint {root}/step_000008: it does not load (")
    assert f"resumed from {root}/step_000006 at step 6" in out
    assert_same_run(run_dir, tiny_run)
    assert load_checkpoint(root / "step_000008")["step"] == 8


def test_resume_overrides_are_recorded_and_shape_changes_refused(tiny_run, tmp_path):
    """--resume R never rewrites R/config.yaml: its overrides go to R/resumes.jsonl and apply to later
    resumes and to export_hf (checkpoint.resume_config). An override of what the checkpoint's
    parameters or tokenizer depend on is refused in one line, before anything is loaded or written."""
    import shutil

    from checkpoint import resume_config

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    config = (run_dir / "config.yaml").read_bytes()

    def error(*argv):
        run = run_train("--resume", str(run_dir), *argv)
        assert run.returncode == 2, run.stderr[-3000:]
        return run.error

    assert error("model.tiny.hidden_size=256") == (
        f"error: --resume {run_dir}: model.tiny.hidden_size cannot change on resume (128 -> 256): the checkpoint "
        "holds that model and run; drop the override, or start a new run")
    assert "model.dtype cannot change on resume ('float32' -> 'bfloat16')" in error("model.dtype=bfloat16")
    assert "drop --config and give changes as key=value overrides" in error("--config", "configs/tiny_cpu.yaml")
    assert (run_dir / "config.yaml").read_bytes() == config and not (run_dir / "resumes.jsonl").exists()

    run = run_train("--resume", str(run_dir), f"train.steps={TINY_STEPS + 1}")  # one more step
    assert run.returncode == 0, run.stderr[-3000:]
    assert (run_dir / "config.yaml").read_bytes() == config
    records = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert [(r["step"], r["overrides"]) for r in records] == [(TINY_STEPS, [f"train.steps={TINY_STEPS + 1}"])]
    assert resume_config(run_dir).train.steps == TINY_STEPS + 1  # what a plain --resume and export_hf see
    assert max(by_step(run_dir)) == TINY_STEPS + 1
    assert latest_checkpoint(run_dir / "checkpoints").name == f"step_{TINY_STEPS + 1:06d}"
