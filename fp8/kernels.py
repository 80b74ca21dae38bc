"""One Triton kernel of ours: an activation quantized into BOTH GEMM layouts in one pass (GPU only).

Every FP8 linear needs each activation twice: x as 1x128 groups for the forward GEMM and as
128x1 groups (along tokens) for the weight-gradient GEMM; grad_out as 1x128 groups for dgrad
and as 128x1 groups for wgrad. torchao 0.18 reads the BF16 tensor once per layout (its
act_quant_lhs, act_quant_rhs and act_quant_transposed_lhs kernels). `quant_dual` reads each
128x128 tile from memory once and writes both: the row-wise tile (torchao's lhs layout) and the
column-wise tile stored transposed (the rhs / transposed_lhs layout; the two are the same bytes);
by default in two 64-row slices whose second read hits the cache (fewer registers per thread). The
arithmetic is torchao's line for line, so the FP8 bytes and scales are the same (tests/gpu). With
it the linear saves the FP8 128x1 copy of x for backward instead of x in BF16: half the bytes.

Imported lazily by fp8/linear.py (Triton, CUDA).
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fp8.quant import E4M3, FP8_MAX, TORCHAO_EPS

BLOCK = 128  # fp8.linear.BLOCK (linear imports this module)


# (row splits, num_warps): the launch configuration. The bytes written do not depend on it (each
# group's amax is an exact max); only the speed does. FP8_GRPO_QUANT_DUAL="split,warps" overrides it
# (bench/quant.py times the choices on the GPU it runs on). H100, one layer's 8 calls at 16k tokens:
# (1, 8) 2.87 ms = 1.88x the copy floor (ncu: 252 registers per thread, one program per SM);
# (2, 4) 2.46 ms = 1.62x (bench/results/quant_h100.json).
DEFAULT_CONFIG = (2, 4)


def _config_from_env(text: str | None) -> tuple[int, int]:
    if not text:
        return DEFAULT_CONFIG
    try:
        split, warps = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"FP8_GRPO_QUANT_DUAL={text!r}: expected 'split,num_warps', e.g. '2,8'") from None
    if split not in (1, 2, 4, 8) or warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"FP8_GRPO_QUANT_DUAL={text!r}: split must be 1, 2, 4 or 8, num_warps a power of 2 up to 32")
    return split, warps


CONFIG = _config_from_env(os.environ.get("FP8_GRPO_QUANT_DUAL"))


@triton.jit
def _quant_dual_kernel(x_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, M, K, BLOCK: tl.constexpr,
                       SPLIT: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr):
    # One program: the 128x128 tile at rows pid_m * 128, columns pid_k * 128. SPLIT = 1: the tile is
    # loaded once and quantized both ways. SPLIT > 1: it is visited in SPLIT row slices, each loaded
    # twice (once for its rows' 1x128 groups and the columns' running amax, once more for the 128x1
    # groups: the second read hits the cache), so fewer values are live per thread.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    SUB: tl.constexpr = BLOCK // SPLIT
    k = pid_k * BLOCK + tl.arange(0, BLOCK)
    col_amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(SPLIT):
        m = pid_m * BLOCK + i * SUB + tl.arange(0, SUB)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :])  # M, K multiples of 128: no masks
        ax = tl.abs(x)
        # 1x128 groups (one per row of the tile), as torchao's act_quant_lhs
        amax = tl.clamp(tl.max(ax, axis=1), min=EPS, max=float("inf")).to(tl.float64)
        scale = (FP8_MAX / amax).to(tl.float32)[:, None]
        y = tl.clamp(x * scale, min=-FP8_MAX, max=FP8_MAX).to(q_row_ptr.dtype.element_ty)
        tl.store(q_row_ptr + m[:, None] * K + k[None, :], y)
        tl.store(s_row_ptr + pid_k * M + m[:, None], tl.div_rn(1.0, scale))  # [M, K/128] column-major
        col_amax = tl.maximum(col_amax, tl.max(ax, axis=0).to(tl.float32))
    # 128x1 groups (one per column), as act_quant_rhs / act_quant_transposed_lhs; stored as [K, M]
    amax = tl.clamp(col_amax, min=EPS, max=float("inf")).to(tl.float64)
    scale = (FP8_MAX / amax).to(tl.float32)[None, :]
    for i in tl.static_range(SPLIT):
        m = pid_m * BLOCK + i * SUB + tl.arange(0, SUB)
        x = x if SPLIT == 1 else tl.load(x_ptr + m[:, None] * K + k[None, :])
        y = tl.clamp(x * scale, min=-FP8_MAX, max=FP8_MAX).to(q_col_ptr.dtype.element_ty)
        tl.store(q_col_ptr + k[None, :] * M + m[:, None], y)
    tl.store(s_col_ptr + pid_m * K + k[None, :], tl.div_rn(1.0, scale))  # [M/128, K] row-major


@triton_op("fp8_grpo::quant_dual", mutates_args={})
def quant_dual(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [M, K] row-major (both multiples of 128) -> (q [M, K] row-major, s [M, K/128] column-major:
    1x128 groups; qt [K, M] row-major, st [M/128, K] row-major: 128x1 groups).

    As cuBLAS's block-scaled GEMM takes them: (q, s) is an A operand (torchao's lhs); for the
    weight gradient x gives B = (qt.t(), st.t()) (torchao's rhs) and grad_out gives
    A = (qt, st.t()) (torchao's transposed_lhs)."""
    return quant_dual_with(x, CONFIG)


def quant_dual_with(x: Tensor, config: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """quant_dual with an explicit launch configuration (split, num_warps)."""
    m, k = x.shape
    if m % BLOCK or k % BLOCK or not x.is_contiguous():
        raise ValueError(f"quant_dual needs a contiguous [M, K] with M, K multiples of {BLOCK}, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if m * k >= 2**31:  # the kernel's offsets are int32
        raise ValueError(f"quant_dual: {m} tokens x {k} features is >= 2^31 elements; use smaller micro-batches "
                         "(train.micro_batch_size)")
    split, warps = config
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = torch.empty(k // BLOCK, m, dtype=torch.float32, device=x.device).t()
    qt = torch.empty(k, m, dtype=E4M3, device=x.device)
    st = torch.empty(m // BLOCK, k, dtype=torch.float32, device=x.device)
    wrap_triton(_quant_dual_kernel)[(m // BLOCK, k // BLOCK)](x, q, s, qt, st, m, k, BLOCK=BLOCK, SPLIT=split,
                                                              EPS=TORCHAO_EPS, FP8_MAX=FP8_MAX, num_warps=warps)
    return q, s, qt, st
