"""A run's setup, in the order train_grpo.train() calls it, and its checkpoints; trainer.py holds the
step's phases.

    read_config      --config + overrides, or --resume's run and its config.yaml
    make_run_dir     a new run's directory (rank 0 creates it, every rank gets its name)
    reference_model  the KL reference: a frozen BF16 copy of the initial policy
    prepare_trainer  FP8 linears (fp8_model, and fp8/fast where a switch asks; a BF16 run: the twin's), compiled layers, FSDP2
    lr_schedule      warm-up, then constant
    entropy_control  loss.entropy_target's adaptive coefficient for a new State
    resume           the State (and model, optimizer, schedule, sampler, RNG) of the newest checkpoint
    first_refit      fp8.cache_weights' hooks, the first kv scales, the first weight sync into the engine
    save             a checkpoint: what resume reads back

Each builds a piece of trainer.Run or trainer.State, or saves them; none runs inside a step. This module
imports trainer.py (the types, the refit), never the other way round.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from datetime import datetime
from pathlib import Path

import torch

import distributed
import modeling
import routing
from batch import collate
from checkpoint import create_run_dir, load_latest, record_resume, save_checkpoint, set_rng_state
from config import Config
from errors import UserError
from fp8.calibrate import kv_scales_from_state, kv_scales_state
from losses import collapse
from observe import RunLogger
from rollout import Sample
from trainer import Run, State, compile_backend, log_calibration, recalibrate, refit


# ----------------------------------------------------------------------------- the run

def read_config(args) -> tuple[Config, Path | None]:
    """(config, resume dir or None) from the command line: --config + overrides, or --resume's run."""
    from checkpoint import resume_config
    from config import load_config

    resume_dir = Path(args.resume) if args.resume else None
    if resume_dir and args.config:
        raise UserError(f"--resume {resume_dir} continues with the run's own config.yaml: drop --config and give "
                        "changes as key=value overrides")
    if resume_dir and not (resume_dir / "config.yaml").is_file():
        raise UserError(f"--resume {resume_dir}: not a run directory (no config.yaml)")
    return (resume_config(resume_dir, args.overrides) if resume_dir else load_config(args.config, args.overrides),
            resume_dir)


def make_run_dir(cfg: Config, config_path: str | None, d: distributed.Dist) -> Path:
    """A new run's dir, created by rank 0 alone and exclusively (checkpoint.create_run_dir: never one
    that exists); every rank gets its name, or rank 0's error."""
    made = None
    if d.main:
        auto = not cfg.train.run_name
        name = cfg.train.run_name or f"{Path(config_path or 'default').stem}-{datetime.now():%Y%m%d-%H%M%S}"
        try:
            made = str(create_run_dir(cfg.train.out_dir, name, auto))
        except UserError as e:
            made = e
    made = distributed.broadcast_object(made, d)
    if isinstance(made, UserError):
        raise made
    return Path(made)


# ----------------------------------------------------------------------------- the model

def reference_model(model, cfg: Config):
    """KL reference: a frozen copy of the initial policy (BF16, never quantized); None without KL."""
    return copy.deepcopy(model).eval().requires_grad_(False) if cfg.loss.kl_coef > 0 else None


def fp8_model(model, fp8, world: int = 1) -> tuple[list[str], list[str]]:
    """The trainer's FP8 model in place: fp8.convert.convert_to_fp8_training, then fp8.fast.apply when
    fp8.uses_fast (benchmarks and analysis build theirs here too), for `world` FSDP2 ranks. Returns (the
    converted linears' HF names, what fp8.fast did)."""
    from fp8.convert import convert_to_fp8_training

    converted = convert_to_fp8_training(model, fp8)
    if not fp8.uses_fast:
        return converted, []
    from fp8 import fast

    return converted, fast.apply(model, fp8, world)


