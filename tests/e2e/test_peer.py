"""bench/peer.py on the CPU: TRL's GRPOTrainer (HF generation), eager and compiled, and our BF16 twin on one
tiny workload.

Three rollout steps each (step 1 profiled with --profile, so step 2 is the one timed), TRL's 12 optimizer steps
of one micro-batch against ours' (the twin's 4 per rollout step), on the model dir the benchmark writes (a tiny
Llama that never samples a special token, so every sample runs to the budget in both). optim.name=adamw spares ours the 8-bit AdamW's CPU compile (~20 s);
tests/e2e/test_shipped_configs.py runs the config's own optimizer. The compiled TRL row (inductor on the CPU,
~30 s) must train as the eager one: one generation per rollout step. Skipped without TRL
(requirements-peer.txt).

The GPU rows' TRL settings (each TRL system, both model shapes) are validated here by TRL itself, and the
pieces they rely on (regional compilation, Liger, the checkpoint stride) without running a kernel.
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
    p = peer("--tiny", "--systems", "trl,trl_compile,ours_bf16", "--steps", "3", "--profile", "1", "--out",
             str(tmp_path), "--runs", str(tmp_path / "runs"), "optim.name=adamw")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads((tmp_path / "peer_cpu.json").read_text())["rows"]}
    assert set(rows) == {"trl", "trl_compile", "ours_bf16"}
    for r in rows.values():
        assert "error" not in r, r
        # prompts x samples x fixed length, counted by each system; the compiled TRL row generates once per
        # rollout step too, as a training run (bench/peer.py run_trl: GRPOTrainer's self.model in train mode)
        assert r["gen_tokens"] == 2 * 8 * 8
        assert r["timed_steps"] == 1 and r["step_s"] > 0 and r["profiled_step"] == 1  # step 1 left the medians
        # --profile: each side's train phase in a "train" span (the CPU has no device kernels to list)
        profile = (tmp_path / f"peer_{r['system']}_profile.txt").read_text()
        assert profile.splitlines()[0].split() == ["phase", "wall_s", "device_busy_s", "busy"], profile
        assert any(line.startswith("train ") for line in profile.splitlines()), profile
        assert r["tokens_per_s"] == pytest.approx(r["gen_tokens"] / r["step_s"], rel=0.02)
        assert r["gpu"] == "cpu" and r["command"].startswith("python -m bench.peer --tiny") and r["settings"]
        assert isinstance(r["cpu"], str)  # the host CPU model (empty where /proc/cpuinfo has none)
    trl = rows["trl"]
    assert trl["rollout_s"] > 0 and trl["train_s"] > 0 and trl["logprobs_s"] >= 0
    assert trl["settings"]["rollout"] == "transformers generate"
    assert rows[trl["trl_baseline"]]["tokens_per_s_vs_trl"] == 1.0 and trl["trl_baseline"] in ("trl", "trl_compile")
    assert rows["trl_compile"]["settings"]["compile"] == "decoder layers (accelerate's regional compilation), inductor"
    log = (tmp_path / "peer_trl_compile.log").read_text()
    assert "'completions/mean_length'" in log and "'eval_completions/mean_length'" not in log  # trained, not evaluated
    assert rows["ours_bf16"]["settings"]["optimizer"] == "adamw"
    assert "[trl] step 1:" in p.stdout and "[ours_bf16] step 1:" in p.stdout  # progress per step
    md = (tmp_path / "peer_cpu.md").read_text()
    assert "| trl |" in md and "| ours_bf16 |" in md


@pytest.mark.parametrize("args, flag", [(["--steps", "1"], "--steps"), (["--systems", "trl,verl"], "--systems"),
                                        (["--systems", "trl_liger"], "--systems"), (["rollout.nn=3"], "rollout.nn"),
                                        (["--steps", "3", "--profile", "3"], "--profile"),
                                        (["--steps", "2", "--profile", "1"], "--profile")])
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


def the_args(tmp_path, model="llama8b", steps=6):
    """bench.peer's parsed arguments for a GPU run of `model` (what its children read)."""
    import argparse

    from bench import peer as bp

    args = argparse.Namespace(tiny=False, model=model, model_dir=None, runs=str(tmp_path / "runs"), steps=steps,
                              profile=0, overrides=[])
    args.model_dir = str(bp.model_dir(args))
    return args


TRL_SYSTEMS = ["trl", "trl_compile", "trl_liger", "trl_ckpt2"]


