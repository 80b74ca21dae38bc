"""The trainer's optimizer, chosen so that its updates survive at RL learning rates and stay within
Adam's bound.

An Adam step moves a weight by about lr (the normalised update m / sqrt(v) is ~1). Stored in bf16,
a weight w only takes values on a grid of spacing ulp(w) = 2^(floor(log2 |w|) - 7); a round-to-nearest
update smaller than ulp(w) / 2 leaves w where it was. At |w| ~ 0.02 (the init scale of 8B models)
that threshold is ~6e-5, so at RL's lr 3e-7 .. 1e-6 almost nothing moves: ten AdamW steps at lr 3e-7
on a 4096 x 4096 bf16 weight of std 0.02 change 0.47% of its entries, in fp32 99.96%. This is a
learning-rate-to-magnitude effect, not a small-model one. Two maintained ways out:

* fp32 master weights (model.dtype=float32; forward/backward under bf16 autocast, and FSDP2's
  MixedPrecisionPolicy all-gathers them as bf16 over several GPUs, as torchtitan does). Every step
  moves every weight. Memory per parameter: 4 (weight) + 4 (grad) + 8 (torch AdamW's two fp32
  states) = 16 bytes, or 4 + 4 + 2 = 10 with an 8-bit AdamW.
* bf16 weights with stochastic rounding (optim.bf16_stochastic_round, torchao): each update is
  rounded up or down with the probabilities that keep its expectation, so small updates are kept on
  average; a single step changes only a share ~lr / ulp of the entries.

8-bit states (what lets one 141 GB GPU hold fp32 master weights of an 8B model next to vLLM: 32 + 32
+ 16 = 80 GB while training; the gradients are freed before vLLM wakes). torchao's AdamW8bit
(`adamw8bit`) stores m and v in blocks of 256 entries, each entry an 8-bit code of a dynamic-exponent
map times the block's max. v's smallest non-zero code is 3.25e-7 of the block max, so an entry whose v
is below ~1.6e-7 of its block's largest decodes to v = 0: in gradient units, any entry whose gradient
history is below ~4e-4 of the block's largest. Its m survives (m's map reaches 2.75e-7 in m's own, not
squared, units), so the next step divides m by sqrt(0.001 g^2) + eps, or by eps alone where g = 0 (an
embedding row of a token absent from the batch, an MLP unit that did not fire): updates of 10 to
10,000 x lr (measured on a 135M model's real gradients). `adamw8bit_rms` (AdamW8bitRMS below) keeps
torchao's 8-bit container, code map and block size but stores sqrt(v), the gradient's running RMS:
the map then spans the same 3.25e-7 in gradient units, no entry with a gradient history decodes to 0,
and its updates stay within ~1.1-1.6 x lr at the same 2 bytes per parameter (tests/unit/
test_optimizer.py). torchao has no such variant; it is one function and a step() that calls it.
"""

import torch
from torch import Tensor

from config import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """cfg.name -> torch.optim.AdamW, torchao.optim.AdamW8bit or AdamW8bitRMS over `params`
    (config.validate has already refused combinations whose updates round away)."""
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        params = list(params)
        # CPU: the fused kernel. The default CPU path (one tensor at a time) takes a float32 sqrt that is not
        # correctly rounded (~20% of inputs; a vector-math routine, not ATen's exact SIMD sqrt) and rounds
        # differently on an AMD EPYC than on an Intel Xeon with AVX-512 FP16/AMX, so CPU runs parted by host.
        on_cpu = all(p.device.type == "cpu" for p in params)
        return torch.optim.AdamW(params, fused=on_cpu or None, **kw)
    from torchao.optim import AdamW8bit  # compiles its update with torch.compile (inductor)

    cls = AdamW8bit if cfg.name == "adamw8bit" else adamw8bit_rms_cls()
    optimizer = cls(params, bf16_stochastic_round=cfg.bf16_stochastic_round, **kw)
    init_states(optimizer)
    return optimizer


def init_states(optimizer: torch.optim.Optimizer) -> None:
    """Create a torchao 8-bit AdamW's states now, before any gradient or activation exists. Created
    lazily in the first step, each small state lands in the allocator's segments among that step's
    fp32 temporaries, and keeps them from being returned when the engine wakes (27 GB at 8B through
    every rollout: docs/log.md)."""
    from torchao.optim import AdamW8bit
    if not isinstance(optimizer, AdamW8bit):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            _init_state(optimizer, p)


def _init_state(optimizer, p: Tensor) -> dict:
    """optimizer.state[p], created as AdamW8bit.step creates it (amsgrad off) if it is empty."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = optimizer._new_buffer(p, True)
        state["exp_avg_sq"] = optimizer._new_buffer(p, False)  # AdamW8bitRMS: sqrt(v)
    return state


def adamw_rms_update(p: Tensor, grad: Tensor, step: Tensor, exp_avg: Tensor, exp_avg_rms: Tensor, lr: Tensor,
                     beta1: float, beta2: float, weight_decay: float, eps: float, bf16_stochastic_round: bool):
    """torchao's single_param_adam (AdamW, fp32 arithmetic) with the second-moment state holding
    sqrt(v) = exp_avg_rms: v = lerp(rms^2, g^2, 1 - beta2), stored back as sqrt(v)."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    p_f32, grad_f32 = p.float(), grad.float()
    p_f32 = p_f32 - lr * weight_decay * p_f32
    bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
    m = exp_avg.float().lerp(grad_f32, 1 - beta1)
    # the 8-bit state implements lerp and copy_ only; lerp(x, y, 0) is x dequantized (y keeps DTensor-ness)
    rms = exp_avg_rms.float().lerp(grad_f32, 0.0).square().lerp(grad_f32.square(), 1 - beta2).sqrt()
    exp_avg.copy_(m)
    exp_avg_rms.copy_(rms)
    p_f32 = p_f32 - lr * (m / bias_correction1) / (rms / bias_correction2.sqrt() + eps)
    p.copy_(_fp32_to_bf16_sr(p_f32) if bf16_stochastic_round else p_f32)


def adamw8bit_rms_cls():
    """AdamW8bitRMS: torchao's AdamW8bit whose 'exp_avg_sq' state holds sqrt(v) (module docstring)."""
    from torchao.optim import AdamW8bit

    class AdamW8bitRMS(AdamW8bit):
        @torch.no_grad()
        def step(self, closure=None):
            assert closure is None, "AdamW8bitRMS.step takes no closure"
            update = torch.compile(adamw_rms_update, fullgraph=True, dynamic=False)
            with torch._dynamo.utils.disable_cache_limit():  # one compile per parameter shape, as torchao
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = _init_state(self, p)
                        state["step"] += 1
                        update(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"], group["lr"],
                               group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"],
                               self.bf16_stochastic_round and p.dtype is torch.bfloat16)

    return AdamW8bitRMS
