"""Sharded, atomic checkpoints through torch.distributed.checkpoint (DCP); resume from the newest
one that loads.

On disk, under <run_dir>/checkpoints/ (one dir per saved step, the last train.keep_ckpts kept):

    step_000120/
        .metadata        DCP's index: every tensor's global shape and dtype, and which file and
                         byte range holds each shard of it (pickled)
        __0_0.distcp     rank 0's shards of the model and optimizer tensors, one file per rank
        __1_0.distcp     (__{rank}_0.distcp; each tensor shard is one torch.save record)
        meta.pt          torch.save of everything else, written by rank 0: step, world (ranks that
                         wrote it), scheduler, sampler, rng (a list: every rank's), kv_scales
                         (fp8/calibrate.py's kv_scales_state), bad_steps, entropy_coef (the adaptive
                         entropy coefficient), entropy (the last step's policy/entropy), optimizer_stepped
                         (False: saved before any optimizer step, whose zero Adam state is not restored)
    .tmp-step_000160/    a save in progress, or one a crash left: never read; the next save removes it

The tensors are {"model": ..., "optimizer": ...} as get_state_dict(model, optimizer) gives them:
this rank's FSDP2 shards (DTensors), the optimizer state keyed by parameter name (FQN). Each rank
writes only its own shards, so no process ever holds the full model or optimizer state (the
single-file format gathered ~96 GB through rank 0's CPU memory at 8B with fp32 master weights and
AdamW). `.metadata` places each shard in its global tensor, so a checkpoint loads on any number
of ranks: DCP reads, for each new shard, the byte ranges that overlap it (resharding).

One path for every world size: in one process (no process group) DCP writes a single .distcp of
plain tensors and reads any checkpoint into plain tensors (dcp's no_dist mode), so there is no
world-size branch and 1 <-> N-rank resume is the same code as N <-> M.

Atomic commit: rank 0 makes `.tmp-step_N/`; every rank writes its file into it (DCP fsyncs each
file and `.metadata`); rank 0 writes meta.pt, fsyncs it and the dir, renames the dir to
`step_N` (atomic in POSIX) and fsyncs the parent. A crash at any moment (SIGKILL, power loss)
leaves either the complete `step_N/` or none, plus at most a `.tmp-*` dir. Several nodes: the
checkpoint dir must be on a filesystem every node sees (as DCP's FileSystemWriter assumes).

Resume (load_latest): the newest complete checkpoint that loads. One whose files are damaged (a
file truncated or garbled after its commit, a disk error: `damage` finds meta.pt or .metadata
unreadable, or a file shorter than its index says) is skipped with one line naming it and why, and
the next older one is tried. A checkpoint whose files are intact but that does not load (a shape or
key that differs from this run, a bug) stops the resume: an older checkpoint would fail alike, and
the files are not to blame. The error names the checkpoint and the reason, after the traceback.
Not caught: flipped bits inside a tensor's data (DCP keeps no checksums and torch.load does not
verify them): those load. Running out of device memory is no damage either: it stops the resume
with one line naming the checkpoint, the memory asked for and free, and the fix (more GPUs, a
smaller vLLM share).

RNG: meta.pt keeps every rank's global RNG states (python, numpy, torch CPU, CUDA). Resumed on
the same number of ranks, each rank gets its own back: exact. On another number there is no
rank-to-rank correspondence, so every rank gets rank 0's, as in a fresh run where every rank
seeds train.seed. The loop stays exact across world sizes anyway because the randomness it
depends on (prompt order, rollout sampling, mini-batch shuffles) comes from explicit seeds of
(seed, step, sample index), never from these global RNGs; code that draws from them differently
per rank would resume exactly only on the same world size.

Memory: dcp.load reads each stored record into CPU memory and copies it into the live tensor (this
rank's shard), one at a time; nothing full-size is materialized on the device. The load holds what
training holds (weights, optimizer states: built before the load by optimizer.init_states; torch's
AdamW gets its states and zero gradients from get_state_dict) but vLLM's share must be free:
run_setup.resume puts the engine to sleep first.

Single-file checkpoints of earlier versions (`state.pt`, full tensors) still load, on any number
of ranks (distributed.load_full_state).

The run directory around them (create_run_dir, resume_config, ...) lives here too, and so do
the repo's two atomic-write helpers (atomic_write for one file, replace_dir for a whole dir):
this module owns what a run leaves on disk, and the exported model dirs, metrics and batch
dumps need the same all-or-nothing guarantee as checkpoints.

Fault injection (tests/e2e/test_resume.py): with GRPO_CKPT_FAULT=<step> in the environment, the
save of that step truncates rank 0's .distcp file in its temp dir to half and SIGKILLs its own
process.
"""

