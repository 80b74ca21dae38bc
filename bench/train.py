"""Trainer throughput: BF16 vs torchao block-wise FP8 (Hopper).

    python -m bench.train linear            # isolated linears at Llama-3.1-8B shapes
    python -m bench.train stack             # a stack of Llama-3.1-8B decoder layers, fwd + bwd + AdamW
    python -m bench.train all               # stack, then linear (autotuning is shared: ~ the cost of one)
    python -m bench.train stack --layers 8 --tokens 16384 --seq-len 4096 --modes bf16,fp8

`linear`: forward + backward of one bias-free linear (M tokens x K -> N) at the four Llama-3.1-8B
projection shapes and 8192 / 16384 tokens; fp8 = torchao Float8BlockwiseLinear (1x128 activation
tiles, 128x128 weight blocks, quantization timed, as in training).

`stack`: --layers Llama-3.1-8B decoder layers (transformers LlamaModel, SDPA attention, a 128-entry
embedding that is never used), bf16 parameters, train mode. One iteration = zero_grad + --accum x
[forward of a micro-batch of --tokens hidden states (requires_grad, as if from an embedding) +
backward of a random output gradient] + fused AdamW step. A micro-batch is tokens / seq_len causal
rows of --seq-len (0 = one row): packed documents without a varlen kernel. A GRPO step accumulates
many micro-batches per optimizer step (bench/step_8b_long_h100.yaml: 64): --accum 4 shows what the
per-step costs (AdamW, and with fp8.cache_weights the weight quantization) weigh there. Modes, each
a set of FP8Config overrides (STACK_MODES), built and timed one after another in this process:
  bf16         nn.Linear everywhere
  fp8          convert_to_fp8_training(FP8Config(train=True)): every decoder linear torchao FP8, q/k/v
               and gate/up one GEMM each (fuse_projections), silu*mul inside the FP8 quantization of
               down_proj's input (fuse_swiglu)
  fp8_unfused  fp8 with fuse_projections=False: one GEMM (and one input quantization) per linear; as
               in the trainer, no fp8/fast kernels then (run_setup.fp8_model)
  fp8_two_pass (ablation) torchao's separate 1x128 and 128x1 quantizers (two reads of x and of
               grad_out) instead of fp8/fast/kernels.py's quant_dual (one), without fuse_swiglu
  fp8_cached   fp8.cache_weights: each weight quantized once per optimizer step, not in every
               micro-batch's forward and backward
  fp8_cached_noswiglu  (ablation) fp8_cached with fuse_swiglu=False (HF's MLP forward)
  <mode>_compile  every decoder layer torch.compile'd (inductor, static shapes, per block as
               torchtitan does); the FP8 autograd Functions are traced, quantizers and GEMMs are
               opaque custom ops. speedup is against bf16_compile, speedup_eager against bf16.
Reported per micro-batch: ms (iteration / accum; median of --iters after --warmup, CUDA events),
tok_s, tflops (6 x linear params x tokens + 6 x seq_len^2 x hidden x rows x layers, causal
attention), speedup, peak memory, rel_err of the output vs bf16 (same weights, before any step);
with --profile the GPU time per kernel category and gpu_busy = kernel time / wall time.

Both write OUT/train.json (runs of the same GPU already there are kept unless re-measured) and
print a table. fp8.torchao.keep_triton_autotuning() keeps Triton's autotune results on disk, so a
later process on the same host skips the ~17 s per kernel and shape.
"""

import argparse
import sys
from pathlib import Path

import torch

from fp8.torchao import keep_triton_autotuning

keep_triton_autotuning()  # before torchao's @triton.autotune kernels are defined
from bench.runner import (RESULTS, add_ratio, cpu_ops, cuda_kernels, cuda_time_ms,  # noqa: E402
                          markdown_table, parse_choices, run_inline, update_results, write_json)

SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (4096, 1024),
          "gate/up_proj": (4096, 14336), "down_proj": (14336, 4096)}
