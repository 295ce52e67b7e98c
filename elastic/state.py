"""`State`: a training loop's resumable state, as Horovod's elastic state.

    state = State(model=model, optimizer=opt, step=0,
                  checkpointer=Checkpointer(os.environ["SHOAL_CHECKPOINT_DIR"]))
    state.load()          # after a restart: the newest verified checkpoint, if any
    state.sync()          # rank 0's state to every rank (a joining worker gets it too)
    while state.step < steps:
        train_one(state.step)
        state.step += 1
        if state.step % 10 == 0:
            state.commit()   # in memory on every rank, on disk from rank 0

Objects with `state_dict()`/`load_state_dict()` (models, optimizers, schedulers) are captured
through them; anything else (counters, arrays, dicts) is deep-copied and replaced on restore.
The RNG states of Python's `random`, numpy's global generator and core's generator are
captured too unless `rng=False`.
"""

from __future__ import annotations

import copy
import logging
import os
import random
from typing import Any, Optional

import numpy as np

from shoal import collectives
from shoal.core.ops import random as core_random
from shoal.core.timeouts import TimeoutLike
from shoal.elastic.checkpoint import Checkpointer

logger = logging.getLogger(__name__)

__all__ = ["State"]

_RNG_KEY = "__rng__"
_STEP_KEY = "step"


def _capture_rng() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "core": core_random.get_state()}


def _apply_rng(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "core" in states:  # a snapshot taken by an older shoal may lack it
        core_random.set_state(states["core"])


def _has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


class State:
    """Named training objects that can be committed, restored, synced and checkpointed.

    Args:
        checkpointer: where `commit` also saves (from rank 0) and `load` reads; optional.
        rank: this process's rank (default: the default process group's, else $RANK, else 0).
        rng: capture and restore the RNG states.
        **objects: the named objects; read and assign them as attributes (`state.step += 1`).
    """

    def __init__(self, *, checkpointer: Optional[Checkpointer] = None,
                 rank: Optional[int] = None, rng: bool = True, **objects: Any):
        if not objects:
            raise ValueError("State needs at least one named object, e.g. State(model=model).")
        clash = [n for n in objects if n.startswith("_") or hasattr(type(self), n)]
        if clash:
            raise ValueError(
                f"State object names {clash} clash with State's own attributes or start with '_'.")
        if checkpointer is not None and not isinstance(checkpointer, Checkpointer):
            raise TypeError(f"checkpointer must be an elastic.Checkpointer, got {checkpointer!r}.")
        object.__setattr__(self, "_objects", dict(objects))
        object.__setattr__(self, "_checkpointer", checkpointer)
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_rng", rng)
        object.__setattr__(self, "_commits", 0)
        # Like Horovod, the state as constructed is the first commit (memory only).
        object.__setattr__(self, "_saved", self._capture())

    # ------------------------------------------------------------------ attribute access

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"State has no object named {name!r}; it holds {sorted(objects)}.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._objects:
            self._objects[name] = value
        else:
            raise AttributeError(
                f"State has no object named {name!r}; name every object when building the "
                f"State (it holds {sorted(self._objects)}).")

    @property
    def names(self) -> list[str]:
        """The names of the objects held."""
        return list(self._objects)

    def rank(self) -> int:
        """This process's rank, used to decide who writes checkpoints."""
        if self._rank is not None:
            return self._rank
        if collectives.is_initialized():
            return collectives.get_rank()
        return int(os.environ.get("RANK", "0") or 0)

    # ------------------------------------------------------------------ capture / apply

    def _capture(self) -> dict:
        snap = {}
        for name, obj in self._objects.items():
            value = obj.state_dict() if _has_state_dict(obj) else obj
            snap[name] = copy.deepcopy(value)
        if self._rng:
            snap[_RNG_KEY] = _capture_rng()
        return snap

    def _apply(self, snap: dict) -> None:
        missing = [n for n in self._objects if n not in snap]
        if missing:
            raise KeyError(
                f"The saved state has no entry for {missing}; it holds "
                f"{sorted(k for k in snap if k != _RNG_KEY)}. Were objects renamed?")
        for name, obj in list(self._objects.items()):
            value = copy.deepcopy(snap[name])
            if _has_state_dict(obj):
                obj.load_state_dict(value)
            else:
                self._objects[name] = value
        if self._rng and _RNG_KEY in snap:
            _apply_rng(snap[_RNG_KEY])

    def _step(self) -> int:
        step = self._objects.get(_STEP_KEY)
        if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
            return int(step)
        return self._commits

    # ------------------------------------------------------------------ Horovod's API

    def commit(self) -> None:
        """Snapshot every object in memory; rank 0 also saves a checkpoint (at `step`)."""
        snap = self._capture()
        object.__setattr__(self, "_saved", snap)
        object.__setattr__(self, "_commits", self._commits + 1)
        if self._checkpointer is not None and self.rank() == 0:
            self._checkpointer.save(self._step(), snap)

    def restore(self) -> None:
        """Put every object back as it was at the last commit."""
        self._apply(self._saved)

    def sync(self, root: int = 0, group=None, timeout: TimeoutLike = None) -> None:
        """Make every rank's state equal to rank `root`'s (then commit it in memory).

        Needs an initialized default process group (collectives.init_process_group).
        """
        box = [self._capture() if self.rank() == root else None]
        collectives.broadcast_object_list(box, src=root, group=group, timeout=timeout)
        snap = box[0]
        if self.rank() != root:
            self._apply(snap)
        object.__setattr__(self, "_saved", snap)

    def load(self) -> Optional[int]:
        """Apply the newest verified checkpoint (and commit it in memory); return its step.

        Returns None, changing nothing, when there is no checkpointer or no checkpoint.
        """
        if self._checkpointer is None:
            return None
        found = self._checkpointer.load_latest()
        if found is None:
            return None
        step, snap = found
        self._apply(snap)
        object.__setattr__(self, "_saved", snap)
        logger.info("Resumed state from the checkpoint of step %d", step)
        return step

    def __repr__(self) -> str:
        return f"State({', '.join(self._objects)}; commits={self._commits})"
