"""What a run leaves to look at: metrics, profiles, saved batches, episodes; and the guards.

* RunLogger: metrics.jsonl + TensorBoard in the run dir, silent off rank 0 (no `if rank == 0` in
  the loop).
* Profiling: torch.profiler around one step (log.profile_step) with the device-busy share of each
  phase, and the Python garbage collector's pauses (time/gc).
* Rollout batches (log.save_batch_every): one step's whole batch as the trainer saw it, for
  notebooks/ through analysis.py (whose docstring lists the fields and shapes).
* Episodes (log.dump_episodes_every): a few samples per step as JSONL, to read what the model writes.
* mismatch_guard: warn (train.mismatch_warn) or stop (train.mismatch_stop) on a step whose
  rollout/trainer token_mult_prob_error is too high; update_guard: the same (optim.update_ratio_warn,
  optim.update_ratio_stop) for a step that moved a weight far beyond Adam's ~lr bound.
"""

import bisect
import functools
import gc
import json
import re
import time
from pathlib import Path

import torch
from torch import Tensor

import distributed
from batch import StepBatch
from checkpoint import atomic_write
from errors import UserError

BATCH_FORMAT = "fp8-grpo/rollout-batch/v1"
TENSOR_FIELDS = ("input_ids", "attention_mask", "mask", "rollout_logp", "old_logp", "bf16_logp",
                 "rewards", "advantages")


# ----------------------------------------------------------------------------- metrics

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


def _guard(value: float, shown: str, step: int, warn: tuple[str, float], stop: tuple[str, float], why: str,
           fix: str, logger) -> None:
    """Print a warning when value > warn's bound; raise UserError when value > stop's bound (0 = never).
    shown: 'metric=value' as printed; warn, stop: (config key, bound)."""
    if value > warn[1]:
        logger.print(f"WARNING step {step}: {shown} > {warn[0]}={warn[1]}: {why}")
    if stop[1] and value > stop[1]:
        raise UserError(f"step {step}: {shown} > {stop[0]}={stop[1]}: {why}; {fix}, or raise {stop[0]} "
                        "(0 = never stop)")


def mismatch_guard(metrics: dict, step: int, cfg, logger: RunLogger) -> None:
    """cfg: TrainConfig. Warn when mismatch/token_mult_prob_error exceeds train.mismatch_warn; raise
    UserError when it exceeds train.mismatch_stop (0 = never). trainer.train_phase calls it once the first
    mini-batch's forward has measured it, before any optimizer step; not measured: nothing to do."""
    if "mismatch/token_mult_prob_error" not in metrics:
        return
    mult_err = metrics["mismatch/token_mult_prob_error"]
    _guard(mult_err, f"mismatch/token_mult_prob_error={mult_err:.4f}", step, ("train.mismatch_warn", cfg.mismatch_warn),
           ("train.mismatch_stop", cfg.mismatch_stop), "rollout and trainer disagree",
           "check the weight sync and the fp8.* settings of both sides", logger)


def update_guard(ratio: float, name: str, step: int, cfg, logger) -> None:
    """cfg: OptimConfig. Warn when the step moved a weight (tensor `name`) by more than
    optim.update_ratio_warn x lr, raise UserError above optim.update_ratio_stop (0 = never): Adam moves a
    weight by at most ~lr per step (optimizer.py)."""
    _guard(ratio, f"optim/update_ratio_max={ratio:.3g} ({name})", step,
           ("optim.update_ratio_warn", cfg.update_ratio_warn), ("optim.update_ratio_stop", cfg.update_ratio_stop),
           "an update far beyond Adam's ~lr bound", "with optim.name=adamw8bit use adamw8bit_rms (optimizer.py)",
           logger)


# ----------------------------------------------------------------------------- profiling

def start_profile(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []),
                   record_shapes=True)
    prof.start()
    return prof


PHASES = ("rollout", "logprobs", "train", "recalibrate", "refit")  # the step's record_function spans


