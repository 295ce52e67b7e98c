"""torchrun's own documented command lines, with only the program name changed to `shoal run`.

The lines come from torch.distributed.run's documentation (Usage: single-node, stacked, fault
tolerant, elastic) and from what Kubeflow's PyTorchJob injects (PET_* variables, static
rendezvous). Where torch is installed, the single-node lines also run under torchrun itself and
the workers must see the same torchrun variables. Multi-node lines run one agent per
network-namespace host (tests/support/netns.py), so the fixed ports of the documentation (29400,
29500) are private to the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.support.netns import Hosts, require_netns
from tests.support.requirements import missing
from tests.support.shoal_run import ROOT, WORKERS

WORKER = str(WORKERS / "torchrun_worker.py")
SHOAL = [sys.executable, "-m", "shoal.launcher", "run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SECRET = "torchrun-compat-" + uuid.uuid4().hex
TIMEOUT = 60
# The variables a torchrun worker reads that must agree between the two launchers.
# TORCHELASTIC_MAX_RESTARTS is left out on purpose: shoal's default --max-restarts is 3
# (restart from the last checkpoint), torchrun's 0; given explicitly they agree.
COMPARED = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "OMP_NUM_THREADS",
            "TORCHELASTIC_RESTART_COUNT", "rest", "name"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "SHOAL_", "TORCHELASTIC_")) and k != "OMP_NUM_THREADS"}
    env.update(SHOAL_AUTH_TOKEN=SECRET, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra)
    return env


def _run(program, args, timeout=TIMEOUT, **extra):
    return subprocess.run(program + list(args), cwd=ROOT, env=_env(**extra), capture_output=True,
                          text=True, timeout=timeout)


def _envs(output: str) -> list[dict]:
    # raw_decode: under torchrun two ranks' lines can share a line (no per-line prefixing).
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(output, m.end())[0] for m in re.finditer(r"ENV ", output)]
    return sorted(found, key=lambda e: int(e["RANK"]))


def _compared(envs):
    return [{k: e.get(k) for k in COMPARED} for e in envs]


# torchrun's documentation, "Single-node multi-worker" and "Stacked single-node multi-worker".
SINGLE_NODE_LINES = {
    "standalone": ["--standalone", "--nnodes=1", "--nproc-per-node=2"],
    "stacked c10d": ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1",
                     "--nproc-per-node=2"],
    "old spellings": ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
                      "--nproc_per_node", "2", "--max_restarts", "0"],
}


@pytest.mark.parametrize("line", list(SINGLE_NODE_LINES), ids=list(SINGLE_NODE_LINES))
def test_single_node_lines_give_torchruns_environment(line):
    args = SINGLE_NODE_LINES[line] + [WORKER, "--arg1", "x"]
    done = _run(SHOAL, args[:-3] + [WORKER, "--meet", "--arg1", "x"])
    assert done.returncode == 0, done.stderr
    envs = _envs(done.stdout)
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["sum"] for e in envs} == {1}
    # torchrun's notice and value: two workers and no OMP_NUM_THREADS given.
    assert "Setting OMP_NUM_THREADS=1 for each of the 2 workers" in done.stderr
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    try:
        import torch  # noqa: F401
    except ImportError:
        return  # the reference run needs torch; shoal's own checks above still ran
    reference = _run(TORCHRUN, args)
    assert reference.returncode == 0, reference.stderr
    assert _compared(envs) == _compared(_envs(reference.stdout))


def test_omp_num_threads_of_the_user_is_kept():
    done = _run(SHOAL, ["--nproc-per-node=2", WORKER], OMP_NUM_THREADS="3")
    assert done.returncode == 0, done.stderr
    assert {e["OMP_NUM_THREADS"] for e in _envs(done.stdout)} == {"3"}
    assert "OMP_NUM_THREADS" not in done.stderr


def test_nproc_per_node_auto_and_gpu():
    done = _run(SHOAL, ["--nproc-per-node=auto", "--max-restarts=0", WORKER])
    assert done.returncode == 0, done.stderr
    from shoal.launcher import devices

    expected = devices.gpu_count() or len(os.sched_getaffinity(0))
    assert {e["LOCAL_WORLD_SIZE"] for e in _envs(done.stdout)} == {str(expected)}
    gpu = _run(SHOAL, ["--nproc-per-node=gpu", WORKER])
    if devices.gpu_count() == 0:
        assert gpu.returncode == 2 and "Traceback" not in gpu.stderr
        assert "'gpu' asks for one worker per GPU, but no CUDA device is visible" in gpu.stderr
    else:
        assert gpu.returncode == 0, gpu.stderr
        assert len(_envs(gpu.stdout)) == devices.gpu_count()


def test_version():
    from shoal import __version__

    for program in ([sys.executable, "-m", "shoal.launcher"], SHOAL):
        done = _run(program, ["--version"])
        assert (done.returncode, done.stdout.strip()) == (0, f"shoal {__version__}")


def test_redirects_tee_and_local_ranks_filter(tmp_path):
    logs = tmp_path / "logs"
    done = _run(SHOAL, ["--standalone", "--nproc-per-node=2", "--rdzv-id=streams",
                        f"--log-dir={logs}", "-r", "3", "-t", "0:1", WORKER, "--chatter"])
    assert done.returncode == 0, done.stderr
    # -r 3: every stream to its file only; -t 0:1: local rank 0's stdout to the console too.
    assert "[rank 0] out of local rank 0" in done.stdout
    assert "err of local rank 0" not in done.stderr and "local rank 1" not in done.stdout
    for rank in (0, 1):
        text = (logs / "streams" / "round_0" / f"rank_{rank}.log").read_text()
        assert f"out of local rank {rank}" in text and f"err of local rank {rank}" in text
    filtered = _run(SHOAL, ["--nproc-per-node=2", "--local-ranks-filter=1", WORKER, "--chatter"])
    assert filtered.returncode == 0, filtered.stderr
    assert "[rank 1] out of local rank 1" in filtered.stdout
    assert "[rank 1] err of local rank 1" in filtered.stderr
    assert "local rank 0" not in filtered.stdout + filtered.stderr


@pytest.mark.parametrize("name", ["SIGHUP", "SIGQUIT", "SIGUSR1"])
def test_signals_are_forwarded_to_the_workers(tmp_path, name):
    signum = getattr(signal, name)
    args = ["--nproc-per-node=2", "--grace-period=10", WORKER, "--wait-signal", str(tmp_path)]
    if name == "SIGUSR1":  # not in torchrun's default set: asked for as on SLURM
        args = ["--signals-to-handle=SIGTERM,SIGINT,SIGUSR1"] + args
    proc = subprocess.Popen(SHOAL + args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(list(tmp_path.glob("ready-*"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, err
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} got {name}" in out, out + err


def test_no_python_and_run_path(tmp_path):
    program = tmp_path / "train.sh"
    program.write_text("#!/bin/sh\necho \"shell rank $RANK of $WORLD_SIZE args $*\"\n")
    program.chmod(0o755)
    done = _run(SHOAL, ["--nproc-per-node=2", "--no-python", str(program), "a", "b"])
    assert done.returncode == 0, done.stderr
    assert "[rank 1] shell rank 1 of 2 args a b" in done.stdout
    done = _run(SHOAL, ["--nproc-per-node=1", "--run-path", WORKER, "p", "q"])
    assert done.returncode == 0, done.stderr
    env = _envs(done.stdout)[0]
    assert (env["name"], env["argv0"], env["rest"]) == ("__main__", WORKER, ["p", "q"])
    bad = _run(SHOAL, ["--no-python", "-m", "pkg", WORKER])
    assert bad.returncode == 2 and "do not combine it with -m/--module" in bad.stderr


def test_virtual_local_rank_gives_each_worker_its_own_device_as_torchrun_does(tmp_path):
    program = tmp_path / "show.sh"
    program.write_text("#!/bin/sh\necho \"VLR rank=$RANK local=$LOCAL_RANK "
                       "cuda=$CUDA_VISIBLE_DEVICES pid=$$\"\n")
    program.chmod(0o755)
    args = ["--standalone", "--nproc-per-node=2", "--virtual-local-rank", "--no-python",
            str(program)]

    def lines(output):
        return sorted(re.findall(r"VLR (rank=\d local=\d cuda=\S+)", output))

    # torchrun's flags without a counterpart are accepted with one warning line each.
    done = _run(SHOAL, args[:-2] + ["--numa-binding=node", "--logs-specs=mine"] + args[-2:],
                CUDA_VISIBLE_DEVICES="5,7")
    assert done.returncode == 0, done.stderr
    assert lines(done.stdout) == ["rank=0 local=0 cuda=5", "rank=1 local=0 cuda=7"]
    assert re.search(r"WARNING --numa-binding node is torchrun's and is ignored: shoal does not "
                     r"pin workers to CPUs", done.stderr)
    assert re.search(r"WARNING --logs-specs mine is torchrun's and is ignored", done.stderr)
    # The worker is exec'd in the wrapper's place: the pid the agent started is the worker's.
    started = re.search(r"Started ranks \[0, 1\] as pids \[(\d+), (\d+)\]", done.stderr)
    shown = dict(re.findall(r"VLR rank=(\d) .* pid=(\d+)", done.stdout))
    assert started and [shown["0"], shown["1"]] == list(started.groups()), done.stderr
    unset = _run(SHOAL, args)
    assert lines(unset.stdout) == ["rank=0 local=0 cuda=0", "rank=1 local=0 cuda=1"]
    reference = _run(TORCHRUN, args, CUDA_VISIBLE_DEVICES="5,7")
    assert reference.returncode == 0, reference.stderr
    assert lines(reference.stdout) == lines(done.stdout)


def test_error_files_follow_torchruns_contract(tmp_path):
    agent_file = tmp_path / "termination-log"
    done = _run(SHOAL, ["--nproc-per-node=2", "--max-restarts=0", f"--log-dir={tmp_path}",
                        "--rdzv-id=errs", WORKER, "--raise"],
                TORCHELASTIC_ERROR_FILE=str(agent_file))
    assert done.returncode == 1
    assert re.search(r"Its error: ValueError: rank [01] found a bad batch", done.stderr)
    doc = json.loads(agent_file.read_text())
    message = doc["message"]
    assert re.fullmatch(r"ValueError: rank [01] found a bad batch", message["message"])
    assert "raise ValueError" in message["extraInfo"]["py_callstack"]
    assert message["extraInfo"]["timestamp"].isdigit()
    rank = doc["shoal"]["rank"]
    worker_file = tmp_path / "errs" / "round_0" / f"rank_{rank}" / "error.json"
    assert doc["shoal"]["error_file"] == str(worker_file)
    assert json.loads(worker_file.read_text())["message"]["message"] == message["message"]
    # Each worker had its own file, never the agent's.
    assert {e["TORCHELASTIC_ERROR_FILE"] for e in _envs(done.stdout)} == {
        str(tmp_path / "errs" / "round_0" / f"rank_{r}" / "error.json") for r in (0, 1)}


# Workers that die without an error file of their own: rank 1 by a signal, or by os._exit
# (no exception, so no @record); rank 0 waits to be stopped.
DYING = {
    "signal": ("#!/bin/sh\nif [ \"$RANK\" = 1 ]; then echo \"pid $$\"; kill -KILL $$; fi\n"
               "sleep 30\n", "signal SIGKILL (exit code -9)", -9),
    "os._exit": ("#!" + sys.executable + "\nimport os, time\nif os.environ['RANK'] == '1':\n"
                 "    print('pid', os.getpid(), flush=True)\n    os._exit(7)\ntime.sleep(30)\n",
                 "exit code 7", 7),
}


def _die(tmp_path, how, **extra):
    source, exit_text, exitcode = DYING[how]
    program = tmp_path / "dying-worker"
    program.write_text(source)
    program.chmod(0o755)
    done = _run(SHOAL, ["--nproc-per-node=2", "--max-restarts=0", f"--log-dir={tmp_path}",
                        "--rdzv-id=dies", "--no-python", str(program)], **extra)
    assert done.returncode == 1, done.stderr
    pid = int(re.search(r"\[rank 1\] pid (\d+)", done.stdout).group(1))
    return done, pid, exit_text, exitcode


@pytest.mark.parametrize("how", list(DYING))
def test_a_worker_dead_without_an_error_file_gets_one_and_is_the_termination_message(
        tmp_path, how):
    agent_file = tmp_path / "termination-log"
    done, pid, exit_text, exitcode = _die(tmp_path, how,
                                          TORCHELASTIC_ERROR_FILE=str(agent_file))
    expected = f"rank 1 (pid {pid}) ended with {exit_text} and wrote no error file"
    # The agent wrote the worker's file for it, in torch's format...
    worker_file = tmp_path / "dies" / "round_0" / "rank_1" / "error.json"
    worker = json.loads(worker_file.read_text())
    assert worker["message"]["message"] == expected
    assert worker["shoal"] == {"rank": 1, "exitcode": exitcode}
    # ...and its own file (the pod's termination message) names the same rank and exit.
    doc = json.loads(agent_file.read_text())
    assert doc["message"]["message"] == expected
    assert doc["message"]["extraInfo"]["timestamp"].isdigit()
    assert {k: doc["shoal"][k] for k in ("rank", "local_rank", "pid", "exitcode", "exit",
                                         "error_file", "round")} == {
        "rank": 1, "local_rank": 1, "pid": pid, "exitcode": exitcode, "exit": exit_text,
        "error_file": str(worker_file), "round": 0}
    assert "The failing worker: rank 1 (local rank 1 on node" in done.stderr
    assert f"ended with {exit_text} in round 0." in done.stderr


def _in_mount_namespace(script: str, argv: list[str], env: dict):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        missing("the mounted termination-log test", "it needs root and util-linux's unshare "
                "to bind-mount a file")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           "set -e; " + script + "; exec \"$@\"", "sh", *argv], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("directory", ["writable", "read-only"])
def test_the_termination_log_is_written_where_kubernetes_mounts_it(tmp_path, directory):
    """Kubernetes bind-mounts /dev/termination-log as a file: it cannot be renamed over
    (EBUSY), and on a read-only root its directory may not take a temporary file."""
    logs = tmp_path / "logs"
    logs.mkdir()
    dev = tmp_path / "dev"
    dev.mkdir()
    log = dev / "termination-log"
    log.write_text("")
    # As the kubelet: the file lives outside the container and is mounted onto the path.
    source = tmp_path / "pod-termination-log"
    source.write_text("")
    program = tmp_path / "dying-worker"
    program.write_text(DYING["signal"][0])
    program.chmod(0o755)
    script = f"mount --bind {dev} {dev}; "
    if directory == "read-only":
        script += f"mount -o remount,bind,ro {dev}; "
    script += f"mount --bind {source} {log}"
    done = _in_mount_namespace(
        script, SHOAL + ["--nproc-per-node=2", "--max-restarts=0", f"--log-dir={logs}",
                         "--rdzv-id=mounted", "--no-python", str(program)],
        _env(TORCHELASTIC_ERROR_FILE=str(log)))
    assert done.returncode == 1, done.stderr
    assert "Cannot write the error file" not in done.stderr
    doc = json.loads(source.read_text())
    assert re.fullmatch(r"rank 1 \(pid \d+\) ended with signal SIGKILL \(exit code -9\) and "
                        r"wrote no error file", doc["message"]["message"])
    assert list(dev.iterdir()) == [log] and log.read_text() == ""  # nothing left beside it


def test_no_writable_temp_dir_is_a_clear_error(request):
    """A read-only root filesystem: /tmp, /var/tmp and the working directory not writable."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        missing("the read-only filesystem test", "it needs root and util-linux's unshare to "
                "mount read-only temporary directories")
    # Each temporary directory becomes an empty read-only tmpfs. A checkout (or the
    # interpreter's environment) inside one of them is bind-mounted back in first (through a
    # mount point under /dev/shm, removed after), so the test also runs from a clone in /tmp.
    keep = sorted({str(Path(p).resolve()) for p in (ROOT, sys.prefix)})
    holders = tempfile.mkdtemp(prefix="shoal-test-keep-", dir="/dev/shm")
    request.addfinalizer(lambda: shutil.rmtree(holders, ignore_errors=True))
    pairs = " ".join(f"{k}={holders}/{i}" for i, k in enumerate(keep))
    script = ("set -e; for p in " + pairs + "; do mkdir -p ${p#*=}; mount --bind ${p%%=*} "
              "${p#*=}; done; for d in /tmp /var/tmp /usr/tmp; do [ -d $d ] || continue; "
              "mount -t tmpfs tmpfs $d; for p in " + pairs + "; do case ${p%%=*} in $d/*) "
              "mkdir -p ${p%%=*}; mount --bind ${p#*=} ${p%%=*};; esac; done; "
              "mount -o remount,ro $d; done; cd /tmp; exec \"$@\"")
    env = _env()
    env.pop("TMPDIR", None)
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                           "sh", *SHOAL, "--nproc-per-node=1", WORKER], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "shoal run: error: no writable temporary directory" in done.stderr
    assert "mount a writable volume (a Kubernetes emptyDir) at /tmp" in done.stderr
    # A configured TMPDIR (outside the read-only mounts) is used.
    scratch = tempfile.mkdtemp(prefix="shoal-test-tmpdir-", dir="/dev/shm")
    try:
        ok = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             script, "sh", *SHOAL, "--nproc-per-node=1", WORKER],
                            env={**env, "TMPDIR": scratch}, capture_output=True, text=True,
                            timeout=TIMEOUT)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert ok.returncode == 0, ok.stderr


