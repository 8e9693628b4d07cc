"""dvc.yaml is generated (workflow/scripts/dvc_yaml.py): tracking any experiment adds it, no hand edits."""

import importlib.util

import yaml

from conftest import REPO

_spec = importlib.util.spec_from_file_location("dvc_yaml", REPO / "workflow" / "scripts" / "dvc_yaml.py")
dvc_yaml = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dvc_yaml)


def test_committed_dvc_yaml_is_as_generated():
    assert dvc_yaml.main(["--check"]) == 0


def test_tracking_a_new_experiment_adds_its_metric_and_plot(tmp_path):
    out = tmp_path / "dvc.yaml"
    out.write_text((REPO / "dvc.yaml").read_text())
    assert dvc_yaml.main(["--out", str(out), "my_new_exp"]) == 0
    doc = yaml.safe_load(out.read_text())
    assert "results/my_new_exp/summary.json" in doc["metrics"] and "results/default/summary.json" in doc["metrics"]
    assert {"results/my_new_exp/curves.csv"} <= {next(iter(p)) for p in doc["plots"]}
    again = out.read_text()
    assert dvc_yaml.main(["--out", str(out), "my_new_exp"]) == 0 and out.read_text() == again  # idempotent
    assert dvc_yaml.main(["--check", "--out", str(out)]) == 0
    # dvc_track.sh runs it for the experiment it tracks
    assert 'workflow/scripts/dvc_yaml.py "$exp"' in (REPO / "workflow" / "scripts" / "dvc_track.sh").read_text()
