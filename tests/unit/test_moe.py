"""Mixture of experts (Qwen3-MoE): the family, block-FP8 experts (fp8/moe.py), the export of experts,
routing record/replay/mismatch and the aux loss (routing.py), and the moe config."""

import contextlib
import copy
from pathlib import Path

import pytest
import torch

import models
import routing
from batch import collate, logprob_pass
from config import ConfigError, FP8Config, TinyModelConfig, load_config
from fp8.export import export_weights, vllm_quantization_config
from fp8.convert import convert_to_fp8_training
from fp8.linear import bf16_reference
from fp8.moe import BlockFP8Experts, expert_names
from fp8.plan import fp8_plan
from fp8.quant import fake_quant_act_1x128, fake_quant_act_128x1, fake_quant_weight, quantize_blockwise
from modeling import build_char_tokenizer, build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
VOCAB = "0123456789+-*=?() \n"


def tiny_moe(seed: int = 0, **kw):
    torch.manual_seed(seed)
    kw = {"hidden_size": 128, "moe_intermediate_size": 128, **kw}
    t = TinyModelConfig(arch="qwen3_moe", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                        num_experts=4, num_experts_per_tok=2, **kw)
    model = build_tiny_model(t, build_char_tokenizer(VOCAB), torch.float32)
    with torch.no_grad():  # routers away from their near-zero init: distinct, input-dependent top-k
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


def test_family_registered_with_experts_and_routers_in_the_plan():
    spec = models.family("qwen3_moe")
    assert (spec.config_class, spec.model_class, spec.experts, spec.router) == \
        ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "mlp.experts", "mlp.gate")
    model = tiny_moe()
    assert models.family_of(model) is spec and routing.is_moe(model) and len(routing.routers(model)) == 2
    for i, layer in enumerate(model.model.layers):
        experts = layer.get_submodule(spec.experts)
        assert experts.gate_up_proj.shape == (4, 256, 128) and experts.down_proj.shape == (4, 128, 128)
    plan = fp8_plan(model, FP8Config())
    assert plan["model.layers.0.mlp.experts"] == (True, "fp8")
    assert plan["model.layers.1.mlp.gate"] == (False, "MoE router")
    kept = fp8_plan(model, FP8Config(keep_bf16=["*.layers.1.mlp.experts"], keep_first_layers=0))
    assert kept["model.layers.1.mlp.experts"] == (False, "keep_bf16 '*.layers.1.mlp.experts'")
    assert not fp8_plan(tiny_moe(moe_intermediate_size=96), FP8Config())["model.layers.0.mlp.experts"][0]
    dense = build_tiny_model(TinyModelConfig(), build_char_tokenizer(VOCAB), torch.float32)
    assert not routing.is_moe(dense) and expert_names(dense) == {}


