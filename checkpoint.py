"""Atomic checkpoints: write into a temp dir, fsync, rename; keep the last K.

A checkpoint is a directory `step_000123/` holding `state.pt` (model, optimizer, scheduler,
RNG states, data position, step, fp8 kv scales). It appears under its final name only by an
atomic rename of a complete, fsynced temp dir, so a crash (even SIGKILL or power loss) mid-save
leaves at most a `.tmp-*` dir, which `latest_checkpoint` ignores and the next save removes.

The run directory around them (create_run_dir, resume_config, ...) lives here too.

Fault injection (tests/test_resume.py): with GRPO_CKPT_FAULT=<step> in the environment, the
save of that step writes half of state.pt into its temp dir and SIGKILLs its own process.
"""

import json
import os
import random
import re
import shutil
import signal
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from config import UserError, load_config, to_dict

_STEP_DIR = re.compile(r"step_(\d+)")


def rng_state() -> dict:
    """The global RNGs of this process. Under torchrun only rank 0 saves (its own), and on resume every
    rank restores that one: like a fresh run, where every rank seeds train.seed. So a checkpoint resumes
    on any world size; the loop's randomness that matters (prompt order, rollout sampling, mini-batch
    shuffles) comes from explicit seeds, not from these."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # only the devices this process sees: a checkpoint written on 8 GPUs may resume on fewer
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation inside `path` durable (POSIX: the entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root as (step, dir), oldest first (numeric order, any width)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted((s, p) for s, p in found if (p / "state.pt").is_file())


def save_checkpoint(root: str | Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write `state` as root/step_{step:06d}/state.pt atomically; delete all but the newest `keep`
    (keep <= 0: keep all) and any temp dir a crashed save left behind. Returns the checkpoint dir."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step:06d}", root / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        if os.environ.get("GRPO_CKPT_FAULT") == str(step):  # test hook: crash mid-save
            f.truncate(f.tell() // 2)
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step (end of a resumed run): swap, so a complete copy always exists
        old = root / f".tmp-old-step_{step:06d}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    for _, old in checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint dir under root, or None (temp dirs of crashed saves never count)."""
    done = checkpoints(root)
    return done[-1][1] if done else None


def load_checkpoint(path: str | Path) -> dict:
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------- run directories
# A run dir belongs to one run: created exclusively, its config.yaml written once and never rewritten
# (a resume's overrides go to resumes.jsonl), removed again if the run fails before it logs a step.

RESUMES = "resumes.jsonl"
FIXED_ON_RESUME = ("model.name_or_path", "model.tiny.", "model.dtype", "train.out_dir", "train.run_name")
"""Keys (or key prefixes) a resume cannot override: they fix the parameters' shapes and dtype and the
tokenizer the checkpoint holds, or where the run lives."""


def create_run_dir(out_dir: str | Path, name: str, auto: bool) -> Path:
    """Create out_dir/name with os.mkdir, which fails if it exists, so two runs never share a dir (two
    runs started in the same second get the same timestamped name). auto (a generated name): on a
    clash try name-2, name-3, ...; an explicit train.run_name that exists is an error."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i in range(1, 1000):
        run_dir = out_dir / (name if i == 1 else f"{name}-{i}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            if auto:
                continue
            if latest_checkpoint(run_dir / "checkpoints") is not None:
                raise UserError(f"train.run_name: {run_dir} holds a run already: continue it with --resume {run_dir}, "
                                "or pick another train.run_name") from None
            raise UserError(f"train.run_name: {run_dir} exists (and has no complete checkpoint, so it cannot be "
                            "resumed): pick another train.run_name, or delete that directory") from None
    raise UserError(f"train.out_dir: {out_dir} has 999 runs named {name}-*; set train.run_name")


def remove_unstarted_run(run_dir: str | Path) -> bool:
    """Delete a new run's dir if the run failed before it logged a step or saved a checkpoint: what it
    holds then (config.yaml, an empty metrics.jsonl, event files, the tiny model's config) is debris.
    Call it only for a dir this process created (never a resumed run's). Returns whether it did."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if (metrics.is_file() and metrics.stat().st_size > 0) or checkpoints(run_dir / "checkpoints"):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def _flat(cfg) -> dict:
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else out.__setitem__(prefix + k, v)

    walk(to_dict(cfg), "")
    return out


def resume_overrides(run_dir: str | Path) -> list[str]:
    """The overrides of the run's earlier resumes, in order (resumes.jsonl; a torn last line is skipped)."""
    path = Path(run_dir) / RESUMES
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out += json.loads(line)["overrides"]
        except (ValueError, KeyError, TypeError):
            pass
    return out


def resume_config(run_dir: str | Path, overrides: list[str] = ()):
    """The config a run continues with: run_dir/config.yaml, the overrides of its earlier resumes, then
    `overrides`. Refuses an override of a FIXED_ON_RESUME key, before anything is loaded."""
    run_dir = Path(run_dir)
    earlier = resume_overrides(run_dir)
    saved = _flat(load_config(run_dir / "config.yaml", earlier))
    cfg = load_config(run_dir / "config.yaml", earlier + list(overrides))
    for key, value in _flat(cfg).items():
        if key.startswith(FIXED_ON_RESUME) and value != saved[key]:
            raise UserError(f"--resume {run_dir}: {key} cannot change on resume ({saved[key]!r} -> {value!r}): the "
                            "checkpoint holds that model and run; drop the override, or start a new run")
    return cfg


def record_resume(run_dir: str | Path, overrides: list[str], step: int) -> None:
    """Append this resume (time, step, overrides) to run_dir/resumes.jsonl; config.yaml stays as written."""
    rec = {"time": datetime.now().isoformat(timespec="seconds"), "step": step, "overrides": list(overrides)}
    with open(Path(run_dir) / RESUMES, "a") as f:
        f.write(json.dumps(rec) + "\n")
