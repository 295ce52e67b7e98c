"""torch.jit's task parallelism (fork a call onto a thread pool, wait for its value), and its
decorators as eager pass-throughs (shoal has no TorchScript compiler)."""

from shoal.core.jit.eager import export, ignore, is_scripting, is_tracing, script, trace, unused
from shoal.core.jit.futures import Future, fork, wait

__all__ = ["Future", "fork", "wait", "script", "trace", "ignore", "unused", "export",
           "is_scripting", "is_tracing"]
