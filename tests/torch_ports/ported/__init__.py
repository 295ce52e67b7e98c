"""PyTorch's test modules under renamed imports: importing `tests.torch_ports.ported.<name>`
loads torch's file through tests/torch_ports/shim.py (in spawned ranks too, since unpickling
a test class imports this package first)."""

from tests.torch_ports import shim

shim.install()