# ----------------------------------------------------------------------------- several nodes

def _agents(hosts, argvs, envs):
    """Run one agent per host (the store's host, hosts[0], started last) and wait for all.

    The others wait for the store to come up, so they join as soon as it does: with shoal's
    2 s last call (torchrun's is 30 s) an elastic round (1:4) must not close on the first node
    alone because the second one's interpreter started late on a busy machine. A cluster may
    start its nodes in any order; this one is simply the order that leaves no race.
    """
    procs = [hosts[i].popen(SHOAL + argvs[i], cwd=ROOT, env=envs[i], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
             for i in reversed(range(len(argvs)))][::-1]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
    return [p.returncode for p in procs], outputs


@pytest.mark.parametrize("nnodes", ["2", "1:4"], ids=["fault tolerant", "elastic"])
def test_multi_node_c10d_lines_on_two_hosts(nnodes):
    """torchrun's "Fault tolerant" and "Elastic" lines exactly, --rdzv-endpoint=$HOST_NODE_ADDR
    without a port: the store on the first host at 29400."""
    require_netns()
    with Hosts(2) as hosts:
        line = [f"--nnodes={nnodes}", "--nproc-per-node=2", "--max-restarts=3",
                "--rdzv-id=job42", "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0].address}",
                WORKER, "--meet"]
        codes, outputs = _agents(hosts, [line, line], [_env(), _env()])
        assert codes == [0, 0], "\n----\n".join(outputs)
        assert f"Rendezvous store listening on {hosts[0].address}:29400" in outputs[0]
        envs = _envs("".join(outputs))
        assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
        assert {e["sum"] for e in envs} == {6} and {e["WORLD_SIZE"] for e in envs} == {"4"}


def test_static_rendezvous_from_flags_and_from_kubeflows_variables():
    require_netns()
    with Hosts(2) as hosts:
        flags = [["--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}",
                  f"--master-addr={hosts[0].address}", "--master-port=29500", WORKER, "--meet"]
                 for rank in (0, 1)]
        codes, outputs = _agents(hosts, flags, [_env(), _env()])
        assert codes == [0, 0], "\n----\n".join(outputs)
        envs = _envs("".join(outputs))
        assert [(e["RANK"], e["GROUP_RANK"]) for e in envs] == [("0", "0"), ("1", "1")]
        # What PyTorchJob injects, with the bare command line of its examples. The master
        # address is the master pod's name: its own /etc/hosts (the kubelet's) and the other
        # pods' DNS both give its address.
        made = [Path("/etc/netns") / host.netns for host in hosts]
        try:
            for etc in made:
                etc.mkdir(parents=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n{hosts[0].address} "
                                           "shoal-train-master-0\n")
            pet = [_env(PET_NNODES="2", PET_NPROC_PER_NODE="2", PET_NODE_RANK=str(rank),
                        PET_MASTER_ADDR="shoal-train-master-0", PET_MASTER_PORT="23456")
                   for rank in (0, 1)]
            codes, outputs = _agents(hosts, [[WORKER, "--meet"]] * 2, pet)
        finally:
            for etc in made:
                shutil.rmtree(etc, ignore_errors=True)
        assert codes == [0, 0], "\n----\n".join(outputs)
        assert "Rendezvous store listening on shoal-train-master-0:23456" in outputs[0]
        envs = _envs("".join(outputs))
        assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
        assert {e["sum"] for e in envs} == {6}
