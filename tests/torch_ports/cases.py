"""PyTorch's RPC and dist_autograd test suites (from the torch wheel, through the shim) made
concrete for shoal's agent, as torch's own test_tensorpipe_agent.py makes them for TensorPipe:
each suite, an agent fixture, and torch's MultiProcessTestCase, which spawns the ranks.

Not collected by the suite (no test_ prefix); tests/torch_ports/test_torch_ports.py runs the
chosen tests from here in a child pytest and compares the outcomes with expected.py.
"""

# First: the ported package installs the shim, and a stand-in for the expecttest package that
# torch's testing modules import.
from tests.torch_ports.ported import dist_autograd_test, rpc_agent_test_fixture, rpc_test

import torch

import shoal.rpc_agent as rpc
from shoal import core
import torch.testing._internal.dist_utils
from torch.testing._internal.common_distributed import MultiProcessTestCase


class ShoalAgentFixture(rpc_agent_test_fixture.RpcAgentTestFixture):
    """shoal's agent where torch's fixture names TensorPipe's (its backend_registry and
    transports are TensorPipe internals, not API a user's script touches)."""

    @property
    def rpc_backend(self):
        """The backend torch's tests pass to init_rpc."""
        return rpc.BackendType.TENSORPIPE

    @property
    def rpc_backend_options(self):
        """Options as a user would build them: a fresh object per call, as torch's."""
        return rpc.TensorPipeRpcBackendOptions(init_method=self.init_method)

    def get_shutdown_error_regex(self):
        """Any error: torch's TensorPipe fixture accepts any shutdown error too."""
        return ".*"

    def get_timeout_error_regex(self):
        """The phrase a timed-out RPC's error carries."""
        return "RPC ran for more than|timed out|[Tt]imeout"


def _as_torch(value):
    """shoal tensors (also inside lists, tuples and dicts) as torch tensors, for torch's
    assertEqual; anything else as it is."""
    if isinstance(value, core.Tensor):
        return torch.from_numpy(value.numpy(force=True).copy())
    if isinstance(value, (list, tuple)):
        return type(value)(_as_torch(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_torch(v) for k, v in value.items()}
    return value


class _Spawn(MultiProcessTestCase):
    """torch's rpc_utils.SpawnHelper without its TCP-init switch (file:// init is used), and
    torch's assertEqual made to read shoal tensors (the one place the real test machinery
    meets the renamed API's values)."""

    def setUp(self):
        """Spawn the ranks, each running one test method."""
        super().setUp()
        self._spawn_processes()

    def assertEqual(self, x, y=None, *args, **kwargs):  # noqa: N802 - unittest's name
        """torch's assertEqual on shoal values, compared as torch tensors."""
        return super().assertEqual(_as_torch(x), _as_torch(y), *args, **kwargs)


class ShoalRpcTest(rpc_test.RpcTest, ShoalAgentFixture, _Spawn):
    """torch's generic RpcTest on shoal's agent."""


class ShoalDistAutogradTest(dist_autograd_test.DistAutogradTest, ShoalAgentFixture, _Spawn):
    """torch's DistAutogradTest on shoal's agent."""
