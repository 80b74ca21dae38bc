"""Atomic checkpoints: write into a temp dir, fsync, rename; keep the last K.

A checkpoint is a directory `step_000123/` holding `state.pt` (model, optimizer, scheduler,
RNG states, data position, step, fp8 kv scales). It appears under its final name only by an
atomic rename of a complete, fsynced temp dir, so a crash (even SIGKILL or power loss) mid-save
leaves at most a `.tmp-*` dir, which `latest_checkpoint` ignores and the next save removes.

Fault injection (tests/test_resume.py): with GRPO_CKPT_FAULT=<step> in the environment, the
save of that step writes half of state.pt into its temp dir and SIGKILLs its own process.
"""

import os
import random
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

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
