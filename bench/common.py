"""Shared by the benchmarks: timing and the results-file schema of ../shared/DESIGN.md."""

import json
import sys
from datetime import date
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def cuda_time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median wall time of fn() in ms, measured with CUDA events after warm-up (autotune)."""
    for _ in range(warmup):
        fn()
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


def write_results(name: str, runs: list[dict], out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": date.today().isoformat(), "command": " ".join(["python"] + sys.argv), "runs": runs}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def markdown_table(runs: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in runs:
        lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                       for c in cols) + " |")
    return "\n".join(lines)

