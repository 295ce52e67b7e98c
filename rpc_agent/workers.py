"""The job's worker table as one agent knows it: names, ids and the two addresses of each."""

from __future__ import annotations

from typing import Optional, Union

from shoal.rpc_agent.types import RpcError, WorkerInfo

WorkerRef = Union[str, int, WorkerInfo]


class WorkerTable:
    """Every worker of a job of `world_size`, by id and by name, with its gRPC address
    (`grpc_addresses[id]`, "host:port") and data-channel address (`data_addresses[id]`)."""

    def __init__(self, me: WorkerInfo, world_size: int):
        self.me = me
        self.world_size = world_size
        self._by_id: list[Optional[WorkerInfo]] = [None] * world_size
        self._by_name: dict[str, WorkerInfo] = {}
        self.grpc_addresses: dict[int, str] = {}
        self.data_addresses: dict[int, tuple[str, int]] = {}
        # Each worker's incarnation nonce (a hello to it must name it; transport/grpc.py).
        self.grpc_incarnations: dict[int, bytes] = {}

    def install(self, infos: list[dict]) -> None:
        """Record the job's workers as the store lists them (name, id, host, two ports and the
        gRPC incarnation)."""
        for item in infos:
            info = WorkerInfo(item["name"], int(item["id"]))
            self._by_id[info.id] = info
            self._by_name[info.name] = info
            self.grpc_addresses[info.id] = f"{item['host']}:{item['grpc_port']}"
            self.data_addresses[info.id] = (item["host"], int(item["data_port"]))
            self.grpc_incarnations[info.id] = _incarnation(item.get("grpc_incarnation"))
        self._by_id[self.me.id] = self.me
        self._by_name[self.me.name] = self.me

    def info(self, ref: Optional[WorkerRef] = None) -> WorkerInfo:
        """The WorkerInfo of a name, id or WorkerInfo (this worker's for None).

        Raises:
            RpcError: no such worker in this job.
        """
        if ref is None:
            return self.me
        if isinstance(ref, WorkerInfo):
            ref = ref.id
        if isinstance(ref, str):
            info = self._by_name.get(ref)
        elif isinstance(ref, int) and not isinstance(ref, bool):
            info = self._by_id[ref] if 0 <= ref < self.world_size else None
        else:
            raise TypeError(f"A worker is named by str, int or WorkerInfo, got {ref!r}.")
        if info is None:
            known = ", ".join(repr(w.name) for w in self._by_id if w is not None)
            raise RpcError(f"Unknown worker {ref!r}: this job has workers {known}.")
        return info

    def all(self) -> list[WorkerInfo]:
        """Every worker of the job known so far, by id."""
        return [w for w in self._by_id if w is not None]

    def name_of(self, peer_id: int) -> Optional[str]:
        """The name of worker `peer_id`, None while it is unknown."""
        if 0 <= peer_id < self.world_size and self._by_id[peer_id] is not None:
            return self._by_id[peer_id].name
        return None

    def label_of(self, peer_id: int) -> Optional[str]:
        """"worker 'name' (id N)" for log and error messages, None while it is unknown."""
        name = self.name_of(peer_id)
        return None if name is None else f"worker {name!r} (id {peer_id})"


def _incarnation(value) -> bytes:
    # Unreadable (a store entry nobody honest wrote) gives none: hellos then fail, naming why.
    try:
        return bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        return b""
