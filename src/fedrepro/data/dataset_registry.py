"""The dataset registry, apart from its entries: `DatasetSpec`, `DATASETS` and how to register
and load one.

Owns what a dataset entry is (a `DatasetSpec`: how to obtain and read it) and the registry the
entries add themselves to. The entries live in their own modules (fedrepro.data.datasets for
fmnist, digits and synthetic; fedrepro.data.vision; fedrepro.data.domains.*), which import this
one; this one imports none of them (as timm keeps its model registry apart from the models), so
there is no import circle. `fedrepro.data.datasets` imports every built-in entry; a lookup in
`DATASETS` loads them (and the plugins) first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fedrepro.data.base import RawDataset
from fedrepro.registry import Param, Registry, resolve_params


@dataclass(frozen=True)
class DatasetSpec:
    """How to obtain and read one dataset, plus the facts `fedrepro list` prints."""

    name: str
    summary: str  # one line
    source: str  # where the data comes from (URL / package)
    num_classes: int
    sample_shape: tuple
    size: str  # human readable
    params: dict[str, Param]
    prepare: Callable[[Path, dict], None]  # make raw files present under root; idempotent
    load: Callable[[Path, dict], RawDataset]  # raw files under root -> RawDataset; offline
    #: Per-class sample counts (official train, official test), in label order, where the files are fixed
    #: and no parameter changes them; None where unknown. `fedrepro validate` decides partition feasibility
    #: from them before any job (fedrepro.data.datasets.class_counts), or from the counts `prepare` caches.
    class_counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None


DATASETS: Registry[DatasetSpec] = Registry[DatasetSpec]("dataset", plugin_group="fedrepro.datasets")


def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    """Add `spec` to DATASETS: the built-in sources and plugins (docs/plugins.md) alike."""
    DATASETS.add(spec.name, spec, spec.summary, spec.params, source=spec.source, size=spec.size)
    return spec


def resolve_dataset(name: str, params: dict | None) -> tuple[DatasetSpec, dict[str, Any]]:
    """The spec of dataset `name` and its parameters (defaults overlaid with `params`, checked)."""
    spec = DATASETS.get(name)  # unknown name -> ConfigError listing the allowed names
    return spec, resolve_params(f"dataset '{name}'", spec.params, params)


def load_dataset(name: str, root: Path, params: dict | None = None) -> RawDataset:
    """Read dataset `name` from `root` (no network); `DataMissingError` if absent."""
    spec, resolved = resolve_dataset(name, params)
    return spec.load(Path(root), resolved)
