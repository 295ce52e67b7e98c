"""The RPC agent's Prometheus metrics (core.telemetry registers each once per process)."""

from __future__ import annotations

from shoal.core import telemetry

REQUESTS = telemetry.counter(
    "shoal_rpc_requests_total",
    "RPCs this worker issued, by kind (sync, async, remote, rref) and outcome "
    "(ok, error, timeout).",
    ["kind", "status"],
)
LATENCY = telemetry.histogram(
    "shoal_rpc_latency_seconds",
    "Seconds from issuing an RPC to its reply, by kind.",
    ["kind"],
)
INFLIGHT = telemetry.gauge(
    "shoal_rpc_inflight",
    "RPCs this worker issued that have not completed yet.",
)
BYTES = telemetry.counter(
    "shoal_rpc_bytes_total",
    "Bytes on this worker's RPC streams and data channels, by direction (sent, received).",
    ["direction"],
)
REJECTED = telemetry.counter(
    "shoal_rpc_rejected_total",
    "Connections and messages dropped before anything was unpickled, by port (stream, data).",
    ["port"],
)

KINDS = ("sync", "async", "remote", "rref")
STATUSES = ("ok", "error", "timeout")

# Children resolved once: `labels()` costs a dict lookup and a lock per call on the hot path.
REQUEST_CHILDREN = {(k, s): REQUESTS.labels(k, s) for k in KINDS for s in STATUSES}
LATENCY_CHILDREN = {k: LATENCY.labels(k) for k in KINDS}
BYTES_SENT = BYTES.labels("sent")
BYTES_RECEIVED = BYTES.labels("received")
REJECTED_STREAM = REJECTED.labels("stream")
REJECTED_DATA = REJECTED.labels("data")
RECEIVE_CACHE_BYTES = telemetry.gauge(
    "shoal_rpc_receive_cache_bytes",
    "Bytes of memory this worker keeps for reuse by large received buffers "
    "(RpcBackendOptions.receive_cache_bytes bounds it).",
)

# Distributed autograd (rpc_agent/dist_autograd/).
DIST_CONTEXTS = telemetry.gauge(
    "shoal_rpc_dist_autograd_contexts",
    "Distributed autograd contexts live on this worker (created here or joined by a call).",
)
DIST_BACKWARD = telemetry.counter(
    "shoal_rpc_dist_autograd_backward_total",
    "Distributed backward passes this worker started, by outcome (ok, error).",
    ["status"],
)
DIST_BACKWARD_SECONDS = telemetry.histogram(
    "shoal_rpc_dist_autograd_backward_seconds",
    "Seconds a distributed backward pass took on the worker that started it.",
)
DIST_GRADIENT_BATCHES = telemetry.counter(
    "shoal_rpc_dist_autograd_gradient_batches_total",
    "Batches of gradients this worker sent to a peer during backward passes, by how they went: "
    "as a message of their own, or on the answer to a message from that peer.",
    ["how"],
)
DIST_BATCHES_AS_MESSAGE = DIST_GRADIENT_BATCHES.labels("message")
DIST_BATCHES_ON_ANSWER = DIST_GRADIENT_BATCHES.labels("on_answer")
DIST_BACKWARD_OK = DIST_BACKWARD.labels("ok")
DIST_BACKWARD_ERROR = DIST_BACKWARD.labels("error")
