"""fp8/ on an SM90 GPU (H100/H200) with torchao 0.18; skipped without one.

* quant.py == torchao's Triton quantization kernels, bit for bit (weights 128x128, activations
  1x128 and 128x1), and the FP8 weight torchao's linear actually feeds its GEMM == quant.py's;
* fp8/fast/kernels.py's quant_dual == torchao's three activation quantizers, bit for bit; its SwiGLU
  modes == quant_dual of swiglu(gu) / swiglu_backward; a compiled FP8 linear and a compiled fused
  SwiGLU MLP == the eager ones, bit for bit;
* convert_to_fp8_training on a small Llama (hidden 1024) picks torchao; forward/backward are
  finite with a token count that is not a multiple of 128 (padding path);
* FP8 error vs the BF16 reference (bf16_reference) below stated bounds;
* EmulatedFP8Linear == torchao up to accumulation order (fp32 GEMM vs FP8 tensor cores), for the
  output and both gradients;
* vLLM's CUDA 1x128 activation quantizer == quant.py's 'vllm' recipe (skipped without vLLM).

    python -m pytest tests/gpu/test_fp8_gpu.py -q -s     # -s prints the measured errors
"""

import math
import re

import pytest
import torch
from torch import nn

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not SM90, reason="needs CUDA on an SM90 (H100/H200) GPU")

