"""Compare the metrics.json files of two results trees, timings aside: did a change alter any result?

    python benchmarks/compare_metrics.py BEFORE AFTER

BEFORE and AFTER are folders (a workflow's working directory, a results/<experiment> folder, ...);
every metrics.json below each is paired by its path relative to the folder. Two files agree when
their JSON is equal after dropping the wall-clock fields (`resources`' seconds and peak memory,
which differ from run to run); every other field, floats included, must be equal to the bit.
Prints one line per differing file (with the first differing keys), per file found on one side
only, and a count; exits 1 when anything differs or nothing was compared, 2 for a folder that is
not one or a metrics.json that cannot be read (benchmarks/script_inputs.py: one line, no traceback).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_inputs import OneLineParser, existing_dir, read_json  # noqa: E402

#: What differs from run to run of the same computation (metrics.json `resources`).
WALL_CLOCK = {"wall_time_s", "train_time_s", "eval_time_s", "personal_eval_time_s", "peak_rss_mb", "peak_gpu_mb"}


def without_timings(metrics: dict) -> dict:
    out = dict(metrics)
    if isinstance(out.get("resources"), dict):
        out["resources"] = {k: v for k, v in out["resources"].items() if k not in WALL_CLOCK}
    return out


def differences(a, b, where: str = "") -> list[str]:
    """The key paths at which `a` and `b` differ (NaN equals NaN: json.loads reads both as nan)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys(), key=str)
                for d in (differences(a[k], b[k], f"{where}.{k}") if k in a and k in b else [f"{where}.{k} (one side)"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
    return [] if same and type(a) is type(b) else [where or "."]


def compare(before: Path, after: Path) -> tuple[int, list[str]]:
    """(files compared, lines describing every difference)."""
    found = {side: {p.relative_to(root): p for p in root.rglob("metrics.json")} for side, root in (("before", before), ("after", after))}
    lines = [f"only in {side}: {rel}" for side in found for rel in sorted(found[side].keys() - found["after" if side == "before" else "before"].keys())]
    common = sorted(found["before"].keys() & found["after"].keys())
    for rel in common:
        a, b = (without_timings(read_json(found[s][rel], "metrics file")) for s in ("before", "after"))
        diff = differences(a, b)
        if diff:
            lines.append(f"differs: {rel}: {', '.join(diff[:5])}" + (f" (+{len(diff) - 5} more)" if len(diff) > 5 else ""))
    return len(common), lines


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=existing_dir)
    ap.add_argument("after", type=existing_dir)
    args = ap.parse_args(argv)
    n, lines = compare(args.before, args.after)
    for line in lines:
        print(line)
    print(f"{n} metrics.json compared, {len(lines)} difference(s) (wall-clock fields aside: {', '.join(sorted(WALL_CLOCK))})")
    return 1 if lines or n == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
