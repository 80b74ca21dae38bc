"""Block-FP8 mixture-of-experts GEMMs for the trainer (and the CPU engine's stand-in for vLLM's FusedMoE).

An HF MoE layer keeps its experts as 3-D parameters (models/<family>.py `experts`, `expert_weights`):
gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I]. Expert e
computes, for the tokens routed to it, y = w * down[e] @ (silu(x gate[e]^T) * (x up[e]^T)), w the
router's weight; a token's output sums its top-k experts'.

FP8 recipe (the trainer: torchao 0.18's grouped block-FP8 GEMM, blockwise_fp8/grouped_mm.py
`_Float8BlockwiseGroupedMM` with grouped_mm_backend.py's emulated backend, the one AUTO picks when DeepGEMM is
not installed). Quantizers and axes are the dense linears' (fp8/linear.py): each expert's weight [N, K] in
128x128 blocks (forward and dgrad: grouped_kernels.triton_fp8_blockwise_weight_quant_grouped_(transposed_)rhs,
the dense kernels run per expert, so blocks never straddle two experts), its tokens' x and grad_out in 1x128
groups (kernels.triton_fp8_blockwise_act_quant_lhs), and for wgrad grad_out^T and x in 128x1 groups along the
expert's own tokens (act_quant_transposed_lhs / act_quant_rhs): pad_token_groups starts every expert at a
multiple of 128 rows and pads with zeros, which change no amax and add nothing. The scale math is
fp8/quant.py's torchao recipe (amax clamped at 1e-12, s = fp32(448/amax), q = e4m3(x s), scale_inv = 1/s).

Where the experts differ from the dense linears: the GEMM. Dense torchao multiplies FP8 operands in cuBLAS
(scales applied to fp32 partial sums; our dense emulation: fp32-dequantized operands, one fp32 GEMM). torchao's
grouped GEMM instead dequantizes each operand in BF16 (grouped_kernels._emulated_blockwise_scaled_grouped_mm_impl:
bf16(q) * bf16(scale_inv), i.e. the scale rounded to bf16 and the product rounded to bf16, each up to 2^-9
relative) and runs torch._grouped_mm on those bf16 operands (fp32 sums, bf16 out). Everything around it is bf16
too: x is cast to bf16, the output and grad_x are bf16, and the weight gradient is bf16 before it reaches an
fp32 master weight. Emulating the experts with the dense recipe put the two backends 2e-2 apart (relative, a
Qwen3-MoE layer's output), because the ~1e-3 operand differences flip FP8 roundings of the next GEMM's input.

Backends:

* torchao (SM90): `_to_fp8_blockwise_then_scaled_grouped_mm`, one call per projection for all experts, on
  torchao's emulated grouped backend (above).
* deep_gemm (SM90, fp8.deep_gemm): the same call on torchao's DeepGEMM backend (m-grouped FP8 GEMMs for forward
  and dgrad, k-grouped for wgrad, fp32 scales), whose numerics the emulation does not follow. torchao looks for
  a top-level `deep_gemm`; vLLM 0.26 vendors DeepGEMM as vllm.third_party.deep_gemm, which `import_deep_gemm`
  makes importable under that name.
* emulated (CPU, non-SM90, fp8.emulate), act_recipe 'torchao' (the trainer): _TorchaoGroupedMM, the grouped
  recipe above in torch ops: the same bf16 operands bit for bit, multiplied in fp32 and rounded once to bf16;
  only the fp32 summation order differs from torch._grouped_mm (tests/unit/test_moe.py runs torchao's own grouped
  GEMM on the CPU against it).
* emulated, act_recipe 'vllm' (the CPU engine's stand-in for vLLM's fused MoE): each expert's tokens through
  fp8/linear.py's _BlockFP8MM with EmulatedKernels: fp32-dequantized operands and one fp32 GEMM.

What stays out: the router (BF16, fp8/plan.py), the top-k, the SiLU * up and the weighted sum.
`convert_experts` is called by fp8/convert.py's convert_planned for convert_to_fp8_training (act_recipe
'torchao') and engines/hf.py's convert_to_fp8_rollout (act_recipe 'vllm': vLLM's block-FP8 fused MoE quantizes its
GEMM inputs with the divide recipe); the engine pins the exact exported FP8 bytes (load_fp8_expert).
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from errors import UserError
from fp8.linear import EmulatedKernels, block_fp8_mm, use_torchao
from fp8.plan import clean_name
from fp8.quant import BLOCK, dequantize_blockwise, quantize_act_1x128, quantize_act_128x1, quantize_blockwise
from models import family_of

if TYPE_CHECKING:
    from config import FP8Config


def expert_names(model: nn.Module) -> dict[str, tuple[str, str, int, slice]]:
    """Per-expert checkpoint linears of `model` (the names vLLM's FusedMoE loader takes):
    {'model.layers.0.mlp.experts.3.gate_proj': ('model.layers.0.mlp.experts', 'gate_up_proj', 3, rows)},
    rows the linear's slice of dim 1 of the 3-D parameter. {} for a dense model."""
    spec = family_of(model)
    if spec.experts is None:
        return {}
    out = {}
    for name, mod in model.named_modules():
        name = clean_name(name)
        if not name.endswith("." + spec.experts):
            continue
        for param, linears in spec.expert_weights:
            w = getattr(mod, param)
            n = w.shape[1] // len(linears)
            for e in range(w.shape[0]):
                for j, linear in enumerate(linears):
                    out[f"{name}.{e}.{linear}"] = (name, param, e, slice(j * n, (j + 1) * n))
    return out


def _grouped_emulated(x: Tensor, w: Tensor, counts: list[int], kernels) -> Tensor:
    """x [M, K] rows grouped by expert (counts[e] rows each), w [E, N, K] -> [M, N]: each group
    times its expert's weight with fp8/linear.py's block-FP8 GEMM (`kernels`)."""
    parts, lo = [], 0
    for e, c in enumerate(counts):
        if c:
            parts.append(block_fp8_mm(x[lo:lo + c], kernels, w[e]))
        lo += c
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])


