"""The checkpoint directory's file system side: opening a checkpoint without trusting what sits
under its name, moving aside what is in a save's way, and telling a disk that refuses writes
(full, read-only, not ours) from a fault a restart could cure.

Whoever can write to the directory can put anything under a checkpoint's name: a FIFO (a plain
open() for reading waits for a writer forever), a symbolic link to a device, a directory (a
rename over it fails, so every later save would). Loading opens with O_NONBLOCK and O_NOFOLLOW
and accepts only a regular file; saving never deletes what it did not write, it renames it
aside and logs where it went.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import logging
import traceback
from typing import BinaryIO, Callable, Optional, Sequence

from shoal.elastic.api import CheckpointError
from shoal.elastic.checkpoint_format import CheckpointCorrupt
from shoal.elastic.errors import ERROR_FILE_ENV, error_document, write_error_file

logger = logging.getLogger(__name__)

__all__ = ["CheckpointDiskError", "DISK_ERRNOS", "NotARegularFile", "open_regular", "move_aside",
           "kind_of", "fsync_dir", "pid_alive", "what_is_left", "report_not_retryable"]

# A save failing with one of these fails the same way after a restart: the disk must change.
DISK_ERRNOS = frozenset(e for e in (
    errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", None),
) if e is not None)
_MOVE_ASIDE_TRIES = 1000


class CheckpointDiskError(CheckpointError):
    """A checkpoint cannot be saved because of the disk (full, read-only, over quota, not
    writable): a restart would fail the same save, so the agent does not restart into it."""

    retryable = False


class NotARegularFile(CheckpointCorrupt):
    """Something other than a regular file sits under a checkpoint's name."""


def kind_of(mode: int) -> str:
    """'a directory', 'a FIFO'...: what a file of `mode` is, for messages."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return f"a file of mode {mode:o}"


def open_regular(path: str) -> BinaryIO:
    """`path` opened for reading, only if it is a regular file (not through a symbolic link).

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer; fstat on
    the open descriptor then decides, so the file checked is the file read.

    Raises:
        FileNotFoundError: nothing is there.
        NotARegularFile: a FIFO, a directory, a device, a socket or a symbolic link is.
        OSError: it cannot be opened.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotARegularFile(
                f"Checkpoint {path!r} is a symbolic link, not a regular file; a checkpoint is "
                "opened only as a regular file (a link could lead to a device or a pipe).") from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(
                f"Checkpoint {path!r} is not a regular file but {kind_of(mode)}: left unread.")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def move_aside(path: str) -> Optional[str]:
    """Rename what is at `path` to the first free `path.in-the-way-N`; return the new path, or
    None when nothing was there. Never deletes: the entry may be a user's."""
    for n in range(1, _MOVE_ASIDE_TRIES + 1):
        aside = f"{path}.in-the-way-{n}"
        if not os.path.lexists(aside):
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return None
            return aside
    raise CheckpointError(f"{path!r} is in the way and {_MOVE_ASIDE_TRIES} names to move it "
                          "aside to are taken; clear the directory.")


def fsync_dir(directory: str) -> None:
    """Make the directory's entries (a rename) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """A process of that id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def what_is_left(directory: str, list_steps: Callable[[], Sequence[int]]) -> str:
    """A sentence on what a failed save leaves in `directory`: the checkpoints still there (as
    `list_steps` finds them), or that the directory is gone."""
    if not os.path.isdir(directory):
        return (f"The checkpoint directory {directory!r} is gone (deleted or unmounted): no "
                "checkpoint is left, a restart would start over.")
    try:
        steps = list_steps()
    except OSError as exc:
        return f"What is left in {directory!r} cannot be listed ({exc})."
    if not steps:
        return f"No checkpoint is left in {directory!r}; a restart would start over."
    listed = ", ".join(str(s) for s in steps)
    return (f"Still in {directory!r}: the checkpoint(s) of step(s) {listed}; a restart resumes "
            f"from step {steps[-1]} if it verifies.")


def report_not_retryable(error: CheckpointError) -> None:
    """Write `error` to this worker's TORCHELASTIC_ERROR_FILE as torch's `@record` would, marked
    not retryable, so that the agent fails the job instead of restarting into the same disk
    fault even when the script is not wrapped in `record` (a later `record` write keeps the
    class name, which the agent also reads: elastic.agent.failures.not_retryable)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    doc = error_document(f"{type(error).__name__}: {error}", traceback.format_exc(),
                         {"retryable": False})
    try:
        write_error_file(path, doc)
    except OSError as exc:
        logger.warning("Cannot write the error file %s: %s", path, exc)
