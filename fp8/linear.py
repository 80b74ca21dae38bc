"""Block-wise FP8 linears for the trainer, and THE skip list shared with the weight export.

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
  pads the token dim with zero rows, which is exact (zeros change no amax and add nothing).
  x's 128x1 copy is made in the forward, in the same pass as its 1x128 copy (fp8/kernels.py),
  and saved for backward in FP8 instead of x in BF16; likewise grad_out's two copies.
* Stays BF16: embeddings and lm_head (logits are what the RL ratio is computed from), MoE
  routers (tiny, decisions are discontinuous), linears with a bias, linears whose dims are not
  multiples of 128, names matching FP8Config.keep_bf16, the first keep_first_layers and last
  keep_last_layers decoder layers. vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj
  and refuses a fused layer whose shards differ in precision, so a group is FP8 only if all its
  members are (fp8_plan).
* Attention (QK^T, PV), norms, RoPE, softmax and the loss stay in high precision in the trainer.

Why ONE quantizer and ONE skip list: the GRPO importance ratio pi_train/pi_rollout is only
meaningful if both sides run the same function. If the trainer quantizes a layer the engine
keeps in BF16 (or uses a different scale convention), every token's log-prob carries a
systematic offset that IS correction cannot tell from policy change: it silently biases the
ratios, clipping and the mismatch metrics. So `fp8_plan` decides for both convert_* here and
fp8/export.py, and both quantize weights with fp8/quant.py (bit-identical to torchao's kernels).

Backends: `convert_to_fp8_training` uses torchao's Float8BlockwiseLinear (cuBLAS FP8 GEMMs,
torchao's Triton weight quantizers, our quant_dual for activations) on SM90 when not
cfg.emulate, else EmulatedFP8Linear: quantize-dequantize with fp8/quant.py and a float32 matmul.
Differences of the emulation from torchao: (1) accumulation: torchao accumulates e4m3 products
in the tensor cores' FP8 accumulator per 128-chunk and applies scale_a*scale_b per chunk, we
multiply dequantized float32 operands in one fp32 GEMM (measured on an H100, tests/gpu:
emulation vs torchao 6.6e-4 relative for output, dgrad and wgrad, elementwise <= 2 bf16 ulps
+ 5e-3 rms; the emulation is the exact product rounded once, torchao adds ~1e-4);
(2) torchao always returns BF16, we return the input dtype (an fp32 CPU model stays fp32).
Speed-only structure on top, same quantization: fuse_projections (q/k/v and gate/up as one GEMM
each), fuse_swiglu (a SwiGLU MLP as one autograd node whose silu(gate) * up is made inside the
quantization kernel), cache_weights (FP8 weights kept between optimizer steps).
`convert_to_fp8_rollout` builds the CPU stand-in for vLLM's W8A8 linear: activations use
vLLM's 1x128 recipe (divide by amax/448) and weights can be pinned to the exact exported FP8
bytes (load_fp8_weight), so the CPU engine computes what vLLM would up to accumulation order.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import os
import re
import sys
import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fp8.quant import dequantize_blockwise, fake_quant_act_1x128, fake_quant_act_128x1, fake_quant_weight

if TYPE_CHECKING:
    from config import FP8Config

logger = logging.getLogger(__name__)

BLOCK = 128
# Infixes that wrappers (torch.compile, FSDP1, activation checkpointing, DDP) put into names.
_WRAPPER_PARTS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
_ROUTER_PATTERNS = ("*router*", "*.mlp.gate", "*.block_sparse_moe.gate", "*shared_expert_gate")
_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM's packed modules
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def clean_name(name: str) -> str:
    """Module/parameter name as in the HF checkpoint: drop wrapper infixes and a DDP 'module.'."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def num_decoder_layers(model: nn.Module) -> int:
    """config.num_hidden_layers, else 1 + the largest `layers.<i>.` index in module names."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if isinstance(n, int):
        return n
    idx = [int(m.group(1)) for name, _ in model.named_modules() if (m := _LAYER_RE.search(name + "."))]
    return max(idx) + 1 if idx else 0


def fp8_eligible(name: str, module: nn.Module, cfg: FP8Config, num_layers: int) -> tuple[bool, str]:
    """Per-module rule: (True, 'fp8') or (False, why it stays BF16).

    keep_bf16 patterns also apply through vLLM's fused groups (q/k/v, gate/up: keeping k_proj
    keeps q_proj and v_proj). A sibling kept for its dims or bias can only be seen with the whole
    model: prefer fp8_plan(model, cfg), which applies this rule and then that check."""
    name = clean_name(name)
    if not isinstance(module, nn.Linear):
        return False, "not an nn.Linear"
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "lm_head":
        return False, "lm_head"
    if "embed" in leaf:
        return False, "embedding"
    if any(fnmatch.fnmatchcase(name, p) for p in _ROUTER_PATTERNS):
        return False, "MoE router"
    for pat in cfg.keep_bf16:
        if fnmatch.fnmatchcase(name, pat):
            return False, f"keep_bf16 '{pat}'"
    parent = name.rpartition(".")[0]
    siblings = next((g for g in _FUSED_GROUPS if leaf in g), ())  # their dims/bias: see fp8_plan
    for sib in siblings:
        for pat in cfg.keep_bf16 if sib != leaf else ():
            if fnmatch.fnmatchcase(f"{parent}.{sib}", pat):
                return False, f"fused with {sib} (keep_bf16 '{pat}')"
    if m := _LAYER_RE.search(name):
        i = int(m.group(1))
        if i < cfg.keep_first_layers:
            return False, "keep_first_layers"
        if i >= num_layers - cfg.keep_last_layers:
            return False, "keep_last_layers"
    if module.bias is not None:
        return False, "has bias"
    if module.in_features % BLOCK or module.out_features % BLOCK:
        return False, f"dims {module.out_features}x{module.in_features} not divisible by {BLOCK}"
    return True, "fp8"


def fp8_plan(model: nn.Module, cfg: FP8Config) -> dict[str, tuple[bool, str]]:
    """{HF module name: (fp8?, reason)} for every nn.Linear of `model` - THE skip list.

    fp8_eligible per module, then a fused group (q/k/v, gate/up of one parent) is FP8 only if
    all its members present in the model are (vLLM loads them into one qkv_proj/gate_up_proj).
    """
    n_layers = num_decoder_layers(model)
    base = {clean_name(n): fp8_eligible(n, m, cfg, n_layers)
            for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    plan = dict(base)
    for name, (ok, _) in base.items():
        if not ok or "." not in name:
            continue
        parent, leaf = name.rsplit(".", 1)
        for group in _FUSED_GROUPS:
            if leaf in group:
                for sib in group:
                    s = base.get(f"{parent}.{sib}")
                    if s is not None and not s[0]:
                        plan[name] = (False, f"fused with {sib} ({s[1]})")
                        break
    return plan


def _log_summary(kind: str, plan: dict[str, tuple[bool, str]]) -> None:
    """One line on rank 0: how many linears are FP8, which stay BF16 and why."""
    kept: dict[str, list[str]] = {}
    for name, (ok, reason) in plan.items():
        if not ok:
            kept.setdefault(reason, []).append(name)
    n_fp8 = sum(ok for ok, _ in plan.values())
    parts = [f"{reason} x{len(names)} [{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}]"
             for reason, names in kept.items()]
    msg = f"fp8: converted {n_fp8} linears to {kind}, kept {len(plan) - n_fp8} in BF16: " + ("; ".join(parts) or "-")
    if plan and not n_fp8:
        msg += (f"\nWARNING fp8: no linear is FP8, the whole model runs in BF16: block FP8 needs bias-free "
                f"linears whose dims are multiples of {BLOCK} (see fp8.keep_bf16 / keep_*_layers), or set "
                "fp8.train/rollout=false")
    logger.info(msg)
    _print_rank0(msg)


def _print_rank0(msg: str, **kwargs) -> None:
    """print on rank 0 only (every process when torch.distributed is not initialized)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(msg, flush=True, **kwargs)


