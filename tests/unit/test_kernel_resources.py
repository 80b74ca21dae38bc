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


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_each_quant_input_is_passed_to_the_kernel_once(monkeypatch, mode):
    """_launch passes each input tensor in one pointer slot only, a stand-in in the slots its mode does not
    read: Inductor copies a fused kernel's output once per slot it is passed in (an RMSNorm wrote its
    output three times when x filled the x, gu and x_out slots)."""
    import torch

    from fp8.fast import kernels

    launched = []

    class Recorder:  # wrap_triton(kernel)[grid](*args, **constants)
        def __getitem__(self, grid):
            return lambda *args, **constants: launched.append(args)

    monkeypatch.setattr(kernels, "wrap_triton", lambda kernel: Recorder())
    x = torch.zeros(256, 512, dtype=torch.bfloat16)
    gu = torch.zeros(256, 1024, dtype=torch.bfloat16)
    inputs = {0: (x, None, 512), 1: (None, gu, 512), 2: (x, gu, 1024)}[mode]
    kernels._launch(*inputs, mode=mode, config=(1, 8))
    (args,) = launched
    for t in inputs[:2]:
        if t is not None:
            assert sum(a is t for a in args) == 1, mode
    unread = [a for a in args[:3] if not any(a is t for t in inputs[:2])]
    assert all(a.numel() == 1 for a in unread), [tuple(a.shape) for a in unread]
