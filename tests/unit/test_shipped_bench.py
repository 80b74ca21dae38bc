"""scripts/flagship_check.py --shipped: each FP8 config and its BF16 twin at the config's own workload
(n, generation budget, micro-batch, optimizer steps per step), and the pair rows of
bench/results/shipped_<gpu>.json."""

import json
from pathlib import Path

import pytest

from config import load_config
from scripts import flagship_check as fc

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config", ["llama31_8b_fp8", "llama31_8b_bf16", "qwen3_8b_fp8_kv", "qwen3_8b_bf16"])
def test_shipped_run_keeps_the_configs_own_workload(config):
    own = load_config(REPO / "configs" / f"{config}.yaml")
    cfg = load_config(REPO / "configs" / f"{config}.yaml", fc.shipped_run(config, 8))
    r, t = cfg.rollout, cfg.train
    assert (r.n, r.max_new_tokens, t.micro_batch_size) == (own.rollout.n, own.rollout.max_new_tokens,
                                                           own.train.micro_batch_size) == (32, 3584, 4)
    assert r.prompts_per_step * r.n // t.mini_batch_size == \
        own.rollout.prompts_per_step * own.rollout.n // own.train.mini_batch_size == 4  # optimizer steps per step
    assert r.ignore_eos and (r.ignore_eos_median, r.ignore_eos_sigma) == fc.LENGTHS and not t.probe
    assert (cfg.fp8, cfg.optim, cfg.loss, r.gpu_memory_utilization, cfg.model.dtype) == \
        (own.fp8, own.optim, own.loss, own.rollout.gpu_memory_utilization, own.model.dtype)


def test_shipped_rows_pair_runs_of_one_gpu_kind():
    run = {"ok": True, "step_s": 100.0, "rollout_s": 60.0, "mem_peak_gib": 120.0, "gpu": "H200", "workload": "w",
           "date": "2026-11-26", "command": "c"}
    results = [{**run, "config": "llama31_8b_bf16", "step_s": 125.0}, {**run, "config": "llama31_8b_fp8"},
               {**run, "config": "qwen3_8b_bf16", "gpu": "H100"}, {**run, "config": "qwen3_8b_fp8_kv"},
               {**run, "config": "qwen3_8b_fp8", "ok": False}]
    results[0]["command"] = "c0"
    rows = fc.shipped_rows(results)
    assert len(rows) == 1  # qwen3: another GPU kind's baseline; qwen3_8b_fp8 failed
    row = rows[0]
    assert (row["config"], row["baseline"], row["ratio"], row["step_s"], row["baseline_step_s"]) == \
        ("llama31_8b_fp8", "llama31_8b_bf16", 1.25, 100.0, 125.0)
    assert (row["gpu"], row["gpus"], row["workload"], row["command"], row["date"]) == ("H200", 1, "w", "c ; c0", "2026-11-26")
    assert row["phases"]["llama31_8b_bf16"]["rollout_s"] == 60.0 and "compiled_in_timed_step" not in row
    # a timed step that compiled graphs (compile/graphs summed over ranks grew in it) is flagged in the row
    results[0]["compiled_graphs"], results[1]["compiled_graphs"] = [10, 10], [12, 18]
    assert fc.shipped_rows(results)[0]["compiled_in_timed_step"] == {"llama31_8b_fp8": 6}


def test_a_run_row_holds_steps_that_moved_no_weight():
    """A step with no gradient to move the weights (all advantages 0) logs no optim/changed_frac: the
    run's row says None (the smallest share over the steps that have one) instead of stopping the whole
    bench, whose other runs' rows would be lost."""
    step = {"time/step": 10.0, "time/rollout": 4.0, "mismatch/token_mult_prob_error": 1.5}
    assert fc.row("a", [step], [], 12.0, 0)["changed_frac"] is None
    r = fc.row("a", [step, {**step, "optim/changed_frac": 0.98}, {**step, "optim/changed_frac": 0.99}], [], 12.0, 0)
    assert (r["changed_frac"], r["steps"], r["step_s"], r["rollout_s"]) == (0.98, 3, 10.0, 4.0)


def test_a_run_row_carries_the_memory_models_peaks(tmp_path):
    """The start-up memory model's peaks, read from the run's log as memory.describe writes them."""
    import memory
    from test_memory import QWEN3_8B, H100, cfg

    e = memory.estimate(QWEN3_8B, cfg("qwen3_8b_fp8_kv", "rollout.gpu_memory_utilization=0.4"), 2, H100)
    log = tmp_path / "run.log"
    log.write_text("INFO vllm noise\n" + "\n".join(f"[rank0]: {line}" for line in memory.describe(e).splitlines()))
    assert fc.memory_model(log) == {"model_trainer_peak_gib": round(e.trainer_peak, 1),
                                    "model_step0_rollout_peak_gib": round(round(e.rollout_peak, 1)
                                                                          + round(e.first_refit, 1), 1)}
    assert fc.memory_model(tmp_path / "absent.log") == {}
    log.write_text("no model here")
    assert fc.memory_model(log) == {}