# ------------------------------------------------------------------------------------ emulation


class _BlockFP8MM(torch.autograd.Function):
    """y = x @ cat(weights).T with block-FP8 GEMM operands and torchao's backward recipe.

    Shapes: x [..., K], weights [N_i, K] -> y [..., sum N_i] (one weight for a plain linear, a
    fused group's members otherwise: see FusedProjections). `kernels` does the three quantized
    GEMMs: forward q1x128(x) @ q128x128(W).T, dgrad q1x128(g) @ q128x128(W), wgrad
    q128x1(g).T @ q128x1(x), where 128x1 groups run along the token dim (the contracting dim of
    the wgrad GEMM). kernels.fwd(x2, w, save) returns y and what wgrad needs of x (with torchao's
    kernels: its FP8 128x1 copy, half the bytes of x; emulated: x), kernels.bwd(g2, w, saved,
    need_x, need_w) the two gradients. Saved: that, and the members' weights, not their
    concatenation (re-concatenated in backward); the weight is re-quantized there, as torchao does,
    unless `cached` holds its quantized copies (fp8.cache_weights: WeightCache).
    """

    @staticmethod
    def forward(ctx, x: Tensor, kernels, cached, *weights: Tensor) -> Tensor:
        y, saved = _block_fp8_forward(x, kernels, weights, cached, save=any(ctx.needs_input_grad[3:]))
        ctx.kernels, ctx.x_shape, ctx.x_dtype = kernels, x.shape, x.dtype
        ctx.n_saved, ctx.n_cached = len(saved), len(cached or ())
        ctx.save_for_backward(*saved, *(cached or ()), *weights)
        return y

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        t = ctx.saved_tensors  # read once: under activation checkpointing each read unpacks (recomputes)
        saved, rest = t[:ctx.n_saved], t[ctx.n_saved:]
        cached, weights = rest[:ctx.n_cached] or None, rest[ctx.n_cached:]
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()  # [M, N]
        w = _weight(weights, cached)
        need_w = any(ctx.needs_input_grad[3:])
        grad_x, grad_w = ctx.kernels.bwd(g2, w, saved, ctx.needs_input_grad[0], need_w, cached)
        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype).reshape(ctx.x_shape)
        return grad_x, None, None, *_member_grads(grad_w, weights)


