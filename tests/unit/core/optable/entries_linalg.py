"""Op table entries: core.linalg against torch.linalg.

Functions whose results are unique (det, inv, solve, norms, eigenvalues, singular values) are
compared as they are. eigh's and svd's vectors are unique only up to each column's sign, so
their entries compare sign-free functions of them (squared entries), which also carry the
gradient through the vectors. Float32 results come from different LAPACKs (OpenBLAS under
numpy, MKL or OpenBLAS under torch); on these 3x3 to 5x5 Gaussian matrices (condition numbers
below ~100) they agree within the table's float32 tolerance.
"""

from __future__ import annotations

from tests.unit.core.optable.table import FLOATS, A, DT, S, Seq, op

_SQUARE_ERROR = (S(A((2, 3))), RuntimeError)  # "A must be batches of square matrices"


def _linalg(name: str):
    """`call` for core.linalg.<name> / torch.linalg.<name>."""
    return lambda lib, *args, **kwargs: getattr(lib.linalg, name)(*args, **kwargs)


def _spd(lib, a, **kwargs):
    """cholesky of a symmetric positive-definite matrix made from a: a a^T + 3 I."""
    n = a.shape[-1]
    return lib.linalg.cholesky(a @ a.mT + 3 * lib.eye(n, dtype=a.dtype), **kwargs)


def _eigh(lib, a, **kwargs):
    w, v = lib.linalg.eigh(a + a.mT, **kwargs)
    return w, v * v


def _svd(lib, a, **kwargs):
    u, s, vh = lib.linalg.svd(a, **kwargs)
    k = s.shape[-1]
    return s, u[..., :k] * u[..., :k], vh[..., :k, :] * vh[..., :k, :]


def _entry(name: str, samples: tuple, **kw):
    return op(f"linalg.{name}", samples, forms=("call",), call=kw.pop("call", _linalg(name)),
              **kw)


ENTRIES = [
    _entry("det", (S(A((3, 3))), S(A((2, 3, 3))), S(A((1, 1)))), error=_SQUARE_ERROR),
    _entry("slogdet", (S(A((3, 3))), S(A((2, 4, 4)))), error=_SQUARE_ERROR),
    _entry("inv", (S(A((3, 3))), S(A((2, 3, 3)))), error=_SQUARE_ERROR),
    _entry("solve", (S(A((3, 3)), A((3, 2))), S(A((3, 3)), A((3,))),
                     S(A((2, 3, 3)), A((3, 1))), S(A((3, 3)), A((2, 3, 3))),
                     S(A((3, 3)), A((2, 3)), left=False)),
           error=(S(A((3, 3)), A((4,))), RuntimeError)),
    _entry("matrix_power", (S(A((3, 3)), 3), S(A((2, 3, 3)), -2), S(A((3, 3)), 0),
                            S(A((3, 3)), 1)),
           error=(S(A((2, 3)), 2), RuntimeError)),
    _entry("cholesky", (S(A((3, 3))), S(A((2, 4, 4))), S(A((3, 3)), upper=True)), call=_spd),
    _entry("qr", (S(A((4, 3))), S(A((3, 3))), S(A((2, 5, 3))))),
    _entry("eigvalsh", (S(A((3, 3))), S(A((2, 4, 4))), S(A((3, 3)), UPLO="U")),
           call=lambda lib, a, **kw: lib.linalg.eigvalsh(a + a.mT, **kw)),
    _entry("eigh", (S(A((3, 3))), S(A((2, 4, 4))), S(A((3, 3)), UPLO="U")), call=_eigh),
    _entry("svd", (S(A((4, 3)), full_matrices=False), S(A((3, 5)), full_matrices=False),
                   S(A((2, 3, 3)), full_matrices=False), S(A((4, 3))), S(A((3, 4))),
                   S(A((5, 2)))),
           call=_svd),
    _entry("svdvals", (S(A((4, 3))), S(A((2, 3, 5))))),
    _entry("pinv", (S(A((4, 3))), S(A((3, 5))), S(A((2, 3, 3))), S(A((4, 3)), atol=0.5),
                    S(A((3, 3)), hermitian=True))),
    _entry("matrix_rank", (S(A((4, 3))), S(A((3, 3))), S(A((4, 3)), atol=2.0),
                           S(A((2, 3, 5)), rtol=0.3)), grad=False),
    _entry("lstsq", (S(A((5, 3)), A((5, 2))), S(A((5, 3)), A((5, 2)), driver="gelsd"),
                     S(A((2, 5, 3)), A((2, 5, 1)), driver="gels"), S(A((5, 3)), A((5,))),
                     S(A((5, 3)), A((5, 2)), driver="gelss"))),
    _entry("vector_norm", (S(A((3, 4))), S(A((3, 4)), 1), S(A((3, 4)), 3.0, 1),
                           S(A((3, 4)), float("inf"), (0, 1)), S(A((3, 4)), 0),
                           S(A((3, 4)), -1.5, 0, keepdim=True),
                           S(A((3, 4)), dtype=DT("float64")))),
    _entry("matrix_norm", (S(A((3, 4))), S(A((2, 3, 4)), "nuc"), S(A((3, 4)), 2),
                           S(A((3, 4)), -2), S(A((3, 4)), 1), S(A((3, 4)), float("inf")),
                           S(A((2, 3, 4)), -1, (0, 2), keepdim=True)),
           error=(S(A((3, 3)), 3), RuntimeError)),
    _entry("norm", (S(A((3, 4))), S(A((3, 4)), "fro"), S(A((5,))), S(A((5,)), 3),
                    S(A((2, 3, 4)), None, (1, 2)), S(A((3, 4)), 2, 1)),
           error=(S(A((2, 3, 4)), 2), RuntimeError)),
    _entry("cross", (S(A((4, 3)), A((4, 3))), S(A((3, 2)), A((3, 1)), dim=0)),
           error=(S(A((2,)), A((2,))), RuntimeError)),
    _entry("multi_dot", (S(Seq((A((3, 4)), A((4, 5)), A((5, 2))))),)),
]
# Every entry runs in float32 and float64 (the table's FLOATS).
assert all(e.dtypes == FLOATS for e in ENTRIES)