from config import FP8Config  # noqa: E402
from fp8.calibrate import QKVCalibrator  # noqa: E402
from fp8.fast.cache import refresh_weight_caches, refresh_weight_caches_on_step  # noqa: E402
from fp8.fast.swiglu import FusedSwiGLU, swiglu, swiglu_backward  # noqa: E402
from fp8.linear import EmulatedFP8Linear, bf16_reference  # noqa: E402
from fp8.quant import E4M3, quantize_act_1x128, quantize_act_128x1, quantize_blockwise  # noqa: E402
from fp8.torchao import torchao_linear_cls  # noqa: E402
from test_fp8_linear import convert_fast  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def torchao_quantizers_without_autotuning():
    """These tests check numerics, not speed: each of torchao's quantizers runs with one fixed launch
    config. torchao 0.18 autotunes a quantizer over up to 45 configs for every new K (~20 s each on
    an H100), and the small models here bring a dozen new Ks: the file outlasted a 10-minute device
    call. A quantizer's output does not depend on its launch config (rows/columns per program,
    warps, stages); Triton skips the benchmark when an autotuner has a single config."""
    from torchao.prototype.blockwise_fp8_training import kernels
    from triton.runtime.autotuner import Autotuner

    saved = {t: t.configs for t in vars(kernels).values() if isinstance(t, Autotuner)}
    prefer = {"NUM_GROUPS": 64, "BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128}
    for t, configs in saved.items():
        pick = [c for c in configs if all(c.kwargs.get(k, v) == v for k, v in prefer.items())
                and (c.num_warps, c.num_stages) == (4, 2)]
        t.configs = (pick or configs)[:1]
    yield
    for t, configs in saved.items():
        t.configs = configs


# Bounds; measured on an H100 (torch 2.11, torchao 0.18), printed with -s:
LINEAR_REL_ERR = 0.06  # FP8 linear vs BF16, random normal x and W: measured 0.036 (torchao: ~3.6%)
LOGITS_REL_ERR = 0.15  # 2-layer random-init Llama, all 14 linears FP8: measured 0.109
EMU_REL_ERR = 2e-3  # emulation vs torchao, relative Frobenius error: measured 6.6e-4 .. 7.0e-4
# Elementwise: |emu - torchao| <= EMU_ULPS bf16 ulps of |torchao| + EMU_ATOL * rms. The emulation is
# the exact FP8 product rounded once to bf16 (fp32 accumulate: 1.662e-3 from fp64, like rounding the
# fp64 result); torchao's FP8 tensor-core accumulation adds noise that is absolute (~2^-14 of
# sum |terms|), so outputs near 0 need the rms-relative atol; elsewhere they differ by 1 bf16 ulp.
EMU_ULPS, EMU_ATOL = 2, 5e-3


@pytest.fixture(scope="module")
def ao():
    return pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")


def same_bytes(a, b):
    return a.dtype == b.dtype == E4M3 and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def weight(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape, device="cuda", generator=g) * 0.02
    w[:128, :128] = 0  # zero block
    w[128:256, 128:256] *= 5e5  # amax ~ 1e4
    w[256:384, :128] *= 1e-6
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 1024), (384, 640)])
def test_weight_quant_equals_torchao_triton(ao, shape, dtype):
    w = weight(shape, dtype=dtype)
    q, s = quantize_blockwise(w)
    assert torch.equal(q.view(torch.uint8).cpu(), quantize_blockwise(w.cpu())[0].view(torch.uint8))  # device-free
    nonzero = w.float().abs().view(shape[0] // 128, 128, shape[1] // 128, 128).amax(dim=(1, 3)) > 0
    # forward path: W^T, 128x128 blocks, column-major [K, N]
    y_t, s_t = ao.triton_fp8_blockwise_weight_quant_transposed_rhs(w)
    assert same_bytes(y_t.t(), q)
    assert torch.equal(s_t.t()[nonzero], s[nonzero])
    # dgrad path: W, 128x128 blocks, column-major [N, K]
    y, s2 = ao.triton_fp8_blockwise_weight_quant_rhs(w)
    assert same_bytes(y, q)
    assert torch.equal(s2[nonzero], s[nonzero])
    zero_diff = int((s_t.t()[~nonzero] != s[~nonzero]).sum() + (s2[~nonzero] != s[~nonzero]).sum())
    print(f"\nweight {shape} {dtype}: bytes equal; all-zero blocks with another eps rounding: {zero_diff}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_equals_torchao_triton(ao, dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(512, 1024, device="cuda", generator=g) * 3)
    x[7, :128] = 0
    x[:128, 5] = 0
    x[300:, 200:] *= 1e3
    x = x.to(dtype)
    q, s = quantize_act_1x128(x)
    y, sy = ao.triton_fp8_blockwise_act_quant_lhs(x)  # forward x and dgrad grad_out: 1x128
    assert same_bytes(y, q)
    nz = x.float().abs().view(512, 8, 128).amax(-1) > 0
    assert torch.equal(sy[nz], s[nz])
    qc, sc = quantize_act_128x1(x)
    y, sy = ao.triton_fp8_blockwise_act_quant_rhs(x)  # wgrad x: 128x1
    assert same_bytes(y, qc)
    nzc = x.float().abs().view(4, 128, 1024).amax(1) > 0
    assert torch.equal(sy[nzc], sc[nzc])
    y, sy = ao.triton_fp8_blockwise_act_quant_transposed_lhs(x)  # wgrad grad_out^T: [K, M], 1x128
    assert same_bytes(y, qc.t())
    assert torch.equal(sy.t()[nzc], sc[nzc])


@pytest.mark.parametrize("shape", [(512, 1024), (384, 14336)])
def test_quant_dual_equals_torchao_triton(ao, shape):
    """fp8/fast/kernels.py's quant_dual (one read, both layouts) == torchao's act_quant_lhs, act_quant_rhs
    and act_quant_transposed_lhs: same bytes, scales and layouts (zero groups included). A NaN stays
    NaN (no clamp before the saturating conversion, unlike torchao) and leaves its group's other
    values as torchao quantizes them."""
    from fp8.fast.kernels import quant_dual

    g = torch.Generator(device="cuda").manual_seed(2)
    m, k = shape
    x = torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-4, 3, k, device="cuda")
    x[5, :128] = 0  # a zero 1x128 group
    x[128:256, 7] = 0  # a zero 128x1 group
    x = x.bfloat16()
    q, s, qt, st = quant_dual(x)
    for got, want in (((q, s), ao.triton_fp8_blockwise_act_quant_lhs(x)),
                      ((qt.t(), st), ao.triton_fp8_blockwise_act_quant_rhs(x)),
                      ((qt, st.t()), ao.triton_fp8_blockwise_act_quant_transposed_lhs(x))):
        assert [(t.shape, t.stride()) for t in got] == [(t.shape, t.stride()) for t in want]
        assert same_bytes(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="M a multiple of 128"):
        quant_dual(x[:100])
    x[3, 200] = float("nan")
    q, s, qt, st = quant_dual(x)
    assert q[3, 200].float().isnan() and qt[200, 3].float().isnan()
    want_q, want_s = ao.triton_fp8_blockwise_act_quant_lhs(x)
    print(f"\nNaN input: quant_dual writes {q[3, 200].float().item()}, torchao {want_q[3, 200].float().item()}")
    got, want = q.view(torch.uint8).clone(), want_q.view(torch.uint8).clone()
    got[3, 200] = want[3, 200] = 0
    assert torch.equal(got, want) and torch.equal(s, want_s)


def test_quant_dual_launch_configs_write_the_same_bytes():
    """bench/quant.py's sweep may pick any (row splits, num_warps[, stages, programs per SM]): each
    writes the same bytes, the persistent grids too (fewer programs than tiles); FP8_GRPO_QUANT_DUAL
    is checked."""
    from fp8.fast.kernels import _config_from_env, quant_dual, quant_dual_with

    x = (torch.randn(384, 14336, device="cuda") * torch.logspace(-3, 2, 14336, device="cuda")).bfloat16()
    want = quant_dual(x)
    for cfg in [(1, 4), (1, 8), (2, 8), (4, 8), (8, 16), (1, 8, 2, 1), (2, 4, 3, 2), (1, 16, 1, 1)]:
        got = quant_dual_with(x, cfg)
        assert all(same_bytes(a, b) if a.dtype != torch.float32 else torch.equal(a, b) for a, b in zip(got, want)), cfg
    assert _config_from_env("2,8") == (2, 8) and _config_from_env("") == _config_from_env(None)
    assert _config_from_env("1,8,2,1") == (1, 8, 2, 1)
    for bad in ("2", "3,8", "2,6", "2,8,1", "a,b", "1,8,0,1", "1,8,2,0"):
        with pytest.raises(ValueError, match="FP8_GRPO_QUANT_DUAL"):
            _config_from_env(bad)


def test_quant_bench_times_each_call_of_a_layer():
    """bench.quant --shape: every call of a layer runs with the trainer's launches and gets a time and a copy
    floor; the last row sums them over a micro-batch's calls."""
    from bench import quant

    rows = quant.per_call("llama3b", 256)
    calls, total = rows[:-1], rows[-1]
    assert len(calls) == 8 and all(r["ms"] > 0 and r["floor_ms"] > 0 for r in calls)
    assert total["ms"] == pytest.approx(sum(r["ms"] * r["per_micro_batch"] * 28 for r in calls))
    print({r["call"]: round(r["vs_floor"], 2) for r in rows})


def test_swiglu_quant_kernels_quantize_swiglu_like_quant_dual():
    """fp8/fast/kernels.py's SwiGLU modes: the BF16 tile they quantize is fp8.fast's swiglu(gu) /
    swiglu_backward(grad_h, gu) within one bf16 ulp (float32 sigmoid implementations differ), and the
    bytes and scales they write are quant_dual's of that tile, bit for bit, for each launch config."""
    from fp8.fast.kernels import (SWIGLU_CONFIG, _launch, quant_dual, swiglu_backward_quant_dual, swiglu_quant_dual,
                                  swiglu_quant_lhs)

    g = torch.Generator(device="cuda").manual_seed(3)
    m, inter = 384, 1408
    gu = (torch.randn(m, 2 * inter, device="cuda", generator=g) * 3).bfloat16()
    dh = (torch.randn(m, inter, device="cuda", generator=g) * torch.logspace(-3, 1, inter, device="cuda")).bfloat16()
    cases = (("forward", (None, gu), inter, 1, swiglu(gu), swiglu_quant_dual(gu)),
             ("backward", (dh, gu), 2 * inter, 2, swiglu_backward(dh, gu), swiglu_backward_quant_dual(dh, gu)))
    for name, args, k, mode, ref, op_out in cases:
        for cfg in [(2, 4), (1, 8), (4, 4), (1, 8, 2, 1), (1, 16, 2, 1), SWIGLU_CONFIG]:
            tile = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            got = _launch(*args, k, mode=mode, config=cfg, x_out=tile)
            d = (tile.float() - ref.float()).abs()
            exact = (d == 0).float().mean().item()
            print(f"\n{name} {cfg}: tile == torch reference for {exact:.5f} of elements, max diff {(d / bf16_ulp(ref)).max():.1f} ulp")
            assert (d <= bf16_ulp(ref)).all() and exact > 0.99, name
            want = quant_dual(tile)
            assert all(same_bytes(a, b) if a.dtype != torch.float32 else torch.equal(a, b) for a, b in zip(got, want))
            if cfg == SWIGLU_CONFIG:  # the default launch: what the ops run
                assert all(same_bytes(a, b) if a.dtype != torch.float32 else torch.equal(a, b)
                           for a, b in zip(op_out, got)), name
    q, s = swiglu_quant_lhs(gu)
    assert same_bytes(q, cases[0][5][0]) and torch.equal(s, cases[0][5][1])
    with pytest.raises(ValueError, match="gu"):
        swiglu_quant_dual(gu[:, :384].contiguous())  # I = 192: not a multiple of 128
    with pytest.raises(ValueError, match="grad_h"):
        swiglu_backward_quant_dual(dh[:, :128].contiguous(), gu)


@pytest.mark.parametrize("cache", [False, True])
def test_fused_swiglu_mlp_torchao(cache):
    """fp8.fuse_swiglu with torchao's GEMMs: the fused MLP == HF's MLP of FP8 linears up to h's rounding
    (once vs silu rounded first: moves some FP8 roundings), and a torch.compile'd one == eager, bit for
    bit (output and every gradient), 400 tokens (padded to 512)."""
    outs = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 200, 1024, device="cuda", generator=g).bfloat16()
    gy = torch.randn(2, 200, 1024, device="cuda", generator=g).bfloat16()
    for fuse in (False, True):
        model = small_llama()
        convert_fast(model, FP8Config(fuse_swiglu=fuse, cache_weights=cache))
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp, FusedSwiGLU) == fuse
        for compiled in (False, True) if fuse else (False,):
            torch._dynamo.reset()
            fn = torch.compile(mlp, fullgraph=True) if compiled else mlp
            xi = x.clone().requires_grad_(True)
            mlp.zero_grad(set_to_none=True)
            y = fn(xi)
            y.backward(gy)
            outs[fuse, compiled] = [y.detach(), xi.grad] + [mlp.get_submodule(n).weight.grad.clone()
                                                            for n in ("gate_proj", "up_proj", "down_proj")]
    torch._dynamo.reset()
    names = ("out", "grad_x", "grad_gate", "grad_up", "grad_down")
    same = {n: torch.equal(a, b) for n, a, b in zip(names, outs[True, False], outs[True, True])}
    err = {n: round(rel(a, b), 5) for n, a, b in zip(names, outs[False, False], outs[True, False])}
    print(f"\nfused SwiGLU MLP (cache={cache}): compiled vs eager bitwise {same}; vs HF MLP rel {err}")
    assert all(same.values()), same
    assert max(err.values()) < 2e-2, err  # a wrong slice, order or silu': ~1


