"""The phases of a GRPO step, in the order train_grpo.train() calls them, and the setup they share.

    rollout_phase   engine samples n completions per prompt and scores them (rewards.REWARDS);
                    dynamic sampling may roll out more rounds
    assemble_batch  group advantages, the kept groups, the padded [B, L] tensors (batch.StepBatch)
    old_logprob_phase  trainer logprobs of the behaviour weights (old_logp), the KL reference,
                    entropy and the rollout/trainer mismatch
    train_phase     mini-batches of micro-batches: the policy forward, the objective (losses/grpo.py's
                    micro_batch_loss), one optimizer step per mini-batch (non-finite steps skipped
                    and counted)
    refit_phase     q/k/v scale recalibration (FP8 KV cache), then the weight sync into the engine
    validate        greedy accuracy on the held-out prompts
    save            a checkpoint of the run state

What a phase needs comes in as arguments: `Run` holds what setup built (fixed for the run), `State`
what the steps change and checkpoints keep (kv scales, consecutive bad steps).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import time
from datetime import datetime
from pathlib import Path

import torch

import distributed
import modeling
import routing
from batch import StepBatch, amp, by_length, collate, length_multiple, logprob_pass, micro_batches, token_logprobs
from checkpoint import create_run_dir, load_latest, record_resume, save_checkpoint, set_rng_state
from config import Config, to_dict
from data import reward_last_number
from errors import UserError
from fp8.calibrate import QKVCalibrator, kv_scales_from_state, kv_scales_state, send_kv_scales, token_mask
from fp8.export import export_weights
from fp8.linear import bf16_reference
from losses import collapse
from losses.advantages import group_advantages
from losses.grpo import LossInputs, MiniBatchTotals, micro_batch_loss
from losses.mismatch import mismatch_metrics
from observe import RunLogger, gc_timer, mismatch_guard, save_step_batch, update_guard
from probe import WeightChange, policy_gain, probe_rewards
from rewards import REWARDS, format_reward, reward_stats
from rollout import Sample, step_seed


@dataclasses.dataclass(kw_only=True)
class Run:
    """What setup built for the run; the phases read it and never rebind its fields."""
    cfg: Config
    d: distributed.Dist
    run_dir: Path
    logger: RunLogger
    model: torch.nn.Module                  # the policy (FP8 linears if fp8.train, sharded if world > 1)
    ref_model: torch.nn.Module | None       # KL reference: the initial policy, frozen, BF16
    tokenizer: object
    engine: object                          # rollout.Engine
    model_dir: str | Path                   # what the engine loaded (tokenizer dir of saved batches)
    calibrator: QKVCalibrator | None        # fp8.calibrate.make_calibrator: fp8.kv_cache and fp8.recalibrate
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: object                         # data.PromptSampler
    weight_change: WeightChange
    train_set: list[dict]
    val_set: list[dict]
    fp8_tokens: int = 1                     # token multiple the trainer's FP8 GEMMs want
    mixed: bool = False                     # fp32 master weights, bf16 compute (CUDA)


@dataclasses.dataclass
class State:
    """What the steps change and a checkpoint keeps."""
    start_step: int = 0
    kv_scales: dict | None = None           # {layer: (q, k, v)} the engine's FP8 attention scales
    bad_steps: int = 0                      # consecutive optimizer steps skipped as non-finite
    entropy_control: collapse.EntropyControl | None = None  # loss.entropy_target's adaptive coefficient


def entropy_control(cfg: Config) -> collapse.EntropyControl | None:
    """loss.entropy_target's controller, starting at loss.entropy_coef (None: a fixed coefficient)."""
    lo = cfg.loss
    return None if lo.entropy_target is None else \
        collapse.EntropyControl(lo.entropy_target, lo.entropy_coef_step, lo.entropy_coef)


# ----------------------------------------------------------------------------- setup

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


