"""scripts/real_learn.py: the task files, the per-run rows and per-mode summary from metrics files, bad input,
and the script end to end on CPU (tiny_cpu's model built from scratch, HF engine)."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import real_learn  # noqa: E402


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
        r = [{"step": 0, "val/accuracy": v0}] + [{"step": s, "reward/mean": 0.1 * s, real_learn.MISMATCH: 0.01}
                                                 for s in range(steps)]
        return r + ([{"step": 3, "val/accuracy": vend}] if vend is not None else [])
    runs = [{"mode": "fp8kv", "seed": 0, **real_learn.summarize(rows(0.1, 0.3), 3)},
            {"mode": "fp8kv", "seed": 1, **real_learn.summarize(rows(0.1, 0.5), 3)},
            {"mode": "bf16", "seed": 0, **real_learn.summarize(rows(0.2, 0.3), 3)},
            {"mode": "bf16", "seed": 1, **real_learn.summarize(rows(0.2, None, steps=2), 3)}]
    assert runs[0]["gain"] == pytest.approx(0.2) and runs[0]["reward_last5"] == pytest.approx(0.1)
    assert not runs[3]["finished"] and runs[3]["gain"] is None and runs[3]["steps_logged"] == 2
    agg = real_learn.aggregate(runs, ["fp8kv", "bf16"])
    assert agg["fp8kv"]["gain_mean"] == pytest.approx(0.3) and agg["fp8kv"]["gain_std"] == pytest.approx(0.1414, abs=1e-3)
    assert agg["bf16"]["finished"] == 1 and agg["bf16"]["gain_std"] is None
    assert agg["gap_gain"] == pytest.approx(0.2)
    md = real_learn.markdown(runs, agg, ["fp8kv", "bf16"])
    assert "| fp8kv | 0 | 0.100 | 0.300 | +0.200 | 3 |" in md and "2 (unfinished)" in md and "fp8kv - bf16: gain +0.200" in md


@pytest.mark.parametrize("argv, says", [
    (["--modes", "fp8"], "error: --modes fp8"), (["--task", "add3"], "error: --task add3"),
    (["--seeds", "a"], "error: --seeds"), (["--steps", "0"], "error: --steps 0"),
    (["--model", "/nonexistent"], "error: --model /nonexistent"), (["--model", "tiny", "train.bogus=1"], "train.bogus")])
def test_bad_input_exits_2(tmp_path, argv, says):
    p = subprocess.run([sys.executable, str(ROOT / "scripts/real_learn.py"), "--cpu", "--config",
                        str(ROOT / "configs/tiny_cpu.yaml"), "--out", str(tmp_path / "out"), "--work",
                        str(tmp_path / "work"), *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and says in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_end_to_end_on_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run([sys.executable, str(ROOT / "scripts/real_learn.py"), "--cpu", "--model", "tiny", "--config",
                        str(ROOT / "configs/tiny_cpu.yaml"), "--seeds", "0", "--steps", "2", "--prompts", "4",
                        "--n", "4", "--max-new-tokens", "4", "--out", str(out), "--work", str(work),
                        "train.micro_batch_size=16"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "real_learn.json").read_text())
    assert [(r["mode"], r["seed"]) for r in res["runs"]] == [("fp8kv", 0), ("bf16", 0)]
    for r in res["runs"]:
        assert r["finished"] and r["steps_logged"] == 2 and r["rc"] == 0
        assert r["gain"] == pytest.approx(r["val_final"] - r["val_step0"]) and r["reward_first5"] is not None
    assert res["runs"][0]["token_mult_prob_error"] is not None
    assert res["summary"]["fp8kv"]["finished"] == 1 and "gap_gain" in res["summary"] and res["unfinished"] == []
    assert "fp8.kv_cache=true" in res["commands"]["fp8kv_s0"] and "fp8.kv_cache=false" in res["commands"]["bf16_s0"]
    assert "| fp8kv | 0 |" in (out / "real_learn.md").read_text()
    with tarfile.open(out / "real_learn_runs.tgz") as tar:
        assert {"real_learn.json", "real_learn.md", "fp8kv_s0_metrics.jsonl", "bf16_s0.log"} <= set(tar.getnames())
