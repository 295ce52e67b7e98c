"""Differentiable ops, one module per family; each op's forward and backward sit together.

The ops and Tensor import each other: each op wraps its result in Tensor, and core/tensor.py binds
the ops as Tensor's methods once the class is defined. That resolves only when core/tensor.py
starts first, so the package loads it before any op module, whichever module asked for an op.
"""

import shoal.core.tensor  # noqa: F401  (Tensor before any op: see above)
