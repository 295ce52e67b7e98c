"""The launcher's own log lines on stderr: their format, and the levels `shoal run` and
`shoal store` log at."""

from __future__ import annotations

import logging
import sys

from shoal.core import settings as core_settings
from shoal.core.config import SettingError

logger = logging.getLogger("shoal.run")

# Where the launcher's own log lines go, and their prefix.
LOG_FORMAT = "[shoal] %(asctime)s.%(msecs)03d %(levelname)s %(message)s"


def configure_logging() -> None:
    """The launcher's and agent's own news at INFO, other layers' at WARNING, unless
    SHOAL_LOG_LEVEL sets one level for everything (a bad one is warned about, not fatal)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    try:
        level = core_settings.LOG_LEVEL.get()
    except SettingError:
        raw = core_settings.LOG_LEVEL.raw() or ""
        logger.warning("%s=%r is not a logging level; using the defaults",
                       core_settings.LOG_LEVEL.name, raw.strip().upper())
        level = None
    if level:
        root.setLevel(level.upper())
        return
    root.setLevel(logging.WARNING)
    logging.getLogger("shoal").setLevel(logging.INFO)
