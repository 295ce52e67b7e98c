"""Every calibration measurement of the cost model, raw (JSON-able, so that a saved run can be
refitted): the peers' timings over each path, memory, shoal's own calls, and other work's load
during each."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from .allreduce_bench import allreduce_rows, has_hosts_mode
from .constants import ROOT, SCRIPT
from .load import LoadSampler
from .units import KiB, MiB


def _peer_argv() -> list[str]:
    """The command line that starts one of `peer.peer_main`'s roles."""
    return [sys.executable, str(SCRIPT), "--peer"]


def _last_json(stdout: str) -> dict:
    """A peer's result: the last line it printed, as JSON."""
    return json.loads(stdout.strip().splitlines()[-1])


def _run_pair(serve_prefix: list, drive_prefix: list, family: str, address: str,
              reps: int) -> dict:
    """Start a serving peer, then a driving one; return the driver's timings."""
    name = address if family != "unix" else f"shoal-scale-{uuid.uuid4().hex[:8]}"
    server = subprocess.Popen(serve_prefix + _peer_argv() + ["serve", family, name],
                              stdout=subprocess.PIPE, text=True)
    try:
        where = server.stdout.readline().strip()  # bounded: the peer's accept times out
        if not where:
            raise RuntimeError(f"the {family} peer did not start")
        port = where if family != "unix" else "0"
        done = subprocess.run(drive_prefix + _peer_argv() + ["drive", family, name, port,
                                                             str(reps)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"the {family} measurement failed: {done.stderr[-2000:]}")
        server.wait(30)
        return {kind: {int(n): t for n, t in by_size.items()}
                for kind, by_size in _last_json(done.stdout).items()}
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


def _run_shoal_calls(reps: int, transport: str) -> dict:
    """Both ranks of `_shoal_calls`, as subprocesses; rank 0's timings."""
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Late: the variables' declared names are all this process needs of shoal, and importing
    # the collectives layer costs the fitting-only paths (--replay, the unit tests) nothing.
    from shoal.collectives import settings as collective_settings
    from shoal.core import settings as core_settings

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env[collective_settings.LOCAL_TRANSPORT.name] = transport
    env[collective_settings.SPIN_US.name] = "0"  # receivers sleep: the model's a^block
    env.setdefault(core_settings.AUTH_TOKEN.name, uuid.uuid4().hex)
    procs = [subprocess.Popen(_peer_argv() + ["shoal-calls", str(r), str(port), str(reps),
                                              transport],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(p.returncode for p in procs):
        raise RuntimeError("the shoal calls measurement failed: "
                           + " | ".join(err[-1500:] for _, err in outs))
    return _last_json(outs[0][0])


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (32 MiB when sysfs does not say)."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": KiB, "M": MiB}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KM")) * scale)
    return best or 32 * MiB


def _veth_hosts():
    """Two network-namespace hosts, or (None, why not)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        from tests.support.netns import Hosts, netns_unavailable_reason
    except ImportError as exc:
        return None, f"tests.support.netns is not importable ({exc})"
    reason = netns_unavailable_reason()
    if reason:
        return None, reason
    return Hosts(2), None


def measure(reps: int) -> dict:
    """Every calibration measurement, raw (JSON-able: `fit_model` turns it into the model, now
    or when a saved run is replayed), with other work's load during each."""
    raw, loads = {"llc_bytes": last_level_cache_bytes()}, {}
    for name, family, address in (("unix", "unix", ""), ("tcp_lo", "tcp", "127.0.0.1")):
        with LoadSampler() as load:
            raw[name] = _run_pair([], [], family, address, reps)
        loads[name] = load.background
    made, reason = _veth_hosts()
    if made is None:
        print(f"veth: not measured ({reason}); tcp_lo's figures stand in for it")
    else:
        with made as hosts, LoadSampler() as load:
            raw["veth"] = _run_pair(hosts[0].command([]), hosts[1].command([]), "tcp",
                                    hosts[0].address, reps)
        loads["veth"] = load.background
    with LoadSampler() as load:
        done = subprocess.run(_peer_argv() + ["memory", str(reps)], capture_output=True,
                              text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the memory measurement failed: {done.stderr[-2000:]}")
    raw["memory"] = _last_json(done.stdout)
    loads["memory"] = load.background
    with LoadSampler() as load:
        raw["shoal_calls"] = _run_shoal_calls(reps, "unix")
        raw["shoal_shm"] = _run_shoal_calls(reps, "shm")
    loads["shoal"] = load.background
    if made is not None and has_hosts_mode():
        with LoadSampler() as load:
            raw["veth_ring"] = _veth_ring_rows(reps)
        loads["veth_ring"] = load.background
    raw["background"] = loads
    return raw


def _veth_ring_rows(reps: int) -> list[dict]:
    """bench/allreduce.py's rows of shoal's all_reduce on 2 hosts x 1 rank, 256 KiB and up."""
    argv = ["--hosts", "2x1", "--json", "--no-compare", "--ops", "all_reduce",
            "--min-bytes", str(256 * KiB)] + (["--quick"] if reps < 9 else [])
    return [{key: row[key] for key in ("bytes", "shoal_ms", "shoal_cpu_ms") if key in row}
            for row in allreduce_rows(argv, timeout=600)]