def compile_backend(cfg: Config, device: torch.device) -> str:
    """train.compile resolved: "auto" is inductor on CUDA and none elsewhere."""
    return cfg.train.compile if cfg.train.compile != "auto" else "inductor" if device.type == "cuda" else "none"


def prepare_trainer(model, ref_model, cfg: Config, d: distributed.Dist, mixed: bool, logger: RunLogger) -> int:
    """FP8 linears (fp8.train) with fp8/fast's speed-only structure where a switch asks for it,
    compiled layers (train.compile), FSDP2 (world > 1), in that order; returns the token multiple the
    trainer's FP8 GEMMs want (1 = any). Without fp8.uses_fast (fuse_projections, cache_weights and
    fuse_grad_accum off), fp8/fast is never imported: the recipe runs without it."""
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
    state = State(meta["step"], kv_scales_from_state(meta), meta.get("bad_steps", 0), entropy_control(run.cfg))
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
            "entropy_coef": None if state.entropy_control is None else state.entropy_control.coef}
    t0 = time.perf_counter()
    path = save_checkpoint(run.run_dir / "checkpoints", step, meta, run.model, run.optimizer, run.d,
                           keep=run.cfg.train.keep_ckpts)
    run.logger.print(f"checkpoint: {path} (saved in {time.perf_counter() - t0:.1f} s)")


# ----------------------------------------------------------------------------- rollout and reward

def judge(run: Run, samples, answers: list[str]) -> tuple[list[str], list[float]]:
    """(texts, verdicts): each sample decoded, and data.reward's verdict on it against its gold answer."""
    texts = run.tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
    reward, last_number = REWARDS[run.cfg.data.reward], reward_last_number(run.cfg.data)
    return texts, [reward(t, a, finish_reason=s.finish_reason, last_number=last_number)
                   for t, a, s in zip(texts, answers, samples)]


def score(run: Run, prompts: list[dict], samples) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(texts, rewards [B], correct [B]): data.reward's verdict per sample, plus the format bonus."""
    cfg = run.cfg
    texts, verdicts = judge(run, samples, [prompts[s.prompt_index]["answer"] for s in samples])
    correct = torch.tensor(verdicts)  # [B]
    rewards = correct + cfg.data.format_reward * torch.tensor([format_reward(t) for t in texts])
    if cfg.train.probe:  # a synthetic reward with variance: the update direction is checkable on any model
        rewards = probe_rewards(samples)
    return texts, rewards, correct


def rollout_round(run: Run, step: int, r: int, metrics: dict) -> collapse.Groups:
    """Draw prompts, generate n samples each, score them: this rank's groups of round r of the step."""
    cfg, n = run.cfg, run.cfg.rollout.n
    gen, own = distributed.rollout_share(run.d, cfg.rollout.prompts_per_step)  # whole groups; see rollout_share
    prompts = next(run.sampler)[gen]  # same draw on every rank
    with torch.profiler.record_function("rollout"):  # a named span in the profile's trace
        samples = run.engine.generate([ex["prompt_ids"] for ex in prompts], n=n, temperature=cfg.rollout.temperature,
                                      top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
                                      seed=step_seed(cfg, step, r) + gen.start * n)
    batch = prompts[own]  # this rank's prompts and their samples (all of them without TP)
    samples = [dataclasses.replace(s, prompt_index=s.prompt_index - own.start)
               for s in samples[own.start * n: own.stop * n]]
    t0 = time.perf_counter()
    texts, rewards, correct = score(run, batch, samples)
    metrics["time/reward"] = metrics.get("time/reward", 0.0) + time.perf_counter() - t0
    return collapse.Groups(batch, samples, texts, rewards, correct)


