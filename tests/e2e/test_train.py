"""End to end on CPU: the tiny run learns; the run interface; bad input exits with one line."""

import json
import os
import subprocess

import pytest
import torch

from checkpoint import latest_checkpoint
from conftest import ROOT, TINY_RUN, read_metrics, run_train, train_cmd


def run(args, cwd):
    """train_grpo.py in a child process (its own torch and compile state, as a user runs it)."""
    return subprocess.run(train_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=900)


def test_tiny_cpu_learns_with_emulated_fp8(tmp_path):
    """The embedded default (FP8 emulated on both sides, TIS) raises greedy val accuracy by >= 0.2."""
    p = run(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "train.run_name=e2e", f"train.out_dir={tmp_path}",
             "train.steps=80", "log.tensorboard=false"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    run_dir = tmp_path / "e2e"
    assert p.stdout.splitlines()[0] == f"run_dir: {run_dir}"
    metrics = read_metrics(run_dir)
    acc = [m["val/accuracy"] for m in metrics if "val/accuracy" in m]
    assert acc[-1] - acc[0] >= 0.2, acc
    step0 = metrics[0]
    for key in ("reward/mean", "mismatch/token_mult_prob_error", "mismatch/kl", "loss/policy", "is/truncated_frac",
                "time/step", "time/refit", "optim/grad_norm"):
        assert key in step0, key
    # FP8 W8A8 engine vs FP8 trainer: same quantizer, but activations are quantized with
    # different recipes/orders, so a small nonzero mismatch is expected and bounded
    assert 1.0 <= step0["mismatch/token_mult_prob_error"] < 1.05
    assert (run_dir / "config.yaml").is_file() and list((run_dir / "episodes").glob("*.jsonl"))
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_000080"


@pytest.mark.parametrize("args, message", [
    (["loss.is_capp=5"], "unknown config key 'loss.is_capp'"),
    (["model.name_or_path=/nonexistent/model"], "model.name_or_path: '/nonexistent/model' is not a model directory"),
    (["data.source=jsonl", "data.path=DATA", "data.prompt_field=question"], "no field 'question' (data.prompt_field)"),
])
def test_bad_input_exits_with_one_line(tmp_path, args, message):
    (tmp_path / "d.jsonl").write_text('{"problem": "1+1=", "answer": "2"}\n')
    args = [a.replace("DATA", str(tmp_path / "d.jsonl")) for a in args]
    p = run(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}", *args], cwd=tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert [f.name for f in tmp_path.iterdir()] == ["d.jsonl"]  # no run dir left behind


def test_done_is_the_last_line_on_stdout(tmp_path):
    """The run interface: `run_dir: PATH` first, `done: ...` last, also when the end-of-run checkpoint
    (steps not a multiple of train.ckpt_every) comes after the loop's."""
    run = run_train(*TINY_RUN, f"train.out_dir={tmp_path}", "train.run_name=r", "train.steps=3", "train.ckpt_every=2",
                    "train.val_every=0")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0] == f"run_dir: {tmp_path / 'r'}"
    saved = [line for line in lines if line.startswith("checkpoint: ")]
    assert len(saved) == 2 and "step_000003" in saved[-1], saved
    assert lines[-1] == f"done: 3 steps; final {{}}; run_dir {tmp_path / 'r'}", lines[-3:]


