"""Mixed precision with torch.amp's names: autocast regions and the GradScaler."""

from shoal.core.amp.autocast_mode import autocast, get_autocast_dtype, is_autocast_enabled
from shoal.core.amp.grad_scaler import GradScaler

__all__ = ["GradScaler", "autocast", "get_autocast_dtype", "is_autocast_enabled"]
