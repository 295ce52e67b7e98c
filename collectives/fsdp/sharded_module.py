"""`fully_shard(module)`: torch FSDP2's per-module sharding, its hooks and its root (torch keeps
them in `_fully_shard`; the module is not named after the function, which would hide it).

Call it on each layer and then on the root module. Each call shards the parameters the module
holds that no sharded submodule holds (one `ParamGroup`) and turns the module's class into an
`FSDPModule` subclass. The first forward of the root learns the order in which the groups run:

- before a group's forward, its all_gather is waited for (or issued, the first time) and the
  next group's is issued, so one layer's gather travels while the one before computes;
- after it, the module gets its shards back and, with `reshard_after_forward`, the gathered
  memory is freed; its outputs pass through a node whose backward re-gathers the group (and
  issues the gather of the group before it) just before the layer's own backward ops run;
- when the last of a group's parameters has its gradient, the gradients are packed and their
  reduce_scatter is issued at once, overlapping the backward of the layers below;
- the root's outputs are tied to a sentinel node created before its forward, whose backward runs
  after every other op (core's engine runs newer nodes first): there every reduce_scatter is
  waited for and the averaged gradients land in the shards' `.grad`, ready for the optimizer.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import numpy as np

from shoal.collectives.fsdp.api import (
    CPUOffloadPolicy,
    FSDPError,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardedParameter,
)
from shoal.collectives.amp import agree_for_replicas
from shoal.collectives.fsdp.param_group import ParamGroup
from shoal.collectives.types import ReduceOp
from shoal.collectives.world import member_group
from shoal.core import backend
from shoal.core.autograd import Node, is_grad_enabled
from shoal.core.nn.module import Module
from shoal.core.tensor import Tensor

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "model_state_bytes"]

_STATES: "weakref.WeakKeyDictionary[Module, _State]" = weakref.WeakKeyDictionary()
_CLASSES: dict[type, type] = {}


class _Root:
    """What the root shares with every group under it: the learned order and pending work."""

    def __init__(self, states: list["_State"]) -> None:
        self.states = states
        self.order: list[_State] = []  # as their forwards begin: forward prefetches by it
        self.post_order: list[_State] = []  # as they end: backward prefetches by it, as torch
        self.recording = True
        self.pending: list[ParamGroup] = []
        # The last layer's gradients when they wait to leave with the root's (`grads_ready`).
        self.deferred: list[ParamGroup] = []
        self.top: Optional["_State"] = None  # the root module's own state
        self.sentinel: Optional[Tensor] = None
        self.in_backward = False
        self.agreements: list = []  # found_inf registrations, kept as long as the root lives

    def next_of(self, state: "_State", step: int) -> Optional["_State"]:
        """The state after `state` in forward (step 1) or before it in backward (step -1):
        backward runs in the reverse of the order in which forwards ended, so the root, whose
        forward ends last, passes its backward on to the last layer."""
        order = self.order if step > 0 else self.post_order
        if state not in order:
            return None
        i = order.index(state) + step
        return order[i] if 0 <= i < len(order) else None


class _State:
    """One fully_shard module: its group, its policies, and its place under the root."""

    def __init__(self, module: Module, group: Optional[ParamGroup], reshard: bool,
                 mp: MixedPrecisionPolicy) -> None:
        self.module = module
        self.group = group
        self.reshard_after_forward = reshard
        self.mp = mp
        self.root: Optional[_Root] = None
        self.is_root = False
        self.sync_grads = True
        self.pre_backward_done = False
        self.forward_ran = False  # since the last backward ended
        self.explicit_prefetch: dict[str, list["_State"]] = {}

    # ------------------------------------------------------------------ forward

    def pre_forward(self, module: Module, args: tuple) -> tuple:
        if self.root is None:
            _lazy_init(self)
        root = self.root
        if root.in_backward:  # activation checkpointing recomputes this forward in backward
            if self.group is not None:
                self.group.wait_unshard()
                self.group.use_full()
            return self._cast_inputs(args)
        if self.is_root:
            self._root_pre_forward()
        if root.recording and self not in root.order:
            root.order.append(self)
        following = [s.group for s in self.prefetch("forward")]
        if self.group is not None:
            # Where this gather was not prefetched (the root's, at every step's start), the
            # next ones travel in the same collective: they would be issued at once anyway.
            self.group.start_unshard([g for g in following if self.group.can_gather_with(g)])
        for group in following:  # the rest queue behind it, before waiting for it
            group.start_unshard()
        if self.group is not None:
            self.group.wait_unshard()
            self.group.use_full()
        self.pre_backward_done = False
        self.forward_ran = True
        return self._cast_inputs(args)

    def _cast_inputs(self, args: tuple) -> tuple:
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args = _cast_floats(args, self.mp.param_dtype)
        return args

    def _root_pre_forward(self) -> None:
        root = self.root
        if root.deferred:  # a backward that never reached the sentinel: finish its reductions
            _reduce_together(root, list(root.deferred))
        if root.pending:
            _finish_reductions(root)
        root.sentinel = _sentinel(self)
        root.in_backward = False

    def post_forward(self, module: Module, args: tuple, out: Any) -> Any:
        root = self.root
        if root.recording and not root.in_backward and self not in root.post_order:
            root.post_order.append(self)
        if self.group is not None:
            self.group.use_shards()
            # A recomputation in backward keeps the gathered weights: the ops it just recorded
            # need them, and the group reshards once its gradients are in.
            if self.reshard_after_forward and not self.is_root and not root.in_backward:
                self.group.reshard()
        if self.mp.output_dtype is not None:
            out = _cast_floats(out, self.mp.output_dtype)
        if not is_grad_enabled() or root.in_backward:
            return out
        if self.group is not None:
            out = _map_tensors(out, lambda t: _through(t, "FSDPPreBackward", self.pre_backward))
        if self.is_root:
            root.recording = False
            sentinel = root.sentinel
            out = _map_tensors(out, lambda t: _tie(t, sentinel, root))
        return out

    # ------------------------------------------------------------------ backward

    def pre_backward(self) -> None:
        if self.pre_backward_done or self.group is None:
            return
        self.pre_backward_done = True
        self.root.in_backward = True
        self.group.wait_unshard()
        # Prefetch only a group whose backward is still to come: the root's last use (the
        # head) may come first in backward, and a stale gather would outlive the step.
        for earlier in self.prefetch("backward"):
            if not earlier.group.grads_done:
                earlier.group.start_unshard()

    def prefetch(self, direction: str) -> list["_State"]:
        """The states whose gathers to issue now: the ones set with set_modules_to_*_prefetch,
        else the next (forward) or previous (backward) in the order the first forward ran."""
        chosen = self.explicit_prefetch.get(direction)
        if chosen is None:
            nearby = self.root.next_of(self, 1 if direction == "forward" else -1)
            chosen = [] if nearby is None else [nearby]
        return [s for s in chosen if s.group is not None]

    def grads_ready(self, group: ParamGroup) -> None:
        root = self.root
        if not self.sync_grads:
            group.ready = 0  # accumulate: the unsharded gradients stay for the next backward
        elif self._waits_for_root(group):
            root.deferred.append(group)
        else:
            # One reduce_scatter in flight at a time (torch FSDP2's rule): the one before,
            # issued while this layer's backward ran, is finished first, so that its W x S send
            # buffer is freed now instead of every layer's living to the end of backward.
            _finish_reductions(root)
            _reduce_together(root, [group, *root.deferred])
        group.reshard()

    def _waits_for_root(self, group: ParamGroup) -> bool:
        """Whether this layer's gradients wait to leave in one reduce_scatter with the root's:
        they are the last layer's to be ready and the root's are still to come, as in a
        language model whose embedding gets its gradient last. The two would otherwise be
        issued a few operations apart, the second only after waiting for the first."""
        top = self.root.top
        if self.is_root or top is None or top.group is None:
            return False
        tg = top.group
        if tg.grads_done or not tg.expected or not top.sync_grads or not top.forward_ran or \
                not tg.can_reduce_with(group):
            return False
        return all(s.group.grads_done for s in self.root.states
                   if s.group is not None and s is not top and s.sync_grads and s.forward_ran)

    def finish_backward(self) -> None:
        """The root's sentinel: reduce what is left, wait for every reduction, reshard all."""
        root = self.root
        late = []
        for state in reversed(root.order):
            group = state.group
            # Every group that ran forward reduces, so that all ranks issue the same
            # reduce_scatters even where some parameter got no gradient (zeros stand in).
            if group is not None and state.sync_grads and state.forward_ran and \
                    not group.grads_done and group not in root.pending:
                late.append(group)
        _reduce_together(root, [*root.deferred, *late])
        _finish_reductions(root)
        for state in root.states:
            state.forward_ran = False
            if state.group is not None:
                state.group.ready = 0 if state.sync_grads else state.group.ready
                state.group.grads_done = False
                state.group.drop_gather()
                state.group.reshard()
        root.in_backward = False


