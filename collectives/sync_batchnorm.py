"""SyncBatchNorm: batch normalisation whose batch statistics span every rank of a group.

In training the per-channel count, sum and sum of squares are all-reduced in the forward pass
(so ranks may hold different batch sizes, as in torch), and the sums of dy and dy * xhat in
the backward pass; core's batch_norm takes the reduction as a callable, so core never imports
collectives. Weight and bias gradients stay local: DDP averages them as it averages any other.
"""

from __future__ import annotations

from typing import Any

from shoal.collectives import world
from shoal.core import nn
from shoal.core.nn.normalization import _BatchNorm
from shoal.core.nn import functional as F


class SyncBatchNorm(_BatchNorm):
    """torch.nn.SyncBatchNorm: BatchNorm over (N, C, ...) with statistics from every rank."""

    _input_dims = ()

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
        affine: bool = True, track_running_stats: bool = True, process_group: Any = None,
        device: Any = None, dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: Any) -> None:  # noqa: A002 - torch's name
        if input.ndim < 2:
            raise ValueError(f"expected at least 2D input (got {input.ndim}D input)")

    def _group(self) -> Any:
        if self.process_group is not None:
            return self.process_group
        # Outside a process group (a single process) the statistics are this rank's alone.
        return world.get_default_group() if world.is_initialized() else None

    def forward(self, input: Any) -> Any:  # noqa: A002 - torch's name
        self._check_input_dim(input)
        factor, use_batch = self._momentum_and_mode()
        mean, var = self._running()
        group = self._group() if use_batch else None
        reduce_sums = None
        if group is not None and group.size() > 1:
            def reduce_sums(arr: Any) -> Any:
                group.all_reduce(arr)  # in place, summed over the group
                return arr
        return F.batch_norm(input, mean, var, self.weight, self.bias, use_batch, factor,
                            self.eps, reduce_sums=reduce_sums)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """Replace every BatchNorm*d in module with a SyncBatchNorm sharing its parameters and stats."""
        output = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            output = cls(module.num_features, module.eps, module.momentum, module.affine,
                         module.track_running_stats, process_group)
            if module.affine:
                output.weight = module.weight
                output.bias = module.bias
            output.running_mean = module.running_mean
            output.running_var = module.running_var
            output.num_batches_tracked = module.num_batches_tracked
            output.training = module.training
        for name, child in list(module.named_children()):
            output.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return output
