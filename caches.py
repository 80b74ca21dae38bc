"""One directory for every compile and JIT cache a run fills, so that later runs on the host reuse them.

    FP8_GRPO_CACHE_DIR=/data/fp8-grpo-cache python train_grpo.py --config configs/qwen3_8b_fp8_kv.yaml

A cold start of an 8B config spends minutes compiling and JIT-building: vLLM's torch.compile graphs and
CUDA-graph plans, FlashInfer's kernels (XQA), Triton's kernels and autotuning results (torchao's FP8 GEMMs),
Inductor's compiled trainer, DeepGEMM's kernels. Each tool keeps its own cache in its own default place
(~/.cache/vllm, ~/.cache/flashinfer, ~/.triton, /tmp/torchinductor_<user>, ~/.deep_gemm). With
FP8_GRPO_CACHE_DIR set, each goes to a subdirectory of that one directory instead: one path to keep on a
persistent disk, copy to a new host, or delete. A variable the user set already wins. Unset: nothing changes.
The tools read these variables when they first compile, not at import, so train_grpo.py sets them first thing.
"""

import os
from pathlib import Path

ENV = "FP8_GRPO_CACHE_DIR"
SUBDIRS = {  # the tool's own variable -> its subdirectory
    "VLLM_CACHE_ROOT": "vllm",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "DG_JIT_CACHE_DIR": "deep_gemm",
}


def use_cache_dir(env=os.environ) -> dict[str, str]:
    """Point every tool's cache variable that is not set into FP8_GRPO_CACHE_DIR; -> {variable: dir} set."""
    root = env.get(ENV)
    if not root:
        return {}
    root = Path(root).expanduser().resolve()
    done = {}
    for var, sub in SUBDIRS.items():
        if not env.get(var):
            (root / sub).mkdir(parents=True, exist_ok=True)
            env[var] = done[var] = str(root / sub)
    return done
