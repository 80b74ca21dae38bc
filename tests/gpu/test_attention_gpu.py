"""The trainer's attention kernel on a CUDA GPU (modeling.pin_sdpa_backends); skipped without CUDA.

With model.cudnn_sdpa=true the trainer's SDPA calls run cuDNN's kernel, eager with checkpointed
layers and compiled, as the 8B configs train; vLLM's CUDA platform import, which turns cuDNN's SDPA off the
first time it runs, comes before the pin and cannot switch the kernel later; a compiled run after one with
the other kernel traces its own graphs (the switch is in torch.compile's cache key; without it the cuDNN run
reused FlashAttention-2's graphs); the logprobs and gradients match FlashAttention-2's
(model.cudnn_sdpa=false) within BF16 rounding.

    python -m pytest tests/gpu/test_attention_gpu.py -q -s     # -s prints the differences
"""

import importlib.util

import pytest
import torch

from test_fp8_gpu import rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("backend", [None, "inductor"], ids=["eager", "compiled"])
def test_the_trainers_sdpa_runs_the_pinned_kernel(backend):
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from batch import amp, token_logprobs
    from distributed import compile_layers
    from modeling import pin_sdpa_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    g = torch.Generator("cuda").manual_seed(0)
    batches = [torch.randint(0, 512, (4, n), device="cuda", generator=g) for n in (200, 328)]
    runs = {}
    try:
        for cudnn in (False, True):
            pin_sdpa_backends(cudnn)
            if importlib.util.find_spec("vllm") is not None:
                from fp8.moe import import_deep_gemm  # the import that flipped the switch mid-run before the pin
                import_deep_gemm()
            assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(
                hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                num_hidden_layers=2, vocab_size=512, max_position_embeddings=1024, attn_implementation="sdpa")).cuda()
            model.gradient_checkpointing_enable()  # fp32 master weights under bf16 autocast, as the 8B configs
            if backend:
                torch._dynamo.reset()
                compile_layers(model, backend)
            model.train()
            counters.clear()
            logps = []
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for ids in batches:  # checkpointed: backward recomputes each layer's attention
                    with amp(True):
                        logp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
                    (logp * torch.linspace(-1, 1, ids.shape[1], device="cuda")).sum().backward()
                    logps.append(logp.detach())
                torch.cuda.synchronize()
            names = {e.key for e in prof.key_averages()}
            attention = sorted(n for n in names if "scaled_dot_product" in n or "cudnn" in n.lower()
                               or "flash_fwd" in n or "flash_bwd" in n)
            runs[cudnn] = (logps, {n: p.grad for n, p in model.named_parameters()}, attention)
            print(f"\ncudnn={cudnn} compile={backend}: caches {dict(counters['aot_autograd'])} "
                  f"{dict(counters['inductor'])}")
    finally:
        torch._dynamo.reset()
        torch.backends.cuda.enable_cudnn_sdp(before)
    (fa_logps, fa_grads, fa_names), (cu_logps, cu_grads, cu_names) = runs[False], runs[True]
    print(f"\ncompile={backend}: FlashAttention-2 ops/kernels {fa_names}\n  cuDNN ops/kernels {cu_names}")
    assert any("cudnn" in n.lower() for n in cu_names), cu_names
    assert not any("cudnn" in n.lower() for n in fa_names), fa_names
    assert any("flash" in n.lower() for n in fa_names), fa_names
    logp_err = max(rel(a, b) for a, b in zip(cu_logps, fa_logps))
    grad_err = {n: rel(cu_grads[n], fa_grads[n]) for n in fa_grads}
    worst = max(grad_err, key=grad_err.get)
    print(f"  cuDNN vs FlashAttention-2: logprobs rel {logp_err:.2e}, gradients rel max {grad_err[worst]:.2e} "
          f"({worst})")
    assert logp_err < 1e-2  # BF16 attention, another accumulation order: ~1e-3; a wrong mask is O(1)
    assert grad_err[worst] < 5e-2, grad_err