def fake_runs(monkeypatch, script: Path, gpu: str) -> None:
    """Each run is `script RUN_DIR` (a stand-in for train_grpo.py that writes the metrics) on a `gpu` card,
    nvidia-smi not watched."""
    import sys

    monkeypatch.setattr(fc, "command", lambda config, name, extra, short, steps, runs, *a: [sys.executable, str(script),
                                                                                          str(runs / name)])
    monkeypatch.setattr(fc, "gpu_name", lambda: gpu)
    monkeypatch.setattr(fc, "smi_peak_watcher", lambda path, gpu=None: (path.write_text(""), None)[1])


def test_parallel_runs_one_config_per_gpu(tmp_path, monkeypatch):
    """--parallel --ranks 2: each run gets its own two GPUs (CUDA_VISIBLE_DEVICES), side by side, and every
    run's row lands in flagship.json and the pair rows (a stand-in for train_grpo.py writes the metrics)."""
    import json
    import sys

    fake = tmp_path / "fake_train.py"
    fake.write_text(
        "import json, os, sys, time\n"
        "run = sys.argv[1]; os.makedirs(run, exist_ok=True); time.sleep(0.5)\n"
        "step = {'step': 0, 'time/step': 10.0 if 'bf16' in run else 8.0, 'optim/changed_frac': 1.0,\n"
        "        'mismatch/token_mult_prob_error': 1.0, 'gpu': os.environ.get('CUDA_VISIBLE_DEVICES')}\n"
        "open(os.path.join(run, 'metrics.jsonl'), 'w').write(json.dumps(step) + '\\n')\n")
    fake_runs(monkeypatch, fake, "H200")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(sys, "argv", ["flagship_check.py", "--shipped", "--parallel", "--ranks", "2", "--prompts", "8",
                                      "--configs", "llama31_8b_fp8,llama31_8b_bf16", "--out", str(tmp_path / "out"),
                                      "--runs", str(tmp_path / "runs")])
    with pytest.raises(SystemExit):
        fc.main()
    runs = {r["config"]: r for r in json.loads((tmp_path / "out/flagship.json").read_text())}
    assert set(runs) == {"llama31_8b_fp8", "llama31_8b_bf16"} and all(r["ok"] for r in runs.values())
    gpus = {json.loads((tmp_path / "runs" / c / "metrics.jsonl").read_text())["gpu"] for c in runs}
    assert gpus == {"0,1", "2,3"}  # side by side, two GPUs each
    pair = json.loads((tmp_path / "out/shipped_h200.json").read_text())
    assert len(pair) == 1 and pair[0]["ratio"] == 1.25 and pair[0]["gpus"] == 2
    assert "--parallel --ranks 2" in pair[0]["command"]


def test_ranks_launch_through_torchrun_and_group_the_gpus():
    one = fc.command("llama31_8b_fp8", "a", [], [], 2, Path("/r"), 12, [])
    two = fc.command("llama31_8b_fp8", "a", [], [], 2, Path("/r"), 12, [], ranks=2)
    assert one[1].endswith("train_grpo.py") and two[1:5] == ["-m", "torch.distributed.run", "--standalone",
                                                              "--nproc_per_node=2"]
    assert two[5:] == one[1:]
    assert fc.gpu_slots(["0", "1", "2", "3"], 2) == ["0,1", "2,3"] and fc.gpu_slots(["0", "1", "2"], 2) == ["0,1"]
    assert fc.gpu_slots(["0"], 2) == [] and fc.gpu_slots([None], 2) == [None]


def test_merge_names_an_override_it_swallowed(tmp_path):
    """--merge takes every word after it: an override there is named as such, exit 2, nothing written."""
    import subprocess
    import sys

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "scripts.flagship_check", "--shipped", "--out", str(out),
                        "--configs", "qwen3_8b_bf16", "--merge", "rollout.gpu_memory_utilization=0.4"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and not out.exists()
    assert p.stderr.startswith("error: --merge rollout.gpu_memory_utilization=0.4: no such file")
    assert "give overrides before --merge" in p.stderr


