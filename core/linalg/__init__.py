"""torch.linalg's counterpart: LAPACK through numpy/scipy on cpu and cupy on cuda, batched over
leading dims, with gradients and torch's errors (LinAlgError for singular input)."""

from shoal.core.linalg import formulas  # noqa: F401 - registers create_graph formulas
from shoal.core.linalg._common import LinAlgError
from shoal.core.linalg.decompositions import (
    EighResult, QRResult, SVDResult, cholesky, eigh, eigvalsh, qr, svd, svdvals,
)
from shoal.core.linalg.extras import (
    CholeskyExResult, EigResult, InvExResult, SolveExResult, cholesky_ex, cond, diagonal, eig,
    eigvals, inv_ex, matrix_exp, solve_ex, solve_triangular, vecdot,
)
from shoal.core.linalg.inverse import SlogdetResult, det, inv, matrix_power, slogdet, solve
from shoal.core.linalg.lu import (
    LUFactorExResult, LUFactorResult, LUResult, lu, lu_factor, lu_factor_ex, lu_solve,
)
from shoal.core.linalg.leastsq import LstsqResult, lstsq, matrix_rank, pinv
from shoal.core.linalg.norms import cross, matrix_norm, norm, vector_norm
from shoal.core.ops.derived import multi_dot
from shoal.core.ops.linalg import matmul

__all__ = [
    "CholeskyExResult", "EigResult", "EighResult", "InvExResult", "LinAlgError", "LstsqResult",
    "QRResult", "SVDResult", "SlogdetResult", "SolveExResult", "cholesky", "cholesky_ex", "cond",
    "cross", "det", "diagonal", "eig", "eigh", "eigvals", "eigvalsh", "inv", "inv_ex", "lstsq",
    "LUFactorExResult", "LUFactorResult", "LUResult", "lu", "lu_factor", "lu_factor_ex",
    "lu_solve",
    "matmul", "matrix_exp", "matrix_norm", "matrix_power", "matrix_rank", "multi_dot", "norm",
    "pinv", "qr", "slogdet", "solve", "solve_ex", "solve_triangular", "svd", "svdvals",
    "vecdot", "vector_norm",
]
