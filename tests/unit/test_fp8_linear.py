"""fp8/plan.py, fp8/linear.py and fp8/fast/ on CPU: the skip list, in-place conversion of a tiny Llama,
the emulated FP8 GEMMs bit-exact against a manual quantize-dequantize recipe (forward and both backward
GEMMs), bf16_reference, that an all-FP8 model still trains, and that every speed-only path of
fp8.fast (fused projections, fused SwiGLU, weight cache; eager, compiled, checkpointed) computes what
the recipe does."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from config import FP8Config
from engines.hf import convert_to_fp8_rollout
from fp8 import fast
from fp8 import linear as fp8_linear
from fp8.convert import convert_to_fp8_training
from fp8.fast.fused import FusedLinear
from fp8.fast.swiglu import FusedSwiGLU, swiglu, swiglu_backward
from fp8.linear import EmulatedFP8Linear, bf16_reference, is_fp8_linear, use_torchao
from fp8.plan import fp8_eligible, fp8_plan
from fp8.quant import (
    dequantize_act_1x128, dequantize_act_128x1, dequantize_blockwise, quantize_act_1x128, quantize_act_128x1,
    quantize_blockwise,
)


def tiny_llama(layers=4, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=layers, vocab_size=64, max_position_embeddings=128,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype)


def test_skip_reasons():
    model = tiny_llama()
    mlp = model.model.layers[1].mlp
    mlp.gate = nn.Linear(256, 128, bias=False)  # a MoE router
    mlp.biased = nn.Linear(256, 256, bias=True)
    mlp.odd = nn.Linear(256, 96, bias=False)
    cfg = FP8Config(keep_first_layers=1, keep_last_layers=1, keep_bf16=["*.down_proj"])
    plan = fp8_plan(model, cfg)
    assert plan["lm_head"] == (False, "lm_head")
    assert plan["model.layers.0.self_attn.q_proj"] == (False, "keep_first_layers")
    assert plan["model.layers.3.mlp.up_proj"] == (False, "keep_last_layers")
    assert plan["model.layers.1.mlp.gate"] == (False, "MoE router")
    assert plan["model.layers.1.mlp.biased"] == (False, "has bias")
    assert plan["model.layers.1.mlp.odd"] == (False, "dims 96x256 not divisible by 128")
    assert plan["model.layers.2.mlp.down_proj"] == (False, "keep_bf16 '*.down_proj'")
    for i in (1, 2):
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj"):
            assert plan[f"model.layers.{i}.{p}"] == (True, "fp8"), p
    # the per-module rule on its own, and on things that are no linear / wrapped names
    emb = model.model.embed_tokens
    assert fp8_eligible("model.embed_tokens", emb, cfg, 4) == (False, "not an nn.Linear")
    q = model.model.layers[1].self_attn.q_proj
    assert fp8_eligible("_orig_mod.model.layers.1.self_attn.q_proj", q, cfg, 4) == (True, "fp8")
    assert fp8_eligible("model.layers.1.mlp.shared_router", q, cfg, 4) == (False, "MoE router")


def test_fused_groups_stay_consistent():
    """vLLM loads q/k/v into one qkv_proj and gate/up into one gate_up_proj and rejects mixed
    precision: keeping one member in BF16 keeps its group in BF16."""
    model = tiny_llama(layers=2)
    plan = fp8_plan(model, FP8Config(keep_bf16=["model.layers.1.self_attn.k_proj", "*.0.mlp.up_proj"]))
    for p in ("q_proj", "v_proj"):
        assert plan[f"model.layers.1.self_attn.{p}"] == (False, "fused with k_proj (keep_bf16 "
                                                          "'model.layers.1.self_attn.k_proj')")
    assert plan["model.layers.0.mlp.gate_proj"][0] is False
    assert plan["model.layers.0.self_attn.q_proj"] == (True, "fp8")
    assert plan["model.layers.1.self_attn.o_proj"] == (True, "fp8")
    # the per-module rule sees keep_bf16 of siblings by name ...
    cfg = FP8Config(keep_bf16=["*.up_proj"])
    assert fp8_eligible("model.layers.0.mlp.gate_proj", model.model.layers[0].mlp.gate_proj, cfg, 2) == (
        False, "fused with up_proj (keep_bf16 '*.up_proj')")
    # ... dims need the model: one kv head of 64 -> k/v [64, 256] stay BF16, so q_proj does too
    torch.manual_seed(0)
    gqa = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                       num_key_value_heads=1, head_dim=64, num_hidden_layers=1, vocab_size=64))
    plan = fp8_plan(gqa, FP8Config())
    assert plan["model.layers.0.self_attn.k_proj"] == (False, "dims 64x256 not divisible by 128")
    assert plan["model.layers.0.self_attn.q_proj"] == (False, "fused with k_proj (dims 64x256 not divisible by 128)")
    assert plan["model.layers.0.self_attn.o_proj"] == (True, "fp8")


def test_convert_in_place_keeps_names_and_parameters(capsys):
    model = tiny_llama(layers=3)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    cfg = FP8Config(keep_last_layers=1)
    names = convert_to_fp8_training(model, cfg)
    assert "converted 14 linears" in capsys.readouterr().out
    plan = fp8_plan(model, cfg)
    assert names == [n for n, (ok, _) in plan.items() if ok] and len(names) == 14
    assert not use_torchao(cfg)  # CPU
    for n in names:
        m = model.get_submodule(n)
        assert isinstance(m, EmulatedFP8Linear) and m.act_recipe == "torchao"
        assert m.weight is before[n + ".weight"]  # same Parameter object (optimizer state survives)
    assert not is_fp8_linear(model.model.layers[2].mlp.down_proj)
    assert list(model.state_dict()) == keys
    assert convert_to_fp8_training(model, cfg) == []  # idempotent


def manual_forward(x, w):
    """The recipe by hand: dq(q_1x128(x)) @ dq(q_128x128(W)).T in fp32, cast to x.dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    xq = dequantize_act_1x128(*quantize_act_1x128(x2))
    wq = dequantize_blockwise(*quantize_blockwise(w))
    return (xq @ wq.t()).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def test_emulated_forward_backward_bitwise():
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(1)
        lin = nn.Linear(256, 384, bias=False).to(dtype)
        emu = EmulatedFP8Linear.from_linear(lin)
        x = torch.randn(3, 50, 256, dtype=dtype, requires_grad=True)  # 150 tokens: not a multiple of 128
        y = emu(x)
        assert y.dtype == dtype and torch.equal(y, manual_forward(x.detach(), lin.weight.detach()))
        g = torch.randn_like(y)
        y.backward(g)
        # dgrad: grad_out in 1x128 tiles, W in 128x128 blocks
        g2, x2, w = g.reshape(-1, 384), x.detach().reshape(-1, 256), lin.weight.detach()
        gq = dequantize_act_1x128(*quantize_act_1x128(g2))
        wq = dequantize_blockwise(*quantize_blockwise(w))
        assert torch.equal(x.grad, (gq @ wq).to(dtype).reshape(x.shape))
        # wgrad: grad_out and x in 128x1 groups along the token dim
        gc = dequantize_act_128x1(*quantize_act_128x1(g2))
        xc = dequantize_act_128x1(*quantize_act_128x1(x2))
        assert torch.equal(lin.weight.grad, (gc.t() @ xc).to(dtype))
        # and all of it is close to the BF16/FP32 linear (FP8 e4m3: a few % relative error)
        ref = F.linear(x.detach().float(), w.float())
        assert (y.float() - ref).norm() / ref.norm() < 0.08