def _member_grads(grad_w: Tensor | None, weights) -> list[Tensor | None]:
    """The GEMM's weight gradient [sum N_i, K] split into its members' (None each without one)."""
    if grad_w is None:
        return [None] * len(weights)
    return [g.to(w.dtype) for g, w in zip(grad_w.split([w.shape[0] for w in weights]), weights)]


def _needs_grad(x: Tensor, weights) -> bool:
    """An autograd Function is needed: grad mode on and x or a weight requires a gradient."""
    return torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))


def _weight(weights: tuple[Tensor, ...], cached) -> Tensor | None:
    """The GEMM's weight: the one weight, or a fused group's concatenation; None when cached."""
    return None if cached else weights[0] if len(weights) == 1 else torch.cat(weights)


def _block_fp8_forward(x: Tensor, kernels, weights: tuple[Tensor, ...], cached=None, save: bool = False):
    y, saved = kernels.fwd(x.reshape(-1, x.shape[-1]), _weight(weights, cached), save, cached)
    return y.reshape(*x.shape[:-1], y.shape[-1]), saved


def block_fp8_mm(x: Tensor, kernels, *weights: Tensor, cache: WeightCache | None = None) -> Tensor:
    """_BlockFP8MM.apply where a gradient is needed, else its forward alone: nothing saved, and
    torch.compile (torch 2.11) mis-binds an autograd.Function with *args traced under no_grad
    (the old_logp forward of a train.compile'd trainer)."""
    cached = cache.get() if cache is not None else None
    if _needs_grad(x, weights):
        return _BlockFP8MM.apply(x, kernels, cached, *weights)
    return _block_fp8_forward(x, kernels, weights, cached)[0]


class WeightCache:
    """fp8.cache_weights: the quantized copies of one GEMM's weight (a linear's, or a fused group's
    concatenation), in the layouts its kernels take (kernels.quant_weight), kept until the weights
    change. The weight quantization (and a fused group's weight concatenation) then runs once per
    optimizer step instead of in every forward and backward of every micro-batch; it costs a second
    copy of the FP8 weights (2 bytes per parameter with torchao's two layouts).

    Eager, each use compares the weights' version counters and re-quantizes after any in-place
    change. Inside torch.compile it cannot: refresh_weight_caches after every optimizer step
    (train_grpo hooks it onto the optimizer). Refreshes write in place, so compiled graphs keep
    their inputs."""

    def __init__(self, weights: list[Tensor], kernels):
        self.weights, self.kernels = weights, kernels
        self.tensors: tuple[Tensor, ...] | None = None
        self.key: tuple | None = None

    def _key(self) -> tuple:
        return tuple((w._version, w.data_ptr()) for w in self.weights)

    def get(self) -> tuple[Tensor, ...] | None:
        if not torch.compiler.is_compiling() and self._key() != self.key:
            self.refresh()
        return self.tensors

    @torch.no_grad()
    def refresh(self) -> None:
        new = self.kernels.quant_weight(_weight(tuple(w.detach() for w in self.weights), None))
        if self.tensors is None:
            self.tensors = new
        else:
            for dst, src in zip(self.tensors, new):
                dst.copy_(src)
        self.key = self._key()


def refresh_weight_caches(model: nn.Module) -> int:
    """Re-quantize every WeightCache of `model` (after an optimizer step); returns their count."""
    caches = {id(c): c for m in model.modules() if (c := getattr(m, "_wcache", None)) is not None}
    for c in caches.values():
        c.refresh()
    return len(caches)


