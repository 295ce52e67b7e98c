"""Failures through the "shoal" torch backend are diagnosed as shoal's own groups do: a killed
rank surfaces in seconds as an error naming it, and a rank that never arrives at a collective
(or at the group's setup) ends in a timeout naming it."""

from __future__ import annotations

import os
import re
import signal

from tests.support.ranks import Ranks


def _init(rank, world, seconds):
    import datetime

    import torch
    import torch.distributed as dist

    import shoal.torch_bridge  # noqa: F401 - registers the "shoal" backend

    torch.set_num_threads(1)
    dist.init_process_group("shoal", init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=seconds))
    return torch, dist


def _error_of(call) -> tuple:
    import time

    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def _killed_mid_training(rank, world):
    torch, dist = _init(rank, world, 60)  # the group's timeout is far beyond the bound below
    t = torch.ones(100_000)
    dist.all_reduce(t)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _error_of(lambda: [dist.all_reduce(t) for _ in range(1000)])


def test_a_killed_torch_rank_is_named_within_seconds(torch_env, tmp_path):
    with Ranks(_killed_mid_training, 3, env=dict(torch_env, SHOAL_DUMP_DIR=str(tmp_path))) as ranks:
        results = ranks.results(timeout=90, ranks=[0, 1])
    for rank in (0, 1):
        status, (kind, message, elapsed) = results[rank]
        assert status == "ok" and kind is not None, (rank, results[rank])
        assert kind == "PeerLost", (rank, kind, message)
        assert re.match(rf"Rank {rank} failed all_reduce #\d+ of group 'default': rank 2 was lost",
                        message), message
        # A dead peer's socket closes at once; shoal turns that into an error at the next read,
        # not at the group's 60 s timeout. 15 s leaves room for a loaded 2-core machine.
        assert elapsed < 15, (rank, elapsed, message)


def _one_never_arrives(rank, world):
    import datetime

    torch, dist = _init(rank, world, 4)
    if rank == world - 1:
        # Alive but elsewhere: wait until the others have their error, then leave.
        peer = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=datetime.timedelta(seconds=60))
        peer.wait(["reported/0", "reported/1"])
        return None
    result = _error_of(lambda: dist.all_reduce(torch.ones(4)))
    dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                  is_master=False).set(f"reported/{rank}", "1")
    return result


def test_a_rank_that_never_arrives_is_named_in_the_timeout(torch_env, run_torch_ranks, tmp_path):
    env = dict(torch_env, SHOAL_DUMP_DIR=str(tmp_path))
    results = run_torch_ranks(_one_never_arrives, 3, timeout=90, env=env)
    for rank in (0, 1):
        kind, message, elapsed = results[rank]
        assert kind == "CollectiveTimeout", (rank, kind, message)
        # Whichever watchdog fires first fails the group; the other rank relays its reason.
        assert re.match(rf"Rank {rank} (timed out after 4s in all_reduce #1 of group 'default'|"
                        rf"failed all_reduce #1 of group 'default': rank [01] timed out after 4s "
                        rf"in all_reduce #1): rank 2 never arrived\.", message), message
        assert 4 <= elapsed < 30, (rank, elapsed)  # the group's 4 s timeout, plus the watchdog
        # The dump of each rank's recent collectives, as shoal's own groups write it.
        assert list(tmp_path.glob(f"shoal-collectives-default-rank{rank}-*.json")), message


def _never_joins(rank, world):
    if rank == 1:
        return None  # never calls init_process_group
    return _error_of(lambda: _init(rank, world, 3))


def test_a_rank_that_never_joins_the_group_is_named(torch_env, run_torch_ranks, tmp_path):
    env = dict(torch_env, SHOAL_DUMP_DIR=str(tmp_path))
    kind, message, elapsed = run_torch_ranks(_never_joins, 2, timeout=60, env=env)[0]
    assert kind == "CollectiveTimeout", (kind, message)
    assert re.match(r"Rank 0 of group 'default' waited 3s for connections from rank\(s\) 1, "
                    "which never connected", message), message
    assert elapsed < 30, elapsed  # the 3 s timeout, after torch's own start-up


def _mismatched(rank, world):
    import prometheus_client

    torch, dist = _init(rank, world, 20)
    dist.all_reduce(torch.ones(8))
    done = prometheus_client.REGISTRY.get_sample_value(
        "shoal_collectives_op_duration_seconds_count", {"op": "all_reduce", "backend": "tcp"})
    return done, _error_of(lambda: dist.all_reduce(torch.ones(4 + rank)))


def test_mismatched_torch_calls_are_named_and_counted_in_shoals_metrics(torch_env, run_torch_ranks,
                                                                         tmp_path):
    env = dict(torch_env, SHOAL_DUMP_DIR=str(tmp_path))
    for rank, (done, (kind, message, elapsed)) in enumerate(
            run_torch_ranks(_mismatched, 2, timeout=60, env=env)):
        assert done == 1.0, (rank, done)  # the bridge's all_reduce is in shoal's metrics
        assert kind == "CollectiveMismatch", (rank, kind, message)
        assert "float32[4]" in message and "float32[5]" in message, message
        assert elapsed < 10, elapsed  # the headers disagree at once, no timeout involved


def _join_with_own_secret(rank, world):
    return _error_of(lambda: _init(rank, world, 5))


def test_a_rank_without_the_jobs_secret_cannot_join(torch_env, tmp_path):
    env = dict(torch_env, SHOAL_DUMP_DIR=str(tmp_path))
    secrets = {0: {"SHOAL_AUTH_TOKEN": "the-jobs-secret"}, 1: {"SHOAL_AUTH_TOKEN": "a-guess"}}
    with Ranks(_join_with_own_secret, 2, env=env, rank_env=secrets) as ranks:
        results = ranks.results(timeout=60)
    # torch's store is shared and unauthenticated, but the shoal group's own connections prove
    # the secret first: the guessing rank is refused, naming the cause, and the job's rank
    # never counts it as connected.
    (s0, (kind0, message0, _)), (s1, (kind1, message1, _)) = results[0], results[1]
    assert (s0, kind0, s1, kind1) == ("ok", "CollectiveTimeout", "ok", "CollectiveError")
    assert message0.startswith("Rank 0 of group 'default' waited 5s for connections from "
                               "rank(s) 1, which never connected"), message0
    assert message1.startswith("Rank 1 of group 'default' could not connect to rank 0") \
        and "refused this process's secret" in message1, message1
