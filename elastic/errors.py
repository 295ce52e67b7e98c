"""torchrun's error-file contract: TORCHELASTIC_ERROR_FILE.

The agent gives each worker its own TORCHELASTIC_ERROR_FILE. A worker whose entry point is
wrapped in `record` (or torch's `@record`, same format) writes its exception there as it dies;
the agent reads it to name the real error, and writes one itself for a worker that died without
(a signal, os._exit, a crash in C). When the job fails for good, `shoal run` writes the root
cause to the file named by its own TORCHELASTIC_ERROR_FILE, so Kubernetes can show it as the
pod's termination message (point it at /dev/termination-log).

The format is torch's:
    {"message": {"message": "<Exception: text>",
                 "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<unix seconds>"}}}
shoal adds a "shoal" object with the failure record (rank, node, exit, log path).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import time
import traceback
from typing import Any, Callable, Mapping, Optional, TypeVar

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# Kubernetes reads at most 4096 bytes of a termination message.
TERMINATION_MESSAGE_LIMIT = 4096

F = TypeVar("F", bound=Callable[..., Any])


def error_document(message: str, callstack: str = "",
                   extra: Optional[Mapping[str, Any]] = None) -> dict:
    """The JSON document torch's error handler writes."""
    doc: dict = {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack, "timestamp": str(int(time.time()))}}}
    if extra:
        doc["shoal"] = dict(extra)
    return doc


def write_error_file(path: str, doc: Mapping[str, Any], limit: Optional[int] = None) -> None:
    """Write `doc` as JSON to `path`: atomically (a temporary file renamed over it) where the
    directory allows it, else in place (a device, a mounted file such as Kubernetes'
    /dev/termination-log, a read-only directory).

    With `limit`, the traceback is cut from its start until the text fits (a termination
    message keeps the end, where the error is).
    """
    text = json.dumps(doc)
    if limit is not None and len(text.encode()) > limit:
        trimmed = json.loads(text)
        info = trimmed["message"]["extraInfo"]
        trimmed.pop("shoal", None)
        stack = info.get("py_callstack", "")
        over = len(json.dumps(trimmed).encode()) - limit
        info["py_callstack"] = "..." + stack[max(0, over + 3):] if over > 0 else stack
        text = json.dumps(trimmed)[:limit]
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(path) and not os.path.isfile(path):
        _write_in_place(path, text)  # a device
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=".error-", dir=directory)
    except OSError:
        if not os.path.exists(path):
            raise
        # A directory we cannot write around a file we may (a read-only root filesystem with
        # /dev/termination-log mounted into it).
        _write_in_place(path, text)
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not os.path.exists(path):
            raise
        # The file is a mount point (EBUSY): Kubernetes bind-mounts /dev/termination-log.
        _write_in_place(path, text)


def _write_in_place(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read_error_file(path: Optional[str]) -> Optional[dict]:
    """The document a worker wrote, or None (no file, or not torch's format)."""
    if not path:
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or "message" not in doc:
        return None
    message = doc["message"]
    if isinstance(message, str):  # torch also accepts a bare message
        doc["message"] = {"message": message, "extraInfo": {"py_callstack": "",
                                                            "timestamp": ""}}
    elif not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    return doc


def record(fn: F) -> F:
    """Wrap a worker's entry point: an exception it raises is written to
    TORCHELASTIC_ERROR_FILE (if set) before it propagates, as torch's `@record` does."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code in (None, 0):
                raise
            _write_current(f"SystemExit: {exc.code}")
            raise
        except BaseException as exc:
            _write_current(f"{type(exc).__name__}: {exc}")
            raise
    return wrapper  # type: ignore[return-value]


def _write_current(message: str) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        write_error_file(path, error_document(message, traceback.format_exc()))
    except OSError:
        pass  # the exception itself still propagates and is printed
