"""Hosts for multi-host tests: Linux network namespaces joined by veth pairs to one bridge.

Each `Host` is a network namespace with its own loopback and one interface (`eth0`) on a private
subnet that exists only inside the namespaces made here; the bridge sits in a namespace of its
own, so nothing is added to the machine's own network. Processes started on a host see only
that host's interfaces (so abstract Unix sockets and loopback are per host, as on real
machines). `cut(host)` tears a host off the network and kills everything it runs, as a lost
machine would look to the others. `link_gbit` shapes every host's link to that rate each way
(tbf on both ends of its veth), so a test or bench can see a network that bounds by bandwidth
rather than by the CPU that the unshaped software links here cost.

Needs root and iproute2. Without them `require_netns()` fails the test under CI=true (CI must
run them) and skips it elsewhere, with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

from tests.support.requirements import missing

# A subnet used only between the namespaces made here (never routed anywhere else).
SUBNET = "10.213.47"
PREFIX_LEN = 24
_IP_TIMEOUT_S = 10.0
# A shaped link's queue: deep enough that TCP's window, not tail drops, decides its pace (a
# drop costs a retransmission timeout and makes the figures jump), as a switch port buffers.
_SHAPER_QUEUE_S = 0.1


def netns_unavailable_reason() -> Optional[str]:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    probe = f"shoal-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=_IP_TIMEOUT_S)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_IP_TIMEOUT_S)
    return None


def require_netns() -> None:
    """Skip the test when hosts cannot be made here; fail it under CI=true."""
    reason = netns_unavailable_reason()
    if reason is not None:
        missing("the multi-host tests", reason)


def require_link_shaping() -> None:
    """Skip the test when links cannot be shaped here (no `tc`, or a kernel without tbf);
    fail it under CI=true. Call after require_netns()."""
    # Named as Hosts names its namespaces, so a run killed mid-probe has it removed later.
    probe = f"shoal-{_run_tag()}-probe"
    _ip("netns", "add", probe)
    try:
        _tc("qdisc", "add", "dev", "lo", "root", *shaper_args(1.0), netns=probe)
    except RuntimeError as exc:
        missing("the link-shaping tests", str(exc))
    finally:
        _delete_netns(probe)


def _ip(*args: str, netns: Optional[str] = None) -> None:
    argv = ["ip"] + (["-n", netns] if netns else []) + list(args)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


_OURS = re.compile(r"^shoal-(\d+)\.(\d+)-[0-9a-f]{8}-(?:sw|h\d+|probe)$")


def _tc(*args: str, netns: str) -> None:
    argv = ["tc", "-n", netns] + list(args)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except FileNotFoundError:
        raise RuntimeError("shaping a link needs iproute2's `tc`, which is not installed") from None
    if done.returncode != 0:
        hint = (" (shaping needs the kernel's sch_tbf)"
                if "unknown" in done.stderr.lower() or "module" in done.stderr.lower() else "")
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}{hint}")


def shaper_args(gbit: float) -> list[str]:
    """tbf's arguments for `gbit` Gbit/s: a burst of 1/5 ms of traffic (at least two 64 KiB
    segments, which veth passes unsplit) and a queue of _SHAPER_QUEUE_S."""
    rate = int(gbit * 1e9)  # bit/s
    burst = max(128 * 1024, rate // 8 // 5000)
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst),
            "latency", f"{int(_SHAPER_QUEUE_S * 1000)}ms"]


def _run_tag() -> str:
    """This process's pid and start time, and a random part: in every namespace name made
    here, they let a later run remove what a killed run left (and never what a live one
    holds, even after pid reuse; see _OURS)."""
    return f"{os.getpid()}.{_start_time(os.getpid())}-{uuid.uuid4().hex[:8]}"


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None
    when it does not exist: with the pid it names one process across pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=_IP_TIMEOUT_S)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _kill_everything_in(netns: str) -> None:
    listed = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                            timeout=_IP_TIMEOUT_S)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _delete_netns(name: str) -> None:
    for _ in range(50):  # a namespace whose last process is still exiting is busy
        done = subprocess.run(["ip", "netns", "del", name], capture_output=True,
                              timeout=_IP_TIMEOUT_S)
        if done.returncode == 0 or not os.path.exists(f"/run/netns/{name}"):
            return
        time.sleep(0.1)


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces (and kill what runs in them) that a test process which no longer
    exists made: a run killed before its cleanup (SIGKILL, a CI timeout) leaves them behind.
    Returns their names."""
    stale = []
    for name in _namespaces():
        match = _OURS.match(name)
        if match is None or _start_time(int(match.group(1))) == match.group(2):
            continue  # not ours, or its maker still runs
        _kill_everything_in(name)
        _delete_netns(name)
        stale.append(name)
    return stale


