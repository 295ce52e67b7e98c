"""Turning op instrumentation on and off: wrappers installed only while a profiler records.

core's ops have no central dispatch (each op is a plain function, bound to Tensor as a method
and re-exported by name in several modules), so while a profiler is on, every reference a
shoal module holds to an op function, and Tensor's operator methods, are swapped for a timing
wrapper, and swapped back when it stops. Code with the profiler off runs the original
functions: the cost of the profiler being off is zero, apart from the autograd engine's one
`_profile_hook is None` test per node.
"""

from __future__ import annotations

import sys
import threading
from weakref import ref as _weakref
from typing import Any, Callable

import numpy as np

from shoal.core import autograd
from shoal.core.ops import arith, attention, conv, creation, linalg, logical, nn, norm
from shoal.core.ops import pooling, reduce, shape, unary
from shoal.core.data.dataloader import _LoaderIter
from shoal.core.optim.optimizer import Optimizer
from shoal.core.profiler import cuda, state
from shoal.core.profiler.events import Event, now_ns, user_stack
from shoal.core.tensor import Tensor

_OP_MODULES = (arith, attention, conv, creation, linalg, logical, nn, norm, pooling, reduce,
               shape, unary)

# Tensor's operator methods are closures made in bind.py (reflection, NotImplemented), not the
# op functions themselves, so they are wrapped on the class by name.
_DUNDERS = {
    "__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "sub",
    "__mul__": "mul", "__rmul__": "mul", "__truediv__": "div", "__rtruediv__": "div",
    "__pow__": "pow", "__rpow__": "pow", "__matmul__": "matmul", "__rmatmul__": "matmul",
    "__neg__": "neg", "__abs__": "abs", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt",
    "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__getitem__": "getitem",
    "__setitem__": "setitem",
}

_ndarray = np.ndarray
_lock = threading.Lock()
_users = 0
_restore: list[tuple[Any, str, Any]] = []


def _op_functions() -> dict[Callable, str]:
    """Every public op function, by identity, with the name its events carry."""
    fns: dict[Callable, str] = {}
    for mod in _OP_MODULES:
        for name, fn in vars(mod).items():
            if (not name.startswith("_") and callable(fn) and not isinstance(fn, type)
                    and getattr(fn, "__module__", None) == mod.__name__):
                # aliases (shape.view = shape.reshape) keep the function's own name
                fns[fn] = fn.__name__ if not fn.__name__.startswith("_") else name
    return fns


def _alloc_bytes(out: Any, args: tuple, rec: Any, t: int) -> int:
    """Bytes of new storage in the op's output tensors (views of an input count nothing).

    Each output is counted once, by the innermost op that made it, and its free is recorded
    when the tensor is collected (a weak reference's callback: far cheaper than a finalizer).
    """
    if out.__class__ is Tensor:
        return _count_tensor(out, args, rec, t)
    if not isinstance(out, (tuple, list)):
        return _count_tensor(out, args, rec, t) if isinstance(out, Tensor) else 0
    return sum(_count_tensor(o, args, rec, t) for o in out if isinstance(o, Tensor))


def _count_tensor(o: Any, args: tuple, rec: Any, t: int) -> int:
    key = id(o)
    if key in rec.live_tensors:
        return 0
    d = o.array
    base = d.base
    if base is None:
        base = d
    for a in args:
        if a.__class__ is Tensor or isinstance(a, Tensor):
            ad = a.array
            if ad is base or ad.base is base:
                return 0  # a view of (or the very array of) an input
    n = d.nbytes
    rec.live_tensors[key] = n  # Tensor.__del__, set while memory is profiled, records the free
    # at `t`, the op's last nanosecond: the allocation lies inside the op that made it, where
    # the trace's readers look for it; the tensor's id is its Addr
    rec.mem_raw.append((t, n, threading.get_ident(), key))
    if d.__class__ is not _ndarray:
        _note_device(rec, key, d)
    return n


def _note_device(rec: Any, addr: int, array: Any) -> None:
    """Remember the GPU of an array that is not numpy's (cupy's), for its memory events."""
    device = getattr(array, "device", None)
    if device is not None and hasattr(device, "id"):
        rec.gpu_addrs[addr] = int(device.id)


