"""DataPipes in the torchdata style: composable iterable and map-style pipes."""

from shoal.core.data.datapipes.combine import Demultiplexer, Forker, Multiplexer
from shoal.core.data.datapipes.files import FileLister, FileOpener, LineReader
from shoal.core.data.datapipes.iter import (
    Batcher,
    Collator,
    Concater,
    Cycler,
    Filter,
    Header,
    IterableWrapper,
    IterDataPipe,
    Mapper,
    ShardingFilter,
    Shuffler,
    UnBatcher,
    Zipper,
    apply_shuffle_settings,
)
from shoal.core.data.datapipes.map import MapDataPipe, SequenceWrapper
from shoal.core.data.datapipes.sharding import (
    apply_sharding,
    distributed_info,
    set_distributed_info,
)

__all__ = [
    "Batcher", "Collator", "Concater", "Cycler", "Demultiplexer", "FileLister", "FileOpener",
    "Filter", "Forker", "Header", "IterDataPipe", "IterableWrapper", "LineReader", "MapDataPipe",
    "Mapper", "Multiplexer", "SequenceWrapper", "ShardingFilter", "Shuffler", "UnBatcher",
    "Zipper", "apply_sharding", "apply_shuffle_settings", "distributed_info",
    "set_distributed_info",
]
