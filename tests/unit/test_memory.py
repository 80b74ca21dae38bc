"""memory.py: the start-up memory model against the H200 peaks it was calibrated on, FSDP2's sharding,
and the refusal that never blocks a run that fits."""

from pathlib import Path

import pytest
import torch

import memory
from config import load_config
from distributed import Dist
from errors import UserError

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = memory.ModelShape(8_030_261_248, 4096, 32, 128256, 14336, 8, 128)
QWEN3_8B = memory.ModelShape(8_190_735_360, 4096, 36, 151936, 12288, 8, 128)
H200, H100 = 139.8, 79.2  # GiB
LINE = ("rollout.gpu_memory_utilization=0.4", "train.micro_batch_size=4", "train.fused_head=true")  # the 80 GB line
MB2 = ("rollout.gpu_memory_utilization=0.4", "train.micro_batch_size=2")


def cfg(name, *overrides):
    return load_config(ROOT / "configs" / f"{name}.yaml", list(overrides))


@pytest.mark.parametrize("name,shape,measured", [("llama31_8b_bf16", LLAMA_8B, 109.6), ("llama31_8b_fp8", LLAMA_8B, 121.0),
                                                 ("qwen3_8b_bf16", QWEN3_8B, 112.0),
                                                 ("qwen3_8b_fp8_kv", QWEN3_8B, 123.7)])
def test_trainer_peak_within_5_percent_of_the_h200_measurement(name, shape, measured):
    """The BF16 peaks were measured before the BF16 configs took the weight cache: estimated without it; with it
    the bf16 copy's 2 bytes a parameter more, as the FP8 configs' cache, and no warning."""
    twin = name.endswith("bf16")
    e = memory.estimate(shape, cfg(name, *["fp8.cache_weights=false"] * twin), 1, H200)
    assert abs(e.trainer_peak - measured) < 0.05 * measured, e.trainer_peak
    assert 107 < e.rollout_peak < 113  # measured 109-112 GiB: weights + 8-bit states beside vLLM's 0.45
    assert memory.check(e) is None
    if twin and cfg(name).fp8.cache_weights:  # llama31_8b_bf16 (qwen3_8b_bf16 leaves it off: its yaml says why)
        shipped = memory.estimate(shape, cfg(name), 1, H200)
        assert shipped.fp8_cache == pytest.approx(shape.params * 2 / 2**30)
        assert shipped.trainer_peak == pytest.approx(e.trainer_peak + shipped.fp8_cache)
        assert shipped.rollout_peak == e.rollout_peak and memory.check(shipped) is None


def test_counted_bytes_and_sharding():
    one = memory.estimate(LLAMA_8B, cfg("llama31_8b_fp8"), 1, H200)
    assert one.weights == one.grads == pytest.approx(8.03e9 * 4 / 2**30, rel=1e-3)  # fp32 master weights
    assert one.optimizer == pytest.approx(one.weights / 2) and one.fp8_cache == pytest.approx(one.optimizer)
    assert one.vllm_share == pytest.approx(0.45 * H200) and one.tokens == 4 * 4096
    assert one.kv_tokens == int(one.kv_cache * 2**30 / (2 * 32 * 8 * 128 * 1))  # FP8 KV, 64 KiB a token
    eight = memory.estimate(LLAMA_8B, cfg("llama31_8b_fp8"), 8, H100)
    assert eight.weights == pytest.approx(one.weights / 8) and eight.optimizer == pytest.approx(one.optimizer / 8)
    assert eight.fp8_cache == pytest.approx(one.fp8_cache / 16) and eight.gathered > 0  # its FP8 shard (1 byte)
    # each rank runs whole micro-batches, its FP8 layers counted at BF16's bytes over ranks
    assert eight.activations == memory.estimate(LLAMA_8B, cfg("llama31_8b_bf16"), 8, H100).activations > one.activations
    text = memory.describe(eight)
    assert text.startswith("memory model (GiB per rank, 8 ranks, device 79.2):") and "vLLM share 35.6" in text


