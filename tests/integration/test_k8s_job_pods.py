"""The rendered Kubernetes Job run as a cluster would run it, without a cluster.

Each pod of `deploy/kubernetes/overlays/cpu`'s Indexed Job is one process group in its own
network namespace with its own address (tests/support/netns.py), started with exactly the
container's command line: the image's entry point (deploy/Dockerfile) without tini, which is
not installed here, and the container's args. Its environment is the image's ENV plus the
container's env, resolved as the kubelet does: field references (the Job's uid and name, the
completion index, the pod IP), the Secret's value from the rendered Secret, `$(VAR)` expansion.
The only changes are paths: the mounts (/checkpoints, /tmp) and /dev/termination-log point at
test directories. `etcd-0.etcd` resolves, through the namespace's own /etc/hosts, to a real
etcd running in a third namespace on the port the manifests name.

The pods' root filesystem is read-only, as the manifests declare (readOnlyRootFilesystem):
each pod runs in a mount namespace of its own where `/` is remounted read-only and only its
volumes (the /tmp emptyDir, the checkpoint volume) and its termination-log file are writable,
so a write anywhere else fails the job instead of passing unnoticed.

The Job completes; a second Job object made from the same manifests (a new uid) completes from
a clean rendezvous; and a worker killed in one pod is recovered by the agents. The Kubeflow
Trainer v2 variant's two pods run the same way, on the variables the Trainer injects, and the
JobSet variant's on the labels and names JobSet gives its pods.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.kustomize import render
from tests.support.netns import Hosts, require_netns

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
JOB_TIMEOUT = 150
TOKEN = uuid.uuid4().hex * 2
_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


# ----------------------------------------------------------------------------- the manifests

def _rendered(tmp_path, variant="overlays/cpu") -> dict:
    tree = tmp_path / "kubernetes"
    if not tree.exists():
        shutil.copytree(KUBERNETES, tree)
        (tree / "common" / "secrets" / "token").write_text(TOKEN)
    return {(o["kind"], o["metadata"]["name"]): o for o in render(tree / variant)}


def _image() -> tuple[list[str], dict]:
    """The Dockerfile's entry point (tini dropped) and ENV."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "deploy" / "Dockerfile").read_text())
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(\w+)=(\S+)", line[4:]))
        elif line.startswith("ENTRYPOINT "):
            import json

            entrypoint = json.loads(line[len("ENTRYPOINT "):])
    assert entrypoint[:2] == ["/usr/bin/tini", "--"], entrypoint
    if not os.path.exists("/usr/bin/tini"):
        entrypoint = entrypoint[2:]  # the init process only forwards signals and reaps
    return entrypoint, env


