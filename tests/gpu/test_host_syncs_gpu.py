"""What the trainer does between two micro-batches makes the host wait for the GPU nowhere, on a CUDA
GPU (torch.cuda.set_sync_debug_mode("error") turns each wait into an error); skipped without CUDA.

A wait per micro-batch drains the GPU's queue, which then idles while the host launches the next
micro-batch's first kernels:
* fp8.calib_pass=logprobs: closing one micro-batch's q/k/v amax record (the next forward's pre-hook);
* the policy loss of a micro-batch (losses.grpo.micro_batch_loss), for each aggregation, its metrics
  and its weight, which the trainer sums on the device until the train phase ends.

    python -m pytest tests/gpu/test_host_syncs_gpu.py -q
"""

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from fp8.calibrate import QKVCalibrator  # noqa: E402
from losses.grpo import LossConfig, LossInputs, MiniBatchTotals, micro_batch_loss  # noqa: E402


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_closing_a_calibration_record_does_not_wait_for_the_gpu():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
                                         vocab_size=64, max_position_embeddings=128)).cuda().eval()
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    calib = QKVCalibrator(model)
    with calib.capture(), torch.no_grad():
        model(input_ids=ids)  # micro-batch 1: its record is open
        with no_host_sync():
            calib._on_forward(model, (), {"input_ids": ids})  # what micro-batch 2's forward does first
        model(input_ids=ids)
    assert calib.amax().shape == (2, 3, 3) and (calib.amax() > 0).all()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batch_loss_does_not_wait_for_the_gpu(agg):
    g = torch.Generator("cuda").manual_seed(0)
    logp = -torch.rand(4, 6, device="cuda", generator=g).requires_grad_(True)
    old, rollout = -torch.rand(4, 6, device="cuda", generator=g), -torch.rand(4, 6, device="cuda", generator=g)
    mask = (torch.rand(4, 6, device="cuda", generator=g) > 0.3).float()
    totals = MiniBatchTotals(mask.sum(), 4.0)
    with no_host_sync():
        out = micro_batch_loss(LossInputs(logp, old, rollout, torch.randn(4, device="cuda", generator=g), mask),
                               totals, LossConfig(agg=agg))
        out.loss.backward()
        share = out.weight.detach().double() / 2  # the trainer's sum over the mini-batches
        summed = {k: v.double() * share for k, v in out.metrics.items()}
    assert all(v.device.type == "cuda" for v in summed.values()) and torch.isfinite(logp.grad).all()
