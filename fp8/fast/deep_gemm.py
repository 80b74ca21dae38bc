"""DeepGemmKernels: the dense FP8 linears' three GEMMs on DeepGEMM instead of cuBLAS (fp8.deep_gemm, SM90).

torchao 0.18 runs the dense block-FP8 GEMMs on cuBLAS (torchao::blockwise_scaled_mm) and offers DeepGEMM only
for its MoE grouped GEMM, so this class calls DeepGEMM's dense `fp8_gemm_nt` itself (vLLM vendors DeepGEMM;
fp8.moe.import_deep_gemm finds it). Same FP8 operands, from the same quantizers (DualQuantKernels): only the
GEMM changes, and with it the order in which the products are summed (DeepGEMM promotes the FP8 tensor-core
sums to fp32 every 128 of K, as cuBLAS's block-scaled kernels do). The fp32 scales are used as they are
(disable_ue8m0_cast: no rounding to powers of two). Layouts, as DeepGEMM's NT GEMM takes them (both operands
K-major):
  forward  x [M, K] (1x128 scales [M, K/128], M-major) x W [N, K] (128x128 blocks)       1D2D kernel
  dgrad    g [M, N] x W.T [K, N]: the weight_dgrad operand, transposed view               1D2D
  wgrad    g.T [N, M] x x.T [K, M], both with 1x128 scales along the M tokens             1D1D, fp32 out
Each GEMM is a torch.library op, so a compiled layer stays one graph. DeepGEMM JIT-compiles each new shape
with nvcc (CUDA_HOME) on first use.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fp8.fast.dual import DualQuantKernels


@torch.library.custom_op("fp8_grpo::deep_gemm_nt", mutates_args=())
def _gemm_nt(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, gran_n: int) -> Tensor:
    """[M, K] x [N, K].T -> [M, N]; a's scales 1x128, b's 128x128 (gran_n 128: BF16 out) or 1x128 (gran_n 1:
    fp32 out, the only output SM90's 1D1D kernel writes, as an accumulation into a zeroed C)."""
    import deep_gemm

    if gran_n == 1:
        out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
        deep_gemm.fp8_gemm_nt((a, sa), (b, sb), out, c=out, recipe=(1, 1, 128), disable_ue8m0_cast=True)
        return out
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
    deep_gemm.fp8_gemm_nt((a, sa), (b, sb), out, recipe=(1, gran_n, 128), disable_ue8m0_cast=True)
    return out


@_gemm_nt.register_fake
def _(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, gran_n: int) -> Tensor:
    return a.new_empty(a.shape[0], b.shape[0], dtype=torch.float32 if gran_n == 1 else torch.bfloat16)


class DeepGemmKernels(DualQuantKernels):
    """DualQuantKernels whose GEMMs run on DeepGEMM (module doc); the operands are DualQuantKernels' (and
    fp8.fast.cache's cached weight operands, unchanged)."""

    def gemm(self, xq: Tensor, xs: Tensor, w_op: tuple[Tensor, Tensor]) -> Tensor:
        # w_op: weight_fwd's q [K, N] and scales [K/128, N/128], both column-major: W [N, K] row-major as a view
        return _gemm_nt(xq, xs, w_op[0].t(), w_op[1].t(), 128)

    def gemm_dgrad(self, gq: Tensor, gs: Tensor, w_op: tuple[Tensor, Tensor]) -> Tensor:
        # w_op: weight_dgrad's q [N, K] and scales [N/128, K/128], column-major: W.T [K, N] row-major as a view
        return _gemm_nt(gq, gs, w_op[0].t(), w_op[1].t(), 128)

    def gemm_wgrad(self, gqt: Tensor, gst: Tensor, xq: Tensor, xs: Tensor) -> Tensor:
        # gqt [N, M] with scales gst [N, M/128]; xq [M, K] column-major with scales xs [M/128, K]. fp32 out:
        # member_grads casts it to the weight's dtype (a no-op for fp32 master weights: no BF16 rounding)
        return _gemm_nt(gqt, gst, xq.t(), xs.t(), 1)
