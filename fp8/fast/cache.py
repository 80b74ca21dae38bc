"""fp8.cache_weights: each FP8 GEMM's quantized weight kept until the optimizer changes the weight.

The weight quantization (and a fused group's weight concatenation) then runs once per optimizer
step instead of in every forward and backward of every micro-batch; it costs a second copy of the
FP8 weights (2 bytes per parameter with torchao's two layouts).

A WeightCache is the kernels object of its GEMM (the linear's `kernels`, shared by a fused group's
members): it hands out the cached weight operands and leaves the rest to the kernels it wraps.
Eager, each forward compares the weights' version counters and re-quantizes after any in-place
change. Inside torch.compile it cannot: refresh_weight_caches_on_step registers the one optimizer
hook that re-quantizes after every step. Refreshes write in place, so compiled graphs keep their
inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fp8.fast.fused import FusedLinear, has_kernels


class KernelsWrapper:
    """Kernels of one FP8 GEMM that do one part their own way (the weight operands: WeightCache, the weight
    gradient: accum.GradAccumulator) and leave the rest to the kernels they wrap."""

    def __init__(self, kernels):
        self.kernels = kernels

    def weight_fwd(self, weights):
        return self.kernels.weight_fwd(weights)

    def weight_dgrad(self, weights):
        return self.kernels.weight_dgrad(weights)

    def fwd(self, x2, w_op, save=False):
        return self.kernels.fwd(x2, w_op, save)

    def bwd(self, g2, w_op, saved, need_x, need_w, acc=None):
        return self.kernels.bwd(g2, w_op, saved, need_x, need_w, acc)

    def fwd_swiglu(self, gu, w_op, save=False):
        return self.kernels.fwd_swiglu(gu, w_op, save)

    def bwd_swiglu(self, grad_h, gu, w_op, saved, need_x, need_w, acc=None):
        return self.kernels.bwd_swiglu(grad_h, gu, w_op, saved, need_x, need_w, acc)


def kernels_of(model: nn.Module, cls: type) -> list:
    """The `cls` kernels objects of `model`'s GEMMs (has_kernels), each once, found along each linear's wrappers."""
    found = {}
    for m in model.modules():
        k = m.kernels if has_kernels(m) else None
        while k is not None and not isinstance(k, cls):
            k = k.kernels if isinstance(k, KernelsWrapper) else None
        if k is not None:
            found[id(k)] = k
    return list(found.values())


class WeightCache(KernelsWrapper):
    """Kernels of one FP8 GEMM (a linear's, or a fused group's) whose weight_fwd/weight_dgrad return
    the operands `kernels` made of the current weights, kept between optimizer steps."""

    def __init__(self, kernels, weights: list[Tensor]):
        super().__init__(kernels)
        self.weights = weights
        self.fwd_op: tuple[Tensor, ...] | None = None
        self.dgrad_op: tuple[Tensor, ...] | None = None
        self.key: tuple | None = None
        self._sizes: list[int] = []  # the operands' storage bytes while released

    def _key(self) -> tuple:
        return tuple((w._version, w.data_ptr()) for w in self.weights)

    def weight_fwd(self, weights: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if not torch.compiler.is_compiling() and self._key() != self.key:
            self.refresh()
        return self.fwd_op

    def weight_dgrad(self, weights: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return self.dgrad_op  # as of this step's forward (weight_fwd checked it)

    @torch.no_grad()
    def refresh(self) -> None:
        k, ws = self.kernels, tuple(w.detach() for w in self.weights)
        fwd = tuple(k.weight_fwd(ws))
        shared = type(k).weight_dgrad is type(k).weight_fwd  # one operand for both GEMMs: keep it once
        dgrad = fwd if shared else tuple(k.weight_dgrad(ws))
        if self.fwd_op is None:
            self.fwd_op, self.dgrad_op = fwd, dgrad
        else:
            for dst, src in zip(self.fwd_op + (() if shared else self.dgrad_op), fwd + (() if shared else dgrad)):
                dst.copy_(src)
        self.key = self._key()

    def _operands(self) -> list[Tensor]:
        shared = self.dgrad_op is self.fwd_op
        return list(self.fwd_op or ()) + ([] if shared else list(self.dgrad_op or ()))

    def release(self) -> None:
        """Give the operands' memory back (while the engine's KV cache needs it); the tensors stay the
        same objects (compiled graphs hold them), empty until refill()."""
        self._sizes = [t.untyped_storage().nbytes() for t in self._operands()]
        for t in self._operands():
            t.untyped_storage().resize_(0)

    def refill(self) -> None:
        for t, n in zip(self._operands(), self._sizes):
            t.untyped_storage().resize_(n)
        self.refresh()


def wrap_kernels(model: nn.Module, cls: type) -> int:
    """One cls(kernels, weights) per GEMM of `model` (has_kernels; a fused group's members share one), wrapping the
    kernels the GEMM had: the outermost. GEMMs already wrapped by a cls keep theirs. Returns the count added."""
    n = 0
    for m in model.modules():
        if has_kernels(m) and not isinstance(m.kernels, cls):
            members = m.group.members if isinstance(m, FusedLinear) else [m]
            wrapper = cls(m.kernels, [x.weight for x in members])
            for x in members:
                x.kernels = wrapper
            n += 1
    return n


def attach_weight_caches(model: nn.Module) -> int:
    """fp8.cache_weights: one WeightCache per FP8 GEMM of `model` (a fused group's members share one)."""
    return wrap_kernels(model, WeightCache)


def weight_caches(model: nn.Module) -> list[WeightCache]:
    """The WeightCaches of `model`, each once."""
    return kernels_of(model, WeightCache)


def refresh_weight_caches(model: nn.Module) -> int:
    """Re-quantize every WeightCache of `model` (after an optimizer step); returns their count."""
    caches = weight_caches(model)
    for c in caches:
        c.refresh()
    return len(caches)


def refresh_weight_caches_on_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Fill `model`'s WeightCaches now (before a compiled forward, which cannot) and register THE hook
    of fp8.cache_weights: re-quantize them after every step of `optimizer`. Returns their count (0: no
    caches, no hook)."""
    n = refresh_weight_caches(model)
    if n:
        optimizer.register_step_post_hook(lambda *_: refresh_weight_caches(model))
    return n


def release_weight_caches(model: nn.Module) -> None:
    """Free every WeightCache's memory while the engine's KV cache is awake (2 bytes per FP8 parameter,
    16 GB at 8B); refill_weight_caches before the trainer's next forward."""
    for c in weight_caches(model):
        c.release()


def refill_weight_caches(model: nn.Module) -> None:
    for c in weight_caches(model):
        c.refill()
