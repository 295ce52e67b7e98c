"""The RPC worker the port fuzz tests attack: a spawned process running `init_rpc("w1")`, and
the functions the test process calls on it (they are pickled by reference, so they live in a
module the worker imports, not in the test module)."""

from __future__ import annotations

import os
import traceback


def peer_main(store_port: int, token: bytes, stop, results) -> None:
    """Join the test process's RPC world as worker w1, then serve until `stop` is set."""
    try:
        from shoal import rpc_agent
        from shoal.collectives.store.tcp import TCPStore

        store = TCPStore("127.0.0.1", store_port, timeout=30, token=token)
        rpc_agent.init_rpc("w1", 1, 2, rpc_agent.RpcBackendOptions(
            store=store, token=token, rpc_timeout=10, init_timeout=30))
    except BaseException:  # noqa: BLE001  (sent to the test process)
        results.put(("failed", traceback.format_exc()))
        return
    results.put(("ready", os.getpid()))
    stop.wait(600)
    rpc_agent.shutdown(timeout=10)
    store.close()


def echo(value):
    """The right-secret client's call."""
    return value


def ports() -> tuple[int, int]:
    """This worker's gRPC and data-channel ports."""
    from shoal.rpc_agent import _current

    agent = _current.get()
    return agent.grpc_port, agent.data_port


def incarnation() -> bytes:
    """This worker's gRPC incarnation nonce (hellos to it must name it)."""
    from shoal.rpc_agent import _current

    return _current.get().grpc_incarnation


def data_gate() -> tuple[int, int]:
    """The data channel's pending handshakes and how many connections it turned away."""
    from shoal.rpc_agent import _current

    gate = _current.get()._data._gate
    return gate.num_pending, sum(gate.rejections.values())


def rejected_streams() -> float:
    """RPC streams this worker dropped before reading them (its metric)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("shoal_rpc_rejected_total", {"port": "stream"}) or 0.0
