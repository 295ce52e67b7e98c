"""Metrics for training code, labelled by rank (imported as `shoal.metrics`).

Under `shoal run` a worker's prometheus_client metrics go to the node agent's /metrics
(multiprocess mode) and are summed across the node's workers; these carry a `rank` label so
each rank stays visible. (In a job that synchronises inside the step, as DDP does, every rank's
step takes the slowest rank's time; the straggler is the rank that spends the least of it
waiting in collectives: the dashboard's "work per step" panel.)

    import shoal.metrics as sm
    for step, batch in enumerate(loader):
        with sm.step(step, samples=len(batch)) as s:
            loss = train_step(batch)
            s.loss = float(loss)

or, timing the step yourself, `sm.record_step(step, seconds, samples=..., loss=...)`.
`sm.counter/gauge/histogram` make your own metrics with the rank label added;
`sm.save_checkpoint` and `sm.load_latest_checkpoint` time a Checkpointer and record the
last checkpointed step. The rank label is bounded by the world size.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional, Sequence

from shoal.core import telemetry

__all__ = ["rank", "record_step", "step", "counter", "gauge", "histogram", "save_checkpoint",
           "load_latest_checkpoint", "record_checkpoint_save", "record_checkpoint_load"]

# Step times from 1 ms to 10 min (a straggler heatmap reads these buckets).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0, 300.0, 600.0)

STEP_SECONDS = telemetry.histogram(
    "shoal_training_step_seconds", "Wall time of one training step on this rank.", ["rank"],
    buckets=STEP_BUCKETS)
SAMPLES = telemetry.counter(
    "shoal_training_samples_total", "Samples this rank trained on.", ["rank"])
LOSS = telemetry.gauge(
    "shoal_training_loss", "The loss of this rank's last recorded step.", ["rank"],
    multiprocess_mode="livemax")
LAST_STEP = telemetry.gauge(
    "shoal_training_last_step", "The last step this rank recorded (a progress heartbeat).",
    ["rank"], multiprocess_mode="livemax")
# "max" as collectives' heartbeat (a timestamp only grows; the agent leaves out ranks its node
# no longer runs); the last step itself is "livemax": a restarted rank resumes from an older
# checkpoint, and its dead process's higher step must not hide that.
LAST_STEP_TIME = telemetry.gauge(
    "shoal_training_last_step_timestamp_seconds",
    "Unix time this rank last recorded a step.", ["rank"], multiprocess_mode="max")
CHECKPOINT_SECONDS = telemetry.histogram(
    "shoal_checkpoint_duration_seconds", "Seconds to save or load one checkpoint, by operation.",
    ["operation"])
# The last checkpoint's figures are "mostrecent": the value written last wins, whichever process
# (alive or ended) wrote it. "max" would keep reporting a newer checkpoint that a restarted job
# found unusable and fell back from.
CHECKPOINT_LAST_SECONDS = telemetry.gauge(
    "shoal_checkpoint_last_duration_seconds", "Seconds the last checkpoint save or load took, "
    "by operation.", ["operation"], multiprocess_mode="mostrecent")
CHECKPOINT_BYTES = telemetry.counter(
    "shoal_checkpoint_bytes_total", "Bytes of checkpoint files saved or loaded, by operation.",
    ["operation"])
CHECKPOINT_STEP = telemetry.gauge(
    "shoal_checkpoint_last_step", "The step of the newest usable checkpoint: the last one saved, "
    "or the one a restarted job resumed from (work a failure would not lose).",
    multiprocess_mode="mostrecent")
CHECKPOINT_TIME = telemetry.gauge(
    "shoal_checkpoint_last_save_timestamp_seconds", "Unix time the newest usable checkpoint was "
    "saved.", multiprocess_mode="mostrecent")
for _operation in ("save", "load"):
    CHECKPOINT_SECONDS.labels(operation=_operation)
    CHECKPOINT_BYTES.labels(operation=_operation)


def rank() -> str:
    """This process's rank as the label value: RANK from the environment ("0" without)."""
    return os.environ.get("RANK", "0")