def _grouped_reference(x: Tensor, w: Tensor, counts: list[int], kernels=None) -> Tensor:
    """As _grouped_emulated in plain high precision (bf16_reference, or FP8 off)."""
    parts, lo = [], 0
    for e, c in enumerate(counts):
        if c:
            parts.append(F.linear(x[lo:lo + c], w[e]))
        lo += c
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])


# ------------------------------------------------------------------ torchao's grouped recipe, emulated

_BF16 = torch.bfloat16


@torch.library.custom_op("fp8_grpo::torchao_grouped_operand", mutates_args=())
def _torchao_operand(x: Tensor, groups: str, counts: list[int]) -> Tensor:
    """One operand of torchao's emulated grouped GEMM, bf16, x's shape: FP8-quantize (fp8/quant.py's torchao
    recipe: the math of torchao's Triton quantizers, bit for bit, tests/unit/test_fp8_quant.py and tests/gpu), then
    dequantize as grouped_kernels._emulated_blockwise_scaled_grouped_mm_impl does: bf16(q) * bf16(scale_inv),
    a bf16 multiply (the exact fp32 product rounded once to bf16).

    groups '1x128': x [M, K], per row (forward x, dgrad grad_out); '128x1': x [M, K] rows grouped by expert
    (counts), 128-row groups per column starting at each expert's first row (wgrad: torchao pads every expert's
    rows to a multiple of 128 with zeros, which change no amax); '128x128': x [E, N, K], per expert weight.
    An opaque op, as torchao's kernels are (fp8/linear.py's _fake_quant_op says why)."""
    assert x.shape[-1] % BLOCK == 0, f"K={x.shape[-1]} must be a multiple of {BLOCK} (torchao's grouped GEMM)"
    if groups == "1x128":
        q, s = quantize_act_1x128(x)
        s = s.repeat_interleave(BLOCK, -1)
    elif groups == "128x1":
        parts = [quantize_act_128x1(xe) for xe in x.split(counts) if len(xe)]
        if not parts:
            return x.new_zeros(x.shape, dtype=_BF16)
        q = torch.cat([p[0] for p in parts])
        s = torch.cat([p[1].repeat_interleave(BLOCK, 0)[:len(p[0])] for p in parts])
    else:  # one expert at a time: the expanded scales of all experts at once would be 2x the weight in fp32
        return torch.stack([_dequant_bf16(*_expanded(quantize_blockwise(we))) for we in x])
    return _dequant_bf16(q, s)


