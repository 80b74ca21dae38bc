"""Compare GRPO runs: convergence plots and a summary table from their metrics.jsonl files.

    python -m scripts.plot_runs runs                                  # every run under runs/ -> runs/compare/
    python -m scripts.plot_runs runs/bf16_s0/metrics.jsonl runs/fp8_tis_s0/metrics.jsonl --out /tmp/figs

A directory is searched for *metrics.jsonl files, except under a notebooks/ folder in it (the
notebooks' scratch runs, runs/notebooks/ by default; name that folder, or its files, to include
them). A run's name is <config>_s<seed>, read from the file name (conv_fp8_tis_s1_metrics.jsonl, as
scripts/convergence.sh writes them) or from its run dir (runs/fp8_tis_s1/metrics.jsonl); a name
without _s<seed> is seed 0. Runs of one config are averaged over seeds: a line for the mean, a
band from min to max. Writes, into --out (default: compare/ in the directory holding the runs
given, e.g. runs/compare/ for `runs` or for runs/a/metrics.jsonl and runs/b/metrics.jsonl; the
committed figures are redrawn with --out docs/figures, docs/results.md has each command):

    <prefix>_val_accuracy.png   val/accuracy (greedy, held-out) vs step
    <prefix>_reward.png         reward/mean vs step (trailing mean over --smooth steps)
    <prefix>_mismatch.png       mismatch/token_mult_prob_error vs step (same smoothing; log axis above 10)
    <prefix>_is_truncated.png   is/truncated_frac (share of tokens whose IS weight hit the cap)
    <prefix>_routing_mismatch.png  moe/routing_mismatch, when a run logs it (mixture of experts)
    <prefix>_summary.png        the four panels in one figure
    <prefix>_table.md           the table below (also printed)

Table, per config (mean ± half the min-max range over seeds, from the raw logged values):
  val@0     val/accuracy at step 0 (the SFT model, greedy through the engine)
  final     each run's last logged val/accuracy (the end-of-run validation, or the last one
            before the run was stopped); `steps` gives the range of those steps over seeds
  gain      each run's final minus its own val@0 (runs from different SFT models compare here)
  best      each run's best val/accuracy
  val@S     val/accuracy at S, the last step at which every run in the table (that validated at
            all) logged a validation: the like-for-like comparison when runs were cut at
            different steps
  mismatch  mean over the run's steps of mismatch/token_mult_prob_error, then over seeds
  is_trunc  mean of is/truncated_frac, likewise
  zero_std  reward/zero_std_groups over the run's last 5 steps, then over seeds
  routing   mean of moe/routing_mismatch (a column only when a run logs it)

Then, for each pair of configs with 2+ seeds each, whether they differ beyond seed noise: the difference
of their means over seeds and a two-sided permutation test over the runs (p: the share of relabelings of
the pooled runs whose difference is at least as large; exact up to 20,000 relabelings, else 20,000
seeded random ones), on three measures: the final val/accuracy, the mean val/accuracy over each run's
second half (validations from half its last step on: steadier than one validation) and reward/mean over
the last --tail steps.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import re
from pathlib import Path

from scripts.common import load_rows, tail_mean

PANELS = [  # (metric key, file suffix, y label, smoothed)
    ("val/accuracy", "val_accuracy", "validation accuracy (greedy)", False),
    ("reward/mean", "reward", "reward/mean", True),
    ("mismatch/token_mult_prob_error", "mismatch", "mismatch/token_mult_prob_error", True),
    ("is/truncated_frac", "is_truncated", "is/truncated_frac", True),
]
ROUTING = ("moe/routing_mismatch", "routing_mismatch", "moe/routing_mismatch (own top-k != engine's)", True)
ORDER = ["bf16", "fp8_tis", "fp8_nois", "fp8kv_tis", "fp8rollout_tis"]
_NAME = re.compile(r"^(?:conv_)?(?P<config>.+?)(?:_s(?P<seed>\d+))?(?:_metrics)?$")


SCRATCH = "notebooks"  # the notebooks' scratch runs go under runs/notebooks/ (analysis.scratch_rollout_batch)


def find_files(paths: list[str]) -> list[Path]:
    """The metrics files named, and those under each directory named (none under a notebooks/ folder of it)."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*metrics.jsonl")
                            if f.is_file() and SCRATCH not in f.relative_to(p).parts[:-1])
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"error: {p}: no such file or directory")
    if not files:
        raise SystemExit(f"error: no *metrics.jsonl under {' '.join(paths)}")
    return files


