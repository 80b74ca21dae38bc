"""Model conversion to block FP8: the one walk that replaces a model's linears and MoE experts in place.

    convert_to_fp8_training(model, cfg.fp8)   # the trainer: torchao on SM90, else the emulation
    convert_planned(model, cfg, plan, make_linear, act_recipe)   # engines/hf.py: the CPU engine's W8A8

fp8/plan.py's fp8_plan decides which modules (THE skip list, shared with fp8/export.py); this module
builds them from the layers of fp8/linear.py (the recipe and its emulation), fp8/torchao.py (its SM90
kernels) and fp8/moe.py (the experts), which never import this module or one another's converters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fp8.linear import EmulatedFP8Linear, is_fp8_linear, use_torchao
from fp8.moe import convert_experts
from fp8.plan import clean_name, fp8_plan, log_summary
from fp8.torchao import torchao_linear_cls  # imports torchao and Triton only when called

if TYPE_CHECKING:
    from config import FP8Config


def convert_planned(model: nn.Module, cfg: FP8Config, plan: dict[str, tuple[bool, str]], make_linear,
                    act_recipe: str) -> list[str]:
    """The walk the trainer's and the CPU engine's conversions share: each nn.Linear the plan makes FP8
    (and not FP8 yet) replaced in place by make_linear(linear), then the MoE experts (fp8/moe.py, with
    act_recipe); returns their HF names."""
    converted = []
    for raw_name, mod in list(model.named_modules()):
        name = clean_name(raw_name)
        if isinstance(mod, nn.Linear) and not is_fp8_linear(mod) and plan.get(name, (False,))[0]:
            model.set_submodule(raw_name, make_linear(mod))
            converted.append(name)
    return converted + convert_experts(model, cfg, plan, act_recipe)


def convert_to_fp8_training(model: nn.Module, cfg: FP8Config) -> list[str]:
    """Replace the fp8_plan-eligible nn.Linear of `model` in place; returns their HF names.

    torchao Float8BlockwiseLinear on SM90 (BF16 weights), else EmulatedFP8Linear (the recipe
    alone: fp8.fast.apply adds the speed-only structure). Call before wrapping the model
    (FSDP/compile) and before creating hooks on the linears; the weight Parameters are reused, so
    an optimizer created earlier stays valid.
    """
    kinds = set()

    def make_linear(mod: nn.Linear) -> nn.Linear:
        if use_torchao(cfg, mod.weight.device) and mod.weight.dtype in (torch.bfloat16, torch.float32):
            kinds.add("torchao")
            return torchao_linear_cls().from_float(mod).train(mod.training)
        kinds.add("emulated")
        return EmulatedFP8Linear.from_linear(mod, "torchao")

    plan = fp8_plan(model, cfg)
    converted = convert_planned(model, cfg, plan, make_linear, "torchao")
    log_summary("block-FP8 (" + "+".join(sorted(kinds) or ["none"]) + ")", plan)
    return converted
