"""What the trainer does for a micro-batch makes the host wait for the GPU nowhere, on a CUDA GPU
(torch.cuda.set_sync_debug_mode reports each wait); skipped without CUDA.

A wait per micro-batch drains the GPU's queue, which then idles while the host launches the next
micro-batch's first kernels:
* fp8.calib_pass=logprobs: closing one micro-batch's q/k/v amax record (the next forward's pre-hook);
* the policy loss of a micro-batch (losses.grpo.micro_batch_loss), for each aggregation, its metrics
  and its weight, which the trainer sums on the device until the train phase ends;
* the shipped 8B recipe's micro-batch itself (torchao FP8 linears, fused projections and SwiGLU, the
  weight cache, compiled and checkpointed layers, fp32 master weights under bf16 autocast): its no-grad
  pass with the q/k/v amax capture, and its train pass, once compiled (CUDA only; the FP8 parts on SM90).
A failure lists every waiting call's file and line (sync_debug_mode "warn", each warning recorded).

    python -m pytest tests/gpu/test_host_syncs_gpu.py -q
"""

import contextlib
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from fp8.calibrate import QKVCalibrator  # noqa: E402
from losses.grpo import LossConfig, LossInputs, MiniBatchTotals, micro_batch_loss  # noqa: E402
from test_fp8_gpu import small_llama, torchao_quantizers_without_autotuning  # noqa: E402,F401 (autouse: no autotuning)


@contextlib.contextmanager
def host_syncs():
    """The calls inside that made the host wait for the GPU, as 'file:line: message' (empty: none)."""
    torch.cuda.synchronize()
    sites: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites += sorted({f"{w.filename}:{w.lineno}: {str(w.message)[:80]}" for w in caught
                     if "called a synchronizing CUDA operation" in str(w.message)})


def test_closing_a_calibration_record_does_not_wait_for_the_gpu():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
                                         vocab_size=64, max_position_embeddings=128)).cuda().eval()
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    calib = QKVCalibrator(model)
    with calib.capture(), torch.no_grad():
        model(input_ids=ids)  # micro-batch 1: its record is open
        with host_syncs() as sites:
            calib._on_forward(model, (), {"input_ids": ids})  # what micro-batch 2's forward does first
    assert not sites, sites
    amax = calib.amax()  # micro-batch 1's record, and the one the call above opened (nothing ran in it)
    assert amax.shape == (2, 3, 3) and (amax[0] > 0).all() and (amax[1] == 0).all()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batch_loss_does_not_wait_for_the_gpu(agg):
    g = torch.Generator("cuda").manual_seed(0)
    logp = (-torch.rand(4, 6, device="cuda", generator=g)).requires_grad_(True)
    old, rollout = -torch.rand(4, 6, device="cuda", generator=g), -torch.rand(4, 6, device="cuda", generator=g)
    mask = (torch.rand(4, 6, device="cuda", generator=g) > 0.3).float()
    totals = MiniBatchTotals(mask.sum(), 4.0)
    with host_syncs() as sites:
        out = micro_batch_loss(LossInputs(logp, old, rollout, torch.randn(4, device="cuda", generator=g), mask),
                               totals, LossConfig(agg=agg))
        out.loss.backward()
        share = out.weight.detach().double() / 2  # the trainer's sum over the mini-batches
        summed = {k: v.double() * share for k, v in out.metrics.items()}
    assert not sites, sites
    assert all(v.device.type == "cuda" for v in summed.values()) and torch.isfinite(logp.grad).all()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="torchao's FP8 training kernels need an SM90 (H100/H200) GPU")
def test_an_fp8_micro_batch_does_not_wait_for_the_gpu():
    from test_fp8_linear import convert_fast

    from batch import amp, token_logprobs
    from config import FP8Config
    from distributed import compile_layers
    from fp8.fast.cache import refresh_weight_caches_on_step

    model = small_llama().float()  # fp32 master weights, bf16 autocast: the 8B configs' trainer
    convert_fast(model, FP8Config(cache_weights=True))
    refresh_weight_caches_on_step(model, torch.optim.SGD(model.parameters(), lr=0.0))
    model.gradient_checkpointing_enable()
    torch._dynamo.reset()
    compile_layers(model, "inductor")
    model.train()
    g = torch.Generator("cuda").manual_seed(0)
    batches = [torch.randint(0, 512, (2, n), device="cuda", generator=g) for n in (192, 256, 320, 384)]
    calib = QKVCalibrator(model)

    def logprobs(ids):
        with torch.no_grad(), amp(True):
            return token_logprobs(model, ids, torch.ones_like(ids), 1.0)

    def train(ids):
        with amp(True):
            logp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
        logp.sum().backward()

    try:
        with calib.capture():  # the trainer's logprobs pass (fp8.calib_pass=logprobs)
            for ids in batches[:2]:  # compiled: a static, then a dynamic-length variant
                logprobs(ids)
            with host_syncs() as logprob_sites:
                for ids in batches[2:]:
                    logprobs(ids)
        for ids in batches[:2]:
            train(ids)
        with host_syncs() as train_sites:
            for ids in batches[2:]:
                train(ids)
    finally:
        torch._dynamo.reset()
    assert calib.amax().shape[0] == 4 and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not logprob_sites and not train_sites, {"logprobs": logprob_sites, "train": train_sites}
