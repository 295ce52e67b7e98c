"""`shoal top`: a live terminal view of one node agent's /metrics, for people without Grafana.

    shoal top                       # http://127.0.0.1:9400/metrics, refreshed every second
    shoal top HOST:PORT --interval 2
    shoal top URL --once            # two readings an interval apart, printed as text
    shoal top https://HOST:PORT --cacert ca.pem [--cert client.pem --key client.key]
              [--user prom --password-file FILE]   # an endpoint behind SHOAL_METRICS_WEB_CONFIG

One line for the job (run id, world size, workers running, restarts used of max_restarts,
failed workers, the last restart) and one row per rank: last step, mean step time and samples/s
over the last interval, WAIT (the share of time spent inside collectives: the straggler is the
rank that waits least, marked), seconds since the last step and collective, resident memory
and CPU. A rank that others have waited for inside a collective for over a second (it never
arrived, or did not finish: the watchdog's progress records say so long before its timeout) is
marked as hung, with a line naming the ranks that wait for it and for how long.
Rates come from the difference of two readings, as Prometheus' rate() would. `q` quits.

A password never comes from the command line (other users can read it there): it is read from
--password-file or from the SHOAL_METRICS_PASSWORD environment variable. It is sent only over
https: basic auth over plain http is readable by anyone on the path, so --user with a bare
HOST:PORT (without --cacert or --cert) or an http:// URL is refused unless
--allow-http-password says to send it anyway.
"""

from __future__ import annotations

import base64
import curses
import dataclasses
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from shoal.launcher import settings
from shoal.launcher.flag_spec import CommandParser

DEFAULT_TARGET = "127.0.0.1:9400"
FETCH_TIMEOUT_S = 5.0
PASSWORD_ENV = settings.METRICS_PASSWORD.name


class TopError(Exception):
    """The endpoint cannot be read or parsed."""


@dataclasses.dataclass
class Reading:
    """One scrape: when, and every sample as {(name, sorted labels): value}."""

    at: float
    samples: dict

    def value(self, name: str, **labels) -> Optional[float]:
        """The sum of `name`'s samples whose labels include `labels` (None: there are none)."""
        found = [v for (n, ls), v in self.samples.items()
                 if n == name and all(dict(ls).get(k) == w for k, w in labels.items())]
        return sum(found) if found else None

    def label_values(self, name: str, label: str) -> set:
        """The values `label` takes in the samples of metric `name`."""
        return {dict(ls)[label] for (n, ls) in self.samples if n == name and label in dict(ls)}


def metrics_url(target: str, tls: bool = False) -> str:
    """`HOST:PORT`, `http(s)://HOST:PORT` or a full URL, as the /metrics URL (a bare HOST:PORT
    is https:// when `tls`)."""
    if "://" not in target:
        target = f"{'https' if tls else 'http'}://{target}"
    scheme, rest = target.split("://", 1)
    return target if "/" in rest else f"{scheme}://{rest}/metrics"


@dataclasses.dataclass
class Access:
    """How to reach a secured endpoint: a TLS context (server CA, client certificate) and the
    Authorization header of HTTP basic auth; both None for plain HTTP."""

    ssl_context: Optional[ssl.SSLContext] = None
    authorization: Optional[str] = None


