"""torch.jit's task parallelism: fork a call onto a thread pool, wait for its value."""

from shoal.core.jit.futures import Future, fork, wait

__all__ = ["Future", "fork", "wait"]
