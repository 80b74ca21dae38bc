"""Collapse controls end to end: dynamic sampling on 1 and 2 ranks, the entropy bonus across a resume."""

import torch


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


def test_entropy_bonus_keeps_a_collapsing_policy_exploring(tmp_path):
    """lr 0.05 collapses the tiny policy within 3 steps; the bonus (always on: the target is above any
    entropy) keeps its entropy higher, and the adaptive coefficient climbs by its step up to 1, across
    a resume too. It steps on the previous step's entropy (this step's is measured in the training forward
    that needs it), so the first step runs without the bonus."""
    from test_distributed import by_step, launch

    extra = ["fp8.train=false", "fp8.rollout=false", "optim.lr=0.05", "optim.warmup_steps=0"]
    plain = launch(tmp_path, "plain", 1, extra)
    bonus = launch(tmp_path, "bonus", 1, [*extra, "loss.entropy_target=10", "loss.entropy_coef=0.5",
                                          "loss.entropy_coef_step=0.25"])
    assert by_step(bonus, "loss/entropy_coef") == [0.0, 0.75, 1.0]
    ent_plain, ent_bonus = by_step(plain, "policy/entropy"), by_step(bonus, "policy/entropy")
    assert ent_plain[0] == ent_bonus[0] and ent_bonus[-1] > ent_plain[-1] + 0.1, (ent_plain, ent_bonus)
    # the coefficient is run state: a run stopped after 2 steps and resumed goes on to 1.0, not from 0
    from test_distributed import read, torchrun
    launch(tmp_path, "cut", 1, [*extra, "loss.entropy_target=10", "loss.entropy_coef=0.5",
                                "loss.entropy_coef_step=0.25", "train.steps=2"])
    torchrun(tmp_path, 1, "--resume", str(tmp_path / "cut"), "train.steps=3")
    assert by_step(read(tmp_path / "cut"), "loss/entropy_coef") == [0.0, 0.75, 1.0]
