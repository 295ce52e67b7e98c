"""Arrays as the process groups see them: unwrapping, validation, reductions, fingerprints.

Collectives accept numpy arrays, cupy arrays, `core.Tensor`s (whose `.array` is one of the
two) and any object exposing `__dlpack__` or the array interface (torch tensors, JAX arrays;
`collectives.dlpack`), and work in place on the underlying buffer, as torch does on a tensor's
storage.
"""

from __future__ import annotations

import pickle
from typing import Any, Sequence

import numpy as np

from shoal.collectives.dlpack import foreign_array, refusal
from shoal.collectives.types import PremulSum, ReduceOp
from shoal.core.errors import ShapeError


def is_tensor(x: Any) -> bool:
    """True for a `core.Tensor` (detected without importing core.tensor)."""
    return type(x).__module__.startswith("shoal.core.") and hasattr(x, "array")


def is_cupy(x: Any) -> bool:
    """True for a cupy ndarray (detected without importing cupy)."""
    return type(x).__module__.startswith("cupy")


def unwrap(x: Any, what: str):
    """The contiguous numpy or cupy array behind `x`, which collectives read and write in place.

    Raises:
        TypeError: `x` is no array (`collectives.dlpack.ForeignArrayError`, naming its type and
            what to pass instead).
        ValueError: the array is not C-contiguous or not writeable.
    """
    if type(x) is np.ndarray:
        arr = x
    elif isinstance(x, np.ndarray):
        arr = x
    elif is_tensor(x):
        arr = x.array
    elif is_cupy(x):
        arr = x
    else:
        arr = foreign_array(x, what)
        if arr is None:
            raise refusal(x, what)
    if arr.dtype.hasobject:
        raise TypeError(f"{what} has dtype object; collectives move numeric arrays only.")
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{what} must be C-contiguous to be used in place (shape {tuple(arr.shape)}, strides "
            f"{tuple(arr.strides)}); pass np.ascontiguousarray(...) or .copy()."
        )
    if isinstance(arr, np.ndarray) and not arr.flags.writeable:
        hint = "" if x is arr else (
            f" (it is a {type(x).__name__}; for an immutable one such as a JAX array pass "
            "np.array(x), a writable copy, and read the result from that)")
        raise ValueError(f"{what} is read-only; collectives write their result into it{hint}.")
    return arr


def unwrap_list(xs: Sequence[Any], what: str, count: int) -> list:
    """`unwrap` each of exactly `count` arrays."""
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__len__"):
        raise TypeError(f"{what} must be a list of {count} arrays, got {type(xs).__name__}.")
    if len(xs) != count:
        raise ValueError(f"{what} must hold {count} arrays (one per rank), got {len(xs)}.")
    return [unwrap(x, f"{what}[{i}]") for i, x in enumerate(xs)]


def same_layout(arrays: Sequence, ref, what: str, ref_what: str) -> None:
    """Raise unless every array has `ref`'s shape and dtype."""
    for i, a in enumerate(arrays):
        if a.shape != ref.shape or a.dtype != ref.dtype:
            raise ShapeError(
                f"{what}[{i}] is {describe(a)} but {ref_what} is {describe(ref)}; they must match."
            )


def same_layout_pairs(arrays: Sequence, refs: Sequence, what: str) -> None:
    """Raise unless `arrays[i]` has `refs[i]`'s shape and dtype for every i."""
    for i, (a, ref) in enumerate(zip(arrays, refs)):
        if a.shape != ref.shape or a.dtype != ref.dtype:
            raise ShapeError(
                f"{what}[{i}] is {describe(a)} but input {i} is {describe(ref)}; they must match."
            )


def describe(arr) -> str:
    """`float32[4, 3]`: the dtype and shape that fingerprints and messages show."""
    return f"{arr.dtype.name}{list(arr.shape)}"


def check_same_dtype(output, input_array, output_what: str, input_what: str,
                     rule: str = "both must share one dtype") -> None:
    """Refuse an output and input (unwrapped arrays) of different dtypes: a collective that
    moves blocks copies bytes and never converts them, so a mismatch would garble the data.

    Raises:
        TypeError: naming both arrays, e.g. "all_to_all_single output is float32[6] but input
            is float64[6]; both must share one dtype."
    """
    if output.dtype != input_array.dtype:
        raise TypeError(
            f"{output_what} is {describe(output)} but {input_what} is "
            f"{describe(input_array)}; {rule}."
        )


def as_bytes(arr) -> memoryview:
    """A flat writable byte view of a contiguous numpy array (works for every dtype)."""
    try:
        return memoryview(arr).cast("B")
    except (TypeError, ValueError):  # dtypes the buffer protocol cannot name (bfloat16), 0-d
        return memoryview(arr.reshape(-1).view(np.uint8))


def reduce_op(op: Any) -> ReduceOp:
    """Accept a ReduceOp or its name ("sum", "SUM")."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, PremulSum):
        return op.op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    raise ValueError(
        f"op must be one of {', '.join('ReduceOp.' + o.name for o in ReduceOp)}, got {op!r}."
    )


_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def check_reducible(op: ReduceOp, dtype) -> None:
    """Raise for reductions a dtype does not support (AVG of integers, MIN/MAX of complex)."""
    kind = np.dtype(dtype).kind
    if op is ReduceOp.AVG and kind not in "fc" and np.dtype(dtype).name != "bfloat16":
        raise ValueError(
            f"ReduceOp.AVG needs a floating-point dtype, got {np.dtype(dtype).name}; use SUM and "
            "divide, or cast first."
        )
    if op in _BITWISE and kind not in "iub":
        raise ValueError(
            f"Cannot use ReduceOp.{op.name} with non-integral dtype {np.dtype(dtype).name}: "
            "bitwise reductions take integer or bool arrays."
        )
    if op is ReduceOp.PREMUL_SUM:
        raise ValueError(
            "ReduceOp.PREMUL_SUM needs its factor: pass collectives.make_premul_sum(factor) "
            "(torch: _make_nccl_premul_sum) as the op."
        )
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise ValueError(f"ReduceOp.{op.name} is undefined for complex dtype {np.dtype(dtype).name}.")


def ufunc(op: ReduceOp):
    """The numpy ufunc that combines two operands in place for `op` (AVG sums, then divides)."""
    return _UFUNCS[op]


def premul(arr, factor: float, copy: bool):
    """`arr` times PREMUL_SUM's `factor` (in place unless `copy`), for floating dtypes."""
    kind = np.dtype(arr.dtype).kind
    if kind not in "fc" and np.dtype(arr.dtype).name != "bfloat16":
        raise ValueError(
            f"ReduceOp.PREMUL_SUM needs a floating-point dtype, got {np.dtype(arr.dtype).name}."
        )
    out = arr.copy() if copy else arr
    out *= out.dtype.type(factor)
    return out


def finish_avg(arr: np.ndarray, world: int) -> None:
    """Divide a SUM by the number of ranks, in place."""
    if arr.size:
        np.divide(arr, arr.dtype.type(world), out=arr)


def pickle_to_array(obj: Any) -> np.ndarray:
    """`obj` pickled into a uint8 array (object collectives move these)."""
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()


def array_to_object(arr: np.ndarray) -> Any:
    """Inverse of `pickle_to_array` (only ever called on bytes from authenticated peers)."""
    return pickle.loads(arr.tobytes())
