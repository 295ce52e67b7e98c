"""The `shoal` command line: `shoal run` starts an elastic job, `shoal store` a standalone store."""

from shoal.launcher.cli import main  # noqa: F401  (re-export)
