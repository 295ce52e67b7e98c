"""`bench/torch_bridge.py --hosts HxL`: the bridge's figures across hosts made as network namespaces.

H hosts (Linux network namespaces joined by veth pairs to one bridge, tests/support/netns.py;
needs root and iproute2) with L ranks each. Every rank is a process started on its host that
runs exactly what a rank of the one-host run does (`torch_bridge.rank_rows`): torch's world on
the "shoal" backend through torch's TCPStore on host 0, a gloo group of the same ranks beside it
(gloo on each host's eth0), the kinds in rotating blocks. The shoal group under the bridge sees
several hosts and takes its two-level algorithms (shared memory within a host, rings between
hosts); gloo runs its own over TCP. Rank 0 prints its rows as one protocol line on stdout; the
parent, outside the namespaces, reads them.

The veth links are software: their bandwidth is this machine's copy speed, shared with the
ranks' own work on its cores, so the figures compare algorithms and overheads, not networks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from allreduce_hosts import parse_hosts

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = "@@torch_bridge "  # rank 0's stdout line with the rows; anything else passes through
# Each run makes fresh namespaces in which nothing else listens, so a fixed port cannot clash.
PORT = 29500
WAIT_S = 1800.0


def worker(spec: list, figures: set, blocks: int, quick: bool, rank_rows) -> None:
    """One rank on its host (`--worker RANK WORLD MASTER PORT`): run the figures, and on rank 0
    print the rows for the parent."""
    rank, world, master, port = int(spec[0]), int(spec[1]), spec[2], int(spec[3])
    rows = rank_rows(rank, world, f"tcp://{master}:{port}", figures, blocks, quick,
                     ddp_any_world=True)
    if rank == 0:
        sys.stdout.write(PROTOCOL + json.dumps(rows) + "\n")
        sys.stdout.flush()


def run(spec: str, figures: set, blocks: int, quick: bool, script: str) -> list:
    """Make the hosts, start every rank of `script --worker` on its host, and return rank 0's
    rows, each marked with the layout."""
    sys.path.insert(0, str(ROOT))
    from tests.support.netns import Hosts, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        raise SystemExit(f"bench/torch_bridge.py --hosts: {reason}")
    n_hosts, per_host = parse_hosts(spec)
    world = n_hosts * per_host
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0")
    flags = ["--blocks", str(blocks)] + (["--quick"] if quick else [])
    if len(figures) == 1:
        flags += ["--only", next(iter(figures))]
    with Hosts(n_hosts) as hosts:
        procs = []
        for r in range(world):
            argv = [sys.executable, script, "--worker", str(r), str(world), hosts[0].address,
                    str(PORT), *flags]
            procs.append(hosts[r // per_host].popen(argv, stdout=subprocess.PIPE, env=env))
        deadline = time.monotonic() + WAIT_S
        outputs = []
        for r, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"rank {r} did not finish within {WAIT_S:g}s") from None
            if proc.returncode != 0:
                raise SystemExit(f"rank {r} exited with {proc.returncode} (its stderr is above)")
            outputs.append(out.decode(errors="replace"))
    rows = []
    for line in outputs[0].splitlines():
        if line.startswith(PROTOCOL):
            rows = json.loads(line[len(PROTOCOL):])
        else:
            print(f"[rank 0] {line}", file=sys.stderr)
    two_level = n_hosts > 1 and per_host > 1
    for row in rows:
        if row["two_level"] != two_level:
            raise SystemExit(f"the shoal group reports two_level={row['two_level']} on {spec}; "
                             f"expected {two_level}: the comparison would be void")
        row["hosts"] = spec
    return rows
