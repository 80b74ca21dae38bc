"""Sampling speed of the HF engine (engines/hf.py) on CPU, on a real model.

    python -m bench.hf_engine                                   # SmolLM2-135M-Instruct, 8 x 96 tokens
    python -m bench.hf_engine --set rollout.hf_cpu_threads=2    # torch's 2 threads on a 2-core host
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m bench.hf_engine   # as an AVX2 host

The model: --model DIR, default the dir scripts/real_model.py prints (converted once). One chat
prompt (a GSM8K problem with configs/gsm8k.yaml's instruction), n samples of at most
--tokens new tokens (EOS stops a sample), temperature 1, seed 0; the engine as the trainer builds
it from configs/gsm8k.yaml (+ --set overrides), after a 2-token warm-up. Prints one JSON line:
seconds, generated tokens, tokens/s, the CPU capability and thread count, and a hash of the
sampled tokens (equal hashes = the same samples).
"""

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF model dir (default: scripts/real_model.py's)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.dtype=bfloat16")
    args = ap.parse_args()
    model_dir = args.model or subprocess.run([sys.executable, "-m", "scripts.real_model"], cwd=ROOT, check=True,
                                             capture_output=True, text=True).stdout.strip()
    import torch

    from config import load_config
    from data import render_prompt
    from engines.hf import HFEngine
    from modeling import load_model_and_tokenizer
    cfg = load_config(ROOT / "configs/gsm8k.yaml", [f"model.name_or_path={model_dir}", "rollout.engine=hf",
                                                    "train.device=cpu", *args.set])
    model, tok = load_model_and_tokenizer(cfg.model, torch.device("cpu"))
    engine = HFEngine(cfg, model, tok, torch.device("cpu"))
    ids = tok(render_prompt(QUESTION, tok, cfg.data), add_special_tokens=False).input_ids
    engine.generate([ids], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    t = time.perf_counter()
    samples = engine.generate([ids], n=args.n, temperature=1.0, top_p=1.0, max_new_tokens=args.tokens, seed=0)
    seconds = time.perf_counter() - t
    tokens = sum(len(s.token_ids) for s in samples)
    print(json.dumps({"model": Path(model_dir).name, "dtype": cfg.model.dtype, "n": args.n,
                      "max_new_tokens": args.tokens,
                      "prompt_tokens": len(ids), "seconds": round(seconds, 2), "tokens": tokens,
                      "tok_s": round(tokens / seconds, 1), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "threads": torch.get_num_threads(), "hf_cpu_threads": cfg.rollout.hf_cpu_threads,
                      "samples_sha": hashlib.sha256(str([s.token_ids for s in samples]).encode()).hexdigest()[:16]}))


if __name__ == "__main__":
    main()
