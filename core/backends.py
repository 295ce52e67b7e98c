"""torch.backends' flags: cudnn, cuda.matmul, mps; shoal keeps them for scripts that set them."""

from __future__ import annotations

from types import SimpleNamespace

from shoal.core import cuda as _cuda

# Plain attributes, as torch's: scripts set them (benchmark, deterministic). shoal's kernels do
# not read them; core.use_deterministic_algorithms is the switch that shoal honours.
cudnn = SimpleNamespace(
    enabled=True, benchmark=False, deterministic=False, allow_tf32=True,
    is_available=_cuda.is_available, version=lambda: None,
)
cuda = SimpleNamespace(
    matmul=SimpleNamespace(allow_tf32=False, allow_fp16_reduced_precision_reduction=True),
    is_built=_cuda.is_available,
)
mps = SimpleNamespace(is_available=lambda: False, is_built=lambda: False)
