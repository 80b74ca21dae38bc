"""bench/decode_attention.py without a GPU: argument errors (exit 2, one `error:` line), the exit
without CUDA, the page table, the FP8 cache and its scales, the float32 paged reference against a
direct per-sequence computation, the workload's references, the bandwidth arithmetic, the verdict, and
each variant's calls bound to the installed vLLM / FlashInfer signatures (the kernels replaced by
recorders). The kernels, the CUDA graphs and the in-place scale check run only on the Hopper host."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import decode_attention as da



@pytest.mark.parametrize("argv, needle", [
    (["--batch", "0"], "--batch must be >= 1"),
    (["--q-heads", "12", "--kv-heads", "8"], "multiple of --kv-heads"),
    (["--block-sizes", "16,24"], "multiples of 16"),
    (["--block-sizes", "x"], "positive integers"),
    (["--variants", "fa3_bf16,nosuch"], "choose from"),
    (["--head-dim", "100"], "multiple of 16"),
    (["--warmup", "-1"], "--warmup"),
    (["--nosuch"], "unrecognized arguments"),
])
def test_bad_args_exit_2_with_one_error_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        da.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_defaults_are_the_8b_decode_shape():
    a = da.build_parser().parse_args([])
    assert (a.batch, a.context, a.q_heads, a.kv_heads, a.head_dim, a.block_sizes) == (128, 4096, 32, 8, 128, [16])
    assert a.variants == da.VARIANTS and da.check_args(a) is None
    assert da.build_parser().parse_args(["--block-size", "64"]).block_sizes == [64]


def test_without_cuda_exits_with_its_message(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "bench.decode_attention", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "needs a CUDA GPU" in r.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())


def test_block_table_is_a_seeded_permutation_of_all_pages():
    bt = da.make_block_table(4, 100, 16, torch.Generator().manual_seed(0))
    assert bt.dtype == torch.int32 and bt.shape == (4, 7)  # ceil(100 / 16) pages per sequence
    assert sorted(bt.flatten().tolist()) == list(range(28))
    assert not torch.equal(bt.flatten(), torch.arange(28, dtype=torch.int32))
    assert torch.equal(bt, da.make_block_table(4, 100, 16, torch.Generator().manual_seed(0)))


def test_bandwidth_arithmetic():
    assert da.kv_bytes(128, 4096, 8, 128, 2) == 2 ** 31  # the BF16 default: 2 GiB of K + V per step
    assert da.kv_bytes(128, 4096, 8, 128, 1) == 2 ** 30
    assert da.tb_per_s(10 ** 12, 1e6) == pytest.approx(1.0)
    assert da.tb_per_s(2 ** 30, 400.0) == pytest.approx(2.684, rel=1e-3)


def test_fp8_cache_views_and_scales():
    raw = torch.randn(6, 4, 2, 16, dtype=torch.bfloat16)
    k, v = da.split_kv(raw, 8, separate=False)
    assert k.shape == v.shape == (6, 4, 2, 8) and k.data_ptr() == raw.data_ptr() and not k.is_contiguous()
    ks, vs = da.split_kv(raw, 8, separate=True)
    assert ks.is_contiguous() and torch.equal(ks, k) and torch.equal(vs, v)
    scale = da.amax_scale(k)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    assert scale.item() == pytest.approx(k.abs().max().float().item() / 448)
    q8 = da.quantize_fp8(k, scale)
    assert q8.dtype == torch.float8_e4m3fn and q8.float().abs().max().item() == 448
    assert (q8.float() * scale - k.float()).abs().max() <= 0.07 * k.float().abs().max()
    assert da.quantize_fp8(torch.tensor([1e6, -1e6]), torch.ones(1)).float().tolist() == [448, -448]  # saturates


def direct_attention(q, k_cache, v_cache, block_table, seq_lens, scale, k_scale, v_scale):
    """Sequence by sequence: its pages copied out one at a time, float64 SDPA with the kv heads repeated."""
    outs = []
    for i in range(q.shape[0]):
        pages = [int(p) for p in block_table[i]]
        k = torch.cat([k_cache[p].double() for p in pages])[: int(seq_lens[i])] * k_scale  # (T, H, D)
        v = torch.cat([v_cache[p].double() for p in pages])[: int(seq_lens[i])] * v_scale
        group = q.shape[1] // k.shape[1]
        k, v = (x.transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))  # (Hq, T, D)
        qi = q[i].double().unsqueeze(1)  # (Hq, 1, D)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qi, k, v, scale=scale).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_matches_direct_attention(fp8):
    g = torch.Generator().manual_seed(1)
    batch, q_heads, kv_heads, d, bs, pages = 5, 8, 2, 16, 4, 3
    bt = da.make_block_table(batch, pages * bs, bs, g)
    raw = torch.randn(batch * pages, bs, kv_heads, 2 * d, generator=g).to(torch.bfloat16)
    k, v = da.split_kv(raw, d, separate=False)
    ks = vs = 1.0
    if fp8:
        ks, vs = da.amax_scale(k), da.amax_scale(v)
        k, v = da.quantize_fp8(k, ks), da.quantize_fp8(v, vs)
    q = torch.randn(batch, q_heads, d, generator=g).to(torch.bfloat16)
    seq_lens = torch.tensor([12, 1, 7, 9, 12], dtype=torch.int32)  # partial last pages, a one-token sequence
    out = da.reference(q, k, v, bt, seq_lens, d ** -0.5, ks, vs, chunk=2)
    want = direct_attention(q, k, v, bt, seq_lens, d ** -0.5, float(ks), float(vs))
    assert out.dtype == torch.float32 and out.shape == (batch, q_heads, d)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert da.rel_err(out, out) == 0 and da.rel_err(want.float(), out) < 1e-5


@pytest.mark.parametrize("separate", [False, True])
def test_cpu_workload_references(separate):
    a = da.build_parser().parse_args(["--batch", "3", "--context", "40", "--q-heads", "4", "--kv-heads", "2",
                                      "--head-dim", "16"] + (["--separate-kv"] if separate else []))
    w = da.make_workload(a, 16, device="cpu")
    assert w.bt.shape == (3, 3) and w.k8.dtype == torch.float8_e4m3fn and w.seq_lens.tolist() == [40] * 3
    assert w.ref16.shape == w.ref8.shape == w.ref8_new.shape == (3, 4, 16)
    assert da.rel_err(w.ref8, w.ref16) < 0.1  # FP8 e4m3 of the same K/V
    assert da.rel_err(w.ref8_new, w.ref8) > 0.3  # the scale check can tell new scales from old ones


def test_verdict_takes_the_fastest_scale_updating_fp8_kernel():
    rows = [{"workload": "w", "mode": "fa3_bf16", "us": 400.0, "scale_update_ok": None},
            {"workload": "w", "mode": "fa3_fp8", "us": 300.0, "scale_update_ok": True},
            {"workload": "w", "mode": "xqa_fp8", "us": 250.0, "scale_update_ok": True},
            {"workload": "w", "mode": "xqa_fp8_const", "us": 200.0, "scale_update_ok": False},
            {"workload": "w", "mode": "triton_fp8", "error": "RuntimeError: no"}]
    da.add_ratio(rows, "speedup", "us", lower_is_better=True, base="fa3_bf16")
    assert da.verdict(rows) == {"w": {"mode": "xqa_fp8", "speedup": 1.6, "meets_goal": True}}
    assert da.verdict(rows[:2])["w"]["meets_goal"] is False  # 1.33x


def installed_apis() -> dict:
    """The real functions the variants call (their signatures), from the installed vLLM and FlashInfer."""
    import importlib.util
    import inspect

    try:
        import flashinfer.decode
        import vllm
        from vllm.model_executor.layers.quantization.utils import fp8_utils
        from vllm.v1.attention.ops import triton_unified_attention
    except Exception as e:
        pytest.skip(f"vllm / flashinfer do not import here ({type(e).__name__}: {e})")
    path = Path(vllm.__file__).parent / "vllm_flash_attn/flash_attn_interface.py"
    spec = importlib.util.spec_from_file_location("fa_interface_signatures", path)
    fa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fa)  # its kernel imports are guarded: loads without a GPU
    return {"flash_attn_varlen_func": inspect.signature(fa.flash_attn_varlen_func),
            "get_scheduler_metadata": inspect.signature(fa.get_scheduler_metadata),
            "unified_attention": inspect.signature(triton_unified_attention.unified_attention),
            "trtllm_batch_decode_with_kv_cache": inspect.signature(flashinfer.decode.trtllm_batch_decode_with_kv_cache),
            "per_token_group_quant_fp8": inspect.signature(fp8_utils.per_token_group_quant_fp8),
            "modules": (triton_unified_attention, flashinfer.decode, fp8_utils)}


def test_variants_bind_to_the_installed_signatures(monkeypatch):
    """Every variant's launch() on a tiny CPU workload, the kernels replaced by recorders that bind the
    call to the real function's signature: the keyword names, the FP8 q, the scales passed as the
    workload's own tensors (what the in-place update relies on), floats only for xqa_fp8_const, PDL off only
    for xqa_fp8_nopdl; a *_quant variant is its attention call, then o_proj's input quantization."""
    import types

    apis, calls = installed_apis(), []
    triton_mod, flashinfer_decode, fp8_utils = apis.pop("modules")

    def recorder(name):
        def call(*args, **kw):
            calls.append((name, apis[name].bind(*args, **kw).arguments))
            if name == "get_scheduler_metadata":
                return torch.zeros(8, dtype=torch.int32)
            if name == "per_token_group_quant_fp8":
                return None
            out = kw.get("out")
            out.zero_()
            return out
        return call

    fa = types.ModuleType("vllm.vllm_flash_attn")
    fa.flash_attn_varlen_func, fa.get_scheduler_metadata = (recorder(n) for n in list(apis)[:2])
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fa)
    monkeypatch.setattr(triton_mod, "unified_attention", recorder("unified_attention"))
    monkeypatch.setattr(flashinfer_decode, "trtllm_batch_decode_with_kv_cache",
                        recorder("trtllm_batch_decode_with_kv_cache"))
    monkeypatch.setattr(fp8_utils, "per_token_group_quant_fp8", recorder("per_token_group_quant_fp8"))
    a = da.build_parser().parse_args(["--batch", "2", "--context", "32", "--q-heads", "4", "--kv-heads", "2",
                                      "--head-dim", "16"])
    w = da.make_workload(a, 16, device="cpu")
    for variant in da.VARIANTS:
        calls.clear()
        out = torch.empty_like(w.q)
        da.build(variant, w, out)()
        if variant.endswith("_quant"):
            name, kw = calls.pop()
            assert name == "per_token_group_quant_fp8" and kw["x"].shape == (2, 4 * 16)
            assert kw["x"].data_ptr() == out.data_ptr() and kw["group_size"] == 128 and kw["column_major_scales"]
            variant = variant.removesuffix("_quant")
        name, kw = calls[-1]
        if variant.startswith("fa3"):
            meta = calls[0][1]
            splits = 1 if variant.endswith("splits1") else a.max_splits
            assert meta["num_splits"] == kw["num_splits"] == splits and kw["scheduler_metadata"] is not None
            assert kw["fa_version"] == 3 and kw["block_table"] is w.bt and meta["page_size"] == 16
            if variant == "fa3_bf16":
                assert kw["q"].dtype == torch.bfloat16 and kw["k"] is w.k16 and kw["k_descale"] is None
                continue
            assert kw["q"].dtype == torch.float8_e4m3fn and kw["k"] is w.k8 and meta["qkv_dtype"] == torch.float8_e4m3fn
            for s in ("q", "k", "v"):
                scale = kw[f"{s}_descale"]
                assert scale.shape == (2, 2) and scale.data_ptr() == getattr(w, f"{s}_scale").data_ptr()
        elif variant == "triton_fp8":
            assert kw["q"].dtype == torch.float8_e4m3fn and kw["kv_quant_mode"] == 1  # FP8_PER_TENSOR
            assert kw["q_descale"] is w.q_scale and kw["k_descale"].data_ptr() == w.k_scale.data_ptr()
        else:
            assert name == "trtllm_batch_decode_with_kv_cache" and kw["backend"] == "xqa" and kw["kv_layout"] == "NHD"
            assert kw["query"].dtype == torch.bfloat16 and kw["kv_cache"][0] is w.k8
            assert kw["enable_pdl"] is (False if variant == "xqa_fp8_nopdl" else None)  # None: flashinfer's default
            if variant in ("xqa_fp8", "xqa_fp8_nopdl"):
                assert kw["bmm2_scale"] is w.v_scale
                assert kw["bmm1_scale"].item() == pytest.approx(w.k_scale.item() * w.sm_scale)
            else:
                assert isinstance(kw["bmm1_scale"], float) and isinstance(kw["bmm2_scale"], float)