def rollout_phase(run: Run, step: int, metrics: dict) -> list[collapse.Groups]:
    """The step's rollout rounds: one, or under dynamic_sampling=resample more while any rank lacks
    groups with reward variance (every rank runs the same rounds: losses/collapse.py)."""
    cfg, n = run.cfg, run.cfg.rollout.n
    t0 = time.perf_counter()
    # the FP8 weight cache makes room for the KV cache (async: the engines have GPUs of their own)
    cached = cfg.fp8.train and cfg.fp8.cache_weights and cfg.rollout.mode == "colocated"
    if cached:
        from fp8.fast.cache import refill_weight_caches, release_weight_caches
        from fp8.fast.gather import release_fp8_shards
        release_weight_caches(run.model)
        release_fp8_shards(run.model)
    run.engine.wake()
    metrics["time/wake"] = time.perf_counter() - t0  # within time/rollout: the weight cache's release + the wake
    preempted = getattr(run.engine, "preemptions", None)  # vLLM: sequences recomputed for KV-cache room
    rounds = [rollout_round(run, step, 0, metrics)]
    while cfg.train.dynamic_sampling == "resample" and len(rounds) < cfg.train.max_rollout_rounds and \
            distributed.all_sum(torch.tensor(float(collapse.deficit(rounds, n)), device=run.d.device), run.d) > 0:
        rounds.append(rollout_round(run, step, len(rounds), metrics))
    if run.d.device.type == "cuda":  # the step's peak splits into the rollout's and the rest's (step_metrics)
        metrics["mem/rollout_peak_gib"] = distributed.peak_gib(run.d.device)
    if preempted is not None:
        metrics["rollout/preemptions"] = run.engine.preemptions - preempted
    versions = [s.policy_version for g in rounds for s in g.samples if s.policy_version is not None]
    if versions:  # rollout.mode=async: how many optimizer steps old the generating weights were, and
        # the engine's own time on the batch (time/rollout is the trainer's wait for it)
        metrics["rollout/policy_version"] = min(versions)
        metrics["rollout/staleness"] = step - min(versions)
        metrics["rollout/engine_s"] = run.engine.generate_s
    t_sleep = time.perf_counter()
    run.engine.sleep()
    distributed.peak_gib(run.d.device)  # the trainer's interval starts with the engine asleep
    if cached:
        refill_weight_caches(run.model)
    metrics["time/sleep"] = time.perf_counter() - t_sleep  # within time/rollout: the sleep + the cache's refill
    metrics["time/rollout"] = time.perf_counter() - t0 - metrics["time/reward"]
    return rounds


def length_multiples(cfg: Config, fp8_tokens: int, rows: int, device: torch.device) -> tuple[int, int]:
    """(multiple, align) of a step batch of `rows` rows: its length L is a multiple of `multiple`, and each
    micro-batch's length of both (StepBatch, batch.by_length)."""
    # layers compiled by Inductor: every length a multiple of COMPILED_ALIGN (distributed.compile_layers says why)
    align = distributed.COMPILED_ALIGN if compile_backend(cfg, device) == "inductor" else 1
    # micro-batch tokens % 128 == 0 for torchao's FP8 GEMMs, else each FP8 linear pads (and keeps) a copy of its
    # input (packed micro-batches: any row count, so L a multiple of the token multiple itself; by_length rounds each)
    tokens = fp8_tokens if cfg.train.pack_micro_batches else length_multiple(min(cfg.train.micro_batch_size, rows),
                                                                              fp8_tokens)
    return math.lcm(tokens, align), align


