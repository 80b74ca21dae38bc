"""fp8.cache_weights over FSDP2 ranks: FSDP2 all-gathers each FP8 linear's weight as block-FP8 bytes and
scales, which every rank quantized from its own shard once per optimizer step.

On one GPU the weight cache (cache.py) keeps each GEMM's quantized weight between optimizer steps. Over
FSDP2 ranks no rank holds a whole weight: FSDP2 all-gathers it (in bf16) before every forward, recompute
and backward of every micro-batch, and the FP8 GEMM then quantized the gathered weight each time. Here
FSDP2's all-gather extension (torch 2.11, `fsdp_pre_all_gather` / `fsdp_post_all_gather` on the sharded
tensor, as torchao's float8 weights use it) does it the other way round:

* `ShardedFP8Weight` wraps a linear's master weight before fully_shard; each rank's shard stays one.
  Before an all-gather it quantizes the shard (128x128 blocks; kept until the shard changes: the
  optimizer step) and hands FSDP2 the FP8 bytes and fp32 block scales: 1 byte + 1/4096 scale per
  element on the wire instead of 2.
* After the all-gather the module's weight is a `GatheredFP8Weight` (outer shape and dtype of the
  weight, inner FP8 bytes [N, K] and block scales [N/128, K/128]), and `GatheredKernels` build the
  forward and dgrad operands from it: no quantization and no concatenation per micro-batch.

Same numbers as without it: a 128x128 block never spans two shards (a weight is wrapped only if its
rows split into whole blocks per rank, `can_gather`), so each block's amax and bytes are those the
GEMM would compute from the gathered weight; the shard is quantized from its bf16 cast (FSDP2's
param_dtype), as FSDP2 would have gathered it. Gradients are unchanged (bf16, reduce-scattered in fp32).
A linear that cannot be split so (e.g. a tiny model's narrow k/v) stays as before; a fused group
(fused.py) gathers FP8 only when all its members can.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from fp8.fast.cache import KernelsWrapper
from fp8.fast.fused import FusedLinear
from fp8.linear import cat_weights, is_fp8_linear
from fp8.quant import BLOCK, dequantize_blockwise, quantize_blockwise
from fp8.torchao import TorchaoKernels

aten = torch.ops.aten
# ops through which a shard stays a ShardedFP8Weight: those FSDP2 uses to shard, pad and copy it,
# and to_(device); everything else (the optimizer's arithmetic, collectives) sees the plain tensor
_KEEP = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
         aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
         aten.clone.default, aten.detach.default}


def _quantize(w: Tensor, torchao: bool) -> tuple[Tensor, Tensor]:
    """(FP8 bytes [n, K] row-major, fp32 block scales [n/128, K/128] row-major) of a weight shard, the
    bytes the GEMM's own weight quantizer writes."""
    if torchao:  # weight_transposed_rhs writes W^T column-major: W row-major, read through .t()
        from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_weight_quant_transposed_rhs

        q, s = triton_fp8_blockwise_weight_quant_transposed_rhs(w.contiguous(), block_size=BLOCK)
        return q.t(), s.t()
    return quantize_blockwise(w)