def _tensor_freed(self: Any) -> None:
    """Tensor.__del__ while a profiler records memory: a counted tensor's free is an event.

    A finalizer on the class costs a fraction of a weak reference per tensor (created, then
    called back), and tensors are the most numerous allocations a step makes.
    """
    for rec in _memory_recorders:  # the job's window and a user's may both count tensors
        n = rec.live_tensors.pop(id(self), None)
        if n is not None:
            rec.mem_raw.append((now_ns(), -n, threading.get_ident(), id(self)))


_memory_recorders: tuple = ()


def watch_tensor_frees(rec: Any) -> None:
    """Record the frees of `rec`'s counted tensors (until `unwatch_tensor_frees(rec)`)."""
    global _memory_recorders
    with _lock:
        _memory_recorders = _memory_recorders + (rec,)
        Tensor.__del__ = _tensor_freed  # type: ignore[attr-defined]


def unwatch_tensor_frees(rec: Any) -> None:
    """`rec`'s tensors die silently again; with no recorder left, every tensor does."""
    global _memory_recorders
    with _lock:
        _memory_recorders = tuple(r for r in _memory_recorders if r is not rec)
        if not _memory_recorders:
            try:
                del Tensor.__del__  # type: ignore[attr-defined]
            except AttributeError:
                pass


def _wrap(fn: Callable, name: str) -> Callable:
    get_ident = threading.get_ident

    def profiled(*args: Any, **kwargs: Any) -> Any:
        rec = state.recorder if not state.local_users else state.current()
        if rec is None:
            return fn(*args, **kwargs)
        if rec.detailed and (rec.cuda or rec.with_stack):
            return _profiled_detailed(rec, fn, name, args, kwargs)
        # One tuple per call, turned into an Event when the window ends; shapes and memory
        # are inlined here (not in _profiled_detailed) because they run for every op.
        t0 = now_ns()
        out = fn(*args, **kwargs)
        t1 = now_ns()
        node = getattr(out, "grad_fn", None)
        flow = node.seq + 1 if node is not None else 0
        if not rec.detailed:
            rec.raw.append((name, "cpu_op", t0, t1 - t0, get_ident(), flow))
            return out
        shapes = tuple([getattr(a, "shape", ()) for a in args]) if rec.record_shapes else None
        mem = 0
        if rec.profile_memory:
            if out.__class__ is Tensor:
                mem = _count_tensor(out, args, rec, t1 - 1) if id(out) not in rec.live_tensors \
                    else 0
            else:
                mem = _alloc_bytes(out, args, rec, t1 - 1)
        rec.detailed_raw.append((name, "cpu_op", t0, t1 - t0, get_ident(), flow, mem, shapes,
                                 None))
        return out

    _pose_as(profiled, fn, name)
    return profiled


def _pose_as(wrapper: Callable, fn: Callable, name: str) -> None:
    """Give `wrapper` the original's module and names: pickle (RPC sends functions by
    reference) then writes the real name, and finds the wrapper there while it is installed.

    Set once when the wrapper is made, so the profiler being off costs nothing.
    """
    wrapper.__module__ = getattr(fn, "__module__", None) or __name__
    wrapper.__name__ = getattr(fn, "__name__", name)
    wrapper.__qualname__ = getattr(fn, "__qualname__", name)
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]


def wrapper_for(fn: Callable) -> Callable:
    """The timing wrapper of op function `fn` while the profiler is installed, else `fn`.

    An RPC callee unpickles the function it runs before its profiled call installs the
    wrappers, so it holds the original: it calls this to record the op as the caller asked.
    """
    if _users <= 0:
        return fn
    return _wrapper_cache.get(fn, fn)


