"""DistributedSampler and DataPipe sharding in real process groups: defaults read the default
group, the ranks' shares are torch's and cover the dataset, and pipes shard by the group, over
worker processes too, and resume at another world size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.ranks import agent_store, run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _shares(rank, world):
    import shoal.collectives as c
    from shoal.core import data

    with pytest.raises(c.CollectiveError, match="call collectives.init_process_group"):
        c.DistributedSampler(range(10))
    c.init_process_group("tcp", init_method="env://", timeout=20)
    try:
        sampler = c.DistributedSampler(range(29), seed=4)
        sampler.set_epoch(2)
        # num_workers=0: these spawned ranks are daemonic, and multiprocessing forbids a
        # daemonic process children (tests/integration/test_data_resume.py runs workers in ranks)
        loader = data.DataLoader(range(29), batch_size=3, sampler=sampler)
        mine = [i for b in loader for i in b.array.tolist()]
        gathered = [None] * world
        c.all_gather_object(gathered, mine)
        c.set_datapipe_sharding()
        pipe = (data.datapipes.IterableWrapper(range(40)).shuffle(buffer_size=8)
                .sharding_filter())
        piped = [i for b in data.DataLoader(pipe, batch_size=4, generator=data.Generator(1))
                 for i in b.array.tolist()]
        return sampler.rank, sampler.num_replicas, mine, gathered, piped
    finally:
        c.destroy_process_group()


def test_defaults_read_the_default_group_and_shares_cover_the_dataset():
    torch = pytest.importorskip("torch")
    store, env = agent_store()
    try:
        results = run_ranks(_shares, 3, timeout=90, env=env)
    finally:
        store.close()
    for rank, (r, world, mine, gathered, _) in enumerate(results):
        assert (r, world) == (rank, 3)
        theirs = torch.utils.data.DistributedSampler(range(29), 3, rank, seed=4)
        theirs.set_epoch(2)
        assert mine == list(theirs)
        assert gathered == [res[2] for res in results]
    assert {i for res in results for i in res[2]} == set(range(29))
    piped = sorted(i for res in results for i in res[4])
    assert piped == list(range(40))  # each rank its shard of one shared shuffle: each item once


def test_workers_in_a_daemonic_process_are_refused_with_a_reason():
    results = run_ranks(_daemonic, 1, timeout=60)
    assert "this process is daemonic" in results[0]


def _daemonic(rank, world):
    from shoal.core import data

    try:
        list(data.DataLoader(range(4), num_workers=1))
    except data.DataLoaderError as exc:
        return str(exc)
    return "no error"


# --- DataPipes over worker processes in real ranks --------------------------------------------
# run_ranks' processes are daemonic and may not start DataLoader workers, so these ranks are
# plain subprocesses running _pipe_rank (below) that join one process group.

PIPE_SIZE, PIPE_BATCH, HEAD_STEPS = 151, 4, 5


def with_worker(x):
    """The item and the id of the loader worker that produced it (-1: the rank itself)."""
    from shoal.core import data

    info = data.get_worker_info()
    return x, info.id if info is not None else -1


def _pipe_rank() -> None:
    phase, workers, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import shoal.collectives as c
    from shoal.collectives import gather_loader_state  # the lazy public name
    from shoal.core import data

    c.init_process_group("tcp", init_method="env://", timeout=30)
    try:
        c.set_datapipe_sharding()
        pipe = (data.datapipes.IterableWrapper(range(PIPE_SIZE)).shuffle(buffer_size=16)
                .sharding_filter().map(with_worker))
        loader = data.DataLoader(pipe, batch_size=PIPE_BATCH, num_workers=workers,
                                 generator=data.Generator(11))
        if phase != "first":
            with open(path) as f:
                loader.load_state_dict(json.load(f)[phase])
        head, rest, served = [], [], set()
        it = iter(loader)
        if phase == "first":  # lockstep steps, then both states, then the rest of the epoch
            for _ in range(HEAD_STEPS):
                x, wid = next(it)
                head += x.array.tolist()
                served.update(wid.array.tolist())
            states = {"rank0": loader.state_dict(), "merged": gather_loader_state(loader)}
            if c.get_rank() == 0:
                with open(path, "w") as f:
                    json.dump(states, f, default=lambda a: a.tolist())  # generator words
            c.barrier()
        for x, wid in it:
            rest += x.array.tolist()
            served.update(wid.array.tolist())
        print(json.dumps({"head": head, "rest": rest, "served": sorted(served)}), flush=True)
    finally:
        c.destroy_process_group()


def launch(world: int, phase: str, workers: int, path: str, timeout: float = 90) -> list[dict]:
    store, env = agent_store()
    code = "from tests.multiproc.test_data_distributed import _pipe_rank; _pipe_rank()"
    procs = []
    try:
        for rank in range(world):
            rank_env = dict(os.environ, **env, RANK=str(rank), WORLD_SIZE=str(world),
                            LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen(
                [sys.executable, "-c", code, phase, str(workers), path], env=rank_env,
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = []
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err[-4000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        store.close()


def test_pipes_shard_over_ranks_and_workers_and_resume_at_other_world_sizes(tmp_path):
    path = str(tmp_path / "states.json")
    first = launch(3, "first", 2, path)
    whole = [i for r in first for i in r["head"] + r["rest"]]
    assert sorted(whole) == list(range(PIPE_SIZE))  # every sample once over 3 ranks x 2 workers
    assert all(r["served"] == [0, 1] for r in first)  # both workers of every rank produced
    head = [i for r in first for i in r["head"]]
    assert len(head) == 3 * HEAD_STEPS * PIPE_BATCH
    # rank 0's state (what elastic.State saves) at 2 ranks x 2 workers; every rank's at 4 x 0
    for phase, world, workers in (("rank0", 2, 2), ("merged", 4, 0)):
        resumed = [i for r in launch(world, phase, workers, path) for i in r["rest"]]
        assert sorted(head + resumed) == list(range(PIPE_SIZE)), phase
