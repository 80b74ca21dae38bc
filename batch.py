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
import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fp8.calibrate import token_mask
from losses import collapse


def length_multiple(rows: int, tokens: int) -> int:
    """The batch length multiple that makes `rows` rows hold a multiple of `tokens` tokens."""
    return tokens // math.gcd(rows, tokens)


def _flat(lists, count: int, dtype) -> Tensor:
    """The lists' elements end to end as one 1-D tensor (numpy reads a Python iterable several times
    faster than torch.tensor reads a list)."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=count))


def collate(samples, pad_id: int, multiple: int = 1):
    """Samples -> right-padded prompt+response batch, its length L a multiple of `multiple`.

    Returns input_ids [B, L], attention_mask [B, L], mask [B, L] (1 on response tokens) and
    rollout_logp [B, L] (engine logprob of token t at position t; 0 elsewhere). All rows are filled
    at once through boolean masks (row-major, as the tokens lie end to end): 512 samples of ~1,600
    tokens take ~0.06 s instead of a per-row loop's 0.22 s on a 2-core CPU, time every step waits."""
    bad = [i for i, s in enumerate(samples) if len(s.logprobs) != len(s.token_ids)]
    if bad:  # the fill below would shift every later row's logprobs
        s = samples[bad[0]]
        raise ValueError(f"collate: sample {bad[0]} has {len(s.logprobs)} logprobs for {len(s.token_ids)} response tokens")
    prompt = torch.tensor([len(s.prompt_ids) for s in samples])
    response_len = torch.tensor([len(s.token_ids) for s in samples])
    total = prompt + response_len
    L = -(-int(total.max()) // multiple) * multiple
    pos = torch.arange(L)[None, :]
    real = pos < total[:, None]                                   # [B, L] prompt + response
    response = real & (pos >= prompt[:, None])                    # [B, L] response
    input_ids = torch.full(real.shape, pad_id, dtype=torch.long)
    input_ids[real] = _flat((x for s in samples for x in (s.prompt_ids, s.token_ids)), int(total.sum()), np.int64)
    rollout_logp = torch.zeros(real.shape)
    rollout_logp[response] = _flat((s.logprobs for s in samples), int(response_len.sum()), np.float32)
    return input_ids, real.long(), response.float(), rollout_logp


def micro_batches(n: int, size: int) -> list[slice]:
    """Slices of `size` rows (the last one shorter) covering n rows."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def by_length(attention_mask: Tensor, rows: Tensor, size: int, multiple: int = 1, budget: int = 0,
              count: int = 0, align: int = 1) -> list[tuple[Tensor, int]]:
    """`rows` (indices into the batch) as micro-batches of `size`, longest first, each with the length
    it needs: its longest row rounded up to `multiple` (at most the batch's L). Rows of like length
    share a micro-batch, so a batch of varied lengths (reasoning RL: a long tail up to the budget)
    computes little padding. The rows' order inside a mini-batch changes no sum but a float rounding.

    budget > 0 (train.pack_micro_batches): as many rows per micro-batch as fit `budget` tokens at the
    micro-batch's length, at least one, instead of `size` rows; `multiple` is then a token multiple:
    each micro-batch's rows x length is one (its length rounded up to length_multiple(rows, multiple)),
    so the batch's L must be a multiple of `multiple`. count: split the micro-batches of the most rows
    until there are `count` (FSDP2's forwards are collective: every rank runs as many). align: every
    length also a multiple of this (compiled layers; the batch's L must be one too)."""
    lengths = attention_mask[rows].sum(1).tolist()  # one host sync
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
    L = attention_mask.shape[1]

    def length(start: int, stop: int) -> int:  # the micro-batch of order[start:stop]'s padded length
        m = math.lcm(length_multiple(stop - start, multiple) if budget else multiple, align)
        return min(L, -(-lengths[order[start]] // m) * m)

    spans = [(s.start, s.stop) for s in micro_batches(len(order), size)] if not budget else []
    start = 0
    while budget and start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * length(start, stop + 1) <= budget:
            stop += 1
        spans.append((start, stop))
        start = stop
    while len(spans) < count:  # halve the micro-batch of the most rows (count <= rows: always reachable)
        i = max(range(len(spans)), key=lambda j: spans[j][1] - spans[j][0])
        a, b = spans[i]
        if b - a < 2:
            raise ValueError(f"by_length: {count} micro-batches asked of {len(order)} rows")
        spans[i:i + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return [(rows[torch.tensor(order[a:b], device=rows.device)], length(a, b)) for a, b in spans]


def amp(mixed: bool):
    """The trainer's compute context: bf16 autocast over fp32 master weights on CUDA (mixed), else none."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()


LOGIT_CHUNK_BYTES = 512 << 20  # fp32 logits of one chunk of tokens: the largest [tokens, V] tensor the head makes


def _head_stats(z: Tensor, targets: Tensor, temperature: float, entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Per token of logits z [c, V] (compute dtype): log-normalizer, logit of the target, entropy (fp32)."""
    zf = z.float() / temperature
    lse = torch.logsumexp(zf, -1)
    tgt = zf.gather(1, targets[:, None])[:, 0]
    if not entropy:
        return lse, tgt, torch.zeros_like(lse)
    return lse, tgt, collapse.token_entropy(zf - lse[:, None])


def _head_grad(z: Tensor, lse: Tensor, ent: Tensor, g: Tensor, targets: Tensor, temperature: float,
               entropy: bool) -> Tensor:
    """d loss / d z for logits z [c, V] in z's dtype, g [c, 2] the gradients of (log p(target), entropy):
    ((onehot - p) g_logp - p (log p + H) g_H) / T."""
    lp = z.float() / temperature - lse[:, None]
    p = lp.exp()
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
    gz = (onehot.float() - p) * g[:, 0:1]
    if entropy:
        gz = gz - (p * (lp + ent[:, None])).nan_to_num(nan=0.0) * g[:, 1:2]
    return (gz / temperature).to(z.dtype)


@functools.cache
def _compiled(fn):
    """fn compiled, for CUDA: one pass over a chunk's logits instead of several in fp32; dynamic
    shapes, so the chunk sizes do not recompile."""
    return torch.compile(fn, dynamic=True)


class _HeadLogprobs(torch.autograd.Function):
    """out [N, 2] float32 = (log p(target), entropy) of each of N tokens under softmax(h @ W.T / T), the
    LM head and the log-softmax in one, a chunk of tokens at a time: no [N, V] tensor is kept, in
    forward or for backward. Saved: h [N, d] (in the compute dtype), W, the targets, and per token the
    log-normalizer and the entropy; backward recomputes each chunk's logits (one more LM-head GEMM).
    At 8B shape a 4 x 4096-token micro-batch (Qwen3's 152k vocabulary) otherwise keeps 10 GB of fp32
    log-softmax and its BF16 logits alive until backward.

    As the unfused path computes: logits in the compute dtype (autocast's, else h's), then fp32 / T; the
    log-normalizer by logsumexp instead of log_softmax's (equal up to fp32 rounding).
    d logp / dz = onehot - p; d H / dz = -p (log p + H). entropy_grad=False: the entropy is a metric the
    loss leaves out, and backward skips its term."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, temperature: float, entropy: bool,
                entropy_grad: bool = True) -> Tensor:
        dt = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
        hc, wc = h.to(dt), weight.to(dt)
        out, lse = torch.zeros(h.shape[0], 2, dtype=torch.float32, device=h.device), []
        stats = _compiled(_head_stats) if h.is_cuda else _head_stats
        for s in micro_batches(h.shape[0], _chunk(weight.shape[0])):
            lse_s, tgt, ent = stats(hc[s] @ wc.t(), targets[s], temperature, entropy)
            out[s, 0], out[s, 1] = tgt - lse_s, ent
            lse.append(lse_s)
        lse = torch.cat(lse)
        ctx.save_for_backward(hc, weight, targets, lse, out[:, 1].clone())
        ctx.temperature, ctx.entropy, ctx.h_dtype = temperature, entropy and entropy_grad, h.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hc, weight, targets, lse, ent = ctx.saved_tensors
        T, need_h, need_w = ctx.temperature, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        wc = weight.to(hc.dtype)
        grad_h = torch.empty(hc.shape, dtype=ctx.h_dtype, device=hc.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g = grad_out.float()
        grad = _compiled(_head_grad) if hc.is_cuda else _head_grad
        for s in micro_batches(hc.shape[0], _chunk(weight.shape[0])):
            gz = grad(hc[s] @ wc.t(), lse[s], ent[s], g[s], targets[s], T, ctx.entropy)  # [c, V]
            if need_h:
                grad_h[s] = gz @ wc
            if need_w and hc.is_cuda:  # cuBLAS adds the fp32 product into grad_w: no bf16 [V, d] product
                torch.addmm(grad_w, gz.t(), hc[s], out_dtype=torch.float32, out=grad_w)
            elif need_w:
                grad_w += gz.t() @ hc[s]
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def _chunk(other: int) -> int:
    """Rows of a [rows, other] fp32 tensor in LOGIT_CHUNK_BYTES."""
    return max(1, LOGIT_CHUNK_BYTES // (4 * other))


@contextlib.contextmanager
def fused_head(model, input_ids, temperature: float, entropy: bool, enabled: bool = True,
               entropy_grad: bool = True):
    """Inside: the model's LM head returns [B, L, 2] (log p of token t, entropy of its distribution)
    at position t (0 at t = 0) from _HeadLogprobs (entropy_grad: as there) instead of [B, L, V] logits;
    yields False (logits as usual) when not enabled and for a head other than a bias-free nn.Linear.
    The result goes out through the model's own output, so FSDP2's root hooks see the backward pass
    through it as through logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not enabled or type(head) is not torch.nn.Linear or head.bias is not None:
        yield False
        return

    def forward(h: Tensor) -> Tensor:
        B, L, d = h.shape
        out = _HeadLogprobs.apply(h[:, :-1].reshape(-1, d), head.weight, input_ids[:, 1:].reshape(-1),
                                  temperature, entropy, entropy_grad)
        return torch.nn.functional.pad(out.view(B, L - 1, 2), (0, 0, 1, 0))

    head.forward = forward
    try:
        yield True
    finally:
        del head.forward


def _one_sequence(position_ids: Tensor) -> None:
    return None


@contextlib.contextmanager
def rows_not_packed():
    """transformers, called without an attention mask, checks at every forward whether position_ids
    pack several sequences into a row (masking_utils.find_packed_sequence_indices), and reading the
    answer makes the host wait for the GPU: once per micro-batch, draining the GPU's queue each time
    (tests/gpu/test_host_syncs_gpu.py found it). Rows here never pack sequences (one right-padded
    sample each), so the answer is known: None. Swapped in for the forward only; left alone where the
    installed transformers has no such function."""
    from transformers import masking_utils

    check = getattr(masking_utils, "find_packed_sequence_indices", None)
    if check is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _one_sequence
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = check


def _logits_logprobs(logits: Tensor, targets: Tensor, temperature: float, entropy: bool,
                     entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """log p of targets [B, L-1] under log_softmax(logits[:, :-1] / T) of logits [B, L, V], in fp32, and
    with entropy its distribution's entropy [B, L-1] (entropy_grad=False: detached)."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    logp = lp.gather(-1, targets[..., None])[..., 0]
    return logp, (collapse.token_entropy(lp if entropy_grad else lp.detach()) if entropy else None)


@functools.cache
def _compiled_head(backend: str):
    """_logits_logprobs compiled once for any rows and length (the vocabulary static: token_logprobs marks
    it); Inductor fuses the fp32 passes over the bf16 logits and keeps only what backward needs. On an H100
    at 4 x 1,029 tokens and a 128,256 vocabulary: 18.4 against 28.0 ms forward and backward, row by row
    eager (docs/results.md, the LM head alone). A size of 1 is specialized: a 1-row micro-batch gets a
    graph of its own once."""
    # Inductor's memory-coalescing tiling analysis (an optional heuristic) fails an assertion on this graph's
    # symbolic sizes (torch 2.11, H100: tiling_utils.get_pw_red_splits); without it the graph compiles
    options = {"triton.coalesce_tiling_analysis": False} if backend == "inductor" else None
    return torch.compile(_logits_logprobs, backend=backend, dynamic=True, options=options)


def token_logprobs(model, input_ids, attention_mask, temperature: float, entropy: bool = False,
                   fused: bool = True, entropy_grad: bool = True, compile_head: str = "none"):
    """log p(token t | tokens < t) under log_softmax(logits / T), aligned to position t. [B, L]
    entropy=True: (logp, H) with H [B, L] the entropy (nats) of the distribution token t was drawn from;
    entropy_grad=False: H detached, a metric beside a loss that leaves it out (no graph kept for it).
    fused: the LM head and the log-softmax in one, chunk by chunk (_HeadLogprobs: faster without grad,
    and with grad it keeps no [B, L, V] tensor for backward, at the cost of recomputing the logits
    there); else [B, L, V] logits, then a per-row fp32 log-softmax, or with compile_head (a torch.compile
    backend, the trainer's train.compile) the whole micro-batch's log-softmax in one compiled function.

    attention_mask must be right padding (collate's): under causal attention no real token then sees
    a pad, so the model runs without it (pad positions get finite values, masked out downstream).
    With it, HF builds a [B, 1, L, L] mask for any padded batch and SDPA leaves its causal flash
    kernel for a masked one that computes all L x L scores."""
    # no KV cache: nothing to reuse, and its per-layer state would make compiled layers recompile
    # token_mask still keeps pads out of the q/k/v calibrator's amax
    with token_mask(attention_mask), rows_not_packed(), \
            fused_head(model, input_ids, temperature, entropy, fused, entropy_grad) as head_fused:
        out = model(input_ids=input_ids, use_cache=False).logits  # [B, L, 2] fused, else [B, L, V]
    if head_fused:
        ent = out[..., 1] if entropy_grad else out[..., 1].detach()
        return (out[..., 0], ent) if entropy else out[..., 0]
    if compile_head != "none":
        torch._dynamo.mark_static(out, 2)
        # the targets' own strides (a slice's would make dynamo guard on the full row's length)
        logp, ent = _compiled_head(compile_head)(out, input_ids[:, 1:].contiguous(), temperature, entropy,
                                                 entropy_grad)  # [B, L-1]
    else:
        lps, ents = [], []
        for row_logits, row_ids in zip(out, input_ids):  # one row at a time: fp32 [L, V] stays small
            lp = torch.log_softmax(row_logits[:-1].float() / temperature, dim=-1)  # [L-1, V]
            lps.append(lp.gather(-1, row_ids[1:, None]).squeeze(-1))  # [L-1]
            if entropy:  # a metric's (entropy_grad=False) a chunk of positions at a time: no second [L, V] buffer
                ents.append(collapse.token_entropy(lp) if entropy_grad else torch.cat(
                    [collapse.token_entropy(c) for c in lp.detach().split(_chunk(lp.shape[-1]))]))  # [L-1]
        logp, ent = torch.stack(lps), torch.stack(ents) if entropy else None  # [B, L-1]
    logp = torch.nn.functional.pad(logp, (1, 0))  # [B, L]
    return (logp, torch.nn.functional.pad(ent, (1, 0))) if entropy else logp


@torch.no_grad()
def logprob_pass(model, input_ids, attention_mask, temperature: float, micro_batch: int, *,
                 entropy: bool = False, mixed: bool = False, device=None, forward_context=None,
                 plan: list[tuple[Tensor, int]] | None = None):
    """No-grad token_logprobs of a whole batch, micro_batch rows per forward (by_length: rows of like
    length together, each micro-batch cut to its own length; or the given `plan` of by_length's (rows,
    length), the trainer's micro-batches): logp [B, L], or (logp, entropy) [B, L] each with entropy=True
    (0 past a row's micro-batch length). mixed: amp(). device: move each micro-batch there first (a batch
    kept on the CPU, scored on the GPU); the result stays where it was computed. forward_context: (rows,
    columns) index -> a context each micro-batch's forward runs in (routing.forward_context)."""
    B, L = input_ids.shape
    outs = None
    for rows, n in plan or by_length(attention_mask, torch.arange(B, device=input_ids.device), micro_batch):
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
    entropy: Tensor | None = None   # [B, L] their token entropy (policy/entropy); with old_logp, the first
                                    # mini-batch's rows filled by its training forward
    ref_logp: Tensor | None = None  # [B, L] KL reference (loss.kl_coef > 0)
    routed_experts: Tensor | None = None  # [B, L, moe layers, k] int16 engine routing, -1 = none (routing.py)
    multiple: int = 1           # a micro-batch's length is a multiple of this (collate's; FP8 GEMMs' tokens)
    align: int = 1              # and of this (Inductor-compiled layers: distributed.COMPILED_ALIGN)

    @property
    def answers(self) -> list[str]:
        return [self.prompts[s.prompt_index]["answer"] for s in self.samples]