def access_from(cacert: Optional[str], cert: Optional[str], key: Optional[str],
                user: Optional[str], password_file: Optional[str],
                environ=os.environ) -> Access:
    """The Access that `shoal top`'s options ask for.

    Raises:
        ValueError: a key without a certificate, a user without a password (from the file,
            whose trailing line break is not part of it, or SHOAL_METRICS_PASSWORD), a password
            file without a user, or a file that cannot be read.
    """
    if key and not cert:
        raise ValueError("--key needs --cert (the client certificate the key belongs to).")
    context = None
    if cacert or cert:
        try:
            context = ssl.create_default_context(cafile=cacert)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"Cannot load --cacert {cacert!r}: {exc}") from exc
        try:
            if cert:
                context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"Cannot load the client certificate {cert!r}"
                             f"{f' with key {key!r}' if key else ''}: {exc}") from exc
    password = None
    if password_file:
        try:
            with open(password_file) as f:
                password = f.read().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"Cannot read --password-file {password_file!r}: {exc}") from exc
        if not password:
            raise ValueError(f"--password-file {password_file!r} is empty.")
    elif settings.METRICS_PASSWORD.is_set(environ):
        password = settings.METRICS_PASSWORD.get(environ)
    if user is None:
        if password_file:
            raise ValueError("--password-file needs --user (the basic auth user name).")
        return Access(context, None)
    if ":" in user:
        raise ValueError(f"--user {user!r}: a basic auth user name cannot contain ':'.")
    if password is None:
        raise ValueError(f"--user {user!r} needs a password: give --password-file FILE or set "
                         f"{PASSWORD_ENV} (never on the command line).")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return Access(context, f"Basic {token}")


def clear_text_problem(url: str, access: Access, user: Optional[str]) -> Optional[str]:
    """Why `access` would give its password away on the way to `url` (None: it would not)."""
    if access.authorization is None or urllib.parse.urlsplit(url).scheme.lower() == "https":
        return None
    return (f"--user {user!r} would send its password in clear text to {url}: give an "
            "https:// endpoint (or a bare HOST:PORT with --cacert), or pass "
            "--allow-http-password to send it anyway.")


