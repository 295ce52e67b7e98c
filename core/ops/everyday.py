"""The registry of torch's everyday ops that core gained in one go: which are `core.<name>`
functions, which are Tensor methods, and the in-place `name_` variants built on
core/ops/inplace.py's recorded update.

core/ops/bind.py installs METHODS (an op already bound under the same name wins), and
core/__init__.py exports FUNCTIONS.
"""

from __future__ import annotations

from typing import Any, Callable

from shoal.core.ops import (
    arith, binary_table, graph_inplace, predicates, indexing, inplace, products, random_fill, rearrange, scans, sorting,
    unary_table,
)
from shoal.core.ops._util import UnsupportedOperand


def _inplace_unary(fn: Callable) -> Callable:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return inplace.update(self, lambda a, _: fn(a, *args, **kwargs), None)

    method.__name__ = fn.__name__ + "_"
    method.__doc__ = f"In-place {fn.__name__}."
    return method


def _inplace_binary(fn: Callable) -> Callable:
    def method(self: Any, other: Any, *args: Any, **kwargs: Any) -> Any:
        return inplace.update(self, lambda a, b: fn(a, b, *args, **kwargs), other)

    method.__name__ = fn.__name__ + "_"
    method.__doc__ = f"In-place {fn.__name__}."
    return method


