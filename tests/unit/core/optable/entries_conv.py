"""Op table entries: conv3d and the transposed convolutions (conv1d/conv2d are in
entries_reduce.py)."""

from __future__ import annotations

from tests.unit.core.optable.table import FLOATS, A, S, op

_FUNCTION = dict(dtypes=FLOATS, forms=("function",))

ENTRIES = [
    # (input, weight, bias, stride, padding, dilation, groups)
    op("conv3d", (S(A((2, 3, 4, 5, 4)), A((4, 3, 2, 3, 2))),
                  S(A((1, 4, 5, 4, 4)), A((2, 2, 3, 2, 3)), A((2,)), (2, 1, 1), 1, (1, 2, 1), 2),
                  S(A((2, 5, 4, 3)), A((3, 2, 3, 3, 3)), None, 1, "same")),
       error=(S(A((2, 3, 4, 4, 4)), A((4, 2, 3, 3, 3))), RuntimeError), **_FUNCTION),
    # (input, weight, bias, stride, padding, output_padding, groups, dilation)
    op("conv_transpose1d", (S(A((2, 4, 6)), A((4, 3, 3))),
                            S(A((2, 4, 5)), A((4, 2, 3)), A((4,)), 2, 1, 1, 2),
                            S(A((3, 5)), A((3, 2, 2)), None, 3, 0, 2, 1, 2)),
       error=(S(A((2, 3, 6)), A((4, 3, 3))), RuntimeError), **_FUNCTION),
    op("conv_transpose2d", (S(A((2, 3, 4, 4)), A((3, 2, 3, 3))),
                            S(A((1, 4, 3, 5)), A((4, 1, 3, 2)), A((2,)), (2, 1), (1, 0), (1, 0),
                              2, (1, 2))),
       error=(S(A((2, 3, 4, 4)), A((3, 2, 3, 3)), None, 1, 0, 1), RuntimeError), **_FUNCTION),
    op("conv_transpose3d", (S(A((2, 2, 3, 3, 2)), A((2, 3, 2, 2, 2))),
                            S(A((1, 4, 3, 2, 3)), A((4, 1, 2, 3, 2)), A((2,)), 2, 1, 1, 2, 1)),
       error=(S(A((2, 3, 3, 3, 3)), A((2, 3, 2, 2, 2))), RuntimeError), **_FUNCTION),
]