def test_async_runs_each_config_synchronous_and_async_on_two_gpus(tmp_path, monkeypatch):
    """--async: <config> on 2 GPUs as shipped (colocated) and <config>_async (a trainer rank + an engine rank at
    --async-share), paired in async_<gpu>.json as sync step s / async step s."""
    import json
    import sys

    assert fc.plan("llama31_8b_fp8", ["on"], 0.9) == [
        ("llama31_8b_fp8", "llama31_8b_fp8", []),
        ("llama31_8b_fp8_async", "llama31_8b_fp8", ["rollout.mode=async", "rollout.gpu_memory_utilization=0.9"])]
    seen = []

    def command(config, name, extra, short, steps, runs, moe_layers, overrides, ranks):
        seen.append((name, extra, ranks, steps))
        return [sys.executable, "-c", "import json, os; os.makedirs(r'%s', exist_ok=True); open(r'%s', 'w').write("
                "json.dumps({'step': 0, 'time/step': %s, 'optim/changed_frac': 1.0, "
                "'mismatch/token_mult_prob_error': 1.0}))" % (runs / name, runs / name / "metrics.jsonl",
                                                              8.0 if name.endswith("_async") else 10.0)]

    monkeypatch.setattr(fc, "command", command)
    monkeypatch.setattr(fc, "gpu_name", lambda: "H200")
    monkeypatch.setattr(fc, "smi_peak_watcher", lambda path, gpu=None: (path.write_text(""), None)[1])
    monkeypatch.setattr(sys, "argv", ["flagship_check.py", "--shipped", "--async", "--steps", "3", "--prompts", "8",
                                      "--configs", "llama31_8b_fp8", "--out", str(tmp_path / "out"),
                                      "--runs", str(tmp_path / "runs")])
    with pytest.raises(SystemExit):
        fc.main()
    assert sorted(seen) == [("llama31_8b_fp8", [], 2, 3),
                            ("llama31_8b_fp8_async", ["rollout.mode=async", "rollout.gpu_memory_utilization=0.9"], 2, 3)]
    (row,) = json.loads((tmp_path / "out/async_h200.json").read_text())
    assert (row["config"], row["baseline"], row["ratio"], row["gpus"]) == ("llama31_8b_fp8_async", "llama31_8b_fp8", 1.25, 2)
    assert "--async --steps 3 --configs llama31_8b_fp8" in row["command"]


def test_warm_runs_each_config_cold_then_from_the_caches_it_filled(tmp_path, monkeypatch):
    """--warm: each config twice in a row, both with FP8_GRPO_CACHE_DIR = RUNS/cache (emptied first: the first run
    starts cold), the second as <config>_warm; each row's launch_to_step1_s is its wall time less its steps after
    step 0; flagship.md pairs the cold and warm ones. With --parallel, or FP8_GRPO_CACHE_DIR already set, the
    first run would not be cold: exit 2, nothing run."""
    import json
    import os
    import subprocess
    import sys

    assert [r[0] for r in fc.plan("llama31_8b_fp8,llama31_8b_bf16", ["on"], warm=True)] == [
        "llama31_8b_fp8", "llama31_8b_fp8_warm", "llama31_8b_bf16", "llama31_8b_bf16_warm"]
    (tmp_path / "runs/cache/stale").mkdir(parents=True)
    fake = tmp_path / "fake_train.py"
    fake.write_text(  # a step 0 of 0.2 s and a step 1 of 100 s (logged, not slept)
        "import json, os, sys, time\n"
        "run, cache = sys.argv[1], os.environ['FP8_GRPO_CACHE_DIR']; os.makedirs(run, exist_ok=True)\n"
        "cold = not os.path.exists(os.path.join(cache, 'filled')); os.makedirs(cache, exist_ok=True)\n"
        "open(os.path.join(cache, 'filled'), 'w').close(); time.sleep(0.2)\n"
        "rows = [{'step': i, 'time/step': t, 'optim/changed_frac': 1.0, 'mismatch/token_mult_prob_error': 1.0,\n"
        "         'cold': cold, 'stale': os.path.exists(os.path.join(cache, 'stale'))} for i, t in ((0, 0.2), (1, 100.0))]\n"
        "open(os.path.join(run, 'metrics.jsonl'), 'w').write(''.join(json.dumps(r) + '\\n' for r in rows))\n")
    fake_runs(monkeypatch, fake, "H100")
    monkeypatch.delenv("FP8_GRPO_CACHE_DIR", raising=False)
    monkeypatch.setattr(sys, "argv", ["flagship_check.py", "--warm", "--configs", "llama31_8b_fp8",
                                      "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")])
    with pytest.raises(SystemExit):
        fc.main()
    rows = {r["config"]: r for r in json.loads((tmp_path / "out/flagship.json").read_text())}
    assert set(rows) == {"llama31_8b_fp8", "llama31_8b_fp8_warm"}
    logged = {n: json.loads((tmp_path / "runs" / n / "metrics.jsonl").read_text().splitlines()[0]) for n in rows}
    assert (logged["llama31_8b_fp8"]["cold"], logged["llama31_8b_fp8_warm"]["cold"]) == (True, False)
    assert not any(m["stale"] for m in logged.values())  # the cache dir emptied before the first run
    for r in rows.values():  # wall time less step 1's logged 100 s: negative, as nothing slept that long
        assert abs(r["launch_to_step1_s"] - (r["wall_s"] - 100.0)) < 0.11 and r["step0_s"] == 0.2
    assert "| llama31_8b_fp8 | " in (tmp_path / "out/flagship.md").read_text().split("launch to step 1, cold s")[1]
    for extra, env in ((["--parallel"], {}), ([], {"FP8_GRPO_CACHE_DIR": str(tmp_path / "mine")})):
        p = subprocess.run([sys.executable, "-m", "scripts.flagship_check", "--warm", *extra, "--configs",
                            "llama31_8b_fp8", "--out", str(tmp_path / "o2")], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **env})
        assert p.returncode == 2 and p.stderr.startswith("error: --warm: ") and not (tmp_path / "o2").exists()


