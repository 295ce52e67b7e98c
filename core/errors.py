"""The root of shoal's exception tree; every package subclasses `ShoalError`."""

from __future__ import annotations


class ShoalError(Exception):
    """Base class of every error shoal raises on purpose."""


class ShapeError(ShoalError, ValueError):
    """Operands whose shapes an op cannot combine; the message names the op and both shapes."""


class DeviceError(ShoalError, RuntimeError):
    """A device that does not exist here, or operands on different devices."""


class AuthenticationError(ShoalError, ConnectionError):
    """A peer failed the shared-secret handshake (wrong token, garbage, or too slow)."""
