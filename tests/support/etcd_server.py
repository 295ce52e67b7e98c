"""A real etcd (Debian's etcd-server) on loopback with a temporary data dir, for tests.

etcd binds port 0 for clients and peers and logs the client port it got; the helper reads it
back from the log. `stop()` and `start()` keep the data dir and, on restart, listen on the
port etcd chose the first time, so clients keep their endpoint across an outage.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Optional, Sequence

import pytest

from tests.support.requirements import missing

STARTUP_S = 30.0
STOP_S = 10.0
MAX_REQUEST_BYTES = 32 * 1024 * 1024
_SERVING = re.compile(rb"serving insecure client requests on [0-9.]+:(\d+)")
_READY = re.compile(rb"ready to serve client requests")


def etcd_binary() -> Optional[str]:
    """The etcd executable, or None if etcd-server is not installed."""
    return shutil.which("etcd") or (os.path.exists("/usr/bin/etcd") and "/usr/bin/etcd") or None


def require_etcd() -> str:
    """The etcd executable; skips the test without one, or fails it under CI=true."""
    binary = etcd_binary()
    if binary is None:
        missing("the etcd tests", "etcd is not installed (apt-get install etcd-server)")
    return binary


class EtcdServer:
    """One single-member etcd process; `endpoint` is 'host:port' once started."""

    def __init__(self, binary: Optional[str] = None, data_root: Optional[str] = None,
                 host: str = "127.0.0.1", command_prefix: Sequence[str] = ()):
        # `host` and `command_prefix` serve multi-host tests: etcd runs inside a test host
        # (`ip netns exec NS`) and listens on that host's address.
        self.binary = binary or require_etcd()
        self.host = host
        self.command_prefix = list(command_prefix)
        # tmpfs keeps etcd's fsyncs cheap on a busy CI disk.
        root = data_root or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.workdir = tempfile.mkdtemp(prefix="shoal-etcd-", dir=root)
        self.data_dir = os.path.join(self.workdir, "data")
        self.log_path = os.path.join(self.workdir, "etcd.log")
        self.port: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self._log_offset = 0

    @property
    def endpoint(self) -> str:
        """'host:port' of the client listener."""
        if self.port is None:
            raise RuntimeError("etcd was never started")
        return f"{self.host}:{self.port}"

    def start(self) -> "EtcdServer":
        """Start etcd (on its first port after a stop) and wait until it serves clients."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("etcd is already running")
        client = f"http://{self.host}:{self.port or 0}"
        args = self.command_prefix + [
            self.binary, "--name", "shoal-test", "--data-dir", self.data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", f"http://{self.host}:0",
            "--initial-advertise-peer-urls", f"http://{self.host}:0",
            "--initial-cluster", f"shoal-test=http://{self.host}:0",
            "--enable-grpc-gateway=false", "--log-level", "info",
            # The Store contract sends 4 MiB values; etcd's default limit is 1.5 MiB.
            "--max-request-bytes", str(MAX_REQUEST_BYTES),
        ]
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.workdir, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        end = time.monotonic() + STARTUP_S
        port = None
        while time.monotonic() < end:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read()
            match = _SERVING.search(text)
            if match:
                port = int(match.group(1))
            if port and _READY.search(text):
                self.port = port
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"etcd did not start within {STARTUP_S:g}s (exit code {self.proc.returncode});"
                    f" log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM etcd and wait for it to exit (SIGKILL after STOP_S)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL etcd."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_S)

    def restart(self, downtime: float) -> None:
        """Stop etcd, stay down for `downtime` seconds, start it again on the same port."""
        self.stop()
        time.sleep(downtime)
        self.start()

    def close(self) -> None:
        """Stop etcd and remove its data."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
