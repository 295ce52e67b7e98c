"""`_remote_device`: where a RemoteModule lives, parsed as torch.distributed.remote_device's
class of the same name ("worker1/cpu", "worker1", "rank:1/cuda:0", or a bare local device)."""

from __future__ import annotations

from typing import Optional, Union

from shoal.core.backend import Device
from shoal.core.errors import DeviceError


class _remote_device:  # noqa: N801  (torch's name)
    """A device on a worker named by name or by rank; `worker_name()`, `rank()`, `device()`.

    Raises:
        ValueError: the string has more than one '/', an empty worker, or a bad rank field.
        TypeError: neither a string nor a Device.
        DeviceError: the device field is not a device (a RuntimeError, as torch's).
    """

    def __init__(self, remote_device: Union[str, Device]) -> None:
        parse_error = (
            f"Could not parse remote_device: {remote_device}. The valid format is "
            "'<workername>/<device>' or 'rank:<rank>/<device>' or '<device>'"
        )
        self._worker_name: Optional[str] = None
        self._rank: Optional[int] = None
        if isinstance(remote_device, Device):
            device: Union[str, Device] = remote_device
        elif isinstance(remote_device, str):
            fields = remote_device.split("/")
            if len(fields) == 2:
                self._worker_name, device = fields
            elif len(fields) == 1 and _is_device(fields[0]):
                device = fields[0]
            elif len(fields) == 1:
                self._worker_name, device = fields[0], "cpu"
            else:
                raise ValueError(parse_error)
        else:
            raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
        if self._worker_name is not None and not self._worker_name:
            raise ValueError(parse_error)
        self._device = Device(device)
        if self._worker_name is not None:
            fields = self._worker_name.split(":")
            if len(fields) == 2:
                if fields[0] != "rank" or not fields[1].isdigit():
                    raise ValueError(parse_error)
                self._rank, self._worker_name = int(fields[1]), None
            elif len(fields) > 2:
                raise ValueError(parse_error)

    def worker_name(self) -> Optional[str]:
        """The worker's name, or None when given by rank or not at all."""
        return self._worker_name

    def rank(self) -> Optional[int]:
        """The worker's rank, or None when given by name or not at all."""
        return self._rank

    def device(self) -> Device:
        """The device on that worker."""
        return self._device

    def __repr__(self) -> str:
        if self._worker_name is not None:
            return f"{self._worker_name}/{self._device}"
        if self._rank is not None:
            return f"rank:{self._rank}/{self._device}"
        return str(self._device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _remote_device) and (
            (self._worker_name, self._rank, self._device)
            == (other._worker_name, other._rank, other._device))

    def __hash__(self) -> int:
        return hash((self._worker_name, self._rank, self._device))


def _is_device(spec: str) -> bool:
    try:
        Device(spec)
    except DeviceError:
        return False
    return True
