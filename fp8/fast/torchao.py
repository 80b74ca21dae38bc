"""The torchao backend of the FP8 recipe (SM90): torchao's kernels behind fp8/linear.py's _BlockFP8MM.

fp8/linear.py holds the recipe and its emulation; on an H100/H200 (linear.use_torchao) its
convert_to_fp8_training builds TorchaoFP8Linear here: torchao 0.18's Float8BlockwiseLinear computing
through the recipe's _BlockFP8MM with TorchaoKernels (torchao's Triton quantizers and cuBLAS
block-scaled GEMM), tokens padded to a multiple of 128. Same numerics as the emulation up to
accumulation order (tests/gpu). torchao and Triton are imported only when a GPU asks for them.

DualQuantKernels is the speed-only part (fp8.fast.apply gives it to every torchao linear), same
bytes: where TorchaoKernels quantizes each activation as torchao does - x's 1x128 copy in the
forward, its 128x1 copy in backward from x saved in BF16, and grad_out twice - it writes both layouts
of x (and of grad_out) in one pass with quant_dual (fast/kernels.py) and saves x's FP8 128x1 copy for
backward instead of x in BF16: half the bytes. Its SwiGLU entry points make h = silu(gate) * up (and
the gradient of [gate | up]) inside the quantization (fp8.fuse_swiglu).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from fp8.linear import block_fp8_mm, cat_weights
from fp8.quant import BLOCK


def rows_padded(x: Tensor) -> tuple[Tensor, int]:
    """x [..., K] as [M', K] with M' = M tokens rounded up to a multiple of 128, and M: torchao's wgrad
    kernels need M % 128 == 0; zero rows are exact (they change no amax and add nothing)."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    return (F.pad(x2, (0, 0, 0, BLOCK - m % BLOCK)) if m % BLOCK else x2), m


class TorchaoKernels:
    """_BlockFP8MM's GEMMs as torchao 0.18's fp8_blockwise_mm computes them: its Triton quantizers
    and its cuBLAS block-scaled GEMM (torchao::blockwise_scaled_mm). Needs M % 128 == 0. BF16
    output. Every kernel is a torch.library op, so torch.compile keeps a layer in one graph;
    torchao's own _scaled_mm calls F.scaled_mm, which dynamo cannot trace (a graph break per GEMM).

    Layouts, as cuBLAS takes them: lhs q [M, K] row-major, 1x128 scales [M, K/128] column-major;
    rhs(x) q [M, K] column-major, 128x1 scales [M/128, K]; transposed_lhs(g) q [N, M] row-major,
    1x128 scales (along M) column-major; weight_rhs q [N, K] and weight_transposed_rhs q [K, N]
    column-major, 128x128 scales column-major."""

    def __init__(self):
        from torchao.prototype.blockwise_fp8_training import kernels as k

        self.mm = k.blockwise_scaled_mm
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
            need_w: bool):
        grad_x = self.gemm_dgrad(*self.lhs(g2, BLOCK), w_op) if need_x else None
        grad_w = self.gemm_wgrad(*self.transposed_lhs(g2, BLOCK), *self.rhs(saved[0], BLOCK)) if need_w else None
        return grad_x, grad_w

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
    (into its per-config compile cache); rollout.VLLMEngine puts it back (rollout.kept_env).
    The caller's settings win."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))


@functools.cache
def torchao_linear_cls() -> type:
    """TorchaoFP8Linear: torchao's Float8BlockwiseLinear (its from_float) computing through
    _BlockFP8MM with TorchaoKernels, + bf16_reference switch and token padding.

    Built on first use: torchao pulls in Triton, and the CPU path never needs it. Reachable as
    fp8.fast.torchao.TorchaoFP8Linear (module __getattr__), so it
    pickles by reference.
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
            need_w: bool):
        g = self.dual(g2) if need_w else self.lhs(g2, BLOCK) if need_x else ()
        return self._gemms_bwd(g, w_op, saved, need_x, need_w)

    def bwd_swiglu(self, grad_h: Tensor, gu: Tensor, w_op: tuple[Tensor, Tensor] | None, saved: tuple[Tensor, ...],
                   need_x: bool, need_w: bool):
        """bwd(swiglu_backward(grad_h, gu), ...), with the gradient made inside the quantization kernel."""
        return self._gemms_bwd(self.swiglu_bwd_dual(grad_h, gu), w_op, saved, need_x, need_w)

    def _gemms_bwd(self, g: tuple[Tensor, ...], w_op, saved: tuple[Tensor, ...], need_x: bool, need_w: bool):
        grad_x = grad_w = None
        if need_w:  # g.T [N, M] (quant_dual's qt, 1x128 groups along M) and x [M, K] (128x1 groups)
            grad_w = self.gemm_wgrad(g[2], g[3].t(), saved[0].t(), saved[1])
        if need_x:
            grad_x = self.gemm_dgrad(g[0], g[1], w_op)
        return grad_x, grad_w