def test_async_needs_shipped(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "scripts.flagship_check", "--async", "--out", str(tmp_path / "o"),
                        "--configs", "llama31_8b_fp8"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: --async compares") and not (tmp_path / "o").exists()


def test_plot_shipped_draws_the_last_pair_of_each_config_and_gpu(tmp_path):
    """scripts/plot_shipped.py: a later row of the same config and GPU kind replaces the earlier one; the
    rest of the step is what the three phases leave; each run shows its own overrides (a merged pair's
    command holds two); an unreadable results file is a one-line error."""
    import subprocess
    import sys

    phases = {"qwen3_8b_fp8_kv": {"step_s": 60.0, "rollout_s": 30.0, "logprobs_s": 6.0, "train_s": 22.0},
              "qwen3_8b_bf16": {"step_s": 90.0, "rollout_s": 40.0, "logprobs_s": 7.0, "train_s": 41.0}}
    cmd = "bash scripts/gpu_check.sh shipped --prompts 8 --ranks 2 --configs"
    row = {"config": "qwen3_8b_fp8_kv", "baseline": "qwen3_8b_bf16", "ratio": 1.5, "gpu": "H100", "gpus": 2,
           "workload": "8 prompts x 32 samples", "date": "2026-11-28", "phases": phases,
           "command": f"{cmd} qwen3_8b_fp8_kv train.micro_batch_size=4 ; {cmd} qwen3_8b_bf16 rollout.gpu_memory_utilization=0.4"}
    path = tmp_path / "shipped_h100.json"
    path.write_text(json.dumps([{**row, "ratio": 0.9, "date": "2026-11-26"}, row]))
    script = [sys.executable, "-m", "scripts.plot_shipped"]
    out = subprocess.run([*script, "--results", str(path), "--out", str(tmp_path / "figs")],
                         capture_output=True, text=True, check=True).stdout
    assert "| qwen3_8b_fp8_kv | 2 x H100 | 2026-11-28 | micro_batch_size=4 | 60.0 | 30.00 | 6.00 | 22.00 | 2.00 | 1.5 |" in out
    assert "| qwen3_8b_bf16 | 2 x H100 | 2026-11-28 | gpu_memory_utilization=0.4 | 90.0 |" in out  # its own
    assert "2026-11-26" not in out and (tmp_path / "figs/shipped_pairs.png").stat().st_size > 0
    bad = subprocess.run([*script, "--results", str(tmp_path / "missing.json")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --results") and len(bad.stderr.splitlines()) == 1


@pytest.mark.parametrize("config,multiple", [("llama31_8b_fp8", 32), ("llama31_8b_bf16", 8)])
def test_attention_bench_cuts_a_step_as_the_8b_trainer_does(config, multiple):
    """bench/attention.py's --multiple for each 8B config is the trainer's on a GPU (FP8 GEMMs' 128 tokens over
    4 rows; Inductor's 8), and a step's lengths are one per micro-batch, longest first, each a multiple."""
    import torch

    from bench.attention import step_lengths
    from fp8.quant import BLOCK
    from trainer import length_multiples

    cfg = load_config(REPO / f"configs/{config}.yaml")
    tokens = BLOCK if cfg.fp8.train else 1
    rows = 16 * cfg.rollout.n
    assert length_multiples(cfg, tokens, rows, torch.device("cuda")) == (multiple, 8)
    lengths = step_lengths(16, cfg.rollout.n, 128, cfg.rollout.max_new_tokens, cfg.train.micro_batch_size,
                           multiple, seed=0)
    assert len(lengths) == rows // cfg.train.micro_batch_size
    assert lengths == sorted(lengths, reverse=True) and all(n % multiple == 0 for n in lengths)
    assert 128 + 1 <= lengths[-1] and lengths[0] < 128 + cfg.rollout.max_new_tokens + multiple
