"""What the FP8 KV cache costs in trainer/engine mismatch on a real pretrained model, per attention variant.

    python -m scripts.kv_mismatch --out /tmp/kv                        # all variants, SmolLM2 (scripts/real_model.py)
    python -m scripts.kv_mismatch --model DIR --data DIR --steps 5     # another HF model dir, local GSM8K JSONL
    python -m scripts.kv_mismatch --variants fp8kv_triton,fp8kv_triton_norecal --merge /tmp/kv1/kv_mismatch.json
    bash scripts/gpu_check.sh kvmismatch [ARGS]                        # on the GPU host, results -> $OUT
    python -m scripts.kv_mismatch --cpu --config configs/tiny_cpu.yaml --model tiny ...   # the machinery on CPU

Each variant runs the real trainer (train_grpo.py, one process after another, as scripts/flagship_check.py)
on configs/gsm8k.yaml scaled down: --prompts prompts x --n samples of <= --max-new-tokens tokens (the
model's own EOS ends them), --steps steps, one optimizer step per step (plain AdamW, eager trainer: no
compile time), no validation or checkpoints. The learning rate and warm-up stay the config's (3e-7
after 13 warm-up steps: over a few steps the weights barely move, so per-step recalibration has little
to track; optim.lr=... optim.warmup_steps=0 as overrides make them move). Every variant keeps the trainer's and the engine's linears
in BF16 (fp8.train=false fp8.rollout=false), so the variants differ in the engine's attention and KV
cache only (add fp8.train=true fp8.rollout=true as overrides for the whole recipe):

    bf16                  fp8.kv_cache=false: BF16 KV cache, BF16 attention (the baseline)
    fp8kv_fa3             FP8 KV cache, FlashAttention 3 in FP8 (q and P quantized too), scales
                          recalibrated from the trainer's q/k/v before every rollout
    fp8kv_xqa             FP8 KV cache, FlashInfer: XQA decode with device-side scales, q unscaled
                          (fp8.kv_attention=xqa, engines/vllm_internals.py)
    fp8kv_triton          FP8 KV cache, vLLM's Triton attention (fp8.kv_attention=triton)
    fp8kv_fa3_norecal     fp8.recalibrate=false: no calibrator, so the engine keeps its start-up scales
    fp8kv_triton_norecal  of 1.0 for q, k and v (unit scales: e4m3 saturates above 448)

fp8kv_triton is a second FP8 attention kernel, not FP8 K/V under BF16 math: in vLLM 0.26's source the
Triton backend on CUDA takes q in FP8 as FA3 does (TritonAttentionImpl.supports_quant_query_input is
true, so Attention.forward quantizes q with q_scale), keeps the FP8 K/V tiles in FP8 for q.K^T and
casts P to FP8 for P.V. What separates FP8 q/k/v from FP8 P is the HF engine (--cpu): its emulation
rounds q, k and v to e4m3 with the same scales (q multiplied by 1/scale, k/v divided, as vLLM) and
computes attention, P included, in the model dtype; it ignores fp8.kv_attention. scripts/qkv_rounding.py
splits that rounding by tensor (q, k, v), teacher-forced.

The runs go in this order, so a cut call still has the baseline and the two recalibrated variants.
Per variant: mismatch/token_mult_prob_error per step and its mean / min / max over the steps after step 0
(step 0's scales come from a calibration over prompts only, before any response exists), the other
mismatch/* metrics averaged over those steps, response lengths, wall time and rc. The recalibrated runs
also write RUN/kv_calibration.jsonl (trainer.log_calibration: per calibration, per layer, max|q|,
max|k|, max|v| and the scales sent to the engine); the per-layer table gives each layer's largest
amax over the run and amax / 448, the share of e4m3's range a unit scale (the norecal variants) uses:
above 1 it saturates, far below 1 the values sink toward e4m3's subnormals (below 2^-6).

--data DIR: DIR/train.jsonl and DIR/test.jsonl in GSM8K's fields ({"question", "answer": "... #### 72"});
without it the script writes small GSM8K-format files (one-line word problems) into OUT/data. --model
tiny with --config configs/tiny_cpu.yaml runs the config's model built from scratch (CPU tests).

On the GPU host (no hub access), SmolLM2-135M-Instruct arrives as its GGUF split in parts:
    python -m scripts.real_model --gguf part1 part2 part3     # converts once, prints the model dir
    bash scripts/gpu_check.sh kvmismatch --model <that dir>
Time: not yet run on a GPU (each run is a trainer + vLLM start-up plus --steps steps; gpu_check.sh's
part starts no run with less than 120 s left of 570 s, and --variants + --merge finish the rest in another call).

Writes into --out: kv_mismatch.json ({model, config, gpu, date, overrides, variants: a row per variant,
amax: {variant: {layer: {amax, amax_over_448, scales}}}}), kv_mismatch.md (variant x mismatch table and
the per-layer amax table), and per variant <variant>.log, <variant>_metrics.jsonl and (recalibrated
variants) <variant>_kv_calibration.jsonl. Exit 0 when every variant finished, 1 if one did not, 2 on
bad arguments (one line `error: ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path

from scripts.common import (MIN_RUN_S, ROOT, fail, gpu_name, load_rows, model_dir, real_data, run_logged,
                            run_timeout, synthetic_gsm8k)

FP8_MAX = 448.0  # e4m3's largest finite value
KV = ["fp8.kv_cache=true"]
VARIANTS = {  # run order (see above)
    "bf16": ["fp8.kv_cache=false", "fp8.kv_attention=fa3"],  # the attention setting is inert without FP8 KV
    "fp8kv_fa3": [*KV, "fp8.kv_attention=fa3", "fp8.recalibrate=true"],
    "fp8kv_xqa": [*KV, "fp8.kv_attention=xqa", "fp8.recalibrate=true"],
    "fp8kv_triton": [*KV, "fp8.kv_attention=triton", "fp8.recalibrate=true"],
    "fp8kv_fa3_norecal": [*KV, "fp8.kv_attention=fa3", "fp8.recalibrate=false"],
    "fp8kv_triton_norecal": [*KV, "fp8.kv_attention=triton", "fp8.recalibrate=false"],
}
COMMON = ["fp8.train=false", "fp8.rollout=false"]  # BF16 linears on both sides: only attention / KV differ
CPU = ["train.device=cpu", "rollout.engine=hf", "model.gradient_checkpointing=false", "fp8.cache_weights=false"]
KEY = "mismatch/token_mult_prob_error"


def short_run(args, data: Path) -> list[str]:
    """configs/gsm8k.yaml scaled down (see above), on `data`, as overrides for every variant."""
    run = [f"model.name_or_path={args.model}", *real_data(data), "data.prompt_field=question",
           "data.answer_field=answer", "data.answer_regex=#### (.*)", f"rollout.prompts_per_step={args.prompts}",
           f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.max_model_len=0",
           "optim.name=adamw", "train.mini_batch_size=0", "train.compile=none", f"train.steps={args.steps}",
           "train.val_every=0", "train.ckpt_every=0", "train.save_final=false", "train.probe=false",
           "log.tensorboard=false", "log.dump_episodes_every=0"]
    if args.model == "tiny":  # a char tokenizer: no chat template
        run.append("data.template=plain")
    return run + (CPU if args.cpu else [])


def command(variant: str, config: Path, run: list[str], runs: Path, overrides: list[str]) -> list[str]:
    """train_grpo.py's command line for one variant."""
    return [sys.executable, str(ROOT / "train_grpo.py"), "--config", str(config), *run, *COMMON, *VARIANTS[variant],
            f"train.out_dir={runs}", f"train.run_name={variant}", *overrides]


