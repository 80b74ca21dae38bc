"""fp8/fast/gather.py on one process: the FP8 all-gather's pieces without FSDP2 (tests/e2e/test_distributed.py
runs them under FSDP2 on 2 gloo ranks)."""

import pytest
import torch
import torch.nn.functional as F

from fp8.fast.gather import GatheredFP8Weight, GatheredKernels, ShardedFP8Weight, _quantize, can_gather
from fp8.linear import EmulatedKernels


def gathered(w: torch.Tensor, ranks: int, torchao: bool = False) -> GatheredFP8Weight:
    """What FSDP2's all-gather hands the module: each rank's shard quantized, concatenated along dim 0."""
    parts = [_quantize(s, torchao) for s in w.chunk(ranks)]
    return GatheredFP8Weight(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), w.dtype)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_gathered_shards_give_the_whole_weights_operands(ranks):
    """A 128x128 block never spans two shards, so the gathered bytes are those of the whole weight (and of
    a fused group's concatenation): the operands equal EmulatedKernels', bit for bit."""
    torch.manual_seed(0)
    ws = (torch.randn(1024, 384) * 0.02, torch.randn(512, 384))  # a fused group: members of different scales
    kernels = EmulatedKernels("torchao")
    want = kernels.weight_fwd(ws)[0]
    got = GatheredKernels(kernels).weight_fwd(tuple(gathered(w, ranks) for w in ws))[0]
    assert torch.equal(got, want)
    dgrad = GatheredKernels(kernels).weight_dgrad((gathered(ws[0], ranks),))[0]
    assert torch.equal(dgrad, kernels.weight_dgrad(ws[:1])[0])


def test_can_gather_needs_whole_blocks_per_rank():
    assert can_gather(torch.empty(256, 128), 2) and can_gather(torch.empty(1024, 4096), 8)
    assert not can_gather(torch.empty(128, 128), 2)  # 64 rows a rank: a block would span two ranks
    assert not can_gather(torch.empty(256, 100), 1)


def test_shard_requantizes_after_any_in_place_change():
    """The FP8 bytes are kept between all-gathers until an op changes the shard in place (the optimizer's
    step, a checkpoint load, through the wrapper) or its tensor's version moves (a write to it directly)."""
    mp = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=None)
    w = ShardedFP8Weight(torch.randn(256, 128), torchao=False)
    first = w.fsdp_pre_all_gather(None, None, None, None, mp)[0]
    assert w.fsdp_pre_all_gather(None, None, None, None, mp)[0] is first  # kept
    w.mul_(2.0)
    second = w.fsdp_pre_all_gather(None, None, None, None, mp)[0]
    assert second is not first and torch.equal(second[1], first[1] * 2)
    w._tensor.add_(1.0)
    assert w.fsdp_pre_all_gather(None, None, None, None, mp)[0] is not second
    assert type(w + 1) is torch.Tensor and type(w.detach()) is ShardedFP8Weight  # arithmetic sees the plain tensor


def test_shard_quantizes_its_bf16_cast_under_mixed_precision():
    """FSDP2 with param_dtype=bf16 would gather the bf16 cast of the fp32 master, and the GEMM quantize
    that: the shard quantizes the same cast."""
    w = torch.randn(256, 128)
    mp = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    q, s = ShardedFP8Weight(w, torchao=False).fsdp_pre_all_gather(None, None, None, None, mp)[0]
    want_q, want_s = _quantize(w.bfloat16(), False)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def test_gathered_weight_serves_only_the_fp8_gemm():
    g = gathered(torch.randn(256, 128), 2)
    assert type(g.detach()) is GatheredFP8Weight
    with pytest.raises(NotImplementedError, match="fp8.cache_weights=false"):
        F.linear(torch.randn(3, 128), g)


def test_every_gemm_gathers_when_linears_share_one_kernels_object():
    """torchao's linears share one kernels object (fp8.fast's DualQuantKernels): each GEMM is still visited
    once, by its members. At 2 ranks a layer's q/k/v group stays bf16-gathered (k/v: 128 rows, 64 a rank),
    its gate/up group, o_proj and down_proj gather FP8."""
    from config import FP8Config
    from fp8.fast.gather import gather_fp8_weights
    from fp8.linear import is_fp8_linear
    from test_fp8_linear import convert_fast, tiny_llama

    model = tiny_llama(layers=2)
    convert_fast(model, FP8Config())
    shared = EmulatedKernels("torchao")
    for m in model.modules():
        if is_fp8_linear(m):
            m.kernels = shared
    assert gather_fp8_weights(model, 2) == 6
    layer = model.model.layers[0]
    assert type(layer.self_attn.k_proj.weight.data) is torch.Tensor
    assert all(type(m.weight.data) is ShardedFP8Weight for m in (layer.mlp.gate_proj, layer.mlp.up_proj,
                                                                 layer.mlp.down_proj, layer.self_attn.o_proj))
    assert layer.mlp.gate_proj.kernels is layer.mlp.up_proj.kernels and isinstance(layer.mlp.up_proj.kernels,
                                                                                   GatheredKernels)