def default_out(paths: list[str]) -> Path:
    """compare/ in the directory that holds the runs given: a directory itself, a run dir's metrics.jsonl its
    run dir's parent, another metrics file its own directory (the deepest one common to them all)."""
    def holder(p: Path) -> Path:
        return p if p.is_dir() else p.parent.parent if p.name == "metrics.jsonl" else p.parent
    return Path(os.path.commonpath([holder(Path(p).absolute()) for p in paths])) / "compare"


def run_key(path: Path) -> tuple[str, int]:
    """(config, seed) of a metrics file: from its name, or its run dir's if it is metrics.jsonl."""
    stem = path.parent.name if path.name == "metrics.jsonl" else path.name.removesuffix(".jsonl")
    m = _NAME.match(stem)
    return m.group("config"), int(m.group("seed") or 0)


def series(rows: list[dict], key: str) -> dict[int, float]:
    """{step: value} of one metric (a later row of the same step wins: the final validation)."""
    return {int(r["step"]): float(r[key]) for r in rows if isinstance(r.get(key), (int, float))}


def smooth(s: dict[int, float], k: int) -> dict[int, float]:
    steps = sorted(s)
    return {st: sum(s[x] for x in steps[max(0, i - k + 1): i + 1]) / len(steps[max(0, i - k + 1): i + 1])
            for i, st in enumerate(steps)}


