"""The trainer's logprobs and train phases of a GRPO step, as train_grpo.py runs them, on a synthetic batch at
a shipped config's workload: what those two phases cost apart from the rollout, on one GPU or under FSDP2.

    python -m bench.trainer_phase --config configs/qwen3_8b_bf16.yaml --shape qwen3 --prompts 16
    torchrun --nproc_per_node 2 -m bench.trainer_phase --config configs/qwen3_8b_bf16.yaml --shape qwen3 \
        --prompts 8 --set rollout.gpu_memory_utilization=0.4 train.micro_batch_size=4 train.fused_head=true
    ... --engine     # the config's vLLM engine built first and left asleep in the process, as train_grpo.py has it

What runs is the trainer's own code: run_setup.prepare_trainer (FP8, compile, FSDP2), the optimizer,
trainer.assemble_batch, trainer.old_logprob_phase and trainer.train_phase, unchanged. The batch:
--prompts prompts (split over the ranks) x the config's rollout.n samples, --prompt random prompt tokens
each, response lengths log-normal as `scripts/flagship_check.py --shipped` draws them (median 1,400,
sigma 0.6, cut at rollout.max_new_tokens), random response tokens, rewards 0/1 at random; the mini-batches
as --shipped cuts them (the config's optimizer steps per step, each of whole micro-batches). Step 0
compiles and autotunes; steps 1.. are timed. A shipped run's time/logprobs and time/train at the same
--prompts compare with these: the difference is what the rest of the trainer's process (the engine, the
rollout before the phases) costs them; --engine puts the engine back.

Writes OUT/trainer_phase.json (bench/runner.py's schema, one row per timed step: time/logprobs,
time/train, seconds per micro-batch of each, the trainer's peak memory, the graphs compiled so far over the
ranks: one that grew in a timed step spent time compiling); --profile: the last step under
torch.profiler, its phases' device-busy table and top kernels in OUT/profile/ (observe.save_profile);
--memory: the last step under torch's allocator history, and per rank in OUT/trainer_phase_memory.json what
held memory at its allocated peak, by origin and stream, the allocator's cache per stream, the device's peak
against torch's, and the memory model's terms (bench/memory_breakdown.py). Without --engine, since a sleeping
engine's pool sits in torch's books.
"""

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from bench.rollout import ALIASES, MODELS, SHIPPED_LENGTHS, optimizer_steps, tiny_flow
from bench.runner import RESULTS, fail, write_results

ROOT = Path(__file__).resolve().parents[1]
MEDIAN, SIGMA = SHIPPED_LENGTHS


