"""The `shoal` command: `shoal run` (an elastic job's node agent), `shoal store` (a standalone
TCPStore), `shoal trace` and `shoal top`.

Each command's heavy imports (prometheus_client, the agent, the stores, the etcd client) happen
when it runs, so that `shoal --help` is quick and PROMETHEUS_MULTIPROC_DIR can be taken out of
this process's environment before prometheus_client reads it. `shoal run`'s phases are in
`launcher.job`; the flags, which import only the rendezvous' rules, in `launcher.flags`.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from shoal import __version__
from shoal.launcher import flags, settings
from shoal.launcher.console import configure_logging

USAGE = """usage: shoal {run,store,trace,top,--version} ...

  shoal run [flags] SCRIPT [ARGS...]   run an elastic job's workers on this node
  shoal store [--host H] [--port P]     serve a standalone TCPStore for rendezvous
  shoal trace {merge,summary,plot} DIR  the job view of `shoal run --profile DIR` traces
  shoal top [HOST:PORT|URL]             a live per-rank view of an agent's /metrics

`shoal run --help` lists every flag; each also reads SHOAL_<FLAG>."""

# prometheus_client reads it once, when first imported (see `run`).
_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _usage_error(message: str) -> int:
    # The first line of the usage only: the error stays in sight (`shoal --help` has the rest).
    sys.stderr.write(f"{USAGE.splitlines()[0]}\nshoal: error: {message}\n")
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `shoal` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return _usage_error("name a command: run, store, trace or top")
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        sys.stdout.write(USAGE + "\n")
        return 0
    if command in ("-V", "--version", "version"):
        sys.stdout.write(f"shoal {__version__}\n")
        return 0
    if command == "run":
        return run(rest)
    if command == "store":
        return store(rest)
    if command == "trace":  # the profiler's job view (launcher/trace/)
        from shoal.launcher.trace.cli import main as trace_main  # noqa: PLC0415  (import cost)

        return trace_main(rest)
    if command == "top":  # a terminal view of an agent's /metrics (launcher/top.py)
        from shoal.launcher.top import main as top_main  # noqa: PLC0415  (curses, prometheus)

        return top_main(rest)
    return _usage_error(f"unknown command {command!r}; choose run, store, trace or top")


def run(argv: Sequence[str]) -> int:
    """`shoal run`: parse the flags, then run this node's part of the job (`launcher.job`)."""
    run_settings = flags.parse_run(argv)
    # The agent's own metrics live in its registry; only its workers write multiprocess files,
    # below the directory the launcher was given.
    metrics_parent = os.environ.pop(_MULTIPROC_ENV, None)
    # Imported only now: it imports prometheus_client, which must not see the variable.
    from shoal.launcher import job  # noqa: PLC0415  (must follow the pop above)

    return job.run(run_settings, metrics_parent)


def store(argv: Sequence[str]) -> int:
    """`shoal store`: serve a TCPStore until SIGTERM/SIGINT; the first line names the port."""
    store_settings = flags.parse_store(argv)
    # A standalone store serves no metrics; checking the tables imports prometheus_client,
    # which would otherwise write multiprocess files for this process.
    os.environ.pop(_MULTIPROC_ENV, None)
    settings.check_or_exit(flags.store_parser())
    configure_logging()
    from shoal.launcher import secret  # noqa: PLC0415  (core.auth loads cryptography)

    token = secret.store_token(store_settings)
    from shoal.collectives.store.tcp import serve_forever  # noqa: PLC0415  (import cost)

    def announce(server) -> None:
        sys.stdout.write(f"shoal store listening on {server.host}:{server.port}\n")
        sys.stdout.flush()

    try:
        serve_forever(store_settings.host, store_settings.port, token=token, on_ready=announce)
    except OSError as exc:
        sys.stderr.write(f"shoal store: cannot serve on {store_settings.host}:"
                         f"{store_settings.port}: {exc}\n")
        return 1
    return 0
