"""init_process_group across real processes: file:// init, subgroups, and a second incarnation
after destroy_process_group in the same processes (what an elastic restart does)."""

from __future__ import annotations

import numpy as np

from tests.support.ranks import agent_store, run_ranks


def _reinit(rank, world, path):
    import shoal.collectives as c

    c.init_process_group("tcp", init_method=f"file://{path}", rank=rank, world_size=world, timeout=20)
    a = np.full(3, rank + 1.0)
    c.all_reduce(a)
    sub = c.new_group([1], timeout=20)
    if rank == 1:
        b = np.ones(2)
        c.all_reduce(b, group=sub)
        assert c.get_process_group_ranks(sub) == [1]
    c.destroy_process_group()
    # A second incarnation in the same processes (what an elastic restart does).
    c.init_process_group("tcp", init_method="env://", timeout=20)
    x = np.full(2, rank, np.int64)
    assert c.recv(x, src=0) == 0 if rank == 1 else c.send(np.full(2, 7, np.int64), dst=1) is None
    c.destroy_process_group()
    return a.tolist(), x.tolist()


def test_file_init_then_reinit_after_destroy(tmp_path):
    store, env = agent_store()
    try:
        results = run_ranks(_reinit, 2, args=(str(tmp_path / "fs"),), timeout=60, env=env)
    finally:
        store.close()
    assert results[0][0] == results[1][0] == [3.0, 3.0, 3.0]
    assert results[1][1] == [7, 7]
