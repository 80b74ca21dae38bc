"""Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath").

For each prompt we sample G completions and score them; an estimator, a function of ADVANTAGE_REGISTRY
named by advantage.estimator, turns each group's rewards into advantages. The one shipped, "grpo",
takes the group mean as the baseline:

    A_i = (r_i - mean_g) / (std_g + eps)      (std_g unbiased, i.e. divided by G - 1)
    A_i =  r_i - mean_g                       (normalize_std=False, Dr. GRPO, Liu et al. 2025)

A group whose rewards are all equal carries no signal and gets A = 0 (never NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from losses.registry import Registry


@dataclass
class AdvantageConfig:
    """The `advantage` section of the run config: how rewards become advantages."""
    estimator: str = "grpo"
    """The advantage estimator, by name in losses.advantages.ADVANTAGE_REGISTRY: "grpo" (the group
    mean as the baseline; normalize_std and eps shape it)."""
    normalize_std: bool = True
    """Divide by the group's reward std (GRPO). false: A = r - mean_g (Dr. GRPO, Liu et al. 2025,
    arXiv 2503.20783): dividing by the std up-weights groups that are nearly all right or all wrong,
    a difficulty bias."""
    eps: float = 1e-6
    """Added to the std before dividing (normalize_std): keeps a zero-spread group at A = 0."""


# f(rewards [P, G] float32, one row per prompt's group, cfg) -> advantages [P, G]
ADVANTAGE_REGISTRY = Registry("advantage.estimator")


@ADVANTAGE_REGISTRY.register("grpo")
def grpo(r: Tensor, cfg: AdvantageConfig) -> Tensor:
    """A = (r - mean_g) / (std_g + eps), unbiased std; A = r - mean_g without normalize_std"""
    adv = r - r.mean(dim=1, keepdim=True)                       # [P, G]
    if cfg.normalize_std:
        # unbiased std; a group of one has no spread (torch would give NaN), so use 0 -> A = 0
        std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + cfg.eps)                             # [P, G]
    return adv


ADVANTAGE_ESTIMATORS = tuple(ADVANTAGE_REGISTRY)


def compute_advantages(rewards: Tensor, group_size: int, cfg: AdvantageConfig) -> Tensor:
    """rewards [B] laid out group by group (B = n_prompts * group_size) -> advantages [B], by the
    registered estimator cfg.estimator."""
    estimator = ADVANTAGE_REGISTRY[cfg.estimator]
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {list(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    B = rewards.shape[0]
    if B % group_size != 0:
        raise ValueError(f"group_size {group_size} does not divide the batch size B={B} "
                         f"(rewards must be n_prompts * group_size, ordered group by group)")
    r = rewards.detach().float().view(-1, group_size)          # [P, G]
    return estimator(r, cfg).reshape(B)


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """GRPO's advantages: rewards [B] laid out group by group (B = n_prompts * group_size) -> [B]."""
    return compute_advantages(rewards, group_size, AdvantageConfig("grpo", normalize_std, eps))
