"""The CPU-testable parts of the benchmarks (the GPU runs them for real).

runner: the results file (schema, atomic write, same-device merge). rollout: workload/model/mode
parsing, the 8B configs and model dirs (checked by vLLM's own EngineArgs/ModelConfig, as
tests/unit/test_vllm_args.py does), the worker's records (--dry-run engine), the child processes through
the runner (spawn, stream, partial writes, a failing and a timed-out child), the derived figures
and the table. train: the stack's FP8 plan per mode, one CPU step, FLOPs, inputs, a failing mode.
trainer_pass, trainer_phase and checkpoint: CPU smoke runs of the real CLI.
"""

import importlib
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from bench import runner
from bench import rollout as br
from bench import train as bt
from test_distributed import crash_report, ranks_run

REPO = Path(__file__).resolve().parents[2]


def _vllm():
    try:
        return importlib.import_module("vllm")
    except Exception as e:
        pytest.skip(f"vllm does not import here ({type(e).__name__}: {e})")


# ----------------------------------------------------------------------------------- parsing


def test_workloads_parse():
    w = br.parse_workload("512x256->1024")
    assert (w.prompts, w.prompt_len, w.gen_len, w.seq_len, w.name) == (512, 256, 1024, 1280, "512x256->1024")
    assert br.parse_workload(" 128 x 1024 : 8192 ") == br.Workload(128, 1024, 8192)  # shell-safe form
    assert [x.name for x in br.parse_workloads(br.DEFAULT_WORKLOADS)] == ["512x256->1024", "64x1024->4096"]
    for bad in ["512x256", "512*256->1", "0x256->1024", "ax1->2", ""]:
        with pytest.raises(Exception):
            br.parse_workloads(bad)
    assert br.parse_models("llama,qwen3-8b,QWEN3") == ["llama3.1-8b", "qwen3-8b", "qwen3-8b"]
    assert runner.parse_choices("bf16,fp8kv", br.MODES) == ["bf16", "fp8kv"]
    for fn, bad in [(br.parse_models, "mistral"), (lambda t: runner.parse_choices(t, br.MODES), "fp4"),
                    (br.parse_gpu_mem, "1.5"), (br.parse_gpu_mem, "x")]:
        with pytest.raises(Exception):
            fn(bad)
    assert br.parse_gpu_mem("auto") == "auto" and br.parse_gpu_mem("0.7") == "0.7"


def test_quant_calls_of_a_layer_and_their_bytes(capsys):
    """bench.quant --shape: the twelve quantization calls a decoder layer runs per micro-batch (four activations
    in the checkpointed forward and again in its recompute, four gradients) at the model's widths; at the 3B
    peer micro-batch they read and write ~35 GB over its 28 layers. Bad --shape / --tokens: exit 2."""
    from bench import quant

    m = 4224
    calls = quant.layer_calls(br.MODELS["llama3.2-3b"], m)
    assert [(c["k"], c["mode"], c["per_micro_batch"]) for c in calls] == [
        (3072, 0, 2), (3072, 0, 2), (3072, 0, 2), (8192, 1, 2), (5120, 0, 1), (3072, 0, 1), (3072, 0, 1),
        (16384, 2, 1)]
    moved = sum(c["per_micro_batch"] * (c["read_bytes"] + 2 * m * c["k"]) for c in calls) * 28
    assert sum(c["per_micro_batch"] for c in calls) == 12 and moved == pytest.approx(35.3e9, rel=0.01)
    for argv, msg in [(["--shape", "llama5b"], "--shape 'llama5b' is not one of"),
                      (["--shape", "llama3b", "--tokens", "4000"], "--tokens 4000: needs a positive multiple of 128")]:
        with pytest.raises(SystemExit) as e:
            quant.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_cli_errors(tmp_path, capsys):
    for argv, msg in [(["--workloads", "512x256"], "PROMPTSxPROMPT_LEN->GEN_LEN"), (["--modes", "fp4"], "choose from"),
                      (["--refits", "0"], "--refits"), (["--worker", "--models", "llama"], "--worker needs"),
                      (["--set", "rollout.blok_size=64"], "--set: unknown config key 'rollout.blok_size'")]:
        with pytest.raises(SystemExit) as e:
            br.main([*argv, "--out", str(tmp_path)])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not a results file"):
        br.main(["--merge", str(tmp_path / "missing.json")])


def test_worker_argv_round_trips():
    args = br.build_parser().parse_args(["--workloads", "8x16->32,4x8:64", "--refits", "2", "--gpu-mem", "0.6",
                                         "--capacity-only", "--seed", "7"])
    argv = br.worker_argv(args, "qwen3-8b", "fp8kv", Path("/tmp/r.jsonl"), 123.0)
    assert argv[:3] == [sys.executable, "-m", "bench.rollout"]
    w = br.build_parser().parse_args(argv[3:])
    assert w.worker and w.models == ["qwen3-8b"] and w.modes == ["fp8kv"] and w.capacity_only
    assert w.workloads == args.workloads and w.refits == 2 and w.gpu_mem == "0.6" and w.seed == 7
    assert w.result_file == "/tmp/r.jsonl" and w.deadline == 123.0 and not w.dry_run and w.decode_steps == 0
    args = br.build_parser().parse_args(["--decode-steps", "64"])
    assert br.build_parser().parse_args(br.worker_argv(args, "llama3.1-8b", "fp8", Path("/r"), None)[3:]).decode_steps == 64
    args = br.build_parser().parse_args(["--set", "rollout.block_size=64", "--set", "rollout.seed=3"])
    w = br.build_parser().parse_args(br.worker_argv(args, "llama3.1-8b", "fp8", Path("/r"), None)[3:])
    assert w.set == ["rollout.block_size=64", "rollout.seed=3"]
    cfg = br.bench_config("fp8kv", args.workloads, 0.8, overrides=tuple(w.set))
    assert cfg.rollout.block_size == 64 and cfg.rollout.seed == 3 and cfg.fp8.kv_cache
    assert br.set_tag(w.set) == "_rolloutblock_size64_rolloutseed3"  # file names: no '=' or '.'


def test_vllm_keywords_reach_the_engine_kwargs_and_the_labels(monkeypatch, tmp_path, capsys):
    """--vllm KEY=JSON: checked at parse time, passed to the children, merged into the engine's vllm.LLM
    keywords (a dict key by key), and part of the workload label and file names."""
    import engines.vllm as ev

    for bad, msg in [("custom_ops", "give KEY=JSON"), ("compilation_config={custom_ops: 1}", "is not JSON"),
                     ("linear_backend=flashinfer_cutlass", "a string needs its quotes")]:
        with pytest.raises(SystemExit) as e:
            br.main(["--vllm", bad, "--out", str(tmp_path)])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    cc = 'compilation_config={"custom_ops": ["-quant_fp8"]}'
    args = br.build_parser().parse_args(["--set", "rollout.seed=3", "--vllm", cc, "--vllm", 'hf_overrides={"x": 1}'])
    w = br.build_parser().parse_args(br.worker_argv(args, "llama3.1-8b", "fp8", Path("/r"), None)[3:])
    assert w.vllm == [cc, 'hf_overrides={"x": 1}']
    assert br.overrides(w) == ["rollout.seed=3", f"vllm.{cc}", 'vllm.hf_overrides={"x": 1}']
    assert br.set_tag(br.overrides(w)[:2]) == "_rolloutseed3_vllmcompilation_configcustom_opsquant_fp8"

    monkeypatch.setattr(ev, "vllm_engine_kwargs", ev.vllm_engine_kwargs)  # restored after the test
    plain = ev.vllm_engine_kwargs(br.bench_config("bf16", args.workloads, 0.5), "dir", architecture="LlamaForCausalLM")
    br.add_engine_kwargs(w.vllm)
    kw = ev.vllm_engine_kwargs(br.bench_config("bf16", args.workloads, 0.5), "dir", architecture="LlamaForCausalLM")
    assert kw == {**plain, "compilation_config": {"custom_ops": ["-quant_fp8"]},
                  "hf_overrides": {"architectures": ["LlamaForCausalLM"], "x": 1}}
    assert br.merge_engine_kwargs({"a": {"b": 1, "c": {"d": 2}}, "e": 3}, {"a": {"c": {"f": 4}}, "e": {"g": 5}}) == \
        {"a": {"b": 1, "c": {"d": 2, "f": 4}}, "e": {"g": 5}}


