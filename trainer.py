"""The phases of a GRPO step, in the order train_grpo.train() calls them.

    rollout_phase   engine samples n completions per prompt and scores them (rewards.REWARDS);
                    dynamic sampling may roll out more rounds
    assemble_batch  group advantages, the kept groups, the padded [B, L] tensors (batch.StepBatch)
    old_logprob_phase  trainer logprobs of the behaviour weights (old_logp) for every row but the
                    first mini-batch's, and the KL reference (train.old_logp=rollout: the KL
                    reference only)
    train_phase     mini-batches of micro-batches: the policy forward, the objective (losses/grpo.py's
                    micro_batch_loss), one optimizer step per mini-batch (non-finite steps skipped
                    and counted); the first mini-batch's forward gives its rows' old_logp, then
                    the step's entropy and rollout/trainer mismatch are measured
    refit_phase     q/k/v scale recalibration (FP8 KV cache), then the weight sync into the engine
    validate        greedy accuracy on the held-out prompts

What a phase needs comes in as arguments: `Run` holds what setup built (fixed for the run), `State`
what the steps change and checkpoints keep (kv scales, consecutive bad steps). run_setup.py builds
both, resumes and saves them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import time
from pathlib import Path

import torch

import distributed
import routing
from batch import StepBatch, amp, by_length, collate, length_multiple, logprob_pass, micro_batches, token_logprobs
from config import Config, to_dict
from data import reward_last_number
from errors import UserError
from fp8.calibrate import QKVCalibrator, send_kv_scales, token_mask
from fp8.export import export_weights
from fp8.linear import bf16_reference
from losses import collapse
from losses.advantages import compute_advantages
from losses.grpo import LossInputs, MiniBatchTotals, micro_batch_loss
from losses.mismatch import mismatch_metrics
from observe import RunLogger, gc_timer, mismatch_guard, save_step_batch, update_guard
from probe import WeightChange, policy_gain, probe_rewards
from rewards import REWARDS, format_reward, reward_stats
from rollout import step_seed


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
    entropy: float | None = None            # the last step's policy/entropy (loss.entropy_target's control input)


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
                                      seed=step_seed(cfg.rollout, cfg.train.seed, step, r) + gen.start * n)
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
    # the weight cache (FP8, or the BF16 twin's) makes room for the KV cache (async: the engines have GPUs of their own)
    cached = cfg.fp8.cache_weights and cfg.rollout.mode == "colocated"
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


def compile_backend(cfg: Config, device: torch.device) -> str:
    """train.compile resolved: "auto" is inductor on CUDA and none elsewhere."""
    return cfg.train.compile if cfg.train.compile != "auto" else "inductor" if device.type == "cuda" else "none"


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
    advantages = compute_advantages(groups.rewards, n, cfg.advantage)  # [B]
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


def mini_batches(run: Run, b: StepBatch, step: int) -> list[torch.Tensor]:
    """The step's mini-batches on this rank: its rows in an order seeded by train.seed + step, cut into
    train.mini_batch_size / world rows each (0: one mini-batch of every row); one optimizer step each."""
    cfg, d = run.cfg, run.d
    B = len(b.samples)
    order = torch.randperm(B, generator=torch.Generator().manual_seed(cfg.train.seed + step)).to(d.device)
    mini = (cfg.train.mini_batch_size or B * d.world) // d.world  # per rank; the global one spans ranks
    return [order[s] for s in micro_batches(B, mini)]


def first_from_forward(run: Run) -> bool:
    """Whether the first mini-batch's training forward gives its rows' old_logp (train.old_logp=trainer on a
    dense model). An MoE model's no-grad pass scores every row: it measures the trainer/engine routing
    mismatch (moe/routing_mismatch), a host sync per layer that the training forward must not take."""
    return run.cfg.train.old_logp == "trainer" and not routing.is_moe(run.model)


def old_logprob_phase(run: Run, b: StepBatch, step: int, metrics: dict) -> None:
    """b.old_logp and b.entropy [B, L] of the behaviour weights from a no-grad pass over every row but the
    first mini-batch's: train_phase's first forward runs on the same weights, before any optimizer step, and
    fills those rows (their PPO ratio is then exactly 1, as verl's on-policy mini-batch has it); an MoE
    model's pass scores every row (first_from_forward). b.ref_logp from the KL reference.
    fp8.calib_pass=logprobs: this pass's q/k/v amax, with the first mini-batch's, gives the next rollout's
    scales. train.old_logp=rollout: old_logp is the engine's, and only the KL reference pass runs."""
    cfg = run.cfg
    t0 = time.perf_counter()
    with torch.profiler.record_function("logprobs"):
        if cfg.train.old_logp == "rollout":
            b.old_logp = b.rollout_logp
        else:
            minis = mini_batches(run, b, step)
            b.old_logp, b.entropy = torch.zeros_like(b.rollout_logp), torch.zeros_like(b.rollout_logp)
            metrics["perf/logprob_micro_batches"] = 0
            if rest := minis[1:] if first_from_forward(run) else minis:  # else one mini-batch: its forward gives all
                behaviour_pass(run, b, torch.cat(rest), metrics)
        if run.ref_model is not None:
            b.ref_logp = logprob_pass(run.ref_model, b.input_ids, b.attention_mask, cfg.rollout.temperature,
                                      cfg.train.micro_batch_size, mixed=run.mixed, plan=micro_plan(run, b))
    metrics["time/logprobs"] = time.perf_counter() - t0


def behaviour_pass(run: Run, b: StepBatch, rows: torch.Tensor, metrics: dict) -> None:
    """b.old_logp and b.entropy of `rows` from a no-grad pass (by train_phase's micro-batches, counted in
    perf/logprob_micro_batches); under fp8.calib_pass=logprobs its q/k/v amax recorded (the calibrator reset
    first); an MoE model's routing mismatch against the engine's, over every rank."""
    cfg = run.cfg
    plan = micro_plan(run, b, rows)
    metrics["perf/logprob_micro_batches"] = len(plan)
    capture = run.calibrator.capture() if run.calibrator is not None and cfg.fp8.calib_pass == "logprobs" \
        else contextlib.nullcontext()
    stats = routing.RoutingStats()  # MoE: the trainer's top-k vs the engine's, over response tokens
    routed = routing.forward_context(run.model, b.routed_experts, cfg.moe.router_replay, b.mask.bool(), stats)
    with capture:
        b.old_logp, b.entropy = logprob_pass(run.model, b.input_ids, b.attention_mask, cfg.rollout.temperature,
                                             cfg.train.micro_batch_size, entropy=True, mixed=run.mixed,
                                             forward_context=routed, plan=plan)
    if routed is not None:
        tally = distributed.all_sum(torch.tensor([stats.differ, stats.pairs, stats.tokens_differ, stats.tokens],
                                                 device=run.d.device), run.d).tolist()
        metrics.update(routing.RoutingStats(*tally).metrics())


def bf16_logprobs(run: Run, b: StepBatch) -> torch.Tensor:
    """No-grad logprobs [B, L] of the master weights, linears not quantized (train.probe, saved batches)."""
    with bf16_reference(run.model):
        return logprob_pass(run.model, b.input_ids, b.attention_mask, run.cfg.rollout.temperature,
                            run.cfg.train.micro_batch_size, mixed=run.mixed, plan=micro_plan(run, b))


def save_batch(run: Run, b: StepBatch, step: int) -> None:
    """The step's batch with the trainer's and the BF16 logprobs, for notebooks/ (observe.save_step_batch);
    collective. The trainer's come from a no-grad pass of the behaviour weights over every row, made for the
    save (the loss's old_logp of the first mini-batch come only with its forward, and under
    train.old_logp=rollout the loss takes the engine's), so that the notebooks compare the trainer with
    the engine; the loss is untouched."""
    cfg = run.cfg
    routed = routing.forward_context(run.model, b.routed_experts, cfg.moe.router_replay, b.mask.bool())
    trainer_logp = logprob_pass(run.model, b.input_ids, b.attention_mask, cfg.rollout.temperature,
                                cfg.train.micro_batch_size, mixed=run.mixed, forward_context=routed,
                                plan=micro_plan(run, b))
    save_step_batch(run.run_dir / "batches" / f"step_{step:06d}.pt", step, b, trainer_logp, bf16_logprobs(run, b),
                    to_dict(cfg), run.tokenizer, run.model_dir, run.d)


def train_phase(run: Run, state: State, b: StepBatch, step: int, metrics: dict) -> None:
    """The policy update: mini-batches (one optimizer step each) of micro-batches. The first mini-batch's
    forward runs on the behaviour weights: it fills its rows of b.old_logp and b.entropy (first_from_forward),
    and before its optimizer step policy/entropy and mismatch/* are measured (over every row; under
    train.old_logp=rollout over its rows, in a buffer of their own) and the mismatch guard runs. A
    mini-batch whose loss or grad norm is non-finite on any rank is skipped (state.bad_steps counts them in
    a row; train.max_bad_steps aborts)."""
    cfg, d = run.cfg, run.d
    probe_before = bf16_logprobs(run, b) if cfg.train.probe else None  # the policy before the update
    t0 = time.perf_counter()
    entropy_coef = entropy_coefficient(state, cfg.loss.entropy_coef)
    if cfg.loss.entropy_coef or state.entropy_control is not None:
        metrics["loss/entropy_coef"] = entropy_coef
    run.weight_change.start()
    with torch.profiler.record_function("train"):
        run.model.train()
        minis = mini_batches(run, b, step)
        bypass, own = cfg.train.old_logp == "rollout", first_from_forward(run)
        behaviour = torch.zeros_like(b.rollout_logp) if bypass else b.old_logp  # the first forward writes here
        entropy = torch.zeros_like(b.rollout_logp) if bypass else b.entropy
        measured = minis[0] if bypass else slice(None)  # the rows whose behaviour logprobs are known after it
        tally = TrainTally()
        first_capture = contextlib.ExitStack()  # and with fp8.calib_pass=logprobs its q/k/v amax, the next scales
        if (bypass or own) and run.calibrator is not None and cfg.fp8.calib_pass == "logprobs":
            first_capture.enter_context(run.calibrator.capture(reset=bypass or len(minis) == 1))  # else with the pass's
        for m, idx in enumerate(minis):
            nonfinite_loss = mini_batch_backward(run, b, idx, entropy_coef, len(minis), tally,
                                                 first=(behaviour, entropy) if m == 0 and (bypass or own) else None)
            first_capture.close()  # before any optimizer step
            if m == 0:
                metrics.update({f"mismatch/{k}": v for k, v in mismatch_metrics(
                    *(distributed.gather_rows(x[measured], d) for x in (behaviour, b.rollout_logp, b.mask))).items()})
                metrics["policy/entropy"] = mean_entropy(entropy[measured], b.mask[measured], d)
                mismatch_guard(metrics, step, cfg.train, run.logger)
            if not optimizer_step(run, state, nonfinite_loss, step, metrics):
                tally.skipped += 1
        zero_grads(run, keep=False)  # free the gradients before the engine wakes (memory)
        routing.clear(run.model)
        metrics.update(tally.metrics(d))
    state.entropy = metrics["policy/entropy"]
    metrics["time/train"] = time.perf_counter() - t0
    update_metrics(run, b, step, probe_before, metrics)


def entropy_coefficient(state: State, fixed: float) -> float:
    """The entropy bonus's coefficient for this step: loss.entropy_coef (fixed), or the adaptive
    controller's value from the previous step's policy/entropy (state.entropy: this step's is measured
    in the first training forward, which already needs the coefficient); none yet (a run's first step):
    the bonus is off and the coefficient stays where it is."""
    if state.entropy_control is None:
        return fixed
    return 0.0 if state.entropy is None else state.entropy_control(state.entropy)


def mean_entropy(entropy: torch.Tensor, mask: torch.Tensor, d: distributed.Dist) -> float:
    """policy/entropy: the token entropy [R, L] (nats) averaged over the response tokens (mask [R, L], kept
    groups or not) of every rank's rows; collective."""
    return float(distributed.all_sum((entropy * mask).sum(), d) / distributed.all_sum(mask.sum(), d).clamp(min=1))


@dataclasses.dataclass
class TrainTally:
    """What train_phase sums over its mini-batches. The loss metrics stay one float64 vector on the
    device until the phase ends: no host sync per micro-batch."""
    loss_keys: list[str] = dataclasses.field(default_factory=list)
    loss_sum: torch.Tensor | None = None  # [len(loss_keys)] float64: the loss metrics' weighted sum
    forwards: int = 0                     # micro-batches this rank trained (perf/micro_batches: packing shows here)
    skipped: int = 0                      # optimizer steps skipped for a non-finite loss or grad norm

    def add(self, loss_metrics: dict, weight: torch.Tensor) -> None:
        """One micro-batch's loss metrics ({name: 0-dim tensor}), times weight (0-dim float64)."""
        terms = torch.stack(list(loss_metrics.values())).double() * weight
        self.loss_keys, self.loss_sum = list(loss_metrics), terms if self.loss_sum is None else self.loss_sum + terms

    def metrics(self, d: distributed.Dist) -> dict:
        """loss/* over all ranks, optim/skipped_steps, perf/micro_batches; collective."""
        out = {}
        if self.loss_sum is not None:  # each rank's terms are already weighted by its share of the global batch
            out.update(zip(self.loss_keys, distributed.all_sum(self.loss_sum, d).tolist()))
        return {**out, "optim/skipped_steps": self.skipped, "perf/micro_batches": self.forwards}


def mini_batch_backward(run: Run, b: StepBatch, idx: torch.Tensor, entropy_coef: float, n_mini: int,
                        tally: TrainTally, first: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One mini-batch's gradients (rows idx of b, [M]), accumulated over its micro-batches; each
    micro-batch's loss metrics go to tally, weighted by its share of the mini-batch and 1 / n_mini.
    first: (logp, entropy) [B, L] each, given for the first mini-batch (no optimizer step has run: the
    behaviour weights'): they get each forward's logprobs and token entropies, detached, before its loss
    reads b.old_logp (which is first's logp, but under train.old_logp=rollout). Returns this rank's count
    of non-finite micro-batch losses (a 0-dim tensor, no host sync)."""
    cfg, d, model = run.cfg, run.d, run.model
    totals = MiniBatchTotals(  # over every rank's share of the mini-batch
        tokens=distributed.all_sum(b.loss_mask[idx].sum(), d).clamp(min=1),
        rows=float(distributed.all_sum(b.loss_mask[idx].amax(1).sum(), d)),  # rows that count
        response_tokens=distributed.all_sum(b.mask[idx].sum(), d).clamp(min=1) if entropy_coef > 0 else None)
    zero_grads(run)
    nonfinite_loss = torch.zeros((), device=d.device)
    for rows, n in micro_plan(run, b, idx):  # rows of like length, cut to n
        tally.forwards += 1
        j = (rows, slice(0, n))
        routed = routing.prepare(model, None if b.routed_experts is None else b.routed_experts[j],
                                 cfg.moe.router_replay, keep_logits=cfg.moe.aux_loss_coef > 0)  # MoE
        entropy = entropy_coef > 0 or first is not None  # the bonus's (with grad), or the metric's
        with amp(run.mixed):  # the policy forward, with grad
            logp = token_logprobs(model, b.input_ids[j], b.attention_mask[j], cfg.rollout.temperature,
                                  entropy=entropy, fused=cfg.train.fused_head, entropy_grad=entropy_coef > 0,
                                  compile_head=compile_backend(cfg, d.device))
        logp, policy_entropy = logp if entropy else (logp, None)
        if first is not None:  # the behaviour weights' logprobs and entropy
            first[0][j], first[1][j] = logp.detach(), policy_entropy.detach()
        aux = routing.load_balancing_loss(routed.logits, b.attention_mask[j]) \
            if routed is not None and cfg.moe.aux_loss_coef > 0 else None  # MoE, over the real tokens
        out = micro_batch_loss(LossInputs(
            logp, b.old_logp[j], b.rollout_logp[j], b.advantages[rows], b.loss_mask[j],
            ref_logp=None if b.ref_logp is None else b.ref_logp[j], entropy=policy_entropy,
            response_mask=b.mask[j], aux_loss=aux), totals, cfg.loss, entropy_coef, cfg.moe.aux_loss_coef)
        (out.loss * distributed.grad_scale(d)).backward()
        nonfinite_loss += (~torch.isfinite(out.loss.detach())).float()
        tally.add(out.metrics, out.weight.detach().double() / n_mini)
    return nonfinite_loss


def optimizer_step(run: Run, state: State, nonfinite_loss: torch.Tensor, step: int, metrics: dict) -> bool:
    """Clip the gradients and step the optimizer and the schedule; False, and the gradients dropped, if
    the grad norm or a loss (nonfinite_loss: this rank's count) is non-finite on any rank
    (state.bad_steps counts such skips in a row; train.max_bad_steps of them abort)."""
    cfg = run.cfg
    max_norm = math.inf if cfg.optim.max_grad_norm is None else cfg.optim.max_grad_norm  # null: no clip
    grad_norm = distributed.clip_grad_norm(run.model.parameters(), max_norm)
    if not torch.isfinite(grad_norm) or distributed.all_sum(nonfinite_loss, run.d) > 0:  # every rank agrees
        run.optimizer.zero_grad(set_to_none=True)
        state.bad_steps += 1
        run.logger.print(f"WARNING step {step}: non-finite loss/grad norm, optimizer step skipped "
                         f"({state.bad_steps} in a row)")
        if state.bad_steps >= cfg.train.max_bad_steps:
            raise UserError(f"{state.bad_steps} consecutive non-finite steps (train.max_bad_steps); lower "
                            "optim.lr, check the data, or try fp8.train=false to isolate FP8")
        return False
    state.bad_steps = 0
    run.optimizer.step()
    run.scheduler.step()
    metrics["optim/grad_norm"] = float(grad_norm)  # before clipping; after (clip_grads_with_norm_'s factor):
    metrics["optim/grad_norm_clipped"] = float(grad_norm) * min(1.0, max_norm / (float(grad_norm) + 1e-6))
    return True


def update_metrics(run: Run, b: StepBatch, step: int, probe_before: torch.Tensor | None, metrics: dict) -> None:
    """After the update: the share of weights it moved, its largest |dw| / lr (observe.update_guard) and,
    with train.probe, the policy gain against probe_before (the [B, L] BF16 logprobs before it)."""
    cfg, d = run.cfg, run.d
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
    """optimizer.zero_grad(set_to_none=True). With fp8.fuse_grad_accum the linears' gradient buffers (FP8, or
    the BF16 twin's) are then zeroed and their .grad views put back (keep), or their memory given back (the
    engine's turn)."""
    run.optimizer.zero_grad(set_to_none=True)
    if run.cfg.fp8.fuse_grad_accum:
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
