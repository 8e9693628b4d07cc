"""Make Snakemake read `--configfile` with fedrepro's strict reader instead of YTE.

Snakemake 9 reads every `--configfile` in its own process before any line of the Snakefile
runs: `snakemake.cli.args_to_api` builds `snakemake.settings.types.ConfigSettings`, whose
`__post_init__` calls `snakemake.common.configfile.load_configfile` -> `_load_configfile`,
which tries `json.load` and then `yte.process_yaml(f, require_use_yte=True)`. A YAML file
with a top-level `__use_yte__: true` is then a YTE template: `?expr` values and
`__definitions__` are evaluated as Python. The Snakefile cannot prevent that (it runs later).

What does run earlier is the parsing of the workflow profile (snakemake.cli.parse_args,
before args_to_api), and Snakemake itself renders a profile that sets `__use_yte__: true`
with YTE. fedrepro's profiles (workflow/profiles/local, workflow/profiles/slurm and the
default profile profiles/default that Snakemake uses when no --workflow-profile is given)
therefore call `install()` from their `__definitions__`. It replaces Snakemake's config-file
reader with `load_configfile` below, which reads the file with fedrepro.configfile (plain
YAML/JSON: no tags, no YTE, no duplicate keys, no aliases beyond a small budget, finite
numbers) and stops Snakemake with a one-line message otherwise. Nothing in the config file
is evaluated. See docs/security.md for what this does not cover.
"""

from __future__ import annotations

import sys
from pathlib import Path

PREFIX = "fedrepro: invalid experiment config: "
_PATCHED = [("snakemake.common.configfile", "load_configfile"), ("snakemake.settings.types", "load_configfile")]


def load_configfile(configpath) -> dict:
    """Snakemake's `load_configfile`, reading strictly; exits with the message on a bad file."""
    from .configfile import read_config_file
    from .registry import ConfigError, show

    try:
        config = read_config_file(Path(configpath))
        if not isinstance(config, dict):
            raise ConfigError(f"config key '(top level)' has value {show(config)}; allowed: a mapping of the experiment's keys")
    except ConfigError as exc:
        sys.exit(f"{PREFIX}{exc}")
    return config


def install() -> None:
    """Route Snakemake's config-file reading through `load_configfile`. Fails closed: if the
    installed Snakemake no longer has the functions replaced here, the profile fails to load
    (Snakemake stops) instead of silently reading configs with YTE."""
    import importlib

    for module_name, attr in _PATCHED:
        module = importlib.import_module(module_name)
        if not callable(getattr(module, attr, None)):
            raise RuntimeError(f"fedrepro's config guard cannot find {module_name}.{attr} in this Snakemake version; "
                               "refusing to run without it (see docs/security.md)")
        setattr(module, attr, load_configfile)


def installed() -> bool:
    import importlib

    return all(getattr(importlib.import_module(m), a, None) is load_configfile for m, a in _PATCHED)