@pytest.mark.parametrize("model", ["llama3b", "llama8b"])
@pytest.mark.parametrize("system", TRL_SYSTEMS)
def test_every_trl_rows_settings_are_accepted_by_trl(tmp_path, monkeypatch, system, model):
    """Each TRL row's GRPOConfig for each model's GPU run (vLLM colocated, sleep mode, 8-bit AdamW, bf16) as TRL
    validates it, with only its bf16-GPU probe answered: 256 samples a generation in groups of 32, 4 optimizer
    steps each, TRL's IS correction on, fixed-length generations, no nan/inf filter; then what each row adds."""
    pytest.importorskip("trl")
    import transformers.training_args as ta
    from accelerate.utils import TorchDynamoPlugin
    from trl import GRPOConfig

    from bench import peer as bp
    from config import load_config

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda *a, **k: True)
    args = the_args(tmp_path, model)
    assert args.model_dir == f"/tmp/peer_{model}"
    cfg = load_config(ROOT / "configs" / f"{bp.TWIN}.yaml", bp.workload_overrides(args, system))
    c = GRPOConfig(**bp.trl_args(cfg, tmp_path / "run", cuda=True, system=system))
    assert (c.generation_batch_size, c.num_generations, c.max_completion_length) == (256, 32, 1024)
    assert c.steps_per_generation // c.gradient_accumulation_steps == 4 and c.num_iterations == 1
    assert c.per_device_train_batch_size * c.gradient_accumulation_steps == 64  # samples per optimizer step
    assert c.use_vllm and c.vllm_mode == "colocate" and c.vllm_enable_sleep_mode and c.gradient_checkpointing
    assert c.vllm_importance_sampling_correction and c.generation_kwargs == {"ignore_eos": True}
    assert c.learning_rate == cfg.optim.lr and "8bit" in getattr(c.optim, "value", c.optim)
    assert c.logging_nan_inf_filter is False and c.max_steps == 4 * args.steps
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.steps_per_generation) == (4, 16, 64)
    assert c.torch_compile == (system == "trl_compile") and c.use_liger_kernel == (system == "trl_liger")
    every = (c.gradient_checkpointing_kwargs or {}).get("every_n_layers", 1)
    assert every == (2 if system == "trl_ckpt2" else 1)
    for key, value in bp.SYSTEMS[system].env.items():
        monkeypatch.setenv(key, value)
    plugin = TorchDynamoPlugin(backend=c.torch_compile_backend, mode=c.torch_compile_mode)  # as Trainer makes it
    assert plugin.use_regional_compilation == (system == "trl_compile")
    if system == "trl_compile":
        assert c.torch_compile_backend == "inductor" and c.gradient_checkpointing_kwargs == {"use_reentrant": False}
    settings = bp.trl_settings(c)
    assert settings["batch"] == "micro-batches of 4 rows, 64 samples per optimizer step"
    assert settings["compile"] == ("decoder layers (accelerate's regional compilation), inductor"
                                   if system == "trl_compile" else "none")
    assert settings["checkpointing"].startswith("1 decoder layer in 2" if system == "trl_ckpt2" else "every")


@pytest.mark.parametrize("model, params, layers", [("llama3b", 3.61e9, 28), ("llama8b", 8.03e9, 32)])
def test_the_model_shapes(model, params, layers):
    """--model's dims, counted on the meta device: Llama-3.2-3B's with an untied head (3.6 B), Llama-3.1-8B's."""
    import torch

    from bench import peer as bp
    from config import TinyModelConfig
    from modeling import build_char_tokenizer, build_tiny_model

    spec = TinyModelConfig(**bp.MODELS[model][1])
    with torch.device("meta"):
        m = build_tiny_model(spec, build_char_tokenizer(spec.vocab), torch.bfloat16)
    assert sum(p.numel() for p in m.parameters()) == pytest.approx(params, rel=0.002)
    assert m.config.num_hidden_layers == layers and not m.config.tie_word_embeddings
    assert m.config.vocab_size == 128256 and m.config.num_key_value_heads == 8


def test_results_are_named_after_the_card_and_ratios_taken_per_group(tmp_path):
    """peer_h100.json for the 3B runs on an H100, peer_h200.json for the 8B on an H200; each row's ratio is over
    the fastest TRL row of its workload and group (the checkpointing pair apart from the main rows)."""
    from bench import peer as bp

    assert bp.results_path(tmp_path, "NVIDIA H100 80GB HBM3") == tmp_path / "peer_h100.json"
    assert bp.results_path(tmp_path, "NVIDIA H200") == tmp_path / "peer_h200.json"
    assert bp.results_path(tmp_path, "cpu") == tmp_path / "peer_cpu.json"
    w3, w8 = (bp.workload_label(the_args(tmp_path, m)) for m in ("llama3b", "llama8b"))
    assert "Llama-3.2-3B shape" in w3 and "Llama-3.1-8B shape" in w8
    speed = {"trl": 100, "trl_compile": 150, "trl_liger": 120, "ours_bf16": 180, "ours_fp8": 240, "trl_ckpt2": 110,
             "ours_bf16_ckpt2": 220}
    rows = [{"system": s, "workload": w3, "tokens_per_s": v} for s, v in speed.items()]
    rows += [{"system": "trl", "workload": w8, "tokens_per_s": 50}, {"system": "ours_fp8", "workload": w8,
                                                                    "tokens_per_s": 75},
             {"system": "trl_liger", "workload": w8, "tokens_per_s": 90, "error": "exit 124: killed"}]
    got = {(r["system"], r["workload"]): (r["trl_baseline"], r["tokens_per_s_vs_trl"]) for r in bp.add_ratios(rows)}
    assert got[("trl", w3)] == ("trl_compile", 0.667) and got[("ours_fp8", w3)] == ("trl_compile", 1.6)
    assert got[("trl_ckpt2", w3)] == ("trl_ckpt2", 1.0) and got[("ours_bf16_ckpt2", w3)] == ("trl_ckpt2", 2.0)
    assert got[("ours_fp8", w8)] == ("trl", 1.5)  # a row with an error is never the baseline
    md = bp.markdown(rows, "NVIDIA H100 80GB HBM3")
    assert "Ratios over trl_compile (the fastest TRL row)." in md and "Ratios over trl_ckpt2" in md
    assert md.index("| trl |") < md.index("| trl_compile |") < md.index("| ours_fp8 |") < md.index("| trl_ckpt2 |")


