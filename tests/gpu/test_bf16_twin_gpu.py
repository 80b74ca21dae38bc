"""The BF16 twin with the FP8 path's structure (fp8/fast/bf16.py) on a CUDA GPU, compiled layers under the
trainer's bf16 autocast over fp32 master weights; skipped without CUDA.

Two micro-batches into one gradient, then an optimizer step: the twin's logprobs match autocast's plain
linears within bf16 rounding, its weight gradients (summed in fp32 by cuBLAS's addmm, not rounded to bf16
between micro-batches) within bf16 rounding of autograd's, and after the step the cached bf16 weights are
those of the new master weights.

    python -m pytest tests/gpu/test_bf16_twin_gpu.py -q -s
"""

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from batch import amp, token_logprobs  # noqa: E402
from config import FP8Config, load_config  # noqa: E402
from distributed import compile_layers  # noqa: E402
from fp8.fast.accum import zero_grad_accumulators  # noqa: E402
from fp8.fast.bf16 import bf16_twin  # noqa: E402
from fp8.fast.cache import refresh_weight_caches_on_step, weight_caches  # noqa: E402
from modeling import load_model_and_tokenizer  # noqa: E402


def _pass(model, opt, batches):
    """Both micro-batches' logprobs and the gradients they sum to, then the optimizer step."""
    opt.zero_grad(set_to_none=True)
    zero_grad_accumulators(model)
    logps = []
    with amp(True):
        for ids in batches:
            logp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
            (logp * torch.linspace(-1, 1, ids.shape[1], device=ids.device)).sum().backward()
            logps.append(logp.detach().float())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return torch.cat(logps), grads


def test_twin_matches_autocast_linears_compiled():
    cfg = load_config(None, ["model.dtype=float32", "train.device=cuda", "model.tiny.hidden_size=512",
                             "model.tiny.intermediate_size=1024", "model.tiny.num_layers=2", "model.tiny.num_heads=8",
                             "model.tiny.num_kv_heads=8", "model.tiny.head_dim=64"])
    torch.manual_seed(0)
    plain, tok = load_model_and_tokenizer(cfg.model, torch.device("cuda"))
    plain.train()
    twin = copy.deepcopy(plain)
    done = bf16_twin(twin, FP8Config(cache_weights=True, fuse_grad_accum=True), torch.bfloat16)
    print(done)
    assert done[0].startswith("14 linears") and "4 q/k/v + gate/up groups" in done[1] and len(done) == 4
    runs = {}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, len(tok), (4, 256), generator=g).cuda() for _ in range(2)]
    for name, model in (("plain", plain), ("twin", twin)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        refresh_weight_caches_on_step(model, opt)
        torch._dynamo.reset()
        compile_layers(model, "inductor")
        runs[name] = _pass(model, opt, batches)
    torch._dynamo.reset()
    (lp, gp), (lt, gt) = runs["plain"], runs["twin"]
    print(f"logprobs max |diff| {(lt - lp).abs().max().item():.2e}")
    torch.testing.assert_close(lt, lp, rtol=0, atol=5e-2)
    assert gt.keys() == gp.keys()
    for name in gp:
        assert gt[name].dtype == torch.float32, name
        rel = ((gt[name] - gp[name]).norm() / gp[name].norm()).item()
        assert rel < 2e-2, (name, rel)
    for cache in weight_caches(twin):  # refreshed by the optimizer hook after the step
        w = torch.cat([p.detach() for p in cache.weights]).to(torch.bfloat16)
        assert torch.equal(cache.fwd_op[0], w)
