"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): transformers' Qwen3MoeForCausalLM, vLLM's Qwen3MoeForCausalLM.

Decoder layer i: self_attn as Qwen3 (q/k/v/o_proj, q_norm/k_norm), then mlp = Qwen3MoeSparseMoeBlock:
  mlp.gate     Qwen3MoeTopKRouter, weight [E, H]: logits = x W^T, p = softmax(logits) in fp32, the top-k
               of p, renormalised to sum 1 when config.norm_topk_prob (Qwen3-30B-A3B: true)
  mlp.experts  Qwen3MoeExperts, 3-D parameters gate_up_proj [E, 2I, H] (gate rows first, then up) and
               down_proj [E, H, I]: expert e computes down[e] @ (silu(x gate[e]^T) * (x up[e]^T))
A layer in config.mlp_only_layers has a dense Qwen3MoeMLP instead (none in the released models).

vLLM loads the experts of layer i into one FusedMoE (`model.layers.i.mlp.experts`, w13 / w2) from
per-expert checkpoint names `mlp.experts.{e}.{gate,up,down}_proj.weight` (+ `.weight_scale_inv`
for block FP8: the published Qwen3-30B-A3B-FP8 format), and the router as a ReplicatedLinear
`mlp.gate` (kept BF16 through ignored_layers). vLLM packs q/k/v into qkv_proj (gate/up into
gate_up_proj only in dense layers) and holds the kv-cache scales on self_attn.attn.
"""

import torch
from torch import Tensor, nn

from models import FamilySpec


def replay_weights(router: nn.Module, logits: Tensor, ids: Tensor) -> Tensor:
    """Qwen3MoeTopKRouter's weights for the experts `ids` [N, k] (not necessarily its own top-k):
    softmax(logits [N, E]) in fp32 at ids, renormalised as the router does. For ids equal to
    the router's own top-k this is bit-identical to its output."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    weights = probs.gather(-1, ids)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def tiny_config(t) -> dict:
    """HF Qwen3MoeConfig kwargs of the tiny model (config.TinyModelConfig): every layer sparse,
    top-k weights renormalised as in Qwen3-30B-A3B."""
    return dict(num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
                moe_intermediate_size=t.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[])


SPEC = FamilySpec(
    name="qwen3_moe",
    config_class="Qwen3MoeConfig",
    model_class="Qwen3MoeForCausalLM",
    # fused_groups, swiglu, layers, attention, kv_scale_module: FamilySpec's defaults (gate/up and the
    # SwiGLU MLP exist in dense layers only, config.mlp_only_layers)
    experts="mlp.experts",
    router="mlp.gate",
    expert_weights=(("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))),
    replay_weights=replay_weights,
    tiny_config=tiny_config,
)