def test_trl_undoes_the_checkpoint_stride_and_the_benchmark_keeps_it():
    """Trainer checkpoints every n-th layer (gradient_checkpointing_kwargs every_n_layers); TRL's no-grad passes
    turn checkpointing off and back on with the kwargs as they are, which checkpoints every layer again (if this
    first assertion fails, TRL keeps the stride itself and keep_checkpoint_stride can go)."""
    pytest.importorskip("trl")
    import torch
    from trl.models.utils import disable_gradient_checkpointing

    from bench import peer as bp
    from config import TinyModelConfig
    from modeling import build_char_tokenizer, build_tiny_model

    kwargs = {"every_n_layers": 2}  # trl_ckpt2's gradient_checkpointing_kwargs
    spec = TinyModelConfig(**{**bp.TINY, "num_layers": 4})
    for keep, want in [(False, [True] * 4), (True, [True, False, True, False])]:
        model = build_tiny_model(spec, build_char_tokenizer(spec.vocab), torch.float32)
        if keep:
            bp.keep_checkpoint_stride(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, every_n_layers=2)  # as Trainer does
        assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]
        with disable_gradient_checkpointing(model, kwargs):  # GRPOTrainer's old-logprob pass
            assert not any(layer.gradient_checkpointing for layer in model.model.layers)
        assert [layer.gradient_checkpointing for layer in model.model.layers] == want, keep


def test_trl_compile_compiles_each_decoder_layer():
    """trl_compile's environment makes accelerate compile the repeated decoder layers one by one
    (compile_regions, what Accelerator.prepare_model calls), not the model's forward; nothing runs here. The
    compiled model is a new top module: Trainer's train() reaches it and the layers, not the module
    GRPOTrainer reads its mode from (why run_trl sets that one's train mode itself)."""
    pytest.importorskip("trl")
    import torch
    from accelerate.utils import TorchDynamoPlugin, compile_regions

    from bench import peer as bp
    from config import TinyModelConfig
    from modeling import build_char_tokenizer, build_tiny_model

    spec = TinyModelConfig(**bp.TINY)
    model = build_tiny_model(spec, build_char_tokenizer(spec.vocab), torch.float32).eval()  # as from_pretrained
    plugin = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    compiled = compile_regions(model, **plugin.to_kwargs())
    assert all(isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in compiled.model.layers)
    assert not isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled.model.layers[0]._orig_mod is model.model.layers[0]  # the parameters are shared
    compiled.train()  # Trainer.training_step
    assert compiled.training and model.model.layers[0].training and not model.training


LIGER_CHECK = """
import torch
import transformers.models.llama.modeling_llama as llama
from transformers.integrations.liger import apply_liger_kernel

from bench import peer as bp
from config import TinyModelConfig
from modeling import build_char_tokenizer, build_tiny_model

spec = TinyModelConfig(**bp.TINY)
model = build_tiny_model(spec, build_char_tokenizer(spec.vocab), torch.float32)
forward = type(model).forward
apply_liger_kernel(model, {"fused_linear_cross_entropy": False})  # the config GRPOTrainer.__init__ sets
layer = model.model.layers[0]
print(type(layer.mlp.forward.__self__).__name__, layer.mlp.forward.__qualname__,
      layer.input_layernorm.forward.__qualname__, model.model.norm.forward.__qualname__,
      llama.apply_rotary_pos_emb.__name__, type(model).forward is forward)
"""


def test_liger_patches_the_trl_rows_model():
    """trl_liger: transformers' apply_liger_kernel (Trainer, use_liger_kernel) with the config GRPOTrainer sets
    swaps Liger's SwiGLU, RMSNorm and RoPE into the Llama model, its fused cross-entropy off (TRL keeps its own
    fused LM head). In a process of its own (Liger also replaces transformers' Llama classes module-wide); on the
    CPU nothing runs: Liger's kernels are Triton."""
    pytest.importorskip("trl")
    pytest.importorskip("liger_kernel")
    p = subprocess.run([sys.executable, "-c", LIGER_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    mlp_type, mlp_forward, norm, final_norm, rope, forward_kept = p.stdout.split()
    assert mlp_forward.startswith("LigerSwiGLUMLP.") and norm.startswith("LigerRMSNorm.")
    assert final_norm.startswith("LigerRMSNorm.") and rope == "liger_rotary_pos_emb" and forward_kept == "True"
