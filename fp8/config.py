"""The FP8 settings (the YAML section `fp8:`): what runs in FP8 on each side, the KV cache and its scales,
and the speed-only switches. config.py loads and checks them with the rest."""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class FP8Config:
    train: bool = False
    """Trainer linears in block-wise FP8 (torchao on SM90, exact emulation elsewhere)."""
    rollout: bool = False
    """Engine linears in block-wise W8A8 FP8, weights quantized by fp8/quant.py."""
    kv_cache: bool = False
    """FP8 KV cache + FP8 attention in the engine (needs q/k/v scales: see recalibrate)."""
    kv_attention: Literal["fa3", "triton", "xqa"] = "fa3"
    """Engine attention over the FP8 KV cache. fa3: FlashAttention 3 in FP8 (q and P quantized too).
    triton: vLLM's Triton attention (q/k/v scales read from device tensors, so per-step
    recalibration reaches it inside CUDA graphs), slower than fa3 at decode
    (docs/results.md#the-decode-step-by-kernel-kind). Not BF16 math: in vLLM 0.26's source its CUDA
    path also takes q in FP8 (supports_quant_query_input), computes q.K^T on the FP8 tiles and casts P
    to FP8 for P.V.
    xqa: vLLM's FlashInfer backend, decode by FlashInfer's XQA kernel with the scales read from device
    tensors (engines/vllm_internals.py patch_xqa_scales; SM90 only, q scale fixed at 1). It reads the FP8
    cache faster than fa3's FP8 kernel at the same mismatch, and the learning gate passes with it
    (docs/results.md#fp8-decode-attention-kernels-with-scales-on-the-device-2026-11-26-nvidia-h200,
    docs/results.md#qwen3-with-xqa-decode-at-16-prompts-2026-11-27-4-x-nvidia-h200-141-gb-one-config-per-gpu)."""
    recalibrate: bool = True
    """Recompute q/k/v scales from the trainer's attention inputs after every step."""
    calib_pass: Literal["separate", "logprobs"] = "separate"
    """Where the per-step q/k/v amax comes from. separate: a no-grad forward of the updated weights
    over calib_samples rows after the optimizer step (fresh, costs a forward). logprobs: captured in
    the old_logp forward that runs anyway (free, all rows of the step, but measured on the weights
    before this step's update, so the next rollout's scales are one optimizer step old)."""
    keep_bf16: list[str] = field(default_factory=list)
    """fnmatch patterns of module names kept in BF16 (e.g. '*.down_proj')."""
    keep_first_layers: int = 0
    keep_last_layers: int = 0
    fuse_projections: bool = True
    """Trainer: q/k/v and gate/up of a layer as ONE FP8 GEMM each on the concatenated weights, as
    vLLM computes qkv_proj/gate_up_proj (the input is quantized once per group; same numerics up
    to accumulation order; parameter names unchanged). False: one GEMM per linear (ablation). With train=false
    and cache_weights or fuse_grad_accum (the BF16 twin, fp8/fast/bf16.py): one bf16 GEMM per group."""
    fuse_swiglu: bool = True
    """Trainer, with fuse_projections: a SwiGLU MLP (Llama, Qwen, Mistral) computes silu(gate) * up
    inside the FP8 quantization of down_proj's input, and its gradient inside the quantization of
    gate/up's output gradient (fp8/fast/kernels.py on Hopper), so neither is written in BF16 and read back.
    Same numerics (h rounded to BF16 once, as torch.compile does). False: HF's MLP forward (ablation)."""
    cache_weights: bool = False
    """Trainer: keep each FP8 weight's quantized copies until the optimizer changes it, so the weight
    quantization runs once per optimizer step, not in every forward and backward of every
    micro-batch. Costs 2 bytes per FP8 parameter (torchao's two GEMM layouts). Over FSDP2 ranks each
    rank keeps its shard's FP8 bytes (1 byte per parameter / ranks) and FSDP2 all-gathers those instead
    of the bf16 weight (fp8/fast/gather.py; weights whose rows split into whole 128-row blocks per rank;
    off with train.probe, whose BF16 reference needs the bf16 weights). With train=false (the BF16 twin), on
    one GPU: the bf16 copy of each weight the FP8 recipe would quantize, cast once per optimizer step
    instead of in every forward and recompute (fp8/fast/bf16.py; 2 bytes per parameter)."""
    fuse_grad_accum: bool = False
    """Trainer, one GPU: each FP8 weight-gradient GEMM adds its product into the weight's gradient itself
    (fp8/fast/accum.py; on SM90 DeepGEMM's wgrad kernel accumulates into the fp32 gradient in its epilogue),
    so autograd's BF16 weight gradient, its cast to the master weights' dtype and the add across
    micro-batches are gone. The gradients of the FP8 linears then live in one buffer per GEMM, zeroed at
    each mini-batch; the sum is not rounded to BF16 on the way. Off over FSDP2 ranks (their gradients are
    reduce-scattered as autograd makes them). With train=false (the BF16 twin): the bf16 wgrad GEMM of
    those linears adds into the fp32 gradient (cuBLAS, an fp32 output; fp8/fast/bf16.py)."""
    dense_gemm: Literal["cublas", "deep_gemm"] = "cublas"
    """Trainer on SM90: the kernel of the dense FP8 linears' forward and data-gradient GEMMs. cublas:
    torchao's block-scaled cuBLAS GEMM. deep_gemm: DeepGEMM's 1D2D kernel (an installed `deep_gemm`, else
    the copy vLLM vendors; it JIT-compiles a kernel per weight shape at the first step of a host, the token
    count a runtime argument) on the same FP8 operands and fp32 scales: the products summed in another
    order, so not bit-equal to cublas, and no change to what the engine receives. The weight gradient
    stays as fuse_grad_accum says. The emulation (CPU, other GPUs) ignores it. bench/gemm.py times both at
    a model's shapes."""
    emulate: bool = False
    """Use the emulated FP8 linear even on SM90 (debugging the torchao path). Other GPUs always get
    the emulation (same numerics, slower than BF16), with a warning unless this is set."""
    deep_gemm: bool = False
    """Trainer, MoE experts on SM90: torchao's grouped block-FP8 GEMM through DeepGEMM's FP8 kernels
    (forward, dgrad and wgrad; an installed `deep_gemm`, else the copy vLLM vendors) instead of torchao's
    emulated backend, which dequantizes both operands to BF16 and runs a BF16 grouped GEMM (no faster
    than BF16). Same FP8 operands; the products are summed in FP8 tensor cores with fp32 scales, as the
    dense linears' cuBLAS GEMMs do, so the CPU emulation no longer follows the experts bit for bit."""
    linear_backend: Literal["auto", "cutlass", "deep_gemm", "triton"] = "cutlass"
    """vLLM block-FP8 GEMM backend. cutlass: the configs' choice. deep_gemm JIT-compiles its kernels
    with nvcc at the first engine start on a host (minutes; cached on disk); its decode step is faster at
    small batches, but the 8B configs' rollout, bound by vLLM's host loop, takes as long
    (docs/results.md#deepgemm-linears-in-the-configs-rollout-and-the-hosts-cpu-2026-11-28-2-x-nvidia-h200-141-gb-two-hosts).
    triton: vLLM's Triton block-FP8 GEMM, slower than cutlass at decode
    (docs/results.md#the-decode-step-by-kernel-kind)."""
    calib_percentile: float = 99.9
    """Percentile over micro-batches of the per-layer amax of q/k/v."""
    calib_margin: float = 1.05
    calib_samples: int = 64
    """Samples of the step's batch the recalibration forward runs over (calib_pass=separate; also
    the prompts of the calibration before the first rollout)."""

    @property
    def uses_fast(self) -> bool:
        """A speed-only switch is on, so the trainer's FP8 model gets fp8/fast's structure (fp8.fast.apply);
        with all of them off the recipe runs without fp8/fast."""
        return self.train and (self.fuse_projections or self.cache_weights or self.fuse_grad_accum
                               or self.dense_gemm != "cublas")
