"""fp8/fast/kernels.py's quantization kernel compiled for sm_90 on the CPU (scripts/kernel_regs.py): the
default launches keep the register budget the float32-scale kernel's speedup came from (H100: quant_dual at 2 programs per SM
instead of 1; bench/results/quant_h100.json), without spilling."""

import pytest

pytest.importorskip("triton")


def test_default_quant_launches_fit_their_register_budget():
    from fp8.fast import kernels
    from scripts.kernel_regs import resources

    split, warps = kernels.DEFAULT_CONFIG[:2]
    dual = resources(split, warps, mode=0)
    # 2 programs of `warps` warps per SM need <= 65536 / (2 * 32 * warps) registers per thread
    assert dual["stack_bytes"] == 0 and dual["registers"] <= 65536 // (2 * 32 * warps), dual
    split, warps = kernels.DEFAULT_SWIGLU_CONFIG[:2]
    for mode in (1, 2):
        r = resources(split, warps, mode=mode)
        assert r["stack_bytes"] == 0 and r["registers"] <= 65536 // (32 * warps), (mode, r)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_quant_stores_stay_vectorized_at_a_dynamic_length(mode):
    """A compiled layer of varying length launches the kernel with its row count unspecialized: the
    [K, M] FP8 output must still go out in 16-byte stores, not byte by byte (what an M argument of
    unknown divisibility gave: 64 byte stores per thread and tile, +35% kernel time in the train pass)."""
    from fp8.fast import kernels
    from scripts.kernel_regs import resources

    split, warps = (kernels.DEFAULT_CONFIG if mode == 0 else kernels.DEFAULT_SWIGLU_CONFIG)[:2]
    assert resources(split, warps, mode=mode, size_hint=False)["byte_stores"] == 0
