"""The trainer's two passes of one GRPO micro-batch, as the trainer runs them, BF16 vs FP8.

    python -m bench.trainer_pass                                   # bench/step_8b_long_h100.yaml's shape
    python -m bench.trainer_pass --config bench/step_8b.yaml --rows 8 --prompt 32 --response 512
    python -m bench.trainer_pass --config configs/qwen3_8b_fp8_kv.yaml --shape qwen3 --prompt 128 --response 1664 \
        --compile --profile --modes bf16,fp8_cached        # a shipped config's micro-batch at full shape

The model, dtype and micro-batch size come from --config (the bench/step.py workload; --set overrides
it, --shape builds its model at a real model's dims; fp32 master weights compute under bf16 autocast, as
the trainer's). One micro-batch = --rows rows of --prompt + --response tokens, right-padded
(batch.collate) to the length the FP8 trainer rounds to (rows x L a multiple of 128). Timed per
micro-batch: `logprobs` = token_logprobs under no_grad (the old_logp pass), `train` = token_logprobs +
masked sum + backward (the policy update, without the optimizer step). Variants:
  bf16 unpadded  rows of exactly prompt + response tokens (what the BF16 step feeds when every
                 sample has the same length: no padding, no mask)
  <mode> masked  the padded batch with its attention mask passed to the model (HF builds a
                 [rows, 1, L, L] mask, SDPA runs a masked kernel: what token_logprobs avoids)
  <mode>         the padded batch without the mask (token_logprobs now: right padding + causal), the
                 LM head + log-softmax fused in both passes (batch.fused_head; train.fused_head)
  <mode> unfused head  the same with [tokens, vocab] logits and a per-row fp32 log-softmax (the train
                 pass's default): its time and memory against the fused head
  <mode> calib   (--calib) the `<mode>` variant with its logprobs calls inside one q/k/v amax capture
                 (fp8.calib_pass=logprobs: what recording costs the logprobs pass; the train pass as `<mode>`)
Modes, run in this order: bf16, then bf16_acc (the BF16 twin with the FP8 path's structure, fp8/fast/bf16.py: the
bf16 weights cast once, as between two optimizer steps, and each wgrad GEMM adding into the fp32 gradient),
then fp8 (run_setup.fp8_model of the same model; torchao on Hopper),
then fp8_cached (fp8.cache_weights: the FP8 weights quantized once, as between two optimizer steps),
then fp8_acc (fp8_cached + fp8.fuse_grad_accum: each FP8 wgrad GEMM adds into the weight's gradient buffer).
--accumulate: the gradients are kept from one train call to the next, so each call after the first adds
into them, as the trainer's micro-batches after a mini-batch's first do (without it every call starts
from no gradients: autograd takes the first one as .grad and adds nothing).
logp_sum: the sum of the token logprobs of the unmasked call (float64): equal for fp8 and fp8_cached.
--compile: the decoder layers torch.compile'd as train.compile=inductor does (distributed.compile_layers),
and the train pass's unfused head with them (batch.token_logprobs' compile_head, as the trainer's policy
forward), only the `<mode>` variant (the others would add graphs); the first calls of a mode compile. --dynamic: each
variant first runs both passes 128 tokens shorter, so compiled layers time their length-generic graphs (the
trainer's: its micro-batches differ in length) instead of graphs specialized to this one length.
Under torchrun with several ranks (FSDP2, the 80 GB recipe), each mode builds its own model and prepares
it as the trainer does (run_setup.prepare_trainer: FP8 conversion, compile, fully_shard; fp8_cached: with
fp8.cache_weights, i.e. the weights all-gathered in FP8 from shards quantized once, fp8/fast/gather.py),
and only the padded variants run: every rank the same micro-batch, the times rank 0's, the all-gathers
and gradient reduce-scatters of each pass inside them, e.g.
    torchrun --nproc_per_node 2 -m bench.trainer_pass --config configs/qwen3_8b_fp8_kv.yaml --shape qwen3 \
        --prompt 128 --response 1664 --rows 2 --compile --modes bf16,fp8,fp8_cached
Output: OUT/trainer_pass.json (ms per micro-batch, median of --iters after one warm-up, and each of them
sorted, `<pass>_ms_each`: on a host that sets the pace the median moves with the host's load, so compare the
fastest; CUDA events;
per variant, on CUDA, mem/peak_gib and mem/alloc_retries as train_grpo.py logs them; with --profile,
per pass the GPU ms per kernel category, gemm / fp8 quantize / attention / copy / elementwise, and the
top kernels, and its host side (bench/train.py summarize_host: profiled host ms and how much of it waited for the
GPU, ~0 where the host sets the pace, kernel launches, each custom
op's calls, the top host events), from 2 profiled calls after the timed ones).
"""

