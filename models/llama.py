"""Llama (Llama 2/3/3.1): transformers' LlamaForCausalLM, vLLM's LlamaForCausalLM.

Decoder layer i: model.layers.i.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj + act_fn (SiLU)}.
vLLM packs q/k/v into qkv_proj and gate/up into gate_up_proj, and holds the kv-cache scales on
self_attn.attn (its Attention module). No routers.
"""

from models import VLLM_PACKED, FamilySpec

SPEC = FamilySpec(
    name="llama",
    config_class="LlamaConfig",
    model_class="LlamaForCausalLM",
    fused_groups=VLLM_PACKED,
    swiglu=("gate_proj", "up_proj", "down_proj", "act_fn"),
    layers="model.layers",
    attention="self_attn",
    kv_scale_module="attn",
)
