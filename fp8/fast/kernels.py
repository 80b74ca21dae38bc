"""One Triton kernel of ours: an activation quantized into BOTH GEMM layouts in one pass (GPU only).

Every FP8 linear needs each activation twice: x as 1x128 groups for the forward GEMM and as
128x1 groups (along tokens) for the weight-gradient GEMM; grad_out as 1x128 groups for dgrad
and as 128x1 groups for wgrad. torchao 0.18 reads the BF16 tensor once per layout (its
act_quant_lhs, act_quant_rhs and act_quant_transposed_lhs kernels). `quant_dual` reads each
128x128 tile from memory once and writes both: the row-wise tile (torchao's lhs layout) and the
column-wise tile stored transposed (the rhs / transposed_lhs layout; the two are the same bytes),
either at once or in row slices whose second read hits the cache (the launch's `split`). The
FP8 bytes and scales are torchao's for every finite input (tests/gpu), with less arithmetic: the
scales in float32 (torchao divides in float64 and rounds: the same float32, as double rounding of a
quotient is innocuous with 53 >= 2 x 24 + 2 bits), no clamp before the conversion (sm_90's
cvt.rn.satfinite saturates at 448 as the clamp did; a NaN stays NaN, which torchao's clamp does not
keep), the tile widened to float32 once. With it the linear saves the FP8 128x1 copy of x for
backward instead of x in BF16: half the bytes.

The same kernel also makes its tile before quantizing it: for a SwiGLU MLP (fp8.fuse_swiglu),
down_proj's input h = silu(gate) * up from gate_up's output, and in backward the gradient of
[gate | up] from h's gradient, so neither is written to memory in BF16 and read back.

Imported lazily by fp8/fast/dual.py (Triton, CUDA).
"""

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fp8.quant import BLOCK, E4M3, FP8_MAX, TORCHAO_EPS


# (row splits, num_warps[, stages, programs per SM]): the launch configuration. The bytes written do
# not depend on it (each group's amax is an exact max); only the speed does. Two numbers: one program
# per 128x128 tile. Four: a persistent grid of programs per SM, each looping over tiles with the
# loads of the next `stages - 1` tiles in flight (Triton's software pipelining). FP8_GRPO_QUANT_DUAL
# ="split,warps[,stages,per_sm]" overrides it (bench/quant.py times the choices on the GPU it runs on).
# H100, one layer's 8 calls at 16k tokens (bench/results/quant_h100.json): (1, 8)
# 1.85 ms = 1.22x the copy floor (ncu: 117 registers per thread, two programs per SM, DRAM 60% of
# peak); (2, 4) 1.90 ms = 1.25x; the persistent grids 1.8-6x (quant_h100_persistent.json).
DEFAULT_CONFIG = (1, 8)


# The SwiGLU modes hold two or three input tiles per slice: their own default (bench/quant.py --swiglu;
# H100, 16k tokens, I = 14336: forward 0.88 ms, backward 2.17 ms, 179 registers, one program per SM).
DEFAULT_SWIGLU_CONFIG = (1, 8)


def _config_from_env(text: str | None, var: str = "FP8_GRPO_QUANT_DUAL",
                     default: tuple[int, ...] = DEFAULT_CONFIG) -> tuple[int, ...]:
    if not text:
        return default
    try:
        config = tuple(int(v) for v in text.split(","))
    except ValueError:
        config = ()
    if len(config) not in (2, 4):
        raise ValueError(f"{var}={text!r}: expected 'split,num_warps' or 'split,num_warps,stages,per_sm', "
                         "e.g. '2,8' or '1,8,2,1'")
    split, warps, stages, per_sm = _launch_params(config)
    if (split not in (1, 2, 4, 8) or warps not in (1, 2, 4, 8, 16, 32)
            or len(config) == 4 and not (1 <= stages <= 4 and 1 <= per_sm <= 16)):
        raise ValueError(f"{var}={text!r}: split must be 1, 2, 4 or 8, num_warps a power of 2 up to 32, "
                         "stages 1-4, per_sm 1-16")
    return config