def reference_experts(x, ids, weights, gate_up, down, recipe):
    """fp8/quant.py's quantize-dequantize per expert in fp32: y_e = q(q(silu(q(x) q(Wgu)^T)...)), the textbook loop
    of the CPU engine's stand-in for vLLM's fused MoE (activations in `recipe`)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(ids == e)
        if not len(tok):
            continue
        gu = fake_quant_act_1x128(x[tok], recipe) @ fake_quant_weight(gate_up[e]).t()
        g, u = gu.chunk(2, -1)
        y = fake_quant_act_1x128(torch.nn.functional.silu(g) * u, recipe) @ fake_quant_weight(down[e]).t()
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def test_emulated_vllm_experts_match_quant_reference():
    """The 'vllm' recipe (the CPU engine) keeps fp32 operands: exactly fp8/quant.py's quantize-dequantize."""
    model = tiny_moe()
    experts = model.model.layers[0].mlp.experts
    fp8 = BlockFP8Experts(experts, "emulated", "vllm")
    torch.manual_seed(1)
    x = torch.randn(40, 128, requires_grad=True)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(40)])
    w = torch.softmax(torch.randn(40, 2), -1)
    y = fp8(x, ids, w)
    ref = reference_experts(x.detach(), ids, w, experts.gate_up_proj.detach(), experts.down_proj.detach(), "vllm")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    with bf16_reference(torch.nn.Sequential(fp8)):  # the switch reaches the experts: no quantization
        plain = fp8(x, ids, w)
    assert (plain - ref).abs().max() > 100 * 1e-6  # so the comparison above sees the FP8 rounding

    # backward: dgrad q1x128(g) q(W), wgrad q128x1(g)^T q128x1(x), per expert over its own tokens
    g = torch.randn_like(y)
    (y * g).sum().backward()
    e, (tok, slot) = 2, torch.where(ids == 2)
    xe = x.detach()[tok]
    gu = fake_quant_act_1x128(xe, "vllm") @ fake_quant_weight(experts.gate_up_proj[e].detach()).t()
    gate, up = gu.chunk(2, -1)
    h = torch.nn.functional.silu(gate) * up
    grad_h = fake_quant_act_1x128(g[tok] * w[tok, slot, None]) @ fake_quant_weight(experts.down_proj[e].detach())
    wgrad_down = fake_quant_act_128x1(g[tok] * w[tok, slot, None]).t() @ fake_quant_act_128x1(h)
    torch.testing.assert_close(experts.down_proj.grad[e], wgrad_down, rtol=1e-5, atol=1e-6)
    sig = torch.sigmoid(gate)
    grad_gu = torch.cat([grad_h * up * sig * (1 + gate * (1 - sig)), grad_h * torch.nn.functional.silu(gate)], -1)
    wgrad_gu = fake_quant_act_128x1(grad_gu).t() @ fake_quant_act_128x1(xe)
    torch.testing.assert_close(experts.gate_up_proj.grad[e], wgrad_gu, rtol=1e-4, atol=1e-5)


# -------------------------------------------------- the trainer's experts: torchao's grouped GEMM, run on the CPU

@contextlib.contextmanager
def torchao_grouped_on_cpu():
    """torchao 0.18's own block-FP8 grouped GEMM (blockwise_fp8.grouped_mm._Float8BlockwiseGroupedMM, its
    emulated backend, its padding and its grouped GEMM torch._grouped_mm) running on the CPU: only its Triton
    quantizers are swapped, for torchao's torch references of the same math (kernels.torch_blockwise_scale_*,
    which tests/unit/test_fp8_quant.py and tests/gpu pin to the Triton kernels), in the layouts the Triton ones write."""
    from torchao.prototype.blockwise_fp8_training import kernels as ao
    from torchao.prototype.moe_training.blockwise_fp8 import grouped_mm, grouped_mm_backend

    def weights(b_t, block_size=128, dtype=torch.float8_e4m3fn):  # per expert W[e] [N, K], 128x128
        qs = [ao.torch_blockwise_scale_weight_quant(b_t[e].t().contiguous(), block_size, dtype) for e in range(len(b_t))]
        return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])  # [E, N, K], [E, N/128, K/128]

    def weight_fwd(b_t, block_size=128, dtype=torch.float8_e4m3fn):  # (E, K, N) column-major, scales (E, K/128, N/128)
        q, s = weights(b_t, block_size, dtype)
        return q.transpose(-2, -1), s.transpose(-2, -1)

    def weight_dgrad(b_t, block_size=128, dtype=torch.float8_e4m3fn):  # (E, N, K) column-major, scales (E, N/128, K/128)
        q, s = weights(b_t, block_size, dtype)
        return q.transpose(-2, -1).contiguous().transpose(-2, -1), s

    def lhs(x, block_size=128, dtype=torch.float8_e4m3fn):  # x [M, K], 1x128 along K
        return ao.torch_blockwise_scale_act_quant_lhs(x, block_size, dtype)

    def transposed_lhs(x, block_size=128, dtype=torch.float8_e4m3fn):  # x [M, N] -> [N, M], 1x128 along M
        return ao.torch_blockwise_scale_act_quant_lhs(x.t().contiguous(), block_size, dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grouped_mm, "triton_fp8_blockwise_act_quant_lhs", lhs)
        mp.setattr(grouped_mm_backend, "triton_fp8_blockwise_act_quant_transposed_lhs", transposed_lhs)
        mp.setattr(grouped_mm_backend, "triton_fp8_blockwise_act_quant_rhs", ao.torch_blockwise_scale_act_quant_rhs)
        mp.setattr(grouped_mm_backend, "triton_fp8_blockwise_weight_quant_grouped_transposed_rhs", weight_fwd)
        mp.setattr(grouped_mm_backend, "triton_fp8_blockwise_weight_quant_grouped_rhs", weight_dgrad)
        yield


