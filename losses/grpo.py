"""GRPO policy loss (PPO clip) with train/rollout importance correction: the whole objective.

Three logprobs of the sampled tokens, each [B, T]:
    logp          pi_theta    current policy, the one that gets gradients
    old_logp      pi_old      the trainer's logprobs under the weights that generated the batch
    rollout_logp  pi_rollout  the inference engine's logprobs under those same weights

pi_old and pi_rollout are the same weights, but different kernels / FP8 quantisation make them
differ, so the batch is slightly off-policy for the trainer. PPO's clip acts on the ratio
r = pi_theta / pi_old; the train/rollout gap is corrected by a detached importance weight
w ~ pi_old / pi_rollout (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"):

    r    = exp(logp - old_logp)                                             [B, T]
    pg   = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))               PPO / DAPO clip
    pg   = min(pg, -A c)                 where A < 0, c = dual_clip         dual clip
    w    = IS(exp(old_logp - rollout_logp))      detached; non-finite -> 0
    loss = agg(w * pg + kl_coef * k3),   k3 = exp(ref - logp) - (ref - logp) - 1

IS(.) by is_correction, a function of IS_REGISTRY below (C = is_cap, F = is_floor; "mean_t" /
"sum_t" run over masked tokens):
    none          w = 1
    tis           w = min(w, C)                                  truncated IS, token level
    icepop        w = w * [F <= w <= C]                          mask tokens outside the band
    seq_mask_tis  w = w * [F <= exp(mean_t(old - rollout)) <= C] mask whole sequences
    seq_tis       w = min(exp(sum_t(old - rollout)), C)          one weight per sequence
In the sequence-level modes a sequence that contains a non-finite token weight gets w = 0.

agg over the masked [B, T] per-token loss, a function of AGG_REGISTRY below:
    token_mean            sum(loss * mask) / sum(mask)
    seq_mean_token_mean   mean_b( mean_t loss )   (original GRPO)
    seq_mean_token_sum    mean_b( sum_t loss )    (Dr. GRPO: no length normalisation)
Sequences with no masked token contribute 0 and are left out of the mean over sequences.

The trainer backpropagates micro_batch_loss, micro-batch by micro-batch; summed over the micro-batches
(and ranks) of a mini-batch it is that mini-batch's objective:
    L_micro = weight * (loss + aux_coef * aux)  -  entropy_coef * sum(H * response_mask) / N_response
    weight  = sum(mask) / N_tokens                      an agg whose mean runs over tokens (token_mean)
            = rows with a masked token / N_rows         one whose mean runs over sequences (seq_mean_*)
where loss is the agg above over the micro-batch, N_tokens, N_rows and N_response count the whole
mini-batch (MiniBatchTotals), H is the policy's token entropy, averaged over every response token,
kept group or not (entropy_coef: loss.entropy_coef or its adaptive value), and aux is the MoE
load-balancing loss of the micro-batch's forward (aux_coef: moe.aux_loss_coef).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from losses.mismatch import masked_mean
from losses.registry import Registry


@dataclass
class LossConfig:
    clip_low: float = 0.2
    """PPO clip (Schulman et al. 2017): the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """Upper clip 1 + clip_high; raising it above clip_low is DAPO's "clip-higher" (Yu et al.
    2025), which keeps low-probability tokens able to grow and so fights entropy collapse."""
    dual_clip: float | None = None
    """Dual-clip PPO (Ye et al. 2020, "Mastering complex control in MOBA games with deep RL"):
    for A < 0 the loss is capped at -A * dual_clip (> 1), so a huge ratio cannot blow it up."""
    is_correction: str = "tis"
    """Train/rollout mismatch correction: "none", "tis" (truncated IS, Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"), "icepop" (Ling team,
    IcePop / Ring-1T: mask tokens whose weight leaves [is_floor, is_cap]), "seq_mask_tis"
    (mask whole sequences by their geometric-mean ratio) or "seq_tis" (sequence-level TIS)."""
    is_cap: float = 2.0
    """Upper bound C on the importance weight (the truncation of TIS, the band top of IcePop)."""
    is_floor: float = 0.0
    """Lower bound on the weight for icepop / seq_mask_tis (IcePop's band bottom, e.g. 0.5). Their
    window [is_floor, is_cap] must hold 1, the weight of a token engine and trainer agree on
    (config.validate refuses one without it: every token would be masked)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL penalty to a reference policy (Schulman 2020 "Approximating KL
    divergence", as in GRPO, Shao et al. 2024); 0 disables it, as in DAPO / Dr. GRPO."""
    entropy_coef: float = 0.0
    """Entropy bonus (Williams & Peng 1991; PPO's c2): the trainer subtracts entropy_coef times the
    policy's mean token entropy over every sampled response token, kept group or not (a collapsed
    group has no advantage, and the bonus is what reaches it). With entropy_target: the start value."""
    entropy_target: float | None = None
    """Adaptive entropy control (Skywork-OR1, He et al. 2025): each step the coefficient moves by
    entropy_coef_step towards keeping policy/entropy (nats per response token, measured before the
    update) at or above this target, within [0, 1], and the bonus applies only on steps whose
    entropy is below it. None: the fixed entropy_coef. With train.old_logp=rollout the controller
    reads the previous step's policy/entropy (this step's comes from the training forward itself)."""
    entropy_coef_step: float = 0.005
    """The coefficient's change per step under entropy_target (Skywork-OR1's Delta)."""
    agg: str = "token_mean"
    """Loss aggregation: "token_mean" (DAPO token-level mean), "seq_mean_token_mean" (original
    GRPO, biased towards short correct / long wrong answers) or "seq_mean_token_sum" (Dr. GRPO,
    Liu et al. 2025, removes that length bias)."""

    def __post_init__(self):
        if self.is_correction not in IS_REGISTRY:
            raise ValueError(f"LossConfig.is_correction={self.is_correction!r} is not valid; "
                             f"expected one of {IS_REGISTRY.choices()}")
        if self.agg not in AGG_REGISTRY:
            raise ValueError(f"LossConfig.agg={self.agg!r} is not valid; expected one of {AGG_REGISTRY.choices()}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"LossConfig: need 0 <= clip_low < 1 and clip_high >= 0, "
                             f"got clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"LossConfig.dual_clip={self.dual_clip} must be > 1 (or None)")
        if not 0 <= self.is_floor <= self.is_cap:
            raise ValueError(f"LossConfig: need 0 <= is_floor <= is_cap, "
                             f"got is_floor={self.is_floor}, is_cap={self.is_cap}")


# ---------------------------------------------------------------- IS corrections (loss.is_correction)
# f(w, log_ratio, mask, nonfinite, cfg) -> (weights [B, T], truncated bool [B, T]), all detached.
#   w          [B, T]  the raw weight exp(old_logp - rollout_logp), its non-finite entries set to 0
#   log_ratio  [B, T]  old_logp - rollout_logp as it is (non-finite entries included)
#   mask       [B, T]  bool, the tokens that count;  nonfinite [B, T] bool, where w was inf or NaN
# truncated: the correction changed the weight of a token whose raw weight was finite.
IS_REGISTRY = Registry("loss.is_correction")


@IS_REGISTRY.register("none")
def no_correction(w: Tensor, log_ratio: Tensor, mask: Tensor, nonfinite: Tensor, cfg: LossConfig):
    """w = 1: no correction"""
    return torch.ones_like(w), torch.zeros_like(mask)


@IS_REGISTRY.register("tis")
def tis(w: Tensor, log_ratio: Tensor, mask: Tensor, nonfinite: Tensor, cfg: LossConfig):
    """w = min(w, C): truncated IS, token level"""
    return w.clamp(max=cfg.is_cap), w > cfg.is_cap


@IS_REGISTRY.register("icepop")
def icepop(w: Tensor, log_ratio: Tensor, mask: Tensor, nonfinite: Tensor, cfg: LossConfig):
    """w = w * [F <= w <= C]: tokens outside the band leave the gradient"""
    keep = ((w >= cfg.is_floor) & (w <= cfg.is_cap)) | nonfinite   # [B, T] (nonfinite: w is 0)
    return w * keep, ~keep


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor, nonfinite: Tensor) -> tuple[Tensor, Tensor]:
    """mean_t of the masked log ratio [B, 1], and [B, 1] bool: no masked token of the row is non-finite."""
    seq_ok = ~(nonfinite & mask).any(-1, keepdim=True)             # [B, 1]
    d = torch.where(nonfinite, torch.zeros_like(log_ratio), log_ratio)  # [B, T]
    return masked_mean(d, mask, dim=-1).unsqueeze(-1), seq_ok      # [B, 1] x2


