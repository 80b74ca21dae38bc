"""fp8.fuse_projections: the FP8 linears of one vLLM fused group (q/k/v or gate/up) as ONE FP8 GEMM.

The members stay where they are (same module names, same Parameters): `subclass` gives each a class
that mixes FusedLinear into its own, as torch.nn.utils.parametrize does for parametrized modules,
and its forward goes through the group's FusedProjections.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from models import family_of


@functools.cache
def _mixed(mixin: type, cls: type) -> type:
    return type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})


def subclass(module: nn.Module, mixin: type) -> None:
    """Give `module` the class (mixin, type(module)): mixin's methods come first, the module's own via
    super(). Same object: names, parameters, hooks and wrappers are unchanged. Such a class is made
    on first use, so a module with one pickles by value only (deepcopy works)."""
    module.__class__ = _mixed(mixin, type(module))


def has_kernels(m: nn.Module) -> bool:
    """A linear whose GEMMs go through _BlockFP8MM's `kernels`: an FP8 linear, or the BF16 twin's (bf16.py)."""
    return isinstance(m, nn.Linear) and hasattr(m, "kernels")


class FusedLinear:
    """Mixin of a linear in a fused group (an FP8 linear, or the BF16 twin's): its forward is the group's GEMM
    (bf16_reference: the linear's own forward)."""

    group: FusedProjections

    def forward(self, x: Tensor) -> Tensor:
        return self.group(self, x) if getattr(self, "fp8_enabled", True) else super().forward(x)


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
            self._outs = member.mm(x, *(m.weight for m in self.members)).split(self.sizes, dim=-1)
            self._x, self._key, self._pending = x, key, set(range(len(self.members)))
        self._pending.discard(i)
        # A column slice is strided; measured on an H100 (4 Llama-8B layers, 16k tokens) eager silu/mul
        # on strided slices cost ~8 ms per step more than on dense ones; the copy ~2 ms. Compiled, the
        # copies were saved for backward besides the GEMM output: inductor reads the slices in place.
        out = self._outs[i] if torch.compiler.is_compiling() else self._outs[i].contiguous()
        if not self._pending:  # every member served: drop the references
            self._x, self._outs = None, ()
        return out


def fuse_projections(model: nn.Module) -> int:
    """Link each parent's FP8 linears (or the BF16 twin's: has_kernels) of one fused group of the model's
    family (models/: q/k/v and gate/up) into a FusedProjections; returns the count.

    A group is linked only if all its members are such linears of one class with the same input
    size, weight dtype and device (fp8_plan already makes a group all-FP8 or all-BF16)."""
    n, groups = 0, family_of(model).fused_groups
    for parent in model.modules():
        for leaves in groups:
            members = [getattr(parent, leaf, None) for leaf in leaves]
            if not all(has_kernels(m) and not isinstance(m, FusedLinear) for m in members):
                continue
            if len({type(m) for m in members}) > 1:
                continue
            if len({(m.in_features, m.weight.dtype, m.weight.device) for m in members}) > 1:
                continue
            group = FusedProjections(members)
            for m in members:
                subclass(m, FusedLinear)
                m.group = group
            n += 1
    return n
