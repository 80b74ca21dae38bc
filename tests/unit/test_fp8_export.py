"""fp8/export.py on CPU: HF names, FP8 bytes == quant.py (the trainer's quantizer: the "one
quantizer" proof on the CPU side), round trip into an HF model, tied embeddings, and kv-scale
names that vLLM 0.26's own name mapping accepts unchanged."""

import inspect

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from config import FP8Config
from engines.hf import convert_to_fp8_rollout, get_kv_scales, load_exported_into_hf
from fp8.export import export_weights, kv_scale_names, vllm_quantization_config
from fp8.linear import EmulatedFP8Linear
from fp8.plan import fp8_plan
from fp8.quant import E4M3, dequantize_blockwise, quantize_blockwise
from test_fp8_linear import convert_fast


def tiny_llama(tie=False, layers=3, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=layers, vocab_size=64, max_position_embeddings=128,
                      tie_word_embeddings=tie, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype)


CFG = FP8Config(keep_last_layers=1, keep_bf16=["model.layers.0.self_attn.k_proj"])
KV = {0: (0.01, 0.02, 0.03), 1: (0.04, 0.05, 0.06), 2: (0.07, 0.08, 0.09)}


def test_names_and_dtypes():
    model = tiny_llama()
    sd = model.state_dict()
    stream = export_weights(model, CFG, fp8=False)
    assert inspect.isgenerator(stream)
    pairs = list(stream)
    assert [n for n, _ in pairs] == list(sd)
    assert all(t.dtype == torch.bfloat16 and t.data_ptr() == sd[n].data_ptr() for n, t in pairs)  # no copies

    pairs = dict(export_weights(model, CFG, fp8=True))
    plan = fp8_plan(model, CFG)
    fp8_prefixes = {n for n, (ok, _) in plan.items() if ok}
    assert len(fp8_prefixes) == 4 + 7  # layer 0: o + mlp (q/k/v kept as a group), layer 1: all, layer 2: kept
    assert "model.layers.0.self_attn.q_proj" not in fp8_prefixes
    expected = set(sd) | {p + ".weight_scale_inv" for p in fp8_prefixes}
    assert set(pairs) == expected
    for name, t in pairs.items():
        prefix = name.rsplit(".", 1)[0]
        if prefix in fp8_prefixes:
            assert t.dtype == (torch.float32 if name.endswith("_scale_inv") else E4M3), name
        else:
            assert t.dtype == torch.bfloat16 and torch.equal(t, sd[name]), name


