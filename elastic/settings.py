"""The `SHOAL_*` variables the elastic layer reads (see `core.config`)."""

from __future__ import annotations

from shoal.core.config import Setting, SettingsTable

METRICS_WEB_CONFIG = Setting(
    "SHOAL_METRICS_WEB_CONFIG", "path", None,
    "A web config file in Prometheus' exporter format (tls_server_config, basic_auth_users) "
    "that puts TLS, client certificates and basic auth in front of the agent's /metrics "
    "(`shoal run --metrics-port`).")
METRICS_LINGER_S = Setting(
    "SHOAL_METRICS_LINGER_S", "float", 30.0,
    "The longest, in seconds, the agent's /metrics stays up after the job to answer one more "
    "scrape, so that Prometheus sees the job's last state (0: stop at once).",
    minimum=0)

TABLE = SettingsTable(
    "elastic", "The node agent's metrics endpoint.",
    (METRICS_WEB_CONFIG, METRICS_LINGER_S))
