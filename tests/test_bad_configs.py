"""Malformed experiment configs: the documented messages (docs/bad_configs.md) are the
real ones, and each config is rejected before any job runs.

The cases are tests/test_config.py's `BAD` list (imported through
workflow/scripts/bad_configs_doc.py, which generates the document): changes of the parsed
config (row["config"]) and changes of the file's text (row["text"]: duplicate keys, tags,
YTE, aliases, encoding), each written to `bad.yaml`.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from fedrepro.cli import main as fedrepro_main

_spec = importlib.util.spec_from_file_location("bad_configs_doc", REPO / "workflow" / "scripts" / "bad_configs_doc.py")
doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doc)

REGENERATE = ".venv/bin/python workflow/scripts/bad_configs_doc.py"


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return doc.collect()


def row(rows: list[dict], case_id: str) -> dict:
    return next(r for r in rows if r["id"] == case_id)


def write_case(r: dict, path) -> None:
    """The case's bad file: its text as is, or its config dumped as YAML."""
    if r["text"] is not None:
        path.write_bytes(r["text"])
    else:
        path.write_text(yaml.safe_dump(r["config"], sort_keys=False))


def test_doc_is_in_sync_with_the_actual_messages(rows):
    expected = doc.render(rows)
    actual = doc.DOC.read_text() if doc.DOC.exists() else ""
    if actual != expected:
        diff = "".join(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                            "docs/bad_configs.md", "regenerated", n=1))
        pytest.fail(f"docs/bad_configs.md is out of date; regenerate it with `{REGENERATE}`:\n{diff[:6000]}")


def test_script_check_mode_agrees(tmp_path):
    stale = tmp_path / "bad_configs.md"
    stale.write_text("# outdated\n")
    assert doc.main(["--check", "--out", str(stale)]) == 1
    assert doc.main(["--out", str(stale)]) == 0
    assert doc.main(["--check", "--out", str(stale)]) == 0


def test_at_least_80_cases_each_naming_key_value_and_what_is_allowed(rows):
    assert len(rows) >= 80
    assert len({r["id"] for r in rows}) == len(rows)
    cases = {case_id: expected for case_id, _, expected in doc.load_cases()}
    text = doc.DOC.read_text()
    for r in rows:
        msg = r["message"]
        assert msg.startswith(("config key '", "config file 'bad.yaml': ")), msg  # the key, or the unreadable file
        assert "allowed" in msg or "required" in msg, msg  # what is allowed
        assert all(s in msg for s in cases[r["id"]]), (msg, cases[r["id"]])  # the value, per test_config.py
        assert f"## {r['id']}\n" in text and f"```\n{r['doc_message']}\n```" in text


def test_cases_cover_the_kinds_of_mistakes(rows):
    ids = {r["id"] for r in rows}
    for case_id in ("unknown-method", "unknown-dataset", "negative-rounds", "alpha-zero",  # Dirichlet concentration <= 0
                    "participation-fraction-above-1", "classes-per-partition-above-classes", "missing-seeds",
                    "rounds-wrong-type", "alpha-wrong-type", "unknown-hparam", "unknown-partitioner-param"):
        assert case_id in ids


def test_fedrepro_validate_rejects_every_case_with_the_documented_message(rows, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for r in rows:
        write_case(r, tmp_path / "bad.yaml")
        assert fedrepro_main(["validate", "bad.yaml"]) == 2, r["id"]
        err = capsys.readouterr().err
        assert err.strip() == f"fedrepro validate: error: {r['message']}", r["id"]
        assert "Traceback" not in err


SNAKEMAKE_CASES = ["unknown-method", "negative-rounds", "alpha-zero", "participation-fraction-above-1",
                   "classes-per-partition-above-classes", "missing-seeds", "unknown-hparam", "rounds-wrong-type",
                   # issue 15: refused by the strict reader (the default profile's guard) or the name / number checks
                   "yte-template", "duplicate-method-key", "python-object-apply-tag", "alias-bomb", "yaml11-on-key",
                   "experiment-trailing-newline", "lr-nan", "rounds-huge",
                   # issue 12: a bad search space stops before any job
                   "tuning-unknown-parameter", "tuning-empty-grid",
                   # issue 24: once failing only inside a job, or an option silently ignored
                   "conv-model-on-small-images", "official-test-without-one", "momentum-under-adam"]


def dry_run(r: dict, folder) -> subprocess.CompletedProcess:
    """`snakemake -n --configfile bad.yaml` in `folder`, which holds only the case's bad.yaml."""
    folder.mkdir()
    write_case(r, folder / "bad.yaml")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(folder),
                           "-n", "--configfile", "bad.yaml"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def dry_runs(rows, tmp_path_factory) -> dict:
    """{case id: (the dry run's process, its folder)} for every SNAKEMAKE_CASES case: independent
    processes, each in its own folder, run as many at a time as there are cores (most of each is
    Snakemake's and the package's start-up)."""
    from concurrent.futures import ThreadPoolExecutor

    base = tmp_path_factory.mktemp("dry_runs")
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {case_id: pool.submit(dry_run, row(rows, case_id), base / case_id) for case_id in SNAKEMAKE_CASES}
        return {case_id: (future.result(), base / case_id) for case_id, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case_id", SNAKEMAKE_CASES)
def test_snakemake_dry_run_stops_with_the_documented_message_before_any_job(rows, dry_runs, case_id):
    r = row(rows, case_id)
    proc, tmp_path = dry_runs[case_id]
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert doc.SNAKEMAKE_PREFIX + r["message"] in text.splitlines(), text[-3000:]
    assert r["doc_message"] in doc.DOC.read_text()
    # stopped while parsing: no DAG, no job, nothing written
    assert "Building DAG" not in text and "Job stats" not in text and "rule " not in text and "Traceback" not in text
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".snakemake") == ["bad.yaml"]
