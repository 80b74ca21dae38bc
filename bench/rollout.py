"""Rollout throughput of engines.vllm.VLLMEngine at 8B shapes (random weights): BF16 vs FP8 vs FP8 + FP8 KV.

    python -m bench.rollout                          # Llama-3.1-8B shape, bf16/fp8kv/fp8, 2 workloads
    python -m bench.rollout --models qwen3           # Qwen3-8B shape
    python -m bench.rollout --models llama3b --workloads 256x16:1024   # bench/peer.py's 3B shape and rollout
    python -m bench.rollout --models qwen3-30b-a3b   # Qwen3-30B-A3B (MoE) cut to 12 of its 48 layers
    python -m bench.rollout --workloads '512x256->1024,64x1024->8192' --modes bf16,fp8kv
    python -m bench.rollout --capacity-only          # Qwen3-8B KV-cache capacity per mode vs NeMo RL's
    python -m bench.rollout --decode-steps 64 --workloads 128x4096:64   # decode step ms by kernel kind
    python -m bench.rollout --decode-steps 64 --workloads 128x4096:64 --modes fp8kv --set fp8.kv_attention=xqa --no-pdl
    python -m bench.rollout --modes fp8kv --set rollout.block_size=128  # a config override, every mode
    python -m bench.rollout --modes fp8 --vllm 'compilation_config={"custom_ops": ["-quant_fp8"]}'  # a vllm.LLM keyword
    python -m bench.rollout --merge a/rollout.json b/rollout.json --out bench/results   # combine calls

What runs: the trainer's engine (engines.vllm.VLLMEngine: in-process vLLM 0.26, dummy load, CUDA
graphs, then `update_weights(export_weights(...))`) on a dir of config.json + the repo's char
tokenizer; fp8 = block W8A8 linears (cutlass), fp8kv = + FP8 KV cache and FA3 FP8 attention
(q/k/v scales 1.0); in the MoE shape the experts are vLLM's FusedMoE (block FP8 in fp8 / fp8kv, routers
BF16), returning each token's experts as in training. Prompts are random token ids;
`rollout.ignore_eos=true` makes every sample exactly gen_len tokens; T=1, top_p=1, n=1, seeded. The trainer-side model (HF bf16, normal(0, 0.02),
~16 GB) exists only to be exported: refit_s = median wall time of update_weights(export_weights(...)),
FP8 quantization included. Per run: out_tok_s = generated tokens / generate() wall time (after a
small warm-up generate), startup_s (vllm.LLM construction), the KV capacity vLLM computed
(kv_capacity_tokens = num_gpu_blocks * block_size; kv_max_concurrency: sequences of max_model_len
that fit; seqs_fit = capacity // (prompt_len + gen_len)), gpu_memory_utilization ('auto': 0.80,
lowered so that the trainer model + 10 GiB stay outside vLLM's share: ~0.68 on an H100).

One child per (model, mode) (vLLM: one engine per process), through bench/runner.py: one per
visible GPU at a time, their `[bench]` lines streamed, full logs in OUT/logs/, OUT/rollout.json
rewritten after every child (runs of the same device already there are kept unless re-measured).
--time-limit S starts no child that cannot finish and kills running ones at S (scripts/gpu_check.sh:
540). Default modes bf16, fp8kv, fp8: the full recipe before the ablation, in case the limit cuts
the last. A default run takes ~3 min per mode on an H200. Workloads: PxL->G or PxL:G (P prompts of
L tokens, G generated).

--capacity-only (default model Qwen3-8B): engine start with enforce_eager, no weights, no
generation -> OUT/rollout_capacity.json. NeMo RL reports for Qwen3-8B BF16 249,952 tokens, FP8
linears 299,344 (x1.20), + FP8 KV 598,672 (x2.40) at an unknown gpu_memory_utilization. KV memory =
util * total - weights - activation peak - non-torch memory, so another util shifts every mode's KV
bytes equally; kv_tokens_at_nemo_budget applies the shift that makes our BF16 capacity NeMo's.
"""

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bench.runner import (RESULTS, Job, add_ratio, cuda_busy_ms, cuda_kernels, emit,
                          markdown_table, merge_files, parse_choices, read_records, read_results, run_jobs, say,
                          update_results, visible_gpus)

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3
MODES = {  # bench mode -> config overrides (fp8.rollout, fp8.kv_cache)
    "bf16": ["fp8.rollout=false", "fp8.kv_cache=false"],
    "fp8": ["fp8.rollout=true", "fp8.kv_cache=false"],
    "fp8kv": ["fp8.rollout=true", "fp8.kv_cache=true"],
    # vLLM's Triton block-FP8 GEMM instead of cutlass (decode: which one reads the FP8 weights at bandwidth)
    "fp8kv_triton": ["fp8.rollout=true", "fp8.kv_cache=true", "fp8.linear_backend=triton"],
}
DEFAULT_MODES = ["bf16", "fp8kv", "fp8"]
# HF config fields of the real checkpoints (meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B); weights are random.
MODELS = {
    "llama3.1-8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-8b": dict(arch="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_window_layers=36),
}
# Llama-3.2-3B's dimensions with an untied head (3.6 B), bench/peer.py's llama3b workload: the shape that fits
# one 80 GB card beside the trainer. rope_scaling is the 8B's (its factor does not change a kernel's time).
MODELS["llama3.2-3b"] = dict(MODELS["llama3.1-8b"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                             num_attention_heads=24)
# Qwen/Qwen3-30B-A3B (30.5B parameters, 3.3B active) with its 48 layers cut to MOE_LAYERS, so that the
# trainer (fp32 master weights + grads + AdamW8bit states, 10 B per parameter) and vLLM share one H200:
# per layer 623.1M parameters (128 experts x 3 x 2048 x 768 = 604.0M, attention 18.9M, router 0.26M),
# embeddings + lm_head 622.3M; 12 layers = 8.10B, the 8B configs' size (81 GB of training state beside
# vLLM's 0.45 of the card, as measured for them). Every layer is sparse and alike: which 12 does not matter.
MOE_LAYERS = 12
MODELS["qwen3-30b-a3b"] = dict(arch="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                               num_hidden_layers=MOE_LAYERS, num_attention_heads=32, num_key_value_heads=4,
                               head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                               rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
                               moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                               mlp_only_layers=[])
ALIASES = {"llama": "llama3.1-8b", "llama3.1": "llama3.1-8b", "llama3b": "llama3.2-3b", "qwen3": "qwen3-8b",
           "qwen3-moe": "qwen3-30b-a3b",
           "qwen3-30b": "qwen3-30b-a3b"}
# MODELS' HF field -> config.TinyModelConfig field (tiny_shape: the same shape as model.tiny for the trainer)
TINY_FIELDS = {"arch": "arch", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
               "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
               "max_position_embeddings": "max_position_embeddings", "num_experts": "num_experts",
               "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size"}
SHIPPED_LENGTHS = (1400, 0.6)  # the shipped 8B workload's response lengths: log-normal (median tokens, sigma)
NEMO_QWEN3_8B_KV_TOKENS = {"bf16": 249952, "fp8": 299344, "fp8kv": 598672}  # NeMo RL's FP8 docs
CHAR_VOCAB = "".join(chr(c) for c in range(32, 127))  # the engine never decodes: any small vocab works
FIRST_TOKEN = 3  # prompts use ids >= 3: 0, 1, 2 are the char tokenizer's <pad>, <bos>, <eos>


def optimizer_steps(cfg) -> int:
    """Optimizer steps per GRPO step of `cfg`: its samples over train.mini_batch_size (unset: one)."""
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n
    return per_step // (cfg.train.mini_batch_size or per_step)


# ----------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Workload:
    prompts: int
    prompt_len: int
    gen_len: int

    @property
    def name(self) -> str:
        return f"{self.prompts}x{self.prompt_len}->{self.gen_len}"

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len


_WORKLOAD_RE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?:->|:)\s*(\d+)\s*$")
DEFAULT_WORKLOADS = "512x256->1024,64x1024->4096"


def parse_workload(text: str) -> Workload:
    m = _WORKLOAD_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"workload {text!r} must look like PROMPTSxPROMPT_LEN->GEN_LEN "
                                         "(e.g. 512x256->1024, or 512x256:1024)")
    w = Workload(*(int(g) for g in m.groups()))
    if min(w.prompts, w.prompt_len, w.gen_len) < 1:
        raise argparse.ArgumentTypeError(f"workload {text!r}: every number must be >= 1")
    return w


