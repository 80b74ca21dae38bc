"""The torchao backend of the FP8 recipe (SM90): torchao's kernels behind fp8/linear.py's _BlockFP8MM.

fp8/linear.py holds the recipe and its emulation; on an H100/H200 (linear.use_torchao) fp8/convert.py's
convert_to_fp8_training builds TorchaoFP8Linear here: torchao 0.18's Float8BlockwiseLinear computing
through the recipe's _BlockFP8MM with TorchaoKernels (torchao's Triton quantizers and cuBLAS
block-scaled GEMM), tokens padded to a multiple of 128. Same numerics as the emulation up to
accumulation order (tests/gpu). torchao and Triton are imported only when a GPU asks for them.
fp8/fast/dual.py's DualQuantKernels (speed only, same bytes) subclasses TorchaoKernels.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from fp8.linear import accumulate, block_fp8_mm, cat_weights
from fp8.quant import BLOCK


def rows_padded(x: Tensor) -> tuple[Tensor, int]:
    """x [..., K] as [M', K] with M' = M tokens rounded up to a multiple of 128, and M: torchao's wgrad
    kernels need M % 128 == 0; zero rows are exact (they change no amax and add nothing)."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    return (F.pad(x2, (0, 0, 0, BLOCK - m % BLOCK)) if m % BLOCK else x2), m


class TorchaoKernels:
    """_BlockFP8MM's GEMMs as torchao 0.18's fp8_blockwise_mm computes them: its Triton quantizers
    and its cuBLAS block-scaled GEMM (torchao::blockwise_scaled_mm's aten._scaled_mm_v2). Needs
    M % 128 == 0. BF16 output. Every kernel is a torch.library op, so torch.compile keeps a layer in
    one graph; torchao's own _scaled_mm calls F.scaled_mm, which dynamo cannot trace (a graph break
    per GEMM).

    Layouts, as cuBLAS takes them: lhs q [M, K] row-major, 1x128 scales [M, K/128] column-major;
    rhs(x) q [M, K] column-major, 128x1 scales [M/128, K]; transposed_lhs(g) q [N, M] row-major,
    1x128 scales (along M) column-major; weight_rhs q [N, K] and weight_transposed_rhs q [K, N]
    column-major, 128x128 scales column-major."""

    def __init__(self):
        from torchao.prototype.blockwise_fp8_training import kernels as k

        self.rhs_scale = k._prepare_blockwise_scaled_mm_rhs_scale
        self.x1x128 = k._scaling_type_value(k.BLOCKWISE_1X128_SCALING_TYPE)
        self.x128x128 = k._scaling_type_value(k.BLOCKWISE_128X128_SCALING_TYPE)
        self.lhs, self.rhs = k.triton_fp8_blockwise_act_quant_lhs, k.triton_fp8_blockwise_act_quant_rhs
        self.transposed_lhs = k.triton_fp8_blockwise_act_quant_transposed_lhs
        self.weight_rhs = k.triton_fp8_blockwise_weight_quant_rhs
        self.weight_transposed_rhs = k.triton_fp8_blockwise_weight_quant_transposed_rhs

    def weight_fwd(self, weights: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        return self.weight_transposed_rhs(cat_weights(weights), block_size=BLOCK)

    def weight_dgrad(self, weights: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        return self.weight_rhs(cat_weights(weights), block_size=BLOCK)

    def fwd(self, x2: Tensor, w_op: tuple[Tensor, Tensor], save: bool = False) -> tuple[Tensor, tuple[Tensor, ...]]:
        x2 = x2.contiguous()
        return self.gemm(*self.lhs(x2, BLOCK), w_op), (x2,) if save else ()

    def bwd(self, g2: Tensor, w_op: tuple[Tensor, Tensor] | None, saved: tuple[Tensor, ...], need_x: bool,
            need_w: bool, acc: Tensor | None = None):
        grad_x = self.gemm_dgrad(*self.lhs(g2, BLOCK), w_op) if need_x else None
        grad_w = self.gemm_wgrad(*self.transposed_lhs(g2, BLOCK), *self.rhs(saved[0], BLOCK)) if need_w else None
        return grad_x, accumulate(grad_w, acc)

    def mm(self, a: Tensor, b: Tensor, a_s: Tensor, recipe_a: int, b_s: Tensor, recipe_b: int,
           out_dtype: torch.dtype) -> Tensor:
        """torchao::blockwise_scaled_mm (a [M, K] row-major, b [K, N] column-major) without its Python
        custom op: the aten op it calls, straight, with the scale padding it does. Inside a compiled layer
        the custom op took 80 us of profiled host time a call besides the aten op's on a slow-cored H100
        host, 27 ms of a 3B train micro-batch (336 calls), where that host time, not the GPU, set the pace
        (docs/results.md, "The FP8 passes' host time")."""
        return torch.ops.aten._scaled_mm_v2.default(a, b, [a_s], [recipe_a], [], [self.rhs_scale(b_s, recipe_b)],
                                                    [recipe_b], [], None, out_dtype, [], False)

    def gemm(self, xq: Tensor, xs: Tensor, w_op: tuple[Tensor, Tensor]) -> Tensor:
        """y [M, N] = x @ W.T from x's 1x128 operand and W's weight_fwd operand."""
        return self.mm(xq, w_op[0], xs, self.x1x128, w_op[1], self.x128x128, torch.bfloat16)

    def gemm_dgrad(self, gq: Tensor, gs: Tensor, w_op: tuple[Tensor, Tensor]) -> Tensor:
        """grad_x [M, K] = g @ W from g's 1x128 operand and W's weight_dgrad operand."""
        return self.mm(gq, w_op[0], gs, self.x1x128, w_op[1], self.x128x128, torch.bfloat16)

    def gemm_wgrad(self, gqt: Tensor, gst: Tensor, xq: Tensor, xs: Tensor) -> Tensor:
        """grad_w [N, K] = g.T @ x: g.T [N, M] with 1x128 groups along M (transposed_lhs), x [M, K]
        with 128x1 groups (rhs: scales [M/128, K]): both along the tokens."""
        return self.mm(gqt, xq, gst, self.x1x128, xs.t(), self.x1x128, torch.bfloat16)


def keep_triton_autotuning() -> None:
    """torchao's quantizers autotune each new K (45 configs each; the first FP8 step of an 8B model
    spends ~3 min on it, H100). Keep the results on disk, in one fixed place, for later runs:
    TRITON_CACHE_AUTOTUNING is read when the @triton.autotune kernels are defined (torchao's
    import), TRITON_CACHE_DIR at each autotuning. vLLM's engine start overwrites TRITON_CACHE_DIR
    (into its per-config compile cache); engines.vllm.VLLMEngine puts it back (engines.vllm.kept_env).
    The caller's settings win."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))


@functools.cache
def torchao_linear_cls() -> type:
    """TorchaoFP8Linear: torchao's Float8BlockwiseLinear (its from_float) computing through
    _BlockFP8MM with TorchaoKernels, + bf16_reference switch and token padding.

    Built on first use: torchao pulls in Triton, and the CPU path never needs it. Reachable as
    fp8.torchao.TorchaoFP8Linear (module __getattr__), so it pickles by reference.
    """
    keep_triton_autotuning()
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    class TorchaoFP8Linear(Float8BlockwiseLinear):
        fp8_enabled = True  # False inside bf16_reference()
        kernels = TorchaoKernels()  # stateless, shared; fp8.fast may give an instance its own

        def forward(self, x: Tensor) -> Tensor:
            if not self.fp8_enabled:
                return F.linear(x, self.weight)
            return self.mm(x, self.weight)

        def mm(self, x: Tensor, *weights: Tensor) -> Tensor:
            """x [..., K] @ cat(weights).T in block FP8, tokens padded to a multiple of 128."""
            x2, m = rows_padded(x)
            y = block_fp8_mm(x2, self.kernels, *weights)
            return y[:m].reshape(*x.shape[:-1], y.shape[-1])

    TorchaoFP8Linear.__module__, TorchaoFP8Linear.__qualname__ = __name__, "TorchaoFP8Linear"
    return TorchaoFP8Linear


def __getattr__(name: str):
    if name == "TorchaoFP8Linear":
        return torchao_linear_cls()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
