"""fp8.kv_attention=xqa: decode over the FP8 KV cache with FlashInfer's XQA kernel (SM90), its scales
read from the attention layers' device tensors.

vLLM 0.26's FlashInfer backend already decodes an FP8 cache with XQA on SM90 (FlashInferImpl,
backend="xqa"), but passes the kernel host floats: bmm1 = softmax scale x k_scale, recomputed from
the float mirror at each call (so frozen into a CUDA graph at capture), and bmm2 = v_scale, cached
at the first forward and never read again. The trainer recalibrates q/k/v scales every step by
writing the device tensors in place (engines/vllm.py), so both must come from those tensors; flashinfer's
trtllm_batch_decode_with_kv_cache takes a float or a 0-d fp32 tensor for each. No vLLM option
passes tensors, hence the patch. On an H200 XQA with tensor scales ran a batch-128, 4096-context
decode 1.76x FA3's BF16 kernel, FA3's FP8 kernel 1.20x (bench/decode_attention.py).

XQA on SM90 casts the BF16 q to e4m3 with no scale (flashinfer's mha_sm90.cu), so in this mode the
engine sets q_scale to 1: FlashInfer's FP8 prefill, which quantizes q with it, then agrees with decode.
"""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def patch_flashinfer_scales() -> None:
    """FlashInferImpl's XQA decode reads k/v scales from the layer's device tensors (idempotent).
    Call before the engine is built, so that CUDA-graph capture sees the patched calls."""
    from vllm.v1.attention.backends import flashinfer as fib

    impl = fib.FlashInferImpl
    if getattr(impl, "_device_scales", False):
        return
    forward = impl.forward

    def get_xqa_bmm1_scale(self, layer, q_data_type):
        # a 0-d fp32 tensor made at launch: inside a CUDA graph this product is a captured kernel
        # reading layer._k_scale, so set_kv_scales' fill_ reaches every replay without a host sync
        s = layer._k_scale * self.scale
        return s * layer._q_scale if q_data_type in FP8 else s

    def forward_with_device_scales(self, layer, *args, **kwargs):
        if fib.is_quantized_kv_cache(self.kv_cache_dtype):
            self.bmm2_scale = layer._v_scale  # the tensor itself (vLLM caches a float here once)
        return forward(self, layer, *args, **kwargs)

    impl.get_xqa_bmm1_scale = get_xqa_bmm1_scale
    impl.forward = forward_with_device_scales
    impl._device_scales = True


def check_available() -> str | None:
    """Why XQA decode is not available on this process's GPU, or None. Call after vLLM's environment
    is set (engines.vllm.vllm_env sets VLLM_HAS_FLASHINFER_CUBIN, without which vLLM probes NVIDIA's
    artifact server and, offline, silently decodes with FlashInfer's native kernel and frozen scales)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "it needs an SM90 GPU (H100/H200); use fp8.kv_attention=fa3"
    from vllm.utils.flashinfer import supports_trtllm_attention

    if not supports_trtllm_attention(is_prefill=False):
        return "vLLM does not offer the XQA decode kernel here (VLLM_BATCH_INVARIANT set, or flashinfer unusable)"
    return None