def assemble_batch(run: Run, rounds: list[collapse.Groups], metrics: dict) -> StepBatch:
    """Advantages and the padded batch; groups left out by dynamic sampling get loss mask 0 (the batch
    keeps its shape). Logs the collapse signals over round 0 (the step's fresh draw)."""
    cfg, d, n = run.cfg, run.d, run.cfg.rollout.n
    t0 = time.perf_counter()
    groups, keep = collapse.assemble(rounds, n, cfg.train.dynamic_sampling)  # keep: bool [B / n]
    advantages = group_advantages(groups.rewards, n, cfg.advantage.normalize_std, cfg.advantage.eps)  # [B]
    signals = {"reward/zero_std_groups": (~collapse.has_variance(rounds[0].rewards, n)).float(),
               "reward/distinct_answers": collapse.distinct_answers(rounds[0].texts, n),
               "reward/unsolved_groups": (rounds[0].correct.view(-1, n).amax(1) == 0).float(),
               "reward/kept_groups": keep.float()}
    metrics.update({k: float(distributed.gather_rows(v[:, None].to(d.device), d).mean()) for k, v in signals.items()})
    metrics["rollout/rounds"] = len(rounds)
    multiple, align = length_multiples(cfg, run.fp8_tokens, len(groups.samples), d.device)
    input_ids, attention_mask, mask, rollout_logp = (x.to(d.device) for x in collate(
        groups.samples, run.tokenizer.pad_token_id, multiple))
    loss_mask = mask * keep.repeat_interleave(n).to(d.device)[:, None]  # [B, L]
    routed = routing.collate_routing(groups.samples, input_ids.shape[1])  # MoE: the engine's experts, else None
    metrics["time/assemble"] = time.perf_counter() - t0
    return StepBatch(groups.prompts, groups.samples, groups.texts, groups.rewards, groups.correct, keep,
                     advantages.to(d.device), input_ids, attention_mask, mask, loss_mask, rollout_logp,
                     routed_experts=None if routed is None else routed.to(d.device), multiple=multiple, align=align)


# ----------------------------------------------------------------------------- trainer passes

def micro_plan(run: Run, b: StepBatch, rows: torch.Tensor | None = None) -> list[tuple[torch.Tensor, int]]:
    """by_length's micro-batches of `rows` (default all): train.micro_batch_size rows each, or packed to
    the worst case's tokens (train.pack_micro_batches); as many on every rank (each forward of an FSDP2
    model is collective)."""
    cfg, d = run.cfg, run.d
    rows = torch.arange(len(b.samples), device=d.device) if rows is None else rows
    budget = cfg.micro_batch_tokens if cfg.train.pack_micro_batches else 0
    plan = by_length(b.attention_mask, rows, cfg.train.micro_batch_size, b.multiple, budget, align=b.align)
    if budget and d.world > 1:
        count = int(distributed.all_sum(torch.tensor(len(plan), device=d.device), d, torch.distributed.ReduceOp.MAX))
        if count > len(plan):  # the busiest rank keeps its plan
            plan = by_length(b.attention_mask, rows, cfg.train.micro_batch_size, b.multiple, budget, count, b.align)
    return plan


def old_logprob_phase(run: Run, b: StepBatch, metrics: dict) -> None:
    """b.old_logp (and b.ref_logp) from no-grad passes; policy/entropy and mismatch/* over all ranks.
    fp8.calib_pass=logprobs: this forward's q/k/v amax gives the next rollout's scales.
    train.old_logp=rollout: old_logp is the engine's, and only the KL reference pass runs (train_phase
    measures the mismatch and the amax in its first mini-batch)."""
    cfg, d = run.cfg, run.d
    t0 = time.perf_counter()
    if cfg.train.old_logp == "rollout":
        b.old_logp = b.rollout_logp
        if run.ref_model is not None:
            b.ref_logp = logprob_pass(run.ref_model, b.input_ids, b.attention_mask, cfg.rollout.temperature,
                                      cfg.train.micro_batch_size, mixed=run.mixed, plan=micro_plan(run, b))
        metrics["time/logprobs"] = time.perf_counter() - t0
        return
    capture = run.calibrator.capture() if run.calibrator is not None and cfg.fp8.calib_pass == "logprobs" \
        else contextlib.nullcontext()
    stats = routing.RoutingStats()  # MoE: the trainer's top-k vs the engine's, over response tokens
    routed = routing.forward_context(run.model, b.routed_experts, cfg.moe.router_replay, b.mask.bool(), stats)
    plan = micro_plan(run, b)
    with capture, torch.profiler.record_function("logprobs"):
        b.old_logp, entropy = logprob_pass(run.model, b.input_ids, b.attention_mask, cfg.rollout.temperature,
                                           cfg.train.micro_batch_size, entropy=True, mixed=run.mixed,
                                           forward_context=routed, plan=plan)  # [B, L]
    if run.ref_model is not None:
        b.ref_logp = logprob_pass(run.ref_model, b.input_ids, b.attention_mask, cfg.rollout.temperature,
                                  cfg.train.micro_batch_size, mixed=run.mixed, plan=plan)
    metrics["time/logprobs"] = time.perf_counter() - t0
    metrics["policy/entropy"] = float(distributed.all_sum((entropy * b.mask).sum(), d)
                                      / distributed.all_sum(b.mask.sum(), d).clamp(min=1))
    metrics.update({f"mismatch/{k}": v for k, v in mismatch_metrics(
        *(distributed.gather_rows(x, d) for x in (b.old_logp, b.rollout_logp, b.mask))).items()})
    if routed is not None:
        tally = distributed.all_sum(torch.tensor([stats.differ, stats.pairs, stats.tokens_differ, stats.tokens],
                                                 device=d.device), d).tolist()
        metrics.update(routing.RoutingStats(*tally).metrics())


