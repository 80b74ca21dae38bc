"""Dtype casts of one train micro-batch under bf16 autocast over fp32 master weights, counted by what they
cast: the trainer's GPU setting (batch.amp), on the CPU, where autocast casts the same tensors.

    python -m bench.casts                       # every decoder layer checkpointed, as the configs train
    python -m bench.casts --no-checkpointing

A dispatch mode sees every aten._to_copy of one micro-batch (token_logprobs with the unfused head, the
masked sum, backward) of a 2-layer Llama built from scratch, and sorts them: a weight cast to bf16 in the
forward, the same again in the backward (checkpointing's recompute), a weight-shaped bf16 -> fp32 cast in the
backward (the weight's gradient, back through autocast's cast); casts of activations and logits scale with
the tokens, not the weights, and are left out. Each is given as "weight passes": the elements cast over the
weights' elements, per weight kind (decoder layers, LM head; gradients over both), so it carries to any size;
--shape turns the passes into GB a micro-batch at a real model's dims (bench/rollout.py's MODELS). Writes
OUT/casts.json.
"""

import argparse
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.checkpoint import param_counts
from bench.rollout import ALIASES, MODELS
from bench.runner import RESULTS


class CastCount(TorchDispatchMode):
    """{(phase, what, from dtype, to dtype): elements} of every aten._to_copy under it; phase is set by the caller."""

    def __init__(self, weights: dict[int, str], shapes: set):
        super().__init__()
        self.weights, self.shapes, self.phase, self.counts = weights, shapes, "forward", {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype != args[0].dtype:
            x = args[0]
            what = self.weights.get(x.data_ptr()) or ("grad" if tuple(x.shape) in self.shapes
                                                       and out.dtype == torch.float32 else None)
            if what is None:  # an activation's or the logits'
                return out
            key = (self.phase, what, str(x.dtype).removeprefix("torch."), str(out.dtype).removeprefix("torch."))
            self.counts[key] = self.counts.get(key, 0) + x.numel()
        return out


def count(checkpointing: bool, rows: int = 2, length: int = 64) -> dict:
    """Weight passes of one train micro-batch: {"<phase> <what> <from>-><to>": passes}, weights by kind."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from batch import token_logprobs

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kind = {p.data_ptr(): ("head" if n.startswith("lm_head") else "layers")
            for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n}
    numel = {k: sum(p.numel() for p in model.parameters() if kind.get(p.data_ptr()) == k) for k in ("layers", "head")}
    ids = torch.randint(3, cfg.vocab_size, (rows, length))
    mode = CastCount(kind, {tuple(p.shape) for p in model.parameters() if p.data_ptr() in kind})
    with mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = token_logprobs(model, ids, torch.ones_like(ids), 1.0, fused=False).sum()
        mode.phase = "backward"
        loss.backward()
    out = {}
    for (phase, what, a, b), n in sorted(mode.counts.items()):
        per = numel.get(what, sum(numel.values()))  # gradients: over all weights
        out[f"{phase} {what} {a}->{b}"] = round(n / per, 3)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-checkpointing", action="store_true", help="no decoder layer checkpointed")
    p.add_argument("--shape", choices=sorted({*MODELS, *ALIASES}), default="llama3b",
                   help="the dims that turn weight passes into GB a micro-batch (default llama3b, bench/peer.py's)")
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    args = p.parse_args()
    passes = count(not args.no_checkpointing)
    m = MODELS[ALIASES.get(args.shape, args.shape)]
    h = m["hidden_size"]
    layer, _ = param_counts(m)  # a decoder layer's parameters, its two RMSNorm weights (not cast) among them
    numel = {"layers": m["num_hidden_layers"] * (layer - 2 * h), "head": m["vocab_size"] * h}
    gb = {}
    for key, n in passes.items():
        what, cast = key.split()[1], key.split()[2]
        src, dst = (2 if t == "bfloat16" else 4 for t in cast.split("->"))
        weights = numel.get(what, sum(numel.values()))
        gb[key] = round(n * weights * (src + dst) / 1e9, 2)  # bytes read + written
    result = {"checkpointing": not args.no_checkpointing, "weight_passes": passes, "shape": args.shape,
              "gb_per_micro_batch": gb}
    print(json.dumps(result, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "casts.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
