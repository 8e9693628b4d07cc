"""The wheels the GPU check (benchmarks/gpu_check.sh, docs/gpu.md) must carry to a device machine,
which has no network: every package that fedrepro (pyproject.toml's dependencies) and Snakemake
need, through their whole dependency closure, at the versions of workflow/envs/requirements.lock,
minus the packages the device image already has (benchmarks/gpu_image_packages.txt: torch,
torchvision, numpy, pandas, ...). A needed package that the image has is carried anyway where a
carried package bounds its version from above (e.g. Snakemake's `packaging<26`): the image's
version is not known here. NOT_CARRIED lists what is left out, and why.

    .venv/bin/python benchmarks/gpu_wheels.py              # the list and the pip download command
    .venv/bin/python benchmarks/gpu_wheels.py --download   # fetch them into .whl/ (git-ignored)

The dependency graph is read from the installed distributions' metadata (the .venv that
workflow/scripts/setup.sh installs from the lock), with environment markers evaluated for the
device: CPython 3.12 on manylinux x86_64. A locked package published only as a source
distribution is built into a wheel here (pure Python only: `pip wheel --no-deps`).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "workflow" / "envs" / "requirements.lock"
IMAGE = REPO / "benchmarks" / "gpu_image_packages.txt"
WHEELS = REPO / ".whl"
FMNIST = REPO / ".fmnist"  # the four .gz files of Fashion-MNIST, carried beside the wheels (docs/gpu.md)
TRAVEL_LIMIT = 64 * 2**20  # what a device call may send: the working tree and the carried folders
#: What runs on the device beyond fedrepro's own dependencies: the workflow.
EXTRA_ROOTS = ("snakemake",)
#: Needed by the closure but left behind, with the reason (the carried files must stay within 64 MiB).
NOT_CARRIED = {"pulp": "a 16 MiB wheel, mostly CBC solver binaries for every platform; only Snakemake's ILP "
                       "scheduler imports it, and the GPU check runs Snakemake with --scheduler greedy"}
#: The image's own build serves even where a requirement bounds the version (pyproject.toml's
#: torch>=2.12,<2.13): its CUDA build is what the check is about, and the lock's are gigabytes.
IMAGE_SERVES = {"torch", "torchvision", "triton"}
#: The device: CPython 3.12 on Linux x86_64 (markers and pip download's platform tags).
TARGET_MARKERS = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython",
                  "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                  "platform_machine": "x86_64", "extra": ""}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")


def normalize(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """Normalized name -> pinned version of every `name==version` line of the lock."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            spec = next(iter(req.specifier), None)
            if spec is None or spec.operator != "==":
                raise SystemExit(f"{path}: line {line!r} is not a pin (name==version)")
            pins[normalize(req.name)] = spec.version
    return pins


def read_image(path: Path = IMAGE) -> set[str]:
    return {normalize(line.strip()) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def roots(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [Requirement(d) for d in deps] + [Requirement(r) for r in EXTRA_ROOTS]


def requirements(name: str) -> list[Requirement]:
    """`name`'s requirements that apply on the device (no extras), from its installed metadata."""
    try:
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        raise SystemExit(f"package {name} of the lock is not installed here: run workflow/scripts/setup.sh first "
                         "(the dependency graph is read from the installed metadata)") from None
    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(TARGET_MARKERS):
            out.append(req)
    return out


def needed(pins: dict[str, str] | None = None, image: set[str] | None = None) -> dict[str, str]:
    """Normalized name -> locked version of every package to carry (see the module docstring)."""
    pins = read_lock() if pins is None else pins
    image = read_image() if image is None else image
    carry: dict[str, str] = {}
    todo = list(roots())
    while todo:
        req = todo.pop()
        name = normalize(req.name)
        if name in carry or name in NOT_CARRIED or name in IMAGE_SERVES:
            continue
        capped = any(s.operator in ("<", "<=", "==", "~=", "===") for s in req.specifier)
        if name in image and not capped:
            continue  # the image's copy serves (and so do its own dependencies)
        if name not in pins:
            raise SystemExit(f"{LOCK}: {name} is needed on the device but not pinned in the lock")
        carry[name] = pins[name]
        todo += requirements(name)
    return dict(sorted(carry.items()))


def download_command(packages: dict[str, str], dest: Path = WHEELS, python: str = sys.executable) -> list[str]:
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + ["--platform", "any", "-d", str(dest)] + [f"{n}=={v}" for n, v in packages.items()]


def download(packages: dict[str, str], dest: Path = WHEELS) -> list[Path]:
    """Fetch every wheel into a fresh `dest` (old wheels removed: two versions of one package stop
    the install); a package without a matching wheel is built here if it is pure Python."""
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "whl"
        stage.mkdir()
        missing = []
        if subprocess.run(download_command(packages, stage), capture_output=True).returncode != 0:
            for name, version in packages.items():  # one at a time: which ones have no wheel
                if subprocess.run(download_command({name: version}, stage), capture_output=True).returncode != 0:
                    missing.append((name, version))
        for name, version in missing:
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", name, "-w", str(stage),
                            f"{name}=={version}"], check=True, capture_output=True, text=True)
        wheels = sorted(stage.glob("*.whl"))
        built = [w for w in wheels if not w.name.endswith("-none-any.whl") and normalize(w.name.split("-")[0])
                 in {n for n, _ in missing}]
        if built:
            raise SystemExit(f"no wheel for the device of {', '.join(w.name for w in built)}: it is not pure Python "
                             "and was built for this machine; carry a manylinux wheel instead")
        got = {normalize(w.name.split("-")[0]) for w in wheels}
        if got != set(packages):
            raise SystemExit(f"wheels missing for: {', '.join(sorted(set(packages) - got))}")
        dest.mkdir(exist_ok=True)
        for old in dest.glob("*.whl"):
            old.unlink()
        for w in wheels:
            shutil.move(str(w), dest / w.name)
    return sorted(dest.glob("*.whl"))


def travel_size() -> dict[str, int]:
    """Bytes that a device call sends: the files git tracks or would track, and the carried folders."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((REPO / f.decode()).stat().st_size for f in listed if f and (REPO / f.decode()).is_file())
    carried = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in (WHEELS, FMNIST) if p.is_dir()}
    return {"tree": tree, **carried}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--download", action="store_true", help=f"fetch the wheels into {WHEELS.relative_to(REPO)}/")
    args = ap.parse_args(argv)
    packages = needed()
    print(f"{len(packages)} packages to carry:", " ".join(f"{n}=={v}" for n, v in packages.items()))
    if not args.download:
        print(shlex.join(download_command(packages)))
        return
    wheels = download(packages)
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels in {WHEELS}: {size / 2**20:.1f} MiB")
    sizes = travel_size()
    total = sum(sizes.values())
    print("a device call sends " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items())
          + f" = {total / 2**20:.1f} MiB of at most {TRAVEL_LIMIT / 2**20:.0f} MiB")
    if total > TRAVEL_LIMIT:
        raise SystemExit("over the limit: carry less (NOT_CARRIED says what can stay behind)")


if __name__ == "__main__":
    main()
