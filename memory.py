"""A device-memory model of one rank, printed at start-up: what the trainer and the colocated vLLM
engine hold in each phase of a step, next to the device's memory.

Per rank, with P parameters, N ranks (FSDP2 shards weights, gradients and optimizer states over
them; activations are per rank), GiB = 2^30 bytes:

    weights       P x 4 / N (fp32 master weights; 2 for bf16)
    grads         the same as the weights (freed before vLLM wakes)
    optimizer     P x 2 / N for adamw8bit(_rms) (8-bit m and v); torch AdamW: two states of the weights' dtype
    fp8 cache     P x 2 with fp8.cache_weights (an FP8 copy of each linear weight in the GEMMs' two layouts,
                  released while vLLM runs); over N > 1 ranks P x 1 / N (each rank's FP8 shard, which FSDP2
                  all-gathers instead of the bf16 weight; fp8/fast/gather.py). The BF16 twin (fp8.train=false) on
                  one GPU: P x 2 as well (a bf16 copy; fp8/fast/bf16.py), none over N > 1 ranks
    reference     the KL reference model (loss.kl_coef > 0): a copy of the weights
    gathered      N > 1: FSDP2's all-gathered bf16 units, 3 x 2 x max(layer, V x h): the all-gather stream's
                  cache held 3 of Qwen3-8B's largest (V x h) at the 2-rank trainer peak
    reduce-scatter  N > 1: 4 x max(layer, V x h), the fp32 gradient of the largest unit before its reduce-scatter;
                  the sharded gradients live in the reduce-scatter stream's cache, which other streams cannot reuse
    activations   per micro-batch token (micro_batch_size x (prompt + response) tokens, bf16):
                    2 h per layer (gradient checkpointing keeps each layer's input; without it,
                      the layer term below for every layer; model.gradient_checkpointing_every = n:
                      2 h for the checkpointed layers 0, n, 2n, ..., the layer term for the others)
                  + 5 x (4 h + 3 ffn) x 2 (one layer recomputed in backward; 1 byte for FP8 linears,
                      which keep FP8 inputs, on one rank; over N > 1 ranks FP8 layers count 2 bytes too, as
                      measured at the 2-rank peak)
                  + 10 x V (bf16 logits, fp32 log-softmax and its gradient); 3 x V with train.fused_head
                      (it kept 7 bytes x V per token less at 4 x 4128 tokens, V 128k, on an H200)
    runtime       2 GiB (CUDA context, allocator slack, compiled kernels)
    vLLM share    rollout.gpu_memory_utilization x device memory: its weights (2 bytes per parameter,
                  1 in FP8 linears; / tensor_parallel_size), ~2 GiB of activations and CUDA graphs, the
                  KV cache the rest (2 x layers x kv_heads x head_dim x 2 bytes per token, 1 with fp8.kv_cache)

    first refit   2 bytes per parameter, not sharded: the first weight sync into vLLM holds about a
                  bf16 copy of the model until its rollout ends (measured, not derived: 10-16 GiB above
                  the rollout phase at 8B shape, in step 0 only, on 1 and on 2 ranks; which allocation
                  holds it is not pinned down)

    trainer phase = weights + grads + optimizer + fp8 cache + reference + gathered + reduce-scatter + activations
                    + runtime
                    (+ the vLLM share without rollout.sleep_mode)
    rollout phase = weights + optimizer + reference + runtime + vLLM share
    peak          = max(trainer phase, rollout phase + first refit)

Calibrated on one H200 (139.8 GiB; Llama-3.1-8B, 8.03B parameters, and Qwen3-8B, 8.19B; fp32 master
weights, adamw8bit_rms, gradient checkpointing, micro-batch 4 x 4096 tokens, vLLM 0.45): measured
trainer-phase peaks 109.6 GiB (llama31_8b_bf16), 121.0 (llama31_8b_fp8, fp8 cache), 112.0
(qwen3_8b_bf16), 123.7 (qwen3_8b_fp8_kv); this model gives 109.4, 119.8, 114.1, 125.3. Rollout-phase
peaks 109-112 GiB; the model gives 109.8 (8B Llama). The activation constants (5, 10) are fitted to
those four runs; the rest is counting bytes. Step 0's peak (the first refit) against rollout phase +
first refit: llama31_8b_fp8 on 1 H200 125.9 GiB (model 124.8), on 2 H200s 100.7 (102.3); qwen3_8b_bf16
and qwen3_8b_fp8_kv on 2 H100s at vLLM 0.4, 69.2 and 73.2 (71.9 both), qwen3_8b_fp8_kv with micro-batches of
4 x 4096 tokens through the fused head 74.8 (71.9). On 2 ranks the trainer phase is under-counted: measured
69.4 / 67.8 GiB (qwen3_8b_bf16 / qwen3_8b_fp8_kv, micro-batch 2) and 71.2 (qwen3_8b_fp8_kv, 4 rows, fused
head) on 2 H100s, where the model without the reduce-scatter term and with 2 gathered units gave 60.4 / 62.1
and 61.8. `bench/trainer_phase.py --memory` on 2 H200s (the 80 GB line: vLLM 0.4, micro-batch 4, fused head)
placed the gap in the allocator's per-stream caches: at the step's end the reduce-scatter stream reserved
18.0 GiB (the 15.3 GiB of sharded fp32 gradients and 2.8 more) and the all-gather stream 3.5 GiB (BF16; FP8:
7.3, 3.2 of it the FP8 weight shards quantized there), hence the two terms above. With them the model gives
65.5 / 65.3 GiB for qwen3_8b_bf16 / qwen3_8b_fp8_kv there, against device peaks of 65.6 / 70.4. FP8 was still
under-counted by 5 GiB: its micro-batch left as much live at the peak as BF16's (9.5 GiB on the default stream),
where the activations term halved the FP8 layers'. Its peak falls inside a layer's backward (2.9 GiB live from
the FP8 GEMMs), BF16's inside the LM head's; which tensors keep FP8's layer as large as BF16's over FSDP2 is not
pinned down. So over N > 1 ranks the FP8 layers count BF16's bytes: 69.3 GiB against 70.4 there, and on
2 H100s 67.7 / 69.3 against 67.8 / 71.2 (micro-batch 2 / 4 rows through the fused head), from 65.6 / 65.3.

The run is refused before its first step only when the tensors that must exist, without
activations or runtime, exceed the device's memory (weights + grads + optimizer states while
training, weights + optimizer states + vLLM share while rolling out): such a run cannot fit, and a
run that fits is never refused. An estimate above 92% of the device is a warning.
"""

