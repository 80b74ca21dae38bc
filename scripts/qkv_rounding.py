"""Which of q, k, v rounded to e4m3 costs what mismatch: teacher-forced on a real model, no engine.

    python -m scripts.qkv_rounding --out /tmp/qkv                          # SmolLM2 (scripts/real_model.py), CPU
    python -m scripts.qkv_rounding --model DIR --data DIR --prompts 8 --max-new-tokens 256

The model samples --samples completions of <= --max-new-tokens tokens for each of --prompts GSM8K-format
prompts (chat template + configs/gsm8k.yaml's instruction; --data DIR/train.jsonl, or the synthetic rows
of scripts/common.py). Then each sequence is scored again with attention inputs rounded to e4m3 by
the hook the HF engine's FP8 KV emulation uses (fp8/calibrate.py): q only, k only, v only, k and v (the
FP8 KV cache alone), q, k and v (FP8 attention without P), each with the per-layer scales a calibration
over these sequences gives (fp8/calibrate.py's percentile and margin) and with unit scales. Static
per-tensor K/V scales make a cache write the same rounding as in a full forward, so this is what an
engine with exact attention math would log. Per case: losses/mismatch.py's metrics (token_mult_prob_error,
kl, ...) over the completion tokens against the unrounded model. Writes OUT/qkv_rounding.json and
OUT/qkv_rounding.md. Bad input: `error: ...`, exit 2.

--per-layer adds where the cost sits: q, k and v rounded (calibrated scales) in one layer at a time, then
in every layer but the k costliest of those (k = 1, 2, 4, 8, ...). The second is what vLLM's
`kv_cache_dtype_skip_layers` (fp8.kv_skip_layers) does: the skipped layers keep a BF16 cache and BF16
attention, the rest FP8.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from scripts.common import ROOT, fail, model_dir, synthetic_gsm8k

CASES = ["q", "k", "v", "kv", "qkv"]


def rounding(which: str, scales: tuple[float, float, float]):
    """The hook's (q, k, v) transform: the tensors named in `which` fake-quantized to e4m3 as vLLM does."""
    from fp8.quant import fake_quant_per_tensor

    def t(q, k, v):
        return tuple(fake_quant_per_tensor(x, s, name == "q") if name in which else x
                     for name, x, s in zip("qkv", (q, k, v), scales))
    return t


