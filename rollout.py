"""Rollout engines behind one small interface.

    engine = make_engine(cfg, model, tokenizer, device)
    samples = engine.generate(prompt_ids, n=8, temperature=1.0, top_p=1.0, max_new_tokens=64)
    engine.update_weights(export_weights(model, cfg.fp8, fp8=cfg.fp8.rollout))   # after each step
    engine.set_kv_scales({layer: (q_scale, k_scale, v_scale)})                  # FP8 KV cache

* `HFEngine` (CPU / debug reference): a separate copy of the model that receives weights
  through the same export stream vLLM gets, with the same FP8 numerics emulated: W8A8 block
  linears (weights dequantized from the pushed fp8 + scale_inv, activations 1x128
  quantize-dequantized) and, with fp8.kv_cache, q/k/v fake-quantized with the pushed scales.
* `VLLMEngine` (GPU): vLLM in-process, colocated with the trainer.

Logprob convention (both engines, and the trainer): the log-probability of each sampled token
under the *processed* distribution, i.e. log_softmax(logits / temperature) (vLLM's
`logprobs_mode="processed_logprobs"`). Keep top_p = 1.0 for RL: the trainer does not apply
the top-p mask, so with top_p < 1 the engine's logprobs are renormalised over the nucleus.
"""

import copy
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import Config


@dataclass
class Sample:
    prompt_index: int  # index of the prompt in the generate() call
    prompt_ids: list[int]
    token_ids: list[int]  # response tokens, EOS included when emitted
    logprobs: list[float]  # engine logprob of each response token
    finish_reason: str  # "stop" | "length"
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None = None) -> list[Sample]:
        """n samples per prompt, ordered prompt by prompt (the GRPO group layout).
        temperature == 0 means greedy."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def set_kv_scales(self, scales: dict[int, tuple[float, float, float]]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class W8A8Linear(nn.Module):
    """Inference linear as vLLM's block-FP8 W8A8 computes it: weight held as fp8 + 128x128
    scales (dequantized once), activations quantize-dequantized in 1x128 tiles per forward."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)  # [N, K] dequantized

    def forward(self, x):
        from fp8.quant import quantize_act_1x128

        q, scale_inv = quantize_act_1x128(x)  # [..., K] fp8, [..., K/128]
        x_dq = (q.float().unflatten(-1, (-1, 128)) * scale_inv.unsqueeze(-1)).flatten(-2).to(x.dtype)
        return F.linear(x_dq, self.weight)


class HFEngine:
    """Batched sampling with HF transformers on a private copy of the model."""

    def __init__(self, cfg: Config, model: nn.Module, tokenizer, device):
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.fp8.rollout:  # same skip-list as the trainer and the export
            from fp8.linear import fp8_eligible
            n_layers = self.model.config.num_hidden_layers
            for name, mod in list(self.model.named_modules()):
                if isinstance(mod, nn.Linear) and fp8_eligible(name, mod, cfg.fp8, n_layers)[0]:
                    self.model.set_submodule(name, W8A8Linear(mod))
        self.kv_scales = None

    @torch.no_grad()
    def update_weights(self, weights):
        from fp8.export import load_exported_into_hf

        load_exported_into_hf(self.model, weights)

    def set_kv_scales(self, scales):
        from fp8.calibrate import set_fp8_attention

        self.kv_scales = dict(scales)
        set_fp8_attention(self.model, self.kv_scales)

    def sleep(self):  # nothing to release on CPU
        pass

    def wake(self):
        pass

    @torch.no_grad()
    def generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, seed=None):
        from transformers import GenerationConfig

        if seed is not None:
            torch.manual_seed(seed)
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        rows = [ids for ids in prompt_ids for _ in range(n)]  # group by group
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, r in enumerate(rows):  # left padding
            input_ids[i, width - len(r):] = torch.tensor(r)
            attention_mask[i, width - len(r):] = 1
        greedy = temperature == 0
        gen_cfg = GenerationConfig(do_sample=not greedy, temperature=None if greedy else temperature,
                                   top_p=None if greedy else top_p, top_k=None, max_new_tokens=max_new_tokens,
                                   eos_token_id=eos, pad_token_id=pad, output_scores=True,
                                   return_dict_in_generate=True)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                  generation_config=gen_cfg)
        new_tokens = out.sequences[:, width:]  # [B, T_new]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T_new, V] processed logits
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B, T_new]
        samples = []
        for i, r in enumerate(rows):
            toks = new_tokens[i].tolist()
            finish = "length"
            if eos in toks:
                toks, finish = toks[: toks.index(eos) + 1], "stop"
            samples.append(Sample(i // n, r, toks, logprobs[i, : len(toks)].tolist(), finish))
        return samples


def make_engine(cfg: Config, model, tokenizer, device, model_dir=None) -> Engine:
    if cfg.rollout.engine == "hf":
        return HFEngine(cfg, model, tokenizer, device)
    return VLLMEngine(cfg, model, tokenizer, device, model_dir)


class VLLMEngine:
    """vLLM in-process, colocated with the trainer (see issue 4)."""

    def __init__(self, cfg, model, tokenizer, device, model_dir=None):
        raise NotImplementedError("VLLMEngine lands with the vLLM issue; use rollout.engine=hf")
