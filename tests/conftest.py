"""Suite-wide settings: a fixed auth token for spawned ranks and no stray BLAS threads."""

import os

# Every process the suite starts inherits these, so ranks agree on the secret and numpy's BLAS
# does not oversubscribe the two cores CI has.
os.environ.setdefault("SHOAL_AUTH_TOKEN", "shoal-test-suite-token")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest

# The message every listener or dial gives when it refuses the development token off loopback.
DEVELOPMENT_TOKEN_RULE = (
    r"which is not a loopback address, and no secret is set: set SHOAL_AUTH_TOKEN")


@pytest.fixture
def no_secret(monkeypatch):
    """No secret anywhere in the environment: shoal falls back to its development token."""
    for name in ("SHOAL_AUTH_TOKEN", "SHOAL_AUTH_TOKEN_FILE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