def _finish_reductions(root: _Root) -> None:
    pending, root.pending = root.pending, []
    for group in pending:
        group.finish_reduce()


def _reduce_together(root: _Root, groups: list[ParamGroup]) -> None:
    """Issue the reduce_scatters of `groups` (and the deferred ones, which are among them),
    as few as their process groups and dtypes allow, in the same order on every rank."""
    root.deferred = []
    while groups:
        head, rest = groups[0], groups[1:]
        mates = [g for g in rest if head.can_reduce_with(g)]
        groups = [g for g in rest if not head.can_reduce_with(g)]
        head.start_reduce(mates)
        root.pending.extend([head, *mates])


def _lazy_init(state: _State) -> None:
    """The first forward: the module it runs on is the root of every state beneath it."""
    states = [_STATES[m] for m in state.module.modules() if m in _STATES]
    root = _Root(states)
    for s in states:
        if s.root is not None and s.root is not root:
            raise FSDPError("fully_shard: a module belongs to two sharded roots; call forward on "
                            "one root only.")
        s.root = root
        s.is_root = s is state
    root.top = state
    state.reshard_after_forward = False  # the root's gather is needed again in backward at once
    _agree_found_inf(root)


def _agree_found_inf(root: _Root) -> None:
    """A GradScaler stepping the shards skips a step on every rank when any rank's shard of a
    gradient overflowed (torch's ShardedGradScaler): one agreement per sharding group."""
    by_group: dict[int, tuple[Any, list]] = {}
    for s in root.states:
        if s.group is not None:
            entry = by_group.setdefault(id(s.group.pg), (s.group.pg, []))
            entry[1].extend(fp.shard for fp in s.group.params)
    root.agreements = [agree_for_replicas(shards, pg) for pg, shards in by_group.values()]


