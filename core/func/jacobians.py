"""jacrev, jacfwd and hessian: whole Jacobians from vjp/jvp mapped over a basis with vmap.

jacrev is the release's example made a function: `vmap(vjp_fn)(unit_vectors)`, one row of the
Jacobian per unit cotangent, computed as one batched backward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from shoal.core.func._pytree import tree_flatten, tree_unflatten
from shoal.core.func.autodiff import _argnums, _split_aux, jvp, vjp
from shoal.core.func.vmap import vmap
from shoal.core.ops import creation


def _basis(like: Any) -> Any:
    """The unit vectors of like's elements, shaped (numel, *like.shape)."""
    n = like.numel()
    return creation.eye(n, dtype=like.dtype, device=like.device).reshape(n, *like.shape)


def _with(args: tuple, nums: tuple, values: tuple) -> tuple:
    out = list(args)
    for n, v in zip(nums, values):
        out[n] = v
    return tuple(out)


def jacrev(func: Callable, argnums: Any = 0, *, has_aux: bool = False,
           chunk_size: int | None = None) -> Callable:
    """The Jacobian of func w.r.t. argnums, by reverse mode (one vjp per output element)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nums = _argnums(argnums, len(args), "jacrev")

        def partial(*diff: Any) -> Any:
            return func(*_with(args, nums, diff), **kwargs)

        res = vjp(partial, *(args[n] for n in nums), has_aux=has_aux)
        out, vjp_fn = res[0], res[1]
        outs, spec = tree_flatten(out)
        per_out = []
        for i, o in enumerate(outs):
            def row(ct: Any, i: int = i) -> Any:
                cts = [creation.zeros_like(x) if j != i else ct for j, x in enumerate(outs)]
                return vjp_fn(tree_unflatten(cts, spec))

            rows = vmap(row, chunk_size=chunk_size)(_basis(o))
            per_out.append(tuple(r.reshape(*o.shape, *args[n].shape)
                                 for r, n in zip(rows, nums)))
        jac = [p[0] if isinstance(argnums, int) else p for p in per_out]
        jac = tree_unflatten(jac, spec)
        return (jac, res[2]) if has_aux else jac

    return wrapper


def jacfwd(func: Callable, argnums: Any = 0, has_aux: bool = False, *,
           randomness: str = "error") -> Callable:
    """The Jacobian of func w.r.t. argnums, by forward mode (one jvp per input element)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nums = _argnums(argnums, len(args), "jacfwd")

        def partial(*diff: Any) -> Any:
            out = func(*_with(args, nums, diff), **kwargs)
            return _split_aux(out, has_aux, "jacfwd")[0]

        primals = tuple(args[n] for n in nums)
        per_arg = []
        for k, x in enumerate(primals):
            def column(t: Any, k: int = k) -> Any:
                tangents = tuple(t if j == k else creation.zeros_like(p)
                                 for j, p in enumerate(primals))
                return jvp(partial, primals, tangents)[1]

            cols = vmap(column, randomness=randomness)(_basis(x))
            flat, spec = tree_flatten(cols)
            per_arg.append((flat, spec, x))
        out_flat = []
        for i in range(len(per_arg[0][0])):
            items = []
            for flat, _, x in per_arg:
                c = flat[i]  # (numel(x), *out.shape)
                out_shape = tuple(c.shape[1:])
                moved = c.reshape(x.numel(), -1).t() if out_shape else c.reshape(x.numel())
                items.append(moved.reshape(*out_shape, *x.shape))
            out_flat.append(items[0] if isinstance(argnums, int) else tuple(items))
        jac = tree_unflatten(out_flat, per_arg[0][1])
        if has_aux:
            return jac, _split_aux(func(*args, **kwargs), True, "jacfwd")[1]
        return jac

    return wrapper


def hessian(func: Callable, argnums: Any = 0) -> Callable:
    """The Hessian of func's scalar output w.r.t. argnums: jacfwd(jacrev(func))."""
    return jacfwd(jacrev(func, argnums), argnums)