import dataclasses

from config import Config
from errors import UserError

GIB = 2**30
RUNTIME_GIB = 2.0      # CUDA context, allocator slack, compiled kernels (trainer); fitted
VLLM_OVERHEAD_GIB = 2.0  # vLLM's profiled activations and CUDA graphs inside its share
WARN_SHARE = 0.92


@dataclasses.dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    layers: int
    vocab: int
    ffn: int
    kv_heads: int
    head_dim: int


def model_shape(model) -> ModelShape:
    """The shape fields of an HF causal LM's config, and its parameter count."""
    c = model.config
    heads = getattr(c, "num_attention_heads", 1)
    return ModelShape(params=sum(p.numel() for p in model.parameters()), hidden=c.hidden_size,
                      layers=c.num_hidden_layers, vocab=c.vocab_size,
                      ffn=getattr(c, "intermediate_size", 4 * c.hidden_size),
                      kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """GiB per rank (module docstring)."""
    world: int
    device: float
    weights: float
    grads: float
    optimizer: float
    fp8_cache: float
    reference: float
    gathered: float
    reduce_scatter: float
    activations: float
    tokens: int                # per micro-batch
    vllm_share: float
    vllm_weights: float
    kv_cache: float
    kv_tokens: int             # tokens the KV cache holds
    sleep: bool
    first_refit: float         # 0 without an engine share

    @property
    def trainer_static(self) -> float:
        return self.weights + self.grads + self.optimizer + (0.0 if self.sleep else self.vllm_share)

    @property
    def rollout_static(self) -> float:
        return self.weights + self.optimizer + self.vllm_share

    @property
    def trainer_peak(self) -> float:
        return (self.trainer_static + self.fp8_cache + self.reference + self.gathered + self.reduce_scatter
                + self.activations + RUNTIME_GIB)

    @property
    def rollout_peak(self) -> float:
        return self.rollout_static + self.reference + RUNTIME_GIB

    @property
    def peak(self) -> float:
        return max(self.trainer_peak, self.rollout_peak + self.first_refit)


def estimate(shape: ModelShape, cfg: Config, world: int, device_gib: float) -> Estimate:
    """The memory model of one rank of `world` for cfg on a device of device_gib (module docstring)."""
    p, n, r = shape.params, world, cfg.rollout
    w_bytes = 4 if cfg.model.dtype == "float32" else 2
    state_bytes = 2 if cfg.optim.name.startswith("adamw8bit") else 2 * w_bytes
    weights = p * w_bytes / n
    tokens = cfg.micro_batch_tokens
    h, f = shape.hidden, shape.ffn
    layer = 5 * (4 * h + 3 * f) * (1 if cfg.fp8.train and n == 1 else 2)  # FP8 inputs: half, on one rank only
    # checkpointed layers (0, n, 2n, ...) keep their input, the others all of the layer term; + one layer recomputed
    ckpt = -(-shape.layers // cfg.model.gradient_checkpointing_every) if cfg.model.gradient_checkpointing else 0
    per_token = 2 * h * ckpt + layer * (shape.layers - ckpt + (1 if ckpt else 0)) \
        + (3 if cfg.train.fused_head else 10) * shape.vocab
    # rollout.mode=async: the engines have GPUs of their own, a trainer rank holds no vLLM share
    share = r.gpu_memory_utilization * device_gib if r.engine == "vllm" and r.mode == "colocated" else 0.0
    engine_bytes = p + 2 * shape.vocab * h if cfg.fp8.rollout else 2 * p  # FP8 linears; bf16 embedding, lm_head
    vllm_weights = engine_bytes / r.tensor_parallel_size / GIB if share else 0.0
    kv_cache = max(share - vllm_weights - VLLM_OVERHEAD_GIB, 0.0) if share else 0.0
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * (1 if cfg.fp8.kv_cache else 2) \
        / r.tensor_parallel_size
    unit = max((p - 2 * shape.vocab * h) / shape.layers, shape.vocab * h)  # a decoder layer, or an embedding
    return Estimate(
        world=n, device=device_gib, weights=weights / GIB, grads=weights / GIB, optimizer=p * state_bytes / n / GIB,
        fp8_cache=(p * 2 if n == 1 else p / n) / GIB if cfg.fp8.cache_weights and (cfg.fp8.train or n == 1) else 0.0,
        reference=weights / GIB if cfg.loss.kl_coef > 0 else 0.0,
        gathered=3 * 2 * unit / GIB if n > 1 else 0.0, reduce_scatter=4 * unit / GIB if n > 1 else 0.0,
        activations=tokens * per_token / GIB, tokens=tokens,
        vllm_share=share, vllm_weights=vllm_weights, kv_cache=kv_cache, kv_tokens=int(kv_cache * GIB / kv_per_token),
        sleep=r.sleep_mode, first_refit=2 * p / GIB if share else 0.0)


def describe(e: Estimate) -> str:
    """The start-up block: a few lines, GiB per rank."""
    ranks = f"{e.world} rank{'s' * (e.world > 1)}"
    lines = [f"memory model (GiB per rank, {ranks}, device {e.device:.1f}):",
             f"  weights {e.weights:.1f}, grads {e.grads:.1f}, optimizer states {e.optimizer:.1f}"
             + (f", fp8 cache {e.fp8_cache:.1f}" if e.fp8_cache else "")
             + (f", reference {e.reference:.1f}" if e.reference else "")
             + (f", fsdp gathered {e.gathered:.1f}, reduce-scatter {e.reduce_scatter:.1f}" if e.gathered else ""),
             (f"  activations {e.activations:.1f} per micro-batch of {e.tokens} tokens"
              f" ({e.activations * GIB / e.tokens / 2**20:.2f} MiB per token), runtime {RUNTIME_GIB:.0f}")]
    if e.vllm_share:
        lines.append(f"  vLLM share {e.vllm_share:.1f}: weights {e.vllm_weights:.1f}, KV cache {e.kv_cache:.1f}"
                     f" (~{e.kv_tokens} tokens)" + ("" if e.sleep else ", awake while training (sleep_mode off)"))
    lines.append(f"  peak: trainer phase {e.trainer_peak:.1f}, rollout phase {e.rollout_peak:.1f}"
                 + (f" (+ {e.first_refit:.1f} in the first refit's step)" if e.first_refit else "")
                 + f" of {e.device:.1f} ({e.peak / e.device:.0%})")
    return "\n".join(lines)


def check(e: Estimate) -> str | None:
    """UserError when the tensors that must exist exceed the device; a warning line when the estimate
    is above WARN_SHARE of it; else None."""
    fix = "run on more GPUs (torchrun --nproc_per_node N) or lower rollout.gpu_memory_utilization"
    for phase, need in (("training", e.trainer_static), ("rollout", e.rollout_static)):
        if need > e.device:
            what = "weights + grads + optimizer states" if phase == "training" else \
                "weights + optimizer states + vLLM share"
            raise UserError(f"memory: {what} need {need:.1f} GiB per rank during {phase}, more than the device's "
                            f"{e.device:.1f} GiB: {fix}")
    peak = e.peak
    if peak > WARN_SHARE * e.device:
        return (f"warning: memory model: {peak:.1f} GiB per rank at peak, {peak / e.device:.0%} of the device's "
                f"{e.device:.1f} GiB; if it runs out, {fix}, or lower train.micro_batch_size")
    return None


def startup_report(cfg: Config, model, d, log=print) -> None:
    """On CUDA: print the memory model for this rank and refuse a run that cannot fit; nothing elsewhere."""
    if d.device.type != "cuda" or getattr(model, "config", None) is None:
        return
    import torch

    e = estimate(model_shape(model), cfg, d.world, torch.cuda.mem_get_info(d.device)[1] / GIB)
    log(describe(e))
    warning = check(e)
    if warning:
        log(warning)
