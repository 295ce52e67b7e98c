"""What a test needs from the machine (a real etcd, Prometheus, root for network namespaces):
in CI a missing one fails the test, since CI must run it; elsewhere it skips with the reason."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(what: str, reason: str) -> NoReturn:
    """Fail under CI=true, skip elsewhere; `what` names the tests ("the etcd tests")."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; CI must run {what}.")
    pytest.skip(reason)