def test_print_config_shows_each_key_with_its_doc_and_trains_nothing(tmp_path):
    """--print-config: the resolved config (file, then overrides) as YAML with each field's doc above it,
    exit 0, no run dir; bad input is still one line and exit 2."""
    from config import load_config, to_dict

    args = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path / 'runs'}", "rollout.n=4"]
    run = run_train("--print-config", *args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rollout:\n" in run.stdout and "  # Samples per prompt (the GRPO group size).\n  n: 4\n" in run.stdout
    assert list(tmp_path.iterdir()) == []  # nothing trained, no run dir
    (tmp_path / "printed.yaml").write_text(run.stdout)
    assert to_dict(load_config(tmp_path / "printed.yaml")) == to_dict(load_config(args[1], args[2:]))
    bad = run_train("--print-config", *args, "train.steps=ten", cwd=tmp_path)
    assert bad.returncode == 2 and bad.error == "error: train.steps: expected an integer, got 'ten'"


def test_fp8_kv_cache_recalibrated_every_step(tmp_path):
    """fp8.kv_cache on the CPU loop: scales recalibrated each step, FP8 attention emulated in the
    engine only, so the engine/trainer mismatch grows but stays small."""
    p = run(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "train.run_name=kv", f"train.out_dir={tmp_path}",
             "train.steps=3", "train.val_every=0", "log.tensorboard=false", "fp8.kv_cache=true"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = read_metrics(tmp_path / "kv")
    assert len(metrics) == 3
    for m in metrics:
        assert m["fp8/q_scale_mean"] > 0 and m["fp8/k_scale_mean"] > 0 and m["time/recalibrate"] > 0
        assert 1.0005 < m["mismatch/token_mult_prob_error"] < 1.1  # without kv emulation: ~1.00001


def frozen_runs(tmp_path, key: str, values, *extra: str) -> dict[str, list[dict]]:
    """{value: metrics} of 2-step tiny_cpu runs with an FP8 KV cache whose weights never move (lr=1e-30:
    lr=0 is refused, and every Adam update, <= ~lr, is below the fp32 resolution of every weight), one per
    value of `key`."""
    common = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}", "train.steps=2",
              "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0", "fp8.kv_cache=true",
              "optim.lr=1e-30", "rollout.prompts_per_step=4", *extra]
    runs = {}
    for value in values:
        p = run([*common, f"train.run_name={value}", f"{key}={value}"], cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[value] = read_metrics(tmp_path / value)
    return runs


@pytest.mark.parametrize("extra", [[], ["train.mini_batch_size=16", "fp8.calib_percentile=100"]])
def test_calib_pass_logprobs_equals_separate_pass_when_weights_do_not_move(tmp_path, extra):
    """fp8.calib_pass=logprobs takes the q/k/v amax from the old_logp forwards (the no-grad pass over every
    mini-batch but the first, and the first's training forward; with one mini-batch that forward alone)
    instead of a separate forward after the update. With lr=1e-30 (lr=0 is refused) every Adam update (<= ~lr)
    is below the fp32 resolution of every weight, so the weights never move, and the separate pass covers
    every row (calib_samples >= batch), so both must give the same scales, step by step, exactly: with one
    micro-batch each, or, with two mini-batches of micro-batches other than the separate pass's, at the
    100th percentile of the micro-batches' amax (the largest: every row's, however grouped)."""
    runs = frozen_runs(tmp_path, "fp8.calib_pass", ("separate", "logprobs"), "fp8.calib_samples=100000", *extra)
    for sep, lp in zip(runs["separate"], runs["logprobs"]):
        for k in ("fp8/q_scale_mean", "fp8/k_scale_mean", "fp8/v_scale_mean", "mismatch/token_mult_prob_error"):
            assert sep[k] == lp[k], (k, sep[k], lp[k])
        assert sep["fp8/k_scale_mean"] > 0


RECORD_OLD_LOGP = """
import json, os, trainer
_loss, _pass, calls = trainer.micro_batch_loss, trainer.logprob_pass, []
def micro_batch_loss(x, *a, **k):  # what each micro-batch's loss compared: its logp against old_logp
    m = x.mask.bool()
    calls.append({"loss": float((x.logp.detach() - x.old_logp)[m].abs().max()), "rows": len(x.logp)})
    return _loss(x, *a, **k)
def logprob_pass(model, input_ids, *a, plan=None, **k):  # the rows each no-grad pass scored
    calls.append({"pass": sum(len(r) for r, _ in plan)})
    return _pass(model, input_ids, *a, plan=plan, **k)
trainer.micro_batch_loss, trainer.logprob_pass = micro_batch_loss, logprob_pass
import atexit; atexit.register(lambda: open(os.environ["RECORD_TO"], "w").write(json.dumps(calls)))
"""


def test_the_first_mini_batch_takes_its_old_logp_from_its_own_forward(tmp_path):
    """train.old_logp=trainer with 2 mini-batches of 2 micro-batches: the no-grad pass scores only the
    second mini-batch's rows; the first's old_logp is its own training forward's, so their PPO ratio is 1 to
    the last bit, while the second's come from the no-grad pass (the fused head, where training goes
    through the unfused one): equal to float rounding on weights that do not move (lr=1e-30); one
    mini-batch: no pass at all. mismatch/* (an FP8 KV cache's, in the engine only) and policy/entropy cover
    every row either way: with weights that do not move, the same as with one mini-batch, to rounding."""
    base = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}", "train.steps=1",
            "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0", "optim.lr=1e-30",
            "rollout.prompts_per_step=8", "train.micro_batch_size=16", "fp8.kv_cache=true"]
    calls, metrics = {}, {}
    for name, mini in (("two", 32), ("one", 0)):
        out = tmp_path / f"{name}.json"
        p = subprocess.run(train_cmd(*base, f"train.run_name={name}", f"train.mini_batch_size={mini}",
                                     patch=RECORD_OLD_LOGP),  # the recorder patched in, in its process
                           cwd=tmp_path, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "RECORD_TO": str(out)})
        assert p.returncode == 0, p.stderr[-3000:]
        calls[name], metrics[name] = json.loads(out.read_text()), read_metrics(tmp_path / name)[0]
    two = calls["two"]
    assert [c.get("pass") for c in two][:1] == [32]  # the second mini-batch's 32 of the 64 rows
    losses = [c["loss"] for c in two if "loss" in c]
    assert len(losses) == 4 and losses[:2] == [0.0, 0.0], losses  # the first mini-batch: its own forward
    assert max(losses[2:]) < 1e-4, losses  # the second: the no-grad pass's, to rounding
    assert [c for c in calls["one"] if "pass" in c] == []  # one mini-batch: no no-grad pass
    assert metrics["one"]["mismatch/token_mult_prob_error"] > 1.0005  # the FP8 KV emulation's, there to see
    for k in ("mismatch/token_mult_prob_error", "mismatch/mean_abs_diff", "policy/entropy"):
        assert metrics["two"][k] == pytest.approx(metrics["one"][k], rel=1e-4), k