def padded_rows(t, counts, dim=0):
    """torchao's padded token layout -> ours: each expert's rows start at a multiple of 128 (pad_token_groups),
    its pad rows zero."""
    parts, lo = [], 0
    for c in counts:
        seg = t.narrow(dim, lo, -(-c // 128) * 128)
        parts.append(seg.narrow(dim, 0, c))
        assert not seg.narrow(dim, c, seg.shape[dim] - c).any()
        lo += seg.shape[dim]
    return torch.cat(parts, dim)


def assert_same_sum(got, want, a, b):
    """got and want are a @ b (bf16 operands) each summed in fp32 in some order and rounded once to bf16: they
    may differ by the two summation errors (each <= K 2^-24 sum_k |a_k b_k|) plus one bf16 step (2^-7 relative)."""
    k = a.shape[-1]
    err = 2 * k * 2.0 ** -24 * (a.double().abs() @ b.double().abs()) + 2.0 ** -7 * want.double().abs()
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - want.double()).abs() <= err).all()


def compare_grouped_gemm(x, w, g, counts):
    """fp8/moe.py's emulated grouped GEMM against torchao's (fp8/moe.py's torchao backend) on x [M, K] bf16 rows
    grouped by counts, w [E, N, K], output gradient g [M, N]: every dequantized GEMM operand of forward, dgrad
    and wgrad bit-identical to the one torchao hands torch._grouped_mm (so the quantizers, their axes, the
    128-row padding of each expert and the bf16 dequantization are the same), the outputs equal up to the fp32
    summation order (assert_same_sum); bf16 outputs and grad_x, grad_w bf16 values in w's dtype.
    Returns the fraction of bit-identical output elements of (forward, dgrad, wgrad)."""
    from fp8.moe import _grouped_torchao, _grouped_torchao_emulated, _torchao_operand

    out, calls, real_mm = {}, [], torch._grouped_mm

    def recording_mm(a, b, offs=None, **kw):  # torchao's dequantized operands
        calls.append((a, b))
        return real_mm(a, b, offs=offs, **kw)

    for name, fn in (("torchao", _grouped_torchao), ("emulated", _grouped_torchao_emulated)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with pytest.MonkeyPatch.context() as mp:
            if name == "torchao":
                mp.setattr(torch, "_grouped_mm", recording_mm)
            y = fn(xi, wi, counts)
            y.backward(g)
        out[name] = (y.detach(), xi.grad, wi.grad)
    (y, gx, gw), (y0, gx0, gw0) = out["emulated"], out["torchao"]
    assert len(calls) == 3 and y.dtype == gx.dtype == torch.bfloat16 and gw.dtype == w.dtype
    assert torch.equal(gw.to(torch.bfloat16).to(w.dtype), gw)  # the weight gradient is bf16, as torchao's

    wq, x1, g1 = (_torchao_operand(t, k, counts) for t, k in ((w, "128x128"), (x, "1x128"), (g, "1x128")))
    x128, g128 = _torchao_operand(x, "128x1", counts), _torchao_operand(g, "128x1", counts)
    (a, b), (ga, gb), (wa, wb) = calls  # forward, dgrad, wgrad
    assert torch.equal(padded_rows(a, counts), x1) and torch.equal(b, wq.transpose(-2, -1))
    assert torch.equal(padded_rows(ga, counts), g1) and torch.equal(gb, wq)
    assert torch.equal(padded_rows(wa, counts, 1), g128.t()) and torch.equal(padded_rows(wb, counts), x128)

    for e, (xe, ge, xe128, ge128) in enumerate(zip(*(t.split(counts) for t in (x1, g1, x128, g128)))):
        rows = slice(sum(counts[:e]), sum(counts[:e + 1]))
        assert_same_sum(y[rows], y0[rows], xe, wq[e].t())
        assert_same_sum(gx[rows], gx0[rows], ge, wq[e])
        if counts[e]:
            assert_same_sum(gw[e].to(torch.bfloat16), gw0[e].to(torch.bfloat16), ge128.t(), xe128)
        else:
            assert not gw[e].any() and not gw0[e].any()
    return tuple(float((p == q).float().mean()) for p, q in ((y, y0), (gx, gx0), (gw, gw0)))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_emulated_grouped_gemm_is_torchaos(wdtype):
    """The trainer's experts off SM90 (fp8/moe.py's emulated grouped GEMM) compute what torchao's grouped GEMM
    computes, torchao's own code run on the CPU (compare_grouped_gemm)."""
    torch.manual_seed(0)
    counts = [70, 0, 200, 129]  # an expert without tokens, groups not multiples of 128
    w = (torch.randn(4, 256, 384) * 0.05).to(wdtype)
    w[2, :128, :128] = 0  # an all-zero weight block
    x = torch.randn(sum(counts), 384).to(torch.bfloat16)
    x[5, 128:256] = 0  # an all-zero activation group
    g = torch.randn(sum(counts), 256).to(torch.bfloat16)
    with torchao_grouped_on_cpu():
        same = compare_grouped_gemm(x, w, g, counts)
    assert min(same) > 0.99  # most sums round the same whatever their order


def test_emulated_experts_match_torchao_experts():
    """A whole experts layer (an fp32 model: x goes to bf16, gradients come back to fp32 as torchao's do), the
    'emulated' backend against the 'torchao' one running torchao's code on the CPU: the only difference left is
    the GEMMs' fp32 summation order (test_emulated_grouped_gemm_is_torchaos), which moves ~1e-4 of the bf16
    outputs by a step and through them, rarely, an FP8 rounding of the next GEMM's input: measured here
    <= 4e-5 relative with 99.98% of the elements bit-identical; 1e-3 and 99% allowed. The recipe difference this replaced (fp32 dequantization) was 2e-2."""
    model = tiny_moe(hidden_size=256, moe_intermediate_size=256)
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(1)
    x = torch.randn(300, 256, requires_grad=True)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(300)])
    w = torch.softmax(torch.randn(300, 2), -1)
    with torch.no_grad():
        ref = experts(x, ids, w)
    out = {}
    with torchao_grouped_on_cpu():
        for backend in ("emulated", "torchao"):
            x.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
            y = BlockFP8Experts(experts, backend)(x, ids, w)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            out[backend] = (y.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    assert out["emulated"][0].dtype == x.grad.dtype == experts.down_proj.grad.dtype == torch.float32
    for what, a, b in zip(("out", "dgrad", "wgrad gate_up", "wgrad down"), out["emulated"], out["torchao"]):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-3, (what, rel)
        assert (a == b).float().mean() > 0.99, what
    fp8_error = float((out["emulated"][0] - ref).norm() / ref.norm())
    assert 1e-2 < fp8_error < 1e-1  # FP8, not a no-op


def test_convert_to_fp8_training_converts_experts_and_keeps_parameters():
    model = tiny_moe()
    params = {n: p for n, p in model.named_parameters()}
    converted = convert_to_fp8_training(model, FP8Config(train=True))
    assert "model.layers.0.mlp.experts" in converted and "model.layers.1.mlp.experts" in converted
    assert isinstance(model.model.layers[1].mlp.experts, BlockFP8Experts)
    assert {n: p for n, p in model.named_parameters()} == params  # same names, same Parameter objects


def test_deep_gemm_switch_picks_the_backend_or_names_the_fix(monkeypatch):
    """fp8.deep_gemm on a (pretended) SM90 device: the experts take torchao's DeepGEMM backend where DeepGEMM
    imports, and stop with the fix where it does not; off, torchao's emulated backend, as before."""
    import fp8.moe as moe
    from errors import UserError

    monkeypatch.setattr(moe, "use_torchao_experts", lambda cfg, experts: True)
    for deep_gemm, found, backend in ((False, "", "torchao"), (True, "vllm.third_party.deep_gemm", "deep_gemm")):
        monkeypatch.setattr(moe, "import_deep_gemm", lambda found=found: found)
        model = tiny_moe()
        convert_to_fp8_training(model, FP8Config(train=True, deep_gemm=deep_gemm))
        assert {m.backend for m in model.modules() if isinstance(m, BlockFP8Experts)} == {backend}
    monkeypatch.setattr(moe, "import_deep_gemm", lambda: "")
    with pytest.raises(UserError, match=r"fp8.deep_gemm=true: neither deep_gemm nor vllm.third_party.deep_gemm "
                                        r"imports; install DeepGEMM, or set fp8.deep_gemm=false"):
        convert_to_fp8_training(tiny_moe(), FP8Config(train=True, deep_gemm=True))


def test_vendored_deep_gemm_is_importable_as_torchao_looks_for_it():
    """import_deep_gemm registers vLLM's vendored DeepGEMM as `deep_gemm` where no other is installed, with
    the m- and k-grouped FP8 kernels torchao's AUTO backend needs (checked in a fresh interpreter)."""
    import json
    import subprocess
    import sys

    code = ("import importlib.util, json; from fp8.moe import import_deep_gemm\n"
            "installed = importlib.util.find_spec('deep_gemm') is not None; src = import_deep_gemm()\n"
            "if src:\n    import deep_gemm\n"
            "print(json.dumps([src, installed, src and deep_gemm.__name__, src and all(hasattr(deep_gemm, k) for k in"
            " ('m_grouped_fp8_gemm_nt_contiguous', 'k_grouped_fp8_gemm_nt_contiguous'))]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    src, installed, name, kernels = json.loads(p.stdout.splitlines()[-1])
    if not src:
        pytest.skip("neither deep_gemm nor vllm.third_party.deep_gemm imports on this host")
    if not installed:
        assert src == name == "vllm.third_party.deep_gemm"
    assert kernels


def test_export_experts_per_expert_names_and_bytes():
    model = tiny_moe()
    cfg = FP8Config(rollout=True)
    out = dict(export_weights(model, cfg, fp8=True))
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj.detach()
    down = model.model.layers[1].mlp.experts.down_proj.detach()
    for e in range(4):
        for linear, w in (("gate_proj", gate_up[e, :128]), ("up_proj", gate_up[e, 128:]), ("down_proj", down[e])):
            name = f"model.layers.1.mlp.experts.{e}.{linear}"
            q, s = quantize_blockwise(w)
            assert out[name + ".weight"].dtype == torch.float8_e4m3fn and out[name + ".weight"].shape == (128, 128)
            assert torch.equal(out[name + ".weight"].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(out[name + ".weight_scale_inv"], s)
    assert not [n for n in out if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert out["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router as it is
    assert {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= set(
        vllm_quantization_config(model, cfg)["ignored_layers"])
    # BF16 experts (kept by the skip-list): 2-D per expert, and vLLM is told to keep them unquantized
    keep = FP8Config(rollout=True, keep_bf16=["*.layers.0.mlp.experts"])
    out = dict(export_weights(model, keep, fp8=True))
    assert torch.equal(out["model.layers.0.mlp.experts.3.up_proj.weight"],
                       model.model.layers[0].mlp.experts.gate_up_proj.detach()[3, 128:])
    assert "model.layers.0.mlp.experts" in vllm_quantization_config(model, keep)["ignored_layers"]


def test_hf_engine_loads_exported_experts_with_pinned_bytes():
    from engines.hf import convert_to_fp8_rollout, load_exported_into_hf

    trainer, engine = tiny_moe(), tiny_moe(seed=1)
    cfg = FP8Config(train=True, rollout=True)
    convert_to_fp8_rollout(engine, cfg)
    load_exported_into_hf(engine, export_weights(trainer, cfg, fp8=True))
    for i in range(2):
        got, src = engine.model.layers[i].mlp.experts, trainer.model.layers[i].mlp.experts
        assert torch.equal(got.gate_up_proj, torch.stack([fake_quant_weight(w) for w in src.gate_up_proj.detach()]))
        assert torch.equal(got.down_proj, torch.stack([fake_quant_weight(w) for w in src.down_proj.detach()]))
        assert got._weight("down_proj")[1]  # the exact bytes are pinned


def hf_engine_samples(model, overrides=()):
    from engines.hf import HFEngine

    cfg = load_config(None, ["model.tiny.arch=qwen3_moe", "model.tiny.num_experts=4", *overrides])
    tok = build_char_tokenizer(VOCAB)
    engine = HFEngine(cfg, model, tok, torch.device("cpu"))
    prompts = [tok(p)["input_ids"] for p in ("1+2=", "3+4=", "12+7=")]
    return engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=3), tok


def test_engine_records_routing_that_the_trainer_reproduces():
    """The HF engine's routing, laid out as batch.collate lays out the tokens, equals the trainer's own
    top-k on the same sequences (same weights, no FP8): routing mismatch 0, and replaying it gives
    bit-identical logprobs; forcing other experts changes them."""
    model = tiny_moe()
    samples, tok = hf_engine_samples(model)
    for s in samples:
        assert s.routed_experts.dtype == torch.int16
        assert tuple(s.routed_experts.shape) == (len(s.prompt_ids) + len(s.token_ids) - 1, 2, 2)
    ids, am, mask, _ = collate(samples, tok.pad_token_id)
    experts = routing.collate_routing(samples, ids.shape[1])  # [B, L, layers, k]
    stats = routing.RoutingStats()
    ctx = routing.forward_context(model, experts, replay=False, count=mask.bool(), stats=stats)
    own = logprob_pass(model, ids, am, 1.0, micro_batch=4, forward_context=ctx)
    assert stats.pairs > 0 and stats.tokens > 0
    assert stats.metrics() == {"moe/routing_mismatch": 0.0, "moe/routing_mismatch_tokens": 0.0}
    replayed = logprob_pass(model, ids, am, 1.0, micro_batch=4,
                            forward_context=routing.forward_context(model, experts, replay=True))
    assert torch.equal(own, replayed)
    assert torch.equal(own, logprob_pass(model, ids, am, 1.0, micro_batch=4))  # no hooks left behind

    forced = torch.where(experts >= 0, (experts + 1) % 4, experts)  # every routed token to other experts
    stats = routing.RoutingStats()
    other = logprob_pass(model, ids, am, 1.0, micro_batch=4, forward_context=routing.forward_context(
        model, forced, replay=True, count=mask.bool(), stats=stats))
    assert stats.metrics()["moe/routing_mismatch"] > 0.5
    assert ((other - own) * mask).abs().max() > 1e-2


def test_replay_gradients_reach_router_and_aux_loss():
    model = tiny_moe()
    ids = torch.randint(3, 12, (2, 6))
    routed = routing.prepare(model, None, replay=False, keep_logits=True)
    model(input_ids=ids, use_cache=False)
    aux = routing.load_balancing_loss(routed.logits, torch.ones(2, 6))
    routing.clear(model)
    assert 0.0 < float(aux.detach()) <= 8.0  # E * sum_e f_e P_e (f summing to k): k when balanced, at most E k
    aux.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("override, match", [
    ("moe.aux_loss_coef=-0.1", "moe.aux_loss_coef=-0.1: must be >= 0"),
    ("moe.aux_loss_coef=.nan", "moe.aux_loss_coef=nan: must be a number"),
    ("moe.router_replay=maybe", "moe.router_replay: expected true or false"),
    ("model.tiny.num_experts=1", "model.tiny.num_experts=1: must be >= 2"),
    ("model.tiny.num_experts_per_tok=5", r"model.tiny.num_experts_per_tok=5: must be in \[1, model.tiny.num_experts\]"),
    ("model.tiny.arch=llama", "model.tiny.num_experts=4: must be 0 for the dense family 'llama'"),
])
def test_bad_moe_config(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "configs/tiny_moe_cpu.yaml", [override])


def test_engine_and_trainer_copies_share_no_hooks():
    """HFEngine deep-copies the model: the engine's capture hooks and the trainer's replay state are apart."""
    model = tiny_moe()
    routing.install(model)
    twin = copy.deepcopy(model)
    with routing.capture(model) as calls:
        twin(input_ids=torch.randint(3, 12, (1, 5)), use_cache=False)
    assert calls == [[], []]
