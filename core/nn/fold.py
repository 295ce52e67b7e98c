"""torch.nn.functional.unfold (im2col) and fold (col2im), and the Unfold and Fold modules.

unfold copies each sliding block of a (N, C, H, W) input into a column of (N, C*kh*kw, L),
rows ordered channel-major then kernel row then kernel column, as aten's im2col; fold sums the
columns back into place. Each is the other's backward, so both are one strided slice per
kernel position: kh*kw array copies (or adds) of block-sized views, no per-block loop.
"""

from __future__ import annotations

from typing import Any

from shoal.core.nn.module import Module
from shoal.core.ops._util import result, xp_of
from shoal.core.tensor import Tensor

__all__ = ["fold", "unfold", "Fold", "Unfold"]


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"expected a pair of ints, got {value!r}")
        return int(value[0]), int(value[1])
    return int(value), int(value)


def _check_args(k: tuple, d: tuple, p: tuple, s: tuple) -> None:
    """aten's im2col/col2im argument checks, in its order and words."""
    if min(k) <= 0:
        raise RuntimeError(f"kernel size should be greater than zero, but got kernel_height: "
                           f"{k[0]} kernel_width: {k[1]}")
    if min(s) <= 0:
        raise RuntimeError(f"stride should be greater than zero, but got stride_height: {s[0]} "
                           f"stride_width: {s[1]}")
    if min(d) <= 0:
        raise RuntimeError(f"dilation should be greater than zero, but got dilation_height: "
                           f"{d[0]} dilation_width: {d[1]}")
    if min(p) < 0:
        raise RuntimeError(f"padding should be non-negative, but got pad_height: {p[0]} "
                           f"pad_width: {p[1]}")


def _blocks(size: tuple, k: tuple, d: tuple, p: tuple, s: tuple) -> tuple[int, int]:
    """The number of sliding blocks along height and width."""
    return tuple((size[a] + 2 * p[a] - d[a] * (k[a] - 1) - 1) // s[a] + 1 for a in (0, 1))


def _taps(k: tuple, d: tuple, s: tuple, blocks: tuple) -> list:
    """(kernel row, kernel column, the padded input's rows, its columns) per kernel position."""
    out = []
    for i in range(k[0]):
        for j in range(k[1]):
            rows = slice(i * d[0], i * d[0] + s[0] * (blocks[0] - 1) + 1, s[0])
            cols = slice(j * d[1], j * d[1] + s[1] * (blocks[1] - 1) + 1, s[1])
            out.append((i, j, rows, cols))
    return out


def _im2col(x: Any, k: tuple, d: tuple, p: tuple, s: tuple, blocks: tuple) -> Any:
    """(N, C, H, W) -> (N, C*kh*kw, L)."""
    xp = xp_of(x)
    n, c = x.shape[:2]
    xpad = xp.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1]))) if any(p) else x
    cols = xp.empty((n, c, k[0], k[1]) + tuple(blocks), dtype=x.dtype)
    for i, j, rows, columns in _taps(k, d, s, blocks):
        cols[:, :, i, j] = xpad[:, :, rows, columns]
    return cols.reshape(n, c * k[0] * k[1], blocks[0] * blocks[1])


def _col2im(cols: Any, size: tuple, k: tuple, d: tuple, p: tuple, s: tuple,
            blocks: tuple) -> Any:
    """(N, C*kh*kw, L) -> (N, C, H, W), overlapping blocks summed."""
    xp = xp_of(cols)
    n = cols.shape[0]
    c = cols.shape[1] // (k[0] * k[1])
    cols6 = cols.reshape((n, c, k[0], k[1]) + tuple(blocks))
    out = xp.zeros((n, c, size[0] + 2 * p[0], size[1] + 2 * p[1]), dtype=cols.dtype)
    for i, j, rows, columns in _taps(k, d, s, blocks):
        out[:, :, rows, columns] += cols6[:, :, i, j]
    return out[:, :, p[0]: p[0] + size[0], p[1]: p[1] + size[1]]


