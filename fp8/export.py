"""Stream trainer weights to the rollout engine in HF checkpoint names, FP8 where fp8_plan says so.

    for name, t in export_weights(model, cfg.fp8, fp8=cfg.fp8.rollout, kv_scales=scales):
        ...  # vLLM: reload_weights (engines/vllm.py); CPU engine: engines.hf.load_exported_into_hf

Names are the HF state_dict names of the unwrapped model (`model.layers.0.self_attn.q_proj.
weight`, ...), the converted FP8 training linears keep those names. With fp8=True each FP8
linear yields `<prefix>.weight` as float8_e4m3fn [N, K] and `<prefix>.weight_scale_inv` float32
[ceil(N/128), ceil(K/128)] (DeepSeek-V3 / vLLM `Fp8Config(weight_block_size=[128, 128])`
checkpoint format; the engine's config.json needs `vllm_quantization_config(...)`), bit-identical
to what torchao's kernels use in the trainer (both are fp8/quant.py). All other tensors are
yielded as they are (model dtype, no copy). A tied lm_head.weight is skipped, as vLLM's
LlamaForCausalLM/Qwen3ForCausalLM.load_weights skip it too.

MoE experts (models/<family>.py `experts`): each 3-D parameter goes out as one 2-D linear per expert,
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` (+ `.weight_scale_inv` when the plan
makes the experts FP8): the per-expert names vLLM's FusedMoE loader maps to w13/w2 (and the published
Qwen3-30B-A3B-FP8 checkpoint's). With I % 128 == 0 the 128x128 blocks of gate and up quantized apart
are those of the trainer's [2I, H] expert weight, so the bytes are the trainer's.

KV scales go out as `model.layers.{i}.self_attn.attn.{q,k,v}_scale` (the module names
models/<family>.py gives: layers, attention, kv_scale_module), 0-dim float32 - the names
of the KVCacheScaleParameter attributes that vLLM's BaseKVCacheMethod.create_weights puts on its
Attention module `self_attn.attn` (vllm/model_executor/layers/quantization/kv_cache.py). That
form is already final: the cache-scale name mapper that AutoWeightsLoader applies
(QuantizationConfig.get_cache_scale_mapper, base_config.py; Fp8Config's adds suffix rules) maps
`.{q,k,v}_scale` -> `.attn.{q,k,v}_scale` only when not already preceded by `.attn`, and
maybe_remap_kv_scale_name returns a name found in the params dict unchanged. The ModelOpt form
`self_attn.k_proj.k_scale` would work for k/v but not for q (it would become
`self_attn.q_proj.attn.q_scale`). vLLM creates these parameters only when a quantization config
is active (Fp8Config.get_quant_method returns Fp8KVCacheMethod for Attention); with plain BF16
weights there is nothing to load them into.

Streaming: one tensor at a time (quantized on the weight's device, DTensors gathered one by
one); the state_dict used for iteration holds references, not copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from fp8.plan import clean_name, fp8_plan
from fp8.quant import BLOCK, quantize_blockwise
from models import attention_modules, family_of

if TYPE_CHECKING:
    from config import FP8Config

SCALE_SUFFIX = ".weight_scale_inv"
KV_SCALE_NAMES = ("q_scale", "k_scale", "v_scale")  # vLLM Attention's; the module holding them: family_of


def _full(t: Tensor) -> Tensor:
    """A DTensor (FSDP2/TP shard) gathered to a plain tensor; anything else detached."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach()


def _tied(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return bool(getattr(text_cfg, "tie_word_embeddings", False))


def kv_scale_names(model: nn.Module) -> dict[int, str]:
    """{layer: '<attention module name>.<family's kv_scale_module>'} e.g. 'model.layers.0.self_attn.attn'."""
    names = {id(m): clean_name(n) for n, m in model.named_modules()}
    sub = family_of(model).kv_scale_module
    return {i: f"{names[id(m)]}.{sub}" for i, m in attention_modules(model).items()}


def export_weights(model: nn.Module, cfg: FP8Config, fp8: bool,
                   kv_scales: dict[int, tuple[float, float, float]] | None = None,
                   ) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, tensor): FP8 weight + weight_scale_inv for fp8_plan linears when fp8,
    everything else as is; then q/k/v scales per layer if kv_scales is given."""
    plan = fp8_plan(model, cfg) if fp8 else {}
    skip_lm_head = _tied(model)
    experts = _experts_by_param(model)
    for raw_name, t in model.state_dict(keep_vars=True).items():
        name = clean_name(raw_name)
        if skip_lm_head and name == "lm_head.weight":
            continue
        if name in experts:  # a 3-D expert weight: one 2-D linear per expert, as vLLM's FusedMoE loads them
            w = _full(t)
            for linear, (module, _, e, rows) in experts[name]:
                if plan.get(module, (False,))[0]:
                    q, scale_inv = quantize_blockwise(w[e, rows], BLOCK)  # [n, K] e4m3, [n/128, K/128] fp32
                    yield f"{linear}.weight", q
                    yield linear + SCALE_SUFFIX, scale_inv
                else:
                    yield f"{linear}.weight", w[e, rows]
            continue
        prefix = name[: -len(".weight")] if name.endswith(".weight") else None
        if prefix is not None and plan.get(prefix, (False,))[0]:
            q, scale_inv = quantize_blockwise(_full(t), BLOCK)  # [N, K] e4m3, [N/128, K/128] fp32
            yield name, q
            yield prefix + SCALE_SUFFIX, scale_inv
        else:
            yield name, _full(t)
    if kv_scales is not None:
        for i, prefix in sorted(kv_scale_names(model).items()):
            for n, s in zip(KV_SCALE_NAMES, kv_scales[i]):
                yield f"{prefix}.{n}", torch.tensor(float(s), dtype=torch.float32)


def _experts_by_param(model: nn.Module) -> dict[str, list[tuple[str, tuple[str, str, int, slice]]]]:
    """{3-D expert parameter name: [(per-expert linear name, fp8.moe.expert_names entry)]}."""
    from fp8.moe import expert_names

    out: dict[str, list] = {}
    for linear, entry in expert_names(model).items():
        out.setdefault(f"{entry[0]}.{entry[1]}", []).append((linear, entry))
    return out


def vllm_quantization_config(model: nn.Module, cfg: FP8Config) -> dict:
    """`quantization_config` for the engine's config.json matching export_weights(fp8=True):
    block-128 FP8 with dynamic 1x128 activations; every linear fp8_plan keeps in BF16 is listed
    in ignored_layers (HF names; vLLM maps them and checks fused groups for consistency), MoE routers
    and BF16 experts modules included (fp8/plan.py)."""
    ignored = sorted(name for name, (ok, _) in fp8_plan(model, cfg).items() if not ok)
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "ignored_layers": ignored}