import contextlib
import json
import os
import random
import re
import shutil
import signal
import traceback
import warnings
from datetime import datetime
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import distributed
from config import load_config, to_dict
from distributed import Dist
from errors import UserError

META, LEGACY = "meta.pt", "state.pt"
_STEP_DIR = re.compile(r"step_(\d+)")
RESUMES = "resumes.jsonl"
FIXED_ON_RESUME = ("model.name_or_path", "model.tiny.", "model.dtype", "optim.name", "train.out_dir",
                   "train.run_name")
"""Keys (or key prefixes) a resume cannot override: they fix the parameters' shapes and dtype, the
optimizer state and the tokenizer the checkpoint holds, or where the run lives."""


def rng_state() -> dict:
    """The global RNGs of this process (saved per rank; see the module docstring)."""
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


# ------------------------------------------------------------------------------ atomic writes

def fsync(path: str | Path) -> None:
    """Make a file's data, or a dir's entries (a rename/creation inside it), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write the file `path` all or nothing: write(f) fills a temp file beside it (`.NAME.tmp`),
    which is fsynced and renamed over `path` (atomic in POSIX), then the dir is fsynced. A crash
    leaves the old file or the new one, never a torn one; an exception in write removes the temp file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written left behind
        raise
    fsync(path.parent)
    return path


def replace_dir(tmp: Path, final: Path) -> None:
    """Publish the dir `tmp`, whose files the caller has written and fsynced, as `final`: fsync tmp,
    rename it to final (atomic in POSIX), fsync the parent. An existing final is first renamed to
    `tmp.old` and removed after the commit, so a complete copy exists at every moment."""
    fsync(tmp)
    old = tmp.with_name(tmp.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------ checkpoints

def is_checkpoint(path: str | Path) -> bool:
    """A committed checkpoint dir: DCP (meta.pt and .metadata) or single-file (state.pt)."""
    path = Path(path)
    return ((path / META).is_file() and (path / ".metadata").is_file()) or (path / LEGACY).is_file()


def checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root as (step, dir), oldest first (numeric order, any width)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted((s, p) for s, p in found if is_checkpoint(p))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint dir under root, or None (temp dirs of crashed saves never count)."""
    done = checkpoints(root)
    return done[-1][1] if done else None


