"""Mixture-of-experts routing: the engine's choices recorded, replayed in the trainer, compared; the aux loss.

A MoE model adds a mismatch dense models do not have: for the same token the engine (FP8, other
kernels) and the trainer can pick different top-k experts, and a different expert is a different
function, not a rounding difference. So:

* the engine records, per position it ran, each MoE layer's top-k expert ids
  (`rollout.Sample.routed_experts` [P + T - 1, layers, k]: prompt and response tokens, the last
  sampled token is never fed back; vLLM's CompletionOutput.routed_experts has the same layout);
* `moe.router_replay`: the trainer's old_logp and policy forwards use those ids instead of their own
  top-k, with the router weights recomputed from the trainer's logits over the replayed ids
  (models/<family>.py `replay_weights`), so gradients still reach the router ("routing replay", as in
  verl's R3 and NeMo RL's);
* `moe/routing_mismatch` (every step, old_logp pass): the share of (response token, MoE layer) pairs
  whose trainer top-k set differs from the engine's; `moe/routing_mismatch_tokens`: the share of
  response tokens with such a difference in any layer.
* `moe.aux_loss_coef`: the Switch-Transformer load-balancing loss over the routers of the policy forward.

Mechanism: one forward hook per router (models/<family>.py `router`, output (logits [N, E], weights
[N, k], ids [N, k]), N = batch x positions flattened row-major) reads what `prepare` put on it: the
engine's ids for these rows (-1 where it recorded none: the trainer then keeps its own), whether to
replay them, a mismatch tally, a list for the logits of the aux loss. The state stays until the next
`prepare` or `clear`, so activation checkpointing's recomputation in backward routes as the forward did.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from models import decoder_layers, family_of


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of `model` in layer order (its family's `router` in each decoder layer that has one)."""
    path = family_of(model).router
    if path is None:
        return []
    out = []
    for layer in decoder_layers(model):
        try:
            out.append(layer.get_submodule(path))
        except AttributeError:  # a dense layer of a MoE model
            pass
    return out


def is_moe(model: nn.Module) -> bool:
    return bool(routers(model))


@dataclass
class RoutingStats:
    """Tally of trainer-vs-engine top-k disagreement over the counted positions."""
    differ: float = 0.0  # (token, layer) pairs whose top-k sets differ
    pairs: float = 0.0
    tokens_differ: float = 0.0  # tokens whose top-k differs in any layer
    tokens: float = 0.0
    token_differ: Tensor | None = None  # [N] bool, of the forward in progress

    def metrics(self) -> dict[str, float]:
        return {"moe/routing_mismatch": self.differ / max(self.pairs, 1.0),
                "moe/routing_mismatch_tokens": self.tokens_differ / max(self.tokens, 1.0)}


@dataclass
class _RouterState:
    replay_ids: Tensor | None = None  # [N, k] long, the engine's ids (-1: none recorded)
    apply: bool = False  # use them (router replay) rather than only compare
    count: Tensor | None = None  # [N] bool, the rows the mismatch counts
    stats: RoutingStats | None = None
    logits: list | None = None  # [(logits [N, E], ids [N, k])] for the aux loss
    capture: list | None = None  # engine: ids [N, k] of every call
    replay_weights: object = None  # the family's (router, logits, ids) -> weights


def _hook(router: nn.Module, args, out):
    st: _RouterState = router._moe_routing
    logits, weights, ids = out
    if st.capture is not None:
        st.capture.append(ids.detach())
    if st.replay_ids is not None:
        if st.replay_ids.shape != ids.shape:
            raise RuntimeError(f"router replay: {tuple(st.replay_ids.shape)} engine ids for a forward of "
                               f"{tuple(ids.shape)} (routing.prepare was given other rows)")
        engine = st.replay_ids.to(ids.device)
        has = (engine >= 0).all(-1)  # [N] the engine routed this row
        if st.stats is not None:
            differ = (ids.sort(-1).values != engine.sort(-1).values).any(-1) & has & st.count
            st.stats.differ += float(differ.sum())
            st.stats.pairs += float((has & st.count).sum())
            st.stats.token_differ = differ if st.stats.token_differ is None else st.stats.token_differ | differ
        if st.apply:
            ids = torch.where(has[:, None], engine, ids)
            weights = st.replay_weights(router, logits, ids)
    if st.logits is not None:
        st.logits.append((logits, ids))
    return logits, weights, ids


def install(model: nn.Module) -> list[nn.Module]:
    """The routers, each with the routing hook (added once)."""
    rs = routers(model)
    for r in rs:
        if not hasattr(r, "_moe_routing"):
            r._moe_routing = _RouterState()
            r.register_forward_hook(_hook)
    return rs


