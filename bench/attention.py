"""The trainer's attention (PyTorch SDPA, causal, GQA) at a shipped 8B step's micro-batch shapes: FlashAttention-2
against cuDNN (`model.cudnn_sdpa`), per call and per new shape, Hopper.

    python -m bench.attention [--prompts 16] [--multiple 32|8] [--steps 3] [--out DIR]   # -> OUT/attention.json

The 8B configs train on micro-batches of 4 rows, each as long as its longest row rounded up to a multiple: 32
tokens with FP8 linears, 8 in BF16 (trainer.length_multiples, batch.by_length). A step's lengths are drawn as
`scripts/flagship_check.py --shipped` draws them (--prompts x 32 samples, log-normal, median 1,400, sigma 0.6,
cut at 3,584, after --prompt tokens), so nearly every micro-batch of a step has a length of its own. cuDNN builds
an execution plan the first time it sees a shape (PyTorch caches them by shape); FlashAttention-2 builds none.
For each kernel this times, at every length of --steps steps (seeds --seed, +1, ...) the first time the process
meets it: the first forward (no grad, as the logprob pass) and the first forward + backward, then both again
with any plan cached (median of 5 after 2, CUDA events). The step's attention at the cached speed is, per layer
and micro-batch, two no-grad forwards (the logprob pass and the checkpointed training forward) and one forward
+ backward (the recompute and the backward), times the layers; the first calls' extra is what a step's new
lengths cost on top, once per length in a process (the layers share the plan).
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.rollout import SHIPPED_LENGTHS
from bench.runner import RESULTS, cuda_time_ms, fail, markdown_table, write_results

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def step_lengths(prompts: int, n: int, prompt: int, cap: int, rows: int, multiple: int, seed: int) -> list[int]:
    """The micro-batch lengths of one step, longest first, as batch.by_length cuts them."""
    from batch import by_length
    from engines.vllm import drawn_lengths

    median, sigma = SHIPPED_LENGTHS
    total = torch.tensor([prompt + x for x in drawn_lengths(prompts * n, median, sigma, cap, seed)])
    mask = (torch.arange(int(total.max()) + multiple)[None] < total[:, None]).long()
    return [length for _, length in by_length(mask, torch.arange(len(total)), rows, multiple)]


def first_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def time_kernel(kernel: str, steps: list[list[int]], rows: int, heads: int, kv_heads: int, head_dim: int,
                layers: int) -> list[dict]:
    """One row per step: its lengths new to the process, what their first calls cost over the cached calls
    (once, whatever the layers), and the step's attention at the cached speed (times the layers)."""
    per, out = {}, []
    with sdpa_kernel([KERNELS[kernel]]):
        for step, lengths in enumerate(steps):
            new = sorted(set(lengths) - set(per))
            for length in new:
                # [rows, length, heads, head_dim] transposed, as the model's q/k/v projections hand them to SDPA
                q, k, v = (torch.randn(rows, length, h, head_dim, device="cuda", dtype=torch.bfloat16)
                           .transpose(1, 2).requires_grad_() for h in (heads, kv_heads, kv_heads))
                dout = torch.randn_like(q)

                def fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

                def fwd_bwd():
                    torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                                        (q, k, v), dout)

                row = {"fwd_first": first_ms(fwd), "fwd_bwd_first": first_ms(fwd_bwd)}
                row["fwd"], row["fwd_bwd"] = cuda_time_ms(fwd, 2, 5), cuda_time_ms(fwd_bwd, 2, 5)
                per[length] = row
            extra = sum(per[n]["fwd_first"] - per[n]["fwd"] + per[n]["fwd_bwd_first"] - per[n]["fwd_bwd"]
                        for n in new)
            cached = layers * sum(2 * per[n]["fwd"] + per[n]["fwd_bwd"] for n in lengths)
            out.append({"kernel": kernel, "step": step, "micro_batches": len(lengths),
                        "distinct_lengths": len(set(lengths)), "new_lengths": len(new),
                        "cached_s": round(cached / 1e3, 3), "new_shapes_extra_s": round(extra / 1e3, 3)})
            print(f"{kernel} step {step}: {len(new)} new of {len(set(lengths))} lengths, cached {out[-1]['cached_s']}"
                  f" s, new shapes +{out[-1]['new_shapes_extra_s']} s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (x --n samples)")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of each sample")
    p.add_argument("--cap", type=int, default=3584, help="rollout.max_new_tokens")
    p.add_argument("--rows", type=int, default=4, help="train.micro_batch_size")
    p.add_argument("--multiple", type=int, default=32, help="length multiple: 32 (FP8 linears), 8 (BF16, compiled); "
                   "one per process, since the plans cached for one would serve the other's lengths")
    p.add_argument("--steps", type=int, default=3, help="steps drawn (seeds --seed, --seed + 1, ...)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32, help="decoder layers, for the step totals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    args = p.parse_args()
    for key in ("multiple", "steps", "prompts", "rows"):
        if getattr(args, key) < 1:
            fail(f"--{key} {getattr(args, key)}: give a positive integer")
    if not torch.cuda.is_available():
        fail("bench/attention.py times CUDA kernels: run it on a GPU host")
    torch.backends.cuda.enable_cudnn_sdp(True)  # on, whatever imported before; sdpa_kernel then picks each kernel
    steps = [step_lengths(args.prompts, args.n, args.prompt, args.cap, args.rows, args.multiple, args.seed + s)
             for s in range(args.steps)]
    runs = [dict(r, multiple=args.multiple) for kernel in KERNELS
            for r in time_kernel(kernel, steps, args.rows, args.heads, args.kv_heads, args.head_dim, args.layers)]
    print(markdown_table(runs, ["kernel", "multiple", "step", "micro_batches", "distinct_lengths", "new_lengths",
                                "cached_s", "new_shapes_extra_s"]))
    write_results("attention", runs, Path(args.out), shape={"rows": args.rows, "heads": args.heads,
                                                              "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                                                              "layers": args.layers, "prompts": args.prompts})


if __name__ == "__main__":
    main()
