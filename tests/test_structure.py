"""Layering: the methods never import the engine (the engine builds the methods), and every
data source module registers its dataset behind the one registry."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fedrepro"


def test_methods_import_without_loading_the_engine():
    code = "import sys, fedrepro.methods; print(sorted(m for m in sys.modules if m.startswith('fedrepro.engine')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert "fedrepro.engine.engine" not in out, out


def test_no_method_module_names_the_engine_module():
    offenders = []
    for py in (SRC / "methods").glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("engine.engine"):
                offenders.append(py.name)
    assert not offenders, offenders


def test_each_domain_source_registers_from_its_own_module():
    from fedrepro.data.datasets import DATASETS
    import fedrepro.data.domains as dom

    for name in ("mnistm", "syn", "digit5", "pacs", "domainnet", "mitbih"):
        assert name in DATASETS.names()
        assert (SRC / "data" / "domains" / f"{name}.py").exists()
    assert dom.DOMAINNET_PINS is dom.domainnet.DOMAINNET_PINS


def _module_imports() -> dict[str, set[str]]:
    """fedrepro module -> the fedrepro modules its import statements name at module level
    (inside `if TYPE_CHECKING:` and try blocks too; not the deferred imports inside functions)."""
    modules = {}
    for py in SRC.rglob("*.py"):
        parts = list(py.relative_to(SRC.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = py
    graph: dict[str, set[str]] = {}
    for name, py in modules.items():
        package = name if py.name == "__init__.py" else name.rpartition(".")[0]
        statements, todo = [], list(ast.parse(py.read_text()).body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                statements.append(node)
            elif isinstance(node, (ast.If, ast.Try)):
                todo += node.body + node.orelse + getattr(node, "finalbody", [])
                todo += [s for h in getattr(node, "handlers", []) for s in h.body]
        deps = set()
        for node in statements:
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import sub` names the submodule, `from mod import x` the module
                deps |= {f"{target}.{alias.name}"} if f"{target}.{alias.name}" in modules else {target} & modules.keys()
        graph[name] = deps - {name}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (a path back to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n, [n]))), None)


def test_no_import_circles_in_src():
    """No module of src/ imports, through any chain, a module that imports it back (registries are
    kept apart from their entries: fedrepro.data.dataset_registry, fedrepro.models.base)."""
    graph = _module_imports()
    assert {"fedrepro.engine.engine", "fedrepro.engine.vectorized", "fedrepro.data.datasets"} <= graph.keys()
    assert "fedrepro.engine.vectorized" in graph["fedrepro.engine.training"]  # the walk sees relative imports
    assert _circle(graph) is None, " -> ".join(_circle(graph))


def test_the_circle_finder_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None