def _sentinel(state: _State) -> Tensor:
    anchor = Tensor(np.zeros((), dtype=np.float32), requires_grad=True)
    sentinel = Tensor(np.zeros((), dtype=np.float32))
    sentinel.requires_grad = True

    def finish(grad: Any) -> tuple:
        state.finish_backward()
        return (None,)

    sentinel.grad_fn = Node("FSDPPostBackward", finish, (anchor,))
    return sentinel


def _through(t: Tensor, name: str, before: Any) -> Tensor:
    """`t` passed through a node that calls `before()` when its gradient arrives."""
    if not t.requires_grad:
        return t
    out = Tensor(t.array)
    out.requires_grad = True

    def backward(g: Any) -> tuple:
        before()
        return (g,)

    out.grad_fn = Node(name, backward, (t,))
    return out


def _tie(t: Tensor, sentinel: Tensor, root: _Root) -> Tensor:
    """`t` tied to the sentinel; its backward, the first of the root's, marks backward begun."""
    if not t.requires_grad:
        return t
    out = Tensor(t.array)
    out.requires_grad = True
    xp = backend.array_module(sentinel.array)

    def backward(g: Any) -> tuple:
        root.in_backward = True
        return (g, xp.zeros((), dtype=sentinel.array.dtype))

    out.grad_fn = Node("FSDPRootBackward", backward, (t, sentinel))
    return out


