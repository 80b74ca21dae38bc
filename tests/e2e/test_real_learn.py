"""scripts/real_learn.py: the task files, the per-run rows and per-mode summary from metrics files, bad input,
--gpus' assignment (round-robin, CUDA_VISIBLE_DEVICES per run through common.launch_all's env hook), the
micro-batch and gradient checkpointing settings, and the script end to end on CPU (tiny_cpu's model built
from scratch, HF engine), with one launcher and with one per --gpus group."""

import argparse
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from scripts import common, real_learn

ROOT = Path(__file__).resolve().parents[2]


def test_task_files_are_held_out_and_deterministic(tmp_path):
    a = real_learn.write_task(tmp_path / "a", "add1", seed=3)
    b = real_learn.write_task(tmp_path / "b", "add1", seed=3)
    assert (a / "train.jsonl").read_text() == (b / "train.jsonl").read_text()
    test = [json.loads(x) for x in (a / "test.jsonl").read_text().splitlines()]
    train = {json.loads(x)["question"] for x in (a / "train.jsonl").read_text().splitlines()}
    assert len(test) == 40 and len({t["question"] for t in test}) == 40 and not train & {t["question"] for t in test}
    q = test[0]["question"]
    x, y = (int(v) for v in q.removeprefix("What is ").removesuffix("?").split(" + "))
    assert test[0]["answer"].endswith(f"#### {x + y}")


def test_summary_gain_std_and_gap():
    def rows(v0, vend, steps=3):
        r = [{"step": 0, "val/accuracy": v0}] + [{"step": s, "reward/mean": 0.1 * s, real_learn.MISMATCH: 0.01,
                                                  "loss/clip_frac": 0.02 * s, "is/truncated_frac": 0.001}
                                                 for s in range(steps)]
        return r + ([{"step": 3, "val/accuracy": vend}] if vend is not None else [])
    runs = [{"mode": "fp8kv", "seed": 0, **real_learn.summarize(rows(0.1, 0.3), 3)},
            {"mode": "fp8kv", "seed": 1, **real_learn.summarize(rows(0.1, 0.5), 3)},
            {"mode": "bf16", "seed": 0, **real_learn.summarize(rows(0.2, 0.3), 3)},
            {"mode": "bf16", "seed": 1, **real_learn.summarize(rows(0.2, None, steps=2), 3)}]
    assert runs[0]["gain"] == pytest.approx(0.2) and runs[0]["reward_last5"] == pytest.approx(0.1)
    assert runs[0]["reward_run"] == pytest.approx(0.1) and runs[0]["clip_frac"] == pytest.approx(0.02)
    assert runs[0]["truncated_frac"] == pytest.approx(0.001)
    assert not runs[3]["finished"] and runs[3]["gain"] is None and runs[3]["steps_logged"] == 2
    agg = real_learn.aggregate(runs, ["fp8kv", "bf16"])
    assert agg["fp8kv"]["gain_mean"] == pytest.approx(0.3) and agg["fp8kv"]["gain_std"] == pytest.approx(0.1414, abs=1e-3)
    assert agg["bf16"]["finished"] == 1 and agg["bf16"]["gain_std"] is None
    assert agg["gap_gain"] == pytest.approx(0.2) and agg["fp8kv"]["reward_run_mean"] == pytest.approx(0.1)
    md = real_learn.markdown(runs, agg, ["fp8kv", "bf16"])
    assert "| 0.100 | 0.0200 / 0.0010 |" in md and "| 0.100 ± 0.000 |" in md
    assert "| fp8kv | 0 | 0.100 | 0.300 | +0.200 | 3 |" in md and "2 (unfinished)" in md and "fp8kv - bf16: gain +0.200" in md
    assert agg["fp8kv"]["val_step0_values"] == [0.1] and "step-0 validation differs" not in md
    runs[1]["val_step0"] = 0.15  # greedy from one model: a seed whose step 0 differs is flagged
    agg = real_learn.aggregate(runs, ["fp8kv", "bf16"])
    assert "step-0 validation differs across seeds (expected one value per mode): fp8kv 0.100, 0.150" in \
        real_learn.markdown(runs, agg, ["fp8kv", "bf16"])


