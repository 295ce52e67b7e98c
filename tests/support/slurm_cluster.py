"""A real Slurm cluster for tests (Debian's slurm-wlm, with munge): one `slurmd` per
network-namespace host (tests/support/netns.py), `slurmctld` on the first, one `munged` for
all (its Unix socket is shared through the file system, as a node's would be local).

Node i is named `n<i+1>` and answers at host i's address; every host resolves every node name
through its own /etc/hosts (`ip netns exec` mounts /etc/netns/<ns>/hosts there). The daemons
use fixed ports, private to the namespaces. Jobs run as root with the submitter's environment,
so they find this checkout's Python. `close()` stops every daemon and removes every file.

    with Hosts(2) as hosts, SlurmCluster(hosts) as cluster:
        job = cluster.sbatch(script_path)
        cluster.wait_for_state(job, {"COMPLETED"}, timeout=60)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

from tests.support.netns import Hosts
from tests.support.requirements import missing

STARTUP_S = 30.0
CTLD_PORT = 6817
SLURMD_PORT = 6818
_DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


def require_slurm() -> None:
    """Skip without slurm-wlm and munge (fail under CI=true)."""
    absent = [name for name in _DAEMONS if shutil.which(name) is None
              and not os.path.exists(f"/usr/sbin/{name}")]
    if absent:
        missing("the Slurm tests", f"{', '.join(absent)} not installed "
                                   "(apt-get install slurm-wlm munge)")


def _cgroup_mounts() -> str:
    """Shell commands that mount the machine's cgroup file systems under /sys/fs/cgroup again
    (each `cmd && `), read from this mount namespace's /proc/mounts."""
    commands = []
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fstype, options = line.split()[:4]
            if not point.startswith("/sys/fs/cgroup") or fstype not in ("tmpfs", "cgroup",
                                                                       "cgroup2"):
                continue
            keep = ",".join(o for o in options.split(",") if o not in ("rw", "ro", "relatime",
                                                                       "nosuid", "nodev",
                                                                       "noexec") and
                            not o.startswith(("mode=", "size=", "nr_inodes=", "uid=", "gid=")))
            opts = f"-o {keep} " if keep else ""
            commands.append(f"mkdir -p {point} && mount -t {fstype} {opts}{fstype} {point} && ")
    return "".join(commands)


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """slurmctld on hosts[0], a slurmd per host; `names[i]` is host i's node name."""

    def __init__(self, hosts: Hosts, cpus: int = 1, slurmd_timeout_s: int = 5):
        require_slurm()
        self.hosts = hosts
        self.names = [f"n{i + 1}" for i in range(len(hosts))]
        self.dir = Path(tempfile.mkdtemp(prefix="shoal-slurm-"))
        os.chmod(self.dir, 0o755)  # munged wants every directory above its socket searchable
        self.conf = self.dir / "slurm.conf"
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._etc: list[Path] = []
        self._cpus = cpus
        self._slurmd_timeout = slurmd_timeout_s

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def env(self) -> dict:
        """The environment of a Slurm client (sbatch, srun, scontrol) of this cluster; jobs
        inherit it, with this Python's directory (a virtual environment's shoal) first on
        PATH."""
        path = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        return {**os.environ, "PATH": path, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        """munged, the config, slurmctld, then every slurmd; wait until every node is idle."""
        self._hosts_files()
        self._start_munge()
        self._write_conf()
        (self.dir / "state").mkdir()
        ctld = self.hosts[0]
        self._spawn("slurmctld", ctld.popen(
            [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=self.env,
            stdout=self._log("slurmctld.out"), stderr=subprocess.STDOUT))
        for host, name in zip(self.hosts.hosts, self.names):
            (self.dir / f"spool-{name}").mkdir()
            # `ip netns exec` mounts a fresh /sys, without the cgroup file systems slurmd
            # insists on finding (even with proctrack/linuxproc): mounted again as the
            # machine has them, in the mount namespace `ip netns exec` made.
            slurmd = [_binary("slurmd"), "-D", "-N", name, "-f", str(self.conf)]
            self._spawn(f"slurmd {name}", host.popen(
                ["sh", "-c", f'{_cgroup_mounts()}exec "$@"', "sh", *slurmd], env=self.env,
                stdout=self._log(f"slurmd-{name}.out"), stderr=subprocess.STDOUT))
        self._wait_idle()

    def _log(self, name: str):
        return open(self.dir / name, "wb")

    def _spawn(self, what: str, proc: subprocess.Popen) -> None:
        self._procs.append((what, proc))

    def _hosts_files(self) -> None:
        lines = "".join(f"{h.address} {n}\n" for h, n in zip(self.hosts.hosts, self.names))
        for host in self.hosts.hosts:
            etc = Path("/etc/netns") / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            self._etc.append(etc)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{lines}")

    def _start_munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = self.dir / "munge.sock"
        proc = subprocess.Popen(
            [_binary("munged"), "-F", "--force", f"--key-file={key}",
             f"--socket={self.munge_socket}", f"--pid-file={self.dir / 'munged.pid'}",
             f"--log-file={self.dir / 'munged.log'}", f"--seed-file={self.dir / 'munged.seed'}"],
            stdin=subprocess.DEVNULL, stdout=self._log("munged.out"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self._spawn("munged", proc)
        deadline = time.monotonic() + STARTUP_S
        while not self.munge_socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                self._fail("munged did not start")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        d = self.dir
        nodes = "".join(f"NodeName={n} NodeAddr={h.address} CPUs={self._cpus} State=UNKNOWN\n"
                        for h, n in zip(self.hosts.hosts, self.names))
        self.conf.write_text(
            "ClusterName=shoaltest\n"
            # slurmctld only runs where the machine's hostname is the controller's name.
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({self.hosts[0].address})\n"
            f"SlurmctldPort={CTLD_PORT}\nSlurmdPort={SLURMD_PORT}\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={self.munge_socket}\n"
            f"StateSaveLocation={d / 'state'}\nSlurmdSpoolDir={d}/spool-%n\n"
            f"SlurmctldPidFile={d / 'slurmctld.pid'}\nSlurmdPidFile={d}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={d / 'slurmctld.log'}\nSlurmdLogFile={d}/slurmd-%n.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/linear\nSchedulerType=sched/builtin\n"
            "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            "MpiDefault=none\nSwitchType=switch/none\nReturnToService=2\nMailProg=/bin/true\n"
            f"SlurmdTimeout={self._slurmd_timeout}\nSlurmctldTimeout=10\nMessageTimeout=5\n"
            "KillWait=5\nInactiveLimit=0\nMinJobAge=600\nPropagateResourceLimits=NONE\n"
            f"{nodes}"
            f"PartitionName=debug Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE "
            "State=UP\n")

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while True:
            states = self.node_states()
            if states and all(s.upper().startswith("IDLE") for s in states.values()):
                return
            if time.monotonic() > deadline:
                self._fail(f"the nodes did not become idle (states {states})")
            for what, proc in self._procs:
                if proc.poll() is not None:
                    self._fail(f"{what} exited with {proc.returncode}")
            time.sleep(0.2)

    def close(self) -> None:
        """Stop every daemon (slurmd first), remove the hosts files and the directory."""
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for _, proc in reversed(self._procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _fail(self, why: str) -> None:
        logs = []
        for name in ("slurmctld.log", "slurmctld.out", "munged.log", *(
                f"slurmd-{n}.{ext}" for n in self.names for ext in ("log", "out"))):
            path = self.dir / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-15:]
                logs.append(f"--- {name}\n" + "\n".join(tail))
        pytest.fail(f"Slurm: {why}.\n" + "\n".join(logs))

    # ------------------------------------------------------------------ clients

    def client(self, argv: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run a Slurm client command on the controller's host."""
        return self.hosts[0].run(argv, timeout=timeout, env=self.env)

    def node_states(self) -> dict[str, str]:
        """{node name: state} from `sinfo` ({} if the controller does not answer)."""
        done = self.client(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
        if done.returncode != 0:
            return {}
        return dict(line.split() for line in done.stdout.splitlines() if line.strip())

    def sbatch(self, script: Path, options=(), args=()) -> int:
        """Submit `script` with sbatch `options` and the script's own `args`; returns the job
        id."""
        done = self.client(["sbatch", "--parsable", *options, str(script), *args])
        if done.returncode != 0:
            self._fail(f"sbatch failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job_state(self, job: int) -> Optional[str]:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, ...), None if unknown."""
        done = self.client(["scontrol", "show", "job", str(job)], timeout=15)
        match = re.search(r"JobState=(\S+)", done.stdout)
        return match.group(1) if match else None

    def wait_for_state(self, job: int, states: set, timeout: float) -> str:
        """Wait until the job is in one of `states`; fail with the logs otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job)
            if state in states:
                return state
            if time.monotonic() > deadline:
                self._fail(f"job {job} is {state}, not {sorted(states)}, after {timeout:g}s")
            time.sleep(0.25)
