"""torch.linalg's counterpart: LAPACK through numpy/scipy on cpu and cupy on cuda, batched over
leading dims, with gradients and torch's errors (LinAlgError for singular input)."""

from shoal.core.linalg import formulas  # noqa: F401 - registers create_graph formulas
from shoal.core.linalg._common import LinAlgError
from shoal.core.linalg.decompositions import (
    EighResult, QRResult, SVDResult, cholesky, eigh, eigvalsh, qr, svd, svdvals,
)
from shoal.core.linalg.inverse import SlogdetResult, det, inv, matrix_power, slogdet, solve
from shoal.core.linalg.leastsq import LstsqResult, lstsq, matrix_rank, pinv
from shoal.core.linalg.norms import cross, matrix_norm, norm, vector_norm
from shoal.core.ops.derived import multi_dot

__all__ = [
    "EighResult", "LinAlgError", "LstsqResult", "QRResult", "SVDResult", "SlogdetResult",
    "cholesky", "cross", "det", "eigh", "eigvalsh", "inv", "lstsq", "matrix_norm",
    "matrix_power", "matrix_rank", "multi_dot", "norm", "pinv", "qr", "slogdet", "solve",
    "svd", "svdvals", "vector_norm",
]
