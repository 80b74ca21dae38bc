"""FP8-KV paged decode attention vs BF16 FA3, kernel level, with scales as device tensors (Hopper).

    python -m bench.decode_attention --out /tmp/dec          # -> /tmp/dec/decode_attention.json, a table
    python -m bench.decode_attention --block-sizes 16,64 --variants fa3_bf16,xqa_fp8

The question: does an FP8-KV decode kernel run >= 1.4x faster than BF16 FA3 at batch 128, context
4096, the Qwen3-8B / Llama-3.1-8B attention shape (32 q heads, 8 kv heads, head_dim 128, one new token
per sequence), WHILE its q/k/v scales are device tensors updated in place between CUDA-graph replays?
(The trainer recalibrates the KV scales every step; vLLM decodes inside CUDA graphs, so a scale
passed as a Python float is frozen into the graph.)

Variants, each called as vLLM 0.26's backend calls it (a failing import / JIT / launch becomes a row
with "error", the others still run; a CUDA fault, though, poisons the later variants: rerun them
with --variants):
  fa3_bf16         vllm_flash_attn.flash_attn_varlen_func(fa_version=3) over the BF16 cache: the baseline
  fa3_fp8          the same over the FP8 cache: q quantized with the q scale tensor (in the graph),
                   q/k/v_descale = the scale tensors expanded to (batch, kv_heads), as vLLM does
  fa3_fp8_splits1  fa3_fp8 with num_splits 1 (vLLM's batch-invariant setting; default --max-splits 32)
  triton_fp8       vLLM's triton unified_attention, FP8 q, KVQuantMode.FP8_PER_TENSOR, tensor scales
  xqa_fp8          flashinfer trtllm_batch_decode_with_kv_cache(backend="xqa") (SM90: mha_sm90.cu),
                   BF16 q, bmm1_scale = softmax_scale * k_scale and bmm2_scale = v_scale as TENSORS
  xqa_fp8_const    the same with Python-float scales (how vLLM passes them): the control for the
                   scale check (expected scale_update_ok False) and the cost of the tensor scales
  xqa_fp8_nopdl    xqa_fp8 launched without programmatic dependent launch (flashinfer's enable_pdl, which
                   defaults on for SM90 and which vLLM 0.26 leaves at its default)
  <variant>_quant  each call followed by o_proj's input quantization as vLLM's block-FP8 linear runs it
                   (per_token_group_quant_fp8 of the [batch, q_heads x head_dim] output, groups of 128,
                   column-major scales): fa3_fp8_quant, xqa_fp8_quant, xqa_fp8_nopdl_quant. In a profiled
                   decode step that kernel took 70 us a call after XQA and 3 us after FA3; the pair's time
                   here says whether PDL costs time or only moves it between the two kernels' spans
FA3 gets its scheduler metadata ahead of time with the same num_splits (vLLM's full-CUDA-graph path).
The KV cache is vLLM's layout: one tensor per layer, physically (blocks, block_size, kv_heads,
2 * head_dim), K and V the two halves of the last dim (--separate-kv: two contiguous tensors); the
block tables a random permutation of the pages. The FP8 e4m3 cache quantizes the same BF16 K/V with
per-tensor scales amax / 448.

Per variant: eager output vs a float32 reference over the dequantized cache (BF16 cache for
fa3_bf16): max_abs_err, rel_err (norm of the difference / norm of the reference; rel_err_graph: the
same for the graph's replay); then the call is
captured in a CUDA graph (--calls-per-graph back-to-back calls, as the layers of a decode step) and
the replays timed with CUDA events (median of --iters after --warmup): us per call, kv_tb_s (bytes of
K + V read / time), speedup vs fa3_bf16 of the same workload. Then k_scale x2 and v_scale x0.5 are
written IN PLACE and the graph replayed: scale_update_ok is True when the output follows the
reference for the new scales (as close as before, and far from the old output); None for BF16.

Measured on an H200 (bench/results/decode_attention_h200.json, docs/results.md "FP8 decode attention
kernels with scales on the device"): xqa_fp8 1.76x fa3_bf16, fa3_fp8 1.20x, triton_fp8 0.71x.
"""

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from bench import runner
from bench.runner import (add_ratio, cuda_time_ms, markdown_table, parse_choices, run_inline,
                          write_results)

VARIANTS = ["fa3_bf16", "fa3_fp8", "fa3_fp8_splits1", "triton_fp8", "xqa_fp8", "xqa_fp8_const", "xqa_fp8_nopdl",
            "fa3_fp8_quant", "xqa_fp8_quant", "xqa_fp8_nopdl_quant"]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
