"""Data loading with torch's names: datasets, samplers, default_collate, a multi-process
DataLoader that hands batches over in shared memory, and DataPipes.

The DistributedSampler, which reads the default process group, lives in collectives (core
never imports collectives); it implements the same resumable-sampler protocol as the samplers
here, so `DataLoader.state_dict()` survives a restart at another world size.
"""

from shoal.core.data import datapipes
from shoal.core.data.collate import default_collate, default_convert
from shoal.core.data.dataloader import DataLoader
from shoal.core.data.dataset import (
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)
from shoal.core.data.errors import (
    CollateError,
    DataLoaderError,
    DataLoaderTimeout,
    WorkerDied,
    WorkerError,
)
from shoal.core.data.random import Generator
from shoal.core.data.sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from shoal.core.data.stream_state import merge_states as merge_loader_states
from shoal.core.data.worker import WorkerInfo, get_worker_info

__all__ = [
    "BatchSampler", "ChainDataset", "CollateError", "ConcatDataset", "DataLoader",
    "DataLoaderError", "DataLoaderTimeout", "Dataset", "Generator", "IterableDataset",
    "RandomSampler", "Sampler", "SequentialSampler", "StackDataset", "Subset",
    "SubsetRandomSampler", "TensorDataset", "WeightedRandomSampler", "WorkerDied", "WorkerError",
    "WorkerInfo", "datapipes", "default_collate", "default_convert", "get_worker_info",
    "merge_loader_states", "random_split",
]
