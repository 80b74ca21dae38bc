"""A step's batch as tensors, and the trainer's logprobs of it.

    input_ids, attention_mask, mask, rollout_logp = collate(samples, pad_id, length_multiple(mb, 128))
    old_logp = logprob_pass(model, input_ids, attention_mask, temperature, micro_batch=mb)   # [B, L]

Rows are right-padded prompt+response sequences; the logprob of token t sits at position t (0 at
prompt and pad positions). Every no-grad trainer logprob pass of the repo (old_logp, the KL
reference, the BF16 reference of a saved batch, the probe, analysis.py, bench/alignment.py) is
`logprob_pass`; the train phase's forward with grad is `token_logprobs` on one micro-batch.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fp8.calibrate import token_mask
from losses import collapse


def length_multiple(rows: int, tokens: int) -> int:
    """The batch length multiple that makes `rows` rows hold a multiple of `tokens` tokens."""
    return tokens // math.gcd(rows, tokens)


def collate(samples, pad_id: int, multiple: int = 1):
    """Samples -> right-padded prompt+response batch, its length L a multiple of `multiple`.

    Returns input_ids [B, L], attention_mask [B, L], mask [B, L] (1 on response tokens) and
    rollout_logp [B, L] (engine logprob of token t at position t; 0 elsewhere)."""
    L = -(-max(len(s.prompt_ids) + len(s.token_ids) for s in samples) // multiple) * multiple
    B = len(samples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L)
    rollout_logp = torch.zeros(B, L)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.token_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.token_ids)
        attention_mask[i, : p + r] = 1
        mask[i, p: p + r] = 1
        rollout_logp[i, p: p + r] = torch.tensor(s.logprobs)
    return input_ids, attention_mask, mask, rollout_logp


def micro_batches(n: int, size: int) -> list[slice]:
    """Slices of `size` rows (the last one shorter) covering n rows."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def by_length(attention_mask: Tensor, rows: Tensor, size: int, multiple: int = 1) -> list[tuple[Tensor, int]]:
    """`rows` (indices into the batch) as micro-batches of `size`, longest first, each with the length
    it needs: its longest row rounded up to `multiple` (at most the batch's L). Rows of like length
    share a micro-batch, so a batch of varied lengths (reasoning RL: a long tail up to the budget)
    computes little padding. The rows' order inside a mini-batch changes no sum but a float rounding."""
    lengths = attention_mask[rows].sum(1).tolist()  # one host sync
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
    L = attention_mask.shape[1]
    out = []
    for s in micro_batches(len(order), size):
        need = lengths[order[s.start]]
        out.append((rows[torch.tensor(order[s], device=rows.device)], min(L, -(-need // multiple) * multiple)))
    return out


def amp(mixed: bool):
    """The trainer's compute context: bf16 autocast over fp32 master weights on CUDA (mixed), else none."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()


def token_logprobs(model, input_ids, attention_mask, temperature: float, entropy: bool = False):
    """log p(token t | tokens < t) under log_softmax(logits / T), aligned to position t. [B, L]
    entropy=True: (logp, H) with H [B, L] the entropy (nats) of the distribution token t was drawn from.

    attention_mask must be right padding (collate's): under causal attention no real token then sees
    a pad, so the model runs without it (pad positions get finite values, masked out downstream).
    With it, HF builds a [B, 1, L, L] mask for any padded batch and SDPA leaves its causal flash
    kernel for a masked one that computes all L x L scores."""
    # no KV cache: nothing to reuse, and its per-layer state would make compiled layers recompile
    with token_mask(attention_mask):  # still keeps pads out of the q/k/v calibrator's amax
        logits = model(input_ids=input_ids, use_cache=False).logits  # [B, L, V]
    out, ent = [], []
    for row_logits, row_ids in zip(logits, input_ids):  # one row at a time: fp32 [L, V] stays small
        lp = torch.log_softmax(row_logits[:-1].float() / temperature, dim=-1)  # [L-1, V]
        out.append(lp.gather(-1, row_ids[1:, None]).squeeze(-1))  # [L-1]
        if entropy:
            ent.append(collapse.token_entropy(lp))  # [L-1]
    logp = torch.nn.functional.pad(torch.stack(out), (1, 0))  # [B, L]
    return (logp, torch.nn.functional.pad(torch.stack(ent), (1, 0))) if entropy else logp


@torch.no_grad()
def logprob_pass(model, input_ids, attention_mask, temperature: float, micro_batch: int, *,
                 entropy: bool = False, mixed: bool = False, device=None, forward_context=None, multiple: int = 1):
    """No-grad token_logprobs of a whole batch, micro_batch rows per forward (by_length: rows of like
    length together, each micro-batch cut to its own length, a multiple of `multiple`): logp [B, L], or
    (logp, entropy) [B, L] each with entropy=True (0 past a row's micro-batch length). mixed: amp().
    device: move each micro-batch there first (a batch kept on the CPU, scored on the GPU); the result
    stays where it was computed. forward_context: (rows, columns) index -> a context each micro-batch's
    forward runs in (routing.forward_context)."""
    B, L = input_ids.shape
    outs = None
    for rows, n in by_length(attention_mask, torch.arange(B, device=input_ids.device), micro_batch, multiple):
        ids, am = input_ids[rows, :n], attention_mask[rows, :n]
        if device is not None:
            ids, am = ids.to(device), am.to(device)
        with amp(mixed), (forward_context((rows, slice(0, n))) if forward_context else contextlib.nullcontext()):
            parts = token_logprobs(model, ids, am, temperature, entropy=entropy)
        parts = parts if entropy else (parts,)
        if outs is None:
            outs = [torch.zeros(B, L, dtype=p.dtype, device=p.device) for p in parts]
        for out, p in zip(outs, parts):
            out[rows.to(p.device), :n] = p
    return tuple(outs) if entropy else outs[0]


@dataclass
class StepBatch:
    """One step's training batch on this rank (B samples, L positions), as the phases fill it in."""
    prompts: list[dict]         # [B / n] the groups' prompts (each with "answer")
    samples: list               # [B] rollout.Sample, group by group
    texts: list[str]            # [B] decoded completions
    rewards: Tensor             # [B] float, what the advantages are made of
    correct: Tensor             # [B] float, the selected reward's verdict (reward/accuracy)
    keep: Tensor                # [B / n] bool: the group carries a gradient (dynamic sampling)
    advantages: Tensor          # [B] on the device
    input_ids: Tensor           # [B, L] long
    attention_mask: Tensor      # [B, L] long
    mask: Tensor                # [B, L] 1 on response tokens
    loss_mask: Tensor           # [B, L] the tokens the loss averages (mask of the kept groups)
    rollout_logp: Tensor        # [B, L] engine logprobs
    old_logp: Tensor | None = None  # [B, L] trainer logprobs of the behaviour weights
    ref_logp: Tensor | None = None  # [B, L] KL reference (loss.kl_coef > 0)
    routed_experts: Tensor | None = None  # [B, L, moe layers, k] int16 engine routing, -1 = none (routing.py)
    multiple: int = 1           # a micro-batch's length is a multiple of this (collate's; FP8 GEMMs' tokens)

    @property
    def answers(self) -> list[str]:
        return [self.prompts[s.prompt_index]["answer"] for s in self.samples]
