"""Block-wise FP8 linears for the trainer (and the CPU engine's stand-in for vLLM's).

The recipe (DeepSeek-V3 style, as in torchao 0.18 `blockwise_fp8_training` and vLLM block W8A8):

* Format: E4M3 (float8_e4m3fn, max 448, 3 mantissa bits) for every GEMM operand; FP32 accumulate;
  output in BF16 (the input dtype for the emulation).
* Weights [N, K]: one scale per 128x128 block. Activations x [M, K]: one scale per 1x128 tile
  (a token's 128 consecutive channels), so one outlier token does not crush the others.
* Scales: amax/448 of the group (exact arithmetic in fp8/quant.py): the largest element maps
  to +-448, nothing saturates. Scales are recomputed from the BF16 master weights at every
  forward ("just in time"); the optimizer only ever sees BF16/FP32 master weights.
* Backward (torchao's fp8_blockwise_mm): dgrad = q1x128(grad_out) @ q128x128(W), wgrad =
  q128x1(grad_out).T @ q128x1(x), where 128x1 groups run along the token dim, i.e. along the
  contracting dim of the wgrad GEMM. torchao needs tokens % 128 == 0 there; TorchaoFP8Linear
  (fp8/torchao.py) pads the token dim with zero rows, which is exact (zeros change no amax
  and add nothing).
* Which linears: fp8/plan.py's fp8_plan, THE skip list shared with fp8/export.py. Attention
  (QK^T, PV), norms, RoPE, softmax and the loss stay in high precision in the trainer.

Backends: fp8/convert.py's `convert_to_fp8_training` uses torchao's Float8BlockwiseLinear (cuBLAS FP8
GEMMs and torchao's Triton quantizers; fp8/torchao.py wires them into _BlockFP8MM) on SM90 when not
cfg.emulate, else EmulatedFP8Linear:
quantize-dequantize with fp8/quant.py and a float32 matmul. Differences of the emulation from
torchao: (1) accumulation: torchao accumulates e4m3 products in the tensor cores' FP8
accumulator per 128-chunk and applies scale_a*scale_b per chunk, we multiply dequantized float32
operands in one fp32 GEMM (measured on an H100, tests/gpu: emulation vs torchao 6.6e-4 relative
for output, dgrad and wgrad, elementwise <= 2 bf16 ulps + 5e-3 rms; the emulation is the exact
product rounded once, torchao adds ~1e-4); (2) torchao always returns BF16, we return the input
dtype (an fp32 CPU model stays fp32).

Speed-only structure, same quantization, lives in fp8/fast/ and is applied to the converted model
by its one entry point, fp8.fast.apply (run_setup.prepare_trainer calls it when a switch asks): a
one-pass activation quantizer, fused projections, a fused SwiGLU MLP and a weight cache. That is why
_BlockFP8MM takes a `kernels` object and several weights: fp8/fast swaps the kernels and fuses
members, the recipe here never does; nothing here imports fp8/fast.

engines/hf.py's `convert_to_fp8_rollout` builds the CPU stand-in for vLLM's W8A8 linear from the
same EmulatedFP8Linear: activations use vLLM's 1x128 recipe (divide by amax/448) and weights can be pinned to the exact exported FP8
bytes (load_fp8_weight), so the CPU engine computes what vLLM would up to accumulation order.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fp8.plan import print_rank0
from fp8.quant import BLOCK, dequantize_blockwise, fake_quant_act_1x128, fake_quant_act_128x1, fake_quant_weight

if TYPE_CHECKING:
    from config import FP8Config

logger = logging.getLogger(__name__)


class _BlockFP8MM(torch.autograd.Function):
    """y = x @ cat(weights).T with block-FP8 GEMM operands and torchao's backward recipe.

    Shapes: x [..., K], weights [N_i, K] -> y [..., sum N_i] (one weight for a plain linear; a
    fused group's members, fp8/fast). `kernels` quantizes and multiplies:
      weight_fwd(weights) / weight_dgrad(weights): the weight operand of the forward / dgrad GEMM;
      fwd(x2, w_op, save) -> (y, saved): q1x128(x) @ q128x128(W).T, and what wgrad needs of x;
      bwd(g2, w_op, saved, need_x, need_w, acc=None) -> (grad_x, grad_w): q1x128(g) @ q128x128(W) and
      q128x1(g).T @ q128x1(x); with acc (fp8.fuse_grad_accum) grad_w is added into it and None returned.
    Saved: what fwd returns and the members' weights (not their concatenation); the weight is
    re-quantized in backward, as torchao does.
    """

    @staticmethod
    def forward(ctx, x: Tensor, kernels, *weights: Tensor) -> Tensor:
        y, saved = _forward(x, kernels, weights, save=any(ctx.needs_input_grad[2:]))
        ctx.kernels, ctx.x_shape, ctx.x_dtype, ctx.n_saved = kernels, x.shape, x.dtype, len(saved)
        ctx.save_for_backward(*saved, *weights)
        return y

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        t = ctx.saved_tensors  # read once: under activation checkpointing each read unpacks (recomputes)
        saved, weights = t[:ctx.n_saved], t[ctx.n_saved:]
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[2:])
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()  # [M, N]
        w_op = ctx.kernels.weight_dgrad(weights) if need_x else None
        grad_x, grad_w = ctx.kernels.bwd(g2, w_op, saved, need_x, need_w)
        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
        return grad_x, None, *member_grads(grad_w, weights)


def _forward(x: Tensor, kernels, weights: tuple[Tensor, ...], save: bool = False):
    y, saved = kernels.fwd(x.reshape(-1, x.shape[-1]), kernels.weight_fwd(weights), save)
    return y.reshape(*x.shape[:-1], y.shape[-1]), saved


def member_grads(grad_w: Tensor | None, weights) -> list[Tensor | None]:
    """A GEMM's weight gradient [sum N_i, K] split into its members' (None each without one)."""
    if grad_w is None:
        return [None] * len(weights)
    return [g.to(w.dtype) for g, w in zip(grad_w.split([w.shape[0] for w in weights]), weights)]


def needs_grad(x: Tensor, weights) -> bool:
    """An autograd Function is needed: grad mode on and x or a weight requires a gradient."""
    return torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))


def cat_weights(weights: tuple[Tensor, ...]) -> Tensor:
    """The GEMM's weight: the one weight, or a fused group's concatenation [sum N_i, K]."""
    return weights[0] if len(weights) == 1 else torch.cat(weights)


def block_fp8_mm(x: Tensor, kernels, *weights: Tensor) -> Tensor:
    """_BlockFP8MM.apply where a gradient is needed, else its forward alone: nothing saved, and
    torch.compile (torch 2.11) mis-binds an autograd.Function with *args traced under no_grad
    (the old_logp forward of a train.compile'd trainer)."""
    if needs_grad(x, weights):
        return _BlockFP8MM.apply(x, kernels, *weights)
    return _forward(x, kernels, weights)[0]



# ------------------------------------------------------------------------------------ emulation


@torch.library.custom_op("fp8_grpo::fake_quant", mutates_args=())
def _fake_quant_op(x: Tensor, groups: str, recipe: str) -> Tensor:
    """fp8/quant.py's dequantize(quantize(x)), float32, contiguous; groups '1x128' (activations,
    along the last dim), '128x1' (along dim 0) or '128x128' (weights). An opaque op, as torchao's
    Triton quantizers are, so a compiled graph has the GPU path's structure (inductor's C++
    backend in torch 2.11 also fails an assertion on the traced 128x1 quantizer)."""
    if groups == "1x128":
        return fake_quant_act_1x128(x, recipe).contiguous()
    if groups == "128x1":
        return fake_quant_act_128x1(x, recipe).contiguous()
    return fake_quant_weight(x).contiguous()


@_fake_quant_op.register_fake
def _(x: Tensor, groups: str, recipe: str) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


class EmulatedKernels:
    """_BlockFP8MM's GEMMs as quantize-dequantize (fp8/quant.py) + one float32 matmul, any device.
    Weight operands: (dequantize(quantize(W)) float32 [N, K],), the same for forward and dgrad."""

    def __init__(self, act_recipe: str):
        self.act_recipe = act_recipe

    def weight_fwd(self, weights: tuple[Tensor, ...]) -> tuple[Tensor]:
        return (_fake_quant_op(cat_weights(weights), "128x128", ""),)

    weight_dgrad = weight_fwd  # one operand for both GEMMs (a cache keeps it once: fp8/fast)

    def fwd(self, x2: Tensor, w_op: tuple[Tensor], save: bool = False) -> tuple[Tensor, tuple[Tensor, ...]]:
        y = _fake_quant_op(x2, "1x128", self.act_recipe) @ w_op[0].t()
        # not a no-op .to(): torch 2.11's compiled autograd.Function drops the gradient of an output
        # that is `t.to(t.dtype)` (it returns t itself), all its gradients come out zero
        return y if y.dtype == x2.dtype else y.to(x2.dtype), (x2,) if save else ()

    def bwd(self, g2: Tensor, w_op: tuple[Tensor] | None, saved: tuple[Tensor, ...], need_x: bool, need_w: bool,
            acc: Tensor | None = None):
        grad_x = _fake_quant_op(g2, "1x128", "torchao") @ w_op[0] if need_x else None
        grad_w = None
        if need_w:
            grad_w = _fake_quant_op(g2, "128x1", "torchao").t() @ _fake_quant_op(saved[0], "128x1", "torchao")
        return grad_x, accumulate(grad_w, acc)


def accumulate(grad_w: Tensor | None, acc: Tensor | None) -> Tensor | None:
    """The weight gradient to return: grad_w, or None once added into acc (fp8.fuse_grad_accum's buffer)."""
    if acc is None or grad_w is None:
        return grad_w
    add_into(acc, grad_w)
    return None


_LIB = torch.library.Library("fp8_grpo", "FRAGMENT")


def inplace_op(schema: str):
    """Decorator: fn(acc, ...) -> None as the op fp8_grpo::<fn name><schema>, which adds into `acc` (Tensor(a!))
    and returns nothing, so that a compiled backward keeps the mutation. Defined through torch.library.Library,
    not torch.library.custom_op: no Python autograd and ADInplaceOrView kernels around the call, 17 us less
    host time a call on an H100 host (7.1 against 24.4 us, bench/host_speed.py), and these run once per FP8
    linear per micro-batch inside the compiled backward. The fake (meta) kernel returns nothing."""

    def define(fn):
        _LIB.define(fn.__name__ + schema)
        _LIB.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"fp8_grpo::{fn.__name__}", lambda *args: None, lib=_LIB)
        return getattr(torch.ops.fp8_grpo, fn.__name__).default

    return define


@inplace_op("(Tensor(a!) acc, Tensor grad) -> ()")
def add_into(acc: Tensor, grad: Tensor) -> None:
    """acc += grad (any dtypes, one kernel)."""
    acc.add_(grad)


class EmulatedFP8Linear(nn.Linear):
    """nn.Linear whose GEMMs see block-FP8 operands (quantize-dequantize), any device/dtype.

    act_recipe: 'torchao' (trainer, default) or 'vllm' (CPU stand-in for vLLM's W8A8 linear).
    Parameter names and objects are those of the replaced nn.Linear (checkpoint names unchanged).
    """

    fp8_enabled = True  # False inside bf16_reference()

    def __init__(self, *args, act_recipe: str = "torchao", **kwargs):
        super().__init__(*args, **kwargs)
        self.act_recipe = act_recipe
        self.kernels = EmulatedKernels(act_recipe)
        self._fp8_weight: tuple[Tensor, Tensor, int, int] | None = None  # q, scale_inv, version, ptr

    @classmethod
    def from_linear(cls, mod: nn.Linear, act_recipe: str = "torchao") -> "EmulatedFP8Linear":
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, act_recipe=act_recipe)
        new.weight = mod.weight  # the same Parameter object: optimizer state and names survive
        new.bias = mod.bias
        new.train(mod.training)
        return new

    @torch.no_grad()
    def load_fp8_weight(self, q: Tensor, scale_inv: Tensor) -> None:
        """Pin the exact FP8 weight (q e4m3 [N, K], scale_inv [N/128, K/128]) as vLLM holds it.

        Also writes dequantize(q, scale_inv) into .weight. The pinned bytes are used until the
        weight is modified in place (its version counter moves), e.g. by an optimizer step.
        """
        self.weight.copy_(dequantize_blockwise(q, scale_inv, BLOCK, self.weight.dtype))
        self._fp8_weight = (q.to(self.weight.device), scale_inv.to(self.weight.device),
                            self.weight._version, self.weight.data_ptr())

    def _pinned_weight(self) -> Tensor | None:
        p = self._fp8_weight
        if p is None or p[2] != self.weight._version or p[3] != self.weight.data_ptr():
            self._fp8_weight = None
            return None
        return dequantize_blockwise(p[0], p[1], BLOCK)

    def forward(self, x: Tensor) -> Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)
        w = self._pinned_weight() if self._fp8_weight is not None else None
        if w is not None and not needs_grad(x, (self.weight,)):
            x2 = x.reshape(-1, x.shape[-1])
            y = (fake_quant_act_1x128(x2, self.act_recipe) @ w.t()).to(x.dtype)
            y = y.reshape(*x.shape[:-1], w.shape[0])
        else:
            y = self.mm(x, self.weight)
        return y if self.bias is None else y + self.bias

    def mm(self, x: Tensor, *weights: Tensor) -> Tensor:
        """x [..., K] @ cat(weights).T in block FP8 with this linear's kernels."""
        return block_fp8_mm(x, self.kernels, *weights)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=block128, act_recipe={self.act_recipe}"