def test_checkpointing_every_nth_layer_keeps_the_others_activations():
    # model.gradient_checkpointing_every=n: layers 0, n, 2n, ... keep their input, the others the whole layer term
    act = {every: memory.estimate(LLAMA_8B, cfg("llama31_8b_bf16", f"model.gradient_checkpointing_every={every}"),
                                  1, H200).activations for every in (1, 2, 32)}
    off = memory.estimate(LLAMA_8B, cfg("llama31_8b_bf16", "model.gradient_checkpointing=false"), 1, H200).activations
    assert act[1] < act[2] < act[32] and act[32] == pytest.approx(off, rel=0.02)  # 1 layer in 32: almost none
    assert act[2] == pytest.approx((act[1] + off) / 2, rel=0.03)  # half the layers keep theirs


def test_an_async_trainer_rank_holds_no_vllm_share():
    # rollout.mode=async: the 8B FP8 trainer alone on an 80 GB card; the engine's 0.85 is its own GPU's
    e = memory.estimate(LLAMA_8B, cfg("llama31_8b_fp8", "rollout.mode=async", "rollout.gpu_memory_utilization=0.85"),
                        1, H100)
    assert e.vllm_share == e.kv_cache == e.first_refit == 0 and e.rollout_static < e.device
    assert "vLLM share" not in memory.describe(e)


def test_refused_only_when_the_tensors_alone_exceed_the_device():
    # one 80 GB card: 30 + 30 + 15 GiB of weights, grads and states fit; with vLLM's 0.45 beside
    # weights + states (30 + 15 + 35.6) they do not: refused before the first step, naming the fix
    with pytest.raises(UserError, match=r"weights \+ optimizer states \+ vLLM share need 80\.5 GiB per rank during "
                                        r"rollout, more than the device's 79\.2 GiB: run on more GPUs"):
        memory.check(memory.estimate(LLAMA_8B, cfg("llama31_8b_fp8"), 1, H100))
    # the same tensors fit with a smaller share: the activations make it a warning, not a refusal
    e = memory.estimate(LLAMA_8B, cfg("llama31_8b_fp8", "rollout.gpu_memory_utilization=0.3"), 1, H100)
    assert e.trainer_peak > e.device and e.trainer_static < e.device
    assert memory.check(e).startswith("warning: memory model: ")
    # 2 x H100: the shipped share (0.45) warns (the first refit's step); Qwen3's 152k-token vocabulary makes
    # its BF16 micro-batch of 4 x 4096 tokens warn too (measured 78.2 of 79.2 GiB). vLLM at 0.4 with
    # micro-batches of 2 fit below 92%
    two = memory.estimate(LLAMA_8B, cfg("llama31_8b_fp8"), 2, H100)
    assert two.rollout_peak + two.first_refit > 0.92 * H100 and two.fp8_cache == pytest.approx(8.03e9 / 2 / 2**30, rel=1e-3)
    assert memory.check(two).startswith("warning: memory model: ")
    qwen = memory.estimate(QWEN3_8B, cfg("qwen3_8b_bf16", "rollout.gpu_memory_utilization=0.4"), 2, H100)
    assert qwen.trainer_peak > 0.92 * H100 > qwen.rollout_peak + qwen.first_refit
    for name, shape in (("llama31_8b_fp8", LLAMA_8B), ("qwen3_8b_bf16", QWEN3_8B), ("qwen3_8b_fp8_kv", QWEN3_8B)):
        assert memory.check(memory.estimate(shape, cfg(name, *MB2), 2, H100)) is None, name
        # the README's 80 GB launch line: micro-batches of 4 through the fused LM head fit below 92% too (the model's
        # trainer phase 69.3 GiB for qwen3_8b_fp8_kv, measured 71.2)
        four = memory.estimate(shape, cfg(name, *LINE), 2, H100)
        assert memory.check(four) is None and 62 < four.trainer_peak < 70 and four.peak < 72.5, (name, four)


