"""grad, grad_and_value, vjp and jvp: torch.func's reverse- and forward-mode transforms.

They run the function on fresh leaves (core/func/_leaves.py) with core's autograd and read the
gradients back; composed with vmap they give per-sample results, because the graph is built on
the physical (batched) tensors. jvp uses the double-vjp trick (core has no forward mode): with
u a dummy cotangent, g(u) = J^T u is linear in u, and the vjp of g with the tangent v is J v;
that needs every op on the way to have a create_graph formula (core/double_backward.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from shoal.core import autograd
from shoal.core.func._leaves import Leaf
from shoal.core.func._pytree import tree_flatten, tree_map, tree_unflatten
from shoal.core.func.batched import STATE, rewrap, unwrap_all
from shoal.core.func._leaves import active_levels, materialize
from shoal.core.grad_mode import enable_grad
from shoal.core.ops import creation
from shoal.core.tensor import Tensor


def _argnums(argnums: Any, nargs: int, op: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if not isinstance(nums, tuple) or not nums or not all(isinstance(n, int) for n in nums):
        raise RuntimeError(f"{op}: argnums must be int or Tuple[int, ...], got: "
                           f"{type(argnums)}")
    out = []
    for n in nums:
        if not -nargs <= n < nargs:
            raise RuntimeError(f"Got argnum={n}, but only {nargs} positional inputs")
        out.append(n % nargs)
    return tuple(out)


class _Run:
    """One transform's run: leaves made, the function called with them nested one level."""

    def __init__(self, op: str, first_order: bool) -> None:
        self.op = op
        self.create_graph = STATE.diff_depth > 0
        self.first_order = first_order and not self.create_graph
        self.leaves: list[Leaf] = []

    def leaves_of(self, tree: Any) -> Any:
        """The structure of tree with each tensor replaced by its leaf's view."""
        flat, spec = tree_flatten(tree)
        made = [Leaf(x, self.op) for x in flat]
        self.leaves.extend(made)
        return tree_unflatten([leaf.view for leaf in made], spec)

    def call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """func(*args, **kwargs) one differentiation level deeper."""
        prev = STATE.first_order
        STATE.diff_depth += 1
        STATE.first_order = self.first_order
        try:
            return func(*args, **kwargs)
        finally:
            STATE.diff_depth -= 1
            STATE.first_order = prev

    def gradients(self, outs: list, cotangents: list, leaves: list[Leaf],
                  create_graph: bool | None = None) -> list:
        """d(sum <out, cotangent>)/d leaf for each leaf, wrapped in the leaf's levels."""
        roots, seeds = [], []
        for out, ct in zip(outs, cotangents):
            phys, levels = unwrap_all(out)
            if not phys.requires_grad:
                continue
            ct_phys, ct_levels = unwrap_all(ct)
            if not set(ct_levels) <= set(levels):
                continue  # out is the same along a level the cotangent varies on: no path
            want = [(lvl, phys.shape[levels.index(lvl)]) for lvl in levels]
            roots.append(phys)
            seeds.append(materialize(ct_phys, ct_levels, want).to(phys.dtype))
        grads = [None] * len(leaves)
        if roots:
            grads = autograd.grad(roots, [leaf.physical for leaf in leaves], seeds,
                                  retain_graph=True, allow_unused=True,
                                  create_graph=self.create_graph if create_graph is None
                                  else create_graph)
        return [rewrap(creation.zeros_like(leaf.physical) if g is None else g, leaf.levels)
                for g, leaf in zip(grads, leaves)]

    def finish(self, tree: Any) -> Any:
        """An output handed back to the caller: cut from the graph unless nested."""
        if self.create_graph:
            return tree
        return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def _split_aux(out: Any, has_aux: bool, op: str) -> tuple[Any, Any]:
    if not has_aux:
        return out, None
    if not isinstance(out, tuple) or len(out) != 2:
        raise RuntimeError(f"{op}(f, ...)(*args): output of function f should be a tuple: "
                           "(output, aux) if has_aux is True")
    return out


