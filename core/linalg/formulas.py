"""create_graph formulas (core/double_backward.py's table) for linalg's own nodes, written with
core ops and linalg itself, so that hessian, jvp and gradient penalties go through linalg."""

from __future__ import annotations

from typing import Any

from shoal.core.double_backward import FORMULAS, sum_to
from shoal.core.linalg.inverse import det, inv, solve
from shoal.core.linalg.norms import vector_norm
from shoal.core.ops import arith, unary
from shoal.core.ops import linalg as ops_linalg
from shoal.core.ops import shape as shape_ops


def _closure(node: Any) -> dict:
    """The values the op's backward closure holds, by name."""
    fn = node.backward_fn
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _mt(t: Any) -> Any:
    return shape_ops.transpose(t, -2, -1)


def _vector_norm(node: Any, g: Any) -> tuple:
    (x,) = node.inputs
    saved = _closure(node)
    order, axes, keepdim = saved["ord"], saved["axes"], saved["keepdim"]
    norm = vector_norm(x, order, axes, True)
    gk = g
    if not keepdim and axes is not None:
        for a in sorted(axes):
            gk = shape_ops.unsqueeze(gk, a)
    mag = unary.abs(x)
    # Masks as arithmetic (x / |x| is 0 at 0; nothing flows where the norm is 0), so that the
    # formula's own graph is made of ops that have formulas too.
    sgn = arith.div(x, arith.add(mag, arith.eq(mag, 0).to(mag.dtype)))
    if order == 1:
        return (arith.mul(sgn, gk),)
    at_zero = arith.eq(norm, 0).to(norm.dtype)
    scale = arith.div(gk, arith.pow(arith.add(norm, at_zero), order - 1))
    grad = arith.mul(arith.mul(sgn, arith.pow(mag, order - 1)), scale)
    return (arith.mul(grad, arith.rsub(at_zero, 1.0)),)


def _inv(node: Any, g: Any) -> tuple:
    (a,) = node.inputs
    xt = _mt(inv(a))
    return (arith.neg(ops_linalg.matmul(ops_linalg.matmul(xt, g), xt)),)


def _det(node: Any, g: Any) -> tuple:
    (a,) = node.inputs
    scale = shape_ops.unsqueeze(shape_ops.unsqueeze(arith.mul(g, det(a)), -1), -1)
    return (arith.mul(scale, _mt(inv(a))),)


def _solve(node: Any, g: Any) -> tuple:
    a, b = node.inputs
    saved = _closure(node)
    if not saved["left"]:
        raise NotImplementedError("double backward through linalg.solve(left=False) is not "
                                  "supported yet.")
    vector = saved["vector"]
    x = solve(a, b)
    gb = solve(_mt(a), g)
    gb2 = shape_ops.unsqueeze(gb, -1) if vector else gb
    x2 = shape_ops.unsqueeze(x, -1) if vector else x
    ga = arith.neg(ops_linalg.matmul(gb2, _mt(x2)))
    return (sum_to(ga, a.shape) if a.requires_grad else None,
            sum_to(gb, b.shape) if b is not None and b.requires_grad else None)


for _name, _formula in (("LinalgVectorNormBackward", _vector_norm), ("LinalgInvExBackward", _inv),
                        ("LinalgDetBackward", _det), ("LinalgSolveExBackward", _solve)):
    FORMULAS.setdefault(_name, _formula)
