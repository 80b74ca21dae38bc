"""fp8/fast/kernels.py quant_dual: launch configurations vs bandwidth at the trainer's shapes (Hopper).

    python -m bench.quant            # sweep -> OUT/quant.json (its "best": 'split,warps[,stages,per_sm]'), a table
    python -m bench.quant --shape llama3b --tokens 4224   # each call of a layer at the peer micro-batch, vs its floor
    export FP8_GRPO_QUANT_DUAL=$(python -c "import json; print(json.load(open('bench/results/quant.json'))['best'])")

One Llama-3.1-8B decoder layer quantizes 8 activations per training micro-batch of M tokens with
quant_dual: forward the inputs of qkv, o_proj, gate/up (K = 4096) and down_proj (14336); backward
the output gradients of qkv (6144), o_proj (4096), gate/up (28672) and down_proj (4096). Each
configuration (row splits of the 128x128 tile, num_warps; the bytes written do not depend on it)
(one program per tile, or a persistent grid: stages, programs per SM)
is timed on those 8 shapes at M = 8192 and 16384 tokens (one CUDA graph of the 8 calls, median of
20 replays); reported per layer: ms, GB/s (quant_dual reads 2 bytes and writes 2 bytes per
element, plus scales) and the ratio to a BF16 clone of the same tensors (the same bytes moved by
torch's copy kernel: the memory floor). (torchao's two-kernel path is the stack's fp8_two_pass
mode: its quantizers autotune 45 configs per new shape, minutes here.)
"""

import argparse
import sys
from pathlib import Path

import torch

from bench.runner import RESULTS, cuda_time_ms, fail, markdown_table, write_results