def grad_and_value(func: Callable, argnums: Any = 0, has_aux: bool = False) -> Callable:
    """A function returning (gradient of func's scalar output w.r.t. argnums, output)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nums = _argnums(argnums, len(args), "grad_and_value")
        with enable_grad():
            run = _Run("grad_and_value", first_order=True)
            args = list(args)
            trees = []
            for n in nums:
                start = len(run.leaves)
                args[n] = run.leaves_of(args[n])
                trees.append((start, len(run.leaves), tree_flatten(args[n])[1]))
            out = run.call(func, tuple(args), kwargs)
            value, aux = _split_aux(out, has_aux, "grad_and_value")
            if not isinstance(value, Tensor):
                raise RuntimeError(f"grad_and_value(f)(*args): Expected f(*args) to return a "
                                   f"Tensor, got {type(value)}")
            if value.ndim != 0:
                raise RuntimeError(f"grad_and_value(f)(*args): Expected f(*args) to return a "
                                   f"scalar Tensor, got tensor with {value.ndim} dims. Maybe you "
                                   "wanted to use the vjp or jacrev APIs instead?")
            phys, levels = unwrap_all(value)
            grads = run.gradients([value], [rewrap(creation.ones_like(phys), levels)],
                                  run.leaves)
        per_arg = tuple(tree_unflatten(grads[a:b], spec) for a, b, spec in trees)
        g = per_arg[0] if isinstance(argnums, int) else per_arg
        value = run.finish(value)
        return (g, (value, run.finish(aux))) if has_aux else (g, value)

    return wrapper


def grad(func: Callable, argnums: Any = 0, has_aux: bool = False) -> Callable:
    """A function returning the gradient of func's scalar output w.r.t. argnums."""
    inner = grad_and_value(func, argnums, has_aux)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        g, value = inner(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return wrapper


def vjp(func: Callable, *primals: Any, has_aux: bool = False) -> tuple:
    """(func(*primals), vjp_fn): vjp_fn(cotangents) gives the cotangents times the Jacobian."""
    with enable_grad():
        run = _Run("vjp", first_order=False)
        views = run.leaves_of(tuple(primals))
        out = run.call(func, tuple(views), {})
    value, aux = _split_aux(out, has_aux, "vjp")
    outs, out_spec = tree_flatten(value)
    graph_levels = {lvl for lvl, _ in active_levels()}
    prim_spec = tree_flatten(tuple(primals))[1]

    def vjp_fn(cotangents: Any, retain_graph: bool = True, create_graph: bool | None = None
               ) -> tuple:
        flat_ct, _ = tree_flatten(cotangents)
        if len(flat_ct) != len(outs):
            raise RuntimeError(f"Expected pytree structure of cotangents to be the same as "
                               f"pytree structure of outputs to the function: {len(flat_ct)} "
                               f"cotangents for {len(outs)} outputs.")
        for ct, o in zip(flat_ct, outs):
            if tuple(ct.shape) != tuple(o.shape):
                raise RuntimeError(f"Mismatch in shape: grad_output[0] has a shape of "
                                   f"{tuple(ct.shape)} and output[0] has a shape of "
                                   f"{tuple(o.shape)}.")
        new_levels = {lvl for ct in flat_ct for lvl in unwrap_all(ct)[1]} - graph_levels
        if new_levels:
            # A cotangent batched by a vmap around vjp_fn: the graph holds one sample, so the
            # function runs again with its inputs broadcast along the new levels.
            return vjp(func, *primals, has_aux=has_aux)[1](cotangents)
        with enable_grad():
            nested = STATE.diff_depth > 0 or run.create_graph
            grads = run.gradients(outs, flat_ct, run.leaves,
                                  create_graph=nested if create_graph is None else create_graph)
        return tree_unflatten(grads, prim_spec)

    result = (run.finish(value), vjp_fn)
    return (*result, run.finish(aux)) if has_aux else result


def jvp(func: Callable, primals: Any, tangents: Any, *, strict: bool = False,
        has_aux: bool = False) -> tuple:
    """(func(*primals), J @ tangents), by the double-vjp trick (see the module docstring)."""
    if not isinstance(primals, tuple):
        raise RuntimeError("jvp(f, primals, tangents): Expected primals to be a tuple. E.g. it "
                           "should be valid to call f(*primals).")
    if not isinstance(tangents, tuple) or len(tangents) != len(primals):
        raise RuntimeError("jvp(f, primals, tangents): Expected primals and tangents to have "
                           "the same python structure.")
    flat_t = tree_flatten(tangents)[0]
    for p, t in zip(tree_flatten(primals)[0], flat_t):
        if tuple(p.shape) != tuple(t.shape):
            raise RuntimeError("jvp(f, primals, tangents): Expected primals and tangents to "
                               f"have the same shape, got {tuple(p.shape)} and "
                               f"{tuple(t.shape)}.")
    with enable_grad():
        run = _Run("jvp", first_order=False)
        views = run.leaves_of(primals)
        out = run.call(func, tuple(views), {})
        value, aux = _split_aux(out, has_aux, "jvp")
        outs, out_spec = tree_flatten(value)
        dummies = [_Dummy(o) for o in outs]
        g = run.gradients(outs, [d.view for d in dummies], run.leaves, create_graph=True)
        used = [(gi, t) for gi, t in zip(g, flat_t) if unwrap_all(gi)[0].requires_grad]
        tangent_outs = [creation.zeros_like(d.physical) for d in dummies]
        if used:
            found = autograd.grad([unwrap_all(gi)[0] for gi, _ in used],
                                  [d.physical for d in dummies],
                                  [_like(t, gi) for gi, t in used], retain_graph=True,
                                  allow_unused=True, create_graph=run.create_graph)
            tangent_outs = [z if f is None else f for f, z in zip(found, tangent_outs)]
    jv = [rewrap(t, d.levels) for t, d in zip(tangent_outs, dummies)]
    result = (run.finish(value), tree_unflatten(jv, out_spec))
    return (*result, run.finish(aux)) if has_aux else result


class _Dummy:
    """The dummy cotangent u of the double-vjp trick, shaped as one output."""

    __slots__ = ("physical", "levels", "view")

    def __init__(self, out: Tensor) -> None:
        phys, levels = unwrap_all(out)
        self.physical = creation.zeros_like(phys).requires_grad_(True)
        self.levels = levels
        self.view = rewrap(self.physical, levels)


def _like(t: Any, g: Any) -> Tensor:
    """A tangent as the physical shape of the gradient it multiplies."""
    g_phys, g_levels = unwrap_all(g)
    t_phys, t_levels = unwrap_all(t)
    want = [(lvl, g_phys.shape[g_levels.index(lvl)]) for lvl in g_levels]
    return materialize(t_phys, t_levels, want).to(g_phys.dtype)