@pytest.mark.parametrize("cache", [False, True])
def test_compiled_fp8_linear_equals_eager(cache):
    """A torch.compile'd TorchaoFP8Linear (quant_dual and torchao's ops traced as custom ops) gives the
    eager module's output and both gradients bit for bit; so does it with fp8.cache_weights."""
    torch.manual_seed(0)
    lin = nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    model = nn.Sequential(lin)
    convert_fast(model, FP8Config(cache_weights=cache))
    mod = model[0]
    if cache:
        assert refresh_weight_caches(model) == 1
    x = torch.randn(4, 128, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4, 128, 2048, device="cuda", dtype=torch.bfloat16)
    outs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(mod, fullgraph=True) if compiled else mod
        xi = x.clone().requires_grad_(True)
        mod.weight.grad = None
        y = fn(xi)
        y.backward(g)
        outs.append((y.detach(), xi.grad, mod.weight.grad.clone()))
    torch._dynamo.reset()
    same = {k: torch.equal(a, b) for k, a, b in zip(("out", "grad_x", "grad_w"), *outs)}
    print(f"\ncompiled vs eager TorchaoFP8Linear (cache={cache}): bitwise {same}")
    assert all(same.values()), same


def test_compiled_norm_into_quant_dual_writes_the_norm_once():
    """An RMSNorm compiled into quant_dual (the FP8 layer's qkv and gate/up input) writes its output once:
    with x passed in three of the kernel's pointer slots, Inductor made one copy per slot, and the
    fused norm kernel wrote three identical [M, K] float32 tensors. Values as eager's, up to the norm's last bit."""
    from torch._inductor.utils import run_and_get_code

    from fp8.fast.kernels import quant_dual

    def norm_quant(h, w):
        x = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return quant_dual(x.reshape(-1, x.shape[-1]))

    torch.manual_seed(0)
    h = torch.randn(2, 256, 512, device="cuda")
    w = torch.rand(512, device="cuda") + 0.5
    torch._dynamo.reset()
    got, (code, *_) = run_and_get_code(torch.compile(norm_quant, fullgraph=True), h, w)
    torch._dynamo.reset()
    shapes = re.findall(r"empty_strided_cuda\(\(([\d, ]+)\), \([\d, ]+\), torch\.float32\)", code)
    copies = sum(math.prod(int(n) for n in shape.split(",") if n.strip()) == h.numel() for shape in shapes)
    print(f"\nfloat32 buffers of the norm's size in the compiled norm + quant_dual: {copies}")
    assert copies == 1, code
    for a, b in zip(got, norm_quant(h, w)):  # Inductor's norm may round its last bit apart from eager's
        if a.dtype == E4M3:  # then an FP8 value lands one step away, rarely
            a, b = a.float(), b.float()
            assert ((a - b).abs() <= b.abs() / 8 + 2**-9).all() and (a != b).float().mean() < 1e-2
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0)


