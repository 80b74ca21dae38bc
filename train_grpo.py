"""End-to-end FP8 GRPO, top to bottom.

    python train_grpo.py --config configs/tiny_cpu.yaml                  # CPU, a few minutes
    torchrun --nproc_per_node 1 train_grpo.py --config configs/llama31_8b_fp8.yaml
    python train_grpo.py --config configs/tiny_cpu.yaml loss.is_cap=5 fp8.train=false
    python train_grpo.py --resume runs/tiny_cpu-20261122-101500           # continue a run

Each step: rollout (engine samples n completions per prompt, with each token's logprob) ->
reward (math-verify) -> group advantages -> trainer logprobs of the behaviour weights
(`old_logp`) and rollout/trainer mismatch -> one or more optimizer steps on the clipped
surrogate with truncated importance sampling -> q/k/v scale recalibration (FP8 KV cache) ->
weight sync into the engine (FP8 weights made by fp8/quant.py) -> log.

Where this departs from textbook GRPO:
- Two policies, not one: the engine (FP8, different kernels) samples, the trainer scores. The
  PPO ratio uses the trainer's own `old_logp`; the engine/trainer gap is corrected by a
  separate, detached importance weight w = exp(old_logp - rollout_logp), truncated (TIS).
- Loss aggregation, KL and IS variants are config knobs (losses/grpo.py documents each).
- Validation is greedy (temperature 0) accuracy on a held-out split.
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
import yaml

import distributed
from checkpoint import (atomic_write, create_run_dir, load_latest, record_resume, remove_unstarted_run,
                        resume_config, save_checkpoint, set_rng_state)
from config import Config, UserError, load_config, to_dict
from data import (PromptSampler, data_warnings, format_reward, load_splits, math_reward, reward_last_number,
                  reward_stats)
from fp8.calibrate import token_mask
from fp8.linear import bf16_reference
from losses import collapse
from losses.advantages import group_advantages
from losses.grpo import grpo_loss
from losses.mismatch import mismatch_metrics
from optimizer import build_optimizer
from probe import WeightChange, policy_gain, probe_rewards
from profiling import gc_timer, save_profile, start_profile


# ----------------------------------------------------------------------------- logging

class RunLogger:
    """metrics.jsonl + TensorBoard in the run dir; a no-op off rank 0 (no `if rank == 0` in the loop)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled, self.tb = enabled, None
        if not enabled:
            return
        self.file = open(run_dir / "metrics.jsonl", "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        for k, v in metrics.items():
            if self.tb is not None and isinstance(v, (int, float)):
                self.tb.add_scalar(k, v, step)

    def print(self, *args) -> None:
        if self.enabled:
            from tqdm import tqdm
            tqdm.write(" ".join(str(a) for a in args))

    def truncate(self, step: int) -> None:
        """Resume from a checkpoint of `step`: drop the records of steps >= step that the interrupted
        run logged after it (the resumed run logs them again), so metrics.jsonl keeps one record
        per step; TensorBoard hides them too (purge_step). Unparsable (torn) lines are dropped."""
        if not self.enabled:
            return
        path = Path(self.file.name)
        self.file.close()
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] < step:
                    keep.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                pass
        atomic_write(path, lambda f: f.write("".join(keep).encode()))
        self.file = open(path, "a")
        if self.tb is not None:
            from torch.utils.tensorboard import SummaryWriter
            self.tb.close()
            self.tb = SummaryWriter(str(path.parent), purge_step=step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


# ----------------------------------------------------------------------------- tensors

def length_multiple(rows: int, tokens: int) -> int:
    """The batch length multiple that makes `rows` rows hold a multiple of `tokens` tokens."""
    return tokens // math.gcd(rows, tokens)


def collate(samples, pad_id: int, multiple: int = 1):
    """Samples -> right-padded prompt+response batch, its length L a multiple of `multiple`.

    Returns input_ids [B, L], attention_mask [B, L], mask [B, L] (1 on response tokens) and
    rollout_logp [B, L] (engine logprob of token t at position t; 0 elsewhere)."""
    L = -(-max(len(s.prompt_ids) + len(s.token_ids) for s in samples) // multiple) * multiple
    B = len(samples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L)
    rollout_logp = torch.zeros(B, L)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.token_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.token_ids)
        attention_mask[i, : p + r] = 1
        mask[i, p: p + r] = 1
        rollout_logp[i, p: p + r] = torch.tensor(s.logprobs)
    return input_ids, attention_mask, mask, rollout_logp


def token_logprobs(model, input_ids, attention_mask, temperature: float, entropy: bool = False):
    """log p(token t | tokens < t) under log_softmax(logits / T), aligned to position t. [B, L]
    entropy=True: (logp, H) with H [B, L] the entropy (nats) of the distribution token t was drawn from.

    attention_mask must be right padding (collate's): under causal attention no real token then sees
    a pad, so the model runs without it (pad positions get finite values, masked out downstream).
    With it, HF builds a [B, 1, L, L] mask for any padded batch and SDPA leaves its causal flash
    kernel for a masked one that computes all L x L scores."""
    # no KV cache: nothing to reuse, and its per-layer state would make compiled layers recompile
    with token_mask(attention_mask):  # still keeps pads out of the q/k/v calibrator's amax
        logits = model(input_ids=input_ids, use_cache=False).logits  # [B, L, V]
    out, ent = [], []
    for row_logits, row_ids in zip(logits, input_ids):  # one row at a time: fp32 [L, V] stays small
        lp = torch.log_softmax(row_logits[:-1].float() / temperature, dim=-1)  # [L-1, V]
        out.append(lp.gather(-1, row_ids[1:, None]).squeeze(-1))  # [L-1]
        if entropy:
            ent.append(collapse.token_entropy(lp))  # [L-1]
    logp = torch.nn.functional.pad(torch.stack(out), (1, 0))  # [B, L]
    return (logp, torch.nn.functional.pad(torch.stack(ent), (1, 0))) if entropy else logp


def micro_batches(n: int, size: int):
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


# ----------------------------------------------------------------------------- setup

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


def prepare_prompts(examples, tokenizer, cfg: Config):
    """Render + tokenize; prompts longer than data.max_prompt_tokens are dropped (counted)."""
    from data import filter_long_prompts, uses_chat_template

    kept, dropped = filter_long_prompts(examples, tokenizer, cfg.data)
    if cfg.model.name_or_path == "tiny":
        from modeling import check_char_vocab
        check_char_vocab(cfg.model.tiny.vocab, [ex["prompt"] for ex in kept])
    special = not uses_chat_template(tokenizer, cfg.data)  # chat templates write their own BOS
    ids = tokenizer([ex["prompt"] for ex in kept], add_special_tokens=special)["input_ids"] if kept else []
    return [{**ex, "prompt_ids": i} for ex, i in zip(kept, ids)], dropped


def validate_accuracy(engine, val_set, tokenizer, cfg: Config, d: distributed.Dist) -> float:
    """Greedy accuracy on the first val_max_prompts held-out prompts (ranks split them)."""
    val = val_set[: cfg.train.val_max_prompts]
    mine = val[d.rank // d.tp:: d.world // d.tp]  # one share per engine (a TP group generates it together)
    samples = engine.generate([ex["prompt_ids"] for ex in mine], n=1, temperature=0.0, top_p=1.0,
                              max_new_tokens=cfg.rollout.max_new_tokens)
    texts = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
    counted = d.rank % d.tp == 0  # the group's first rank scores its engine's answers; the others add 0
    last_number = reward_last_number(cfg.data)
    correct = torch.tensor(float(sum(math_reward(t, ex["answer"], finish_reason=s.finish_reason, last_number=last_number)
                                     for t, ex, s in zip(texts, mine, samples)) if counted else 0), device=d.device)
    return float(distributed.all_sum(correct, d)) / len(val)


# ----------------------------------------------------------------------------- main loop

def train(args) -> Path:
    resume_dir = Path(args.resume) if args.resume else None
    if resume_dir and args.config:
        raise UserError(f"--resume {resume_dir} continues with the run's own config.yaml: drop --config and give "
                        "changes as key=value overrides")
    if resume_dir and not (resume_dir / "config.yaml").is_file():
        raise UserError(f"--resume {resume_dir}: not a run directory (no config.yaml)")
    cfg = resume_config(resume_dir, args.overrides) if resume_dir else load_config(args.config, args.overrides)
    d = distributed.init(cfg)
    device, rank = d.device, d.rank
    if cfg.rollout.engine == "vllm" and device.type != "cuda":
        raise UserError(f"rollout.engine=vllm needs a CUDA GPU (the device is {device}); set rollout.engine=hf")
    run_dir = resume_dir or make_run_dir(cfg, args.config, d)
    args.new_run_dir = run_dir if d.main and not resume_dir else None  # main() removes it if the run fails early
    if d.main:
        print(f"run_dir: {run_dir}", flush=True)
        if not resume_dir:  # never rewritten: a resume's overrides go to resumes.jsonl (record_resume)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), flush=True)
    logger = RunLogger(run_dir, enabled=rank == 0, tensorboard=cfg.log.tensorboard)
    torch.manual_seed(cfg.train.seed)
    mixed = device.type == "cuda" and cfg.model.dtype == "float32"  # fp32 master weights, bf16 compute

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()

    def score(net, input_ids, attention_mask):
        """No-grad token_logprobs [B, L] in micro-batches."""
        with torch.no_grad(), amp():
            return torch.cat([token_logprobs(net, input_ids[s], attention_mask[s], cfg.rollout.temperature)
                              for s in micro_batches(len(input_ids), cfg.train.micro_batch_size)])

    from modeling import load_model_and_tokenizer, save_config_dir
    from rollout import Sample, make_engine
    model, tokenizer = load_model_and_tokenizer(cfg.model, device)
    train_set, val_set = load_splits(cfg.data)
    train_set, dropped = prepare_prompts(train_set, tokenizer, cfg)
    val_set, _ = prepare_prompts(val_set, tokenizer, cfg)
    if cfg.train.val_every and not val_set:
        raise UserError("the validation split is empty; set data.val_size / data.val_split, or train.val_every=0")
    logger.print(f"data: {len(train_set)} train prompts ({dropped} dropped as overlong), {len(val_set)} val")
    for warning in data_warnings(train_set, dropped, cfg.data):
        logger.print(f"WARNING data: {warning}")

    # The engine gets its own copy of the weights (HF) or its own process memory (vLLM)
    # before the trainer's linears become FP8: it only ever sees weights through export.
    model_dir = save_config_dir(model, tokenizer, run_dir / "engine_model") \
        if cfg.model.name_or_path == "tiny" else cfg.model.name_or_path
    engine = make_engine(cfg, model, tokenizer, device, model_dir)
    # KL reference: the initial policy, frozen, in BF16 (never quantized)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.loss.kl_coef > 0 else None
    from fp8.export import export_weights
    from fp8.calibrate import QKVCalibrator
    fp8_tokens = 1  # token multiple the trainer's FP8 GEMMs want
    if cfg.fp8.train:
        from fp8.linear import convert_to_fp8_training, use_torchao
        from fp8.quant import BLOCK
        if cfg.fp8.cache_weights and d.world > 1:
            raise UserError(f"fp8.cache_weights keeps unsharded FP8 weights, which defeats FSDP over {d.world} "
                            "ranks: set fp8.cache_weights=false, or run on one GPU")
        converted = convert_to_fp8_training(model, cfg.fp8)
        logger.print(f"fp8: trainer linears in block FP8: {len(converted)}")
        fp8_tokens = BLOCK if use_torchao(cfg.fp8, device) else 1
    if cfg.train.compile != "none":  # after FP8 conversion: the FP8 linears are traced into the graph
        distributed.compile_layers(model, cfg.train.compile)
    # after FP8 conversion: FSDP2 all-gathers the weight each FP8 linear then quantizes, as on one GPU
    distributed.shard(model, d, bf16_compute=mixed)
    if ref_model is not None:
        distributed.shard(ref_model, d, bf16_compute=mixed)
    calibrator = QKVCalibrator(model, cfg.fp8.calib_percentile, cfg.fp8.calib_margin) \
        if cfg.fp8.kv_cache and cfg.fp8.recalibrate else None

    optimizer = build_optimizer(model.parameters(), cfg.optim)
    weight_change = WeightChange(optimizer)  # optim/changed_frac: did the step move the weights?
    warmup = cfg.optim.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    sampler = PromptSampler(train_set, cfg.rollout.prompts_per_step, seed=cfg.data.seed)
    start_step, kv_scales, bad_steps = 0, None, 0
    entropy_control = None if cfg.loss.entropy_target is None else \
        collapse.EntropyControl(cfg.loss.entropy_target, cfg.loss.entropy_coef_step, cfg.loss.entropy_coef)
    ckpt_root = run_dir / "checkpoints"
    if resume_dir:
        loaded = load_latest(ckpt_root, model, optimizer, d, log=logger.print)  # newest that loads; collective
        if loaded is None:
            raise UserError(f"--resume {resume_dir}: no complete checkpoint in {ckpt_root}, so it cannot be resumed; "
                            "start a new run (another train.run_name), or delete that directory")
        ckpt, state = loaded
        if state["world"] != d.world:  # DCP reshards: any world size reads it (checkpoint.py)
            logger.print(f"resuming a {state['world']}-rank checkpoint on {d.world} rank{'s' * (d.world > 1)}")
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        start_step, kv_scales, bad_steps = state["step"], state["kv_scales"], state.get("bad_steps", 0)
        if entropy_control is not None and state.get("entropy_coef") is not None:
            entropy_control.coef = state["entropy_coef"]
        logger.truncate(start_step)  # steps the interrupted run logged past the checkpoint are redone
        logger.print(f"resumed from {ckpt} at step {start_step}")
        if d.main:
            record_resume(run_dir, args.overrides, start_step)
    if cfg.fp8.train and cfg.fp8.cache_weights:  # fp8.cache_weights: filled now, re-quantized after every step
        from fp8.fast import refresh_weight_caches_on_step
        refresh_weight_caches_on_step(model, optimizer)

    def sync_engine():
        t0 = time.perf_counter()
        with torch.profiler.record_function("refit"):
            engine.update_weights(export_weights(model, cfg.fp8, fp8=cfg.fp8.rollout))
            if cfg.fp8.kv_cache and kv_scales is not None:
                engine.set_kv_scales(kv_scales)
        return time.perf_counter() - t0

    def recalibrate(input_ids, attention_mask):
        """Per-layer (q, k, v) scales from a no-grad forward over the first calib_samples rows."""
        with torch.no_grad(), amp(), calibrator.capture():
            for s in micro_batches(min(len(input_ids), cfg.fp8.calib_samples), cfg.train.micro_batch_size):
                with token_mask(attention_mask[s]):  # right padding: no mask needed (token_logprobs)
                    model(input_ids=input_ids[s], use_cache=False)
        return calibrator.scales()

    def save(step):  # collective: each rank writes its own shards (checkpoint.py)
        meta = {"scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(), "step": step,
                "kv_scales": kv_scales, "bad_steps": bad_steps,
                "entropy_coef": None if entropy_control is None else entropy_control.coef}
        path = save_checkpoint(ckpt_root, step, meta, model, optimizer, d, keep=cfg.train.keep_ckpts)
        logger.print(f"checkpoint: {path}")

    if calibrator is not None and kv_scales is None:  # the first rollout already gets calibrated scales
        prompts = [Sample(0, ex["prompt_ids"], [], [], "length") for ex in train_set[: cfg.fp8.calib_samples]]
        ids, am, _, _ = collate(prompts, tokenizer.pad_token_id)
        kv_scales = recalibrate(ids.to(device), am.to(device))
    sync_engine()
    from tqdm import tqdm
    n, T = cfg.rollout.n, cfg.rollout.temperature
    gen, own = distributed.rollout_share(d, cfg.rollout.prompts_per_step)  # whole groups; see rollout_share

    last_number = reward_last_number(cfg.data)  # the reward's lenient mode (synthetic data)

    def rollout_round(step: int, r: int, metrics: dict) -> collapse.Groups:
        """Draw prompts, generate n samples each, score them: this rank's groups of round r of the step."""
        prompts = next(sampler)[gen]  # same draw on every rank
        # sample j of global prompt i gets seed step_seed + i*n + j: disjoint across steps and ranks (a
        # resample round r >= 1 adds r * 2**40, past every step's range)
        step_seed = (cfg.train.seed * 1_000_003 + step) * cfg.rollout.prompts_per_step * n + (r << 40)
        with torch.profiler.record_function("rollout"):  # a named span in the profile's trace
            samples = engine.generate([ex["prompt_ids"] for ex in prompts], n=n, temperature=T,
                                      top_p=cfg.rollout.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
                                      seed=step_seed + gen.start * n)
        batch = prompts[own]  # this rank's prompts and their samples (all of them without TP)
        samples = [dataclasses.replace(s, prompt_index=s.prompt_index - own.start)
                   for s in samples[own.start * n: own.stop * n]]
        t0 = time.perf_counter()
        texts = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
        answers = [batch[s.prompt_index]["answer"] for s in samples]
        correct = torch.tensor([math_reward(t, a, finish_reason=s.finish_reason, last_number=last_number)
                                for t, a, s in zip(texts, answers, samples)])  # [B]
        rewards = correct + cfg.data.format_reward * torch.tensor([format_reward(t) for t in texts])
        if cfg.train.probe:  # a synthetic reward with variance: the update direction is checkable on any model
            rewards = probe_rewards(samples)
        metrics["time/reward"] = metrics.get("time/reward", 0.0) + time.perf_counter() - t0
        return collapse.Groups(batch, samples, texts, rewards, correct)

    pbar = tqdm(range(start_step, cfg.train.steps), initial=start_step, total=cfg.train.steps,
                disable=rank != 0, dynamic_ncols=True)
    distributed.memory_metrics(device)  # each step's mem/* start here
    gc_timer().take()  # each step's time/gc starts here
    for step in pbar:
        metrics, t_step = {}, time.perf_counter()
        profiling = step == cfg.log.profile_step
        prof = start_profile(device) if profiling and cfg.log.profile_rollout else None
        if cfg.train.val_every and step % cfg.train.val_every == 0:
            metrics["val/accuracy"] = validate_accuracy(engine, val_set, tokenizer, cfg, d)

        # ---- rollout and reward; dynamic_sampling=resample rolls out more rounds while any rank lacks
        # groups with reward variance (every rank runs the same rounds: losses/collapse.py)
        t0 = time.perf_counter()
        engine.wake()
        rounds = [rollout_round(step, 0, metrics)]
        while cfg.train.dynamic_sampling == "resample" and len(rounds) < cfg.train.max_rollout_rounds and \
                distributed.all_sum(torch.tensor(float(collapse.deficit(rounds, n)), device=device), d) > 0:
            rounds.append(rollout_round(step, len(rounds), metrics))
        engine.sleep()
        metrics["time/rollout"] = time.perf_counter() - t0 - metrics["time/reward"]
        if profiling and prof is None:  # log.profile_rollout=false: the trainer's phases only
            prof = start_profile(device)

        # ---- advantages; groups left out by dynamic sampling get loss mask 0 (the batch keeps its shape)
        groups, keep = collapse.assemble(rounds, n, cfg.train.dynamic_sampling)  # keep: bool [B / n]
        batch, samples, texts, rewards, correct = groups.prompts, groups.samples, groups.texts, groups.rewards, \
            groups.correct
        answers = [batch[s.prompt_index]["answer"] for s in samples]
        advantages = group_advantages(rewards, n)  # [B]
        # collapse signals over round 0 (the step's fresh draw, what dynamic_sampling=none trains on)
        signals = {"reward/zero_std_groups": (~collapse.has_variance(rounds[0].rewards, n)).float(),
                   "reward/distinct_answers": collapse.distinct_answers(rounds[0].texts, n),
                   "reward/unsolved_groups": (rounds[0].correct.view(-1, n).amax(1) == 0).float(),
                   "reward/kept_groups": keep.float()}
        metrics.update({k: float(distributed.gather_rows(v[:, None].to(device), d).mean()) for k, v in signals.items()})
        metrics["rollout/rounds"] = len(rounds)
        # micro-batch tokens % 128 == 0 for torchao's FP8 GEMMs, else each FP8 linear pads (and keeps) a copy of its input
        B, mb = len(samples), cfg.train.micro_batch_size
        input_ids, attention_mask, mask, rollout_logp = collate(samples, tokenizer.pad_token_id,
                                                                length_multiple(min(mb, B), fp8_tokens))
        input_ids, attention_mask, mask, rollout_logp, advantages = (
            x.to(device) for x in (input_ids, attention_mask, mask, rollout_logp, advantages))
        loss_mask = mask * keep.repeat_interleave(n).to(device)[:, None]  # [B, L] the tokens the loss averages

        # ---- trainer logprobs of the behaviour weights, and the engine/trainer mismatch
        t0 = time.perf_counter()
        capture = calibrator.capture() if calibrator is not None and cfg.fp8.calib_pass == "logprobs" \
            else contextlib.nullcontext()  # q/k/v amax of this forward -> the next rollout's scales
        with torch.no_grad(), amp():
            with capture, torch.profiler.record_function("logprobs"):
                old_logp, entropy = (torch.cat(x) for x in zip(*[token_logprobs(
                    model, input_ids[s], attention_mask[s], T, entropy=True) for s in micro_batches(B, mb)]))  # [B, L]
        ref_logp = None if ref_model is None else score(ref_model, input_ids, attention_mask)
        metrics["time/logprobs"] = time.perf_counter() - t0
        metrics["policy/entropy"] = float(distributed.all_sum((entropy * mask).sum(), d)
                                          / distributed.all_sum(mask.sum(), d).clamp(min=1))
        metrics.update({f"mismatch/{k}": v for k, v in mismatch_metrics(
            *(distributed.gather_rows(x, d) for x in (old_logp, rollout_logp, mask))).items()})
        if cfg.log.save_batch_every and step % cfg.log.save_batch_every == 0:  # for notebooks/ (analysis.py)
            from analysis import save_rollout_batch
            with bf16_reference(model):  # same weights, linears not quantized
                bf16_logp = score(model, input_ids, attention_mask)  # [B, L]
            rows = [distributed.gather_rows(x, d, pad=tokenizer.pad_token_id if x is input_ids else 0)
                    for x in (input_ids, attention_mask, mask, rollout_logp, old_logp, bf16_logp)]
            rows += [distributed.gather_rows(x[:, None].to(device).float(), d)[:, 0].cpu()
                     for x in (rewards, advantages)]
            if rank == 0:  # every rank's rows, in rank order
                save_rollout_batch(run_dir / "batches" / f"step_{step:06d}.pt", step, *rows, to_dict(cfg), tokenizer,
                                   model_dir)
        mult_err = metrics["mismatch/token_mult_prob_error"]
        if mult_err > cfg.train.mismatch_warn:
            logger.print(f"WARNING step {step}: mismatch/token_mult_prob_error={mult_err:.4f} > "
                         f"train.mismatch_warn={cfg.train.mismatch_warn}: rollout and trainer disagree")
        if cfg.train.mismatch_stop and mult_err > cfg.train.mismatch_stop:
            raise UserError(f"step {step}: mismatch/token_mult_prob_error={mult_err:.4f} > train.mismatch_stop="
                            f"{cfg.train.mismatch_stop}: rollout and trainer disagree; check the weight sync and the "
                            "fp8.* settings of both sides, or raise train.mismatch_stop (0 = never stop)")

        if cfg.train.probe:  # the master weights' policy before the update (without FP8 rounding flips)
            with bf16_reference(model):
                probe_before = score(model, input_ids, attention_mask)  # [B, L]

        # ---- policy update: mini-batches (one optimizer step each) of micro-batches
        t0 = time.perf_counter()
        entropy_coef = cfg.loss.entropy_coef if entropy_control is None else entropy_control(metrics["policy/entropy"])
        if cfg.loss.entropy_coef or entropy_control is not None:
            metrics["loss/entropy_coef"] = entropy_coef
        weight_change.start()
        with torch.profiler.record_function("train"):
            model.train()
            order = torch.randperm(B, generator=torch.Generator().manual_seed(cfg.train.seed + step)).to(device)
            mini = (cfg.train.mini_batch_size or B * d.world) // d.world  # per rank; the global one spans ranks
            n_mini = len(micro_batches(B, mini))
            loss_metrics: dict[str, float] = {}
            skipped = 0  # optimizer steps skipped for a non-finite loss or grad norm
            for mini_slice in micro_batches(B, mini):
                idx = order[mini_slice]
                mini_tokens = distributed.all_sum(loss_mask[idx].sum(), d).clamp(min=1)
                mini_all_tokens = distributed.all_sum(mask[idx].sum(), d).clamp(min=1)  # kept groups or not
                mini_rows = float(distributed.all_sum(loss_mask[idx].amax(1).sum(), d))  # rows that count
                optimizer.zero_grad(set_to_none=True)
                nonfinite_loss = torch.zeros((), device=device)
                for micro in micro_batches(len(idx), mb):
                    j = idx[micro]
                    with amp():
                        logp = token_logprobs(model, input_ids[j], attention_mask[j], T, entropy=entropy_coef > 0)
                    logp, policy_entropy = logp if entropy_coef > 0 else (logp, None)
                    loss, m = grpo_loss(logp, old_logp[j], rollout_logp[j], advantages[j], loss_mask[j], cfg.loss,
                                        ref_logp=None if ref_logp is None else ref_logp[j])
                    # weight micro-batches so the accumulated loss equals the mini-batch's aggregate
                    weight = loss_mask[j].sum() / mini_tokens if cfg.loss.agg == "token_mean" else \
                        float(loss_mask[j].amax(1).sum()) / max(mini_rows, 1.0)
                    loss = loss * weight
                    if entropy_coef > 0:  # the bonus: mean entropy over all the mini-batch's response tokens
                        loss = loss - entropy_coef * (policy_entropy * mask[j]).sum() / mini_all_tokens
                    (loss * distributed.grad_scale(d)).backward()
                    nonfinite_loss += (~torch.isfinite(loss.detach())).float()
                    for k, v in m.items():
                        loss_metrics[k] = loss_metrics.get(k, 0.0) + v * float(weight) / n_mini
                max_norm = math.inf if cfg.optim.max_grad_norm is None else cfg.optim.max_grad_norm  # null: no clip
                grad_norm = distributed.clip_grad_norm(model.parameters(), max_norm)
                if not torch.isfinite(grad_norm) or distributed.all_sum(nonfinite_loss, d) > 0:  # every rank agrees
                    optimizer.zero_grad(set_to_none=True)
                    bad_steps, skipped = bad_steps + 1, skipped + 1
                    logger.print(f"WARNING step {step}: non-finite loss/grad norm, optimizer step skipped "
                                 f"({bad_steps} in a row)")
                    if bad_steps >= cfg.train.max_bad_steps:
                        raise UserError(f"{bad_steps} consecutive non-finite steps (train.max_bad_steps); lower "
                                        "optim.lr, check the data, or try fp8.train=false to isolate FP8")
                    continue
                bad_steps = 0
                optimizer.step()
                scheduler.step()
                metrics["optim/grad_norm"] = float(grad_norm)  # before clipping; after (clip_grads_with_norm_'s factor):
                metrics["optim/grad_norm_clipped"] = float(grad_norm) * min(1.0, max_norm / (float(grad_norm) + 1e-6))
            optimizer.zero_grad(set_to_none=True)  # free the gradients before the engine wakes (memory)
            if d.world > 1:  # each rank's terms are already weighted by its share of the global batch
                summed = distributed.all_sum(torch.tensor(list(loss_metrics.values()), device=device), d)
                loss_metrics = dict(zip(loss_metrics, summed.tolist()))
            metrics.update(loss_metrics)
            metrics["optim/skipped_steps"] = skipped
        metrics["time/train"] = time.perf_counter() - t0
        if (changed := weight_change.finish()) is not None:  # the share of weights the step moved
            metrics["optim/changed_frac"] = changed
        if cfg.train.probe:  # did the update raise the positive-advantage samples relative to the negative ones?
            with bf16_reference(model):
                metrics["probe/policy_gain"] = policy_gain(score(model, input_ids, attention_mask), probe_before,
                                                           advantages, mask)

        # ---- recalibrate q/k/v scales (on the new weights, or from the old_logp capture), then push
        # weights (+ scales)
        if calibrator is not None:
            t0 = time.perf_counter()
            with torch.profiler.record_function("recalibrate"):
                kv_scales = recalibrate(input_ids, attention_mask) if cfg.fp8.calib_pass == "separate" \
                    else calibrator.scales()
            metrics["time/recalibrate"] = time.perf_counter() - t0
            for i, name in enumerate(("q", "k", "v")):
                metrics[f"fp8/{name}_scale_mean"] = sum(sc[i] for sc in kv_scales.values()) / len(kv_scales)
        metrics["time/refit"] = sync_engine()

        # ---- log (over all ranks' samples)
        truncated = torch.tensor([float(s.finish_reason == "length") for s in samples])
        rewards, correct, lengths, truncated = (distributed.gather_rows(x[:, None].to(device).float(), d)[:, 0].cpu()
                                                for x in (rewards, correct, mask.sum(1), truncated))
        tokens = float(distributed.all_sum(attention_mask.sum(), d))
        metrics.update({
            "reward/mean": float(rewards.mean()), "reward/accuracy": float(correct.mean()),
            "reward/solved_groups": float((correct.view(-1, n).max(1).values > 0).float().mean()),
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/truncated_frac": float(truncated.mean()),
            "optim/lr": float(scheduler.get_last_lr()[0]), "time/step": time.perf_counter() - t_step,
            "perf/tokens_per_s": tokens / (time.perf_counter() - t_step),
            "time/gc": gc_timer().take(), **reward_stats(), **distributed.memory_metrics(device),
        })
        if prof is not None:
            logger.print(f"profile: {save_profile(prof, run_dir / 'profile', step, rank, device)}")
        logger.log(step, metrics)
        pbar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3f}" for k in
                          ("reward/mean", "mismatch/token_mult_prob_error", "val/accuracy") if k in metrics})
        if d.main and cfg.log.dump_episodes_every and step % cfg.log.dump_episodes_every == 0:
            dump_episodes(run_dir, step, samples, texts, answers, rewards, advantages, old_logp, mask, tokenizer,
                          cfg.log.dump_episodes_n)
        if cfg.train.ckpt_every and (step + 1) % cfg.train.ckpt_every == 0:
            save(step + 1)

    final = {"val/accuracy": validate_accuracy(engine, val_set, tokenizer, cfg, d)} if cfg.train.val_every else {}
    if final:
        logger.log(cfg.train.steps, final)
    logger.print(f"done: {cfg.train.steps} steps; final {final}; run_dir {run_dir}")
    if cfg.train.save_final and start_step < cfg.train.steps and not (
            cfg.train.ckpt_every and cfg.train.steps % cfg.train.ckpt_every == 0):
        save(cfg.train.steps)  # (else the loop has just saved this step, or nothing ran)
    logger.close()
    distributed.close(d)
    return run_dir


def dump_episodes(run_dir, step, samples, texts, answers, rewards, advantages, old_logp, mask, tokenizer, k):
    out = run_dir / "episodes"
    out.mkdir(exist_ok=True)
    with open(out / f"step_{step:06d}.jsonl", "w") as f:
        for i, s in enumerate(samples[:k]):
            pos = mask[i].nonzero().squeeze(-1)
            f.write(json.dumps({
                "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=True), "completion": texts[i],
                "answer": answers[i], "reward": float(rewards[i]), "advantage": float(advantages[i]),
                "finish_reason": s.finish_reason, "rollout_logp": s.logprobs,
                "trainer_logp": old_logp[i, pos].tolist()}) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="YAML config (default: configs/tiny_cpu.yaml)")
    p.add_argument("--resume", help="run dir to continue from its latest checkpoint")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. loss.is_cap=5")
    args = p.parse_args(argv)
    if not args.config and not args.resume:
        args.config = str(Path(__file__).parent / "configs" / "tiny_cpu.yaml")
    try:
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
