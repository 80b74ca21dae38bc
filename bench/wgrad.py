"""The FP8 weight-gradient GEMM: which operand order cuBLAS runs fastest (Hopper).

    python -m bench.wgrad [--tokens 16384] [--out DIR]    # -> OUT/wgrad.json, a table

grad_W [N, K] = g^T x contracts over the M tokens; both operands carry 1x128 scales along M (x's
and grad_out's 128x1 groups), so cuBLAS runs its Avec128 x Bvec128 kernel, which in the decoder
stack's profile ran at ~3/4 the rate of the forward / dgrad GEMMs (Ablk128 x Bvec128: the weight's
128x128 blocks). Timed per Llama-3.1-8B projection (qkv, o, gate/up, down) at M tokens:
  wgrad      fp8/linear.py's call: A = g^T [N, M], B = x [M, K] -> [N, K]
  wgrad_t    the transposed product x^T g: A = x^T [K, M], B = g [M, N] -> [K, N] (.t() is grad_W,
             column-major), and wgrad_t_copy with the .contiguous() copy a row-major grad_W costs
  fwd        the forward GEMM of the same FLOPs (x [M, K] @ W^T, W's 128x128 blocks): the rate to match
  bf16       g^T @ x in BF16
Median of 20 CUDA-event-timed calls; TFLOP/s = 2 M N K / time; max |wgrad_t - wgrad| / max |wgrad|.
"""

import argparse
import sys
from pathlib import Path

import torch

from bench.runner import RESULTS, cuda_time_ms, markdown_table, write_results

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def bench(tokens: int) -> list[dict]:
    from fp8.fast.dual import DualQuantKernels

    ao = DualQuantKernels()
    rows = []
    for name, (n, k) in SHAPES.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        xq, xs, xqt, xst = ao.dual(x)
        _, _, gqt, gst = ao.dual(g)
        wq, ws = ao.weight_transposed_rhs(w, block_size=128)
        v = ao.x1x128
        calls = {
            "wgrad": lambda: ao.mm(gqt, xqt.t(), gst.t(), v, xst.t(), v, torch.bfloat16),
            "wgrad_t": lambda: ao.mm(xqt, gqt.t(), xst.t(), v, gst.t(), v, torch.bfloat16).t(),
            "wgrad_t_copy": lambda: ao.mm(xqt, gqt.t(), xst.t(), v, gst.t(), v, torch.bfloat16).t().contiguous(),
            "fwd": lambda: ao.mm(xq, wq, xs, v, ws, ao.x128x128, torch.bfloat16),
            "bf16": lambda: g.t() @ x,
        }
        ref, swapped = calls["wgrad"](), calls["wgrad_t"]()
        err = ((swapped.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        flops = 2 * tokens * n * k
        for call, fn in calls.items():
            ms = cuda_time_ms(fn, warmup=5, iters=20)
            rows.append({"shape": f"{name} {n}x{k}", "tokens": tokens, "gemm": call, "ms": ms,
                         "tflops": flops / ms / 1e9, "rel_diff_vs_wgrad": err if call.startswith("wgrad_t") else None})
            print(f"{name} {call}: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s", file=sys.stderr, flush=True)
        del x, g, w, xq, xs, xqt, xst, gqt, gst, wq, ws, ref, swapped
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384, help="M, a multiple of 128 (default 16384)")
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench/wgrad.py needs a Hopper (SM90) GPU")
    if args.tokens % 128:
        sys.exit(f"--tokens {args.tokens}: must be a multiple of 128 (the 1x128 scale groups run along the tokens)")
    rows = bench(args.tokens)
    path = write_results("wgrad", rows, Path(args.out))
    print(markdown_table(rows, ["shape", "tokens", "gemm", "ms", "tflops", "rel_diff_vs_wgrad"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
