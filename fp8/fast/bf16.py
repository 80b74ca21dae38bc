"""The BF16 twin with the FP8 path's structure: fp8.cache_weights and fp8.fuse_grad_accum with fp8.train=false.

What FP8 buys is measured against the BF16 twin, and a BF16 linear under autocast over fp32 master weights
pays two costs the FP8 path's structure removes: it casts each weight to bf16 in every forward (and again
in every recompute of a checkpointed layer), and autograd casts each bf16 weight gradient to fp32 and adds
it into .grad in a kernel of its own. Megatron-based BF16 baselines (NeMo RL's) have neither. Here the
linears fp8_plan makes FP8 in the FP8 recipe become Bf16Linear instead: the GEMMs of _BlockFP8MM without
quantization, in the compute dtype, so that the FP8 path's wrappers fit them unchanged:

* fp8.cache_weights (cache.WeightCache): the bf16 copy of each weight made once per optimizer step
  (2 bytes per parameter, as the FP8 cache's two layouts), freed while the engine runs;
* fp8.fuse_grad_accum (accum.GradAccumulator): each wgrad GEMM adds its product into the fp32 gradient
  (cuBLAS, `addmm` with an fp32 output), so no bf16 gradient is written, cast and added.
* fp8.fuse_projections (fused.FusedProjections), with either switch above: q/k/v and gate/up of a layer as one
  bf16 GEMM each, as Megatron's linear_qkv and linear_fc1 compute them (x cast once, one dgrad output).

The products are those autocast computes (bf16 operands, fp32 accumulation, bf16 output); the gradient
sum is not rounded to bf16 on the way, as with the FP8 path's. One GPU only (FSDP2 reduce-scatters each
gradient as autograd makes it, and casts in its all-gather). Built only when a switch asks for it,
by run_setup.prepare_trainer.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fp8.fast.accum import attach_grad_accumulators
from fp8.fast.cache import attach_weight_caches
from fp8.fast.fused import fuse_projections
from fp8.linear import block_fp8_mm, cat_weights, inplace_op
from fp8.plan import clean_name, fp8_plan


class Bf16Kernels:
    """_BlockFP8MM's kernels without quantization: every GEMM's operands in `dtype` (bf16 over fp32
    master weights; the weights' own dtype where it is None). The weight operand is a copy, never the
    Parameter (a WeightCache frees its operand's memory while the engine runs)."""

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype

    def weight_fwd(self, weights: tuple[Tensor, ...]) -> tuple[Tensor]:
        w = cat_weights(weights)
        return (w.to(self.dtype or w.dtype, copy=True),)

    weight_dgrad = weight_fwd  # one operand for both GEMMs (a cache keeps it once)

    def fwd(self, x2: Tensor, w_op: tuple[Tensor], save: bool = False) -> tuple[Tensor, tuple[Tensor, ...]]:
        x2 = x2.to(w_op[0].dtype)
        return x2 @ w_op[0].t(), (x2,) if save else ()

    def bwd(self, g2: Tensor, w_op: tuple[Tensor] | None, saved: tuple[Tensor, ...], need_x: bool, need_w: bool,
            acc: Tensor | None = None):
        x2 = saved[0] if need_w else None
        g2 = g2.to(x2.dtype if x2 is not None else w_op[0].dtype)
        grad_x = g2 @ w_op[0] if need_x else None
        if not need_w:
            return grad_x, None
        if acc is None:
            return grad_x, g2.t() @ x2
        addmm_into(acc, g2.t(), x2)
        return grad_x, None


@inplace_op("(Tensor(a!) acc, Tensor a, Tensor b) -> ()")
def addmm_into(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b. On CUDA with bf16 a, b and an fp32 acc one cuBLAS GEMM adds in its epilogue (the bf16
    product never written); elsewhere the product in a's dtype, then added, as autograd would."""
    if acc.is_cuda and a.dtype != acc.dtype:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)


class Bf16Linear(nn.Linear):
    """nn.Linear whose GEMMs run through _BlockFP8MM with Bf16Kernels, so that fp8/fast's weight cache and
    gradient accumulator wrap its `kernels`. Parameter objects and names are those of the replaced linear."""

    kernels: object

    @classmethod
    def from_linear(cls, mod: nn.Linear, dtype: torch.dtype | None) -> Bf16Linear:
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight, new.bias = mod.weight, mod.bias  # the same Parameters: optimizer state and names survive
        new.kernels = Bf16Kernels(dtype)
        return new.train(mod.training)

    def forward(self, x: Tensor) -> Tensor:
        y = self.mm(x, self.weight)
        return y if self.bias is None else y + self.bias

    def mm(self, x: Tensor, *weights: Tensor) -> Tensor:
        """x [..., K] @ cat(weights).T with this linear's kernels (a fused group's GEMM: fused.py)."""
        return block_fp8_mm(x, self.kernels, *weights)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compute={self.kernels.dtype or self.weight.dtype}"


def bf16_twin(model: nn.Module, cfg, dtype: torch.dtype | None) -> list[str]:
    """Give the linears fp8_plan(model, cfg) makes FP8 (with fp8.train=true) the FP8 path's structure in
    `dtype`, in place: Bf16Linear, cfg.fuse_projections' groups (q/k/v and gate/up as one GEMM each), then
    cfg.cache_weights' caches and cfg.fuse_grad_accum's buffers (one GPU; the caller leaves them off over
    FSDP2 ranks). Returns what it did, for the log."""
    plan, n = fp8_plan(model, cfg), 0
    for raw_name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and plan.get(clean_name(raw_name), (False,))[0]:
            model.set_submodule(raw_name, Bf16Linear.from_linear(mod, dtype))
            n += 1
    done = [f"{n} linears through one autograd node in {dtype or 'the weights dtype'}"]
    if cfg.fuse_projections and (groups := fuse_projections(model)):
        done.append(f"{groups} q/k/v + gate/up groups fused into one GEMM each")
    if cfg.cache_weights:
        done.append(f"{attach_weight_caches(model)} weights cast once per optimizer step")
    if cfg.fuse_grad_accum:
        done.append(f"{attach_grad_accumulators(model)} weight gradients added into .grad by their GEMM")
    return done