@IS_REGISTRY.register("seq_mask_tis")
def seq_mask_tis(w: Tensor, log_ratio: Tensor, mask: Tensor, nonfinite: Tensor, cfg: LossConfig):
    """w = w * [F <= exp(mean_t(old - rollout)) <= C]: mask whole sequences"""
    mean_d, seq_ok = _sequence_log_ratio(log_ratio, mask, nonfinite)  # [B, 1] x2
    r_seq = mean_d.exp()                                           # [B, 1] geometric mean ratio
    in_band = (r_seq >= cfg.is_floor) & (r_seq <= cfg.is_cap)      # [B, 1]
    return w * (seq_ok & in_band), (seq_ok & ~in_band).expand_as(mask)


@IS_REGISTRY.register("seq_tis")
def seq_tis(w: Tensor, log_ratio: Tensor, mask: Tensor, nonfinite: Tensor, cfg: LossConfig):
    """w = min(exp(sum_t(old - rollout)), C): one weight per sequence"""
    mean_d, seq_ok = _sequence_log_ratio(log_ratio, mask, nonfinite)  # [B, 1] x2
    r_seq = (mean_d * mask.sum(-1, keepdim=True)).exp()            # [B, 1] sum_t = mean_t * n_tokens
    w = (r_seq.clamp(max=cfg.is_cap) * seq_ok).expand_as(w)        # [B, T]
    return w, (seq_ok & (r_seq > cfg.is_cap)).expand_as(mask)