# ------------------------------------------------------------------- backend choice (conversion: fp8/convert.py)


def is_fp8_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) and hasattr(type(m), "fp8_enabled")


def use_torchao(cfg: FP8Config, device: torch.device | str | None = None) -> bool:
    """torchao kernels: not cfg.emulate, a CUDA device of capability exactly (9, 0) (H100/H200).

    Any other CUDA GPU (Ampere, Ada, Blackwell) falls back to the emulated linear - same numerics,
    but quantize-dequantize + an fp32 GEMM, slower than BF16 - with a one-time warning that says
    so; fp8.emulate=true asks for the emulation explicitly (no warning)."""
    if cfg.emulate or not torch.cuda.is_available():
        return False
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        return False
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        _warn_not_sm90(torch.cuda.get_device_name(device), capability)
        return False
    return True


@functools.cache
def _warn_not_sm90(name: str, capability: tuple[int, int]) -> None:
    msg = (f"WARNING fp8: {name} is sm_{capability[0]}{capability[1]}, torchao's block-FP8 training kernels need "
           "SM90 (H100/H200): the trainer's FP8 linears are EMULATED (same numerics, slower than BF16). Set "
           "fp8.emulate=true to make this explicit, or fp8.train=false to train in BF16")
    logger.warning(msg)
    print_rank0(msg, file=sys.stderr)


@contextlib.contextmanager
def bf16_reference(model: nn.Module):
    """Converted linears compute a plain high-precision F.linear inside (no quantization)."""
    mods = [m for m in model.modules() if hasattr(type(m), "fp8_enabled")]  # FP8 linears and experts (fp8/moe.py)
    prev = [m.__dict__.get("fp8_enabled") for m in mods]
    for m in mods:
        m.fp8_enabled = False
    try:
        yield model
    finally:
        for m, p in zip(mods, prev):
            if p is None:
                del m.fp8_enabled  # back to the class default
            else:
                m.fp8_enabled = p
