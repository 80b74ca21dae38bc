"""fp8.fuse_swiglu: a SwiGLU MLP as ONE autograd node whose middle never exists in BF16 on the GPU.

down_proj(silu(gate_proj(x)) * up_proj(x)) runs as two block-FP8 GEMMs (gate|up fused, then down);
the kernels make h = swiglu(gu) inside the quantization of down's input and the gradient of gu
inside the quantization of gate|up's output gradient (fp8/fast/kernels.py on Hopper; the emulation
materializes them). Same numerics as the unfused linears up to h's rounding: once, as compiled
(eager torch rounds silu(gate) too).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fp8.fast.fused import FusedLinear, subclass
from fp8.linear import EmulatedKernels, is_fp8_linear, member_grads, needs_grad
from fp8.torchao import rows_padded
from models import family_of


def swiglu(gu: Tensor) -> Tensor:
    """h = silu(gate) * up of gu = [gate | up] [..., 2I], computed in float32 and rounded once to gu's
    dtype, as inductor's fused kernel and fp8/fast/kernels.py do (eager torch also rounds silu(gate))."""
    g, u = gu.float().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(gu.dtype)


def swiglu_backward(grad_h: Tensor, gu: Tensor) -> Tensor:
    """The gradient of gu = [gate | up] from grad_h, the gradient of swiglu(gu); float32, rounded once."""
    g, u = gu.float().chunk(2, dim=-1)
    dh, s = grad_h.float(), torch.sigmoid(g)
    return torch.cat([dh * u * (s * (1 + g * (1 - s))), dh * (g * s)], dim=-1).to(grad_h.dtype)


class SwiGLUEmulatedKernels(EmulatedKernels):
    """EmulatedKernels with the SwiGLU entry points of DualQuantKernels, h and its gradient materialized."""

    def fwd_swiglu(self, gu: Tensor, w_op, save: bool = False):
        return self.fwd(swiglu(gu), w_op, save)

    def bwd_swiglu(self, grad_h: Tensor, gu: Tensor, w_op, saved: tuple[Tensor, ...], need_x: bool, need_w: bool,
                   acc: Tensor | None = None):
        return self.bwd(swiglu_backward(grad_h, gu), w_op, saved, need_x, need_w, acc)


class _BlockFP8SwiGLU(torch.autograd.Function):
    """y = down(silu(gate) * up), x [M, H] -> y [M, H], with k_gu (gate|up's kernels: fwd) and k_down
    (down's: fwd_swiglu, bwd, bwd_swiglu) as in _BlockFP8MM. Saved: x's and h's FP8 128x1 copies
    (emulated: x and h) and gu [M, 2I] (which the unfused MLP's backward saves too)."""

    @staticmethod
    def forward(ctx, x: Tensor, k_gu, k_down, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        y, saved_x, gu, saved_h = _swiglu_forward(x, k_gu, k_down, (w_gate, w_up), w_down, True)
        ctx.k_gu, ctx.k_down, ctx.x_dtype, ctx.n = k_gu, k_down, x.dtype, (len(saved_x), len(saved_h))
        ctx.save_for_backward(*saved_x, gu, *saved_h, w_gate, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        t, (nx, nh) = list(ctx.saved_tensors), ctx.n  # read once (activation checkpointing: _BlockFP8MM)
        saved_x, gu, saved_h, (w_gate, w_up, w_down) = t[:nx], t[nx], t[nx + 1:nx + 1 + nh], t[nx + 1 + nh:]
        need = ctx.needs_input_grad
        k_gu, k_down = ctx.k_gu, ctx.k_down
        grad_h, grad_down = k_down.bwd(grad_y.contiguous(), k_down.weight_dgrad((w_down,)), tuple(saved_h),
                                       True, need[5])
        w_gu = k_gu.weight_dgrad((w_gate, w_up)) if need[0] else None
        grad_x, grad_gu = k_gu.bwd_swiglu(grad_h, gu, w_gu, tuple(saved_x), need[0], need[3] or need[4])
        grad_x = grad_x.to(ctx.x_dtype) if grad_x is not None else None
        return grad_x, None, None, *member_grads(grad_gu, (w_gate, w_up)), *member_grads(grad_down, (w_down,))


def _swiglu_forward(x: Tensor, k_gu, k_down, w_gu: tuple[Tensor, Tensor], w_down: Tensor, save: bool):
    gu, saved_x = k_gu.fwd(x, k_gu.weight_fwd(w_gu), save)
    y, saved_h = k_down.fwd_swiglu(gu, k_down.weight_fwd((w_down,)), save)
    return y, saved_x, gu, saved_h


class FusedSwiGLU:
    """Mixin of a SwiGLU MLP linked by fuse_swiglu: its forward is one _BlockFP8SwiGLU (the MLP's own
    forward inside bf16_reference)."""

    swiglu_names: tuple[str, str, str]  # its gate, up, down children (the family's, set by fuse_swiglu)

    def forward(self, x: Tensor) -> Tensor:
        gate, up, down = (getattr(self, n) for n in self.swiglu_names)
        if not (gate.fp8_enabled and up.fp8_enabled and down.fp8_enabled):
            return super().forward(x)
        x2, m = rows_padded(x)
        weights = (gate.weight, up.weight, down.weight)
        if needs_grad(x, weights):
            y = _BlockFP8SwiGLU.apply(x2, gate.kernels, down.kernels, *weights)
        else:  # as block_fp8_mm: nothing saved, and no autograd.Function traced under no_grad
            y = _swiglu_forward(x2, gate.kernels, down.kernels, weights[:2], weights[2], False)[0]
        return y[:m].reshape(*x.shape[:-1], y.shape[-1])


def fuse_swiglu(model: nn.Module) -> int:
    """fp8.fuse_swiglu: every SwiGLU MLP of `model` - children exactly the family's gate, up, down
    linears and a SiLU activation (models/: gate_proj, up_proj, down_proj, act_fn), forward
    down(act(gate(x)) * up(x)) as in Llama, Qwen2/3, Mistral - whose three linears are FP8 of one
    class with gate/up fused (fuse_projections) becomes a FusedSwiGLU (fused.subclass: names and
    parameters unchanged). Returns the count."""
    names = family_of(model).swiglu
    n = 0
    for mlp in model.modules() if names else ():
        children = dict(mlp.named_children())
        if isinstance(mlp, FusedSwiGLU) or set(children) != set(names):
            continue
        gate, up, down, act = (children[k] for k in names)
        if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
            continue
        if not (is_fp8_linear(down) and isinstance(gate, FusedLinear) and gate.group.members == [gate, up]
                and isinstance(gate, type(down)) and down.weight.dtype == gate.weight.dtype):
            continue
        subclass(mlp, FusedSwiGLU)
        mlp.swiglu_names = names[:3]
        n += 1
    return n
