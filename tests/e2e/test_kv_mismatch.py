"""scripts/kv_mismatch.py: each variant's command line, the rows and the per-layer amax table from metrics
files, bad input, --merge, and the script end to end on CPU (tiny_cpu, HF engine's FP8 KV emulation);
scripts/qkv_rounding.py on the real model."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config import load_config
from scripts import common, kv_mismatch, qkv_rounding

ROOT = Path(__file__).resolve().parents[2]

TINY = ["--cpu", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--model", "tiny", "--prompts", "2", "--n", "4",
        "--max-new-tokens", "8", "--steps", "2"]


@pytest.mark.parametrize("variant, kv, attention, recalibrate", [
    ("bf16", False, "fa3", True), ("fp8kv_fa3", True, "fa3", True), ("fp8kv_fa3_norecal", True, "fa3", False),
    ("fp8kv_xqa", True, "xqa", True), ("fp8kv_triton", True, "triton", True),
    ("fp8kv_triton_norecal", True, "triton", False)])
def test_command_sets_the_variant_on_gsm8k(tmp_path, variant, kv, attention, recalibrate):
    a = kv_mismatch.build_parser().parse_args(["--model", str(tmp_path), "--prompts", "4", "--n", "2"])
    data = common.synthetic_gsm8k(tmp_path / "data")
    cmd = kv_mismatch.command(variant, Path(a.config), kv_mismatch.short_run(a, data), tmp_path / "runs", ["optim.lr=1e-6"])
    assert cmd[1:4] == [str(ROOT / "train_grpo.py"), "--config", str(ROOT / "configs/gsm8k.yaml")]
    cfg = load_config(cmd[3], cmd[4:])
    f = cfg.fp8
    assert (f.kv_cache, f.kv_attention, f.recalibrate, f.train, f.rollout) == (kv, attention, recalibrate, False, False)
    assert (cfg.model.name_or_path, cfg.rollout.engine, cfg.rollout.prompts_per_step, cfg.rollout.n) == \
        (str(tmp_path), "vllm", 4, 2)
    assert (cfg.data.source, cfg.data.path, cfg.data.answer_regex) == ("jsonl", str(data / "train.jsonl"), "#### (.*)")
    assert (cfg.train.run_name, cfg.train.out_dir, cfg.optim.lr) == (variant, str(tmp_path / "runs"), 1e-6)
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 60 and all(r["answer"].rsplit("#### ", 1)[1].lstrip("-").isdigit() for r in rows)


def test_row_skips_step_0_and_reads_every_mismatch_metric():
    metrics = [{"step": s, "mismatch/token_mult_prob_error": e, "mismatch/kl": k, "response/length_mean": 100.0 + s}
               for s, e, k in ((0, 1.2, 0.1), (1, 1.1, 0.02), (2, 1.3, 0.04))] + [{"step": 3, "val/accuracy": 0.5}]
    r = kv_mismatch.row("fp8kv_fa3", metrics, 12.34, 0)
    assert r["ok"] and r["steps"] == 3 and r["per_step"] == [1.2, 1.1, 1.3] and r["wall_s"] == 12.3
    assert r["token_mult_prob_error"] == {"mean": 1.2, "min": 1.1, "max": 1.3}
    assert r["mismatch"]["kl"] == pytest.approx(0.03) and r["response_length_mean"]["max"] == 102.0
    only0 = kv_mismatch.row("bf16", metrics[:1], 1.0, 1)
    assert not only0["ok"] and only0["token_mult_prob_error"] is None and only0["mismatch"] == {}


def test_layer_amax_takes_each_layers_largest_and_the_last_scales():
    cal = [{"step": 0, "amax": {"0": [896.0, 2.0, 1.0], "1": [4.0, 8.0, 16.0]}, "scales": {"0": [2.1, 0.1, 0.1], "1": [1, 1, 1]}},
           {"step": 1, "amax": {"0": [448.0, 4.0, 0.5], "1": [2.0, 2.0, 2.0]}, "scales": {"0": [1.05, 0.2, 0.2], "1": [2, 2, 2]}}]
    t = kv_mismatch.layer_amax(cal)
    assert list(t) == [0, 1] and t[0]["amax"] == [896.0, 4.0, 1.0] and t[0]["amax_over_448"][0] == 2.0
    assert t[0]["scales"] == [1.05, 0.2, 0.2] and t[1]["amax"] == [4.0, 8.0, 16.0]
    md = kv_mismatch.markdown([kv_mismatch.row("bf16", [], 1.0, 1)], {"fp8kv_fa3": t})
    assert "| 0 | 896.000 | 4.000 | 1.000 | 2.0000 |" in md and "largest: q 2.0000 (layer 0)" in md


@pytest.mark.parametrize("argv, message", [
    (["--variants", "bf16,fp8"], "error: --variants bf16,fp8: give a comma list of bf16, fp8kv_fa3,"),
    (["--steps", "0"], "error: --steps 0: must be >= 1"),
    (["--model", "/no/such/model"], "error: --model /no/such/model: not a HF model dir (no config.json)"),
    (["--data", "/no/such/dir"], "error: --data /no/such/dir: no train.jsonl there"),
    (["--merge", "/no/such.json"], "error: --merge /no/such.json: no such file"),
    (["fp8.kv_attention=flashinfer"], "error: "),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    argv = [*TINY, "--out", str(tmp_path), *argv]  # (a second --model wins)
    with pytest.raises(SystemExit) as e:
        kv_mismatch.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(message), err


def test_end_to_end_on_cpu_then_merge(tmp_path):
    """bf16 and fp8kv_fa3 for 2 steps each: a row per variant with its per-step mismatch, the recalibrated
    run's per-layer amax (from its kv_calibration.jsonl: the calibration before step 0 and after each
    step); then a call that starts nothing (--time-limit) keeps both rows through --merge."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "scripts.kv_mismatch", *TINY, "--variants", "bf16,fp8kv_fa3",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((out / "kv_mismatch.json").read_text())
    rows = {r["variant"]: r for r in res["variants"]}
    assert list(rows) == ["bf16", "fp8kv_fa3"] and all(r["ok"] and r["steps"] == 2 for r in rows.values())
    for r in rows.values():
        e = r["token_mult_prob_error"]
        assert len(r["per_step"]) == 2 and e["min"] <= e["mean"] <= e["max"] and e["mean"] >= 1.0
        assert "kl" in r["mismatch"] and (out / f"{r['variant']}.log").is_file()
    assert set(rows["fp8kv_fa3"]["scale_mean"]) == {"q", "k", "v"} and rows["bf16"]["scale_mean"] == {}
    cal = [json.loads(x) for x in (out / "fp8kv_fa3_kv_calibration.jsonl").read_text().splitlines()]
    assert [c["step"] for c in cal] == [0, 1, 2] and all(set(c["amax"]) == set(c["scales"]) == {"0", "1"} for c in cal)
    assert not (out / "bf16_kv_calibration.jsonl").exists() and list(res["amax"]) == ["fp8kv_fa3"]
    for layer in res["amax"]["fp8kv_fa3"].values():
        assert all(a > 0 for a in layer["amax"])
        assert layer["amax_over_448"] == [round(a / 448, 4) for a in layer["amax"]]
    md = (out / "kv_mismatch.md").read_text()
    assert "| bf16 | True | 2 |" in md and "| fp8kv_fa3 | True | 2 |" in md and "| 1 | " in md

    again = tmp_path / "again"
    p = subprocess.run([sys.executable, "-m", "scripts.kv_mismatch", *TINY, "--variants", "fp8kv_triton",
                        "--time-limit", "1", "--merge", str(out / "kv_mismatch.json"), "--out", str(again)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]                                    # fp8kv_triton did not run
    res2 = json.loads((again / "kv_mismatch.json").read_text())
    assert [r["variant"] for r in res2["variants"]] == ["bf16", "fp8kv_fa3", "fp8kv_triton"]
    assert res2["variants"][:2] == res["variants"] and res2["variants"][2]["rc"] == "not started (--time-limit)"
    assert res2["amax"] == res["amax"]


def test_run_logged_stops_a_run_past_its_timeout(tmp_path):
    """common.run_logged (each variant's run): the whole process group stopped at the timeout (the
    child's own child too), rc 124, the metrics it logged so far; the run dir emptied first."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 9}\n')
    child = "import json, pathlib, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; " \
            f"time.sleep(600)']); pathlib.Path({str(tmp_path / 'run')!r}).mkdir(); " \
            f"pathlib.Path({str(tmp_path / 'grandchild')!r}).write_text(str(p.pid)); " \
            f"pathlib.Path({str(tmp_path / 'run' / 'metrics.jsonl')!r}).write_text(json.dumps({{'step': 0}}) + '\\n'); " \
            "print('started', flush=True); time.sleep(600)"
    t0 = time.time()
    metrics, rc = common.run_logged([sys.executable, "-c", child], tmp_path / "run", tmp_path / "log", 20)
    assert rc == 124 and metrics == [{"step": 0}] and time.time() - t0 < 300  # not the child's 600 s
    assert (tmp_path / "log").read_text() == "started\n"
    status = Path(f"/proc/{(tmp_path / 'grandchild').read_text()}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()  # gone (or dead, not yet reaped)


def test_qkv_rounding_on_the_real_model(real_model_dir, tmp_path):
    """scripts/qkv_rounding.py: every case (q, k, v, kv, qkv x calibrated / unit scales) scored on the
    sampled completions; a count below 1 is a one-line error."""
    script = [sys.executable, "-m", "scripts.qkv_rounding"]
    p = subprocess.run([*script, "--model", str(real_model_dir), "--prompts", "1", "--max-new-tokens", "8",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "qkv_rounding.json").read_text())
    assert [(c["rounded"], c["scales"]) for c in res["cases"]] == \
        [(w, s) for w in qkv_rounding.CASES for s in ("calibrated", "unit")]
    assert res["tokens"] > 0 and res["sequences"] == 2 and len(res["scales"]) == 30
    assert all(c["token_mult_prob_error"] >= 1.0 for c in res["cases"])
    assert "| kv | unit |" in (tmp_path / "qkv_rounding.md").read_text()
    p = subprocess.run([*script, "--samples", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == "error: --samples 0: must be >= 1"
