"""RRefs across three spawned workers: remote() and to_here(), the proxy helpers, RRefs inside
arguments and results, and lifetimes checked through a weakref on the owner."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

from shoal.rpc_agent.functions import async_execution
from tests.support.rpc_workers import RpcWorkers

WORLD = 3


@pytest.fixture(scope="module")
def workers():
    with RpcWorkers(WORLD) as pool:
        yield pool
        pool.shutdown()


# ----------------------------------------------------------------------------- owner side

class Counter:
    """A stateful object that lives on its owner."""

    def __init__(self, start):
        self.value = start

    def add(self, n):
        self.value += n
        return self.value

    def get(self):
        return self.value

    def fail(self):
        raise KeyError("no such entry")

    @async_execution
    def add_later(self, n):
        from shoal import rpc_agent

        fut = rpc_agent.Future()
        threading.Timer(0.05, lambda: fut.set_result(self.add(n))).start()
        return fut


class Tracked:
    """An owner-side object whose lifetime the tests watch."""

    def __init__(self, tag):
        self.tag = tag
        self.payload = np.arange(10)


_watch: dict[str, weakref.ref] = {}
_held: dict[str, object] = {}


def make_tracked(tag):
    obj = Tracked(tag)
    _watch[tag] = weakref.ref(obj)
    return obj


def is_alive(tag, timeout=0.0):
    """Whether the tracked object still exists here (waiting up to `timeout` for it to go)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        ref = _watch.get(tag)
        alive = ref is not None and ref() is not None
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def slow_value(seconds, value):
    time.sleep(seconds)
    return value


def raise_in_remote():
    raise LookupError("the remote function failed")


def hold(key, rref):
    """Keep an RRef received as an argument (a user fork on this worker)."""
    _held[key] = rref
    return rref.is_owner(), rref.owner_name()


def wait_confirmed(key, timeout=10.0):
    """The owner confirms a received fork asynchronously; wait until it has."""
    deadline = time.monotonic() + timeout
    while not _held[key].confirmed_by_owner():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def drop(key):
    _held.pop(key, None)
    gc.collect()


def fetch_held(key):
    return _held[key].to_here().tag


def owned_count():
    from shoal.rpc_agent import _current

    return _current.get().rrefs.owned_count()


def my_own_rref(tag):
    """An RRef owned by this worker, returned to the caller (owner -> user fork)."""
    from shoal import rpc_agent

    return rpc_agent.RRef(make_tracked(tag))


def value_through_owner_handle(rref):
    """Run on the owner: an RRef sent back to its owner arrives as the owner's handle."""
    return rref.is_owner(), rref.local_value().tag


# ----------------------------------------------------------------------------- user side

def basic_remote():
    from shoal import rpc_agent

    rref = rpc_agent.remote("w1", Counter, (10,))
    out = {
        "owner": (rref.owner().name, rref.owner().id),
        "owner_name": rref.owner_name(),
        "is_owner": rref.is_owner(),
        "to_here": rref.to_here().value,
        "sync_add": rref.rpc_sync().add(5),
        "async_add": rref.rpc_async().add(1).wait(10),
        "async_method": rref.rpc_sync().add_later(100),
    }
    child = rref.remote().get()
    out["child_owner"] = child.owner_name()
    out["child_value"] = child.to_here()
    try:
        rref.rpc_sync().fail()
    except KeyError as exc:
        out["method_error"] = str(exc)
    try:
        rref.local_value()
    except rpc_agent.RpcError as exc:
        out["local_value_error"] = str(exc)
    local = rpc_agent.remote("w0", Counter, (3,))
    out["self_remote"] = (local.is_owner(), local.local_value().get(), local.to_here().get())
    return out


def test_remote_to_here_and_the_proxy_helpers(workers):
    out = workers.run(0, basic_remote)
    assert out["owner"] == ("w1", 1) and out["owner_name"] == "w1"
    assert out["is_owner"] is False
    assert out["to_here"] == 10
    assert out["sync_add"] == 15 and out["async_add"] == 16 and out["async_method"] == 116
    assert out["child_owner"] == "w1" and out["child_value"] == 116
    assert out["method_error"] == "'no such entry'"
    assert out["local_value_error"].startswith("local_value() called on worker 'w0' for an RRef "
                                               "owned by 'w1'")
    assert out["self_remote"] == (True, 3, 3)


def to_here_waits():
    from shoal import rpc_agent

    t = time.monotonic()
    rref = rpc_agent.remote("w2", slow_value, (0.5, "ready"))
    value = rref.to_here(timeout=10)
    return value, time.monotonic() - t


def to_here_of_failed_remote():
    from shoal import rpc_agent

    rref = rpc_agent.remote("w1", raise_in_remote)
    try:
        rref.to_here(timeout=10)
    except LookupError as exc:
        return type(exc).__name__, str(exc), "raise_in_remote" in exc.remote_traceback
    return None


def to_here_timeout():
    from shoal import rpc_agent

    rref = rpc_agent.remote("w2", slow_value, (3, "late"))
    try:
        rref.to_here(timeout=0.3)
    except rpc_agent.RpcTimeout as exc:
        return str(exc)
    return None


_KEPT: dict = {}


def keep_and_return(key):
    """Runs on its worker: makes an object, remembers it, returns it."""
    _KEPT[key] = Counter(7)
    return _KEPT[key]