def fetch(url: str, timeout: float = FETCH_TIMEOUT_S, access: Optional[Access] = None
          ) -> Reading:
    """Scrape `url` once (through `access` for a secured endpoint).

    Raises:
        TopError: it cannot be reached, answers an error, or is not the text exposition.
    """
    access = access or Access()
    request = urllib.request.Request(url)
    if access.authorization is not None:
        request.add_header("Authorization", access.authorization)
    try:
        with urllib.request.urlopen(request, timeout=timeout,
                                    context=access.ssl_context) as reply:
            text = reply.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise TopError(f"cannot read {url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TopError(f"cannot read {url}: {reason}") from exc
    samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    except ValueError as exc:
        raise TopError(f"{url} does not serve Prometheus metrics: {exc}") from exc
    return Reading(time.time(), samples)


def _delta(prev: Optional[Reading], cur: Reading, name: str, **labels) -> Optional[float]:
    if prev is None:
        return None
    before, after = prev.value(name, **labels), cur.value(name, **labels)
    if before is None or after is None or after < before:  # a restart reset the counter
        return None
    return after - before


WAITING_FOR = "shoal_collectives_waiting_for_rank_since_timestamp_seconds"
# The straggler mark needs some rank to wait this much more of its time inside collectives than
# the one that waits least (the dashboard's "Which rank is the straggler?" uses the same gap):
# ranks of equal work differ by noise.
STRAGGLER_MIN_WAIT_GAP = 0.1


def awaited(cur: Reading) -> dict[str, dict[str, float]]:
    """{awaited rank: {waiting rank: since (Unix time)}} from the waiting-for series."""
    out: dict[str, dict[str, float]] = {}
    for (name, labels), value in cur.samples.items():
        found = dict(labels)
        if name == WAITING_FOR and value > 0 and "peer" in found and "rank" in found:
            out.setdefault(found["peer"], {})[found["rank"]] = value
    return out


def rank_rows(prev: Optional[Reading], cur: Reading) -> list[dict]:
    """Per rank: the figures of the table (None where a reading is missing)."""
    ranks = set()
    for name in ("shoal_collectives_wait_seconds_total", "shoal_training_last_step",
                 "shoal_worker_resident_memory_bytes"):
        ranks |= cur.label_values(name, "rank")
    span = cur.at - prev.at if prev is not None else None
    waits = awaited(cur)
    rows = []
    for rank in sorted(ranks, key=lambda r: (len(r), r)):
        steps = _delta(prev, cur, "shoal_training_step_seconds_count", rank=rank)
        step_time = _delta(prev, cur, "shoal_training_step_seconds_sum", rank=rank)
        samples = _delta(prev, cur, "shoal_training_samples_total", rank=rank)
        wait = _delta(prev, cur, "shoal_collectives_wait_seconds_total", rank=rank)
        cpu = _delta(prev, cur, "shoal_worker_cpu_seconds_total", rank=rank)
        last_step_at = cur.value("shoal_training_last_step_timestamp_seconds", rank=rank)
        last_op_at = cur.value("shoal_collectives_last_op_timestamp_seconds", rank=rank)
        rows.append({
            "rank": rank,
            "step": cur.value("shoal_training_last_step", rank=rank),
            "step_time": step_time / steps if steps else None,
            "samples_per_s": samples / span if samples is not None and span else None,
            "wait_share": wait / span if wait is not None and span else None,
            "since_step": cur.at - last_step_at if last_step_at else None,
            "since_collective": cur.at - last_op_at if last_op_at else None,
            "rss": cur.value("shoal_worker_resident_memory_bytes", rank=rank),
            "cpu_share": cpu / span if cpu is not None and span else None,
            "waited_by": waits.get(rank, {}),
        })
    return rows


def job_line(cur: Reading) -> str:
    """The header line: the job's run id, size and restarts."""
    info = [dict(ls) for (n, ls) in cur.samples if n == "shoal_job_info"]
    # Every sample an agent serves carries run_id; before its first round only the job info
    # is missing.
    runs = cur.label_values("shoal_job_info", "run_id") or {
        dict(ls)["run_id"] for (_, ls) in cur.samples if "run_id" in dict(ls)}
    run = min(runs) if runs else "?"
    world = info[0].get("world_size", "?") if info else "?"
    used = cur.value("shoal_elastic_job_restarts")
    most = cur.value("shoal_elastic_max_restarts")
    failed = cur.value("shoal_elastic_worker_exits_total", state="failed")
    running = cur.value("shoal_elastic_workers", state="running")
    last = cur.value("shoal_elastic_last_restart_timestamp_seconds")
    since = f"{_seconds(cur.at - last)} ago" if last else "never"
    return (f"run {run}  world {world}  running {_int(running)}  "
            f"restarts {_int(used)}/{_int(most)}  failed {_int(failed)}  "
            f"last restart {since}")


def _int(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def _seconds(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}s" if v < 120 else f"{v / 60:.0f}m"


def _fmt(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "ms":
        return f"{v * 1000:.1f}"
    if kind == "pct":
        return f"{v * 100:.0f}%"
    if kind == "mib":
        return f"{v / 2 ** 20:.0f}"
    if kind == "rate":
        return f"{v:.1f}"
    return _seconds(v) if kind == "s" else _int(v)


# Fits an 80-column terminal with the straggler mark.
COLUMNS = (("RANK", "rank", None, 5), ("STEP", "step", "int", 7), ("STEP ms", "step_time", "ms", 8),
           ("SMPL/s", "samples_per_s", "rate", 8), ("WAIT", "wait_share", "pct", 6),
           ("STEP AGO", "since_step", "s", 9), ("COLL AGO", "since_collective", "s", 9),
           ("RSS MiB", "rss", "mib", 8), ("CPU", "cpu_share", "pct", 5))


def render(url: str, prev: Optional[Reading], cur: Optional[Reading],
           error: Optional[str] = None) -> list[str]:
    """The screen's lines."""
    stamp = time.strftime("%H:%M:%S")
    lines = [f"shoal top - {url} - {stamp}  (q quits)"]
    if error is not None:
        return lines + [f"! {error}"]
    if cur is None:
        return lines + ["reading..."]
    lines.append(job_line(cur))
    lines.append("".join(title.rjust(width) for title, _, _, width in COLUMNS))
    rows = rank_rows(prev, cur)
    waits = [r["wait_share"] for r in rows if r["wait_share"] is not None]
    hung = []
    for row in rows:
        cells = "".join((row[key] if kind is None else _fmt(row[key], kind)).rjust(width)
                        for _, key, kind, width in COLUMNS)
        # The rank that waits least in a synchronous job is the one the others wait for.
        straggler = len(waits) > 1 and row["wait_share"] == min(waits) and \
            max(waits) - min(waits) > STRAGGLER_MIN_WAIT_GAP
        if row["waited_by"]:
            hung.append(row)
        mark = "  <- hung" if row["waited_by"] else "  <- straggler" if straggler else ""
        lines.append(cells + mark)
    if not rows:
        lines.append("(no ranks reported yet)")
    for row in hung:
        by = row["waited_by"]
        waiting = sorted(by, key=lambda r: (len(r), r))
        word = "rank" if len(waiting) == 1 else "ranks"
        lines.append(f"rank {row['rank']} holds up the job: {word} {', '.join(waiting)} "
                     f"waited for it inside a collective for {_seconds(cur.at - min(by.values()))}")
    return lines


def _loop(screen, url: str, interval: float, access: Access) -> None:
    curses.curs_set(0)
    screen.timeout(int(interval * 1000))
    prev = cur = None
    while True:
        error = None
        try:
            prev, cur = cur, fetch(url, access=access)
        except TopError as exc:
            error = str(exc)
        screen.erase()
        height, width = screen.getmaxyx()
        for y, line in enumerate(render(url, prev, cur, error)[:height]):
            screen.addnstr(y, 0, line, width - 1)
        screen.refresh()
        if screen.getch() in (ord("q"), ord("Q")):
            return


def main(argv: Sequence[str]) -> int:
    """`shoal top`; returns the exit status."""
    parser = CommandParser(prog="shoal top", description=__doc__.split("\n\n")[0],
                           short_usage="shoal top [HOST:PORT|URL] [--interval S] [--once]")
    parser.add_argument("target", nargs="?", default=DEFAULT_TARGET,
                        help=f"the agent's metrics: HOST:PORT or URL (default {DEFAULT_TARGET})")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    parser.add_argument("--once", action="store_true",
                        help="print two readings' view as text and exit (no terminal UI)")
    secured = parser.add_argument_group(
        "a secured endpoint (shoal run with SHOAL_METRICS_WEB_CONFIG)")
    secured.add_argument("--cacert", metavar="FILE",
                         help="CA certificate(s) to verify the endpoint's TLS certificate with")
    secured.add_argument("--cert", metavar="FILE", help="client certificate (PEM)")
    secured.add_argument("--key", metavar="FILE",
                         help="the client certificate's private key (PEM), unless --cert has it")
    secured.add_argument("--user", help="basic auth user name")
    secured.add_argument("--password-file", metavar="FILE",
                         help=f"file holding the basic auth password (or set {PASSWORD_ENV})")
    secured.add_argument("--allow-http-password", action="store_true",
                         help="send the password even over plain http, where anyone on the "
                              "path can read it (refused without this)")
    args = parser.parse_args(list(argv))
    if not args.interval > 0:
        parser.error(f"--interval must be > 0, got {args.interval:g}")
    try:
        access = access_from(args.cacert, args.cert, args.key, args.user, args.password_file)
    except ValueError as exc:
        parser.error(str(exc))
    url = metrics_url(args.target, tls=access.ssl_context is not None)
    if access.ssl_context is not None and not url.startswith("https://"):
        parser.error(f"--cacert and --cert are for an https:// endpoint, not {url}")
    problem = clear_text_problem(url, access, args.user)
    if problem and not args.allow_http_password:
        parser.error(problem)
    if args.once:
        try:
            first = fetch(url, access=access)
            time.sleep(args.interval)
            second = fetch(url, access=access)
        except TopError as exc:
            sys.stderr.write(f"shoal top: {exc}\n")
            return 1
        sys.stdout.write("\n".join(render(url, first, second)[1:]) + "\n")
        return 0
    curses.wrapper(_loop, url, args.interval, access)
    return 0