def _stats(xs: list[float]) -> dict | None:
    return {"mean": round(sum(xs) / len(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)} if xs else None


def row(variant: str, metrics: list[dict], wall: float, rc) -> dict:
    """One variant's metrics.jsonl rows -> its result row (statistics over the steps after step 0)."""
    steps = [m for m in metrics if KEY in m]
    later = [m for m in steps if m["step"] > 0]
    keys = sorted({k for m in steps for k in m if k.startswith("mismatch/")})
    return {"variant": variant, "overrides": VARIANTS[variant], "ok": rc == 0 and bool(steps), "rc": rc,
            "wall_s": round(wall, 1), "steps": len(steps),
            "token_mult_prob_error": _stats([m[KEY] for m in later]),
            "per_step": [round(m[KEY], 4) for m in steps],
            "mismatch": {k.split("/", 1)[1]: round(sum(m[k] for m in later if k in m) / len(later), 5)
                         for k in keys} if later else {},
            "response_length_mean": _stats([m["response/length_mean"] for m in steps if "response/length_mean" in m]),
            "scale_mean": {t: [round(m[f"fp8/{t}_scale_mean"], 5) for m in steps if f"fp8/{t}_scale_mean" in m]
                           for t in "qkv" if any(f"fp8/{t}_scale_mean" in m for m in steps)}}


def layer_amax(calibrations: list[dict]) -> dict:
    """kv_calibration.jsonl lines -> {layer: {amax: [q, k, v] largest over the run, amax_over_448,
    scales: the last ones}} (layers in order)."""
    out = {}
    for layer in sorted({int(i) for c in calibrations for i in c["amax"]}):
        mine = [c for c in calibrations if str(layer) in c["amax"]]
        amax = [max(c["amax"][str(layer)][t] for c in mine) for t in range(3)]
        out[layer] = {"amax": amax, "amax_over_448": [round(a / FP8_MAX, 4) for a in amax],
                      "scales": mine[-1]["scales"][str(layer)]}
    return out


def _fmt(s: dict | None, key: str) -> str:
    return "-" if not s else f"{s[key]:.4f}"


def markdown(rows: list[dict], amax: dict) -> str:
    lines = ["| variant | ok | steps | token_mult_prob_error mean | min | max | per step | kl | response length | wall s |",
             "|" + "---|" * 10]
    for r in rows:
        e = r.get("token_mult_prob_error")
        lines.append(f"| {r['variant']} | {r['ok']} | {r.get('steps', 0)} | {_fmt(e, 'mean')} | {_fmt(e, 'min')} | "
                     f"{_fmt(e, 'max')} | {' '.join(f'{x:.4f}' for x in r.get('per_step', []))} | "
                     f"{r.get('mismatch', {}).get('kl', '-')} | {_fmt(r.get('response_length_mean'), 'mean')} | "
                     f"{r.get('wall_s', '-')} |")
    for variant, layers in amax.items():
        lines += ["", f"Per-layer max |q|, |k|, |v| over {variant}'s calibrations, and amax / 448 (the share of "
                  "e4m3's range a unit scale uses; > 1 saturates):", "",
                  "| layer | max abs q | max abs k | max abs v | q / 448 | k / 448 | v / 448 |", "|" + "---|" * 7]
        lines += [f"| {i} | " + " | ".join(f"{a:.3f}" for a in d["amax"]) + " | "
                  + " | ".join(f"{a:.4f}" for a in d["amax_over_448"]) + " |" for i, d in layers.items()]
        top = [max((d["amax_over_448"][t], i) for i, d in layers.items()) for t in range(3)]
        lines.append("\nlargest: " + ", ".join(f"{n} {v:.4f} (layer {i})" for n, (v, i) in zip("qkv", top)))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF model dir, or 'tiny' (the config's model.tiny) (default: scripts/real_model.py's)")
    p.add_argument("--config", default=str(ROOT / "configs" / "gsm8k.yaml"))
    p.add_argument("--data", help="DIR with train.jsonl + test.jsonl in GSM8K's fields (default: synthetic)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--out", default="/tmp/kv_mismatch")
    p.add_argument("--runs", help="run dirs (default OUT/runs)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds for all runs (0 = none): no run starts "
                   f"with less than {MIN_RUN_S} s left")
    p.add_argument("--merge", nargs="+", default=[], metavar="FILE", help="earlier kv_mismatch.json files (same "
                   "settings; each row names its GPU): their variants not run now are kept")
    p.add_argument("--cpu", action="store_true", help="train.device=cpu rollout.engine=hf (its FP8 KV emulation: "
                   "q/k/v in e4m3, P exact, whatever fp8.kv_attention says)")
    p.add_argument("overrides", nargs="*", help="more section.key=value overrides for every variant")
    return p


def check_args(args) -> None:
    """Bad input -> `error: ...`, exit 2, before any run starts."""
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not names or any(v not in VARIANTS for v in names):
        fail(f"--variants {args.variants}: give a comma list of {', '.join(VARIANTS)}")
    args.variants = names
    for name in ("steps", "prompts", "n", "max_new_tokens"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not Path(args.config).is_file():
        fail(f"--config {args.config}: no such file; give a YAML config such as configs/gsm8k.yaml")
    for f in args.merge:
        if not Path(f).is_file():
            fail(f"--merge {f}: no such file (a kv_mismatch.json of an earlier run)")
    args.model = model_dir(args.model)


def main(argv=None) -> int:
    t_start = time.time()  # --time-limit counts from here
    args = build_parser().parse_args(argv)
    check_args(args)
    out = Path(args.out)
    runs = Path(args.runs or out / "runs")
    data = Path(args.data) if args.data else synthetic_gsm8k(out / "data")
    run = short_run(args, data)  # (exits 2 on a --data dir without the files)
    from config import load_config
    from errors import UserError
    try:  # a bad override fails here, once, not in every run
        for v in args.variants:
            load_config(args.config, [*run, *COMMON, *VARIANTS[v], *args.overrides])
    except UserError as e:
        fail(str(e))
    out.mkdir(parents=True, exist_ok=True)
    merged = [json.loads(Path(f).read_text()) for f in args.merge]
    rows = {r["variant"]: r for m in merged for r in m["variants"]}
    amax = {v: {int(i): d for i, d in layers.items()} for m in merged for v, layers in m.get("amax", {}).items()}
    gpu = gpu_name() or "cpu"
    for v in args.variants:
        timeout = run_timeout(v, args.timeout, args.time_limit, t_start)
        if timeout is None:
            rows[v] = {"variant": v, "overrides": VARIANTS[v], "ok": False, "rc": "not started (--time-limit)"}
            continue
        t0 = time.time()
        metrics, rc = run_logged(command(v, Path(args.config), run, runs, args.overrides), runs / v, out / f"{v}.log",
                                 timeout)
        rows[v] = {**row(v, metrics, time.time() - t0, rc), "gpu": gpu}
        print(json.dumps(rows[v]), flush=True)
        for src, dst in ((runs / v / "metrics.jsonl", f"{v}_metrics.jsonl"),
                         (runs / v / "kv_calibration.jsonl", f"{v}_kv_calibration.jsonl")):
            if src.is_file():
                (out / dst).write_bytes(src.read_bytes())
        amax.pop(v, None)
        if (runs / v / "kv_calibration.jsonl").is_file():
            amax[v] = layer_amax(load_rows(runs / v / "kv_calibration.jsonl"))
    ordered = [rows[v] for v in VARIANTS if v in rows]
    (out / "kv_mismatch.json").write_text(json.dumps({
        "model": args.model, "config": args.config, "gpu": gpu,
        "date": datetime.now().isoformat(timespec="seconds"), "overrides": [*COMMON, *args.overrides],
        "settings": {k: getattr(args, k) for k in ("steps", "prompts", "n", "max_new_tokens", "cpu")},
        "variants": ordered, "amax": amax}, indent=1) + "\n")
    md = markdown(ordered, amax)
    (out / "kv_mismatch.md").write_text(md)
    print(md, flush=True)
    return 0 if all(r["ok"] for r in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
