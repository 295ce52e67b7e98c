"""Errors of distributed autograd (a leaf module: it imports nothing of its package)."""

from __future__ import annotations

from shoal.rpc_agent.types import RpcError


class DistAutogradError(RpcError):
    """Distributed autograd was misused or failed; the message names the context id."""


class ContextIdTypeError(DistAutogradError, TypeError):
    """A context id that is not an int: a TypeError as torch's (its binding refuses the
    argument), and still a DistAutogradError."""
