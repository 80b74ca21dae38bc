"""Policy collapse: the signals that show it, and DAPO's dynamic sampling that works against it.

A GRPO group whose n samples all get the same reward has advantage 0 on every sample
(losses/advantages.py): it carries no gradient. When the policy collapses onto one answer per
prompt, every group is such a group, the gradient is exactly 0 and the run stops learning for
good. The signals, logged every step (over the step's first rollout round), show it coming:

    reward/zero_std_groups   share of groups whose rewards are all equal          -> 1
    reward/unsolved_groups   share of groups without one right answer             -> 1 - accuracy
    reward/distinct_answers  mean number of distinct completion texts per group   -> 1
    policy/entropy           mean over response tokens of H(softmax(logits / T))  -> 0

zero_std_groups also rises in a run that learns (a group whose samples are all right has no
variance either): the collapse onto a wrong answer is zero_std_groups high with unsolved_groups
high too. policy/entropy is the trainer's, of the behaviour weights (the exact entropy of each
position's distribution, not the sampled-token estimate -mean(rollout_logp)): measured in the old_logp
pass over every row, or with train.old_logp=rollout in the first mini-batch's training forward, before
its optimizer step, over that mini-batch's rows.

Dynamic sampling (Yu et al. 2025, "DAPO", arXiv 2503.14476, section 3.2) keeps the gradient
alive by training only on groups with reward variance (`train.dynamic_sampling`):

    none      every group is trained on (zero-variance groups add tokens to the loss's
              denominator but no gradient, which shrinks the step as the policy collapses)
    filter    zero-variance groups are left out of the loss: their rows get loss mask 0, so the
              loss is normalised over the kept groups' tokens only
    resample  as filter, and more prompts are drawn and rolled out (up to
              train.max_rollout_rounds rounds per step) until the batch holds prompts_per_step
              groups with variance; the batch keeps its size: short of that after the last
              round, zero-variance groups fill it, masked out as under filter

Masking instead of dropping keeps the batch's shape fixed, so every rank runs the same micro-
and mini-batches (FSDP's collectives stay in lockstep) and nothing depends on how many groups
survive. Under resample every rank runs the same number of rounds (the loop stops when no rank
lacks groups), so engines of a tensor-parallel group generate together; each rank fills its own
share from its own groups (no rebalancing across ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

DYNAMIC_SAMPLING = ("none", "filter", "resample")


@dataclass
class Groups:
    """One rollout round of a rank: P prompts, their n samples each, scored. Samples are ordered
    group by group (sample k belongs to prompt k // n) and `prompt_index` points into `prompts`."""
    prompts: list[dict]   # [P]
    samples: list         # [P * n] rollout.Sample
    texts: list[str]      # [P * n] decoded completions
    rewards: Tensor       # [P * n] float
    correct: Tensor       # [P * n] float, 1.0 = right answer

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, groups: list[int]) -> Groups:
        """The groups at these indices, in this order (prompt_index renumbered)."""
        n = len(self.samples) // max(len(self.prompts), 1)
        rows = [g * n + j for g in groups for j in range(n)]
        samples = [replace(self.samples[r], prompt_index=k // n) for k, r in enumerate(rows)]
        return Groups([self.prompts[g] for g in groups], samples, [self.texts[r] for r in rows],
                      self.rewards[rows], self.correct[rows])


def has_variance(rewards: Tensor, n: int) -> Tensor:
    """rewards [P * n], group by group -> bool [P]: the group's rewards are not all equal (the
    groups whose advantages are not all 0)."""
    r = rewards.view(-1, n)                                      # [P, n]
    return r.max(1).values > r.min(1).values                     # [P]


def distinct_answers(texts: list[str], n: int) -> Tensor:
    """texts [P * n], group by group -> [P] float: the number of distinct completions per group
    (1 = the group's samples are identical, n = all differ)."""
    return torch.tensor([float(len(set(texts[i: i + n]))) for i in range(0, len(texts), n)])


def token_entropy(logp: Tensor) -> Tensor:
    """logp [..., V] (log_softmax) -> entropy in nats [...]: -sum_v p log p.

    Without grad: one extra [..., V] buffer, worked in place; 0 * log 0 counts 0 (exp(-inf) * -inf
    is NaN). With grad (an entropy bonus): out of place, so autograd keeps exp(logp)."""
    if logp.requires_grad:
        return -(logp.exp() * logp).nan_to_num(nan=0.0).sum(-1)   # [...]
    plogp = logp.exp().mul_(logp)                                 # [..., V]
    return -plogp.nan_to_num_(nan=0.0).sum(-1)                    # [...]


def concat(parts: list[Groups]) -> Groups:
    """Groups of several rounds as one (prompt_index renumbered)."""
    samples, offset = [], 0
    for part in parts:
        samples += [replace(s, prompt_index=s.prompt_index + offset) for s in part.samples]
        offset += len(part)
    return Groups([p for part in parts for p in part.prompts], samples, [t for part in parts for t in part.texts],
                  torch.cat([part.rewards for part in parts]), torch.cat([part.correct for part in parts]))


def assemble(rounds: list[Groups], n: int, mode: str) -> tuple[Groups, Tensor]:
    """The groups a step trains on and which of them carry a gradient.

    rounds: this rank's rollout rounds of the step, each of P groups. Returns (groups [P], keep
    bool [P]). none: round 0, all kept. filter: round 0, kept = has variance. resample: the
    first P groups with variance over all rounds (round 0's first), then, if fewer than P, the
    first zero-variance groups as filler, not kept."""
    if mode not in DYNAMIC_SAMPLING:
        raise ValueError(f"dynamic sampling mode {mode!r}; expected one of {DYNAMIC_SAMPLING}")
    first = rounds[0]
    if mode == "none":
        return first, torch.ones(len(first), dtype=torch.bool)
    if mode == "filter":
        return first, has_variance(first.rewards, n)
    var = [has_variance(rnd.rewards, n).tolist() for rnd in rounds]     # [rounds][P]
    pool = [(r, g) for r, v in enumerate(var) for g in range(len(v)) if v[g]]
    pool += [(r, g) for r, v in enumerate(var) for g in range(len(v)) if not v[g]]
    chosen = pool[:len(first)]
    return (concat([rounds[r].select([g]) for r, g in chosen]),
            torch.tensor([var[r][g] for r, g in chosen], dtype=torch.bool))


def deficit(rounds: list[Groups], n: int) -> int:
    """Groups with variance that resample still lacks for a full batch (0 = full)."""
    return max(0, len(rounds[0]) - sum(int(has_variance(rnd.rewards, n).sum()) for rnd in rounds))


@dataclass
class EntropyControl:
    """Skywork-OR1's adaptive entropy control (He et al. 2025, "Skywork Open Reasoner 1"): the
    entropy bonus's coefficient c rises by `step` while the policy's entropy is below `target` and
    falls by `step` while it is above, within [0, 1]; the bonus applies only below the target.
    So the bonus switches itself on as a collapse starts and off once exploration is back.

    coef: the state (checkpointed, so a resumed run continues the same schedule)."""
    target: float
    step: float
    coef: float = 0.0

    def __call__(self, entropy: float) -> float:
        """policy/entropy (nats, of the behaviour weights: this step's, or the previous step's under
        train.old_logp=rollout, trainer.entropy_coefficient) -> this step's coefficient."""
        self.coef = min(1.0, max(0.0, self.coef + (self.step if entropy < self.target else -self.step)))
        return self.coef if entropy < self.target else 0.0
