"""GPU tests check numerics, not speed: torchao's quantizers run with one fixed launch config each.

torchao 0.18 autotunes each block-FP8 quantizer over up to 45 launch configs per new K (~20 s
each on an H100); the small test models hit a dozen new Ks, which made test_fp8_gpu.py outlast a
10-minute device call. A quantizer's output does not depend on its launch config (rows/columns
per program, warps, stages): each 1x128 / 128x1 / 128x128 group is reduced the same way. Triton
skips the benchmark when an autotuner has a single config.
"""

import pytest
import torch


def _pin(autotuner) -> None:
    prefer = {"NUM_GROUPS": 64, "BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128}
    configs = autotuner.configs
    best = [c for c in configs if all(c.kwargs.get(k, v) == v for k, v in prefer.items())
            and c.num_warps == 4 and c.num_stages == 2]
    autotuner.configs = (best or configs)[:1]


@pytest.fixture(autouse=True, scope="session")
def torchao_quantizers_without_autotuning():
    if not torch.cuda.is_available():
        yield
        return
    try:
        from torchao.prototype.blockwise_fp8_training import kernels
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        yield
        return
    tuners = [v for v in vars(kernels).values() if isinstance(v, Autotuner)]
    saved = [(t, t.configs) for t in tuners]
    for t in tuners:
        _pin(t)
    yield
    for t, configs in saved:
        t.configs = configs
