"""CITATION.cff is valid Citation File Format 1.2.0 and LICENSE is the permissive one it names.

The schema is the official CFF 1.2.0 JSON schema (citation-file-format/citation-file-format,
as shipped in cffconvert 2.0.0), kept in tests/data so the check runs offline.
"""

import json
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_citation_cff_validates_against_the_cff_schema():
    schema = json.loads((ROOT / "tests/data/cff-schema-1.2.0.json").read_text())
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    jsonschema.validate(cff, schema, format_checker=jsonschema.FormatChecker())
    assert cff["license"] == "MIT"
    assert "MIT License" in (ROOT / "LICENSE").read_text()


def test_citation_lists_every_paper_whose_tables_are_regenerated():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    cited = {r["title"] for r in cff["references"]}
    published = sorted((ROOT / "config/papers/published").glob("*.yaml"))
    assert published
    for path in published:
        title = yaml.safe_load(path.read_text())["paper"]["title"]
        assert title in cited, f"{path.name}: {title!r} missing from CITATION.cff references"
        assert title in (ROOT / "README.md").read_text(), f"{path.name}: {title!r} missing from the README's How to cite"
