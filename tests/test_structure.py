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
