"""Pipeline parallelism (torch.distributed.pipelining): a model cut into stages, one per rank,
run over micro-batches by a GPipe or 1F1B schedule on the point-to-point ops."""

from shoal.collectives.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    split_microbatches,
)
from shoal.collectives.pipelining.stage import PipelineError, PipelineStage

__all__ = ["PipelineError", "PipelineScheduleSingle", "PipelineStage", "Schedule1F1B",
           "ScheduleGPipe", "split_microbatches"]
