"""A dataset's error in a DataLoader worker, against torch.utils.data as the oracle: each
failing batch raises the dataset's own exception type with the worker's traceback, and the
loader goes on with the next batches (torch's ExceptionWrapper semantics), for map-style
datasets and for an IterableDataset whose `__iter__` fails."""

from __future__ import annotations

import gc
import os
import re
import time

import pytest

from shoal.core import data

torch = pytest.importorskip("torch")
tud = torch.utils.data


def _record(loader, limit: int = 10) -> list[tuple]:
    """What each next() gave: ('ok', values), ('stop',) or (error type, torch's first words)."""
    it = iter(loader)
    try:
        return _outcomes(it, limit)
    finally:
        _stop(it)


def _stop(it) -> None:
    """Stop a torch iterator's workers now: after a reraise its iterator sits in a reference
    cycle, and a garbage collection in some later test would wait seconds for its workers."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _outcomes(it, limit: int) -> list[tuple]:
    out: list[tuple] = []
    for _ in range(limit):
        try:
            batch = next(it)
        except StopIteration:
            out.append(("stop",))
            break
        except Exception as exc:  # noqa: BLE001 - recorded and compared with torch's
            head = re.match(r"Caught \w+ in DataLoader worker process \d+", str(exc))
            out.append((type(exc).__name__, head.group(0) if head else str(exc)))
        else:
            out.append(("ok", batch.tolist() if hasattr(batch, "tolist") else batch))
    return out


def _both(make_ours, make_theirs, limit: int = 10, **kwargs) -> tuple[list, list]:
    ours = _record(data.DataLoader(make_ours(), **kwargs), limit)
    theirs = _record(tud.DataLoader(make_theirs(), **kwargs), limit)
    return ours, theirs


def _bad_get(base):
    class BadGet(base):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            if i in (2, 4):
                raise KeyError(f"no record {i}")
            return i

    return BadGet()


def _yields_then_fails(base):
    class YieldsThenFails(base):
        def __iter__(self):
            yield 1
            raise ValueError("stream broke")

    return YieldsThenFails()


def _iter_fails(base):
    class IterFails(base):
        def __iter__(self):
            raise ValueError("cannot open the shard")

    return IterFails()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_getitem_error_is_raised_for_its_batch_and_the_loader_goes_on(workers):
    ours, theirs = _both(lambda: _bad_get(data.Dataset), lambda: _bad_get(tud.Dataset),
                         num_workers=workers)
    assert ours == theirs
    assert [r[0] for r in ours] == ["ok", "ok", "KeyError", "ok", "KeyError", "ok", "stop"]


def test_a_workers_key_error_reads_as_torchs_not_as_a_repr():
    loader = data.DataLoader(_bad_get(data.Dataset), num_workers=1)
    with pytest.raises(KeyError) as info:
        list(loader)
    tit = iter(tud.DataLoader(_bad_get(tud.Dataset), num_workers=1))
    with pytest.raises(KeyError) as tinfo:
        list(tit)
    _stop(tit)
    # Both start with the text itself, not with its repr's quote.
    assert str(info.value).startswith("Caught KeyError in DataLoader worker process 0")
    assert str(tinfo.value).startswith("Caught KeyError in DataLoader worker process 0")
    assert "no record 2" in str(info.value) and "Original Traceback" in str(info.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_that_fails_mid_stream_raises_once_per_worker_then_ends(workers):
    ours, theirs = _both(lambda: _yields_then_fails(data.IterableDataset),
                         lambda: _yields_then_fails(tud.IterableDataset),
                         batch_size=None, num_workers=workers)
    assert ours == theirs
    expected = ([("ok", 1)] * max(workers, 1)
                + [("ValueError", f"Caught ValueError in DataLoader worker process {w}")
                   for w in range(workers)] + [("stop",)])
    if workers == 0:
        expected = [("ok", 1), ("ValueError", "stream broke"), ("stop",)]
    assert ours == expected


def test_an_iterable_whose_iter_fails_raises_its_error_from_each_worker():
    ours, theirs = _both(lambda: _iter_fails(data.IterableDataset),
                         lambda: _iter_fails(tud.IterableDataset), limit=3,
                         batch_size=2, num_workers=2)
    # Each worker's first batch is its __iter__'s error, with its type, as torch's. Then
    # torch's workers answer UnboundLocalError (they never built their fetcher) for ever; a
    # shoal worker's stream ends instead (docs/coming-from-pytorch.md).
    assert ours[:2] == theirs[:2] == [
        ("ValueError", f"Caught ValueError in DataLoader worker process {w}") for w in (0, 1)]
    assert ours[2] == ("stop",) and theirs[2][0] == "UnboundLocalError"


def test_the_workers_traceback_names_the_failing_line():
    it = iter(data.DataLoader(_iter_fails(data.IterableDataset), num_workers=1))
    with pytest.raises(ValueError, match=r"(?s)Original Traceback \(most recent call last\):"
                                         r".*in __iter__.*cannot open the shard"):
        next(it)


class _WithMessage(Exception):
    """An exception type that takes its text as `message=` (torch's reraise names it so)."""

    message = "unset"

    def __init__(self, *, message: str) -> None:
        super().__init__(message)
        self.message = message


class _RaisesWithMessage(data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        raise _WithMessage(message="bad sample")


def test_an_exception_with_a_message_field_is_rebuilt_with_it():
    with pytest.raises(_WithMessage, match="Caught _WithMessage in DataLoader worker process 0"):
        list(data.DataLoader(_RaisesWithMessage(), num_workers=1))


class _Dies(data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 1:
            os._exit(3)
        return i


def test_after_a_dead_worker_the_iterator_says_so_instead_of_a_closed_handle():
    it = iter(data.DataLoader(_Dies(), num_workers=1))
    assert next(it).tolist() == [0]
    with pytest.raises(data.WorkerDied, match="exited with code 3"):
        next(it)
    with pytest.raises(data.DataLoaderError, match=r"stopped at an earlier error \(WorkerDied"):
        next(it)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_a_failed_batch_resumes_after_it(workers):
    loader = data.DataLoader(_bad_get(data.Dataset), num_workers=workers)
    it = iter(loader)
    assert [next(it).tolist() for _ in range(2)] == [[0], [1]]
    with pytest.raises(KeyError):
        next(it)
    state = loader.state_dict()
    again = data.DataLoader(_bad_get(data.Dataset), num_workers=workers)
    again.load_state_dict(state)
    it = iter(again)
    assert next(it).tolist() == [3]


def test_an_iterator_left_after_an_error_stops_its_workers_when_collected():
    # The loader and its iterator refer to each other, so only the garbage collector frees
    # them; it once ran the pool's pipes' own finalizers first, the workers never heard
    # "stop", and each collection waited out the 5 s join.
    _record(data.DataLoader(_bad_get(data.Dataset), num_workers=2))
    loader = data.DataLoader(_bad_get(data.Dataset), num_workers=1)
    it = iter(loader)
    with pytest.raises(KeyError):
        list(it)
    worker = it.pool.procs[0]
    del loader, it
    started = time.monotonic()
    gc.collect()
    assert time.monotonic() - started < 2.0  # a stopped worker leaves in well under a second
    worker.join(2.0)
    assert not worker.is_alive()
