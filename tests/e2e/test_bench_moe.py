"""The MoE measurements' CPU-testable parts: the Qwen3-30B-A3B cut-layer shape (bench/rollout.py MODELS),
the same shape as model.tiny overrides (scripts/flagship_check.py, bench/alignment.py --moe), the
flagship runs' plan and command lines (router replay on/off, --moe-layers) as the config loader reads
them, and the rollout worker on the MoE shape (--dry-run engine)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import alignment as ba
from bench import rollout as br
from bench import runner
from config import load_config
from modeling import build_char_tokenizer, build_tiny_model
from scripts import common
from scripts import flagship_check as fc

MOE = "qwen3-30b-a3b"
LAYER, OUTER = 623_120_640, 622_331_904  # parameters of one decoder layer; embeddings + lm_head + final norm


def test_moe_shape_is_qwen3_30b_a3b_cut():
    """48 layers give the real 30.5B parameters; the default cut (12 layers) is 8.10B, the 8B configs' size."""
    assert br.parse_models("qwen3-moe,Qwen3-30B-A3B") == [MOE, MOE]
    full = br.meta_model(br.hf_config(MOE, layers=48))
    assert sum(p.numel() for p in full.parameters()) == OUTER + 48 * LAYER == 30_532_122_624
    cfg = br.hf_config(MOE)
    model = br.meta_model(cfg)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and br.MOE_LAYERS == 12
    assert br.param_bytes(model) == 2 * (OUTER + 12 * LAYER)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (128, 2 * 768, 2048) and experts.down_proj.shape == (128, 2048, 768)
    assert model.model.layers[11].mlp.gate.weight.shape == (128, 2048) and cfg.num_experts_per_tok == 8
    assert br.kv_bytes_per_token(cfg, False) == 2 * 12 * 4 * 128 * 2 == 2 * br.kv_bytes_per_token(cfg, True)


@pytest.mark.parametrize("layers", [None, 2])
def test_tiny_override_builds_the_same_model(layers):
    """model.tiny={tiny_flow} through config.load_config builds (modeling.build_tiny_model, meta device)
    the very model bench/rollout.py's HF config does: same parameter names and shapes."""
    cfg = load_config(None, [f"model.tiny={br.tiny_flow(MOE, layers)}"])
    t = cfg.model.tiny
    assert (t.arch, t.num_layers, t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.num_kv_heads) == \
        ("qwen3_moe", layers or 12, 128, 8, 768, 4)
    with torch.device("meta"):
        tiny = build_tiny_model(t, build_char_tokenizer(t.vocab), torch.bfloat16)
    ref = br.meta_model(br.hf_config(MOE, layers))
    assert {n: p.shape for n, p in tiny.named_parameters()} == {n: p.shape for n, p in ref.named_parameters()}
    assert sum(p.numel() for p in tiny.parameters()) == OUTER + (layers or 12) * LAYER


def test_flagship_moe_plan_and_commands(tmp_path):
    """--configs moe expands to the three configs, each run per --router-replay value; the command line a
    run gets loads (train_grpo.py's loader) with the shipped config's settings at the cut shape."""
    assert [r[0] for r in fc.plan("moe", ["on", "off"])] == [
        "qwen3_30b_a3b_bf16", "qwen3_30b_a3b_bf16_noreplay", "qwen3_30b_a3b_fp8", "qwen3_30b_a3b_fp8_noreplay",
        "qwen3_30b_a3b_fp8_kv", "qwen3_30b_a3b_fp8_kv_noreplay"]
    assert fc.plan("qwen3_8b_fp8,qwen3_30b_a3b_fp8", ["off"]) == [
        ("qwen3_8b_fp8", "qwen3_8b_fp8", []),  # dense: no replay key
        ("qwen3_30b_a3b_fp8_noreplay", "qwen3_30b_a3b_fp8", ["moe.router_replay=false"])]
    assert [r[0] for r in fc.plan("8b", ["on"])] == fc.CONFIGS
    assert fc.build_parser().parse_args(["--router-replay", "on,off"]).router_replay == ["on", "off"]
    with pytest.raises(SystemExit):
        fc.build_parser().parse_args(["--router-replay", "maybe"])
    for run, config, extra in fc.plan("moe", ["on", "off"]):
        cmd = fc.command(config, run, extra, fc.SHORT_RUN, 2, tmp_path, 8, ["train.seed=3"])
        assert cmd[1].endswith("train_grpo.py") and cmd[2] == "--config"
        cfg = load_config(cmd[3], cmd[4:])
        t = cfg.model.tiny
        assert (t.arch, t.num_layers, t.hidden_size, t.num_experts, t.vocab_size) == ("qwen3_moe", 8, 2048, 128, 151936)
        assert cfg.moe.router_replay == (not run.endswith("_noreplay")) and cfg.train.seed == 3
        assert cfg.fp8.train == cfg.fp8.rollout == ("fp8" in config) and cfg.fp8.kv_cache == config.endswith("kv")
        assert cfg.optim.name == "adamw8bit_rms" and cfg.model.dtype == "float32" and cfg.rollout.sleep_mode
        assert cfg.train.run_name == run and cfg.rollout.max_new_tokens == 1024
    # the 8B configs' command is unchanged: their family's shape, no layer override
    cmd = fc.command("llama31_8b_fp8", "x", [], fc.SHORT_RUN, 2, tmp_path, 8, [])
    assert cmd[4] == f"model.tiny={common.SHAPES['llama']}" and cmd[5] == fc.SHORT_RUN[0]


