"""The trainer's three block-FP8 GEMMs on cuBLAS (torchao's) vs DeepGEMM (vLLM's vendored copy), Hopper.

    python -m bench.gemm [--tokens 8192,16384] [--model llama|qwen3|llama3b] [--out DIR]   # -> OUT/gemm.json, a table

Every FP8 linear of the trainer runs three GEMMs per micro-batch, on torchao's cuBLAS block-scaled GEMM
(fp8/torchao.py). torchao 0.18 offers DeepGEMM only for its MoE grouped GEMM (fp8.deep_gemm); this times
DeepGEMM's dense fp8_gemm_nt on the same FP8 operands (quantized once with fp8.fast's quant_dual and
torchao's weight quantizers; fp32 scales used as they are, disable_ue8m0_cast):
  fwd    y [M, N] = x [M, K] @ W.T       x 1x128 scales, W 128x128 blocks   (DeepGEMM: its 1D2D kernel)
  dgrad  dx [M, K] = g [M, N] @ W        g 1x128, W 128x128                 (1D2D)
  wgrad  dW [N, K] = g.T @ x             both 1x128 along the M tokens      (1D1D: fp32 out only)
per fused projection of an 8B model at M tokens (a micro-batch): median of 20 CUDA-event-timed calls
after 5 warm-up calls (DeepGEMM JIT-compiles a kernel for each new shape and tile configuration in the
first). Also timed: wgrad_acc, the weight gradient added into an fp32 gradient (DeepGEMM accumulates in
its epilogue; cuBLAS writes BF16 and a separate add follows), and each GEMM in BF16.
rel_diff: ||out - cuBLAS out|| / ||cuBLAS out||. The summary sums fwd + dgrad + wgrad over the projections
(one decoder layer's linear GEMMs). fp8.dense_gemm=deep_gemm puts the trainer's fwd and dgrad on DeepGEMM.
"""

import argparse
import sys
from pathlib import Path

import torch

from bench.runner import RESULTS, cuda_time_ms, markdown_table, write_results

# (N, K) of each fused projection: q/k/v as one GEMM, gate/up as one (fp8.fuse_projections)
SHAPES = {
    "llama": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "qwen3": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    # bench/peer.py's llama3b
    "llama3b": {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)},
}


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def gemms(tokens: int, n: int, k: int) -> dict[str, dict]:
    """{gemm: {kernel: zero-argument call}} for one (N, K) projection at M = tokens."""
    from fp8.fast.dual import DualQuantKernels
    from fp8.moe import import_deep_gemm

    if not import_deep_gemm():
        sys.exit("bench/gemm.py: neither deep_gemm nor vllm.third_party.deep_gemm imports")
    import deep_gemm

    ao = DualQuantKernels()
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    xq, xs, xqt, xst = ao.dual(x)  # x [M, K] 1x128 (scales [M, K/128], M-major); x.T [K, M] + scales [M/128, K]
    gq, gs, gqt, gst = ao.dual(g)
    w_fwd, w_dgrad = ao.weight_transposed_rhs(w, block_size=128), ao.weight_rhs(w, block_size=128)
    dw32 = torch.zeros(n, k, device="cuda", dtype=torch.float32)

    def nt(a, b, gran_n: int, acc: torch.Tensor | None = None):
        """DeepGEMM's [M, K] x [N, K].T, both operands K-major; b's scales 128x128 (gran_n 128, BF16 out) or
        1x128 (gran_n 1: SM90's 1D1D kernel, which only accumulates into an fp32 C)."""
        if gran_n == 1:
            out = acc if acc is not None else torch.zeros(a[0].shape[0], b[0].shape[0], device="cuda")
            deep_gemm.fp8_gemm_nt(a, b, out, c=out, recipe=(1, 1, 128), disable_ue8m0_cast=True)
            return out
        out = torch.empty(a[0].shape[0], b[0].shape[0], device="cuda", dtype=torch.bfloat16)
        deep_gemm.fp8_gemm_nt(a, b, out, recipe=(1, 128, 128), disable_ue8m0_cast=True)
        return out

    # torchao's weight operands are column-major: their .t() views are the K-major W [N, K] and W.T [K, N]
    return {
        "fwd": {"cublas": lambda: ao.gemm(xq, xs, w_fwd),
                "deep_gemm": lambda: nt((xq, xs), (w_fwd[0].t(), w_fwd[1].t()), 128), "bf16": lambda: x @ w.t()},
        "dgrad": {"cublas": lambda: ao.gemm_dgrad(gq, gs, w_dgrad),
                  "deep_gemm": lambda: nt((gq, gs), (w_dgrad[0].t(), w_dgrad[1].t()), 128), "bf16": lambda: g @ w},
        "wgrad": {"cublas": lambda: ao.gemm_wgrad(gqt, gst.t(), xqt.t(), xst),
                  "deep_gemm": lambda: nt((gqt, gst.t()), (xqt, xst.t()), 1), "bf16": lambda: g.t() @ x},
        "wgrad_acc": {"cublas": lambda: dw32.add_(ao.gemm_wgrad(gqt, gst.t(), xqt.t(), xst)),
                      "deep_gemm": lambda: nt((gqt, gst.t()), (xqt, xst.t()), 1, acc=dw32)},
    }


def bench(tokens: int, model: str) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES[model].items():
        calls = gemms(tokens, n, k)
        for gemm, kernels in calls.items():
            ref = kernels["cublas"]().clone() if gemm != "wgrad_acc" else None
            for kernel, fn in kernels.items():
                out = fn().clone() if ref is not None else None
                ms = cuda_time_ms(fn, warmup=5, iters=20)
                rows.append({"model": model, "shape": f"{name} {n}x{k}", "tokens": tokens, "gemm": gemm,
                             "kernel": kernel, "ms": round(ms, 4), "tflops": round(2 * tokens * n * k / ms / 1e9),
                             "rel_diff": round(rel_diff(out, ref), 5) if ref is not None else None})
                print(f"{name} {gemm} {kernel}: {ms:.3f} ms", file=sys.stderr, flush=True)
        del calls
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per tokens and kernel: the three GEMMs of all projections summed (one decoder layer's linears)."""
    out = {}
    for r in rows:
        if r["gemm"] in ("fwd", "dgrad", "wgrad"):
            out.setdefault((r["model"], r["tokens"], r["kernel"]), 0.0)
            out[(r["model"], r["tokens"], r["kernel"])] += r["ms"]
    return [{"model": m, "tokens": t, "kernel": kern, "layer_ms": round(ms, 3),
             "vs_cublas": round(out[(m, t, "cublas")] / ms, 3)} for (m, t, kern), ms in out.items()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192,16384", help="M values, multiples of 128 (default 8192,16384)")
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3", help="projection shapes (default qwen3)")
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    args = p.parse_args(argv)
    tokens = [int(t) if t.strip().isdigit() else -1 for t in args.tokens.split(",")]
    if any(t <= 0 or t % 128 for t in tokens):
        p.error(f"--tokens {args.tokens}: each must be a positive multiple of 128 (the 1x128 groups of wgrad run "
                "along the tokens)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench/gemm.py needs a Hopper (SM90) GPU")
    rows = [r for t in tokens for r in bench(t, args.model)]
    layers = summary(rows)
    path = write_results("gemm", rows + [dict(r, summary=True) for r in layers], Path(args.out))
    print(markdown_table(rows, ["shape", "tokens", "gemm", "kernel", "ms", "tflops", "rel_diff"]))
    print(markdown_table(layers, ["model", "tokens", "kernel", "layer_ms", "vs_cublas"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