def phase_busy(spans: dict[str, list[tuple[int, int]]], device_intervals: list[tuple[int, int]]) -> dict:
    """{phase: (wall_s, device_busy_s)}: each phase's summed span time and the time inside its spans
    during which the device ran something (union of kernel/copy intervals, ns). busy/wall well under 1
    means the host, not the GPU, set the phase's pace (launch overhead, syncs, Python)."""
    merged: list[list[int]] = []
    for a, b in sorted(device_intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [a for a, _ in merged]
    out = {}
    for name, ranges in spans.items():
        busy = 0
        for s, e in ranges:
            i = max(bisect.bisect_right(starts, s) - 1, 0)
            while i < len(merged) and merged[i][0] < e:
                busy += max(0, min(e, merged[i][1]) - max(s, merged[i][0]))
                i += 1
        out[name] = (sum(e - s for s, e in ranges) / 1e9, busy / 1e9)
    return out


KERNEL_KINDS = (  # a trainer's kernels: (kind, pattern on the name), the first match wins; the rest "elementwise"
    ("optimizer", r"adam|multi_tensor_apply"),  # a compiled optimizer's kernels: by its span (profile_phases)
    ("attention", r"flash|fmha|attention|attn"),  # before gemm: flash kernels' templates name cutlass
    ("gemm", r"gemm|nvjet|xmma|cublas|cutlass|gemv|wgmma|triton_tem|scaled_mm|splitk"),
    ("quant", r"quant|amax|e4m3|fp8"),
    ("norm", r"rsqrt|norm|pow_sum"),  # inductor's RMSNorm: forward ..._mean_mul_pow_rsqrt, backward ..._mul_pow_sum
    ("softmax", r"softmax|logsumexp"),
    # casts and layout only: eager copies, and inductor kernels whose every fused op is one (most name _to_copy)
    ("copy", r"memcpy|memset|fill|direct_copy|copy_kernel|catarray|^triton_(poi|red|per)_fused"
             r"(_+(to|copy|clone|cat|t|view|unsafe|split|with|sizes|permute|transpose|expand|slice|squeeze|unsqueeze"
             r"|select|as|strided))+_\d+$"),
    ("comm", r"nccl"),
)


def kernel_kind(name: str, table=KERNEL_KINDS, default: str = "elementwise") -> str:
    """The first kind of table ((kind, regex), ...) whose pattern occurs in a device kernel's name (any case)."""
    return next((kind for kind, pattern in table if re.search(pattern, name, re.I)), default)


def profile_phases(prof, top: int = 30, top_phase: int = 15) -> str:
    """phase_busy of a stopped torch.profiler profile, as a table (empty without phase spans), then the
    `top` device kernels by summed time, then for each phase its kernels' time by kind (kernel_kind; kind
    "optimizer": launched inside an optimizer's step) and its `top_phase` kernels. A kernel belongs where
    the operator that launched it started on the host (the trace's link from kernel to operator), or where
    it started itself if the trace links it to none. Read straight from the trace's events, in seconds
    where key_averages takes minutes for a long step."""
    spans: dict[str, list[tuple[int, int]]] = {}
    optimizer: list[tuple[int, int]] = []  # the optimizer steps' spans
    ops: dict[int, int] = {}  # host operator's correlation id -> its start
    device = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == torch.autograd.DeviceType.CPU:
            if ev.name() in PHASES:
                spans.setdefault(ev.name(), []).append((ev.start_ns(), ev.end_ns()))
            elif ev.name().startswith(OPTIMIZER_SPAN):
                optimizer.append((ev.start_ns(), ev.end_ns()))
            if ev.linked_correlation_id() == 0:
                ops[ev.correlation_id()] = ev.start_ns()
        elif not ev.is_user_annotation() and ev.name() not in PHASES:  # kernels, memcpy, memset
            device.append((ev.linked_correlation_id(), ev.start_ns(), ev.end_ns(), ev.name()))
    linked = sum(op > 0 and op in ops for op, *_ in device)
    device = [(ops.get(op, start) if op > 0 else start, start, end, name) for op, start, end, name in device]
    kernels, by_phase, kinds = kernels_by_phase(spans, device, optimizer)
    rows = [f"{'phase':<12} {'wall_s':>8} {'device_busy_s':>14} {'busy':>6}"]
    for name, (wall, busy) in phase_busy(spans, [(s, e) for _, s, e, _ in device]).items():
        rows.append(f"{name:<12} {wall:8.3f} {busy:14.3f} {busy / max(wall, 1e-12):6.1%}")
    if device:
        rows.append(f"kernels placed by their launching operator: {linked} of {len(device)}")
    per_phase = "".join(f"phase {name}:\n" + kind_table(kinds[name]) + kernel_table(by_phase[name], top_phase)
                        for name in PHASES if name in by_phase)
    return ("\n".join(rows) + "\n\n" if spans else "") + kernel_table(kernels, top) + per_phase


OPTIMIZER_SPAN = "Optimizer.step"  # torch.optim's record_function around every step: "Optimizer.step#AdamW.step"


def kernels_by_phase(spans: dict[str, list[tuple[int, int]]], device: list[tuple[int, int, int, str]],
                     optimizer: list[tuple[int, int]] = ()) -> tuple[dict, dict, dict]:
    """Device events [(host ns it belongs at, start ns, end ns, kernel name)] -> ({name: [summed ns, calls]},
    {phase: the same for the kernels placed inside one of the phase's spans}, {phase: {kind: summed ns}}:
    kernel_kind, or "optimizer" for a kernel placed inside one of the `optimizer` spans (OPTIMIZER_SPAN))."""
    optimizer = sorted(optimizer)
    ranges = sorted((s, e, name) for name, rs in spans.items() for s, e in rs)
    starts, opt_starts = [s for s, _, _ in ranges], [s for s, _ in optimizer]
    kernels: dict[str, list[int]] = {}
    by_phase: dict[str, dict[str, list[int]]] = {}
    kinds: dict[str, dict[str, int]] = {}
    for at, s, e, name in device:
        i = bisect.bisect_right(starts, at) - 1
        phase = ranges[i][2] if i >= 0 and at < ranges[i][1] else None
        for table in [kernels] + ([by_phase.setdefault(phase, {})] if phase else []):
            k = table.setdefault(name, [0, 0])
            k[0], k[1] = k[0] + e - s, k[1] + 1
        if phase:
            j = bisect.bisect_right(opt_starts, at) - 1
            kind = "optimizer" if j >= 0 and at < optimizer[j][1] else kernel_kind(name)
            table = kinds.setdefault(phase, {})
            table[kind] = table.get(kind, 0) + e - s
    return kernels, by_phase, kinds


def kind_table(kinds: dict[str, int]) -> str:
    """{kind: summed ns} as one line per kind, by time, with each one's share."""
    total = sum(kinds.values()) or 1
    return "".join(f"  {kind:<12} {ns / 1e6:10.1f} ms {ns / total:6.1%}\n"
                   for kind, ns in sorted(kinds.items(), key=lambda kv: -kv[1])) + "\n"


def kernel_table(kernels: dict[str, list[int]], top: int) -> str:
    """{kernel name: [summed ns, calls]} as a table of the `top` by time, with each one's share of all."""
    if not kernels:
        return ""
    total = sum(ns for ns, _ in kernels.values())
    rows = [f"{'device kernel (top ' + str(top) + ')':<100} {'ms':>10} {'share':>6} {'calls':>7}"]
    for name, (ns, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        rows.append(f"{name[:100]:<100} {ns / 1e6:10.1f} {ns / total:6.1%} {n:7d}")
    return "\n".join(rows) + f"\nall device kernels: {total / 1e9:.3f} s\n\n"


def profile_stem(out_dir: Path, step: int, rank: int) -> Path:
    """out_dir/step_NNNNNN_rankR: save_profile's files are this with .txt and .json."""
    return Path(out_dir) / f"step_{step:06d}_rank{rank}"


def save_profile(prof, out_dir: Path, step: int, rank: int, device: torch.device, trace: bool = True) -> Path:
    """Stop the profiler; write (.txt) the device-busy share of each phase and the top device kernels
    (profile_phases), then with `trace` the top-40 operator table below them and the trace (.json): the
    last two take minutes for a long step's ~10^6 events, so a run cut off meanwhile still leaves the first."""
    prof.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = profile_stem(out_dir, step, rank)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    phases = profile_phases(prof)
    stem.with_suffix(".txt").write_text(phases)  # first what is quick to get, then the slow parts
    if not trace:
        return stem.with_suffix(".txt")
    stem.with_suffix(".txt").write_text(phases + prof.key_averages().table(sort_by=sort, row_limit=40))
    prof.export_chrome_trace(f"{stem}.json")
    return stem.with_suffix(".txt")


class GCTimer:
    """Seconds this process spent in Python garbage collection since the last take() (time/gc), and
    the part of them in full collections (time/gc_full, perf/gc_full: their count): a collection
    pauses the host, and the GPU with it once its queue runs dry. One per process (gc_timer()),
    registered in gc.callbacks for the process's life."""

    def __init__(self):
        self.seconds, self.full, self.full_count, self._t0 = 0.0, 0.0, 0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt, self._t0 = time.perf_counter() - self._t0, None
            self.seconds += dt
            if info["generation"] == 2:
                self.full, self.full_count = self.full + dt, self.full_count + 1

    def take(self) -> dict[str, float]:
        out = {"time/gc": self.seconds, "time/gc_full": self.full, "perf/gc_full": self.full_count}
        self.seconds, self.full, self.full_count = 0.0, 0.0, 0
        return out


@functools.cache
def gc_timer() -> GCTimer:
    return GCTimer()


FULL_GC_SPACING = 100  # generation-1 collections between automatic full collections (Python's default: 10)


def freeze_gc_heap() -> None:
    """Collect, then move every object alive now into the collector's permanent generation (gc.freeze,
    as vLLM does at its engine's start; perf/gc_frozen counts them). Called once, after the
    first step: what it built and keeps (compiled graphs and their guards, autotuning results, the
    engine's state) is most of the heap, and every full collection would walk it again at each later
    step (time/gc: 1.5-2 s a step at 8B before). Objects freed by refcount are still freed; only cycles
    among frozen objects that die later stay uncollected.

    Then a full collection waits for FULL_GC_SPACING young (generation-1) collections instead of
    Python's 10. CPython also skips a full collection while fewer objects are new than a quarter of
    the last one's survivors; once the heap is frozen that count is small, and a 16-prompt 8B step
    still ran 11 full collections, 1.1-1.2 s of its 1.6-1.7 s time/gc (time/gc_full). Young cycles
    are still collected as often as before, and vLLM's sleep runs a full collection every step."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_GC_SPACING)


class StepProfile:
    """log.profile_step's profiler for one step: started before the rollout, or after it
    (log.profile_rollout=false: the trainer's phases only); finish() writes it."""

    def __init__(self, step: int, cfg, device: torch.device):
        self.on, self.step, self.device, self.trace = step == cfg.profile_step, step, device, cfg.profile_trace
        self.prof = start_profile(device) if self.on and cfg.profile_rollout else None

    def after_rollout(self) -> None:
        if self.on and self.prof is None:
            self.prof = start_profile(self.device)

    def finish(self, run_dir: Path, rank: int, logger: RunLogger) -> None:
        if self.prof is not None:
            path = save_profile(self.prof, run_dir / "profile", self.step, rank, self.device, self.trace)
            logger.print(f"profile: {path}")


# ----------------------------------------------------------------------------- batches and episodes

def save_rollout_batch(path, step, input_ids, attention_mask, mask, rollout_logp, old_logp, bf16_logp,
                       rewards, advantages, config: dict, tokenizer=None, tokenizer_dir=None) -> Path:
    """Write one step's batch (shapes in the module docstring) atomically (checkpoint.atomic_write)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t = {k: v.detach().cpu().clone() for k, v in zip(TENSOR_FIELDS, (
        input_ids, attention_mask, mask, rollout_logp, old_logp, bf16_logp, rewards, advantages))}
    resp = t["mask"] != 0
    n_real = t["attention_mask"].sum(1)
    first = torch.where(resp.any(1), resp.float().argmax(1), n_real)  # first response position
    ids = t["input_ids"].tolist()
    batch = {
        "format": BATCH_FORMAT, "step": int(step), **t, "config": config,
        "prompt_ids": [row[: int(f)] for row, f in zip(ids, first)],
        "response_ids": [[i for i, r in zip(row, m) if r] for row, m in zip(ids, resp.tolist())],
        "token_text": {} if tokenizer is None else
        {i: tokenizer.decode([i]) for i in sorted(set(t["input_ids"].flatten().tolist()))},
        "tokenizer_dir": None if tokenizer_dir is None else str(tokenizer_dir),
        "run_dir": str(path.parent.parent),
    }
    return atomic_write(path, lambda f: torch.save(batch, f))


def load_rollout_batch(path) -> dict:
    """The dict save_rollout_batch wrote; ValueError naming the path if it is not a rollout batch."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such rollout batch file")
    try:
        batch = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - anything torch cannot read safely is "not a batch"
        raise ValueError(f"{path} is not a rollout batch (torch.load failed: {str(e).splitlines()[0]})") from None
    if not isinstance(batch, dict) or batch.get("format") != BATCH_FORMAT:
        got = batch.get("format") if isinstance(batch, dict) else type(batch).__name__
        raise ValueError(f"{path} is not a rollout batch (format {got!r}, expected {BATCH_FORMAT!r}); "
                         "batches are written by train_grpo.py with log.save_batch_every=N")
    return batch


def save_step_batch(path: Path, step: int, b: StepBatch, trainer_logp: Tensor, bf16_logp: Tensor, config: dict,
                    tokenizer, tokenizer_dir, d: distributed.Dist) -> None:
    """save_rollout_batch of every rank's rows (rank 0 writes them, in rank order); trainer_logp [B, L]: this
    rank's trainer logprobs of the behaviour weights (saved as old_logp); bf16_logp [B, L]: the same weights',
    linears not quantized (trainer.bf16_logprobs). Collective."""
    rows = [distributed.gather_rows(x, d, pad=tokenizer.pad_token_id if x is b.input_ids else 0)
            for x in (b.input_ids, b.attention_mask, b.mask, b.rollout_logp, trainer_logp, bf16_logp)]
    rows += [distributed.gather_rows(x[:, None].to(d.device).float(), d)[:, 0].cpu() for x in (b.rewards, b.advantages)]
    if d.rank == 0:
        save_rollout_batch(path, step, *rows, config, tokenizer, tokenizer_dir)


def dump_episodes(run_dir: Path, step: int, b: StepBatch, tokenizer, k: int, trainer_logp: bool = True) -> None:
    """The first k samples of this rank's batch to <run_dir>/episodes/step_N.jsonl, one JSON object each.
    trainer_logp=False (train.old_logp=rollout: the batch's old_logp is the engine's): "trainer_logp" is null."""
    out = run_dir / "episodes"
    out.mkdir(exist_ok=True)
    answers = b.answers
    with open(out / f"step_{step:06d}.jsonl", "w") as f:
        for i, s in enumerate(b.samples[:k]):
            pos = b.mask[i].nonzero().squeeze(-1)
            f.write(json.dumps({
                "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=True), "completion": b.texts[i],
                "answer": answers[i], "reward": float(b.rewards[i]), "advantage": float(b.advantages[i]),
                "finish_reason": s.finish_reason, "rollout_logp": s.logprobs,
                "trainer_logp": b.old_logp[i, pos].tolist() if trainer_logp else None}) + "\n")
