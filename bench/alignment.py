"""Engine/trainer alignment: how far apart are vLLM's logprobs and the trainer's, per FP8 mode?

    python -m bench.alignment            # all engine modes, each in its own process (vLLM: one engine each)
    python -m bench.alignment --moe      # Qwen3-30B-A3B width, 4 layers: + routing mismatch, replay off/on

For each engine mode (bf16; fp8 = block W8A8 linears; fp8kv = + FP8 KV cache and attention
with q/k/v scales 1.0; fp8kv_calibrated = scales from fp8/calibrate.py), a randomly initialised
Llama-shaped model (seeded: every process builds the same weights) is pushed into vLLM through
fp8/export.py, samples 64 random prompts x 4 completions of 128 tokens at T=1, and the
trainer scores them in BF16 and in torchao block FP8 (fp32 master weights under bf16 autocast, as in training). Writes OUT/alignment.json (default runs/bench; the committed one: bench/results/alignment.json)
(token_mult_prob_error and kl per engine/trainer pair); child logs in OUT/logs/.

--moe: the model is Qwen3-30B-A3B's width (bench/rollout.py MODELS: 128 experts of width 768, top-8,
hidden 2048, vocab 151936) cut to --layers decoder layers (default 4), vLLM's FusedMoE block FP8 in
the fp8 modes, and vLLM returns each token's experts. Every engine/trainer pair is scored twice, with
router replay off (the trainer routes by its own top-k) and on (by the engine's: routing.py, as
moe.router_replay does in training), each row adding routing_mismatch / routing_mismatch_tokens
(routing.RoutingStats: the share of (response token, layer) pairs, and of response tokens in any
layer, whose trainer top-k set differs from the engine's). Writes OUT/alignment_moe.json.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

from bench.rollout import tiny_flow
from bench.runner import RESULTS, Job, emit, markdown_table, read_records, run_jobs, say, write_results

MODES = {"bf16": [], "fp8": ["fp8.rollout=true"], "fp8kv": ["fp8.rollout=true", "fp8.kv_cache=true"],
         "fp8kv_calibrated": ["fp8.rollout=true", "fp8.kv_cache=true"]}
VOCAB = "model.tiny.vocab=" + "".join(map(chr, range(32, 127)))  # a str field takes the raw text
SHAPE = ["model.tiny.hidden_size=1024", "model.tiny.intermediate_size=3072", "model.tiny.num_layers=8",
         "model.tiny.num_heads=16", "model.tiny.num_kv_heads=8", "model.tiny.head_dim=128", VOCAB]
MOE_LAYERS = 4  # --moe: decoder layers of the Qwen3-30B-A3B width (fast; the routing mismatch grows with depth)


def shape(moe: bool, layers: int | None) -> list[str]:
    """The model.tiny overrides: SHAPE (dense, --layers replacing its 8), or Qwen3-30B-A3B's width with
    `layers` decoder layers (default MOE_LAYERS); the char vocab either way."""
    if not moe:
        return [*SHAPE, *([f"model.tiny.num_layers={layers}"] if layers else [])]
    return [f"model.tiny={tiny_flow('qwen3-30b-a3b', layers or MOE_LAYERS)}", VOCAB]


def measure(mode: str, prompts: int, n: int, new_tokens: int, model_shape: list[str] = SHAPE) -> list[dict]:
    from config import load_config
    from fp8.calibrate import QKVCalibrator
    from fp8.export import export_weights
    from run_setup import fp8_model
    from losses.mismatch import mismatch_metrics
    from modeling import load_model_and_tokenizer
    from engines.vllm import VLLMEngine
    from batch import collate, logprob_pass, micro_batches
    import routing

    cfg = load_config(None, [*model_shape, *MODES[mode], "rollout.engine=vllm", "rollout.enforce_eager=true",
                             "rollout.sleep_mode=false", "rollout.gpu_memory_utilization=0.3",
                             f"rollout.max_new_tokens={new_tokens}", "data.max_prompt_tokens=64"])
    device = torch.device("cuda")
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(cfg.model, device)
    engine = VLLMEngine(cfg, model, tok, device)
    g = torch.Generator().manual_seed(1)
    prompt_ids = [[tok.bos_token_id] + torch.randint(3, len(tok), (32,), generator=g).tolist() for _ in range(prompts)]
    trainers = {"bf16": model, "fp8": copy.deepcopy(model)}
    fp8_model(trainers["fp8"], cfg.fp8)
    scales = None
    if mode == "fp8kv_calibrated":  # scales from the trainer's own q/k/v on the prompts
        calib = QKVCalibrator(trainers["fp8"], cfg.fp8.calib_percentile, cfg.fp8.calib_margin)
        ids = torch.tensor(prompt_ids, device=device)
        with torch.no_grad(), calib.capture():
            for s in micro_batches(len(ids), 16):
                trainers["fp8"](input_ids=ids[s])
        scales = calib.scales()
    engine.update_weights(export_weights(model, cfg.fp8, fp8=cfg.fp8.rollout, kv_scales=scales))
    samples = engine.generate(prompt_ids, n=n, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, seed=0)
    input_ids, attention_mask, mask, rollout_logp = (x.to(device) for x in collate(samples, tok.pad_token_id))
    routed = routing.collate_routing(samples, input_ids.shape[1])  # [B, L, layers, k] engine's experts (MoE)
    if routing.is_moe(model) and routed is None:
        raise RuntimeError("vLLM returned no routed experts for a MoE model (enable_return_routed_experts)")
    rows = []
    for name, trainer in trainers.items():
        for replay in (False, True) if routed is not None else (None,):  # MoE: router replay off, then on
            stats = routing.RoutingStats()
            ctx = None if routed is None else routing.forward_context(trainer, routed.to(device), replay,
                                                                      mask.bool(), stats)
            logp = logprob_pass(trainer, input_ids, attention_mask, 1.0, micro_batch=32, mixed=True,
                                forward_context=ctx)  # as the trainer
            m = mismatch_metrics(logp, rollout_logp, mask)
            row = {"engine": mode, "trainer": name, **m, "refit_s": engine.last_refit_s}
            if replay is not None:
                row.update(router_replay=replay, **{k.split("/", 1)[1]: v for k, v in stats.metrics().items()})
            rows.append(row)
            say(f"engine {mode:17s} trainer {name:5s} token_mult_prob_error {m['token_mult_prob_error']:.4f} "
                f"kl {m['kl']:.2e}" + ("" if replay is None else f" router_replay {replay} routing_mismatch "
                                                                  f"{row['routing_mismatch']:.4f}"))
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS), help="results dir (default runs/bench, untracked)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B width (see above) -> OUT/alignment_moe.json")
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers (default 8; --moe {MOE_LAYERS})")
    p.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)  # the child: one mode
    p.add_argument("--records", help=argparse.SUPPRESS)
    return p


def child_argv(args, mode: str, records: Path) -> list[str]:
    """The child process of one engine mode, with the parent's sizes and shape."""
    return [sys.executable, "-m", "bench.alignment", "--mode", mode, "--records", str(records),
            "--prompts", str(args.prompts), "--n", str(args.n), "--new-tokens", str(args.new_tokens),
            *(["--moe"] if args.moe else []), *(["--layers", str(args.layers)] if args.layers else [])]


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.mode:
        for row in measure(args.mode, args.prompts, args.n, args.new_tokens, shape(args.moe, args.layers)):
            emit(args.records, row)
        return
    name = "alignment_moe" if args.moe else "alignment"
    logs = Path(args.out) / "logs"
    jobs = [Job(mode, child_argv(args, mode, logs / f"{name}_{mode}.jsonl"), logs / f"{name}_{mode}.log",
                logs / f"{name}_{mode}.jsonl") for mode in MODES]
    runs = []

    def on_done(job):  # a failed mode is a row with its error; the others still run
        runs.extend(read_records(job.records) or [{"engine": job.label, "error": f"{job.status}, exit {job.rc}"}])
        write_results(name, runs, Path(args.out))

    failed = run_jobs(jobs, on_done, poll_s=0.5, tag="alignment")  # one vLLM engine per process
    print(f"wrote {Path(args.out) / f'{name}.json'}")
    moe_cols = ["router_replay", "routing_mismatch", "routing_mismatch_tokens"] if args.moe else []
    print(markdown_table(runs, ["engine", "trainer", *moe_cols, "token_mult_prob_error", "kl", "max_abs_diff"]))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