def refresh_weight_caches_on_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Fill `model`'s WeightCaches now (before a compiled forward, which cannot) and re-quantize them
    after every step of `optimizer`; returns their count (0: no caches, no hook)."""
    n = refresh_weight_caches(model)
    if n:
        optimizer.register_step_post_hook(lambda *_: refresh_weight_caches(model))
    return n


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


class _EmulatedKernels:
    """_BlockFP8MM's GEMMs as quantize-dequantize (fp8/quant.py) + one float32 matmul, any device."""

    def __init__(self, act_recipe: str):
        self.act_recipe = act_recipe

    def quant_weight(self, w: Tensor) -> tuple[Tensor]:
        return (_fake_quant_op(w, "128x128", ""),)

    def fwd(self, x2: Tensor, w: Tensor | None, save: bool = False, cached=None) -> tuple[Tensor, tuple[Tensor, ...]]:
        (w_fq,) = cached or self.quant_weight(w)
        y = _fake_quant_op(x2, "1x128", self.act_recipe) @ w_fq.t()
        # not a no-op .to(): torch 2.11's compiled autograd.Function drops the gradient of an output
        # that is `t.to(t.dtype)` (it returns t itself), all its gradients come out zero
        return y if y.dtype == x2.dtype else y.to(x2.dtype), (x2,) if save else ()

    def bwd(self, g2: Tensor, w: Tensor | None, saved: tuple[Tensor, ...], need_x: bool, need_w: bool, cached=None):
        grad_x = _fake_quant_op(g2, "1x128", "torchao") @ (cached or self.quant_weight(w))[0] if need_x else None
        grad_w = None
        if need_w:
            grad_w = _fake_quant_op(g2, "128x1", "torchao").t() @ _fake_quant_op(saved[0], "128x1", "torchao")
        return grad_x, grad_w

    def fwd_swiglu(self, gu: Tensor, w: Tensor | None, save: bool = False, cached=None):
        return self.fwd(swiglu(gu), w, save, cached)

    def bwd_swiglu(self, grad_h: Tensor, gu: Tensor, w: Tensor | None, saved: tuple[Tensor, ...], need_x: bool,
                   need_w: bool, cached=None):
        return self.bwd(swiglu_backward(grad_h, gu), w, saved, need_x, need_w, cached)


class EmulatedFP8Linear(nn.Linear):
    """nn.Linear whose GEMMs see block-FP8 operands (quantize-dequantize), any device/dtype.

    act_recipe: 'torchao' (trainer, default) or 'vllm' (CPU stand-in for vLLM's W8A8 linear).
    Parameter names and objects are those of the replaced nn.Linear (checkpoint names unchanged).
    """

    fp8_enabled = True  # False inside bf16_reference()
    _fused: FusedProjections | None = None  # set by convert_to_fp8_training (fp8.fuse_projections)
    _wcache: WeightCache | None = None  # set by convert_to_fp8_training (fp8.cache_weights)

    def __init__(self, *args, act_recipe: str = "torchao", **kwargs):
        super().__init__(*args, **kwargs)
        self.act_recipe = act_recipe
        self._kernels = _EmulatedKernels(act_recipe)
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
        if w is not None and not _needs_grad(x, (self.weight,)):
            x2 = x.reshape(-1, x.shape[-1])
            y = (fake_quant_act_1x128(x2, self.act_recipe) @ w.t()).to(x.dtype)
            y = y.reshape(*x.shape[:-1], w.shape[0])
        elif self._fused is not None:
            y = self._fused(self, x)
        else:
            y = self._mm(x, self.weight)
        return y if self.bias is None else y + self.bias

    def _mm(self, x: Tensor, *weights: Tensor) -> Tensor:
        return block_fp8_mm(x, self._kernels, *weights, cache=self._wcache)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=block128, act_recipe={self.act_recipe}"


# ------------------------------------------------------------------------------------ fusion


