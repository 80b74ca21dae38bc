"""THE block-wise FP8 (E4M3) quantizer of this repo: pure torch, any device, bit-exact.

Every FP8 weight the trainer multiplies with and every FP8 weight the rollout engine receives
comes out of `quantize_blockwise`, so trainer and engine use the same bytes (tests pin this).

Recipes (bitwise matters, so the exact arithmetic is part of the contract):

* "torchao" (default; weights always; trainer activations). Exactly what torchao 0.18's
  blockwise_fp8_training kernels compute (`torch_blockwise_scale_weight_quant`,
  `torch_blockwise_scale_act_quant_lhs/_rhs` and their Triton twins in fast/kernels.py):
      amax  = max|x| over the group, clamped at 1e-12 in float64
      s     = float32(448 / amax)                 # multiplier, computed in float64
      q     = e4m3(clamp(float32(x) * s, -448, 448))   # MULTIPLY, round-to-nearest-even
      scale_inv = float32(1 / s)                  # what the GEMM multiplies back, stored
  Note scale_inv is 1/fp32(448/amax), which differs from fp32(amax/448) in the last ulp for
  ~24% of blocks; we ship torchao's value because that is what the trainer's GEMM uses.

* "vllm" (activations only: what the rollout engine does to its GEMM inputs). vLLM 0.26's CUDA
  `per_token_group_fp8_quant` (csrc/quantization/w8a8/fp8/per_token_group_quant.cu, the path
  taken on GPU for contiguous inputs):
      amax  = max(max|x|, 1e-10) in float32
      scale = float32(amax / 448)                 # IEEE division
      q     = e4m3(clamp(float32(x) / scale, -448, 448))   # DIVIDE
  vLLM's torch-native `QuantFP8._quantize_group_native` is identical except it clamps the scale
  (not amax) at 1/(448*512), i.e. differs only for groups with amax < 1/512; its Triton fallback
  multiplies amax by fp32(1/448) instead of dividing (differs in the last ulp).

The two recipes give different FP8 bytes for ~3e-4 of elements (values that land on an E4M3
rounding boundary) and different scales for ~24% of groups. That trainer/engine activation
difference is inherent (different kernels); weights are shared, so it is the only one.

Division/multiplication are done in float64 and rounded once to float32: for +,-,*,/ a float64
intermediate then a float32 rounding equals the correctly rounded float32 result (53 >= 2*24+2),
which makes the result independent of how a backend implements fp32 division (CUDA turns
`tensor / python_scalar` into a multiply by the reciprocal). Inputs must be finite.

Shapes: weights [N, K] -> q [N, K] e4m3, scale_inv [ceil(N/B), ceil(K/B)] float32; edge blocks
are padded with zeros, which never win the amax, so they use their real values only.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 128  # the block edge: weights in BLOCK x BLOCK blocks, activations in 1 x BLOCK tiles
E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
TORCHAO_EPS = 1e-12  # torchao kernels.EPS, applied to amax in float64
VLLM_EPS = 1e-10  # vLLM per_token_group_quant_fp8 default eps, applied to amax in float32
RECIPES = ("torchao", "vllm")


def _quant_groups(x: Tensor, amax: Tensor, recipe: str) -> tuple[Tensor, Tensor]:
    """q = e4m3(x scaled), scale (what dequantization multiplies by); amax broadcasts against x."""
    if recipe == "torchao":
        s = (FP8_MAX / amax.double().clamp(min=TORCHAO_EPS)).float()  # fp32 multiplier
        y = x.float() * s  # fp32 multiply: IEEE-exact on every backend
        scale = s.double().reciprocal().float()
    elif recipe == "vllm":
        scale = (amax.float().clamp(min=VLLM_EPS).double() / FP8_MAX).float()
        y = (x.double() / scale.double()).float()  # == fp32(x) / scale, correctly rounded
    else:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    return y.clamp(-FP8_MAX, FP8_MAX).to(E4M3), scale


def _pad2d(x: Tensor, rows: int, cols: int) -> Tensor:
    pr, pc = rows - x.shape[0], cols - x.shape[1]
    return F.pad(x, (0, pc, 0, pr)) if pr or pc else x


def quantize_blockwise(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Weight [N, K] -> (q e4m3 [N, K], scale_inv float32 [ceil(N/block), ceil(K/block)]).

    torchao recipe (see module doc); w ~= q.float() * scale_inv (block-broadcast).
    """
    assert w.dim() == 2, f"expected a 2-D weight, got {tuple(w.shape)}"
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    blocks = _pad2d(w.detach(), nb * block, kb * block).view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)  # [nb, 1, kb, 1], exact in w.dtype
    q, scale_inv = _quant_groups(blocks, amax, "torchao")
    q = q.view(nb * block, kb * block)[:n, :k].contiguous()
    return q, scale_inv.view(nb, kb)


