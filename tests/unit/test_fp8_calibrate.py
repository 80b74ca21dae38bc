"""fp8/calibrate.py on CPU: captured q/k/v amax equal a hand computation with the layer's own
projections and RoPE, padding is excluded, percentiles over micro-batches, gradients untouched,
the CPU engine's FP8 attention emulation (engines/hf.py, through the same hook) equals a manual
quantize-dequantize, and the scales' hand-off to an engine and into a checkpoint goes one way."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from config import FP8Config
from engines.hf import fp8_attention, get_kv_scales, set_kv_scales
from fp8.calibrate import (
    QKVCalibrator, kv_scales_from_state, kv_scales_state, make_calibrator, scales_from_amax, send_kv_scales,
    start_kv_scales, uninstall,
)
from fp8.quant import E4M3

MARGIN = 1.05


def tiny_llama(impl="sdpa", seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=2, vocab_size=64, max_position_embeddings=128,
                      attn_implementation=impl)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def qkv_by_hand(model, ids, layer):
    """Post-RoPE q [B, H, T, D], k/v [B, Hkv, T, D] of `layer`, from the layer's own modules."""
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states[layer]  # input of `layer`
    blk = model.model.layers[layer]
    attn = blk.self_attn
    h = blk.input_layernorm(hs)
    b, t, _ = h.shape
    q = attn.q_proj(h).view(b, t, -1, 64).transpose(1, 2)
    k = attn.k_proj(h).view(b, t, -1, 64).transpose(1, 2)
    v = attn.v_proj(h).view(b, t, -1, 64).transpose(1, 2)
    cos, sin = model.model.rotary_emb(h, torch.arange(t)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def test_scales_equal_hand_computation():
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    calib = QKVCalibrator(model, percentile=99.9, margin=MARGIN)
    with calib.capture():
        model(input_ids=ids)
    scales = calib.scales()
    assert calib.amax().shape == (1, 2, 3) and sorted(scales) == [0, 1]
    for layer in (0, 1):
        amax = [t.abs().amax().float() for t in qkv_by_hand(model, ids, layer)]
        assert torch.equal(calib.amax()[0, layer], torch.stack(amax))
        expected = [(a.double() * MARGIN / 448).float().item() for a in amax]  # one micro-batch: p-th = it
        assert scales[layer] == pytest.approx(expected, rel=1e-6)
    # the implementation keeps its name (masks, flash kernel selection key on it); it is wrapped
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert model.config._attn_implementation == "sdpa"
    assert ALL_ATTENTION_FUNCTIONS["sdpa"].__name__ == "fp8qkv_sdpa"
    uninstall(model)
    assert not hasattr(model.model.layers[0].self_attn, "_fp8_qkv")
    with torch.no_grad():
        model(input_ids=ids)  # passes straight through


@pytest.mark.parametrize("via", ["attention_mask", "token_logprobs"])  # the latter runs the model without it
def test_padding_excluded(via):
    from batch import token_logprobs

    model = tiny_llama()
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    ids[1, 10:] = 0  # pad id 0 ...
    attn = model.model.layers[0].self_attn
    with torch.no_grad():  # ... whose embedding is an outlier for layer 0's q/k/v (survives RMSNorm)
        model.model.embed_tokens.weight[0] = sum(p.weight[0] / p.weight[0].norm()
                                                 for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    calib = QKVCalibrator(model)
    with calib.capture(), torch.no_grad():
        if via == "attention_mask":
            model(input_ids=ids, attention_mask=mask)
        else:
            token_logprobs(model, ids, mask, 1.0)
    q, k, v = qkv_by_hand(model, ids, 0)  # causal: valid positions do not see later padding
    valid = mask.bool()[:, None, :, None]
    exp = torch.stack([torch.where(valid, t.abs(), 0).amax() for t in (q, k, v)])
    assert torch.equal(calib.amax()[0, 0], exp)
    assert (torch.stack([t.abs().amax() for t in (q, k, v)]) > 1.5 * exp).all()  # padding would dominate


def test_percentile_over_microbatches():
    amax = torch.tensor([[[1.0, 10.0, 100.0]], [[2.0, 20.0, 200.0]], [[4.0, 40.0, 400.0]]])  # [3 mb, 1 layer, 3]
    s = scales_from_amax(amax, 50.0, MARGIN)[0]
    assert s == pytest.approx([2 * MARGIN / 448, 20 * MARGIN / 448, 200 * MARGIN / 448], rel=1e-7)
    # numpy-style linear interpolation: position 0.999 * 2 = 1.998 -> 2 + 0.998 * (4 - 2)
    s = scales_from_amax(amax, 99.9, MARGIN)[0]
    assert s == pytest.approx([3.996 * MARGIN / 448, 39.96 * MARGIN / 448, 399.6 * MARGIN / 448], rel=1e-6)
    assert scales_from_amax(amax, 100.0, 1.0)[0] == pytest.approx([4 / 448, 40 / 448, 400 / 448], rel=1e-7)

    # end to end: 3 forwards = 3 records, each equal to its own single-forward capture
    model = tiny_llama()
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (2, 12), generator=gen) for _ in range(3)]
    calib = QKVCalibrator(model, percentile=50.0, margin=MARGIN)
    singles = []
    for b in batches:
        with calib.capture(), torch.no_grad():
            model(input_ids=b)
        singles.append(calib.amax()[0])
    with calib.capture(), torch.no_grad():
        for b in batches:
            model(input_ids=b)
    assert torch.equal(calib.amax(), torch.stack(singles))
    med = torch.stack(singles).double().median(dim=0).values * MARGIN / 448
    for layer, sc in calib.scales().items():
        assert sc == pytest.approx(med[layer].tolist(), rel=1e-6)


