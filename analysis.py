"""Mismatch and FP8-sensitivity analysis: the engine behind notebooks/ (tests/e2e/test_notebooks.py).

    python train_grpo.py --config configs/llama31_8b_fp8.yaml log.save_batch_every=50   # GPU: save batches
    mkdir -p runs/notebooks && BATCH_PATH=runs/<run>/batches/step_000050.pt FIG_DIR=figs \
        jupyter execute notebooks/mismatch_analysis.ipynb --output="$PWD/runs/notebooks/mismatch_analysis"

A *rollout batch* is one step's whole batch as the trainer saw it, written by the trainer
(log.save_batch_every) to <run_dir>/batches/step_NNNNNN.pt with observe.save_rollout_batch. Rows are
right-padded prompt+response sequences (batch.collate); the logprob of token t sits at
position t. Fields (CPU tensors, float32 unless stated):

    input_ids       long [B, L]   prompt + response token ids
    attention_mask  long [B, L]   1 on real tokens
    mask            [B, L]        1 on response tokens (the ones the loss counts)
    rollout_logp    [B, L]        engine logprobs (vLLM / HFEngine; FP8 if fp8.rollout)
    old_logp        [B, L]        trainer logprobs of the weights that sampled (FP8 linears if fp8.train): the
                                  loss's old_logp, or under train.old_logp=rollout (whose loss takes the
                                  engine's) a pass made for the save
    bf16_logp       [B, L]        trainer logprobs, same weights, every linear unquantized
                                  (fp8.linear.bf16_reference): old - bf16 is the trainer's FP8 error
    rewards [B], advantages [B], step (int), config (the run's config dict), prompt_ids and
    response_ids (list[list[int]]), token_text ({id: decoded text} for every id in the batch,
    so tokens decode without the tokenizer), tokenizer_dir (str), run_dir (str)

About B*L*40 bytes: a 512 x 4096 batch is ~80 MB. Under torchrun, rank 0 saves its own rows.

Log ratios are d = a - b between two of the three logprob tensors; "trainer vs engine" is
d = old_logp - rollout_logp, the log of the importance weight w the loss corrects with. All
mismatch numbers come from losses/mismatch.py and all IS weights from losses/grpo.py, so what
the notebooks show is what the trainer logs and optimizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import torch
import yaml
from torch import Tensor

from batch import logprob_pass
from checkpoint import is_checkpoint, latest_checkpoint, load_checkpoint
from config import load_config, to_dict
from engines.hf import fp8_attention
from fp8.calibrate import QKVCalibrator, scales_from_amax
from fp8.linear import bf16_reference, is_fp8_linear
from fp8.plan import clean_name
from fp8.quant import FP8_MAX, fake_quant_per_tensor
from losses.grpo import IS_CORRECTIONS, LossConfig, grpo_loss, is_weights
from losses.mismatch import masked_mean, mismatch_metrics
from observe import load_rollout_batch

ROOT = Path(__file__).resolve().parent
PAIRS = {  # name -> (a, b): d = a - b
    "trainer vs engine": ("old_logp", "rollout_logp"),
    "trainer BF16 vs engine": ("bf16_logp", "rollout_logp"),
    "trainer FP8 vs trainer BF16": ("old_logp", "bf16_logp"),
}


# ----------------------------------------------------------------------------- batches on disk
# written by the trainer (trainer.save_batch -> observe.save_step_batch), read by observe.load_rollout_batch

def make_rollout_batch(out_dir, steps: int = 12, overrides=(), config=ROOT / "configs" / "tiny_cpu.yaml",
                       quiet: bool = True, threads: int | None = 1, name: str | None = None) -> Path:
    """Train the tiny CPU model for `steps` steps in a new run dir under out_dir (`name`, default
    batch-<random>); return the batch path of the last step.

    Batches are saved at step 0 and at the last step; the one checkpoint is written after steps - 1
    updates, i.e. the exact weights that sampled the last batch (load_batch_model finds it).
    Validation, TensorBoard, episode dumps and the end-of-run checkpoint are off; `overrides`
    ("key.sub=value") win. The run is train_grpo.py in a child process.
    threads: its torch intra-op threads (OMP_NUM_THREADS; None = torch's default). The tiny model's GEMMs
    are too small to gain from threads, and on a busy 2-core machine 2 threads spin-waiting
    for each other made 12 steps take 300 s instead of 20 s.
    """
    if steps < 2:
        raise ValueError(f"steps={steps}: need >= 2 (the last batch's checkpoint is written after steps - 1)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = out_dir / (name or f"batch-{uuid.uuid4().hex[:8]}")  # train_grpo creates it (never one that exists)
    argv = ["--config", str(config), f"train.out_dir={out_dir}", f"train.run_name={run_dir.name}",
            f"train.steps={steps}", f"log.save_batch_every={steps - 1}", f"train.ckpt_every={steps - 1}",
            "train.save_final=false", "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0",
            *overrides]
    env = {**os.environ, **({} if threads is None else {"OMP_NUM_THREADS": str(threads)})}
    p = subprocess.run([sys.executable, str(ROOT / "train_grpo.py"), *argv], env=env, text=True,
                       capture_output=quiet)
    if p.returncode != 0:  # bad input exits 2 with its one-line message in the output
        out = (p.stdout or "") + (p.stderr or "")
        raise RuntimeError(f"train_grpo.py {argv} failed (exit {p.returncode}); output:\n{out[-3000:]}")
    path = run_dir / "batches" / f"step_{steps - 1:06d}.pt"
    if not path.is_file():
        raise RuntimeError(f"no batch at {path} (overrides changed log.save_batch_every?)")
    return path


SCRATCH = "scratch.json"  # in a scratch run's dir, once it is complete: the settings it was made with


def scratch_rollout_batch(out_dir, steps: int = 30, overrides=(), config=ROOT / "configs" / "tiny_cpu.yaml") -> Path:
    """The notebooks' tiny run (make_rollout_batch), kept under out_dir and reused: a later call with the
    same settings (the resolved config and steps) returns its batch without training again, one with other
    settings replaces it. So executing the notebooks, one after the other or again, leaves one run behind
    (scratch-<hash of the settings>), not one per execution; delete it to make a fresh one."""
    out_dir = Path(out_dir)
    resolved = to_dict(load_config(config, list(overrides)))
    settings = {"config": str(config), "overrides": list(overrides), "steps": steps}
    key = hashlib.sha256(json.dumps([resolved, steps], sort_keys=True, default=str).encode()).hexdigest()[:12]
    run_dir = out_dir / f"scratch-{key}"
    path = run_dir / "batches" / f"step_{steps - 1:06d}.pt"
    if (run_dir / SCRATCH).is_file() and path.is_file():
        return path
    for old in out_dir.glob("scratch-*"):  # other settings' run, or one cut short
        if re.fullmatch(r"scratch-[0-9a-f]{12}", old.name) and old.is_dir():
            shutil.rmtree(old)
    path = make_rollout_batch(out_dir, steps, overrides, config, name=run_dir.name)
    (run_dir / SCRATCH).write_text(json.dumps(settings, indent=1) + "\n")
    return path


def find_batches(run_dir) -> list[Path]:
    """Every saved batch of a run, in step order."""
    return sorted(Path(run_dir).glob("batches/step_*.pt"))


def save_figure(fig, path) -> Path:
    """A notebook figure as PNG at `path`, laid out first (tight_layout: panels side by side otherwise put
    one's y label, beside wide tick labels such as -0.00075, over its neighbour), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------- mismatch

def response_aligned(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move each row's masked tokens to the left: x [B, L] -> ([B, R], mask [B, R]), R = max
    tokens per row; column k holds the row's k-th response token (0 and mask 0 past its end)."""
    m = mask != 0                                                  # [B, L]
    pos = m.long().cumsum(1) - 1                                   # [B, L] response index
    R = int(m.sum(1).max()) if m.any() else 0
    out = torch.zeros(x.shape[0], R, dtype=x.dtype)
    out_mask = torch.zeros(x.shape[0], R)
    rows = torch.arange(x.shape[0])[:, None].expand_as(m)
    out[rows[m], pos[m]] = x[m]
    out_mask[rows[m], pos[m]] = 1.0
    return out, out_mask


def mismatch_table(batch: dict, pairs: dict = PAIRS) -> dict[str, dict[str, float]]:
    """{pair name: losses.mismatch.mismatch_metrics(batch[a], batch[b], mask)} for each (a, b)."""
    return {name: mismatch_metrics(batch[a], batch[b], batch["mask"]) for name, (a, b) in pairs.items()}


def per_position_mismatch(batch: dict, a: str = "old_logp", b: str = "rollout_logp",
                          bin_size: int = 1) -> dict[str, list]:
    """Mismatch by response position: {"position": first position of each bin, "n_tokens", and
    every mismatch_metrics key: list per bin}. Bins of bin_size positions (long responses)."""
    da, m = response_aligned(batch[a].float(), batch["mask"])      # [B, R]
    db, _ = response_aligned(batch[b].float(), batch["mask"])      # [B, R]
    out: dict[str, list] = {"position": [], "n_tokens": []}
    for start in range(0, da.shape[1], bin_size):
        cols = slice(start, start + bin_size)
        n = int(m[:, cols].sum())
        if n == 0:
            continue
        out["position"].append(start)
        out["n_tokens"].append(n)
        for k, v in mismatch_metrics(da[:, cols], db[:, cols], m[:, cols]).items():
            out.setdefault(k, []).append(v)
    return out


def per_step_mismatch(batches, a: str = "old_logp", b: str = "rollout_logp") -> dict[str, list]:
    """{"step": [...], metric: [...]} from saved batches (dicts or paths), in the given order."""
    out: dict[str, list] = {"step": []}
    for batch in batches:
        batch = load_rollout_batch(batch) if isinstance(batch, (str, Path)) else batch
        out["step"].append(batch["step"])
        for k, v in mismatch_metrics(batch[a], batch[b], batch["mask"]).items():
            out.setdefault(k, []).append(v)
    return out


def run_metric_curves(run_dir, prefix: str = "mismatch/") -> dict[str, list]:
    """Every step's logged metrics starting with `prefix` from <run_dir>/metrics.jsonl:
    {"step": [...], name without prefix: [...]} (steps that lack the metrics are skipped)."""
    out: dict[str, list] = {"step": []}
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    rows = [r for r in rows if any(k.startswith(prefix) for k in r)]
    keys = sorted({k for r in rows for k in r if k.startswith(prefix)})
    for r in rows:
        out["step"].append(r["step"])
        for k in keys:
            out.setdefault(k[len(prefix):], []).append(r.get(k, math.nan))
    return out


def log_ratios(batch: dict, a: str = "old_logp", b: str = "rollout_logp") -> Tensor:
    """d = a - b on the masked tokens whose d is finite, flattened [N] (row-major order)."""
    d = batch[a].float() - batch[b].float()                        # [B, L]
    keep = (batch["mask"] != 0) & torch.isfinite(d)                # [B, L]
    return d[keep]


def log_ratio_hist(batch: dict, a: str = "old_logp", b: str = "rollout_logp", bins: int = 60,
                   lim: float | None = None) -> dict:
    """Histogram of d = a - b: {"counts" [bins], "edges" [bins + 1], "values" [N]}, symmetric
    range +-lim (default: max |d|, at least 1e-6)."""
    d = log_ratios(batch, a, b)
    lim = lim if lim is not None else max(float(d.abs().max()) if d.numel() else 0.0, 1e-6)
    counts, edges = torch.histogram(d.double(), bins=bins, range=(-lim, lim))
    return {"counts": counts.long(), "edges": edges, "values": d}


def decode(batch: dict, ids) -> str:
    """Join token_text of ids (the batch's own decoding table; '?' for unknown ids)."""
    table = batch.get("token_text") or {}
    return "".join(table.get(int(i), "?") for i in ids)


def worst_tokens(batch: dict, k: int = 10, a: str = "old_logp", b: str = "rollout_logp",
                 context: int = 8, unique: bool = True) -> list[dict]:
    """The k response tokens with the largest |d|, d = a - b (non-finite d first; ties in
    row-major order), as dicts: row, position (index in the response), token_id, token,
    context (the `context` tokens before it, decoded), a, b, log_ratio, reward, advantage.
    unique: skip a token whose whole prefix and id repeat an earlier hit (the n samples of one
    prompt often share their first tokens, with identical logprobs)."""
    d = batch[a].float() - batch[b].float()                        # [B, L]
    m = batch["mask"] != 0                                         # [B, L]
    key = torch.where(torch.isfinite(d), d.abs(), torch.full_like(d, math.inf))
    key = torch.where(m, key, torch.full_like(d, -1.0))            # [B, L]
    order = torch.sort(key.flatten(), descending=True, stable=True).indices[: int(m.sum())]
    L, ids = d.shape[1], batch["input_ids"]
    out, seen = [], set()
    for flat in order.tolist():
        if len(out) == k:
            break
        i, t = divmod(flat, L)
        if unique:
            prefix = tuple(ids[i, : t + 1].tolist())
            if prefix in seen:
                continue
            seen.add(prefix)
        tok = int(ids[i, t])
        out.append({
            "row": i, "position": t - int(m[i].float().argmax()), "token_id": tok, "token": decode(batch, [tok]),
            "context": decode(batch, ids[i, max(0, t - context): t].tolist()),
            "a": float(batch[a][i, t]), "b": float(batch[b][i, t]), "log_ratio": float(d[i, t]),
            "reward": float(batch["rewards"][i]), "advantage": float(batch["advantages"][i]),
        })
    return out


# ----------------------------------------------------------------------------- importance weights

def effective_sample_size(w: Tensor, mask: Tensor | None = None) -> float:
    """Normalized effective sample size of weights w over the N masked entries:
    (sum w)^2 / sum w^2 / N (Kish). 1 for uniform weights, 1/N when one weight carries
    everything, 0 when every weight is 0; in [1/N, 1] for w >= 0 with some w > 0."""
    w = w.double().flatten() if mask is None else w.double()[mask != 0]
    if w.numel() == 0:
        return 0.0
    sq = float((w * w).sum())
    return 0.0 if sq == 0 else float(w.sum()) ** 2 / sq / w.numel()


def loss_config(batch: dict, **changes) -> LossConfig:
    """The batch's run's LossConfig (defaults if the config lacks a loss section), with changes."""
    fields = {k: v for k, v in (batch.get("config") or {}).get("loss", {}).items()
              if k in LossConfig.__dataclass_fields__}
    return LossConfig(**{**fields, **changes})


def is_weights_by_variant(batch: dict, variants=IS_CORRECTIONS, a: str = "old_logp", b: str = "rollout_logp",
                          **changes) -> dict[str, dict]:
    """What each loss.is_correction of losses/grpo.py does to this batch, with the run's is_cap /
    is_floor unless given in `changes`: {variant: {"weights" [N] (masked tokens, row-major),
    "weights_2d" [B, L], "truncated_frac", "zeroed_frac", "weight_mean", "ess"}}."""
    m = batch["mask"] != 0
    out = {}
    for kind in variants:
        cfg = loss_config(batch, is_correction=kind, **changes)
        w, truncated, _ = is_weights(batch[a].float(), batch[b].float(), m, cfg)  # [B, L] x3
        out[kind] = {"weights": w[m], "weights_2d": w * m,
                     "truncated_frac": float(masked_mean(truncated.float(), m)),
                     "zeroed_frac": float(masked_mean((w == 0).float(), m)),
                     "weight_mean": float(masked_mean(w, m)), "ess": effective_sample_size(w, m)}
    return out


def is_cap_sweep(batch: dict, caps, variant: str = "tis", a: str = "old_logp", b: str = "rollout_logp",
                 is_floor: float | None = None) -> dict[str, list]:
    """{"cap", "truncated_frac", "ess", "weight_mean"} per cap for one IS variant (floor: the run's,
    lowered to the cap where it would exceed it). Truncated = the cap/floor/mask changed the weight."""
    out: dict[str, list] = {"cap": [], "truncated_frac": [], "ess": [], "weight_mean": []}
    floor = loss_config(batch).is_floor if is_floor is None else is_floor
    for cap in caps:
        r = is_weights_by_variant(batch, (variant,), a, b, is_cap=float(cap), is_floor=min(floor, float(cap)))[variant]
        out["cap"].append(float(cap))
        for k in ("truncated_frac", "ess", "weight_mean"):
            out[k].append(r[k])
    return out


def bypass_clip(batch: dict, **changes) -> dict[str, float]:
    """What train.old_logp=rollout would do to this batch's first update. The PPO ratio is then
    exp(logp - rollout_logp), at the first update exp(old_logp - rollout_logp): the clip acts on the
    trainer/engine mismatch alone (with the trainer's old_logp that ratio is 1 and nothing is clipped).
    With the run's clip_low / clip_high unless given in `changes`, over the response tokens:
    {"clip_frac": the share whose gradient the clip removes, as the loss logs loss/clip_frac (above
    1 + clip_high where the advantage is positive, below 1 - clip_low where it is negative),
    "outside_frac": the share whose ratio lies outside [1 - clip_low, 1 + clip_high] at all}."""
    cfg = loss_config(batch, kl_coef=0.0, **changes)
    old, rollout, m = batch["old_logp"].float(), batch["rollout_logp"].float(), batch["mask"]
    _, metrics = grpo_loss(old, rollout, rollout, batch["advantages"].float(), m, cfg)
    r = (old - rollout).exp()[m != 0]
    outside = (r < 1 - cfg.clip_low) | (r > 1 + cfg.clip_high)
    return {"clip_frac": metrics["loss/clip_frac"], "outside_frac": float(outside.float().mean()) if r.numel() else 0.0}


# ----------------------------------------------------------------------------- FP8 sensitivity

def batch_config(batch: dict):
    """The run's Config object from the batch's config dict (validated like a YAML config)."""
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "config.yaml"
        p.write_text(yaml.safe_dump(batch["config"], sort_keys=False))
        return load_config(p)


def load_batch_model(batch: dict, device="cpu", checkpoint=None):
    """(model, tokenizer, cfg): the run's model with the weights that sampled the batch.

    Weights: `checkpoint` (a checkpoints/step_N dir) if given, else <run_dir>/checkpoints/
    step_{batch step} (the state after `step` updates = the batch's behaviour weights), else
    the latest checkpoint there (then "exact" is False), else none (initial weights of a tiny
    model / the hub weights). The model is plain: no FP8 linears until convert_fp8(model, cfg).
    Returns model.eval() with model.batch_weights = {"checkpoint": path or None, "exact": bool}.
    """
    from modeling import load_model_and_tokenizer  # transformers: imported when needed

    cfg = batch_config(batch)
    torch.manual_seed(cfg.train.seed)  # a tiny model without checkpoint: the run's initial weights
    model, tokenizer = load_model_and_tokenizer(cfg.model, torch.device(device))
    root = Path(batch.get("run_dir") or ".") / "checkpoints"
    exact = root / f"step_{batch['step']:06d}"
    ckpt = Path(checkpoint) if checkpoint else exact if is_checkpoint(exact) else latest_checkpoint(root)
    if ckpt is not None:
        model.load_state_dict(load_checkpoint(ckpt, optimizer=False)["model"])
    model.batch_weights = {"checkpoint": None if ckpt is None else str(ckpt),
                           "exact": ckpt == exact if ckpt is not None else batch["step"] == 0}
    return model.eval().requires_grad_(False), tokenizer, cfg


def convert_fp8(model, cfg) -> list[str]:
    """Emulated block-FP8 linears on the run's skip list (fp8.keep_bf16, ...), with fp8/fast's structure
    where the run had it (run_setup.prepare_trainer); their HF names. Inside fp8.linear.bf16_reference(model)
    the converted model computes exactly as before."""
    from run_setup import fp8_model

    return fp8_model(model, dataclasses.replace(cfg.fp8, emulate=True))[0]


def batch_logprobs(model, batch: dict, rows=None, micro_batch: int = 64) -> Tensor:
    """Trainer logprobs [B, L] of the batch's tokens on the CPU (batch.logprob_pass, the run's temperature)."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    if rows is not None:
        ids, am = ids[rows], am[rows]
    return logprob_pass(model, ids, am, batch["config"]["rollout"]["temperature"], micro_batch,
                        device=next(model.parameters()).device).cpu()


@contextlib.contextmanager
def fp8_only(model, names):
    """Inside: only the FP8 linears whose HF name is in `names` quantize; the rest run BF16."""
    names = set(names)
    with bf16_reference(model):
        for raw, m in model.named_modules():
            if is_fp8_linear(m) and clean_name(raw) in names:
                m.fp8_enabled = True
        yield model


def fp8_units(model, unit: str = "linear") -> dict[str, list[str]]:
    """{label: [FP8 linear names]}: unit "linear" (one each), "layer" (a decoder layer's linears,
    label 'layers.i'), "kind" (one projection across layers, e.g. 'q_proj'), or an fnmatch
    pattern per label when unit is a dict {label: pattern}."""
    names = [clean_name(n) for n, m in model.named_modules() if is_fp8_linear(m)]
    if not names:
        raise ValueError("the model has no FP8 linears: call analysis.convert_fp8(model, cfg) first")
    if isinstance(unit, dict):
        return {label: [n for n in names if fnmatch.fnmatchcase(n, pat)] for label, pat in unit.items()}
    groups: dict[str, list[str]] = {}
    for n in names:
        if unit == "linear":
            label = n
        elif unit == "layer":
            parts = n.split(".")
            label = ".".join(parts[parts.index("layers"): parts.index("layers") + 2]) if "layers" in parts else n
        elif unit == "kind":
            label = n.rsplit(".", 1)[-1]
        else:
            raise ValueError(f"unit={unit!r}: expected 'linear', 'layer', 'kind' or a {{label: pattern}} dict")
        groups.setdefault(label, []).append(n)
    return groups


def fp8_sensitivity(model, batch: dict, unit="linear", rows=None, micro_batch: int = 64,
                    sort_by: str = "mean_abs_diff") -> list[dict]:
    """Quantize one unit at a time (fp8_units) and measure the logprob drift against the same
    model all-BF16 on the batch's response tokens: a ranking (largest drift first) of dicts
    {"unit", "n_linears", and the mismatch_metrics of (unit FP8) vs (all BF16)}. The last row,
    unit "all", quantizes every FP8 linear (what the trainer runs) and is not ranked."""
    mask = batch["mask"] if rows is None else batch["mask"][rows]
    with bf16_reference(model):
        ref = batch_logprobs(model, batch, rows, micro_batch)      # [B, L]
    groups = fp8_units(model, unit)
    rank = []
    for label, names in groups.items():
        with fp8_only(model, names):
            lp = batch_logprobs(model, batch, rows, micro_batch)
        rank.append({"unit": label, "n_linears": len(names), **mismatch_metrics(lp, ref, mask)})
    rank.sort(key=lambda r: -r[sort_by])
    everything = batch_logprobs(model, batch, rows, micro_batch)
    n_all = sum(len(v) for v in fp8_units(model, "linear").values())
    return rank + [{"unit": "all", "n_linears": n_all, **mismatch_metrics(everything, ref, mask)}]


def kv_quant_error(model, batch: dict, percentiles=(50.0, 90.0, 99.0, 99.9, 100.0), margins=(1.0, 1.05, 1.25),
                   micro_batch: int = 16, calib_rows=None, eval_rows=None) -> dict[str, list[dict]]:
    """FP8 q/k/v (the engine's FP8 KV cache + attention, fp8/calibrate.py) error for each
    (calib_percentile, calib_margin), with linears in BF16 so only attention is quantized.

    As in the trainer, scales come from one batch and are used on the next: calibrate on
    calib_rows (default: the first half), evaluate on eval_rows (default: the second half).
    Each micro-batch of calib_rows is one amax record, so the percentile runs over
    ceil(len(calib_rows) / micro_batch) records. Returns
      "summary":   per setting {percentile, margin, and the mismatch_metrics of FP8-attention
                   logprobs vs BF16-attention logprobs on eval_rows}
      "per_layer": per setting, layer and tensor (q/k/v) {percentile, margin, layer, tensor,
                   scale, rel_rmse = ||fq(x) - x|| / ||x||, saturated_frac = P(|x| / scale > 448)}
    """
    B = batch["input_ids"].shape[0]
    calib_rows = list(range(B // 2)) if calib_rows is None else list(calib_rows)
    eval_rows = list(range(B // 2, B)) if eval_rows is None else list(eval_rows)
    summary, per_layer = [], []
    with bf16_reference(model):
        calib = QKVCalibrator(model)
        with calib.capture():
            batch_logprobs(model, batch, calib_rows, micro_batch)
        amax = calib.amax()                                        # [n_records, L, 3]
        recorder = _QKVRecorder(model)
        with recorder.capture():
            ref = batch_logprobs(model, batch, eval_rows, micro_batch)  # [B_eval, L]
        mask = batch["mask"][eval_rows]
        for p in percentiles:
            for margin in margins:
                scales = scales_from_amax(amax, p, margin)
                with fp8_attention(model, scales):
                    lp = batch_logprobs(model, batch, eval_rows, micro_batch)
                summary.append({"percentile": p, "margin": margin, **mismatch_metrics(lp, ref, mask)})
                for layer, xs in sorted(recorder.values.items()):
                    for j, name in enumerate("qkv"):
                        x = torch.cat([rec[j] for rec in xs])      # [N] this layer's valid values
                        s = scales[layer][j]
                        err = fake_quant_per_tensor(x, s, reciprocal=name == "q").float() - x.float()
                        per_layer.append({
                            "percentile": p, "margin": margin, "layer": layer, "tensor": name, "scale": s,
                            "rel_rmse": float(err.norm() / x.float().norm().clamp_min(1e-30)),
                            # clipped, beyond the fp32 rounding of the scale itself
                            "saturated_frac": float((x.double().abs() / s > FP8_MAX * (1 + 1e-6)).double().mean())})
    return {"summary": summary, "per_layer": per_layer}


class _QKVRecorder(QKVCalibrator):
    """A QKVCalibrator that also keeps the q/k/v values it sees (real tokens only, flattened,
    on CPU): the error analysis needs the values, not only their amax."""

    def __init__(self, model):
        super().__init__(model)
        self.values: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {i: [] for i in self._mods}
        self._layer = {id(m._fp8_qkv): i for i, m in self._mods.items()}  # attention state -> layer index

    def _record(self, st, q, k, v):
        super()._record(st, q, k, v)
        layer = self._layer[id(st)]
        m = self._mask  # [B, T] when the model was called with a 2-D attention mask
        if m is not None and m.shape == (q.shape[0], q.shape[2]):
            keep = m.to(q.device, torch.bool)[:, None, :, None]  # [B, 1, T, 1]
            self.values[layer].append(tuple(t.detach().masked_select(keep).cpu() for t in (q, k, v)))
        else:
            self.values[layer].append(tuple(t.detach().flatten().cpu() for t in (q, k, v)))
