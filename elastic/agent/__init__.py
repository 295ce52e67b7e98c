"""The node agent: runs a node's workers, meets the other agents through rendezvous, restarts
the group after a failure and reports why."""

from shoal.elastic.agent.agent import (
    Agent,
    AgentInterrupted,
    AgentResult,
    WorkerSpec,
    default_node_id,
    python_argv,
)

__all__ = ["Agent", "AgentInterrupted", "AgentResult", "WorkerSpec", "default_node_id",
           "python_argv"]
