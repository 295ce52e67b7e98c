"""The torch twins of the example models, for the state_dict round-trip tests.

They live with their other user, the benchmarks (bench/torch_twins.py), as bench/
dist_autograd_torch.py's twins do; tests reach bench/ as a namespace package from the
repository root. This name stays so that tests import their helpers from tests.support.
"""

from bench.torch_twins import TorchConvNet, TorchGPT

__all__ = ["TorchConvNet", "TorchGPT"]