def _map_tensors(obj: Any, fn: Any) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [_map_tensors(v, fn) for v in obj]
        return type(obj)(mapped) if type(obj) in (list, tuple) else type(obj)(*mapped)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    return obj


def _cast_floats(obj: Any, dtype: Any) -> Any:
    return _map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


class FSDPModule:
    """The methods fully_shard adds to a module (its class becomes FSDP<class>)."""

    def unshard(self, async_op: bool = False) -> Optional["UnshardHandle"]:
        """Gather this module's parameters now; async_op: only issue the all_gather and return
        a handle whose wait() finishes it (forward waits for it too)."""
        group = _STATES[self].group
        if group is not None:
            group.start_unshard()
            if not async_op:
                group.wait_unshard()
        return UnshardHandle(group) if async_op else None

    def set_modules_to_forward_prefetch(self, modules: list[Module]) -> None:
        """Issue these sharded modules' all_gathers when this one's forward starts (instead of
        the next module's in the order the first forward ran)."""
        _STATES[self].explicit_prefetch["forward"] = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[Module]) -> None:
        """Issue these sharded modules' all_gathers when this one's backward starts."""
        _STATES[self].explicit_prefetch["backward"] = [_state_of(m) for m in modules]

    def reshard(self) -> None:
        """Free this module's gathered parameters."""
        group = _STATES[self].group
        if group is not None:
            group.reshard()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether forward frees the gathered parameters (backward then gathers them again)."""
        for state in _states_under(self, recurse):
            state.reshard_after_forward = bool(reshard_after_forward) and not state.is_root

    def set_requires_gradient_sync(self, requires_gradient_sync: bool,
                                   recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally (torch's no_sync)."""
        for state in _states_under(self, recurse):
            state.sync_grads = bool(requires_gradient_sync)


    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Scale the shards' gradients so that the whole model's gradient norm (over every
        rank's shards: a collective) is at most max_norm; return the norm before (FSDP1's
        method; torch's clip_grad_norm_ on FSDP2's DTensors computes the same)."""
        return _clip_grad_norm(self, float(max_norm), float(norm_type))


def _clip_grad_norm(module: Module, max_norm: float, norm_type: float) -> Tensor:
    shards = [p for p in module.parameters() if p.grad is not None]
    groups = {id(p.group): p.group for p in shards if isinstance(p, ShardedParameter)}
    if len(groups) > 1:
        raise FSDPError("clip_grad_norm_: the module's shards span several groups.")
    inf = np.isinf(norm_type)
    local = np.zeros(1, dtype=np.float64)
    for p in shards:
        g = np.abs(p.grad.array.astype(np.float64, copy=False)).ravel()
        local[0] = max(local[0], g.max(initial=0.0)) if inf else local[0] + (g ** norm_type).sum()
    if groups:
        group = next(iter(groups.values()))
        group.all_reduce(local, ReduceOp.MAX if inf else ReduceOp.SUM).wait()
    total = float(local[0] if inf else local[0] ** (1.0 / norm_type))
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in shards:
            p.grad.array *= p.grad.array.dtype.type(coef)
    return Tensor(np.asarray(total, dtype=np.float32))


class UnshardHandle:
    """What `unshard(async_op=True)` returns: wait() finishes the gather."""

    def __init__(self, group: Optional[ParamGroup]) -> None:
        self._group = group

    def wait(self) -> None:
        """Block until the module's parameters are gathered."""
        if self._group is not None:
            self._group.wait_unshard()


def _state_of(module: Module) -> _State:
    if module not in _STATES:
        raise FSDPError(f"{type(module).__name__} is not sharded: call fully_shard on it first.")
    return _STATES[module]


def _states_under(module: Module, recurse: bool) -> list[_State]:
    mods = module.modules() if recurse else [module]
    return [_STATES[m] for m in mods if m in _STATES]


