"""No import cycle among the repo's own modules.

The graph: one node per tracked .py file outside tests/ (train_grpo, trainer, fp8.linear, engines.hf,
bench.train, ...), an edge for each import of another of them (`if TYPE_CHECKING:` blocks not: they never
run). Importing a.b.c also imports its packages a and a.b, so the edge goes to those too, except from a
module of that package (fp8.fast.cache importing fp8.fast.fused runs inside fp8/fast/__init__'s own
import: a package always comes before its modules).

Three tests. Module-level imports (class bodies included), over every module: they run when the module is
imported, so a cycle among them makes the import order matter and leaves one side partly initialised.
Imports inside functions too, over the library (not bench/ or scripts/, which sit on top of it): the
repo defers heavy or optional dependencies (vLLM, torchao, Triton, fp8/fast) into functions, and a
deferred import that points back is still a cycle of the design, only a hidden one. And the imports of
type hints (`if TYPE_CHECKING:`) on top of those: a module that names another's type depends on it as
much. So the layers go one way: rollout.py (RolloutConfig, Sample, Engine) <- config.py, engines/
(engines.make_engine builds them) <- trainer.py, train_grpo.py; fp8/linear.py <- fp8/torchao.py,
fp8/moe.py <- fp8/convert.py.
"""

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(tree: ast.Module, in_functions: bool = False, type_checking: bool = False) -> list[str]:
    """Dotted names imported outside functions (in_functions: anywhere) and TYPE_CHECKING blocks
    (type_checking: in those too): `import a.b` -> a.b, `from a.b import c` -> a.b and a.b.c (c may be a
    submodule)."""
    names, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not in_functions:
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_checking:
            todo += node.orelse
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        todo += ast.iter_child_nodes(node)
    return names


def import_graph(in_functions: bool = False, library: bool = False, type_checking: bool = False) -> dict[str, set[str]]:
    """{module: the modules it imports} (module_name's dotted names); library: without bench/ and scripts/;
    in_functions, type_checking: as imports_in's."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    skip = ("tests/", "bench/", "scripts/") if library else ("tests/",)
    files = [f for f in files if not f.startswith(skip) and (ROOT / f).is_file()]
    modules = {module_name(f): f for f in files}
    graph = {}
    for name, f in modules.items():
        deps = set()
        for imported in imports_in(ast.parse((ROOT / f).read_text(), f), in_functions, type_checking):
            parts = imported.split(".")
            deps |= {m for i in range(1, len(parts) + 1) if (m := ".".join(parts[:i])) in modules}
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = deps - {name} - own_packages
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the directed graph, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (cycle := visit(w)):
                return cycle
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (cycle := visit(v)):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert {"batch", "fp8.linear"} <= graph["trainer"] and "fp8.quant" in graph["fp8.fast.kernels"]  # it sees edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_counting_imports_in_functions():
    graph = import_graph(in_functions=True, library=True)
    assert "engines.hf" in graph["engines"] and "fp8.fast" in graph["trainer"]  # it sees deferred imports
    assert not any(m.startswith(("bench", "scripts")) for m in graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (function-level imports included): " + " -> ".join(cycle)


def test_no_import_cycle_counting_type_hints():
    """config.py assembles the components' settings (rollout.RolloutConfig, fp8.config.FP8Config, ...), so
    none of them may name config's types, not even for a hint: they take their own settings."""
    graph = import_graph(in_functions=True, library=True, type_checking=True)
    assert "config" in graph["fp8.calibrate"] and "rollout" in graph["config"]  # it sees type-only imports
    assert "config" not in graph["rollout"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (type-hint imports included): " + " -> ".join(cycle)


def test_only_the_trainer_setup_imports_fp8_fast():
    """fp8/fast/ is speed only: of the library (not bench/, scripts/), only the trainer imports it, at
    any level: its setup (run_setup.fp8_model behind fp8.uses_fast, which analysis.convert_fp8 and the
    benchmarks call too, and the weight-cache hooks) and its phases (the caches' release around the
    rollout, the fused gradient buffers)."""
    graph = import_graph(in_functions=True)
    users = {m for m, deps in graph.items() if any(d.startswith("fp8.fast") for d in deps)}
    assert {m for m in users if not m.startswith(("fp8.fast", "bench.", "scripts."))} == {"run_setup", "trainer"}


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    tree = ast.parse("import x.y\nfrom p import q\nif TYPE_CHECKING:\n    import t\ndef f():\n    import u\n"
                     "class C:\n    import v\n")
    assert sorted(imports_in(tree)) == ["p", "p.q", "v", "x.y"]
    assert sorted(imports_in(tree, in_functions=True)) == ["p", "p.q", "u", "v", "x.y"]
    assert sorted(imports_in(tree, type_checking=True)) == ["p", "p.q", "t", "v", "x.y"]
