"""How the model sits in memory: the channels-last layout of `training.channels_last`.

Owns the one decision of whether a model's 4-d weights take the NHWC layout on a device, and
applying it. The engine and the benchmarks' plain training loops lay models out through
`use_layout`, so both measure the same layout.
"""

from __future__ import annotations

import torch


def channels_last(setting: bool | str, device: torch.device) -> bool:
    """Whether the model's 4-d weights take the channels-last layout: `training.channels_last`
    true/false, or "auto" = on the CPU only (measured faster there for every conv model of the
    registry, benchmarks/layouts.py; on GPUs FP32 NHWC is not known to pay)."""
    return device.type == "cpu" if setting == "auto" else bool(setting)


def use_layout(model: torch.nn.Module, setting: bool | str, device: torch.device) -> torch.nn.Module:
    """`model` (in place) in the layout `training.channels_last` = `setting` gives it on `device`:
    NHWC convolution weights where `channels_last` says so (faster CPU (oneDNN) and tensor-core
    convolutions; the same initial values, results equal to floating-point tolerance, not bit
    for bit). The engine and the benchmarks' plain loops lay models out through this."""
    return model.to(memory_format=torch.channels_last) if channels_last(setting, device) else model