def test_decode_row_cancels_the_windows_fixed_costs(monkeypatch, tmp_path, capsys):
    """decode_step_ms is the median full window's wall time per step, fixed costs included;
    decode_step_marginal_ms the median full window less the median half window, per step, without them. A
    stand-in engine advances a stand-in clock: 0.5 s a call + 20 ms a step, plus a fixed cost that varies by
    call (+-0.3 s: one pair of windows would be 9 ms a step off), which the medians of 3 repeats leave out;
    the slower full window shows in the spread, which the row warns of.
    Its steps run through stand-ins of vLLM's in-process step (host_parts), whose parts host_ms_per_step
    times in one more window, putting every method back after."""
    from types import SimpleNamespace

    import torch

    from rollout import Sample

    class Clock:
        t = 0.0

        def perf_counter(self):
            return self.t

    def spend(ms):
        clock.t += ms / 1e3

    jitter = iter([0.0, 0.0, 0.0, 0.3, 0.3, 0.0, -0.3, 0.0, 0.0])  # prefill, (full, half) x 3, host, profiled

    class Scheduler:
        def schedule(self):
            spend(1)

        def update_from_output(self):
            spend(2)

    class Executor:
        def execute_model(self):
            spend(3)

        def sample_tokens(self):
            spend(1)

    class Core:  # vLLM's EngineCore: step_fn an instance attribute
        def __init__(self):
            self.scheduler, self.model_executor, self.step_fn = Scheduler(), Executor(), self.step

        def step(self):
            spend(10)  # waiting for the GPU
            self.scheduler.schedule(), self.model_executor.execute_model()
            self.model_executor.sample_tokens(), self.scheduler.update_from_output()

    class Processor:
        def process_outputs(self):
            spend(2)

    class Front:  # vLLM's LLMEngine
        def __init__(self):
            self.engine_core, self.output_processor = SimpleNamespace(engine_core=Core()), Processor()

        def step(self):
            spend(1)
            self.engine_core.engine_core.step_fn()
            self.output_processor.process_outputs()

    class Engine:
        llm = SimpleNamespace(llm_engine=Front())

        def generate(self, prompts, max_new_tokens, **kw):
            clock.t += 0.5 + next(jitter)
            for _ in range(max_new_tokens):  # 20 ms a step
                self.llm.llm_engine.step()
            return [Sample(i, p, [1] * max_new_tokens, [0.0] * max_new_tokens, "length") for i, p in enumerate(prompts)]

    clock = Clock()
    monkeypatch.setattr(br, "time", clock)
    profiled = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: profiled.append(clock.t))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: profiled.append(clock.t))
    args = br.build_parser().parse_args(["--decode-steps", "64", "--result-file", str(tmp_path / "r.jsonl")])
    base = {"model": "llama3.1-8b", "mode": "fp8kv", "kv_capacity_tokens": 10**6}
    row = br.decode_row(Engine(), br.parse_workload("4x16:64"), args, base, "llama3.1-8b", 100, 0)
    assert row["decode_step_ms"] == pytest.approx(1e3 * (0.5 + 0.02 * 64) / 64, abs=1e-3)  # (rounded to us)
    assert row["decode_step_marginal_ms"] == pytest.approx(20.0, abs=1e-3) and row["gen_tokens"] == 4 * 64
    assert row["decode_windows_s"] == {"64": [1.78, 2.08, 1.78], "32": [1.14, 1.44, 0.84]}
    assert row["decode_step_min_ms"] == pytest.approx(1e3 * 1.78 / 64, abs=1e-3)
    assert row["decode_windows_spread"] == pytest.approx(0.3 / 1.78, abs=1e-3)
    assert "full windows spread 17% (fastest 27.81 ms per step)" in capsys.readouterr().out
    assert profiled == pytest.approx([0.52, 2.3])  # the first full window alone, for ncu
    assert row["host_ms_per_step"].pop("gc") >= 0 and row["python_threads"] == br.other_threads()
    assert row["host_ms_per_step"] == {"step": 20.0, "engine_core_step": 17.0, "schedule": 1.0, "execute_model": 3.0,
                                       "sample_tokens": 1.0, "update_from_output": 2.0, "process_outputs": 2.0,
                                       "engine_core_wait": 10.0}
    # a whole generation: per front-end step call (the engine's steps), whatever the tokens per sample
    with br.timed_host(Engine()) as totals:
        for _ in range(8):
            Engine.llm.llm_engine.step()
    ms = br.host_ms_per_step(totals)
    assert totals["step"][1] == 8 and ms.pop("gc") >= 0 and ms == row["host_ms_per_step"]
    core = Engine.llm.llm_engine.engine_core.engine_core
    assert core.step_fn == core.step and not {"schedule", "update_from_output"} & set(vars(core.scheduler))
    assert "step" not in vars(Engine.llm.llm_engine) and "process_outputs" not in vars(Engine.llm.llm_engine.output_processor)
    assert "marginal" in (tmp_path / "decode_llama3.1-8b_fp8kv_4x16_64.txt").read_text().splitlines()[0]
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as e:
            br.build_parser().parse_args(["--decode-repeats", bad])
        assert e.value.code == 2 and "--decode-repeats" in capsys.readouterr().err


def test_generation_bounds_from_a_measured_row():
    """generation_bounds on the FP8 KV row of the 2,048-sequence run on an H100 (docs/results.md): 1,042 engine
    steps of 49.653 ms for 1,048,576 tokens in 52.5 s at GPU busy 0.637; a row without vLLM's timings or
    nvidia-smi's samples gets nothing."""
    row = {"engine_steps": 1042, "host_ms_per_step": {"step": 49.653, "schedule": 9.715}, "gpu_busy_frac": 0.637}
    assert br.generation_bounds(row, 1_048_576, 52.5) == {"mean_batch": 1006.3, "host_us_per_token": 49.3,
                                                          "gpu_busy_s": 33.44}
    assert br.generation_bounds({"host_ms_per_step": {"error": "not timed: HF engine"}}, 1000, 1.0) == {}


def test_gpu_busy_averages_nvml_samples_and_says_why_when_there_are_none(tmp_path, monkeypatch):
    """gpu_busy: the mean of `nvidia-smi -lms` utilization samples taken while inside, as a fraction; its
    command names this process's first visible GPU; a missing or silent nvidia-smi gives gpu_busy_error."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '100\\n50\\n0\\n90\\n'\necho \"$@\" > " + str(tmp_path / "argv") + "\n"
                    "exec sleep 30\n")  # the samples, then a sign they are out, then running on as nvidia-smi does
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with br.gpu_busy(period_ms=50) as busy:
        for _ in range(200):  # until the fake has printed its samples
            if (tmp_path / "argv").exists():
                break
            time.sleep(0.05)
    assert busy == {"gpu_busy_frac": 0.6, "gpu_busy_samples": 4}
    assert (tmp_path / "argv").read_text().split()[:2] == ["-i", "3"] and "50" in (tmp_path / "argv").read_text()
    fake.write_text("#!/bin/sh\necho 'No devices were found'\ntouch " + str(tmp_path / "done") + "\n")
    with br.gpu_busy() as busy:
        for _ in range(200):
            if (tmp_path / "done").exists():
                break
            time.sleep(0.05)
    assert "no samples" in busy["gpu_busy_error"] and "No devices" in busy["gpu_busy_error"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with br.gpu_busy() as busy:
        pass
    assert busy["gpu_busy_error"].startswith("nvidia-smi:")


def test_gc_passes_and_the_host_profile(tmp_path):
    """gc_timed counts the collector's passes inside it (and none after); host_profile writes run()'s Python
    functions by own time; --host-profile reaches the children."""
    import gc

    with br.gc_timed({}) as totals:
        gc.collect()
    assert totals["gc"][1] == 1 and totals["gc"][0] > 0
    gc.collect()
    assert totals["gc"][1] == 1

    def busy():
        return sorted(str(i) for i in range(20000))
    br.host_profile(tmp_path / "p.txt", busy)
    assert "busy" in (tmp_path / "p.txt").read_text() and "tottime" in (tmp_path / "p.txt").read_text()
    args = br.build_parser().parse_args(["--decode-steps", "8", "--host-profile"])
    assert "--host-profile" in br.worker_argv(args, "llama3.1-8b", "bf16", tmp_path / "r.jsonl", None)
    assert "--host-profile" not in br.worker_argv(br.build_parser().parse_args(["--decode-steps", "8"]),
                                                  "llama3.1-8b", "bf16", tmp_path / "r.jsonl", None)


def test_no_pdl_reaches_the_children_the_labels_and_flashinfer(monkeypatch):
    """--no-pdl: passed to the children, part of the label, and flashinfer.decode's SM90 default turned off."""
    args = br.build_parser().parse_args(["--no-pdl", "--set", "fp8.kv_attention=xqa"])
    w = br.build_parser().parse_args(br.worker_argv(args, "llama3.1-8b", "fp8kv", Path("/r"), None)[3:])
    assert w.no_pdl and br.overrides(w) == ["fp8.kv_attention=xqa", "flashinfer.pdl=off"]
    assert br.set_tag(br.overrides(w)) == "_fp8kv_attentionxqa_flashinferpdloff"
    assert not br.build_parser().parse_args([]).no_pdl
    decode = pytest.importorskip("flashinfer.decode")
    monkeypatch.setattr(decode, "device_support_pdl", decode.device_support_pdl)  # restored after the test
    br.launch_flashinfer_decode_without_pdl()
    assert decode.device_support_pdl(torch.device("cuda", 0)) is False


