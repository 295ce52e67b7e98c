"""DDP's Future is the collectives layer's (`collectives.futures`); this name stays for imports."""

from shoal.collectives.futures import (
    Future,
    completed_future,
    future_from_work,
    future_value,
    missing_future_methods,
    wait_bounded,
)

__all__ = ["Future", "completed_future", "future_from_work", "future_value",
           "missing_future_methods", "wait_bounded"]
