"""Training on uneven inputs: the `Join` context manager, `Joinable` and `JoinHook` (as torch's).

Ranks that run out of data leave the `with Join(...)` block first and *shadow* the collectives
the others still issue, so nobody waits for a peer that is gone. Each iteration a rank still
training calls `Join.notify_join_context(joinable)`, whose all_reduce of 1 (0 from a joined
rank) tells everyone how many ranks are still training; a joined rank loops on that same
all_reduce, running each joinable's `main_hook` (which issues the matching collectives) until
the count reaches 0, then every `post_hook` (e.g. DDP makes all replicas identical).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import warnings
from typing import Any, Optional, Sequence

import numpy as np

from shoal.collectives.ddp import comm
from shoal.collectives.types import CollectiveError, ReduceOp

log = logging.getLogger(__name__)

# After this many shadowed iterations a joined rank warns about the skew, as torch does.
WARN_THRESHOLD = 1000


class EarlyTermination(CollectiveError):
    """With throw_on_early_termination=True, a rank ran out of inputs; raised on every rank."""


class JoinHook:
    """What a joined rank runs for a `Joinable`: `main_hook` per shadowed iteration, then `post_hook`."""

    def main_hook(self) -> None:
        """Issue the collectives one training iteration of the non-joined ranks issues."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once every rank has joined; `is_last_joiner` is True on the ranks that joined last."""


@dataclasses.dataclass(frozen=True)
class _JoinConfig:
    enable: bool = False
    throw_on_early_termination: bool = False
    is_first_joinable: bool = False


class Joinable(abc.ABC):
    """A class whose per-iteration collectives a joined rank can shadow (DDP is one)."""

    def __init__(self) -> None:
        self._join_config = _JoinConfig()

    @property
    def join_config(self) -> _JoinConfig:
        """How the Join context this joinable is in runs it (disabled outside one)."""
        return self._join_config

    @join_config.setter
    def join_config(self, config: _JoinConfig) -> None:
        self._join_config = config

    @abc.abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs for this joinable; kwargs come from `Join(...)`."""

    @property
    @abc.abstractmethod
    def join_device(self) -> Any:
        """The device the join all_reduces run on."""

    @property
    @abc.abstractmethod
    def join_process_group(self) -> Any:
        """The process group the join all_reduces run on."""


class Join:
    """Context manager for uneven inputs: `with Join([ddp_model]): for batch in data: ...`.

    Args:
        joinables: the objects taking part; they must share one process group.
        enable: False turns the manager into a no-op (and the joinables skip their notices).
        throw_on_early_termination: raise `EarlyTermination` on every rank as soon as one
            rank runs out of data, instead of shadowing.
        **kwargs: passed to each joinable's `join_hook` (DDP takes
            `divide_by_initial_world_size`).
    """

    def __init__(
        self,
        joinables: Sequence[Joinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        joinables = list(joinables)
        if not joinables:
            raise ValueError("The Join context manager needs at least one Joinable.")
        for joinable in joinables:
            if not hasattr(joinable, "_join_config"):
                raise TypeError(
                    f"{type(joinable).__name__} is passed to Join but its constructor never "
                    "called Joinable.__init__, so it cannot take part."
                )
        self._joinables = joinables
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in joinables]
        self._enable = bool(enable)
        self._throw = bool(throw_on_early_termination)
        group = joinables[0].join_process_group
        for joinable in joinables[1:]:
            if joinable.join_process_group is not group:
                raise ValueError(
                    "Join needs every Joinable on the same process group; "
                    f"{type(joinable).__name__} uses a different one."
                )
        self._group = group
        self._rank = comm.rank(group)
        self._world = comm.size(group)

    def _set_configs(self, enable: bool) -> None:
        for position, joinable in enumerate(self._joinables):
            joinable.join_config = _JoinConfig(
                enable=enable,
                throw_on_early_termination=self._throw,
                is_first_joinable=position == 0,
            )

    def __enter__(self) -> "Join":
        self._set_configs(self._enable)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if not self._enable or exc_type is not None:
                return  # an exception in the block propagates as it is
            self._join_loop()
        finally:
            self._set_configs(False)

    def _join_loop(self) -> None:
        is_last_joiner = True
        shadowed = 0
        while True:
            remaining = self._count_nonjoined(0)
            if remaining == 0:
                break
            if self._throw:
                raise EarlyTermination(
                    f"Rank {self._rank} exhausted all inputs while {remaining} rank(s) still had "
                    "data (Join with throw_on_early_termination=True)."
                )
            if shadowed == WARN_THRESHOLD:
                warnings.warn(
                    f"Detected uneven input skew of more than {WARN_THRESHOLD} iterations: rank "
                    f"{self._rank} has at least {WARN_THRESHOLD} fewer inputs than the ranks "
                    "still training, which slows training down.",
                    stacklevel=2,
                )
            for hook in self._join_hooks:
                hook.main_hook()
            is_last_joiner = False
            shadowed += 1
        log.debug("rank %s: all ranks joined after %s shadowed iteration(s)", self._rank, shadowed)
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)

    def _count_nonjoined(self, mine: int) -> int:
        count = np.array([mine], dtype=np.int64)
        comm.all_reduce(self._group, count, ReduceOp.SUM)
        return int(count[0])

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Optional[int]:
        """Tell the join context that this rank still trains; call once per iteration.

        Only the first joinable of an enabled Join communicates; the others get None. Returns
        the number of ranks still training (this one included).

        Raises:
            EarlyTermination: throw_on_early_termination is set and a rank has run out of data.
        """
        config = getattr(joinable, "_join_config", None)
        if config is None:
            raise TypeError(
                f"{type(joinable).__name__} never called Joinable.__init__, so it cannot notify "
                "a Join context."
            )
        if not (config.enable and config.is_first_joinable):
            return None
        group = joinable.join_process_group
        count = np.ones(1, dtype=np.int64)
        comm.all_reduce(group, count, ReduceOp.SUM)
        remaining = int(count[0])
        world = comm.size(group)
        if config.throw_on_early_termination and remaining < world:
            raise EarlyTermination(
                f"Detected at least one rank that exhausted its inputs ({world - remaining} of "
                f"{world} ranks have joined); throwing on rank {comm.rank(group)} and every "
                "other rank (Join with throw_on_early_termination=True)."
            )
        return remaining
