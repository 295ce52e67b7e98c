"""The `SHOAL_*` variables the launcher reads besides its flags (see `core.config`; each flag's
own `SHOAL_<FLAG>` variable is in the flag table, `launcher.flags`), and the check of every
layer's table that `shoal run` and `shoal store` make before anything starts."""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Mapping, Optional

from shoal.core import settings as core_settings
from shoal.core.config import Setting, SettingError, SettingsTable, check_all

METRICS_PASSWORD = Setting(
    "SHOAL_METRICS_PASSWORD", "secret", None,
    "The basic auth password `shoal top --user` sends to an agent's /metrics when no "
    "--password-file is given (never on the command line).")

TABLE = SettingsTable(
    "launcher", "`shoal run`, `shoal store` and `shoal top`, besides their flags.",
    (METRICS_PASSWORD,))

# Every layer's table, bottom layer first. Imported when checked, not with this module: the
# rpc_agent package loads grpc and prometheus_client, and `shoal run` must take
# PROMETHEUS_MULTIPROC_DIR out of its environment before prometheus_client is imported.
LAYER_TABLES = ("shoal.core.settings", "shoal.collectives.settings", "shoal.rpc_agent.settings",
                "shoal.elastic.settings", "shoal.launcher.settings")


# Tables whose package is costly to import (rpc_agent's __init__ loads its API: grpc, protobuf,
# numpy; 0.1-0.2 s on `shoal run`'s way to its workers). `shoal run` reads them only when a
# SHOAL_* variable that no other table declares is set, which theirs would be.
COSTLY_TABLES = ("shoal.rpc_agent.settings",)


def layer_tables() -> list[SettingsTable]:
    """Every layer's settings table, bottom layer first."""
    return [importlib.import_module(name).TABLE for name in LAYER_TABLES]


def _tables_to_check(env: Mapping[str, str]) -> list[SettingsTable]:
    """The tables a set variable may belong to, bottom layer first: every cheap one, and the
    costly ones only if some SHOAL_* variable is set that no cheap one declares."""
    cheap = {name: importlib.import_module(name).TABLE for name in LAYER_TABLES
             if name not in COSTLY_TABLES}
    declared = set().union(*(table.names() for table in cheap.values()))
    others = any(key.startswith("SHOAL_") and key not in declared for key in env)
    return [cheap[name] if name in cheap else importlib.import_module(name).TABLE
            for name in LAYER_TABLES if name in cheap or others]


def check_every_layer(environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse every `SHOAL_*` variable that is set, so that a bad value stops the command before
    any worker starts instead of failing inside one.

    SHOAL_LOG_LEVEL is left out: the launcher warns about a bad one and goes on with its own
    defaults (see `cli`).

    Raises:
        SettingError: the first bad value, bottom layer first.
    """
    env = dict(os.environ if environ is None else environ)
    env.pop(core_settings.LOG_LEVEL.name, None)
    check_all(_tables_to_check(env), env)


def check_or_exit(parser: argparse.ArgumentParser) -> None:
    """`check_every_layer`, where a bad value ends in `parser`'s usage error (exit status 2)
    naming the variable, the rule and the value."""
    try:
        check_every_layer()
    except SettingError as exc:
        parser.error(str(exc))
