"""VLLMEngine's engine arguments, env and requests, validated on CPU by vLLM's own parsers.

No GPU and no engine: EngineArgs / ModelConfig / Fp8Config / KernelConfig / CacheConfig /
SamplingParams are built from what engines/vllm.py would pass to vllm.LLM, against a tiny local
Llama dir (config.json + char tokenizer). Tests needing vLLM skip when it does not import.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import load_config
from fp8.export import vllm_quantization_config
from engines.vllm import (VLLMEngine, drawn_lengths, kept_env, kv_scale_entry, vllm_engine_kwargs, vllm_env,
                          vllm_requests)

REPO = Path(__file__).resolve().parents[2]
MODES = {  # name -> config overrides (the three rollout recipes of configs/, and the engine options)
    "bf16": [],
    "fp8": ["fp8.rollout=true"],
    "fp8kv": ["fp8.rollout=true", "fp8.kv_cache=true"],
    "fp8kv_triton": ["fp8.rollout=true", "fp8.kv_cache=true", "fp8.kv_attention=triton", "rollout.block_size=32"],
    "fp8kv_xqa": ["fp8.rollout=true", "fp8.kv_cache=true", "fp8.kv_attention=xqa"],
}
TINY = ["rollout.engine=vllm", "data.max_prompt_tokens=64", "rollout.max_new_tokens=64", "model.dtype=float32",
        "model.tiny.hidden_size=256", "model.tiny.intermediate_size=512", "model.tiny.num_layers=3",
        "model.tiny.num_heads=2", "model.tiny.num_kv_heads=2", "model.tiny.head_dim=128"]


def _vllm():
    try:
        return importlib.import_module("vllm")
    except Exception as e:  # not installed, or broken on this host
        pytest.skip(f"vllm does not import here ({type(e).__name__}: {e}); arg validation needs it")


def cfg_for(mode, *extra):
    return load_config(None, [*TINY, *MODES[mode], *extra])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, model_dir): a tiny Llama (3 layers, FP8-eligible 128-multiple dims) and its config dir."""
    from modeling import build_char_tokenizer, build_tiny_model, save_config_dir

    cfg = cfg_for("bf16")
    tok = build_char_tokenizer(cfg.model.tiny.vocab)
    torch.manual_seed(0)
    model = build_tiny_model(cfg.model.tiny, tok, torch.bfloat16)
    return model, save_config_dir(model, tok, tmp_path_factory.mktemp("tiny_llama"))


# ---------------------------------------------------------------- pure (no vLLM needed)

def test_env_pins_scales_inprocess_and_backend():
    for backend, deep_gemm in [("cutlass", "0"), ("triton", "0"), ("deep_gemm", "1"), ("auto", None)]:
        env = vllm_env(cfg_for("fp8", f"fp8.linear_backend={backend}"))
        assert env["VLLM_USE_DEEP_GEMM_E8M0"] == "0"  # else vLLM re-rounds block scales to 2^k
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the model must live in this process
        assert env.get("VLLM_USE_DEEP_GEMM") == deep_gemm
        assert "VLLM_HAS_FLASHINFER_CUBIN" not in env
    # fp8.kv_attention=xqa: without it vLLM probes NVIDIA's artifact server and, offline, decodes with
    # FlashInfer's native kernel, whose float scales CUDA graphs freeze (vllm_internals.patch_xqa_scales)
    assert vllm_env(cfg_for("fp8kv_xqa"))["VLLM_HAS_FLASHINFER_CUBIN"] == "1"
    assert "VLLM_HAS_FLASHINFER_CUBIN" not in vllm_env(cfg_for("fp8", "fp8.kv_attention=xqa"))  # no FP8 KV


