"""The RPC server's accept thread off its completion queue between connections
(rpc_agent/transport/direct_server.py): new connections are still served at once, and stop()
still ends the thread at once. Each case runs in a fresh interpreter with gRPC core set as
shoal's tuning sets it (the `poll` strategy, gRPC's own listener), which it reads once per
process as grpc loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from shoal.rpc_agent.transport.grpc_tuning import ENV_TUNING, GRPC_ENVIRONMENT

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 60

# The accept thread goes quiet 50 ms after a connection and sweeps its queue only every 30 s,
# longer than each call's 10 s deadline: a call served after a quiet spell was accepted because
# the listener woke the thread, not by a sweep. Prints JSON: what each call got back, whether the
# server waited quietly, and how long stop() took.
_SCRIPT = textwrap.dedent("""
    import json, threading, time
    from shoal.rpc_agent.transport import grpc_tuning
    grpc_tuning.apply()
    import grpc
    from shoal.rpc_agent.transport import direct, direct_server
    from shoal.rpc_agent.transport.grpc import METHOD

    direct_server._SETUP_HOLD_S = 0.05
    direct_server._SWEEP_S = 30.0

    def echo(call):
        for message in call:
            call.send(message)

    def on_call(accepted):
        call = direct.ServerCall(accepted, b"".join, 1 << 20, 0.0, "test")
        call.release()
        threading.Thread(target=echo, args=(call,), daemon=True).start()

    server = direct_server.StreamServer(
        "127.0.0.1", [], METHOD, on_call, "test",
        quiet_accept=grpc_tuning.poll_without_listener_engine())
    port = server.start()
    got = []
    for word in (b"first", b"second"):
        time.sleep(0.3)  # well past the hold: the thread waits on the listening socket
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        replies = channel.stream_stream(METHOD)(iter([word]), timeout=10)
        try:
            got.append(b"".join(replies).decode())
        except grpc.RpcError as exc:
            got.append(f"{exc.code().name}: {exc.details()}")
        channel.close()
    time.sleep(0.3)
    start = time.monotonic()
    server.stop(10)
    print(json.dumps({"got": got, "quiet": server.waits_quietly,
                      "stop_s": time.monotonic() - start, "running": server.running}))
""")


def test_a_quiet_accept_thread_serves_new_connections_and_stops_at_once():
    clean = {k: v for k, v in os.environ.items()
             if k not in GRPC_ENVIRONMENT and k != ENV_TUNING}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=clean, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["quiet"], "the server did not find its listening socket"
    assert result["got"] == ["first", "second"]
    assert not result["running"], "the accept thread did not end"
    # The next sweep is 30 s away: only the wake-up ends the quiet wait this soon.
    assert result["stop_s"] < 5.0
