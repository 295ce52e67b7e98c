"""The `SHOAL_*` variables the core layer reads (see `core.config`)."""

from __future__ import annotations

from shoal.core.config import Setting, SettingsTable

AUTH_TOKEN = Setting(
    "SHOAL_AUTH_TOKEN", "secret", None,
    "The job's shared secret: every port proves it before reading a payload, and checkpoints "
    "are signed with it. `shoal run` generates one per job or passes this one on.")
AUTH_TOKEN_FILE = Setting(
    "SHOAL_AUTH_TOKEN_FILE", "path", None,
    "A file holding the job's secret (a mounted Kubernetes Secret, say); read when "
    "SHOAL_AUTH_TOKEN is unset.")
LOG_LEVEL = Setting(
    "SHOAL_LOG_LEVEL", "choice", None,
    "The logging level of shoal's loggers (and of `shoal run`); unset: WARNING in workers, "
    "the launcher's own defaults in `shoal run`.",
    choices=("debug", "info", "warning", "error", "critical"))
RUN_ID = Setting(
    "SHOAL_RUN_ID", "str", None,
    "The job's run id, written into traces, metrics and dumps.", set_by="shoal run")
RESTART_COUNT = Setting(
    "SHOAL_RESTART_COUNT", "int", 0,
    "How many times the job has restarted (torchrun's TORCHELASTIC_RESTART_COUNT).",
    minimum=0, set_by="shoal run")
RDZV_ROUND = Setting(
    "SHOAL_RDZV_ROUND", "int", None,
    "The rendezvous round this worker was started in.", minimum=0, set_by="shoal run")
CHECKPOINT_DIR = Setting(
    "SHOAL_CHECKPOINT_DIR", "path", None,
    "Where the job's checkpoints live (`shoal run --checkpoint-dir`, else a per-job "
    "temporary directory).", set_by="shoal run")
ENCRYPT = Setting(
    "SHOAL_ENCRYPT", "bool", False,
    "Encrypt every connection's frames (AES-256-GCM) as well as checking their integrity, which "
    "is always on; costs a copy each way.")
PROFILE_DIR = Setting(
    "SHOAL_PROFILE_DIR", "path", None,
    "Where each rank writes its profiler trace (`shoal run --profile DIR` sets it).",
    set_by="shoal run --profile")
PROFILE_SCHEDULE = Setting(
    "SHOAL_PROFILE_SCHEDULE", "str", "skip_first=2,wait=0,warmup=1,active=3,repeat=1",
    "Which optimizer steps the job profiler records, as profiler.schedule's arguments.")
PROFILE_SHAPES = Setting(
    "SHOAL_PROFILE_SHAPES", "bool", False,
    "Record input shapes in job profiles (record_shapes=True).")
PROFILE_MEMORY = Setting(
    "SHOAL_PROFILE_MEMORY", "bool", False,
    "Record allocations in job profiles (profile_memory=True).")

TABLE = SettingsTable(
    "core", "Tensors, autograd, the profiler and the job's secret.",
    (AUTH_TOKEN, AUTH_TOKEN_FILE, LOG_LEVEL, RUN_ID, RESTART_COUNT, RDZV_ROUND, CHECKPOINT_DIR,
     ENCRYPT, PROFILE_DIR, PROFILE_SCHEDULE,
     PROFILE_SHAPES, PROFILE_MEMORY))
