"""fedrepro: a reproducible benchmark workflow for personalized and fair federated learning."""

from . import kernels as _kernels

# before any torch operation: the CPU kernels capped at one instruction level (fedrepro/kernels.py).
# A bad FEDREPRO_KERNELS is refused by the commands that train (kernels.requested), not at import.
try:
    _kernels.apply()
except _kernels.KernelLevelError:
    pass

from .registry import set_plugin_loader  # noqa: E402
from .version import __version__  # noqa: F401 (its own module: submodules read it without importing this one)


def _load_plugins(group: str) -> None:
    # Imported at the first registry lookup, not here: `import fedrepro` stays cheap, and the
    # registry module never imports the plugins (nor, through them, the built-in components).
    from .plugins import ensure_loaded

    ensure_loaded(group)


set_plugin_loader(_load_plugins)