def test_fp8_bytes_equal_quant_py_on_converted_model():
    """The trainer's converted model exports the same names, and its FP8 weights are
    bit-for-bit quant.py's output (what torchao's kernels compute, see test_fp8_quant/gpu)."""
    model = tiny_llama()
    names_before = [n for n, _ in export_weights(model, CFG, fp8=True)]
    converted = convert_fast(model, CFG)
    pairs = dict(export_weights(model, CFG, fp8=True))
    assert list(pairs) == names_before
    assert sorted(converted) == sorted(n for n, (ok, _) in fp8_plan(model, CFG).items() if ok)
    for prefix in converted:
        q, s = quantize_blockwise(model.get_submodule(prefix).weight)
        assert torch.equal(pairs[prefix + ".weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(pairs[prefix + ".weight_scale_inv"], s)


def test_roundtrip_into_plain_and_rollout_models():
    src = tiny_llama(seed=0)
    pairs = list(export_weights(src, CFG, fp8=True, kv_scales=KV))
    plan = fp8_plan(src, CFG)
    sd = src.state_dict()

    dst = tiny_llama(seed=1)  # plain HF model: receives dequantized weights
    loaded = load_exported_into_hf(dst, pairs)
    assert loaded == set(sd)
    for name, t in dst.state_dict().items():
        prefix = name[: -len(".weight")]
        if plan.get(prefix, (False,))[0]:
            assert torch.equal(t, dequantize_blockwise(*quantize_blockwise(sd[name]), dtype=torch.bfloat16))
        else:
            assert torch.equal(t, sd[name]), name
    assert get_kv_scales(dst) == {i: tuple(torch.tensor(v).float().tolist()) for i, v in KV.items()}

    rollout = tiny_llama(seed=2)  # CPU engine: FP8 bytes pinned in its W8A8 linears
    convert_to_fp8_rollout(rollout, CFG)
    load_exported_into_hf(rollout, pairs)
    pairs_d = dict(pairs)
    for prefix, (ok, _) in plan.items():
        mod = rollout.get_submodule(prefix)
        assert isinstance(mod, EmulatedFP8Linear) == ok
        if ok:
            q, s = mod._fp8_weight[:2]
            assert torch.equal(q.view(torch.uint8), pairs_d[prefix + ".weight"].view(torch.uint8))
            assert torch.equal(s, pairs_d[prefix + ".weight_scale_inv"])

    with pytest.raises(KeyError):
        load_exported_into_hf(tiny_llama(layers=2), pairs)  # layer 2 does not exist there
    with pytest.raises(ValueError):
        load_exported_into_hf(dst, [p for p in pairs if not p[0].endswith("_scale_inv")])


def test_tied_embeddings():
    model = tiny_llama(tie=True)
    names = [n for n, _ in export_weights(model, CFG, fp8=True)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    dst = tiny_llama(tie=True, seed=3)
    load_exported_into_hf(dst, export_weights(model, CFG, fp8=False))
    assert torch.equal(dst.lm_head.weight, model.model.embed_tokens.weight)


def test_kv_scale_names_accepted_by_vllm():
    """Our names are the final vLLM parameter names: vLLM 0.26's cache-scale mapper (applied by
    AutoWeightsLoader when a quant config is active) and maybe_remap_kv_scale_name leave them
    unchanged. The ModelOpt q name would be mangled, which is why we do not use it."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

    model = tiny_llama()
    assert kv_scale_names(model) == {i: f"model.layers.{i}.self_attn.attn" for i in range(3)}
    kv = [(n, t) for n, t in export_weights(model, CFG, fp8=True, kv_scales=KV) if n.endswith(
        ("q_scale", "k_scale", "v_scale"))]
    assert [n for n, _ in kv] == [f"model.layers.{i}.self_attn.attn.{x}_scale" for i in range(3) for x in "qkv"]
    assert all(t.dtype == torch.float32 and t.dim() == 0 for _, t in kv)
    assert kv[4][1].item() == pytest.approx(0.05)
    mapper = Fp8Config.get_cache_scale_mapper()
    for name, _ in kv:
        assert mapper._map_name(name) == name
        assert mapper._map_name(name.removeprefix("model.")) == name.removeprefix("model.")  # inner loader
        assert maybe_remap_kv_scale_name(name, {name: None}) == name
    assert mapper._map_name("model.layers.0.self_attn.q_proj.q_scale") != "model.layers.0.self_attn.attn.q_scale"
    assert mapper._map_name("model.layers.0.self_attn.k_proj.k_scale") == "model.layers.0.self_attn.attn.k_scale"


def test_vllm_quantization_config_matches_plan():
    """vLLM's Fp8Config parses it, and its fused-layer skip check agrees with fp8_plan without
    raising the mixed-precision error (the q/k/v group of layer 0 is kept BF16 as a whole)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    model = tiny_llama()
    qc = vllm_quantization_config(model, CFG)
    vc = Fp8Config.from_config(qc)
    assert vc.weight_block_size == [128, 128] and vc.is_checkpoint_fp8_serialized
    plan = fp8_plan(model, CFG)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # llama.py
    for i in range(3):
        for vllm_name, members in [("self_attn.qkv_proj", ["self_attn.q_proj"]), ("self_attn.o_proj", None),
                                   ("mlp.gate_up_proj", ["mlp.gate_proj"]), ("mlp.down_proj", None)]:
            prefix = f"model.layers.{i}.{vllm_name}"
            hf = f"model.layers.{i}.{(members or [vllm_name])[0]}"
            assert is_layer_skipped(prefix, vc.ignored_layers, packed) == (not plan[hf][0]), prefix


def test_qwen3_end_to_end():
    """Qwen3 (q_norm/k_norm before RoPE): conversion, calibration and export work the same way."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fp8.calibrate import QKVCalibrator

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=64,
                                         tie_word_embeddings=True, attn_implementation="sdpa"))
    assert len(convert_fast(model, FP8Config())) == 14
    calib = QKVCalibrator(model)
    ids = torch.randint(0, 64, (2, 10))
    with calib.capture():
        model(input_ids=ids, labels=ids).loss.backward()
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    blk = model.model.layers[0]
    attn = blk.self_attn
    with torch.no_grad():  # by hand, with the (FP8-emulated) projections and the q/k norms
        h = blk.input_layernorm(model.model.embed_tokens(ids))
        q = attn.q_norm(attn.q_proj(h).view(2, 10, -1, 64)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(2, 10, -1, 64)).transpose(1, 2)
        v = attn.v_proj(h).view(2, 10, -1, 64).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *model.model.rotary_emb(h, torch.arange(10)[None]))
    assert torch.equal(calib.amax()[0, 0], torch.stack([t.abs().amax() for t in (q, k, v)]))
    names = [n for n, _ in export_weights(model, FP8Config(), fp8=True, kv_scales=calib.scales())]
    assert "lm_head.weight" not in names
    assert "model.layers.1.self_attn.q_norm.weight" in names
    assert "model.layers.1.self_attn.attn.v_scale" in names
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" in names