@pytest.mark.parametrize("name,device,overrides,measured,under", [
    ("qwen3_8b_bf16", H200, LINE, 65.61, 0.0), ("qwen3_8b_fp8_kv", H200, LINE, 70.39, 0.0),
    ("qwen3_8b_fp8_kv", H100, MB2, 67.8, 0.0), ("qwen3_8b_fp8_kv", H100, LINE, 71.2, 0.0),
    ("qwen3_8b_bf16", H100, MB2, 69.4, 5.6)])
def test_two_rank_trainer_peak_against_the_device_peak(name, device, overrides, measured, under):
    """Two ranks (FSDP2): the trainer phase's peak per rank, measured, against the model's. The 80 GB line on 2 H200s
    (bench/trainer_phase.py --memory: device peaks) and on 2 H100s (nvidia-smi), docs/results.md. The model's FSDP2
    terms (3 gathered units, the reduce-scatter stream's fp32 unit) are the allocator's per-stream caches there, and
    its FP8 layers count BF16's bytes over ranks. BF16 at micro-batch 2 on H100s stays 5.6 GiB under (not traced)."""
    e = memory.estimate(QWEN3_8B, cfg(name, *overrides), 2, device)
    assert e.gathered == pytest.approx(3 * 2 * 151936 * 4096 / 2**30)  # 3 bf16 copies of the embedding, the largest unit
    assert e.reduce_scatter == pytest.approx(2 / 3 * e.gathered)  # its fp32 gradient
    assert abs(e.trainer_peak + under - measured) < 0.03 * measured, e.trainer_peak


def test_fp8_layers_are_halved_on_one_rank_only():
    """FP8 linears keep FP8 inputs: half the recomputed layer's bytes on one rank (fitted to the H200 peaks above);
    over FSDP2 ranks the 2-rank peaks held as much as BF16's, so the term is BF16's there."""
    h, f, tokens = QWEN3_8B.hidden, QWEN3_8B.ffn, 4 * 4096
    for world, half in ((1, True), (2, False)):
        fp8 = memory.estimate(QWEN3_8B, cfg("qwen3_8b_fp8_kv"), world, H200)
        bf16 = memory.estimate(QWEN3_8B, cfg("qwen3_8b_bf16"), world, H200)
        gap = 5 * (4 * h + 3 * f) * tokens / 2**30 if half else 0.0
        assert bf16.activations - fp8.activations == pytest.approx(gap), world


@pytest.mark.parametrize("name,shape,world,device,overrides,measured", [
    ("llama31_8b_fp8", LLAMA_8B, 1, H200, [], 125.9), ("llama31_8b_fp8", LLAMA_8B, 2, H200, [], 100.7),
    ("qwen3_8b_bf16", QWEN3_8B, 2, H100, ["rollout.gpu_memory_utilization=0.4"], 69.2),
    ("qwen3_8b_fp8_kv", QWEN3_8B, 2, H100, ["rollout.gpu_memory_utilization=0.4"], 73.2),
    ("qwen3_8b_fp8_kv", QWEN3_8B, 2, H100, LINE, 74.8)])
def test_first_refit_step_within_5_percent_of_nvidia_smi(name, shape, world, device, overrides, measured):
    """Step 0's rollout-phase peak per GPU (nvidia-smi, docs/results.md) against rollout phase + first refit."""
    e = memory.estimate(shape, cfg(name, *overrides), world, device)
    assert abs(e.rollout_peak + e.first_refit - measured) < 0.05 * measured, e.rollout_peak + e.first_refit
    assert e.first_refit == pytest.approx(2 * shape.params / 2**30)


def test_silent_off_cuda():
    lines = []
    model = torch.nn.Linear(2, 2)
    memory.startup_report(cfg("tiny_cpu"), model, Dist(), log=lines.append)
    assert lines == []


