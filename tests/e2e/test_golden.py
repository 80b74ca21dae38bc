"""Golden trajectory: tiny_cpu's first steps, metric by metric, against tests/assets/tiny_cpu_golden.json.

A refactor that should keep behaviour identical must keep this test green. Regenerate the file only
for a change meant to alter the numbers, and say so in the commit:

    python tests/e2e/test_golden.py --write

Host independence. The FP8 emulation rounds to e4m3, so a last-bit difference anywhere upstream of a
quantizer (a GEMM's summation order, a vectorised exp, a norm's reduction) flips a rounding now and
then, and from there the trajectories part: on 2 cores, AVX2 and AVX-512 kernels left each other at
step 3 and disagreed on val/accuracy by step 10. So the run pins the code paths that differ between
x86-64 hosts (PINNED_ENV): ATen's baseline kernels instead of its AVX2/AVX-512 dispatch, MKL's
Conditional Numerical Reproducibility mode (the same SSE2 code on any x86 CPU, Intel or AMD), oneDNN
capped at SSE4.1, one thread. With it the trajectory is bit-identical whatever the host's SIMD width
or the caller's own ATEN_CPU_CAPABILITY / MKL_ENABLE_INSTRUCTIONS / thread count (checked by
tests/e2e/test_host_independence.py). One path escaped the pins: torch's default CPU AdamW takes a
float32 sqrt that is not correctly rounded and rounds differently on an Intel Xeon with AVX-512 FP16/AMX
than on an AMD EPYC (same inputs; the trajectories parted at step 6), so the optimizer runs the fused CPU
kernel (optimizer.py). The file holds on both (2026-12-06). To find such an op on a new host:

    python tests/e2e/test_golden.py --op-trace here.jsonl.gz      # on each host
    python tests/e2e/test_golden.py --compare here.jsonl.gz there.jsonl.gz

The tolerances are for metrics summed in another order by a refactor; a changed sample, loss term or
update moves them by more, which the two probe tests show. Timing metrics (time/, perf/) are left out.
"""

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # conftest, also when this file runs as a script (--write)
from conftest import train_cmd  # noqa: E402
GOLDEN = ROOT / "tests/assets/tiny_cpu_golden.json"
OVERRIDES = ["train.steps=10", "train.val_every=5", "train.ckpt_every=0", "log.tensorboard=false",
             "log.dump_episodes_every=0"]
RTOL, ATOL = 1e-4, 1e-7
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
              "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Mutations the golden must catch (run before train_grpo.py, in its process).
PROBES = {
    # one more loss term: + 1e-3 * the mean response-token logprob
    "loss_term": """
import losses.grpo as g
_loss = g.grpo_loss
def grpo_loss(logp, old_logp, rollout_logp, advantages, mask, *a, **k):
    loss, m = _loss(logp, old_logp, rollout_logp, advantages, mask, *a, **k)
    return loss + 1e-3 * (logp * mask).sum() / mask.sum(), m
g.grpo_loss = grpo_loss
""",
    # one sampled token of the first rollout replaced by another
    "sampled_token": """
import engines.hf as h
_generate, _done = h.HFEngine.generate, []
def generate(self, prompt_ids, n, temperature, *a, **k):
    samples = _generate(self, prompt_ids, n, temperature, *a, **k)
    if temperature > 0 and not _done:
        s = samples[0]
        s.token_ids[0] = 1 + s.token_ids[0] % (len(self.tokenizer) - 1)
        _done.append(1)
    return samples
h.HFEngine.generate = generate
""",
}


def run_tiny_cpu(out_dir: Path, patch: str = "") -> list[dict]:
    """tiny_cpu for 10 steps in a child process under PINNED_ENV, `patch` (Python) executed first."""
    argv = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={out_dir}", "train.run_name=golden",
            *OVERRIDES]
    p = subprocess.run(train_cmd(*argv, patch=patch), cwd=out_dir, capture_output=True, text=True, timeout=600,
                       env={**os.environ, **PINNED_ENV})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out_dir / "golden/metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def differences(rows: list[dict], golden: list[dict]) -> list[str]:
    """Every metric of every step that is not within RTOL/ATOL of the golden one."""
    if [r["step"] for r in rows] != [r["step"] for r in golden]:
        return [f"steps {[r['step'] for r in rows]} != golden {[r['step'] for r in golden]}"]
    bad = []
    for got, want in zip(rows, golden):
        if set(got) != set(want):
            bad.append(f"step {want['step']}: metrics differ {sorted(set(got) ^ set(want))}")
        for k, w in want.items():
            g = got.get(k)
            if not (g == w or (isinstance(w, float) and isinstance(g, float)
                               and math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL))):
                bad.append(f"step {want['step']} {k}: {g} != golden {w}")
    return bad


