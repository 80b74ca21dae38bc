"""Where the step goes, FP8 config vs BF16 twin: the last pair of each config per results file of
scripts/flagship_check.py --shipped (bench/results/shipped_<gpu>.json).

    python -m scripts.plot_shipped                  # the committed H200 and H100 files -> runs/figures/
    python -m scripts.plot_shipped --out docs/figures   # redraw the committed figure
    python -m scripts.plot_shipped --results OUT/shipped_h100.json --out figs

One pair of bars per (config, GPU kind, GPU count): rollout, logprobs, train and the rest of the step
(assembly, refit, recalibration, ...), in seconds, the ratio (BF16 step / FP8 step) beside each pair, and
under each bar's name the overrides its run took. Writes
OUT/shipped_pairs.png and prints a markdown table of the same numbers.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = [ROOT / "bench" / "results" / f"shipped_{gpu}.json" for gpu in ("h200", "h100")]
PHASES = ("rollout_s", "logprobs_s", "train_s")


def last_pairs(paths: list[Path]) -> list[dict]:
    """The last row of each (config, gpu, gpus) over the files, in the files' order."""
    rows = {}
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"error: --results {path}: {e}; give a shipped_<gpu>.json of scripts/flagship_check.py",
                  file=sys.stderr)
            sys.exit(2)
        for row in doc:
            rows[(row["config"], row["gpu"], row.get("gpus", 1))] = row
    return list(rows.values())


def bars(row: dict, name: str) -> list[float]:
    """rollout, logprobs, train, rest (s) of one config of a pair row."""
    p = row["phases"][name]
    parts = [p.get(k, 0.0) for k in PHASES]
    return [*parts, max(0.0, p["step_s"] - sum(parts))]


def overrides(row: dict, name: str) -> str:
    """The key=value overrides (last key part only) of `name`'s run in the row's command: a pair merged from
    two runs joins their commands with " ; ", each naming its config after --configs."""
    parts = row.get("command", "").split(" ; ")
    words = next((c.split() for c in parts if name in c.split()), parts[0].split())
    return " ".join(w.split("=")[0].split(".")[-1] + "=" + w.split("=", 1)[1] for w in words if "=" in w)


def table(pairs: list[dict]) -> str:
    lines = ["| config vs twin | GPUs | date | overrides | step s | rollout | logprobs | train | rest | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in pairs:
        for name in (r["config"], r["baseline"]):
            lines.append(f"| {name} | {r.get('gpus', 1)} x {r['gpu']} | {r['date']} | {overrides(r, name)} | "
                         f"{r['phases'][name]['step_s']} | " + " | ".join(f"{x:.2f}" for x in bars(r, name))
                         + f" | {r['ratio'] if name == r['config'] else 1.0} |")
    return "\n".join(lines)


def plot(pairs: list[dict], out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ("rollout", "logprobs", "train", "rest")
    colors = ("#4c72b0", "#dd8452", "#55a868", "#8c8c8c")
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.8 * len(pairs)))
    y, ticks = 0.0, []
    for r in reversed(pairs):
        for name in (r["baseline"], r["config"]):
            left = 0.0
            for value, label, color in zip(bars(r, name), labels, colors):
                ax.barh(y, value, left=left, color=color, label=label if y == 0 else None)
                left += value
            label, extra = f"{name} ({r.get('gpus', 1)} x {r['gpu']}, {r['workload'].split(' x ')[0]})", overrides(r, name)
            ticks.append((y, label + (f"\n{extra}" if extra else "")))
            y += 1
        longest = max(r["phases"][n]["step_s"] for n in (r["config"], r["baseline"]))
        ax.text(longest * 1.01, y - 1.5, f"{r['ratio']:.3f}x", va="center")
        y += 0.6
    ax.set_xlim(0, 1.1 * max(r["phases"][r["baseline"]]["step_s"] for r in pairs))
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=7)
    ax.set_xlabel("seconds per step (step 1)")
    ax.set_title("shipped 8B configs vs their BF16 twins, at their own workload")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "shipped_pairs.png", dpi=120)
    return out / "shipped_pairs.png"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, action="append", help="a shipped_<gpu>.json (repeat; default: the committed ones)")
    p.add_argument("--out", type=Path, default=Path("runs/figures"),
                   help="directory for the PNG (default runs/figures/; the committed figure: docs/figures)")
    args = p.parse_args()
    pairs = last_pairs(args.results or DEFAULT)
    if not pairs:
        print("error: --results: no pair rows in the given files", file=sys.stderr)
        sys.exit(2)
    print(table(pairs))
    print(f"wrote {plot(pairs, args.out)}")


if __name__ == "__main__":
    main()
