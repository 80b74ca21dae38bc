"""The convergence study's tooling: ablation configs, plot/table script, and the one-call driver."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from config import load_config

from scripts import plot_runs

ROOT = Path(__file__).resolve().parents[2]

ABLATIONS = {  # name: (fp8.train, fp8.rollout, fp8.kv_cache, loss.is_correction)
    "bf16": (False, False, False, "tis"),
    "fp8_tis": (True, True, False, "tis"),
    "fp8_nois": (True, True, False, "none"),
    "fp8kv_tis": (True, True, True, "tis"),
    "fp8rollout_tis": (False, True, False, "tis"),
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_ablation_configs_load_and_differ_only_where_they_say(name):
    cfg = load_config(ROOT / "configs/ablations" / f"{name}.yaml")
    assert (cfg.fp8.train, cfg.fp8.rollout, cfg.fp8.kv_cache, cfg.loss.is_correction) == ABLATIONS[name]
    base = load_config(ROOT / "configs/ablations/base.yaml")
    assert (cfg.rollout, cfg.optim, cfg.train, cfg.data) == (base.rollout, base.optim, base.train, base.data)
    assert cfg.fp8.recalibrate and cfg.loss.is_cap == 2.0
    assert cfg.model.name_or_path == "/tmp/conv/sft_model" and cfg.model.dtype == "float32"
    # five runs share one GPU: engines stay resident and small, start-up is short
    assert cfg.rollout.engine == "vllm" and not cfg.rollout.sleep_mode and cfg.rollout.enforce_eager
    assert 5 * cfg.rollout.gpu_memory_utilization <= 0.5
    assert cfg.data.synthetic.disjoint_val and cfg.train.val_every > 0


def test_every_ablation_has_a_config():
    assert {p.stem for p in (ROOT / "configs/ablations").glob("*.yaml")} == set(ABLATIONS) | {"base", "tiny_cpu_is",
                                                                                             "tiny_cpu_is_async"}


def test_cpu_is_ablation_is_tiny_cpu_with_an_engine_whose_attention_clips():
    """tiny_cpu_is: tiny_cpu's run, plus the engine's FP8 KV cache with scales below the amax (the mismatch the
    IS variants act on; docs/configs.md#tiny_cpu_is-the-importance-sampling-ablation) and icepop's band [0.5, 2]."""
    cfg = load_config(ROOT / "configs/ablations/tiny_cpu_is.yaml")
    tiny = load_config(ROOT / "configs/tiny_cpu.yaml")
    assert (cfg.model, cfg.data, cfg.rollout, cfg.optim, cfg.train) == (tiny.model, tiny.data, tiny.rollout, tiny.optim,
                                                                         tiny.train)
    assert cfg.fp8.train and cfg.fp8.rollout and cfg.fp8.kv_cache and cfg.fp8.recalibrate
    assert cfg.fp8.calib_margin < 1 < tiny.fp8.calib_margin  # the engine saturates what the trainer keeps
    assert (cfg.loss.is_correction, cfg.loss.is_cap, cfg.loss.is_floor) == ("tis", 2.0, 0.5)
    assert cfg.rollout.engine == "hf" and cfg.rollout.mode == "colocated"  # one process: runs as CI runs it


def test_cpu_is_ablation_with_a_lagging_engine_is_tiny_cpu_one_step_off_policy():
    """tiny_cpu_is_async: tiny_cpu's run with the engine's FP8 KV cache at its usual scales and the engine one
    optimizer step behind (rollout.mode=async, max_staleness 1: the lag the IS variants act on there;
    docs/configs.md#tiny_cpu_is_async-when-the-mismatch-is-the-engines-lag), icepop's band [0.5, 2]."""
    cfg = load_config(ROOT / "configs/ablations/tiny_cpu_is_async.yaml")
    tiny = load_config(ROOT / "configs/tiny_cpu.yaml")
    assert (cfg.model, cfg.data, cfg.optim, cfg.train) == (tiny.model, tiny.data, tiny.optim, tiny.train)
    assert (cfg.rollout.mode, cfg.rollout.max_staleness, cfg.rollout.engine) == ("async", 1, "hf")
    assert cfg.fp8.train and cfg.fp8.rollout and cfg.fp8.kv_cache and cfg.fp8.calib_margin == tiny.fp8.calib_margin
    assert (cfg.loss.is_correction, cfg.loss.is_cap, cfg.loss.is_floor) == ("tis", 2.0, 0.5)


def write_run(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "reward/me')  # killed mid-line


def rows(vals, mism, trunc, steps_per_val=2, final=None):
    out = []
    for i, (m, t) in enumerate(zip(mism, trunc)):
        r = {"step": i, "reward/mean": 0.1 * i, "mismatch/token_mult_prob_error": m, "is/truncated_frac": t}
        if i % steps_per_val == 0:
            r["val/accuracy"] = vals[i // steps_per_val]
        out.append(r)
    if final is not None:
        out.append({"step": len(mism), "val/accuracy": final})
    return out


def test_plot_runs_table_and_figures(tmp_path):
    d = tmp_path / "metrics"
    d.mkdir()
    # bf16: 2 seeds, 4 steps + final val at step 4; fp8_tis: 1 seed cut after 3 steps (val at 0, 2)
    write_run(d / "conv_bf16_s0_metrics.jsonl", rows([0.2, 0.4], [1.01, 1.03, 1.02, 1.00], [0, 0, 0.1, 0], final=0.5))
    write_run(d / "conv_bf16_s1_metrics.jsonl", rows([0.3, 0.6], [1.00, 1.00, 1.00, 1.00], [0, 0, 0, 0], final=0.4))
    write_run(d / "conv_fp8_tis_s0_metrics.jsonl", rows([0.25, 0.35], [1.05, 1.07, 1.06], [0.2, 0.1, 0.3]))
    out = tmp_path / "figs"
    table, S = plot_runs.main([str(d), "--out", str(out)])
    names = ["val_accuracy", "reward", "mismatch", "is_truncated", "summary"]
    for n in names:
        assert (out / f"convergence_{n}.png").stat().st_size > 1000, n
    by = {r["config"]: r for r in table}
    assert list(by) == ["bf16", "fp8_tis"] and by["bf16"]["seeds"] == [0, 1]
    approx = pytest.approx
    assert S == 2  # the last validation step every run logged
    assert by["bf16"]["val0"] == approx(((0.2 + 0.3) / 2, 0.05))
    assert by["bf16"]["final"] == approx(((0.5 + 0.4) / 2, 0.05)) and by["bf16"]["steps"] == (4, 4)
    assert by["bf16"]["best"] == approx(((0.5 + 0.6) / 2, 0.05))
    assert by["bf16"]["gain"] == approx(((0.3 + 0.1) / 2, 0.1))  # each run's final minus its own val@0
    assert by["bf16"]["val_at_S"] == approx(((0.4 + 0.6) / 2, 0.1))
    assert by["bf16"]["mismatch"] == approx(((1.015 + 1.0) / 2, 0.0075))
    assert by["bf16"]["is_trunc"] == approx(((0.025 + 0.0) / 2, 0.0125))
    assert by["fp8_tis"]["final"] == approx((0.35, 0.0)) and by["fp8_tis"]["steps"] == (2, 2)
    assert by["fp8_tis"]["mismatch"] == approx((1.06, 0.0)) and by["fp8_tis"]["is_trunc"] == approx((0.2, 0.0))
    md = (out / "convergence_table.md").read_text()
    assert "| bf16 | 0,1 | 4 | 0.250 ± 0.050 | 0.450 ± 0.050 | 0.200 ± 0.100 | 0.550 ± 0.050 | 0.500 ± 0.100 | " \
           "1.0075 ± 0.0075 |" in md
    assert "| fp8_tis | 0 | 2 |" in md and "val@2" in md
    assert "routing" not in md and not (out / "convergence_routing_mismatch.png").exists()  # dense runs


def test_permutation_p_counts_every_split_at_least_as_far_apart():
    # 3 + 3 runs: 20 splits; only the observed one and its mirror are 3 apart
    assert plot_runs.permutation_p([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == pytest.approx(2 / 20)
    assert plot_runs.permutation_p([1.0, 2.0], [1.0, 2.0]) == 1.0  # no difference: every split is as far
    a, b = [0.1 * i for i in range(10)], [0.1 * i + 0.05 for i in range(10)]  # 184,756 splits: sampled, seeded
    assert plot_runs.permutation_p(a, b) == plot_runs.permutation_p(a, b) > 0.5


def test_plot_runs_tests_each_pair_of_configs(tmp_path):
    """Configs with 2+ seeds are compared pairwise on final accuracy, second-half accuracy and tail reward;
    a config of one seed is left out of that table."""
    for seed in range(3):
        hi = rows([0.2, 0.6 + 0.1 * seed], [1.0] * 4, [0] * 4, final=0.8 + 0.05 * seed)
        lo = rows([0.2, 0.3 + 0.1 * seed], [1.0] * 4, [0] * 4, final=0.4 + 0.05 * seed)
        for name, r in (("tis", hi), ("icepop", lo)):
            for row in r:
                if "reward/mean" in row:
                    row["reward/mean"] = (0.9 if name == "tis" else 0.5) + 0.01 * seed
            write_run(tmp_path / f"{name}_s{seed}_metrics.jsonl", r)
    write_run(tmp_path / "none_s0_metrics.jsonl", rows([0.2, 0.4], [1.0] * 4, [0] * 4, final=0.5))
    plot_runs.main([str(tmp_path), "--out", str(tmp_path / "figs"), "--prefix", "is", "--tail", "2"])
    md = (tmp_path / "figs/is_table.md").read_text()
    assert "| a - b | final val | val, second half | reward/mean, last 2 |" in md
    # final 0.4 apart, second half (the validations at steps 2 and 4: 0.3 and 0.4 apart) 0.35, reward 0.4;
    # 3 + 3 runs: of the 20 splits only the observed one and its mirror are that far apart
    assert "| icepop - tis | -0.400 (p = 0.100) | -0.350 (p = 0.100) | -0.400 (p = 0.100) |" in md
    assert "none -" not in md and "- none" not in md  # one seed: no test


def test_plot_runs_routing_mismatch_of_moe_runs(tmp_path):
    for seed, routing in ((0, [0.01, 0.03]), (1, [0.02, 0.02])):
        moe_rows = rows([0.2, 0.4], [1.0, 1.0], [0, 0], final=0.5)
        for r, x in zip(moe_rows, routing):
            r["moe/routing_mismatch"] = x
        write_run(tmp_path / f"fp8_replay_s{seed}_metrics.jsonl", moe_rows)
    table, _ = plot_runs.main([str(tmp_path), "--out", str(tmp_path / "figs"), "--prefix", "moe"])
    assert table[0]["routing"] == pytest.approx((0.02, 0.0))
    assert (tmp_path / "figs/moe_routing_mismatch.png").stat().st_size > 1000
    assert "moe/routing_mismatch |" in (tmp_path / "figs/moe_table.md").read_text()


def test_plot_runs_writes_under_the_runs_it_compares_and_skips_notebook_runs(tmp_path, capsys):
    """Without --out the plots and table go to compare/ beside the runs (never the repo's docs/figures, and
    --help says where); the notebooks' scratch runs under runs/notebooks/ are left out unless named."""
    runs = tmp_path / "runs"
    for name, vals in (("fp8_s0", [0.2, 0.4]), ("fp8_s1", [0.3, 0.5]), ("notebooks/batch-1a2b3c4d", [0.0, 0.0])):
        (runs / name).mkdir(parents=True)
        write_run(runs / name / "metrics.jsonl", rows(vals, [1.0] * 4, [0.0] * 4))
    figures = {p: p.stat().st_mtime_ns for p in (ROOT / "docs/figures").iterdir()}
    table, _ = plot_runs.main([str(runs)])
    assert [(r["config"], r["seeds"]) for r in table] == [("fp8", [0, 1])]
    out = runs / "compare"
    assert {p.name for p in out.iterdir()} >= {"convergence_table.md", "convergence_summary.png"}
    assert f"wrote {out / 'convergence_table.md'}" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "docs/figures").iterdir()} == figures
    assert plot_runs.main([str(runs / "notebooks")])[0][0]["config"] == "batch-1a2b3c4d"  # named: included
    assert (runs / "notebooks/compare/convergence_table.md").is_file()
    # two run dirs' files: compare/ in the directory holding both; a script's metrics files: their own dir
    files = [str(runs / "fp8_s0/metrics.jsonl"), str(runs / "fp8_s1/metrics.jsonl")]
    assert plot_runs.default_out(files) == runs / "compare"
    assert plot_runs.default_out([str(tmp_path / "conv_out/conv_bf16_s0_metrics.jsonl")]) == tmp_path / "conv_out/compare"
    help_text = subprocess.run([sys.executable, "-m", "scripts.plot_runs", "--help"], cwd=ROOT, capture_output=True,
                               text=True).stdout
    assert "--out" in help_text and "runs/compare/" in help_text


def test_run_key_names():
    assert plot_runs.run_key(Path("x/conv_fp8kv_tis_s12_metrics.jsonl")) == ("fp8kv_tis", 12)
    assert plot_runs.run_key(Path("runs/fp8_nois_s1/metrics.jsonl")) == ("fp8_nois", 1)
    assert plot_runs.run_key(Path("runs/tiny_cpu-20261122/metrics.jsonl")) == ("tiny_cpu-20261122", 0)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("config, says", [("tiny_cpu_is", "not one of the study's"), ("fp8_tiss", "no configs/")])
def test_convergence_driver_refuses_a_config_outside_the_study(tmp_path, config, says):
    """The CPU ablations sit in configs/ablations/ too but are not the study's (their base is tiny_cpu): refused
    before anything starts, in one line."""
    p = subprocess.run(["bash", str(ROOT / "scripts/convergence.sh"), "--configs", f"bf16,{config}"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "OUT": str(tmp_path / "out")})
    assert p.returncode == 2 and p.stderr.startswith(f"error: --configs {config}: ") and says in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out" / "conv_driver.log").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_convergence_driver_cpu_smoke(tmp_path):
    """The whole driver on CPU at toy size: SFT, a run (HF engine), collect, plot (~40 s on an idle CPU)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "scripts/convergence.sh"), "--configs", "fp8kv_tis", "--steps", "2",
                        "--work", str(tmp_path / "work"), "--deadline-s", "500",
                        "--sft-args", "--toy --device cpu --minutes 0.02 --dev-size 4 --task-overrides "
                                      "train.val_max_prompts=4",
                        "--extra", "rollout.engine=hf train.device=cpu rollout.prompts_per_step=2 rollout.n=2 "
                                   "train.micro_batch_size=4 train.val_max_prompts=4 train.val_every=1"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "out"
    lines = (out / "conv_fp8kv_tis_s0_metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    assert (out / "conv_fp8kv_tis_s0.log").is_file()
    assert json.loads((out / "conv_sft_metrics.json").read_text())["steps"] > 0
    assert (out / "convergence_summary.png").is_file() and "| fp8kv_tis |" in (out / "convergence_table.md").read_text()
    assert all(f.parent == out for f in out.rglob("*") if f.is_file())  # flat
