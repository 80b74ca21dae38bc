"""Hand-computed checks of losses/ (advantages, GRPO loss, IS corrections, the micro-batch objective,
mismatch metrics).

The variants' tests run over the registries (ADVANTAGE_REGISTRY, IS_REGISTRY, AGG_REGISTRY): a registered
variant without its row in the tables below fails them, and so does a row without a variant.
"""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from losses import grpo
from losses.advantages import (ADVANTAGE_ESTIMATORS, ADVANTAGE_REGISTRY, AdvantageConfig, compute_advantages,
                              group_advantages)
from losses.grpo import (AGG_REGISTRY, AGGS, IS_CORRECTIONS, IS_REGISTRY, LossConfig, LossInputs, MiniBatchTotals,
                         aggregate, grpo_loss, is_weights, micro_batch_loss)
from losses.mismatch import masked_mean, mismatch_metrics
from losses.registry import Registry

LN2, LN4 = math.log(2.0), math.log(4.0)
approx = lambda x: pytest.approx(x, rel=1e-5, abs=1e-6)  # noqa: E731


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def run(logp, old, rollout, adv, mask, ref=None, **cfg):
    """grpo_loss plus d loss / d logp."""
    logp = logp.clone().requires_grad_(True)
    loss, metrics = grpo_loss(logp, old, rollout, adv, mask, LossConfig(**cfg), ref_logp=ref)
    loss.backward()
    return loss.item(), metrics, logp.grad


# ---------------------------------------------------------------- advantages

def test_group_advantages_std_normalized():
    # group 0: [0, 0, 3]: mean 1, dev [-1, -1, 2], unbiased var (1 + 1 + 4) / 2 = 3 -> std sqrt(3)
    #   (a biased std, sqrt(2), would fail this)
    # group 1: [5, 5, 5]: all equal -> dev 0, std 0 -> 0 / (0 + eps) = 0, not NaN
    A = group_advantages(t([0, 0, 3, 5, 5, 5]), group_size=3)
    s = math.sqrt(3) + 1e-6
    assert A.tolist() == approx([-1 / s, -1 / s, 2 / s, 0, 0, 0])
    # eps is added to the std, not a floor: eps = 1 -> dev / (sqrt(3) + 1)
    A = group_advantages(t([0, 0, 3]), group_size=3, eps=1.0)
    assert A.tolist() == approx([-1 / (math.sqrt(3) + 1), -1 / (math.sqrt(3) + 1), 2 / (math.sqrt(3) + 1)])


def test_group_advantages_mean_only():
    # normalize_std=False: A = r - mean_g -> [-1, -1, 2] and [0, 0, 0]
    A = group_advantages(t([0, 0, 3, 5, 5, 5]), group_size=3, normalize_std=False)
    assert A.tolist() == approx([-1, -1, 2, 0, 0, 0])
    # group of one: nothing to compare with -> 0 (torch's unbiased std would be NaN)
    assert group_advantages(t([1, 2]), group_size=1).tolist() == [0.0, 0.0]


# rewards [0, 0, 3 | 5, 5, 5] in groups of 3 -> advantages, per estimator: [(cfg changes, expected A), ...]
S3 = math.sqrt(3) + 1e-6
ADVANTAGE_CASES = {
    "grpo": [(dict(), [-1 / S3, -1 / S3, 2 / S3, 0, 0, 0]),
             (dict(normalize_std=False), [-1, -1, 2, 0, 0, 0])],
}


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS)
def test_advantage_estimators(name):
    for changes, want in ADVANTAGE_CASES[name]:
        A = compute_advantages(t([0, 0, 3, 5, 5, 5]), 3, AdvantageConfig(estimator=name, **changes))
        assert A.tolist() == approx(want), changes


def test_group_advantages_errors():
    with pytest.raises(ValueError, match=r"group_size 4 does not divide the batch size B=6"):
        group_advantages(t([0, 0, 3, 5, 5, 5]), group_size=4)
    with pytest.raises(ValueError, match=r"rewards must be 1-D"):
        group_advantages(t([[0, 1]]), group_size=2)


