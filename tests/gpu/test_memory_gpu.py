"""bench/memory_breakdown.py on CUDA's own allocator history (skipped without CUDA): the snapshot's fields
and frame order are what the replay reads."""

import gc
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def make_activation() -> torch.Tensor:
    return torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")


def test_breakdown_of_a_recorded_history():
    from bench.memory_breakdown import breakdown

    gc.collect()  # earlier tests' tensors freed, their pending frees completed: none lands inside the history
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
    try:
        kept = make_activation()
        scratch = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
        del scratch  # freed after the peak, which holds both
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out = breakdown(snapshot, torch.cuda.current_device(), before, str(ROOT))
    assert out["made_in_stretch_at_peak_gib"] == round(96 * MIB / 2**30, 3)
    assert out["allocated_peak_gib"] == round((before + 96 * MIB) / 2**30, 3)
    assert [r["origin"] for r in out["at_peak"]] == ["tests/gpu/test_memory_gpu.py:make_activation",
                                                     "tests/gpu/test_memory_gpu.py:test_breakdown_of_a_recorded_history"]
    assert sum(v["reserved_gib"] for v in out["reserved_by_stream_at_end"].values()) >= 0.06
    del kept