def test_old_logp_from_the_rollout_skips_the_pass_and_measures_in_the_first_mini_batch(tmp_path):
    """train.old_logp=rollout: no old_logp forward, so the IS weight is 1 everywhere; mismatch/*,
    policy/entropy and the q/k/v amax (fp8.calib_pass=logprobs) come from the first mini-batch's training
    forward. With weights that never move (lr=1e-30, as above) and one mini-batch, they match what the
    skipped forward gives, up to the batch shapes' float rounding."""
    runs = frozen_runs(tmp_path, "train.old_logp", ("trainer", "rollout"), "fp8.calib_pass=logprobs")
    for old, new in zip(runs["trainer"], runs["rollout"]):
        for k in ("fp8/q_scale_mean", "fp8/k_scale_mean", "fp8/v_scale_mean"):
            assert new[k] == pytest.approx(old[k], rel=1e-3), k
        assert new["mismatch/token_mult_prob_error"] == pytest.approx(old["mismatch/token_mult_prob_error"], abs=1e-4)
        assert old["mismatch/token_mult_prob_error"] > 1.0005  # the FP8 KV emulation's mismatch is there to see
        assert new["is/weight_mean"] == 1.0 and new["is/truncated_frac"] == 0.0 and old["is/weight_mean"] != 1.0
        assert new["policy/entropy"] == pytest.approx(old["policy/entropy"], rel=1e-4)