def parse_workloads(text: str) -> list[Workload]:
    out = [parse_workload(t) for t in text.split(",") if t.strip()]
    if not out:
        raise argparse.ArgumentTypeError("no workload given")
    return out


def parse_models(text: str) -> list[str]:
    out = []
    for t in (t.strip() for t in text.split(",") if t.strip()):
        name = ALIASES.get(t.lower(), t.lower())
        if name not in MODELS:
            raise argparse.ArgumentTypeError(f"model {t!r} is not one of {sorted(MODELS) + sorted(ALIASES)}")
        out.append(name)
    return out


def parse_repeats(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--decode-repeats {text!r}: a whole number >= 1")
    return int(text)


def parse_gpu_mem(text: str) -> str:
    if text != "auto":
        try:
            v = float(text)
        except ValueError:
            v = -1.0
        if not 0.05 <= v <= 0.98:
            raise argparse.ArgumentTypeError(f"--gpu-mem {text!r}: 'auto' or a fraction in [0.05, 0.98]")
    return text


# ----------------------------------------------------------------------------------- model, dir, config


def hf_config(model_name: str, layers: int | None = None):
    """The transformers config of a MODELS shape (LlamaConfig / Qwen3Config / Qwen3MoeConfig), special ids
    of the char tokenizer; layers: another num_hidden_layers."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    spec = dict(MODELS[model_name], **({"num_hidden_layers": layers} if layers else {}))
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[spec.pop("arch")]
    return cls(**spec, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_shape(model_name: str, layers: int | None = None) -> dict:
    """The MODELS shape as config.TinyModelConfig fields (model.tiny: the trainer builds it from scratch);
    layers: another num_layers."""
    out = {TINY_FIELDS[k]: v for k, v in MODELS[model_name].items() if k in TINY_FIELDS}
    return {**out, **({"num_layers": layers} if layers else {})}


def tiny_flow(model_name: str, layers: int | None = None) -> str:
    """tiny_shape as a YAML flow mapping: `model.tiny=` + this for load_config or train_grpo.py's command line."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in tiny_shape(model_name, layers).items()) + "}"


def meta_model(hf_cfg):
    """The HF causal LM on the meta device, bf16: shapes and names only (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def write_model_dir(model, path, tokenizer=None) -> Path:
    """config.json (+ architectures) + the char tokenizer + generation_config.json: what vLLM needs
    for load_format='dummy'."""
    from modeling import build_char_tokenizer, save_config_dir

    return save_config_dir(model, tokenizer or build_char_tokenizer(CHAR_VOCAB), path)


def bench_config(mode: str, workloads: list[Workload], gpu_mem: float, capacity_only: bool = False,
                 overrides: tuple[str, ...] = ()):
    """The run config the engine is built from: mode's fp8 switches, fixed-length sampling, no sleep
    mode, max_model_len = the longest workload, CUDA graphs unless capacity_only; then overrides (--set)."""
    from config import load_config

    return load_config(None, [
        "rollout.engine=vllm", f"rollout.gpu_memory_utilization={gpu_mem}",
        "rollout.sleep_mode=false", f"rollout.enforce_eager={'true' if capacity_only else 'false'}",
        f"rollout.max_model_len={max(w.seq_len for w in workloads)}",
        f"rollout.max_new_tokens={max(w.gen_len for w in workloads)}",
        f"data.max_prompt_tokens={max(w.prompt_len for w in workloads)}",
        "rollout.ignore_eos=true", "rollout.temperature=1.0", "rollout.top_p=1.0", "fp8.linear_backend=cutlass",
        *MODES[mode], *overrides])


def auto_gpu_memory_utilization(total_bytes: int, trainer_bytes: int, reserve_gib: float = 10.0,
                                cap: float = 0.80) -> float:
    """min(cap, the share that leaves the trainer model + reserve_gib outside vLLM), 2 decimals."""
    u = math.floor(100 * (total_bytes - trainer_bytes - reserve_gib * GiB) / total_bytes) / 100
    if u < 0.3:
        raise RuntimeError(f"GPU of {total_bytes / GiB:.0f} GiB: after the {trainer_bytes / GiB:.1f} GiB trainer "
                           f"model and {reserve_gib} GiB reserve only {u:.2f} is left for vLLM; pass --gpu-mem")
    return min(cap, u)


def kv_bytes_per_token(hf_cfg, fp8_kv: bool) -> int:
    """K and V of every layer for one token, in the cache dtype."""
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    return 2 * hf_cfg.num_hidden_layers * hf_cfg.num_key_value_heads * head_dim * (1 if fp8_kv else 2)


def random_prompts(w: Workload, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN, vocab_size, (w.prompts, w.prompt_len), generator=g).tolist()


# ----------------------------------------------------------------------------------- worker (one engine)


def engine_capacity(engine) -> dict:
    """KV-cache figures vLLM 0.26 computed at start (EngineCore._initialize_kv_caches writes them into
    the shared VllmConfig: cache_config.num_gpu_blocks, block_size, kv_cache_size_tokens,
    kv_cache_max_concurrency) and the worker's memory profile (gpu_worker.Worker.determine_available_memory)."""
    vc = engine.llm.llm_engine.vllm_config
    cc, mc, sc = vc.cache_config, vc.model_config, vc.scheduler_config
    if not cc.num_gpu_blocks or not cc.block_size:
        raise RuntimeError(f"vLLM cache_config.num_gpu_blocks={cc.num_gpu_blocks!r} block_size={cc.block_size!r} "
                           "after engine start: the vLLM 0.26 attributes this bench reads have moved")
    out = {"num_gpu_blocks": int(cc.num_gpu_blocks), "block_size": int(cc.block_size),
           "kv_capacity_tokens": int(cc.num_gpu_blocks) * int(cc.block_size),
           "kv_cache_size_tokens": cc.kv_cache_size_tokens, "kv_max_concurrency": cc.kv_cache_max_concurrency,
           "kv_cache_dtype": str(cc.cache_dtype), "max_model_len": int(mc.max_model_len),
           "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens}
    from engines import vllm_internals

    worker = vllm_internals.worker(engine.llm)
    kv_bytes = getattr(worker, "available_kv_cache_memory_bytes", None)
    out["kv_cache_bytes"] = int(kv_bytes) if kv_bytes is not None else None
    for key, value in [("kv_cache_gib", kv_bytes),
                       ("weights_gib", getattr(worker.model_runner, "model_memory_usage", None)),
                       ("peak_activation_gib", getattr(worker, "peak_activation_memory", None)),
                       ("non_torch_gib", getattr(worker, "non_torch_memory", None)),
                       ("cudagraph_estimate_gib", getattr(worker, "cudagraph_memory_estimate", None))]:
        out[key] = round(value / GiB, 3) if value is not None else None
    return out


def materialize(model, device, seed: int = 0):
    """The meta model on `device` (bf16): norms 1, everything else normal(0, 0.02). Never run forward
    here (its rotary buffers stay uninitialised; they are not exported)."""
    import torch

    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    torch.cuda.synchronize()
    return model


def run_worker(args) -> int:
    """One (model, mode): engine, capacity, refits, warm-up, the workloads. Appends one JSON line per
    result to args.result_file as soon as it has it."""
    t_proc = time.perf_counter()
    (model_name,), (mode,) = args.models, args.modes
    workloads = args.workloads
    base = {"model": model_name, "mode": mode}
    try:
        import torch

        from modeling import build_char_tokenizer

        hf_cfg = hf_config(model_name)
        model = meta_model(hf_cfg)
        tokenizer = build_char_tokenizer(CHAR_VOCAB)
        model_dir = write_model_dir(model, tempfile.mkdtemp(prefix=f"bench_rollout_{model_name}_"), tokenizer)
        trainer_bytes = 0 if args.capacity_only else param_bytes(model)
        if args.dry_run:
            device_name, total = "dry-run", 141 * 10**9
        else:
            if not torch.cuda.is_available():
                raise RuntimeError("bench/rollout.py needs a CUDA GPU (vLLM)")
            device_name, total = torch.cuda.get_device_name(), torch.cuda.mem_get_info()[1]
        gpu_mem = (auto_gpu_memory_utilization(total, trainer_bytes) if args.gpu_mem == "auto"
                   else float(args.gpu_mem))
        cfg = bench_config(mode, workloads, gpu_mem, args.capacity_only, tuple(args.set))
        base.update(device=device_name, gpu_memory_utilization=gpu_mem, enforce_eager=cfg.rollout.enforce_eager,
                    gpu_total_gib=round(total / GiB, 1), trainer_gib=round(param_bytes(model) / GiB, 2),
                    kv_bytes_per_token=kv_bytes_per_token(hf_cfg, cfg.fp8.kv_cache))
        say(f"{model_name} {mode}: {param_bytes(model) / 1e9:.2f} GB bf16 model, gpu_memory_utilization "
            f"{gpu_mem}, max_model_len {cfg.rollout.max_model_len}, enforce_eager {cfg.rollout.enforce_eager}")
        if args.dry_run:
            engine = _DryEngine(cfg, args)
        else:
            add_engine_kwargs(args.vllm)
            if args.no_pdl:
                launch_flashinfer_decode_without_pdl()
            from engines.vllm import VLLMEngine

            engine = VLLMEngine(cfg, model, tokenizer, torch.device("cuda"), model_dir=str(model_dir))
        cap = engine_capacity(engine) if not args.dry_run else engine.capacity()
        base.update(cap, startup_s=round(engine.startup_s, 2), process_ready_s=round(time.perf_counter() - t_proc, 2))
        say(f"engine up: vllm.LLM {engine.startup_s:.1f} s (process {base['process_ready_s']:.1f} s); KV cache "
            f"{cap['kv_capacity_tokens']:,} tokens ({cap['num_gpu_blocks']:,} blocks x {cap['block_size']}, "
            f"{cap['kv_cache_gib']} GiB {cap['kv_cache_dtype']}), max concurrency "
            f"{cap['kv_max_concurrency'] or 0:.1f} at max_model_len {cap['max_model_len']}; vLLM weights "
            f"{cap['weights_gib']} GiB")
        if args.capacity_only:
            emit(args.result_file, {"kind": "run", "workload": f"{model_name} capacity", **base})
            return 0

        # ---- trainer model and refit (the first update_weights is also what makes generate legal)
        if not args.dry_run:
            free = torch.cuda.mem_get_info()[0]
            if free < trainer_bytes + 4 * GiB:
                raise RuntimeError(f"after engine start {free / GiB:.1f} GiB are free, the trainer model needs "
                                   f"{trainer_bytes / GiB:.1f} + 4 GiB: lower --gpu-mem")
            materialize(model, torch.device("cuda"), args.seed)
        from fp8.export import export_weights

        kv_scales = ({i: (1.0, 1.0, 1.0) for i in range(hf_cfg.num_hidden_layers)} if cfg.fp8.kv_cache else None)
        refit, reload = [], []
        for i in range(args.refits):
            t0 = time.perf_counter()
            engine.update_weights(export_weights(model, cfg.fp8, fp8=cfg.fp8.rollout, kv_scales=kv_scales)
                                  if not args.dry_run else iter(()))
            if not args.dry_run:
                torch.cuda.synchronize()
            refit.append(time.perf_counter() - t0)
            reload.append(engine.last_refit_s)
            say(f"refit {i + 1}/{args.refits}: {refit[-1]:.2f} s (engine reload {reload[-1]:.2f} s)")
        base.update(refit_s=round(statistics.median(refit), 3), refit_all_s=[round(t, 3) for t in refit],
                    refit_reload_s=round(statistics.median(reload), 3))
        if not args.dry_run:
            base["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 2)

        warm = Workload(min(32, workloads[0].prompts), min(64, workloads[0].prompt_len), 16)
        t0 = time.perf_counter()
        engine.generate(random_prompts(warm, hf_cfg.vocab_size, args.seed + 999), n=1, temperature=1.0,
                        top_p=1.0, max_new_tokens=warm.gen_len, seed=args.seed)
        say(f"warm-up {warm.name}: {time.perf_counter() - t0:.1f} s")

        if args.decode_steps:
            for k, w in enumerate(workloads):
                emit(args.result_file, decode_row(engine, w, args, base, model_name, hf_cfg.vocab_size, k))
            return 0
        for k, w in enumerate(workloads):
            row = run_row(model_name, w, args, base)
            if args.deadline and time.time() > args.deadline - 20:
                say(f"{w.name}: skipped (time limit)")
                emit(args.result_file, {"kind": "error", **base, "workload": row["workload"],
                                        "error": "skipped: --time-limit reached before this workload"})
                continue
            prompts = random_prompts(w, hf_cfg.vocab_size, args.seed + k)
            preempted, t0 = getattr(engine, "preemptions", None), time.perf_counter()
            # whether the GPU or vLLM's host loop bounds the generation: the host's time per part, the GPU's busy share
            with timed_host(engine) as totals, gpu_busy() as busy:
                samples = engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=w.gen_len,
                                          seed=args.seed + 1000 * (k + 1))
            dt = time.perf_counter() - t0
            row["host_ms_per_step"], row["python_threads"] = host_ms_per_step(totals), other_threads()
            row.update(busy)
            if "error" not in totals:
                row["engine_steps"] = totals["step"][1]
            if preempted is not None:  # sequences vLLM recomputed for KV-cache room
                row["preemptions"] = engine.preemptions - preempted
            lens = [len(s.token_ids) for s in samples]
            gen = sum(lens)
            row.update(gen_s=round(dt, 3), gen_tokens=gen, out_tok_s=round(gen / dt, 1),
                       total_tok_s=round((gen + w.prompts * w.prompt_len) / dt, 1),
                       fixed_length=len(samples) == w.prompts and all(n == w.gen_len for n in lens))
            row.update(generation_bounds(row, gen, dt))
            if not row["fixed_length"] and not engine.cfg.rollout.ignore_eos_median:  # (drawn lengths: not fixed)
                say(f"WARNING {w.name}: {len(samples)} samples, lengths {min(lens)}..{max(lens)} (ignore_eos?)")
            say(f"{w.name}: {gen:,} tokens in {dt:.1f} s = {gen / dt:,.0f} out tok/s "
                f"(KV fits {row['seqs_fit']} of these sequences); {row.get('engine_steps', '?')} engine steps, host ms "
                f"per step {row['host_ms_per_step']} ({row.get('host_us_per_token', '?')} us a token at "
                f"{row.get('mean_batch', '?')} sequences a step); GPU busy {row.get('gpu_busy_frac', '?')} "
                f"({row.get('gpu_busy_s', '?')} s)")
            emit(args.result_file, row)
        return 0
    except Exception as e:  # recorded for the parent; the traceback goes to the log
        traceback.print_exc()
        emit(args.result_file, {"kind": "error", **base, "workload": f"{model_name} *",
                                "error": f"{type(e).__name__}: {str(e)[:2000]}",
                                "traceback": traceback.format_exc()[-4000:]})
        return 1


def run_row(model_name: str, w: Workload, args, base: dict, *label: str) -> dict:
    """A result row's common part; its workload label carries `label` ("decode") and the overrides."""
    return {"kind": "run", "workload": " ".join([model_name, w.name, *label, *overrides(args)]), "prompts": w.prompts,
            "prompt_len": w.prompt_len, "gen_len": w.gen_len, **base,
            "seqs_fit": base["kv_capacity_tokens"] // w.seq_len}


KERNEL_KINDS = (  # decode profile: kernel name pattern -> kind (first match wins)
    ("attention", r"flash|fmha|attn|attention|paged|kernel_mha|xqa"),  # kernel_mha: FlashInfer's XQA decode
    ("gemm", r"gemm|cutlass|xmma|nvjet|matmul|_mm_|scaled_mm|w8a8|marlin"),  # marlin: weight-only FP8
    ("act_quant", r"quant|fp8"),
    ("norm/rope", r"norm|rotary|rope"),
    ("sampling", r"sampl|softmax|topk|top_k|argmax|gumbel|exponential"),
)


def launch_flashinfer_decode_without_pdl() -> None:
    """--no-pdl: FlashInfer's decode (XQA on SM90) launched without programmatic dependent launch, which it
    enables on SM90 unless told otherwise and vLLM 0.26 does not tell it. flashinfer.decode resolves its
    default at each call from this module global, and the engine core runs in this process."""
    import flashinfer.decode

    flashinfer.decode.device_support_pdl = lambda device: False


def overrides(args) -> list[str]:
    """--set overrides, --vllm keywords as vllm.KEY=JSON, --no-pdl: what sets a run apart in labels and file
    names."""
    return [*args.set, *(f"vllm.{v}" for v in args.vllm), *(["flashinfer.pdl=off"] if args.no_pdl else [])]


def set_tag(overrides: list[str]) -> str:
    """File-name suffix of the overrides: "_rolloutblock_size128" for rollout.block_size=128."""
    return "".join("_" + re.sub(r"\W", "", o) for o in overrides)


def parse_vllm_kwarg(text: str) -> str:
    """--vllm KEY=JSON, checked here and kept as text (it goes to the children and into the labels)."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=JSON, a vllm.LLM keyword and its value, e.g. "
                                         """compilation_config='{"custom_ops": ["-quant_fp8"]}'""")
    try:
        json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{key}: its value {value!r} is not JSON ({e}); a string needs its "
                                         f"""quotes: {key}='"text"'""") from None
    return text


def merge_engine_kwargs(kwargs: dict, extra: dict) -> dict:
    """kwargs with extra's keywords set; a dict goes into the dict the engine already set, key by key."""
    out = dict(kwargs)
    for k, v in extra.items():
        out[k] = merge_engine_kwargs(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def add_engine_kwargs(texts: list[str]) -> None:
    """--vllm: every engine this process builds gets these vllm.LLM keywords on top of the config's.
    engines.vllm.vllm_engine_kwargs is wrapped, so that a benchmark can try a vLLM option the config
    does not expose (a compilation pass, another linear backend) without a change to the engine."""
    import engines.vllm as ev

    extra = {key: json.loads(value) for key, _, value in (t.partition("=") for t in texts)}
    make = ev.vllm_engine_kwargs
    ev.vllm_engine_kwargs = lambda *a, **kw: merge_engine_kwargs(make(*a, **kw), extra)


def kernel_table(prof, steps: int, top: int = 30) -> tuple[dict, str]:
    """({kind: ms per decode step}, text): device time of a profiled decode run by kernel kind, then
    the top kernels, each per decode step."""
    from observe import kernel_kind

    def kind_of(name):
        return kernel_kind(name, KERNEL_KINDS, "other")

    kernels = sorted(cuda_kernels(prof), key=lambda k: -k[1])
    kinds: dict[str, float] = {}
    for name, ms, _ in kernels:
        kind = kind_of(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms / steps
    total = sum(kinds.values()) or 1.0  # (no kernel seen: an empty table)
    lines = [f"{'kind':<12} {'ms/step':>9} {'share':>7}"]
    lines += [f"{k:<12} {v:9.3f} {v / total:7.1%}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    lines += ["", f"{'ms/step':>9} {'calls/step':>10} {'kind':<10} kernel"]
    lines += [f"{ms / steps:9.3f} {calls / steps:10.1f} {kind_of(name):<10} {name[:150]}"
              for name, ms, calls in kernels[:top]]
    return {k: round(v, 3) for k, v in kinds.items()}, "\n".join(lines) + "\n"


def host_parts(llm) -> dict[str, tuple[object, str]]:
    """Where vLLM 0.26's in-process decode step does host work, as (object, method name): the front end's step
    (LLM.generate's loop calls it), the engine core's step inside it, and in that the scheduler, the model
    runner's input preparation and graph launch (execute_model), the sampler's launch (sample_tokens) and the
    scheduler's bookkeeping of the outputs; then the front end's output processing (process_outputs)."""
    from engines import vllm_internals

    front, core = llm.llm_engine, vllm_internals.engine_core(llm)
    return {"step": (front, "step"), "engine_core_step": (core, "step_fn"), "schedule": (core.scheduler, "schedule"),
            "execute_model": (core.model_executor, "execute_model"),
            "sample_tokens": (core.model_executor, "sample_tokens"),
            "update_from_output": (core.scheduler, "update_from_output"),
            "process_outputs": (front.output_processor, "process_outputs")}


@contextlib.contextmanager
def timed_calls(parts: dict[str, tuple[object, str]]):
    """Inside: every call of each part's method timed (wall clock); yields {name: [seconds, calls]}. Each method
    is shadowed by an instance attribute and put back after, whether it was the instance's or its class's."""
    totals = {name: [0.0, 0] for name in parts}
    saved = []
    for name, (obj, attr) in parts.items():
        fn, own = getattr(obj, attr), attr in vars(obj)

        def timed(*a, _fn=fn, _total=totals[name], **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                _total[0] += time.perf_counter() - t0
                _total[1] += 1
        setattr(obj, attr, timed)
        saved.append((obj, attr, fn if own else None))
    try:
        yield totals
    finally:
        for obj, attr, fn in reversed(saved):
            if fn is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, fn)


@contextlib.contextmanager
def gc_timed(totals: dict[str, list]):
    """Inside: the Python garbage collector's passes timed into totals["gc"] = [seconds, passes] (gc.callbacks):
    collections run inside whichever host part allocated, so they are an "of which", not a part of their own."""
    import gc

    total, started = totals.setdefault("gc", [0.0, 0]), []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            total[0] += time.perf_counter() - started.pop()
            total[1] += 1
    gc.callbacks.append(on_gc)
    try:
        yield totals
    finally:
        gc.callbacks.remove(on_gc)


def generation_bounds(row: dict, gen_tokens: int, gen_s: float) -> dict:
    """What bounds a generation, from a run row's engine_steps, host_ms_per_step and gpu_busy_frac (each
    where measured): mean_batch (sequences decoded per engine step), host_us_per_token (vLLM's host loop per
    generated token: at a fixed cost per sequence and step, the batch does not amortise it) and gpu_busy_s
    (the GPU's time at work: the rollout a host with no cost would leave)."""
    out = {}
    if row.get("engine_steps") and "step" in row.get("host_ms_per_step", {}):
        out["mean_batch"] = round(gen_tokens / row["engine_steps"], 1)
        out["host_us_per_token"] = round(1000 * row["host_ms_per_step"]["step"] / out["mean_batch"], 1)
    if "gpu_busy_frac" in row:
        out["gpu_busy_s"] = round(gen_s * row["gpu_busy_frac"], 2)
    return out


@contextlib.contextmanager
def gpu_busy(period_ms: int = 100):
    """Inside: NVML's utilization.gpu sampled every period_ms by `nvidia-smi -lms` on this process's first
    visible GPU, the share of each sample period in which some kernel ran (any process on that GPU). Yields
    a dict that gets on exit gpu_busy_frac (the mean over the samples) and gpu_busy_samples, or
    gpu_busy_error. Over a whole rollout, 1 - gpu_busy_frac is the time no kernel runs: what the GPU waits on
    the host for, which host milliseconds per step cannot say when the host loop overlaps the GPU's work
    (async scheduling). Coarse per sample (NVML averages over its own window), meaningful over seconds."""
    out: dict = {}
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    cmd = ["nvidia-smi", "-i", gpu, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
           "-lms", str(period_ms)]
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError as e:
        out["gpu_busy_error"] = f"nvidia-smi: {e}"
        yield out
        return
    try:
        yield out
    finally:
        p.terminate()
        text = p.communicate(timeout=10)[0]
        samples = [float(x) for x in text.split() if re.fullmatch(r"\d+(\.\d+)?", x)]
        if samples:
            out.update(gpu_busy_frac=round(statistics.fmean(samples) / 100, 3), gpu_busy_samples=len(samples))
        else:
            out["gpu_busy_error"] = f"no samples from {' '.join(cmd)}: {text.strip()[:200]!r}"


@contextlib.contextmanager
def timed_host(engine):
    """timed_calls over host_parts(engine.llm), and the garbage collector's passes (gc_timed); yields
    {"error": ...} instead where the engine is not vLLM 0.26's in-process LLM (another vLLM's internals, or a
    stand-in)."""
    try:
        parts = host_parts(engine.llm)
    except AttributeError as e:
        yield {"error": f"not timed: {e}"}
        return
    with timed_calls(parts) as totals, gc_timed(totals):
        yield totals


def other_threads() -> list[str]:
    """The names of this process's live Python threads but the main one (any that runs takes the GIL from vLLM's
    host loop)."""
    import threading

    return sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())


def host_profile(path: Path, run, top: int = 40) -> None:
    """cProfile over run() (e.g. one more decode window), the top functions by own time to path."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(run)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    path.write_text(text.getvalue())


def host_ms_per_step(totals: dict[str, list], steps: int | None = None) -> dict[str, float]:
    """timed_calls' totals as ms per decode step (steps: default the front end's step calls), plus engine_core_wait:
    the engine core's step less its timed parts, mostly the wait for the GPU's sampled tokens (with async
    scheduling, one step behind the launch). "gc", where timed, is inside the parts, not beside them."""
    if "error" in totals:
        return dict(totals)
    steps = steps or max(totals["step"][1], 1)
    ms = {name: 1e3 * sec / steps for name, (sec, _) in totals.items()}
    parts = ("schedule", "execute_model", "sample_tokens", "update_from_output")
    ms["engine_core_wait"] = ms["engine_core_step"] - sum(ms[p] for p in parts)
    return {name: round(v, 3) for name, v in ms.items()}


WINDOW_SPREAD = 0.10  # decode_row warns when its full windows differ by more than this


def decode_row(engine, w: Workload, args, base: dict, model_name: str, vocab: int, k: int) -> dict:
    """Decode step time at batch w.prompts and context ~w.prompt_len: the prompts go through once with
    one new token (their KV stays in vLLM's prefix cache), then windows of args.decode_steps new tokens and of
    half as many are timed in turn, args.decode_repeats times (each sequence's last prompt block is recomputed:
    a small prefill; the first full window runs inside cudaProfilerStart/Stop, which `ncu --profile-from-start
    off` sees alone), then a full window under torch.profiler; the kernel table goes to
    OUT/logs/decode_<model>_<mode>_<workload>.txt, and kernel_busy_ms_per_step is the time any kernel ran
    (overlapping kernels once, where the table's kinds add them up). decode_step_ms is the median full window's
    wall time per step, with its fixed costs (admitting the requests, hashing their prompt blocks, the last
    blocks' prefill); decode_step_marginal_ms what the median full window adds to the median half window per
    step, the fixed costs cancelled (its contexts are up to n / 2 tokens longer). A single pair of windows left
    that difference several ms off at 64 steps, below the kernels' own time, hence the repeats;
    decode_windows_s keeps them all, decode_step_min_ms is the fastest full window per step and
    decode_windows_spread the slowest over the fastest, less 1 (a slow-cored H100 host spread them 40%, where
    two runs' medians then differed by a third: above WINDOW_SPREAD the row says so). host_ms_per_step: one
    more full window with vLLM's host work timed per part (host_parts, timed_calls), ms per decode step, the
    window's fixed costs included: set beside kernel_busy_ms_per_step, it says whether the GPU waits on the
    host."""
    import torch

    prompts, n = random_prompts(w, vocab, args.seed + k), args.decode_steps
    gen = dict(n=1, temperature=1.0, top_p=1.0, seed=args.seed + 1000 * (k + 1))
    t0 = time.perf_counter()
    engine.generate(prompts, max_new_tokens=1, **gen)
    prefill_s = time.perf_counter() - t0
    windows: dict[int, list[float]] = {n: [], n // 2: []} if n >= 2 else {n: []}
    for r in range(args.decode_repeats):
        for steps in windows:
            first = r == 0 and steps == n
            if first:  # (a no-op unless a profiler waits for it: `ncu --profile-from-start off`)
                torch.cuda.profiler.start()
            t0 = time.perf_counter()
            samples = engine.generate(prompts, max_new_tokens=steps, **gen)
            windows[steps].append(time.perf_counter() - t0)
            if first:
                torch.cuda.profiler.stop()
                tokens = sum(len(s.token_ids) for s in samples)
    dt = statistics.median(windows[n])
    row = {**run_row(model_name, w, args, base, "decode"), "gen_len": n, "prefill_s": round(prefill_s, 3),
           "gen_s": round(dt, 3), "gen_tokens": tokens, "out_tok_s": round(tokens / dt, 1),
           "decode_step_ms": round(1e3 * dt / n, 3),
           "decode_windows_s": {str(steps): [round(t, 4) for t in ts] for steps, ts in windows.items()}}
    if n >= 2:
        row["decode_step_marginal_ms"] = round(1e3 * (dt - statistics.median(windows[n // 2])) / (n - n // 2), 3)
    row["decode_step_min_ms"] = round(1e3 * min(windows[n]) / n, 3)
    row["decode_windows_spread"] = round(max(windows[n]) / min(windows[n]) - 1, 3)
    with timed_host(engine) as totals:  # one more full window with vLLM's host work timed: what the GPU may wait on
        engine.generate(prompts, max_new_tokens=n, **gen)
    row["host_ms_per_step"], row["python_threads"] = host_ms_per_step(totals, n), other_threads()
    logs = Path(args.result_file).parent
    tag = f"{model_name}_{base['mode']}_{w.name.replace('->', '_')}{set_tag(overrides(args))}"
    if args.host_profile:  # and one under cProfile: which Python functions the host loop spends its time in
        host_profile(logs / f"host_profile_{tag}.txt", lambda: engine.generate(prompts, max_new_tokens=n, **gen))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, max_new_tokens=n, **gen)
    row["kernel_ms_per_step"], text = kernel_table(prof, n)
    row["kernel_busy_ms_per_step"] = round(cuda_busy_ms(prof) / n, 3)
    path = logs / f"decode_{tag}.txt"
    marginal = row.get("decode_step_marginal_ms", float("nan"))
    busy = row["kernel_busy_ms_per_step"]
    path.write_text(f"{row['workload']} {base['mode']}: {n} decode steps at batch {w.prompts}, "
                    f"{row['decode_step_ms']:.2f} ms per step unprofiled ({marginal:.2f} marginal); kernels busy "
                    f"{busy:.2f} ms per step (the kinds below add up overlapping kernels twice)\n\n{text}")
    say(f"{w.name} decode: {row['decode_step_ms']:.2f} ms per step at batch {w.prompts} "
        f"({row['out_tok_s']:,.0f} tok/s; {marginal:.2f} ms marginal; kernels busy {busy:.2f} ms); kernels per step "
        f"{row['kernel_ms_per_step']}; host ms per step {row['host_ms_per_step']}")
    if row["decode_windows_spread"] > WINDOW_SPREAD:
        say(f"WARNING {w.name}: the full windows spread {100 * row['decode_windows_spread']:.0f}% "
            f"(fastest {row['decode_step_min_ms']:.2f} ms per step): the median moves from run to run on this host; "
            "compare decode_step_min_ms, or more --decode-repeats")
    if row["seqs_fit"] < w.prompts:  # the prefix cache cannot keep every prompt: the window prefills again
        row["note"] = (f"the KV cache holds {row['seqs_fit']} of these {w.prompts} sequences: evicted prompts are "
                       "prefilled again inside the window, so this is not a decode step's time")
        say(f"WARNING {w.name}: {row['note']}")
    return row


class _DryEngine:
    """Stand-in engine for --dry-run (CPU test of the orchestration): fixed figures, fake samples."""

    def __init__(self, cfg, args):
        from rollout import Sample

        self.cfg, self.args, self._sample = cfg, args, Sample
        self.startup_s, self.last_refit_s, self.preemptions = 0.01, 0.001, 0
        if args.dry_run_fail == args.modes[0]:
            raise RuntimeError(f"dry-run failure requested for mode {args.modes[0]}")

    def capacity(self) -> dict:
        tokens = {"bf16": 100000, "fp8": 120000, "fp8kv": 240000}[self.args.modes[0]]
        bpt = 147456 // (2 if self.cfg.fp8.kv_cache else 1)
        return {"num_gpu_blocks": tokens // 16, "block_size": 16, "kv_capacity_tokens": tokens,
                "kv_cache_size_tokens": tokens, "kv_max_concurrency": tokens / self.cfg.rollout.max_model_len,
                "kv_cache_dtype": "fp8" if self.cfg.fp8.kv_cache else "auto",
                "max_model_len": self.cfg.rollout.max_model_len, "max_num_seqs": 1024,
                "max_num_batched_tokens": 16384, "kv_cache_bytes": tokens * bpt, "kv_cache_gib": tokens * bpt / GiB,
                "weights_gib": 15.0, "peak_activation_gib": 1.0, "non_torch_gib": 0.5, "cudagraph_estimate_gib": 0.0}

    def update_weights(self, weights):
        for _ in weights:
            pass

    def generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, seed=None):
        speed = {"bf16": 1.0, "fp8": 1.1, "fp8kv": 1.2}[self.args.modes[0]]
        time.sleep(0.01 / speed)
        return [self._sample(i, p, [FIRST_TOKEN] * max_new_tokens, [0.0] * max_new_tokens, "length")
                for i, p in enumerate(prompt_ids) for _ in range(n)]


# ----------------------------------------------------------------------------------- parent


def derive(runs: list[dict]) -> list[dict]:
    """Workloads in order of first appearance, modes in MODES order within each; cross-run figures
    added in place: speedup (out_tok_s vs bf16 of the same workload), kv_ratio_vs_bf16, and for
    Qwen3-8B the capacities projected to NeMo RL's budget (see the module doc)."""
    mode_rank = {m: i for i, m in enumerate(MODES)}
    first: dict = {}
    for r in runs:
        first.setdefault(r.get("workload", ""), len(first))
    runs = sorted(runs, key=lambda r: (first[r.get("workload", "")], mode_rank.get(r.get("mode"), 99)))
    add_ratio(runs, "speedup", "out_tok_s", digits=3)
    add_ratio(runs, "kv_ratio_vs_bf16", "kv_capacity_tokens", digits=3)
    bf16 = {r["workload"]: r for r in runs if r.get("mode") == "bf16"}
    nemo = NEMO_QWEN3_8B_KV_TOKENS
    for r in runs:
        if not (r.get("model") == "qwen3-8b" and r.get("mode") in nemo
                and str(r.get("workload", "")).endswith(" capacity")):
            continue
        b = bf16.get(r["workload"])
        r["nemo_kv_tokens"] = nemo[r["mode"]]
        r["nemo_kv_ratio_vs_bf16"] = round(nemo[r["mode"]] / nemo["bf16"], 3)
        if b and all(x.get(k) for x in (r, b) for k in ("kv_cache_bytes", "kv_bytes_per_token")):
            shift = nemo["bf16"] * b["kv_bytes_per_token"] - b["kv_cache_bytes"]  # bytes added to the budget
            base_tokens = (b["kv_cache_bytes"] + shift) // b["kv_bytes_per_token"]
            r["kv_tokens_at_nemo_budget"] = int((r["kv_cache_bytes"] + shift) // r["kv_bytes_per_token"])
            r["kv_ratio_at_nemo_budget"] = round(r["kv_tokens_at_nemo_budget"] / base_tokens, 3)
    return runs


THROUGHPUT_COLS = ["workload", "mode", "out_tok_s", "speedup", "preemptions", "startup_s", "refit_s",
                   "kv_capacity_tokens", "kv_max_concurrency", "seqs_fit", "gpu_memory_utilization"]
CAPACITY_COLS = ["workload", "mode", "kv_capacity_tokens", "kv_ratio_vs_bf16", "kv_tokens_at_nemo_budget",
                 "kv_ratio_at_nemo_budget", "nemo_kv_tokens", "nemo_kv_ratio_vs_bf16", "weights_gib", "kv_cache_gib",
                 "gpu_memory_utilization"]


def report(runs: list[dict], capacity: bool) -> str:
    """Markdown table + one speed-up line per (workload, mode) vs bf16 (runs as derive returns them)."""
    text = markdown_table(runs, CAPACITY_COLS if capacity else THROUGHPUT_COLS)
    lines = []
    for r in runs:
        if r.get("mode") == "bf16":
            continue
        if capacity and r.get("kv_ratio_vs_bf16"):
            lines.append(f"{r['workload']} {r['mode']}: KV capacity x{r['kv_ratio_vs_bf16']:.2f} vs bf16"
                         + (f" (at NeMo's budget x{r['kv_ratio_at_nemo_budget']:.2f}; "
                            f"NeMo x{r['nemo_kv_ratio_vs_bf16']:.2f})" if r.get("kv_ratio_at_nemo_budget") else ""))
        elif not capacity and r.get("speedup"):
            lines.append(f"{r['workload']} {r['mode']}: x{r['speedup']:.2f} output tok/s vs bf16")
    return text + ("\n\n" + "\n".join(lines) if lines else "")


def worker_argv(args, model: str, mode: str, result_file: Path, deadline: float | None) -> list[str]:
    argv = [sys.executable, "-m", "bench.rollout", "--worker", "--models", model, "--modes", mode,
            "--workloads", ",".join(w.name for w in args.workloads), "--refits", str(args.refits),
            "--gpu-mem", str(args.gpu_mem), "--seed", str(args.seed), "--result-file", str(result_file)]
    if args.capacity_only:
        argv.append("--capacity-only")
    if args.decode_steps:
        argv += ["--decode-steps", str(args.decode_steps), "--decode-repeats", str(args.decode_repeats)]
        argv += ["--host-profile"] if args.host_profile else []
    for o in args.set:
        argv += ["--set", o]
    for v in args.vllm:
        argv += ["--vllm", v]
    if args.no_pdl:
        argv.append("--no-pdl")
    if deadline:
        argv += ["--deadline", f"{deadline:.1f}"]
    if args.dry_run:
        argv += ["--dry-run", "--dry-run-fail", args.dry_run_fail]
    return argv


def run_parent(args) -> int:
    """One child per (model, mode) through bench.runner.run_jobs, all visible GPUs at once; OUT/<name>.json
    rewritten after every child, keeping the file's runs of the same device that are not re-measured."""
    t0 = time.time()
    deadline = t0 + args.time_limit if args.time_limit else None
    out = Path(args.out).resolve()
    logs = out / "logs"
    name = "rollout_capacity" if args.capacity_only else "rollout"
    models = args.models or (["qwen3-8b"] if args.capacity_only else ["llama3.1-8b"])
    suffix = "_capacity" if args.capacity_only else set_tag(overrides(args))
    jobs = []
    for model in models:
        for mode in args.modes or DEFAULT_MODES:
            stem = f"rollout{suffix}_{model}_{mode}"  # (model names hold dots: no with_suffix)
            log, records = logs / f"{stem}.log", logs / f"{stem}.jsonl"
            jobs.append(Job(f"{model}/{mode}", worker_argv(args, model, mode, records, deadline), log, records,
                            info={"model": model, "mode": mode}))
    gpus = visible_gpus()  # one child per GPU at a time
    print(f"[rollout] {len(jobs)} runs ({', '.join(j.label for j in jobs)}) on GPU slots {gpus}; "
          f"workloads {', '.join(w.name for w in args.workloads)}; "
          f"{'capacity only (enforce_eager); ' if args.capacity_only else ''}"
          f"time limit {args.time_limit or 'none'} s; child logs in {logs}", flush=True)
    existing = read_results(out / f"{name}.json")
    runs, errors, device = [], [], None

    def on_done(job: Job) -> None:
        nonlocal device
        records = read_records(job.records)
        if job.status != "ok" and not any(r.get("kind") == "error" for r in records):
            why = {"not started": "not started: --time-limit", "killed at the time limit": "killed at --time-limit"}
            records.append({"kind": "error", **job.info, "workload": f"{job.info['model']} *",
                            "error": why.get(job.status, f"exit code {job.rc}")})
        for r in records:
            if r.get("device") and device in (None, "unknown"):
                device = r["device"]
            (runs if r.get("kind") == "run" else errors).append({k: v for k, v in r.items() if k != "kind"})
        print(f"[rollout] wrote {write()} ({len(runs)} new runs so far)", flush=True)

    def write() -> Path:
        # no child reported a device yet (all failed early): keep the file's, so its runs survive
        dev = device or (existing or {}).get("device") or "unknown"
        extra = {"errors": [{k: e.get(k) for k in ("workload", "mode", "error")} for e in errors]} if errors else {}
        return update_results(name, runs, out, device=dev, derive=derive, **extra)

    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    min_left = args.min_job_s if args.min_job_s is not None else (45 if args.capacity_only else 120)
    failed = run_jobs(jobs, on_done, gpus=gpus, deadline=deadline, min_left=min_left, stagger_s=args.stagger_s,
                      poll_s=args.poll_s, env=env, cwd=REPO, tag="rollout")
    path = write()
    print(f"\nwrote {path} after {time.time() - t0:.0f} s\n")
    print(report(read_results(path)["runs"], args.capacity_only))
    if errors:
        print("\nerrors:\n" + "\n".join(f"  {e.get('workload')} {e.get('mode')}: {e.get('error')}" for e in errors))
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=parse_models, default=None,
                   help="comma list of llama3.1-8b (llama), llama3.2-3b (llama3b: untied head, bench/peer.py's), "
                        "qwen3-8b (qwen3), qwen3-30b-a3b (qwen3-moe: "
                        f"{MOE_LAYERS} of 48 layers); "
                        "default llama, qwen3 with --capacity-only")
    p.add_argument("--modes", type=lambda text: parse_choices(text, MODES), default=None,
                   help=f"comma list of {list(MODES)}, run in this order (default {','.join(DEFAULT_MODES)})")
    p.add_argument("--workloads", type=parse_workloads, default=parse_workloads(DEFAULT_WORKLOADS),
                   help=f"comma list of PxL->G or PxL:G (default {DEFAULT_WORKLOADS})")
    p.add_argument("--capacity-only", action="store_true",
                   help="engine start (enforce_eager) and KV capacity only; writes rollout_capacity.json")
    p.add_argument("--gpu-mem", type=parse_gpu_mem, default="auto", help="gpu_memory_utilization, or 'auto'")
    p.add_argument("--decode-steps", type=int, default=0,
                   help="instead of whole generations: N decode steps per workload PxL->G (batch P, context ~L, "
                        "G unused) timed and profiled by kernel kind (OUT/logs/decode_*.txt)")
    p.add_argument("--decode-repeats", type=parse_repeats, default=3,
                   help="with --decode-steps: timed windows of each length (median reported, all kept)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override for every mode (e.g. rollout.block_size=128); part of the workload label")
    p.add_argument("--vllm", action="append", default=[], type=parse_vllm_kwarg, metavar="KEY=JSON",
                   help="a vllm.LLM keyword for every mode, on top of the config's (a dict is merged into the "
                        "engine's): vLLM options the config does not expose; part of the workload label")
    p.add_argument("--no-pdl", action="store_true",
                   help="FlashInfer's decode kernels (XQA) launched without programmatic dependent launch, "
                        "which flashinfer enables by default on SM90; part of the workload label")
    p.add_argument("--host-profile", action="store_true",
                   help="with --decode-steps: one more window under cProfile, the top Python functions by own time "
                        "to OUT/logs/host_profile_*.txt")
    p.add_argument("--refits", type=int, default=3, help="update_weights calls timed (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked); logs in OUT/logs")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds: start no child after (limit - min job time), kill children at the limit (0 = none)")
    p.add_argument("--min-job-s", type=float, default=None,
                   help="do not start a child with less time left (default 120, 45 with --capacity-only)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge results files into OUT and print the table")
    # internal: the child side, and the CPU test hooks of the orchestration
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dry-run-fail", default="", help=argparse.SUPPRESS)
    p.add_argument("--stagger-s", type=float, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--poll-s", type=float, default=1.0, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.refits < 1:
        p.error("--refits must be >= 1")
    if args.merge:  # several calls' files: one file, named after the first
        path, runs = merge_files(args.merge, Path(args.merge[0]).stem, Path(args.out), derive)
        print(f"wrote {path}\n{report(runs, all(str(r.get('workload', '')).endswith(' capacity') for r in runs))}")
        return 0
    if args.set:  # a typo fails here, once, not in every child
        from config import ConfigError

        try:
            bench_config("bf16", args.workloads, 0.8, overrides=tuple(args.set))
        except ConfigError as e:
            p.error(f"--set: {e}")
    if args.worker:
        if not args.result_file or not args.models or not args.modes or len(args.models) != 1 or len(args.modes) != 1:
            p.error("--worker needs --result-file and exactly one --models and one --modes")
        try:
            rc = run_worker(args)
        except BaseException:  # (run_worker records its own errors; this is for anything else)
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # skip interpreter teardown of the in-process engine (can hang; nothing left to save)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