class Pod:
    """One pod of the Job: its namespace, directories, process and output."""

    def __init__(self, host, template: dict, index: int, shared: Path, root: Path,
                 secret: dict, fields: dict, injected: dict):
        self.host, self.index = host, index
        self.dir = root / f"pod-{index}"
        (self.dir / "tmp").mkdir(parents=True)
        spec = template["spec"]
        container = spec["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        # Mount paths -> test directories: the PVC is shared by every pod, an emptyDir is not.
        self.paths = {"/dev/termination-log": str(self.dir / "termination-log")}
        for path, name in mounts.items():
            shared_volume = "persistentVolumeClaim" in volumes[name]
            self.paths[path] = str(shared if shared_volume else self.dir / name)
        entrypoint, image_env = _image()
        # HOME as the runtime sets it from the image's /etc/passwd (user 10001 has no home
        # directory there), unless the image's ENV says otherwise.
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": "/home/shoal",
               **{k: self._mapped(v) for k, v in image_env.items()}, **injected}
        for item in container["env"]:
            if "value" in item:
                value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                               item["value"])
            else:
                ref = item["valueFrom"]
                if "secretKeyRef" in ref:
                    key = ref["secretKeyRef"]
                    value = base64.b64decode(secret[key["name"]]["data"][key["key"]]).decode()
                elif ref["fieldRef"]["fieldPath"] == "status.podIP":
                    value = host.address
                else:
                    value = fields[_FIELD.fullmatch(ref["fieldRef"]["fieldPath"]).groups()]
            env[item["name"]] = self._mapped(value)
        self.env = env
        self.argv = [self._mapped(a) for a in entrypoint + container["args"]]
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = None

    def _mapped(self, value: str) -> str:
        for path, target in self.paths.items():
            if value == path or value.startswith(path + "/"):
                return target + value[len(path):]
        return value

    def writable(self) -> list[str]:
        """What the pod may write: its volumes and its termination-log file (the kubelet
        creates that one, empty)."""
        paths = sorted(set(self.paths.values()))
        for path in paths:
            if path.endswith("termination-log"):
                Path(path).touch()
            else:
                os.makedirs(path, exist_ok=True)
        return paths

    def sandboxed(self, argv) -> list[str]:
        """`argv` in a mount namespace whose root is read-only but for the pod's volumes."""
        binds = "".join(f"mount --bind {shlex.quote(p)} {shlex.quote(p)}; "
                        for p in self.writable())
        script = f"set -e; {binds}mount -o remount,bind,ro /; exec \"$@\""
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                *argv]

    def start(self) -> "Pod":
        self.proc = self.host.popen(self.sandboxed(self.argv), env=self.env, cwd=self.dir,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace")
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    match = regex.search(line)
                    if match:
                        return match
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, \
                    f"pod {self.index} printed no {pattern!r}:\n" + self.tail()
                self._cond.wait(min(left, 0.2))

    def tail(self, n: int = 60) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


def _job_pods(hosts, job, shared, root, secret) -> tuple[str, list[Pod]]:
    """The pods of one Indexed Job object (a fresh uid), as the job controller makes them."""
    uid = str(uuid.uuid4())
    pods = []
    for index in range(job["spec"]["completions"]):
        fields = {
            ("labels", "batch.kubernetes.io/controller-uid"): uid,
            ("labels", "batch.kubernetes.io/job-name"): job["metadata"]["name"],
            ("annotations", "batch.kubernetes.io/job-completion-index"): str(index),
        }
        # The job controller adds this to every container of an Indexed Job.
        injected = {"JOB_COMPLETION_INDEX": str(index)}
        pods.append(Pod(hosts[1 + index], job["spec"]["template"], index, shared, root / uid,
                        secret, fields, injected))
    return uid, pods


def _run_job(hosts, job, shared, root, secret, on_running=None) -> tuple[str, list[Pod]]:
    """Start every pod of one Job object and wait until all have exited."""
    uid, pods = _job_pods(hosts, job, shared, root, secret)
    _run_pods(pods, on_running)
    return uid, pods


def _run_pods(pods, on_running=None) -> None:
    for pod in pods:
        pod.start()
    if on_running is not None:
        on_running(pods)
    deadline = time.monotonic() + JOB_TIMEOUT
    for pod in pods:
        try:
            pod.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"pod {pod.index} did not finish within {JOB_TIMEOUT}s:\n{pod.tail()}")


def _final_sha(pods, steps) -> str:
    text = "\n".join(p.output for p in pods)
    found = re.findall(rf"\[rank 0\] final step {steps} params_sha256 ([0-9a-f]{{64}})", text)
    assert len(found) == 1, text[-3000:]
    return found[0]


@pytest.fixture
def cluster(tmp_path):
    """Three namespaces: etcd on the first (as etcd-0.etcd:2379), pods on the others."""
    require_netns()
    with Hosts(3) as hosts:
        made = []
        try:
            for host in hosts.hosts[1:]:
                # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts.
                etc = Path("/etc/netns") / host.netns
                etc.mkdir(parents=True)
                made.append(etc)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{hosts[0].address} etcd-0.etcd "
                                           f"etcd-0.etcd.shoal.svc.cluster.local\n")
            etcd = EtcdServer(host=hosts[0].address, command_prefix=hosts[0].command([]))
            etcd.port = 2379  # the port the manifests name; private to this namespace
            etcd.start()
            try:
                yield hosts, _rendered(tmp_path), tmp_path
            finally:
                etcd.close()
        finally:
            for etc in made:
                shutil.rmtree(etc, ignore_errors=True)


