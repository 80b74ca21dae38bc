"""optimizer.py: every update of an fp32 weight stays within Adam's bound (~lr) under the 8-bit states the
8B configs use; probe.WeightChange measures it (optim/update_ratio_max) and observe.update_guard acts on it."""

import pytest
import torch

from config import OptimConfig
from errors import UserError
from optimizer import build_optimizer
from probe import WeightChange
from observe import update_guard

LR = 1e-5


def gradients(step: int) -> torch.Tensor:
    """A linear weight's gradient [256, 1024] = dy.T @ x with the spread of an LLM's: input features whose
    scales span 1e-4 .. 1 (entries of one 256-wide state block differ by up to 1e8 in g^2), and a quarter
    of them active on odd steps only (an MLP unit or a token that is absent from a batch)."""
    g = torch.Generator().manual_seed(0)
    scale = 10 ** (-4 * torch.rand(1024, generator=g))  # [1024]
    rare = torch.rand(1024, generator=g) < 0.25
    g.manual_seed(1 + step % 2)  # two alternating batches
    x = torch.randn(64, 1024, generator=g) * scale * (~rare | bool(step % 2))  # [64, 1024]
    dy = torch.randn(64, 256, generator=g) * 1e-3  # [64, 256]
    return dy.t() @ x


def update_ratios(name: str, steps: int = 6) -> list[float]:
    """max |dw| / lr of each optimizer step, one fp32 weight [256, 1024]."""
    w = torch.nn.Parameter(torch.randn(256, 1024, generator=torch.Generator().manual_seed(2)) * 0.02)
    opt = build_optimizer([w], OptimConfig(name=name, lr=LR, weight_decay=0.0))
    change = WeightChange(opt)
    ratios = []
    for step in range(steps):
        change.start()
        w.grad = gradients(step)
        opt.step()
        change.finish()
        ratios.append(change.worst[0])
    return ratios


@pytest.fixture(autouse=True)
def eager_torchao():
    """torchao compiles each parameter's update with inductor: the same arithmetic, 30 s a shape on 2 cores."""
    with torch._dynamo.config.patch(disable=True):
        yield


def test_adamw8bit_rms_stays_within_adams_bound():
    """torchao's AdamW8bit decodes the small second moments of a block to 0 and moves those weights by
    m / eps (tens of x lr here, thousands on real embeddings); storing sqrt(v) keeps every update
    near fp32 AdamW's. The first step never reads a stored v: 1.0 for all three."""
    fp32, ao8, rms = (update_ratios(n) for n in ("adamw", "adamw8bit", "adamw8bit_rms"))
    assert max(fp32) < 1.05 and max(rms) < 1.6, (fp32, rms)
    assert ao8[0] < 1.05 and max(ao8[1:]) > 5, ao8  # the behaviour optimizer.py replaces


def test_adamw8bit_rms_updates_follow_fp32_adamw():
    """Not only bounded: after 6 steps the weights are fp32 AdamW's to 10% of the distance moved (8-bit m: 5%)."""
    ws = []
    for name in ("adamw", "adamw8bit_rms"):
        w = torch.nn.Parameter(torch.zeros(256, 1024))
        opt = build_optimizer([w], OptimConfig(name=name, lr=LR, weight_decay=0.0))
        for step in range(6):
            w.grad = gradients(step)
            opt.step()
        ws.append(w.detach().clone())
    assert (ws[1] - ws[0]).norm() < 0.1 * ws[0].norm()
    state = opt.state[w]["exp_avg_sq"]
    assert type(state).__name__ == "OptimState8bit" and state.codes.dtype == torch.uint8  # still 8-bit


def test_update_guard_warns_then_stops():
    lines = []

    class Logger:
        print = staticmethod(lines.append)

    cfg = OptimConfig(update_ratio_warn=2.0, update_ratio_stop=50.0)
    update_guard(1.2, "w", 3, cfg, Logger)
    assert not lines
    update_guard(7.0, "model.embed_tokens.weight", 3, cfg, Logger)
    assert "optim/update_ratio_max=7" in lines[0] and "model.embed_tokens.weight" in lines[0]
    with pytest.raises(UserError, match=r"update_ratio_max=600 .*adamw8bit_rms"):
        update_guard(600.0, "w", 3, cfg, Logger)
    update_guard(600.0, "w", 3, OptimConfig(update_ratio_stop=0.0), Logger)  # 0: never stop
