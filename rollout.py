"""Rollout: the engine interface, the samples it returns, and the seeds it samples with.

    engine = engines.make_engine(cfg, model, tokenizer, device)
    samples = engine.generate(prompt_ids, n=8, temperature=1.0, top_p=1.0, max_new_tokens=64)
    engine.update_weights(export_weights(model, cfg.fp8, fp8=cfg.fp8.rollout))   # after each step
    engine.set_kv_scales({layer: (q_scale, k_scale, v_scale)})                  # FP8 KV cache

The engines (`rollout.engine`), each in its own module under engines/, import this module and
never the reverse:

* `engines.hf.HFEngine` (CPU / debug reference): a separate copy of the model that receives
  weights through the same export stream vLLM gets, with the same FP8 numerics emulated: W8A8
  block linears on the pushed fp8 bytes and, with fp8.kv_cache, q/k/v fake-quantized with the
  pushed scales.
* `engines.vllm.VLLMEngine` (GPU): vLLM in-process, colocated with the trainer. vLLM is
  imported only when the engine is built, so CPU-only use never imports it.
* `engines.remote.RemoteEngine` (rollout.mode=async): the trainer ranks' proxy of engines that run
  on ranks of their own, one batch ahead of the trainer.

Logprob convention (both engines, and the trainer): the log-probability of each sampled token
under the *processed* distribution, i.e. log_softmax(logits / temperature) (vLLM's
`logprobs_mode="processed_logprobs"`). Keep top_p = 1.0 for RL: the trainer does not apply
the top-p mask, so with top_p < 1 the engine's logprobs are renormalised over the nucleus.
"""

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from config import Config


@dataclass
class Sample:
    prompt_index: int  # index of the prompt in the generate() call
    prompt_ids: list[int]
    token_ids: list[int]  # response tokens, EOS included when emitted
    logprobs: list[float]  # engine logprob of each response token
    finish_reason: str  # "stop" | "length"
    routed_experts: torch.Tensor | None = None
    """MoE models: [P + T - 1, moe layers, k] int16, the top-k expert ids each MoE layer chose at each
    position the engine ran (prompt and response tokens; the last sampled token is never fed back),
    vLLM's CompletionOutput.routed_experts layout; None for dense models (routing.py replays them)."""
    policy_version: int | None = None
    """rollout.mode=async: the weights the engine generated with, as the trainer's step count when it
    sent them (its q/k/v scales came with them); None: the trainer's current weights (colocated)."""


class Engine(Protocol):
    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None = None) -> list[Sample]:
        """n samples per prompt, ordered prompt by prompt (the GRPO group layout).
        temperature == 0 means greedy. seed: the call's randomness; the samples use seeds in
        [seed, seed + len(prompt_ids) * n) (vLLM: sample j of prompt i gets seed + i*n + j)."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def set_kv_scales(self, scales: dict[int, tuple[float, float, float]]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


def step_seed(cfg: Config, step: int, r: int = 0) -> int:
    """The seed of round r of `step`'s first sample: sample j of global prompt i gets step_seed + i*n + j,
    disjoint across steps and ranks (a resample round r >= 1 adds r * 2**40, past every step's range)."""
    return (cfg.train.seed * 1_000_003 + step) * cfg.rollout.prompts_per_step * cfg.rollout.n + (r << 40)