def _expanded(qs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    q, s = qs  # a weight's q [N, K] and its 128x128 scales
    return q, s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)


def _dequant_bf16(q: Tensor, scale_inv: Tensor) -> Tensor:
    """torchao's bf16 dequantization, scale_inv expanded to q's shape: both cast to bf16, multiplied in bf16."""
    return q.to(_BF16) * scale_inv.to(_BF16)


@_torchao_operand.register_fake
def _(x: Tensor, groups: str, counts: list[int]) -> Tensor:
    return x.new_empty(x.shape, dtype=_BF16)


def _rows_times(a: Tensor, b: Tensor, counts: list[int]) -> Tensor:
    """a [M, K] rows grouped by expert, b [E, N, K] -> [M, N] bf16: each group times its expert's b[e].T, the
    bf16 operands' exact products summed in fp32 and rounded once to bf16, as torch._grouped_mm does. An fp32
    GEMM of bf16 values: TF32 cannot change it (a bf16 value is a TF32 value), and no bf16 GEMM's
    reduced-precision reductions (cuBLAS's split-K) can enter."""
    parts = [ae.float() @ b[e].float().t() for e, ae in enumerate(a.split(counts)) if len(ae)]
    return torch.cat(parts).to(_BF16) if parts else a.new_zeros(0, b.shape[1], dtype=_BF16)