def unfold(input: Tensor, kernel_size: Any, dilation: Any = 1, padding: Any = 0,  # noqa: A002
           stride: Any = 1) -> Tensor:
    """Sliding local blocks of a (N, C, H, W) or (C, H, W) input as columns (im2col)."""
    k, d, p, s = _pair(kernel_size), _pair(dilation), _pair(padding), _pair(stride)
    _check_args(k, d, p, s)
    xd = input.array
    if xd.ndim not in (3, 4) or any(n == 0 for n in xd.shape[-3:]):
        raise RuntimeError(f"Expected 3D or 4D (batch mode) tensor with optional 0 dim batch "
                           f"size for input, but got: {list(xd.shape)}")
    size = tuple(xd.shape[-2:])
    blocks = _blocks(size, k, d, p, s)
    if min(blocks) < 1:
        raise RuntimeError(
            f"Given input with spatial size {size}, kernel_size={k}, dilation={d}, "
            f"padding={p}, calculated shape of the array of sliding blocks as {blocks}, but its "
            f"components must be at least one.")
    x4 = xd if xd.ndim == 4 else xd[None]
    out = _im2col(x4, k, d, p, s, blocks)

    def backward(g: Any) -> tuple:
        gx = _col2im(g if g.ndim == 3 else g[None], size, k, d, p, s, blocks)
        return (gx if xd.ndim == 4 else gx[0],)

    return result(out if xd.ndim == 4 else out[0], "Im2ColBackward", backward, (input,))


def fold(input: Tensor, output_size: Any, kernel_size: Any, dilation: Any = 1,  # noqa: A002
         padding: Any = 0, stride: Any = 1) -> Tensor:
    """Sum columns of sliding blocks back into a (N, C, H, W) or (C, H, W) output (col2im)."""
    size = _pair(output_size)
    k, d, p, s = _pair(kernel_size), _pair(dilation), _pair(padding), _pair(stride)
    _check_args(k, d, p, s)
    xd = input.array
    if xd.ndim not in (2, 3) or any(n == 0 for n in xd.shape[-2:]):
        raise RuntimeError(f"Expected 2D or 3D (batch mode) tensor for input with possibly 0 "
                           f"batch size and non-zero dimensions for input, but got: "
                           f"{list(xd.shape)}")
    rows, length = xd.shape[-2:]
    if rows % (k[0] * k[1]):
        raise RuntimeError(
            f"Expected size of input's dimension 1 to be divisible by the product of "
            f"kernel_size, but got input.size(1)={rows} and kernel_size={k}.")
    blocks = _blocks(size, k, d, p, s)
    if min(blocks) < 1 or blocks[0] * blocks[1] != length:
        raise RuntimeError(
            f"Given output_size={size}, kernel_size={k}, dilation={d}, padding={p}, "
            f"stride={s}, expected size of input's dimension 2 to match the calculated number "
            f"of sliding blocks {blocks[0]} * {blocks[1]} = {blocks[0] * blocks[1]}, but got "
            f"input.size(2)={length}.")
    cols = xd if xd.ndim == 3 else xd[None]
    out = _col2im(cols, size, k, d, p, s, blocks)

    def backward(g: Any) -> tuple:
        gc = _im2col(g if g.ndim == 4 else g[None], k, d, p, s, blocks)
        return (gc if xd.ndim == 3 else gc[0],)

    return result(out if xd.ndim == 3 else out[0], "Col2ImBackward", backward, (input,))


class Unfold(Module):
    """Module form of unfold (im2col)."""

    def __init__(self, kernel_size: Any, dilation: Any = 1, padding: Any = 0,
                 stride: Any = 1) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.padding = padding
        self.stride = stride

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """unfold(input) with this module's geometry."""
        return unfold(input, self.kernel_size, self.dilation, self.padding, self.stride)

    def extra_repr(self) -> str:
        """The geometry, as torch prints it."""
        return (f"kernel_size={self.kernel_size}, dilation={self.dilation}, "
                f"padding={self.padding}, stride={self.stride}")


class Fold(Module):
    """Module form of fold (col2im)."""

    def __init__(self, output_size: Any, kernel_size: Any, dilation: Any = 1, padding: Any = 0,
                 stride: Any = 1) -> None:
        super().__init__()
        self.output_size = output_size
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.padding = padding
        self.stride = stride

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """fold(input) with this module's geometry."""
        return fold(input, self.output_size, self.kernel_size, self.dilation, self.padding,
                    self.stride)

    def extra_repr(self) -> str:
        """The geometry, as torch prints it."""
        return (f"output_size={self.output_size}, kernel_size={self.kernel_size}, "
                f"dilation={self.dilation}, padding={self.padding}, stride={self.stride}")