def bf16_logprobs(run: Run, b: StepBatch) -> torch.Tensor:
    """No-grad logprobs [B, L] of the master weights, linears not quantized (train.probe, saved batches)."""
    with bf16_reference(run.model):
        return logprob_pass(run.model, b.input_ids, b.attention_mask, run.cfg.rollout.temperature,
                            run.cfg.train.micro_batch_size, mixed=run.mixed, plan=micro_plan(run, b))


def save_batch(run: Run, b: StepBatch, step: int) -> None:
    """The step's batch with its BF16 logprobs, for notebooks/ (observe.save_step_batch); collective."""
    save_step_batch(run.run_dir / "batches" / f"step_{step:06d}.pt", step, b, bf16_logprobs(run, b),
                    to_dict(run.cfg), run.tokenizer, run.model_dir, run.d)


def train_phase(run: Run, state: State, b: StepBatch, step: int, metrics: dict) -> None:
    """The policy update: mini-batches (one optimizer step each) of micro-batches. A mini-batch whose
    loss or grad norm is non-finite on any rank is skipped (state.bad_steps counts them in a row;
    train.max_bad_steps aborts)."""
    cfg, d, model, optimizer = run.cfg, run.d, run.model, run.optimizer
    probe_before = bf16_logprobs(run, b) if cfg.train.probe else None  # the policy before the update
    t0 = time.perf_counter()
    entropy_coef = cfg.loss.entropy_coef if state.entropy_control is None else \
        state.entropy_control(metrics["policy/entropy"])
    if cfg.loss.entropy_coef or state.entropy_control is not None:
        metrics["loss/entropy_coef"] = entropy_coef
    run.weight_change.start()
    with torch.profiler.record_function("train"):
        model.train()
        B = len(b.samples)
        order = torch.randperm(B, generator=torch.Generator().manual_seed(cfg.train.seed + step)).to(d.device)
        mini = (cfg.train.mini_batch_size or B * d.world) // d.world  # per rank; the global one spans ranks
        n_mini = len(micro_batches(B, mini))
        # the loss metrics' names and their weighted sum, one float64 vector on the device until the phase ends:
        # no host sync per micro-batch
        loss_keys, loss_sum = [], None
        skipped = 0  # optimizer steps skipped for a non-finite loss or grad norm
        forwards = 0  # micro-batches this rank trained (perf/micro_batches: packing shows here)
        bypass = cfg.train.old_logp == "rollout"  # the first mini-batch's forward stands in for the old_logp pass
        first_logp = torch.zeros_like(b.rollout_logp) if bypass else None
        first_capture = contextlib.ExitStack()  # and with fp8.calib_pass=logprobs its q/k/v amax, the next scales
        if bypass and run.calibrator is not None and cfg.fp8.calib_pass == "logprobs":
            first_capture.enter_context(run.calibrator.capture())
        for m, mini_slice in enumerate(micro_batches(B, mini)):
            idx = order[mini_slice]
            totals = MiniBatchTotals(  # over every rank's share of the mini-batch
                tokens=distributed.all_sum(b.loss_mask[idx].sum(), d).clamp(min=1),
                rows=float(distributed.all_sum(b.loss_mask[idx].amax(1).sum(), d)),  # rows that count
                response_tokens=distributed.all_sum(b.mask[idx].sum(), d).clamp(min=1) if entropy_coef > 0 else None)
            zero_grads(run)
            nonfinite_loss = torch.zeros((), device=d.device)
            for rows, n in micro_plan(run, b, idx):  # rows of like length, cut to n
                forwards += 1
                j = (rows, slice(0, n))
                routed = routing.prepare(model, None if b.routed_experts is None else b.routed_experts[j],
                                         cfg.moe.router_replay, keep_logits=cfg.moe.aux_loss_coef > 0)  # MoE
                with amp(run.mixed):  # the policy forward, with grad
                    logp = token_logprobs(model, b.input_ids[j], b.attention_mask[j], cfg.rollout.temperature,
                                          entropy=entropy_coef > 0, fused=cfg.train.fused_head)
                logp, policy_entropy = logp if entropy_coef > 0 else (logp, None)
                if bypass and m == 0:  # no optimizer step yet: these are the behaviour weights' logprobs
                    first_logp[j] = logp.detach()
                aux = routing.load_balancing_loss(routed.logits, b.attention_mask[j]) \
                    if routed is not None and cfg.moe.aux_loss_coef > 0 else None  # MoE, over the real tokens
                out = micro_batch_loss(LossInputs(
                    logp, b.old_logp[j], b.rollout_logp[j], b.advantages[rows], b.loss_mask[j],
                    ref_logp=None if b.ref_logp is None else b.ref_logp[j], entropy=policy_entropy,
                    response_mask=b.mask[j], aux_loss=aux), totals, cfg.loss, entropy_coef, cfg.moe.aux_loss_coef)
                (out.loss * distributed.grad_scale(d)).backward()
                nonfinite_loss += (~torch.isfinite(out.loss.detach())).float()
                terms = torch.stack(list(out.metrics.values())).double() * (out.weight.detach().double() / n_mini)
                loss_keys, loss_sum = list(out.metrics), terms if loss_sum is None else loss_sum + terms
            first_capture.close()  # before any optimizer step
            if bypass and m == 0:
                metrics.update({f"mismatch/{k}": v for k, v in mismatch_metrics(
                    *(distributed.gather_rows(x[idx], d) for x in (first_logp, b.rollout_logp, b.mask))).items()})
                mismatch_guard(metrics, step, cfg.train, run.logger)
            max_norm = math.inf if cfg.optim.max_grad_norm is None else cfg.optim.max_grad_norm  # null: no clip
            grad_norm = distributed.clip_grad_norm(model.parameters(), max_norm)
            if not torch.isfinite(grad_norm) or distributed.all_sum(nonfinite_loss, d) > 0:  # every rank agrees
                optimizer.zero_grad(set_to_none=True)
                state.bad_steps, skipped = state.bad_steps + 1, skipped + 1
                run.logger.print(f"WARNING step {step}: non-finite loss/grad norm, optimizer step skipped "
                                 f"({state.bad_steps} in a row)")
                if state.bad_steps >= cfg.train.max_bad_steps:
                    raise UserError(f"{state.bad_steps} consecutive non-finite steps (train.max_bad_steps); lower "
                                    "optim.lr, check the data, or try fp8.train=false to isolate FP8")
                continue
            state.bad_steps = 0
            optimizer.step()
            run.scheduler.step()
            metrics["optim/grad_norm"] = float(grad_norm)  # before clipping; after (clip_grads_with_norm_'s factor):
            metrics["optim/grad_norm_clipped"] = float(grad_norm) * min(1.0, max_norm / (float(grad_norm) + 1e-6))
        zero_grads(run, keep=False)  # free the gradients before the engine wakes (memory)
        routing.clear(model)
        if loss_sum is not None:  # each rank's terms are already weighted by its share of the global batch
            metrics.update(zip(loss_keys, distributed.all_sum(loss_sum, d).tolist()))
        metrics["optim/skipped_steps"] = skipped
        metrics["perf/micro_batches"] = forwards
    metrics["time/train"] = time.perf_counter() - t0
    if (changed := run.weight_change.finish()) is not None:  # the share of weights the step moved
        metrics["optim/changed_frac"] = changed
    if run.weight_change.worst is not None:  # the largest |dw| / lr: Adam's bound is ~1 (every rank agrees)
        ratio, name = run.weight_change.worst
        top = float(distributed.all_sum(torch.tensor([ratio], device=d.device), d, torch.distributed.ReduceOp.MAX))
        metrics["optim/update_ratio_max"] = top
        update_guard(top, name if ratio == top else "a tensor of another rank's shard", step, cfg.optim, run.logger)
    if cfg.train.probe:  # did the update raise the positive-advantage samples relative to the negative ones?
        metrics["probe/policy_gain"] = policy_gain(bf16_logprobs(run, b), probe_before, b.advantages, b.mask)


