"""The trainer's optimizer, chosen so that its updates survive at RL learning rates.

An Adam step moves a weight by about lr (the normalised update m / sqrt(v) is ~1). Stored in bf16,
a weight w only takes values on a grid of spacing ulp(w) = 2^(floor(log2 |w|) - 7); a round-to-nearest
update smaller than ulp(w) / 2 leaves w where it was. At |w| ~ 0.02 (the init scale of 8B models)
that threshold is ~6e-5, so at RL's lr 3e-7 .. 1e-6 almost nothing moves: ten AdamW steps at lr 3e-7
on a 4096 x 4096 bf16 weight of std 0.02 change 0.47% of its entries, in fp32 99.96%. This is a
learning-rate-to-magnitude effect, not a small-model one. Two maintained ways out:

* fp32 master weights (model.dtype=float32; forward/backward under bf16 autocast, and FSDP2's
  MixedPrecisionPolicy all-gathers them as bf16 over several GPUs, as torchtitan does). Every step
  moves every weight. Memory per parameter: 4 (weight) + 4 (grad) + 8 (torch AdamW's two fp32
  states) = 16 bytes, or 4 + 4 + 2 = 10 with `adamw8bit`.
* bf16 weights with stochastic rounding (optim.bf16_stochastic_round, torchao): each update is
  rounded up or down with the probabilities that keep its expectation, so small updates are kept on
  average; a single step changes only a share ~lr / ulp of the entries.

`adamw8bit` is torchao's AdamW8bit (states quantized block-wise to 8 bits with a per-block scale,
the bitsandbytes scheme): it is what lets one 141 GB GPU hold fp32 master weights of an 8B model
next to vLLM (32 + 32 + 16 = 80 GB while training; the gradients are freed before vLLM wakes).
"""

import torch

from config import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """cfg.name -> torch.optim.AdamW or torchao.optim.AdamW8bit over `params` (config.validate has
    already refused combinations whose updates round away)."""
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, **kw)
    from torchao.optim import AdamW8bit  # compiles its update with torch.compile (inductor)

    return AdamW8bit(params, bf16_stochastic_round=cfg.bf16_stochastic_round, **kw)