def test_cuda_busy_ms_counts_overlapping_kernels_once():
    """The union of the CUDA kernels' intervals: a kernel launched early (programmatic dependent launch) that
    waits inside for the one before it adds only its own tail; CPU events are not counted."""
    from types import SimpleNamespace as NS

    def event(kind, start_us, end_us):
        return NS(device_type=NS(name=kind), time_range=NS(start=start_us, end=end_us))

    events = [event("CUDA", 0, 280), event("CUDA", 200, 290),  # XQA, then a quantization that started at 200
              event("CPU", 0, 5000), event("CUDA", 1000, 1100), event("CUDA", 1020, 1050),  # one inside another
              event("CUDA", 300, 300)]  # an empty interval
    assert runner.cuda_busy_ms(NS(events=lambda: events)) == pytest.approx((290 + 100) / 1e3)
    assert runner.cuda_busy_ms(NS(events=lambda: [])) == 0.0


def test_decode_profile_kernel_kinds():
    """Kernel names as vLLM 0.26's decode step launches them on an H100/H200 land in the right kind."""
    names = {
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>(...)": "attention",
        "void flash::FlashAttnFwdCombine<...>": "attention",
        "kernel_unified_attention": "attention",  # vLLM's Triton backend (fp8.kv_attention=triton)
        "kernel_mha(unsigned int, float, float const*, Vec<__nv_bfloat16, 128u>*, ...)": "attention",  # XQA
        "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>(...)": "gemm",
        "nvjet_tst_128x64_64x8_2x1_v_bz_TNT": "gemm",
        "_w8a8_triton_block_scaled_mm": "gemm",
        "void marlin::Marlin<__nv_bfloat16, (vllm::ScalarTypeId)..., 256, 1, 8, 8, true, false, 8, false>(...)": "gemm",
        "void vllm::per_token_group_quant_8bit_kernel<c10::BFloat16, c10::Float8_e4m3fn>(...)": "act_quant",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "other",
        "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(...)": "norm/rope",
        "void vllm::rotary_embedding_kernel<...>": "norm/rope",
        "_topk_log_softmax_kernel": "sampling",
        "void at::native::elementwise_kernel<128, 2, ...>": "other",
    }
    from observe import kernel_kind

    assert {n: kernel_kind(n, br.KERNEL_KINDS, "other") for n in names} == names


# ----------------------------------------------------------------------------------- models and configs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (hf_cfg, meta model, model dir)} for both 8B shapes."""
    out = {}
    for name in br.MODELS:
        cfg = br.hf_config(name)
        model = br.meta_model(cfg)
        out[name] = (cfg, model, br.write_model_dir(model, tmp_path_factory.mktemp(name)))
    return out


def test_8b_shapes(models):
    """Parameter counts of the real checkpoints (8.03 B, 8.19 B), Qwen3's qk-norm, KV bytes per token."""
    for name, cls, params, layers, vocab in [("llama3.1-8b", "LlamaForCausalLM", 8.03e9, 32, 128256),
                                             ("qwen3-8b", "Qwen3ForCausalLM", 8.19e9, 36, 151936)]:
        cfg, model, _ = models[name]
        assert type(model).__name__ == cls and next(model.parameters()).is_meta
        assert abs(br.param_bytes(model) / 2 - params) < 0.01e9
        assert len(model.model.layers) == layers and model.lm_head.weight.shape == (vocab, 4096)
        assert model.model.layers[0].self_attn.k_proj.weight.shape == (1024, 4096)
    assert models["qwen3-8b"][1].model.layers[0].self_attn.k_norm.weight.shape == (128,)
    assert models["llama3.1-8b"][0].rope_parameters["rope_type"] == "llama3"
    qwen = models["qwen3-8b"][0]
    assert br.kv_bytes_per_token(qwen, False) == 2 * 36 * 8 * 128 * 2 == 2 * br.kv_bytes_per_token(qwen, True)
    assert br.kv_bytes_per_token(models["llama3.1-8b"][0], False) == 131072


def test_model_dir(models):
    from transformers import AutoConfig, AutoTokenizer

    for name, arch in [("llama3.1-8b", "LlamaForCausalLM"), ("qwen3-8b", "Qwen3ForCausalLM")]:
        cfg, _, path = models[name]
        raw = json.loads((path / "config.json").read_text())
        assert raw["architectures"] == [arch] and raw["tie_word_embeddings"] is False
        back = AutoConfig.from_pretrained(path)
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size"):
            assert getattr(back, k) == getattr(cfg, k), (name, k)
        tok = AutoTokenizer.from_pretrained(path)
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
        assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
    prompts = br.random_prompts(br.Workload(4, 8, 1), 151936, seed=3)
    assert len(prompts) == 4 and all(len(p) == 8 and br.FIRST_TOKEN <= min(p) and max(p) < 151936 for p in prompts)
    assert prompts == br.random_prompts(br.Workload(4, 8, 1), 151936, seed=3)  # same prompts in every mode


def test_bench_config_per_mode():
    ws = br.parse_workloads("512x256->1024,64x1024->8192")
    for mode, (fp8, kv) in {"bf16": (False, False), "fp8": (True, False), "fp8kv": (True, True)}.items():
        cfg = br.bench_config(mode, ws, 0.8)
        assert (cfg.fp8.rollout, cfg.fp8.kv_cache) == (fp8, kv)
        r = cfg.rollout
        assert r.engine == "vllm" and r.ignore_eos and not r.sleep_mode and not r.enforce_eager
        assert r.max_model_len == 1024 + 8192 and r.max_new_tokens == 8192 and r.gpu_memory_utilization == 0.8
        assert cfg.fp8.linear_backend == "cutlass" and r.temperature == 1.0 and r.top_p == 1.0
    assert br.bench_config("bf16", ws, 0.5, capacity_only=True).rollout.enforce_eager
    cfg = br.bench_config("fp8kv_triton", ws, 0.8)  # the mode's backend wins over the bench's cutlass
    assert cfg.fp8.linear_backend == "triton" and cfg.fp8.kv_cache and cfg.fp8.rollout


def test_auto_gpu_memory_utilization():
    trainer = int(8.03e9 * 2)
    assert br.auto_gpu_memory_utilization(150_754_820_096, trainer) == 0.8  # H200 (140.4 GiB)
    h100 = br.auto_gpu_memory_utilization(85_045_919_744, trainer)  # H100 (79.2 GiB)
    assert 0.6 <= h100 < 0.75 and 85_045_919_744 * (1 - h100) >= trainer + 10 * br.GiB
    assert br.auto_gpu_memory_utilization(85_045_919_744, 0) == 0.8
    with pytest.raises(RuntimeError, match="--gpu-mem"):
        br.auto_gpu_memory_utilization(24 * br.GiB, trainer)


@pytest.mark.parametrize("name", list(br.MODELS))
def test_engine_args_accept_bench_configs(name, models, monkeypatch):
    """What VLLMEngine would pass to vllm.LLM for each mode: parsed by EngineArgs, and the model config
    vLLM derives from our dir has the shape, the causal-LM class, max_model_len and quantization (MoE:
    the routers kept BF16, each token's experts returned)."""
    _vllm()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    import routing
    from fp8.export import vllm_quantization_config
    from engines.vllm import vllm_engine_kwargs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg_hf, model, path = models[name]
    ws = br.parse_workloads(br.DEFAULT_WORKLOADS)
    for mode in br.MODES:
        cfg = br.bench_config(mode, ws, 0.8)
        qc = vllm_quantization_config(model, cfg.fp8) if cfg.fp8.rollout else None  # fp8_plan on the meta model
        arch = model.config.architectures[0]
        moe = routing.is_moe(model)
        kw = vllm_engine_kwargs(cfg, str(path), 1, qc, arch, moe)  # as VLLMEngine.__init__ builds them
        ea = EngineArgs(**kw)
        assert ea.enable_return_routed_experts == moe == (name == "qwen3-30b-a3b")
        assert ea.load_format == "dummy" and not ea.enable_sleep_mode and not ea.enforce_eager
        assert ea.kv_cache_dtype == ("fp8" if cfg.fp8.kv_cache else "auto")
        mc = ea.create_model_config()
        assert mc.architecture == arch and mc.max_model_len == 1024 + 4096
        text = mc.hf_text_config
        assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads, mc.get_head_size(),
                mc.get_vocab_size()) == (cfg_hf.hidden_size, cfg_hf.num_hidden_layers, 4 if moe else 8, 128,
                                  cfg_hf.vocab_size)
        if cfg.fp8.rollout:
            assert mc.quantization == "fp8"
            q = Fp8Config.from_config(mc.hf_config.quantization_config)
            routers = [f"model.layers.{i}.mlp.gate" for i in range(cfg_hf.num_hidden_layers)] if moe else []
            assert q.weight_block_size == [128, 128] and sorted(q.ignored_layers) == sorted(["lm_head", *routers])
        else:
            assert mc.quantization is None


