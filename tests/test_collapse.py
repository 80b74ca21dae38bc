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


def test_dynamic_sampling_keeps_ranks_in_lockstep(tmp_path):
    """filter on 2 gloo ranks reproduces the 1-rank run (the loss normalises over the kept tokens of the
    GLOBAL batch); resample on 2 ranks runs the same rounds on every rank and finishes (no rank waits
    in a collective the other never enters). lr 0.05 makes groups collapse within the 3 steps."""
    from test_distributed import by_step, launch

    extra = ["fp8.train=false", "fp8.rollout=false", "optim.lr=0.05", "optim.warmup_steps=0"]
    one = launch(tmp_path, "filter1", 1, [*extra, "train.dynamic_sampling=filter"])
    two = launch(tmp_path, "filter2", 2, [*extra, "train.dynamic_sampling=filter"])
    for key in ("reward/mean", "reward/kept_groups", "reward/zero_std_groups", "reward/distinct_answers"):
        assert by_step(one, key) == by_step(two, key), key
    assert min(by_step(one, "reward/kept_groups")) < 1  # some group was left out
    torch.testing.assert_close(by_step(two, "optim/grad_norm"), by_step(one, "optim/grad_norm"), rtol=1e-5, atol=0)
    torch.testing.assert_close(by_step(two, "policy/entropy"), by_step(one, "policy/entropy"), rtol=1e-5, atol=0)
    res = launch(tmp_path, "resample2", 2, [*extra, "train.dynamic_sampling=resample", "train.max_rollout_rounds=2"])
    rounds = by_step(res, "rollout/rounds")
    assert len(by_step(res, "reward/mean")) == 3 and 2 in rounds and set(rounds) <= {1, 2}


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


def test_entropy_bonus_keeps_a_collapsing_policy_exploring(tmp_path):
    """lr 0.05 collapses the tiny policy within 3 steps; the bonus (always on: the target is above any
    entropy) keeps its entropy higher, and the adaptive coefficient climbs by its step up to 1, across
    a resume too."""
    from test_distributed import by_step, launch

    extra = ["fp8.train=false", "fp8.rollout=false", "optim.lr=0.05", "optim.warmup_steps=0"]
    plain = launch(tmp_path, "plain", 1, extra)
    bonus = launch(tmp_path, "bonus", 1, [*extra, "loss.entropy_target=10", "loss.entropy_coef=0.5",
                                          "loss.entropy_coef_step=0.25"])
    assert by_step(bonus, "loss/entropy_coef") == [0.75, 1.0, 1.0]
    ent_plain, ent_bonus = by_step(plain, "policy/entropy"), by_step(bonus, "policy/entropy")
    assert ent_plain[0] == ent_bonus[0] and ent_bonus[-1] > ent_plain[-1] + 0.1, (ent_plain, ent_bonus)
    # the coefficient is run state: a run stopped after 2 steps and resumed goes on from 1.0, not 0.5
    from test_distributed import read, torchrun
    launch(tmp_path, "cut", 1, [*extra, "loss.entropy_target=10", "loss.entropy_coef=0.5",
                                "loss.entropy_coef_step=0.25", "train.steps=2"])
    torchrun(tmp_path, 1, "--resume", str(tmp_path / "cut"), "train.steps=3")
    assert by_step(read(tmp_path / "cut"), "loss/entropy_coef") == [0.75, 1.0, 1.0]