def load_runs(files: list[Path]) -> dict[str, dict[int, list[dict]]]:
    """{config: {seed: rows}}; a (config, seed) given twice is an error."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for f in files:
        config, seed = run_key(f)
        if seed in runs.setdefault(config, {}):
            raise SystemExit(f"error: two metrics files for {config} seed {seed} (second: {f})")
        runs[config][seed] = load_rows(f)
    return dict(sorted(runs.items(), key=lambda kv: (ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER), kv[0])))


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _agg(xs: list[float]) -> tuple[float, float] | None:
    """(mean, half range) over seeds, or None."""
    return (_mean(xs), (max(xs) - min(xs)) / 2) if xs else None


def summarize(runs: dict[str, dict[int, list[dict]]]) -> tuple[list[dict], int | None]:
    """Per-config table rows and S, the last validation step every run reached."""
    val_steps = [set(series(rows, "val/accuracy")) for seeds in runs.values() for rows in seeds.values()]
    val_steps = [s for s in val_steps if s]  # a run that never validated (died at start) is left out
    common = set.intersection(*val_steps) if val_steps else set()
    S = max(common) if common else None
    table = []
    for config, seeds in runs.items():
        vals = [series(rows, "val/accuracy") for rows in seeds.values()]
        vals = [v for v in vals if v]
        mism = [_mean(list(series(rows, "mismatch/token_mult_prob_error").values())) for rows in seeds.values()]
        trunc = [_mean(list(series(rows, "is/truncated_frac").values())) for rows in seeds.values()]
        last = [max(v) for v in vals]
        zero_std = [tail_mean(rows, "reward/zero_std_groups") for rows in seeds.values()]
        routing = [_mean(list(series(rows, ROUTING[0]).values())) for rows in seeds.values()]
        table.append({
            "config": config, "seeds": sorted(seeds),
            "steps": (min(last), max(last)) if last else None,
            "val0": _agg([v[0] for v in vals if 0 in v]),
            "final": _agg([v[max(v)] for v in vals]),
            "gain": _agg([v[max(v)] - v[0] for v in vals if 0 in v]),
            "best": _agg([max(v.values()) for v in vals]),
            "val_at_S": _agg([v[S] for v in vals if S in v]) if S is not None else None,
            "mismatch": _agg([m for m in mism if m is not None]),
            "is_trunc": _agg([t for t in trunc if t is not None]),
            "zero_std": _agg([z for z in zero_std if z is not None]),
            "routing": _agg([x for x in routing if x is not None]),
        })
    return table, S


def permutation_p(a: list[float], b: list[float], shuffles: int = 20000) -> float:
    """Two-sided permutation test of mean(a) - mean(b): the share of the splits of a + b into groups of len(a)
    and len(b) whose difference of means is at least the observed one in size; every split when there are at
    most `shuffles`, else `shuffles` random ones (seeded: the same p on every call)."""
    pool, n = a + b, len(a)
    total, observed = sum(pool), abs(sum(a) / n - sum(b) / len(b)) - 1e-12

    def beyond(group_sum: float) -> bool:
        return abs(group_sum / n - (total - group_sum) / (len(pool) - n)) >= observed
    if math.comb(len(pool), n) <= shuffles:
        splits = [beyond(sum(c)) for c in itertools.combinations(pool, n)]
    else:
        rng = random.Random(0)
        splits = [beyond(sum(rng.sample(pool, n))) for _ in range(shuffles)]
    return sum(splits) / len(splits)


MEASURES = [("final", "final val"), ("late", "val, second half"), ("reward", "reward/mean, last {tail}")]


def per_run_measures(rows: list[dict], tail: int) -> dict[str, float]:
    """One run's final val/accuracy, its mean val/accuracy over the validations from half its last step on,
    and its reward/mean over the last `tail` steps (a measure it cannot give is left out)."""
    val, out = series(rows, "val/accuracy"), {}
    if val:
        out["final"] = val[max(val)]
        out["late"] = _mean([v for step, v in val.items() if step >= max(val) / 2])
    reward = tail_mean(rows, "reward/mean", tail)
    if reward is not None:
        out["reward"] = reward
    return out


def compare(runs: dict[str, dict[int, list[dict]]], tail: int) -> list[dict]:
    """Every pair of configs with 2+ seeds: {"pair": (a, b), measure: (mean a - mean b, permutation p)}."""
    per = {c: [per_run_measures(rows, tail) for rows in seeds.values()] for c, seeds in runs.items() if len(seeds) > 1}
    pairs = []
    for a, b in itertools.combinations(per, 2):
        row = {"pair": (a, b)}
        for key, _ in MEASURES:
            xa, xb = [m[key] for m in per[a] if key in m], [m[key] for m in per[b] if key in m]
            if len(xa) > 1 and len(xb) > 1:
                row[key] = (_mean(xa) - _mean(xb), permutation_p(xa, xb))
        pairs.append(row)
    return pairs


def compare_markdown(pairs: list[dict], tail: int) -> str:
    if not pairs:
        return ""
    lines = ["Differences between configs (mean over seeds of a minus b; p: two-sided permutation test over "
             "the runs):", "", "| a - b | " + " | ".join(label.format(tail=tail) for _, label in MEASURES) + " |",
             "|---|" + "---|" * len(MEASURES)]
    for r in pairs:
        cells = [f"{r[k][0]:+.3f} (p {'< 0.001' if r[k][1] < 0.001 else f'= {r[k][1]:.3f}'})" if k in r else "-"
                 for k, _ in MEASURES]
        lines.append(f"| {r['pair'][0]} - {r['pair'][1]} | " + " | ".join(cells) + " |")
    return "\n" + "\n".join(lines) + "\n"


def markdown(table: list[dict], S: int | None) -> str:
    def f(a, digits=3):
        return "-" if a is None else f"{a[0]:.{digits}f} ± {a[1]:.{digits}f}"

    moe = any(r["routing"] for r in table)
    lines = [f"| config | seeds | steps | val@0 | final val | gain | best val | val@{S if S is not None else 'S'} | "
             "token_mult_prob_error | is/truncated_frac | zero-std groups (last 5) |" + (" moe/routing_mismatch |" * moe),
             "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * moe]
    for r in table:
        steps = "-" if r["steps"] is None else (str(r["steps"][0]) if r["steps"][0] == r["steps"][1]
                                                else f"{r['steps'][0]}-{r['steps'][1]}")
        lines.append(f"| {r['config']} | {','.join(map(str, r['seeds']))} | {steps} | {f(r['val0'])} | "
                     f"{f(r['final'])} | {f(r['gain'])} | {f(r['best'])} | {f(r['val_at_S'])} | "
                     f"{f(r['mismatch'], 4)} | {f(r['is_trunc'], 4)} | {f(r['zero_std'], 2)} |"
                     + f" {f(r['routing'], 4)} |" * moe)
    return "\n".join(lines) + "\n"


def band(seeds: dict[int, list[dict]], key: str, k: int):
    """steps, mean, min, max over the seeds that logged each step."""
    per_seed = [series(rows, key) for rows in seeds.values()]
    per_seed = [smooth(s, k) if k > 1 else s for s in per_seed if s]
    steps = sorted(set().union(*per_seed)) if per_seed else []
    vals = [[s[st] for s in per_seed if st in s] for st in steps]
    return steps, [_mean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def plot(runs, out: Path, prefix: str, k: int) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {c: colors[i % len(colors)] for i, c in enumerate(runs)}
    written = []

    def draw(ax, key, label, smoothed):
        any_data, top = False, 0.0
        for config, seeds in runs.items():
            steps, mean, lo, hi = band(seeds, key, k if smoothed else 1)
            if not steps:
                continue
            any_data, top = True, max(top, *hi)
            ax.plot(steps, mean, color=color[config], marker="o" if key == "val/accuracy" else None, ms=3,
                    label=f"{config} (n={len(seeds)})")
            if len(seeds) > 1:
                ax.fill_between(steps, lo, hi, color=color[config], alpha=0.2, lw=0)
        if key == PANELS[2][0] and top > 10:  # token_mult_prob_error >= 1: a log axis once it spans a decade
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label + (f" (mean of {k} steps)" if smoothed and k > 1 else ""))
        ax.grid(alpha=0.3)
        if any_data:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes)

    panels = PANELS + [ROUTING] * any(series(rows, ROUTING[0]) for seeds in runs.values() for rows in seeds.values())
    for key, suffix, label, smoothed in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, key, label, smoothed)
        fig.tight_layout()
        path = out / f"{prefix}_{suffix}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    cols = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 8))
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (key, _, label, smoothed) in zip(axes.flat, panels):
        draw(ax, key, label, smoothed)
    fig.suptitle("GRPO convergence: line = mean over seeds, band = min..max")
    fig.tight_layout()
    path = out / f"{prefix}_summary.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return written + [path]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", nargs="+", help="metrics.jsonl files or directories to search (not their notebooks/)")
    p.add_argument("--out", help="directory for the PNGs and the table (default: compare/ in the directory\n"
                                 "holding the runs given, e.g. runs/compare/ for `runs`)")
    p.add_argument("--prefix", default="convergence")
    p.add_argument("--table", help="markdown table path (default <out>/<prefix>_table.md)")
    p.add_argument("--smooth", type=int, default=5, help="trailing mean over this many steps for per-step metrics")
    p.add_argument("--tail", type=int, default=40,
                   help="the pairwise table's reward/mean: over each run's last N steps")
    args = p.parse_args(argv)
    runs = load_runs(find_files(args.paths))
    out = Path(args.out) if args.out else default_out(args.paths)
    out.mkdir(parents=True, exist_ok=True)
    table, S = summarize(runs)
    md = markdown(table, S) + compare_markdown(compare(runs, args.tail), args.tail)
    table_path = Path(args.table) if args.table else out / f"{args.prefix}_table.md"
    table_path.write_text(md)
    print(md, end="")
    for path in plot(runs, out, args.prefix, args.smooth):
        print(f"wrote {path}")
    print(f"wrote {table_path}")
    return table, S


if __name__ == "__main__":
    main()