def zero_grads(run: Run, keep: bool = True) -> None:
    """optimizer.zero_grad(set_to_none=True). With fp8.fuse_grad_accum the FP8 linears' gradient buffers are
    then zeroed and their .grad views put back (keep), or their memory given back (the engine's turn)."""
    run.optimizer.zero_grad(set_to_none=True)
    if run.cfg.fp8.train and run.cfg.fp8.fuse_grad_accum:
        from fp8.fast.accum import release_grad_accumulators, zero_grad_accumulators
        zero_grad_accumulators(run.model) if keep else release_grad_accumulators(run.model)


# ----------------------------------------------------------------------------- engine refit

def recalibrate(run: Run, input_ids, attention_mask) -> dict:
    """Per-layer (q, k, v) scales from a no-grad forward over the first fp8.calib_samples rows."""
    with torch.no_grad(), amp(run.mixed), run.calibrator.capture():
        for s in micro_batches(min(len(input_ids), run.cfg.fp8.calib_samples), run.cfg.train.micro_batch_size):
            with token_mask(attention_mask[s]):  # right padding: no mask needed (batch.token_logprobs)
                run.model(input_ids=input_ids[s], use_cache=False)
    return run.calibrator.scales()


def refit(run: Run, state: State) -> float:
    """Push the trainer's weights (FP8 by fp8/quant.py if fp8.rollout) and kv scales into the engine; seconds."""
    t0 = time.perf_counter()
    with torch.profiler.record_function("refit"):
        run.engine.update_weights(export_weights(run.model, run.cfg.fp8, fp8=run.cfg.fp8.rollout))
        send_kv_scales(run.engine, run.cfg.fp8, state.kv_scales)
    return time.perf_counter() - t0


