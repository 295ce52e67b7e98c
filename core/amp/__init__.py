"""Mixed precision with torch.amp's names: autocast regions and the GradScaler."""

from shoal.core.amp.autocast_mode import autocast, get_autocast_dtype, is_autocast_enabled

__all__ = ["autocast", "get_autocast_dtype", "is_autocast_enabled"]