def test_capture_keeps_gradients_and_checkpointing():
    model = tiny_llama().train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))

    def grads():
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads()
    calib = QKVCalibrator(model)
    with calib.capture():
        got = grads()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert calib.amax().shape == (1, 2, 3)  # recomputation in backward fed the same record
    with pytest.raises(RuntimeError):
        calib.reset()
        calib.scales()


def test_capture_inside_compiled_layers():
    """train.compile'd layers record inside their graphs (no graph break, no eager fallback): the
    records equal an eager capture's, one per forward, padding excluded as in eager."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    from distributed import compile_layers

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 2:] = 0
    records = []
    for compiled in (False, True):
        model = tiny_llama()
        backend = CompileCounter()
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_layers(model, backend)
        calib = QKVCalibrator(model)
        with calib.capture(), torch.no_grad():
            model(input_ids=ids)
            model(input_ids=ids, attention_mask=mask)
        records.append(calib.amax())
    torch._dynamo.reset()
    assert backend.frame_count >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert records[1].shape == (2, 2, 3) and torch.equal(records[0], records[1])
    assert not torch.equal(records[1][0], records[1][1])  # the padded forward's amax leaves pads out


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_fp8_attention_emulation_is_exact_quant_dequant(impl):
    model = tiny_llama(impl)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref_logits = model(input_ids=ids).logits
    calib = QKVCalibrator(model)
    with calib.capture(), torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref_logits)  # the wrapper alone changes nothing
    scales = calib.scales()

    attn = model.model.layers[0].self_attn
    seen = {}
    hook = attn.register_forward_hook(lambda m, a, out: seen.update(out=out[0]))  # returns None
    with fp8_attention(model, scales), torch.no_grad():
        logits = model(input_ids=ids).logits
    hook.remove()
    assert get_kv_scales(model) is None  # context restored

    def fq(x, s, reciprocal):  # vLLM: k/v divided by the scale, q multiplied by fp32(1/scale)
        s = torch.tensor(s, dtype=torch.float32)
        y = x.float() * (1 / s.double()).float() if reciprocal else (x.double() / s.double()).float()
        return (y.clamp(-448, 448).to(E4M3).float() * s).to(x.dtype)

    q, k, v = qkv_by_hand(model, ids, 0)
    qs, ks, vs = scales[0]
    with torch.no_grad():
        if impl == "sdpa":
            o, _ = sdpa_attention_forward(attn, fq(q, qs, True), fq(k, ks, False), fq(v, vs, False), None,
                                          scaling=attn.scaling)
        else:
            from transformers.models.llama.modeling_llama import eager_attention_forward
            causal = torch.full((20, 20), float("-inf")).triu(1)[None, None]
            o, _ = eager_attention_forward(attn, fq(q, qs, True), fq(k, ks, False), fq(v, vs, False), causal,
                                           scaling=attn.scaling)
        expected = attn.o_proj(o.reshape(2, 20, -1))
    assert torch.equal(seen["out"], expected)
    rel = (logits - ref_logits).norm() / ref_logits.norm()
    assert 0 < rel < 0.05, rel

    set_kv_scales(model, scales)
    assert get_kv_scales(model) == {i: tuple(s) for i, s in scales.items()}
    with pytest.raises(KeyError):
        set_kv_scales(model, {0: scales[0]})
    set_kv_scales(model, None)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref_logits)


class _Engine:
    def __init__(self):
        self.sent = []

    def set_kv_scales(self, scales):
        self.sent.append(scales)


def test_scales_reach_the_engine_only_with_an_fp8_kv_cache():
    """send_kv_scales is the one fp8.kv_cache guard: a BF16 KV cache gets no scales, nor does any engine
    before a calibration (None); start_kv_scales gives 1.0 per layer and tensor."""
    on, off, scales = FP8Config(kv_cache=True), FP8Config(kv_cache=False), {0: (0.5, 0.25, 0.125)}
    engine = _Engine()
    send_kv_scales(engine, off, scales)
    send_kv_scales(engine, on, None)
    start_kv_scales(engine, off, range(2))
    assert engine.sent == []
    send_kv_scales(engine, on, scales)
    start_kv_scales(engine, on, range(2))
    assert engine.sent == [scales, {0: (1.0, 1.0, 1.0), 1: (1.0, 1.0, 1.0)}]
    assert kv_scales_from_state({"step": 3, **kv_scales_state(scales)}) == scales
    assert kv_scales_from_state({"step": 3, **kv_scales_state(None)}) is None


def test_a_calibrator_only_with_fp8_kv_cache_and_recalibrate():
    model = tiny_llama()
    assert make_calibrator(model, FP8Config(kv_cache=False, recalibrate=True)) is None
    assert make_calibrator(model, FP8Config(kv_cache=True, recalibrate=False)) is None
    calib = make_calibrator(model, FP8Config(kv_cache=True, calib_percentile=90.0, calib_margin=1.5))
    assert (calib.percentile, calib.margin) == (90.0, 1.5)
    uninstall(model)
