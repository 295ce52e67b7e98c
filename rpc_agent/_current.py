"""The process's running agent (init_rpc sets it, shutdown clears it)."""

from __future__ import annotations

from typing import Optional

from shoal.rpc_agent.types import RpcError

_agent = None


def get():
    """The running agent.

    Raises:
        RpcError: init_rpc has not been called (or shutdown already ran).
    """
    agent = _agent
    if agent is None:
        raise RpcError("RPC is not initialized in this process: call rpc_agent.init_rpc first.")
    return agent


def peek() -> Optional[object]:
    """The running agent, or None."""
    return _agent


def set_agent(agent) -> None:
    """Install (or with None, clear) the running agent."""
    global _agent
    _agent = agent
