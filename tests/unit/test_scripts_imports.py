"""The scripts and benchmarks import the library by name, and the library imports neither.

scripts/ and bench/ run as modules from the repo root (`python -m scripts.learn_gate`, `python -m
bench.rollout`), so none of them edits sys.path. Run by path instead, a benchmark's own folder would come
first on the path and bench/rollout.py and bench/checkpoint.py would stand in for the library's rollout and
checkpoint modules. What two scripts share lives in scripts/common.py: a script imports no other script.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {p.stem for p in (ROOT / "scripts").glob("*.py")} - {"__init__"}


def sources(*folders: str) -> dict[str, ast.Module]:
    """{path relative to the repo: parsed file} of the .py files under the folders ("" = the whole repo,
    hidden folders such as .venv left out)."""
    files = {p for f in folders for p in (ROOT / f).rglob("*.py")
             if not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(ROOT).parts)}
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in sorted(files)}


def edits_sys_path(tree: ast.Module) -> list[int]:
    """Lines that change sys.path: sys.path.insert/append/extend/..., sys.path = / += / [...] = ..."""
    def is_sys_path(node) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        return isinstance(node, ast.Attribute) and node.attr == "path" and \
            isinstance(node.value, ast.Name) and node.value.id == "sys"

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            lines += [node.lineno for t in targets if is_sys_path(t)]
    return sorted(lines)


def imported(tree: ast.Module) -> list[str]:
    """Every module name an import anywhere in the file names (`from a import b`: a and a.b)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_no_script_or_benchmark_edits_sys_path():
    found = {f: lines for f, tree in sources("scripts", "bench").items() if (lines := edits_sys_path(tree))}
    assert not found, f"sys.path edited (run the file as a module instead): {found}"


def test_the_check_sees_each_way_of_editing_sys_path():
    code = "import sys\nsys.path.insert(0, 'x')\nsys.path.append('x')\nsys.path = []\nsys.path[:0] = ['x']\n" \
           "sys.path += ['x']\nprint(sys.path)\nif x:\n    sys.path.extend(['x'])\n"
    assert edits_sys_path(ast.parse(code)) == [2, 3, 4, 5, 6, 9]


def test_the_library_imports_no_script_or_benchmark():
    library = {f: tree for f, tree in sources("").items() if not f.startswith(("scripts/", "bench/", "tests/"))}
    assert "trainer.py" in library and "fp8/linear.py" in library
    found = {f: names for f, tree in library.items()
             if (names := [n for n in imported(tree) if n.split(".")[0] in ("scripts", "bench")])}
    assert not found, f"the library imports a script or a benchmark: {found}"
    found = {f: names for f, tree in sources("bench").items()
             if (names := [n for n in imported(tree) if n.split(".")[0] == "scripts"])}
    assert not found, f"a benchmark imports a script: {found}"


def test_a_script_imports_no_other_script_but_common():
    assert "common" in SCRIPTS and "learn_gate" in SCRIPTS
    found = {}
    for f, tree in sources("scripts").items():
        names = imported(tree)
        bad = [n for n in names if n.split(".")[0] in SCRIPTS]  # by bare name, as if scripts/ were on the path
        bad += [n for n in names if n.startswith("scripts.") and n.split(".")[1] in SCRIPTS - {"common"}]
        if bad:
            found[f] = bad
    assert not found, f"a script imports another script (move what they share to scripts/common.py): {found}"
