"""TCPStore across real processes: a waiting client killed with SIGKILL, the standalone server
used from another process and stopped with SIGTERM, and a master process that dies."""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

import pytest

from shoal.collectives.types import StoreError
from shoal.collectives.store.tcp import TCPStore

JOIN_S = 30.0


def wait_until(condition, what, timeout=JOIN_S):
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting until {what}")
        time.sleep(0.01)


def join_or_fail(proc, name, expect_exitcode=0):
    proc.join(JOIN_S)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"{name} did not exit within {JOIN_S}s")
    assert proc.exitcode == expect_exitcode, f"{name} exited with code {proc.exitcode}"


def report(results, fn, *args):
    try:
        fn(*args)
        results.put(None)
    except BaseException:  # noqa: BLE001  (handed to the test, which reports it)
        results.put(traceback.format_exc())


# ------------------------------------------------------------------ children (module level)

def _waiting_client(port, results):
    def body():
        store = TCPStore("127.0.0.1", port, timeout=30)
        store.set("child/ready", b"1")
        store.get("child/never", timeout=60)  # killed here

    report(results, body)


def _rank_using_the_standalone_server(port, results):
    def body():
        store = TCPStore("127.0.0.1", port, timeout=30)
        store.add("standalone/count", 5)
        store.set("standalone/from_child", str(os.getpid()))
        store.close()

    report(results, body)


def _master_that_reports_its_port(ports, results):
    def body():
        store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
        ports.put(store.port)
        # Tell the parent once its wait is parked, then idle until killed (bounded anyway).
        deadline = time.monotonic() + JOIN_S
        while store.server.num_parked < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        ports.put("parked")
        time.sleep(JOIN_S)

    report(results, body)


# ------------------------------------------------------------------ tests

def test_client_killed_while_waiting_disturbs_no_one():
    ctx = multiprocessing.get_context("spawn")
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    results = ctx.Queue()
    child = ctx.Process(target=_waiting_client, args=(master.port, results))
    child.start()
    try:
        master.wait(["child/ready"], timeout=JOIN_S)
        wait_until(lambda: master.server.num_parked == 1, "the child's get is parked")
        got = {}
        waiter = threading.Thread(target=lambda: got.setdefault("v", master.get("after", 30)))
        waiter.start()
        wait_until(lambda: master.server.num_parked == 2, "the parent's get is parked")
        os.kill(child.pid, signal.SIGKILL)
        join_or_fail(child, "the waiting client", expect_exitcode=-signal.SIGKILL)
        wait_until(lambda: master.server.num_parked == 1, "the dead client's wait is dropped")
        with TCPStore("127.0.0.1", master.port, timeout=10) as other:
            other.set("after", b"still served")
        waiter.join(10)
        assert got == {"v": b"still served"}
        assert master.add("counter", 1) == 1
    finally:
        if child.is_alive():
            child.kill()
        master.close()


def test_standalone_server_serves_other_processes_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.collectives.store.tcp", "--host", "127.0.0.1", "--port", "0",
         "--world-size", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], JOIN_S)
        line = proc.stdout.readline().decode() if ready else ""
        assert line.startswith("shoal store listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])

        store = TCPStore("127.0.0.1", port, timeout=10)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(target=_rank_using_the_standalone_server, args=(port, results))
        child.start()
        assert store.get("standalone/from_child", timeout=JOIN_S) == str(child.pid).encode()
        join_or_fail(child, "the child rank")
        assert results.get(timeout=5) is None
        assert store.add("standalone/count", 1) == 6

        errors = []

        def wait():
            try:
                store.get("standalone/never", timeout=60)
            except StoreError as exc:
                errors.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.1)  # let the get reach the server; the test holds either way
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        waiter.join(10)
        assert errors and time.monotonic() - start < 5
        assert f"127.0.0.1:{port}" in str(errors[0])
        assert proc.wait(10) == 0
        stderr = proc.stderr.read().decode()
        assert "all 2 workers joined" in stderr and "stopped" in stderr, stderr
        store.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_master_that_dies_fails_clients_promptly():
    ctx = multiprocessing.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    master = ctx.Process(target=_master_that_reports_its_port, args=(ports, results))
    master.start()
    try:
        port = ports.get(timeout=JOIN_S)
        client = TCPStore("127.0.0.1", port, timeout=60)
        errors = []

        def wait():
            try:
                client.get("dies/never", timeout=60)
            except StoreError as exc:
                errors.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert ports.get(timeout=JOIN_S) == "parked"
        start = time.monotonic()
        os.kill(master.pid, signal.SIGKILL)
        waiter.join(10)
        assert time.monotonic() - start < 5, "the parked get did not fail promptly"
        assert len(errors) == 1
        assert f"get of key 'dies/never': lost the server at 127.0.0.1:{port}" in str(errors[0])
        start = time.monotonic()
        with pytest.raises(StoreError, match=rf"could not reach the server at 127\.0\.0\.1:{port}"):
            client.set("dies/k", "v")
        assert time.monotonic() - start < 5
        join_or_fail(master, "the master", expect_exitcode=-signal.SIGKILL)
        client.close()
    finally:
        if master.is_alive():
            master.kill()
            master.join(5)
