"""torch.nn._reduction: the enum values torch's loss kernels take for `reduction`, and the
mapping of the deprecated `size_average`/`reduce` pair to a reduction string. Private in torch,
but older models and PyTorch's own test lists call it."""

from __future__ import annotations

import warnings

__all__ = ["get_enum", "legacy_get_enum", "legacy_get_string", "reduction_of"]

_ENUM = {"none": 0, "mean": 1, "sum": 2}


def get_enum(reduction: str) -> int:
    """0, 1 or 2 for 'none', 'mean' or 'sum' (and 'elementwise_mean', the old name of 'mean')."""
    if reduction == "elementwise_mean":
        warnings.warn("reduction='elementwise_mean' is deprecated, please use "
                      "reduction='mean' instead.", stacklevel=2)
        return _ENUM["mean"]
    if reduction not in _ENUM:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return _ENUM[reduction]


def legacy_get_string(size_average: bool | None, reduce: bool | None,
                      emit_warning: bool = True) -> str:
    """The reduction string the deprecated pair means: reduce=False is 'none', else
    size_average picks 'mean' or 'sum'; either left as None counts as True."""
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    if not reduce:
        result = "none"
    else:
        result = "mean" if size_average else "sum"
    if emit_warning:
        warnings.warn("size_average and reduce args will be deprecated, please use "
                      f"reduction='{result}' instead.", stacklevel=2)
    return result


def legacy_get_enum(size_average: bool | None, reduce: bool | None,
                    emit_warning: bool = True) -> int:
    """get_enum of legacy_get_string."""
    return get_enum(legacy_get_string(size_average, reduce, emit_warning))


def reduction_of(size_average: bool | None, reduce: bool | None, reduction: str) -> str:
    """What a loss reduces by: `reduction`, unless the deprecated pair is given (torch's rule)."""
    if size_average is None and reduce is None:
        return reduction
    return legacy_get_string(size_average, reduce, emit_warning=True)