def fully_shard(module: Module, *, mesh: Any = None, reshard_after_forward: bool = True,
                shard_placement_fn: Any = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy()) -> Module:
    """Shard `module`'s parameters across `mesh`'s ranks and gather them per forward.

    mesh: None (the default group), a ProcessGroup to shard over, or (replicate, shard), two
    ProcessGroups, for hybrid sharding: shards within `shard` (a host), replicas across
    `replicate`, whose gradients are averaged after the reduce_scatter.

    Raises:
        FSDPError: the module is sharded already, a sharded submodule was sharded after its
            parent, or its parameters have more than one dtype.
    """
    if module in _STATES:
        raise FSDPError(f"fully_shard was already applied to {type(module).__name__}.")
    if shard_placement_fn is not None:
        raise FSDPError("fully_shard: shoal shards every parameter flat (shard_placement_fn "
                        "must be None).")
    shard_pg, replicate = _mesh_groups(mesh)
    entries = _managed(module)
    state = _State(module, None, reshard_after_forward, mp_policy)
    if entries:
        state.group = ParamGroup(entries, shard_pg, replicate, mp_policy,
                                 isinstance(offload_policy, CPUOffloadPolicy),
                                 lambda g: state.grads_ready(g))
    _STATES[module] = state
    module.register_forward_pre_hook(state.pre_forward)
    module.register_forward_hook(state.post_forward)
    cls = type(module)
    if not isinstance(module, FSDPModule):
        if cls not in _CLASSES:  # one FSDP<class> per class, as torch keeps
            _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        module.__class__ = _CLASSES[cls]
    return module


def _mesh_groups(mesh: Any) -> tuple[Any, Any]:
    if isinstance(mesh, (tuple, list)):
        if len(mesh) != 2:
            raise FSDPError(f"fully_shard mesh as a tuple is (replicate, shard), got {mesh!r}.")
        return member_group(mesh[1]), member_group(mesh[0])
    pg = member_group(mesh)
    if pg is None:
        raise FSDPError("fully_shard: this rank is not in the mesh's group.")
    return pg, None


def _managed(module: Module) -> list[tuple[list, Any]]:
    """([(owner, name), ...], parameter) of each parameter `module` holds that no sharded
    submodule holds; a parameter held under several names (tied weights) is one entry."""
    entries: dict[int, tuple[list, Any]] = {}
    skip = [m for m in module.modules() if m is not module and m in _STATES]
    inside = {id(m) for s in skip for m in s.modules()}
    for owner in module.modules():
        if id(owner) in inside:
            continue
        for name, param in list(owner.named_parameters(recurse=False)):
            if isinstance(param, ShardedParameter):
                raise FSDPError(
                    f"fully_shard: {type(owner).__name__}.{name} is already sharded; apply "
                    "fully_shard to the layers first, then to the root, and share a weight "
                    "only between modules of one fully_shard call.")
            entries.setdefault(id(param), ([], param))[0].append((owner, name))
    return list(entries.values())


def model_state_bytes(module: Module, optimizer: Any = None) -> int:
    """Bytes this rank holds for `module`'s parameters, their gradients and `optimizer`'s
    state: each distinct memory block counted once (a view counts its base), plus what its
    fully_shard groups hold unsharded or in flight right now."""
    arrays = []
    for p in module.parameters():
        arrays.append(p.array)
        if p.grad is not None:
            arrays.append(p.grad.array)
    if optimizer is not None:
        for entry in optimizer.state.values():
            arrays.extend(v.array if isinstance(v, Tensor) else v for v in entry.values()
                          if isinstance(v, Tensor) or backend.is_array(v))
    seen: dict[int, int] = {}
    for arr in arrays:
        base = arr
        while getattr(base, "base", None) is not None and backend.is_array(base.base):
            base = base.base
        seen[id(base)] = int(base.nbytes)
    held = sum(seen.values())
    for m in module.modules():
        if m in _STATES and _STATES[m].group is not None:
            held += _STATES[m].group.resident_bytes()
    return held
