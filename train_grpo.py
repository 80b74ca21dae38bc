"""End-to-end FP8 GRPO, top to bottom.

    python train_grpo.py --config configs/tiny_cpu.yaml                  # CPU, a few minutes
    torchrun --nproc_per_node 1 train_grpo.py --config configs/llama31_8b_fp8.yaml
    python train_grpo.py --config configs/tiny_cpu.yaml loss.is_cap=5 fp8.train=false
    python train_grpo.py --resume runs/tiny_cpu-20261122-101500           # continue a run
    python train_grpo.py --config configs/tiny_cpu.yaml --print-config   # every knob, its value and doc
    torchrun --nproc_per_node 2 train_grpo.py --config configs/tiny_cpu.yaml rollout.mode=async  # engine on rank 1

Each step: rollout (engine samples n completions per prompt, with each token's logprob) ->
reward (data.reward: math-verify) -> group advantages -> trainer logprobs of the behaviour
weights (`old_logp`; the first mini-batch's from its own training forward) -> one or more optimizer
steps on the clipped surrogate with truncated importance sampling, the rollout/trainer mismatch
measured before the first -> q/k/v scale recalibration (FP8 KV cache) ->
weight sync into the engine (FP8 weights made by fp8/quant.py) -> log. Each phase is a function
of trainer.py, the setup before the steps and the checkpoints are run_setup.py's; batch.py makes
the tensors, observe.py logs, profiles and dumps.

Where this departs from textbook GRPO:
- Two policies, not one: the engine (FP8, different kernels) samples, the trainer scores. The
  PPO ratio uses the trainer's own `old_logp`; the engine/trainer gap is corrected by a
  separate, detached importance weight w = exp(old_logp - rollout_logp), truncated (TIS).
- Loss aggregation, KL and IS variants are config knobs (losses/grpo.py documents each).
- Validation is greedy (temperature 0) accuracy on a held-out split.
- `train.old_logp=rollout` (off by default) skips the old_logp forward: the engine's logprobs are the
  behaviour policy, decoupled PPO's "bypass" form (verl), and the IS weight is 1.
- policy/entropy is complete only after the first mini-batch's forward, so the adaptive entropy
  coefficient (loss.entropy_target) steps on the previous step's entropy.

FP8_GRPO_CACHE_DIR=DIR keeps every compile and JIT cache in one directory that later runs reuse (caches.py).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml

import caches
import distributed
import memory
import observe
import run_setup
import trainer
from checkpoint import remove_unstarted_run
from config import describe, to_dict
from data import PromptSampler, load_data
from errors import UserError
from fp8.calibrate import make_calibrator
from optimizer import build_optimizer
from probe import WeightChange


def train(args) -> Path:
    # ---- setup: caches, config, ranks, run dir
    caches.use_cache_dir()  # before anything compiles
    cfg, resume_dir = run_setup.read_config(args)
    d = distributed.init(cfg)
    if d.engine >= 0:  # rollout.mode=async: an engine rank generates until the trainer stops it
        from engines.remote import serve

        serve(cfg, d)
        distributed.close(d)
        return None
    device = d.device
    if cfg.rollout.engine == "vllm" and device.type != "cuda":
        raise UserError(f"rollout.engine=vllm needs a CUDA GPU (the device is {device}); set rollout.engine=hf")
    run_dir = resume_dir or run_setup.make_run_dir(cfg, args.config, d)
    args.new_run_dir = run_dir if d.main and not resume_dir else None  # main() removes it if the run fails early
    if d.main:
        print(f"run_dir: {run_dir}", flush=True)
        if not resume_dir:  # never rewritten: a resume's overrides go to resumes.jsonl (record_resume)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), flush=True)
    logger = observe.RunLogger(run_dir, enabled=d.main, tensorboard=cfg.log.tensorboard)
    torch.manual_seed(cfg.train.seed)
    mixed = device.type == "cuda" and cfg.model.dtype == "float32"  # fp32 master weights, bf16 compute

    # ---- model, data, engine, trainer
    from engines import make_engine
    from engines.remote import RemoteEngine
    from modeling import load_model_and_tokenizer, save_config_dir
    model, tokenizer = load_model_and_tokenizer(cfg.model, device)
    memory.startup_report(cfg, model, d, log=logger.print)  # per-rank estimate; refuses what cannot fit
    train_set, val_set = load_data(cfg, tokenizer, logger)
    # The engine gets its own copy of the weights (HF) or its own process memory (vLLM)
    # before the trainer's linears become FP8: it only ever sees weights through export.
    model_dir = save_config_dir(model, tokenizer, run_dir / "engine_model") \
        if cfg.model.name_or_path == "tiny" else cfg.model.name_or_path
    engine = RemoteEngine(cfg, d) if cfg.rollout.mode == "async" else \
        make_engine(cfg, model, tokenizer, device, model_dir)  # async: the engine ranks' proxy (engines/remote.py)
    ref_model = run_setup.reference_model(model, cfg)
    fp8_tokens = run_setup.prepare_trainer(model, ref_model, cfg, d, mixed, logger)  # FP8 (+ fp8/fast), compile, FSDP2
    calibrator = make_calibrator(model, cfg.fp8)  # q/k/v scales for the engine's FP8 KV cache
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    run = trainer.Run(cfg=cfg, d=d, run_dir=run_dir, logger=logger, model=model, ref_model=ref_model,
                      tokenizer=tokenizer, engine=engine, model_dir=model_dir, calibrator=calibrator,
                      optimizer=optimizer,
                      weight_change=WeightChange(optimizer, model),  # optim/changed_frac, optim/update_ratio_max
                      scheduler=run_setup.lr_schedule(optimizer, cfg.optim.warmup_steps),
                      sampler=PromptSampler(train_set, cfg.rollout.prompts_per_step, seed=cfg.data.seed),
                      train_set=train_set, val_set=val_set, fp8_tokens=fp8_tokens, mixed=mixed)
    state = run_setup.resume(run, resume_dir, args.overrides) if resume_dir else \
        trainer.State(entropy_control=run_setup.entropy_control(cfg))
    if cfg.rollout.mode == "async":  # the engine ranks' schedule starts here
        engine.start(state.start_step, run.sampler.state_dict())
    run_setup.first_refit(run, state)  # FP8 weight caches filled, the first rollout gets calibrated scales

    # ---- the steps
    from tqdm import tqdm
    pbar = tqdm(range(state.start_step, cfg.train.steps), initial=state.start_step, total=cfg.train.steps,
                disable=not d.main, dynamic_ncols=True)
    distributed.memory_metrics(device)  # each step's mem/* start here
    observe.gc_timer().take()  # each step's time/gc starts here
    for step in pbar:
        metrics, t_step = {}, time.perf_counter()
        prof = observe.StepProfile(step, cfg.log, device)
        if cfg.train.val_every and step % cfg.train.val_every == 0:
            metrics["val/accuracy"] = trainer.validate(run)
            metrics["time/validate"] = time.perf_counter() - t_step
        rounds = trainer.rollout_phase(run, step, metrics)            # generate + reward
        prof.after_rollout()
        batch = trainer.assemble_batch(run, rounds, metrics)          # advantages, [B, L] tensors
        trainer.old_logprob_phase(run, batch, step, metrics)          # old_logp (but the first mini-batch's), ref_logp
        if cfg.log.save_batch_every and step % cfg.log.save_batch_every == 0:  # for notebooks/ (analysis.py)
            trainer.save_batch(run, batch, step)                      # with BF16 logprobs
        trainer.train_phase(run, state, batch, step, metrics)         # policy forward, objective, mismatch, optimizer
        trainer.refit_phase(run, state, batch, step, metrics)         # recalibrate q/k/v, sync the engine
        metrics.update(trainer.step_metrics(run, batch, t_step, metrics))
        prof.finish(run_dir, d.rank, logger)
        logger.log(step, metrics)
        if step == state.start_step:  # compiled, autotuned, engine started: later full collections skip it
            observe.freeze_gc_heap()
        pbar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3f}" for k in
                          ("reward/mean", "mismatch/token_mult_prob_error", "val/accuracy") if k in metrics})
        if d.main and cfg.log.dump_episodes_every and step % cfg.log.dump_episodes_every == 0:
            observe.dump_episodes(run_dir, step, batch, tokenizer, cfg.log.dump_episodes_n,
                                  trainer_logp=cfg.train.old_logp == "trainer")
        if cfg.train.ckpt_every and (step + 1) % cfg.train.ckpt_every == 0:
            run_setup.save(run, state, step + 1)

    # ---- the end
    final = {"val/accuracy": trainer.validate(run)} if cfg.train.val_every else {}
    if final:
        logger.log(cfg.train.steps, final)
    if cfg.train.save_final and state.start_step < cfg.train.steps and not (
            cfg.train.ckpt_every and cfg.train.steps % cfg.train.ckpt_every == 0):
        run_setup.save(run, state, cfg.train.steps)  # (else the loop has just saved this step, or nothing ran)
    logger.close()
    if cfg.rollout.mode == "async":
        engine.close()  # the engine ranks stop
    distributed.close(d)
    logger.print(f"done: {cfg.train.steps} steps; final {final}; run_dir {run_dir}")  # the last line on stdout
    return run_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="YAML config (default: configs/tiny_cpu.yaml)")
    p.add_argument("--resume", help="run dir to continue from its latest checkpoint")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (after --config or --resume and the overrides) as YAML,\n"
                        "each key with its doc, and exit without training or making a run dir")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. loss.is_cap=5")
    args = p.parse_args(argv)
    if not args.config and not args.resume:
        args.config = str(Path(__file__).parent / "configs" / "tiny_cpu.yaml")
    try:
        if args.print_config:
            print(describe(run_setup.read_config(args)[0]), end="")
            return None
        return train(args)
    except BaseException as e:
        if getattr(args, "new_run_dir", None) is not None:  # a new run that failed before its first step
            remove_unstarted_run(args.new_run_dir)          # leaves no dir behind (a resumed one is kept)
        if not isinstance(e, UserError):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