import argparse
import contextlib
import dataclasses
import functools
from pathlib import Path

import torch

from bench.rollout import ALIASES, MODELS, tiny_flow
from bench.runner import RESULTS, cuda_times_ms, parse_choices, run_inline, write_results

DEFAULT_CONFIG = Path(__file__).parent / "step_8b_long_h100.yaml"
MODES = ("bf16", "bf16_acc", "fp8", "fp8_cached", "fp8_acc")  # in this order on one model: each converts or wraps it


def passes(model, input_ids, attention_mask, mask, masked: bool, fused: bool, iters: int, profile: bool = False,
           calib=None, dynamic: bool = False, accumulate: bool = False, compile_head: str = "none") -> dict:
    from batch import token_logprobs

    def forward(cut: int, head: str = "none"):  # the batch's columns from `cut` on
        m = functools.partial(model, attention_mask=attention_mask[:, cut:]) if masked else model  # the old call
        return token_logprobs(m, input_ids[:, cut:], attention_mask[:, cut:], 1.0, fused=fused, compile_head=head)

    def logprobs(cut: int = 0):
        with torch.no_grad():
            forward(cut)

    def train(cut: int = 0):  # the trainer's policy forward compiles an unfused head with its layers
        (forward(cut, compile_head) * mask[:, cut:]).sum().backward()
        if not accumulate:
            model.zero_grad(set_to_none=True)

    if dynamic:  # a first call 128 columns shorter: compiled layers take dynamo's length-generic graphs
        logprobs(128)
        train(128)
    # calib: the logprobs calls inside one q/k/v amax capture, as the trainer's logprobs pass with
    # fp8.calib_pass=logprobs (each call's forward closes the previous call's record)
    capture = calib.capture if calib else contextlib.nullcontext
    # one warm-up call (FP8: torchao's autotuning, unless seeded), then the median of `iters` (each kept, sorted)
    with capture():
        each = {"logprobs": cuda_times_ms(logprobs, 1, iters)}
    each["train"] = cuda_times_ms(train, 1, iters)
    out = {f"{k}_ms": v[len(v) // 2] for k, v in each.items()}
    out.update({f"{k}_ms_each": [round(t, 2) for t in v] for k, v in each.items()})
    if profile:  # after the timing: kernels compiled and autotuned
        from bench.train import profile_kernels

        with capture():
            out["profile"] = {"logprobs": profile_kernels(logprobs)}
        out["profile"]["train"] = profile_kernels(train)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, as train_grpo.py's")
    p.add_argument("--shape", choices=sorted({*MODELS, *ALIASES}), help="build the config's model from scratch at "
                   "this real model's dims (bench/rollout.py MODELS; model.name_or_path=tiny), e.g. a shipped config "
                   "at full shape: --config configs/qwen3_8b_fp8_kv.yaml --shape qwen3")
    p.add_argument("--rows", type=int, help="rows per micro-batch (default: the config's train.micro_batch_size)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, help="default: the config's rollout.max_new_tokens")
    p.add_argument("--modes", type=lambda text: parse_choices(text, MODES), default=["bf16", "fp8"],
                   help=f"comma list of {list(MODES)} (run in that order)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    p.add_argument("--compile", action="store_true", help="compile the decoder layers (train.compile=inductor)")
    p.add_argument("--calib", action="store_true", help="one more variant: the logprobs calls inside a q/k/v amax "
                   "capture (fp8.calib_pass=logprobs: each forward closes the previous one's record)")
    p.add_argument("--dynamic", action="store_true", help="each variant first runs both passes on rows 128 tokens "
                   "shorter: with --compile the layers then run dynamo's length-generic graphs, as in the trainer, "
                   "whose micro-batches differ in length")
    p.add_argument("--accumulate", action="store_true", help="keep the gradients between train calls (each adds "
                   "into them, as the trainer's micro-batches after a mini-batch's first)")
    p.add_argument("--profile", action="store_true", help="CUDA: also each variant's kernels under torch.profiler "
                   "(2 calls per pass): ms per kernel category and the top kernels, and the host work (launches, "
                   "custom ops), as bench/train.py --profile")
    args = p.parse_args()
    args.modes = sorted(args.modes, key=MODES.index)
    import distributed
    from config import load_config
    from distributed import compile_layers, memory_metrics
    from fp8.calibrate import QKVCalibrator
    from fp8.fast.accum import attach_grad_accumulators, zero_grad_accumulators
    from fp8.fast.bf16 import bf16_twin
    from fp8.fast.cache import attach_weight_caches, refresh_weight_caches
    from fp8.linear import is_fp8_linear
    from run_setup import fp8_model, prepare_trainer
    from fp8.quant import BLOCK
    from modeling import load_model_and_tokenizer, pin_sdpa_backends
    from rollout import Sample
    from batch import amp, collate, length_multiple, token_logprobs

    shape = ["model.name_or_path=tiny", f"model.tiny={tiny_flow(ALIASES.get(args.shape, args.shape))}"] \
        if args.shape else []
    # train.device=auto: cuda:LOCAL_RANK, else the CPU (emulated FP8: a smoke run)
    cfg = load_config(args.config, [*shape, *args.set, "train.device=auto"])
    d = distributed.init(cfg)  # torchrun with > 1 rank: joins the process group (FSDP2)
    device = d.device
    pin_sdpa_backends(cfg.model.cudnn_sdpa)  # prepare_trainer's attention kernel (one GPU: measure() skips it)
    rows = args.rows or cfg.train.micro_batch_size
    n_resp = args.response or cfg.rollout.max_new_tokens
    def build():
        """The config's model, seeded: every mode starts from the same weights."""
        torch.manual_seed(0)
        built, tokenizer = load_model_and_tokenizer(cfg.model, device)
        return built.train(), tokenizer

    model, tok = build()
    mixed = device.type == "cuda" and cfg.model.dtype == "float32"  # train_grpo.py's: fp32 master weights, bf16 compute
    g = torch.Generator().manual_seed(0)
    samples = [Sample(0, torch.randint(3, len(tok), (args.prompt,), generator=g).tolist(),
                      torch.randint(3, len(tok), (n_resp,), generator=g).tolist(), [0.0] * n_resp, "length")
               for _ in range(rows)]
    batches = {"unpadded": collate(samples, tok.pad_token_id),
               "padded": collate(samples, tok.pad_token_id, length_multiple(rows, BLOCK))}  # as trainer.assemble_batch
    batches = {k: [x.to(device) for x in (ids, am, mask)] for k, (ids, am, mask, _) in batches.items()}
    L = {k: b[0].shape[1] for k, b in batches.items()}
    workload = (f"{rows} rows x {args.prompt}+{n_resp} tokens (padded to {L['padded']}), {Path(args.config).name}, "
                f"{type(model).__name__} {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B"
                + (f", FSDP2 over {d.world} ranks" if d.world > 1 else ""))
    if d.main:
        print(f"[trainer_pass] {workload}", flush=True)

    if args.compile and d.world == 1:
        compile_layers(model, "inductor")

    prepared = False  # FSDP2: the model built above serves the first mode

    def measure_sharded(mode) -> list[dict]:
        """FSDP2: a fresh model per mode, converted, compiled and sharded in the trainer's order."""
        nonlocal model, prepared
        if prepared:  # the previous mode's model is converted and sharded: build the same one again
            model = None
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = build()[0]
        prepared = True
        fp8 = dataclasses.replace(cfg.fp8, train=mode.startswith("fp8"),
                                  cache_weights=mode in ("bf16_acc", "fp8_cached", "fp8_acc"),
                                  fuse_grad_accum=mode.endswith("_acc"))  # (prepare_trainer: off over FSDP2 ranks)
        run_cfg = dataclasses.replace(cfg, fp8=fp8,
                                      train=dataclasses.replace(cfg.train, compile="inductor" if args.compile else "none"))
        prepare_trainer(model, None, run_cfg, d, mixed, argparse.Namespace(print=print if d.main else lambda *a: None))
        variants = [("padded", False, "fsdp2"), ("padded", False, "fsdp2 unfused head")]
        with amp(mixed):
            return [variant(mode, *v) for v in variants]

    def measure(mode) -> list[dict]:
        torch._dynamo.reset()  # fp8 replaces the linears: a fresh graph
        model.zero_grad(set_to_none=True)  # the previous mode's (--accumulate)
        if mode == "bf16_acc":
            twin = dataclasses.replace(cfg.fp8, train=False, cache_weights=True, fuse_grad_accum=True)
            print(f"[trainer_pass] bf16_acc: {', '.join(bf16_twin(model, twin, torch.bfloat16 if mixed else None))}",
                  flush=True)
            refresh_weight_caches(model)
            zero_grad_accumulators(model)
        if mode.startswith("fp8") and not any(is_fp8_linear(m) for m in model.modules()):
            # the caches only in fp8_cached: a compiled forward cannot fill them (fp8.cache_weights)
            fp8 = dataclasses.replace(cfg.fp8, train=True, cache_weights=False, fuse_grad_accum=False)
            print(f"[trainer_pass] fp8: {len(fp8_model(model, fp8)[0])} linears", flush=True)
        if mode in ("fp8_cached", "fp8_acc"):  # (attach_weight_caches adds none where they are)
            print(f"[trainer_pass] {mode}: {attach_weight_caches(model)} weight caches", flush=True)
            refresh_weight_caches(model)  # before a compiled forward, which cannot fill them
        if mode == "fp8_acc":
            print(f"[trainer_pass] fp8_acc: {attach_grad_accumulators(model)} gradient buffers", flush=True)
            zero_grad_accumulators(model)
        variants = [("unpadded", False, "unpadded")] if mode == "bf16" else []
        variants += [("padded", True, "masked"), ("padded", False, ""), ("padded", False, "unfused head")]
        if args.compile:
            variants = [("padded", False, "compiled"), ("padded", False, "compiled unfused head")]
        if args.calib:
            variants.append(("padded", False, "compiled calib" if args.compile else "calib"))
        with amp(mixed):  # fp32 master weights: bf16 autocast, as the trainer computes
            return [variant(mode, *v) for v in variants]

    def variant(mode: str, batch: str, masked: bool, label: str) -> dict:
        memory_metrics(device)  # this variant's peak starts here
        fused = "unfused" not in label
        r = {"workload": workload, "mode": f"{mode} {label}".strip(), "tokens": rows * L[batch],
             **passes(model, *batches[batch], masked, fused, args.iters, args.profile and device.type == "cuda",
                      QKVCalibrator(model) if "calib" in label else None, args.dynamic, args.accumulate,
                      "inductor" if "compiled" in label else "none"),
             **memory_metrics(device)}
        with torch.no_grad():
            r["logp_sum"] = token_logprobs(model, *batches[batch][:2], 1.0, fused=fused).double().sum().item()
        if not d.main:
            return r
        print(f"[trainer_pass] {r['mode']:>14}: logprobs {r['logprobs_ms']:8.1f} ms  train {r['train_ms']:8.1f} ms"
              f"  (fastest {r['logprobs_ms_each'][0]:.1f} and {r['train_ms_each'][0]:.1f} ms)", flush=True)
        for name, prof in r.get("profile", {}).items():
            cats = ", ".join(f"{c} {v['ms']:.1f}" for c, v in prof["categories"].items())
            print(f"[trainer_pass] {'':>14}  {name} kernels, ms: {cats}", flush=True)
            host = prof["host"]
            custom = ", ".join(f"{o['name']} x{o['calls']:.0f} {o['ms']:.1f} ms" for o in host["custom_ops"])
            print(f"[trainer_pass] {'':>14}  {name} host: {host['self_ms_per_iter']:.1f} ms profiled "
                  f"({host['wait_ms_per_iter']:.1f} ms of it waiting for the GPU against {prof['gpu_ms_per_iter']:.1f} "
                  f"ms of kernels), {host['launches_per_iter']:.0f} launches ({host['launch_ms_per_iter']:.1f} ms); {custom}",
                  flush=True)
        return r

    write = (lambda runs: write_results("trainer_pass", runs, Path(args.out))) if d.main else None
    run_inline(args.modes, measure_sharded if d.world > 1 else measure, workload, on_mode=write)
    if d.main:
        print(f"wrote {Path(args.out) / 'trainer_pass.json'}")
    if d.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
