"""Trainer vs. rollout-engine logprob mismatch metrics, and the shared masked mean.

The rollout engine (vLLM, FP8 kernels, ...) samples y ~ pi_rollout, but the trainer scores the
same tokens with pi_train. With d = log pi_train - log pi_rollout and rho = exp(d) = pi_train /
pi_rollout per token (samples come from pi_rollout):

    token_mult_prob_error = E[exp(|d|)]            (>= 1; 1 means bit-identical)
    kl                    = E[-d]                  k1 estimator of KL(pi_rollout || pi_train)
    k3_kl                 = E[rho - 1 - d]         k3 estimator (Schulman 2020) of the same
                                                   KL(pi_rollout || pi_train); >= 0 per token
    chi2_token            = E[rho^2] - 1           chi^2(pi_train || pi_rollout), per token
    max_abs_diff          = max |d|,  mean_abs_diff = E[|d|],  ratio_mean = E[rho]

E[.] is the mean over masked tokens. Tokens whose d is non-finite (e.g. an engine logprob of
-inf) are left out of every value and counted in nonfinite_frac instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask != 0 (mask weights the terms), along dim or overall.

    Empty slices give 0, not NaN, and the gradient to x stays connected (and finite), so this
    is safe inside a loss. Values of x at masked-out positions are ignored even if non-finite.
    """
    m = mask.to(x.dtype)
    xm = torch.where(m != 0, x * m, torch.zeros_like(x))
    if dim is None:
        return xm.sum() / m.sum().clamp_min(1e-8)
    return xm.sum(dim) / m.sum(dim).clamp_min(1e-8)


@torch.no_grad()
def mismatch_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Per-token mismatch between trainer and engine logprobs, all [B, T]; keys are unprefixed."""
    if train_logp.shape != rollout_logp.shape or train_logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: train_logp {list(train_logp.shape)}, "
                         f"rollout_logp {list(rollout_logp.shape)}, mask {list(mask.shape)}")
    d = train_logp.float() - rollout_logp.float()                  # [B, T] log rho
    m = mask.float() != 0                                          # [B, T]
    finite = torch.isfinite(d)                                     # [B, T]
    valid = m & finite                                             # [B, T]
    d = torch.where(finite, d, torch.zeros_like(d))                # [B, T]
    rho = torch.exp(d)                                             # [B, T]
    abs_d = d.abs()                                                # [B, T]
    vals = {
        "token_mult_prob_error": masked_mean(torch.exp(abs_d), valid),
        "kl": masked_mean(-d, valid),
        "k3_kl": masked_mean(rho - 1 - d, valid),
        "chi2_token": masked_mean(rho * rho, valid) - 1,
        "max_abs_diff": torch.where(valid, abs_d, torch.zeros_like(abs_d)).max(),
        "mean_abs_diff": masked_mean(abs_d, valid),
        "ratio_mean": masked_mean(rho, valid),
        "nonfinite_frac": masked_mean((~finite).float(), m),
    }
    if not valid.any():  # nothing to compare: report "no mismatch" rather than chi2 = -1
        vals["token_mult_prob_error"] = vals["ratio_mean"] = d.new_ones(())
        vals["chi2_token"] = d.new_zeros(())
    return dict(zip(vals, torch.stack([v.reshape(()) for v in vals.values()]).tolist()))