@dataclass
class Host:
    """One namespace: `address` is its eth0 address, `netns` its name for `ip netns exec`."""

    index: int
    netns: str
    address: str
    switch_port: str
    procs: list = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on this host in a session of its own (killed by `cut` and cleanup)."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 30.0, **kwargs):
        """Run `argv` on this host to completion (captured output, bounded by `timeout`)."""
        return subprocess.run(self.command(argv), capture_output=True, text=True,
                              timeout=timeout, **kwargs)


class Hosts:
    """`n` hosts on one bridge; use as a context manager, which removes everything it made."""

    def __init__(self, n: int, mtu: Optional[int] = None, link_gbit: Optional[float] = None):
        if n < 1:
            raise ValueError(f"Hosts needs at least one host, got {n}.")
        if mtu is not None and not 68 <= mtu <= 65535:
            raise ValueError(f"Hosts' mtu must be within 68 and 65535 bytes, got {mtu}.")
        if link_gbit is not None and not 0.01 <= link_gbit <= 400:
            raise ValueError(f"Hosts' link_gbit must be within 0.01 and 400 Gbit/s, "
                             f"got {link_gbit}.")
        # None keeps the kernel's default for veth and bridges: 1500, plain Ethernet.
        self.mtu = mtu
        # None: unshaped (the links run as fast as the CPUs copy).
        self.link_gbit = link_gbit
        tag = _run_tag()
        self.switch = f"shoal-{tag}-sw"
        self.hosts = [Host(i, f"shoal-{tag}-h{i}", f"{SUBNET}.{i + 1}", f"p{i}")
                      for i in range(n)]
        self._made: list[str] = []

    def __enter__(self) -> "Hosts":
        remove_stale_namespaces()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("link", "set", "lo", "up", netns=name)

    def _make(self) -> None:
        self._add_netns(self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for host in self.hosts:
            self._add_netns(host.netns)
            # Both ends are created inside their namespaces: no name ever appears outside.
            _ip("link", "add", "eth0", "netns", host.netns, "type", "veth",
                "peer", "name", host.switch_port, "netns", self.switch)
            if self.mtu is not None:
                _ip("link", "set", "eth0", "mtu", str(self.mtu), netns=host.netns)
                _ip("link", "set", host.switch_port, "mtu", str(self.mtu), netns=self.switch)
            _ip("link", "set", host.switch_port, "master", "br0", netns=self.switch)
            _ip("link", "set", host.switch_port, "up", netns=self.switch)
            _ip("addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", "eth0", netns=host.netns)
            _ip("link", "set", "eth0", "up", netns=host.netns)
            if self.link_gbit is not None:
                # Out of the host on its eth0, into it on the switch's port: a full-duplex NIC.
                shaper = shaper_args(self.link_gbit)
                _tc("qdisc", "add", "dev", "eth0", "root", *shaper, netns=host.netns)
                _tc("qdisc", "add", "dev", host.switch_port, "root", *shaper, netns=self.switch)

    def cut(self, host: Host) -> None:
        """Take `host` off the network and kill everything running on it (a lost machine)."""
        _ip("link", "del", host.switch_port, netns=self.switch)
        self._kill(host)

    def _kill(self, host: Host) -> None:
        # Every process in the namespace, including those started by processes we started.
        _kill_everything_in(host.netns)
        for proc in host.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Kill every process on every host and delete every namespace made (idempotent)."""
        for host in self.hosts:
            if host.netns in self._made:
                self._kill(host)
        for name in reversed(self._made):
            _delete_netns(name)
        self._made.clear()