# ---------------------------------------------------------------- importance correction
# ratio r = 1 (logp == old), A = -1 -> pg = max(-A r, -A clip r) = 1 on every token, so with
# token_mean over the 6 tokens: loss = mean(w) and d loss / d logp = w * (-A r) / 6 = w / 6.
# The grad therefore shows every token's weight.
# old = -1; rollout = old - ln(w_raw) so that w_raw = exp(old - rollout):
#   seq 0: w_raw = [0.5, 1, 3]    prod 1.5,   geometric mean 1.5^(1/3)  = 1.145
#   seq 1: w_raw = [0.1, 0.5, 1]  prod 0.05,  geometric mean 0.05^(1/3) = 0.368
W_RAW = [[0.5, 1.0, 3.0], [0.1, 0.5, 1.0]]
IS_CASES = {
    # name: [(cfg, expected w, truncated_frac), ...]
    "none": [(dict(), [[1, 1, 1], [1, 1, 1]], 0.0)],
    # min(w, 2): only the 3 is capped
    "tis": [(dict(is_cap=2.0), [[0.5, 1, 2], [0.1, 0.5, 1]], 1 / 6)],
    # keep 0.4 <= w <= 2: drops 3 and 0.1
    "icepop": [(dict(is_floor=0.4, is_cap=2.0), [[0.5, 1, 0], [0, 0.5, 1]], 2 / 6)],
    # seq 0 geo-mean 1.145 in [0.4, 1.2] keeps the raw w (3 stays 3); seq 1 0.368 < 0.4 -> 0
    #   (seq 0's product 1.5 would be out of the band: the test tells mean from sum)
    "seq_mask_tis": [(dict(is_floor=0.4, is_cap=1.2), [[0.5, 1, 3], [0, 0, 0]], 3 / 6)],
    "seq_tis": [
        # w_seq = min(prod, 2): 1.5 and 0.05, nothing capped
        (dict(is_cap=2.0), [[1.5] * 3, [0.05] * 3], 0.0),
        # cap 1.2: seq 0 -> 1.2 (its 3 tokens count as truncated), seq 1 stays 0.05
        (dict(is_cap=1.2), [[1.2] * 3, [0.05] * 3], 0.5)],
}


@pytest.mark.parametrize("name", IS_CORRECTIONS)
def test_is_corrections(name):
    for cfg, w, trunc in IS_CASES[name]:
        old = torch.full((2, 3), -1.0)
        rollout = old - torch.log(t(W_RAW))
        loss, m, grad = run(old, old, rollout, t([-1, -1]), torch.ones(2, 3), is_correction=name, **cfg)
        w = t(w)
        assert grad.flatten().tolist() == approx((w / 6).flatten().tolist())
        assert loss == approx(w.mean().item())
        assert m["loss/policy"] == approx(w.mean().item())
        assert m["is/weight_mean"] == approx(w.mean().item())
        assert m["is/truncated_frac"] == approx(trunc)
        assert m["is/nonfinite_frac"] == 0.0
        assert m["loss/clip_frac"] == 0.0


@pytest.mark.parametrize("name", IS_CORRECTIONS)
def test_is_corrections_leave_on_policy_tokens_alone(name):
    """Engine and trainer agree (raw weight 1 everywhere): every variant's default window keeps w = 1."""
    old = torch.full((2, 3), -1.0)
    w, truncated, nonfinite = is_weights(old, old.clone(), torch.ones(2, 3), LossConfig(is_correction=name))
    assert w.tolist() == [[1.0] * 3] * 2 and not truncated.any() and not nonfinite.any()


# Same setup, but seq 1's engine logprobs are [-1 - ln 1.5, NaN, -inf]:
#   w_raw seq 1 = [1.5, NaN, inf] -> the two non-finite tokens get w = 0 (2 of 6 tokens);
#   sequence-level modes give the whole of seq 1 weight 0.
NONFINITE_CASES = {
    "none": (dict(), [[1, 1, 1], [1, 1, 1]]),
    "tis": (dict(is_cap=2.0), [[0.5, 1, 2], [1.5, 0, 0]]),
    "icepop": (dict(is_floor=0.4, is_cap=2.0), [[0.5, 1, 0], [1.5, 0, 0]]),
    "seq_mask_tis": (dict(is_floor=0.4, is_cap=1.2), [[0.5, 1, 3], [0, 0, 0]]),
    "seq_tis": (dict(is_cap=2.0), [[1.5] * 3, [0, 0, 0]]),
}


@pytest.mark.parametrize("name", IS_CORRECTIONS)
def test_is_nonfinite_rollout_gets_zero_weight(name):
    cfg, w = NONFINITE_CASES[name]
    old = torch.full((2, 3), -1.0)
    rollout = t([[-1 + LN2, -1.0, -1 - math.log(3.0)], [-1 - math.log(1.5), math.nan, -math.inf]])
    loss, m, grad = run(old, old, rollout, t([-1, -1]), torch.ones(2, 3), is_correction=name, **cfg)
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    assert grad.flatten().tolist() == approx((t(w) / 6).flatten().tolist())
    assert m["is/nonfinite_frac"] == approx(2 / 6)
    assert m["is/weight_mean"] == approx(t(w).mean().item())