def _torchao_fwd(x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
    return _rows_times(_torchao_operand(x, "1x128", counts), _torchao_operand(w, "128x128", counts), counts)


class _TorchaoGroupedMM(torch.autograd.Function):
    """torchao 0.18's _Float8BlockwiseGroupedMM (blockwise_fp8/grouped_mm.py) with its emulated backend
    (grouped_mm_backend._EmulatedGroupedMMBackend), in torch ops, any device.

    x [M, K] bf16 (rows grouped by expert, counts[e] rows each), w [E, N, K] (bf16 or fp32) -> [M, N] bf16.
    forward: q1x128(x) @ q128x128(w[e]).T; dgrad: q1x128(g) @ q128x128(w[e]); wgrad: q128x1(g_e).T @ q128x1(x_e)
    per expert e (zero for an expert without tokens), rounded to bf16 like every output of the GEMM."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
        ctx.counts = counts
        ctx.save_for_backward(x, w)
        return _torchao_fwd(x, w, counts)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w = ctx.saved_tensors
        counts, g = ctx.counts, g.to(_BF16).contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # the weight quantized again, from the saved parameter, as torchao does
            grad_x = _rows_times(_torchao_operand(g, "1x128", counts),
                                 _torchao_operand(w, "128x128", counts).transpose(-2, -1), counts)
        if ctx.needs_input_grad[1]:
            gq, xq = _torchao_operand(g, "128x1", counts), _torchao_operand(x, "128x1", counts)
            grad_w = torch.zeros(w.shape, dtype=_BF16, device=w.device)
            for e, (ge, xe) in enumerate(zip(gq.split(counts), xq.split(counts))):
                if len(ge):
                    grad_w[e] = (ge.float().t() @ xe.float()).to(_BF16)
            grad_w = grad_w.to(w.dtype)  # what autograd makes of torchao's bf16 grad_B for an fp32 weight
        return grad_x, grad_w, None


def _grouped_torchao_emulated(x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
    """_grouped_torchao's numerics in torch ops (torchao's emulated grouped backend): x [M, K] -> [M, N] bf16."""
    x = x.to(_BF16).contiguous()
    counts = list(counts)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _TorchaoGroupedMM.apply(x, w, counts)
    return _torchao_fwd(x, w, counts)


@functools.cache
def _torchao_grouped_mm():
    from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import _to_fp8_blockwise_then_scaled_grouped_mm

    return _to_fp8_blockwise_then_scaled_grouped_mm


def require_deep_gemm(setting: str, way_out: str) -> None:
    """import_deep_gemm, or the UserError naming the setting that asked for DeepGEMM and the way out."""
    if not import_deep_gemm():
        raise UserError(f"{setting}: neither deep_gemm nor vllm.third_party.deep_gemm imports; install DeepGEMM, "
                        f"or set {way_out}")


@functools.cache
def import_deep_gemm() -> str:
    """Make DeepGEMM importable as `deep_gemm`, as torchao imports it: the installed package, else vLLM's
    vendored copy registered under that name (before torchao's first grouped call, which caches the import).
    Returns where it came from ('deep_gemm', 'vllm.third_party.deep_gemm'), or '' when neither imports."""
    for source in ("deep_gemm", "vllm.third_party.deep_gemm"):
        try:
            module = importlib.import_module(source)
        except (ImportError, OSError):
            continue
        sys.modules.setdefault("deep_gemm", module)
        return source
    return ""


def _grouped_torchao(x: Tensor, w: Tensor, counts: list[int], deep_gemm: bool = False) -> Tensor:
    """torchao 0.18's block-FP8 grouped GEMM: x [M, K] (bf16, rows grouped by expert), w [E, N, K]
    -> [M, N] bf16. torchao takes B_t [E, K, N] per-expert column-major: w.transpose(-2, -1) is
    exactly that view; offs are the groups' int32 end offsets; groups padded to 128 rows inside.
    deep_gemm: its AUTO backend (DeepGEMM where it applies), else the emulated one."""
    from torchao.quantization.quantize_.common import KernelPreference

    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    return _torchao_grouped_mm()(x.to(torch.bfloat16).contiguous(), w.transpose(-2, -1), offs,
                                 out_dtype=torch.bfloat16,
                                 kernel_preference=KernelPreference.AUTO if deep_gemm else KernelPreference.EMULATED)


class BlockFP8Experts(nn.Module):
    """An HF experts module (3-D gate_up_proj [E, 2I, H], down_proj [E, H, I], act_fn; forward(x [N, H],
    top_k_index [N, k], top_k_weights [N, k]) -> [N, H]) whose expert GEMMs are block FP8.

    Holds the replaced module's Parameter objects under the same names (checkpoints, optimizer and
    export unchanged). backend: 'emulated', 'torchao' or 'deep_gemm' (module doc); act_recipe: 'torchao'
    (trainer: torchao's grouped recipe on any backend, the expert GEMMs in bf16 whatever the model's dtype)
    or 'vllm' (the CPU engine's emulation of vLLM's fused MoE, in the model's dtype)."""

    fp8_enabled = True  # False inside fp8.linear.bf16_reference()

    def __init__(self, experts: nn.Module, backend: str = "emulated", act_recipe: str = "torchao"):
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.gate_up_proj, self.down_proj, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn
        self.backend, self.act_recipe = backend, act_recipe
        self.kernels = EmulatedKernels(act_recipe)  # the 'vllm' recipe's GEMMs (_grouped_emulated)
        self._pinned: dict[str, tuple[Tensor, int, int]] = {}  # param -> (dequantized FP8 [E, N, K], version, ptr)
        self.train(experts.training)

    def _weight(self, param: str) -> tuple[Tensor, bool]:
        """(weight, pinned): the engine's exact FP8 weight (dequantized) while the parameter is unchanged
        since load_fp8_expert, else the parameter (quantized in the GEMM)."""
        w, p = getattr(self, param), self._pinned.get(param)
        if p is not None and p[1] == w._version and p[2] == w.data_ptr():
            return p[0], True
        self._pinned.pop(param, None)
        return w, False

    def _mm(self, x: Tensor, param: str, counts: list[int]) -> Tensor:
        w, pinned = self._weight(param)
        if not self.fp8_enabled:
            return _grouped_reference(x, w, counts)
        if pinned and not torch.is_grad_enabled():  # FP8 bytes as vLLM holds them: quantize x only
            from fp8.quant import fake_quant_act_1x128

            return _grouped_reference(fake_quant_act_1x128(x, self.act_recipe), w, counts).to(x.dtype)
        if self.backend in ("torchao", "deep_gemm"):
            return _grouped_torchao(x, w, counts, deep_gemm=self.backend == "deep_gemm")
        if self.act_recipe == "torchao":  # the trainer: torchao's grouped numerics (module doc)
            return _grouped_torchao_emulated(x, w, counts)
        return _grouped_emulated(x, w, counts, self.kernels)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        n, k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # [N k]
        order = torch.argsort(flat, stable=True)  # token-slots grouped by expert
        token = order // k  # [N k] the token of each grouped slot
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x = hidden_states[token]  # [N k, H]
        gate, up = self._mm(x, "gate_up_proj", counts).chunk(2, dim=-1)  # [N k, I] each
        y = self._mm(self.act_fn(gate) * up, "down_proj", counts)  # [N k, H]
        y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))

    @torch.no_grad()
    def load_fp8_expert(self, param: str, e: int, rows: slice, q: Tensor, scale_inv: Tensor) -> None:
        """Pin expert e's FP8 weight rows (q e4m3 [n, K], scale_inv [n/128, K/128]) as vLLM holds them, and
        write dequantize(q, scale_inv) into the parameter."""
        w = getattr(self, param)
        deq = dequantize_blockwise(q.to(w.device), scale_inv.to(w.device), BLOCK)  # float32 [n, K]
        w[e, rows] = deq.to(w.dtype)
        p = self._pinned.get(param)
        buf = p[0] if p is not None else w.detach().float().clone()  # experts not pushed yet: the parameter
        buf[e, rows] = deq
        self._pinned[param] = (buf, w._version, w.data_ptr())

    def extra_repr(self) -> str:
        e, n, k = self.gate_up_proj.shape
        return f"experts={e}, gate_up=[{n}, {k}], fp8=block128, backend={self.backend}, act_recipe={self.act_recipe}"


