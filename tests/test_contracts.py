"""One owner per contract (issue 39): the metrics.json schema id, writer and reader live in
fedrepro.custody; STATS and the statistics over seeds are defined once; the tables build on
aggregation and aggregation never imports the tables, not even inside a function."""

import ast
from importlib import resources

import pytest
import yaml
from test_structure import _module_imports, _src_modules  # the import graph counts imports inside functions

SCHEMA_ID = "fedrepro.metrics/1"


def _module_level_defs(name: str) -> list[str]:
    """The modules of src/ that define `name` at module level (a function, class or assignment; not an import)."""
    found = []
    for module, py in sorted(_src_modules().items()):
        for node in ast.parse(py.read_text()).body:
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name
                    or any(isinstance(t, ast.Name) and t.id == name for t in targets)):
                found.append(module)
    return found


def test_the_metrics_schema_id_is_spelled_in_one_module():
    spelled = [m for m, py in sorted(_src_modules().items()) if SCHEMA_ID in py.read_text()]
    assert spelled == ["fedrepro.custody"], spelled


def test_the_schema_id_is_the_json_schemas_const():
    from fedrepro.custody import METRICS_SCHEMA

    schema = yaml.safe_load(resources.files("fedrepro").joinpath("schemas/metrics.schema.yaml").read_text())
    assert METRICS_SCHEMA == schema["properties"]["schema"]["const"] == SCHEMA_ID


def test_metrics_json_has_one_writer(tmp_path):
    """No module but custody hands a metrics.json path to a file writer (write_*_atomic, atomic_path)."""
    writers = []
    for module, py in sorted(_src_modules().items()):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func.endswith("_atomic") or func == "atomic_path":
                    names = [c.value for a in node.args for c in ast.walk(a) if isinstance(c, ast.Constant)]
                    if any(isinstance(v, str) and v.endswith("metrics.json") for v in names):
                        writers.append(f"{module}:{node.lineno}")
    assert not writers, writers

    from fedrepro.custody import METRICS_SCHEMA, read_metrics, write_metrics

    doc = {"schema": METRICS_SCHEMA, "cell": {"experiment": "e", "dataset": "d", "partition": "p", "partition_id": "x",
                                              "method": "fedavg", "label": "fedavg", "seed": 0, "model": "m"},
           "status": "failed", "failure": {"reason": "diverged", "round": 1}}
    write_metrics(tmp_path / "metrics.json", doc)
    assert read_metrics(tmp_path / "metrics.json") == doc
    with pytest.raises(ValueError, match="schema"):
        write_metrics(tmp_path / "other.json", doc | {"schema": "other/1"})
    assert not (tmp_path / "other.json").exists()


def test_stats_and_seed_statistics_are_defined_once():
    assert _module_level_defs("STATS") == ["fedrepro.metrics"]
    assert _module_level_defs("seed_stats") == ["fedrepro.report.stats"]


def test_aggregation_never_reaches_the_tables():
    """Tables build on aggregation (seed_table, row and column order), never the reverse, through
    any chain of imports, those inside functions included."""
    graph = _module_imports()
    assert "fedrepro.report.aggregate" in graph["fedrepro.report.tables"]
    seen, todo = set(), ["fedrepro.report.aggregate"]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    assert not {"fedrepro.report.tables", "fedrepro.report.paper_tables", "fedrepro.report.landing"} & seen, sorted(seen)


def test_summary_json_and_tables_share_the_seed_statistics():
    """summary.json's means and the tables' mean ± std are report.stats.seed_stats' numbers."""
    import pandas as pd

    from fedrepro.report.aggregate import metrics_json, seed_table
    from fedrepro.report.stats import seed_stats
    from fedrepro.report.tables import numeric_table

    values = [0.81, 0.8325, 0.79]
    frame = pd.DataFrame({"dataset": "d", "partition": "p", "label": "fedavg", "kind": "global", "seed": [0, 1, 2, 3],
                          "status": ["ok", "ok", "ok", "failed"], "acc_weighted_mean": [*values, float("nan")]})
    want = seed_stats(values)
    row = seed_table(frame, "acc_weighted_mean").iloc[0]
    assert (row["mean"], row["std"], row["n_seeds"], row["n_failed"]) == (want.mean, want.std, 3, 1)
    table = numeric_table(frame, "acc_weighted_mean")
    assert table["d/p/mean"][0] == round(want.mean, 6) and table["d/p/std"][0] == round(want.std, 6)
    frame = frame.assign(**{c: frame["acc_weighted_mean"] for c in ("acc_mean", "acc_worst10", "acc_std", "f1_mean")})
    assert metrics_json(frame)["d"]["p"]["fedavg"]["global"]["acc_weighted_mean"] == round(want.mean, 6)
