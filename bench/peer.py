"""Peer benchmark: TRL's GRPOTrainer (eager, compiled, with Liger's kernels), our BF16 twin and our FP8 recipe
on one workload, one GPU.

    python -m bench.peer --model llama3b --prepare                  # the model dir (once per host; ~1 min)
    python -m bench.peer --model llama3b --systems trl --timeout 560          # one system per device call
    python -m bench.peer --model llama3b --systems trl_compile --timeout 560  # (10-minute limit); each call adds
    python -m bench.peer --model llama3b --systems ours_fp8 --timeout 560     # its row to OUT/peer_<card>.json
    python -m bench.peer --model llama3b --systems ours_bf16 --steps 3 --profile 1  # step 1's kernels, by phase
    python -m bench.peer --tiny --out /tmp/peer                     # CPU: a tiny Llama, HF generation (the test)

Run with the repo root as the working directory (or PYTHONPATH=.). Models (--model), random init at real shape:
  llama3b    Llama-3.2-3B's dimensions with an untied head (3.6 B): one H100 80 GB holds every system
  llama8b    Llama-3.1-8B's (8.0 B, the default): TRL's row needs one H200 141 GB (docs/peer.md, memory)
The results file is named after the card (llama3b on an H100 -> peer_h100.json, llama8b on an H200 ->
peer_h200.json) and the workload after the model, so a file holds one table per model run on that card.

Systems, one after another, each in its own process (vLLM: one engine per process):
  trl          TRL 1.16's GRPOTrainer (requirements-peer.txt), eager: vLLM colocated with sleep mode, its
               importance-sampling correction on (its default), fp32 master weights under bf16 autocast (its
               default) with torchao's 8-bit AdamW (its default AdamW does not fit: docs/peer.md); its nan/inf loss
               filter off (on, Trainer syncs the host on every micro-step's loss)
  trl_compile  + torch_compile, accelerate's regional compilation (each decoder layer, as ours)
  trl_liger    + Liger's RMSNorm, RoPE and SwiGLU kernels (use_liger_kernel)
  ours_bf16    train_grpo.py --config configs/llama31_8b_bf16.yaml + the workload overrides
  ours_fp8     train_grpo.py --config configs/llama31_8b_fp8.yaml + the workload overrides
and a pair apart, every 2nd decoder layer checkpointed on both sides (model.gradient_checkpointing_every=2):
  trl_ckpt2, ours_bf16_ckpt2, ours_fp8_ckpt2

Workload: the model written once as a local HF dir in bf16 (--prepare; both sides load it), synthetic prompts,
8 prompts x 32 samples per step, every sample 1,024 new tokens (vLLM ignore_eos on both sides). Everything
else is our BF16 twin's config, and TRL takes its shared knobs from it: lr and warm-up, weight decay, clipping,
gradient checkpointing, vLLM's memory share and max_model_len, temperature, and the batch split. Our configs
train 4 optimizer steps per rollout step (2048 samples, mini-batches of 512); here 256 samples in mini-batches
of 64 of micro-batches of 4. TRL counts one micro-batch as a "step": per_device_train_batch_size = 4 (micro),
gradient_accumulation_steps = 16 (mini / micro), steps_per_generation = 64 (samples / micro), so a generation
feeds 64 / 16 = 4 optimizer steps, and num_iterations = 1 (each sample trained on once, as ours).

Figures per system: the median over steps 1..N-1 (step 0 starts engines, compiles, autotunes; --steps 6 by
default: 5 timed) of the step time, generated tokens per second of step time, and the phases: rollout_s
(generation with the engine's wake and sleep), logprobs_s (reward, advantages, old logprobs), train_s (forward,
backward and optimizer steps), refit_s (weights into the engine; ours: + q/k/v recalibration); peak_gib: the
device memory in use at its peak (distributed.DevicePeak, whole run). Ours come from train_grpo.py's own
metrics; TRL's from timers around its generation (GRPOTrainer._generate_single_turn), its weight push
(VLLMGeneration.sync_weights) and its rollout-and-score (GRPOTrainer._generate_and_score_completions), and the
step from its optimizer steps (a callback). Results: OUT/peer_<card>.json {"rows": [...]} (a run replaces the
rows of the systems it ran, keeps the others) and OUT/peer_<card>.md, the table with each row's tokens/s over
the fastest TRL row of its group (the main rows; the pair). Logs: OUT/peer_<system>.log. docs/peer.md: the
settings that differ.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from bench.host_speed import cpuinfo
from bench.rollout import tiny_shape
from bench.runner import (RESULTS, device_name, fail, kill_group, markdown_table, nvidia_smi, read_records,
                          write_json)

ROOT = Path(__file__).resolve().parents[1]
TWIN = "llama31_8b_bf16"  # TRL's shared knobs come from our BF16 twin with the workload overrides


@dataclass(frozen=True)
class System:
    config: str  # our config it runs; a TRL row: the twin its shared knobs come from
    trl: dict | None = None  # a TRL row: GRPOConfig fields over trl_args'; None: train_grpo.py
    overrides: tuple[str, ...] = ()  # config overrides of this row, before the command line's (TRL reads them too)
    env: dict = field(default_factory=dict)  # the child process's environment
    group: str = "main"  # rows whose ratios share one TRL baseline, the fastest TRL row of the group


# Trainer tests each micro-step's loss for nan/inf in Python (transformers/trainer.py, Trainer._run_epoch,
# logging_nan_inf_filter): a host sync per micro-step that no TRL row needs, the losses here are finite
NO_NAN_FILTER = {"logging_nan_inf_filter": False}
CKPT2 = "model.gradient_checkpointing_every=2"  # layers 0, 2, 4, ... checkpointed; the others keep their activations
SYSTEMS = {
    "trl": System(TWIN, trl=NO_NAN_FILTER),
    # torch_compile with ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1: accelerate compiles each decoder layer
    # (accelerate.utils.compile_regions, from Accelerator.prepare_model) as ours does, not the whole model.
    # Checkpointing stays on every layer, non-reentrant (transformers' default, stated so the row does not rest on
    # it): torch.compile traces it into the compiled layer as a recomputed region, so a compiled layer keeps for
    # backward what an eager checkpointed one does (measured on the CPU: docs/peer.md). The micro-batch stays at 4:
    # the first try's out-of-memory was TRL training on the whole generation batch at once, which run_trl stops.
    "trl_compile": System(TWIN, trl={**NO_NAN_FILTER, "torch_compile": True,
                                     "gradient_checkpointing_kwargs": {"use_reentrant": False}},
                          env={"ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "1"}),
    # Liger's RMSNorm, RoPE and SwiGLU (Triton); GRPOTrainer turns Liger's fused cross-entropy off for its own head
    "trl_liger": System(TWIN, trl={**NO_NAN_FILTER, "use_liger_kernel": True}),
    "ours_bf16": System("llama31_8b_bf16"),
    "ours_fp8": System("llama31_8b_fp8"),
    "trl_ckpt2": System(TWIN, trl=NO_NAN_FILTER, overrides=(CKPT2,), group="ckpt2"),
    "ours_bf16_ckpt2": System("llama31_8b_bf16", overrides=(CKPT2,), group="ckpt2"),
    "ours_fp8_ckpt2": System("llama31_8b_fp8", overrides=(CKPT2,), group="ckpt2"),
}
GROUPS = {"main": "",  # a group's heading in the table
          "ckpt2": "every 2nd decoder layer checkpointed, both sides (model.gradient_checkpointing_every=2)"}
# bench/rollout.py's shapes (model.tiny fields) at the workload's context
LLAMA_8B = dict(tiny_shape("llama3.1-8b"), max_position_embeddings=8192)
LLAMA_3B = dict(tiny_shape("llama3.2-3b"), max_position_embeddings=8192)  # head untied
MODELS = {"llama3b": ("Llama-3.2-3B shape", LLAMA_3B), "llama8b": ("Llama-3.1-8B shape", LLAMA_8B)}  # (label, dims)
MIN_CARD_GIB = {"llama3b": 70, "llama8b": 120}  # TRL's row beside the engine: docs/peer.md, memory
TINY = dict(arch="llama", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=32)
READY = "peer_model_ready"  # written last into the model dir: a dir without it is rebuilt
HEAD_SCALE = 200.0  # --tiny: lm_head scale that makes the zeroed special tokens' logit 0 unreachable (prepare)


def spec(system: str) -> System:
    """The system's definition; a row of an older run with a name no longer defined reads as an eager TRL row
    or one of ours by its prefix."""
    return SYSTEMS.get(system) or System(TWIN, trl={} if system.startswith("trl") else None)


def is_trl(system: str) -> bool:
    return spec(system).trl is not None


@dataclass(frozen=True)
class Workload:
    prompts: int
    n: int
    new_tokens: int
    prompt_tokens: int  # data.max_prompt_tokens (the synthetic prompts are 5 tokens)


FULL = Workload(8, 32, 1024, 128)
SMALL = Workload(2, 8, 8, 32)  # --tiny: 16 samples of 8 tokens, 4 optimizer steps of one micro-batch of 4


def workload(args) -> Workload:
    return SMALL if args.tiny else FULL


def workload_label(args) -> str:
    w = workload(args)
    model = "tiny Llama on CPU" if args.tiny else MODELS[args.model][0]
    return f"{w.prompts} prompts x {w.n} samples x {w.new_tokens} tokens (fixed length), {model}, random init"


def workload_overrides(args, system: str) -> list[str]:
    """The system's config overrides for the workload (TRL reads its shared knobs from the twin with them):
    the workload's, the system's own, then the command line's."""
    from config import load_config

    w, shipped = workload(args), load_config(ROOT / "configs" / f"{TWIN}.yaml")
    opt_steps = shipped.rollout.prompts_per_step * shipped.rollout.n // shipped.train.mini_batch_size
    over = [f"model.name_or_path={args.model_dir}", "data.source=synthetic", "data.template=plain",
            "data.instruction=", f"data.max_prompt_tokens={w.prompt_tokens}", f"rollout.prompts_per_step={w.prompts}",
            f"rollout.n={w.n}", f"rollout.max_new_tokens={w.new_tokens}", "rollout.ignore_eos=true",
            f"train.mini_batch_size={w.prompts * w.n // opt_steps}", f"train.steps={args.steps}",
            "train.val_every=0", "train.ckpt_every=0", "train.save_final=false", "log.tensorboard=false",
            "log.dump_episodes_every=0"]
    if args.tiny:  # our HF engine has no ignore_eos: the tiny model never samples EOS instead (prepare)
        over += ["rollout.engine=hf", "train.device=cpu", "data.synthetic.num_train=64", "data.synthetic.num_val=8"]
    if args.profile:  # ours' profiler (observe.StepProfile) after the rollout: logprobs, train, refit
        over += [f"log.profile_step={args.profile}", "log.profile_rollout=false", "log.profile_trace=false"]
    return over + list(spec(system).overrides) + args.overrides


