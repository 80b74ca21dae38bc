"""Multi-process data parallel on CPU (gloo + FSDP2): 2 ranks reproduce the 1-rank run, and a
sharded (DCP) checkpoint of either resumes on the other: one checkpoint format for every world size."""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from checkpoint import load_checkpoint
from config import load_config
from errors import UserError

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "log.tensorboard=false", "train.val_every=2",
          "train.steps=3", "rollout.prompts_per_step=8", "train.micro_batch_size=16", "train.device=cpu"]


def torchrun(cwd, nproc, *args, fresh: Path | None = None) -> str:
    """train_grpo.py on nproc gloo ranks (ranks_run); its stdout."""
    p = ranks_run(["--nproc_per_node", str(nproc), str(ROOT / "train_grpo.py"), *args], cwd, fresh, timeout=600,
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, crash_report(p.stderr)
    return p.stdout


def ranks_run(args, cwd, fresh: Path | None, **kwargs) -> subprocess.CompletedProcess:
    """`torchrun --standalone ARGS`, output captured. A rank killed by a signal prints its Python stack
    (faulthandler: conftest), which crash_report shows. fresh: the output dir of a launch that starts from
    nothing (not a resume); such a launch, a rank of which died of a signal (a native crash inside torch or
    gloo, never an error the run raised), runs once more from scratch, the first crash's stack in a warning."""
    run = functools.partial(subprocess.run, [sys.executable, "-m", "torch.distributed.run", "--standalone", *args],
                            cwd=cwd, capture_output=True, text=True, **kwargs)
    p = run()
    if p.returncode and fresh is not None and (sig := crash_signal(p.stderr)):
        warnings.warn(f"a rank of {fresh.name} died of {sig}; run again from scratch:\n{crash_report(p.stderr)}")
        shutil.rmtree(fresh, ignore_errors=True)
        p = run()  # the same command
    return p


def crash_signal(stderr: str) -> str | None:
    """The signal that killed the first rank to fail (torchrun's "Root Cause" exit code), e.g. "SIGSEGV"."""
    m = re.search(r"Root Cause.*?exitcode\s*:\s*-(\d+)", stderr, re.S)
    return signal.Signals(int(m[1])).name if m else None


def crash_report(stderr: str) -> str:
    """The end of a failed launch's stderr, after faulthandler's stack of a crashed rank if there is one."""
    at = stderr.find("Fatal Python error")
    return (stderr[at:at + 3000] + "\n...\n" if at >= 0 else "") + stderr[-4000:]


def test_a_rank_killed_by_a_signal_is_named_with_its_stack(tmp_path):
    """What torchrun prints when a rank segfaults: crash_signal names the signal (the retry's condition) and
    crash_report leads with the rank's Python stack."""
    (tmp_path / "crash.py").write_text("import ctypes, os, time\n"
                                       "if os.environ['RANK'] == '1':\n    ctypes.string_at(0)\ntime.sleep(30)\n")
    p = ranks_run(["--nproc_per_node", "2", str(tmp_path / "crash.py")], tmp_path, None, timeout=120)
    assert p.returncode != 0 and crash_signal(p.stderr) == "SIGSEGV", p.stderr[-3000:]
    report = crash_report(p.stderr)
    assert report.startswith("Fatal Python error: Segmentation fault") and "crash.py" in report
    assert crash_signal("Root Cause (first observed failure):\n  exitcode  : 1 (pid: 7)") is None


def test_a_launch_whose_rank_crashed_runs_once_more_from_scratch(tmp_path):
    """ranks_run with fresh: rank 1 segfaults in the first launch only, leaving a file in the run dir; the retry
    removes that dir first (rank 1 fails if it finds the file) and passes, the crash in a warning. Without
    fresh, a crash is not retried. Rank 0 only exits: a rank of its own that read the file could see it made
    in the same launch and fail first, and torchrun would name that failure instead of the crash."""
    (tmp_path / "once.py").write_text(
        "import ctypes, os, sys\nfrom pathlib import Path\nout, crashed = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "if os.environ['RANK'] == '1':\n"
        "    if (out / 'left').exists(): sys.exit(3)\n"
        "    if not crashed.exists():\n"
        "        out.mkdir(); (out / 'left').touch(); crashed.touch(); ctypes.string_at(0)\n")
    run = ["--nproc_per_node", "2", str(tmp_path / "once.py"), str(tmp_path / "run"), str(tmp_path / "crashed")]
    with pytest.warns(UserWarning, match=r"a rank of run died of SIGSEGV; run again from scratch:\nFatal Python error"):
        assert ranks_run(run, tmp_path, tmp_path / "run", timeout=120).returncode == 0
    (tmp_path / "crashed").unlink()
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    assert crash_signal(ranks_run(run, tmp_path, None, timeout=120).stderr) == "SIGSEGV"


def read(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def launch(tmp_path, name, nproc, extra=()):
    torchrun(tmp_path, nproc, *COMMON, f"train.out_dir={tmp_path}", f"train.run_name={name}", *extra,
             fresh=tmp_path / name)
    return read(tmp_path / name)


def by_step(metrics, key):
    return [m[key] for m in metrics if key in m]


def ckpt(run_dir, step):
    return load_checkpoint(run_dir / f"checkpoints/step_{step:06d}")


RUNS_EXTRA = ["fp8.train=false", "fp8.rollout=false", "train.ckpt_every=2", "log.save_batch_every=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    """{world size: run dir} of the same 3 steps (FP8 off) on 1 and on 2 ranks; checkpoints at steps 2, 3."""
    out = tmp_path_factory.mktemp("dist")
    return {n: launch(out, f"world{n}", n, RUNS_EXTRA) and out / f"world{n}" for n in (1, 2)}


def test_two_ranks_reproduce_one_rank(runs):
    """Same global batch split over 2 FSDP2 ranks: same rollouts (per-sample seeds), same rewards,
    and the same gradients (norm to fp32 rounding) step after step; checkpoints hold full tensors
    in one format (model and optimizer state keyed by parameter name)."""
    one, two = read(runs[1]), read(runs[2])
    for key in ("reward/mean", "response/length_mean", "val/accuracy"):
        assert by_step(one, key) == by_step(two, key), key
    torch.testing.assert_close(by_step(two, "optim/grad_norm"), by_step(one, "optim/grad_norm"), rtol=1e-5, atol=0)
    torch.testing.assert_close(by_step(two, "mismatch/kl"), by_step(one, "mismatch/kl"), rtol=0, atol=1e-6)
    a, b = ckpt(runs[1], 3), ckpt(runs[2], 3)
    assert a["model"].keys() == b["model"].keys() and a["world"] == 1 and b["world"] == 2
    # AdamW divides each gradient by its running RMS: the ranks' other fp32 summation order (~1e-7 of a
    # gradient) moves a weight with a tiny gradient by up to ~1% of one step (lr 1e-3), 1e-6 measured
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-4, atol=1e-5)
    assert list(a["optimizer"]["state"]) == list(b["optimizer"]["state"]) == list(a["model"])
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def test_packed_micro_batches_match_row_micro_batches(runs, tmp_path):
    """train.pack_micro_batches on 2 FSDP2 ranks: rows packed into micro-batches of 2 x 34 tokens (2 rows of
    the longest; as many on both ranks, whatever their rows' lengths: each forward is collective) compute
    the 16-row micro-batches' steps. The loss is normalised over the mini-batch, so only the float
    rounding differs."""
    packed = launch(tmp_path, "packed", 2, [*RUNS_EXTRA, "train.micro_batch_size=2", "train.pack_micro_batches=true"])
    rows = read(runs[2])
    for key in ("reward/mean", "response/length_mean"):
        assert by_step(packed, key) == by_step(rows, key), key
    for key in ("optim/grad_norm", "loss/policy", "policy/entropy"):
        torch.testing.assert_close(by_step(packed, key), by_step(rows, key), rtol=1e-4, atol=1e-7, msg=key)


def test_saved_batch_holds_every_ranks_rows(runs):
    """log.save_batch_every on 2 ranks writes the whole global batch (gathered, in rank order), the
    same rows as the 1-rank run's."""
    from observe import load_rollout_batch

    a, b = (load_rollout_batch(r / "batches" / "step_000002.pt") for r in (runs[1], runs[2]))
    assert a["input_ids"].shape[0] == b["input_ids"].shape[0] == 8 * 8  # prompts_per_step x n
    L = a["mask"].shape[1]  # each rank pads to its own longest row; the gather pads to the longest
    assert torch.equal(b["mask"][:, :L], a["mask"]) and not b["mask"][:, L:].any()
    assert torch.equal(b["rewards"], a["rewards"])
    assert torch.equal(b["input_ids"][:, :L] * a["mask"], a["input_ids"] * a["mask"])
    for k in ("rollout_logp", "old_logp"):  # step 2: the weights agree to fp32 rounding (see above)
        torch.testing.assert_close(b[k][:, :L] * a["mask"], a[k] * a["mask"], rtol=0, atol=1e-4)


def assert_same_optimizer(got: dict, want: dict, rel: float = 0.0):
    """Same step counts, and Adam moments equal (rel=0) or within rel of the reference tensor's norm: moments
    summed from gradients that differ at fp32 rounding (1 vs 2 ranks) differ most where they nearly cancel,
    so an elementwise bound there depends on the host; a dropped or restarted state is off by O(1)."""
    assert list(got["state"]) == list(want["state"])
    for name, s in want["state"].items():
        assert int(got["state"][name]["step"]) == int(s["step"]), name
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = got["state"][name][k], s[k]
            assert torch.equal(a, b) if rel == 0 else (a - b).norm() <= rel * b.norm(), \
                f"{name} {k}: {float((a - b).norm() / b.norm().clamp(min=1e-30)):.2e} relative"


@pytest.mark.parametrize("written, resumed", [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_world_size(runs, tmp_path, written, resumed):
    """The step-2 checkpoint of the `written`-rank run, resumed on `resumed` ranks for step 3, ends
    where the uninterrupted `resumed`-rank run does: step 2 (loaded weights) logs its metrics, and
    the step-3 weights and Adam state (which the loaded moments and step count shape) match it
    to fp32 rounding. Dropped optimizer state would restart Adam at step 1: other weights."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs[written], run_dir)
    shutil.rmtree(run_dir / "checkpoints/step_000003")
    out = torchrun(tmp_path, resumed, "--resume", str(run_dir), "train.steps=3")
    assert f"resuming a {written}-rank checkpoint on {resumed} rank{'s' * (resumed > 1)}" in out
    assert f"resumed from {run_dir / 'checkpoints'}/step_000002 at step 2" in out
    got, want = read(run_dir), read(runs[resumed])
    assert [m["step"] for m in got] == [m["step"] for m in want]  # one record per step (and the final val)
    for key in ("reward/mean", "response/length_mean", "val/accuracy"):
        assert by_step(got, key) == by_step(want, key), key
    torch.testing.assert_close(by_step(got, "optim/grad_norm"), by_step(want, "optim/grad_norm"), rtol=1e-5, atol=0)
    torch.testing.assert_close(by_step(got, "mismatch/kl"), by_step(want, "mismatch/kl"), rtol=0, atol=1e-6)
    a, b = ckpt(run_dir, 3), ckpt(runs[resumed], 3)
    assert a["world"] == resumed and a["model"].keys() == b["model"].keys()
    for k in b["model"]:  # (dropped Adam state moves them by ~1e-3)
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5)
    assert_same_optimizer(a["optimizer"], b["optimizer"], rel=1e-3)


RESHARD = """
import sys
sys.path.insert(0, {root!r})
import torch
import distributed
from checkpoint import load_latest, save_checkpoint
from config import load_config
from modeling import load_model_and_tokenizer

run_dir, out = sys.argv[1:]
cfg = load_config(run_dir + "/config.yaml", ["rollout.prompts_per_step=12"])  # whole groups on 1, 2 or 3 ranks
d = distributed.init(cfg)
torch.manual_seed(d.rank + 7)  # other initial weights than the run's: the load must overwrite every one
model, _ = load_model_and_tokenizer(cfg.model, d.device)
distributed.shard(model, d, bf16_compute=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)  # lr and the rest come from the checkpoint
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)  # as in training: adds initial_lr
path, meta = load_latest(run_dir + "/checkpoints", model, optimizer, d)
save_checkpoint(out, meta["step"], {{"step": meta["step"], "from": str(path)}}, model, optimizer, d)
distributed.close(d)
"""


@pytest.mark.parametrize("written, resumed", [(2, 1), (1, 2), (2, 3)])
def test_checkpoint_loads_exactly_on_another_world_size(runs, tmp_path, written, resumed):
    """A `written`-rank checkpoint loaded on `resumed` ranks (DCP reshards the FSDP2 shards) and
    saved again from there is the same checkpoint bit for bit: weights, Adam moments and step
    counts, param groups (lr included). 2 -> 3: N -> M ranks on both sides (the path of 8 -> 4),
    with shards that do not divide evenly (FSDP2 pads dim 0 to a multiple of the world size)."""
    script = tmp_path / "reshard.py"
    script.write_text(RESHARD.format(root=str(ROOT)))
    p = ranks_run(["--nproc_per_node", str(resumed), str(script), str(runs[written]), str(tmp_path / "out")],
                  tmp_path, None, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, crash_report(p.stderr)
    want, got = ckpt(runs[written], 3), load_checkpoint(tmp_path / "out/step_000003")
    assert got["world"] == resumed and want["world"] == written and len(got["rng"]) == resumed
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert_same_optimizer(got["optimizer"], want["optimizer"])
    for n in want["optimizer"]["state"]:
        assert torch.equal(got["optimizer"]["state"][n]["step"], want["optimizer"]["state"][n]["step"]), n
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]


def test_full_state_loads_in_one_process(runs, tmp_path):
    """distributed.load_full_state on 1 rank (single-file checkpoints of earlier versions): full
    tensors of a 2-rank run load exactly, also with optimizer state keyed by index (the oldest
    format); export_hf reads a 2-rank DCP checkpoint like a 1-rank one."""
    import distributed
    import export_hf
    from modeling import load_model_and_tokenizer

    state, d = ckpt(runs[2], 2), distributed.Dist()
    cfg = load_config(runs[2] / "config.yaml")
    names = list(state["optimizer"]["state"])
    by_index = {**state["optimizer"], "state": {i: state["optimizer"]["state"][n] for i, n in enumerate(names)},
                "param_groups": [{**g, "params": [names.index(n) for n in g["params"]]}
                                 for g in state["optimizer"]["param_groups"]]}
    for optim_sd in (state["optimizer"], by_index):
        model, _ = load_model_and_tokenizer(cfg.model, torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
        distributed.load_full_state(model, optimizer, state["model"], optim_sd, d)
        for k, v in model.state_dict().items():
            assert torch.equal(v, state["model"][k]), k
        for n, p in model.named_parameters():
            assert torch.equal(optimizer.state[p]["exp_avg"], state["optimizer"]["state"][n]["exp_avg"]), n
            assert int(optimizer.state[p]["step"]) == 2
        # and what this process would save again is the checkpoint's optimizer state
        assert_same_optimizer(distributed.full_state(model, optimizer, d)[1], state["optimizer"])
    out = export_hf.main([str(runs[2] / "checkpoints/step_000002"), str(tmp_path / "hf")])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, state["model"][k]), k


def test_compiled_layers_under_fsdp2_match_eager(runs, tmp_path):
    """train.compile=aot_eager on 2 FSDP2 ranks (compiled layer forwards, FSDP2's all-gather hooks
    outside them) reproduces the eager 2-rank run step by step."""
    compiled = launch(tmp_path, "compiled", 2, [*RUNS_EXTRA, "train.compile=aot_eager"])
    eager = read(runs[2])
    for key in ("reward/mean", "val/accuracy", "loss/policy", "optim/grad_norm"):
        assert by_step(compiled, key) == pytest.approx(by_step(eager, key), rel=1e-6, abs=1e-9), key


def test_compiled_fp8_layers_under_fsdp2_with_recompute(tmp_path):
    """FP8 linears, gradient checkpointing and compiled layers on 2 FSDP2 ranks, rows of varied length:
    the layers' graph variants (grad mode, input grad, lengths, FP8 row padding, masks) pass dynamo's
    default limit of 8, where a layer would run eager in its backward recompute after a compiled
    forward (CheckpointError). The run completes and matches the eager run step by step."""
    extra = ["model.gradient_checkpointing=true", "rollout.max_new_tokens=8", "rollout.prompts_per_step=32",
             "train.val_every=0"]
    compiled = launch(tmp_path, "compiled", 2, [*extra, "train.compile=aot_eager"])
    eager = launch(tmp_path, "eager", 2, extra)
    assert len(by_step(compiled, "optim/grad_norm")) == 3
    graphs = by_step(compiled, "compile/graphs")  # the layer's variants, compiled as they first appear (5, 5, 9 here)
    assert len(graphs) == 3 and graphs == sorted(graphs) and graphs[0] > 0 and not by_step(eager, "compile/graphs")
    assert not by_step(compiled, "compile/graph_breaks")  # the FP8 linears traced into the layers' graphs
    for key in ("reward/mean", "loss/policy", "optim/grad_norm"):
        assert by_step(compiled, key) == pytest.approx(by_step(eager, key), rel=1e-5, abs=1e-9), key


def test_two_ranks_with_fp8_emulation_stay_close(tmp_path):
    """FP8 on: the 1x128 gradient tiles of the weight-gradient GEMM run along tokens, so they group
    different tokens when the batch is split: same rollouts, gradients equal only to FP8 precision."""
    one, two = launch(tmp_path, "one", 1), launch(tmp_path, "two", 2)
    assert by_step(one, "reward/mean")[0] == by_step(two, "reward/mean")[0]
    torch.testing.assert_close(by_step(two, "optim/grad_norm")[0], by_step(one, "optim/grad_norm")[0],
                               rtol=0.02, atol=0)


def test_moe_router_replay_under_fsdp2_and_compile(tmp_path):
    """tiny_moe_cpu (emulated FP8 experts, router replay) on 2 FSDP2 ranks: the replay and routing
    hooks run outside the compiled layer forwards, so train.compile=aot_eager reproduces the eager run
    step by step, replayed routing included; and 2 ranks stay within FP8 precision of 1 (as dense FP8).
    aux_loss_coef 0: the load-balancing loss is per micro-batch, whose rows differ with the world size."""
    moe = ["--config", str(ROOT / "configs/tiny_moe_cpu.yaml"), *COMMON[2:], "moe.aux_loss_coef=0",
           f"train.out_dir={tmp_path}"]
    for name, nproc, extra in (("one", 1, []), ("eager", 2, []), ("compiled", 2, ["train.compile=aot_eager"])):
        torchrun(tmp_path, nproc, *moe, f"train.run_name={name}", *extra, fresh=tmp_path / name)
    one, eager, compiled = (read(tmp_path / n) for n in ("one", "eager", "compiled"))
    for key in ("reward/mean", "optim/grad_norm", "moe/routing_mismatch", "mismatch/token_mult_prob_error"):
        assert by_step(compiled, key) == pytest.approx(by_step(eager, key), rel=1e-6, abs=1e-9), key
    assert by_step(one, "reward/mean")[0] == by_step(eager, "reward/mean")[0]
    torch.testing.assert_close(by_step(eager, "optim/grad_norm"), by_step(one, "optim/grad_norm"), rtol=0.02, atol=0)


# tiny_cpu at twice its width: every FP8 weight splits into whole 128-row blocks on 2 ranks
WIDE = ["model.tiny.hidden_size=256", "model.tiny.intermediate_size=512", "model.tiny.num_heads=8",
        "model.tiny.num_kv_heads=8"]


def test_weight_cache_over_fsdp2_gathers_fp8_and_trains_the_same(tmp_path):
    """fp8.cache_weights on 2 ranks: FSDP2 all-gathers every FP8 weight as FP8 bytes and block scales, each
    rank's shard quantized once per optimizer step (fp8/fast/gather.py). With compiled layers and
    recompute, the run is the one without it step by step (same bytes in every GEMM), and its checkpoint
    holds the same plain tensors."""
    extra = [*WIDE, "train.compile=aot_eager", "model.gradient_checkpointing=true", "train.ckpt_every=2",
             "train.val_every=0"]
    out = torchrun(tmp_path, 2, *COMMON, f"train.out_dir={tmp_path}", "train.run_name=gather", "fp8.cache_weights=true",
                   *extra)
    assert "8 FP8 weights all-gathered in FP8" in out
    plain, gather = launch(tmp_path, "plain", 2, [*extra, "fp8.cache_weights=false"]), read(tmp_path / "gather")
    assert len(by_step(gather, "optim/grad_norm")) == 3
    for key in ("reward/mean", "loss/policy", "optim/grad_norm", "mismatch/token_mult_prob_error"):
        assert by_step(gather, key) == by_step(plain, key), key
    a, b = ckpt(tmp_path / "gather", 2)["model"], ckpt(tmp_path / "plain", 2)["model"]
    assert a.keys() == b.keys() and all(type(t) is torch.Tensor and torch.equal(t, b[k]) for k, t in a.items())


def test_prompts_must_split_into_whole_groups(monkeypatch):
    import distributed

    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config(None, ["rollout.prompts_per_step=8", "train.device=cpu"])
    with pytest.raises(UserError, match="prompts_per_step=8 is not divisible by the 3 ranks"):
        distributed.init(cfg)
    cfg = load_config(None, ["rollout.prompts_per_step=9", "train.mini_batch_size=8", "train.micro_batch_size=4", "train.device=cpu"])
    with pytest.raises(UserError, match="mini_batch_size=8 is not divisible by the 3 ranks"):
        distributed.init(cfg)


def test_memory_metrics_are_per_step(monkeypatch):
    """mem/peak_gib is the device memory in use at its peak since the previous call (not torch's allocator
    peak, which counts vLLM's sleeping pool); mem/alloc_retries is reset after reading."""
    import distributed

    cuda = torch.device("cuda", 0)
    used = iter([5, 9, 7, 4, 4, 4, 4])  # GiB in use at successive samples
    state = {"num_alloc_retries": 2}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (140 * 2**30 - next(used) * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: dict(state))
    monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda device: state.update({"num_alloc_retries": 0}))
    monkeypatch.setattr(distributed, "_PEAKS", {cuda: distributed.DevicePeak(cuda, poll_s=None)})
    peak = distributed._PEAKS[cuda]
    peak.sample(), peak.sample()  # the poller's samples: 5, then 9 (a peak since released)
    assert distributed.memory_metrics(cuda) == {"mem/peak_gib": 9.0, "mem/alloc_retries": 2.0}  # now 7; then 4
    assert distributed.memory_metrics(cuda) == {"mem/peak_gib": 4.0, "mem/alloc_retries": 0.0}
    assert distributed.memory_metrics(torch.device("cpu")) == {}


RENDEZVOUS = """
import datetime, os, socket, sys
import torch.distributed as dist
from engines.vllm import own_rendezvous
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
guard = own_rendezvous(1) if sys.argv[1] == "guarded" else open(os.devnull)
with guard:  # as vLLM 0.26 starts a one-rank engine: its own group on a fresh TCP port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0,
                            timeout=datetime.timedelta(seconds=60 if sys.argv[1] == "guarded" else 3))
print("agent store after:", os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
"""


@pytest.mark.parametrize("mode", ["guarded", "bare"])
def test_one_rank_engine_rendezvous_under_torchrun(tmp_path, mode):
    """`torchrun --nproc_per_node 1`: a one-rank engine's own TCP process group starts inside
    engines.vllm.own_rendezvous, and times out without it (torchrun's agent-store flag makes torch
    dial the fresh port as a client); the flag is back afterwards."""
    (tmp_path / "rdzv.py").write_text(RENDEZVOUS)
    p = ranks_run(["--nproc_per_node", "1", str(tmp_path / "rdzv.py"), mode], tmp_path, None, timeout=120,
                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    if mode == "guarded":
        assert p.returncode == 0 and "agent store after: True" in p.stdout, p.stderr[-2000:]
    else:
        assert p.returncode != 0 and "DistNetworkError" in p.stderr, p.stderr[-2000:]
