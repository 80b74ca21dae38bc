"""Qwen3 (dense): transformers' Qwen3ForCausalLM, vLLM's Qwen3ForCausalLM.

As Llama, plus q_norm/k_norm (RMSNorm over head_dim) inside self_attn, applied before RoPE: the
calibration hook sees q/k after both. vLLM packs q/k/v into qkv_proj and gate/up into gate_up_proj
and holds the kv-cache scales on self_attn.attn. No routers.
"""

from models import FamilySpec

# every other field is FamilySpec's default: the HF decoder layout described above
SPEC = FamilySpec(name="qwen3", config_class="Qwen3Config", model_class="Qwen3ForCausalLM")