def model_dir(args) -> Path:
    """The workload's model dir: --model-dir, else /tmp/peer_<model> (--tiny: under --runs)."""
    if args.model_dir:
        return Path(args.model_dir).resolve()
    return (Path(args.runs) / "peer_model_tiny" if args.tiny else Path(f"/tmp/peer_{args.model}")).resolve()


def results_path(out, gpu: str) -> Path:
    """OUT/peer_<card>.json: named after the card, 'NVIDIA H100 80GB HBM3' -> peer_h100.json."""
    return Path(out) / f"peer_{gpu_tag(gpu)}.json"


# ----------------------------------------------------------------------------------- the model dir


def prepare(args) -> None:
    """Write args.model_dir: the workload's random-init model in bf16 with the char tokenizer (config,
    safetensors, tokenizer), which transformers and vLLM both load. --tiny: the lm_head rows of <pad>,
    <bos> and <eos> are zeroed and the others scaled by HEAD_SCALE, so those tokens' logit (0) sits tens
    of nats below the largest and is never sampled: fixed lengths in our HF engine, which has no ignore_eos."""
    import torch

    from config import TinyModelConfig
    from modeling import build_char_tokenizer, build_tiny_model, save_model_dir

    path = Path(args.model_dir)
    if (path / READY).is_file():
        print(f"[prepare] {path}: ready", flush=True)
        return
    shutil.rmtree(path, ignore_errors=True)
    t0, device = time.time(), "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    torch.manual_seed(0)
    spec_ = TinyModelConfig(**(TINY if args.tiny else MODELS[args.model][1]))
    tokenizer = build_char_tokenizer(spec_.vocab)
    with torch.device(device):
        model = build_tiny_model(spec_, tokenizer, torch.bfloat16)
    if args.tiny:
        with torch.no_grad():
            head = model.get_output_embeddings().weight  # [V, H]
            head.mul_(HEAD_SCALE)
            head[[tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]] = 0
    save_model_dir(model, tokenizer, path)
    (path / READY).write_text(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
    print(f"[prepare] {path}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in "
          f"{time.time() - t0:.0f} s", flush=True)


# ----------------------------------------------------------------------------------- TRL (child process)


def trl_args(cfg, run_dir: Path, cuda: bool, system: str = "trl") -> dict:
    """GRPOConfig's arguments: the twin's knobs in TRL's terms (the batch split: module docstring), then the
    system's own fields (a dict field, gradient_checkpointing_kwargs, merged key by key)."""
    r, t, o, m = cfg.rollout, cfg.train, cfg.optim, cfg.model
    samples = r.prompts_per_step * r.n
    mini = t.mini_batch_size or samples
    micro = min(t.micro_batch_size, mini)
    args = dict(
        output_dir=str(run_dir), report_to="none", save_strategy="no", logging_steps=samples // mini,
        disable_tqdm=True, seed=t.seed, max_steps=t.steps * (samples // mini),
        per_device_train_batch_size=micro, gradient_accumulation_steps=mini // micro,
        steps_per_generation=samples // micro, num_iterations=1,
        num_generations=r.n, max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
        learning_rate=o.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=o.warmup_steps,
        weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps,
        max_grad_norm=o.max_grad_norm or 0.0, epsilon=cfg.loss.clip_low, epsilon_high=cfg.loss.clip_high,
        beta=cfg.loss.kl_coef, gradient_checkpointing=m.gradient_checkpointing,
        # transformers' Trainer takes every_n_layers from here (keep_checkpoint_stride keeps it past TRL's passes)
        gradient_checkpointing_kwargs={"every_n_layers": m.gradient_checkpointing_every}
        if m.gradient_checkpointing and m.gradient_checkpointing_every > 1 else None,
        model_init_kwargs={"dtype": m.dtype, "attn_implementation": "sdpa"},  # SDPA: ours without flash-attn
        bf16=cuda, use_cpu=not cuda,
        optim="adamw_torch_8bit" if cuda else "adamw_torch",  # torchao AdamW8bit; CPU: no inductor compile
        use_vllm=cuda, vllm_mode="colocate", vllm_enable_sleep_mode=r.sleep_mode,
        vllm_gpu_memory_utilization=r.gpu_memory_utilization, vllm_max_model_length=r.max_model_len or None,
        # fixed lengths: vLLM's ignore_eos; HF generate has none, min_new_tokens does it
        generation_kwargs={"ignore_eos": True} if cuda else {"min_new_tokens": r.max_new_tokens})
    for key, value in (spec(system).trl or {}).items():
        args[key] = {**(args.get(key) or {}), **value} if isinstance(value, dict) else value
    return args


def keep_checkpoint_stride(model) -> None:
    """Keep transformers' every_n_layers across TRL's no-grad passes. TRL runs them with checkpointing off and
    turns it back on with model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)
    (trl/models/utils.py, disable_gradient_checkpointing; GRPOTrainer._generate_and_score_completions), so
    every_n_layers reaches torch.utils.checkpoint as a keyword of the layer's forward, not the stride, and from
    the first rollout on every layer is checkpointed again. This takes the two keys out of the kwargs as
    Trainer.train does (tests/e2e/test_peer.py shows both)."""
    enable = model.gradient_checkpointing_enable

    def gradient_checkpointing_enable(gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        kwargs = dict(gradient_checkpointing_kwargs or {})
        every_n_layers, offload = kwargs.pop("every_n_layers", every_n_layers), kwargs.pop("offload", offload)
        return enable(gradient_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload)

    model.gradient_checkpointing_enable = gradient_checkpointing_enable


def checkpointing(on: bool, every: int) -> str:
    if not on:
        return "off"
    return "every decoder layer" if every == 1 else f"1 decoder layer in {every} (layers 0, {every}, {2 * every}, ...)"


def trl_settings(targs) -> dict:
    """What the TRL row runs that ours does not, read back from its GRPOConfig (and the process's environment,
    where accelerate reads its regional compilation)."""
    opt = getattr(targs.optim, "value", targs.optim)
    autocast = ", bf16 autocast" if targs.bf16 else ""
    regional = os.environ.get("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "").lower() in ("1", "true", "yes")
    compiled = ("decoder layers (accelerate's regional compilation)" if regional else "whole model") + \
        f", {targs.torch_compile_backend}" if targs.torch_compile else "none"
    every = (targs.gradient_checkpointing_kwargs or {}).get("every_n_layers", 1)
    micro = targs.per_device_train_batch_size
    return {"master_weights": f"{targs.model_init_kwargs['dtype']}{autocast}",
            "optimizer": opt + (" (torchao AdamW8bit; states made before step 0, as ours)" if "8bit" in opt else ""),
            "is_correction": f"{targs.vllm_importance_sampling_mode} cap {targs.vllm_importance_sampling_clip_max}"
            if targs.use_vllm and targs.vllm_importance_sampling_correction else "none",
            "loss": targs.loss_type, "lr_schedule": str(getattr(targs.lr_scheduler_type, "value", "")),
            "compile": compiled, "kernels": "Liger: RMSNorm, RoPE, SwiGLU" if targs.use_liger_kernel else "PyTorch",
            "checkpointing": checkpointing(targs.gradient_checkpointing, every),
            "batch": f"micro-batches of {micro} rows, {micro * targs.gradient_accumulation_steps} samples per "
                     "optimizer step",
            "nan_inf_filter": "on (a host sync per micro-step)" if targs.logging_nan_inf_filter else "off",
            "rollout": "vLLM colocate, sleep level 2 (weights re-pushed each step), max_num_batched_tokens 4096"
            if targs.use_vllm else "transformers generate"}


class TrainProfile:
    """--profile on TRL's side: torch.profiler from the end of a rollout step's scoring to its last optimizer step,
    inside a "train" span as ours' phases are (observe.PHASES), written as ours' profile text (profile_phases)."""

    def __init__(self, path: Path, device):
        self.path, self.device, self.prof, self.span = path, device, None, None

    def start(self) -> None:
        import torch

        from observe import start_profile
        self.prof = start_profile(self.device)
        self.span = torch.profiler.record_function("train")
        self.span.__enter__()

    def finish(self) -> None:
        if self.prof is None:
            return
        from observe import profile_phases
        self.span.__exit__(None, None, None)
        self.prof.stop()
        self.path.write_text(profile_phases(self.prof))
        self.prof = None


def run_trl(args) -> None:
    """The TRL system args.child in this process: a record per rollout step appended to RUN_DIR/metrics.jsonl in
    train_grpo.py's names (time/step, time/rollout, time/logprobs, time/train, time/refit), with gen_tokens and
    mem/peak_gib; RUN_DIR/settings.json: trl_settings."""
    os.environ.update(spec(args.child).env)  # before accelerate reads it (Trainer's TorchDynamoPlugin)
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from config import load_config
    from data import load_splits, render_prompt, reward_last_number
    from rewards import REWARDS

    run_dir = Path(args.run_dir)
    cfg = load_config(ROOT / "configs" / f"{TWIN}.yaml", workload_overrides(args, args.child))
    cuda = torch.cuda.is_available() and not args.tiny
    peak = None
    if cuda:
        from distributed import DevicePeak
        peak = DevicePeak(torch.device("cuda"))
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    train_set, _ = load_splits(cfg.data)
    rows = [{"prompt": render_prompt(ex["question"], tokenizer, cfg.data), "answer": ex["answer"]} for ex in train_set]
    reward, last_number = REWARDS[cfg.data.reward], reward_last_number(cfg.data)

    def math(completions, answer, **_):  # ours' judge: every sample ran to the budget ("length")
        return [reward(c, a, finish_reason="length", last_number=last_number) for c, a in zip(completions, answer)]

    targs = GRPOConfig(**trl_args(cfg, run_dir, cuda, args.child))
    opt_steps = targs.steps_per_generation // targs.gradient_accumulation_steps
    phases = defaultdict(float)  # seconds (and gen tokens) of the rollout step in progress
    profile = TrainProfile(run_dir / "profile.txt", torch.device("cuda" if cuda else "cpu"))

    class StepClock(TrainerCallback):
        def on_train_begin(self, args_, state, control, optimizer=None, **kw):
            if cuda:  # lazily made 8-bit states pin the first step's allocator segments (optimizer.init_states)
                from optimizer import init_states
                init_states(getattr(optimizer, "optimizer", optimizer))
            self.t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            if state.global_step % opt_steps:
                return
            profile.finish()  # a profiled step's own time leaves the medians (summarize)
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            step_s, p = now - self.t0, defaultdict(float, phases)
            record = {"step": state.global_step // opt_steps - 1, "time/step": step_s,
                      "time/rollout": p["generate"] - p["sync"], "time/refit": p["sync"],
                      "time/logprobs": p["score"] - p["generate"], "time/train": step_s - p["score"],
                      "gen_tokens": int(p["tokens"]), "mem/peak_gib": peak.take() / 2**30 if peak else None}
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[bench] {args.child} step {record['step']}: {step_s:.1f} s", flush=True)
            phases.clear()
            self.t0 = time.perf_counter()

    trainer = GRPOTrainer(model=str(args.model_dir), reward_funcs=math, args=targs, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(rows), callbacks=[StepClock()])
    if (targs.gradient_checkpointing_kwargs or {}).get("every_n_layers", 1) > 1:
        keep_checkpoint_stride(trainer.model)
    # GRPOTrainer tells training from evaluation by self.model.training. Trainer.training_step puts the module it
    # trains in train mode, and under regional compilation that is a new top module (accelerate's compile_regions)
    # while self.model stays as from_pretrained left it, in eval mode. GRPOTrainer._prepare_inputs then treats every
    # micro-step as an evaluation: it generates anew and trains on the whole generation batch in one forward (256
    # rows: out of memory on an H100 at the 3B shape), old logprobs in chunks of per_device_eval_batch_size, the loss
    # not divided over the accumulation. Eager, self.model is the module trained and Trainer sets it.
    trainer.model.train()

    def timed(key, fn, count_tokens=False):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            phases[key] += time.perf_counter() - t0
            if count_tokens:
                phases["tokens"] += int(out["completion_mask"].sum())
                # scored at its rollout step's start (global_step: optimizer steps), it goes to training next
                if trainer.state.global_step // opt_steps == args.profile > 0:
                    profile.start()
            return out
        return wrapper

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)  # + the weight push
    trainer._generate_and_score_completions = timed("score", trainer._generate_and_score_completions, True)
    if targs.use_vllm:
        trainer.vllm_generation.sync_weights = timed("sync", trainer.vllm_generation.sync_weights)
    (run_dir / "settings.json").write_text(json.dumps(trl_settings(targs)))
    trainer.train()


# ----------------------------------------------------------------------------------- the parent


def ours_settings(cfg, cuda: bool) -> dict:
    f, t = cfg.fp8, cfg.train
    mini = t.mini_batch_size or cfg.rollout.prompts_per_step * cfg.rollout.n
    backend = t.compile if t.compile != "auto" else "inductor" if cuda else "none"  # trainer.compile_backend
    out = {"master_weights": cfg.model.dtype + (", bf16 autocast" if cuda and cfg.model.dtype == "float32" else ""),
           "optimizer": cfg.optim.name, "is_correction": f"{cfg.loss.is_correction} cap {cfg.loss.is_cap}",
           "loss": cfg.loss.agg, "lr_schedule": "linear warm-up, constant",
           "compile": f"decoder layers, {backend}" if backend != "none" else "none",
           "checkpointing": checkpointing(cfg.model.gradient_checkpointing, cfg.model.gradient_checkpointing_every),
           "batch": f"micro-batches of {min(t.micro_batch_size, mini)} rows, {mini} samples per optimizer step",
           "rollout": "vLLM colocate, sleep mode, weights pushed each step" if cfg.rollout.engine == "vllm"
           else "HF engine"}
    if f.train or f.rollout or f.kv_cache:
        out["fp8"] = f"trainer {f.train}, rollout {f.rollout}, kv_cache {f.kv_cache} ({f.kv_attention})"
    return out


def normalized(system: str, metrics: list[dict], samples: int) -> list[dict]:
    """Per-step records in one set of names: TRL's as written; ours' phases folded to the same four."""
    if is_trl(system):
        return metrics
    return [{"step": m["step"], "time/step": m["time/step"], "time/rollout": m.get("time/rollout"),
             "time/logprobs": sum(m.get(k, 0.0) for k in ("time/reward", "time/assemble", "time/logprobs")),
             "time/train": m.get("time/train"), "time/refit": m.get("time/recalibrate", 0.0) + m.get("time/refit", 0.0),
             "gen_tokens": round(m["response/length_mean"] * samples), "mem/peak_gib": m.get("mem/peak_gib")}
            for m in metrics if "time/step" in m]


def summarize(records: list[dict], profiled: int = 0) -> dict:
    """Medians over the timed steps (>= 1, but the profiled one); peak_gib over all; raises ValueError without a
    timed step."""
    timed = [r for r in records if r["step"] >= 1 and r["step"] != profiled]
    if not timed:
        raise ValueError("no timed step (>= 1): the run ended in step 0")

    def med(key):
        values = [r.get(key) for r in timed]
        return None if None in values else round(statistics.median(values), 3)

    peaks = [r["mem/peak_gib"] for r in records if r.get("mem/peak_gib")]
    return {"step_s": med("time/step"),
            "tokens_per_s": round(statistics.median(r["gen_tokens"] / r["time/step"] for r in timed), 1),
            "rollout_s": med("time/rollout"), "logprobs_s": med("time/logprobs"), "train_s": med("time/train"),
            "refit_s": med("time/refit"), "peak_gib": round(max(peaks), 1) if peaks else None,
            "gen_tokens": med("gen_tokens"), "first_step_s": round(records[0]["time/step"], 1),
            "timed_steps": len(timed)}


def progress(system: str, r: dict) -> str:
    def s(key):
        return "-" if r.get(key) is None else f"{r[key]:.1f}"
    return (f"[{system}] step {r['step']}: {s('time/step')} s (rollout {s('time/rollout')}, logprobs "
            f"{s('time/logprobs')}, train {s('time/train')}, refit {s('time/refit')}), {r['gen_tokens']} tokens")


def run_system(system: str, args, out: Path, samples: int) -> tuple[dict, float, int]:
    """One system's process, its per-step progress printed as it logs it -> ({records, run_dir, log}, wall s,
    exit code; 124: killed at --timeout)."""
    run_dir = Path(args.runs) / f"peer_{system}"
    shutil.rmtree(run_dir, ignore_errors=True)  # train_grpo.py refuses a used run dir
    if is_trl(system):
        run_dir.mkdir(parents=True)
        argv = [sys.executable, "-m", "bench.peer", "--child", system, "--run-dir", str(run_dir), "--model-dir",
                str(args.model_dir), "--steps", str(args.steps), "--profile", str(args.profile),
                *(["--tiny"] if args.tiny else []), *args.overrides]
    else:
        config = ROOT / "configs" / f"{spec(system).config}.yaml"
        argv = [sys.executable, str(ROOT / "train_grpo.py"), "--config", str(config),
                *workload_overrides(args, system), f"train.out_dir={args.runs}", f"train.run_name=peer_{system}"]
    log = out / f"peer_{system}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec(system).env,
           "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)}
    print(f"[{system}] started (log {log})", flush=True)
    t0, shown = time.time(), 0
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        while True:
            rc = proc.poll()
            records = normalized(system, read_records(run_dir / "metrics.jsonl"), samples)
            for r in records[shown:]:
                print(progress(system, r), flush=True)
            shown = len(records)
            if rc is not None:
                break
            if args.timeout and time.time() - t0 > args.timeout:
                print(f"[{system}] killed at --timeout {args.timeout:.0f} s", flush=True)
                kill_group(proc)
                rc = 124
                break
            time.sleep(1.0)
    finally:  # an interrupt: no child outlives the parent
        kill_group(proc, grace=2.0)
    records = normalized(system, read_records(run_dir / "metrics.jsonl"), samples)
    from observe import profile_stem  # ours: the trainer's own log.profile_step text (observe.save_profile)
    profile = run_dir / "profile.txt" if is_trl(system) else \
        profile_stem(run_dir / "profile", args.profile, rank=0).with_suffix(".txt")
    if args.profile and profile.is_file():
        shutil.copy(profile, out / f"peer_{system}_profile.txt")
    return {"records": records, "run_dir": run_dir, "log": log}, time.time() - t0, rc


def gpu_tag(name: str) -> str:
    """'NVIDIA H200' -> 'h200' (the results file's suffix); 'cpu' stays."""
    words = [w for w in name.replace("NVIDIA", "").split() if any(c.isdigit() for c in w)]
    return words[0].lower() if words else name.lower().replace(" ", "_")


def add_ratios(rows: list[dict]) -> list[dict]:
    """In place: tokens_per_s_vs_trl = the row's tokens/s over the fastest TRL row's of the same workload and group
    (trl_baseline names it; both None without one). A row with an error is never the baseline."""
    best = {}
    for r in rows:
        key = (r["workload"], spec(r["system"]).group)
        if is_trl(r["system"]) and r.get("tokens_per_s") and "error" not in r and \
                r["tokens_per_s"] > best.get(key, {}).get("tokens_per_s", 0):
            best[key] = r
    for r in rows:
        b = best.get((r["workload"], spec(r["system"]).group))
        ok = b and r.get("tokens_per_s")
        r["tokens_per_s_vs_trl"] = round(r["tokens_per_s"] / b["tokens_per_s"], 3) if ok else None
        r["trl_baseline"] = b["system"] if b else None
    return rows


COLS = ["system", "step_s", "tokens_per_s", "tokens_per_s_vs_trl", "rollout_s", "logprobs_s", "train_s", "refit_s",
        "peak_gib", "gen_tokens", "first_step_s", "error"]


def markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"# Peer benchmark on {gpu}: TRL vs ours", "",
             "Written by bench/peer.py; docs/peer.md says what each setting below does to the figures. "
             "tokens_per_s_vs_trl: over the fastest TRL row of the same group.", ""]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    for label in dict.fromkeys(r["workload"] for r in rows):
        for group in dict.fromkeys(spec(r["system"]).group for r in rows if r["workload"] == label):
            mine = sorted((r for r in rows if r["workload"] == label and spec(r["system"]).group == group),
                          key=lambda r: order.get(r["system"], len(order)))
            base = next((r["trl_baseline"] for r in mine if r.get("trl_baseline")), None)
            title = f"## {label}" + (f": {GROUPS[group]}" if GROUPS.get(group) else "")
            lines += [title, "", markdown_table(mine, COLS), "",
                      f"Ratios over {base} (the fastest TRL row)." if base else "No TRL row to compare with.", "",
                      "Settings:", ""]
            lines += [f"- {r['system']}: " + "; ".join(f"{k} {v}" for k, v in r.get("settings", {}).items())
                      for r in mine]
            commands = dict.fromkeys(f"`{r.get('command')}` ({r.get('date')})" for r in mine)
            lines += ["", "Commands: " + " ; ".join(commands), ""]
    return "\n".join(lines)


def save(new: list[dict], out: Path, gpu: str) -> Path:
    """OUT/peer_<card>.json and .md, atomically: the rows of the systems not re-run are kept."""
    from checkpoint import atomic_write

    path = results_path(out, gpu)
    try:
        old = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        old = []
    fresh = {(r["system"], r["workload"]) for r in new}
    rows = add_ratios([r for r in old if (r.get("system"), r.get("workload")) not in fresh] + new)
    write_json(path, {"rows": rows})
    atomic_write(path.with_suffix(".md"), lambda f: f.write(markdown(rows, gpu).encode()))
    return path


def card_gib() -> float:
    """GPU 0's memory in GiB (nvidia-smi), 0 if unknown."""
    mib = nvidia_smi("memory.total").split()
    try:
        return float(mib[0]) / 1024 if mib else 0.0
    except ValueError:
        return 0.0


def check_args(args) -> list[str]:
    """The systems to run, or fail(): one line naming the flag and the fix, exit 2."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        fail(f"--systems {args.systems!r}: a comma list of {', '.join(SYSTEMS)}")
    least = 2 if args.tiny else 3
    if args.steps < least:
        fail(f"--steps {args.steps}: give >= {least} (step 0 warms up; the figures are medians of the steps after it"
             f"{'' if args.tiny else ', at least 2'})")
    if args.profile and not (1 <= args.profile < args.steps and args.steps >= least + 1):
        fail(f"--profile {args.profile}: a rollout step from 1 to --steps - 1 ({args.steps - 1}), with --steps >= "
             f"{least + 1} (the profiled step leaves the medians: one more step to time)")
    if args.timeout < 0:
        fail(f"--timeout {args.timeout}: seconds per system, > 0 (0 = none)")
    if args.tiny and "trl_liger" in systems:
        fail("--systems trl_liger with --tiny: Liger's kernels are Triton, GPU only; the CPU run takes the others")
    if not args.tiny and not args.prepare:
        if device_name() == "cpu":
            fail(f"no GPU (nvidia-smi finds none): the {args.model} workload needs one; --tiny runs the CPU version")
        gib = card_gib()
        if 0 < gib < MIN_CARD_GIB[args.model]:
            fail(f"--model {args.model}: TRL's row needs a card of >= {MIN_CARD_GIB[args.model]} GiB, this one has "
                 f"{gib:.0f}; --model llama3b fits an 80 GB card (docs/peer.md, memory)")
    from config import ConfigError, load_config
    for system in systems:  # typos in overrides fail here, not minutes into a run
        try:
            load_config(ROOT / "configs" / f"{spec(system).config}.yaml", workload_overrides(args, system))
        except ConfigError as e:
            fail(f"{e}")
    if any(is_trl(s) for s in systems) and not args.prepare:
        import importlib.util
        missing = [m for m, need in [("trl", True), ("liger_kernel", "trl_liger" in systems)]
                   if need and importlib.util.find_spec(m) is None]
        if missing:
            fail(f"--systems {args.systems}: {', '.join(missing)} not installed; bash setup.sh --peer installs "
                 "requirements-peer.txt")
    return systems


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="section.key=value for every system (TRL reads the twin's knobs)")
    p.add_argument("--systems", help=f"comma list of {', '.join(SYSTEMS)} (default: the main rows, "
                                     "the pair left out; --tiny: trl,ours_bf16)")
    p.add_argument("--model", choices=list(MODELS), default="llama8b",
                   help="the workload's model: llama3b (one H100) or llama8b (one H200); not with --tiny")
    p.add_argument("--steps", type=int, default=6, help="rollout steps per system (step 0 is warm-up; 5 timed)")
    p.add_argument("--tiny", action="store_true", help="CPU: a tiny Llama, HF generation (the test's run)")
    p.add_argument("--prepare", action="store_true", help="only write the model dir (a device call of its own)")
    p.add_argument("--model-dir", help="the workload's HF model dir (default /tmp/peer_<model>; --tiny: under --runs)")
    p.add_argument("--profile", type=int, default=0, metavar="STEP",
                   help="profile rollout step STEP (>= 1) of each system with torch.profiler: the train phase's\n"
                        "kernels (ours: the logprobs and refit too) in OUT/peer_<system>_profile.txt; that step\n"
                        "leaves the medians: give one more --steps (0 = off)")
    p.add_argument("--timeout", type=float, default=0.0, help="seconds per system, then it is killed (0 = none)")
    p.add_argument("--out", default=str(RESULTS), help="results + logs dir (default runs/bench, untracked)")
    p.add_argument("--runs", default="/tmp/bench_peer_runs", help="run dirs of the systems")
    p.add_argument("--child", choices=[s for s in SYSTEMS if is_trl(s)], help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model_dir = str(model_dir(args))
    args.systems = args.systems or ("trl,ours_bf16" if args.tiny else ",".join(s for s in SYSTEMS
                                                                              if spec(s).group == "main"))
    if args.child:
        run_trl(args)
        return
    systems = check_args(args)
    if args.prepare:
        prepare(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (Path(args.model_dir) / READY).is_file():  # a child: the parent never holds a CUDA context
        cmd = [sys.executable, "-m", "bench.peer", "--prepare", "--model", args.model, "--model-dir", args.model_dir,
               *(["--tiny"] if args.tiny else [])]
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            sys.exit(f"prepare failed: {' '.join(cmd)}")
    from config import load_config

    gpu = "cpu" if args.tiny else device_name().splitlines()[0]
    w = workload(args)
    command = " ".join(["python -m bench.peer", *sys.argv[1:]])
    failed = 0
    for system in systems:
        child, wall, rc = run_system(system, args, out, w.prompts * w.n)
        row = {"system": system, "workload": workload_label(args)}
        try:
            row.update(summarize(child["records"], args.profile))
        except ValueError as e:
            row["error"] = str(e)
        if rc != 0:
            tail = [line for line in child["log"].read_text(errors="replace").splitlines() if line.strip()][-1:]
            row["error"] = f"exit {rc}: {tail[0][:300] if tail else ''}"
        if is_trl(system):
            settings_file = child["run_dir"] / "settings.json"
            settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        else:
            cfg = load_config(ROOT / "configs" / f"{spec(system).config}.yaml", workload_overrides(args, system))
            settings = ours_settings(cfg, cuda=not args.tiny)
        row.update(gpu=gpu, cpu=cpuinfo("model name"), date=date.today().isoformat(), command=command,
                   settings=settings, wall_s=round(wall))
        if args.profile:
            row["profiled_step"] = args.profile
        failed += "error" in row
        path = save([row], out, gpu)
        print(f"[{system}] {'FAILED: ' + row['error'] if 'error' in row else 'done'}; {path}", flush=True)
    print(markdown(json.loads(path.read_text())["rows"], gpu))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