# ---------------------------------------------------------------- clipping, dual clip, gradient

def test_clipping_both_sides_and_gradient():
    # clip_low 0.2, clip_high 0.28 -> r clipped to [0.8, 1.28]; r = [0.5, 1, 1.5] in both rows
    # seq 0, A = +1: unclipped -r = [-0.5, -1, -1.5], clipped [-0.8, -1, -1.28]
    #   max -> [-0.5, -1, -1.28]; clipped branch active only at r = 1.5
    #   d/dlogp (pg = -A r, d r / d logp = r) -> [-0.5, -1, 0]
    # seq 1, A = -1: unclipped r = [0.5, 1, 1.5], clipped [0.8, 1, 1.28]
    #   max -> [0.8, 1, 1.5]; clipped branch active only at r = 0.5 -> grad [0, 1, 1.5]
    # loss = (-0.5 - 1 - 1.28 + 0.8 + 1 + 1.5) / 6 = 0.52 / 6; clip_frac = 2 / 6
    old = torch.full((2, 3), -1.0)
    logp = old + torch.log(t([[0.5, 1, 1.5], [0.5, 1, 1.5]]))
    loss, m, grad = run(logp, old, old, t([1, -1]), torch.ones(2, 3),
                        clip_low=0.2, clip_high=0.28, is_correction="none")
    assert loss == approx(0.52 / 6)
    assert m["loss/total"] == approx(0.52 / 6)
    assert m["loss/clip_frac"] == approx(2 / 6)
    assert m["loss/ratio_mean"] == approx(1.0)
    assert grad.flatten().tolist() == approx([-0.5 / 6, -1 / 6, 0, 0, 1 / 6, 1.5 / 6])


def test_dual_clip():
    # r = [0.5, 1, 5] in both rows, clip to [0.8, 1.2], dual_clip 3
    # seq 0, A = +1: max(-r, -clip r) = [-0.5, -1, -1.2]; dual clip only acts for A < 0
    # seq 1, A = -1: max(r, clip r) = [0.8, 1, 5] -> min(., -A * 3 = 3) -> [0.8, 1, 3]
    # loss = (-0.5 - 1 - 1.2 + 0.8 + 1 + 3) / 6 = 2.1 / 6; without dual clip (... + 5) = 4.1 / 6
    old = torch.full((2, 3), -1.0)
    logp = old + torch.log(t([[0.5, 1, 5], [0.5, 1, 5]]))
    args = (logp, old, old, t([1, -1]), torch.ones(2, 3))
    loss, m, grad = run(*args, is_correction="none", dual_clip=3.0)
    assert loss == approx(2.1 / 6)
    assert m["loss/dual_clip_frac"] == approx(1 / 6)
    assert grad[1].tolist() == approx([0, 1 / 6, 0])  # dual-clipped token: constant, no grad
    loss, m, grad = run(*args, is_correction="none")
    assert loss == approx(4.1 / 6)
    assert m["loss/dual_clip_frac"] == 0.0
    assert grad[1].tolist() == approx([0, 1 / 6, 5 / 6])


# ---------------------------------------------------------------- aggregation

# r = 1 and A[B, T] = -x, so the per-token loss is x and d loss / d logp = x * d agg / d token.
# seq 2 has no tokens at all; padding holds -inf / NaN logprobs that must not leak NaN.
X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
AGG_CASES = {
    # (1 + 2 + 4 + 5 + 6) / 5 = 18 / 5; each token weighs 1/5
    "token_mean": (18 / 5, [[1 / 5, 2 / 5, 0], [4 / 5, 5 / 5, 6 / 5], [0, 0, 0]]),
    # (mean(1, 2) + mean(4, 5, 6)) / 2 = (1.5 + 5) / 2; seq 0 tokens weigh 1/4, seq 1 1/6
    "seq_mean_token_mean": (3.25, [[1 / 4, 2 / 4, 0], [4 / 6, 5 / 6, 6 / 6], [0, 0, 0]]),
    # (3 + 15) / 2 = 9; every token weighs 1/2
    "seq_mean_token_sum": (9.0, [[1 / 2, 2 / 2, 0], [4 / 2, 5 / 2, 6 / 2], [0, 0, 0]]),
}


