"""Llama (Llama 2/3/3.1): transformers' LlamaForCausalLM, vLLM's LlamaForCausalLM.

Decoder layer i: model.layers.i.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj + act_fn (SiLU)}.
vLLM packs q/k/v into qkv_proj and gate/up into gate_up_proj, and holds the kv-cache scales on
self_attn.attn (its Attention module). No routers.
"""

from models import FamilySpec

# every other field is FamilySpec's default: the HF decoder layout described above
SPEC = FamilySpec(name="llama", config_class="LlamaConfig", model_class="LlamaForCausalLM")
