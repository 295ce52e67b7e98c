"""shoal's collectives as a torch.distributed backend: `import shoal.torch_bridge`, then
`torch.distributed.init_process_group("shoal")` (or "cpu:shoal").

The only part of shoal that imports torch; nothing else imports it, so shoal runs without torch.
"""

from shoal.torch_bridge.backend import BACKEND_NAME, create_process_group, register
from shoal.torch_bridge.group import ShoalProcessGroup
from shoal.torch_bridge.helpers import monitored_barrier, shoal_group
from shoal.torch_bridge.store import TorchStore
from shoal.torch_bridge.work import BridgeWork

__all__ = ["BACKEND_NAME", "BridgeWork", "ShoalProcessGroup", "TorchStore",
           "create_process_group", "monitored_barrier", "register", "shoal_group"]

register()