FP8 = ["fp8.train=true"]
STACK_MODES = {  # mode -> FP8Config overrides; '<mode>_compile' compiles the layers
    "bf16": [],
    "fp8": FP8,
    "fp8_unfused": [*FP8, "fp8.fuse_projections=false"],
    "fp8_two_pass": [*FP8, "fp8.fuse_swiglu=false"],  # + use_two_pass_quant
    "fp8_cached": [*FP8, "fp8.cache_weights=true"],
    "fp8_cached_noswiglu": [*FP8, "fp8.cache_weights=true", "fp8.fuse_swiglu=false"],
}
STACK_MODES |= {f"{m}_compile": v for m, v in STACK_MODES.items()}
COMPILED = "_compile"
DEFAULT_STACK_MODES = ["bf16", "fp8", "fp8_unfused", "bf16_compile", "fp8_compile"]
LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072)


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
            add_ratio(runs, "speedup", "ms", lower_is_better=True)
            print(f"{row['workload']}: bf16 {runs[-2]['ms']:.3f} ms  fp8 {runs[-1]['ms']:.3f} ms  "
                  f"x{runs[-1]['speedup']:.2f}", flush=True)
    return runs


# ----------------------------------------------------------------------------------- stack


def stack_config(layers: int, **overrides):
    """LlamaConfig of `layers` Llama-3.1-8B decoder layers, a 128-token vocab, SDPA attention."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**LLAMA31_8B, **overrides}, num_hidden_layers=layers, vocab_size=128,
                      tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def fp8_config(overrides: list[str]):
    """FP8Config() with `fp8.key=value` overrides (read as the config CLI reads them)."""
    from config import FP8Config, parse_override

    fields = {}
    for text in overrides:
        keys, value = parse_override(text)
        if len(keys) != 2 or keys[0] != "fp8":
            raise ValueError(f"{text!r}: a stack mode overrides fp8.<field> only")
        fields[keys[1]] = value
    return FP8Config(**fields)


def build_stack(hf_cfg, mode: str, device, seed: int = 0):
    """(LlamaModel in bf16, train mode, on device; converted linear names). Same seed, same weights."""
    from transformers import LlamaModel

    from run_setup import fp8_model

    if mode not in STACK_MODES:
        raise ValueError(f"stack mode {mode!r} not in {list(STACK_MODES)}")
    fp8 = fp8_config(STACK_MODES[mode])
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaModel(hf_cfg)
    model = model.to(torch.bfloat16).train()
    converted = fp8_model(model, fp8)[0] if fp8.train else []
    if mode.startswith("fp8_two_pass"):
        use_two_pass_quant(model)
    if mode.endswith(COMPILED):
        torch._dynamo.reset()  # a fresh cache per mode: the modes' graphs never count against each other's limit
        for layer in model.layers:
            layer.compile(dynamic=False)  # each token count gets its own static graph
    return model, converted


def use_two_pass_quant(model) -> None:
    """The fp8_two_pass ablation: the FP8 linears of `model` quantize activations and gradients with
    torchao's act_quant_lhs + act_quant_rhs (one read each, same bytes) instead of quant_dual."""
    import copy

    from torchao.prototype.blockwise_fp8_training import kernels as k

    from fp8.linear import is_fp8_linear

    def two_pass(x):
        q, s = k.triton_fp8_blockwise_act_quant_lhs(x, 128)
        qc, sc = k.triton_fp8_blockwise_act_quant_rhs(x, 128)  # [M, K] column-major = [K, M] row-major
        return q, s, qc.t(), sc

    linears = [m for m in model.modules() if is_fp8_linear(m)]
    kernels = copy.copy(linears[0].kernels)
    kernels.dual = two_pass
    for m in linears:
        m.kernels = kernels


