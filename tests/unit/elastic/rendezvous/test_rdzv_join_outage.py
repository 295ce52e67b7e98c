"""A joining node gives an unreachable backend join_outage_timeout seconds, then gives up with
one clear line; a node whose round runs never gives up on it. Also how the setting is parsed
(code, `--rdzv-conf`) and rejected. In-process: handlers over a HashStore behind a backend
that can be switched off (the real etcd case is tests/integration/test_shoal_run_join_outages.py).
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import pytest

from shoal.collectives.store.hash import HashStore
from shoal.elastic.api import (
    DEFAULT_JOIN_OUTAGE_TIMEOUT_S,
    RendezvousBackend,
    RendezvousError,
    RendezvousSettings,
    RendezvousUnreachableError,
)
from shoal.elastic.rendezvous import RendezvousHandler
from shoal.elastic.rendezvous.store_backend import StoreRendezvousBackend
from shoal.launcher.flags import parse_run

from tests.support.rdzv import FlakyBackend

GRACE_S = 1.0
# Giving up takes the grace plus one retry step (a sleep of at most 0.5 s) and some scheduling.
LATE_S = 1.5


def _switchable(inner: RendezvousBackend, down: threading.Event) -> FlakyBackend:
    """Fails like an unreachable server while `down` is set, with a short delay per call as a
    real connection attempt has; watches wake often enough to notice."""
    return FlakyBackend(inner, down, label="switchable", call_delay_s=0.02, watch_cap_s=0.2)


def _settings(**kw) -> RendezvousSettings:
    base = dict(run_id="job", min_nodes=2, max_nodes=2, last_call_timeout=0.2,
                join_timeout=30.0, heartbeat_interval=0.1, heartbeat_timeout=3.0,
                join_outage_timeout=GRACE_S)
    base.update(kw)
    return RendezvousSettings(**base)


@pytest.fixture
def nodes():
    store, down, made = HashStore(timeout=10), threading.Event(), []
    pool = concurrent.futures.ThreadPoolExecutor(4)

    def make(node: str, **kw) -> RendezvousHandler:
        backend = _switchable(StoreRendezvousBackend(store, "job"), down)
        handler = RendezvousHandler(backend, _settings(**kw), node, store, backend_timeout=1.0)
        made.append(handler)
        return handler

    yield make, down, pool
    down.clear()
    for handler in made:
        handler.shutdown()
    pool.shutdown(wait=False, cancel_futures=True)


def _wait_for(predicate, what: str, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    pytest.fail(f"{what} did not happen within {timeout}s")


def test_a_waiting_node_gives_up_after_the_outage_grace_with_one_clear_line(nodes):
    make, down, pool = nodes
    a = make("a")
    joining = pool.submit(a.next_rendezvous)
    _wait_for(lambda: a._last_state is not None and a._last_state.participants == ("a",),
              "a waiting in round 0")
    down.set()
    cut = time.monotonic()
    with pytest.raises(RendezvousUnreachableError) as caught:
        joining.result(GRACE_S + 10)
    took = time.monotonic() - cut
    assert GRACE_S - 0.2 <= took < GRACE_S + LATE_S, took
    message = str(caught.value)
    assert re.fullmatch(
        r"the switchable backend at test:1 was unreachable for 1s \(join_outage_timeout=1s\) "
        r"while node a waited for round 0 of run 'job' to form \(1 of min_nodes=2 joined: a\); "
        r"giving up the join\.", message), message
    # Given up for good: every later call says the same at once, the heartbeats stopped.
    down.clear()
    with pytest.raises(RendezvousUnreachableError):
        a.next_rendezvous()
    a._heartbeat_thread.join(2)
    assert not a._heartbeat_thread.is_alive()


def test_an_outage_shorter_than_the_grace_only_delays_the_join(nodes):
    make, down, pool = nodes
    a, b = make("a", join_outage_timeout=3), make("b", join_outage_timeout=3)
    joining = pool.submit(a.next_rendezvous)
    _wait_for(lambda: a._last_state is not None and a._last_state.participants == ("a",),
              "a waiting in round 0")
    down.set()
    time.sleep(1.5)  # the outage: half the grace
    down.clear()
    info_b = b.next_rendezvous()
    info_a = joining.result(10)
    assert (info_a.round, info_a.participants) == (info_b.round, ["a", "b"])


def test_a_running_round_never_gives_up_on_the_backend(nodes):
    make, down, pool = nodes
    a, b = make("a"), make("b")
    infos = [f.result(10) for f in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]]
    assert infos[0].participants == ["a", "b"]
    down.set()
    time.sleep(2.5 * GRACE_S)  # well beyond the joining grace: nothing may give up
    with pytest.raises(RendezvousError, match="switchable backend is down") as caught:
        a.restart_requested()
    assert not isinstance(caught.value, RendezvousUnreachableError)
    down.clear()
    # Back: the round goes on (nobody is dead, nobody asked for a restart), heartbeats resume.
    assert a.restart_requested() is None and b.restart_requested() is None
    assert a._aborted is None and a._heartbeat_thread.is_alive()


def test_the_default_grace_and_the_conf_key():
    assert _settings(join_outage_timeout=DEFAULT_JOIN_OUTAGE_TIMEOUT_S).join_outage_timeout == 60
    assert RendezvousSettings("r", 1, 2).join_outage_timeout == DEFAULT_JOIN_OUTAGE_TIMEOUT_S
    conf = RendezvousSettings.from_conf("r", 1, 2, {"join-outage-timeout": "7.5"})
    assert conf.join_outage_timeout == 7.5
    run = parse_run(["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379",
                     "--rdzv-conf", "join_outage_timeout=20,join_timeout=900", __file__], {})
    assert run.rendezvous.join_outage_timeout == 20.0
    assert run.rendezvous.join_timeout == 900.0


@pytest.mark.parametrize("value", ["0", "0.5", "-3", "nan", "inf", "3601"])
def test_a_bad_grace_is_a_usage_error_naming_the_key_and_the_range(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        parse_run(["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379",
                   "--rdzv-conf", f"join_outage_timeout={value}", __file__], {})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    shown = repr(float(value))
    assert err == ("shoal run: error: argument --rdzv-conf/--rdzv_conf: Rendezvous setting "
                   f"join_outage_timeout must be 1 to 3600 seconds, got {shown}."), err


@pytest.mark.parametrize("value, shown", [(0, "0"), (True, "True"), ("60", "'60'"),
                                          (float("nan"), "nan")])
def test_settings_in_code_reject_a_bad_grace_naming_the_range(value, shown):
    with pytest.raises(ValueError, match=re.escape(
            f"Rendezvous setting join_outage_timeout must be 1 to 3600 seconds, got {shown}.")):
        _settings(join_outage_timeout=value)


def test_a_grace_that_is_not_a_number_names_the_key(capsys):
    with pytest.raises(SystemExit):
        parse_run(["--rdzv-conf", "join_outage_timeout=soon", __file__], {})
    assert ("argument --rdzv-conf/--rdzv_conf: key 'join_outage_timeout': 'soon' is not a "
            "number") in capsys.readouterr().err