@pytest.mark.parametrize("agg", AGGS)
def test_aggregation_unequal_mask(agg):
    want_loss, want_grad = AGG_CASES[agg]
    old = torch.full((3, 3), -1.0)
    logp = old.clone()
    logp[0, 2] = math.nan
    old[0, 2] = -math.inf
    old[2] = math.nan
    rollout = old.clone()
    rollout[0, 2] = math.nan
    loss, m, grad = run(logp, old, rollout, -t(X), t(MASK), agg=agg, is_correction="tis")
    assert loss == approx(want_loss)
    assert m["loss/policy"] == approx(want_loss)
    assert m["is/nonfinite_frac"] == 0.0  # padding does not count
    assert torch.isfinite(grad).all()
    assert grad.flatten().tolist() == approx(t(want_grad).flatten().tolist())


def test_sequence_level_is_uses_masked_tokens_only():
    # one sequence, w_raw = [1.5, 1.5, 100] with the 100 on a padding token.
    # seq_mask_tis: geo-mean over the 2 masked tokens = 1.5 > cap 1.4 -> w = 0
    #   (averaging the padding in would give 1.5^(2/3) = 1.31 or worse, and keep it)
    # seq_tis: prod over masked tokens = 2.25 -> w = min(2.25, 3) = 2.25 on the masked tokens
    old = torch.full((1, 3), -1.0)
    rollout = old - torch.log(t([[1.5, 1.5, 100.0]]))
    args = (old, old, rollout, t([-1]), t([[1, 1, 0]]))
    _, m, grad = run(*args, is_correction="seq_mask_tis", is_cap=1.4)
    assert grad.tolist() == [[0, 0, 0]] and m["is/truncated_frac"] == 1.0
    _, m, grad = run(*args, is_correction="seq_tis", is_cap=3.0)
    assert grad.tolist() == [approx([2.25 / 2, 2.25 / 2, 0])]
    assert m["is/weight_mean"] == approx(2.25) and m["is/truncated_frac"] == 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_all_empty_mask_gives_zero_loss_with_grad(agg):
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, m = grpo_loss(logp, logp.detach(), logp.detach(), t([1, -1]), torch.zeros(2, 3),
                        LossConfig(agg=agg))
    loss.backward()
    assert loss.item() == 0.0 and loss.requires_grad
    assert logp.grad.abs().sum().item() == 0.0
    assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------- KL to reference

