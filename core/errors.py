"""The root of shoal's exception tree; every package subclasses `ShoalError`."""

from __future__ import annotations


class ShoalError(Exception):
    """Base class of every error shoal raises on purpose."""


class ShapeError(ShoalError, ValueError, RuntimeError):
    """Operands whose shapes an op cannot combine; the message names the op and both shapes.

    A RuntimeError as torch's shape errors are (so `except RuntimeError` ported from torch
    catches it), and still a ValueError, which shoal's own callers have caught since wave 1.
    """


class DimError(ShapeError, IndexError):
    """A dim outside a tensor's dims: an IndexError, as torch's "Dimension out of range"."""


class DeviceError(ShoalError, RuntimeError):
    """A device that does not exist here, or operands on different devices."""


class AuthenticationError(ShoalError, ConnectionError):
    """A peer failed the shared-secret handshake (wrong token, garbage, or too slow)."""


class HandshakeInterrupted(ShoalError, ConnectionError):
    """The server closed the connection or stayed silent before the handshake's verdict.

    Not a verdict on the secret: a server sheds pending handshakes under load (a flood of idle
    connections) or is restarting, so a client retries within its own timeout.
    """
