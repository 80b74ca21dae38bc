"""The BF16 twin with the FP8 path's structure (fp8/fast/bf16.py): the same training as plain linears.

In float64 the products do not depend on the BLAS's summation order enough to matter, so the twin and
plain nn.Linear agree to ~1e-13 on any host (Inductor's CPU attention backward takes no float64: there
float32, and the first step's logprobs and gradients, before AdamW magnifies the last bits); the bf16
compute is checked against autocast's within bf16 rounding.
"""

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from config import FP8Config
from fp8.fast.accum import grad_accumulators, zero_grad_accumulators
from fp8.fast.bf16 import Bf16Linear, bf16_twin
from fp8.fast.cache import refill_weight_caches, refresh_weight_caches_on_step, release_weight_caches, weight_caches
from test_fp8_linear import _accum_run, tiny_llama

TWIN = FP8Config(cache_weights=True, fuse_grad_accum=True)


def _engine_turn(model):
    """Around a rollout: the caches' memory given back and refilled; the weights themselves stay."""
    release_weight_caches(model)
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    refill_weight_caches(model)


def _train(twin: FP8Config | None, compile_backend: str | None, dtype: torch.dtype):
    """test_fp8_linear's trainer loop (2 optimizer steps of 2 micro-batches under activation checkpointing)
    over plain linears, or the twin's with its caches freed and refilled between steps."""
    if twin is None:
        return _accum_run(FP8Config(), compile_backend, prepare=lambda model, cfg: None, dtype=dtype)
    return _accum_run(twin, compile_backend, prepare=lambda model, cfg: bf16_twin(model, cfg, None), dtype=dtype,
                      between=_engine_turn)


@pytest.mark.parametrize("backend,fused", [(None, False), (None, True), ("aot_eager", True), ("inductor", True)])
def test_twin_trains_as_plain_linears(backend, fused):
    """Cached weights refreshed by the optimizer hook, wgrads added into one buffer per GEMM (the .grad views),
    q/k/v and gate/up one GEMM each (fused) or not, eager and compiled (a compiled backward must keep the
    buffer's mutation): the logprobs, gradients and AdamW updates of plain nn.Linear layers."""
    if backend == "inductor" and sys.platform != "linux":
        pytest.skip("inductor's CPU backend")
    dtype, tol, n = (torch.float32, dict(rtol=1e-4, atol=1e-6), 1) if backend == "inductor" else \
        (torch.float64, dict(rtol=1e-9, atol=1e-12), 2)  # n: the optimizer steps compared
    twin = dataclasses.replace(TWIN, fuse_projections=fused)
    model = tiny_llama(layers=2)
    done = bf16_twin(model, twin, None)
    gemms = 8 if fused else 14  # 2 layers x (qkv, o, gate_up, down), or each linear its own
    assert done[0].startswith("14 linears") and len(done) == 3 + fused, done
    assert len(weight_caches(model)) == gemms and len(grad_accumulators(model)) == gemms
    ref = _train(None, backend, dtype)
    got = _train(twin, backend, dtype)
    for a, b in zip(got[0][:2 * n], ref[0][:2 * n]):
        torch.testing.assert_close(a, b, **tol)
    for step_got, step_ref in zip(got[1][:n], ref[1][:n]):
        assert step_got.keys() == step_ref.keys()
        for name in step_ref:
            torch.testing.assert_close(step_got[name], step_ref[name], **tol, msg=name)
    for a, b in zip(got[2], ref[2]) if n == 2 else ():
        torch.testing.assert_close(a, b, **tol)


def test_twin_computes_in_bf16_as_autocast_does_and_accumulates_in_fp32():
    """dtype=bf16 over fp32 weights: the output in bf16 as autocast's linear gives it, the weight gradient
    added into the fp32 .grad (off CUDA: the bf16 product, then added, as autograd adds it)."""
    torch.manual_seed(0)
    plain = nn.Linear(256, 128, bias=False)
    x = torch.randn(3, 5, 256)
    g = torch.randn(3, 5, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.linear(x, plain.weight)
    twin = nn.Sequential(Bf16Linear.from_linear(plain, torch.bfloat16))
    assert twin[0].weight is plain.weight
    bf16_twin(twin, TWIN, torch.bfloat16)  # caches and buffers on the Bf16Linear already there
    refresh_weight_caches_on_step(twin, torch.optim.SGD(twin.parameters(), lr=0.0))
    zero_grad_accumulators(twin)
    assert weight_caches(twin)[0].fwd_op[0].dtype == torch.bfloat16
    for _ in range(2):
        xi = x.clone().requires_grad_()
        y = twin(xi)
        y.backward(g)
        assert y.dtype == torch.bfloat16 and xi.grad.dtype == torch.float32
        torch.testing.assert_close(y, want, rtol=1.6e-2, atol=1e-2)
    assert plain.weight.grad.dtype == torch.float32
    product = (g.reshape(-1, 128).bfloat16().t() @ x.reshape(-1, 256).bfloat16()).float()
    torch.testing.assert_close(plain.weight.grad, 2 * product, rtol=1e-5, atol=1e-5)