def synthetic_round(cfg, prompts: int, prompt_len: int, vocab: int, seed: int):
    """This rank's collapse.Groups: `prompts` prompts x rollout.n samples of drawn lengths, random tokens."""
    from engines.vllm import drawn_lengths
    from losses.collapse import Groups
    from rollout import Sample

    n, g = cfg.rollout.n, torch.Generator().manual_seed(seed)
    lengths = drawn_lengths(prompts * n, MEDIAN, SIGMA, cfg.rollout.max_new_tokens, seed)
    ids = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    samples = [Sample(k // n, ids[k // n], torch.randint(3, vocab, (t,), generator=g).tolist(), [-1.0] * t, "length")
               for k, t in enumerate(lengths)]
    rewards = torch.randint(0, 2, (prompts * n,), generator=g).float()
    return Groups([{"prompt_ids": p, "answer": "0"} for p in ids], samples, [""] * len(samples), rewards, rewards)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a shipped config, e.g. configs/qwen3_8b_bf16.yaml")
    p.add_argument("--shape", choices=sorted({*MODELS, *ALIASES}), help="build the config's model from scratch at "
                   "this real model's dims (bench/rollout.py MODELS), as the shipped runs do")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, as train_grpo.py's")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step, over all ranks (scripts/flagship_check.py "
                   "--prompts)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of each sample")
    p.add_argument("--steps", type=int, default=2, help="steps; the first is not timed")
    p.add_argument("--engine", action="store_true", help="build the config's rollout engine first and leave it asleep")
    p.add_argument("--profile", action="store_true", help="the last step under torch.profiler -> OUT/profile/")
    p.add_argument("--memory", action="store_true", help="the last step under torch's allocator history: what "
                   "holds memory at its peak, per rank, beside the memory model (bench/memory_breakdown.py) -> "
                   "OUT/trainer_phase_memory.json (the step's time then includes the recording)")
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    args = p.parse_args()
    import distributed
    import memory
    import run_setup
    import trainer
    from bench import memory_breakdown
    from config import load_config
    from errors import UserError
    from modeling import load_model_and_tokenizer
    from observe import freeze_gc_heap, gc_timer, save_profile, start_profile
    from optimizer import build_optimizer
    from probe import WeightChange

    shape = ["model.name_or_path=tiny", f"model.tiny={tiny_flow(ALIASES.get(args.shape, args.shape))}"] \
        if args.shape else []
    if args.steps < 2:
        fail("--steps must be >= 2 (step 0 compiles and is not timed)")
    try:
        base = load_config(args.config, [*shape, *args.set])
        samples, world = args.prompts * base.rollout.n, int(os.environ.get("WORLD_SIZE", "1"))
        opt_steps = optimizer_steps(base)  # the config's optimizer steps per step, kept
        if args.prompts % world or samples % opt_steps or (samples // opt_steps // world) % base.train.micro_batch_size:
            fail(f"--prompts {args.prompts}: {samples} samples do not split into {opt_steps} optimizer steps of whole "
                 f"micro-batches of {base.train.micro_batch_size} on each of {world} rank(s); pick another --prompts")
        cfg = load_config(args.config, [*shape, f"rollout.prompts_per_step={args.prompts}",
                                        f"train.mini_batch_size={samples // opt_steps}", "train.probe=false",
                                        "train.device=auto", *args.set])
    except UserError as e:  # ConfigError included
        fail(str(e))
    d = distributed.init(cfg)
    if args.memory and d.device.type != "cuda":
        fail("--memory: the allocator history is CUDA's; run on a GPU, or leave --memory out")
    say = print if d.main else (lambda *a, **k: None)
    log = argparse.Namespace(print=say)  # the RunLogger methods the phases call
    torch.manual_seed(cfg.train.seed)
    mixed = d.device.type == "cuda" and cfg.model.dtype == "float32"
    model, tokenizer = load_model_and_tokenizer(cfg.model, d.device)
    engine = None
    if args.engine:  # before the FP8 conversion, as train_grpo.py builds it; asleep from here on
        from engines import make_engine
        try:  # model_dir None: the engine writes a tiny model's config dir itself
            engine = make_engine(cfg, model, tokenizer, d.device, None)
        except UserError as e:
            fail(f"--engine: {e}")
        engine.sleep()
    dims = memory.model_shape(model)  # before FSDP2 shards the parameters
    fp8_tokens = run_setup.prepare_trainer(model, None, cfg, d, mixed, log)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    run = trainer.Run(cfg=cfg, d=d, run_dir=Path(args.out), logger=log, model=model, ref_model=None,
                      tokenizer=tokenizer, engine=engine, model_dir="", calibrator=None, optimizer=optimizer,
                      weight_change=WeightChange(optimizer, model),
                      scheduler=run_setup.lr_schedule(optimizer, cfg.optim.warmup_steps), sampler=None,
                      train_set=[], val_set=[], fp8_tokens=fp8_tokens, mixed=mixed)
    run_setup.hook_weight_caches(run)  # run_setup.first_refit's part that concerns the trainer
    state = trainer.State()
    rows = []
    say(f"[trainer_phase] {args.prompts} prompts x {cfg.rollout.n} samples over {d.world} rank(s), "
        f"mini-batch {cfg.train.mini_batch_size}, micro-batch {cfg.train.micro_batch_size}"
        f"{', engine asleep' if engine else ''}", flush=True)
    for step in range(args.steps):
        groups = synthetic_round(cfg, args.prompts // d.world, args.prompt, len(tokenizer),
                                 cfg.train.seed + 1000 * step + d.rank)
        metrics = {}
        last = step == args.steps - 1
        prof = start_profile(d.device) if args.profile and last else None
        watch = args.memory and last  # (off CUDA --memory is refused above)
        if watch:
            torch.cuda.reset_peak_memory_stats(d.device)
            before = torch.cuda.memory_allocated(d.device)
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
        distributed.memory_metrics(d.device)
        gc_timer().take()
        t0 = time.perf_counter()
        b = trainer.assemble_batch(run, [groups], metrics)
        trainer.old_logprob_phase(run, b, step, metrics)
        trainer.train_phase(run, state, b, step, metrics)
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        wall = time.perf_counter() - t0
        if watch:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        if prof is not None:
            say(f"[trainer_phase] profile: {save_profile(prof, Path(args.out) / 'profile', step, d.rank, d.device)}")
        micro, scored = metrics["perf/micro_batches"], metrics.get("perf/logprob_micro_batches", 0)
        row = {"step": step, "timed": step > 0, "samples_per_rank": len(b.samples),
               "response_mean": float(b.mask.sum(1).float().mean()), "micro_batches": micro,
               "logprob_micro_batches": scored,  # the first mini-batch's old_logp come from its training forward
               "logprobs_s": round(metrics["time/logprobs"], 3), "train_s": round(metrics["time/train"], 3),
               "logprobs_s_per_micro_batch": round(metrics["time/logprobs"] / max(scored, 1), 4),
               "train_s_per_micro_batch": round(metrics["time/train"] / micro, 4), "wall_s": round(wall, 3),
               "compiled_graphs": distributed.compiled_graphs(d),  # all ranks': grown in a timed step = compiling
               **{k: round(v, 3) for k, v in gc_timer().take().items()},
               **{k: round(v, 2) for k, v in distributed.memory_metrics(d.device).items()}}
        say(f"[trainer_phase] step {step}: logprobs {row['logprobs_s']:.2f} s, train {row['train_s']:.2f} s "
            f"({scored} / {micro} micro-batches: {row['logprobs_s_per_micro_batch']:.3f} / "
            f"{row['train_s_per_micro_batch']:.3f} s each), {row['compiled_graphs']} graphs compiled so far "
            "over the ranks", flush=True)
        rows.append(row)
        if watch:
            index = torch.cuda.current_device() if d.device.index is None else d.device.index
            mine = memory_breakdown.breakdown(snapshot, index, before, str(ROOT))
            del snapshot
            stats = torch.cuda.memory_stats(d.device)
            model_gib = memory.estimate(dims, cfg, d.world, torch.cuda.mem_get_info(d.device)[1] / memory.GIB)
            mine.update(rank=d.rank, device_peak_gib=row.get("mem/peak_gib"),
                        torch_reserved_peak_gib=round(stats["reserved_bytes.all.peak"] / memory.GIB, 3),
                        torch_allocated_peak_gib=round(stats["allocated_bytes.all.peak"] / memory.GIB, 3),
                        model=dataclasses.asdict(model_gib), model_trainer_peak_gib=round(model_gib.trainer_peak, 3))
            say(f"[trainer_phase] memory, rank 0: device peak {mine['device_peak_gib']} GiB, torch reserved peak "
                f"{mine['torch_reserved_peak_gib']}, model {mine['model_trainer_peak_gib']}; "
                + memory_breakdown.describe(mine), flush=True)
            ranks = distributed.all_gather_object(mine, d)
            if d.main:
                (Path(args.out) / "trainer_phase_memory.json").write_text(json.dumps(ranks, indent=1) + "\n")
        if step == 0:  # as train_grpo.py after its first step: later full collections skip the heap so far
            freeze_gc_heap()
    if d.main:
        workload = (f"{Path(args.config).name}{' ' + args.shape if args.shape else ''}, {args.prompts} prompts x "
                    f"{cfg.rollout.n} samples, response lengths log-normal ({MEDIAN}, {SIGMA}) cut at "
                    f"{cfg.rollout.max_new_tokens}, {d.world} rank(s){', engine asleep' if engine else ''}")
        path = write_results("trainer_phase", [{"workload": workload, "mode": "as configured", **r} for r in rows],
                             Path(args.out), overrides=args.set)
        say(f"wrote {path}")
    distributed.close(d)


if __name__ == "__main__":
    main()