# ----------------------------------------------------------------------------------- worker records


def _worker_args(tmp_path, mode, *extra):
    return br.build_parser().parse_args(["--worker", "--dry-run", "--models", "qwen3", "--modes", mode,
                                         "--workloads", "8x16->32,4x8->64", "--result-file",
                                         str(tmp_path / f"{mode}.jsonl"), *extra])


def test_worker_records(tmp_path):
    assert br.run_worker(_worker_args(tmp_path, "fp8kv")) == 0
    recs = runner.read_records(tmp_path / "fp8kv.jsonl")
    assert [r["workload"] for r in recs] == ["qwen3-8b 8x16->32", "qwen3-8b 4x8->64"]
    for r in recs:
        assert r["kind"] == "run" and r["mode"] == "fp8kv" and r["fixed_length"]
        assert set(br.THROUGHPUT_COLS) - {"speedup"} <= set(r)  # everything the table shows
        assert r["gen_tokens"] == r["prompts"] * r["gen_len"] and r["out_tok_s"] > 0
        assert r["gpu_memory_utilization"] == 0.8 and r["max_model_len"] == 72 and r["kv_bytes_per_token"] == 73728
        assert len(r["refit_all_s"]) == 3
        assert r["host_ms_per_step"]["error"].startswith("not timed: ") and "engine_steps" not in r  # no vLLM here
    assert br.run_worker(_worker_args(tmp_path, "bf16", "--capacity-only")) == 0
    (cap,) = runner.read_records(tmp_path / "bf16.jsonl")
    assert cap["workload"] == "qwen3-8b capacity" and cap["enforce_eager"] and "out_tok_s" not in cap
    assert br.run_worker(_worker_args(tmp_path, "fp8", "--dry-run-fail", "fp8")) == 1
    (err,) = runner.read_records(tmp_path / "fp8.jsonl")
    assert err["kind"] == "error" and "dry-run failure" in err["error"] and err["mode"] == "fp8"


# ----------------------------------------------------------------------------------- derived figures, files


def _run(workload, mode, **kw):
    return {"workload": workload, "mode": mode, "model": workload.split()[0], **kw}