def test_torchao_linear_uses_quant_py_weights(monkeypatch):
    """Intercept the weight operand our torchao linear hands to its FP8 GEMM (forward and dgrad)."""
    cls = torchao_linear_cls()
    seen = {}
    for name in ("weight_transposed_rhs", "weight_rhs"):
        orig = getattr(cls.kernels, name)
        monkeypatch.setattr(cls.kernels, name, lambda w, *a, _o=orig, _n=name, **k: seen.setdefault(_n, _o(w, *a, **k)))
    lin = nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    mod = cls.from_float(lin)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mod(x).sum().backward()
    q, s = quantize_blockwise(lin.weight)
    y_t, s_t = seen["weight_transposed_rhs"]
    y, s2 = seen["weight_rhs"]
    assert same_bytes(y_t.t(), q) and torch.equal(s_t.t(), s)
    assert same_bytes(y, q) and torch.equal(s2, s)


def test_torchao_linear_equals_torchao_fp8_blockwise_mm():
    """Our _BlockFP8MM with the recipe's TorchaoKernels (torchao's quantizers) and with fp8.fast's
    DualQuantKernels (one-pass quantizer, x saved in FP8) is torchao's fp8_blockwise_mm, bit for bit
    (output, dgrad, wgrad); a fused q/k/v group equals the three linears up to accumulation order."""
    from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

    from fp8.fast.dual import DualQuantKernels

    torch.manual_seed(0)
    lin = nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    recipe, fast = torchao_linear_cls().from_float(lin), torchao_linear_cls().from_float(lin)
    fast.kernels = DualQuantKernels()
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    outs = []
    for fn in (lambda xi: fp8_blockwise_mm.apply(xi, lin.weight, 128, torch.bfloat16, False), recipe, fast):
        xi = x.clone().requires_grad_(True)
        lin.weight.grad = None
        y = fn(xi)
        y.backward(g)
        outs.append((y.detach(), xi.grad, lin.weight.grad.clone()))
    same = {f"{who} {k}": torch.equal(a, b) for who, ours in (("recipe", outs[1]), ("fast", outs[2]))
            for k, a, b in zip(("out", "grad_x", "grad_w"), ours, outs[0])}
    diff = {f"{who} {k}": rel(a, b) for who, ours in (("recipe", outs[1]), ("fast", outs[2]))
            for k, a, b in zip(("out", "grad_x", "grad_w"), ours, outs[0])}
    ref = torch.nn.functional.linear(x, lin.weight)
    print(f"\nours vs torchao fp8_blockwise_mm: bitwise {same}, rel {diff}; vs BF16: ours {rel(outs[1][0], ref):.4f}, "
          f"torchao {rel(outs[0][0], ref):.4f}")

    def run(fuse):
        torch.manual_seed(1)
        model = small_llama()
        convert_fast(model, FP8Config(fuse_projections=fuse, fuse_swiglu=False))
        ids = torch.randint(0, 512, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach().float(), model.model.layers[1].self_attn.k_proj.weight.grad.float()

    (lf, gf), (ls, gs) = run(True), run(False)
    print(f"\nfused vs separate: logits rel {rel(lf, ls):.2e}, k_proj grad rel {rel(gf, gs):.2e}")
    assert all(same.values()), diff
    assert rel(lf, ls) < 2e-2 and rel(gf, gs) < 0.1  # a wrong slice or concatenation order: ~1.4


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=2, vocab_size=512, max_position_embeddings=512,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def test_convert_small_llama_torchao():
    model = small_llama()
    names = convert_fast(model, FP8Config())
    assert len(names) == 14
    cls = torchao_linear_cls()
    assert all(isinstance(model.get_submodule(n), cls) for n in names)
    assert {type(model.get_submodule(n).kernels).__name__ for n in names} == {"DualQuantKernels"}  # fp8.fast
    ids = torch.randint(0, 512, (2, 100), device="cuda")  # 200 tokens: padded to 256 inside
    calib = QKVCalibrator(model)
    with calib.capture():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert all(0 < s < float("inf") for sc in calib.scales().values() for s in sc)
    with torch.no_grad():
        fp8_logits = model(input_ids=ids).logits
        with bf16_reference(model):
            ref = model(input_ids=ids).logits
    err = rel(fp8_logits, ref)
    print(f"\nsmall Llama logits: FP8 vs BF16 rel. error {err:.4f} (bound {LOGITS_REL_ERR})")
    assert err < LOGITS_REL_ERR


def bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp(min=2.0 ** -126))) - 7)


