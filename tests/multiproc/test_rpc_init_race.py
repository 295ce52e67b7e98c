"""issue 24's init_rpc start-up race: the lower-id worker must not dial a higher-id worker
before that one has recorded the worker table (its hello was rejected as an unknown worker,
with no retry). A test hook widens the window deterministically: worker 1 records its table
two seconds late."""

from __future__ import annotations

import time

from shoal import rpc_agent
from shoal.rpc_agent import rpc as rpc_module
from tests.support.rpc_workers import RpcWorkers


def _late_table(agent) -> None:
    if agent.info.id == 1:
        time.sleep(2.0)


def start(delay_table: bool, init_timeout: float):
    if delay_table:
        rpc_module._before_set_workers = _late_table
    rank = int(__import__("os").environ["RANK"])
    begin = time.monotonic()
    try:
        rpc_agent.init_rpc(
            f"w{rank}", rank, 2,
            rpc_agent.RpcBackendOptions(init_method="env://", init_timeout=init_timeout),
        )
    except rpc_agent.RpcError as exc:
        return "error", str(exc), time.monotonic() - begin
    return "ok", rpc_agent.rpc_sync(f"w{1 - rank}", len, ("ab",)), time.monotonic() - begin


def stop():
    rpc_agent.shutdown()


def test_a_worker_that_records_the_table_late_is_not_rejected():
    with RpcWorkers(2, init=False) as pool:
        ids = [pool.submit(r, start, True, 30.0) for r in range(2)]
        outcomes = [pool.result(i, timeout=60) for i in ids]
        assert [o[:2] for o in outcomes] == [("ok", 2), ("ok", 2)], outcomes
        for r in range(2):
            pool.submit(r, stop)
        pool.close()


def test_a_missing_worker_fails_init_on_the_other_within_its_timeout_naming_it():
    with RpcWorkers(2, init=False) as pool:
        status, message, seconds = pool.run(0, start, False, 3.0, timeout=30)
        assert status == "error"
        assert "rank(s) 1 never joined" in message, message
        assert seconds < 10
        pool.close()
