"""fp8.fuse_grad_accum: each FP8 weight-gradient GEMM adds its product into the weight's gradient itself.

Autograd's way, per FP8 GEMM and micro-batch: the wgrad GEMM writes a BF16 gradient, autograd casts it to
the master weight's dtype (fp32) and adds it into .grad: 2 + 6 + 12 bytes of memory traffic per parameter
on the way. Here the gradient of a GEMM's weights (a fused group's members together) is ONE buffer
[sum N_i, K] in the weights' dtype, and each member's .grad is a view of its rows:

* on SM90, with fp32 buffers: DeepGEMM's 1D1D wgrad kernel (an installed `deep_gemm`, else vLLM's vendored
  copy) computes D = C + g.T @ x from the same FP8 operands as torchao's cuBLAS wgrad and adds into the buffer
  in its epilogue (8 bytes per parameter). Its length dim (the micro-batch's tokens) is a runtime argument
  (compiled_dims="mn"), so micro-batches of every length share one kernel per weight shape;
* otherwise (no DeepGEMM, bf16 weights): cuBLAS's BF16 product added into the buffer in one kernel;
* emulated (any device): the fp32 product added, the same sum autograd would make.

The Function then returns no weight gradient, so autograd neither casts nor adds. The trainer zeroes the
buffers at each mini-batch (zero_grad_accumulators, which also points the .grad views back after
optimizer.zero_grad) and gives their memory back before the engine wakes (release_grad_accumulators).
The sum is not rounded to BF16 on the way (DeepGEMM), so it differs from autograd's in the last bits.
One GPU only: FSDP2 reduce-scatters each gradient as autograd makes it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fp8.fast.cache import KernelsWrapper, kernels_of, wrap_kernels


class GradAccumulator(KernelsWrapper):
    """Kernels of one FP8 GEMM whose weight gradient goes into `acc` [sum N_i, K] (the members' .grad are
    views of its rows): bwd hands the wrapped kernels the buffer, which they add into and return None for."""

    def __init__(self, kernels, weights: list[Tensor]):
        super().__init__(kernels)
        self.weights = weights
        self.sizes = [w.shape[0] for w in weights]
        w = weights[0]
        self.acc = torch.empty(sum(self.sizes), w.shape[1], dtype=w.dtype, device=w.device)
        self._nbytes = self.acc.untyped_storage().nbytes()
        self.acc.untyped_storage().resize_(0)  # no memory until the first zero(); the same object after (compiled graphs)

    def bwd(self, g2, w_op, saved, need_x, need_w, acc=None):
        return self.kernels.bwd(g2, w_op, saved, need_x, need_w, self.acc if need_w else None)

    def bwd_swiglu(self, grad_h, gu, w_op, saved, need_x, need_w, acc=None):
        return self.kernels.bwd_swiglu(grad_h, gu, w_op, saved, need_x, need_w, self.acc if need_w else None)

    @torch.no_grad()
    def zero(self) -> None:
        storage = self.acc.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._nbytes)
        self.acc.zero_()
        for w, rows in zip(self.weights, self.acc.split(self.sizes)):
            w.grad = rows

    def release(self) -> None:
        for w in self.weights:
            w.grad = None
        self.acc.untyped_storage().resize_(0)


def attach_grad_accumulators(model: nn.Module) -> int:
    """fp8.fuse_grad_accum: one GradAccumulator per FP8 GEMM of `model` (a fused group's members share one),
    the outermost kernels. Returns their count."""
    return wrap_kernels(model, GradAccumulator)


def grad_accumulators(model: nn.Module) -> list[GradAccumulator]:
    return kernels_of(model, GradAccumulator)


def zero_grad_accumulators(model: nn.Module) -> int:
    """Zero every buffer (allocating it after a release) and point its members' .grad at it: after
    optimizer.zero_grad, before a mini-batch's first backward. Returns the count."""
    accumulators = grad_accumulators(model)
    for a in accumulators:
        a.zero()
    return len(accumulators)


def release_grad_accumulators(model: nn.Module) -> None:
    """Drop the members' .grad and the buffers' memory (while the engine's KV cache needs it)."""
    for a in grad_accumulators(model):
        a.release()