def prepare_trainer(model, ref_model, cfg: Config, d: distributed.Dist, mixed: bool, logger: RunLogger) -> int:
    """FP8 linears (fp8.train) with fp8/fast's speed-only structure where a switch asks for it,
    compiled layers (train.compile), FSDP2 (world > 1), in that order; returns the token multiple the
    trainer's FP8 GEMMs want (1 = any). Without fp8.uses_fast (fuse_projections, cache_weights and
    fuse_grad_accum off, dense_gemm cublas), fp8/fast is never imported: the recipe runs without it. A BF16
    run (fp8.train=false) with fp8.cache_weights or fp8.fuse_grad_accum on one GPU gets the FP8 path's
    structure in BF16 instead (fp8/fast/bf16.py)."""
    fp8_tokens = 1
    modeling.pin_sdpa_backends(cfg.model.cudnn_sdpa)  # before any forward or compile: no import flips it later
    if (cfg.moe.router_replay or cfg.moe.aux_loss_coef) and not routing.is_moe(model):
        raise UserError("moe.router_replay / moe.aux_loss_coef need a mixture-of-experts model (a family with "
                        "experts, e.g. model.tiny.arch=qwen3_moe); set moe.router_replay=false moe.aux_loss_coef=0")
    if cfg.fp8.train:
        from fp8.linear import use_torchao
        from fp8.quant import BLOCK
        fp8 = cfg.fp8
        if fp8.cache_weights and d.world > 1 and cfg.train.probe:
            logger.print(f"fp8.cache_weights: off over {d.world} ranks with train.probe (its BF16 reference forward "
                         "needs the BF16 weights, and the cache all-gathers them in FP8)")
            fp8 = dataclasses.replace(fp8, cache_weights=False)
        if fp8.fuse_grad_accum and d.world > 1:
            logger.print(f"fp8.fuse_grad_accum: off over {d.world} ranks (FSDP2 reduce-scatters each gradient as "
                         "autograd makes it)")
            fp8 = dataclasses.replace(fp8, fuse_grad_accum=False)
        converted, fast_done = fp8_model(model, fp8, d.world)
        logger.print(f"fp8: trainer linears in block FP8: {len(converted)}")
        if fp8.uses_fast:
            logger.print("fp8.fast: " + (", ".join(fast_done) or "fast kernels"))
        fp8_tokens = BLOCK if use_torchao(fp8, d.device) else 1
    elif cfg.fp8.cache_weights or cfg.fp8.fuse_grad_accum:  # the FP8 path's structure in BF16 (fp8/fast/bf16.py)
        if d.world > 1:
            logger.print(f"fp8.cache_weights, fp8.fuse_grad_accum: the BF16 twin's are off over {d.world} ranks "
                         "(FSDP2 casts in its all-gather and reduce-scatters each gradient as autograd makes it)")
        else:
            from fp8.fast.bf16 import bf16_twin
            logger.print("fp8.fast, BF16 twin: " + ", ".join(bf16_twin(model, cfg.fp8, torch.bfloat16 if mixed else None)))
    backend = compile_backend(cfg, d.device)
    if backend != "none":  # after FP8 conversion: the FP8 linears are traced into the graph
        distributed.compile_layers(model, backend)
    # after FP8 conversion: FSDP2 all-gathers the weight each FP8 linear then quantizes, as on one GPU (with
    # fp8.cache_weights: the FP8 bytes of each rank's shard, quantized once per optimizer step; fp8/fast/gather.py)
    distributed.shard(model, d, bf16_compute=mixed)
    if ref_model is not None:
        distributed.shard(ref_model, d, bf16_compute=mixed)
    return fp8_tokens


def lr_schedule(optimizer, warmup: int):
    """Linear warm-up over `warmup` optimizer steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)


# ----------------------------------------------------------------------------- the state: new, resumed, saved

def entropy_control(cfg: Config) -> collapse.EntropyControl | None:
    """loss.entropy_target's controller, starting at loss.entropy_coef (None: a fixed coefficient)."""
    lo = cfg.loss
    return None if lo.entropy_target is None else \
        collapse.EntropyControl(lo.entropy_target, lo.entropy_coef_step, lo.entropy_coef)