@dataclass
class Routed:
    """What `prepare` set up for one forward: the aux-loss inputs it collects."""
    logits: list[list] = field(default_factory=list)  # per router [(logits, ids)], filled by the forward


def prepare(model: nn.Module, experts: Tensor | None, replay: bool, keep_logits: bool = False,
            count: Tensor | None = None, stats: RoutingStats | None = None) -> Routed | None:
    """Set the routers up for the next forward over rows [b, L] (None for a dense model).

    experts [b, L, layers, k] (the engine's ids, -1 = none) or None; replay: route by them; count
    [b, L] bool: the positions the mismatch counts (into stats); keep_logits: collect the aux loss's."""
    rs = install(model)
    if not rs:
        return None
    replay_weights = family_of(model).replay_weights
    routed = Routed()
    for j, r in enumerate(rs):
        ids = None if experts is None else experts[:, :, j].reshape(-1, experts.shape[-1]).long()
        routed.logits.append([] if keep_logits else None)
        r._moe_routing = _RouterState(ids, replay and ids is not None, None if count is None else count.reshape(-1).bool(),
                                      stats if ids is not None else None, routed.logits[-1],
                                      replay_weights=replay_weights)
    return routed


def clear(model: nn.Module) -> None:
    """Routers back to their own top-k, nothing recorded."""
    for r in install(model):
        r._moe_routing = _RouterState()


def forward_context(model: nn.Module, experts: Tensor | None, replay: bool, count: Tensor | None = None,
                    stats: RoutingStats | None = None):
    """For batch.logprob_pass: slice -> a context in which the forward over those rows is routed (None
    for a dense model or nothing to do); the tally of any-layer mismatches per token goes into stats."""
    if not is_moe(model) or experts is None:
        return None

    @contextlib.contextmanager
    def ctx(s: slice):
        prepare(model, experts[s], replay, count=None if count is None else count[s], stats=stats)
        try:
            yield
        finally:
            if stats is not None and count is not None:
                stats.tokens += float((count[s].bool() & (experts[s][:, :, 0, 0] >= 0)).sum())
                if stats.token_differ is not None:
                    stats.tokens_differ += float(stats.token_differ.sum())
                stats.token_differ = None
            clear(model)
    return ctx


@contextlib.contextmanager
def capture(model: nn.Module):
    """Engine side: yields [per router: [ids [N, k] of each forward call]] (None for a dense model)."""
    rs = install(model)
    if not rs:
        yield None
        return
    calls = [[] for _ in rs]
    for r, c in zip(rs, calls):
        r._moe_routing = _RouterState(capture=c)
    try:
        yield calls
    finally:
        clear(model)


def collate_routing(samples, length: int) -> Tensor | None:
    """The samples' recorded routing as [B, L, layers, k] int16 at the positions batch.collate puts their
    tokens (-1 elsewhere); None when no sample carries routing."""
    recs = [s.routed_experts for s in samples]
    if all(r is None for r in recs):
        return None
    shape = next(r for r in recs if r is not None).shape[1:]
    out = torch.full((len(samples), length, *shape), -1, dtype=torch.int16)
    for i, r in enumerate(recs):
        if r is not None:
            out[i, : r.shape[0]] = torch.as_tensor(r, dtype=torch.int16)
    return out


def load_balancing_loss(logits_ids: list[list], mask: Tensor) -> Tensor:
    """Switch-Transformer auxiliary loss (Fedus et al. 2021, eq. 4-6; HF's load_balancing_loss_func),
    over the routers' (logits [N, E], ids [N, k]) of one forward and the real tokens (mask [b, L]):
    E * sum_e f_e P_e, f_e = share of the tokens' top-k slots routed to e times k, P_e = mean router
    probability of e; averaged over layers. The ids are those the forward used (replayed or own)."""
    m = mask.reshape(-1).float()
    total = []
    for calls in logits_ids:
        for logits, ids in calls[-1:]:  # the last call: the recomputation of checkpointing repeats it
            m_, num_experts = m.to(logits.device), logits.shape[-1]
            probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
            counts = torch.zeros(num_experts, device=logits.device).index_add_(
                0, ids.reshape(-1), m_.repeat_interleave(ids.shape[-1]))
            tokens = m_.sum().clamp(min=1)
            total.append(num_experts * torch.sum(counts / tokens * (probs * m_[:, None]).sum(0) / tokens))
    return torch.stack(total).mean() if total else torch.zeros(())
