"""`DistributedOptimizer`: one local optimizer per parameter owner, stepped with the gradients
of a distributed autograd context, as torch.distributed.optim.DistributedOptimizer."""

from __future__ import annotations

import threading
from typing import Any

from shoal.rpc_agent import _current
from shoal.rpc_agent.types import RpcError
from shoal.rpc_agent.dist_autograd import engine as dist_engine
from shoal.rpc_agent.rref import RRef


class DistributedOptimizerError(RpcError):
    """A DistributedOptimizer was built with bad arguments, or an owner's step failed (the
    message names the worker and the context id)."""


class _LocalOptimizer:
    """The optimizer on one owner, over the parameters it owns."""

    # Trainers may step the same owner at once: one step at a time, or two in-place updates of
    # the same rows race. (torch's Python _LocalOptimizer locks the same way; its default
    # TorchScript one, used for SGD and most optimizers, does not, and loses updates.)
    _lock = threading.Lock()

    def __init__(self, optimizer_class: type, params: list, args: tuple, kwargs: dict) -> None:
        self.params = [rref.local_value() for rref in params]
        self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = dist_engine.get_gradients(context_id)
        with self._lock:
            for p in self.params:
                # Parameters the pass did not reach get no gradient (the optimizer skips them).
                p.grad = grads.get(p)
            self.optim.step()


def _new_local_optimizer(optimizer_class: type, params: list, args: tuple,
                         kwargs: dict) -> _LocalOptimizer:
    return _LocalOptimizer(optimizer_class, params, args, kwargs)


def _local_step(optimizer_rref: RRef, context_id: int) -> None:
    optimizer_rref.local_value().step(context_id)


class DistributedOptimizer:
    """`DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)`: builds
    `optimizer_class(params, *args, **kwargs)` on every owner of the RRefs in `params_rref`;
    `step(context_id)` steps them all concurrently with that context's gradients."""

    def __init__(self, optimizer_class: type, params_rref: list, *args: Any, **kwargs: Any):
        if not isinstance(optimizer_class, type):
            raise DistributedOptimizerError(
                f"DistributedOptimizer needs an optimizer class, got {optimizer_class!r}."
            )
        params_rref = list(params_rref) if isinstance(params_rref, (list, tuple)) else None
        if not params_rref or not all(isinstance(r, RRef) for r in params_rref):
            raise DistributedOptimizerError(
                "DistributedOptimizer needs a non-empty list of RRefs to parameters "
                "(rpc_agent.RRef(param) on their owners)."
            )
        agent = _current.get()
        by_owner: dict[int, list] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner().id, []).append(rref)
        self._owners = [agent.worker_info(owner) for owner in by_owner]
        self.remote_optimizers = []
        for owner, rrefs in zip(self._owners, by_owner.values()):
            try:
                if owner.id == agent.info.id:
                    # Built here: no call to itself needed.
                    local = _new_local_optimizer(optimizer_class, rrefs, args, kwargs)
                    self.remote_optimizers.append(RRef(local))
                else:
                    rref = agent.remote(owner, _new_local_optimizer,
                                        (optimizer_class, rrefs, args, kwargs), None, None)
                    rref.creation_future().wait()
                    self.remote_optimizers.append(rref)
            except Exception as exc:
                raise DistributedOptimizerError(
                    f"DistributedOptimizer could not build {optimizer_class.__name__} on "
                    f"worker {owner.name!r}: {exc}"
                ) from exc

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of `context_id`, concurrently.

        Raises:
            DistributedOptimizerError: an owner's step failed; names the worker and context.
        """
        agent = _current.get()
        me = agent.info.id
        futures: list = [
            agent.call(owner, _local_step, (rref, context_id), None, None, "async")
            if owner.id != me else None
            for owner, rref in zip(self._owners, self.remote_optimizers)
        ]
        failure = None
        # This worker's own optimizer steps in this thread while the others' calls run.
        for owner, rref, fut in zip(self._owners, self.remote_optimizers, futures):
            try:
                if fut is None:
                    _local_step(rref, context_id)
                else:
                    fut.wait()
            except Exception as exc:  # noqa: BLE001  (every owner finishes; the first re-raised)
                if failure is None:
                    failure = (owner, exc)
        if failure is not None:
            owner, exc = failure
            raise DistributedOptimizerError(
                f"DistributedOptimizer.step(context {context_id}): the optimizer on worker "
                f"{owner.name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
