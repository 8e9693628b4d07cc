"""Method registry: every module in this package registers one method.

Adding a method = adding one file here with a `Method` subclass decorated by
`@register`; nothing else changes (a default tuning space in search_spaces.yaml or the
class's `search_space` is optional). A method can also live in another package
(fedrepro.plugins: entry point group `fedrepro.methods`; docs/plugins.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from ..registry import Registry
from ._finetune import FINETUNE_HPARAMS, with_head_finetuning  # the fine-tuning wrapper, public (engine/finetune.py, config)
from .base import Method, Update, payload_bytes, select, weighted_average

METHODS: Registry = Registry("method", plugin_group="fedrepro.methods")


def register(cls: type[Method]) -> type[Method]:
    METHODS.add(cls.name, cls, cls.summary, cls.hparams, paper=cls.paper)
    return cls


def _discover() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_") and mod.name != "base":
            importlib.import_module(f"{__name__}.{mod.name}")


_discover()

__all__ = ["FINETUNE_HPARAMS", "METHODS", "Method", "Update", "payload_bytes", "register", "select", "weighted_average",
           "with_head_finetuning"]