def stack_inputs(hf_cfg, tokens: int, seq_len: int, device, seed: int = 0):
    """x [rows, seq, hidden] bf16 (requires grad), position_ids [rows, seq], grad_out like x."""
    seq_len = seq_len or tokens
    if tokens % seq_len or tokens % 128:
        raise ValueError(f"--tokens {tokens} must be a multiple of 128 and of --seq-len {seq_len}")
    rows = tokens // seq_len
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (rows, seq_len, hf_cfg.hidden_size)
    x = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16).requires_grad_(True)
    grad = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    pos = torch.arange(seq_len, device=device).expand(rows, seq_len)
    return x, pos, grad


def make_optimizer(model):
    """Fused AdamW on CUDA; with fp8.cache_weights, the FP8 weight caches refreshed after each step."""
    from fp8.fast.cache import refresh_weight_caches_on_step

    fused = all(p.is_cuda for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=fused or None)
    refresh_weight_caches_on_step(model, opt)  # as train_grpo does
    return opt


def stack_step(model, opt, x, pos, grad, accum: int = 1) -> None:
    """One training iteration: zero_grad, `accum` x (forward, backward), AdamW step."""
    opt.zero_grad(set_to_none=True)
    x.grad = None
    for _ in range(accum):
        out = model(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state  # [rows, seq, hidden]
        out.backward(grad)
    opt.step()


def stack_flops(hf_cfg, tokens: int, seq_len: int) -> float:
    """fwd + bwd model FLOPs: 6 x linear params x tokens + 6 x S^2 x hidden x rows x layers (causal)."""
    h, i, L = hf_cfg.hidden_size, hf_cfg.intermediate_size, hf_cfg.num_hidden_layers
    kv = hf_cfg.num_key_value_heads * (getattr(hf_cfg, "head_dim", None) or h // hf_cfg.num_attention_heads)
    linear_params = L * (2 * h * h + 2 * h * kv + 3 * h * i)
    seq_len = seq_len or tokens
    return 6 * linear_params * tokens + 6 * seq_len**2 * h * (tokens // seq_len) * L


def summarize_kernels(kernels: list[tuple], iters: int, top: int = 40) -> dict:
    """[(kernel name, total ms[, calls])] over `iters` iterations -> ms/iter per category and the top kernels,
    each with its launches per iteration where the calls are given (ms / calls: a launch's time, to hold
    against the bytes it moves)."""
    from observe import kernel_kind as category

    total = sum(k[1] for k in kernels) or 1.0
    cats: dict[str, float] = {}
    for name, ms, *_ in kernels:
        cats[category(name)] = cats.get(category(name), 0.0) + ms
    ranked = sorted(kernels, key=lambda k: -k[1])[:top]
    return {"gpu_ms_per_iter": total / iters,
            "categories": {c: {"ms": ms / iters, "share": ms / total} for c, ms in sorted(cats.items(), key=lambda c: -c[1])},
            "top_kernels": [{"name": k[0][:120], "category": category(k[0]), "ms": k[1] / iters,
                             **({"calls": k[2] / iters} if len(k) > 2 else {})} for k in ranked]}


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
BUILT_IN = {"aten", "prim", "prims", "autograd", "torch", "profiler", "c10d", "inductor", "cudnn"}  # not custom ops
# the host blocked until the GPU catches up: a synchronize, or a launch queue full of kernels not yet run
WAIT_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "Command Buffer Full")


def summarize_host(ops: list[tuple[str, float, int]], iters: int, top: int = 25) -> dict:
    """[(host event name, self ms, calls)] over `iters` iterations (runner.cpu_ops) -> the host's side of them
    per iteration: its profiled self time in all (the profiler's own cost included, so above the unprofiled
    host time), of it the time spent waiting for the GPU (WAIT_CALLS: near 0 where the host, not the GPU, sets
    the pace), the kernel launches (runtime and driver calls) and their time, the calls of operators outside
    aten (custom ops: each a Python call from a compiled graph), and the top events by self time. Where a pass's
    wall time exceeds its GPU time, this says what the host spent it on."""
    launches = [o for o in ops if o[0] in LAUNCH_CALLS]
    custom = [o for o in ops if "::" in o[0] and o[0].split("::")[0] not in BUILT_IN]
    return {"self_ms_per_iter": sum(o[1] for o in ops) / iters,
            "wait_ms_per_iter": sum(o[1] for o in ops if o[0] in WAIT_CALLS) / iters,
            "launches_per_iter": sum(o[2] for o in launches) / iters,
            "launch_ms_per_iter": sum(o[1] for o in launches) / iters,
            "custom_ops": [{"name": n, "calls": c / iters, "ms": ms / iters}
                           for n, ms, c in sorted(custom, key=lambda o: -o[1])],
            "top": [{"name": n[:120], "ms": ms / iters, "calls": c / iters}
                    for n, ms, c in sorted(ops, key=lambda o: -o[1])[:top]]}


def profile_kernels(fn, iters: int = 2, per_call: int = 1) -> dict:
    """Run fn `iters` times under torch.profiler (CUDA and CPU activity) and summarize its kernels and its
    host work (summarize_host) per 1 / per_call of a call (per micro-batch of a call that runs per_call)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {**summarize_kernels(cuda_kernels(prof), iters * per_call),
            "host": summarize_host(cpu_ops(prof), iters * per_call)}


def bench_stack(layers: int = 4, tokens=(8192, 16384), seq_len: int = 2048, modes=DEFAULT_STACK_MODES,
                warmup: int = 3, iters: int = 10, device="cuda", timer=None, profile_dir: Path | None = None,
                on_mode=None, accums=(1,)) -> list[dict]:
    """Each mode's runs (one per token count and accum), modes in this process one after another
    (bench.runner.run_inline: a failing mode is an error row); on_mode(runs so far) after each mode."""
    timer = timer or (lambda fn: cuda_time_ms(fn, warmup=warmup, iters=iters))
    hf_cfg = stack_config(layers)
    ref = {}  # tokens -> bf16's output: every mode's rel_err is against it

    def measure(mode):
        return _bench_stack_mode(mode, hf_cfg, layers, tokens, seq_len, accums, device, timer, profile_dir, ref)

    def done(runs):
        if device != "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        add_ratio(runs, "speedup", "ms", lower_is_better=True,
                  base=lambda mode: "bf16" + COMPILED * str(mode).endswith(COMPILED))  # compiled vs compiled
        add_ratio(runs, "speedup_eager", "ms", lower_is_better=True)
        if on_mode is not None:
            on_mode(runs)

    return run_inline(modes, measure, f"stack {layers}x Llama-3.1-8B layers", on_mode=done)


def _bench_stack_mode(mode, hf_cfg, layers, tokens, seq_len, accums, device, timer, profile_dir, ref) -> list[dict]:
    """bench_stack for one mode; fills ref (bf16 outputs) for later modes."""
    runs = []
    model, converted = build_stack(hf_cfg, mode, device)
    opt = make_optimizer(model)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    for t in tokens:
        x, pos, grad = stack_inputs(hf_cfg, t, seq_len, device)
        with torch.no_grad():  # before any optimizer step: the same weights in every mode
            out = model(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state.float()
        if mode == "bf16":
            ref[t] = out
        rel = float((out - ref[t]).norm() / ref[t].norm()) if t in ref else None
        del out
        rows = t // (seq_len or t)
        for a in accums:
            if device != "cpu" and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            ms = timer(lambda: stack_step(model, opt, x, pos, grad, a)) / a  # per micro-batch
            per_step = f", {a} micro-batches per optimizer step" if a > 1 else ""
            run = {"workload": f"stack {layers}x Llama-3.1-8B layers {t} tok ({rows}x{seq_len or t}){per_step}",
                   "mode": mode, "ms": ms, "tok_s": t / ms * 1e3, "tflops": stack_flops(hf_cfg, t, seq_len) / ms / 1e9,
                   "rel_err": rel, "layers": layers, "tokens": t, "seq_len": seq_len or t, "accum": a,
                   "fp8_linears": len(converted), "bf16_linears": n_linear - len(converted)}
            if device != "cpu" and torch.cuda.is_available():
                run["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if profile_dir is not None:
                prof = profile_kernels(lambda: stack_step(model, opt, x, pos, grad, a), per_call=a)
                run["profile"] = prof["categories"]
                run["gpu_busy"] = prof["gpu_ms_per_iter"] / ms  # < 1: the GPU waits on kernel launches
                write_json(Path(profile_dir) / f"profile_stack_{mode}_{t}{f'_accum{a}' if a > 1 else ''}.json",
                           {**run, **prof})
                print(f"  kernels {prof['gpu_ms_per_iter']:.1f} ms/micro-batch (GPU busy {run['gpu_busy']:.0%}): "
                      + ", ".join(f"{c} {v['ms']:.1f} ({v['share']:.0%})" for c, v in prof["categories"].items()),
                      flush=True)
            runs.append(run)
            print(f"{run['workload']} {mode}: {ms:.1f} ms/micro-batch, {run['tok_s']:,.0f} tok/s, "
                  f"{run['tflops']:.0f} TFLOP/s", flush=True)
        del x, pos, grad
    return runs


# ----------------------------------------------------------------------------------- results


LINEAR_COLS = ["workload", "mode", "ms", "tflops", "speedup", "rel_err"]
STACK_COLS = ["workload", "mode", "ms", "tok_s", "tflops", "speedup", "speedup_eager", "peak_mem_gib", "rel_err",
              "bf16_linears", "gpu_busy"]


def parse_ints(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["linear", "stack", "all"])
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    p.add_argument("--layers", type=int, default=4, help="stack: decoder layers")
    p.add_argument("--tokens", type=parse_ints, default=[8192, 16384], help="stack: tokens per micro-batch")
    p.add_argument("--seq-len", type=int, default=2048, help="stack: row length (0 = one row of --tokens)")
    p.add_argument("--accum", type=parse_ints, default=[1],
                   help="stack: micro-batches per optimizer step, comma list (default 1)")
    p.add_argument("--modes", type=lambda text: parse_choices(text, STACK_MODES), default=DEFAULT_STACK_MODES,
                   help=f"stack: comma list of {list(STACK_MODES)}")
    p.add_argument("--warmup", type=int, default=3, help="stack: untimed iterations (autotuning happens here)")
    p.add_argument("--iters", type=int, default=10, help="stack: timed iterations")
    p.add_argument("--profile", action="store_true",
                   help="stack: also profile 2 iterations per run (torch.profiler): GPU time per kernel category "
                        "(gemm, fp8 quantize, attention, optimizer, ...) in train.json and OUT/profile_stack_*.json")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.layers < 1 or args.iters < 1 or args.warmup < 0 or args.seq_len < 0:
        sys.exit("bench/train.py: --layers and --iters must be >= 1, --warmup and --seq-len >= 0")
    for t in args.tokens:
        if t % 128 or (args.seq_len and t % args.seq_len):
            sys.exit(f"bench/train.py: --tokens {t} must be a multiple of 128 and of --seq-len {args.seq_len}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bench/train.py needs a Hopper (SM90) GPU: torchao's block-wise FP8 kernels are SM90-only")
    out = Path(args.out)
    if args.what in ("stack", "all"):
        runs = bench_stack(args.layers, args.tokens, args.seq_len, args.modes, args.warmup, args.iters,
                           profile_dir=out if args.profile else None,
                           on_mode=lambda done: update_results("train", done, out),  # a timeout loses one mode at most
                           accums=args.accum)
        print(f"wrote {out / 'train.json'}")
        print(markdown_table(runs, STACK_COLS))
    if args.what in ("linear", "all"):
        runs = bench_linear()
        print(f"wrote {update_results('train', runs, out)}")
        print(markdown_table(runs, LINEAR_COLS))


if __name__ == "__main__":
    main()