def save_checkpoint(root: str | Path, step: int, meta: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
                    d: Dist = Dist(), keep: int = 2) -> Path:
    """Write root/step_{step:06d} (the layout above) atomically; then delete all but the newest `keep`
    (keep <= 0: keep all), those of later steps (stale after a resume) and any temp dir a crashed save
    left. Collective: every rank calls it.
    meta: the non-tensor state (rank 0's is written), to which this adds "rng" (every rank's) and
    "world". Returns the checkpoint dir."""
    root = Path(root)
    final, tmp = root / f"step_{step:06d}", root / f".tmp-step_{step:06d}"
    if d.main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    rngs = distributed.all_gather_object(rng_state(), d)
    distributed.barrier(d)  # the temp dir exists before any rank writes into it
    stepped = bool(optimizer.state)  # else sharded_state initialises it (Adam step 1): undone after the save
    model_sd, optim_sd = distributed.sharded_state(model, optimizer)
    with _quiet():
        dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    if not stepped:  # saving must not change training: the first real step still starts Adam at step 1
        optimizer.state.clear()
    if d.main:
        if os.environ.get("GRPO_CKPT_FAULT") == str(step):  # test hook: crash mid-save
            torn = tmp / "__0_0.distcp"
            os.truncate(torn, torn.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        atomic_write(tmp / META, lambda f: torch.save({**meta, "rng": rngs, "world": d.world,
                                                       "optimizer_stepped": stepped}, f))
        replace_dir(tmp, final)  # re-saving a step (end of a resumed run) swaps the old copy out
        done = checkpoints(root)
        # steps after this one are of the run before a resume (e.g. a newest one that did not load):
        # this run redoes them, as RunLogger.truncate drops their metrics; else keep-K would keep them
        stale, kept = [p for s, p in done if s > step], [p for s, p in done if s <= step]
        for old in stale + (kept[:-keep] if keep > 0 else []):
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    distributed.barrier(d)  # no rank goes on (and may save again) before the commit
    return final


@contextlib.contextmanager
def _quiet():
    """DCP warns at every save and load without a process group: in one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def _reason(e: BaseException) -> str:
    """One line on why a checkpoint did not load: the first rank's error of a DCP CheckpointException."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))[0]
    text = (str(e).strip().splitlines() or [""])[0].split(". ")[0]  # torch's corrupt-zip error runs on
    return f"{type(e).__name__}: {text}"[:300]


def _out_of_memory(e: BaseException) -> BaseException | None:
    """The torch.OutOfMemoryError behind e (itself, or a rank's error in a DCP CheckpointException), else None."""
    errors = [e] + [f[0] for f in (getattr(e, "failures", None) or {}).values()]
    return next((x for x in errors if isinstance(x, torch.OutOfMemoryError)), None)


def _oom_error(path: Path, oom: BaseException, d: Dist) -> UserError:
    """Out of memory while loading: the checkpoint is fine, the device too small for it beside what it holds."""
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(oom))
    facts = [f"asked for {asked.group(1)} more" if asked else "out of memory"]
    if d.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(d.device)
        facts.append(f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free on {d.device}")
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 2**30
    facts.append(f"its files {size:.1f} GiB, loaded over {d.world} rank{'s' * (d.world > 1)}")
    return UserError(f"checkpoint {path} does not fit in device memory ({'; '.join(facts)}); it is not damaged: "
                     "resume on more GPUs (torchrun --nproc_per_node N), or lower rollout.gpu_memory_utilization")


def damage(path: str | Path) -> str | None:
    """Why checkpoint `path`'s files are damaged, else None: meta.pt or DCP's .metadata unreadable, or a
    file the index points into missing or shorter than the index says (a copy or write cut short).
    Bytes changed inside a file's length are not seen (DCP keeps no checksums)."""
    path = Path(path)
    try:
        if (path / LEGACY).is_file():
            torch.load(path / LEGACY, map_location="cpu", weights_only=False)
            return None
        torch.load(path / META, map_location="cpu", weights_only=False)
        with _quiet():
            index = dcp.FileSystemReader(path).read_metadata().storage_data
    except Exception as e:
        return _reason(e)
    need: dict[str, int] = {}
    for item in index.values():
        need[item.relative_path] = max(need.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(need.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have is None or have < size:
            return f"{name} is {'missing' if have is None else f'{have} bytes'}, its index needs {size}"
    return None


def _stage_on_cpu(optim_sd: dict) -> dict[tuple[str, str], torch.Tensor]:
    """Swap each torchao low-bit optimizer state (8-bit AdamW's) of a one-process optimizer state dict for
    a CPU copy for DCP to load into; {(param name, key): the live tensor} to copy it back to.
    Why: torchao keeps a state of < 4096 values per rank in full precision, so an RMSNorm weight's
    moments saved on 2 ranks are plain tensors that load into 8-bit ones on 1 rank, and torchao 0.18's
    OptimState8bit.copy_ quantizes a plain source on the source's device with the destination's
    code map: DCP's CPU reads into CUDA states fail ("Expected all tensors to be on the same device").
    On CPU both are on one device; 8-bit to 8-bit copies move codes and scales (1 byte per value).
    FSDP2's DTensor states are left as they are: a tensor that is 8-bit under M > 1 ranks and plain
    under N > M (e.g. 8192 values, 4 -> 2 ranks) would still meet the failure."""
    from torch.distributed.tensor import DTensor
    from torchao.utils import TorchAOBaseTensor
    live = {}
    for name, states in optim_sd.get("state", {}).items():
        for key, t in states.items():
            if isinstance(t, TorchAOBaseTensor) and not isinstance(t, DTensor):
                live[name, key], states[key] = t, t.to("cpu")
    return live


def _load_into(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, d: Dist) -> dict:
    """Load checkpoint `path` into model and optimizer (collective); its meta with this rank's RNG state."""
    if (path / LEGACY).is_file():
        meta = torch.load(path / LEGACY, map_location="cpu", weights_only=False)
        distributed.load_full_state(model, optimizer, meta.pop("model"), meta.pop("optimizer"), d)
    else:  # meta first: a bad meta.pt is found before any weight is touched; every rank reads the same file
        meta = torch.load(path / META, map_location="cpu", weights_only=False)
        model_sd, optim_sd = distributed.sharded_state(model, optimizer)
        live = _stage_on_cpu(optim_sd)
        state = {"model": model_sd, "optimizer": optim_sd}
        with _quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))  # errors are raised on every rank
        for (name, key), t in live.items():  # each staged state into its live tensor, in place
            t.copy_(optim_sd["state"][name][key])
            optim_sd["state"][name][key] = t
        distributed.load_sharded_state(model, optimizer, state["model"], state["optimizer"])
        if not meta.get("optimizer_stepped", True):  # saved before any optimizer step: none taken yet
            optimizer.state.clear()
    rngs = meta["rng"] if isinstance(meta["rng"], list) else [meta["rng"]]  # single-file ones: rank 0's
    meta["rng"] = rngs[d.rank] if len(rngs) == d.world else rngs[0]  # see the module docstring
    meta.setdefault("world", 1)
    return meta


def load_latest(root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, d: Dist = Dist(),
                log=print) -> tuple[Path, dict] | None:
    """Load the newest checkpoint under root that loads into model and optimizer (collective):
    (its dir, its meta, with "rng" this rank's RNG state to restore). A damaged checkpoint is skipped
    with one line through `log`; a skipped one may have left some weights half-loaded, which the older
    checkpoint then overwrites completely. None when root holds no complete checkpoint; UserError when
    none of them loads, when one with intact files does not load (its traceback through `log` first),
    or when one runs out of memory (every checkpoint of the run needs the same memory, so none is
    skipped for that)."""
    failed = []
    for _, path in reversed(checkpoints(root)):
        try:
            return path, _load_into(path, model, optimizer, d)
        except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
            if (oom := _out_of_memory(e)) is not None:  # an older checkpoint needs as much: no fallback
                raise _oom_error(path, oom, d) from e
            if damage(path) is None:  # the run, not the files, stops it: an older checkpoint would fail alike
                log(f"loading checkpoint {path} failed:\n{''.join(traceback.format_exception(e)).rstrip()}")
                raise UserError(f"checkpoint {path} does not load into this run ({_reason(e)}), though its files "
                                "are intact (not damaged; no older checkpoint is tried): check what changed since "
                                "it was saved (config overrides, GPUs, library versions), and report the traceback "
                                "above if nothing did") from e
            failed.append(f"{path.name}: {_reason(e)}")
            log(f"skipping checkpoint {path}: it does not load ({_reason(e)})")
    if failed:
        raise UserError(f"no checkpoint in {root} loads ({'; '.join(failed)}); restore one, or start a new run "
                        "without --resume")
    return None


def load_checkpoint(path: str | Path, optimizer: bool = True) -> dict:
    """A checkpoint as one dict of full CPU tensors, in one process (export, analysis, tests): meta.pt's
    fields plus "model" (state dict) and "optimizer" (keyed by parameter name; optimizer=False skips
    it, the bulk of the bytes). Reads DCP and single-file checkpoints alike."""
    path = Path(path)
    if (path / LEGACY).is_file():
        return torch.load(path / LEGACY, map_location="cpu", weights_only=False)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    meta = torch.load(path / META, map_location="cpu", weights_only=False)
    with _quiet():
        # what format_utils.dcp_to_torch_save does: rebuild the state dict from .metadata (torch 2.11)
        tensors = _load_state_dict_from_keys({"model", "optimizer"} if optimizer else {"model"},
                                             storage_reader=dcp.FileSystemReader(path))
    return {**meta, **tensors}
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
