"""THE skip list: which nn.Linear of a model are block-FP8, for the trainer AND the engine.

The GRPO importance ratio pi_train/pi_rollout is only meaningful if both sides run the same
function. If the trainer quantizes a layer the engine keeps in BF16 (or the reverse), every
token's log-prob carries a systematic offset that IS correction cannot tell from policy change:
it silently biases the ratios, clipping and the mismatch metrics. So `fp8_plan` decides for
fp8/convert.py (convert_to_fp8_training), engines/hf.py (convert_to_fp8_rollout) and fp8/export.py alike.

Stays BF16: embeddings and lm_head (logits are what the RL ratio is computed from), MoE routers
(tiny, decisions are discontinuous; router names and fused groups are the model family's, models/),
linears with a bias, linears whose dims are not multiples of 128, names matching
FP8Config.keep_bf16, the first keep_first_layers and last keep_last_layers decoder layers.
vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj and refuses a fused layer whose
shards differ in precision, so a group is FP8 only if all its members are.

Mixture of experts: each layer's experts module (3-D weights, models/<family>.py `experts`) is one
plan entry, FP8 or not as a whole (vLLM's FusedMoE has one precision), by the same rules
(keep_bf16 on its name, keep_*_layers, every expert GEMM's dims multiples of 128); each router
(`router`) is an entry kept BF16, so vllm_quantization_config lists it in ignored_layers (vLLM's
router is a ReplicatedLinear that would otherwise be FP8).
"""

from __future__ import annotations

import fnmatch
import logging
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from fp8.quant import BLOCK
from models import GENERIC, FamilySpec, family_of

if TYPE_CHECKING:
    from config import FP8Config

logger = logging.getLogger(__name__)

# Infixes that wrappers (torch.compile, FSDP1, activation checkpointing, DDP) put into names.
_WRAPPER_PARTS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
    idx = [int(m.group(1)) for name, _ in model.named_modules() if (m := LAYER_RE.search(name + "."))]
    return max(idx) + 1 if idx else 0


def fp8_eligible(name: str, module: nn.Module, cfg: FP8Config, num_layers: int,
                 family: FamilySpec = GENERIC) -> tuple[bool, str]:
    """Per-module rule: (True, 'fp8') or (False, why it stays BF16); routers and fused groups are
    those of `family` (fp8_plan passes the model's).

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
    if any(fnmatch.fnmatchcase(name, p) for p in family.router_patterns):
        return False, "MoE router"
    for pat in cfg.keep_bf16:
        if fnmatch.fnmatchcase(name, pat):
            return False, f"keep_bf16 '{pat}'"
    parent = name.rpartition(".")[0]
    siblings = next((g for g in family.fused_groups if leaf in g), ())  # their dims/bias: see fp8_plan
    for sib in siblings:
        for pat in cfg.keep_bf16 if sib != leaf else ():
            if fnmatch.fnmatchcase(f"{parent}.{sib}", pat):
                return False, f"fused with {sib} (keep_bf16 '{pat}')"
    if m := LAYER_RE.search(name):
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
    """{HF module name: (fp8?, reason)} for every nn.Linear of `model`, and its MoE experts and
    routers (moe_plan) - THE skip list.

    fp8_eligible per module, then a fused group (q/k/v, gate/up of one parent) is FP8 only if
    all its members present in the model are (vLLM loads them into one qkv_proj/gate_up_proj).
    """
    n_layers, family = num_decoder_layers(model), family_of(model)
    base = {clean_name(n): fp8_eligible(n, m, cfg, n_layers, family)
            for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    plan = dict(base)
    plan.update(moe_plan(model, cfg, n_layers, family))
    for name, (ok, _) in base.items():
        if not ok or "." not in name:
            continue
        parent, leaf = name.rsplit(".", 1)
        for group in family.fused_groups:
            if leaf in group:
                for sib in group:
                    s = base.get(f"{parent}.{sib}")
                    if s is not None and not s[0]:
                        plan[name] = (False, f"fused with {sib} ({s[1]})")
                        break
    return plan


def moe_plan(model: nn.Module, cfg: FP8Config, num_layers: int, family: FamilySpec) -> dict[str, tuple[bool, str]]:
    """{experts module name: (fp8?, reason)} and {router name: (False, 'MoE router')} of a MoE family."""
    if family.experts is None:
        return {}
    plan = {}
    for name, mod in model.named_modules():
        name = clean_name(name)
        if family.router and name.endswith("." + family.router) and LAYER_RE.search(name):
            plan[name] = (False, "MoE router")
        if not (name.endswith("." + family.experts) and (m := LAYER_RE.search(name))):
            continue
        i = int(m.group(1))
        dims = [d for param, linears in family.expert_weights
                for d in (getattr(mod, param).shape[1] // len(linears), getattr(mod, param).shape[2])]
        pat = next((p for p in cfg.keep_bf16 if fnmatch.fnmatchcase(name, p)), None)
        plan[name] = ((False, f"keep_bf16 '{pat}'") if pat is not None else
                      (False, "keep_first_layers") if i < cfg.keep_first_layers else
                      (False, "keep_last_layers") if i >= num_layers - cfg.keep_last_layers else
                      (False, f"expert dims {dims} not divisible by {BLOCK}") if any(d % BLOCK for d in dims) else
                      (True, "fp8"))
    return plan


def log_summary(kind: str, plan: dict[str, tuple[bool, str]]) -> None:
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
    print_rank0(msg)


def print_rank0(msg: str, **kwargs) -> None:
    """print on rank 0 only (every process when torch.distributed is not initialized)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print(msg, flush=True, **kwargs)
