"""Atomic checkpoints: write into a temp dir, fsync, rename; keep the last K.

A checkpoint is a directory `step_000123/` holding `state.pt` (model, optimizer, scheduler,
RNG states, data position, step, fp8 scales). A crash mid-save leaves only a `.tmp-*` dir,
which `latest_checkpoint` ignores and the next save removes.
"""

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | Path, step: int, state: dict, keep: int = 2) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step:06d}", root / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # re-saving the same step (e.g. end of a resumed run)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    done = sorted(p for p in Path(root).glob("step_*") if (p / "state.pt").is_file())
    return done[-1] if done else None


def load_checkpoint(path: str | Path) -> dict:
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
