"""Flatten a list of arrays into one contiguous buffer and copy a buffer back into the arrays.

DDP reduces gradients in buckets: one collective on one buffer instead of one per parameter.
On CUDA each direction is one kernel launch for the whole list (a table of pointers and offsets
on the device) instead of one copy per array.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shoal.core.errors import ShapeError
from shoal.core.kernels._cuda import cached_kernel, cupy, is_cuda_array, launch_1d


def _check_buffer(buffer: Any, arrays: Sequence[Any], op: str) -> int:
    total = sum(int(a.size) for a in arrays)
    if buffer.ndim != 1 or buffer.size < total:
        raise ShapeError(
            f"{op} needs a 1-D buffer of at least {total} elements for {len(arrays)} arrays; "
            f"got a buffer of shape {tuple(buffer.shape)}."
        )
    for index, a in enumerate(arrays):
        if a.dtype != buffer.dtype:
            raise ShapeError(
                f"{op}: array {index} has dtype {a.dtype} but the buffer has {buffer.dtype}; "
                "every array in a bucket must share the buffer's dtype."
            )
    return total


def flatten_reference(arrays: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Copy `arrays` end to end into `out` (1-D; allocated when None) and return it."""
    if out is None:
        dtype = arrays[0].dtype if arrays else np.float32
        out = np.empty(sum(int(a.size) for a in arrays), dtype=dtype)
    _check_buffer(out, arrays, "flatten")
    offset = 0
    for a in arrays:
        n = int(a.size)
        out[offset : offset + n].reshape(a.shape)[...] = a
        offset += n
    return out


def unflatten_reference(buffer: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """Copy consecutive slices of `buffer` back into each of `arrays`, in place."""
    _check_buffer(buffer, arrays, "unflatten")
    offset = 0
    for a in arrays:
        n = int(a.size)
        a[...] = buffer[offset : offset + n].reshape(a.shape)
        offset += n


_FLATTEN_SOURCE = r"""
// Index of the array holding flat element i: the last k with offsets[k] <= i. Empty arrays
// share their offset with the next one, so the search skips them.
__device__ __forceinline__ int shoal_find_array(const long long* offsets, int count, long long i) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

template <typename T>
__global__ void shoal_flatten(const unsigned long long* ptrs, const long long* offsets,
                              int count, T* out, long long total) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int k = shoal_find_array(offsets, count, i);
        out[i] = ((const T*)ptrs[k])[i - offsets[k]];
    }
}

template <typename T>
__global__ void shoal_unflatten(const T* buffer, const unsigned long long* ptrs,
                                const long long* offsets, int count, long long total) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        int k = shoal_find_array(offsets, count, i);
        ((T*)ptrs[k])[i - offsets[k]] = buffer[i];
    }
}
"""

# The copy only moves bytes, so one instantiation per element size serves every dtype.
_WORD_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


@cached_kernel
def _flatten_module():
    names = []
    for word in _WORD_TYPES.values():
        names += [f"shoal_flatten<{word}>", f"shoal_unflatten<{word}>"]
    return cupy().RawModule(code=_FLATTEN_SOURCE, options=("-std=c++14",), name_expressions=names)


def _table(cp, arrays: Sequence[Any], op: str):
    for index, a in enumerate(arrays):
        if not a.flags.c_contiguous:
            raise ShapeError(
                f"{op} needs C-contiguous arrays; array {index} of shape {tuple(a.shape)} is not."
            )
    ptrs = cp.asarray([a.data.ptr for a in arrays], dtype=cp.uint64)
    offsets = cp.asarray(np.cumsum([0] + [int(a.size) for a in arrays[:-1]]), dtype=cp.int64)
    return ptrs, offsets


def flatten_cuda(arrays: Sequence[Any], out: Any | None = None) -> Any:
    """Copy cupy `arrays` into one 1-D buffer with a single kernel launch."""
    cp = cupy()
    arrays = list(arrays)
    if out is None:
        dtype = arrays[0].dtype if arrays else cp.float32
        out = cp.empty(sum(int(a.size) for a in arrays), dtype=dtype)
    total = _check_buffer(out, arrays, "flatten")
    if total == 0:
        return out
    ptrs, offsets = _table(cp, arrays, "flatten")
    word = _WORD_TYPES[out.dtype.itemsize]
    kernel = _flatten_module().get_function(f"shoal_flatten<{word}>")
    grid, block = launch_1d(total)
    kernel(grid, block, (ptrs, offsets, np.int32(len(arrays)), out, np.int64(total)))
    return out


def unflatten_cuda(buffer: Any, arrays: Sequence[Any]) -> None:
    """Copy a cupy buffer back into cupy `arrays` in place with a single kernel launch."""
    cp = cupy()
    arrays = list(arrays)
    total = _check_buffer(buffer, arrays, "unflatten")
    if total == 0:
        return
    ptrs, offsets = _table(cp, arrays, "unflatten")
    word = _WORD_TYPES[buffer.dtype.itemsize]
    kernel = _flatten_module().get_function(f"shoal_unflatten<{word}>")
    grid, block = launch_1d(total)
    kernel(grid, block, (cp.ascontiguousarray(buffer), ptrs, offsets, np.int32(len(arrays)),
                         np.int64(total)))


def flatten(arrays: Sequence[Any], out: Any | None = None) -> Any:
    """One 1-D buffer holding `arrays` end to end: one CUDA launch for cupy, numpy otherwise."""
    if (out is not None and is_cuda_array(out)) or (arrays and is_cuda_array(arrays[0])):
        return flatten_cuda(arrays, out)
    return flatten_reference(arrays, out)


def unflatten(buffer: Any, arrays: Sequence[Any]) -> None:
    """Copy `buffer` back into `arrays` in place: one CUDA launch for cupy, numpy otherwise."""
    if is_cuda_array(buffer):
        unflatten_cuda(buffer, arrays)
    else:
        unflatten_reference(buffer, arrays)