def convert_fast(model: nn.Module, cfg: FP8Config) -> list[str]:
    """The trainer's FP8 model (run_setup.prepare_trainer): the recipe's linears, then fp8/fast's structure."""
    names = convert_to_fp8_training(model, cfg)
    fast.apply(model, cfg)
    return names

def test_bf16_reference():
    model = tiny_llama(layers=2)
    convert_to_fp8_training(model, FP8Config())
    lin = model.model.layers[0].mlp.up_proj
    x = torch.randn(4, 256)
    with bf16_reference(model):
        assert torch.equal(lin(x), F.linear(x, lin.weight))
        with bf16_reference(model):  # nests
            pass
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    assert not torch.equal(lin(x), F.linear(x, lin.weight))
    assert "fp8_enabled" not in lin.__dict__


def test_all_fp8_model_trains():
    model = tiny_llama(layers=2)
    names = convert_to_fp8_training(model, FP8Config())
    assert len(names) == 14
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


def test_rollout_conversion_and_pinned_weight():
    """convert_to_fp8_rollout = vLLM's activation recipe; load_fp8_weight pins exact FP8 bytes
    until the weight is modified in place."""
    model = tiny_llama(layers=2, dtype=torch.bfloat16)
    names = convert_to_fp8_rollout(model, FP8Config())
    lin = model.get_submodule(names[0])
    assert isinstance(lin, EmulatedFP8Linear) and lin.act_recipe == "vllm"
    w = torch.randn_like(lin.weight)
    q, s = quantize_blockwise(w)
    lin.load_fp8_weight(q, s)
    assert torch.equal(lin.weight, dequantize_blockwise(q, s, dtype=torch.bfloat16))
    x = torch.randn(5, lin.in_features, dtype=torch.bfloat16)
    expected = (dequantize_act_1x128(*quantize_act_1x128(x, "vllm")) @ dequantize_blockwise(q, s).t())
    with torch.no_grad():
        assert torch.equal(lin(x), expected.to(torch.bfloat16))
        lin.weight.mul_(2)  # e.g. an optimizer step: the pin is dropped, the weight re-quantized
        y = lin(x)
    assert lin._fp8_weight is None
    assert torch.equal(y, (dequantize_act_1x128(*quantize_act_1x128(x, "vllm"))
                           @ dequantize_blockwise(*quantize_blockwise(lin.weight)).t()).to(torch.bfloat16))


@pytest.fixture
def float64_gemms(monkeypatch):
    """The emulated FP8 GEMMs accumulate in float64 (their operands, FP8 values times fp32 scales, are
    exact in float64), so a GEMM's fp32 result no longer depends on the BLAS's accumulation order,
    which differs between a fused and a separate GEMM and between hosts. Without this, a result one
    fp32 ulp apart can land on the other side of a later FP8 rounding boundary and move that value
    by an FP8 step (12%): a comparison through several FP8 layers then depends on the host's BLAS."""
    fake_quant = fp8_linear._fake_quant_op
    monkeypatch.setattr(fp8_linear, "_fake_quant_op", lambda *a: fake_quant(*a).double())


def _group_outputs_and_grads(parent, names, h, grads):
    """Call the members `names` of `parent` on h in order (as the HF module does), backward with
    `grads`: (outputs, h.grad, weight grads)."""
    h = h.clone().requires_grad_(True)
    outs = [parent.get_submodule(n)(h) for n in names]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], h.grad, [parent.get_submodule(n).weight.grad for n in names]


