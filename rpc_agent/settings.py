"""The `SHOAL_*` variables the RPC layer reads (see `core.config`); the job's secret and restart
count are core's (`core.settings`)."""

from __future__ import annotations

from shoal.core.config import Setting, SettingsTable

GRPC_LAYER = Setting(
    "SHOAL_RPC_GRPC", "choice", "direct",
    "How RPC streams drive gRPC: direct (grpcio's Cython layer, one thread hand-off less per "
    "message each way) or public (grpcio's public API at both ends, to rule the direct layer "
    "out). Streams fall back to public on their own where this grpcio's private layer differs.",
    choices=("direct", "public"))
GRPC_TUNING = Setting(
    "SHOAL_RPC_GRPC_TUNING", "choice", "1",
    "1 sets gRPC core's process-wide settings shoal's RPC latency is measured with "
    "(GRPC_EXPERIMENTS, GRPC_POLL_STRATEGY; each only where unset) before grpc loads; 0 "
    "leaves the environment alone. They hold for every gRPC user in the process and its "
    "children.",
    choices=("0", "1"))

TABLE = SettingsTable(
    "rpc_agent", "The RPC agent's gRPC transport.",
    (GRPC_LAYER, GRPC_TUNING))