def test_flagship_moe_rows(tmp_path):
    """A MoE run's row carries the routing mismatch; --time-limit too short starts nothing and says so;
    an unknown config is a one-line error before anything is written."""
    step = {"time/step": 30.0, "time/rollout": 9.0, "time/refit": 0.5, "mem/peak_gib": 120.0,
            "optim/changed_frac": 0.995, "mismatch/token_mult_prob_error": 1.6, "probe/policy_gain": 0.01,
            "moe/routing_mismatch": 0.0312, "moe/routing_mismatch_tokens": 0.21}
    r = fc.row("qwen3_30b_a3b_fp8", [step, {**step, "moe/routing_mismatch": 0.0401}], [1024 * 119], 200.0, 0)
    assert r["ok"] and r["routing_mismatch"] == 0.0401 and r["routing_mismatch_tokens"] == 0.21
    assert r["refit_s"] == 0.5 and r["smi_peak_gib"] == 119.0 and "compiled_graphs" not in r
    compiled = fc.row("qwen3_8b_fp8", [{**step, "compile/graphs": 6}, {**step, "compile/graphs": 9}], [], 1.0, 0)
    assert compiled["compiled_graphs"] == [6, 9]  # step 1 compiled 3 more graphs: its time includes compiling
    assert "routing_mismatch" not in fc.row("qwen3_8b_fp8", [{k: v for k, v in step.items()
                                                              if not k.startswith("moe/")}], [], 1.0, 0)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "scripts.flagship_check", "--configs", "qwen3_30b_a3b_bf16",
                        "--router-replay", "on,off", "--time-limit", "5", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    rows = json.loads((out / "flagship.json").read_text())
    assert [(x["config"], x["rc"]) for x in rows] == [("qwen3_30b_a3b_bf16", "not started (--time-limit)"),
                                                      ("qwen3_30b_a3b_bf16_noreplay", "not started (--time-limit)")]
    bad = tmp_path / "bad"
    p = subprocess.run([sys.executable, "-m", "scripts.flagship_check", "--configs", "qwen3_30b_a3b_fp9",
                        "--out", str(bad)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: --configs") and "fp9" in p.stderr and not bad.exists()


def test_alignment_moe_shape_and_children():
    """--moe: the 30B width at 4 layers (or --layers) with the char vocab; the children get the shape."""
    cfg = load_config(None, [*ba.shape(True, None), *ba.MODES["fp8kv"], "rollout.engine=vllm"])
    t = cfg.model.tiny
    assert (t.arch, t.num_layers, t.num_experts, t.hidden_size) == ("qwen3_moe", ba.MOE_LAYERS, 128, 2048)
    assert set(t.vocab) == {chr(c) for c in range(32, 127)} and cfg.fp8.kv_cache  # (SHAPE's vocab, as dense)
    assert load_config(None, ba.shape(True, 12)).model.tiny.num_layers == 12
    dense = load_config(None, ba.shape(False, None)).model.tiny
    assert (dense.arch, dense.num_layers, dense.hidden_size) == ("llama", 8, 1024)
    assert load_config(None, ba.shape(False, 3)).model.tiny.num_layers == 3
    args = ba.build_parser().parse_args(["--moe", "--layers", "6", "--prompts", "8"])
    child = ba.build_parser().parse_args(ba.child_argv(args, "fp8", Path("/r.jsonl"))[3:])
    assert child.moe and child.layers == 6 and child.prompts == 8 and child.mode == "fp8" and child.records == "/r.jsonl"
    assert not ba.build_parser().parse_args(ba.child_argv(ba.build_parser().parse_args([]), "bf16", Path("/r"))[3:]).moe


def test_rollout_worker_on_the_moe_shape(tmp_path):
    """The worker path (meta model, model dir, config, refits, workloads) on the MoE shape, --dry-run engine."""
    args = br.build_parser().parse_args(["--worker", "--dry-run", "--models", "qwen3-moe", "--modes", "fp8kv",
                                         "--workloads", "8x16->32", "--result-file", str(tmp_path / "r.jsonl")])
    assert br.run_worker(args) == 0
    (rec,) = runner.read_records(tmp_path / "r.jsonl")
    assert rec["kind"] == "run" and rec["workload"] == f"{MOE} 8x16->32" and rec["model"] == MOE
    assert rec["kv_bytes_per_token"] == 2 * 12 * 4 * 128 and rec["trainer_gib"] == round(2 * (OUTER + 12 * LAYER) / br.GiB, 2)