# torch.linalg's everyday rest (core/linalg/extras.py).
ENTRIES += [
    _entry("matmul", (S(A((3, 4)), A((4, 2))), S(A((2, 3, 4)), A((4,))))),
    _entry("vecdot", (S(A((3, 4)), A((3, 4))), S(A((3, 4)), A((4,))), S(A((2, 3)), A((2, 3)), dim=0))),
    _entry("diagonal", (S(A((3, 4))), S(A((2, 3, 3)), offset=1), S(A((3, 2, 4)), dim1=0, dim2=2)),
           view=True, xfail={"alias": "core's diagonal (core/ops/products.py, which linalg.diagonal "
                                      "calls) returns a copy where torch's is a view"}),
    # p = 1, inf, "fro", "nuc" would run torch's cond backward through inv, which fails in torch
    # 2.13 (an in-place update of inv's output), so their values are compared in
    # linalg/test_linalg.py instead.
    _entry("cond", (S(A((3, 3))), S(A((4, 3))), S(A((3, 3)), -2), S(A((2, 3, 3)), 2))),
    _entry("solve_triangular", (S(A((3, 3)), A((3, 2)), upper=True),
                                S(A((3, 3)), A((3, 2)), upper=False, unitriangular=True),
                                S(A((3, 3)), A((2, 3)), upper=True, left=False),
                                S(A((2, 3, 3)), A((3, 1)), upper=False))),
    _entry("matrix_exp", (S(A((3, 3))), S(A((2, 4, 4))))),
    _entry("eigvals", (S(A((3, 3))), S(A((2, 4, 4)))), grad=False),
    _entry("inv_ex", (S(A((3, 3))), S(A((2, 3, 3))))),
    _entry("solve_ex", (S(A((3, 3)), A((3, 2))), S(A((3, 3)), A((3,))))),
    _entry("cholesky_ex", (S(A((3, 3))), S(A((3, 3)), upper=True)),
           call=lambda lib, a, **kw: lib.linalg.cholesky_ex(
               a @ a.mT + 3 * lib.eye(a.shape[-1], dtype=a.dtype), **kw)),
]

# LU (core/linalg/lu.py): values and pivots; no gradients yet (refused, tested in test_linalg).
ENTRIES += [
    _entry("lu_factor", (S(A((3, 3))), S(A((2, 4, 4))), S(A((4, 3))), S(A((3, 5)))), grad=False),
    _entry("lu_factor_ex", (S(A((3, 3))), S(A((2, 4, 4)))), grad=False),
    _entry("lu", (S(A((3, 3))), S(A((2, 4, 4))), S(A((4, 3))), S(A((3, 5)))), grad=False),
    _entry("lu_solve", (S(A((3, 3)), A((3, 2))), S(A((2, 3, 3)), A((2, 3, 1))),
                        S(A((3, 3)), A((2, 3)), left=False),
                        S(A((3, 3)), A((3, 2)), adjoint=True)), grad=False,
           call=lambda lib, a, b, **kw: lib.linalg.lu_solve(*lib.linalg.lu_factor(a), b, **kw)),
]
