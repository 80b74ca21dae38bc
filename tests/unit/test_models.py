"""models/: every registered family builds a tiny model on CPU, family_of finds its spec, and the
module names its spec gives exist in that model (fused groups, SwiGLU children, attention modules,
decoder layers), so the fp8 plan, fusion, calibration, export and FSDP see what they expect."""

import fnmatch

import pytest
import torch
from torch import nn

import distributed
import models
from config import TinyModelConfig
from errors import UserError
from fp8.export import kv_scale_names
from modeling import build_char_tokenizer, build_tiny_model


def tiny(arch: str) -> nn.Module:
    torch.manual_seed(0)
    moe = models.FAMILIES[arch].experts is not None
    t = TinyModelConfig(arch=arch, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=64, num_experts=4 if moe else 0)
    return build_tiny_model(t, build_char_tokenizer("abc"), torch.float32)


@pytest.mark.parametrize("arch", sorted(models.FAMILIES))
def test_family_names_exist_in_its_tiny_model(arch):
    spec = models.FAMILIES[arch]
    model = tiny(arch)
    assert type(model).__name__ == spec.model_class
    assert models.family_of(model) is spec and models.family_of(model.config) is spec
    layers = distributed.required_decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers == 2
    attn = models.attention_modules(model)
    assert sorted(attn) == [0, 1]
    for i, layer in enumerate(layers):
        assert attn[i] is getattr(layer, spec.attention) and attn[i].layer_idx == i
        names = {n for n, _ in layer.named_modules()}
        for group in spec.fused_groups:  # each group is the sibling linears of one parent
            parents = {n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in group}
            if not parents and spec.experts is not None:  # a MoE layer has no dense gate/up
                continue
            assert len(parents) == 1, (group, parents)
            parent = layer.get_submodule(parents.pop())
            assert all(isinstance(getattr(parent, leaf), nn.Linear) for leaf in group), group
        routers = [n for n in names for p in spec.router_patterns if fnmatch.fnmatchcase(f"{spec.layers}.{i}.{n}", p)]
        if spec.experts is None:
            mlps = [m for m in layer.modules() if set(dict(m.named_children())) == set(spec.swiglu)]
            assert len(mlps) == 1, spec.swiglu
            assert not routers  # a dense family: no module of it is taken for a router
            continue
        # a MoE family: the router the skip-list keeps BF16, and the 3-D experts fp8/moe.py and the export read
        assert routers == [spec.router]
        experts = layer.get_submodule(spec.experts)
        e = model.config.num_experts
        for param, linears in spec.expert_weights:
            w = getattr(experts, param)
            assert isinstance(w, nn.Parameter) and w.dim() == 3 and w.shape[0] == e and w.shape[1] % len(linears) == 0
    # the kv-scale modules vLLM creates sit under the attention modules (test_fp8_export checks the names)
    assert kv_scale_names(model) == {i: f"{spec.layers}.{i}.{spec.attention}.{spec.kv_scale_module}"
                                     for i in range(2)}


def test_unknown_family():
    """A model of an unregistered type gets the generic HF decoder conventions; building a tiny
    model of one is a UserError naming the registered families."""
    assert models.family_of(nn.Linear(2, 2)) is models.GENERIC
    assert models.family_of("gpt_oss") is models.GENERIC
    with pytest.raises(UserError, match="not registered .known: llama, qwen3, qwen3_moe"):
        models.family("gpt_oss")
    assert models.decoder_layers(nn.Linear(2, 2)) == []
    with pytest.raises(UserError, match="no model.layers to shard"):
        distributed.required_decoder_layers(nn.Linear(2, 2))


def test_a_model_dir_on_the_meta_device_has_the_structure_and_no_weights(tmp_path):
    """An async vLLM engine rank builds the model on the meta device: config and module names, no weights."""
    from config import ModelConfig
    from modeling import load_model_and_tokenizer, save_model_dir

    tiny, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path="tiny"), torch.device("cpu"))
    save_model_dir(tiny, tokenizer, tmp_path)
    meta, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(tmp_path)), torch.device("meta"))
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in tiny.named_parameters()}
    assert all(p.is_meta for p in meta.parameters()) and type(meta) is type(tiny)


@pytest.mark.parametrize("cudnn", [True, False])
def test_the_trainer_pins_sdpas_cudnn_switch_before_its_first_forward(cudnn):
    """prepare_trainer sets cuDNN's SDPA switch as model.cudnn_sdpa says, for the process, whatever it was,
    and tags torch.compile's cache keys with it. vLLM's CUDA platform import (which turns it off) comes
    before that on the GPU, so an import later in the run (the engine, an FP8 kernel's first use) changes no
    attention kernel, not even between an eager checkpointed layer's forward and its recompute."""
    import argparse
    from pathlib import Path

    import run_setup
    from config import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml"),
                      ["train.compile=none", f"model.cudnn_sdpa={str(cudnn).lower()}"])
    before, tag = torch.backends.cuda.cudnn_sdp_enabled(), torch.compiler.config.cache_key_tag
    torch.backends.cuda.enable_cudnn_sdp(not cudnn)
    try:
        run_setup.prepare_trainer(tiny("llama"), None, cfg, distributed.Dist(0, 1, torch.device("cpu"), 1), False,
                                argparse.Namespace(print=lambda *a: None))
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
        # torch.compile's caches key on the switch: no graph traced with the other kernel is reused
        assert torch.compiler.config.cache_key_tag.endswith(f"cudnn_sdp={int(cudnn)}")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
        torch.compiler.config.cache_key_tag = tag
