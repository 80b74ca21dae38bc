"""Shared by the benchmarks: timing and the results-file schema (docs/design.md, "Benchmark results")."""

import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def cuda_time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median wall time of fn() in ms, measured with CUDA events after warm-up (autotune).
    Without CUDA (a CPU smoke run of a benchmark): time.perf_counter."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def write_results(name: str, runs: list[dict], out_dir: Path = RESULTS, device: str | None = None,
                  **extra) -> Path:
    """Write out_dir/name.json: {"device", "date", "command", "runs", **extra} (docs/design.md).

    device: name of the GPU the runs measured (default: this process's GPU 0, or "cpu"); a parent
    process whose children did the measuring passes theirs instead of touching CUDA itself.
    The file is replaced atomically, so a reader (or a kill mid-write) never sees half a file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {"device": device, "date": date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
           "runs": runs, **extra}
    return write_json(out_dir / f"{name}.json", doc)


def write_json(path: Path, doc) -> Path:
    """json.dumps(doc) to path atomically (a temp file, then rename): never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
    return path


def read_results(path: Path) -> dict | None:
    """A results document written by write_results, or None if the file is absent or unreadable."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("runs"), list) else None


def merge_runs(old: list[dict], new: list[dict], key) -> list[dict]:
    """old runs whose key(run) no new run has, then the new runs (a re-measured run replaces its old one)."""
    fresh = {key(r) for r in new}
    return [r for r in old if key(r) not in fresh] + list(new)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return "" if v is None else str(v)


def markdown_table(runs: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in runs:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def parse_choices(text: str, choices) -> list[str]:
    """argparse helper: 'a,b' -> ['a', 'b'], each one of `choices` (a non-empty list)."""
    import argparse

    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [m for m in out if m not in choices]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"modes {bad or text!r}: choose from {list(choices)}")
    return out
