"""scripts/learn_gate.py: the verdict from metrics files, and the whole gate end to end on CPU."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from scripts import learn_gate

ROOT = Path(__file__).resolve().parents[2]

STEPS = 20


def write_run(path: Path, final_val: float | None, zero_std_end: float = 0.3, steps: int = STEPS):
    """A run's metrics.jsonl: `steps` training records (zero-variance groups falling to zero_std_end over the
    last 5), validation every 10 steps and, if final_val is given, the end-of-run validation at step STEPS."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in range(steps):
        r = {"step": s, "reward/mean": 0.5, "reward/unsolved_groups": 0.1,
             "reward/zero_std_groups": 0.9 if s < steps - 5 else zero_std_end, "reward/distinct_answers": 2.0, "policy/entropy": 0.3,
             "optim/grad_norm": 0.0 if s == 7 else 1.0, "time/step": 0.5}
        if s % 10 == 0:
            r["val/accuracy"] = 0.1
        rows.append(r)
    if final_val is not None:
        rows.append({"step": STEPS, "val/accuracy": final_val})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')  # torn last line


def runs_dir(tmp_path, fp8=(0.84, 0.8, 0.76, 0.92), bf16=(0.88, 0.8, 0.72, 0.92), fp8_async=(), **special):
    """DIR/<mode>_s<seed>/metrics.jsonl for each accuracy; special[(mode, seed)] = write_run kwargs."""
    files = {}
    for mode, accs in (("fp8", fp8), ("bf16", bf16), ("fp8_async", fp8_async)):
        for seed, acc in enumerate(accs):
            f = tmp_path / f"{mode}_s{seed}" / "metrics.jsonl"
            write_run(f, **{"final_val": acc, **special.get(f"{mode}{seed}", {})})
            files[(mode, seed)] = f
    return files


def test_passing_runs_pass(tmp_path):
    passed, reasons, means, runs = learn_gate.check(runs_dir(tmp_path), STEPS)
    assert passed and reasons == []
    assert means["fp8"] == pytest.approx(0.83) and means["bf16"] == pytest.approx(0.83) and means["gap"] == pytest.approx(0)
    r = next(r for r in runs if r["mode"] == "fp8" and r["seed"] == 0)
    assert r["final_val"] == 0.84 and r["steps_logged"] == STEPS and r["first_zero_grad_step"] == 7
    assert r["unsolved_groups"] == pytest.approx(0.1) and r["zero_std_groups"] == pytest.approx(0.3)
    md = learn_gate.table(runs, means)
    assert md.count("\n| fp8 |") == 4 and md.count("\n| bf16 |") == 4 and "| 0.10 | 0.84 | 20 | 0.10 | 0.30 |" in md
    assert r["start_val"] == 0.1 and "mean gain over the run fp8: +0.730; mean gain over the run bf16: +0.730;" in md


@pytest.mark.parametrize("kwargs, reason", [
    ({"fp8": (0.84, 0.8, 0.68, 0.92)}, "fp8 seed 2: final val/accuracy 0.68 < 0.7"),
    ({"bf16": (0.88, 0.8, 0.72)}, "bf16: 3 seeds, the gate needs >= 4"),
    ({"fp8": (0.72, 0.72, 0.72, 0.72), "bf16": (0.96, 0.96, 0.96, 0.96)}, "|gap| 0.240 > 0.05"),
    ({"bf16": (0.8, 0.8, 0.8, 0.8), "fp8": (0.92, 0.92, 0.88, 0.88)}, "|gap| 0.100 > 0.05"),  # within: both ways
    ({"fp8": (0.84, 0.8, 0.76, 0.92), "bf161": {"zero_std_end": 0.6}}, "bf16 seed 1: ends with 0.60 of its groups at zero variance"),
    ({"fp83": {"final_val": None, "steps": 12}}, "fp8 seed 3: did not finish (12 steps logged"),
])
def test_each_threshold_fails_the_gate(tmp_path, kwargs, reason):
    special = {k: v for k, v in kwargs.items() if k not in ("fp8", "bf16")}
    passed, reasons, _, _ = learn_gate.check(
        runs_dir(tmp_path, **{k: v for k, v in kwargs.items() if k in ("fp8", "bf16")}, **special), STEPS)
    assert not passed and any(reason in r for r in reasons), reasons


