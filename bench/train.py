"""Trainer throughput: BF16 vs torchao block-wise FP8 (Hopper).

    python bench/train.py linear            # isolated linears at Llama-3.1-8B shapes

`linear`: forward + backward of one bias-free linear, M tokens x K in -> N out, at the four
Llama-3.1-8B projection shapes (q/o 4096->4096, k/v 4096->1024, gate/up 4096->14336,
down 14336->4096) and 8192 / 16384 tokens. FP8 = torchao Float8BlockwiseLinear (1x128
activation tiles, 128x128 weight blocks, quantization included in the timing, as in
training). Writes bench/results/train.json and prints a markdown table.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import cuda_time_ms, markdown_table, write_results  # noqa: E402

SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (4096, 1024),
          "gate/up_proj": (4096, 14336), "down_proj": (14336, 4096)}


def bench_linear(tokens=(8192, 16384)) -> list[dict]:
    from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

    runs = []
    for name, (k, n) in SHAPES.items():
        for m in tokens:
            bf16 = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            fp8 = Float8BlockwiseLinear.from_float(torch.nn.Linear(k, n, bias=False, device="cuda",
                                                                   dtype=torch.bfloat16))
            fp8.weight.data.copy_(bf16.weight.data)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            row = {"workload": f"linear {name} {m}x{k}->{n}"}
            for mode, mod in (("bf16", bf16), ("fp8", fp8)):
                ms = cuda_time_ms(lambda: mod(x).backward(grad))
                flops = 6 * m * k * n  # fwd + dgrad + wgrad
                runs.append({**row, "mode": mode, "ms": ms, "tok_s": m / ms * 1e3, "tflops": flops / ms / 1e9})
            with torch.no_grad():
                ref, out = bf16(x), fp8(x)
                runs[-1]["rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
            runs[-1]["speedup"] = runs[-2]["ms"] / runs[-1]["ms"]
            print(f"{row['workload']}: bf16 {runs[-2]['ms']:.3f} ms  fp8 {runs[-1]['ms']:.3f} ms  "
                  f"x{runs[-1]['speedup']:.2f}", flush=True)
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["linear"])
    p.add_argument("--out", default=None, help="results dir (default bench/results)")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench/train.py needs a Hopper (SM90) GPU: torchao's block-wise FP8 kernels are SM90-only")
    runs = bench_linear()
    kw = {"out_dir": Path(args.out)} if args.out else {}
    print(f"wrote {write_results('train', runs, **kw)}")
    print(markdown_table(runs, ["workload", "mode", "ms", "tflops", "speedup", "rel_err"]))


if __name__ == "__main__":
    main()
