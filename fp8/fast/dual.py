"""DualQuantKernels: fp8.fast's kernels for torchao linears (fp8.fast.apply gives them to each), same bytes.

Where the recipe's TorchaoKernels (fp8/torchao.py) quantizes each activation as torchao does - x's
1x128 copy in the forward, its 128x1 copy in backward from x saved in BF16, and grad_out twice - these
write both layouts of x (and of grad_out) in one pass with quant_dual (kernels.py) and save x's FP8
128x1 copy for backward instead of x in BF16: half the bytes. Their SwiGLU entry points make
h = silu(gate) * up (and the gradient of [gate | up]) inside the quantization (fp8.fuse_swiglu).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fp8.linear import accumulate, inplace_op
from fp8.quant import BLOCK
from fp8.torchao import TorchaoKernels


class DualQuantKernels(TorchaoKernels):
    """TorchaoKernels with quant_dual for activations and gradients (one read for both layouts where
    torchao reads twice; same bytes). quant_dual's 128x1 copy: qt [K, M] row-major + scales [M/128, K]."""

    def __init__(self):
        super().__init__()
        from fp8.fast.kernels import quant_dual, swiglu_backward_quant_dual, swiglu_quant_dual, swiglu_quant_lhs

        self.dual = quant_dual
        self.swiglu_dual, self.swiglu_lhs, self.swiglu_bwd_dual = (swiglu_quant_dual, swiglu_quant_lhs,
                                                                    swiglu_backward_quant_dual)

    def fwd(self, x2: Tensor, w_op: tuple[Tensor, Tensor], save: bool = False) -> tuple[Tensor, tuple[Tensor, ...]]:
        # save: the weight gradient will need x's 128x1 copy: quantize both layouts in one pass
        xq, xs, *x128x1 = self.dual(x2.contiguous()) if save else self.lhs(x2.contiguous(), BLOCK)
        return self.gemm(xq, xs, w_op), tuple(x128x1)

    def fwd_swiglu(self, gu: Tensor, w_op: tuple[Tensor, Tensor], save: bool = False):
        """fwd(swiglu(gu), ...), with silu(gate) * up made inside the quantization kernel."""
        hq, hs, *h128x1 = self.swiglu_dual(gu) if save else self.swiglu_lhs(gu)
        return self.gemm(hq, hs, w_op), tuple(h128x1)

    def bwd(self, g2: Tensor, w_op: tuple[Tensor, Tensor] | None, saved: tuple[Tensor, ...], need_x: bool,
            need_w: bool, acc: Tensor | None = None):
        g = self.dual(g2) if need_w else self.lhs(g2, BLOCK) if need_x else ()
        return self._gemms_bwd(g, w_op, saved, need_x, need_w, acc)

    def bwd_swiglu(self, grad_h: Tensor, gu: Tensor, w_op: tuple[Tensor, Tensor] | None, saved: tuple[Tensor, ...],
                   need_x: bool, need_w: bool, acc: Tensor | None = None):
        """bwd(swiglu_backward(grad_h, gu), ...), with the gradient made inside the quantization kernel."""
        return self._gemms_bwd(self.swiglu_bwd_dual(grad_h, gu), w_op, saved, need_x, need_w, acc)

    def _gemms_bwd(self, g: tuple[Tensor, ...], w_op, saved: tuple[Tensor, ...], need_x: bool, need_w: bool,
                   acc: Tensor | None = None):
        grad_x = grad_w = None
        # g.T [N, M] (quant_dual's qt, 1x128 groups along M) and x [M, K] (128x1 groups)
        if need_w and acc is not None and acc.is_cuda and acc.dtype == torch.float32 and deep_gemm_wgrad():
            wgrad_into(acc, g[2], g[3].t(), saved[0], saved[1].t())  # fp8.fuse_grad_accum, in the GEMM's epilogue
        elif need_w:
            grad_w = accumulate(self.gemm_wgrad(g[2], g[3].t(), saved[0].t(), saved[1]), acc)
        if need_x:
            grad_x = self.gemm_dgrad(g[0], g[1], w_op)
        return grad_x, grad_w


class DeepGemmKernels(DualQuantKernels):
    """DualQuantKernels with the forward and data-gradient GEMMs on DeepGEMM's SM90 1D2D kernel
    (fp8.dense_gemm=deep_gemm): the same operands, the activation's 1x128 copy and the weight's 128x128
    blocks, fp32 scales as they are; BF16 out. bench/gemm.py times it against cuBLAS."""

    def gemm(self, xq: Tensor, xs: Tensor, w_op: tuple[Tensor, Tensor]) -> Tensor:
        return deep_gemm_mm(xq, xs, *w_op)

    gemm_dgrad = gemm  # g [M, N] @ W: W's weight_dgrad operand in the same layout as weight_fwd's


@torch.library.custom_op("fp8_grpo::deep_gemm_mm", mutates_args=())
def deep_gemm_mm(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor) -> Tensor:
    """y [M, N] = x @ W.T in BF16 from x as FP8 [M, K] with 1x128 scales [M, K/128] (M-major) and torchao's
    weight operand: W.T as FP8 [K, N] and its 128x128 scales, both column-major, so their .t() views are the
    K-major [N, K] and [N/128, K/128] DeepGEMM takes. M is a runtime argument (compiled_dims "nk")."""
    import deep_gemm

    out = torch.empty(xq.shape[0], wq.shape[1], device=xq.device, dtype=torch.bfloat16)
    deep_gemm.fp8_gemm_nt((xq, xs), (wq.t(), ws.t()), out, recipe=(1, 128, 128), disable_ue8m0_cast=True)
    return out


@deep_gemm_mm.register_fake
def _(xq: Tensor, xs: Tensor, wq: Tensor, ws: Tensor) -> Tensor:
    return xq.new_empty(xq.shape[0], wq.shape[1], dtype=torch.bfloat16)


@torch.compiler.assume_constant_result
def deep_gemm_wgrad() -> bool:
    """DeepGEMM imports (fp8/moe.py: the installed package, else vLLM's vendored copy; cached there), for
    wgrad_into. A constant to torch.compile: traced, the import inside would break the graph at the FP8
    linear's autograd.Function, which would then run eagerly between pieces of the layer's graph (the GPU
    idle between them)."""
    from fp8.moe import import_deep_gemm

    return bool(import_deep_gemm())


@inplace_op("(Tensor(a!) acc, Tensor gqt, Tensor gs, Tensor xqt, Tensor xs) -> ()")
def wgrad_into(acc: Tensor, gqt: Tensor, gs: Tensor, xqt: Tensor, xs: Tensor) -> None:
    """acc [N, K] fp32 += g.T @ x in DeepGEMM's SM90 1D1D kernel, which adds into acc in its epilogue: g.T as
    FP8 [N, M] with 1x128 scales along M [N, M/128] (M-major), x.T as FP8 [K, M] with scales [K, M/128], the
    operands of torchao's wgrad GEMM. M (tokens) is a runtime argument: one kernel per weight shape."""
    import deep_gemm

    deep_gemm.fp8_gemm_nt((gqt, gs), (xqt, xs), acc, c=acc, recipe=(1, 1, 128), compiled_dims="mn",
                          disable_ue8m0_cast=True)
