"""A placeholder secret (the `change-me` of shoal's manifests) is named as such by the
commands that serve a store, never reported as a store that cannot be reached nor as a
traceback (issue 34, low items).

The store client and server say so at once (tests/unit/collectives/store/test_store_tcp.py);
`shoal run` checks the secret before it builds its rendezvous
(tests/integration/test_shoal_run_low_items.py). `core.auth.load_token` raises
AuthenticationError, a ConnectionError, so code that reads every OSError as "the store is not
there" masks it: that was `shoal run`'s "cannot reach the store rendezvous".
"""

from __future__ import annotations

import os
import subprocess
import sys


PLACEHOLDER = "change-me"
RUN_S = 120


def _run(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """`python -m module args` with the placeholder as the secret, output merged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "MASTER_"))}
    env["SHOAL_AUTH_TOKEN"] = PLACEHOLDER
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=RUN_S)


def _assert_named(result: subprocess.CompletedProcess) -> None:
    assert result.returncode != 0, result.stdout
    assert f"the placeholder '{PLACEHOLDER}'" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout, result.stdout
    for masked in ("cannot reach", "could not reach", "hosted by another process"):
        assert masked not in result.stdout, result.stdout


def test_shoal_store_names_a_placeholder_secret_in_the_variable(tmp_path):
    _assert_named(_run("shoal.launcher", "store", "--host", "127.0.0.1", "--port", "0",
                       cwd=tmp_path))


def test_the_store_module_names_a_placeholder_secret(tmp_path):
    _assert_named(_run("shoal.collectives.store.tcp", cwd=tmp_path))