def dequantize_blockwise(q: Tensor, scale_inv: Tensor, block: int = BLOCK,
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """(q [N, K], scale_inv [ceil(N/block), ceil(K/block)]) -> q * scale_inv in `dtype` [N, K].

    The product is formed in float32 (exact for an e4m3 value times a float32 scale up to one
    rounding), then cast to `dtype`.
    """
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (q.float() * s).to(dtype)


def quantize_act_1x128(x: Tensor, recipe: str = "torchao", block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Per-token groups of `block` along the last dim.

    x [..., K] -> (q e4m3 [..., K], scale float32 [..., ceil(K/block)]); x ~= q * scale.
    recipe "torchao" = trainer (torch_blockwise_scale_act_quant_lhs), "vllm" = rollout engine.
    """
    k = x.shape[-1]
    g = math.ceil(k / block)
    xp = F.pad(x.detach(), (0, g * block - k)) if g * block != k else x.detach()
    groups = xp.reshape(*x.shape[:-1], g, block)  # [..., G, block]
    q, scale = _quant_groups(groups, groups.abs().amax(dim=-1, keepdim=True), recipe)
    q = q.reshape(*x.shape[:-1], g * block)[..., :k].contiguous()
    return q, scale.squeeze(-1)


def dequantize_act_1x128(q: Tensor, scale: Tensor, block: int = BLOCK,
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of quantize_act_1x128: q [..., K], scale [..., G] -> [..., K] in `dtype`."""
    k = q.shape[-1]
    s = scale.float().repeat_interleave(block, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


def quantize_act_128x1(x: Tensor, recipe: str = "torchao", block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Column groups: x [M, K] -> (q e4m3 [M, K], scale float32 [ceil(M/block), K]).

    Groups of `block` consecutive rows per column, i.e. along the contracting dim of the
    weight-gradient GEMM (torchao's torch_blockwise_scale_act_quant_rhs / act_quant_transposed_lhs).
    """
    q_t, s_t = quantize_act_1x128(x.t(), recipe, block)  # [K, M], [K, ceil(M/block)]
    return q_t.t().contiguous(), s_t.t().contiguous()


def dequantize_act_128x1(q: Tensor, scale: Tensor, block: int = BLOCK,
                         dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of quantize_act_128x1: q [M, K], scale [ceil(M/block), K] -> [M, K]."""
    return dequantize_act_1x128(q.t(), scale.t(), block, dtype).t()


def fake_quant_weight(w: Tensor, block: int = BLOCK) -> Tensor:
    """dequantize(quantize(w)) in float32 [N, K]: the weight the FP8 GEMM effectively uses."""
    return dequantize_blockwise(*quantize_blockwise(w, block), block)


def fake_quant_act_1x128(x: Tensor, recipe: str = "torchao", block: int = BLOCK) -> Tensor:
    """dequantize(quantize(x)) in float32, 1x128 groups along the last dim."""
    return dequantize_act_1x128(*quantize_act_1x128(x, recipe, block), block)


def fake_quant_act_128x1(x: Tensor, recipe: str = "torchao", block: int = BLOCK) -> Tensor:
    """dequantize(quantize(x)) in float32, 128x1 groups along dim 0 of a 2-D x."""
    return dequantize_act_128x1(*quantize_act_128x1(x, recipe, block), block)


def fake_quant_per_tensor(x: Tensor, scale: float, reciprocal: bool = False) -> Tensor:
    """Static per-tensor FP8 as vLLM's KV cache / FP8 attention does it, back in x.dtype.

    q = e4m3(clamp(x / scale, -448, 448)) (reshape_and_cache's scaled_convert: divide), or with
    reciprocal=True x * fp32(1/scale) (QuantFP8 static per-tensor, used for the query);
    returns q * scale. Any shape.
    """
    s32 = torch.tensor(scale, dtype=torch.float32, device=x.device)
    if reciprocal:
        y = x.float() * s32.double().reciprocal().float()
    else:
        y = (x.double() / s32.double()).float()
    return (y.clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() * s32).to(x.dtype)