def test_derive_speedups_and_nemo_projection():
    bpt = {"bf16": 147456, "fp8": 147456, "fp8kv": 73728}
    gib = br.GiB
    kv = {"bf16": 60 * gib, "fp8": 66.5 * gib, "fp8kv": 66.5 * gib}  # fp8 linears free 6.5 GiB for KV
    runs = [_run("qwen3-8b capacity", m, kv_cache_bytes=int(kv[m]), kv_bytes_per_token=bpt[m],
                 kv_capacity_tokens=int(kv[m]) // bpt[m]) for m in ("fp8kv", "bf16", "fp8")]
    runs += [_run("llama3.1-8b 8x16->32", "bf16", out_tok_s=100.0, kv_capacity_tokens=1000),
             _run("llama3.1-8b 8x16->32", "fp8", out_tok_s=120.0, kv_capacity_tokens=1100),
             _run("llama3.1-8b 4x8->64", "fp8kv", out_tok_s=50.0)]  # no bf16 run: no speed-up
    out = {(r["workload"], r["mode"]): r for r in br.derive(runs)}
    assert out[("llama3.1-8b 8x16->32", "fp8")]["speedup"] == 1.2
    assert out[("llama3.1-8b 8x16->32", "fp8")]["kv_ratio_vs_bf16"] == 1.1
    assert out[("llama3.1-8b 8x16->32", "bf16")]["speedup"] == 1.0
    assert out[("llama3.1-8b 4x8->64", "fp8kv")]["speedup"] is None
    assert "nemo_kv_tokens" not in out[("llama3.1-8b 8x16->32", "bf16")]
    b, f, k = (out[("qwen3-8b capacity", m)] for m in ("bf16", "fp8", "fp8kv"))
    assert abs(b["kv_tokens_at_nemo_budget"] - 249952) <= 1 and b["kv_ratio_at_nemo_budget"] == 1.0
    shift = 249952 * 147456 - 60 * gib  # the budget difference applies to every mode
    assert f["kv_tokens_at_nemo_budget"] == int((66.5 * gib + shift) // 147456)
    assert k["kv_tokens_at_nemo_budget"] == int((66.5 * gib + shift) // 73728)
    assert f["nemo_kv_ratio_vs_bf16"] == round(299344 / 249952, 3) and k["nemo_kv_ratio_vs_bf16"] == 2.395
    assert abs(k["kv_ratio_at_nemo_budget"] - 2 * f["kv_ratio_at_nemo_budget"]) < 0.002
    runs = br.derive(runs)
    assert [r["mode"] for r in runs][:3] == ["bf16", "fp8", "fp8kv"]
    text = br.report(runs, capacity=True)
    assert text.startswith("| workload | mode | kv_capacity_tokens") and "fp8kv: KV capacity x" in text
    text = br.report(runs, capacity=False)
    assert "| llama3.1-8b 8x16->32 | fp8 | 120 | 1.2 |" in text and "fp8: x1.20 output tok/s vs bf16" in text


def test_results_files(tmp_path):
    """The schema of bench/runner.py; update_results keeps the file's other runs of the same device,
    replaces re-measured ones and drops other devices'; --merge combines files and re-derives ratios."""
    path = runner.write_results("train", [{"workload": "linear", "mode": "bf16", "ms": 16400.4}], tmp_path,
                                device="GPU A", errors=[{"mode": "fp8"}])
    doc = json.loads(path.read_text())
    assert set(doc) == {"device", "cpu", "date", "command", "versions", "runs", "errors"} and doc["device"] == "GPU A"
    assert doc["versions"]["torch"] == torch.__version__.split("+")[0] and doc["versions"]["python"]
    assert runner.read_results(path)["runs"][0]["ms"] == 16400.4 and not list(tmp_path.glob("*.tmp"))
    (tmp_path / "bad.json").write_text("{")
    assert runner.read_results(tmp_path / "bad.json") is None and runner.read_results(tmp_path / "no.json") is None
    assert runner.markdown_table([{"a": 16400.4, "b": 0.01234, "c": None, "d": 3}], list("abcd")).splitlines()[-1] \
        == "| 16400 | 0.0123 |  | 3 |"
    stack = {"workload": "stack", "mode": "fp8", "ms": 9.0}
    runner.update_results("train", [stack], tmp_path, device="GPU A")
    runner.update_results("train", [{**stack, "ms": 8.0}], tmp_path, device="GPU A")
    runs = runner.read_results(path)["runs"]
    assert [(r["workload"], r["ms"]) for r in runs] == [("linear", 16400.4), ("stack", 8.0)]
    runner.update_results("train", [stack], tmp_path, device="GPU B")  # another GPU: the old runs do not mix in
    assert len(runner.read_results(path)["runs"]) == 1
    a = runner.write_results("rollout", [{"workload": "w", "mode": "bf16", "out_tok_s": 10.0}], tmp_path / "a", "G")
    b = runner.write_results("rollout", [{"workload": "w", "mode": "fp8kv", "out_tok_s": 15.0}], tmp_path / "b", "G")
    assert br.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 0
    doc = json.loads((tmp_path / "m" / "rollout.json").read_text())
    assert [(r["mode"], r["speedup"]) for r in doc["runs"]] == [("bf16", 1.0), ("fp8kv", 1.5)]
    assert doc["merged"] == [str(a), str(b)]


# ----------------------------------------------------------------------------------- parent orchestration

FAKE_CHILD = textwrap.dedent("""
    import json, sys, time
    mode, result = sys.argv[1], sys.argv[2]
    print("vllm noise that is not echoed", flush=True)
    print(f"[bench] {mode} engine up", flush=True)
    rec = {"kind": "run", "workload": "m 1x1->1", "mode": mode, "device": "FakeGPU", "model": "m",
           "out_tok_s": {"bf16": 10.0, "fp8": 12.0}.get(mode, 20.0)}
    if mode == "fp8kv":
        time.sleep(60)
    with open(result, "a") as f:
        f.write(json.dumps(rec) + "\\n")
    if mode == "fp8":
        print("Traceback: boom", flush=True)
        sys.exit(3)
""")


def test_parent_streams_keeps_partial_results_and_kills_at_limit(tmp_path, monkeypatch, capsys):
    """Three children in parallel: bf16 succeeds, fp8 writes a result then fails, fp8kv hangs and is killed
    at --time-limit; the file holds bf16 and fp8 (after the run of an earlier call it already held)
    and names both failures."""
    def fake_argv(args, model, mode, result_file, deadline):
        return [sys.executable, "-c", FAKE_CHILD, mode, str(result_file)]

    monkeypatch.setattr(br, "worker_argv", fake_argv)
    runner.write_results("rollout", [{"workload": "m 2x2->2", "mode": "bf16", "out_tok_s": 5.0}], tmp_path, "FakeGPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")  # three GPU slots: the children run side by side
    args = br.build_parser().parse_args(["--out", str(tmp_path), "--time-limit", "6",
                                         "--min-job-s", "0", "--stagger-s", "0", "--poll-s", "0.1"])
    assert br.run_parent(args) == 1  # failures -> non-zero exit
    out = capsys.readouterr().out
    assert re.search(r"\[llama3.1-8b/bf16 \+\d+s\] bf16 engine up", out)
    assert out.count("vllm noise") == 2  # not streamed; only in the log tails of the two failed children
    assert "llama3.1-8b/fp8: FAILED (exit 3)" in out and "Traceback: boom" in out
    assert "llama3.1-8b/fp8kv: killed at the time limit" in out
    doc = json.loads((tmp_path / "rollout.json").read_text())
    assert doc["device"] == "FakeGPU"
    assert [(r["workload"], r["mode"], r["speedup"]) for r in doc["runs"]] == [
        ("m 2x2->2", "bf16", 1.0), ("m 1x1->1", "bf16", 1.0), ("m 1x1->1", "fp8", 1.2)]
    assert {(e["mode"], e["error"]) for e in doc["errors"]} == {("fp8", "exit code 3"),
                                                                ("fp8kv", "killed at --time-limit")}
    assert (tmp_path / "logs" / "rollout_llama3.1-8b_bf16.log").is_file()


def test_dry_run_end_to_end(tmp_path):
    """The real CLI and child process (imports, argv, result file, exit) with a stand-in engine."""
    r = subprocess.run([sys.executable, "-m", "bench.rollout", "--dry-run", "--out", str(tmp_path),
                        "--modes", "fp8kv", "--workloads", "8x16->32", "--stagger-s", "0", "--poll-s", "0.2"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "rollout.json").read_text())
    assert [(x["workload"], x["mode"], x["fixed_length"]) for x in doc["runs"]] == [
        ("llama3.1-8b 8x16->32", "fp8kv", True)]
    assert "errors" not in doc and "| llama3.1-8b 8x16->32 | fp8kv |" in r.stdout
    assert "] 8x16->32: 256 tokens in" in r.stdout  # the child's progress, streamed by the parent


# ----------------------------------------------------------------------------------- bench/train.py stack


TINY = dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)


def test_stack_modes_are_fp8_config_overrides():
    cfg = bt.stack_config(2, **TINY)
    assert cfg._attn_implementation == "sdpa" and cfg.num_hidden_layers == 2 and cfg.vocab_size == 128
    full = bt.stack_config(4)
    assert (full.hidden_size, full.intermediate_size, full.num_key_value_heads) == (4096, 14336, 8)
    c = bt.fp8_config(bt.STACK_MODES["fp8_cached_noswiglu_compile"])
    assert c.train and c.cache_weights and not c.fuse_swiglu and c.fuse_projections
    assert not bt.fp8_config(bt.STACK_MODES["bf16"]).train
    with pytest.raises(ValueError, match="fp8.<field> only"):
        bt.fp8_config(["train.lr=1"])
    linears = sorted(f"layers.{i}.{leaf}" for i in range(2) for leaf in ["self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    for mode, want in {"bf16": [], "fp8": linears, "fp8_unfused": linears}.items():
        model, converted = bt.build_stack(cfg, mode, "cpu")
        assert sorted(converted) == want
        assert next(model.parameters()).dtype == torch.bfloat16 and model.training
    with pytest.raises(ValueError):
        bt.build_stack(cfg, "fp4", "cpu")


def test_stack_bench_runs_on_cpu(monkeypatch):
    """bench_stack end to end with tiny dims and a wall-clock timer: one real fwd + bwd + AdamW per mode."""
    orig = bt.stack_config
    monkeypatch.setattr(bt, "stack_config", lambda layers: orig(layers, **TINY))
    calls = []

    def timer(fn):
        fn()
        calls.append(1)
        return 2.0

    runs = bt.bench_stack(1, tokens=[256], seq_len=128, modes=["bf16", "fp8"], device="cpu", timer=timer,
                          accums=[1, 4])
    assert len(calls) == 4 and [(r["mode"], r["accum"]) for r in runs] == [
        ("bf16", 1), ("bf16", 4), ("fp8", 1), ("fp8", 4)]
    bf16, _, fp8, fp8_accum = runs
    assert bf16["rel_err"] == 0.0 and 0 < fp8["rel_err"] < 0.05 and fp8["speedup"] == 1.0
    assert (fp8["fp8_linears"], fp8["bf16_linears"]) == (7, 0) and fp8["tokens"] == 256 and fp8["seq_len"] == 128
    assert fp8["workload"] == "stack 1x Llama-3.1-8B layers 256 tok (2x128)"
    # 4 micro-batches per optimizer step: the iteration's 2 ms is 0.5 ms per micro-batch, its own workload
    assert fp8_accum["ms"] == 0.5 and fp8_accum["tok_s"] == 256 / 0.5e-3 and fp8_accum["speedup"] == 1.0
    assert fp8_accum["workload"] == "stack 1x Llama-3.1-8B layers 256 tok (2x128), 4 micro-batches per optimizer step"
    model, _ = bt.build_stack(bt.stack_config(1), "fp8", "cpu")
    opt = bt.make_optimizer(model)
    x, pos, grad = bt.stack_inputs(model.config, 256, 128, "cpu")
    before = model.layers[0].mlp.down_proj.weight.detach().clone()
    forwards = []
    model.layers[0].register_forward_hook(lambda *_: forwards.append(1))
    bt.stack_step(model, opt, x, pos, grad, accum=3)
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    assert not torch.equal(before, model.layers[0].mlp.down_proj.weight)  # AdamW stepped
    assert len(forwards) == 3 and [s["step"].item() for s in opt.state.values()][:1] == [1]  # once
    model, _ = bt.build_stack(bt.stack_config(1), "fp8_cached", "cpu")  # fp8.cache_weights
    opt = bt.make_optimizer(model)
    cache = model.layers[0].mlp.down_proj.kernels  # fp8.fast.cache.WeightCache
    bt.stack_step(model, opt, x, pos, grad)
    assert cache.key == cache._key()  # re-quantized by the optimizer's hook, after its step


def test_stack_bench_records_a_failing_mode_and_goes_on(monkeypatch):
    orig_cfg, orig_build = bt.stack_config, bt.build_stack
    monkeypatch.setattr(bt, "stack_config", lambda layers: orig_cfg(layers, **TINY))

    def build(cfg, mode, device):
        if mode == "fp8_compile":
            raise RuntimeError("inductor: no kernel for you")
        return orig_build(cfg, mode, device)

    monkeypatch.setattr(bt, "build_stack", build)
    runs = bt.bench_stack(1, tokens=[256], seq_len=128, modes=["fp8_compile", "bf16"], device="cpu",
                          timer=lambda fn: (fn(), 2.0)[1])
    assert [r["mode"] for r in runs] == ["fp8_compile", "bf16"]
    assert runs[0]["error"] == "RuntimeError: inductor: no kernel for you" and runs[1]["ms"] == 2.0


def test_stack_inputs_and_flops():
    cfg = bt.stack_config(4)
    x, pos, grad = bt.stack_inputs(bt.stack_config(1, **TINY), 512, 128, "cpu")
    assert x.shape == grad.shape == (4, 128, 256) and x.requires_grad and pos[3].tolist() == list(range(128))
    assert bt.stack_inputs(bt.stack_config(1, **TINY), 256, 0, "cpu")[0].shape == (1, 256, 256)  # one row
    with pytest.raises(ValueError):
        bt.stack_inputs(cfg, 8192 + 64, 0, "cpu")
    linear = 4 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # 4 layers' linear params (218 M each)
    assert bt.stack_flops(cfg, 16384, 2048) == 6 * linear * 16384 + 6 * 2048**2 * 4096 * 8 * 4
    args = bt.build_parser().parse_args(["stack", "--tokens", "8192,16384", "--modes", "bf16,fp8_compile"])
    assert args.tokens == [8192, 16384] and args.modes == ["bf16", "fp8_compile"] and args.layers == 4
    assert bt.build_parser().parse_args(["all"]).modes == ["bf16", "fp8", "fp8_unfused", "bf16_compile", "fp8_compile"]
    with pytest.raises(SystemExit):
        bt.build_parser().parse_args(["stack", "--modes", "fp4"])


def test_gpu_check_script_parses():
    r = subprocess.run(["bash", "-n", str(REPO / "scripts/gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (REPO / "scripts/gpu_check.sh").read_text()
    assert "-m bench.rollout" in text and "-m bench.train" in text


def test_gpu_check_jobs_run_parts_side_by_side(tmp_path):
    """`gpu_check.sh jobs`: each job with its own OUT folder and GPU (the i-th on GPU i, or GPUS=...), the
    parts of one job (' ; ') one after another in job<i>/<k>, each part's rc in jobs.txt, each job's
    folder packed into a .tgz. Unknown parts here: each exits 2 with the usage."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "JOBS_LIMIT": "60", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "jobs", "nosuch a b", "GPUS=2,3 other ; third x"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = (out / "jobs.txt").read_text().splitlines()
    assert sorted(line.split(": rc=")[0] for line in lines) == [
        "job0.0 (nosuch a b) on GPU 0", "job1.0 (other) on GPU 2,3", "job1.1 (third x) on GPU 2,3"]
    assert all(": rc=2 after" in line for line in lines)
    assert lines.index(next(x for x in lines if x.startswith("job1.0"))) < \
        lines.index(next(x for x in lines if x.startswith("job1.1")))
    for i, parts in ((0, 1), (1, 2)):
        assert not (out / f"job{i}").exists()
        with tarfile.open(out / f"job{i}.tgz") as t:
            for k in range(parts):
                assert "usage: gpu_check.sh" in t.extractfile(f"job{i}/{k}/job.log").read().decode()


def test_gpu_check_seeds_and_packs_flashinfer_modules(tmp_path):
    """FlashInfer's JIT-built modules: a host that compiled one packs them into OUT/flashinfer_aot.tgz (name/name.so
    and the versions' KEY, no build files); the next host, given that file as FLASHINFER_SEED, gets them in
    flashinfer's AOT dir and packs nothing more; a seed made for other versions is not used."""
    pkg = tmp_path / "site" / "flashinfer"  # stands in for the installed package: its data/aot is written
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    built = tmp_path / "home1" / ".cache/flashinfer/0.6.14/90a/cached_ops/xqa_fp8"
    built.mkdir(parents=True)
    (built / "xqa_fp8.so").write_bytes(b"module")
    (built / "mha.cuda.o").write_bytes(b"object")

    def run(home, out, **env):
        env = {**os.environ, "HOME": str(tmp_path / home), "OUT": str(tmp_path / out), "PY": sys.executable,
               "PYTHONPATH": os.pathsep.join([str(pkg.parent), os.environ["PYTHONPATH"]]),  # the stand-in first
               "TRITON_CACHE_DIR": str(tmp_path / "triton"), **env}
        r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "nosuch"], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=120)
        assert r.returncode == 2, r.stderr  # the unknown part: usage; the exit handler still runs
        return (tmp_path / out / "env.log").read_text()

    run("home1", "out1")
    with tarfile.open(tmp_path / "out1/flashinfer_aot.tgz") as t:
        assert sorted(t.getnames()) == [".", "./KEY", "./xqa_fp8", "./xqa_fp8/xqa_fp8.so"]
        key = t.extractfile("./KEY").read().decode()
    assert key.startswith("flashinfer ") and " torch " in key
    log = run("home2", "out2", FLASHINFER_SEED=str(tmp_path / "out1/flashinfer_aot.tgz"))
    assert "seeded FlashInfer's AOT modules" in log and ": 1 module(s)" in log
    assert (pkg / "data/aot/xqa_fp8/xqa_fp8.so").read_bytes() == b"module"
    assert not (tmp_path / "out2/flashinfer_aot.tgz").exists()  # nothing compiled that the seed lacks
    (tmp_path / "other").mkdir()
    (tmp_path / "other/KEY").write_text("flashinfer 0.0.1 torch 1.0\n")
    with tarfile.open(tmp_path / "other.tgz", "w:gz") as t:
        t.add(tmp_path / "other", arcname=".")
    assert "not used" in run("home2", "out3", FLASHINFER_SEED=str(tmp_path / "other.tgz"))


def test_gpu_check_learn_returns_few_files(tmp_path):
    """`gpu_check.sh learn`: the device returns at most 8 files of OUT, so the gate's per-run metrics and logs
    come back inside learn_runs.tgz, not loose beside it (the machinery on CPU: one tiny seed, a FAIL)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    r = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "learn", "--cpu", "--seeds", "0", "--steps", "1",
                        "--work", str(tmp_path / "work")], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]  # tiny_cpu after one step: FAIL
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"learn_gate.json", "learn_gate.md", "learn_gate.log", "learn_runs.tgz"} <= set(files), files
    assert not [f for f in files if f.endswith(("_metrics.jsonl", "_s0.log"))], files
    with tarfile.open(out / "learn_runs.tgz") as t:
        assert {"learn_gate.json", "fp8_s0_metrics.jsonl", "bf16_s0.log"} <= set(t.getnames())


def test_gpu_check_bg_and_collect(tmp_path):
    """`gpu_check.sh bg NAME PART`: the part detached, its files in BG_DIR/NAME; `collect NAME` waits for it,
    packs them into OUT/NAME.tgz with its rc and removes the folder; an unknown NAME is a usage error."""
    env = {**os.environ, "BG_DIR": str(tmp_path / "bg"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    run = lambda out, *args: subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), *args], cwd=REPO,  # noqa: E731
                                            capture_output=True, text=True, env={**env, "OUT": str(tmp_path / out)},
                                            timeout=120)
    started = run("o1", "bg", "job", "nosuch", "a")
    assert started.returncode == 0 and "job: started in the background" in started.stdout, started.stderr
    done = run("o2", "collect", "job")
    assert done.returncode == 0 and "job: finished, rc=2" in done.stdout, done.stdout + done.stderr
    with tarfile.open(tmp_path / "o2/job.tgz") as t:
        assert "usage: gpu_check.sh" in t.extractfile("job/job.log").read().decode()
    assert not (tmp_path / "bg/job").exists()
    assert run("o3", "collect", "job").returncode == 2


def test_gpu_check_queue_runs_parts_on_free_gpus_and_collects_them_as_they_end(tmp_path):
    """`gpu_check.sh queue NAME PART...`: the parts detached, in order, one per GPU of CUDA_VISIBLE_DEVICES at a
    time (3 parts, 2 GPUs: the third waits for a free one); `collect NAME` packs each finished part into
    OUT/NAME_job<k>.tgz with its rc and GPU, and removes the folder once all are collected."""
    env = {**os.environ, "BG_DIR": str(tmp_path / "bg"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "CUDA_VISIBLE_DEVICES": "0,1", "COLLECT_LIMIT": "100"}
    run = lambda out, *args: subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), *args], cwd=REPO,  # noqa: E731
                                            capture_output=True, text=True, env={**env, "OUT": str(tmp_path / out)},
                                            timeout=150)
    started = run("o1", "queue", "q", "nosuch a", "other", "third x y")
    assert started.returncode == 0 and "q: 3 parts queued on GPUs 0,1" in started.stdout, started.stderr
    done = run("o2", "collect", "q")
    assert done.returncode == 0 and "q: all 3 parts collected" in done.stdout, done.stdout + done.stderr
    lines = sorted(x for x in done.stdout.splitlines() if x.startswith("q job"))
    assert [x.split(" on GPU ")[0] for x in lines] == ["q job0 (nosuch a)", "q job1 (other)", "q job2 (third x y)"]
    assert all(x.split(" on GPU ")[1] in ("0: rc=2", "1: rc=2") for x in lines)
    for k in range(3):
        with tarfile.open(tmp_path / f"o2/q_job{k}.tgz") as t:
            assert "usage: gpu_check.sh" in t.extractfile(f"job{k}/job.log").read().decode()
    assert not (tmp_path / "bg/q").exists()


def test_gpu_check_queue_parts_take_their_own_environment(tmp_path):
    """A queued part may begin with VAR=VALUE words, set for that part alone (one queue comparing settings read
    from the environment): PY=echo makes the tests part print the command it would run (rc 0), while the next
    part keeps the caller's PY (false: rc 1); the collected line names the part with its settings."""
    env = {**os.environ, "BG_DIR": str(tmp_path / "bg"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "CUDA_VISIBLE_DEVICES": "0", "COLLECT_LIMIT": "100", "PY": "false", "HOME": str(tmp_path)}
    run = lambda out, *args: subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), *args], cwd=REPO,  # noqa: E731
                                            capture_output=True, text=True, env={**env, "OUT": str(tmp_path / out)},
                                            timeout=150)
    assert run("o1", "queue", "q", "PY=echo tests x", "tests y").returncode == 0
    done = run("o2", "collect", "q")
    assert "q job0 (PY=echo tests x) on GPU 0: rc=0" in done.stdout, done.stdout + done.stderr
    assert "q job1 (tests y) on GPU 0: rc=1" in done.stdout, done.stdout
    with tarfile.open(tmp_path / "o2/q_job0.tgz") as t:
        assert "-m pytest x -v -s -rs" in t.extractfile("job0/job.log").read().decode()


def test_kernel_summary_categories():
    """--profile's kernel table: names map to categories, ms are per iteration, shares add up."""
    kernels = [("triton_fp8_blockwise_act_quant_lhs_kernel", 4.0, 56), ("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA", 10.0),
               ("pytorch_flash::flash_fwd_kernel<...>", 3.0), ("void at::native::(anonymous)::fused_adam", 1.0),
               ("void at::native::vectorized_elementwise_kernel<4, silu>", 1.0), ("CatArrayBatchedCopy", 1.0)]
    s = bt.summarize_kernels(kernels, iters=2, top=3)
    cats = s["categories"]
    assert s["gpu_ms_per_iter"] == 10.0
    assert {c: v["ms"] for c, v in cats.items()} == {"gemm": 5.0, "quant": 2.0, "attention": 1.5,
                                                     "optimizer": 0.5, "elementwise": 0.5, "copy": 0.5}
    assert list(cats)[0] == "gemm" and abs(sum(v["share"] for v in cats.values()) - 1) < 1e-9
    assert [k["category"] for k in s["top_kernels"]] == ["gemm", "quant", "attention"]
    assert [k.get("calls") for k in s["top_kernels"]] == [None, 28, None]  # launches per iteration, where given


def test_host_summary_counts_launches_and_custom_ops():
    """--profile's host side: launches and custom ops (not aten, autograd or profiler ranges) per iteration, from a
    synthetic event list and from a real CPU profile of a compiled function calling a custom op."""
    from torch.profiler import ProfilerActivity, profile

    from bench.runner import cpu_ops
    from fp8.linear import add_into

    ops = [("cudaLaunchKernel", 2.0, 100), ("cuLaunchKernel", 1.0, 40), ("torchao::blockwise_scaled_mm", 3.0, 24),
           ("aten::mm", 5.0, 8), ("autograd::engine::evaluate_function: MmBackward0", 1.0, 4),
           ("fp8_grpo::wgrad_into", 0.5, 8), ("cudaDeviceSynchronize", 0.5, 2), ("Command Buffer Full", 1.0, 6)]
    s = bt.summarize_host(ops, iters=2, top=2)
    assert (s["launches_per_iter"], s["launch_ms_per_iter"], s["self_ms_per_iter"]) == (70, 1.5, 7.0)
    assert s["wait_ms_per_iter"] == 0.75  # the host blocked on the GPU: a synchronize, a full launch queue
    assert [(o["name"], o["calls"]) for o in s["custom_ops"]] == [("torchao::blockwise_scaled_mm", 12),
                                                                   ("fp8_grpo::wgrad_into", 4)]
    assert [o["name"] for o in s["top"]] == ["aten::mm", "torchao::blockwise_scaled_mm"]

    acc = torch.zeros(8, 8)

    @torch.compile(backend="aot_eager")
    def f(x):
        add_into(acc, x * 2)  # fp8_grpo::add_into
        return x.sum()

    x = torch.ones(8, 8)
    f(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            f(x)
    s = bt.summarize_host(cpu_ops(prof), iters=3)
    assert [(o["name"], o["calls"]) for o in s["custom_ops"]] == [("fp8_grpo::add_into", 1)]
    assert s["launches_per_iter"] == 0 and s["wait_ms_per_iter"] == 0 and s["self_ms_per_iter"] > 0
    assert torch.equal(acc, torch.full((8, 8), 8.0))  # 4 calls, each adding 2


def test_trainer_pass_times_both_passes_of_each_variant(tmp_path):
    """bench/trainer_pass.py on the CPU (emulated FP8): every variant timed, the padded batch a
    multiple of 128 tokens (as the FP8 trainer collates it), the unpadded one exactly the rows."""
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "bench.trainer_pass", "--config", str(root / "configs/tiny_cpu.yaml"),
                        "--rows", "2", "--prompt", "5", "--response", "40", "--iters", "3", "--calib",
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    runs = json.loads((tmp_path / "trainer_pass.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == ["bf16 unpadded", "bf16 masked", "bf16", "bf16 unfused head", "bf16 calib",
                                         "fp8 masked", "fp8", "fp8 unfused head", "fp8 calib"]
    assert runs[0]["tokens"] == 2 * 45 and all(r["tokens"] == 128 for r in runs[1:])
    assert all(r["logprobs_ms"] > 0 and r["train_ms"] > 0 for r in runs)
    for r in runs:  # each timing kept, sorted; the median the middle one
        for name in ("logprobs", "train"):
            each = r[f"{name}_ms_each"]
            assert len(each) == 3 and each == sorted(each) and each[1] == round(r[f"{name}_ms"], 2)
    assert "(fastest " in p.stdout
    by_mode = {r["mode"]: r["logp_sum"] for r in runs}  # the fused head computes the unfused logprobs
    for mode in ("bf16", "fp8"):
        assert abs(by_mode[mode] - by_mode[f"{mode} unfused head"]) < 1e-4 * abs(by_mode[mode])
        assert by_mode[f"{mode} calib"] == by_mode[mode]  # recording changes no logprob


def test_trainer_pass_accumulates_like_the_trainer_with_the_gradient_buffers(tmp_path):
    """--accumulate keeps the gradients between train calls; fp8_acc adds fp8.fuse_grad_accum's buffers to the
    cached FP8 model (emulated on CPU): the same logprobs as fp8_cached, and the FP8 weights' .grad views of
    the buffers after the timed calls. bf16_acc, the BF16 twin with that structure, computes bf16's logprobs;
    the modes run in their fixed order whatever the order asked."""
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "bench.trainer_pass", "--config", str(root / "configs/tiny_cpu.yaml"),
                        "--rows", "2", "--prompt", "5", "--response", "40", "--iters", "1", "--accumulate",
                        "--modes", "fp8_acc,fp8_cached,bf16_acc,bf16", "--out", str(tmp_path)], capture_output=True,
                       text=True, cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "fp8_acc: 8 gradient buffers" in p.stdout and "bf16_acc: 14 linears through one autograd node" in p.stdout
    runs = {r["mode"]: r for r in json.loads((tmp_path / "trainer_pass.json").read_text())["runs"]}
    assert runs["fp8_acc"]["logp_sum"] == runs["fp8_cached"]["logp_sum"] and runs["fp8_acc"]["train_ms"] > 0
    assert abs(runs["bf16_acc"]["logp_sum"] - runs["bf16"]["logp_sum"]) < 1e-5 * abs(runs["bf16"]["logp_sum"])


def test_trainer_phase_runs_the_trainers_phases_under_fsdp2(tmp_path):
    """bench/trainer_phase.py, torchrun with 2 gloo ranks: trainer.assemble_batch, old_logprob_phase and
    train_phase on the synthetic batch, each rank its half of the samples in whole micro-batches, step 0
    untimed; a --prompts that does not split into whole micro-batches, or --memory off CUDA, is a one-line
    error, exit 2."""
    cmd = ["-m", "bench.trainer_phase", "--config", "configs/tiny_cpu.yaml", "--set", "rollout.max_new_tokens=40",
           "rollout.n=4", "train.micro_batch_size=4", "rollout.prompts_per_step=8", "train.mini_batch_size=16"]
    p = ranks_run(["--nproc_per_node", "2", *cmd, "--prompts", "8", "--prompt", "5", "--out", str(tmp_path / "two")],
                  REPO, tmp_path / "two")
    assert p.returncode == 0, crash_report(p.stderr)
    doc = json.loads((tmp_path / "two/trainer_phase.json").read_text())
    assert doc["overrides"] == ["rollout.max_new_tokens=40", "rollout.n=4", "train.micro_batch_size=4",
                                "rollout.prompts_per_step=8", "train.mini_batch_size=16"]
    runs = doc["runs"]
    assert [(r["step"], r["timed"]) for r in runs] == [(0, False), (1, True)]
    assert all(r["workload"].endswith("2 rank(s)") and r["samples_per_rank"] == 16 and r["micro_batches"] == 4
               and r["logprob_micro_batches"] == 2  # 2 optimizer steps of 8 rows a rank: the second's
               and r["response_mean"] == 40 and r["train_s"] > 0 and r["logprobs_s"] > 0
               and r["compiled_graphs"] == 0 for r in runs)  # eager on CPU: nothing compiled on either rank
    bad = subprocess.run([sys.executable, *cmd[:4], "--set", "rollout.n=3", "train.micro_batch_size=4", "--prompts", "3",
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True, cwd=REPO)  # 9 samples
    assert bad.returncode == 2 and bad.stderr.startswith("error: --prompts 3:") and len(bad.stderr.splitlines()) == 1
    assert not (tmp_path / "bad").exists()
    cpu = subprocess.run([sys.executable, *cmd, "--prompts", "8", "--memory", "--out", str(tmp_path / "cpu")],
                         capture_output=True, text=True, cwd=REPO)  # the allocator history is CUDA's
    assert cpu.returncode == 2 and cpu.stderr.startswith("error: --memory:") and len(cpu.stderr.splitlines()) == 1
    assert not (tmp_path / "cpu").exists()


def test_trainer_pass_under_fsdp2_computes_the_unsharded_logprobs(tmp_path):
    """torchrun, 2 gloo ranks: each mode's model built and sharded as the trainer prepares it, the padded
    variants timed, and their log-probabilities those of the same model on one process; fp8_cached (the
    weights all-gathered in FP8, at a width whose weights split into whole blocks) computes fp8's exactly."""
    wide = ["model.tiny.hidden_size=256", "model.tiny.intermediate_size=512", "model.tiny.num_heads=8",
            "model.tiny.num_kv_heads=8"]
    cmd = ["-m", "bench.trainer_pass", "--config", "configs/tiny_cpu.yaml", "--set", *wide, "--rows", "2", "--prompt", "5",
           "--response", "40", "--iters", "1", "--modes", "bf16,fp8,fp8_cached"]
    one = subprocess.run([sys.executable, *cmd, "--out", str(tmp_path / "one")], capture_output=True, text=True, cwd=REPO)
    two = ranks_run(["--nproc_per_node", "2", *cmd, "--out", str(tmp_path / "two")], REPO, tmp_path / "two")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, crash_report(two.stderr)
    assert "8 FP8 weights all-gathered in FP8" in two.stdout
    ref = {r["mode"]: r for r in json.loads((tmp_path / "one/trainer_pass.json").read_text())["runs"]}
    runs = json.loads((tmp_path / "two/trainer_pass.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == [f"{m} fsdp2{h}" for m in ("bf16", "fp8", "fp8_cached") for h in ("", " unfused head")]
    assert all(r["workload"].endswith("FSDP2 over 2 ranks") and r["train_ms"] > 0 for r in runs)
    for r in runs:
        unsharded = ref[r["mode"].replace("fsdp2", "").replace("  ", " ").strip()]
        assert r["tokens"] == unsharded["tokens"] == 128
        assert r["logp_sum"] == pytest.approx(unsharded["logp_sum"], rel=1e-6)
    by_mode = {r["mode"]: r["logp_sum"] for r in runs}
    assert by_mode["fp8_cached fsdp2"] == by_mode["fp8 fsdp2"]


def test_trainer_pass_builds_a_shipped_config_at_a_named_shape(tmp_path):
    """--shape qwen3 builds the config's model from scratch at Qwen3-8B's dims (model.tiny), and --set
    applies after it (here: cut down to one small layer, so the CPU can run it)."""
    small = ["model.tiny.num_layers=1", "model.tiny.hidden_size=128", "model.tiny.intermediate_size=256",
             "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.head_dim=64", "model.tiny.vocab_size=0"]
    p = subprocess.run([sys.executable, "-m", "bench.trainer_pass", "--config", str(REPO / "configs/tiny_cpu.yaml"),
                        "--shape", "qwen3", "--set", *small, "--rows", "1", "--prompt", "4", "--response", "8",
                        "--modes", "bf16", "--iters", "1", "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    runs = json.loads((tmp_path / "trainer_pass.json").read_text())["runs"]
    assert "Qwen3ForCausalLM" in runs[0]["workload"] and "tiny_cpu.yaml" in runs[0]["workload"]
    assert runs[0]["mode"] == "bf16 unpadded" and runs[0]["tokens"] == 12


def test_checkpoint_bench_runs_on_cpu(tmp_path):
    """bench/checkpoint.py at a tiny shape: the four (format, op) rows, each load restores every
    weight and moment, both formats hold the same bytes to within DCP's index, the dir is cleaned."""
    r = subprocess.run([sys.executable, "-m", "bench.checkpoint", "--tiny", "--layers", "2", "--device", "cpu",
                        "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "ckpt")],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "out/checkpoint.json").read_text())
    assert [(row["mode"], row["op"]) for row in doc["runs"]] == [("full", "save"), ("full", "load"),
                                                                  ("dcp", "save"), ("dcp", "load")]
    assert [row["restored"] for row in doc["runs"]] == [None, True, None, True]
    full, sharded = doc["runs"][0]["ckpt_gb"], doc["runs"][2]["ckpt_gb"]
    assert doc["params"] * 12 / 1e9 <= min(full, sharded) and abs(full - sharded) < 0.2 * full
    assert doc["layers"] == 2 and not list((tmp_path / "ckpt").iterdir())


def test_gemm_bench_names_bad_token_counts_and_needs_hopper(tmp_path):
    """bench/gemm.py: a token count that is not a positive multiple of 128 is a usage error naming the
    value (exit 2, nothing written); on a host without an SM90 GPU it stops with what it needs."""
    bench = [sys.executable, "-m", "bench.gemm", "--out", str(tmp_path)]
    for bad in ("100", "8192,abc", "0"):
        p = subprocess.run([*bench, "--tokens", bad], capture_output=True, text=True)
        assert p.returncode == 2 and f"error: --tokens {bad}: each must be a positive multiple of 128" in p.stderr
    p = subprocess.run([*bench, "--tokens", "8192"], capture_output=True, text=True)
    if not p.returncode:
        pytest.skip("an SM90 GPU is here: the benchmark ran")
    assert "needs a Hopper (SM90) GPU" in p.stderr
    assert not list(tmp_path.iterdir())


def test_host_speed_prints_one_json_line_of_facts_and_times():
    """bench/host_speed.py: one JSON line with the host's CPU facts and each timing, positive numbers (no
    figure is pinned: they are the host's)."""
    p = subprocess.run([sys.executable, "-m", "bench.host_speed"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (line,) = p.stdout.strip().splitlines()
    out = json.loads(line)
    assert out["cpus_allowed"] >= 1 and out["python"] == sys.version.split()[0]
    for key in ("py_loop_ms", "py_objs_ms", "hash_pickle_ms", "torch_cpu_small_op_us", "torch_custom_op_us",
                "torch_custom_op_inplace_us", "torch_library_op_inplace_us"):
        assert out[key] > 0, key
    assert ("cuda_launch_us" in out) == torch.cuda.is_available()


def test_attention_bench_names_bad_counts_and_needs_a_gpu(tmp_path):
    """bench/attention.py: a count below 1 is a usage error naming the flag (exit 2); without CUDA it stops
    with what it needs; nothing written either way."""
    bench = [sys.executable, "-m", "bench.attention", "--out", str(tmp_path)]
    p = subprocess.run([*bench, "--multiple", "0"], capture_output=True, text=True)
    assert p.returncode == 2 and "error: --multiple 0: give a positive integer" in p.stderr
    p = subprocess.run([*bench, "--steps", "1", "--prompts", "1"], capture_output=True, text=True, timeout=600)
    if not p.returncode:
        pytest.skip("a GPU is here: the benchmark ran")
    assert p.returncode == 2 and "run it on a GPU host" in p.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("checkpointing", [True, False])
def test_casts_counts_each_weight_cast_of_a_train_micro_batch(checkpointing):
    """bench/casts.py: under bf16 autocast every weight is cast once in the forward, once more in the
    recompute when its layer is checkpointed, and its gradient once back to fp32."""
    from bench.casts import count

    want = {"forward layers float32->bfloat16": 1.0, "forward head float32->bfloat16": 1.0,
            "backward grad bfloat16->float32": 1.0}
    if checkpointing:  # the head is outside the checkpointed layers: not recomputed
        want["backward layers float32->bfloat16"] = 1.0
    assert count(checkpointing) == want


def test_head_variants_agree_with_the_trainers_head(tmp_path):
    """bench/head.py: the fused head and the compiled ones (Inductor on the CPU here) give the unfused head's
    log p, entropy and gradients (h and the head weight) up to fp32 rounding; head.json has each variant; the
    one compiled for any length serves a shorter micro-batch without a new graph."""
    from bench.head import VARIANTS, main

    for entropy in ([], ["--entropy"]):  # the 8B configs' train forward, and one under an entropy bonus
        runs = main(["--hidden", "64", "--vocab", "512", "--rows", "3", "--length", "33", "--iters", "2",
                     "--out", str(tmp_path), *entropy])
        assert [r["variant"] for r in runs] == list(VARIANTS)
        for r in runs:
            assert all(r[f"max_diff_{k}"] < 1e-4 for k in ("logp", "entropy", "grad_h", "grad_w")), r
            assert r["ms"] > 0 and r["workload"].endswith(", entropy") == bool(entropy)
        assert runs[0]["max_diff_grad_w"] == 0  # unfused is the reference
        assert [r.get("recompiles") for r in runs] == [None, None, None, 0]
        assert [r["variant"] for r in json.loads((tmp_path / "head.json").read_text())["runs"]] == list(VARIANTS)
