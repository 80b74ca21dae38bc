"""The LM head's log-probabilities in the training forward, three ways: time, memory and agreement.

    python -m bench.head --shape llama3b --rows 4 --length 1029       # the peer workload's micro-batch
    python -m bench.head --shape llama3.1-8b --rows 4 --length 4128   # the long 8B step's

What the train pass does after the last decoder layer, alone: hidden states h [rows, length, d] (bf16, with
grad) through the LM head (fp32 master weight under bf16 autocast, as the trainer runs on CUDA), the
chosen tokens' log p (with --entropy also the entropy, with grad, as under an entropy bonus: the quickstart's;
the 8B configs and the peer workload have none), then a loss over them and backward.
The first two variants are batch.token_logprobs itself, through a model that is only the head:

  unfused   [rows, length, V] bf16 logits, then per row an fp32 log-softmax and its gather (train.fused_head
            false, every shipped config): autograd keeps the fp32 log-softmax for backward
  fused     batch._HeadLogprobs (train.fused_head true): the head and the log-softmax chunk by chunk, nothing
            [tokens, V] kept, the logits recomputed in backward (one more head GEMM)
  compiled  the unfused math over the whole micro-batch in one torch.compile'd function: Inductor fuses the
            fp32 work into the passes over the bf16 logits and chooses what backward keeps; compiled for the
            one shape timed
  compiled_lengths  token_logprobs(compile_head="inductor"), what the train pass runs where train.compile
            resolves to inductor: the same math compiled once for any rows and length (the vocabulary static);
            its row says how many graphs a second, shorter micro-batch compiled (recompiles: 0 is what the
            trainer needs)

Each variant: median ms of forward + backward (CUDA events; perf_counter on the CPU), peak memory above the
inputs (CUDA), and the largest difference of its log p, entropy, grad h and grad W from `unfused`'s. Writes
OUT/head.json. The byte arithmetic that motivates it is in docs/peer.md (the train phase against TRL's).
"""

import argparse
from types import SimpleNamespace

import torch
from torch._dynamo.utils import counters

from batch import _logits_logprobs, token_logprobs
from bench.rollout import ALIASES, MODELS
from bench.runner import RESULTS, cuda_time_ms, parse_choices, say, write_results

VARIANTS = ("unfused", "fused", "compiled", "compiled_lengths")


class HeadOnly(torch.nn.Module):
    """A causal LM that is only its head, as batch.token_logprobs calls a model: fixed hidden states h
    [B, L, d] (a leaf with grad) through lm_head."""

    def __init__(self, h: torch.Tensor, head: torch.nn.Linear):
        super().__init__()
        self.h, self.lm_head = h, head

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.lm_head(self.h))


# the train pass's math (batch._logits_logprobs), compiled for the one shape timed. With dynamic=True Inductor's
# Triton tiling analysis fails an assertion (tiling_utils.get_pw_red_splits, H100, torch 2.11):
# batch._compiled_head, the trainer's, turns that analysis off
_compiled_logprobs = torch.compile(_logits_logprobs, dynamic=False)


def head_logprobs(variant: str, model: HeadOnly, ids: torch.Tensor, temperature: float, entropy: bool) -> list:
    """[log p] or [log p, entropy], each [B, L] with grad and 0 at position 0, as token_logprobs returns them."""
    if variant != "compiled":
        out = token_logprobs(model, ids, torch.ones_like(ids), temperature, entropy=entropy, fused=variant == "fused",
                             compile_head="inductor" if variant == "compiled_lengths" else "none")
        return list(out) if entropy else [out]
    logp, ent = _compiled_logprobs(model(ids).logits, ids[:, 1:], temperature, entropy, True)
    return [torch.nn.functional.pad(x, (1, 0)) for x in (logp, *([ent] if entropy else []))]