def _check_the_read_only_root(pod: Pod) -> None:
    """The sandbox a pod runs in refuses a write outside its volumes and takes one inside."""
    probe = ("import errno, sys\n"
             "for path in sys.argv[1:]:\n"
             "    try:\n"
             "        open(path, 'w').close(); print(path, 'ok')\n"
             "    except OSError as exc:\n"
             "        print(path, errno.errorcode[exc.errno])\n")
    outside, inside = pod.dir / "outside-a-volume", Path(pod.paths["/tmp"]) / "inside"
    done = pod.host.run(pod.sandboxed([sys.executable, "-c", probe, str(outside), str(inside),
                                       os.path.join(pod.env["HOME"], "home-file")]),
                        env=pod.env, cwd=pod.dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{outside} EROFS", f"{inside} ok",
                                        f"{pod.paths['/tmp']}/home-file ok"], done.stdout


def test_the_job_completes_recovers_a_killed_worker_and_a_second_job_starts_clean(cluster):
    hosts, objects, tmp_path = cluster
    job = objects[("Job", "shoal-train")]
    secret = {name: obj for (kind, name), obj in objects.items() if kind == "Secret"}
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    steps = int(next(a for a in args if a.startswith("--steps=")).split("=")[1])
    shared = tmp_path / "checkpoints-volume"
    shared.mkdir()
    killed = {}
    _check_the_read_only_root(_job_pods(hosts, job, shared, tmp_path / "probe", secret)[1][0])

    def kill_a_worker(pods):
        # Once training runs, SIGKILL one worker of the second pod (an OOM kill, a segfault).
        pods[0].wait_for(r"\[rank 0\] step 40 ", JOB_TIMEOUT)
        pid = int(pods[1].wait_for(r"Started ranks \[[0-9, ]+\] as pids \[(\d+)", 10).group(1))
        os.kill(pid, signal.SIGKILL)
        killed["pid"] = pid

    uid, pods = _run_job(hosts, job, shared, tmp_path, secret, on_running=kill_a_worker)
    assert [p.proc.returncode for p in pods] == [0, 0], "\n----\n".join(p.tail() for p in pods)
    text = "\n".join(p.output for p in pods)
    assert "Node n00000-" in text and f"joins run {uid} (etcd backend, nodes 2:2" in text
    assert "ended with signal SIGKILL" in pods[1].output and killed
    assert "Restarting the job (restart 1 of 10)" in text
    assert re.search(r"\[rank 0\] resumed from step \d+ \(restart 1\)", text), text[-3000:]
    first_sha = _final_sha(pods, steps)
    # Dumps and checkpoints went to the shared volume, named by the Job.
    assert any((shared / "shoal-train").glob("*")), list(shared.iterdir())
    # Success: the termination message stays empty.
    assert all(Path(p.paths["/dev/termination-log"]).read_text() == "" for p in pods)

    # The same manifests again: a new Job object, so a new run id and a clean rendezvous. It
    # finds its name's checkpoints on the volume and resumes from the end.
    uid2, pods2 = _run_job(hosts, job, shared, tmp_path, secret)
    assert [p.proc.returncode for p in pods2] == [0, 0], "\n----\n".join(p.tail() for p in pods2)
    text2 = "\n".join(p.output for p in pods2)
    assert uid2 != uid and f"joins run {uid2} " in text2
    assert "Round 0: node rank 0 of 2 runs ranks [0, 1] of 4 (restart 0)" in text2
    assert "already ended" not in text2 and "closed" not in text2.replace("closes", "")
    assert f"[rank 0] resumed from step {steps} (restart 0)" in text2
    assert _final_sha(pods2, steps) == first_sha


