"""Copy a worker's output to the console with a rank prefix, to its log file, and keep its tail."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import IO, Optional, TextIO, Union

logger = logging.getLogger(__name__)

TAIL_LINES = 20

# One lock for every worker's console writes, so that lines never interleave mid-line.
_console_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class StreamRoute:
    """Where one worker's (stdout, stderr) go: to the console, to its log file."""

    console: tuple[bool, bool] = (True, True)
    file: tuple[bool, bool] = (True, True)


class LogTee:
    """Reader threads for one worker's stdout and stderr pipes.

    Each line goes to the console (stdout lines to `console_out`, stderr lines to
    `console_err`) as `[rank R] line` when `to_console`, unprefixed to `log_path` when given,
    and into a ring buffer of the last `TAIL_LINES` lines for failure summaries.
    """

    def __init__(
        self,
        rank: int,
        stdout: Optional[IO[bytes]],
        stderr: Optional[IO[bytes]],
        *,
        console_out: TextIO,
        console_err: TextIO,
        to_console: Union[bool, tuple[bool, bool]],
        log_path: Optional[str] = None,
        to_file: tuple[bool, bool] = (True, True),
    ):
        self.rank = rank
        self._prefix = f"[rank {rank}] "
        # Per stream (stdout, stderr), as torchrun's --redirects/--tee choose them.
        shown = to_console if isinstance(to_console, tuple) else (to_console, to_console)
        if log_path is None or not any(to_file):
            log_path, to_file = None, (False, False)
        self.log_path = log_path
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._tail_lock = threading.Lock()
        self._file = None
        if log_path is not None:
            os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
            self._file = open(log_path, "ab", buffering=0)
        self._threads = [
            threading.Thread(target=self._pump, args=(pipe, console if show else None, keep),
                             daemon=True, name=f"shoal-log-rank{rank}-{name}")
            for name, pipe, console, show, keep in (
                ("out", stdout, console_out, shown[0], to_file[0]),
                ("err", stderr, console_err, shown[1], to_file[1]))
            if pipe is not None
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, pipe: IO[bytes], console: Optional[TextIO], keep: bool) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                with self._tail_lock:
                    self._tail.append(line.rstrip("\n"))
                if self._file is not None and keep:
                    try:
                        self._file.write(raw if raw.endswith(b"\n") else raw + b"\n")
                    except (OSError, ValueError) as exc:
                        logger.warning("Cannot write rank %s's log %s: %s", self.rank,
                                       self.log_path, exc)
                if console is not None:
                    with _console_lock:
                        try:
                            console.write(self._prefix + line)
                            console.flush()
                        except (OSError, ValueError):
                            pass  # a closed console must not stop the worker's pipe draining
        except (OSError, ValueError) as exc:
            logger.debug("Output pipe of rank %s closed: %s", self.rank, exc)
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def join(self, timeout: float) -> None:
        """Wait for both pipes to reach EOF (the worker and its children exited), then close."""
        for thread in self._threads:
            thread.join(timeout)
        if self._file is not None and not any(t.is_alive() for t in self._threads):
            self._file.close()

    def tail(self) -> list[str]:
        """The last lines the worker wrote (stdout and stderr together)."""
        with self._tail_lock:
            return list(self._tail)


class RepeatLimiter:
    """Warn at most once per `every` seconds; a line says how many were held back since.

    A store whose host died fails every call the agent makes while it settles a failure (ten
    a second); one line with a count tells the operator as much as a hundred.
    """

    def __init__(self, log: logging.Logger, every: float = 5.0):
        self._log = log
        self._every = every
        self._last: Optional[float] = None
        self._held = 0

    def warning(self, text: str) -> None:
        """Log `text` now, or count it when a warning went out less than `every` s ago."""
        now = time.monotonic()
        if self._last is not None and now - self._last < self._every:
            self._held += 1
            return
        held = (f" ({self._held} more like it in the last {now - self._last:.0f}s)"
                if self._held and self._last is not None else "")
        self._log.warning("%s%s", text, held)
        self._last, self._held = now, 0

