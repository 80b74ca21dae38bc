"""fp8.kv_attention=xqa (engines/vllm_internals.py, patch_xqa_scales) on the CPU: vLLM 0.26's real FlashInferImpl.forward drives its
XQA decode call, recorded against flashinfer's installed signature. Unpatched, vLLM passes the scales
as floats (frozen under CUDA graphs, v never updated); patched, as the layer's own device tensors, so
the engine's in-place recalibration reaches the kernel. The GPU kernel itself: bench/decode_attention.py."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from config import load_config
from engines.vllm import VLLMEngine

B, HQ, HK, D, PAGE = 2, 4, 2, 16, 16


def _fib():
    try:
        import flashinfer.decode
        from vllm.v1.attention.backends import flashinfer as fib
    except Exception as e:  # not installed, or broken on this host
        pytest.skip(f"vllm/flashinfer do not import here ({type(e).__name__}: {e})")
    return fib, inspect.signature(flashinfer.decode.trtllm_batch_decode_with_kv_cache)


def test_xqa_decode_reads_the_layers_scale_tensors(monkeypatch):
    fib, sig = _fib()
    from engines import vllm_internals

    calls = []

    def decode(*a, **kw):  # flashinfer's kernel entry point, as called by vLLM's decode path
        calls.append(sig.bind(*a, **kw).arguments)
        return kw["out"].zero_()

    monkeypatch.setattr(fib, "trtllm_batch_decode_with_kv_cache", decode)
    monkeypatch.setattr(fib, "_get_trtllm_workspace_buffer", lambda: torch.zeros(64, dtype=torch.uint8))
    monkeypatch.setattr(fib, "get_kv_cache_layout", lambda: "NHD")
    monkeypatch.setattr(fib, "can_use_trtllm_attention", lambda *a, **k: True)  # no artifact-server probe
    for name in ("forward", "get_xqa_bmm1_scale"):  # the patch is undone after the test
        monkeypatch.setattr(fib.FlashInferImpl, name, getattr(fib.FlashInferImpl, name))
    monkeypatch.setattr(fib.FlashInferImpl, "_device_scales", False, raising=False)

    layer = SimpleNamespace(_q_scale=torch.tensor(0.5), _k_scale=torch.tensor(2.0), _v_scale=torch.tensor(3.0),
                            _q_scale_float=0.5, _k_scale_float=2.0, _v_scale_float=3.0, _o_scale_float=None)
    kv = torch.zeros(4, PAGE, HK, 2 * D, dtype=torch.uint8).permute(0, 2, 1, 3)  # vLLM's NHD pages, K | V
    meta = fib.FlashInferMetadata(
        num_actual_tokens=B, slot_mapping=torch.zeros(B, dtype=torch.int64),
        q_data_type_prefill=torch.float8_e4m3fn, q_data_type_decode=torch.bfloat16,
        num_decodes=B, num_decode_tokens=B, num_prefills=0, num_prefill_tokens=0, causal=True, prefill=None,
        decode=fib.FlashInferTrtllmAPIDecode(kernel=fib.FlashInferDecodeKernel.XQA,
                                             block_tables=torch.zeros(B, 2, dtype=torch.int32),
                                             seq_lens=torch.full((B,), 20, dtype=torch.int32), max_seq_len=20),
        use_cascade=False, cascade_wrapper=None)
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16)

    def step():
        impl = fib.FlashInferImpl(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HK, alibi_slopes=None,
                                  sliding_window=None, kv_cache_dtype="fp8")
        calls.clear()
        impl.forward(layer, q, q[:, :HK], q[:, :HK], kv, meta, torch.empty(B, HQ, D, dtype=torch.bfloat16))
        (kw,) = calls
        assert kw["backend"] == "xqa" and kw["kv_layout"] == "NHD" and kw["query"].dtype == torch.bfloat16
        assert kw["kv_cache"][0].dtype == torch.float8_e4m3fn
        return kw["bmm1_scale"], kw["bmm2_scale"]

    assert step() == (pytest.approx(2.0 * D ** -0.5), 3.0)  # vLLM's own: host floats
    vllm_internals.patch_xqa_scales()
    vllm_internals.patch_xqa_scales()  # idempotent: one wrapper, not two
    for k, v in [(2.0, 3.0), (4.0, 0.25)]:
        layer._k_scale.fill_(k)  # as set_kv_scales does; the float mirrors stay stale on purpose
        layer._v_scale.fill_(v)
        bmm1, bmm2 = step()
        assert isinstance(bmm1, torch.Tensor) and bmm1.dtype == torch.float32 and bmm1.dim() == 0
        assert bmm1.item() == pytest.approx(k * D ** -0.5)  # BF16 q: no q scale in bmm1
        assert bmm2 is layer._v_scale


def test_xqa_engine_fixes_q_scale_at_one(monkeypatch, caplog):
    """XQA casts q to e4m3 unscaled: the engine writes q scale 1 (prefill quantizes q with it) and says
    when a layer's calibrated q would not fit e4m3 that way; k and v scales are written as given."""
    eng = object.__new__(VLLMEngine)
    eng.cfg = load_config(None, ["fp8.kv_cache=true", "fp8.kv_attention=xqa"])
    eng.kv_scales, eng._warned_q_range = {0: (0.5, 2.0, 3.0), 1: (1.5, 0.25, 0.125)}, False
    attn = {i: SimpleNamespace(**{f"_{x}_scale": torch.tensor(9.0) for x in "qkv"},
                               **{f"_{x}_scale_cpu": torch.tensor(9.0) for x in "kv"}) for i in (0, 1)}
    monkeypatch.setattr(VLLMEngine, "_attention_layers", lambda self: attn)
    eng._apply_kv_scales()
    for i, (_, k, v) in eng.kv_scales.items():
        a = attn[i]
        assert (a._q_scale.item(), a._k_scale.item(), a._v_scale.item()) == (1.0, k, v)
        assert (a._q_scale_float, a._k_scale_float, a._v_scale_float) == (1.0, k, v)
    assert "layer 1's calibrated q scale is 1.5" in caplog.text and "layer 0" not in caplog.text