def per_layer(layers: list[int], scales: dict, score) -> dict:
    """q, k, v rounded in one layer at a time; then in all but the k layers costliest alone (k = 1, 2, 4, ...).
    score(transform): the mismatch metrics with transform(layer) as each layer's q/k/v transform."""
    def rounded_in(chosen: set) -> dict:
        return score(lambda i: rounding("qkv", scales[i]) if i in chosen else None)
    single = []
    for i in layers:
        single.append({"layer": i, **rounded_in({i})})
        print(json.dumps(single[-1]), flush=True)
    costliest = [r["layer"] for r in sorted(single, key=lambda r: -r["token_mult_prob_error"])]
    skip, k = [], 1
    while k < len(layers):
        skip.append({"bf16_layers": sorted(costliest[:k]), **rounded_in(set(layers) - set(costliest[:k]))})
        print(json.dumps(skip[-1]), flush=True)
        k *= 2
    return {"single": single, "skip": skip}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF model dir (default: scripts/real_model.py's)")
    p.add_argument("--data", help="DIR with train.jsonl in GSM8K's fields (default: synthetic)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=2, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/qkv_rounding")
    p.add_argument("--per-layer", action="store_true", help="also the cost per layer, and with the costliest layers left BF16")
    args = p.parse_args(argv)
    for name in ("prompts", "samples", "max_new_tokens"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    args.model = model_dir(args.model)
    if args.model == "tiny":
        fail("--model tiny: give a HF model dir with a chat template (default: scripts/real_model.py's)")
    if args.data and not (Path(args.data) / "train.jsonl").is_file():
        fail(f"--data {args.data}: no train.jsonl there (GSM8K's rows as JSON lines); pass a directory holding it")
    out = Path(args.out)
    data = Path(args.data) if args.data else synthetic_gsm8k(out / "data")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batch import token_logprobs
    from config import load_config
    from fp8.calibrate import QKVCalibrator, install
    from losses.mismatch import mismatch_metrics
    torch.manual_seed(args.seed)
    f8 = load_config(ROOT / "configs" / "gsm8k.yaml")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()][: args.prompts]
    seqs = []  # (token ids [T], prompt length)
    with torch.no_grad():
        for r in rows:
            text = tok.apply_chat_template([{"role": "user", "content": f"{r['question']} {f8.data.instruction}"}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids.to(args.device)
            gen = model.generate(ids, do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                                 num_return_sequences=args.samples, pad_token_id=tok.pad_token_id)
            seqs += [(g, ids.shape[1]) for g in gen]
    calib = QKVCalibrator(model, f8.fp8.calib_percentile, f8.fp8.calib_margin)
    with torch.no_grad(), calib.capture():
        for s, _ in seqs:
            model(s[None])
    scales, mods = calib.scales(), install(model)

    def logps() -> tuple[torch.Tensor, torch.Tensor]:
        """Completion-token logprobs [N, T] (padded) and their mask."""
        lps, masks = [], []
        with torch.no_grad():
            for s, n in seqs:
                lp = token_logprobs(model, s[None], torch.ones_like(s[None]), 1.0)[0, 1:]
                mask = (s[1:] != tok.pad_token_id).float()
                mask[: n - 1] = 0  # prompt tokens
                lps.append(lp.cpu())
                masks.append(mask.cpu())
        width = max(len(x) for x in lps)
        pad = [torch.nn.functional.pad(x, (0, width - len(x))) for x in lps]
        return torch.stack(pad), torch.stack([torch.nn.functional.pad(m, (0, width - len(m))) for m in masks])

    ref, mask = logps()

    def score(transform) -> dict:
        """Mismatch metrics against the unrounded model with transform(layer) as each layer's q/k/v transform."""
        for i, m in mods.items():
            m._fp8_qkv.transform = transform(i)
        return {k: round(float(v), 5) for k, v in mismatch_metrics(ref, logps()[0], mask).items()}
    results = []
    for which in CASES:
        for kind in ("calibrated", "unit"):
            results.append({"rounded": which, "scales": kind, **score(
                lambda i: rounding(which, scales[i] if kind == "calibrated" else (1.0, 1.0, 1.0)))})  # noqa: B023
            print(json.dumps(results[-1]), flush=True)
    layers = per_layer(list(mods), scales, score) if args.per_layer else None
    for m in mods.values():
        m._fp8_qkv.transform = None
    out.mkdir(parents=True, exist_ok=True)
    (out / "qkv_rounding.json").write_text(json.dumps({
        "model": args.model, "device": args.device, "tokens": int(mask.sum()), "sequences": len(seqs),
        "settings": {k: getattr(args, k) for k in ("prompts", "samples", "max_new_tokens", "seed")},
        "scales": {i: list(s) for i, s in scales.items()}, "cases": results, "per_layer": layers}, indent=1) + "\n")
    md = ["| rounded to e4m3 | scales | token_mult_prob_error | kl | mean abs diff | max abs diff |", "|---|---|---|---|---|---|"]
    md += [f"| {r['rounded']} | {r['scales']} | {r['token_mult_prob_error']:.4f} | {r['kl']:.5f} | "
           f"{r['mean_abs_diff']:.4f} | {r['max_abs_diff']:.3f} |" for r in results]
    md.append(f"\n{int(mask.sum())} completion tokens of {len(seqs)} sequences; against the same model unrounded.")
    if layers:
        md += ["", "| q, k, v rounded in | token_mult_prob_error | kl |", "|---|---|---|"]
        md += [f"| layer {r['layer']} only | {r['token_mult_prob_error']:.4f} | {r['kl']:.5f} |" for r in layers["single"]]
        md += [f"| all but layers {r['bf16_layers']} | {r['token_mult_prob_error']:.4f} | {r['kl']:.5f} |"
               for r in layers["skip"]]
    (out / "qkv_rounding.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
