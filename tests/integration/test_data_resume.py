"""A real `shoal run` of examples/train_ddp.py reading through DataLoader workers: a data
worker is SIGKILLed mid-epoch, the job fails naming it, and a second launch at another world
size resumes from the checkpoint; over the epoch every sample is consumed exactly once."""

from __future__ import annotations

import collections
import os
import re
import signal

from tests.support.shoal_run import TRAIN_DDP, ShoalRun

SIZE, BATCH, EVERY = 96, 2, 3  # 8 samples a step at 4 ranks, 6 at 3: resumable at steps 3k
JOB_TIMEOUT = 90
TRAIN = [str(TRAIN_DDP), "--dataset-size", str(SIZE), "--batch-size", str(BATCH),
         "--checkpoint-every", str(EVERY), "--data-workers", "1", "--log-samples"]
SAMPLES = re.compile(r"\[rank (\d+)\] rank \d+ step (\d+) epoch (\d+) samples ([\d,]+)")


def data_workers_of(pid: int) -> list[int]:
    """The DataLoader worker processes a rank forked (they name themselves shoal-data-N)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/comm") as comm:
                    if comm.read().startswith("shoal-data-"):
                        found.append(int(child))
    return found


def consumed(output: str, epoch: int, until: int | None = None) -> list[int]:
    """The sample indices the ranks logged for `epoch` (only steps <= until, if given)."""
    out = []
    for match in SAMPLES.finditer(output):
        step, ep = int(match.group(2)), int(match.group(3))
        if ep == epoch and (until is None or step <= until):
            out += [int(i) for i in match.group(4).split(",")]
    return out


def test_a_killed_data_worker_then_a_resume_at_three_ranks_reads_the_epoch_once(tmp_path):
    ck = str(tmp_path / "checkpoints")
    first = ShoalRun(["--standalone", "--nproc-per-node", "4", "--max-restarts", "0",
                      "--checkpoint-dir", ck] + TRAIN + ["--steps", "40", "--step-sleep", "0.2"],
                     name="4 ranks")
    with first:
        ranks = first.worker_pids(JOB_TIMEOUT)
        first.wait_for(r"\[rank 0\] step 5 loss", JOB_TIMEOUT)
        workers = data_workers_of(ranks[2])
        assert len(workers) == 1, f"rank 2 (pid {ranks[2]}) has data workers {workers}"
        os.kill(workers[0], signal.SIGKILL)
        assert first.wait(JOB_TIMEOUT) != 0, first.tail()
    assert re.search(rf"DataLoader worker 0 \(pid {workers[0]}\) was killed by signal SIGKILL",
                     first.output), first.tail()

    second = ShoalRun(["--standalone", "--nproc-per-node", "3", "--max-restarts", "0",
                       "--checkpoint-dir", ck] + TRAIN + ["--steps", "34"], name="3 ranks")
    with second:
        assert second.wait(JOB_TIMEOUT) == 0, second.tail()
    resumed = int(second.wait_for(r"\[rank 0\] resumed from step (\d+)", 1).group(1))
    assert resumed >= EVERY and resumed % EVERY == 0, second.tail()
    assert "[rank 2] rank 2 of 3" in second.output

    epoch0 = consumed(first.output, 0, until=resumed) + consumed(second.output, 0)
    counts = collections.Counter(epoch0)
    assert sorted(counts) == list(range(SIZE)), second.tail()
    assert set(counts.values()) == {1}, {i: c for i, c in counts.items() if c != 1}
    # the next epoch, wholly at 3 ranks, is one permutation of the dataset as well
    assert sorted(consumed(second.output, 1)) == list(range(SIZE))


def test_a_loader_in_elastic_state_resumes_mid_epoch_through_a_checkpoint(tmp_path):
    from shoal.core import data
    from shoal.elastic.checkpoint import Checkpointer
    from shoal.elastic.state import State

    def loader():
        return data.DataLoader(range(40), batch_size=4, shuffle=True, num_workers=1,
                               generator=data.Generator(3))

    whole = [b.array.tolist() for b in loader()]
    first = loader()
    state = State(checkpointer=Checkpointer(str(tmp_path)), rank=0, rng=False, loader=first,
                  step=0)
    it = iter(first)
    head = [next(it).array.tolist() for _ in range(3)]
    state.step = 3
    state.commit()  # in memory and on disk; the loader's state is ints and a uint32 array
    again = loader()
    restored = State(checkpointer=Checkpointer(str(tmp_path)), rank=0, rng=False, loader=again,
                     step=0)
    assert restored.load() == 3
    assert head + [b.array.tolist() for b in again] == whole


def test_a_pipe_loaders_state_goes_through_a_checkpoint_and_resumes_with_other_workers(tmp_path):
    from shoal.core import data
    from shoal.elastic.checkpoint import Checkpointer
    from shoal.elastic.state import State

    def loader(workers):
        pipe = (data.datapipes.IterableWrapper(range(50)).shuffle(buffer_size=8)
                .sharding_filter())
        return data.DataLoader(pipe, batch_size=4, num_workers=workers,
                               generator=data.Generator(3))

    first = loader(2)
    state = State(checkpointer=Checkpointer(str(tmp_path)), rank=0, rng=False, loader=first,
                  step=0)
    it = iter(first)
    head = [i for _ in range(3) for i in next(it).array.tolist()]
    state.step = 3
    state.commit()  # on disk: the shards' counts and layout are ints, lists and an int-keyed dict
    it.close()
    again = loader(0)  # the workers' shards are re-dealt to the one the process reads itself
    restored = State(checkpointer=Checkpointer(str(tmp_path)), rank=0, rng=False, loader=again,
                     step=0)
    assert restored.load() == 3
    assert sorted(head + [i for b in again for i in b.array.tolist()]) == list(range(50))
