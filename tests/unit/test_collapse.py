"""Collapse signals and dynamic sampling (losses/collapse.py), and their place in the loop."""

import math
from dataclasses import dataclass

import pytest
import torch

from config import ConfigError, load_config
from losses import collapse
from rollout import Sample


@dataclass
class TaggedSample(Sample):
    id: str = ""  # the id of the prompt the sample was drawn for


def make_round(rewards_by_group, texts_by_group=None, tag="r0"):
    """A Groups of len(rewards_by_group) prompts; prompt g is {'id': f'{tag}/{g}'} and its samples carry the
    prompt's id, so a test can check that prompt_index still points at the right prompt."""
    prompts, samples, texts, rewards = [], [], [], []
    for g, rs in enumerate(rewards_by_group):
        prompts.append({"id": f"{tag}/{g}", "prompt_ids": [g]})
        for j, r in enumerate(rs):
            samples.append(TaggedSample(g, [g], [j], [-0.5], "stop", id=f"{tag}/{g}"))
            texts.append(texts_by_group[g][j] if texts_by_group else str(j))
            rewards.append(float(r))
    r = torch.tensor(rewards)
    return collapse.Groups(prompts, samples, texts, r, (r > 0).float())


def ids(groups):
    assert all(groups.prompts[s.prompt_index]["id"] == s.id for s in groups.samples)
    return [p["id"] for p in groups.prompts]


def test_has_variance_and_distinct_answers():
    rewards = torch.tensor([1., 0., 1., 0., 0., 0., 1., 1., 1.])  # groups of 3: mixed, all 0, all 1
    assert collapse.has_variance(rewards, 3).tolist() == [True, False, False]
    texts = ["7", "7", "8", "3", "3", "3", "a", "b", "c"]
    assert collapse.distinct_answers(texts, 3).tolist() == [2.0, 1.0, 3.0]


def test_token_entropy_matches_categorical_and_survives_zero_probabilities():
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11)
    logits[0, 0, :5] = -math.inf  # p = 0 for some tokens: 0 log 0 counts 0, not NaN
    lp = torch.log_softmax(logits, -1)
    want = torch.distributions.Categorical(logits=logits).entropy()
    got = collapse.token_entropy(lp.clone())
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got).all()
    uniform = torch.log_softmax(torch.zeros(3, 11), -1)
    torch.testing.assert_close(collapse.token_entropy(uniform), torch.full((3,), math.log(11)))
    one_hot = torch.log_softmax(torch.tensor([[0., -math.inf, -math.inf]]), -1)
    assert collapse.token_entropy(one_hot).tolist() == [0.0]


def test_none_and_filter_keep_the_round_and_mark_the_groups():
    rnd = make_round([[1, 0], [0, 0], [1, 1], [0, 1]])
    groups, keep = collapse.assemble([rnd], 2, "none")
    assert groups is rnd and keep.tolist() == [True] * 4
    groups, keep = collapse.assemble([rnd], 2, "filter")
    assert groups is rnd and keep.tolist() == [True, False, False, True]


def test_resample_takes_groups_with_variance_from_later_rounds():
    r0 = make_round([[1, 0], [0, 0], [1, 1], [0, 1]], tag="r0")
    r1 = make_round([[0, 0], [1, 0], [1, 1], [1, 1]], tag="r1")
    r2 = make_round([[0, 1], [1, 0], [0, 0], [1, 0]], tag="r2")
    assert collapse.deficit([r0], 2) == 2 and collapse.deficit([r0, r1], 2) == 1 and collapse.deficit([r0, r1, r2], 2) == 0
    groups, keep = collapse.assemble([r0, r1, r2], 2, "resample")
    assert ids(groups) == ["r0/0", "r0/3", "r1/1", "r2/0"] and keep.tolist() == [True] * 4
    assert groups.rewards.tolist() == [1, 0, 0, 1, 1, 0, 0, 1]
    assert [s.prompt_index for s in groups.samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert collapse.has_variance(groups.rewards, 2).all()
    # short after the last round: zero-variance groups fill the batch (earliest first), not kept
    groups, keep = collapse.assemble([r0, r1], 2, "resample")
    assert ids(groups) == ["r0/0", "r0/3", "r1/1", "r0/1"] and keep.tolist() == [True, True, True, False]
    assert groups.texts == ["0", "1"] * 4 and groups.correct.tolist() == [1, 0, 0, 1, 1, 0, 0, 0]
    # a full first round needs no other
    full = make_round([[1, 0], [0, 1]])
    assert collapse.deficit([full], 2) == 0 and ids(collapse.assemble([full], 2, "resample")[0]) == ["r0/0", "r0/1"]


def test_config_knobs():
    cfg = load_config(None, [])
    assert cfg.train.dynamic_sampling == "none" and cfg.train.max_rollout_rounds >= 1
    with pytest.raises(ConfigError, match="train.dynamic_sampling"):
        load_config(None, ["train.dynamic_sampling=sometimes"])
    with pytest.raises(ConfigError, match="train.max_rollout_rounds"):
        load_config(None, ["train.max_rollout_rounds=0"])


def test_entropy_control_follows_the_target():
    """Skywork-OR1's rule: the coefficient climbs by `step` while entropy is below the target (the
    bonus on), falls by `step` above it (the bonus off), and stays within [0, 1]."""
    ctl = collapse.EntropyControl(target=0.5, step=0.1)
    assert [round(ctl(0.2), 6) for _ in range(3)] == [0.1, 0.2, 0.3]   # collapsing: bonus grows
    assert ctl(0.9) == 0.0 and round(ctl.coef, 6) == 0.2               # above target: off, decays
    assert [ctl(0.9) for _ in range(5)] == [0.0] * 5 and ctl.coef == 0.0
    ctl.coef = 0.95
    assert ctl(0.1) == 1.0                                             # clamped at 1


def test_entropy_bonus_raises_the_entropy():
    """The bonus's sign and its gradient: a step on -H alone raises the token entropy, and the
    grad-carrying entropy equals the in-place one the metrics use."""
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, requires_grad=True)                # [B, T, V]
    H = collapse.token_entropy(torch.log_softmax(logits, -1))           # [B, T] with grad
    assert torch.allclose(H.detach(), collapse.token_entropy(torch.log_softmax(logits.detach(), -1)))
    (-H.sum()).backward()
    with torch.no_grad():
        after = collapse.token_entropy(torch.log_softmax(logits - logits.grad, -1))
    assert after.mean() > H.mean() + 0.01


