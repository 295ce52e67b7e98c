"""Shared fixtures for core's unit tests."""

import pytest

from shoal import core


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Each test starts from the same global generator state, so random data is reproducible."""
    core.manual_seed(1234)