QC = {"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]}


def kwargs(mode, *overrides, **kw):
    cfg = cfg_for(mode, *overrides)
    return vllm_engine_kwargs(cfg, "/m", quant_config=QC if cfg.fp8.rollout else None, **kw)


def test_kwargs_shape_per_mode():
    bf16, fp8, fp8kv, fp8kv_triton, fp8kv_xqa = (kwargs(m) for m in MODES)
    for kw in (bf16, fp8, fp8kv, fp8kv_triton, fp8kv_xqa):
        assert kw["dtype"] == "bfloat16" and kw["load_format"] == "dummy" and kw["tensor_parallel_size"] == 1
        assert kw["logprobs_mode"] == "processed_logprobs"
        assert kw["max_model_len"] == 64 + 64  # 0 -> data.max_prompt_tokens + rollout.max_new_tokens
        assert "distributed_executor_backend" not in kw
    assert "quantization" not in bf16 and "kv_cache_dtype" not in bf16 and "hf_overrides" not in bf16
    assert kwargs("bf16", architecture="X")["hf_overrides"] == {"architectures": ["X"]}
    assert fp8["hf_overrides"]["quantization_config"] is QC
    assert fp8["quantization"] == "fp8" and fp8["linear_backend"] == "cutlass" and "kv_cache_dtype" not in fp8
    assert fp8kv["kv_cache_dtype"] == "fp8" and "calculate_kv_scales" not in fp8kv  # removed in vLLM 0.28
    assert fp8kv["attention_config"] == {"backend": "FLASH_ATTN", "flash_attn_version": 3}
    assert fp8kv_triton["attention_config"] == {"backend": "TRITON_ATTN"} and fp8kv_triton["block_size"] == 32
    assert fp8kv_xqa["attention_config"] == {"backend": "FLASHINFER"} and fp8kv_xqa["kv_cache_dtype"] == "fp8"
    assert "block_size" not in fp8kv  # 0: vLLM's default
    assert kwargs("bf16", "rollout.max_model_len=100")["max_model_len"] == 100
    assert "max_num_seqs" not in bf16 and kwargs("fp8kv", "rollout.max_num_seqs=512")["max_num_seqs"] == 512
    assert "linear_backend" not in kwargs("fp8", "fp8.linear_backend=auto")
    assert "kv_cache_memory_bytes" not in bf16  # 0: sized by gpu_memory_utilization
    assert kwargs("bf16", "rollout.kv_cache_gib=1.5")["kv_cache_memory_bytes"] == 3 * 2**29
    with pytest.raises(ValueError, match="needs quant_config"):
        vllm_engine_kwargs(cfg_for("fp8"), "/m")
    dp = kwargs("fp8kv", world_size=4)
    assert dp["distributed_executor_backend"] == "external_launcher" and dp["tensor_parallel_size"] == 1


def test_kv_scale_entries_are_recognised():
    assert kv_scale_entry("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_entry("model.layers.12.self_attn.attn.q_scale") == (12, "q")
    assert kv_scale_entry("model.layers.0.self_attn.v_proj.v_scale") == (0, "v")
    assert kv_scale_entry("model.layers.1.self_attn.kv_scale") == (1, "kv")
    for name in ["model.layers.0.self_attn.q_proj.weight_scale_inv", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.mlp.gate_up_proj.weight_scale", "lm_head.weight"]:
        assert kv_scale_entry(name) is None, name


CPU_ONLY = """
import sys, torch, engines, engines.vllm
from config import load_config
from modeling import load_model_and_tokenizer
cfg = load_config(None, ["train.device=cpu", "fp8.rollout=true", "fp8.kv_cache=true"])
model, tok = load_model_and_tokenizer(cfg.model, torch.device("cpu"))
engine = engines.make_engine(cfg, model, tok, torch.device("cpu"))
samples = engine.generate([tok("1+1=").input_ids], n=2, temperature=1.0, top_p=1.0, max_new_tokens=3, seed=0)
vllm_modules = [m for m in sys.modules if m.split(".")[0] == "vllm"]
print(type(engine).__name__, engines.vllm.VLLMEngine.__name__, len(samples), vllm_modules)
"""


def test_cpu_use_never_imports_vllm():
    """The CPU engine runs (FP8 emulated) and both engine classes resolve without importing vLLM."""
    r = subprocess.run([sys.executable, "-c", CPU_ONLY], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "HFEngine VLLMEngine 2 []"


# ---------------------------------------------------------------- vLLM's own parsers

@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_engine_args_parse(mode, world_size, tiny, monkeypatch):
    _vllm()
    from vllm.config import CacheConfig, KernelConfig, ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    model, model_dir = tiny
    cfg = cfg_for(mode)
    qc = vllm_quantization_config(model, cfg.fp8) if cfg.fp8.rollout else None
    kw = vllm_engine_kwargs(cfg, model_dir, world_size, qc, type(model).__name__)
    ea = EngineArgs(**kw)  # unknown / misspelt keys raise TypeError here
    assert ea.logprobs_mode == "processed_logprobs" and ea.load_format == "dummy" and ea.dtype == "bfloat16"
    assert ea.enable_sleep_mode is cfg.rollout.sleep_mode and ea.seed == cfg.rollout.seed
    assert ea.kv_cache_dtype == ("fp8" if cfg.fp8.kv_cache else "auto")
    # Sleep mode needs a CUDA platform: validate the rest of the model config without it.
    monkeypatch.setattr(ea, "enable_sleep_mode", False)
    mc = ea.create_model_config()  # reads config.json, applies hf_overrides, checks quantization
    assert mc.architecture == "LlamaForCausalLM" and mc.runner_type == "generate"  # not the headless LlamaModel
    assert mc.dtype == torch.bfloat16 and mc.logprobs_mode == "processed_logprobs"
    assert mc.max_model_len == cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    KernelConfig(linear_backend=ea.linear_backend)  # pydantic: rejects unknown backends
    CacheConfig(cache_dtype=ea.kv_cache_dtype, calculate_kv_scales=ea.calculate_kv_scales, block_size=ea.block_size)
    assert ea.block_size == (cfg.rollout.block_size or None)
    if cfg.fp8.kv_cache:
        backend = {"fa3": "FLASH_ATTN", "triton": "TRITON_ATTN", "xqa": "FLASHINFER"}[cfg.fp8.kv_attention]
        assert ea.attention_config.backend.name == backend
        assert cfg.fp8.kv_attention != "fa3" or ea.attention_config.flash_attn_version == 3
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # ParallelConfig flips it for external_launcher
    pc = ParallelConfig(distributed_executor_backend=ea.distributed_executor_backend,
                        tensor_parallel_size=ea.tensor_parallel_size)
    assert pc.world_size == 1  # TP=1: every rank its own engine
    assert (pc.distributed_executor_backend == "external_launcher") == (world_size > 1)
    if not cfg.fp8.rollout:
        assert mc.quantization is None and ea.linear_backend == "auto"
        return
    assert mc.quantization == "fp8" and ea.linear_backend == "cutlass"
    qc = Fp8Config.from_config(mc.hf_config.quantization_config)
    assert qc.is_checkpoint_fp8_serialized  # our fp8 bytes are loaded as they are, not re-quantized
    assert qc.weight_block_size == [128, 128] and qc.activation_scheme == "dynamic"
    assert qc.ignored_layers == ["lm_head"]  # default fp8 config: every decoder linear is FP8


def test_ignored_layers_are_what_vllm_skips(tiny):
    """fp8_plan's BF16 linears (keep_first_layers, keep_bf16) are exactly the vLLM layers that
    Fp8Config leaves unquantized, fused qkv_proj / gate_up_proj included."""
    _vllm()
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from fp8.plan import fp8_plan

    model, model_dir = tiny
    cfg = cfg_for("fp8", "fp8.keep_first_layers=1", "fp8.keep_bf16=['*.down_proj']")
    kw = vllm_engine_kwargs(cfg, model_dir, 1, vllm_quantization_config(model, cfg.fp8))
    qc = Fp8Config.from_config(kw["hf_overrides"]["quantization_config"])
    # what vLLM 0.26 does before creating layers (model_executor/models/interfaces.py SupportsQuant)
    qc.apply_vllm_mapper(LlamaForCausalLM.hf_to_vllm_mapper.get_unstacked_mapper())
    plan = fp8_plan(model, cfg.fp8)
    fused = LlamaForCausalLM.packed_modules_mapping
    vllm_layers = [("self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"]), ("self_attn.o_proj", ["o_proj"]),
                   ("mlp.gate_up_proj", ["gate_proj", "up_proj"]), ("mlp.down_proj", ["down_proj"])]
    n_fp8 = 0
    for i in range(cfg.model.tiny.num_layers):
        for vllm_name, parts in vllm_layers:
            prefix = f"model.layers.{i}.{vllm_name}"
            hf = [f"{prefix.rsplit('.', 1)[0]}.{p}" for p in parts]
            want_fp8 = {plan[h][0] for h in hf}
            assert len(want_fp8) == 1, hf  # fp8_plan keeps fused groups consistent
            skipped = is_layer_skipped(prefix, qc.ignored_layers, fused_mapping=fused)
            assert skipped == (not want_fp8.pop()), prefix
            n_fp8 += not skipped
    assert n_fp8 == 2 * 3  # layers 1, 2: qkv, o, gate_up in FP8; layer 0 and every down_proj BF16


def test_sampling_requests():
    _vllm()
    from vllm.sampling_params import SamplingType

    prompts = [[1, 5, 6], [1, 7]]
    greedy = vllm_requests(prompts, n=3, temperature=0.0, top_p=0.9, max_new_tokens=5)
    assert [i for i, _, _ in greedy] == [0, 0, 0, 1, 1, 1]  # vLLM refuses n > 1 when greedy
    assert [p["prompt_token_ids"] for _, p, _ in greedy] == [prompts[0]] * 3 + [prompts[1]] * 3
    sp = greedy[0][2]
    assert sp.n == 1 and sp.sampling_type == SamplingType.GREEDY and sp.top_p == 1.0 and sp.max_tokens == 5
    sampled = vllm_requests(prompts, n=4, temperature=0.7, top_p=1.0, max_new_tokens=9)
    assert [i for i, _, _ in sampled] == [0, 1]
    sp = sampled[0][2]
    assert sp.n == 4 and sp.temperature == 0.7 and sp.top_p == 1.0 and sp.top_k in (0, -1)
    assert sp.sampling_type == SamplingType.RANDOM and sp.seed is None
    seeded = vllm_requests(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=9, seed=100)
    assert [sp.seed for _, _, sp in seeded] == [100, 104]  # children: 100..103, 104..107
    assert all(sp.sampling_type == SamplingType.RANDOM_SEED for _, _, sp in seeded)
    assert all(sp.seed is None for _, _, sp in vllm_requests(prompts, 2, 0.0, 1.0, 4, seed=5))  # greedy
    for _, _, sp in greedy + sampled + seeded:
        assert sp.logprobs == 0 and sp.flat_logprobs and not sp.detokenize  # sampled token's logprob only


def test_drawn_lengths_give_each_sample_its_own_budget():
    """rollout.ignore_eos_median: one request per sample with its drawn max_tokens, seeded as vLLM seeds
    the children of an n-sample request; the draw is a function of the seed, cut at the budget."""
    _vllm()
    lengths = drawn_lengths(4000, 1400, 0.6, 3584, seed=7)
    assert lengths == drawn_lengths(4000, 1400, 0.6, 3584, seed=7) != drawn_lengths(4000, 1400, 0.6, 3584, seed=8)
    assert min(lengths) >= 1 and max(lengths) == 3584
    assert 1300 < sorted(lengths)[2000] < 1500  # the median
    assert 0.03 < sum(x == 3584 for x in lengths) / 4000 < 0.09  # P(lognormal > 3584) = 5.9%: the truncated
    reqs = vllm_requests([[1, 5], [1, 7, 8]], n=3, temperature=1.0, top_p=1.0, max_new_tokens=9, seed=100,
                         ignore_eos=True, lengths=[3, 1, 4, 1, 5, 9])
    assert [(i, sp.n, sp.seed, sp.max_tokens) for i, _, sp in reqs] == [
        (0, 1, 100, 3), (0, 1, 101, 1), (0, 1, 102, 4), (1, 1, 103, 1), (1, 1, 104, 5), (1, 1, 105, 9)]
    assert all(sp.ignore_eos for _, _, sp in reqs)


def test_wake_returns_the_trainers_cached_memory_first(monkeypatch):
    """VLLMEngine wakes vLLM only after PyTorch's caching allocator gave its free blocks (the
    trainer's activations) back to the driver, where vLLM's allocator maps its pools."""
    calls = []

    class FakeLLM:
        def wake_up(self, tags):
            calls.append(("wake_up", tuple(tags)))

    eng = object.__new__(VLLMEngine)  # no vLLM: only the sleep/wake bookkeeping
    eng.llm, eng._asleep, eng.kv_scales = FakeLLM(), {"weights", "kv_cache"}, {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(VLLMEngine, "_apply_kv_scales", lambda self: calls.append("scales"))
    eng._wake(("weights",))
    eng.wake()
    eng.wake()  # awake: nothing to do
    assert calls == ["empty_cache", ("wake_up", ("weights",)), "scales", "empty_cache", ("wake_up", ("kv_cache",))]


@pytest.mark.parametrize("before", [None, "/tmp/fixed"])
def test_kept_env_restores_what_the_body_overwrote(monkeypatch, before):
    # vLLM's engine start sets TRITON_CACHE_DIR to its compile cache; VLLMEngine wraps it in kept_env
    if before is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", before)
    with pytest.raises(RuntimeError):
        with kept_env("TRITON_CACHE_DIR"):
            os.environ["TRITON_CACHE_DIR"] = "/root/.cache/vllm/torch_compile_cache/x/triton_cache"
            raise RuntimeError("engine start failed")
    assert os.environ.get("TRITON_CACHE_DIR") == before