class FusedProjections:
    """The FP8 linears of one vLLM fused group (q/k/v or gate/up of one parent) as ONE FP8 GEMM.

    vLLM computes qkv_proj and gate_up_proj as one GEMM each; the trainer's HF modules call
    q_proj(h), k_proj(h), v_proj(h) (gate_proj(h), up_proj(h)) on the same tensor h. The first
    member called with h multiplies h by the members' concatenated weights and keeps the output;
    each sibling called with that same h (same object, version and grad mode) takes its slice.
    The quantization is that of separate linears - 1x128 tiles of h, 128x128 blocks of each W
    (concatenating along the output dim at multiples of 128 changes no block), grad_out tiles
    inside one member's columns - but h is quantized once per group instead of once per member
    (forward and wgrad), the thin k/v GEMMs (N=1024) ride in one wide GEMM, and h is saved once
    for backward. dgrad sums the members' contributions inside one fp32 accumulation instead of
    adding BF16 results. Any other call pattern (a member alone, a different input) still gives
    the right output: it just recomputes the group's GEMM.
    """

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self._x: Tensor | None = None
        self._key: tuple[int, bool] | None = None
        self._outs: tuple[Tensor, ...] = ()
        self._pending: set[int] = set()

    def __call__(self, member: nn.Module, x: Tensor) -> Tensor:
        i = next(j for j, m in enumerate(self.members) if m is member)
        # traced by torch.compile: a graph's tensors are not mutated between the members' calls
        key = (-1 if torch.compiler.is_compiling() else x._version, torch.is_grad_enabled())
        if not (self._x is x and self._key == key and i in self._pending):
            self._outs = member._mm(x, *(m.weight for m in self.members)).split(self.sizes, dim=-1)
            self._x, self._key, self._pending = x, key, set(range(len(self.members)))
        self._pending.discard(i)
        # A column slice is strided; measured on an H100 (4 Llama-8B layers, 16k tokens) eager silu/mul
        # on strided slices cost ~8 ms per step more than on dense ones; the copy ~2 ms. Compiled,
        # the copies were saved for backward besides the GEMM output (ninth session): inductor reads
        # the slices in place.
        out = self._outs[i] if torch.compiler.is_compiling() else self._outs[i].contiguous()
        if not self._pending:  # every member served: drop the references
            self._x, self._outs = None, ()
        return out


def fuse_projections(model: nn.Module) -> int:
    """Link each parent's q/k/v and gate/up FP8 linears into a FusedProjections; returns the count.

    A group is linked only if all its members are FP8 linears of one class with the same input
    size, weight dtype and device (fp8_plan already makes a group all-FP8 or all-BF16)."""
    n = 0
    for parent in model.modules():
        for leaves in _FUSED_GROUPS:
            members = [getattr(parent, leaf, None) for leaf in leaves]
            if not all(is_fp8_linear(m) for m in members) or len({type(m) for m in members}) > 1:
                continue
            if len({(m.in_features, m.weight.dtype, m.weight.device) for m in members}) > 1:
                continue
            group = FusedProjections(members)
            for m in members:
                m._fused = group
            n += 1
    return n


def attach_weight_caches(model: nn.Module) -> int:
    """fp8.cache_weights: one WeightCache per FP8 GEMM of `model` (a fused group's members share one)."""
    n = 0
    for m in model.modules():
        if is_fp8_linear(m) and m._wcache is None:
            members = m._fused.members if m._fused is not None else [m]
            cache = WeightCache([x.weight for x in members], m._kernels)
            for x in members:
                x._wcache = cache
            n += 1
    return n


def swiglu(gu: Tensor) -> Tensor:
    """h = silu(gate) * up of gu = [gate | up] [..., 2I], computed in float32 and rounded once to gu's
    dtype, as inductor's fused kernel and fp8/kernels.py do (eager torch also rounds silu(gate))."""
    g, u = gu.float().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(gu.dtype)


def swiglu_backward(grad_h: Tensor, gu: Tensor) -> Tensor:
    """The gradient of gu = [gate | up] from grad_h, the gradient of swiglu(gu); float32, rounded once."""
    g, u = gu.float().chunk(2, dim=-1)
    dh, s = grad_h.float(), torch.sigmoid(g)
    return torch.cat([dh * u * (s * (1 + g * (1 - s))), dh * (g * s)], dim=-1).to(grad_h.dtype)


