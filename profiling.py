"""Where a step's time goes: torch.profiler around one step (log.profile_step) with the device-busy
share of each phase, and the Python garbage collector's pauses (time/gc)."""

import bisect
import functools
import gc
import time
from pathlib import Path

import torch


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


def profile_phases(prof) -> str:
    """phase_busy of a stopped torch.profiler profile, as a table (empty without phase spans)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    device = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == torch.autograd.DeviceType.CPU:
            if ev.name() in PHASES:
                spans.setdefault(ev.name(), []).append((ev.start_ns(), ev.end_ns()))
        elif not ev.is_user_annotation() and ev.name() not in PHASES:  # kernels, memcpy, memset
            device.append((ev.start_ns(), ev.end_ns()))
    rows = [f"{'phase':<12} {'wall_s':>8} {'device_busy_s':>14} {'busy':>6}"]
    for name, (wall, busy) in phase_busy(spans, device).items():
        rows.append(f"{name:<12} {wall:8.3f} {busy:14.3f} {busy / max(wall, 1e-12):6.1%}")
    return "\n".join(rows) + "\n\n" if spans else ""


def save_profile(prof, out_dir: Path, step: int, rank: int, device: torch.device) -> Path:
    """Stop the profiler; write (.txt) the device-busy share of each phase (profile_phases), then the
    top-40 operator table below it, then the trace (.json): the last two take minutes for a long
    step's ~10^6 events, so a run cut off meanwhile still leaves the phase table."""
    prof.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"step_{step:06d}_rank{rank}"
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    phases = profile_phases(prof)
    stem.with_suffix(".txt").write_text(phases)  # first what is quick to get, then the slow parts
    stem.with_suffix(".txt").write_text(phases + prof.key_averages().table(sort_by=sort, row_limit=40))
    prof.export_chrome_trace(f"{stem}.json")
    return stem.with_suffix(".txt")


class GCTimer:
    """Seconds this process spent in Python garbage collection since the last take() (time/gc):
    a collection pauses the host, and the GPU with it once its queue runs dry. One per process
    (gc_timer()), registered in gc.callbacks for the process's life."""

    def __init__(self):
        self.total, self._t0 = 0.0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.total, self._t0 = self.total + time.perf_counter() - self._t0, None

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


@functools.cache
def gc_timer() -> GCTimer:
    return GCTimer()
