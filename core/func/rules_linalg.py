"""Batching rules for core.linalg: its functions already take leading batch dims, so most take
the batched value as it is; the norms and cross shift their dims past the batch dim."""

from __future__ import annotations

from typing import Any, Callable

from shoal.core import linalg
from shoal.core.func._rulekit import physical_dim, value, wrap_out
from shoal.core.func.dispatch import register, wrapper_for
from shoal.core.func.rules import transparent
from shoal.core.func.rules_nn import _all_in_front


def _vector_norm(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    names = ("x", "ord", "dim", "keepdim")
    bound = {**dict(zip(names, args)), **kwargs}
    x = bound.pop("x")
    dim = bound.pop("dim", None)
    if dim is None:
        dims = tuple(range(1, x.ndim + 1))
    else:
        dims = tuple(physical_dim(d, x.ndim, "linalg.vector_norm")
                     for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))
    return wrap_out(call(value(x), dim=dims, **bound), level)


def _matrix_norm(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    names = ("A", "ord", "dim", "keepdim")
    bound = {**dict(zip(names, args)), **kwargs}
    x = bound.pop("A")
    dim = bound.pop("dim", (-2, -1))
    dims = tuple(physical_dim(d, x.ndim, "linalg.matrix_norm") for d in dim)
    return wrap_out(call(value(x), dim=dims, **bound), level)


def _norm(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """linalg.norm's choice made on the logical shape, then the vector or matrix rule."""
    names = ("A", "ord", "dim", "keepdim")
    bound = {**dict(zip(names, args)), **kwargs}
    x, ord_, dim = bound.pop("A"), bound.pop("ord", None), bound.pop("dim", None)
    if isinstance(dim, int):
        dim = (dim,)
    matrix = (dim is not None and len(dim) == 2) or (dim is None and ord_ is not None
                                                      and x.ndim == 2)
    if matrix:
        return wrapper_for(linalg.matrix_norm)(x, "fro" if ord_ is None else ord_,
                                               dim or (-2, -1), **bound)
    if dim is None and ord_ is not None and x.ndim != 1:
        raise RuntimeError("linalg.norm: If dim is not specified but ord is, the input must be "
                           f"1D or 2D. Got {x.ndim}D.")
    return wrapper_for(linalg.vector_norm)(x, 2 if ord_ is None else ord_, dim, **bound)


def _cross(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    a = args[0]
    dim = kwargs.get("dim", -1)
    d = physical_dim(dim, a.ndim, "linalg.cross")
    return _all_in_front(lambda *xs, **kw: call(*xs, dim=d), level, args[:2], {})


def _diagonal(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    dims = {k: physical_dim(kwargs.get(k, d), x.ndim, "linalg.diagonal")
            for k, d in (("dim1", -2), ("dim2", -1))}
    return wrap_out(call(value(x), offset=kwargs.get("offset", 0), **dims), level)


register([linalg.det, linalg.slogdet, linalg.inv, linalg.cholesky, linalg.qr, linalg.eigh,
          linalg.eigvalsh, linalg.svd, linalg.svdvals, linalg.pinv, linalg.matrix_rank,
          linalg.matrix_power, linalg.matrix_exp, linalg.eig, linalg.eigvals, linalg.inv_ex,
          linalg.cholesky_ex, linalg.cond, linalg.lu, linalg.lu_factor, linalg.lu_factor_ex],
         transparent)
register([linalg.solve, linalg.lstsq, linalg.solve_triangular, linalg.solve_ex, linalg.lu_solve],
         _all_in_front)
register(linalg.diagonal, _diagonal)
register(linalg.vector_norm, _vector_norm)
register(linalg.matrix_norm, _matrix_norm)
register(linalg.norm, _norm)
register(linalg.cross, _cross)
