"""Layering: the methods never import the engine (the engine builds the methods), every data
source module registers its dataset behind the one registry, no module imports one that imports
it back (at any depth: imports inside functions count), and no module touches another module's
private names."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "fedrepro"


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


def _src_modules() -> dict[str, Path]:
    """fedrepro module name -> its file."""
    modules = {}
    for py in SRC.rglob("*.py"):
        parts = list(py.relative_to(SRC.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = py
    return modules


def _import_targets(node: ast.ImportFrom, package: str) -> str:
    """The absolute module name `node` imports from (`package`: the importing module's package)."""
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    return ".".join(base + ([node.module] if node.module else []))


def _module_imports() -> dict[str, set[str]]:
    """fedrepro module -> the fedrepro modules its import statements name, anywhere in the file:
    at module level, under `if TYPE_CHECKING:`, in try blocks and inside functions (a deferred
    import is still a dependency: a circle through one is a circle)."""
    modules = _src_modules()
    graph: dict[str, set[str]] = {}
    for name, py in modules.items():
        package = name if py.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                target = _import_targets(node, package)
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
    """No module of src/ imports, through any chain and at any depth, a module that imports it back
    (registries are kept apart from their entries: fedrepro.data.dataset_registry,
    fedrepro.models.base; the registry module never imports the plugins, whose loader
    fedrepro/__init__.py hands it)."""
    graph = _module_imports()
    assert {"fedrepro.engine.engine", "fedrepro.engine.vectorized", "fedrepro.data.datasets"} <= graph.keys()
    assert "fedrepro.engine.vectorized" in graph["fedrepro.engine.training"]  # the walk sees relative imports
    assert "fedrepro.plugins" in graph["fedrepro"]  # ... and the imports inside functions (its plugin loader)
    assert _circle(graph) is None, " -> ".join(_circle(graph))


def test_the_circle_finder_finds_a_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


# Library objects whose needed step has no public name (not fedrepro's state): file -> attributes.
LIBRARY_PRIVATES = {
    "models/prompted_vit.py": {"_pos_embed"},  # timm's VisionTransformer: the position-embedding step
    "ssl/objectives.py": {"_init_memory_bank"},  # lightly's MemoryBankModule: a fresh random bank
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module_outside(target: str, importer: str) -> bool:
    """True if `target` lies under a private module (`pkg._mod`) of a package `importer` is not in."""
    parts = target.split(".")
    first = next((i for i, p in enumerate(parts) if _private(p)), None)
    owner = ".".join(parts[:first]) if first is not None else ""
    return first is not None and importer != owner and not importer.startswith(owner + ".")


def _private_accesses(py: Path, module: str, modules: dict[str, Path]) -> list[str]:
    """Where the file `py` (module `module`) touches another module's private name:
    `from x import _name`, a private module of another package, and `obj._attr` (or
    getattr(obj, "_attr")) where obj is not self, cls or super() and `_attr` is not defined by
    this module itself (`self._attr = ...`, a class body, a module-level name). Objects bound to a
    third-party module (`import numpy as np`, `from torch import nn`) are the library's business."""
    tree = ast.parse(py.read_text())
    package = module if py.name == "__init__.py" else module.rpartition(".")[0]
    own, library = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
            if isinstance(node, ast.ClassDef):
                own |= {t.id for s in node.body if isinstance(s, (ast.Assign, ast.AnnAssign))
                        for t in (s.targets if isinstance(s, ast.Assign) else [s.target]) if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.Import):
            library |= {(a.asname or a.name).partition(".")[0] for a in node.names if not a.name.startswith("fedrepro")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("fedrepro"):
            library |= {a.asname or a.name for a in node.names}
    own |= {t.id for s in tree.body if isinstance(s, (ast.Assign, ast.AnnAssign))
            for t in (s.targets if isinstance(s, ast.Assign) else [s.target]) if isinstance(t, ast.Name)}
    allowed = own | LIBRARY_PRIVATES.get(str(py.relative_to(SRC)), set())

    def foreign(obj: ast.expr) -> bool:
        root = obj
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if isinstance(root, ast.Name) and root.id in library:
            return False
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
            return False
        return not (isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super")

    found = []
    for node in sorted((n for n in ast.walk(tree) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset)):
        where = f"{py.relative_to(SRC)}:{node.lineno}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if _private_module_outside(a.name, module)]
        elif isinstance(node, ast.ImportFrom):
            target = _import_targets(node, package)
            if not target.startswith("fedrepro"):
                continue
            if _private_module_outside(target, module):
                found.append(f"{where}: from {target} import ...")
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    if _private_module_outside(f"{target}.{alias.name}", module):
                        found.append(f"{where}: from {target} import {alias.name} (a private module)")
                elif _private(alias.name):
                    found.append(f"{where}: from {target} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in allowed and foreign(node.value):
            found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value) and node.args[1].value not in allowed and foreign(node.args[0]):
            found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_no_module_touches_another_modules_private_names():
    """Each module owns its private names: no `from x import _name`, no private module of another
    package, no `obj._attr` on another module's object. A shared thing has a public name in its owner."""
    modules = _src_modules()
    by_file = {}
    for name, py in sorted(modules.items()):
        if found := _private_accesses(py, name, modules):
            by_file[str(py.relative_to(SRC))] = found
    report = "\n".join(f"{f} ({len(v)}):\n    " + "\n    ".join(v) for f, v in by_file.items())
    if by_file:
        pytest.fail(f"private names touched across modules in {len(by_file)} files:\n{report}", pytrace=False)


def test_the_private_access_finder_is_precise(tmp_path, monkeypatch):
    """It flags what crosses a module's border and nothing that stays inside one."""
    pkg = tmp_path / "fedrepro"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "_shared.py").write_text("def helper(): pass\n")
    (pkg / "sub" / "mod.py").write_text(
        "import torch\nfrom torch import nn\nfrom ._shared import helper\nfrom .other import _hidden\n"
        "class A(nn.Module):\n    _cache = None\n    def __init__(self):\n        super().__init__()\n"
        "        self._x = 1\n        super()._init()\n    def same(self, other):\n"
        "        return other._x, A._cache, self.__dict__, torch._foreach_mul_, nn.modules.batchnorm._BatchNorm\n"
        "def f(engine, obj):\n    engine._stream = 2\n    return obj._streams, getattr(obj, '_y')\n")
    (pkg / "top.py").write_text("from .sub._shared import helper\nfrom .sub import _shared\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    modules = _src_modules()
    inside = _private_accesses(pkg / "sub" / "mod.py", "fedrepro.sub.mod", modules)
    assert [v.partition(": ")[2] for v in inside] == [
        "from fedrepro.sub.other import _hidden", "engine._stream", "obj._streams", "getattr(obj, '_y')"]
    outside = _private_accesses(pkg / "top.py", "fedrepro.top", modules)
    assert [v.partition(": ")[2] for v in outside] == [
        "from fedrepro.sub._shared import ...", "from fedrepro.sub import _shared (a private module)"]


def _workflow_files() -> dict[str, str]:
    files = {p.name: p.read_text() for p in sorted((REPO / "workflow" / "rules").glob("*.smk"))}
    return files | {"Snakefile": (REPO / "Snakefile").read_text()}


def test_the_workflow_is_thin():
    """The rules' logic lives in the package (fedrepro.planning): common.smk holds the config and its
    validation and defines no helper; no workflow file imports the CLI or sets an environment
    variable itself: the jobs' environment is set once, by planning.set_job_environment; and
    the console watcher starts only when jobs run (an `onstart:` handler, never in a dry run)."""
    files = _workflow_files()
    assert not re.search(r"^\s*def ", files["common.smk"], re.M), "common.smk defines a function"
    for name, text in files.items():
        assert "fedrepro.cli" not in text, f"{name} imports the CLI: planning helpers live in fedrepro.planning"
        assert not re.search(r"os\.environ|putenv", text), f"{name} sets the environment outside set_job_environment"
        for m in re.finditer(r"ConsoleWatcher\(", text):
            handler = [line for line in text[: m.start()].splitlines() if line and not line[0].isspace()][-1]
            assert handler == "onstart:", f"{name} starts the console watcher outside onstart: ({handler!r})"
    assert sum(text.count("set_job_environment(") for text in files.values()) == 1
