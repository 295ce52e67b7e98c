"""A real Prometheus (Debian's `prometheus`) for tests: port 0, read back from its log.

`PrometheusServer(targets).start()` writes a scrape config for `targets` ("host:port" strings),
starts Prometheus on 127.0.0.1:0 with a temporary TSDB, reads the bound port from its
"Listening on" log line, and waits until /-/ready answers. `query(expr)` runs an instant query;
given `rules`, Prometheus evaluates them and `alerts()` / `wait_for_alert()` read its alerts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional, Sequence

import pytest

from tests.support.requirements import missing

STARTUP_S = 30.0
_LISTENING = re.compile(rb'msg="Listening on" address=(?:\[[^\]]*\]|[0-9.]+):(\d+)')


def require_prometheus() -> str:
    """The prometheus executable; skips without one, or fails under CI=true."""
    binary = shutil.which("prometheus")
    if binary is None:
        missing("the Prometheus tests", "prometheus is not installed (apt-get install prometheus)")
    return binary


class PrometheusServer:
    """One Prometheus process scraping `targets` every `interval`."""

    def __init__(self, targets: Sequence[str], interval: str = "500ms", job: str = "shoal",
                 rules: Optional[str] = None):
        self.binary = require_prometheus()
        self.workdir = tempfile.mkdtemp(prefix="shoal-prometheus-")
        self.config_path = os.path.join(self.workdir, "prometheus.yml")
        self.log_path = os.path.join(self.workdir, "prometheus.log")
        targets_yaml = ", ".join(f'"{t}"' for t in targets)
        # With `rules` (a rules file's path) they are evaluated at the scrape interval.
        rule_config = "" if rules is None else f"rule_files: [\"{rules}\"]\n"
        evaluation = "" if rules is None else f"  evaluation_interval: {interval}\n"
        with open(self.config_path, "w") as f:
            f.write(
                "global:\n"
                f"  scrape_interval: {interval}\n"
                f"  scrape_timeout: {interval}\n"
                + evaluation + rule_config +
                "scrape_configs:\n"
                f"  - job_name: {job}\n"
                "    static_configs:\n"
                f"      - targets: [{targets_yaml}]\n"
            )
        self.port: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "PrometheusServer":
        """Start Prometheus and wait until it is ready; fail with its log otherwise."""
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config_path}",
             "--web.listen-address=127.0.0.1:0",
             f"--storage.tsdb.path={os.path.join(self.workdir, 'data')}",
             "--log.level=info"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.port is None:
                with open(self.log_path, "rb") as f:
                    match = _LISTENING.search(f.read())
                if match:
                    self.port = int(match.group(1))
            if self.port is not None:
                try:
                    with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                        if reply.status == 200:
                            return self
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.05)
        self.close()
        pytest.fail(f"Prometheus did not become ready within {STARTUP_S:g}s; "
                    f"log:\n{self.log_tail()}")

    def query(self, expr: str, at: Optional[float] = None) -> list[dict]:
        """An instant query (at Unix time `at`, default now); returns the result vector (a list
        of {metric, value})."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for_series(self, expr: str, timeout: float) -> list[dict]:
        """Query until `expr` returns at least one series; fail naming it otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() >= deadline:
                targets = urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5).read()
                pytest.fail(f"Prometheus has no series for {expr!r} after {timeout:g}s; "
                            f"targets: {targets[:2000]!r}")
            time.sleep(0.2)

    def alerts(self, name: Optional[str] = None, state: str = "firing") -> list[dict]:
        """The alerts in `state` ("firing", "pending"; None: either), of `name` (None: all)."""
        with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=5) as reply:
            body = json.loads(reply.read())
        return [a for a in body["data"]["alerts"]
                if (name is None or a["labels"]["alertname"] == name)
                and (state is None or a["state"] == state)]

    def wait_for_alert(self, name: str, timeout: float, count: int = 1) -> list[dict]:
        """Wait until at least `count` alerts `name` fire; fail naming it otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            firing = self.alerts(name)
            if len(firing) >= count:
                return firing
            if time.monotonic() > deadline:
                pytest.fail(f"{name} is not firing ({len(firing)} of {count}) after {timeout:g}s;"
                            f" all alerts: {self.alerts(state=None)}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of Prometheus's log."""
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Stop Prometheus and remove its files."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "PrometheusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
