"""Step-time breakdown of the 8B-shape GRPO step on 1 GPU vs 2 GPUs (data parallel, and one TP=2 engine).

    python -m scripts.plot_scaling                                   # the committed H200 figures -> runs/figures/
    python -m scripts.plot_scaling --one bench/results/step.json --match "micro-batch 16" \
        --two "2 GPUs, DP=docs/results_data/multi_gpu/mg_step8b_2rank_tp1_metrics.jsonl" --out docs/figures

1 GPU: the bf16 row of a bench/step.py results file whose workload contains --match. 2 GPUs: a
trainer metrics.jsonl per bar ("label=path"), medians over steps >= 1 (step 0 warms up). Every bar
is the same global batch, so the step-time ratio is the throughput ratio. Writes
OUT/scaling_step8b.png and prints a markdown table.
"""

import argparse
import json
import sys
from pathlib import Path

from bench.runner import read_results
from bench.step import PARTS, summarize
from scripts.common import ROOT

DATA = ROOT / "docs" / "results_data" / "multi_gpu"
DEFAULT_TWO = [f"2 GPUs, data parallel={DATA / 'mg_step8b_2rank_tp1_metrics.jsonl'}",
               f"2 GPUs, one TP=2 engine={DATA / 'mg_step8b_2rank_tp2_metrics.jsonl'}"]


def from_step_json(path: Path, match: str, mode: str = "bf16") -> dict:
    doc = read_results(path)
    runs = [r for r in (doc or {}).get("runs", []) if r.get("mode") == mode and match in r.get("workload", "")]
    if not runs:
        sys.exit(f"{path}: no {mode} run whose workload contains {match!r}")
    return runs[-1]


def from_metrics(path: Path) -> dict:
    """The bench/step.py summary (medians over steps >= 1) of one trainer run's metrics.jsonl."""
    try:
        return summarize([json.loads(line) for line in path.read_text().splitlines()], path.stem, str(path))
    except ValueError as e:
        sys.exit(f"{path}: {e}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--one", type=Path, default=ROOT / "bench" / "results" / "step.json")
    p.add_argument("--match", default="16 layers, micro-batch 16")
    p.add_argument("--two", nargs="+", default=DEFAULT_TWO, help="label=metrics.jsonl, one per bar")
    p.add_argument("--out", type=Path, default=Path("runs/figures"),
                   help="directory for the PNG (default runs/figures/; the committed figure: docs/figures)")
    args = p.parse_args()
    bars = {"1 GPU": from_step_json(args.one, args.match)}
    for spec in args.two:
        label, _, path = spec.rpartition("=")
        bars[label or Path(path).stem] = from_metrics(Path(path))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = bars["1 GPU"]["step_s"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (label, b) in enumerate(bars.items()):
        left = 0.0
        for j, part in enumerate(PARTS):
            ax.barh(i, b.get(f"{part}_s", 0.0), left=left, color=f"C{j}", label=part if i == 0 else None)
            left += b.get(f"{part}_s", 0.0)
        ax.text(b["step_s"] + 0.05, i, f"{b['step_s']:.2f} s  (x{base / b['step_s']:.2f})", va="center", fontsize=9)
    ax.set_yticks(range(len(bars)), list(bars))
    ax.invert_yaxis()
    ax.set_xlim(0, base * 1.35)
    ax.set_xlabel("seconds per GRPO step (bars: the timed parts; text: the whole step)")
    ax.set_title("8B-width Llama, 16 layers, bf16: 128 samples x 512 tokens per step (H200)", fontsize=9)
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "scaling_step8b.png", dpi=120)
    print("| setup | step s | rollout s | logprobs s | train s | refit s | speed-up |\n|---|---|---|---|---|---|---|")
    for label, b in bars.items():
        print(f"| {label} | {b['step_s']:.2f} | {b.get('rollout_s', 0):.2f} | {b.get('logprobs_s', 0):.2f} | "
              f"{b.get('train_s', 0):.2f} | {b.get('refit_s', 0):.3f} | {base / b['step_s']:.2f}x |")
    print(f"wrote {args.out / 'scaling_step8b.png'}")


if __name__ == "__main__":
    main()
