"""Distributed checkpoints (torch.distributed.checkpoint): each rank writes its own shards, a
signed manifest says where every element is, and a load at any world size reads what it needs."""

from shoal.collectives.checkpoint.api import export_safetensors, load, save
from shoal.collectives.checkpoint.metadata import CheckpointException
from shoal.collectives.checkpoint.planner import DefaultLoadPlanner, DefaultSavePlanner

__all__ = ["CheckpointException", "DefaultLoadPlanner", "DefaultSavePlanner",
           "export_safetensors", "load", "save"]
