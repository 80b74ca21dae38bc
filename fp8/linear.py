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

Backends: `convert_to_fp8_training` uses torchao's Float8BlockwiseLinear (cuBLAS/Triton FP8
GEMMs) on SM90 when not cfg.emulate, else EmulatedFP8Linear: quantize-dequantize with
fp8/quant.py and a float32 matmul. Differences of the emulation from torchao: (1) accumulation:
torchao accumulates e4m3 products in the tensor cores' FP8 accumulator per 128-chunk and applies
scale_a*scale_b per chunk, we multiply dequantized float32 operands in one fp32 GEMM (measured on
an H100, tests/gpu: emulation vs torchao 6.6e-4 relative for output, dgrad and wgrad, elementwise
<= 2 bf16 ulps + 5e-3 rms; the emulation is the exact product rounded once, torchao adds ~1e-4);
(2) torchao always returns BF16, we return the input dtype (an fp32 CPU model stays fp32).
`convert_to_fp8_rollout` builds the CPU stand-in for vLLM's W8A8 linear: activations use
vLLM's 1x128 recipe (divide by amax/448) and weights can be pinned to the exact exported FP8
bytes (load_fp8_weight), so the CPU engine computes what vLLM would up to accumulation order.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import re
import sys
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


class _EmulatedFP8MM(torch.autograd.Function):
    """y = fq1x128(x) @ fq128x128(W).T with torchao's backward recipe (fq = quantize-dequantize).

    Shapes: x [..., K], W [N, K] -> y [..., N]. The weight is re-quantized in backward instead of
    saving a float32 copy (torchao does the same), so memory matches a BF16 linear.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, act_recipe: str) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        y = fake_quant_act_1x128(x2, act_recipe) @ fake_quant_weight(weight).t()  # fp32 [M, N]
        ctx.save_for_backward(x, weight)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [M, N]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dgrad: grad_out 1x128 tiles, W 128x128 blocks
            grad_x = (fake_quant_act_1x128(g2) @ fake_quant_weight(weight)).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:  # wgrad: both operands in 128x1 groups along the token dim M
            x2 = x.reshape(-1, x.shape[-1])
            grad_w = (fake_quant_act_128x1(g2).t() @ fake_quant_act_128x1(x2)).to(weight.dtype)
        return grad_x, grad_w, None


class EmulatedFP8Linear(nn.Linear):
    """nn.Linear whose GEMMs see block-FP8 operands (quantize-dequantize), any device/dtype.

    act_recipe: 'torchao' (trainer, default) or 'vllm' (CPU stand-in for vLLM's W8A8 linear).
    Parameter names and objects are those of the replaced nn.Linear (checkpoint names unchanged).
    """

    fp8_enabled = True  # False inside bf16_reference()

    def __init__(self, *args, act_recipe: str = "torchao", **kwargs):
        super().__init__(*args, **kwargs)
        self.act_recipe = act_recipe
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
        if w is not None and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            x2 = x.reshape(-1, x.shape[-1])
            y = (fake_quant_act_1x128(x2, self.act_recipe) @ w.t()).to(x.dtype)
            y = y.reshape(*x.shape[:-1], w.shape[0])
        else:
            y = _EmulatedFP8MM.apply(x, self.weight, self.act_recipe)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=block128, act_recipe={self.act_recipe}"


# ------------------------------------------------------------------------------------ torchao


@functools.cache
def torchao_linear_cls() -> type:
    """TorchaoFP8Linear: torchao's Float8BlockwiseLinear + bf16_reference switch + token padding.

    Imported lazily: torchao pulls in Triton, and the CPU path never needs it.
    """
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear, fp8_blockwise_mm

    class TorchaoFP8Linear(Float8BlockwiseLinear):
        fp8_enabled = True

        def forward(self, x: Tensor) -> Tensor:
            if not self.fp8_enabled:
                return F.linear(x, self.weight)
            x2 = x.reshape(-1, x.shape[-1])  # [M, K]
            m = x2.shape[0]
            if m % BLOCK:  # torchao's wgrad kernels need M % 128 == 0; zero rows are exact
                x2 = F.pad(x2, (0, 0, 0, BLOCK - m % BLOCK))
            y = fp8_blockwise_mm.apply(x2.contiguous(), self.weight, self.block_size, self.dtype,
                                       self.use_triton)
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
    _log_summary("block-FP8 (" + "+".join(sorted(kinds) or ["none"]) + ")", plan)
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