def resume(run: Run, resume_dir: Path, overrides: list[str]) -> State:
    """The state of the newest checkpoint that loads (model, optimizer, schedule, sampler, RNG); collective."""
    ckpt_root, logger, d = run.run_dir / "checkpoints", run.logger, run.d
    # vLLM's share back while the checkpoint loads: loading holds the trainer's weights and optimizer
    # states at once, which training does only while the engine sleeps. Level 2 drops the engine's
    # (dummy) weights; first_refit's update_weights reloads them, and the first rollout wakes the rest.
    run.engine.sleep()
    t0 = time.perf_counter()
    loaded = load_latest(ckpt_root, run.model, run.optimizer, d, log=logger.print)
    if loaded is None:
        raise UserError(f"--resume {resume_dir}: no complete checkpoint in {ckpt_root}, so it cannot be resumed; "
                        "start a new run (another train.run_name), or delete that directory")
    ckpt, meta = loaded
    if meta["world"] != d.world:  # DCP reshards: any world size reads it (checkpoint.py)
        logger.print(f"resuming a {meta['world']}-rank checkpoint on {d.world} rank{'s' * (d.world > 1)}")
    run.scheduler.load_state_dict(meta["scheduler"])
    run.sampler.load_state_dict(meta["sampler"])
    set_rng_state(meta["rng"])
    state = State(meta["step"], kv_scales_from_state(meta), meta.get("bad_steps", 0), entropy_control(run.cfg),
                  meta.get("entropy"))
    if state.entropy_control is not None and meta.get("entropy_coef") is not None:
        state.entropy_control.coef = meta["entropy_coef"]
    logger.truncate(state.start_step)  # steps the interrupted run logged past the checkpoint are redone
    logger.print(f"resumed from {ckpt} at step {state.start_step} (loaded in {time.perf_counter() - t0:.1f} s)")
    if d.main:
        record_resume(run.run_dir, overrides, state.start_step)
    return state


def save(run: Run, state: State, step: int) -> None:
    """Checkpoint after `step` steps; collective: each rank writes its own shards (checkpoint.py)."""
    meta = {"scheduler": run.scheduler.state_dict(), "sampler": run.sampler.state_dict(), "step": step,
            **kv_scales_state(state.kv_scales), "bad_steps": state.bad_steps,
            "entropy_coef": None if state.entropy_control is None else state.entropy_control.coef,
            "entropy": state.entropy}
    t0 = time.perf_counter()
    path = save_checkpoint(run.run_dir / "checkpoints", step, meta, run.model, run.optimizer, run.d,
                           keep=run.cfg.train.keep_ckpts)
    run.logger.print(f"checkpoint: {path} (saved in {time.perf_counter() - t0:.1f} s)")


# ----------------------------------------------------------------------------- before the first step

def hook_weight_caches(run: Run) -> None:
    """fp8.cache_weights: fill the weight caches (FP8, or the BF16 twin's) and hook their refresh to the optimizer's step."""
    if run.cfg.fp8.cache_weights:
        from fp8.fast.cache import refresh_weight_caches_on_step
        refresh_weight_caches_on_step(run.model, run.optimizer)


def first_refit(run: Run, state: State) -> None:
    """Before step 0 (or on resume): fp8.cache_weights' caches filled and hooked to the optimizer
    (here, once the weights are final, and before the first forward, which a compiled layer cannot
    fill them in); scales from the training prompts if none were saved, so the first rollout is
    calibrated too; then the weight sync."""
    hook_weight_caches(run)
    if run.calibrator is not None and state.kv_scales is None:
        prompts = [Sample(0, ex["prompt_ids"], [], [], "length") for ex in run.train_set[: run.cfg.fp8.calib_samples]]
        ids, am, _, _ = collate(prompts, run.tokenizer.pad_token_id)
        state.kv_scales = recalibrate(run, ids.to(run.d.device), am.to(run.d.device))
        log_calibration(run, state, state.start_step)
    refit(run, state)
