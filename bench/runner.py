"""The benchmarks' shared mode runner: modes, timing, child processes and the results file.

A *mode* is a named set of overrides (`MODES = {"bf16": [...], "fp8": [...], "fp8kv": [...]}`;
`section.key=value` config overrides, the trainer stack's FP8Config fields as `fp8.key=value`).
A benchmark runs its modes either in this process (`run_inline`: one model, mode after mode) or one
child process per mode (`run_jobs`: vLLM allows one engine per process; a fresh process also
isolates peak memory). Either way a failed mode becomes an error row and the others still run, and
the results file is rewritten after every mode, so a timeout loses one mode at most.

Results file: OUT/<name>.json (default OUT = runs/bench, untracked: a run leaves the committed figures in
bench/results alone; `--out bench/results` refreshes them), written atomically:

    {
      "device":   "NVIDIA H100 80GB HBM3",  # the hardware: GPU 0's name, the children's for a parent
                                            # process (it never touches CUDA), or "cpu"
      "cpu":      "Intel(R) Xeon(R) Processor",  # the host's CPU model: host-bound phases move with it
      "date":     "2026-11-24",             # of the write
      "command":  "python -m bench.step --modes bf16,fp8kv",
      "versions": {"python": "3.12.3", "torch": "2.11.0", "torchao": "0.18.0", "triton": "3.6.0",
                   "transformers": "5.17.0", "vllm": "0.26.0"},   # null: not installed
      "runs": [                              # one row per (workload, mode)
        {"workload": "...", "mode": "fp8kv", <figures: step_s, out_tok_s, ms, ...>,
         "speedup": 1.31, ...},              # ratios vs the bf16 row of the same workload; null if none
        {"workload": "...", "mode": "fp8", "error": "exit 1: ..."},   # a mode that failed
      ],
      "errors": [{"workload", "mode", "error"}],   # optional: failures that produced no row
      ...                                    # per benchmark: "merged" (files combined by --merge),
    }                                        # "best"/"default" (quant), "layers"/"fs"/... (checkpoint)

Ratios (`add_ratio`): "speedup" = bf16's time / the mode's time (step: step_s, train: ms) or the
mode's throughput / bf16's (rollout: out_tok_s); "speedup_eager" (train: vs eager bf16 for a
compiled mode), "kv_ratio_vs_bf16" (rollout: KV-cache tokens). The bf16 row has 1.0.
Sweeps without modes (quant.py: "config", wgrad.py: "gemm", alignment.py: "engine" x "trainer")
name their rows by those keys; the document around them is the same.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import date
from importlib import metadata
from pathlib import Path

import torch

from bench.host_speed import cpuinfo

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "runs" / "bench"  # the benchmarks' default --out; the committed figures: bench/results
VERSIONED = ("torch", "torchao", "triton", "transformers", "vllm")


# ----------------------------------------------------------------------------------- timing


def cuda_time_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median wall time of fn() in ms, measured with CUDA events after warm-up (autotune).
    Without CUDA (a CPU smoke run of a benchmark): time.perf_counter."""
    times = cuda_times_ms(fn, warmup, iters)
    return times[len(times) // 2]


def cuda_times_ms(fn, warmup: int = 5, iters: int = 20) -> list[float]:
    """cuda_time_ms's `iters` timings, sorted: where the host sets the pace the median moves from run to run,
    and the fastest and the spread say more."""
    for _ in range(warmup):
        fn()
    times, cuda = [], torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    for _ in range(iters):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)


def cuda_kernels(prof) -> list[tuple[str, float, int]]:
    """(name, self device time in ms, calls) of each CUDA kernel a torch.profiler run recorded."""
    return [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0]


def cpu_ops(prof) -> list[tuple[str, float, int]]:
    """(name, self host time in ms, calls) of each host event a torch.profiler run with CPU activity recorded:
    operators (aten::mm, a custom op's torchao::blockwise_scaled_mm), CUDA runtime and driver calls
    (cudaLaunchKernel, cuLaunchKernel), record_function ranges."""
    return [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.device_type.name == "CPU" and e.count]