def hook_weight_caches(run: Run) -> None:
    """fp8.cache_weights: fill the FP8 weight caches and hook their refresh to the optimizer's step."""
    if run.cfg.fp8.train and run.cfg.fp8.cache_weights:
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


def log_calibration(run: Run, state: State, for_step: int) -> None:
    """Append the last calibration to RUN_DIR/kv_calibration.jsonl (rank 0; one line per calibration,
    a few floats per layer): {"step": the step whose rollout uses these scales, "amax": {layer:
    [max|q|, max|k|, max|v|]} over the calibration's micro-batches on rank 0, "scales": {layer: [q, k, v]}
    as sent to the engine}. amax / 448 is the share of e4m3's range a unit scale would use."""
    if not run.d.main:
        return
    amax = run.calibrator.amax().amax(0).tolist()  # [L, 3]
    line = {"step": for_step, "amax": {i: [round(x, 4) for x in amax[i]] for i in state.kv_scales},
            "scales": {i: list(s) for i, s in state.kv_scales.items()}}
    with open(run.run_dir / "kv_calibration.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def refit_phase(run: Run, state: State, b: StepBatch, step: int, metrics: dict) -> None:
    """Recalibrate q/k/v scales (on the new weights, or from the old_logp capture), then push weights + scales."""
    if run.calibrator is not None:
        t0 = time.perf_counter()
        with torch.profiler.record_function("recalibrate"):
            state.kv_scales = recalibrate(run, b.input_ids, b.attention_mask) if run.cfg.fp8.calib_pass == "separate" \
                else run.calibrator.scales()
        metrics["time/recalibrate"] = time.perf_counter() - t0
        log_calibration(run, state, step + 1)
        for i, name in enumerate(("q", "k", "v")):
            metrics[f"fp8/{name}_scale_mean"] = sum(sc[i] for sc in state.kv_scales.values()) / len(state.kv_scales)
    metrics["time/refit"] = refit(run, state)


# ----------------------------------------------------------------------------- validation and step metrics

def validate(run: Run) -> float:
    """Greedy accuracy (data.reward's mean) on the first val_max_prompts held-out prompts (ranks split them)."""
    cfg, d = run.cfg, run.d
    val = run.val_set[: cfg.train.val_max_prompts]
    mine = val[d.rank // d.tp:: d.world // d.tp]  # one share per engine (a TP group generates it together)
    samples = run.engine.generate([ex["prompt_ids"] for ex in mine], n=1, temperature=0.0, top_p=1.0,
                                  max_new_tokens=cfg.rollout.max_new_tokens)
    counted = d.rank % d.tp == 0  # the group's first rank scores its engine's answers; the others add 0
    correct = torch.tensor(float(sum(judge(run, samples, [ex["answer"] for ex in mine])[1]) if counted else 0),
                           device=d.device)
    return float(distributed.all_sum(correct, d)) / len(val)


PHASE_TIMES = ("time/validate", "time/rollout", "time/reward", "time/assemble", "time/logprobs", "time/train",
               "time/recalibrate", "time/refit")


def step_metrics(run: Run, b: StepBatch, t_step: float, metrics: dict) -> dict:
    """Rewards, lengths, lr, time and memory of the step, over all ranks' samples. time/other: the step's
    seconds outside its timed phases (PHASE_TIMES: the metrics' host syncs, the batch dump, the probe)."""
    d, n = run.d, run.cfg.rollout.n
    truncated = torch.tensor([float(s.finish_reason == "length") for s in b.samples])
    rewards, correct, lengths, truncated = (distributed.gather_rows(x[:, None].to(d.device).float(), d)[:, 0].cpu()
                                            for x in (b.rewards, b.correct, b.mask.sum(1), truncated))
    tokens = float(distributed.all_sum(b.attention_mask.sum(), d))
    graphs, breaks = distributed.compiled_graphs(d), distributed.graph_breaks()
    memory = distributed.memory_metrics(d.device)  # mem/peak_gib: since the rollout's (mem/rollout_peak_gib)
    if memory:
        memory["mem/trainer_peak_gib"] = memory["mem/peak_gib"]
        memory["mem/peak_gib"] = max(memory["mem/peak_gib"], metrics.get("mem/rollout_peak_gib", 0.0))
    elapsed = time.perf_counter() - t_step
    return {
        "reward/mean": float(rewards.mean()), "reward/accuracy": float(correct.mean()),
        "reward/solved_groups": float((correct.view(-1, n).max(1).values > 0).float().mean()),
        "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(truncated.mean()),
        "optim/lr": float(run.scheduler.get_last_lr()[0]), "time/step": elapsed,
        "time/other": elapsed - sum(v for k, v in metrics.items() if k in PHASE_TIMES),
        "perf/tokens_per_s": tokens / elapsed,
        **gc_timer().take(), "perf/gc_frozen": gc.get_freeze_count(), **reward_stats(), **memory,
        **({"compile/graphs": graphs} if graphs else {}), **({"compile/graph_breaks": breaks} if breaks else {})}
