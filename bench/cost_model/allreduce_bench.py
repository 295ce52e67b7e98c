"""bench/allreduce.py run as a child process: its all_reduce rows, for the check and for
veth's calibration on shoal's own ring."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Sequence

from .constants import ROOT


def has_hosts_mode() -> bool:
    """True once bench/allreduce.py takes --hosts (the multi-host mode)."""
    return "--hosts" in (ROOT / "bench" / "allreduce.py").read_text()


def allreduce_rows(args: Sequence[str], timeout: float) -> list[dict]:
    """bench/allreduce.py's JSON rows for all_reduce."""
    argv = [sys.executable, str(ROOT / "bench" / "allreduce.py"), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout)[-2000:]}")
    rows = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if row.get("op") == "all_reduce" and "bytes" in row:
                rows.append(row)
    return rows