def cuda_busy_ms(prof) -> float:
    """ms during which at least one CUDA kernel ran in a torch.profiler run: the union of the kernels' intervals.
    It falls below the sum of cuda_kernels' times where kernels overlap: other streams, or a kernel launched
    early by programmatic dependent launch that waits inside for the one before it."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                              if e.device_type.name == "CUDA"):
        if stop > end:
            busy, end = busy + stop - max(start, end), stop
    return busy / 1e3


# ----------------------------------------------------------------------------------- modes and ratios


def parse_choices(text: str, choices) -> list[str]:
    """argparse type: 'a,b' -> ['a', 'b'], each one of `choices` (a non-empty list)."""
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [m for m in out if m not in choices]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"modes {bad or text!r}: choose from {list(choices)}")
    return out


def add_ratio(runs: list[dict], name: str, metric: str, lower_is_better: bool = False, base="bf16",
              digits: int | None = None) -> list[dict]:
    """In place: r[name] = r[metric] / b[metric] (b[metric] / r[metric] if lower_is_better), b = the row
    of the same workload whose mode is `base` (or base(r["mode"])); None where either figure is missing."""
    base_of = base if callable(base) else (lambda mode: base)
    rows = {(r.get("workload"), r.get("mode")): r for r in runs}
    for r in runs:
        b = rows.get((r.get("workload"), base_of(r.get("mode"))))
        if not (b and r.get(metric) and b.get(metric)):
            r[name] = None
            continue
        ratio = b[metric] / r[metric] if lower_is_better else r[metric] / b[metric]
        r[name] = round(ratio, digits) if digits is not None else ratio
    return runs


def run_inline(modes: list[str], measure, workload: str, on_mode=None) -> list[dict]:
    """measure(mode) -> rows, for each mode in this process, in order. A mode that raises becomes one
    {"workload", "mode", "error"} row (traceback printed) and the next mode runs; on_mode(rows so
    far) after each mode (e.g. to write the results file)."""
    runs = []
    for mode in modes:
        try:
            runs += measure(mode)
        except Exception as e:  # e.g. a compile failure: record it, measure the other modes
            traceback.print_exc()
            runs.append({"workload": workload, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        if on_mode is not None:
            on_mode(runs)
    return runs


# ----------------------------------------------------------------------------------- child processes


def emit(path, record: dict) -> None:
    """Child side: append one result row (a JSON line) to the parent's records file, at once."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def nvidia_smi(field: str) -> str:
    """nvidia-smi's `field` (a --query-gpu name) of each GPU, a line each, without units; "" without nvidia-smi
    (the caller never touches CUDA)."""
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def device_name() -> str:
    """nvidia-smi's GPU names, a line each ("NVIDIA H200"), or "cpu"."""
    return nvidia_smi("name") or "cpu"


def fail(why: str) -> None:
    """A benchmark's bad input: one line `error: ...` on stderr, exit 2."""
    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)


def say(msg: str) -> None:
    """Child side: a progress line the parent streams (run_jobs' `stream` marker)."""
    print(f"[bench] {msg}", flush=True)


def read_records(path) -> list[dict]:
    """The rows a child emitted (a line cut by a kill is skipped)."""
    out = []
    if path and Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


@dataclass
class Job:
    """One child process: `argv`, its stdout + stderr in `log`, the rows it emits to `records`."""
    label: str
    argv: list[str]
    log: Path
    records: Path | None = None
    timeout: float | None = None  # seconds for this child (besides run_jobs' deadline)
    info: dict = field(default_factory=dict)  # the caller's (e.g. model and mode)
    # filled by run_jobs
    rc: int | None = None
    status: str = ""  # "ok", "failed", "timeout", "killed at the time limit", "not started"
    gpu: str | None = None
    started: float = 0.0
    wall_s: float = 0.0
    proc: subprocess.Popen | None = None
    _offset: int = 0
    _partial: str = ""

    def tail(self, lines: int) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()[-lines:] if self.log.is_file() else []