def remote_to_self_keeps_the_object():
    """remote() to this worker holds the object the function returned (torch's OwnerRRef
    holds the value itself), not a pickled copy; a failing one fails its RRef."""
    from shoal import rpc_agent

    rref = rpc_agent.remote("w0", keep_and_return, ("self",))
    same = rref.to_here(timeout=10) is _KEPT["self"] and rref.local_value() is _KEPT["self"]
    failing = rpc_agent.remote("w0", raise_in_remote)
    try:
        failing.to_here(timeout=10)
        failed = None
    except LookupError as exc:
        failed = type(exc).__name__
    return same, failed


def test_remote_to_this_worker_keeps_the_returned_object(workers):
    assert workers.run(0, remote_to_self_keeps_the_object) == (True, "LookupError")


def test_to_here_waits_for_a_value_still_being_computed(workers):
    value, elapsed = workers.run(0, to_here_waits)
    assert value == "ready" and elapsed >= 0.45
    assert workers.run(0, to_here_of_failed_remote) == (
        "LookupError", "the remote function failed", True)
    assert workers.run(0, to_here_timeout) == (
        "The rref call of shoal.rpc_agent.rref._fetch on worker 'w2' (id 2) timed out after 0.3s.")


def lifetime_user_to_user(tag):
    """w0 creates the value on w1, hands the RRef to w2, then drops its own."""
    from shoal import rpc_agent

    rref = rpc_agent.remote("w1", make_tracked, (tag,))
    held = rpc_agent.rpc_sync("w2", hold, (tag, rref))
    del rref
    gc.collect()
    return held


def test_owner_keeps_the_value_until_every_user_dropped_it(workers):
    tag = "u2u"
    before = workers.run(1, owned_count)
    held = workers.run(0, lifetime_user_to_user, tag)
    assert held == (False, "w1")
    assert workers.run(2, wait_confirmed, tag) is True
    # w0 dropped its fork; w2's fork still keeps the value alive on w1.
    assert workers.run(1, is_alive, tag, 0.5) is True
    assert workers.run(2, fetch_held, tag) == tag
    workers.run(2, drop, tag)
    assert workers.run(1, is_alive, tag, 10.0) is False
    assert workers.run(1, owned_count) <= before


def lifetime_owner_to_user(tag):
    """w0 gets an RRef that w1 owns (w1 created it with RRef(value)) and sends it back to w1."""
    from shoal import rpc_agent

    rref = rpc_agent.rpc_sync("w1", my_own_rref, (tag,))
    owner_view = rpc_agent.rpc_sync("w1", value_through_owner_handle, (rref,))
    value = rref.to_here().tag
    del rref
    gc.collect()
    return owner_view, value


def test_owner_to_user_and_user_to_owner_forks_are_released(workers):
    tag = "o2u"
    owner_view, value = workers.run(0, lifetime_owner_to_user, tag)
    assert owner_view == (True, tag) and value == tag
    assert workers.run(1, is_alive, tag, 10.0) is False


def many_forks(tag, rounds):
    """Pass one RRef back and forth between users many times, then drop everything."""
    from shoal import rpc_agent

    rref = rpc_agent.remote("w1", make_tracked, (tag,))
    for i in range(rounds):
        rpc_agent.rpc_sync("w2", hold, (f"{tag}-{i}", rref))
    del rref
    gc.collect()


def drop_prefix(prefix):
    for key in [k for k in _held if k.startswith(prefix)]:
        del _held[key]
    gc.collect()


def test_many_forks_from_two_users_all_count(workers):
    tag = "many"
    workers.run(0, many_forks, tag, 20)
    assert workers.run(1, is_alive, tag, 0.3) is True
    workers.run(2, drop_prefix, tag)
    assert workers.run(1, is_alive, tag, 10.0) is False


def pickle_rref_outside_rpc():
    import pickle

    from shoal import rpc_agent

    rref = rpc_agent.RRef(5)
    try:
        pickle.dumps(rref)
    except rpc_agent.RpcError as exc:
        return str(exc)
    return None


def test_rrefs_cannot_be_pickled_outside_an_rpc(workers):
    assert workers.run(0, pickle_rref_outside_rpc) == (
        "An RRef can only be pickled as an argument or result of an RPC; it cannot be saved or "
        "sent any other way.")


def drop_a_burst(tags):
    """w0 makes one RRef per tag on w1, fetches each, then drops them all at once; returns how
    many delete messages it sent for them."""
    from shoal import rpc_agent
    from shoal.rpc_agent import metrics

    deletes = metrics.REQUEST_CHILDREN[("rref", "ok")]
    rrefs = [rpc_agent.remote("w1", make_tracked, (tag,)) for tag in tags]
    assert [r.to_here().tag for r in rrefs] == tags
    sent_before = deletes._value.get()
    del rrefs
    deadline = time.monotonic() + 10.0
    while rpc_agent.rpc_sync("w1", any_alive, (tags,)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return deletes._value.get() - sent_before


def any_alive(tags):
    return any(is_alive(tag) for tag in tags)


def test_a_burst_of_drops_frees_every_value_in_a_few_messages(workers):
    tags = [f"burst{i}" for i in range(40)]
    before = workers.run(1, owned_count)
    delete_messages = workers.run(0, drop_a_burst, tags)
    assert workers.run(1, any_alive, tags) is False
    assert workers.run(1, owned_count) <= before
    # Drops within DELETE_LINGER_S (2 ms) share one message per owner; these 40 come in one
    # `del` of a list (microseconds), so one or two messages, unless the OS stops w0 for more
    # than 2 ms several times inside it. One message per drop would be 40.
    assert 1 <= delete_messages <= 10
