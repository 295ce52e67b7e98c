"""torch.linalg's counterpart (issue 35 starts it with multi_dot; more belongs here)."""

from shoal.core.ops.derived import multi_dot, norm as _norm
from shoal.core.tensor import Tensor


def vector_norm(x: Tensor, ord: float = 2, dim: object = None, keepdim: bool = False) -> Tensor:  # noqa: A002 - torch's name
    """The vector ord-norm over dim (all elements when None)."""
    return _norm(x, ord, dim, keepdim)


__all__ = ["multi_dot", "vector_norm"]