def accumulation_noise_ok(a, b):
    """(every element within EMU_ULPS bf16 ulps of b + EMU_ATOL * rms(b), max |a - b| / rms(b))."""
    d, rms = (a.float() - b.float()).abs(), b.float().pow(2).mean().sqrt()
    return bool((d <= EMU_ULPS * bf16_ulp(b) + EMU_ATOL * rms).all()), (d.max() / rms).item()


@pytest.mark.parametrize("m", [256, 328])
def test_emulated_matches_torchao(m):
    torch.manual_seed(m)
    lin = nn.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16)
    ao_mod, emu = torchao_linear_cls().from_float(lin), EmulatedFP8Linear.from_linear(lin)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    outs = []
    for mod in (ao_mod, emu):
        xi = x.clone().requires_grad_(True)
        lin.weight.grad = None
        y = mod(xi)
        y.backward(g)
        outs.append((y.detach(), xi.grad, lin.weight.grad.clone()))
    (y_ao, gx_ao, gw_ao), (y_em, gx_em, gw_em) = outs
    ref = torch.nn.functional.linear(x.float(), lin.weight.float())
    errs = {"out": rel(y_em, y_ao), "grad_x": rel(gx_em, gx_ao), "grad_w": rel(gw_em, gw_ao)}
    elem = {"out": accumulation_noise_ok(y_em, y_ao), "grad_x": accumulation_noise_ok(gx_em, gx_ao),
            "grad_w": accumulation_noise_ok(gw_em, gw_ao)}
    fp8_err = rel(y_ao, ref)
    print(f"\nM={m}: emulated vs torchao rel {errs}, (elementwise ok, max/rms) {elem}; torchao vs BF16 {fp8_err:.4f}")
    assert y_ao.dtype == y_em.dtype == torch.bfloat16
    assert all(e < EMU_REL_ERR for e in errs.values()), errs
    assert all(ok for ok, _ in elem.values()), elem
    assert fp8_err < LINEAR_REL_ERR


