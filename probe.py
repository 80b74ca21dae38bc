"""Checks that an optimizer step does what it should, on any model (random weights included).

* WeightChange: the share of trainable weights an optimizer step changed (optim/changed_frac). bf16
  weights under a round-to-nearest optimizer at RL learning rates change well under 1% (optimizer.py);
  fp32 master weights change ~all. Counted on up to `k` fixed entries per tensor, so it costs a few
  small gathers per step at 8B (exact for tensors of at most k entries).
* train.probe: rewards replaced by a synthetic one with variance in every group (probe_rewards), and
  after the step's updates one more no-grad forward over its batch: policy_gain says whether the
  policy moved toward the positive-advantage samples (> 0) or away (< 0).
"""

import torch
from torch import Tensor


def _local(p: Tensor) -> Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor: this rank's shard


class WeightChange:
    """Hooks on `optimizer`: before each step, k fixed entries of every trainable tensor are copied; after
    it, `frac` is the share of those with a non-zero gradient that the step changed (the last step's,
    over this rank's shards). Entries without a gradient, e.g. embedding rows of tokens absent from the
    batch, are not counted: no optimizer should move them on its first step."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 65536, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.index = [None if _local(p).numel() <= k else
                      torch.randperm(_local(p).numel(), generator=g)[:k].to(_local(p).device) for p in self.params]
        self.before, self.frac = None, float("nan")
        optimizer.register_step_pre_hook(lambda *_: self._snapshot())
        optimizer.register_step_post_hook(lambda *_: self._compare())

    def _sampled(self, t: Tensor, i: Tensor | None) -> Tensor:
        flat = _local(t).detach().reshape(-1)
        return flat if i is None else flat[i]

    @torch.no_grad()
    def _snapshot(self) -> None:
        self.before = [None if p.grad is None else (self._sampled(p, i).clone(), self._sampled(p.grad, i) != 0)
                       for p, i in zip(self.params, self.index)]

    @torch.no_grad()
    def _compare(self) -> None:
        kept = [(self._sampled(p, i), b) for p, i, b in zip(self.params, self.index, self.before) if b is not None]
        changed = sum(int(((now != old) & has_grad).sum()) for now, (old, has_grad) in kept)
        self.frac = changed / max(1, sum(int(has_grad.sum()) for _, (_, has_grad) in kept))
        self.before = None


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
