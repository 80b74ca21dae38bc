"""bench/step.py drives the real trainer per mode and summarizes its time/* metrics (CPU run)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.step import add_speedups, first_step_times, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_summary_is_the_median_of_timed_steps():
    metrics = [{"step": 0, "time/step": 100.0}] + [
        {"step": s, "time/step": t, "time/rollout": t / 2, "time/refit": 0.1, "time/recalibrate": 0.05}
        for s, t in ((1, 4.0), (2, 6.0), (3, 5.0))]
    row = summarize(metrics, "fp8kv", "w")
    assert row["step_s"] == 5.0 and row["rollout_s"] == 2.5 and row["first_step_s"] == 100.0
    assert row["timed_steps"] == 3 and row["train_s"] == 0.0
    assert row["sync_frac"] == pytest.approx(0.15 / 5.0)
    runs = [{"workload": "w", "mode": "bf16", "step_s": 6.0}, row, {"workload": "w", "mode": "fp8", "error": "x"}]
    add_speedups(runs)
    assert runs[1]["speedup"] == pytest.approx(1.2) and runs[2]["speedup"] is None
    with pytest.raises(ValueError, match="no timed step"):
        summarize(metrics[:1], "bf16", "w")
    assert first_step_times(metrics[:1]) == {"first_step_s": 100.0}  # what a cut-off run keeps
    assert first_step_times([]) == {}
    cuda = [dict(m, **{"mem/peak_gib": 40.0 + m["step"], "mem/alloc_retries": 0.0}) for m in metrics]
    assert summarize(cuda, "bf16", "w")["mem_peak_gib"] == 42.0 and "mem_peak_gib" not in row


def test_driver_runs_each_mode_and_writes_results(tmp_path):
    p = subprocess.run([sys.executable, "-m", "bench.step", "--config", str(ROOT / "configs/tiny_cpu.yaml"),
                        "--modes", "bf16,fp8kv", "--steps", "2", "--out", str(tmp_path), "--runs", str(tmp_path / "runs"),
                        "train.val_every=0", "rollout.prompts_per_step=4", "train.micro_batch_size=32",
                        "log.tensorboard=false", "log.profile_step=1", "log.profile_rollout=false"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for mode in ("bf16", "fp8kv"):  # the trainer phases' operator tables come back next to the logs
        assert "Self CPU" in (tmp_path / f"profile_{mode}_step_000001_rank0.txt").read_text()
    doc = json.loads((tmp_path / "step.json").read_text())
    assert [r["mode"] for r in doc["runs"]] == ["bf16", "fp8kv"]
    assert all(r["step_s"] > 0 and r["timed_steps"] == 1 for r in doc["runs"])
    assert doc["runs"][1]["recalibrate_s"] > 0 and "speedup" in doc["runs"][1]
    assert (tmp_path / "step_fp8kv.log").is_file() and "| fp8kv |" in p.stdout


def test_merge_combines_per_gpu_files_and_recomputes_speedups(tmp_path):
    def doc(device, runs):
        return {"device": device, "date": "2026-11-22", "command": "x", "runs": runs}

    (tmp_path / "a.json").write_text(json.dumps(doc("H200", [{"workload": "w", "mode": "bf16", "step_s": 6.0}])))
    (tmp_path / "b.json").write_text(json.dumps(doc("H200", [{"workload": "w", "mode": "fp8kv", "step_s": 4.0}])))
    (tmp_path / "c.json").write_text(json.dumps(doc("H100", [])))
    cmd = [sys.executable, "-m", "bench.step", "--out", str(tmp_path / "out"), "--merge"]
    p = subprocess.run([*cmd, str(tmp_path / "a.json"), str(tmp_path / "b.json")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    merged = json.loads((tmp_path / "out/step.json").read_text())
    assert merged["device"] == "H200" and [r["mode"] for r in merged["runs"]] == ["bf16", "fp8kv"]
    assert merged["runs"][1]["speedup"] == pytest.approx(1.5)
    p = subprocess.run([*cmd, str(tmp_path / "a.json"), str(tmp_path / "c.json")], capture_output=True, text=True)
    assert p.returncode != 0 and "different devices" in p.stderr


def test_scaling_plot_reads_both_sources_and_reports_speedups(tmp_path):
    step = {"device": "H200", "runs": [{"workload": "w, micro-batch 16", "mode": "bf16", "step_s": 6.0,
                                        "rollout_s": 2.0, "train_s": 3.0}]}
    (tmp_path / "step.json").write_text(json.dumps(step))
    recs = [{"step": 0, "time/step": 60.0}, {"step": 1, "time/step": 4.0, "time/train": 1.5},
            {"step": 2, "time/step": 2.0, "time/train": 1.5}]  # median of timed steps: 3.0 s
    (tmp_path / "m.jsonl").write_text("\n".join(map(json.dumps, recs)))
    p = subprocess.run([sys.executable, "-m", "scripts.plot_scaling", "--one", str(tmp_path / "step.json"),
                        "--match", "micro-batch 16", "--two", f"2 GPUs={tmp_path / 'm.jsonl'}", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "| 1 GPU | 6.00 |" in p.stdout and "| 2 GPUs | 3.00 |" in p.stdout and "| 2.00x |" in p.stdout
    assert (tmp_path / "scaling_step8b.png").stat().st_size > 10_000
