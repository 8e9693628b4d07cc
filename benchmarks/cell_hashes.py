"""Which cells does a change retrain? The cell hashes of every config, before and after.

    python benchmarks/cell_hashes.py                # the working tree against HEAD
    python benchmarks/cell_hashes.py --base b9b4010 # against any revision

A cell is identified by the hash of its resolved config (README: Concepts), so a change that
leaves a method alone must leave the hashes of its cells alone. The script resolves every
config under config/ (config/*.yaml, config/experiments/, config/papers/) in the working tree
and, through `git worktree`, at the base revision, and prints per config how many cells kept
their hash, which methods' cells changed, and how many cells came or went. Exits 0; it reports,
or 2 for a --base that names no commit or where the configs cannot be resolved (one line).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from script_inputs import OneLineParser, error_line, fail, revision  # noqa: E402

CONFIGS = ("config/*.yaml", "config/experiments/*.yaml", "config/papers/*.yaml")

# Run inside one checkout (its own src/ first on the path): {config: {cell id: hash}} as JSON.
PROBE = """
import glob, json, sys
from fedrepro.cli import cell_id
from fedrepro.config import load_and_resolve
from fedrepro.io import short_hash
out = {}
for pattern in json.loads(sys.argv[1]):
    for path in sorted(glob.glob(pattern)):
        try:
            out[path] = {cell_id(c): short_hash(c) for c in load_and_resolve([path])[1]["cells"]}
        except Exception as exc:  # a config the other checkout cannot read is reported, not fatal
            out[path] = f"error: {exc}"
json.dump(out, sys.stdout)
"""


def hashes(checkout: Path, name: str) -> dict:
    """The cell hashes of every config of `checkout`; `name` says which in the message if they cannot be had."""
    run = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CONFIGS)], cwd=checkout,
                         capture_output=True, text=True, env={"PYTHONPATH": str(checkout / "src"), "PATH": ""})
    if run.returncode != 0:  # e.g. a revision older than fedrepro.cli.cell_id
        fail(f"{name}: its cell hashes cannot be computed ({error_line(run.stderr)})")
    return json.loads(run.stdout)


def method_of(cell: str) -> str:
    return cell.split("[", 1)[1].split("]", 1)[0]


def report(before: dict, after: dict) -> list[str]:
    lines = []
    for path in sorted(set(before) | set(after)):
        b, a = before.get(path, {}), after.get(path, {})
        if isinstance(b, str) or isinstance(a, str):
            lines.append(f"{path}: {b if isinstance(b, str) else 'ok'} -> {a if isinstance(a, str) else 'ok'}")
            continue
        changed = [c for c in b if c in a and a[c] != b[c]]
        kept = sum(1 for c in b if c in a and a[c] == b[c])
        methods = ", ".join(sorted({method_of(c) for c in changed})) or "-"
        lines.append(f"{path}: {kept} kept, {len(changed)} changed (methods: {methods}), "
                     f"{sum(c not in a for c in b)} gone, {sum(c not in b for c in a)} new")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD", type=revision, help="the revision to compare the working tree with (default HEAD)")
    args = ap.parse_args(argv)  # args.base: the commit's hash (script_inputs.revision), never read by git as an option
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO, check=True, capture_output=True)
        try:
            before = hashes(base, f"argument --base {args.base}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=True, capture_output=True)
    print("\n".join(report(before, hashes(REPO, "the working tree"))))


if __name__ == "__main__":
    main()