def use_torchao_experts(cfg: FP8Config, experts: nn.Module) -> bool:
    """torchao's grouped GEMM: where fp8/linear.py would use torchao for a linear (SM90, not emulate)."""
    return use_torchao(cfg, experts.gate_up_proj.device)


def convert_experts(model: nn.Module, cfg: FP8Config, plan: dict[str, tuple[bool, str]],
                    act_recipe: str = "torchao") -> list[str]:
    """Replace every experts module the plan makes FP8 by a BlockFP8Experts; returns their names.
    act_recipe 'torchao': the trainer (torchao kernels on SM90); 'vllm': the CPU engine (emulated)."""
    spec = family_of(model)
    if spec.experts is None:
        return []
    done = []
    for raw_name, mod in list(model.named_modules()):
        name = clean_name(raw_name)
        if not name.endswith("." + spec.experts) or isinstance(mod, BlockFP8Experts) or not plan.get(name, (False,))[0]:
            continue
        backend = "torchao" if act_recipe == "torchao" and use_torchao_experts(cfg, mod) else "emulated"
        if backend == "torchao" and cfg.deep_gemm:
            require_deep_gemm("fp8.deep_gemm=true", "fp8.deep_gemm=false (torchao's emulated grouped GEMM)")
            backend = "deep_gemm"
        model.set_submodule(raw_name, BlockFP8Experts(mod, backend, act_recipe))
        done.append(name)
    return done