def visible_gpus() -> list[str | None]:
    """GPU ids for the children's CUDA_VISIBLE_DEVICES: this process's CUDA_VISIBLE_DEVICES, else every
    GPU torch counts (NVML: no CUDA context here); [None] = one slot, environment unchanged."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()] or [None]
    try:
        n = torch.cuda.device_count()
    except Exception:
        n = 0
    return [str(i) for i in range(n)] or [None]


def kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM then SIGKILL to the child's process group (the child and what it spawned, e.g. compile workers)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGKILL:
                return
        except subprocess.TimeoutExpired:
            continue


def _stream(job: Job, marker: str) -> None:
    """Print the child's new log lines that hold `marker`."""
    try:
        with open(job.log, "rb") as f:
            f.seek(job._offset)
            data = f.read()
    except OSError:
        return
    job._offset += len(data)
    lines = (job._partial + data.decode(errors="replace")).split("\n")
    job._partial = lines.pop()
    for line in lines:
        if marker in line:
            print(f"[{job.label} +{time.time() - job.started:.0f}s] {line.split(marker, 1)[1].strip()}", flush=True)


def run_jobs(jobs: list[Job], on_done, *, gpus=(None,), deadline: float | None = None, min_left: float = 0.0,
             stagger_s: float = 0.0, poll_s: float = 1.0, stream: str | None = "[bench]", env: dict | None = None,
             cwd=None, tag: str = "bench", log_tail: int = 40) -> int:
    """Run the jobs in order, one per GPU slot at a time (CUDA_VISIBLE_DEVICES=slot; None: unchanged),
    each in its own process group; returns how many did not finish with exit code 0.

    on_done(job) after each (job.status, job.rc, job.wall_s set; read its rows with read_records).
    deadline (time.time()): no child starts with less than min_left s to go, and running ones are
    killed at it; job.timeout kills one child. stagger_s between launches (vLLM's port races at
    init); lines of the child's log that hold `stream` are echoed as they come; a failed child's
    last log_tail lines are printed."""
    env = {**os.environ, **({"PYTHONUNBUFFERED": "1"} if stream else {}),  # streamed lines as they come
           "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p),
           **(env or {})}
    pending, running, free, failed, last_launch = list(jobs), [], list(gpus), 0, 0.0
    try:
        while pending or running:
            now = time.time()
            if pending and free and now - last_launch >= stagger_s:
                if deadline and deadline - now < min_left:
                    for job in pending:
                        print(f"[{tag}] {job.label}: not started, {deadline - now:.0f} s left < {min_left} s",
                              flush=True)
                        job.status = "not started"
                        failed += 1
                        on_done(job)
                    pending = []
                    continue
                job, job.gpu = pending.pop(0), free.pop(0)
                job.log.parent.mkdir(parents=True, exist_ok=True)
                if job.records is not None:
                    Path(job.records).unlink(missing_ok=True)
                child_env = {**env, **({"CUDA_VISIBLE_DEVICES": job.gpu} if job.gpu is not None else {})}
                with open(job.log, "w") as logf:
                    job.proc = subprocess.Popen(job.argv, stdout=logf, stderr=subprocess.STDOUT, env=child_env,
                                                cwd=cwd, start_new_session=True)
                job.started = last_launch = time.time()
                running.append(job)
                where = f" on GPU {job.gpu}" if job.gpu is not None else ""
                print(f"[{tag}] {job.label}: started{where} (pid {job.proc.pid}, log {job.log})", flush=True)
            for job in list(running):
                if stream:
                    _stream(job, stream)
                rc = job.proc.poll()
                now = time.time()
                cut = ("killed at the time limit" if deadline and now > deadline else
                       "timeout" if job.timeout and now - job.started > job.timeout else "")
                if rc is None and cut:
                    print(f"[{tag}] {job.label}: {cut}", flush=True)
                    job.status = cut
                    kill_group(job.proc)
                    rc = job.proc.wait()
                if rc is None:
                    continue
                job.wall_s = time.time() - job.started
                kill_group(job.proc, grace=2.0)  # leftovers of an exited child (no-op if none)
                if stream:
                    _stream(job, stream)
                running.remove(job)
                free.append(job.gpu)
                job.rc, job.status = rc, job.status or ("ok" if rc == 0 else "failed")
                if job.status != "ok":
                    failed += 1
                    print(f"[{tag}] {job.label}: FAILED (exit {rc}) after {job.wall_s:.0f} s; last log lines:\n    "
                          + "\n    ".join(job.tail(log_tail)), flush=True)
                else:
                    print(f"[{tag}] {job.label}: done in {job.wall_s:.0f} s", flush=True)
                on_done(job)
            if running or pending:
                time.sleep(poll_s)
    finally:  # an interrupt or a failing on_done: no child outlives the parent
        for job in running:
            kill_group(job.proc, grace=2.0)
    return failed