def _profiled_detailed(rec: Any, fn: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """An op under with_stack or CUDA timing (and maybe shapes and memory too)."""
    gpu = rec.cuda and cuda.on_gpu(args)
    if gpu:
        start = cuda.mark()
    t0 = now_ns()
    out = fn(*args, **kwargs)
    t1 = now_ns()
    node = getattr(out, "grad_fn", None)
    flow = node.seq + 1 if node is not None else 0
    shapes = tuple([getattr(a, "shape", ()) for a in args]) if rec.record_shapes else None
    stack = user_stack() if rec.with_stack else None
    mem = 0
    if rec.profile_memory:
        if out.__class__ is Tensor:  # the common case, inlined: this runs for every op
            mem = _count_tensor(out, args, rec, t1 - 1) if id(out) not in rec.live_tensors \
                    else 0
        else:
            mem = _alloc_bytes(out, args, rec, t1 - 1)
    if gpu:
        ev = Event(name, "cpu_op", t0, t1 - t0, threading.get_ident(), flow=flow, mem=mem,
                   shapes=shapes, stack=stack)
        cuda.pend(rec, ev, start)
        rec.detailed_raw.append(ev)
    else:
        rec.detailed_raw.append((name, "cpu_op", t0, t1 - t0, threading.get_ident(), flow,
                                 mem, shapes, stack))
    return out


def _backward_hook(node: Any, fn: Callable, g: Any) -> Any:
    rec = state.recorder if not state.local_users else state.current()
    if rec is None:
        return fn(g)
    if rec.cuda and cuda.array_on_gpu(g):
        return _backward_on_gpu(rec, node, fn, g)
    t0 = now_ns()
    grads = fn(g)
    t1 = now_ns()
    if not rec.profile_memory:
        rec.raw.append((node.name(), "backward", t0, t1 - t0, threading.get_ident(),
                        node.seq + 1))
        return grads
    rec.detailed_raw.append((node.name(), "backward", t0, t1 - t0, threading.get_ident(),
                             node.seq + 1, _grad_bytes(grads, g, rec, t1 - 1), None, None))
    return grads


def _backward_on_gpu(rec: Any, node: Any, fn: Callable, g: Any) -> Any:
    """A backward node under ProfilerActivity.CUDA whose gradient is on a GPU: its kernels'
    time from two CUDA events around it, as a forward op's (`_profiled_detailed`)."""
    start = cuda.mark()
    t0 = now_ns()
    grads = fn(g)
    t1 = now_ns()
    mem = _grad_bytes(grads, g, rec, t1 - 1) if rec.profile_memory else 0
    ev = Event(node.name(), "backward", t0, t1 - t0, threading.get_ident(), flow=node.seq + 1,
               mem=mem)
    cuda.pend(rec, ev, start)
    rec.detailed_raw.append(ev)  # kept as an Event: resolve_window fills in its CUDA time
    return grads


_NOT_ARRAY = object()


def _grad_bytes(grads: Any, g: Any, rec: Any, t: int) -> int:
    """Bytes of fresh gradient arrays a backward node returned (views of its input: none)."""
    if grads.__class__ is not tuple and not isinstance(grads, (tuple, list)):
        return 0
    base = g.base
    if base is None:
        base = g
    first = None  # two outputs may share one fresh buffer (x * x): count it once
    total = 0
    for gi in grads:
        if gi is None:
            continue
        r = getattr(gi, "base", _NOT_ARRAY)
        if r is None:
            r = gi
        elif r is _NOT_ARRAY:
            continue
        if r is base or r is first or id(r) in rec.counted:
            continue
        if first is None:
            first = r
        n = r.nbytes
        total += n
        ref = _weakref(r, rec.free_callback)
        rec.counted.add(id(r))
        rec.live[id(ref)] = (ref, n, id(r))
        rec.mem_raw.append((t, n, threading.get_ident(), id(r)))  # inside the node
        if r.__class__ is not _ndarray:
            _note_device(rec, id(r), r)
    return total


def _wrap_next(nxt: Callable, cls_name: str) -> Callable:
    """A DataLoader iterator's __next__ as an event: the time the loop waited for a batch."""
    name = f"enumerate(DataLoader)#{cls_name}.__next__"  # torch's event name

    def profiled_next(self: Any) -> Any:
        rec = state.recorder if not state.local_users else state.current()
        if rec is None:
            return nxt(self)
        t0 = now_ns()
        try:
            return nxt(self)
        finally:
            rec.events.append(Event(name, "dataloader", t0, now_ns() - t0,
                                    threading.get_ident()))

    profiled_next.__wrapped__ = nxt  # type: ignore[attr-defined]
    return profiled_next


def _wrap_step(step: Callable) -> Callable:
    def profiled_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = state.recorder if not state.local_users else state.current()
        if rec is None:
            out = step(self, *args, **kwargs)
        else:
            t0 = now_ns()
            out = step(self, *args, **kwargs)
            t1 = now_ns()
            name = f"Optimizer.step#{type(self).__name__}.step"  # torch's event name
            rec.events.append(Event(name, "optimizer", t0, t1 - t0, threading.get_ident()))
        for hook in _step_listeners:
            hook(self)
        return out

    profiled_step.__wrapped__ = step  # type: ignore[attr-defined]
    return profiled_step


# Called after every optimizer step while instrumented (the job profiler counts steps by them).
_step_listeners: list[Callable[[Any], None]] = []


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


# Installed code (the standard library, site-packages) never calls shoal's ops by a name it
# imported; scanning only shoal's modules and the user's keeps install() fast next to torch.
_INSTALLED = tuple(sorted({p for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p}))


def _holds_user_calls(mod_name: str, mod: Any) -> bool:
    """Whether a module may hold references to op functions worth swapping."""
    if mod_name.startswith("shoal.core.profiler"):
        return False
    if mod_name.startswith("shoal.") or mod_name == "__main__":
        return True
    path = getattr(mod, "__file__", None)
    return bool(path) and not path.startswith(_INSTALLED)


_wrapper_cache: dict[Callable, Callable] = {}
_scan_cache: tuple[int, list] = (-1, [])


def _wrappers() -> dict[Callable, Callable]:
    """One timing wrapper per op function, made once (they hold no state of a window)."""
    if not _wrapper_cache:
        _wrapper_cache.update({fn: _wrap(fn, name) for fn, name in _op_functions().items()})
    return _wrapper_cache


def _references(wrappers: dict) -> list[tuple[Any, str, Callable]]:
    """(module, name, op function) for every module-level reference to an op, rescanned only
    when modules were imported since: a profiled RPC installs the wrappers once per call."""
    global _scan_cache
    count = len(sys.modules)
    if _scan_cache[0] != count:
        refs = []
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not _holds_user_calls(mod_name, mod):
                continue
            for attr, value in list(vars(mod).items()):
                try:
                    if value in wrappers:
                        refs.append((mod, attr, value))
                except TypeError:  # an unhashable module attribute
                    continue
        _scan_cache = (count, refs)
    return _scan_cache[1]


def install() -> None:
    """Swap op references for timing wrappers (reference counted: nested profilers share)."""
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        wrappers = _wrappers()
        for mod, attr, value in _references(wrappers):
            if vars(mod).get(attr) is value:  # still bound as when it was scanned
                _restore.append((mod, attr, value))
                setattr(mod, attr, wrappers[value])
        for attr, value in list(vars(Tensor).items()):
            if not callable(value):
                continue
            w = wrappers.get(value)
            if w is None and attr in _DUNDERS:
                w = _wrap(value, _DUNDERS[attr])
            if w is not None:
                _restore.append((Tensor, attr, value))
                setattr(Tensor, attr, w)
        for cls in _subclasses(Optimizer):
            # one fused update of a parameter group: torch's `_fused_sgd_`-style op, so the
            # step's own work shows among the ops (it runs on raw arrays, below the op layer)
            group_step = cls.__dict__.get("_step_group")
            if group_step is not None:
                _restore.append((cls, "_step_group", group_step))
                cls._step_group = _wrap(group_step, f"_fused_{cls.__name__.lower()}_")
        for cls in _subclasses(_LoaderIter):
            nxt = cls.__dict__.get("__next__")
            if nxt is not None:
                _restore.append((cls, "__next__", nxt))
                cls.__next__ = _wrap_next(nxt, cls.__name__)
        autograd.set_profile_hook(_backward_hook)
    _wrap_steps()


def uninstall() -> None:
    """Put every original reference back once the last profiler stops."""
    global _users
    with _lock:
        _users -= 1
        if _users > 0:
            return
        autograd.set_profile_hook(None)
        while _restore:
            owner, attr, value = _restore.pop()
            setattr(owner, attr, value)
    _unwrap_steps()


_step_lock = threading.Lock()
_step_users = 0
_step_restore: list[tuple[type, Any]] = []


def _wrap_steps() -> None:
    """Wrap every Optimizer class's own step (reference counted, apart from the op wrappers:
    the job profiler watches steps also while it is not recording)."""
    global _step_users
    with _step_lock:
        _step_users += 1
        if _step_users > 1:
            return
        for cls in _subclasses(Optimizer):
            step = cls.__dict__.get("step")
            if step is not None:
                _step_restore.append((cls, step))
                cls.step = _wrap_step(step)


def _unwrap_steps() -> None:
    global _step_users
    with _step_lock:
        _step_users -= 1
        if _step_users > 0:
            return
        while _step_restore:
            cls, step = _step_restore.pop()
            cls.step = step


def watch_steps(listener: Callable[[Any], None]) -> None:
    """Call `listener(optimizer)` after every optimizer step from now on."""
    _step_listeners.append(listener)
    _wrap_steps()