# ---------------------------------------------------------------- aggregations (loss.agg)
# f(x [B, T], mask [B, T]) -> scalar. mean_over ("tokens" | "sequences"): what the outer mean runs
# over, so what a micro-batch's share of a mini-batch is (micro_batch_loss).
AGG_REGISTRY = Registry("loss.agg", mean_over=("tokens", "sequences"))


def _per_sequence(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The per-sequence token mean [B] and the masked token count [B] (in x's dtype)."""
    return masked_mean(x, mask, dim=-1), (mask != 0).to(x.dtype).sum(-1)


@AGG_REGISTRY.register("token_mean", mean_over="tokens")
def token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(loss * mask) / sum(mask)"""
    return masked_mean(x, mask)


@AGG_REGISTRY.register("seq_mean_token_mean", mean_over="sequences")
def seq_mean_token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """mean_b( mean_t loss )   (original GRPO)"""
    per_seq, n_tok = _per_sequence(x, mask)                        # [B] x2
    return masked_mean(per_seq, n_tok > 0)


@AGG_REGISTRY.register("seq_mean_token_sum", mean_over="sequences")
def seq_mean_token_sum(x: Tensor, mask: Tensor) -> Tensor:
    """mean_b( sum_t loss )    (Dr. GRPO: no length normalisation)"""
    per_seq, n_tok = _per_sequence(x, mask)                        # [B] x2
    return masked_mean(per_seq * n_tok, n_tok > 0)                 # [B] token sums


IS_CORRECTIONS = tuple(IS_REGISTRY)  # the names, in registration order
AGGS = tuple(AGG_REGISTRY)


def aggregate(x: Tensor, mask: Tensor, agg: str) -> Tensor:
    """Reduce a per-token [B, T] quantity to a scalar by the registered aggregation `agg`."""
    return AGG_REGISTRY[agg](x, mask)


def is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cfg: LossConfig):
    """Detached importance weights [B, T] plus bool [B, T] maps (truncated, nonfinite), by the
    registered correction cfg.is_correction.

    truncated: the cap / floor / mask changed the weight of a token whose raw weight was
    finite; nonfinite: the raw weight exp(old - rollout) was inf or NaN (it becomes 0).
    """
    correction = IS_REGISTRY[cfg.is_correction]
    m = mask != 0                                                  # [B, T]
    d = (old_logp - rollout_logp).detach()                         # [B, T]
    w_raw = d.exp()                                                # [B, T]
    nonfinite = ~torch.isfinite(w_raw)                             # [B, T]
    w = torch.where(nonfinite, torch.zeros_like(w_raw), w_raw)     # [B, T]
    w, truncated = correction(w, d, m, nonfinite, cfg)             # [B, T] x2
    return w, truncated, nonfinite


def _check_shapes(logp, advantages, **others):
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {list(logp.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"shape mismatch: {name} has shape {list(t.shape)} but logp has "
                             f"shape {list(logp.shape)} (all per-token inputs must be [B, T])")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"shape mismatch: advantages has shape {list(advantages.shape)}; "
                         f"expected [B]={list(logp.shape[:1])} or [B, T]={list(logp.shape)}")


def grpo_loss(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, advantages: Tensor,
              mask: Tensor, cfg: LossConfig, ref_logp: Tensor | None = None, *, on_device: bool = False
              ) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss (differentiable w.r.t. logp) and a dict of python-float metrics; on_device: the
    metrics as 0-d tensors on logp's device instead (no host sync: the trainer reads them once a step)."""
    _check_shapes(logp, advantages, old_logp=old_logp, rollout_logp=rollout_logp, mask=mask,
                  ref_logp=ref_logp)
    if cfg.kl_coef != 0 and ref_logp is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logp (got None)")
    m = mask != 0                                                  # [B, T]
    zero = torch.zeros_like(logp, dtype=torch.float32)             # [B, T]
    # padding may hold -inf / NaN logprobs: zero them so no NaN reaches the gradient
    logp = torch.where(m, logp.float(), zero)                      # [B, T]
    old = torch.where(m, old_logp.detach().float(), zero)          # [B, T]
    rollout = torch.where(m, rollout_logp.detach().float(), zero)  # [B, T]
    A = advantages.detach().float()
    A = (A.unsqueeze(-1) if A.dim() == 1 else A).expand_as(logp)   # [B, T]

    ratio = (logp - old).exp()                                     # [B, T]
    pg_unclipped = -A * ratio                                      # [B, T]
    pg_clipped = -A * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)  # [B, T]
    pg = torch.maximum(pg_unclipped, pg_clipped)                   # [B, T]
    clipped = pg_clipped > pg_unclipped                            # [B, T]
    dual = torch.zeros_like(m)                                     # [B, T]
    if cfg.dual_clip is not None:
        dual = (A < 0) & (pg > -A * cfg.dual_clip)                 # [B, T]
        pg = torch.where(dual, -A * cfg.dual_clip, pg)             # [B, T]

    w, truncated, nonfinite = is_weights(old, rollout, m, cfg)     # [B, T] x3
    pg_loss = w * pg                                               # [B, T]
    if ref_logp is not None:
        dr = torch.where(m, ref_logp.detach().float(), zero) - logp  # [B, T]
        k3 = dr.exp() - dr - 1                                     # [B, T]
    else:
        k3 = zero
    loss = aggregate(pg_loss + cfg.kl_coef * k3, m, cfg.agg)

    with torch.no_grad():
        vals = {
            "loss/total": loss,
            "loss/policy": aggregate(pg_loss, m, cfg.agg),
            "loss/kl": aggregate(k3, m, cfg.agg),
            "loss/clip_frac": masked_mean(clipped.float(), m),
            "loss/dual_clip_frac": masked_mean(dual.float(), m),
            "loss/ratio_mean": masked_mean(ratio, m),
            "is/weight_mean": masked_mean(w, m),
            "is/truncated_frac": masked_mean(truncated.float(), m),
            "is/nonfinite_frac": masked_mean(nonfinite.float(), m),
        }
        stacked = torch.stack([v.detach() for v in vals.values()])
    return loss, dict(zip(vals, stacked if on_device else stacked.tolist()))


@dataclass
class LossInputs:
    """One micro-batch of b rows: per-token tensors [b, T], advantages [b] or [b, T]."""
    logp: Tensor                          # current policy (requires grad)
    old_logp: Tensor                      # trainer, behaviour weights
    rollout_logp: Tensor                  # engine
    advantages: Tensor
    mask: Tensor                          # tokens the policy loss counts (response tokens of kept groups)
    ref_logp: Tensor | None = None        # KL reference (kl_coef > 0)
    entropy: Tensor | None = None         # the policy's token entropy (entropy_coef > 0)
    response_mask: Tensor | None = None   # every response token, kept group or not (the entropy mean)
    aux_loss: Tensor | None = None        # scalar: MoE load balancing of this forward (aux_coef > 0)


@dataclass
class MiniBatchTotals:
    """Counts over the whole mini-batch (every rank): the denominators of micro_batch_loss."""
    tokens: Tensor                        # masked tokens (>= 1)
    rows: float                           # rows with a masked token
    response_tokens: Tensor | None = None  # every response token (>= 1); needed for the entropy bonus


@dataclass
class LossOutputs:
    loss: Tensor                          # scalar to backpropagate: the micro-batch's share of the objective
    weight: Tensor                        # its share of the mini-batch's policy loss (weights the metrics)
    metrics: dict[str, Tensor]            # grpo_loss's, plus moe/aux_loss: 0-d, on the device


def micro_batch_loss(x: LossInputs, totals: MiniBatchTotals, cfg: LossConfig, entropy_coef: float = 0.0,
                     aux_coef: float = 0.0) -> LossOutputs:
    """The micro-batch objective of the module docstring: micro-batch losses summed over a mini-batch
    give its aggregate, the entropy bonus and the MoE auxiliary loss. Nothing in it waits for the GPU."""
    loss, metrics = grpo_loss(x.logp, x.old_logp, x.rollout_logp, x.advantages, x.mask, cfg, ref_logp=x.ref_logp,
                              on_device=True)
    if AGG_REGISTRY[cfg.agg].mean_over == "tokens":
        weight = x.mask.sum() / totals.tokens
    else:  # "sequences" (the registry allows no other): rows with a masked token
        weight = x.mask.amax(1).sum() / max(totals.rows, 1.0)
    loss = loss * weight
    if entropy_coef > 0:
        loss = loss - entropy_coef * (x.entropy * x.response_mask).sum() / totals.response_tokens
    if x.aux_loss is not None and aux_coef > 0:
        loss = loss + aux_coef * x.aux_loss * weight
        metrics = {**metrics, "moe/aux_loss": x.aux_loss.detach().float()}
    return LossOutputs(loss, weight, metrics)
