"""`ZeroRedundancyOptimizer`: each rank keeps the optimizer state of its share of the parameters
only (ZeRO stage 1), as torch.distributed.optim.ZeroRedundancyOptimizer.

The parameters are partitioned once, group by group, largest first, each to the rank whose share
is smallest so far (torch's greedy rule), so shares stay within one parameter of even. Every rank
still holds every parameter and its gradient (DDP averages those); `step()` updates this rank's
share with a local `optimizer_class` and then each rank broadcasts its share, packed into one
flat buffer per rank and dtype, so all ranks end the step with the same parameters.

The state dict is torch's: `consolidate_state_dict(to)` brings every rank's local state to rank
`to`, whose `state_dict()` then looks like that of one `optimizer_class` over all parameters (the
indices count parameters in param_groups order); `load_state_dict` on every rank keeps only the
entries of its own share.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any, Callable, Optional, Type

import numpy as np

from shoal.collectives.object_collectives import gather_object
from shoal.collectives.world import member_group
from shoal.core.optim.optimizer import Optimizer, OptimizerError
from shoal.core.tensor import Tensor
from shoal.core.timeouts import TimeoutLike

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


class ZeroRedundancyOptimizer(Optimizer):
    """Wraps `optimizer_class` so that each rank holds the state of 1/W of the parameters.

    Args:
        params: Tensors or parameter-group dicts, as for any optimizer.
        optimizer_class: the local optimizer (core.optim.Adam, SGD, ...).
        process_group: the ranks that share the state (default: the world).
        parameters_as_bucket_view: accepted for torch's scripts; the broadcast always packs
            each rank's share into one buffer.
        overlap_with_ddp: True runs each rank's step inside DDP's communication hook, bucket by
            bucket as their all_reduces finish, and the exchange after the last one: register
            `hook_with_zero_step(allreduce_hook, ddp, zero)` and do not call step().
        **defaults: the local optimizer's hyper-parameters (lr, betas, ...).
    """

    def __init__(self, params: Any, optimizer_class: Type[Optimizer], process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        self.overlap_with_ddp = bool(overlap_with_ddp)
        self._pg = member_group(process_group)
        if self._pg is None:
            raise ValueError("ZeroRedundancyOptimizer: this rank is not in process_group.")
        self.rank, self.world_size = self._pg.rank(), self._pg.size()
        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._local: Optional[Optimizer] = None
        self._bucket_optimizers: dict[tuple, Optimizer] = {}
        self._consolidated: Optional[list] = None
        self._timeout: TimeoutLike = None
        super().__init__(params, defaults)
        self._partition()

    # -- partition -------------------------------------------------------------------------
    def _partition(self) -> None:
        """Assign every parameter to a rank and (re)build the local optimizer over this rank's."""
        sizes = [0] * self.world_size
        self._owner: dict[int, int] = {}
        local_groups = []
        for group in self.param_groups:
            mine = []
            for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
                rank = min(range(self.world_size), key=lambda r: sizes[r])
                sizes[rank] += p.numel()
                self._owner[id(p)] = rank
                if rank == self.rank:
                    mine.append(p)
            # Keep the group's order among this rank's parameters (state_dict indices follow it).
            order = {id(p): i for i, p in enumerate(group["params"])}
            mine.sort(key=lambda t: order[id(t)])
            local_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": mine})
        old = self._local
        self._bucket_optimizers = {}
        self._local = _build_local(self.optimizer_class, local_groups, self.defaults)
        if old is not None:  # add_param_group: the existing parameters keep their state
            for p, s in old.state.items():
                self._local.state[p] = s

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; the partition is recomputed over every group, as torch does."""
        super().add_param_group(param_group)
        if self._local is not None:
            self._partition()

    @property
    def optim(self) -> Optimizer:
        """The local optimizer over this rank's share (torch's attribute name)."""
        return self._local

    def owner_of(self, param: Tensor) -> int:
        """The rank that updates `param` and broadcasts it."""
        return self._owner[id(param)]

    # -- step ------------------------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """Update this rank's share, then every rank's share reaches every rank (with
        overlap_with_ddp the hook does both: this only warns and returns None, as torch)."""
        if self.overlap_with_ddp:
            logger.warning("ZeroRedundancyOptimizer.step() should not be called with "
                           "overlap_with_ddp=True: DDP's hook steps (hook_with_zero_step).")
            return None
        self._push_hyperparameters()
        loss = self._local.step(closure, **kwargs)
        self._sync_params()
        return loss

    def step_bucket(self, parameters: list[Tensor], gradients: list[Tensor]) -> None:
        """Step this rank's parameters among `parameters` with the reduced `gradients` (what
        the overlap hook calls for each DDP bucket); the state is the local optimizer's."""
        self._push_hyperparameters()
        mine = {id(p): g for p, g in zip(parameters, gradients) if self._owner[id(p)] == self.rank}
        groups = []
        for local in self._local.param_groups:
            params = [p for p in local["params"] if id(p) in mine]
            if params:
                groups.append({**{k: v for k, v in local.items() if k != "params"},
                               "params": params})
        if not groups:
            return
        key = tuple(id(p) for g in groups for p in g["params"])
        opt = self._bucket_optimizers.get(key)
        if opt is None:
            opt = _build_local(self.optimizer_class, groups, self.defaults)
            opt.state = self._local.state  # one state, whichever bucket steps a parameter
            self._bucket_optimizers[key] = opt
        else:
            for group, fresh in zip(opt.param_groups, groups):
                group.update({k: v for k, v in fresh.items() if k != "params"})
        for g in groups:
            for p in g["params"]:
                p.grad = mine[id(p)]
        opt.step()

    def exchange_async(self, on_done: Callable[[Optional[BaseException]], None]) -> None:
        """Issue the broadcasts of every rank's share without waiting; `on_done(error)` runs
        once all are in place (in the thread that finishes the last one)."""
        pending = self._issue_broadcasts()
        remaining = [len(pending)]
        lock = threading.Lock()

        def finished(_work: Any) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            error = next((w.exception() for w, *_ in pending if w.exception()), None)
            if error is None:
                for _work2, rank, flat, params in pending:
                    if rank != self.rank:
                        _unpack(flat, params)
            on_done(error)

        if not pending:
            on_done(None)
        for work, *_ in pending:
            work.add_done_callback(finished)

    def _push_hyperparameters(self) -> None:
        # A scheduler changes self.param_groups; the local groups follow, as in torch.
        for full, local in zip(self.param_groups, self._local.param_groups):
            for key, value in full.items():
                if key != "params":
                    local[key] = value

    def _sync_params(self) -> None:
        """Broadcast each rank's share, one flat buffer per (rank, dtype), all in flight at once."""
        pending = self._issue_broadcasts()
        for work, rank, flat, params in pending:
            work.wait(self._timeout)
            if rank != self.rank:
                _unpack(flat, params)

    def _issue_broadcasts(self) -> list[tuple[Any, int, np.ndarray, list[Tensor]]]:
        shares: dict[tuple[int, Any], list[Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                shares.setdefault((self._owner[id(p)], p.array.dtype), []).append(p)
        pending = []
        for (rank, dtype), params in sorted(shares.items(), key=lambda kv: (kv[0][0],
                                                                            str(kv[0][1]))):
            flat = np.empty(sum(p.numel() for p in params), dtype=dtype)
            if rank == self.rank:
                _pack(params, flat)
            work = self._pg.broadcast(flat, rank, async_op=True, timeout=self._timeout)
            pending.append((work, rank, flat, params))
        return pending

    # -- state dict ------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Bring every rank's local state to rank `to` (a collective: every rank calls it)."""
        local = self._local.state_dict()
        packed = {
            "state": {self._global_index(gi, i): _host(s) for (gi, i), s in
                      _flat_state(local, self._local.param_groups).items()},
        }
        gathered: Optional[list] = [None] * self.world_size if self.rank == to else None
        gather_object(packed, gathered, group=self._pg, timeout=self._timeout, group_dst=to)
        self._consolidated = gathered

    def _global_index(self, group_index: int, local_index: int) -> int:
        param = self._local.param_groups[group_index]["params"][local_index]
        return self._index_of()[id(param)]

    def _index_of(self) -> dict[int, int]:
        index: dict[int, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        return index

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state dict, on the rank `consolidate_state_dict` named."""
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict() on rank {self.rank}: call "
                "consolidate_state_dict(to=...) on every rank first; only rank `to` gets it.")
        state: dict[int, dict] = {}
        for part in self._consolidated:
            state.update(part["state"])
        groups = []
        index = self._index_of()
        for group in self.param_groups:
            packed = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole optimizer's state dict; each rank keeps its own share's entries."""
        super().load_state_dict(state_dict)
        self._local.state.clear()
        for p, value in self.state.items():
            if self._owner[id(p)] == self.rank:
                self._local.state[p] = value
        self.state.clear()  # the shares of other ranks are not kept here
        self._push_hyperparameters()


def _build_local(optimizer_class: Type[Optimizer], groups: list, defaults: dict) -> Optimizer:
    """The local optimizer; a rank with no parameter gets a placeholder that steps nothing."""
    nonempty = [g for g in groups if g["params"]]
    if not nonempty:
        return _Empty(groups)
    local = optimizer_class(nonempty[:1], **defaults)
    for group in nonempty[1:]:
        local.add_param_group(group)
    if len(nonempty) != len(groups):
        raise OptimizerError(
            "ZeroRedundancyOptimizer: a parameter group left this rank no parameter while "
            "others did; give each group at least world_size parameters.")
    return local


class _Empty(Optimizer):
    """The local optimizer of a rank whose share is empty (fewer parameters than ranks)."""

    def __init__(self, groups: list) -> None:
        # Not Optimizer.__init__, which refuses an empty parameter list.
        self.defaults, self.param_groups, self._workspaces = {}, groups, {}
        self.state = {}

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Nothing to update; returns closure() when given."""
        return closure() if closure is not None else None

    def state_dict(self) -> dict[str, Any]:
        """No state."""
        return {"state": {}, "param_groups": [{"params": []} for _ in self.param_groups]}


def _flat_state(local: dict, groups: list) -> dict[tuple[int, int], dict]:
    """A local state dict's entries keyed by (group index, position in the group)."""
    where = {}
    for gi, group in enumerate(local["param_groups"]):
        for pos, index in enumerate(group["params"]):
            where[index] = (gi, pos)
    return {where[i]: s for i, s in local["state"].items()}


def _host(state: dict) -> dict:
    """A copy of one parameter's state with arrays as numpy (picklable, owned)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, Tensor):
            value = Tensor(value.numpy(force=True).copy())
        out[key] = value
    return out


def _pack(params: list[Tensor], flat: np.ndarray) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n] = p.array.reshape(-1)
        offset += n


def _unpack(flat: np.ndarray, params: list[Tensor]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.array[...] = flat[offset:offset + n].reshape(p.array.shape)  # in place: views stay
        offset += n
