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

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Protocol

import torch


@dataclass
class RolloutConfig:
    engine: Literal["hf", "vllm"] = "hf"
    prompts_per_step: int = 32
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    """Keep 1.0 for RL: the trainer scores tokens without the top-p mask."""
    max_new_tokens: int = 256
    ignore_eos: bool = False
    """Benchmarks only: every sample runs to max_new_tokens (vLLM engine; fixed-length workloads)."""
    ignore_eos_median: int = 0
    """Benchmarks with ignore_eos: 0 = every sample is max_new_tokens long; N > 0 = each sample's
    length is drawn from a log-normal with median N tokens and sigma ignore_eos_sigma, cut at
    max_new_tokens (the cut tail is the truncated share), the same draw for every engine and precision
    (seeded by the step's seed): a reasoning-RL length distribution on random weights."""
    ignore_eos_sigma: float = 0.6
    # vLLM knobs
    gpu_memory_utilization: float = 0.5
    """vLLM's share of the GPU's memory while it is awake (weights + activations + KV cache; the KV
    cache gets the rest). With sleep_mode the trainer then holds only parameters and optimizer
    states: gradients are freed after the update and PyTorch's cached blocks are returned before
    vLLM wakes. So on one GPU up to ~1 - (params + optimizer states [+ KL reference] + 3 GB) / total (8B, bf16
    params + AdamW on 80 GB: ~0.35; on 141 GB: ~0.6); the more, the more sequences decode at once."""
    sleep_mode: bool = True
    """Release vLLM's weights and KV cache while the trainer runs (colocated on one GPU)."""
    enforce_eager: bool = False
    max_model_len: int = 0
    """0 = max prompt tokens + max_new_tokens."""
    block_size: int = 0
    """vLLM's KV-cache page in tokens, a multiple of 16; 0 = vLLM's default (16)."""
    max_num_seqs: int = 0
    """vLLM's cap on sequences decoding at once; 0 = vLLM's default (1024 on 80-141 GB cards). A batch
    larger than the KV cache holds makes vLLM preempt and recompute sequences, so the 8B configs, with
    2048 samples per step, cap it below vLLM's default
    (docs/results.md#capping-the-decode-batch-rolloutmax_num_seqs-2026-11-26-4-x-nvidia-h200)."""
    kv_cache_gib: float = 0.0
    """vLLM's KV cache in GiB (its kv_cache_memory_bytes); 0 = what gpu_memory_utilization leaves. A fixed
    size skips vLLM's free-memory profile at start, so engines started side by side on one GPU (several
    runs, or a neighbour allocating) cannot fail its "memory changed during profiling" check; weights +
    activations + this must fit. vLLM still refuses to start unless gpu_memory_utilization x the card is
    free at that moment, so beside neighbours set that share to what this engine needs, not more."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism over consecutive torchrun ranks (a group of this many ranks holds one
    engine, sharded; for a model whose weights + KV do not fit one GPU's share). The group generates
    its ranks' prompts together and each rank trains on its own; must divide the world size. The HF
    engine (CPU) runs the same data flow with every rank of a group generating the group's prompts."""
    mode: Literal["colocated", "async"] = "colocated"
    """colocated: every rank generates its own prompts, then trains on them (engine and trainer take
    turns on each GPU). async: the last rollout.engine_ranks ranks only generate, the others only
    train, and the engines generate the next step's batch while the trainer trains on this one, with
    weights up to rollout.max_staleness optimizer steps old (engines/remote.py; a vLLM engine rank
    holds a whole GPU, so set rollout.gpu_memory_utilization for that). The importance
    weight already uses the engine's own logprobs, so the one-step-old policy is corrected like any
    engine/trainer mismatch (loss.is_correction); rollout/staleness logs the lag. That covers a small
    policy step, not a large one: on tiny_cpu the lag cost nothing at lr 3e-4 but lost final
    accuracy at lr 1e-3 (docs/results.md#asynchronous-rollouts-on-cpu-2026-11-27-2-core-dev-machine)."""
    engine_ranks: int = 1
    """rollout.mode=async: how many of the torchrun ranks (the last ones) run engines; each serves the
    trainer ranks r with r % engine_ranks == its index."""
    max_staleness: int = 1
    """rollout.mode=async: optimizer steps the generating weights may lag the trainer's. 1: the
    engines generate step t+1 with the weights of step t while the trainer trains step t. 0: they wait
    for the newest weights (the synchronous loop's samples, on separate ranks). One batch is in flight
    at a time, so larger values would not overlap more."""
    hf_cpu_threads: int = 1
    """HF engine on CPU: intra-op threads while it generates (the trainer keeps torch's setting);
    0 = torch's setting. Decoding runs hundreds of small ops per token (a few rows each), where
    OpenMP's fork/join costs more than a second core gains, and on a host shared with other work a
    descheduled thread stalls every op by a time slice
    (docs/results.md#the-hf-engine-on-cpu-one-intra-op-thread-2026-11-26-2-core-dev-machine)."""
    seed: int = 0


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


def step_seed(rollout: RolloutConfig, train_seed: int, step: int, r: int = 0) -> int:
    """The seed of round r of `step`'s first sample (train_seed: train.seed): sample j of global prompt i
    gets step_seed + i*n + j, disjoint across steps and ranks (a resample round r >= 1 adds r * 2**40, past
    every step's range)."""
    return (train_seed * 1_000_003 + step) * rollout.prompts_per_step * rollout.n + (r << 40)