def test_tiny_cpu_matches_golden(tmp_path):
    bad = differences(run_tiny_cpu(tmp_path), json.loads(GOLDEN.read_text()))
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_golden_catches(probe, tmp_path):
    """The comparison is not vacuous: one extra loss term at 1e-3, or one changed token of 2,048 sampled
    at step 0, leaves the golden trajectory."""
    bad = differences(run_tiny_cpu(tmp_path, PROBES[probe]), json.loads(GOLDEN.read_text()))
    assert bad, f"{probe}: the trajectory still matches the golden one"
    print(f"{probe}: {len(bad)} differences, first: {bad[0]}")


# Per-op checksums of the golden run: every ATen op's inputs and outputs hashed, in order, with the repo line
# that called it. Run on two hosts and compare: the first op whose inputs agree and outputs differ is the one
# that takes another path on the other host.
OP_TRACE = """
import atexit, gzip, hashlib, json, os, traceback
import torch
from torch.utils._python_dispatch import TorchDispatchMode

def _digest(x):
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        t = x.detach().cpu().contiguous().reshape(-1)
        return hashlib.blake2b(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", digest_size=6).hexdigest()
    if isinstance(x, (list, tuple)):
        return [_digest(y) for y in x]
    return None

class _Trace(TorchDispatchMode):
    rows = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        where = next((f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(traceback.extract_stack(limit=14))
                      if f.filename.startswith(os.environ["GOLDEN_ROOT"]) and "/.venv/" not in f.filename), "?")
        uninitialized = "empty" in str(func)  # memory as the allocator left it
        self.rows.append({"op": str(func), "where": where, "in": _digest(list(args)),
                          "out": None if uninitialized else _digest(out)})
        return out

_trace = _Trace()
_trace.__enter__()
def _write():
    with gzip.open(os.environ["GOLDEN_OP_TRACE"], "wt") as f:
        f.writelines(json.dumps(r) + "\\n" for r in _trace.rows)
atexit.register(_write)
"""


def compare_traces(a: Path, b: Path, show: int = 5) -> None:
    """Prints the first ops whose inputs agree and outputs differ between two traces (an op that computes
    differently), after the first op whose outputs differ at all."""
    import gzip
    rows = [[json.loads(line) for line in gzip.open(p, "rt")] for p in (a, b)]
    print(f"{len(rows[0])} vs {len(rows[1])} ops")
    first, shown = None, 0
    for i, (x, y) in enumerate(zip(*rows)):
        if x["op"] != y["op"]:
            print(f"op {i}: the runs part ({x['op']} at {x['where']} vs {y['op']} at {y['where']})")
            return
        if x["out"] != y["out"]:
            if first is None:
                first = i
                print(f"first output difference: op {i}, {x['op']} at {x['where']}")
            if x["in"] == y["in"]:
                print(f"op {i}: {x['op']} at {x['where']}: same inputs, other outputs")
                shown += 1
                if shown == show:
                    return
    if first is None:
        print("no output differs")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--write"]:
        with tempfile.TemporaryDirectory() as d:
            GOLDEN.write_text(json.dumps(run_tiny_cpu(Path(d)), indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    elif len(args) == 2 and args[0] == "--op-trace":  # the golden run, every op hashed -> FILE (.jsonl.gz)
        os.environ.update(GOLDEN_OP_TRACE=str(Path(args[1]).resolve()), GOLDEN_ROOT=str(ROOT))
        with tempfile.TemporaryDirectory() as d:
            run_tiny_cpu(Path(d), OP_TRACE)
        print(f"wrote {args[1]}")
    elif len(args) == 3 and args[0] == "--compare":
        compare_traces(Path(args[1]), Path(args[2]))
    else:
        sys.exit("usage: python tests/e2e/test_golden.py --write | --op-trace FILE | --compare FILE FILE")