def _run_static_pods(tmp_path, template: dict, master: str, fields, injected) -> list[Pod]:
    """Two pods of a static-rendezvous variant in their own namespaces, `master` (pod 0's
    stable name) resolving to pod 0's address in both; `fields(i)` and `injected(i)` are pod
    i's label/annotation values and the variables its controller adds."""
    require_netns()
    objects = _rendered(tmp_path, template["variant"])
    pod_template = template["get"](objects)
    secret = {name: obj for (kind, name), obj in objects.items() if kind == "Secret"}
    shared = tmp_path / "checkpoints-volume"
    shared.mkdir()
    with Hosts(2) as hosts:
        made = []
        try:
            for host in hosts.hosts:
                etc = Path("/etc/netns") / host.netns
                etc.mkdir(parents=True)
                made.append(etc)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{hosts[0].address} {master}\n")
            pods = [Pod(hosts[index], pod_template, index, shared, tmp_path / "pods", secret,
                        fields(index), injected(index)) for index in range(2)]
            _run_pods(pods)
        finally:
            for etc in made:
                shutil.rmtree(etc, ignore_errors=True)
    assert [p.proc.returncode for p in pods] == [0, 0], "\n----\n".join(p.tail() for p in pods)
    text = "\n".join(p.output for p in pods)
    assert "(static (store) backend, nodes 2:2, 2 worker(s) here)" in text
    assert f"Rendezvous store listening on {master}:29500" in pods[0].output
    args = pod_template["spec"]["containers"][0]["args"]
    _final_sha(pods, int(next(a for a in args if a.startswith("--steps=")).split("=")[1]))
    return pods


def test_the_trainjob_runs_on_the_variables_kubeflow_trainer_injects(tmp_path):
    """trainer/: the pods the Trainer makes from the ClusterTrainingRuntime for the TrainJob,
    with what its torch plugin adds to the container named node (PET_*) and the JobSet labels
    the pods carry."""
    name = "shoal-train"
    master = f"{name}-node-0-0.{name}"

    def pod_template(objects):
        runtime = objects[("ClusterTrainingRuntime", "shoal")]
        (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
        return replicated["template"]["spec"]["template"]

    def fields(index):
        return {("labels", "jobset.sigs.k8s.io/jobset-name"): name,
                ("annotations", "batch.kubernetes.io/job-completion-index"): str(index)}

    def injected(index):
        return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(index),
                "PET_MASTER_ADDR": master, "PET_MASTER_PORT": "29500",
                "JOB_COMPLETION_INDEX": str(index), "PYTHONUNBUFFERED": "1"}

    _run_static_pods(tmp_path, {"variant": "trainer", "get": pod_template}, master, fields,
                     injected)
    assert any((tmp_path / "checkpoints-volume" / name).glob("*"))


def test_the_jobset_runs_on_the_names_and_labels_jobset_gives_its_pods(tmp_path):
    """jobset/: JobSet's labels (its uid, the restart attempt, its name) and the completion
    index on each pod, pod 0 reachable as shoal-train-node-0-0.shoal-train."""
    name = "shoal-train"
    master = f"{name}-node-0-0.{name}"
    uid = str(uuid.uuid4())

    def pod_template(objects):
        (replicated,) = objects[("JobSet", name)]["spec"]["replicatedJobs"]
        return replicated["template"]["spec"]["template"]

    def fields(index):
        return {("labels", "jobset.sigs.k8s.io/jobset-uid"): uid,
                ("labels", "jobset.sigs.k8s.io/restart-attempt"): "0",
                ("labels", "jobset.sigs.k8s.io/jobset-name"): name,
                ("annotations", "batch.kubernetes.io/job-completion-index"): str(index)}

    pods = _run_static_pods(tmp_path, {"variant": "jobset", "get": pod_template}, master,
                            fields, lambda index: {"JOB_COMPLETION_INDEX": str(index)})
    assert f"run {uid}-0" in "\n".join(p.output for p in pods)