@pytest.mark.parametrize("argv, says", [
    (["--modes", "fp8"], "error: --modes fp8"), (["--task", "add3"], "error: --task add3"),
    (["--seeds", "a"], "error: --seeds"), (["--steps", "0"], "error: --steps 0"),
    (["--model", "/nonexistent"], "error: --model /nonexistent"), (["--model", "tiny", "train.bogus=1"], "train.bogus"),
    (["--model", "tiny", "--gpus", "0,x"], "error: --gpus 0,x"), (["--model", "tiny", "--gpus", "1,1"], "error: --gpus 1,1"),
    (["--model", "tiny", "--micro-batch", "0"], "error: --micro-batch 0"),
    (["--from-work"], "error: --from-work: ")])
def test_bad_input_exits_2(tmp_path, argv, says):
    p = subprocess.run([sys.executable, "-m", "scripts.real_learn", "--cpu", "--config",
                        str(ROOT / "configs/tiny_cpu.yaml"), "--out", str(tmp_path / "out"), "--work",
                        str(tmp_path / "work"), *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and says in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_gpus_round_robin_shifted_each_round():
    runs = [(m, s) for s in range(4) for m in ("fp8kv", "bf16")]  # the launch order
    got = real_learn.assign_gpus(runs, ["0", "1", "2", "3"])
    assert [got[r] for r in runs] == ["0", "1", "2", "3", "1", "2", "3", "0"]
    for g in "0123":  # two runs per GPU, one of each mode
        assert sorted(m for (m, _), x in got.items() if x == g) == ["bf16", "fp8kv"]
    assert [real_learn.assign_gpus(runs, ["4", "5"])[r] for r in runs] == ["4", "5", "5", "4", "4", "5", "5", "4"]
    three = real_learn.assign_gpus(runs, ["0", "1", "2"])
    assert sorted(list(three.values()).count(g) for g in "012") == [2, 3, 3]
    assert set(real_learn.assign_gpus(runs, []).values()) == {None}


def test_micro_batch_and_gradient_checkpointing():
    assert real_learn.micro_batch(256, 64) == 64 and real_learn.micro_batch(16, 64) == 16
    assert real_learn.micro_batch(100, 64) == 50 and real_learn.micro_batch(97, 64) == 1
    a = argparse.Namespace(seeds=[0, 1, 2, 3], modes=["fp8kv", "bf16"], gpus=[], grad_ckpt="auto")
    assert real_learn.runs_per_gpu(a) == 8 and real_learn.grad_ckpt(a)
    a.gpus = ["0", "1", "2", "3"]
    assert real_learn.runs_per_gpu(a) == 2 and not real_learn.grad_ckpt(a)
    a.grad_ckpt = "on"
    assert real_learn.grad_ckpt(a)


def test_dry_run_prints_each_runs_gpu(tmp_path):
    p = subprocess.run([sys.executable, "-m", "scripts.real_learn", "--model", "tiny", "--dry-run", "--gpus",
                        "0,1,2,3", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[:8] == ["fp8kv_s0: CUDA_VISIBLE_DEVICES=0", "bf16_s0: CUDA_VISIBLE_DEVICES=1",
                         "fp8kv_s1: CUDA_VISIBLE_DEVICES=2", "bf16_s1: CUDA_VISIBLE_DEVICES=3",
                         "fp8kv_s2: CUDA_VISIBLE_DEVICES=1", "bf16_s2: CUDA_VISIBLE_DEVICES=2",
                         "fp8kv_s3: CUDA_VISIBLE_DEVICES=3", "bf16_s3: CUDA_VISIBLE_DEVICES=0"]
    assert "train.micro_batch_size=64 model.gradient_checkpointing=false" in p.stdout  # 2 runs per GPU
    assert "log.dump_episodes_every=0" in p.stdout and not (tmp_path / "out").exists()


def test_launch_all_env_hook_and_run_list(tmp_path, monkeypatch):
    """common.launch_all with args.runs and args.env (what --gpus passes), its process start faked."""
    started = []

    class Done:
        pid, returncode = 12345, 0

        def __init__(self, cmd, env, **kw):
            started.append((cmd, env))

        def poll(self):
            return 0
    monkeypatch.setattr(common.subprocess, "Popen", Done)
    gate = argparse.Namespace(seeds=[0, 1], modes=["fp8kv", "bf16"], runs=[("bf16", 1), ("fp8kv", 0)],
                              env={"CUDA_VISIBLE_DEVICES": "3"}, deadline_s=60, threads=1, max_concurrent=8,
                              stagger=False, stagger_timeout_s=1, config=ROOT / "configs/tiny_cpu.yaml",
                              run_overrides=[], mode_overrides={"fp8kv": [], "bf16": []}, extra=[])
    runs = common.launch_all(gate, tmp_path, time.time())
    assert list(runs) == [("bf16", 1), ("fp8kv", 0)] and all(r["rc"] == 0 for r in runs.values())
    assert [e["CUDA_VISIBLE_DEVICES"] for _, e in started] == ["3", "3"]
    assert "train.run_name=bf16_s1" in started[0][0] and "train.seed=1" in started[0][0]


@pytest.mark.parametrize("gpus", [[], ["--gpus", "0,1"]], ids=["one-launcher", "per-gpu-launchers"])
def test_end_to_end_on_cpu(tmp_path, gpus):
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run([sys.executable, "-m", "scripts.real_learn", "--cpu", "--model", "tiny", "--config",
                        str(ROOT / "configs/tiny_cpu.yaml"), "--seeds", "0", "--steps", "2", "--prompts", "4",
                        "--n", "4", "--max-new-tokens", "4", "--out", str(out), "--work", str(work), *gpus,
                        "train.micro_batch_size=16"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "real_learn.json").read_text())
    assert [(r["mode"], r["seed"]) for r in res["runs"]] == [("fp8kv", 0), ("bf16", 0)]
    assert [r["gpu"] for r in res["runs"]] == (["0", "1"] if gpus else [None, None])
    for r in res["runs"]:
        assert r["finished"] and r["steps_logged"] == 2 and r["rc"] == 0
        assert r["gain"] == pytest.approx(r["val_final"] - r["val_step0"]) and r["reward_first5"] is not None
    assert res["runs"][0]["token_mult_prob_error"] is not None
    assert res["summary"]["fp8kv"]["finished"] == 1 and "gap_gain" in res["summary"] and res["unfinished"] == []
    assert "fp8.kv_cache=true" in res["commands"]["fp8kv_s0"] and "fp8.kv_cache=false" in res["commands"]["bf16_s0"]
    assert "| fp8kv | 0 |" in (out / "real_learn.md").read_text()
    with tarfile.open(out / "real_learn_runs.tgz") as tar:
        assert {"real_learn.json", "real_learn.md", "fp8kv_s0_metrics.jsonl", "bf16_s0.log"} <= set(tar.getnames())
    # a call cut before its summary: --from-work writes the same table from the run dirs, launching nothing
    again = tmp_path / "again"
    p = subprocess.run([sys.executable, "-m", "scripts.real_learn", "--from-work", "--config",
                        str(ROOT / "configs/tiny_cpu.yaml"), "--seeds", "0", "--steps", "2", "--out", str(again),
                        "--work", str(work), *gpus], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rebuilt = json.loads((again / "real_learn.json").read_text())
    assert rebuilt["summary"] == res["summary"] and rebuilt["commands"] == {}
    assert [r["rc"] for r in rebuilt["runs"]] == ["not recorded"] * 2
    assert (again / "real_learn.md").read_text() == (out / "real_learn.md").read_text()
