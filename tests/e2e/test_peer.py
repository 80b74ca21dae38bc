"""bench/peer.py on the CPU: TRL's GRPOTrainer (HF generation) and our BF16 twin on one tiny workload.

Two rollout steps each, TRL's 8 optimizer steps of one micro-batch against ours' (the twin's 4 per rollout
step), on the model dir the benchmark writes (a tiny Llama that never samples a special token, so every
sample runs to the budget in both). optim.name=adamw spares ours the 8-bit AdamW's CPU compile (~20 s);
tests/e2e/test_shipped_configs.py runs the config's own optimizer. Skipped without TRL
(requirements-peer.txt).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def peer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.peer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_trl_and_ours_generate_the_same_tokens(tmp_path):
    pytest.importorskip("trl")
    p = peer("--tiny", "--systems", "trl,ours_bf16", "--steps", "2", "--out", str(tmp_path), "--runs",
             str(tmp_path / "runs"), "optim.name=adamw")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads((tmp_path / "peer_cpu.json").read_text())["rows"]}
    assert set(rows) == {"trl", "ours_bf16"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["gen_tokens"] == 2 * 8 * 8  # prompts x samples x fixed length, counted by each system
        assert r["timed_steps"] == 1 and r["step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["gen_tokens"] / r["step_s"], rel=0.02)
        assert r["gpu"] == "cpu" and r["command"].startswith("python -m bench.peer --tiny") and r["settings"]
    trl = rows["trl"]
    assert trl["rollout_s"] > 0 and trl["train_s"] > 0 and trl["logprobs_s"] >= 0
    assert trl["settings"]["rollout"] == "transformers generate" and trl["tokens_per_s_vs_trl"] == 1.0
    assert rows["ours_bf16"]["settings"]["optimizer"] == "adamw"
    assert "[trl] step 1:" in p.stdout and "[ours_bf16] step 1:" in p.stdout  # progress per step
    md = (tmp_path / "peer_cpu.md").read_text()
    assert "| trl |" in md and "| ours_bf16 |" in md


@pytest.mark.parametrize("args, flag", [(["--steps", "1"], "--steps"), (["--systems", "trl,verl"], "--systems"),
                                        (["rollout.nn=3"], "rollout.nn")])
def test_bad_input_is_one_line_naming_the_flag(tmp_path, args, flag):
    p = peer("--tiny", "--out", str(tmp_path), "--runs", str(tmp_path / "runs"), *args)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().startswith("error: ") and flag in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_the_trl_methods_the_gpu_run_times_exist():
    """The GPU run wraps these (bench/peer.py run_trl); the CPU run above reaches only the first two."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    for owner, name in [(GRPOTrainer, "_generate_single_turn"), (GRPOTrainer, "_generate_and_score_completions"),
                        (VLLMGeneration, "sync_weights"), (VLLMGeneration, "generate")]:
        assert callable(getattr(owner, name, None)), f"{owner.__name__}.{name}"


def test_the_gpu_rows_trl_settings_are_accepted_by_trl(tmp_path, monkeypatch):
    """The 8B workload's GRPOConfig (vLLM colocated, sleep mode, 8-bit AdamW, bf16) as TRL validates it, with
    only its bf16-GPU probe answered: 256 samples a generation in groups of 32, 4 optimizer steps each,
    TRL's IS correction on, fixed-length generations."""
    pytest.importorskip("trl")
    import argparse

    import transformers.training_args as ta
    from trl import GRPOConfig

    from bench import peer as bp
    from config import load_config

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda *a, **k: True)
    args = argparse.Namespace(tiny=False, model_dir=str(tmp_path / "m"), steps=3, overrides=[])
    cfg = load_config(ROOT / "configs" / f"{bp.TWIN}.yaml", bp.workload_overrides(args))
    c = GRPOConfig(**bp.trl_args(cfg, tmp_path / "run", cuda=True))
    assert (c.generation_batch_size, c.num_generations, c.max_completion_length) == (256, 32, 1024)
    assert c.steps_per_generation // c.gradient_accumulation_steps == 4 and c.num_iterations == 1
    assert c.use_vllm and c.vllm_mode == "colocate" and c.vllm_enable_sleep_mode and c.gradient_checkpointing
    assert c.vllm_importance_sampling_correction and c.generation_kwargs == {"ignore_eos": True}
    assert c.learning_rate == cfg.optim.lr and "8bit" in getattr(c.optim, "value", c.optim)
