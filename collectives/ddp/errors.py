"""DDPError and the explanations DistributedDataParallel's reducer gives when a round cannot
be reduced: what happened, on which rank, and the usual cause and fix (as torch's messages)."""

from __future__ import annotations

from typing import Sequence

from shoal.collectives.types import CollectiveError
from shoal.core.errors import ShoalError

# A message lists at most this many parameter names (a large model would bury the cause).
SHOWN_NAMES = 20


class DDPError(ShoalError, RuntimeError):
    """DistributedDataParallel was used in a way it cannot reduce correctly; the message says how."""


def with_ddp_context(exc: CollectiveError, rank: int, bucket: int, buckets: int,
                     iteration: int) -> CollectiveError:
    """The same error type, its message extended with what DDP was doing and the usual cause."""
    message = (
        f"{exc} DistributedDataParallel on rank {rank} was reducing gradient bucket {bucket} "
        f"of {buckets} in its synchronised iteration {iteration}. If the ranks have different "
        "numbers of batches, wrap the training loop in `with ddp.join():` so that ranks that "
        "run out of data shadow the others' collectives."
    )
    try:
        return type(exc)(message)
    except TypeError:  # an error class with another signature: keep the original
        return exc


def unfinished_error(names: Sequence[str], ready: Sequence[bool], rank: int, *,
                     static_learned: bool, find_unused: bool, at_end: bool) -> DDPError:
    """A round whose parameters did not all receive gradients: `at_end` when its backward
    finished short of them, else when the next forward found the round still open."""
    missing = [name for name, done in zip(names, ready) if not done]
    got = len(names) - len(missing)
    shown = ", ".join(repr(n) for n in missing[:SHOWN_NAMES])
    shown += " ..." if len(missing) > SHOWN_NAMES else ""
    if static_learned:
        why = (
            "With static_graph=True this means the training graph changed: a parameter "
            "used in the first iteration was not used in this one, which static_graph does "
            "not allow; construct DistributedDataParallel with find_unused_parameters=True "
            "and static_graph=False instead."
        )
    elif find_unused:
        why = (
            "Since find_unused_parameters=True, this likely means that not every output of "
            "forward participated in computing the loss; make every output part of the loss "
            "(or return only the outputs that are)."
        )
    else:
        why = (
            "This means the module has parameters that were not used in producing the "
            "loss. Pass find_unused_parameters=True to DistributedDataParallel (parameters "
            "a forward does not reach are then reduced as zeros), and make sure every "
            "output of forward participates in the loss."
        )
    if at_end:
        head = (
            f"Backward finished on rank {rank} but only {got} of {len(names)} parameters "
            "received gradients, so DDP cannot finish reducing them."
        )
    else:
        head = (
            f"Expected to have finished reduction in the prior iteration before starting a "
            f"new one (rank {rank}): {got} of {len(names)} parameters received "
            "gradients, but that backward never finished (it ended before DDP's part of "
            "the graph, or backward() was not called on a loss computed from every output)."
        )
    return DDPError(
        f"{head} {why} Parameters that did not receive a gradient on rank {rank}: {shown}."
    )


def ready_twice_error(name: str, rank: int, *, reduced_as_unused: bool) -> DDPError:
    """A parameter whose gradient hook fired twice in one round; `reduced_as_unused` when the
    search for unused parameters had already reduced it as unused."""
    unused_hint = ""
    if reduced_as_unused:
        unused_hint = (
            f" Parameter {name!r} was not reachable from forward's outputs, so DDP reduced "
            "it as unused, and then its gradient arrived anyway (for example through a "
            "reentrant backward such as activation checkpointing); if every parameter takes "
            "part in backward, construct DDP with find_unused_parameters=False, or use "
            "static_graph=True if the graph is the same in every iteration."
        )
    return DDPError(
        f"Expected to mark a variable ready only once (rank {rank}): parameter "
        f"{name!r} has been marked as ready twice, meaning that several gradient hooks "
        "fired for it in one iteration. Causes: the parameter is used outside forward or "
        "in several concurrent forward/backward passes; or it is reused by several "
        "reentrant backward passes (e.g. several checkpoint calls over the same layers), "
        "which DDP supports only with static_graph=True when the graph does not change "
        f"between iterations.{unused_hint}"
    )


def graph_changed_error(name: str, rank: int, *, used_in_first: bool) -> DDPError:
    """With static_graph, a parameter's hook fired more often than in the learning round."""
    how = ("more often than in the first iteration" if used_in_first
           else "although it was unused in the first iteration")
    return DDPError(
        f"Your training graph has changed in this iteration (rank {rank}): "
        f"parameter {name!r} received a gradient {how}, which "
        "static_graph=True does not allow; construct DistributedDataParallel with "
        "find_unused_parameters=True and static_graph=False instead."
    )