def test_vllm_cuda_act_quant_equals_vllm_recipe():
    fp8_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.fp8_utils")
    x = (torch.randn(333, 1024, device="cuda") * 3).to(torch.bfloat16)
    x[3, :128] = 0
    q_v, s_v = fp8_utils.per_token_group_quant_fp8(x, 128, use_ue8m0=False)
    q, s = quantize_act_1x128(x, recipe="vllm")
    assert same_bytes(q_v, q) and torch.equal(s_v, s)


@pytest.mark.parametrize("opts,backend", [
    ({"fuse_projections": False, "fuse_swiglu": False}, None), ({}, None),
    ({"cache_weights": True}, None), ({"cache_weights": True}, "inductor")],
    ids=["linear", "fused", "cache_weights", "compiled"])
def test_torchao_paths_under_activation_checkpointing(opts, backend):
    """The shipped 8B configs train with model.gradient_checkpointing: torchao's FP8 linears, fused
    projections, the fused SwiGLU MLP, the weight cache and train.compile under HF's (non-reentrant)
    checkpointing give the logprobs and gradients of the same model without it, bit for bit."""
    from distributed import compile_layers
    from batch import token_logprobs

    ids = torch.randint(0, 512, (2, 192), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = []
    for checkpointing in (False, True):
        model = small_llama()
        convert_fast(model, FP8Config(**opts))
        if opts.get("cache_weights"):
            refresh_weight_caches_on_step(model, torch.optim.SGD(model.parameters(), lr=0.0))
        if checkpointing:
            model.gradient_checkpointing_enable()
        if backend:
            torch._dynamo.reset()
            compile_layers(model, backend)
        model.train()
        logp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
        (logp * torch.linspace(-1, 1, ids.shape[1], device="cuda")).sum().backward()
        runs.append((logp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch._dynamo.reset()
    (ref_logp, ref_grads), (logp, grads) = runs
    assert torch.equal(logp, ref_logp)
    differ = [n for n, g in ref_grads.items() if g is None or not torch.equal(grads[n], g)]
    print(f"\ncheckpointed torchao model {opts} compile={backend}: {len(ref_grads) - len(differ)}/{len(ref_grads)} "
          "gradients bitwise equal")
    assert not differ, differ


@pytest.mark.parametrize("ranks", [2, 8])
def test_gathered_fp8_operands_equal_torchao_weight_quantizers(ranks):
    """fp8.cache_weights over FSDP2 ranks (fp8/fast/gather.py): each rank's shard quantized by torchao's
    transposed-rhs quantizer, the bytes and scales concatenated as FSDP2's all-gather does, give the
    forward and dgrad operands torchao's quantizers make of the whole (fused) weight: same bytes, same
    layouts."""
    from fp8.fast.gather import GatheredFP8Weight, GatheredKernels, _quantize
    from fp8.torchao import TorchaoKernels

    ws = (weight((2048, 1024), seed=1), weight((1024, 1024), seed=2))  # a fused group (q and k, say)

    def gathered(w):
        parts = [_quantize(s, torchao=True) for s in w.chunk(ranks)]
        return GatheredFP8Weight(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), w.dtype)

    kernels, g = TorchaoKernels(), tuple(gathered(w) for w in ws)
    for got, want in ((GatheredKernels(kernels).weight_fwd(g), kernels.weight_fwd(ws)),
                      (GatheredKernels(kernels).weight_dgrad(g), kernels.weight_dgrad(ws))):
        assert same_bytes(got[0], want[0]) and got[0].shape == want[0].shape and got[0].stride() == want[0].stride()
        assert torch.equal(got[1], want[1]) and got[1].shape == want[1].shape and got[1].stride() == want[1].stride()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fp8_all_gather_under_fsdp2_computes_the_same_logprobs(tmp_path):
    """2 GPUs, NCCL, compiled layers: bench/trainer_pass.py's fp8_cached mode (the weights all-gathered in
    FP8) computes the fp8 mode's log-probabilities exactly, the model built and sharded as the trainer does."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    wide = ["model.tiny.hidden_size=256", "model.tiny.intermediate_size=512", "model.tiny.num_heads=8",
            "model.tiny.num_kv_heads=8"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "bench.trainer_pass", "--config", "configs/tiny_cpu.yaml", "--set", *wide, "--rows", "2",
                        "--prompt", "5", "--response", "250", "--iters", "2", "--compile", "--modes", "fp8,fp8_cached",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=repo, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "8 FP8 weights all-gathered in FP8" in p.stdout
    runs = {r["mode"]: r for r in json.loads((tmp_path / "trainer_pass.json").read_text())["runs"]}
    print({m: (r["logp_sum"], r["logprobs_ms"], r["train_ms"]) for m, r in runs.items()})
    assert runs["fp8_cached fsdp2"]["logp_sum"] == runs["fp8 fsdp2"]["logp_sum"]


@pytest.mark.parametrize("backend", [None, "inductor"], ids=["eager", "compiled"])
def test_grad_accumulation_in_the_wgrad_gemm(backend):
    """fp8.fuse_grad_accum on fp32 master weights under bf16 autocast, as the 8B configs train: over two
    micro-batches of different lengths (checkpointed, compiled or not) the FP8 linears' gradients are
    autograd's within the BF16 rounding autograd's path adds (DeepGEMM's wgrad adds its fp32 product into
    the buffer; without DeepGEMM, cuBLAS's BF16 one), and every other gradient and the logprobs are
    bitwise equal (dgrad is the same kernel); the buffers are those the .grad attributes view."""
    from batch import token_logprobs
    from distributed import compile_layers
    from fp8.fast.accum import grad_accumulators, zero_grad_accumulators
    from fp8.fast.dual import deep_gemm_wgrad
    from modeling import pin_sdpa_backends
    from torch._dynamo.utils import counters

    pin_sdpa_backends(False)  # as prepare_trainer: the first DeepGEMM import cannot switch SDPA's kernel mid-backward
    gen = torch.Generator("cuda").manual_seed(0)
    batches = [torch.randint(0, 512, (2, n), device="cuda", generator=gen) for n in (192, 320)]
    runs = []
    counters.clear()
    for fused in (False, True):
        model = small_llama().float()
        convert_fast(model, FP8Config(cache_weights=True, fuse_grad_accum=fused))
        refresh_weight_caches_on_step(model, torch.optim.SGD(model.parameters(), lr=0.0))
        model.gradient_checkpointing_enable()
        if backend:
            torch._dynamo.reset()
            compile_layers(model, backend)
        model.train()
        if fused:
            assert zero_grad_accumulators(model) == 8  # 2 layers x (qkv, o, gate_up, down)
        logps = []
        for ids in batches:
            with torch.autocast("cuda", torch.bfloat16):
                logp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
            (logp * torch.linspace(-1, 1, ids.shape[1], device="cuda")).sum().backward()
            logps.append(logp.detach())
        grads = {n: p.grad for n, p in model.named_parameters()}
        if fused:
            views = {a.acc.untyped_storage().data_ptr() for a in grad_accumulators(model)}
            fp8_names = {n for n, p in model.named_parameters() if p.grad.untyped_storage().data_ptr() in views}
        runs.append((logps, grads))
    torch._dynamo.reset()
    (ref_logps, ref_grads), (logps, grads) = runs
    assert all(torch.equal(a, b) for a, b in zip(logps, ref_logps))
    assert len(fp8_names) == 14, sorted(fp8_names)  # 2 layers x 7 linears
    errs = {n: rel(grads[n], ref_grads[n]) for n in sorted(fp8_names)}
    others = [n for n in ref_grads if n not in fp8_names and not torch.equal(grads[n], ref_grads[n])]
    print(f"\nfuse_grad_accum ({'DeepGEMM' if deep_gemm_wgrad() else 'cuBLAS + add'}, compile={backend}): "
          f"FP8 weight gradients rel {max(errs.values()):.2e} max over {len(errs)}; other gradients differ: {others}")
    assert not counters["graph_break"], dict(counters["graph_break"])  # the FP8 linears inside the layers' graphs
    assert not others, others
    assert max(errs.values()) < 4e-3, errs  # BF16 rounding of autograd's per-micro-batch products: ~1e-3


def test_deep_gemm_wgrad_adds_into_the_buffer_with_one_kernel_for_every_length():
    """fp8/fast/dual.py's wgrad_into (DeepGEMM's SM90 1D1D kernel, fp32 C = D): acc += g.T @ x from
    quant_dual's operands equals cuBLAS's wgrad (torchao's kernel, BF16 out) within its BF16 rounding, twice
    in a row adds twice; micro-batches of other lengths (the contraction dim, a runtime argument with
    compiled_dims="mn") compile no new kernel into DeepGEMM's JIT cache."""
    import os
    from pathlib import Path

    from fp8.fast.dual import DualQuantKernels, deep_gemm_wgrad, wgrad_into

    if not deep_gemm_wgrad():
        pytest.skip("neither deep_gemm nor vllm.third_party.deep_gemm imports")
    cache = Path(os.environ.get("DG_JIT_CACHE_DIR") or Path.home() / ".deep_gemm")
    ao, n, k = DualQuantKernels(), 1536, 1024

    def operands(m: int, seed: int):
        gen = torch.Generator("cuda").manual_seed(seed)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        g = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
        return ao.dual(g), ao.dual(x)

    def entries() -> int:
        return sum(1 for _ in cache.rglob("*")) if cache.exists() else 0

    (gq, gs, gqt, gst), (xq, xs, xqt, xst) = operands(1024, 0)
    ref = ao.gemm_wgrad(gqt, gst.t(), xqt.t(), xst).float()
    acc = torch.zeros(n, k, device="cuda")
    wgrad_into(acc, gqt, gst.t(), xqt, xst.t())
    err = rel(acc, ref)
    wgrad_into(acc, gqt, gst.t(), xqt, xst.t())
    err2 = rel(acc, 2 * ref)
    before = entries()
    for m in (384, 1664, 2944, 4096):
        (_, _, gqt, gst), (_, _, xqt, xst) = operands(m, m)
        out = torch.zeros(n, k, device="cuda")
        wgrad_into(out, gqt, gst.t(), xqt, xst.t())
        assert rel(out, ao.gemm_wgrad(gqt, gst.t(), xqt.t(), xst).float()) < 4e-3, m
    torch.cuda.synchronize()
    print(f"\nwgrad_into vs cuBLAS wgrad: rel {err:.2e}, twice {err2:.2e}; JIT cache {cache}: {before} -> {entries()} "
          "entries over 4 more lengths")
    assert err < 4e-3 and err2 < 4e-3
    assert entries() == before


@pytest.mark.parametrize("backend", [None, "inductor"], ids=["eager", "compiled"])
def test_deep_gemm_dense_gemms_match_cublas(backend):
    """fp8.dense_gemm=deep_gemm: a linear's output and input gradient (DeepGEMM's 1D2D forward and dgrad GEMMs
    on the same FP8 operands) equal cuBLAS's within accumulation order at two token counts (the token count a
    runtime argument), the weight gradient (cuBLAS's wgrad either way) bit for bit; compiled with fullgraph,
    the custom op stays inside the graph."""
    import copy

    from fp8.fast.dual import DeepGemmKernels, deep_gemm_wgrad

    if not deep_gemm_wgrad():
        pytest.skip("neither deep_gemm nor vllm.third_party.deep_gemm imports")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(1024, 1536, bias=False, device="cuda", dtype=torch.bfloat16))
    data = [(torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16),
             torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16)) for m in (256, 640)]
    runs = {}
    for dense in ("cublas", "deep_gemm"):
        model = copy.deepcopy(base)
        convert_fast(model, FP8Config(dense_gemm=dense))
        mod = model[0]
        assert isinstance(mod.kernels, DeepGemmKernels) == (dense == "deep_gemm")
        torch._dynamo.reset()
        fn = torch.compile(mod, fullgraph=True, backend=backend) if backend and dense == "deep_gemm" else mod
        runs[dense] = []
        for x, g in data:
            xi = x.clone().requires_grad_(True)
            mod.weight.grad = None
            y = fn(xi)
            y.backward(g)
            runs[dense].append((y.detach(), xi.grad, mod.weight.grad.clone()))
    torch._dynamo.reset()
    errs = [(rel(y, y0), rel(gx, gx0)) for (y, gx, _), (y0, gx0, _) in zip(runs["deep_gemm"], runs["cublas"])]
    same_w = [torch.equal(w, w0) for (_, _, w), (_, _, w0) in zip(runs["deep_gemm"], runs["cublas"])]
    print(f"\nDeepGEMM vs cuBLAS forward/dgrad (compile={backend}): rel (out, grad_x) per length {errs}; "
          f"grad_w bitwise {same_w}")
    assert all(same_w), same_w
    assert max(max(e) for e in errs) < 4e-3, errs  # fp32 sums in another order, rounded to BF16: ~1e-3