def test_gap_at_the_threshold_passes(tmp_path):
    passed, reasons, means, _ = learn_gate.check(runs_dir(tmp_path, fp8=(0.8,) * 4, bf16=(0.76,) * 4), STEPS)
    assert passed, reasons
    assert means["gap"] == pytest.approx(0.04)


@pytest.mark.parametrize("fp8_async, reason", [
    ((0.8, 0.8, 0.8, 0.84), None),  # mean 0.81, fp8's 0.83: within 0.05
    ((0.76, 0.76, 0.76, 0.76), "mean final accuracy fp8_async 0.760 vs fp8 0.830: |gap| 0.070 > 0.05"),
    ((0.84, 0.84, 0.84), "fp8_async: 3 seeds, the gate needs >= 4"),
    ((0.84, 0.84, 0.66, 0.84), "fp8_async seed 2: final val/accuracy 0.66 < 0.7"),
])
def test_async_runs_are_held_to_the_fp8_runs(tmp_path, fp8_async, reason):
    passed, reasons, means, runs = learn_gate.check(runs_dir(tmp_path, fp8_async=fp8_async), STEPS)
    assert (passed, reasons) == (True, []) if reason is None else (not passed and reason in reasons), reasons
    assert means["async_gap"] == pytest.approx(sum(fp8_async) / len(fp8_async) - 0.83)
    assert "gap fp8_async - fp8: " in learn_gate.table(runs, means, [*learn_gate.MODES, learn_gate.ASYNC])


def test_a_missing_run_fails(tmp_path):
    files = runs_dir(tmp_path)
    files[("bf16", 0)].unlink()
    passed, reasons, _, runs = learn_gate.check(files, STEPS)
    assert not passed and any("bf16 seed 0: did not finish (0 steps logged" in r for r in reasons)


def test_check_cli_writes_json_table_and_exit_code(tmp_path):
    runs_dir(tmp_path / "runs", fp8=(0.84, 0.8, 0.6, 0.92))
    out = tmp_path / "out"
    rc = learn_gate.main(["--cpu", "--check", str(tmp_path / "runs"), "--out", str(out), f"train.steps={STEPS}"])
    assert rc == 1
    res = json.loads((out / "learn_gate.json").read_text())
    assert res["verdict"] == "FAIL" and res["reasons"] == ["fp8 seed 2: final val/accuracy 0.60 < 0.7"]
    assert res["thresholds"] == {"min_seeds": 4, "min_val_accuracy": 0.7, "max_mean_gap": 0.05,
                                 "max_zero_std_groups": 0.5, "tail_steps": 5}
    assert (out / "learn_gate.md").read_text().rstrip().endswith("- fp8 seed 2: final val/accuracy 0.60 < 0.7")
    with tarfile.open(out / "learn_runs.tgz") as tar:
        assert {"learn_gate.json", "learn_gate.md", "fp8_s2_metrics.jsonl"} <= set(tar.getnames())


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert learn_gate.main(["--cpu", "--modes", "fp16", "--out", str(tmp_path)]) == 2
    assert "error: --modes fp16" in capsys.readouterr().err
    assert learn_gate.main(["--cpu", "--out", str(tmp_path), "train.dynamic_sampling=always"]) == 2
    assert "train.dynamic_sampling" in capsys.readouterr().err
    assert learn_gate.main(["--cpu", "--out", str(tmp_path), "--async", "--sweep", "x:optim.lr=1e-4"]) == 2
    assert "error: --async with --sweep" in capsys.readouterr().err
    assert learn_gate.main(["--out", str(tmp_path), "--async", "--async-gpus", "0"]) == 2
    assert "error: --async-gpus 0: name two GPUs" in capsys.readouterr().err


