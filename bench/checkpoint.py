"""Checkpoint save and load at Llama-3.1-8B shape: the single-file full gather + torch.save against
sharded DCP (checkpoint.py). Time, peak host RSS and checkpoint size -> OUT/checkpoint.json.

    python -m bench.checkpoint --out $OUT                       # GPU: as many layers as fit (<= 8)
    python -m bench.checkpoint --layers 4 --out $OUT            # fewer layers (disk, time)
    python -m bench.checkpoint --tiny --out /tmp/ckpt_bench     # CPU smoke run (tests/e2e/test_bench.py)

What is measured: a random-init LlamaForCausalLM at Llama-3.1-8B's shape with --layers decoder
layers instead of 32, fp32 master weights, FSDP2 over a 1-rank process group (DTensor parameters,
as under torchrun), AdamW whose moments one step has materialised. One child process per op
(bench/runner.py), so that ru_maxrss (peak RSS) is that op's alone:

    full save   get_state_dict(full_state_dict, cpu_offload) (the whole state in this process's CPU
                memory), torch.save to one file, fsync
    full load   torch.load of that file + set_state_dict(full_state_dict)
    dcp save    checkpoint.save_checkpoint: dcp.save of the shards, meta.pt, fsync, atomic rename
    dcp load    checkpoint.load_latest: meta.pt, dcp.load into the shards, set_state_dict

Before a load the files are dropped from the page cache (posix_fadvise DONTNEED after fsync), so
loads read the disk, and the weights and moments are zeroed: `restored` says the load brought back
every value. Each row: seconds, GB on disk, peak RSS and RSS before the op (GiB), peak GPU memory.
32-layer (8B) figures are arithmetic: bytes grow by `layer_gb` per layer (12 bytes per parameter:
fp32 weight + two Adam moments; 8.03e9 x 12 B = 96 GB at 32 layers), the full format's peak RSS
about as much.

--layers auto: the most layers, up to 8 (2.80B parameters, 33.6 GB of state), whose weights,
gradients and moments (16 B per parameter) fit 85% of the GPU's memory, whose checkpoint fits 80%
of the free disk under --dir (one checkpoint at a time; removed at the end) and whose full state
fits 60% of the host's memory.
"""

import argparse
import json
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.runner import RESULTS, Job, emit, read_records, run_jobs, write_results

L8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
           vocab_size=128256)
TINY = dict(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512)
OPS = ("full-save", "full-load", "dcp-save", "dcp-load")
BYTES_PER_PARAM = 12  # fp32 weight + fp32 exp_avg + fp32 exp_avg_sq


def param_counts(shape: dict) -> tuple[int, int]:
    """(parameters per decoder layer, parameters outside the layers: embeddings, lm_head, final norm)."""
    h, i, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h  # q, k, v, o, gate/up/down, 2 RMSNorms
    return layer, 2 * shape["vocab_size"] * h + h


def auto_layers(shape: dict, ckpt_dir: Path, device: str, cap: int = 8) -> int:
    layer, rest = param_counts(shape)
    free_disk = shutil.disk_usage(ckpt_dir).free * 0.8
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.6
    gpu = torch.cuda.get_device_properties(0).total_memory * 0.85 if device == "cuda" else float("inf")
    fits = [n for n in range(1, cap + 1) if (rest + n * layer) * BYTES_PER_PARAM < min(free_disk, host)
            and (rest + n * layer) * 16 < gpu]
    if not fits:
        sys.exit(f"error: not even 1 layer's checkpoint fits: {free_disk / 1e9:.0f} GB of disk free under {ckpt_dir} "
                 f"(80%), {host / 1e9:.0f} GB of host memory (60%); use --dir on a larger disk, or a larger host")
    return fits[-1]


def build(shape: dict, layers: int, device: torch.device):
    """The FSDP2 (1-rank) fp32 model and an AdamW with materialised moments."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, **shape)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=False)  # no foreach temporaries
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return model, optimizer


def fingerprint(model, optimizer) -> list[float]:
    """Sums of this rank's weights and Adam moments (float64): equal before a save and after a load."""
    local = [getattr(t, "to_local", lambda: t)() for p in model.parameters()
             for t in (p, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])]
    return [float(t.double().sum()) for t in local]