def measure(variant: str, model: HeadOnly, ids: torch.Tensor, temperature: float, entropy: bool, mixed: bool,
            iters: int) -> dict:
    """One variant: its outputs and gradients (for the agreement check), its ms and peak memory."""
    coef = torch.linspace(-1, 1, ids.numel(), device=ids.device).view(ids.shape)  # stands in for advantages

    def step():
        model.h.grad = model.lm_head.weight.grad = None
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=mixed):
            logp, *ent = head_logprobs(variant, model, ids, temperature, entropy)
        ((logp * coef).sum() + sum(1e-3 * e.sum() for e in ent)).backward()
        return logp.detach(), (ent[0] if ent else torch.zeros_like(logp)).detach()

    logp, ent = step()
    out = {"variant": variant, "logp": logp, "entropy": ent, "grad_h": model.h.grad.clone(),
           "grad_w": model.lm_head.weight.grad.clone()}
    if ids.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out["ms"] = round(cuda_time_ms(step, warmup=2, iters=iters), 2)
    if ids.is_cuda:
        out["peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
    if variant == "compiled_lengths":  # a row fewer and about half the length: a new graph? (Dynamo specializes
        # a size of 1, so a 1-row micro-batch gets a graph of its own once; 2 rows stay 2)
        rows, length = max(2, ids.shape[0] - 1) if ids.shape[0] > 1 else 1, max(2, ids.shape[1] // 2)
        graphs = counters["stats"]["unique_graphs"]
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=mixed):
            logp, *_ = head_logprobs(variant, HeadOnly(model.h[:rows, :length], model.lm_head),
                                     ids[:rows, :length].contiguous(),  # as a micro-batch's own ids: their strides
                                     temperature, entropy)
        logp.sum().backward()
        out["recompiles"] = counters["stats"]["unique_graphs"] - graphs
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3b", choices=sorted({*MODELS, *ALIASES}),
                   help="the model whose hidden size and vocabulary the head takes (bench/rollout.py MODELS)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--length", type=int, default=1029, help="tokens per row (prompt + response)")
    p.add_argument("--variants", type=lambda t: parse_choices(t, VARIANTS), default=list(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)} (agreement is against unfused, always run first)")
    p.add_argument("--entropy", action="store_true", help="the entropy too, with grad (an entropy bonus)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--hidden", type=int, help="override the shape's hidden size (small CPU runs)")
    p.add_argument("--vocab", type=int, help="override the shape's vocabulary (small CPU runs)")
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    args = p.parse_args(argv)
    spec = MODELS[ALIASES.get(args.shape, args.shape)]
    d, V = args.hidden or spec["hidden_size"], args.vocab or spec["vocab_size"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mixed = device.type == "cuda"  # the trainer's bf16 autocast over fp32 master weights (batch.amp)
    torch.manual_seed(0)
    head = torch.nn.Linear(d, V, bias=False, device=device)
    h = (torch.randn(args.rows, args.length, d, device=device) * 2).to(torch.bfloat16 if mixed else torch.float32)
    model = HeadOnly(h.requires_grad_(), head)
    ids = torch.randint(0, V, (args.rows, args.length), device=device)
    workload = (f"{args.rows} rows x {args.length} tokens, hidden {d}, vocabulary {V}"
                + (", entropy" if args.entropy else ""))
    say(f"[head] {workload} on {device}")
    variants = ["unfused", *[v for v in args.variants if v != "unfused"]]
    keys, ref, runs = ("logp", "entropy", "grad_h", "grad_w"), None, []
    for variant in variants:
        r = measure(variant, model, ids, args.temperature, args.entropy, mixed, args.iters)
        tensors = {k: r.pop(k).float() for k in keys}
        ref = ref or tensors
        r.update({f"max_diff_{k}": float((tensors[k] - ref[k]).abs().max()) for k in keys})  # against unfused
        runs.append({"workload": workload, **r})
        say(f"[head] {variant}: {r['ms']} ms" + (f", peak {r['peak_gib']} GiB" if "peak_gib" in r else "")
            + ", max |diff| from unfused: " + ", ".join(f"{k} {r['max_diff_' + k]:.2e}" for k in keys)
            + (f", graphs a shorter micro-batch compiled: {r['recompiles']}" if "recompiles" in r else ""))
    path = write_results("head", runs, args.out)
    say(f"[head] wrote {path}")
    return runs


if __name__ == "__main__":
    main()
