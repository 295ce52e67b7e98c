"""Init methods: how ranks meet before their group exists (env://, tcp://HOST:PORT, file:///PATH),
each giving a store, this rank and the world size, as torch.distributed.rendezvous does."""

from __future__ import annotations

import urllib.parse
from typing import Any, Iterator, Optional

from shoal.collectives import env
from shoal.collectives.store.api import Store
from shoal.collectives.store.file import FileStore
from shoal.collectives.store.tcp import TCPStore
from shoal.collectives.types import DEFAULT_COLLECTIVE_TIMEOUT_S
from shoal.core.timeouts import TimeoutLike, to_seconds


def rank_or_none(value: Any) -> Optional[int]:
    """`value` as an int, or None where torch's -1 (or None) means "not given"."""
    # -1 is torch's "not given" (read it from the init method or the environment); any other
    # value, negative or not, is the caller's and is checked by check_rank_and_size.
    if value is None or (isinstance(value, int) and value == -1):
        return None
    return int(value)


def check_rank_and_size(rank: int, size: int, source: str) -> None:
    """Raise ValueError naming the value and the rule; `source` says where they came from."""
    if size < 1:
        raise ValueError(
            f"world_size must be at least 1 (the number of ranks in the group), got {size} "
            f"({source})."
        )
    if not 0 <= rank < size:
        raise ValueError(
            f"rank must be in [0, world_size) = [0, {size}), got {rank} ({source})."
        )


def store_for(init_method: str, rank: Optional[int], size: Optional[int], timeout: float):
    """(store, rank, size) from an init method URL."""
    url = urllib.parse.urlparse(init_method)
    query = dict(urllib.parse.parse_qsl(url.query))
    if rank is None and "rank" in query:
        rank = int(query["rank"])
    if size is None and "world_size" in query:
        size = int(query["world_size"])
    if url.scheme == "env":
        rank = rank if rank is not None else env.env_rank()
        size = size if size is not None else env.env_world_size()
        host, port = env.env_master()
        missing = [n for n, v in (("MASTER_ADDR", host), ("MASTER_PORT", port), ("RANK", rank),
                                  ("WORLD_SIZE", size)) if v is None]
        if missing:
            raise ValueError(
                f"init_method 'env://' needs the environment variables {', '.join(missing)} "
                "(or rank=/world_size= arguments); shoal run sets them for you."
            )
    elif url.scheme == "tcp":
        host, port = url.hostname, url.port
        if not host or port is None:
            raise ValueError(f"init_method {init_method!r} must look like tcp://HOST:PORT.")
        rank = rank if rank is not None else env.env_rank()
        size = size if size is not None else env.env_world_size()
        if rank is None or size is None:
            raise ValueError(f"init_method {init_method!r} needs rank= and world_size=.")
    elif url.scheme == "file":
        path = urllib.parse.unquote(url.path)
        if not path:
            raise ValueError(f"init_method {init_method!r} must look like file:///PATH.")
        rank = rank if rank is not None else env.env_rank()
        size = size if size is not None else env.env_world_size()
        if rank is None or size is None:
            raise ValueError(f"init_method {init_method!r} needs rank= and world_size=.")
        check_rank_and_size(rank, size, f"init_method {init_method!r}")
        return FileStore(path, world_size=size, timeout=timeout), rank, size
    else:
        raise ValueError(
            f"init_method {init_method!r} is not supported; use env://, tcp://HOST:PORT or file:///PATH."
        )
    check_rank_and_size(rank, size, f"init_method {init_method!r}")
    if port == 0 and size > 1:
        raise ValueError("MASTER_PORT 0 only works for a world of one; the other ranks need a real port.")
    is_master = rank == 0 and not (url.scheme == "env" and env.use_agent_store())
    # multi_tenant, as torch's env:// and tcp:// rendezvous: RPC on the same MASTER_ADDR:PORT
    # in this process shares the server instead of failing to bind it again.
    store = TCPStore(host, port, world_size=size, is_master=is_master, timeout=timeout,
                     multi_tenant=True)
    return store, rank, size


def rendezvous(url: str, rank: int = -1, world_size: int = -1, timeout: TimeoutLike = None,
               **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    """torch.distributed.rendezvous: yields (store, rank, world_size) for an init method URL
    (env://, tcp://HOST:PORT?rank=&world_size=, file:///PATH), once.

    Raises:
        ValueError: the URL or the rank and world size are missing or inconsistent.
    """
    if not isinstance(url, str):
        raise ValueError(f"rendezvous needs an init method URL (str), got {type(url).__name__}.")
    seconds = to_seconds(timeout, env.collective_timeout() or DEFAULT_COLLECTIVE_TIMEOUT_S)
    yield store_for(url, rank_or_none(rank), rank_or_none(world_size), seconds)
