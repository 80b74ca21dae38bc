"""Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath").

For each prompt we sample G completions and score them; the baseline is the group mean:

    A_i = (r_i - mean_g) / (std_g + eps)      (std_g unbiased, i.e. divided by G - 1)
    A_i =  r_i - mean_g                       (normalize_std=False, Dr. GRPO, Liu et al. 2025)

A group whose rewards are all equal carries no signal and gets A = 0 (never NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """rewards [B] laid out group by group (B = n_prompts * group_size) -> advantages [B]."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {list(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    B = rewards.shape[0]
    if B % group_size != 0:
        raise ValueError(f"group_size {group_size} does not divide the batch size B={B} "
                         f"(rewards must be n_prompts * group_size, ordered group by group)")
    r = rewards.detach().float().view(-1, group_size)          # [P, G]
    adv = r - r.mean(dim=1, keepdim=True)                       # [P, G]
    if normalize_std:
        # unbiased std; a group of one has no spread (torch would give NaN), so use 0 -> A = 0
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + eps)                                 # [P, G]
    return adv.reshape(B)
