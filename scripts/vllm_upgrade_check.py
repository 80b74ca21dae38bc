"""Would the recipe start on another vLLM? Checked from that release's source, without importing it.

    python -m scripts.vllm_upgrade_check                          # the installed vLLM
    pip download vllm==0.34.0 --no-deps -d wheels                  # a newer release, any torch
    python -m scripts.vllm_upgrade_check --wheel wheels/vllm-0.34.0-*.whl

1. The engine arguments every shipped config builds (engines.vllm.vllm_engine_kwargs, single GPU and under
   torchrun) against that release's EngineArgs fields, and the SamplingParams keywords of
   engines.vllm.vllm_requests against its SamplingParams.
2. Every internal in engines/vllm_internals.py (INTERNALS) against its source: what is missing, and whether
   the recipe needs it (`engine`, `kv_cache`, `xqa`: the engine refuses to start) or degrades without it
   (`metric`, `bench`, `test`).
Exit 1 when a shipped config would not start. docs/vllm_upgrade.md holds the output for the newest release.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import tempfile
import zipfile
from pathlib import Path

from config import load_config
from engines import vllm_internals as internals
from engines.vllm import vllm_engine_kwargs, vllm_requests

REPO = Path(__file__).resolve().parents[1]
BLOCKING = ("engine", "kv_cache", "xqa")
QUANT = {"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]}
NESTED = {  # engine arguments given as dicts: {key: (file under vllm/, class), or a further level}
    "attention_config": ("config/attention.py", "AttentionConfig"),
    "compilation_config": ("config/compilation.py", "CompilationConfig",
                           {"pass_config": ("config/compilation.py", "PassConfig")}),
}


def class_fields(path: Path, name: str) -> set[str]:
    """The annotated fields of class `name` in one source file (a dataclass's or msgspec Struct's keywords)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    raise SystemExit(f"error: no class {name} in {path}: not a vLLM source tree, or it moved")


def unknown_args(vllm: Path, kw: dict, fields: set[str], nested=NESTED, prefix="") -> list[str]:
    """Keys of kw that are not fields, nested dicts checked against their config classes."""
    out = [prefix + k for k in kw if k not in fields]
    for k, spec in nested.items():
        if isinstance(kw.get(k), dict):
            out += unknown_args(vllm, kw[k], class_fields(vllm / spec[0], spec[1]), spec[2] if len(spec) > 2 else {},
                                f"{prefix}{k}.")
    return sorted(out)


def sampling_keywords() -> set[str]:
    """The keywords engines.vllm.vllm_requests passes to SamplingParams (read from its source)."""
    tree = ast.parse(inspect.getsource(vllm_requests).lstrip())
    return {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "SamplingParams"
            for k in n.keywords}


def shipped_kwargs() -> dict[str, dict]:
    """{config (and launch): the vllm.LLM keywords the recipe builds for it}."""
    out = {}
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        cfg = load_config(str(path), ["rollout.engine=vllm"])
        qc = QUANT if cfg.fp8.rollout else None
        name = str(path.relative_to(REPO / "configs"))
        out[name] = vllm_engine_kwargs(cfg, "/m", 1, qc, "LlamaForCausalLM", moe="moe" in name or "a3b" in name)
        out[name + " (torchrun x2)"] = vllm_engine_kwargs(cfg, "/m", 2 * cfg.rollout.tensor_parallel_size, qc,
                                                          "LlamaForCausalLM")
    return out


def source_version(root: Path) -> str:
    m = re.search(r"""version = (?:__version__ = )?['"]([^'"]+)""", (root / "vllm" / "_version.py").read_text()) \
        if (root / "vllm" / "_version.py").is_file() else None
    return m.group(1) if m else "unknown"


def check(root: Path) -> tuple[str, bool]:
    """(report, every shipped config would start) for the vLLM source tree under root."""
    vllm = root / "vllm"
    engine_fields = class_fields(vllm / "engine" / "arg_utils.py", "EngineArgs")
    sampling_fields = class_fields(vllm / "sampling_params.py", "SamplingParams")
    lines, ok = [f"vLLM {source_version(root)} ({root})", "", "## Engine arguments"], True
    for name, kw in shipped_kwargs().items():
        unknown = unknown_args(vllm, kw, engine_fields)
        ok &= not unknown
        lines.append(f"- {name}: " + (f"NOT ACCEPTED: {', '.join(unknown)}" if unknown else "accepted"))
    unknown = sorted(sampling_keywords() - sampling_fields)
    ok &= not unknown
    lines += ["", "## SamplingParams keywords", "- " + (f"NOT ACCEPTED: {', '.join(unknown)}" if unknown else
                                                       f"accepted ({', '.join(sorted(sampling_keywords()))})")]
    lines += ["", "## Internals (engines/vllm_internals.py)"]
    gone = internals.missing(root)
    for i, why in gone:
        blocking = i.when in BLOCKING
        ok &= not blocking
        lines.append(f"- MISSING [{i.when}{', engine refuses to start' if blocking else ''}] {i.use}: {why}")
    lines.append(f"- {len(internals.INTERNALS) - len(gone)} of {len(internals.INTERNALS)} present")
    lines += ["", "verdict: " + ("every shipped config would start" if ok else "a shipped config would NOT start")]
    return "\n".join(lines), ok


def unpack(wheel: Path, into: Path) -> Path:
    """vllm/**/*.py out of a wheel (the sources are all this check reads)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    return into


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--source", type=Path, help="a directory holding vllm/ (an unpacked wheel or a checkout)")
    g.add_argument("--wheel", type=Path, help="a vllm wheel file (pip download vllm==X --no-deps)")
    a = p.parse_args(argv)
    for flag, path in (("--source", a.source), ("--wheel", a.wheel)):
        if path is not None and not path.exists():
            print(f"error: {flag} {path} does not exist", file=sys.stderr)
            return 2
    if a.source and not (a.source / "vllm").is_dir():
        print(f"error: --source {a.source} holds no vllm/ directory; give the directory above it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = unpack(a.wheel, Path(tmp)) if a.wheel else a.source or internals.installed_source()
        report, ok = check(root)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