# ----------------------------------------------------------------------------------- results files


def command_line() -> str:
    """This process's command as typed: `python -m bench.step --modes bf16` (a module run by its name)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return " ".join(["python", *(["-m", spec.name] if spec else sys.argv[:1]), *sys.argv[1:]])


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def write_results(name: str, runs: list[dict], out_dir: Path = RESULTS, device: str | None = None,
                  **extra) -> Path:
    """Write out_dir/name.json (the schema above). device: the GPU the runs measured (default: this
    process's GPU 0, or "cpu"); a parent whose children measured passes theirs instead of touching CUDA."""
    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {"device": device, "cpu": cpuinfo("model name"), "date": date.today().isoformat(), "command": command_line(),
           "versions": {"python": sys.version.split()[0], **{p: _version(p) for p in VERSIONED}},
           "runs": runs, **extra}
    return write_json(Path(out_dir) / f"{name}.json", doc)


def update_results(name: str, runs: list[dict], out_dir: Path = RESULTS, device: str | None = None, derive=None,
                   **extra) -> Path:
    """write_results, keeping the runs already in out_dir/name.json from the same device that `runs`
    does not re-measure (same workload and mode); derive(all runs) adds the ratios."""
    device = device or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    old = read_results(Path(out_dir) / f"{name}.json")
    kept = old["runs"] if old and old.get("device") == device else []
    runs = merge_runs(kept, runs)
    return write_results(name, derive(runs) if derive else runs, out_dir, device=device, **extra)


def merge_files(files: list[str], name: str, out_dir: Path, derive=None) -> tuple[Path, list[dict]]:
    """--merge: the runs of several results files of one device (e.g. one per GPU of a host) in one
    out_dir/name.json, a later file's run replacing an earlier one's; derive(runs) re-computes the ratios."""
    docs = [read_results(Path(f)) for f in files]
    if None in docs:
        sys.exit(f"--merge: not a results file: {[f for f, d in zip(files, docs) if d is None]}")
    if len({d["device"] for d in docs}) > 1:
        sys.exit(f"--merge: files from different devices {sorted({d['device'] for d in docs})}: ratios need one")
    runs: list[dict] = []
    for d in docs:
        runs = merge_runs(runs, d["runs"])
    runs = derive(runs) if derive else runs
    return write_results(name, runs, Path(out_dir), device=docs[0]["device"], merged=list(files)), runs


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


def merge_runs(old: list[dict], new: list[dict]) -> list[dict]:
    """old runs whose (workload, mode) no new run has, then the new runs (a re-measured run replaces its old one)."""
    def key(r):
        return r.get("workload"), r.get("mode")

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
