"""Checks that an optimizer step does what it should, on any model (random weights included).

* WeightChange: the share of trainable weights a training step changed (optim/changed_frac). bf16
  weights under a round-to-nearest optimizer at RL learning rates change well under 1% (optimizer.py);
  fp32 master weights change ~all. And the largest move of an fp32 weight in units of the step's
  learning rate (optim/update_ratio_max): Adam's bound is ~1, an 8-bit state that decodes to 0 gives
  10-10,000 (optimizer.py). Counted on up to `k` fixed entries per tensor, so it costs a few small
  gathers per step at 8B (exact for tensors of at most k entries).
* train.probe: rewards replaced by a synthetic one with variance in every group (probe_rewards), and
  after the step's updates one more no-grad forward over its batch: policy_gain says whether the
  policy moved toward the positive-advantage samples (> 0) or away (< 0).
"""

import torch
from torch import Tensor


def _local(p: Tensor) -> Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor: this rank's shard


class WeightChange:
    """The share of trainable weights one training step (all its optimizer steps) changed.

    start() copies k fixed entries of every trainable tensor (all of a tensor of at most k); a pre-step
    hook on `optimizer` marks the entries whose gradient exceeded the optimizer's eps in any of the
    step's optimizer steps; finish() returns the share of those that changed (this rank's shards).
    Entries with no such gradient are not counted: embedding rows of tokens absent from the batch, or
    lm_head rows of tokens the policy never gives mass to, which Adam's eps keeps still by design."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, k: int = 65536,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self.names = [names.get(id(p), f"param {i}") for i, p in enumerate(self.params)]
        self.eps = optimizer.param_groups[0].get("eps", 0.0)
        self.index = [None if _local(p).numel() <= k else  # with replacement: randperm of 0.5B entries takes minutes
                      torch.randint(_local(p).numel(), (k,), generator=g).to(_local(p).device) for p in self.params]
        self.before = self.moved = None
        self.lr_sum = 0.0  # the step's optimizer steps' learning rates, summed
        self.worst: tuple[float, str] | None = None  # (largest |dw| / lr_sum, its tensor's name) of the last step
        optimizer.register_step_pre_hook(lambda *_: self._mark_gradients())

    def _sampled(self, t: Tensor, i: Tensor | None) -> Tensor:
        flat = _local(t).detach().reshape(-1)
        return flat if i is None else flat[i]

    @torch.no_grad()
    def start(self) -> None:
        self.before = [self._sampled(p, i).clone() for p, i in zip(self.params, self.index)]
        self.moved = [torch.zeros_like(b, dtype=torch.bool) for b in self.before]
        self.lr_sum = 0.0

    @torch.no_grad()
    def _mark_gradients(self) -> None:
        if self.moved is None:
            return
        self.lr_sum += float(self.optimizer.param_groups[0]["lr"])
        for p, i, m in zip(self.params, self.index, self.moved):
            if p.grad is not None:
                m |= self._sampled(p.grad, i).abs() > self.eps

    @torch.no_grad()
    def finish(self) -> float | None:
        """The share; None when no entry had a gradient above eps (all advantages 0, say)."""
        changed = counted = 0.0
        self.worst = None
        for p, i, b, m, name in zip(self.params, self.index, self.before, self.moved, self.names):
            now = self._sampled(p, i)
            scale = _local(p).numel() / b.numel()  # a sampled tensor stands for all its entries
            changed += scale * int(((now != b) & m).sum())
            counted += scale * int(m.sum())
            if p.dtype in (torch.float32, torch.float64) and self.lr_sum > 0 and now.numel():
                # bf16 weights move by whole ulps (1e-4 at |w| ~ 0.02), which says nothing of the optimizer
                ratio = float((now - b).abs().max()) / self.lr_sum
                if self.worst is None or ratio > self.worst[0]:
                    self.worst = (ratio, name)
        self.before = self.moved = None
        return changed / counted if counted else None


def probe_rewards(samples) -> Tensor:
    """[B] 1.0 where a sample's first response token id is even: a reward any policy, random or not, can
    move toward, with variance in almost every group."""
    return torch.tensor([float(bool(s.token_ids) and s.token_ids[0] % 2 == 0) for s in samples])


def policy_gain(new_logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> float:
    """sum_i A_i * d_i / sum_i |A_i|, d_i = the mean change of sample i's response-token logprobs
    (new_logp - old_logp, both [B, T]; advantages [B]; mask [B, T]): > 0 when the update raised the
    positive-advantage samples relative to the negative ones."""
    d = ((new_logp - old_logp) * mask).sum(1) / mask.sum(1).clamp(min=1)  # [B]
    return float((advantages * d).sum() / advantages.abs().sum().clamp(min=1e-12))
