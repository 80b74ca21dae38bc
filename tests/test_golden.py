"""Golden trajectory: tiny_cpu's first steps, metric by metric, against tests/assets/tiny_cpu_golden.json.

A refactor that should keep behaviour identical must keep this test green. Regenerate the file only
for a change meant to alter the numbers, and say so in the commit:

    python tests/test_golden.py --write

Timing metrics (time/, perf/) are left out. The tolerances absorb BLAS and thread-count rounding
between hosts (metrics agree to ~1e-6 there); a changed sample, loss term or update moves them by more.
"""

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests/assets/tiny_cpu_golden.json"
OVERRIDES = ["train.steps=10", "train.val_every=5", "train.ckpt_every=0", "log.tensorboard=false",
             "log.dump_episodes_every=0"]
RTOL, ATOL = 1e-3, 1e-5


def run_tiny_cpu(out_dir: Path) -> list[dict]:
    p = subprocess.run([sys.executable, str(ROOT / "train_grpo.py"), "--config", str(ROOT / "configs/tiny_cpu.yaml"),
                        f"train.out_dir={out_dir}", "train.run_name=golden", *OVERRIDES],
                       cwd=out_dir, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out_dir / "golden/metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def test_tiny_cpu_matches_golden(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    rows = run_tiny_cpu(tmp_path)
    assert [r["step"] for r in rows] == [r["step"] for r in golden]
    bad = []
    for got, want in zip(rows, golden):
        assert set(got) == set(want), (got["step"], set(got) ^ set(want))
        for k, w in want.items():
            g = got[k]
            if not (g == w or (isinstance(w, float) and math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL))):
                bad.append(f"step {want['step']} {k}: {g} != golden {w}")
    assert not bad, "\n".join(bad[:20])


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_golden.py --write")
    with tempfile.TemporaryDirectory() as d:
        GOLDEN.write_text(json.dumps(run_tiny_cpu(Path(d)), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