def record_step(step: int, seconds: float, samples: Optional[int] = None,
                loss: Optional[float] = None) -> None:
    """Record one finished training step of this rank.

    Raises:
        ValueError: a negative step or duration, or negative samples.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}.")
    if not seconds >= 0:
        raise ValueError(f"seconds must be >= 0, got {seconds!r}.")
    if samples is not None and samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples!r}.")
    r = rank()
    STEP_SECONDS.labels(rank=r).observe(seconds)
    if samples:
        SAMPLES.labels(rank=r).inc(samples)
    if loss is not None:
        LOSS.labels(rank=r).set(float(loss))
    LAST_STEP.labels(rank=r).set(step)
    LAST_STEP_TIME.labels(rank=r).set(time.time())


class _Step:
    def __init__(self, samples: Optional[int], loss: Optional[float]):
        self.samples = samples
        self.loss = loss


@contextlib.contextmanager
def step(number: int, samples: Optional[int] = None, loss: Optional[float] = None):
    """Time the body as step `number`; set `.loss` / `.samples` on the yielded object inside.
    A step whose body raises is not recorded."""
    record = _Step(samples, loss)
    started = time.perf_counter()
    yield record
    record_step(number, time.perf_counter() - started, record.samples, record.loss)


class _RankBound:
    """A user's metric with the rank label filled in: `.labels(**others)` adds rank, and a
    metric with no labels of its own is used directly (`inc`, `set`, `observe`)."""

    def __init__(self, metric, own_labels: Sequence[str]):
        self._metric = metric
        self._own = tuple(own_labels)
        self._bound = None if own_labels else metric.labels(rank=rank())

    def labels(self, **labels):
        return self._metric.labels(rank=rank(), **labels)

    def __getattr__(self, name):
        if self._bound is None:
            raise AttributeError(
                f"{name!r}: this metric has labels {list(self._own)}; call .labels(...) first.")
        return getattr(self._bound, name)


def _check_labels(labelnames: Sequence[str]) -> list[str]:
    if "rank" in labelnames:
        raise ValueError("labelnames must not include 'rank': shoal.metrics adds it.")
    return ["rank", *labelnames]


def counter(name: str, documentation: str, labelnames: Sequence[str] = ()):
    """Your own counter with a rank label (created once per process)."""
    return _RankBound(telemetry.counter(name, documentation, _check_labels(labelnames)),
                      labelnames)


def gauge(name: str, documentation: str, labelnames: Sequence[str] = (),
          multiprocess_mode: str = "livemax"):
    """Your own gauge with a rank label (one series per rank: livemax keeps the live value)."""
    return _RankBound(telemetry.gauge(name, documentation, _check_labels(labelnames),
                                      multiprocess_mode=multiprocess_mode), labelnames)


def histogram(name: str, documentation: str, labelnames: Sequence[str] = (),
              buckets=telemetry.LATENCY_BUCKETS):
    """Your own histogram with a rank label."""
    return _RankBound(telemetry.histogram(name, documentation, _check_labels(labelnames),
                                          buckets=buckets), labelnames)


def record_checkpoint_save(step: int, seconds: float, nbytes: int) -> None:
    """Record a checkpoint of `step` that was saved in `seconds` as `nbytes` bytes."""
    CHECKPOINT_SECONDS.labels(operation="save").observe(seconds)
    CHECKPOINT_LAST_SECONDS.labels(operation="save").set(seconds)
    CHECKPOINT_BYTES.labels(operation="save").inc(nbytes)
    record_usable_checkpoint(step, time.time())


def record_checkpoint_load(seconds: float, nbytes: int, step: Optional[int] = None,
                           saved_at: Optional[float] = None) -> None:
    """Record a checkpoint that was loaded in `seconds` from `nbytes` bytes. Given its `step`
    (and `saved_at`, the Unix time it was saved), it becomes the last checkpointed step: a job
    that fell back to an older checkpoint would lose the work since that one."""
    CHECKPOINT_SECONDS.labels(operation="load").observe(seconds)
    CHECKPOINT_LAST_SECONDS.labels(operation="load").set(seconds)
    CHECKPOINT_BYTES.labels(operation="load").inc(nbytes)
    if step is not None:
        record_usable_checkpoint(step, saved_at)


def record_usable_checkpoint(step: int, saved_at: Optional[float]) -> None:
    """The checkpoint of `step`, saved at `saved_at` (Unix time), is the newest usable one:
    just saved, or the one a job resumed from (also past a damaged newer one)."""
    CHECKPOINT_STEP.set(step)
    if saved_at is not None:
        CHECKPOINT_TIME.set(saved_at)


def save_checkpoint(checkpointer, step: int, state: dict) -> str:
    """`checkpointer.save(step, state)`, which returns the file's path. elastic's Checkpointer
    records its own saves; another checkpointer's save is timed and recorded here."""
    if _records_itself(checkpointer):
        return checkpointer.save(step, state)
    started = time.perf_counter()
    path = checkpointer.save(step, state)
    record_checkpoint_save(step, time.perf_counter() - started, os.path.getsize(path))
    return path


def load_latest_checkpoint(checkpointer):
    """`checkpointer.load_latest()`: (step, state) or None. Records the load as
    `save_checkpoint` records a save, and the step loaded as the last checkpointed one (a
    checkpointer that skipped a damaged newer file falls back to an older step).

    The checkpointer needs `load_latest()` and `path(step)` (the file of a step, whose size and
    modification time are recorded).

    Raises:
        TypeError: the checkpointer lacks one of them.
    """
    missing = [name for name in ("load_latest", "path")
               if not callable(getattr(checkpointer, name, None))]
    if missing:
        raise TypeError(f"load_latest_checkpoint needs a checkpointer with load_latest() and "
                        f"path(step); {type(checkpointer).__name__} has no "
                        f"{' and no '.join(name + '()' for name in missing)}.")
    if _records_itself(checkpointer):
        return checkpointer.load_latest()  # it records the load and the step it resumed from
    started = time.perf_counter()
    found = checkpointer.load_latest()
    if found is not None:
        took = time.perf_counter() - started
        try:
            stat = os.stat(checkpointer.path(found[0]))
        except OSError:  # pruned by another rank since: the load itself succeeded
            record_checkpoint_load(took, 0, step=found[0])
        else:
            record_checkpoint_load(took, stat.st_size, step=found[0], saved_at=stat.st_mtime)
    return found


def _records_itself(checkpointer) -> bool:
    return getattr(type(checkpointer), "records_metrics", False)
