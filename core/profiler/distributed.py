"""What a trace's `distributedInfo` says: the job's backend, this rank's place and its process
groups, in torch's shape (the TensorBoard plugin's Distributed view reads it).

core names no layer above it: collectives describes the default group here when it forms
(collectives/profiler_clock.py), and the collectives a window recorded name the other groups.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

_lock = threading.Lock()
_default: Optional[dict] = None


def describe_default_group(name: str, backend: str, rank: int, world_size: int,
                           ranks: list[int]) -> None:
    """The default process group formed: its name, backend, this rank and its members."""
    global _default
    with _lock:
        _default = {"name": name, "backend": backend, "rank": rank, "world_size": world_size,
                    "ranks": list(ranks)}


def forget_default_group(name: str) -> None:
    """The default group `name` is going away (a later one may have replaced it already)."""
    global _default
    with _lock:
        if _default is not None and _default["name"] == name:
            _default = None


def default_group() -> Optional[dict]:
    """The default group's description, or None outside a process group."""
    return _default


def env_rank() -> Optional[int]:
    """RANK as `shoal run` (and torchrun) set it, or None outside a job."""
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.isdigit() else None


def _backend_config(backend: str) -> str:
    return "cuda:nccl" if backend == "nccl" else f"cpu:{backend},cuda:{backend}"


def distributed_info(groups_seen: dict[str, dict]) -> dict:
    """torch's distributedInfo: backend, rank, world_size, pg_count and pg_config, from the
    default group when one formed and the groups the window's collectives ran in."""
    default = _default
    rank = env_rank()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    configs: dict[str, dict] = {}
    if default is not None:
        rank, world = default["rank"], default["world_size"]
        configs[default["name"]] = {
            "pg_name": default["name"], "pg_desc": "default_pg",
            "backend_config": _backend_config(default["backend"]),
            "pg_size": len(default["ranks"]), "ranks": list(default["ranks"])}
    for name, group in groups_seen.items():
        if name not in configs:
            configs[name] = {"pg_name": name, "pg_desc": name,
                             "backend_config": _backend_config(group["backend"]),
                             "pg_size": len(group["ranks"]), "ranks": list(group["ranks"])}
    backend = default["backend"] if default is not None else next(
        (g["backend"] for g in groups_seen.values()), "")
    return {"backend": backend, "rank": rank if rank is not None else 0, "world_size": world,
            "pg_count": len(configs), "pg_config": list(configs.values())}