COLS = ["workload", "mode", "us", "kv_tb_s", "speedup", "max_abs_err", "rel_err", "scale_update_ok", "error"]
GOAL = 1.4  # speedup over fa3_bf16 the FP8 kernel must reach


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (the repo's user-error convention)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_ints(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, comma separated")
    return out


def build_parser() -> Parser:
    p = Parser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="results dir (default runs/bench, untracked)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=4096, help="KV tokens per sequence")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-sizes", "--block-size", dest="block_sizes", type=parse_ints, default=[16],
                   help="KV page sizes, comma list (multiples of 16)")
    p.add_argument("--variants", type=lambda text: parse_choices(text, VARIANTS), default=VARIANTS, help=f"comma list of {VARIANTS}")
    p.add_argument("--max-splits", type=int, default=32, help="FA3 num_splits (vLLM's CUDA-graph default)")
    p.add_argument("--separate-kv", action="store_true", help="K and V as two contiguous tensors")
    p.add_argument("--calls-per-graph", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    return p


def check_args(a) -> str | None:
    """The first problem with the arguments, or None."""
    for name in ("batch", "context", "q_heads", "kv_heads", "head_dim", "max_splits", "calls_per_graph", "iters"):
        if getattr(a, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}"
    if a.warmup < 0:
        return f"--warmup must be >= 0, got {a.warmup}"
    if a.q_heads % a.kv_heads:
        return f"--q-heads {a.q_heads} must be a multiple of --kv-heads {a.kv_heads}"
    if a.head_dim % 16:
        return f"--head-dim {a.head_dim} must be a multiple of 16"
    bad = [b for b in a.block_sizes if b % 16]
    return f"--block-sizes {bad}: must be multiples of 16 (vLLM's FA3 and triton backends)" if bad else None


# ----------------------------------------------------------------------------------- workload (CPU-testable)


def kv_bytes(batch: int, context: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of K + V one decode step reads: every sequence's context, every kv head."""
    return 2 * batch * context * kv_heads * head_dim * elem_bytes


def tb_per_s(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


def make_block_table(batch: int, context: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, pages per sequence) int32: a random permutation of all the pages (none shared, none
    contiguous in general), as a long-running server's allocator leaves them."""
    pages = -(-context // block_size)
    return torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages)


def amax_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor FP8 scale amax / 448: a float32 tensor of one element, on x's device."""
    return (x.abs().amax().float() / FP8_MAX).reshape(1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, saturated (scale: a float32 tensor of one element)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def split_kv(raw: torch.Tensor, head_dim: int, separate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V views (blocks, block_size, kv_heads, head_dim) of raw (blocks, block_size, kv_heads, 2*head_dim):
    vLLM's packed layout, or (separate) two contiguous copies."""
    k, v = raw[..., :head_dim], raw[..., head_dim:]
    return (k.contiguous(), v.contiguous()) if separate else (k, v)


def reference(q, k_cache, v_cache, block_table, seq_lens, softmax_scale, k_scale=1.0, v_scale=1.0, chunk=16):
    """float32 attention of q (batch, q_heads, D), one token per sequence, over its pages
    block_table[i] of the paged cache (blocks, block_size, kv_heads, D), the first seq_lens[i] tokens,
    the cache dequantized as value * scale. `chunk` sequences at a time (bounded memory)."""
    batch, q_heads, d = q.shape
    kv_heads = k_cache.shape[2]

    def gather(cache, bt, scale):  # pages (n, P) -> (n, H, T, D) float32; fp8 gathered as bytes
        g = cache.view(torch.uint8)[bt].view(cache.dtype) if cache.element_size() == 1 else cache[bt]
        return g.float().reshape(bt.shape[0], -1, kv_heads, d).permute(0, 2, 1, 3) * scale

    outs = []
    for s in range(0, batch, chunk):
        bt = block_table[s:s + chunk].long()
        n = bt.shape[0]
        k, v = gather(k_cache, bt, k_scale), gather(v_cache, bt, v_scale)
        qs = q[s:s + n].float().view(n, kv_heads, q_heads // kv_heads, d)
        scores = qs @ k.transpose(-1, -2) * softmax_scale  # (n, H, G, T)
        pos = torch.arange(k.shape[2], device=q.device)
        scores.masked_fill_(pos >= seq_lens[s:s + n].to(q.device).view(n, 1, 1, 1), float("-inf"))
        outs.append((scores.softmax(-1) @ v).reshape(n, q_heads, d))
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_workload(a, block_size: int, device="cuda") -> SimpleNamespace:
    bt = make_block_table(a.batch, a.context, block_size, torch.Generator().manual_seed(a.seed))
    gen = torch.Generator(device).manual_seed(a.seed)  # ~1e9 values at the default shape: made on the GPU
    raw = torch.randn(bt.numel(), block_size, a.kv_heads, 2 * a.head_dim, generator=gen, device=device,
                      dtype=torch.bfloat16)
    q = torch.randn(a.batch, a.q_heads, a.head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    k16, v16 = split_kv(raw, a.head_dim, a.separate_kv)
    k_scale, v_scale, q_scale = (amax_scale(x) for x in (k16, v16, q))
    raw8 = torch.cat([quantize_fp8(k16, k_scale), quantize_fp8(v16, v_scale)], dim=-1)
    del raw
    k8, v8 = split_kv(raw8, a.head_dim, a.separate_kv)
    if a.separate_kv:
        del raw8
    w = SimpleNamespace(q=q, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, k16=k16, v16=v16, k8=k8, v8=v8,
                        bt=bt.to(device), seq_lens=torch.full((a.batch,), a.context, dtype=torch.int32, device=device),
                        cu_q=torch.arange(a.batch + 1, dtype=torch.int32, device=device),
                        sm_scale=a.head_dim ** -0.5, block_size=block_size, args=a)
    w.ref16 = reference(q, k16, v16, w.bt, w.seq_lens, w.sm_scale)
    w.ref8 = reference(q, k8, v8, w.bt, w.seq_lens, w.sm_scale, k_scale, v_scale)
    w.ref8_new = reference(q, k8, v8, w.bt, w.seq_lens, w.sm_scale, 2 * k_scale, 0.5 * v_scale)  # see measure
    return w


# ----------------------------------------------------------------------------------- variants (GPU)


def build(variant: str, w: SimpleNamespace, out: torch.Tensor):
    """launch() writing `out` for `variant`: everything it does is what the CUDA graph captures."""
    a, shape, dev = w.args, (w.args.batch, w.args.kv_heads), w.q.device
    if variant.endswith("_quant"):
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

        attention = build(variant.removesuffix("_quant"), w, out)

        def launch():
            attention()
            per_token_group_quant_fp8(out.view(a.batch, -1), 128, column_major_scales=True, use_ue8m0=False)
        return launch
    if variant.startswith("fa3"):
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        fp8 = variant != "fa3_bf16"
        splits = 1 if variant.endswith("splits1") else a.max_splits
        k, v = (w.k8, w.v8) if fp8 else (w.k16, w.v16)
        meta = get_scheduler_metadata(a.batch, 1, a.context, a.q_heads, a.kv_heads, a.head_dim, w.seq_lens,
                                      qkv_dtype=FP8 if fp8 else torch.bfloat16, cu_seqlens_q=w.cu_q,
                                      page_size=w.block_size, causal=True, num_splits=splits)

        def launch():
            scales = [s.expand(shape) for s in (w.q_scale, w.k_scale, w.v_scale)] if fp8 else [None] * 3
            flash_attn_varlen_func(quantize_fp8(w.q, w.q_scale) if fp8 else w.q, k, v, max_seqlen_q=1,
                                   cu_seqlens_q=w.cu_q, max_seqlen_k=a.context, seqused_k=w.seq_lens,
                                   softmax_scale=w.sm_scale, causal=True, block_table=w.bt, out=out,
                                   scheduler_metadata=meta, q_descale=scales[0], k_descale=scales[1],
                                   v_descale=scales[2], num_splits=splits, fa_version=3)
        return launch
    if variant == "triton_fp8":
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode

        seq_3d, segs = max(1, 128 // a.kv_heads), 16  # vLLM's TritonAttentionMetadataBuilder buffers
        segm = [torch.empty(seq_3d, a.q_heads, segs, *d, dtype=torch.float32, device=dev)
                for d in ([next_pow2(a.head_dim)], [], [])]

        def launch():
            unified_attention(q=quantize_fp8(w.q, w.q_scale), k=w.k8, v=w.v8, out=out, cu_seqlens_q=w.cu_q,
                              max_seqlen_q=1, seqused_k=w.seq_lens, max_seqlen_k=a.context, softmax_scale=w.sm_scale,
                              causal=True, window_size=(-1, -1), block_table=w.bt, softcap=0,
                              q_descale=w.q_scale, k_descale=w.k_scale.expand(shape), v_descale=w.v_scale.expand(shape),
                              seq_threshold_3D=seq_3d, num_par_softmax_segments=segs, softmax_segm_output=segm[0],
                              softmax_segm_max=segm[1], softmax_segm_expsum=segm[2],
                              kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
        return launch
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    workspace = torch.zeros(394 * 1024 * 1024, dtype=torch.uint8, device=dev)  # vLLM's default size
    bmm1 = torch.empty(1, dtype=torch.float32, device=dev)
    const = (w.sm_scale * w.k_scale.item(), w.v_scale.item())

    def launch():
        if variant != "xqa_fp8_const":
            torch.mul(w.k_scale, w.sm_scale, out=bmm1)  # in the graph: follows k_scale
        b1, b2 = const if variant == "xqa_fp8_const" else (bmm1, w.v_scale)
        trtllm_batch_decode_with_kv_cache(query=w.q, kv_cache=(w.k8, w.v8), workspace_buffer=workspace,
                                          block_tables=w.bt, seq_lens=w.seq_lens, max_seq_len=a.context,
                                          bmm1_scale=b1, bmm2_scale=b2, out=out, kv_layout="NHD", backend="xqa",
                                          enable_pdl=False if variant == "xqa_fp8_nopdl" else None)
    return launch


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def measure(variant: str, w: SimpleNamespace, workload: str) -> list[dict]:
    a, fp8 = w.args, variant != "fa3_bf16"
    out = torch.empty_like(w.q)
    launch = build(variant, w, out)
    launch()  # JIT / autotune, and the eager output
    torch.cuda.synchronize()
    ref = w.ref8 if fp8 else w.ref16
    row = {"workload": workload, "mode": variant, "max_abs_err": (out.float() - ref).abs().max().item(),
           "rel_err": rel_err(out, ref)}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(a.calls_per_graph):
            launch()
    row["us"] = 1e3 * cuda_time_ms(graph.replay, a.warmup, a.iters) / a.calls_per_graph
    row["kv_tb_s"] = tb_per_s(kv_bytes(a.batch, a.context, a.kv_heads, a.head_dim, 1 if fp8 else 2), row["us"])
    row["rel_err_graph"] = rel_err(out, ref)  # the replayed graph's output, as the eager one's
    if fp8:  # the trainer's recalibration: new scales written in place, the same graph replayed
        before = out.float().clone()
        ks, vs = w.k_scale.clone(), w.v_scale.clone()
        w.k_scale.mul_(2.0)
        w.v_scale.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        new_err = rel_err(out, w.ref8_new)
        row["rel_err_new_scales"] = new_err
        row["scale_update_ok"] = new_err <= max(2 * row["rel_err"], 0.02) and rel_err(out, before) > 2 * new_err
        w.k_scale.copy_(ks)
        w.v_scale.copy_(vs)
    else:
        row["scale_update_ok"] = None
    del graph
    torch.cuda.empty_cache()
    print(f"{workload} {variant}: {row['us']:.1f} us, rel_err {row['rel_err']:.3g}, "
          f"scale_update_ok {row['scale_update_ok']}", file=sys.stderr, flush=True)
    return [row]


def run_block_size(args, block_size: int, workload: str, on_mode) -> list[dict]:
    w = make_workload(args, block_size)
    return run_inline(args.variants, lambda variant: measure(variant, w, workload), workload, on_mode=on_mode)


def verdict(rows: list[dict]) -> dict:
    """The best FP8 variant whose scales update in the graph, per workload, against GOAL."""
    best = {}
    for r in rows:
        if r.get("scale_update_ok") and (r.get("speedup") or 0) > best.get(r["workload"], {}).get("speedup", 0):
            best[r["workload"]] = {"mode": r["mode"], "speedup": r["speedup"], "meets_goal": r["speedup"] >= GOAL}
    return best


def main(argv=None):
    args = build_parser().parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        sys.exit("bench/decode_attention.py needs a CUDA GPU (Hopper, SM90: FA3 FP8 and XQA's mha_sm90)")
    out_dir, rows = Path(args.out or runner.RESULTS), []
    extra = {"flashinfer": runner._version("flashinfer-python"), "goal_speedup": GOAL}

    def save(runs):  # after every variant: a crash or timeout loses one at most
        add_ratio(runs, "speedup", "us", lower_is_better=True, base="fa3_bf16")
        return write_results("decode_attention", runs, out_dir, verdict=verdict(runs), **extra)

    for bs in args.block_sizes:
        workload = f"b{args.batch}_ctx{args.context}_q{args.q_heads}kv{args.kv_heads}d{args.head_dim}_bs{bs}"
        rows += run_block_size(args, bs, workload, on_mode=lambda done, before=list(rows): save(before + done))
        torch.cuda.empty_cache()
    path = save(rows)
    print(markdown_table(rows, COLS))
    for workload, v in verdict(rows).items():
        print(f"{workload}: best tensor-scale FP8 kernel {v['mode']} at {v['speedup']:.2f}x fa3_bf16 "
              f"(goal {GOAL}x: {'met' if v['meets_goal'] else 'NOT met'})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