class ShardedFP8Weight(torch.Tensor):
    """An FP8 linear's master weight (its FSDP2 shard once sharded) that FSDP2 all-gathers as block-FP8
    bytes and scales. Any op but those in _KEEP runs on the wrapped tensor and returns plain tensors."""

    @staticmethod
    def __new__(cls, tensor: Tensor, torchao: bool):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   layout=tensor.layout, device=tensor.device,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor, torchao: bool):
        self._tensor, self._torchao = tensor, torchao
        self._fp8: tuple[tuple, tuple[Tensor, Tensor]] | None = None  # (shard version key, (bytes, scales))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mine = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls)]
        if func._schema.is_mutable:  # the optimizer's step, a load: the shard changes, its FP8 bytes go stale
            for a in mine:  # (the wrapped tensor's own version counter does not count ops made through here)
                a._fp8 = None
        torchao = mine[0]._torchao
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        return pytree.tree_map_only(Tensor, lambda t: cls(t, torchao), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._torchao

    @staticmethod
    def __tensor_unflatten__(inner, torchao, outer_size, outer_stride):
        return ShardedFP8Weight(inner["_tensor"], torchao)

    def __repr__(self):
        return f"ShardedFP8Weight({self._tensor!r})"

    def plain(self) -> Tensor:
        """The wrapped tensor (same storage): what checkpoints save and load into (distributed.sharded_state)."""
        return self._tensor

    @torch.no_grad()
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        key = (self._tensor._version, self._tensor.data_ptr())
        if self._fp8 is None or self._fp8[0] != key:
            w = self._tensor if mp_policy.param_dtype is None else self._tensor.to(mp_policy.param_dtype)
            self._fp8 = key, _quantize(w, self._torchao)
        return self._fp8[1], None

    def fsdp_post_all_gather(self, outputs: tuple[Tensor, ...], metadata, param_dtype: torch.dtype, *,
                             out: Tensor | None = None):
        if out is not None:  # FSDP2 refilled the buffers `out` already holds
            return
        data, scale = outputs
        return GatheredFP8Weight(data, scale, param_dtype or self.dtype), (data, scale)


class GatheredFP8Weight(torch.Tensor):
    """An all-gathered FP8 weight: the weight's shape and dtype outside, its FP8 bytes [N, K] and fp32
    block scales [N/128, K/128] inside. Only the FP8 GEMM reads it (GatheredKernels); any other op would
    need the high-precision weight, which no rank holds, and is refused."""

    @staticmethod
    def __new__(cls, data: Tensor, scale: Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: Tensor, scale: Tensor, dtype: torch.dtype):
        self._data, self._scale = data, scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (aten.detach.default, aten.alias.default, aten.as_strided.default):
            (w, *rest) = args  # FSDP2's as_strided to the weight's own size and stride; nn.Parameter's detach
            if func is not aten.as_strided.default or (tuple(rest[0]) == tuple(w.shape)
                                                       and tuple(rest[1]) == w.stride()):
                return cls(w._data, w._scale, w.dtype)
        raise NotImplementedError(f"{func}: a weight all-gathered in FP8 (fp8.cache_weights over FSDP2 ranks) "
                                  "serves only its FP8 GEMM; set fp8.cache_weights=false for this use")

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return GatheredFP8Weight(inner["_data"], inner["_scale"], dtype)

    def __repr__(self):
        return f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype})"


class GatheredKernels(KernelsWrapper):
    """Kernels of one FP8 GEMM whose weights FSDP2 all-gathers in FP8: the weight operands come from the
    gathered bytes and scales (a fused group's concatenated along the output dim); the rest is the
    wrapped kernels'."""

    def __init__(self, kernels):
        super().__init__(kernels)
        self.torchao = isinstance(kernels, TorchaoKernels)

    @staticmethod
    def _cat(weights: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        return cat_weights(tuple(w._data for w in weights)), cat_weights(tuple(w._scale for w in weights))

    def weight_fwd(self, weights: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        data, scale = self._cat(weights)
        if self.torchao:  # weight_transposed_rhs's layout: W^T [K, N] column-major, scales likewise
            return data.t(), scale.t()
        return (dequantize_blockwise(data, scale),)

    def weight_dgrad(self, weights: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if not self.torchao:
            return self.weight_fwd(weights)
        data, scale = self._cat(weights)  # weight_rhs's layout: W [N, K] column-major, scales likewise
        return data.t().contiguous().t(), scale.t().contiguous().t()


def can_gather(weight: Tensor, world: int) -> bool:
    """FSDP2 splits dim 0 into `world` equal shards of whole 128-row blocks (and K into whole blocks)."""
    n, k = weight.shape
    return n % (BLOCK * world) == 0 and k % BLOCK == 0


def gather_fp8_weights(model: nn.Module, world: int) -> int:
    """Before fully_shard: each FP8 GEMM of `model` whose weights can_gather gets them wrapped in
    ShardedFP8Weight and its kernels in GatheredKernels (a fused group's members together). Returns the
    GEMMs done."""
    n, seen = 0, set()
    for m in model.modules():
        if not is_fp8_linear(m) or id(m) in seen or isinstance(m.kernels, GatheredKernels):
            continue
        members = m.group.members if isinstance(m, FusedLinear) else [m]  # (kernels objects may be shared)
        seen.update(id(x) for x in members)
        if not all(can_gather(x.weight, world) for x in members):
            continue
        kernels = GatheredKernels(m.kernels)
        torchao = kernels.torchao
        for x in members:
            x.weight = nn.Parameter(ShardedFP8Weight(x.weight.data, torchao), requires_grad=x.weight.requires_grad)
            x.kernels = kernels
        n += 1
    return n


def release_fp8_shards(model: nn.Module) -> None:
    """Drop every shard's kept FP8 bytes (1 byte per parameter / world) while the engine's KV cache needs
    the memory; the next all-gather quantizes the shard again."""
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        if isinstance(local, ShardedFP8Weight):
            local._fp8 = None