class _BlockFP8SwiGLU(torch.autograd.Function):
    """y = down(silu(gate) * up) of a SwiGLU MLP, x [M, H] -> y [M, H], as two _BlockFP8MM GEMMs
    (gate|up, then down) whose middle never exists in BF16 on the GPU: kernels.fwd_swiglu makes
    h = swiglu(gu) inside the quantization of down's input, kernels.bwd_swiglu the gradient of gu
    inside the quantization of gate|up's output gradient (fp8/kernels.py). Same numerics as the
    unfused linears (up to h's rounding: once, as compiled; eager torch rounds silu(gate) too).
    Saved: x's and h's FP8 128x1 copies and gu [M, 2I] (which the unfused MLP's backward saves too)."""

    @staticmethod
    def forward(ctx, x: Tensor, kernels, cached_gu, cached_down, w_gate: Tensor, w_up: Tensor,
                w_down: Tensor) -> Tensor:
        y, saved_x, gu, saved_h = _swiglu_forward(x, kernels, (w_gate, w_up), w_down, cached_gu, cached_down, True)
        ctx.kernels, ctx.x_dtype = kernels, x.dtype
        ctx.n = (len(saved_x), len(saved_h), len(cached_gu or ()), len(cached_down or ()))
        ctx.save_for_backward(*saved_x, gu, *saved_h, *(cached_gu or ()), *(cached_down or ()), w_gate, w_up, w_down)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        t, (nx, nh, ncg, ncd) = list(ctx.saved_tensors), ctx.n
        saved_x, gu, saved_h = t[:nx], t[nx], t[nx + 1:nx + 1 + nh]
        t = t[nx + 1 + nh:]
        cached_gu, cached_down, (w_gate, w_up, w_down) = t[:ncg] or None, t[ncg:ncg + ncd] or None, t[ncg + ncd:]
        need = ctx.needs_input_grad
        grad_h, grad_down = ctx.kernels.bwd(grad_y.contiguous(), _weight((w_down,), cached_down), tuple(saved_h),
                                            True, need[6], cached_down)
        grad_x, grad_gu = ctx.kernels.bwd_swiglu(grad_h, gu, _weight((w_gate, w_up), cached_gu), tuple(saved_x),
                                                 need[0], need[4] or need[5], cached_gu)
        grad_x = grad_x.to(ctx.x_dtype) if grad_x is not None else None
        return (grad_x, None, None, None, *_member_grads(grad_gu, (w_gate, w_up)),
                *_member_grads(grad_down, (w_down,)))


def _swiglu_forward(x: Tensor, kernels, w_gu: tuple[Tensor, Tensor], w_down: Tensor, cached_gu, cached_down,
                    save: bool):
    gu, saved_x = kernels.fwd(x, _weight(w_gu, cached_gu), save, cached_gu)
    y, saved_h = kernels.fwd_swiglu(gu, _weight((w_down,), cached_down), save, cached_down)
    return y, saved_x, gu, saved_h