def test_old_logp_from_the_rollout_steers_the_adaptive_entropy_bonus(tmp_path):
    """loss.entropy_target with either train.old_logp: policy/entropy is logged every step, measured in the
    first mini-batch's training forward, the same in both on the same batch: the weights never move
    (lr=1e-30, as above) and the q/k/v scales come from the separate pass, so both runs sample the same
    batches. The controller steps on the previous step's entropy (the target is above any entropy, so the
    coefficient climbs by its step), with the bonus off on the first step; a resumed run goes on from the
    checkpoint's entropy, not from a first step's."""
    bonus = ["loss.entropy_target=10", "loss.entropy_coef=0.5", "loss.entropy_coef_step=0.25", "train.steps=3"]
    runs = frozen_runs(tmp_path, "train.old_logp", ("trainer", "rollout"), *bonus)
    old, new = runs["trainer"], runs["rollout"]
    assert len(new) == 3 and all("policy/entropy" in m for m in new)
    for o, n in zip(old, new):
        assert n["policy/entropy"] == pytest.approx(o["policy/entropy"], rel=1e-5, abs=0)
        assert n["reward/mean"] == o["reward/mean"]  # the same samples
        assert n["is/weight_mean"] == 1.0
    assert [m["loss/entropy_coef"] for m in old] == [m["loss/entropy_coef"] for m in new] == [0.0, 0.75, 1.0]
    cut = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}", "train.run_name=cut",
           "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0", "fp8.kv_cache=true",
           "optim.lr=1e-30", "rollout.prompts_per_step=4", "train.old_logp=rollout", *bonus]
    p = run([*cut, "train.steps=2", "train.ckpt_every=2", "train.save_final=false"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run(["--resume", str(tmp_path / "cut"), "train.steps=3"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    resumed = read_metrics(tmp_path / "cut")
    assert [m["loss/entropy_coef"] for m in resumed] == [0.0, 0.75, 1.0]
    assert resumed[2]["policy/entropy"] == new[2]["policy/entropy"]


def test_profile_trace_false_writes_the_phase_tables_only(tmp_path):
    p = run(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "train.run_name=prof", f"train.out_dir={tmp_path}",
             "train.steps=2", "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0",
             "rollout.prompts_per_step=4", "log.profile_step=1", "log.profile_trace=false"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(f.name for f in (tmp_path / "prof" / "profile").iterdir()) == ["step_000001_rank0.txt"]
    table = (tmp_path / "prof" / "profile" / "step_000001_rank0.txt").read_text()
    assert table.startswith("phase ") and "rollout " in table and "Self CPU" not in table


@pytest.mark.parametrize("rollout", [True, False])
def test_profile_step_writes_a_trace_and_an_operator_table(tmp_path, rollout):
    p = run(["--config", str(ROOT / "configs/tiny_cpu.yaml"), "train.run_name=prof", f"train.out_dir={tmp_path}",
             "train.steps=2", "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0",
             "rollout.prompts_per_step=4", "log.profile_step=1", f"log.profile_rollout={str(rollout).lower()}"],
            cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    files = sorted(f.name for f in (tmp_path / "prof" / "profile").iterdir())
    assert files == ["step_000001_rank0.json", "step_000001_rank0.txt"]  # only the asked step
    table = (tmp_path / "prof" / "profile" / "step_000001_rank0.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    trace = json.loads((tmp_path / "prof" / "profile" / "step_000001_rank0.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    spans = {e.get("name") for e in trace["traceEvents"]}
    assert "logprobs" in spans and ("rollout" in spans) == rollout  # log.profile_rollout=false: trainer only
    assert f"profile: {tmp_path / 'prof' / 'profile' / 'step_000001_rank0.txt'}" in p.stdout
    # the phase table above the operator table: every profiled phase, CPU run = no device time
    phases = {line.split()[0]: line.split()[1:] for line in table.split("\n\n")[0].splitlines()[1:]}
    assert set(phases) >= {"logprobs", "train", "refit"} and ("rollout" in phases) == rollout, table[:600]
    assert all(float(busy) == 0 for _, busy, _ in phases.values())
    # one mini-batch: its training forward gives old_logp, and the logprobs span holds no pass
    assert all(float(wall) > 0 for name, (wall, _, _) in phases.items() if name != "logprobs"), table[:600]
    records = [json.loads(line) for line in (tmp_path / "prof" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r]
    assert all(r["time/gc"] >= 0 for r in steps)
    assert steps[0]["perf/gc_frozen"] < steps[1]["perf/gc_frozen"]  # the heap is frozen after the first step


def test_phase_busy_is_the_device_time_inside_each_phase():
    from observe import phase_busy

    spans = {"logprobs": [(0, 100)], "train": [(200, 300), (400, 500)]}
    kernels = [(10, 30), (20, 40), (90, 210), (250, 260), (450, 600), (700, 800)]  # ns; overlaps merge
    out = phase_busy(spans, kernels)
    assert out["logprobs"] == (100e-9, 40e-9)  # [10, 40) + [90, 100)
    assert out["train"] == (200e-9, 70e-9)  # [200, 210) + [250, 260) + [450, 500)
    assert phase_busy({"refit": [(0, 10)]}, []) == {"refit": (10e-9, 0.0)}


def test_kernels_count_in_the_phase_whose_span_holds_their_launch():
    from observe import kernels_by_phase

    spans = {"logprobs": [(0, 100)], "train": [(200, 300), (400, 500)]}
    device = [(10, 10, 30, "gemm_a"), (90, 90, 210, "gemm_a"), (250, 250, 270, "b"), (350, 350, 360, "c"),
              (450, 450, 600, "b"), (290, 310, 330, "rsqrt_d"), (470, 610, 640, "b")]  # (launch, start, end) ns
    kernels, by_phase, kinds = kernels_by_phase(spans, device, optimizer=[(460, 480)])  # an OPTIMIZER_SPAN
    assert kernels == {"gemm_a": [140, 2], "b": [200, 3], "c": [10, 1], "rsqrt_d": [20, 1]}  # every kernel
    # "c" is launched between spans; "rsqrt_d", launched in train, runs after its span: it counts in train
    assert by_phase == {"logprobs": {"gemm_a": [140, 2]}, "train": {"b": [200, 3], "rsqrt_d": [20, 1]}}
    assert kinds == {"logprobs": {"gemm": 140}, "train": {"elementwise": 170, "norm": 20, "optimizer": 30}}


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "gemm"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::",
     "attention"),
    ("_quant_dual_kernel", "quant"),
    ("triton_red_fused__to_copy_abs_amax_scalar_tensor_unsqueeze_where_4", "quant"),
    ("triton_fp8_blockwise_act_quant_lhs_kernel", "quant"),
    ("triton_red_fused_add_mean_mul_pow_rsqrt_t_view_3", "norm"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float>", "softmax"),
    ("triton_poi_fused__to_copy_split_with_sizes_1", "copy"),
    ("triton_poi_fused__to_copy_t_6", "copy"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)",
     "copy"),
    ("triton_red_fused__to_copy_add_div_expand_mul_pow_sum_view_10", "norm"),  # RMSNorm's backward, with casts
    ("triton_poi_fused__to_copy_add_mul_silu_3", "elementwise"),  # a cast fused into real work is that work
    ("Memset (Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
])
def test_kernel_kind_sorts_hopper_kernel_names(name, kind):
    from observe import kernel_kind

    assert kernel_kind(name) == kind


def test_kernel_table_ranks_kernels_by_summed_time():
    from observe import kernel_table

    table = kernel_table({"gemm": [3_000_000, 2], "quant": [1_000_000, 4], "nccl": [4_000_000, 1]}, top=2)
    rows = table.splitlines()
    assert [r.split()[0] for r in rows[1:3]] == ["nccl", "gemm"]  # the top 2 by time; quant cut
    assert rows[1].split()[1:] == ["4.0", "50.0%", "1"] and rows[2].split()[1:] == ["3.0", "37.5%", "2"]
    assert rows[3] == "all device kernels: 0.008 s"
    assert kernel_table({}, top=5) == ""  # a CPU run: no device kernels, no table


def test_gc_timer_counts_collections_once():
    import gc

    from observe import gc_timer

    timer = gc_timer()
    assert timer is gc_timer()  # one per process: callbacks do not pile up over train() calls
    timer.take()
    gc.collect(0)
    gc.collect()
    took = timer.take()
    assert took["time/gc"] > took["time/gc_full"] > 0 and took["perf/gc_full"] == 1
    assert timer.take() == {"time/gc": 0.0, "time/gc_full": 0.0, "perf/gc_full": 0}


def test_freeze_gc_heap_spaces_full_collections():
    """After the freeze, young cycles are collected as before, full collections 10x less often."""
    import gc

    from observe import FULL_GC_SPACING, freeze_gc_heap

    threshold = gc.get_threshold()
    try:
        freeze_gc_heap()
        assert gc.get_freeze_count() > 0 and gc.get_threshold() == (*threshold[:2], FULL_GC_SPACING)
        before = [g["collections"] for g in gc.get_stats()]
        survivors = []
        for i in range(700_000):  # young cycles, and a step's survivors: 3 full collections at Python's spacing
            cycle = []
            cycle.append(cycle)
            if i % 10 == 0:
                survivors.append([i])
        young, _, full = (g["collections"] - b for g, b in zip(gc.get_stats(), before))
        assert young >= 800 and full == 0
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


@pytest.mark.parametrize("calib_pass", ["separate", "logprobs"])
def test_compiled_trainer_matches_eager(tmp_path, calib_pass):
    """train.compile=aot_eager (dynamo + AOT autograd, no code generation) reproduces the eager run's
    losses, gradient norms, q/k/v scales and rewards step by step: the FP8 linears, the fused
    projections, the no-grad old_logp forward and the (eager) calibration capture all trace right;
    so does it with fp8.cache_weights (the cached FP8 weights re-quantized after each optimizer step)."""
    common = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}", "train.steps=3",
              "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0", "fp8.kv_cache=true",
              f"fp8.calib_pass={calib_pass}", "rollout.prompts_per_step=8", "train.save_final=false"]
    runs = {}
    for name, backend, cache in (("none", "none", False), ("aot_eager", "aot_eager", False), ("cached", "aot_eager", True)):
        p = run([*common, f"train.run_name={name}", f"train.compile={backend}", f"fp8.cache_weights={cache}"],
                cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = read_metrics(tmp_path / name)
    assert len(runs["none"]) == len(runs["aot_eager"]) == len(runs["cached"]) == 3
    for eager, compiled in [*zip(runs["none"], runs["aot_eager"]), *zip(runs["none"], runs["cached"])]:
        for k in ("loss/policy", "optim/grad_norm", "fp8/q_scale_mean", "fp8/k_scale_mean", "fp8/v_scale_mean",
                  "mismatch/token_mult_prob_error", "reward/mean"):
            assert compiled[k] == pytest.approx(eager[k], rel=1e-6, abs=1e-9), (eager["step"], k)


def test_gradients_are_freed_before_the_engine_wakes(tmp_path, monkeypatch):
    """After each update the trainer drops its gradients, so the rollout engine (vLLM on a GPU)
    wakes next to parameters and optimizer states only."""
    import distributed
    from engines.hf import HFEngine

    trainer, held = [], []
    shard = distributed.shard
    monkeypatch.setattr(distributed, "shard", lambda model, *a, **k: trainer.append(model) or shard(model, *a, **k))
    monkeypatch.setattr(HFEngine, "wake", lambda self: held.append(
        sum(p.grad is not None for p in trainer[0].parameters())))
    run = run_train("--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}", "train.steps=3",
                    "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0",
                    "rollout.prompts_per_step=4", "train.save_final=false", "train.run_name=g")
    assert run.returncode == 0, run.stderr[-3000:]
    steps = read_metrics(tmp_path / "g")
    assert len(held) == 3 and all(m["optim/grad_norm"] > 0 for m in steps)  # updates happened
    assert held == [0, 0, 0]


def test_length_multiple_makes_micro_batches_whole_blocks():
    from batch import length_multiple

    assert [length_multiple(r, 128) for r in (1, 2, 3, 8, 256)] == [128, 64, 128, 16, 1]
    assert all(r * length_multiple(r, 128) % 128 == 0 for r in range(1, 300))
    assert length_multiple(4, 1) == 1  # BF16 / emulated FP8: no rounding


def test_nothing_imports_the_entry_script():
    """train_grpo.py is a script: the modules, tests/, bench/, scripts/ and notebooks/ take what they share
    from modules (batch.py, observe.py, trainer.py); tests run the script as a user does (conftest.run_train:
    as __main__ in-process, or train_cmd: a child process)."""
    import re

    pattern = re.compile(r"^\s*(?:from\s+train_grpo\s+import|import\s+train_grpo\b|from\s+\.*\s+import\s+train_grpo\b)"
                         r"|import_module\(\s*.train_grpo.|__import__\(\s*.train_grpo.", re.M)
    script = "train_grpo"  # (spelled apart, so that this file does not match)
    for line in (f"import {script}", f"from {script} import main", f"  import {script} as t", f"from . import {script}",
                 f"importlib.import_module('{script}')", f'__import__("{script}")'):
        assert pattern.search(line), line  # the check sees every way of importing it
    assert not pattern.search(f"import {script}_utils") and not pattern.search(f"run_path(ROOT / '{script}.py')")
    files = [p for p in [*ROOT.rglob("*.py"), *ROOT.rglob("*.ipynb")]
             if not {".venv", "runs"} & set(p.relative_to(ROOT).parts)]
    names = {str(p.relative_to(ROOT)) for p in files}
    assert {"analysis.py", "trainer.py", "tests/conftest.py", "tests/e2e/test_guards.py", "bench/runner.py",
            "scripts/learn_gate.py"} <= names
    offenders = [str(p.relative_to(ROOT)) for p in files
                 if pattern.search(p.read_text().replace('\\n",', "\n").replace('"', " "))]
    assert offenders == []


def test_fused_head_trains_as_the_unfused_head(tmp_path, monkeypatch):
    """train.fused_head: the policy forward's LM head + log-softmax fused (batch._HeadLogprobs, which
    the no-grad passes always use) gives the first step's loss and gradient of the unfused head (same
    rollout), up to fp32 rounding; the train pass runs it only with the flag. Two mini-batches, so that the
    second's old_logp come from a no-grad pass."""
    import batch

    grad_calls = []
    apply = batch._HeadLogprobs.apply
    monkeypatch.setattr(batch._HeadLogprobs, "apply",
                        lambda *a: grad_calls.append(torch.is_grad_enabled()) or apply(*a))
    common = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}", "train.steps=1",
              "train.val_every=0", "log.tensorboard=false", "log.dump_episodes_every=0", "train.save_final=false",
              "rollout.prompts_per_step=4", "train.mini_batch_size=16"]
    runs = {}
    for fused in ("true", "false"):
        grad_calls.clear()
        r = run_train(*common, f"train.run_name=f{fused}", f"train.fused_head={fused}")
        assert r.returncode == 0, r.stderr[-3000:]
        assert any(grad_calls) == (fused == "true") and not all(grad_calls)  # no-grad passes: always fused
        runs[fused] = read_metrics(tmp_path / f"f{fused}")[0]
    on, off = runs["true"], runs["false"]
    assert on["reward/mean"] == off["reward/mean"]
    assert off["optim/grad_norm"] > 0
    for k in ("loss/total", "optim/grad_norm"):
        assert on[k] == pytest.approx(off[k], rel=1e-4, abs=1e-7), (k, on[k], off[k])
