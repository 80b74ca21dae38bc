"""What holds a CUDA device's memory at the peak of a stretch of work (bench/trainer_phase.py --memory).

The stretch runs under torch's allocator history (`torch.cuda.memory._record_memory_history`, Python stacks of
each allocation). Afterwards `breakdown` replays the history's alloc / free_completed events from the
allocated bytes at its start, finds the allocated peak, and sums the allocations live there by where they were
made (`origin`). It adds what replay alone cannot see:
- reserved: the allocator's cached segments per stream at the end (FSDP2 allocates on its all-gather and
  reduce-scatter streams, and a stream's cached blocks serve only that stream), against their allocated bytes;
- the device's own peak (`mem_get_info`, distributed.DevicePeak) less torch's reserved peak: CUDA context,
  NCCL buffers, a sleeping vLLM engine, anything outside torch's allocator.
torch ships a viewer for the raw snapshot (pytorch.org/memory_viz) but no summary of it; this is one, small
enough to come back from a GPU host.
"""

from collections import defaultdict

GIB = 2**30
FSDP = "/torch/distributed/fsdp/"


def origin(frames: list[dict], root: str) -> str:
    """Where an allocation was made, from its Python frames (innermost first): an FSDP2 function, else the
    innermost frame in the repo (path relative to root), else compiled code, else the innermost frame;
    allocations made where no Python runs (the autograd engine's backward) have no frames."""
    if not frames:
        return "no Python frame (autograd backward)"
    for f in frames:
        if FSDP in f["filename"]:
            return f"fsdp2 {f['name']}"
    for f in frames:
        if f["filename"].startswith(root):
            return f"{f['filename'][len(root):].lstrip('/')}:{f['name']}"
    for f in frames:
        if "torchinductor" in f["filename"] or "/torch/_inductor/" in f["filename"]:
            return "compiled graph (Inductor)"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['name']}"


def breakdown(snapshot: dict, device: int, base_allocated: int, root: str, top: int = 12) -> dict:
    """The allocated peak of `snapshot`'s recorded history on `device` and what was live there (GiB).
    base_allocated: torch.cuda.memory_allocated when the recording started (what the history does not show)."""
    trace = snapshot["device_traces"][device]
    total, peak, peak_at = 0, 0, -1
    for i, e in enumerate(trace):
        total += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        if total > peak:
            peak, peak_at = total, i
    at_peak, streams, alive = defaultdict(int), defaultdict(int), {}
    for e in trace[:peak_at + 1]:  # replayed again up to the peak: the allocations live there
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    for e in alive.values():
        at_peak[origin(e.get("frames", []), root)] += e["size"]
        streams[e["stream"]] += e["size"]
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    reserved, allocated = defaultdict(int), defaultdict(int)
    for s in segments:
        reserved[s["stream"]] += s["total_size"]
        allocated[s["stream"]] += s["allocated_size"]
    gib = lambda b: round(b / GIB, 3)  # noqa: E731
    ranked = sorted(at_peak.items(), key=lambda kv: -kv[1])
    return {
        "events": len(trace),
        "before_gib": gib(base_allocated),
        "allocated_peak_gib": gib(base_allocated + peak),
        "made_in_stretch_at_peak_gib": gib(sum(at_peak.values())),
        "at_peak": [{"origin": k, "gib": gib(v)} for k, v in ranked[:top]]
        + ([{"origin": f"{len(ranked) - top} more", "gib": gib(sum(v for _, v in ranked[top:]))}]
           if len(ranked) > top else []),
        "at_peak_by_stream": {str(s): gib(v) for s, v in sorted(streams.items())},
        "reserved_by_stream_at_end": {str(s): {"reserved_gib": gib(reserved[s]), "allocated_gib": gib(allocated[s])}
                                      for s in sorted(reserved)},
    }


def describe(b: dict) -> str:
    """A few lines for the log."""
    lines = [f"allocated peak {b['allocated_peak_gib']:.2f} GiB: {b['before_gib']:.2f} before the stretch, "
             f"{b['made_in_stretch_at_peak_gib']:.2f} made in it and live at the peak ({b['events']} events)"]
    lines += [f"  {r['gib']:7.3f}  {r['origin']}" for r in b["at_peak"]]
    lines.append("  reserved by stream at the end (reserved / allocated GiB): " + ", ".join(
        f"{s}: {v['reserved_gib']:.2f} / {v['allocated_gib']:.2f}" for s, v in b["reserved_by_stream_at_end"].items()))
    return "\n".join(lines)