def _inplace_with_source(fn: Callable, source_at: int) -> Callable:
    """In-place index ops: the tensor argument at `source_at` (after self) may carry grad."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) > source_at:
            head, src, tail = args[:source_at], args[source_at], args[source_at + 1:]
            return inplace.update(self, lambda a, s: fn(a, *head, s, *tail, **kwargs), src)
        return inplace.update(self, lambda a, _: fn(a, *args, **kwargs), None)

    method.__name__ = fn.__name__ + "_"
    method.__doc__ = f"In-place {fn.__name__}."
    return method


def _operator(fn: Callable, reflected: bool = False) -> Callable:
    def op(self: Any, other: Any) -> Any:
        try:
            return fn(other, self) if reflected else fn(self, other)
        except UnsupportedOperand:
            return NotImplemented

    op.__name__ = fn.__name__
    return op


# The in-place dunders (//=, %=, &=, ...) reuse inplace.augmented, the one behind +=, -=, ...
_MODULE_FUNCTIONS = {
    indexing: ("gather", "scatter", "scatter_add", "index_select", "index_add", "index_copy",
               "index_fill", "masked_fill", "masked_select", "take", "take_along_dim", "select"),
    sorting: ("sort", "argsort", "topk", "kthvalue", "median", "mode", "unique", "searchsorted",
              "bucketize", "histc", "bincount", "isin", "count_nonzero", "argwhere"),
    scans: ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "diff", "std", "var",
            "std_mean", "var_mean", "aminmax", "nansum", "nanmean"),
    products: ("dot", "vdot", "inner", "outer", "ger", "kron", "einsum", "trace", "diag",
               "diagonal", "diag_embed", "tril", "triu", "tril_indices", "triu_indices",
               "addmm", "addmv", "baddbmm", "addbmm", "cdist", "dist"),
    rearrange: ("flip", "fliplr", "flipud", "roll", "rot90", "movedim", "moveaxis", "swapaxes",
                "swapdims", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit", "tile",
                "repeat_interleave", "unflatten", "ravel", "broadcast_to", "broadcast_shapes",
                "broadcast_tensors", "meshgrid", "atleast_1d", "atleast_2d", "atleast_3d",
                "hstack", "vstack", "row_stack", "dstack", "column_stack", "block_diag",
                "cartesian_prod"),
    binary_table: ("logical_not", "bitwise_not", "float_power", "lerp", "addcmul", "addcdiv"),
    random_fill: ("bernoulli", "multinomial", "normal", "rand_like", "randn_like",
                  "randint_like"),
    predicates: ("isnan", "isinf", "isfinite", "isposinf", "isneginf", "signbit", "isreal",
                 "nan_to_num", "cross"),
}

FUNCTIONS: dict[str, Callable] = {
    name: getattr(module, name) for module, names in _MODULE_FUNCTIONS.items() for name in names
}
FUNCTIONS.update(predicates.FORWARDED)
FUNCTIONS.update(unary_table.OPS)
FUNCTIONS.update(binary_table.OPS)
FUNCTIONS["round"] = unary_table.round
# NumPy's spellings torch keeps
FUNCTIONS.update({"multiply": arith.mul, "subtract": arith.sub, "divide": arith.div,
                  "true_divide": arith.div, "negative": arith.neg})

# Functions that are not Tensor methods in torch (module-level creators and helpers).
_NOT_METHODS = ("tril_indices", "triu_indices", "broadcast_shapes", "broadcast_tensors",
                "meshgrid", "atleast_1d", "atleast_2d", "atleast_3d", "hstack", "vstack",
                "row_stack", "dstack", "column_stack", "block_diag", "cartesian_prod", "normal",
                "rand_like", "randn_like", "randint_like", "bucketize", "searchsorted", "cdist",
                "einsum", "histc_", "std_mean", "var_mean", "take_along_dim_",
                "polygamma")  # torch's method is polygamma(n), self second

METHODS: dict[str, Callable] = {k: v for k, v in FUNCTIONS.items() if k not in _NOT_METHODS}
METHODS.update({name + "_": _inplace_unary(fn) for name, fn in unary_table.OPS.items()})
METHODS["round_"] = _inplace_unary(unary_table.round)
METHODS.update({name + "_": _inplace_binary(binary_table.OPS[name]) for name in (
    "atan2", "hypot", "copysign", "fmod", "remainder", "floor_divide", "logical_and",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "gcd", "lcm",
    "heaviside")})
METHODS.update({
    "lerp_": _inplace_with_source(binary_table.lerp, 0),
    "addcmul_": _inplace_with_source(binary_table.addcmul, 0),
    "addcdiv_": _inplace_with_source(binary_table.addcdiv, 0),
    "scatter_": _inplace_with_source(indexing.scatter, 2),
    "scatter_add_": _inplace_with_source(indexing.scatter_add, 2),
    "index_add_": _inplace_with_source(indexing.index_add, 2),
    "index_copy_": _inplace_with_source(indexing.index_copy, 2),
    "index_fill_": _inplace_unary(indexing.index_fill),
    "masked_fill_": _inplace_unary(indexing.masked_fill),
    "tril_": _inplace_unary(products.tril),
    "triu_": _inplace_unary(products.triu),
    "cumsum_": _inplace_unary(scans.cumsum),
    "logical_not_": _inplace_unary(binary_table.logical_not),
})
METHODS.update(graph_inplace.METHODS)
METHODS.update({name: getattr(random_fill, name) for name in (
    "uniform_", "normal_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
    "bernoulli_", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor")})
METHODS.update({
    "__floordiv__": _operator(binary_table.OPS["floor_divide"]),
    "__rfloordiv__": _operator(binary_table.OPS["floor_divide"], reflected=True),
    "__ifloordiv__": inplace.augmented(binary_table.OPS["floor_divide"]),
    "__mod__": _operator(binary_table.OPS["remainder"]),
    "__rmod__": _operator(binary_table.OPS["remainder"], reflected=True),
    "__imod__": inplace.augmented(binary_table.OPS["remainder"]),
    "__and__": _operator(binary_table.OPS["bitwise_and"]),
    "__rand__": _operator(binary_table.OPS["bitwise_and"], reflected=True),
    "__iand__": inplace.augmented(binary_table.OPS["bitwise_and"]),
    "__or__": _operator(binary_table.OPS["bitwise_or"]),
    "__ror__": _operator(binary_table.OPS["bitwise_or"], reflected=True),
    "__ior__": inplace.augmented(binary_table.OPS["bitwise_or"]),
    "__xor__": _operator(binary_table.OPS["bitwise_xor"]),
    "__rxor__": _operator(binary_table.OPS["bitwise_xor"], reflected=True),
    "__ixor__": inplace.augmented(binary_table.OPS["bitwise_xor"]),
    "__invert__": binary_table.bitwise_not,
})