def _rows_padded(x: Tensor) -> tuple[Tensor, int]:
    """x [..., K] as [M', K] with M' = M tokens rounded up to a multiple of 128, and M: torchao's wgrad
    kernels need M % 128 == 0; zero rows are exact (they change no amax and add nothing)."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    return (F.pad(x2, (0, 0, 0, BLOCK - m % BLOCK)) if m % BLOCK else x2), m


def _swiglu_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """forward of a SwiGLU MLP linked by fuse_swiglu: down_proj(act_fn(gate_proj(x)) * up_proj(x)) as one
    _BlockFP8SwiGLU (the class's own forward inside bf16_reference)."""
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    if not (gate.fp8_enabled and up.fp8_enabled and down.fp8_enabled):
        return type(self).forward(self, x)
    x2, m = _rows_padded(x)
    cached_gu, cached_down = (c.get() if c is not None else None for c in (gate._wcache, down._wcache))
    weights = (gate.weight, up.weight, down.weight)
    if _needs_grad(x, weights):
        y = _BlockFP8SwiGLU.apply(x2, gate._kernels, cached_gu, cached_down, *weights)
    else:  # as block_fp8_mm: nothing saved, and no autograd.Function traced under no_grad
        y = _swiglu_forward(x2, gate._kernels, weights[:2], weights[2], cached_gu, cached_down, False)[0]
    return y[:m].reshape(*x.shape[:-1], y.shape[-1])


def fuse_swiglu(model: nn.Module) -> int:
    """fp8.fuse_swiglu: every SwiGLU MLP of `model` - children exactly gate_proj, up_proj, down_proj and a
    SiLU act_fn, forward down_proj(act_fn(gate_proj(x)) * up_proj(x)) as in Llama, Qwen2/3, Mistral -
    whose three linears are FP8 of one class with gate/up fused (fuse_projections) computes through
    _BlockFP8SwiGLU (its forward is replaced on the instance; names and parameters unchanged).
    Returns the count."""
    n = 0
    for mlp in model.modules():
        children = dict(mlp.named_children())
        if set(children) != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
            continue
        gate, up, down, act = (children[k] for k in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
            continue
        if not (is_fp8_linear(down) and type(down) is type(gate) and gate._fused is not None
                and gate._fused.members == [gate, up] and down.weight.dtype == gate.weight.dtype):
            continue
        mlp.forward = types.MethodType(_swiglu_mlp_forward, mlp)
        n += 1
    return n


# ------------------------------------------------------------------------------------ torchao


class _TorchaoKernels:
    """_BlockFP8MM's GEMMs with torchao 0.18's cuBLAS block-scaled GEMM (torchao::blockwise_scaled_mm)
    and its Triton weight quantizers, plus fp8/kernels.py's quant_dual for activations and
    gradients (one read for both layouts where torchao reads twice; same bytes). Needs M % 128 == 0.
    BF16 output. Every kernel is a torch.library op, so torch.compile keeps a layer in one graph;
    torchao's own _scaled_mm calls F.scaled_mm, which dynamo cannot trace (a graph break per GEMM).

    Layouts, as cuBLAS takes them: lhs q [M, K] row-major, 1x128 scales [M, K/128] column-major;
    quant_dual adds the 128x1 copy as [K, M] row-major + scales [M/128, K]; weight_rhs q [N, K] and
    weight_transposed_rhs q [K, N] column-major, 128x128 scales column-major."""

    def __init__(self):
        from torchao.prototype.blockwise_fp8_training import kernels as k

        from fp8.kernels import quant_dual, swiglu_backward_quant_dual, swiglu_quant_dual, swiglu_quant_lhs

        self.mm = k.blockwise_scaled_mm
        self.x1x128 = k._scaling_type_value(k.BLOCKWISE_1X128_SCALING_TYPE)
        self.x128x128 = k._scaling_type_value(k.BLOCKWISE_128X128_SCALING_TYPE)
        self.lhs, self.dual = k.triton_fp8_blockwise_act_quant_lhs, quant_dual
        self.swiglu_dual, self.swiglu_lhs, self.swiglu_bwd_dual = (swiglu_quant_dual, swiglu_quant_lhs,
                                                                    swiglu_backward_quant_dual)
        self.weight_rhs = k.triton_fp8_blockwise_weight_quant_rhs
        self.weight_transposed_rhs = k.triton_fp8_blockwise_weight_quant_transposed_rhs

    def quant_weight(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The forward's (weight_transposed_rhs) and the dgrad's (weight_rhs) operands of w."""
        return (*self.weight_transposed_rhs(w, block_size=BLOCK), *self.weight_rhs(w, block_size=BLOCK))

    def fwd(self, x2: Tensor, w: Tensor | None, save: bool = False, cached=None) -> tuple[Tensor, tuple[Tensor, ...]]:
        # save: the weight gradient will need x's 128x1 copy: quantize both layouts in one pass
        xq, xs, *x128x1 = self.dual(x2.contiguous()) if save else self.lhs(x2.contiguous(), BLOCK)
        return self._gemm(xq, xs, w, cached), tuple(x128x1)

    def fwd_swiglu(self, gu: Tensor, w: Tensor | None, save: bool = False, cached=None):
        """fwd(swiglu(gu), ...), with silu(gate) * up made inside the quantization kernel."""
        hq, hs, *h128x1 = self.swiglu_dual(gu) if save else self.swiglu_lhs(gu)
        return self._gemm(hq, hs, w, cached), tuple(h128x1)

    def _gemm(self, xq: Tensor, xs: Tensor, w: Tensor | None, cached) -> Tensor:
        wq, ws = cached[:2] if cached else self.weight_transposed_rhs(w, block_size=BLOCK)
        return self.mm(xq, wq, xs, self.x1x128, ws, self.x128x128, torch.bfloat16)

    def bwd(self, g2: Tensor, w: Tensor | None, saved: tuple[Tensor, ...], need_x: bool, need_w: bool, cached=None):
        g = self.dual(g2) if need_w else self.lhs(g2, BLOCK) if need_x else ()
        return self._gemms_bwd(g, w, saved, need_x, need_w, cached)

    def bwd_swiglu(self, grad_h: Tensor, gu: Tensor, w: Tensor | None, saved: tuple[Tensor, ...], need_x: bool,
                   need_w: bool, cached=None):
        """bwd(swiglu_backward(grad_h, gu), ...), with the gradient made inside the quantization kernel."""
        return self._gemms_bwd(self.swiglu_bwd_dual(grad_h, gu), w, saved, need_x, need_w, cached)

    def _gemms_bwd(self, g: tuple[Tensor, ...], w: Tensor | None, saved: tuple[Tensor, ...], need_x: bool,
                   need_w: bool, cached):
        grad_x = grad_w = None
        if need_w:
            gqt, gst = g[2:]
            xqt, xst = saved
            # g.T [N, M] with 1x128 groups along M, x [M, K] with 128x1 groups: both along the tokens
            grad_w = self.mm(gqt, xqt.t(), gst.t(), self.x1x128, xst.t(), self.x1x128, torch.bfloat16)
        if need_x:
            wq, ws = cached[2:] if cached else self.weight_rhs(w, block_size=BLOCK)
            grad_x = self.mm(g[0], wq, g[1], self.x1x128, ws, self.x128x128, torch.bfloat16)
        return grad_x, grad_w


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
    _BlockFP8MM with torchao's kernels, + bf16_reference switch, token padding and fusion.

    Imported lazily: torchao pulls in Triton, and the CPU path never needs it.
    """
    keep_triton_autotuning()
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    class TorchaoFP8Linear(Float8BlockwiseLinear):
        fp8_enabled = True
        _fused: FusedProjections | None = None
        _wcache: WeightCache | None = None
        _kernels = _TorchaoKernels()  # an attribute, as EmulatedFP8Linear's (stateless, shared)

        def forward(self, x: Tensor) -> Tensor:
            if not self.fp8_enabled:
                return F.linear(x, self.weight)
            return self._fused(self, x) if self._fused is not None else self._mm(x, self.weight)

        def _mm(self, x: Tensor, *weights: Tensor) -> Tensor:
            x2, m = _rows_padded(x)
            y = block_fp8_mm(x2, self._kernels, *weights, cache=self._wcache)
            return y[:m].reshape(*x.shape[:-1], y.shape[-1])

    TorchaoFP8Linear.__module__, TorchaoFP8Linear.__qualname__ = __name__, "TorchaoFP8Linear"
    globals()["TorchaoFP8Linear"] = TorchaoFP8Linear  # picklable by reference
    return TorchaoFP8Linear


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
    _print_rank0(msg, file=sys.stderr)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def convert_to_fp8_training(model: nn.Module, cfg: FP8Config) -> list[str]:
    """Replace the fp8_plan-eligible nn.Linear of `model` in place; returns their HF names.

    torchao Float8BlockwiseLinear on SM90 (BF16 weights), else EmulatedFP8Linear. Call before
    wrapping the model (FSDP/compile) and before creating hooks on the linears; the weight
    Parameters are reused, so an optimizer created earlier stays valid.
    """
    plan = fp8_plan(model, cfg)
    converted, kinds = [], set()
    for raw_name, mod in list(model.named_modules()):
        name = clean_name(raw_name)
        if not isinstance(mod, nn.Linear) or is_fp8_linear(mod) or not plan.get(name, (False,))[0]:
            continue
        if use_torchao(cfg, mod.weight.device) and mod.weight.dtype in (torch.bfloat16, torch.float32):
            new, kind = torchao_linear_cls().from_float(mod), "torchao"
            new.train(mod.training)
        else:
            new, kind = EmulatedFP8Linear.from_linear(mod, "torchao"), "emulated"
        _replace(model, raw_name, new)
        converted.append(name)
        kinds.add(kind)
    kind = "block-FP8 (" + "+".join(sorted(kinds) or ["none"]) + ")"
    if cfg.fuse_projections and (n := fuse_projections(model)):
        kind += f", {n} q/k/v + gate/up groups fused into one GEMM each"
    if cfg.fuse_projections and cfg.fuse_swiglu and (n := fuse_swiglu(model)):
        kind += f", {n} SwiGLU MLPs with silu*mul inside the FP8 quantization"
    if cfg.cache_weights:
        kind += f", {attach_weight_caches(model)} FP8 weights cached between optimizer steps"
    _log_summary(kind, plan)
    return converted


def convert_to_fp8_rollout(model: nn.Module, cfg: FP8Config) -> list[str]:
    """CPU/HF stand-in for vLLM's block W8A8 linears: EmulatedFP8Linear with vLLM's activation
    recipe on exactly the fp8_plan set. Feed weights with fp8.export.load_exported_into_hf."""
    plan = fp8_plan(model, cfg)
    converted = []
    for raw_name, mod in list(model.named_modules()):
        name = clean_name(raw_name)
        if isinstance(mod, nn.Linear) and not is_fp8_linear(mod) and plan.get(name, (False,))[0]:
            _replace(model, raw_name, EmulatedFP8Linear.from_linear(mod, "vllm"))
            converted.append(name)
    _log_summary("block-W8A8 (vLLM emulation)", plan)
    return converted


@contextlib.contextmanager
def bf16_reference(model: nn.Module):
    """Converted linears compute a plain high-precision F.linear inside (no quantization)."""
    mods = [m for m in model.modules() if is_fp8_linear(m)]
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
