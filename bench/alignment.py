"""Engine/trainer alignment: how far apart are vLLM's logprobs and the trainer's, per FP8 mode?

    python bench/alignment.py            # all engine modes, each in its own process (vLLM: one engine each)

For each engine mode (bf16; fp8 = block W8A8 linears; fp8kv = + FP8 KV cache and attention
with q/k/v scales 1.0; fp8kv_calibrated = scales from fp8/calibrate.py), a randomly initialised
Llama-shaped model (seeded: every process builds the same weights) is pushed into vLLM through
fp8/export.py, samples 64 random prompts x 4 completions of 128 tokens at T=1, and the
trainer scores them in BF16 and in torchao block FP8 (fp32 master weights under bf16 autocast, as in training). Writes bench/results/alignment.json
(token_mult_prob_error and kl per engine/trainer pair); child logs in OUT/logs/.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.runner import RESULTS, Job, emit, markdown_table, read_records, run_jobs, say, write_results  # noqa: E402

MODES = {"bf16": [], "fp8": ["fp8.rollout=true"], "fp8kv": ["fp8.rollout=true", "fp8.kv_cache=true"],
         "fp8kv_calibrated": ["fp8.rollout=true", "fp8.kv_cache=true"]}
SHAPE = ["model.tiny.hidden_size=1024", "model.tiny.intermediate_size=3072", "model.tiny.num_layers=8",
         "model.tiny.num_heads=16", "model.tiny.num_kv_heads=8", "model.tiny.head_dim=128",
         f"model.tiny.vocab={''.join(chr(c) for c in range(32, 127))!r}"]


def measure(mode: str, prompts: int, n: int, new_tokens: int) -> list[dict]:
    from config import load_config
    from fp8.calibrate import QKVCalibrator
    from fp8.export import export_weights
    from fp8.linear import convert_to_fp8_training
    from losses.mismatch import mismatch_metrics
    from modeling import load_model_and_tokenizer
    from rollout import VLLMEngine
    from batch import collate, logprob_pass, micro_batches

    cfg = load_config(None, [*SHAPE, *MODES[mode], "rollout.engine=vllm", "rollout.enforce_eager=true",
                             "rollout.sleep_mode=false", "rollout.gpu_memory_utilization=0.3",
                             f"rollout.max_new_tokens={new_tokens}", "data.max_prompt_tokens=64"])
    device = torch.device("cuda")
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(cfg.model, device)
    engine = VLLMEngine(cfg, model, tok, device)
    g = torch.Generator().manual_seed(1)
    prompt_ids = [[tok.bos_token_id] + torch.randint(3, len(tok), (32,), generator=g).tolist() for _ in range(prompts)]
    trainers = {"bf16": model, "fp8": copy.deepcopy(model)}
    convert_to_fp8_training(trainers["fp8"], cfg.fp8)
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
    rows = []
    for name, trainer in trainers.items():
        logp = logprob_pass(trainer, input_ids, attention_mask, 1.0, micro_batch=32, mixed=True)  # as the trainer
        m = mismatch_metrics(logp, rollout_logp, mask)
        rows.append({"engine": mode, "trainer": name, **m, "refit_s": engine.last_refit_s})
        say(f"engine {mode:17s} trainer {name:5s} token_mult_prob_error {m['token_mult_prob_error']:.4f} "
            f"kl {m['kl']:.2e}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)  # the child: one mode
    p.add_argument("--records", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        for row in measure(args.mode, args.prompts, args.n, args.new_tokens):
            emit(args.records, row)
        return
    logs = Path(args.out) / "logs"
    sizes = ["--prompts", str(args.prompts), "--n", str(args.n), "--new-tokens", str(args.new_tokens)]
    jobs = [Job(mode, [sys.executable, __file__, "--mode", mode, "--records", str(logs / f"alignment_{mode}.jsonl"),
                       *sizes], logs / f"alignment_{mode}.log", logs / f"alignment_{mode}.jsonl") for mode in MODES]
    runs = []

    def on_done(job):  # a failed mode is a row with its error; the others still run
        runs.extend(read_records(job.records) or [{"engine": job.label, "error": f"{job.status}, exit {job.rc}"}])
        write_results("alignment", runs, Path(args.out))

    failed = run_jobs(jobs, on_done, poll_s=0.5, tag="alignment")  # one vLLM engine per process
    print(f"wrote {Path(args.out) / 'alignment.json'}")
    print(markdown_table(runs, ["engine", "trainer", "token_mult_prob_error", "kl", "max_abs_diff"]))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
