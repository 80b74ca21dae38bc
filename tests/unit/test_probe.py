"""probe.py: the share of weights a step moves, and the direction of the update."""

import pytest
import torch

from probe import WeightChange, policy_gain


@pytest.mark.parametrize("dtype,lr,expect", [(torch.float32, 3e-7, (0.99, 1.0)), (torch.bfloat16, 3e-7, (0.0, 0.02)),
                                             (torch.bfloat16, 1e-3, (0.99, 1.0))])
def test_weight_change_sees_updates_rounded_away(dtype, lr, expect):
    """AdamW at an RL learning rate moves every fp32 weight and almost no bf16 one (half a bf16 ulp at
    |w| ~ 0.02 is 6e-5); a sampled tensor (k < numel) and a whole one agree; rows without a gradient
    are not counted."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 256).to(dtype)
    lin = torch.nn.Linear(256, 512, bias=False).to(dtype)
    for w in (emb.weight, lin.weight):
        torch.nn.init.normal_(w, std=0.02)
    opt = torch.optim.AdamW([*emb.parameters(), *lin.parameters()], lr=lr)
    changes = [WeightChange(opt, k=k) for k in (4096, 10 ** 6)]
    for c in changes:
        c.start()
    for _ in range(2):  # two optimizer steps in one training step; tokens 0..31 only: rows 32.. get no gradient
        opt.zero_grad()
        lin(emb(torch.randint(0, 32, (8, 16)))).float().pow(2).mean().backward()
        opt.step()
    fracs = [c.finish() for c in changes]
    assert all(expect[0] <= f <= expect[1] for f in fracs) and abs(fracs[0] - fracs[1]) < 0.02, fracs


def test_policy_gain_sign():
    old = torch.zeros(4, 3)
    mask = torch.tensor([[0, 1, 1]] * 4).float()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    toward = old + adv[:, None] * 0.1  # positive-advantage samples up, negative ones down
    assert policy_gain(toward, old, adv, mask) == pytest.approx(0.1)
    assert policy_gain(old - adv[:, None] * 0.1, old, adv, mask) == pytest.approx(-0.1)