def test_fused_head_counts_7_bytes_of_vocabulary_less_per_token():
    """train.fused_head keeps no [tokens, vocab] logits for backward: 7 bytes x V per token less, as
    bench/trainer_pass.py measured (11.8-13.8 GiB at 4 x 4128 tokens, V 128k)."""
    off = memory.estimate(QWEN3_8B, cfg("qwen3_8b_fp8_kv"), 2, H100)
    on = memory.estimate(QWEN3_8B, cfg("qwen3_8b_fp8_kv", "train.fused_head=true"), 2, H100)
    assert off.activations - on.activations == pytest.approx(7 * QWEN3_8B.vocab * off.tokens / 2**30)
    assert on.trainer_peak < off.trainer_peak


def test_memory_breakdown_finds_the_peak_and_what_is_live_there():
    """bench/memory_breakdown.py on a hand-made allocator history: the peak of base + allocs - completed frees,
    the live allocations there by origin and stream, a pre-existing block's free counted, reserved per stream."""
    from bench.memory_breakdown import breakdown, describe, origin

    root = "/repo"
    fsdp = [{"filename": "/site/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "name": "foreach_reduce"},
            {"filename": "/repo/trainer.py", "name": "train_phase"}]
    ours = [{"filename": "/site/torch/nn/functional.py", "name": "linear"},
            {"filename": "/repo/losses/grpo.py", "name": "loss"}]
    mib = 2**20
    trace = [{"action": "alloc", "addr": 1, "size": 10 * mib, "stream": 7, "frames": fsdp},
             {"action": "alloc", "addr": 2, "size": 20 * mib, "stream": 0, "frames": ours},
             {"action": "segment_alloc", "addr": 99, "size": 64 * mib, "stream": 0},
             {"action": "free_requested", "addr": 1, "size": 10 * mib, "stream": 7},  # not yet free
             {"action": "alloc", "addr": 3, "size": 5 * mib, "stream": 0, "frames": []},  # the peak: 35 MiB
             {"action": "free_completed", "addr": 1, "size": 10 * mib, "stream": 7},
             {"action": "free_completed", "addr": 50, "size": 40 * mib, "stream": 0},  # made before the history
             {"action": "alloc", "addr": 4, "size": 30 * mib, "stream": 0, "frames": ours}]  # 5 MiB: below it
    segments = [{"device": 0, "stream": 0, "total_size": 96 * mib, "allocated_size": 55 * mib},
                {"device": 0, "stream": 7, "total_size": 32 * mib, "allocated_size": 0},
                {"device": 1, "stream": 0, "total_size": 512 * mib, "allocated_size": 0}]
    b = breakdown({"device_traces": [trace, []], "segments": segments}, 0, 100 * mib, root, top=2)
    gib = 2**30
    assert b["allocated_peak_gib"] == round(135 * mib / gib, 3) and b["before_gib"] == round(100 * mib / gib, 3)
    assert b["made_in_stretch_at_peak_gib"] == round(35 * mib / gib, 3)
    assert [r["origin"] for r in b["at_peak"]] == ["losses/grpo.py:loss", "fsdp2 foreach_reduce", "1 more"]
    assert b["at_peak"][2]["gib"] == round(5 * mib / gib, 3)
    assert b["at_peak_by_stream"] == {"0": round(25 * mib / gib, 3), "7": round(10 * mib / gib, 3)}
    assert b["reserved_by_stream_at_end"] == {"0": {"reserved_gib": 0.094, "allocated_gib": 0.054},
                                              "7": {"reserved_gib": 0.031, "allocated_gib": 0.0}}
    assert "fsdp2 foreach_reduce" in describe(b)
    assert origin([], root).startswith("no Python frame")
    assert origin([{"filename": "/cache/torchinductor_u/ab/cab.py", "name": "call"}], root) == "compiled graph (Inductor)"
    assert origin([{"filename": "/site/torch/nn/functional.py", "name": "linear"}], root) == "functional.py:linear"
