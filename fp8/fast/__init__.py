"""Speed-only structure on top of the FP8 recipe (fp8/linear.py): same quantization, fewer passes.

`apply(model, cfg)` is the one entry point: run_setup.prepare_trainer calls it on the model
convert_to_fp8_training has converted when a switch asks for it (fp8.fuse_projections,
fp8.cache_weights); with them off the recipe runs without this package. It gives every FP8 linear
fast kernels, then adds what the switches ask for:

* kernels (always; same bytes): on torchao, one Triton pass writes an activation's 1x128 and 128x1
  copies and x is saved for backward in FP8 (dual.py, kernels.py); each linear also gets the
  SwiGLU entry points fuse_swiglu uses.
* fp8.fuse_projections: q/k/v and gate/up of a layer as ONE FP8 GEMM each (fused.py).
* fp8.fuse_swiglu (with fuse_projections): a SwiGLU MLP as one autograd node, silu(gate) * up made
  inside the FP8 quantization of down_proj's input (swiglu.py).
* fp8.cache_weights: each GEMM's quantized weight kept until the optimizer changes it (cache.py);
  the trainer registers its optimizer hook with cache.refresh_weight_caches_on_step. Over FSDP2
  ranks (`world` > 1) each rank keeps its shard's instead, and FSDP2 all-gathers FP8 (gather.py).
* fp8.fuse_grad_accum (one rank): each GEMM's weight gradient added into one gradient buffer by the
  GEMM itself (accum.py); the trainer zeroes and releases the buffers.

Module names, Parameters and numerics are those of the recipe (tests/unit/test_fp8_linear.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from torch import nn

from fp8.fast.accum import attach_grad_accumulators
from fp8.fast.cache import attach_weight_caches
from fp8.fast.dual import DeepGemmKernels, DualQuantKernels
from fp8.fast.gather import gather_fp8_weights
from fp8.fast.fused import fuse_projections
from fp8.fast.swiglu import SwiGLUEmulatedKernels, fuse_swiglu
from fp8.linear import EmulatedKernels, is_fp8_linear
from fp8.moe import require_deep_gemm
from fp8.torchao import TorchaoKernels

if TYPE_CHECKING:
    from config import FP8Config


def apply(model: nn.Module, cfg: FP8Config, world: int = 1) -> list[str]:
    """Add the speed-only structure to an FP8-converted `model` in place (idempotent): fast kernels,
    then cfg.fuse_projections, cfg.fuse_swiglu, cfg.cache_weights (over `world` FSDP2 ranks: before
    fully_shard), cfg.fuse_grad_accum (one rank only). Returns what it did, for the log."""
    done, torchao = [], 0
    for m in model.modules():
        if is_fp8_linear(m) and type(m.kernels) is TorchaoKernels:
            m.kernels, torchao = _dual_quant_kernels(cfg.dense_gemm), torchao + 1
        elif is_fp8_linear(m) and type(m.kernels) is EmulatedKernels:
            m.kernels = SwiGLUEmulatedKernels(m.kernels.act_recipe)
    if torchao and cfg.dense_gemm == "deep_gemm":
        done.append(f"{torchao} linears' forward and data-gradient GEMMs on DeepGEMM")
    if cfg.fuse_projections and (n := fuse_projections(model)):
        done.append(f"{n} q/k/v + gate/up groups fused into one GEMM each")
    if cfg.fuse_projections and cfg.fuse_swiglu and (n := fuse_swiglu(model)):
        done.append(f"{n} SwiGLU MLPs with silu*mul inside the FP8 quantization")
    if cfg.cache_weights and world > 1:
        done.append(f"{gather_fp8_weights(model, world)} FP8 weights all-gathered in FP8, each rank's shard "
                    "quantized once per optimizer step")
    elif cfg.cache_weights:
        done.append(f"{attach_weight_caches(model)} FP8 weights cached between optimizer steps")
    if cfg.fuse_grad_accum and world == 1:  # the outermost kernels: after the caches
        done.append(f"{attach_grad_accumulators(model)} weight gradients added into .grad by their GEMM")
    return done


@functools.cache
def _dual_quant_kernels(dense_gemm: str = "cublas"):
    """One DualQuantKernels (DeepGemmKernels for fp8.dense_gemm=deep_gemm) for every torchao linear
    (stateless), as TorchaoKernels is one per class."""
    if dense_gemm == "cublas":
        return DualQuantKernels()
    require_deep_gemm("fp8.dense_gemm=deep_gemm", "fp8.dense_gemm=cublas")
    return DeepGemmKernels()