LAYER_K = [4096, 4096, 4096, 14336, 6144, 4096, 28672, 4096]  # x: qkv, o, gate/up, down; grads: qkv, o, gate/up, down
# (row splits, num_warps): one program per tile; + (stages, programs per SM): a persistent, pipelined grid
# (a full sweep of those on an H100: never better for quant_dual, 1.8-6x a copy)
CONFIGS = [(1, 8), (1, 16), (2, 4), (2, 8), (4, 4), (4, 8), (2, 4, 2, 2), (1, 8, 3, 1)]
SWIGLU_CONFIGS = [(1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (1, 8, 2, 1), (1, 8, 2, 2), (1, 16, 2, 1)]


def graph_ms(fn, reps: int = 10) -> float:
    """GPU time of one fn() call: `reps` calls captured in one CUDA graph, median of its replays / reps."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    ms = cuda_time_ms(graph.replay, warmup=3, iters=20) / reps
    del graph
    torch.cuda.empty_cache()
    return ms


def layer_ms(fn, tokens: int, tensors: dict) -> float:
    """GPU time of fn over one layer's 8 shapes: captured in one CUDA graph, median of its replays.
    (CUDA events around each eager call measure its Python launch too: a 0.05-0.5 ms kernel read
    2-6x slower that way on an H100, and configs ranked by noise.)"""
    xs = [tensors[tokens, k] for k in LAYER_K]

    def layer():
        for x in xs:
            fn(x)

    return graph_ms(layer, reps=1)


def sweep(tokens=(8192, 16384), configs=CONFIGS) -> tuple[list[dict], str]:
    """Rows per (config, tokens) and the best config as 'split,warps[,stages,per_sm]' (least summed time
    over `tokens`)."""
    from fp8.fast.kernels import quant_dual_with

    tensors = {(m, k): torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in tokens for k in set(LAYER_K)}
    rows, total = [], dict.fromkeys(configs, 0.0)
    for m in tokens:
        floor = layer_ms(torch.clone, m, tensors)
        elements = m * sum(LAYER_K)
        gbs = lambda ms: 4 * elements / ms / 1e6  # noqa: E731  2 bytes read + 2 written per element
        rows.append({"config": "bf16 clone (memory floor)", "tokens": m, "ms": floor, "gb_s": gbs(floor)})
        for cfg in configs:
            ms = launchable(lambda: layer_ms(lambda x, c=cfg: quant_dual_with(x, c), m, tensors), cfg)
            total[cfg] += ms or float("inf")
            if ms is None:
                rows.append({"config": ",".join(map(str, cfg)), "tokens": m, "error": "does not fit"})
                continue
            rows.append({"config": ",".join(map(str, cfg)), "tokens": m, "ms": ms, "gb_s": gbs(ms),
                         "vs_floor": ms / floor})
            print(f"{m} tok  quant_dual {rows[-1]['config']}: {ms:.3f} ms/layer, {rows[-1]['gb_s']:.0f} GB/s "
                  f"({rows[-1]['vs_floor']:.2f}x the copy floor)", file=sys.stderr, flush=True)
    return rows, ",".join(map(str, min(total, key=total.get)))


def launchable(timed, cfg) -> float | None:
    """timed(), or None where cfg's kernel does not fit the GPU (shared memory of deep pipelines)."""
    try:
        return timed()
    except Exception as e:  # triton.runtime.errors.OutOfResources, through torch.library
        if "out of resource" not in str(e).lower():
            raise
        print(f"config {cfg}: does not fit ({str(e).splitlines()[0][:120]})", file=sys.stderr, flush=True)
        return None


def sweep_swiglu(tokens=(16384,), inter=14336, configs=SWIGLU_CONFIGS) -> tuple[list[dict], str]:
    """fp8.fuse_swiglu's kernels (h = silu(gate) * up quantized, forward; the gradient of [gate | up]
    quantized, backward) per config at a Llama-3.1-8B MLP, against what they replace: inductor's
    silu*mul (backward) kernel writing BF16, then quant_dual reading it. Best: least fwd + bwd time."""
    from fp8.fast.kernels import CONFIG, _launch, quant_dual_with
    from fp8.fast.swiglu import swiglu, swiglu_backward

    fwd_ref, bwd_ref = torch.compile(swiglu), torch.compile(swiglu_backward)
    named = {",".join(map(str, c)): c for c in configs}
    rows, total = [], dict.fromkeys(configs, 0.0)
    for m in tokens:
        gu = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
        dh = torch.randn(m, inter, device="cuda", dtype=torch.bfloat16)
        timed = {"unfused (inductor + quant_dual)": (lambda: quant_dual_with(fwd_ref(gu), CONFIG),
                                                      lambda: quant_dual_with(bwd_ref(dh, gu), CONFIG))}
        timed |= {name: (lambda c=c: _launch(None, gu, inter, mode=1, config=c),
                         lambda c=c: _launch(dh, gu, 2 * inter, mode=2, config=c)) for name, c in named.items()}
        for name, (fwd, bwd) in timed.items():
            ms = [launchable(lambda: cuda_time_ms(fn, warmup=3, iters=20), name) for fn in (fwd, bwd)]
            if None in ms:
                total[named[name]] = float("inf")  # only our launches can run out of shared memory
                rows.append({"config": name, "tokens": m, "error": "does not fit"})
                continue
            if name in named:
                total[named[name]] += sum(ms)
            rows.append({"config": name, "tokens": m, "fwd_ms": ms[0], "bwd_ms": ms[1], "ms": sum(ms)})
            print(f"{m} tok  swiglu {name}: fwd {ms[0]:.3f} ms, bwd {ms[1]:.3f} ms", file=sys.stderr, flush=True)
    return rows, ",".join(map(str, min(total, key=total.get)))


def layer_calls(dims: dict, tokens: int) -> list[dict]:
    """The quantization calls of one dense decoder layer in the FP8 train pass (fp8/fast/dual.py with
    fuse_swiglu and activation checkpointing): name, kernel mode (0 x itself, 1 silu(gate) * up from [gate | up],
    2 the gradient of [gate | up] from h's), the K of the [M, K] it writes in both FP8 layouts, the bf16 bytes it
    reads, and how often a micro-batch runs it (forward calls twice: the checkpointed forward and its recompute)."""
    h, inter, m = dims["hidden_size"], dims["intermediate_size"], tokens
    head_dim = dims.get("head_dim", h // dims["num_attention_heads"])
    heads, kv_heads = dims["num_attention_heads"], dims["num_key_value_heads"]
    attn, qkv = heads * head_dim, (heads + 2 * kv_heads) * head_dim
    calls = [  # (call, mode, K, bf16 elements read, per micro-batch)
        ("x of qkv_proj", 0, h, m * h, 2), ("x of o_proj", 0, attn, m * attn, 2), ("x of gate_up_proj", 0, h, m * h, 2),
        ("silu(gate) * up, x of down_proj", 1, inter, m * 2 * inter, 2),
        ("grad of qkv_proj's output", 0, qkv, m * qkv, 1), ("grad of o_proj's output", 0, h, m * h, 1),
        ("grad of down_proj's output", 0, h, m * h, 1),
        ("grad of gate_up_proj's output, from h's", 2, 2 * inter, m * inter + m * 2 * inter, 1)]
    return [{"call": c, "mode": mode, "k": k, "read_bytes": 2 * read, "per_micro_batch": n}
            for c, mode, k, read, n in calls]


def per_call(model: str, tokens: int) -> list[dict]:
    """Each quantization call of one decoder layer at `model`'s dims and `tokens` rows, timed alone with the
    trainer's launches, against a bf16 copy of as many bytes as it reads and writes (the floor); the last row
    sums a micro-batch's calls (per_micro_batch x layers): what the train pass's profile shows as quant."""
    from bench.rollout import ALIASES, MODELS
    from fp8.fast.kernels import CONFIG, SWIGLU_CONFIG, _launch

    name = ALIASES.get(model, model)
    dims = MODELS[name]
    rows, total, total_floor = [], 0.0, 0.0
    for c in layer_calls(dims, tokens):
        m, k, mode = tokens, c["k"], c["mode"]
        x = torch.randn(m, k // 2 if mode == 2 else k, device="cuda", dtype=torch.bfloat16) if mode != 1 else None
        gu = torch.randn(m, 2 * k if mode == 1 else k, device="cuda", dtype=torch.bfloat16) if mode else None
        config = CONFIG if mode == 0 else SWIGLU_CONFIG
        ms = graph_ms(lambda: _launch(x, gu, k, mode=mode, config=config))
        moved = c["read_bytes"] + 2 * m * k  # + both FP8 layouts (scales left out)
        copy = torch.empty(moved // 4, device="cuda", dtype=torch.bfloat16)  # a clone of it reads and writes `moved`
        floor = graph_ms(lambda: torch.clone(copy))
        n = c["per_micro_batch"] * dims["num_hidden_layers"]
        total, total_floor = total + n * ms, total_floor + n * floor
        rows.append({**c, "tokens": m, "ms": ms, "floor_ms": floor, "vs_floor": ms / floor,
                     "gb_s": moved / ms / 1e6})
        print(f"{c['call']:>34}: {ms * 1e3:7.1f} us ({rows[-1]['vs_floor']:.2f}x the copy floor, "
              f"{rows[-1]['gb_s']:.0f} GB/s), x{n} a micro-batch", file=sys.stderr, flush=True)
    rows.append({"call": f"a micro-batch ({dims['num_hidden_layers']} layers)", "tokens": tokens, "ms": total,
                 "floor_ms": total_floor, "vs_floor": total / total_floor})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    p.add_argument("--swiglu", action="store_true", help="sweep fp8.fuse_swiglu's kernels instead")
    p.add_argument("--shape", help="instead of a sweep: each quantization call of one decoder layer of this model "
                   "(bench/rollout.py MODELS, e.g. llama3b) timed alone with the trainer's launches, against a copy "
                   "of its bytes -> OUT/quant_calls.json")
    p.add_argument("--tokens", type=int, default=4224, help="rows per call with --shape (a multiple of 128; "
                   "default: the peer micro-batch, 4 x 1,056 tokens)")
    args = p.parse_args(argv)
    if args.shape:
        from bench.rollout import ALIASES, MODELS

        if ALIASES.get(args.shape, args.shape) not in MODELS:
            fail(f"--shape {args.shape!r} is not one of {sorted(MODELS) + sorted(ALIASES)}")
        if args.tokens < 128 or args.tokens % 128:
            fail(f"--tokens {args.tokens}: needs a positive multiple of 128 (the quantization tile)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench/quant.py needs a Hopper (SM90) GPU")
    from fp8.fast.kernels import DEFAULT_CONFIG, DEFAULT_SWIGLU_CONFIG

    if args.shape:
        rows = per_call(args.shape, args.tokens)
        path = write_results("quant_calls", rows, Path(args.out), model=args.shape)
        print(markdown_table(rows, ["call", "k", "tokens", "per_micro_batch", "ms", "floor_ms", "vs_floor", "gb_s"]))
        print(f"wrote {path}")
        return
    if args.swiglu:
        rows, best = sweep_swiglu()
        path = write_results("quant_swiglu", rows, Path(args.out), best=best,
                             default=",".join(map(str, DEFAULT_SWIGLU_CONFIG)))
        print(markdown_table(rows, ["config", "tokens", "fwd_ms", "bwd_ms", "ms"]))
        print(f"best: {best} (default {DEFAULT_SWIGLU_CONFIG}); wrote {path}")
        return
    rows, best = sweep()
    path = write_results("quant", rows, Path(args.out), best=best, default=",".join(map(str, DEFAULT_CONFIG)))
    print(markdown_table(rows, ["config", "tokens", "ms", "gb_s", "vs_floor"]))
    print(f"best: {best} (default {DEFAULT_CONFIG}); wrote {path}")


if __name__ == "__main__":
    main()
