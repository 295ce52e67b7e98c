"""`shoal trace merge DIR -o job.json | summary DIR | plot DIR -o timeline.png`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from shoal.launcher.trace.files import TraceError
from shoal.launcher.trace.merge import merge
from shoal.launcher.trace.plot import plot
from shoal.launcher.trace.summary import render, summarize


def parser() -> argparse.ArgumentParser:
    """The `shoal trace` argument parser."""
    p = argparse.ArgumentParser(prog="shoal trace",
                                description="the job view over `shoal run --profile DIR` traces")
    sub = p.add_subparsers(dest="action", required=True)
    m = sub.add_parser("merge", help="one Chrome/Perfetto trace, a process per rank")
    m.add_argument("dir")
    m.add_argument("-o", "--output", default="job.json")
    s = sub.add_parser("summary", help="compute/communication/idle per rank and step")
    s.add_argument("dir")
    pl = sub.add_parser("plot", help="the ranks' timelines as a picture (needs matplotlib)")
    pl.add_argument("dir")
    pl.add_argument("-o", "--output", default="timeline.png")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one `shoal trace` action; 2 on bad input, with the reason on stderr."""
    ns = parser().parse_args(argv)
    try:
        if ns.action == "merge":
            doc = merge(ns.dir, ns.output)
            err = doc["shoal"]["clock_error_us"]
            print(f"wrote {ns.output}: {len(doc['shoal']['clocks'])} ranks, clock error "
                  f"{'unknown' if err is None else f'<= {err:.1f} us'}")
        elif ns.action == "summary":
            rows, call = summarize(ns.dir)
            sys.stdout.write(render(rows, call))
        else:
            print(f"wrote {plot(ns.dir, ns.output)}")
    except TraceError as exc:
        print(f"shoal trace: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output path that cannot be written, a directory not readable
        where = f" {exc.filename!r}" if exc.filename else ""
        print(f"shoal trace {ns.action}: cannot use{where}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    return 0