def fs_type(path: Path) -> str:
    """The filesystem holding path (/proc/mounts' longest matching mount point): tmpfs would measure RAM."""
    path, best = str(Path(path).resolve()), ("", "?")
    with open("/proc/mounts") as f:
        for line in f:
            mount, kind = line.split()[1:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                best = (mount, kind)
    return best[1]


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def drop_page_cache(root: Path) -> None:
    """Evict the (fsynced, so clean) pages of every file under root, so the next read hits the disk."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(op: str, shape: dict, layers: int, ckpt_dir: Path, device: torch.device) -> dict:
    """Build the model, run one op (timed), return its row."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    import checkpoint
    from distributed import Dist

    with socket.socket() as s:  # a free port for the 1-rank process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    model, optimizer = build(shape, layers, device)
    d, full_file = Dist(0, 1, device), ckpt_dir / "full" / "state.pt"
    fmt, what = op.split("-")
    if what == "load":  # the build is seeded, so the checkpoint holds these values: zeroed, the load must restore them
        want = fingerprint(model, optimizer)
        with torch.no_grad():
            for p in model.parameters():
                for t in (p, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]):
                    t.zero_()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = rss_gib()
    t0 = time.perf_counter()
    if op == "full-save":
        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full_file.parent.mkdir(parents=True, exist_ok=True)
        with open(full_file, "wb") as f:
            torch.save({"model": msd, "optimizer": osd}, f)
            f.flush()
            os.fsync(f.fileno())
    elif op == "full-load":
        state = torch.load(full_file, map_location="cpu", weights_only=False)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
    elif op == "dcp-save":
        checkpoint.save_checkpoint(ckpt_dir / "dcp", 1, {"step": 1}, model, optimizer, d)
    else:
        checkpoint.load_latest(ckpt_dir / "dcp", model, optimizer, d)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    written = ckpt_dir / ("full" if op.startswith("full") else "dcp")
    if op.endswith("save"):
        drop_page_cache(written)
    restored = fingerprint(model, optimizer) == want if what == "load" else None
    dist.destroy_process_group()
    return {"mode": fmt, "op": what, "seconds": round(seconds, 3), "restored": restored,
            "ckpt_gb": round(sum(f.stat().st_size for f in written.rglob("*") if f.is_file()) / 1e9, 6),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),  # KiB on Linux
            "rss_before_gib": round(rss_before, 3),
            "gpu_peak_gib": round(gpu_peak, 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="auto", help="decoder layers (8B has 32), or auto (see the docstring)")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU smoke run) instead of the 8B shape")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written (removed after)")
    p.add_argument("--out", default=str(RESULTS), help="dir for checkpoint.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--worker", choices=OPS, help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    p.add_argument("--records", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = TINY if args.tiny else L8B
    if args.worker:
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)  # set_device needs the index
        row = worker(args.worker, shape, int(args.layers), Path(args.ckpt_dir), device)
        emit(args.records, row)
        return row
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    layers = auto_layers(shape, Path(args.dir), args.device) if args.layers == "auto" else int(args.layers)
    layer, rest = param_counts(shape)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{layers} layers: {(rest + layers * layer) / 1e9:.2f}B parameters, "
          f"{(rest + layers * layer) * BYTES_PER_PARAM / 1e9:.1f} GB of fp32 weights + Adam moments", flush=True)
    ckpt_dir, runs = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)), []
    logs = ckpt_dir / "logs"  # (printed when an op fails; removed with the checkpoints)

    def job(op):
        argv = [sys.executable, "-m", "bench.checkpoint", "--worker", op, "--layers", str(layers),
                "--ckpt-dir", str(ckpt_dir), "--device", args.device, "--records", str(logs / f"{op}.jsonl"),
                *(["--tiny"] if args.tiny else [])]
        return Job(op, argv, logs / f"{op}.log", logs / f"{op}.jsonl")

    def on_done(job):
        rows = read_records(job.records)
        if job.status != "ok" or not rows:  # every later op needs this one's checkpoint
            raise SystemExit(f"error: {job.label} failed (exit {job.rc}); its log is above")
        runs.append({"workload": f"llama31_8b_shape_{layers}_layers" if not args.tiny else "tiny", **rows[-1]})
        print(json.dumps(runs[-1]), flush=True)
        if job.label == "full-load":  # one checkpoint on disk at a time
            shutil.rmtree(ckpt_dir / "full")

    try:  # a fresh process per op: ru_maxrss is that op's peak alone
        run_jobs([job(op) for op in OPS], on_done, poll_s=0.2, stream=None, tag="checkpoint")
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    path = write_results("checkpoint", runs, Path(args.out), device=device, layers=layers, fs=fs_type(Path(args.dir)),
                         params=rest + layers * layer, layer_gb=layer * BYTES_PER_PARAM / 1e9,
                         full_32_layer_gb=(rest + 32 * layer) * BYTES_PER_PARAM / 1e9 if not args.tiny else None)
    print(f"wrote {path}")
    return runs


if __name__ == "__main__":
    main()