def test_fused_projections_match_separate_linears(float64_gemms):
    """fp8.fuse_projections: q/k/v and gate/up run as ONE GEMM on the concatenated weights with
    the same quantization; the members' outputs are slices of one GEMM's output.

    Whole model (float64 GEMMs, so accumulation order is out of the picture): the logits equal the
    one-GEMM-per-linear model's. Gradients, per group, fed the same input and output gradients (so no
    FP8 rounding sees a value that differs): outputs, input gradient and weight gradients equal up to
    fp32 rounding (the input gradient sums the members inside one GEMM instead of adding three).
    A swapped member or a wrong slice is off by O(1)."""
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    sep, fused = tiny_llama(layers=2), tiny_llama(layers=2)
    convert_to_fp8_training(sep, FP8Config(fuse_projections=False))
    convert_fast(fused, FP8Config(fuse_swiglu=False))  # the SwiGLU MLP: test_fused_swiglu_*
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert all(isinstance(m, FusedLinear) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
    assert attn.q_proj.group is attn.k_proj.group is attn.v_proj.group and mlp.gate_proj.group is mlp.up_proj.group
    assert type(mlp.down_proj) is EmulatedFP8Linear and isinstance(attn.q_proj, EmulatedFP8Linear)
    assert type(sep.model.layers[0].self_attn.q_proj) is EmulatedFP8Linear
    assert dict(sep.named_parameters()).keys() == dict(fused.named_parameters()).keys()  # names unchanged

    calls = []
    orig = EmulatedFP8Linear.mm
    EmulatedFP8Linear.mm = lambda self, x, *ws: calls.append(len(ws)) or orig(self, x, *ws)
    try:
        logits_f = fused(input_ids=ids, labels=ids).logits.detach()
    finally:
        EmulatedFP8Linear.mm = orig
    assert calls == [3, 1, 2, 1] * 2, calls  # qkv, o, gate_up, down per layer
    logits_s = sep(input_ids=ids).logits.detach()
    torch.testing.assert_close(logits_f, logits_s, rtol=1e-6, atol=1e-6)

    gen = torch.Generator().manual_seed(2)
    h = torch.randn(2, 32, 256, generator=gen)
    for layer, names in ((1, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                         (0, ("mlp.gate_proj", "mlp.up_proj"))):
        parents = [m.model.layers[layer] for m in (fused, sep)]
        grads = [torch.randn(2, 32, parents[0].get_submodule(n).out_features, generator=gen) for n in names]
        (outs_f, gh_f, gw_f), (outs_s, gh_s, gw_s) = (_group_outputs_and_grads(p, names, h, grads) for p in parents)
        for name, a, b in zip(names * 2, outs_s + gw_s, outs_f + gw_f):
            assert (a - b).norm() <= 1e-6 * a.norm(), name
        assert (gh_s - gh_f).norm() <= 1e-6 * gh_s.norm(), names
    # and quantization is really on: the BF16 reference differs
    with bf16_reference(fused):
        assert not torch.allclose(fused(input_ids=ids).logits, logits_f, atol=1e-5)


def test_swiglu_and_its_backward_against_autograd():
    """swiglu / swiglu_backward (what the fused MLP and fp8/fast/kernels.py compute) == silu(gate) * up and
    its autograd gradient (the silu' formula; both in float32); in bf16 rounded once from float32."""
    gu = torch.randn(16, 2 * 40, dtype=torch.float64) * 3
    dh = torch.randn(16, 40, dtype=torch.float64)
    g = gu.clone().requires_grad_(True)
    h = F.silu(g[:, :40]) * g[:, 40:]
    (want,) = torch.autograd.grad(h, g, dh)
    torch.testing.assert_close(swiglu(gu), h.detach(), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(swiglu_backward(dh, gu), want, rtol=2e-6, atol=1e-6)
    b = gu.bfloat16()
    assert torch.equal(swiglu(b), (F.silu(b.float()[:, :40]) * b.float()[:, 40:]).bfloat16())


class _SwigluSiLU(torch.autograd.Function):
    """silu with its derivative written as swiglu() and swiglu_backward() compute them (same fp32 ops in
    the same order), so the unfused MLP's backward makes the fused node's gradient bit for bit."""

    @staticmethod
    def forward(ctx, g):
        ctx.save_for_backward(g)
        return g * torch.sigmoid(g)

    @staticmethod
    def backward(ctx, grad):
        (g,) = ctx.saved_tensors
        s = torch.sigmoid(g)
        return grad * (s * (1 + g * (1 - s)))


class _SiLUAsSwiglu(nn.Module):
    def forward(self, g):
        return _SwigluSiLU.apply(g)


def _mlp_pass(model, x, g):
    """The layer-0 MLP's output and the gradients of its input and three weights, for output gradient g."""
    mlp = model.model.layers[0].mlp
    xi = x.clone().requires_grad_(True)
    y = mlp(xi)
    y.backward(g)
    return [y.detach(), xi.grad] + [mlp.get_submodule(n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")]


def test_fused_swiglu_mlp_matches_hf_mlp():
    """fp8.fuse_swiglu: a SwiGLU MLP runs as ONE autograd node (silu*mul between its two FP8 GEMMs) with
    the HF MLP's numerics: the HF MLP whose silu computes its value and derivative as the fused node does
    gives the same output and the same gradients, bit for bit. 128 tokens, so that neither path pads and
    both run GEMMs of the same shapes (a BLAS may sum in another order for another row count, as by all
    signs an Intel host's AVX2 MKL did); exact, so no FP8 rounding of grad_gu can land elsewhere on a host
    whose BLAS or vector unit rounds differently. That derivative is silu's (gradcheck). A wrong slice or
    silu' is off by O(1)."""
    torch.autograd.gradcheck(_SwigluSiLU.apply, (torch.randn(64, dtype=torch.float64, requires_grad=True),))
    plain, fused = tiny_llama(layers=1), tiny_llama(layers=1)
    convert_fast(plain, FP8Config(fuse_swiglu=False))
    convert_fast(fused, FP8Config())
    plain.model.layers[0].mlp.act_fn = _SiLUAsSwiglu()
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(0))
    g = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(1))
    outs = [_mlp_pass(model, x, g) for model in (plain, fused)]
    assert isinstance(fused.model.layers[0].mlp, FusedSwiGLU)
    for name, a, b in zip(("y", "x", "gate", "up", "down"), *outs):
        assert torch.equal(a, b), name


def test_fused_swiglu_pads_tokens_with_zero_rows():
    """A token count that is not a multiple of 128 (80): the fused node pads it with zero rows and slices
    them off, giving bit for bit what the same 80 tokens followed by 48 zero tokens give unpadded (the
    same GEMM calls on the same bytes, so on any host): output rows, input gradient, weight gradients."""
    fused = tiny_llama(layers=1)
    convert_fast(fused, FP8Config())
    x = torch.randn(1, 80, 256, generator=torch.Generator().manual_seed(0))
    g = torch.randn(1, 80, 256, generator=torch.Generator().manual_seed(1))
    padded = _mlp_pass(fused, F.pad(x, (0, 0, 0, 48)), F.pad(g, (0, 0, 0, 48)))
    fused.zero_grad(set_to_none=True)
    y, dx, *dw = _mlp_pass(fused, x, g)
    assert torch.equal(y, padded[0][:, :80]) and torch.equal(dx, padded[1][:, :80])
    assert padded[0][:, 80:].abs().max() == 0  # zero tokens stay zero through the MLP (no bias)
    for name, a, b in zip(("gate", "up", "down"), dw, padded[2:]):
        assert torch.equal(a, b), name


def test_fuse_swiglu_links_only_swiglu_mlps():
    """Only all-FP8 SwiGLU MLPs are linked (not one with a BF16 down_proj or a GELU); names and
    parameters unchanged; bf16_reference runs HF's forward; a deepcopy computes with its own linears."""
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    plain, fused = tiny_llama(layers=3), tiny_llama(layers=3)
    for m in (plain, fused):
        m.model.layers[2].mlp.act_fn = nn.GELU()
    convert_fast(plain, FP8Config(keep_bf16=["*.1.mlp.down_proj"], fuse_swiglu=False))
    convert_fast(fused, FP8Config(keep_bf16=["*.1.mlp.down_proj"]))
    assert [isinstance(layer.mlp, FusedSwiGLU) for layer in fused.model.layers] == [True, False, False]
    assert not isinstance(plain.model.layers[0].mlp, FusedSwiGLU)
    assert dict(plain.named_parameters()).keys() == dict(fused.named_parameters()).keys()
    with bf16_reference(fused), bf16_reference(plain):
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
    copy = __import__("copy").deepcopy(fused)
    assert isinstance(copy.model.layers[0].mlp, FusedSwiGLU)
    assert copy.model.layers[0].self_attn.q_proj.group.members[0] is copy.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        want = fused(input_ids=ids).logits
        copy.model.layers[0].mlp.down_proj.weight.mul_(2)  # the copy's own weights, not the original's
        assert torch.equal(fused(input_ids=ids).logits, want)
        assert not torch.allclose(copy(input_ids=ids).logits, want)


def test_fused_member_called_alone_or_twice():
    """A member called with a new input, alone or repeatedly, recomputes the group's GEMM and
    still returns its own output (an in-place change of the input also invalidates the cache)."""
    model = tiny_llama(layers=1)
    convert_fast(model, FP8Config())
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 5, 256)
    for lin in (attn.k_proj, attn.k_proj, attn.v_proj):
        with bf16_reference(model):
            ref = F.linear(x, lin.weight)
        torch.testing.assert_close(lin(x), EmulatedFP8Linear.mm(lin, x, lin.weight))
        assert (lin(x) - ref).abs().max() < 0.1 * ref.abs().max()
    q1 = attn.q_proj(x)
    x.mul_(2)  # same object, new version: q_proj must not serve the stale cache to k_proj
    torch.testing.assert_close(attn.k_proj(x), EmulatedFP8Linear.mm(attn.k_proj, x, attn.k_proj.weight))
    assert attn.q_proj.group._x is not None  # q and v of the new input still pending
    assert q1.shape == (3, 5, 256)


def test_fp8_layers_trace_under_torch_compile():
    """A decoder layer with FP8 linears compiles as ONE graph with 3 FP8 autograd nodes (q/k/v fused,
    o_proj, the SwiGLU MLP's two GEMMs in one, as in eager) and computes what eager does, gradients too."""
    import torch._dynamo

    eager, compiled = tiny_llama(layers=1), tiny_llama(layers=1)
    for m in (eager, compiled):
        convert_fast(m, FP8Config())
    layer = compiled.model.layers[0]
    torch._dynamo.reset()
    x = torch.randn(2, 128, 256)
    pos = torch.arange(128).expand(2, 128)
    pe = compiled.model.rotary_emb(x, pos)
    explain = torch._dynamo.explain(layer)(x, position_embeddings=pe, attention_mask=None, position_ids=pos)
    assert (explain.graph_count, explain.graph_break_count) == (1, 0), explain.break_reasons
    applies = [n for n in explain.graphs[0].graph.nodes if "autograd_function_apply" in str(n.target)]
    assert len(applies) == 3  # qkv, o, gate_up + down
    layer.compile(backend="aot_eager", dynamic=False)
    outs = []
    for m in (eager, compiled):
        xi = x.clone().requires_grad_(True)
        y = m.model.layers[0](xi, position_embeddings=pe, attention_mask=None, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        y.square().mean().backward()
        outs.append((y.detach(), xi.grad, m.model.layers[0].self_attn.k_proj.weight.grad))
    torch._dynamo.reset()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_layers_share_one_graph():
    """distributed.compile_layers + the trainer's forward (batch.token_logprobs, no KV cache):
    every decoder layer runs the same graph, one for grad mode and one for no_grad, whatever the
    number of layers (per-layer state, e.g. a KV cache or the fused groups, would compile one per
    layer and hit dynamo's recompile limit at 8)."""
    import torch._dynamo

    from distributed import compile_layers
    from batch import token_logprobs

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = tiny_llama(layers=3)
    convert_fast(model, FP8Config())
    torch._dynamo.reset()
    compile_layers(model, backend)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    token_logprobs(model, ids, am, 1.0).sum().backward()
    with torch.no_grad():
        token_logprobs(model, ids, am, 1.0)
    torch._dynamo.reset()
    assert len(graphs) == 2
    assert all(n.op != "call_module" for n in graphs[0].graph.nodes)  # linears traced, not opaque modules


AUTOTUNE_PROBE = """
import json, os
from fp8.torchao import torchao_linear_cls
torchao_linear_cls()
from torchao.prototype.blockwise_fp8_training import kernels as k
names = [n for n in dir(k) if n.startswith("triton_fp8_blockwise_") and n.endswith("_kernel")]
print(json.dumps({"cache_results": {n: getattr(k, n).cache_results for n in names},
                  "dir": os.environ.get("TRITON_CACHE_DIR")}))
"""


@pytest.mark.parametrize("preset", [{}, {"TRITON_CACHE_AUTOTUNING": "0", "TRITON_CACHE_DIR": "/tmp/mine"}])
def test_torchao_autotuning_kept_on_disk(preset, tmp_path):
    """torchao's quantizers are defined with Triton's disk cache on, in one fixed dir (a later run
    skips the first step's autotuning); a caller's own settings win."""
    pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_CACHE")}
    env |= {"HOME": str(tmp_path), **preset}  # PYTHONPATH: the repo first (conftest), then the host's
    p = subprocess.run([sys.executable, "-c", AUTOTUNE_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(got["cache_results"]) == 5, got  # lhs, rhs, transposed_lhs (activations); rhs, transposed_rhs (weights)
    assert set(got["cache_results"].values()) == {not preset}
    assert got["dir"] == preset.get("TRITON_CACHE_DIR", str(tmp_path / ".triton" / "cache"))



def reference_blockwise_mm(a, b, a_s, recipe_a, b_s, recipe_b, out_dtype):
    """cuBLAS's block-scaled GEMM (torchao::blockwise_scaled_mm) from its documented layouts: a [M, K]
    row-major, 1x128 scales [M, K/128] column-major; b [K, N] column-major, with 128x128 scales
    [K/128, N/128] or 1x128 scales (groups along K) [N, K/128]. The layout asserts are torchao's."""
    from torchao.prototype.blockwise_fp8_training import kernels as k

    x128x128 = k._scaling_type_value(k.BLOCKWISE_128X128_SCALING_TYPE)
    assert a.stride(1) == 1 and b.stride(0) == 1 and a_s.stride(0) == 1, (a.stride(), b.stride(), a_s.stride())
    assert recipe_a == k._scaling_type_value(k.BLOCKWISE_1X128_SCALING_TYPE)
    sa = a_s.repeat_interleave(128, 1)
    sb = (b_s.repeat_interleave(128, 0).repeat_interleave(128, 1) if recipe_b == x128x128
          else b_s.t().repeat_interleave(128, 0))
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


def cpu_torchao_kernels(one_pass: bool):
    """TorchaoKernels (the recipe: torchao's quantizers) or, with `one_pass`, fp8.fast's DualQuantKernels
    (our one-pass quantizer and its SwiGLU modes), with CPU stand-ins of their Triton quantizers
    (fp8/quant.py, == their bytes: tests/gpu) in the layouts their docstrings give, and
    reference_blockwise_mm."""
    from fp8.torchao import TorchaoKernels
    from fp8.quant import quantize_act_1x128, quantize_act_128x1, quantize_blockwise

    def col_major(t):
        return t.t().contiguous().t()

    def lhs(x, block=128):  # q [M, K] row-major, scales [M, K/128] column-major
        q, s = quantize_act_1x128(x)
        return q, col_major(s)

    def rhs(x, block=128):  # q [M, K] column-major, 128x1 scales [M/128, K] row-major
        q, s = quantize_act_128x1(x)
        return col_major(q), s

    def transposed_lhs(x, block=128):  # x.T [K, M] row-major, 1x128 groups along M: scales [K, M/128] column-major
        q, s = quantize_act_128x1(x)
        return q.t().contiguous(), s.t()

    def dual(x):  # lhs + the 128x1 copy: qt [K, M] row-major, st [M/128, K] row-major
        qc, sc = quantize_act_128x1(x)
        return *lhs(x), qc.t().contiguous(), sc

    def weight_rhs(w, block_size=128):  # w [N, K] -> q [N, K] column-major, scales column-major
        q, s = quantize_blockwise(w)
        return col_major(q), col_major(s)

    def weight_transposed_rhs(w, block_size=128):  # w [N, K] -> q [K, N] column-major, scales [K/128, N/128]
        q, s = quantize_blockwise(w)
        return q.t(), s.t()

    if one_pass:
        from fp8.fast.dual import DualQuantKernels
        k = DualQuantKernels()
        k.dual = dual
        k.swiglu_dual, k.swiglu_lhs = (lambda gu: dual(swiglu(gu))), (lambda gu: lhs(swiglu(gu)))
        k.swiglu_bwd_dual = lambda grad_h, gu: dual(swiglu_backward(grad_h, gu))
    else:
        k = TorchaoKernels()
    k.mm, k.lhs, k.rhs, k.transposed_lhs = reference_blockwise_mm, lhs, rhs, transposed_lhs
    k.weight_rhs, k.weight_transposed_rhs = weight_rhs, weight_transposed_rhs
    return k


@pytest.mark.parametrize("k_dim", [512, 256], ids=["k_blocks_x4", "k_blocks_padded"])
def test_torchao_gemms_trace_to_the_aten_op(k_dim):
    """TorchaoKernels' three GEMMs trace to aten._scaled_mm_v2 itself, with the layouts and recipes
    torchao::blockwise_scaled_mm would hand it (its Python custom op costs host time in every call, not
    in the graph): the weight operands' 128x128 scales padded to a multiple of 4 blocks along K as torchao
    pads them (K = 256: 2 blocks), the 1x128 operands' scales as they are. Meta tensors: no GPU needed."""
    pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8.torchao import TorchaoKernels

    ao = TorchaoKernels()
    m, n, f8 = 256, 384, torch.float8_e4m3fn

    def col(*shape, dtype=f8):  # column-major [a, b]
        return torch.empty(shape[::-1], dtype=dtype, device="meta").t()

    xq, xs = torch.empty(m, k_dim, dtype=f8, device="meta"), col(m, k_dim // 128, dtype=torch.float32)
    w_fwd = (col(k_dim, n), col(k_dim // 128, n // 128, dtype=torch.float32))
    gq, gs = torch.empty(m, n, dtype=f8, device="meta"), col(m, n // 128, dtype=torch.float32)
    w_dgrad = (col(n, k_dim), col(n // 128, k_dim // 128, dtype=torch.float32))
    gqt, gst = torch.empty(n, m, dtype=f8, device="meta"), col(n, m // 128, dtype=torch.float32)
    xqc, xsc = col(m, k_dim), torch.empty(m // 128, k_dim, dtype=torch.float32, device="meta")
    cases = [(lambda a, a_s, b, b_s: ao.gemm(a, a_s, (b, b_s)), (xq, xs, *w_fwd), (m, n)),
             (lambda a, a_s, b, b_s: ao.gemm_dgrad(a, a_s, (b, b_s)), (gq, gs, *w_dgrad), (m, k_dim)),
             (lambda a, a_s, b, b_s: ao.gemm_wgrad(a, a_s, b, b_s), (gqt, gst, xqc, xsc), (n, k_dim))]
    for i, (fn, args, shape) in enumerate(cases):
        gm = make_fx(fn)(*args)
        calls = [nd for nd in gm.graph.nodes if nd.op == "call_function"]
        mm = [nd for nd in calls if nd.target is torch.ops.aten._scaled_mm_v2.default]
        assert len(mm) == 1 and not any("torchao" in str(nd.target) for nd in calls), gm.code
        assert mm[0].args[3] + mm[0].args[6] == [ao.x1x128, ao.x1x128 if i == 2 else ao.x128x128]
        y = fn(*args)
        assert y.shape == shape and y.dtype == torch.bfloat16
        if i < 2:  # the weight's scales as cuBLAS takes them: [K/128 rounded up to 4, N/128], K-major
            rhs_scale = ao.rhs_scale(args[3], ao.x128x128)
            assert rhs_scale.shape[0] == -(-args[3].shape[0] // 4) * 4 and rhs_scale.stride(0) == 1


def test_in_place_ops_carry_no_python_autograd_kernel():
    """fp8.linear.inplace_op's ops, called once per FP8 linear per micro-batch inside the compiled backward, are
    dispatched without the Python autograd and ADInplaceOrView kernels torch.library.custom_op registers around
    every call (17 us of host time a call on an H100 host: bench/host_speed.py): kernels for
    CompositeExplicitAutograd and Meta (the fake) only."""
    import importlib

    for module in ("fp8.fast.bf16", "fp8.fast.dual"):  # they define addmm_into and wgrad_into
        importlib.import_module(module)
    for name in ("add_into", "addmm_into", "wgrad_into"):
        keys = [k for k in ("Autograd", "ADInplaceOrView", "CompositeExplicitAutograd", "Meta")
                if torch._C._dispatch_has_kernel_for_dispatch_key(f"fp8_grpo::{name}", k)]
        assert keys == ["CompositeExplicitAutograd", "Meta"], (name, keys)


@pytest.mark.parametrize("dual", [False, True], ids=["torchao", "dual_quant"])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
def test_torchao_kernels_wire_the_block_scaled_gemm_like_the_emulation(need, dual):
    """The torchao kernels' forward and backward hand the GEMM operands and scales in the right layouts:
    through a reference block-scaled GEMM they equal the emulation's quantize-dequantize + fp32 GEMM bit
    for bit (a transposed scale or the saved 128x1 copy read the wrong way would not). The recipe's
    saves x; fp8.fast's one-pass kernels save x's FP8 128x1 copy, only when the weight gradient needs
    it; behind a WeightCache (operands made once, reused) nothing changes."""
    pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    if dual:
        pytest.importorskip("triton")
    from fp8.fast.cache import WeightCache
    from fp8.fast.swiglu import SwiGLUEmulatedKernels

    ao, emu = cpu_torchao_kernels(dual), SwiGLUEmulatedKernels("torchao")
    g = torch.Generator().manual_seed(0)
    m, k, n = 256, 384, 640
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 2, k)).bfloat16()  # per-channel ranges
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    w[:128, 128:256] *= 1e3  # one loud block
    go = torch.randn(m, n, generator=g).bfloat16()
    need_x, need_w = need
    for kernels in (ao, WeightCache(ao, [w])):
        (y, saved), (y_emu, saved_emu) = (kern.fwd(x, kern.weight_fwd((w,)), need_w) for kern in (kernels, emu))
        assert torch.equal(y, y_emu)
        want_saved = ([torch.float8_e4m3fn, torch.float32] if dual else [torch.bfloat16]) if need_w else []
        assert [t.dtype for t in saved] == want_saved
        got = kernels.bwd(go, kernels.weight_dgrad((w,)), saved, need_x, need_w)
        want = emu.bwd(go, emu.weight_dgrad((w,)), saved_emu, need_x, need_w)
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b.bfloat16()))
        # fp8.fuse_grad_accum: the weight gradient added into a buffer instead (off the GPU: the cuBLAS
        # product, here the reference GEMM's BF16 one, added), None returned for it
        acc = torch.full((n, k), 0.5)
        grad_x, grad_w = kernels.bwd(go, kernels.weight_dgrad((w,)), saved, need_x, need_w, acc)
        assert grad_w is None and (grad_x is None) == (got[0] is None) and (grad_x is None or torch.equal(grad_x, got[0]))
        assert torch.equal(acc, 0.5 + got[1].float()) if need_w else torch.equal(acc, torch.full((n, k), 0.5))
    if not dual:
        return
    # fuse_swiglu's entry points: x taken as gu = [gate | up], the GEMM's input is swiglu(gu) and its
    # input gradient the gradient of gu (the quantization kernels' SwiGLU modes: tests/gpu)
    gu, wd, wgu = x[:, :256].contiguous(), (w[:, :128].contiguous(),), (w[:256, :128].contiguous(),)
    (y, saved), (y_emu, saved_emu) = (kern.fwd_swiglu(gu, kern.weight_fwd(wd), need_w) for kern in (ao, emu))
    assert torch.equal(y, y_emu)
    got = ao.bwd_swiglu(go[:, :128].contiguous(), gu, ao.weight_dgrad(wgu), saved, need_x, need_w)
    want = emu.bwd_swiglu(go[:, :128].contiguous(), gu, emu.weight_dgrad(wgu), saved_emu, need_x, need_w)
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b.bfloat16()))


def _cache_run(cache: bool, compiled: bool = False, steps: int = 2, release: bool = False):
    """A 2-layer FP8 Llama through `steps` x (2 micro-batches of forward + backward, AdamW step):
    each step's token logprobs and the final weights. release: the caches emptied and refilled after
    each step, as around the engine's rollout."""
    from distributed import compile_layers
    from fp8.fast.cache import refresh_weight_caches_on_step
    from batch import token_logprobs

    model = tiny_llama(layers=2)
    convert_fast(model, FP8Config(cache_weights=cache))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if cache:
        assert refresh_weight_caches_on_step(model, opt) == 8  # as train_grpo does
    if compiled:
        torch._dynamo.reset()
        compile_layers(model, "aot_eager")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 32), generator=g) for _ in range(2)]
    logps = []
    for _ in range(steps):
        with torch.no_grad():
            logps.append(torch.cat([token_logprobs(model, ids, torch.ones_like(ids), 1.0) for ids in batches]))
        for ids in batches:
            token_logprobs(model, ids, torch.ones_like(ids), 1.0).sum().backward()
        opt.step()
        opt.zero_grad()
        if release:
            from fp8.fast.cache import refill_weight_caches, release_weight_caches, weight_caches
            release_weight_caches(model)
            ops = [t for c in weight_caches(model) for t in c._operands()]
            assert len(ops) >= 8 and all(t.untyped_storage().nbytes() == 0 for t in ops)
            refill_weight_caches(model)
    torch._dynamo.reset()
    return logps, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("compiled", [False, True])
def test_weight_cache_changes_nothing_but_the_quantization_count(compiled, monkeypatch):
    """fp8.cache_weights: the same logprobs and updated weights, bit for bit, over optimizer steps
    (a cache kept past a step would differ from step 1 on), eager (version counters) and traced
    (the optimizer hook); the weight is quantized once per GEMM per step instead of in every pass."""
    from fp8.linear import EmulatedKernels

    ref_logps, ref_params = _cache_run(cache=False, compiled=compiled)
    calls = []
    orig = EmulatedKernels.weight_fwd
    monkeypatch.setattr(EmulatedKernels, "weight_fwd", lambda self, ws: calls.append(1) or orig(self, ws))
    logps, params = _cache_run(cache=True, compiled=compiled)
    assert all(torch.equal(a, b) for a, b in zip(logps, ref_logps))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    # 2 layers x 4 GEMMs (qkv, o, gate_up, down): at the start and after each of the 2 steps
    assert len(calls) == 8 * 3, len(calls)


@pytest.mark.parametrize("compiled", [False, True])
def test_weight_cache_released_for_the_rollout_refills_the_same_operands(compiled):
    """release_weight_caches frees the cached operands while the engine runs (the tensors stay, empty);
    refill_weight_caches re-quantizes into the same tensors: the run is bit for bit the uncached one."""
    ref_logps, ref_params = _cache_run(cache=False, compiled=compiled)
    logps, params = _cache_run(cache=True, compiled=compiled, release=True)
    assert all(torch.equal(a, b) for a, b in zip(logps, ref_logps))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def _accum_run(fp8: FP8Config, compile_backend: str | None = None, steps: int = 2, prepare=convert_fast,
               dtype=torch.float32, between=None):
    """_cache_run's loop with AdamW, as trainer.train_phase runs it: each step zero_grad (and with
    fp8.fuse_grad_accum its buffers zeroed), 2 micro-batches, clip, step; then the gradients released, as
    before the engine wakes, and between(model) if given. prepare(model, fp8) builds the model's linears
    (default: the FP8 trainer's). Returns each step's logprobs, gradients (before the step) and the final weights."""
    from batch import token_logprobs
    from distributed import compile_layers
    from fp8.fast.accum import grad_accumulators, release_grad_accumulators, zero_grad_accumulators

    model = tiny_llama(layers=2, dtype=dtype)
    prepare(model, fp8)
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if fp8.cache_weights:
        from fp8.fast.cache import refresh_weight_caches_on_step
        refresh_weight_caches_on_step(model, opt)
    if compile_backend:
        torch._dynamo.reset()
        compile_layers(model, compile_backend)
    model.train()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 32), generator=g) for _ in range(2)]
    logps, grads = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        zero_grad_accumulators(model)
        for ids in batches:
            logp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
            (logp * torch.linspace(-1, 1, 32, dtype=logp.dtype)).sum().backward()
            logps.append(logp.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        release_grad_accumulators(model)
        assert all(a.acc.untyped_storage().nbytes() == 0 for a in grad_accumulators(model))
        if between:
            between(model)
    torch._dynamo.reset()
    return logps, grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("fp8,backend", [
    (FP8Config(fuse_projections=False, fuse_swiglu=False), None),   # one _BlockFP8MM per linear
    (FP8Config(), None),                                             # fused q/k/v, gate/up, SwiGLU MLP
    (FP8Config(cache_weights=True), None),                           # + the weight cache
    (FP8Config(cache_weights=True), "aot_eager"),                    # + train.compile
    (FP8Config(cache_weights=True), "inductor"),
], ids=["linear", "fused", "cache_weights", "compiled", "inductor"])
def test_grad_accumulation_in_the_wgrad_gives_autograd_s_sums(fp8, backend):
    """fp8.fuse_grad_accum: each FP8 GEMM adds its weight gradient into one buffer the members' .grad view
    (the emulation: its fp32 product, as autograd would add it), under activation checkpointing and
    compiled layers (a compiled backward must keep the buffer's mutation): the same gradients, logprobs and
    AdamW updates, bit for bit, as autograd's accumulation over micro-batches; zeroed per optimizer step,
    the buffers' memory given back between steps and reused."""
    from fp8.fast.accum import GradAccumulator

    if backend == "inductor" and sys.platform != "linux":
        pytest.skip("inductor's CPU backend")
    ref = _accum_run(fp8, backend)
    fused = dataclasses.replace(fp8, fuse_grad_accum=True)
    model = tiny_llama(layers=2)
    convert_fast(model, fused)
    kinds = {type(m.kernels) for m in model.modules() if fp8_linear.is_fp8_linear(m)}
    assert kinds == {GradAccumulator}, kinds
    logps, grads, params = _accum_run(fused, backend)
    assert all(torch.equal(a, b) for a, b in zip(logps, ref[0]))
    for got, want in zip(grads, ref[1]):
        for name, gw in want.items():
            assert torch.equal(got[name], gw), name
    assert all(torch.equal(a, b) for a, b in zip(params, ref[2]))


def test_the_deep_gemm_check_in_the_traced_backward_breaks_no_graph():
    """The accumulating wgrad's DeepGEMM check runs inside the FP8 linear's backward, which dynamo traces with
    the layer: it is a constant there. Traced, its import broke the graph at every FP8 linear (on CUDA)."""
    import torch._dynamo
    from fp8.fast.dual import deep_gemm_wgrad

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2 if deep_gemm_wgrad() else g * 3

    explain = torch._dynamo.explain(lambda x: Twice.apply(x).sum())(torch.ones(2, requires_grad=True))
    assert (explain.graph_count, explain.graph_break_count) == (1, 0), explain.break_reasons


def _checkpointed_grads(fp8: FP8Config, checkpointing: bool, compile_backend: str | None):
    """Logprobs and gradients of a 2-layer FP8 Llama over two micro-batches, as the trainer's train pass
    computes them (token_logprobs, backward per micro-batch), with or without activation checkpointing."""
    from distributed import compile_layers
    from fp8.fast.cache import refresh_weight_caches_on_step
    from batch import token_logprobs

    model = tiny_llama(layers=2)
    convert_fast(model, fp8)
    if fp8.cache_weights:
        refresh_weight_caches_on_step(model, torch.optim.SGD(model.parameters(), lr=0.0))
    if checkpointing:
        model.gradient_checkpointing_enable()  # HF's (non-reentrant), as modeling.py enables it
    if compile_backend:
        torch._dynamo.reset()
        compile_layers(model, compile_backend)
    model.train()
    g = torch.Generator().manual_seed(2)
    logps = []
    for ids in [torch.randint(0, 64, (2, 32), generator=g) for _ in range(2)]:
        logp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
        (logp * torch.linspace(-1, 1, 32)).sum().backward()  # advantage-like weights of both signs
        logps.append(logp.detach())
    torch._dynamo.reset()
    return logps, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("fp8,backend", [
    (FP8Config(fuse_projections=False, fuse_swiglu=False), None),  # one _BlockFP8MM per linear
    (FP8Config(fuse_swiglu=False), None),                           # fused q/k/v and gate/up
    (FP8Config(), None),                                            # + fused SwiGLU MLP
    (FP8Config(cache_weights=True), None),                          # + the weight cache
    (FP8Config(cache_weights=True), "aot_eager"),                   # + train.compile
], ids=["linear", "fused_projections", "fused_swiglu", "cache_weights", "compiled"])
def test_fp8_paths_under_activation_checkpointing(fp8, backend):
    """model.gradient_checkpointing recomputes each decoder layer in backward; every FP8 path must survive
    that (an autograd.Function that reads ctx.saved_tensors twice fails: each read unpacks) and give the
    same logprobs and gradients, bit for bit, as without it (the recompute is the same computation)."""
    ref_logps, ref_grads = _checkpointed_grads(fp8, False, backend)
    logps, grads = _checkpointed_grads(fp8, True, backend)
    assert all(torch.equal(a, b) for a, b in zip(logps, ref_logps))
    for name, g in ref_grads.items():
        assert g is not None and torch.equal(grads[name], g), name


def test_dense_gemm_switch(monkeypatch):
    """fp8.dense_gemm=deep_gemm puts the trainer on fp8/fast (uses_fast), leaves the emulation's numerics alone
    (CPU: bit-equal to cublas's), and where torchao's kernels would get DeepGEMM's GEMMs but DeepGEMM does not
    import, refuses naming the key and the way out."""
    from errors import UserError
    from fp8.fast import _dual_quant_kernels

    cfg = FP8Config(train=True, fuse_projections=False, fuse_swiglu=False)
    assert not cfg.uses_fast and dataclasses.replace(cfg, dense_gemm="deep_gemm").uses_fast
    x = torch.randn(2, 128, 256)
    outs = []
    for dense in ("cublas", "deep_gemm"):
        model = tiny_llama(layers=1)
        convert_fast(model, dataclasses.replace(cfg, dense_gemm=dense))
        outs.append(model.model.layers[0].mlp.up_proj(x))
    assert torch.equal(*outs)
    _dual_quant_kernels.cache_clear()
    monkeypatch.setattr("fp8.moe.import_deep_gemm", lambda: "")
    with pytest.raises(UserError, match=r"^fp8.dense_gemm=deep_gemm: .* set fp8.dense_gemm=cublas$"):
        _dual_quant_kernels("deep_gemm")
    _dual_quant_kernels.cache_clear()
