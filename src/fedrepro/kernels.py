"""CPU kernel level: every fedrepro process caps torch's CPU kernels at one named instruction level,
so that a cell's numbers are the same on any x86-64 CPU that has it (issue 56).

Measured: on an AVX-512 machine, 8 of FedCoSR's 18 headline cells end one to a few test images
off the values recorded on AVX2 machines; capped at AVX2 they are identical. ATen's dispatch
(ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA) and MKL (MKL_ENABLE_INSTRUCTIONS) each pick
their kernels by the CPU unless told, and each reads its variable once, at its first use: `apply`
runs at `import fedrepro`, before any torch operation.

FEDREPRO_KERNELS chooses the level: `avx2` (the default: reproducibility is what this project
sells), `avx512`, or `native` (no cap: the three variables are removed, each library chooses). The level
in force is recorded in provenance.json (`kernels`) and in a calibration's key; `fedrepro verify`
and `fedrepro readings --check` name a level difference instead of reporting a bare mismatch.
"""

from __future__ import annotations

import os
import platform

ENV = "FEDREPRO_KERNELS"
DEFAULT = "avx2"
#: level -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS); native sets none
LEVELS: dict[str, tuple[str, str, str] | None] = {
    "avx2": ("avx2", "AVX2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE", "AVX512"),
    "native": None,
}
VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


class KernelLevelError(ValueError):
    pass


def requested() -> str:
    """The level FEDREPRO_KERNELS asks for (the default where unset); KernelLevelError naming the
    variable, its value and what is allowed otherwise."""
    level = os.environ.get(ENV, DEFAULT).strip().lower() or DEFAULT
    if level not in LEVELS:
        raise KernelLevelError(f"environment variable {ENV} has value {os.environ.get(ENV)!r}; allowed: "
                               f"{', '.join(LEVELS)} (default {DEFAULT})")
    return level


def apply() -> str:
    """Set the three libraries' variables for the requested level (a capped level overrides values
    set by hand, so that the recorded level is the one asked for); returns the level. Call before
    the first torch operation: each library reads its variable once."""
    level = requested()
    values = LEVELS[level]
    for i, name in enumerate(VARIABLES):
        if values is None:  # native: each library's own choice, also where a parent process had capped them
            os.environ.pop(name, None)
        else:
            os.environ[name] = values[i]
    return level


def in_force() -> dict[str, str | None]:
    """What provenance.json and a calibration record: the level asked for, torch's dispatch level
    (torch.backends.cpu.get_cpu_capability(), e.g. AVX2 or AVX512), the oneDNN and MKL limits as
    set, and the CPU's model name."""
    import torch

    try:
        level = requested()
    except KernelLevelError:
        level = None
    return {"requested": level, "capability": torch.backends.cpu.get_cpu_capability(),
            **{name.lower(): os.environ.get(name) for name in VARIABLES[1:]}, "cpu": cpu_name()}


def capability(provenance: dict) -> str | None:
    """The dispatch level a provenance.json records (None: written before issue 56)."""
    k = provenance.get("kernels")
    return k.get("capability") if isinstance(k, dict) and isinstance(k.get("capability"), str) else None


def difference(recorded: str | None, here: str) -> str:
    """The note for cells recorded under another level ('' where the levels agree or none is recorded)."""
    if recorded is None or recorded == here:
        return ""
    return f"recorded under another kernel level ({recorded}, here {here})"


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (Linux), else what the platform says."""
    from .io import read_regular  # here: `import fedrepro` (which applies the cap) stays free of numpy

    try:
        text = read_regular(cpuinfo, 1 << 20).decode("utf-8", "replace")
    except (OSError, ValueError):
        text = ""
    for line in text.splitlines():
        if line.startswith("model name") and ":" in line:
            return " ".join(line.split(":", 1)[1].split())[:120]
    return platform.processor() or platform.machine() or "unknown"