def test_kl_term():
    # A = 0 -> pg = 0. dr = ref - logp: seq 0 [ln 2, 0, -ln 2], seq 1 [0, x, x] (masked)
    # k3 = e^dr - dr - 1 = [2 - ln2 - 1, 0, 0.5 + ln2 - 1] -> sum (2 + 0.5 - 2) = 0.5 over 4 tokens
    # loss/kl = 0.5 / 4 = 0.125; total = 0.1 * 0.125
    # d k3 / d logp = 1 - e^dr = [-1, 0, 0.5] -> grad = 0.1 * [-1, 0, 0.5] / 4
    logp = torch.full((2, 3), -1.0)
    ref = logp + t([[LN2, 0, -LN2], [0, 9, 9]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    loss, m, grad = run(logp, logp, logp, t([0, 0]), mask, ref=ref, kl_coef=0.1)
    assert m["loss/kl"] == approx(0.125)
    assert m["loss/policy"] == 0.0
    assert loss == approx(0.0125) and m["loss/total"] == approx(0.0125)
    assert grad.flatten().tolist() == approx([-0.025, 0, 0.0125, 0, 0, 0])


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_sum_to_the_mini_batch_objective(agg):
    """micro_batch_loss over micro-batches of 1 and 3 rows sums to the 4-row mini-batch's grpo_loss, minus
    entropy_coef x the mean entropy over every response token, plus aux_coef x the aux losses weighted
    like the policy loss; the gradient is the same either way."""
    g = torch.Generator().manual_seed(0)
    old, rollout = -torch.rand(4, 5, generator=g), -torch.rand(4, 5, generator=g)
    logp0, entropy0 = -torch.rand(4, 5, generator=g), torch.rand(4, 5, generator=g)
    adv = torch.randn(4, generator=g)
    response = t([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    mask = response * t([[1], [1], [0], [1]])  # row 2: a group dynamic sampling left out
    aux = t([0.5, 2.0])  # one per micro-batch
    cfg, coef, aux_coef = LossConfig(agg=agg), 0.01, 0.1

    def total(splits):
        logp, entropy = logp0.clone().requires_grad_(True), entropy0.clone().requires_grad_(True)
        totals = MiniBatchTotals(mask.sum(), float(mask.amax(1).sum()), response.sum())
        outs = [micro_batch_loss(LossInputs(logp[s], old[s], rollout[s], adv[s], mask[s], entropy=entropy[s],
                                            response_mask=response[s], aux_loss=aux[i]), totals, cfg, coef, aux_coef)
                for i, s in enumerate(splits)]
        loss = sum(o.loss for o in outs)
        loss.backward()
        return loss.item(), [float(o.weight) for o in outs], logp.grad

    loss, weights, grad = total([slice(0, 1), slice(1, 4)])
    whole, _ = grpo_loss(logp0, old, rollout, adv, mask, cfg)
    bonus = coef * (entropy0 * response).sum() / response.sum()
    # a micro-batch's share: of the masked tokens (3 + 3) for a mean over tokens, of the rows (1 + 2) over sequences
    assert weights == approx({"tokens": [3 / 6, 3 / 6], "sequences": [1 / 3, 2 / 3]}[AGG_REGISTRY[agg].mean_over])
    assert loss == approx(whole.item() - bonus.item() + aux_coef * (weights[0] * 0.5 + weights[1] * 2.0))
    assert torch.allclose(grad, total([slice(0, 4)])[2], atol=1e-7)


# ---------------------------------------------------------------- mismatch metrics

def test_mismatch_metrics_by_hand():
    # d = train - rollout on the 3 valid tokens: [ln 2, 0, -ln 4]; rho = e^d = [2, 1, 0.25]
    # token [0, 2] has rollout -inf (in the mask: non-finite, left out, 1 of 4 masked tokens)
    # tokens [1, 1], [1, 2] are padding (d = 9 would otherwise dominate max_abs_diff)
    train = torch.full((2, 3), -2.0)
    rollout = train - t([[LN2, 0, 0], [-LN4, 9, 9]])
    rollout[0, 2] = -math.inf
    mask = t([[1, 1, 1], [1, 0, 0]])
    m = mismatch_metrics(train, rollout, mask)
    assert m["token_mult_prob_error"] == approx((2 + 1 + 4) / 3)     # e^|d|
    assert m["kl"] == approx((-LN2 + 0 + LN4) / 3)                   # mean(rollout - train)
    assert m["k3_kl"] == approx(((2 - 1 - LN2) + 0 + (0.25 - 1 + LN4)) / 3)  # rho - 1 - d
    assert m["chi2_token"] == approx((4 + 1 + 0.0625) / 3 - 1)       # mean(rho^2) - 1
    assert m["max_abs_diff"] == approx(LN4)
    assert m["mean_abs_diff"] == approx((LN2 + 0 + LN4) / 3)
    assert m["ratio_mean"] == approx(3.25 / 3)
    assert m["nonfinite_frac"] == approx(1 / 4)
    assert all(type(v) is float for v in m.values())


def test_mismatch_identical_and_empty():
    x = t([[-1.0, -2.0], [-0.5, -3.0]])
    m = mismatch_metrics(x, x.clone(), torch.ones(2, 2))
    assert m["token_mult_prob_error"] == 1.0 and m["kl"] == 0.0 and m["k3_kl"] == 0.0
    assert m["chi2_token"] == approx(0.0) and m["max_abs_diff"] == 0.0
    m = mismatch_metrics(x, x + 5, torch.zeros(2, 2))  # nothing masked in: no NaN
    assert all(math.isfinite(v) for v in m.values())
    assert m["max_abs_diff"] == 0.0 and m["token_mult_prob_error"] == 1.0


def test_masked_mean():
    x = t([[1.0, math.nan], [3.0, 5.0]])
    mask = t([[1, 0], [1, 1]])
    assert masked_mean(x, mask).item() == 3.0                        # (1 + 3 + 5) / 3
    assert masked_mean(x, mask, dim=-1).tolist() == [1.0, 4.0]
    assert masked_mean(x, torch.zeros(2, 2), dim=-1).tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- metrics and errors

def test_metric_names_and_types():
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    _, m = grpo_loss(logp, logp.detach(), logp.detach(), t([1, -1]), torch.ones(2, 3),
                     LossConfig())
    for key in ["loss/policy", "loss/kl", "loss/total", "loss/clip_frac", "is/weight_mean",
                "is/truncated_frac", "is/nonfinite_frac"]:
        assert type(m[key]) is float, key


# ---------------------------------------------------------------- registries

ROOT = Path(__file__).resolve().parents[2]
REGISTRIES = {"advantage.estimator": (ADVANTAGE_REGISTRY, [ADVANTAGE_CASES]),
              "loss.is_correction": (IS_REGISTRY, [IS_CASES, NONFINITE_CASES]),
              "loss.agg": (AGG_REGISTRY, [AGG_CASES])}


@pytest.mark.parametrize("key", REGISTRIES)
def test_every_variant_has_its_test_rows(key):
    registry, tables = REGISTRIES[key]
    assert registry.key == key
    for table in tables:
        assert set(table) == set(registry), f"{key}: test rows {sorted(table)} vs registered {sorted(registry)}"


@pytest.mark.parametrize("key", REGISTRIES)
def test_docs_name_every_variant(key):
    """docs/design.md's contract names every registered variant ("tis" | ...), and losses/grpo.py's docstring
    gives each IS correction and aggregation its line."""
    registry, _ = REGISTRIES[key]
    design = (ROOT / "docs/design.md").read_text()
    assert [n for n in registry if f'"{n}"' not in design] == [], f"{key}: not in docs/design.md"
    if key.startswith("loss."):
        assert [n for n in registry if not re.search(rf"^ +{n} ", grpo.__doc__, re.M)] == [], key


def test_registry_dispatch_is_exhaustive():
    reg = Registry("loss.example", mean_over=("tokens", "sequences"))

    @reg.register("a", mean_over="tokens")
    def a():
        """x = 1"""

    for attrs in [{}, {"mean_over": "rows"}]:  # a required attribute missing or not allowed: refused at once
        with pytest.raises(ValueError, match=r"loss.example: 'c' registers mean_over="):
            reg.register("c", **attrs)(lambda: None)
    assert "c" not in reg

    assert reg["a"] is a and a.mean_over == "tokens" and reg.choices() == "'a'"
    with pytest.raises(ValueError, match=r"loss.example='b' is not registered; expected one of 'a'"):
        reg["b"]
    with pytest.raises(ValueError, match=r"loss.example: 'a' is registered twice"):
        reg.register("a")(lambda: None)
    # the loss's own dispatch, past LossConfig's checks
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"loss.is_correction='tiss' is not registered; expected one of 'none', 'tis'"):
        is_weights(x, x, x, SimpleNamespace(is_correction="tiss"))
    with pytest.raises(ValueError, match=r"loss.agg='mean' is not registered; expected one of 'token_mean'"):
        aggregate(x, x, "mean")
    with pytest.raises(ValueError, match=r"advantage.estimator='rloo' is not registered; expected one of 'grpo'"):
        compute_advantages(t([0, 1]), 2, AdvantageConfig(estimator="rloo"))


def test_config_errors():
    with pytest.raises(ValueError, match=r"is_correction='tiss'.*'none', 'tis', 'icepop'"):
        LossConfig(is_correction="tiss")
    with pytest.raises(ValueError, match=r"agg='mean'.*'token_mean', 'seq_mean_token_mean'"):
        LossConfig(agg="mean")
    with pytest.raises(ValueError, match=r"dual_clip=0.5 must be > 1"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match=r"is_floor <= is_cap"):
        LossConfig(is_floor=3.0, is_cap=2.0)


def test_shape_errors():
    x, mask, cfg = torch.zeros(2, 3), torch.ones(2, 3), LossConfig()
    with pytest.raises(ValueError, match=r"old_logp has shape \[2, 4\] but logp has shape \[2, 3\]"):
        grpo_loss(x, torch.zeros(2, 4), x, t([1, 1]), mask, cfg)
    with pytest.raises(ValueError, match=r"mask has shape \[3, 3\]"):
        grpo_loss(x, x, x, t([1, 1]), torch.ones(3, 3), cfg)
    with pytest.raises(ValueError, match=r"ref_logp has shape \[2\]"):
        grpo_loss(x, x, x, t([1, 1]), mask, cfg, ref_logp=torch.zeros(2))
    with pytest.raises(ValueError, match=r"advantages has shape \[3\]; expected \[B\]=\[2\]"):
        grpo_loss(x, x, x, t([1, 1, 1]), mask, cfg)
    with pytest.raises(ValueError, match=r"kl_coef=0.1 needs ref_logp"):
        grpo_loss(x, x, x, t([1, 1]), mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match=r"shape mismatch: train_logp \[2, 3\], rollout_logp \[2, 2\]"):
        mismatch_metrics(x, torch.zeros(2, 2), mask)
