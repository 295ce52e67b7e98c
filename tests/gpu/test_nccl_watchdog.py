"""The nccl backend's failure paths on real GPUs, in spawned processes: a 2-rank communicator
whose second rank never arrives fails the first with CollectiveTimeout within the timeout plus
a few seconds, whether rank 1 never starts, stops between the store and NCCL, or (with two
GPUs) joins but never calls the collective; and SHOAL_ASYNC_ERROR_HANDLING=1 ends the rank."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

cp = pytest.importorskip("cupy")
CTX = multiprocessing.get_context("spawn")
TIMEOUT_S = 4.0
SLACK_S = 8.0  # the store query, the dump and the abort fit well inside this


def _device_count() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


def _report_and_exit(out, value):
    out.put(value)
    out.close()
    out.join_thread()
    # A rank left blocked inside NCCL (ncclCommInitRank cannot be cancelled) must not keep the
    # process alive through interpreter teardown.
    os._exit(0)


def _rank0(port, mode, out):
    import cupy as cp

    from shoal.collectives.types import CollectiveTimeout
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=30)
    t0 = time.monotonic()
    try:
        timeout = 30.0 if mode == "never_calls" else TIMEOUT_S
        pg = ProcessGroupNCCL(store, 0, 2, timeout=timeout, device=0)
        if mode == "never_calls":
            t0 = time.monotonic()  # time the collective alone, not forming the group
            work = pg.all_reduce(cp.ones(1024, cp.float32), async_op=True, timeout=TIMEOUT_S)
            work.wait()  # returns at once: the stream waits, the host does not
            work.synchronize()
    except CollectiveTimeout as exc:
        _report_and_exit(out, ("timeout", str(exc), time.monotonic() - t0))
    except BaseException as exc:  # noqa: BLE001
        _report_and_exit(out, ("other", f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
    _report_and_exit(out, ("none", "", time.monotonic() - t0))


def _rank1_joins_then_idles(port):
    from shoal.collectives.backends.nccl.group import ProcessGroupNCCL
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=30)
    ProcessGroupNCCL(store, 1, 2, timeout=30, device=1)
    time.sleep(60)  # in the group, but never calls the all_reduce


def _run(mode, env=None):
    from shoal.collectives.backends.nccl import bootstrap
    from shoal.collectives.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30, wait_for_workers=False)
    out = CTX.Queue()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        rank0 = CTX.Process(target=_rank0, args=(store.port, mode, out), daemon=True)
        rank0.start()
        rank1 = None
        if mode == "stops_before_nccl":
            # Rank 1 goes through the store's part of the bootstrap, then never reaches NCCL.
            prefix = bootstrap.join_generation(store, "default", 1, 2)
            bootstrap.announce(store, prefix, 1, device=1)
        elif mode == "never_calls":
            rank1 = CTX.Process(target=_rank1_joins_then_idles, args=(store.port,), daemon=True)
            rank1.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        rank0.join(TIMEOUT_S + 60)
        value = None if out.empty() else out.get(timeout=1)
        return value, rank0.exitcode
    finally:
        for p in (rank0, rank1):
            if p is not None and p.is_alive():
                p.kill()
        store.close()


def test_rank_that_never_starts_is_named():
    value, code = _run("never_starts")
    assert value is not None, f"rank 0 reported nothing (exit code {code})"
    kind, message, seconds = value
    assert kind == "timeout", message
    assert "rank 1 never arrived" in message
    assert seconds < TIMEOUT_S + SLACK_S


def test_rank_that_stops_between_store_and_nccl_does_not_hang_rank_0():
    value, code = _run("stops_before_nccl")
    assert value is not None, f"rank 0 reported nothing (exit code {code})"
    kind, message, seconds = value
    assert kind == "timeout", message
    assert "ncclCommInitRank" in message
    assert seconds < TIMEOUT_S + SLACK_S


@pytest.mark.skipif(_device_count() < 2, reason="a joined 2-rank communicator needs two GPUs")
def test_rank_that_never_calls_the_collective_times_out_and_aborts():
    value, code = _run("never_calls")
    assert value is not None, f"rank 0 reported nothing (exit code {code})"
    kind, message, seconds = value
    assert kind == "timeout", message
    assert "Rank 0 timed out after 4s in all_reduce #1 of group 'default': rank 1 never arrived" in message
    assert seconds < TIMEOUT_S + SLACK_S


@pytest.mark.skipif(_device_count() < 2, reason="a joined 2-rank communicator needs two GPUs")
def test_async_error_handling_ends_the_rank_with_the_exit_code(tmp_path):
    from shoal.collectives.types import ASYNC_ERROR_EXIT_CODE

    value, code = _run("never_calls", env={"SHOAL_ASYNC_ERROR_HANDLING": "1",
                                           "SHOAL_DUMP_DIR": str(tmp_path)})
    assert code == ASYNC_ERROR_EXIT_CODE, (code, value)
    assert list(tmp_path.glob("shoal-collectives-default-rank0-*.json"))
