"""What the recipe must know about a model family, one file per family (models/<family>.py).

Each family file defines `SPEC = FamilySpec(...)`; every module of this package that does is
registered under its `name`, HF's `config.model_type`. Adding a family (say Qwen3-MoE) is adding
one file. The code that uses these facts reads them through `family_of(model)`:

    fp8/plan.py         fused_groups (vLLM packs them into one linear: one precision per group),
                        router_patterns (MoE routers stay BF16), experts (3-D expert weights)
    fp8/moe.py          experts, expert_weights (block-FP8 expert GEMMs)
    routing.py          router, replay_weights (engine routing recorded and replayed, aux loss)
    fp8/fast/fused.py   fused_groups (one FP8 GEMM per group)
    fp8/fast/swiglu.py  swiglu (the MLP's gate/up/down/activation children)
    fp8/calibrate.py    layers + attention (the modules whose q/k/v the calibration hook sees)
    fp8/export.py       layers + attention + kv_scale_module (where vLLM loads the q/k/v scales)
    distributed.py      layers (the blocks FSDP2 shards and train.compile compiles)
    modeling.py         config_class/model_class, tiny_config (the tiny model built from model.tiny)

A model of an unregistered type (any other HF decoder loaded by path) gets GENERIC, the HF
decoder conventions (model.layers[i].self_attn, q/k/v and gate/up projections) that Llama,
Qwen2/3 and Mistral share; only building a tiny model needs a registered family.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from errors import UserError

# Router names of HF's MoE models (Mixtral, Qwen2/3-MoE, DeepSeek, ...): kept BF16 in any family,
# since a router's top-k decisions are discontinuous in its logits and it is tiny.
ROUTERS = ("*router*", "*.mlp.gate", "*.block_sparse_moe.gate", "*shared_expert_gate")
VLLM_PACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # qkv_proj, gate_up_proj


@dataclass(frozen=True)
class FamilySpec:
    """One model family, in HF module names (relative names are children of a decoder layer or MLP)."""

    name: str  # HF config.model_type, e.g. "llama"
    config_class: str  # transformers class names, for the tiny model
    model_class: str
    fused_groups: tuple[tuple[str, ...], ...] = VLLM_PACKED  # sibling linears vLLM loads as one
    router_patterns: tuple[str, ...] = ROUTERS  # fnmatch patterns on full names: MoE routers
    swiglu: tuple[str, str, str, str] | None = ("gate_proj", "up_proj", "down_proj", "act_fn")  # gate, up, down, act
    layers: str = "model.layers"  # dotted path of the decoder layers (nn.ModuleList)
    attention: str = "self_attn"  # each layer's attention child (runs ALL_ATTENTION_FUNCTIONS)
    kv_scale_module: str = "attn"  # vLLM's Attention under it, which holds the {q,k,v}_scale it loads
    # Mixture of experts (None: a dense family). Paths are relative to a decoder layer; a layer
    # without them (a dense layer of a MoE model) is skipped.
    experts: str | None = None  # the module holding the layer's experts as 3-D parameters [E, N, K]
    router: str | None = None  # the top-k router: forward(x [N, H]) -> (logits [N, E], weights [N, k], ids [N, k])
    # each 3-D expert parameter -> the per-expert linears it stacks along dim 1, in checkpoint
    # (and vLLM loader) names: `<experts>.<e>.<linear>.weight` [N / len(linears), K]
    expert_weights: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the router's top-k weights [N, k] for given expert ids [N, k] from its logits [N, E] (router replay)
    replay_weights: Callable[[nn.Module, Tensor, Tensor], Tensor] | None = None
    # extra HF config kwargs of the tiny model, from config.TinyModelConfig (e.g. the expert counts)
    tiny_config: Callable[[object], dict] | None = None


GENERIC = FamilySpec(name="generic", config_class="", model_class="")
FAMILIES: dict[str, FamilySpec] = {}


def register(spec: FamilySpec) -> FamilySpec:
    FAMILIES[spec.name] = spec
    return spec


for _info in pkgutil.iter_modules(__path__):
    _spec = getattr(importlib.import_module(f"{__name__}.{_info.name}"), "SPEC", None)
    if isinstance(_spec, FamilySpec):
        register(_spec)


def family(name: str) -> FamilySpec:
    """The registered family `name` (a config.model_type); UserError naming the known ones."""
    if name not in FAMILIES:
        raise UserError(f"model family {name!r} is not registered (known: {', '.join(sorted(FAMILIES))}); "
                        f"add models/{name}.py with a SPEC = FamilySpec(...)")
    return FAMILIES[name]


def family_of(model_or_config) -> FamilySpec:
    """The spec of a model (its .config), an HF config (its model_type) or a model_type string;
    GENERIC for anything unregistered or without a config (a bare nn.Module)."""
    obj = model_or_config
    if isinstance(obj, nn.Module):
        obj = getattr(obj, "config", None)
    name = obj if isinstance(obj, str) else getattr(obj, "model_type", None)
    return FAMILIES.get(name, GENERIC)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of `model` (its family's `layers` path); [] if it has none."""
    obj = model
    for part in family_of(model).layers.split("."):
        obj = getattr(obj, part, None)
    return list(obj) if obj is not None else []


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{layer index: attention module} of `model` (each decoder layer's `attention` child)."""
    attn = family_of(model).attention
    return {i: m for i, layer in enumerate(decoder_layers(model)) if (m := getattr(layer, attn, None)) is not None}