def _launch_params(config: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(split, warps, stages, per_sm) of a two- or four-number launch; stages 0: one program per tile."""
    return (*config, 0, 0)[:4]


CONFIG = _config_from_env(os.environ.get("FP8_GRPO_QUANT_DUAL"))
SWIGLU_CONFIG = _config_from_env(os.environ.get("FP8_GRPO_SWIGLU_QUANT"), "FP8_GRPO_SWIGLU_QUANT",
                                 DEFAULT_SWIGLU_CONFIG)


@triton.jit
def _tile(x_ptr, gu_ptr, m, pid_k, K, MODE: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    # The BF16 tile [len(m), 128] at columns pid_k * 128 of the [M, K] tensor being quantized. MODE 0: x
    # itself. MODE 1: h = silu(gate) * up of gu = [gate | up] [M, 2K] (the MLP's down_proj input).
    # MODE 2: the gradient of gu [M, K = 2I] (HALF 0: gate's columns, 1: up's) from x = the gradient
    # of h [M, I]. In float32, rounded once to BF16, as inductor's fused SiLU*mul (forward and
    # backward) kernels do.
    c = pid_k * BLOCK + tl.arange(0, BLOCK)
    if MODE == 0:
        t = tl.load(x_ptr + m[:, None] * K + c[None, :])
    elif MODE == 1:
        row = gu_ptr + m[:, None] * (2 * K)
        g = tl.load(row + c[None, :]).to(tl.float32)
        u = tl.load(row + K + c[None, :]).to(tl.float32)
        t = (g * tl.sigmoid(g) * u).to(tl.bfloat16)
    else:
        inter = K // 2
        c = c - HALF * inter
        dh = tl.load(x_ptr + m[:, None] * inter + c[None, :]).to(tl.float32)
        g = tl.load(gu_ptr + m[:, None] * K + c[None, :]).to(tl.float32)
        s = tl.sigmoid(g)
        if HALF == 0:  # d/dgate = dh * up * silu'(gate)
            u = tl.load(gu_ptr + m[:, None] * K + inter + c[None, :]).to(tl.float32)
            t = (dh * u * (s * (1.0 + g * (1.0 - s)))).to(tl.bfloat16)
        else:  # d/dup = dh * silu(gate)
            t = (dh * (g * s)).to(tl.bfloat16)
    return t


@triton.jit
def _quant_dual_kernel(x_ptr, gu_ptr, x_out_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, MT, K,
                       BLOCK: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr, COLS: tl.constexpr,
                       STORE_X: tl.constexpr, STAGES: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr):
    # MT = M / 128 row tiles, not M: a compiled caller of dynamic length passes its size without Triton's
    # divisible-by-16 specialization, and then the [K, M] stores below (stride M) went out byte by byte
    # (64 STG.U8 instead of 4 STG.128 per thread and tile, scripts/kernel_regs.py); M = MT * 128 is
    # known to be a multiple of 128 whatever MT is.
    M = MT * BLOCK
    # The 128x128 tiles in row-major order, program p taking tiles p, p + P, ... of the P launched:
    # one per tile, or a few per SM whose loop Triton software-pipelines (STAGES > 1: the next tiles'
    # loads in flight while this one is quantized). MODE 2: each tile index covers the tiles at
    # columns pid_k * 128 of both halves, gate's then up's (both read the same grad_h and gate
    # tiles: the second reads hit the cache).
    if MODE == 2:
        nk = K // (2 * BLOCK)
    else:
        nk = K // BLOCK
    if STAGES == 0:  # one program per tile
        _quant_tiles(x_ptr, gu_ptr, x_out_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, M, K, tl.program_id(0), nk,
                     BLOCK, SPLIT, MODE, COLS, STORE_X, EPS, FP8_MAX)
    else:
        for t in tl.range(tl.program_id(0), MT * nk, tl.num_programs(0), num_stages=STAGES):
            _quant_tiles(x_ptr, gu_ptr, x_out_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, M, K, t, nk,
                         BLOCK, SPLIT, MODE, COLS, STORE_X, EPS, FP8_MAX)


@triton.jit
def _quant_tiles(x_ptr, gu_ptr, x_out_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, M, K, t, nk,
                 BLOCK: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr, COLS: tl.constexpr,
                 STORE_X: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr):
    pid_m = t // nk
    pid_k = t % nk
    _quant_tile(x_ptr, gu_ptr, x_out_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, M, K, pid_m, pid_k,
                BLOCK, SPLIT, MODE, 0, COLS, STORE_X, EPS, FP8_MAX)
    if MODE == 2:
        _quant_tile(x_ptr, gu_ptr, x_out_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, M, K, pid_m,
                    pid_k + nk, BLOCK, SPLIT, MODE, 1, COLS, STORE_X, EPS, FP8_MAX)


@triton.jit
def _quant_tile(x_ptr, gu_ptr, x_out_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, M, K, pid_m, pid_k,
                BLOCK: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr, COLS: tl.constexpr,
                STORE_X: tl.constexpr, EPS: tl.constexpr, FP8_MAX: tl.constexpr):
    # The tile at rows pid_m * 128, columns pid_k * 128 (of the tensor _tile makes). SPLIT = 1: made
    # once and quantized both ways. SPLIT > 1: visited in SPLIT row slices, each made twice (once for
    # its rows' 1x128 groups and the columns' running amax, once more for the 128x1 groups: the second
    # read hits the cache), so fewer values are live per thread. COLS = False: the 1x128 groups only.
    # STORE_X: also write the BF16 tile (tests).
    SUB: tl.constexpr = BLOCK // SPLIT
    k = pid_k * BLOCK + tl.arange(0, BLOCK)
    col_amax = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(SPLIT):
        m = pid_m * BLOCK + i * SUB + tl.arange(0, SUB)
        x = _tile(x_ptr, gu_ptr, m, pid_k, K, MODE, HALF, BLOCK)  # M, K multiples of 128: no masks
        if STORE_X:
            tl.store(x_out_ptr + m[:, None] * K + k[None, :], x)
        x = x.to(tl.float32)
        ax = tl.abs(x)
        # 1x128 groups (one per row of the tile), as torchao's act_quant_lhs
        amax = tl.clamp(tl.max(ax, axis=1), min=EPS, max=float("inf"))
        scale = tl.div_rn(FP8_MAX, amax)[:, None]
        y = (x * scale).to(q_row_ptr.dtype.element_ty)
        tl.store(q_row_ptr + m[:, None] * K + k[None, :], y)
        tl.store(s_row_ptr + pid_k * M + m[:, None], tl.div_rn(1.0, scale))  # [M, K/128] column-major
        if COLS:
            col_amax = tl.maximum(col_amax, tl.max(ax, axis=0))
    if COLS:
        # 128x1 groups (one per column), as act_quant_rhs / act_quant_transposed_lhs; stored as [K, M]
        amax = tl.clamp(col_amax, min=EPS, max=float("inf"))
        scale = tl.div_rn(FP8_MAX, amax)[None, :]
        for i in tl.static_range(SPLIT):
            m = pid_m * BLOCK + i * SUB + tl.arange(0, SUB)
            x = x if SPLIT == 1 else _tile(x_ptr, gu_ptr, m, pid_k, K, MODE, HALF, BLOCK).to(tl.float32)
            y = (x * scale).to(q_col_ptr.dtype.element_ty)
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
    _check(x, "x")
    return _launch(x, None, x.shape[1], mode=0, config=config)


# The SwiGLU MLP's activations quantized where they are made (fp8.fuse_swiglu): h = silu(gate) * up
# and the gradient of gu = [gate | up] are never written to memory in BF16.
@triton_op("fp8_grpo::swiglu_quant_dual", mutates_args={})
def swiglu_quant_dual(gu: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """gu = [gate | up] [M, 2I] BF16 -> h = silu(gate) * up [M, I] quantized as quant_dual(h)."""
    _check(gu, "gu", 2 * BLOCK, bf16=True)
    return _launch(None, gu, gu.shape[1] // 2, mode=1, config=SWIGLU_CONFIG)


@triton_op("fp8_grpo::swiglu_quant_lhs", mutates_args={})
def swiglu_quant_lhs(gu: Tensor) -> tuple[Tensor, Tensor]:
    """swiglu_quant_dual's 1x128 groups only (q, s): the forward GEMM's operand, no weight gradient."""
    _check(gu, "gu", 2 * BLOCK, bf16=True)
    return _launch(None, gu, gu.shape[1] // 2, mode=1, cols=False, config=SWIGLU_CONFIG)


@triton_op("fp8_grpo::swiglu_backward_quant_dual", mutates_args={})
def swiglu_backward_quant_dual(grad_h: Tensor, gu: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradient of gu = [gate | up] [M, 2I] from grad_h [M, I], the gradient of h = silu(gate) * up,
    quantized as quant_dual(grad_gu)."""
    _check(gu, "gu", 2 * BLOCK, bf16=True)
    _check(grad_h, "grad_h", shape=(gu.shape[0], gu.shape[1] // 2), bf16=True)
    return _launch(grad_h, gu, gu.shape[1], mode=2, config=SWIGLU_CONFIG)


def _check(x: Tensor, name: str, multiple: int = BLOCK, shape: tuple[int, int] | None = None,
           bf16: bool = False) -> None:
    m, k = x.shape
    if m % BLOCK or k % multiple or not x.is_contiguous() or (shape and tuple(x.shape) != shape) or (
            bf16 and x.dtype != torch.bfloat16):
        want = f"{list(shape)}" if shape else f"[M, K] with M a multiple of {BLOCK} and K of {multiple}"
        raise ValueError(f"{name}: needs a contiguous {'BF16 ' if bf16 else ''}{want}, got {tuple(x.shape)} "
                         f"{x.dtype} strides {x.stride()}")
    if x.numel() >= 2**31:  # the kernel's offsets are int32
        raise ValueError(f"{name}: {m} tokens x {k} features is >= 2^31 elements; use smaller micro-batches "
                         "(train.micro_batch_size)")


def _launch(x: Tensor | None, gu: Tensor | None, k: int, mode: int, cols: bool = True,
            config: tuple[int, ...] | None = None, x_out: Tensor | None = None) -> tuple[Tensor, ...]:
    """Run _quant_dual_kernel over an [M, k] output: (q, s, qt, st), or (q, s) without cols. x: what
    modes 0 and 2 read, gu: what modes 1 and 2 read (None where the mode reads none)."""
    src = x if x is not None else gu
    m = src.shape[0]
    split, warps, stages, per_sm = _launch_params(config or CONFIG)
    q = torch.empty(m, k, dtype=E4M3, device=src.device)
    s = torch.empty(k // BLOCK, m, dtype=torch.float32, device=src.device).t()
    qt = torch.empty(k, m, dtype=E4M3, device=src.device) if cols else q
    st = torch.empty(m // BLOCK, k, dtype=torch.float32, device=src.device) if cols else s
    tiles = m // BLOCK * k // BLOCK // (2 if mode == 2 else 1)
    programs = min(tiles, per_sm * _sm_count(src.device.index)) if stages else tiles
    # Each input once, a one-element stand-in in the pointer slots this mode never reads: a compiled
    # graph makes one copy of a tensor per argument it is passed in when a fused kernel produces it
    # (Inductor's user-kernel lowering), so x in all three slots had an RMSNorm write its output 3 times.
    unread = src.new_empty(1)
    wrap_triton(_quant_dual_kernel)[(programs,)](
        unread if x is None else x, unread if gu is None else gu, unread if x_out is None else x_out,
        q, s, qt, st, m // BLOCK, k, BLOCK=BLOCK, SPLIT=split, MODE=mode, COLS=cols,
        STORE_X=x_out is not None, STAGES=stages, EPS=TORCHAO_EPS, FP8_MAX=FP8_MAX, num_warps=warps)
    return (q, s, qt, st) if cols else (q, s)


@functools.cache
def _sm_count(device: int | None) -> int:
    return torch.cuda.get_device_properties(device or 0).multi_processor_count