def test_gate_end_to_end_on_cpu(tmp_path):
    """2 seeds x {fp8, bf16} x 2 steps of a small tiny_cpu: every run finishes and validates; the gate
    FAILs (2 seeds, and 2 steps do not learn) with exit code 1 and writes its results."""
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run([sys.executable, "-m", "scripts.learn_gate", "--cpu", "--seeds", "0,1", "--steps", "2",
                        "--out", str(out), "--work", str(work), "rollout.prompts_per_step=4",
                        "train.micro_batch_size=32", "log.dump_episodes_every=0"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "learn_gate.json").read_text())
    assert res["verdict"] == "FAIL" and "fp8: 2 seeds, the gate needs >= 4" in res["reasons"]
    assert [(r["mode"], r["seed"]) for r in res["runs"]] == [("bf16", 0), ("bf16", 1), ("fp8", 0), ("fp8", 1)]
    for r in res["runs"]:
        assert r["steps_logged"] == 2 and r["final_val"] is not None and 0 <= r["final_val"] <= 1
        assert r["entropy"] > 0 and 1 <= r["distinct_answers"] <= 8
    assert "fp8.train=false" in res["commands"]["bf16_s0"] and "fp8.train=false" not in res["commands"]["fp8_s0"]
    assert "FAIL" in p.stdout and (out / "fp8_s1_metrics.jsonl").is_file() and (out / "learn_runs.tgz").is_file()


def test_async_gate_end_to_end_on_cpu(tmp_path):
    """--async on CPU (gloo, HF engine): each fp8_async run is a trainer rank and an engine rank under torchrun,
    and finishes beside its fp8 twin; FAIL (1 seed, no bf16)."""
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run([sys.executable, "-m", "scripts.learn_gate", "--cpu", "--seeds", "0", "--steps", "2",
                        "--modes", "fp8", "--async", "--out", str(out), "--work", str(work), "rollout.prompts_per_step=4",
                        "train.micro_batch_size=32", "log.dump_episodes_every=0"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "learn_gate.json").read_text())
    assert [(r["mode"], r["steps_logged"]) for r in res["runs"]] == [("fp8", 2), ("fp8_async", 2)]
    assert all(r["final_val"] is not None for r in res["runs"]) and "async_gap" in res["means"]
    cmd = res["commands"]["fp8_async_s0"]
    assert cmd.startswith("-m torch.distributed.run --standalone --nproc_per_node 2 ") and "rollout.mode=async" in cmd
    assert "rollout.mode=async" not in res["commands"]["fp8_s0"]
    staleness = [json.loads(line).get("rollout/staleness") for line in (out / "fp8_async_s0_metrics.jsonl").open()]
    assert [s for s in staleness if s is not None] == [0, 1]


def test_bad_sft_model_exits_2_and_writes_nothing(tmp_path, capsys):
    rc = learn_gate.main(["--sft-model", str(tmp_path / "nope"), "--out", str(tmp_path / "out"),
                          "--work", str(tmp_path / "work")])
    assert rc == 2 and "error: --sft-model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_failed_warm_start_fails_the_gate_without_runs(tmp_path):
    """The quickstart's config names an SFT model: the gate trains it first; if that fails, no run starts
    and the verdict says why."""
    out, work = tmp_path / "out", tmp_path / "work"
    rc = learn_gate.main(["--cpu", "--config", str(ROOT / "configs/quickstart_gpu.yaml"), "--out", str(out),
                          "--work", str(work), "--sft=--no-such-option"])
    assert rc == 1
    result = json.loads((out / "learn_gate.json").read_text())
    assert result["verdict"] == "FAIL" and result["reasons"][0].startswith("the warm start failed")
    assert result["commands"] == {} and (out / "learn_sft.log").is_file()
