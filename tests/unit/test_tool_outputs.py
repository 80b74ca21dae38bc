"""The benchmarks and scripts write where git does not look unless told otherwise: a run with their default
--out never rewrites a committed figure or results file (bench/results, docs/figures are refreshed with an
explicit --out)."""

import ast
import subprocess
from pathlib import Path

import pytest

from bench.runner import REPO, RESULTS

FILES = sorted([*(REPO / "bench").glob("*.py"), *(REPO / "scripts").glob("*.py")])


def out_default(node: ast.Call):
    """The --out argument's default as a path string: a literal, Path("..."), str(RESULTS) / RESULTS, or
    None (the tool then writes to RESULTS or beside its input)."""
    kw = {k.arg: k.value for k in node.keywords}.get("default")
    if kw is None or (isinstance(kw, ast.Constant) and kw.value is None):
        return None
    if isinstance(kw, ast.Constant):
        return kw.value
    if isinstance(kw, ast.Call) and getattr(kw.func, "id", None) in ("Path", "str") and kw.args:
        kw = kw.args[0]
        if isinstance(kw, ast.Constant):
            return kw.value
    if isinstance(kw, ast.Name) and kw.id == "RESULTS":
        return str(RESULTS)
    if isinstance(kw, ast.Call) and getattr(kw.func, "attr", None) == "get":  # os.environ.get("OUT", default)
        return kw.args[1].value
    raise AssertionError(f"unread --out default: {ast.unparse(kw)}")


def out_defaults() -> dict[str, str]:
    found = {}
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and \
                    node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--out":
                found[str(path.relative_to(REPO))] = out_default(node)
    return found


def test_the_tools_have_out_defaults():
    found = out_defaults()
    assert {"bench/rollout.py", "bench/peer.py", "scripts/plot_shipped.py", "scripts/plot_runs.py"} <= set(found)


def in_repo(default: str) -> Path | None:
    """The default as a path inside the repo, or None (an absolute path elsewhere: /tmp/...)."""
    path = (Path(default) if Path(default).is_absolute() else REPO / default).resolve()
    return path if path.is_relative_to(REPO) else None


@pytest.mark.parametrize("tool, default", sorted((k, v) for k, v in out_defaults().items() if v and in_repo(v)))
def test_default_out_is_outside_the_tracked_tree(tool, default):
    rel = in_repo(default).relative_to(REPO) / "result.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=REPO).returncode == 0
    assert ignored, f"{tool}: --out defaults to {default}, which git tracks; default to runs/..."
