"""`Checkpointer`: atomic, authenticated checkpoints of a training state, the newest `keep` kept.

One file per step, `ckpt-<step>.shoal`, in format 2 (`elastic.checkpoint_format` holds the
layout and says why format 1 is refused): a JSON header with an array table, a metadata pickle
that may name only an exact allow-list of globals, the arrays' raw bytes, and an HMAC-SHA256
keyed by the job's secret (`core.auth.load_token()`: SHOAL_AUTH_TOKEN, which `shoal run` sets
per job) over everything before it, checked before anything else is parsed. A file from another
job, a tampered one and a damaged one are all refused; resuming across separate launches needs
the same SHOAL_AUTH_TOKEN or --auth-token-file. With no secret set, the public development
token keys the MAC: it then detects damage only, and the allow-list is the only defence.

A save writes a temporary file in the same directory, fsyncs it, renames it over the final name
and fsyncs the directory, so a crash leaves either the old set of checkpoints or the new one,
never a half-written file under a checkpoint's name. `load_latest` verifies each file and falls
back to the one before when a file is truncated, damaged, foreign or refused, when it claims
more memory than can be had, and when what sits under its name is not a regular file (opened
without blocking or following links: `elastic.checkpoint_files`). A save moves a non-file in
its way aside; a disk that refuses it (full, read-only) raises `CheckpointDiskError`, which
says which checkpoints are left and which the agent does not restart into.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import secrets
import socket
import stat
import time
from typing import Iterable, Optional

from shoal.core.auth import load_token
from shoal.core.errors import ShoalError
from shoal.elastic import training_metrics
from shoal.elastic.api import CheckpointError
from shoal.elastic.checkpoint_files import (
    DISK_ERRNOS,
    CheckpointDiskError,
    fsync_dir,
    kind_of,
    move_aside,
    open_regular,
    pid_alive,
    report_not_retryable,
    what_is_left,
)
from shoal.elastic.checkpoint_format import (
    CheckpointCorrupt,
    CheckpointRefused,
    CheckpointUnauthenticated,
    derive_key,
    read_checkpoint,
    write_checkpoint,
)

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "CheckpointCorrupt", "CheckpointDiskError", "CheckpointRefused",
           "CheckpointUnauthenticated"]

_NAME = re.compile(r"ckpt-(\d{12})\.shoal")
_TMP = re.compile(r"\.ckpt-\d+\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp")


class Checkpointer:
    """Saves `(step, state)` atomically into `directory`, keeping the newest `keep` files.

    Args:
        directory: created if missing; one directory per job.
        keep: how many checkpoints to keep (older ones are deleted after each save).
        trusted: let the metadata pickle name any global (only for files you trust); the MAC
            is checked all the same.
        allow: extra 'module.Name' globals the metadata pickle may name.
        token: the job's secret that keys the files' MAC (default: `core.auth.load_token()`,
            i.e. SHOAL_AUTH_TOKEN or SHOAL_AUTH_TOKEN_FILE).
    """

    records_metrics = True  # saves and loads feed shoal_checkpoint_* (training_metrics)

    def __init__(self, directory: str, keep: int = 3, *, trusted: bool = False,
                 allow: Iterable[str] = (), token: Optional[bytes | str] = None):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer keep must be an integer >= 1, got {keep!r}.")
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"Checkpointer directory must be a path, got {directory!r}.")
        self.directory = os.fspath(directory)
        self.keep = keep
        self.trusted = trusted
        self._allow = frozenset(allow)
        try:
            self._key = derive_key(load_token(token))
        except ShoalError as exc:
            raise CheckpointError(
                f"The checkpoints in {self.directory!r} are authenticated with the job's "
                f"secret, which cannot be had: {exc}") from exc
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"Cannot create the checkpoint directory {self.directory!r}: {exc}") from exc

    # ------------------------------------------------------------------ names

    def path(self, step: int) -> str:
        """The file of `step`'s checkpoint."""
        return os.path.join(self.directory, f"ckpt-{step:012d}.shoal")

    def steps(self) -> list[int]:
        """Steps with a checkpoint file, oldest first (files are not verified here)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _NAME.fullmatch(n)))

    def latest_step(self) -> Optional[int]:
        """The newest step with a checkpoint file, or None (see `load_latest` to verify it)."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict) -> str:
        """Write `state` as the checkpoint of `step` atomically; return the file's path.

        Whatever else sits under the file's name (a directory, a FIFO) is moved aside, never
        deleted, with a warning that says where it went. A checkpoint directory deleted while
        the job ran is made again (its old checkpoints are gone; this one holds the whole state).

        Raises:
            ValueError: a negative or non-integer step, or a state that is not a dict.
            CheckpointDiskError: the disk refuses the write (full, read-only, over quota, not
                writable); its message says which checkpoints are left. The agent does not
                restart into it: a restart would fail the same save.
            CheckpointError: the state cannot be pickled or the file cannot be written.
        """
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10 ** 12:
            raise ValueError(f"Checkpoint step must be an integer in 0..10**12-1, got {step!r}.")
        if not isinstance(state, dict):
            raise ValueError(f"Checkpoint state must be a dict, got {type(state).__name__}.")
        final = self.path(step)
        started = time.perf_counter()
        try:
            try:
                self._write(step, state, final)
            except FileNotFoundError:
                if os.path.isdir(self.directory):
                    raise
                logger.warning("The checkpoint directory %s is gone (deleted while the job ran): "
                               "the checkpoints it held are lost. Making it again to save step %d.",
                               self.directory, step)
                os.makedirs(self.directory, exist_ok=True)
                self._write(step, state, final)
        except OSError as exc:
            raise self._write_failed(step, final, exc) from exc
        logger.info("Saved checkpoint of step %d to %s", step, final)
        # Duration, bytes, last step and time: what a failure now would throw away.
        training_metrics.record_checkpoint_save(step, time.perf_counter() - started,
                                                os.path.getsize(final))
        try:
            self._prune()
        except OSError as exc:  # the checkpoint is saved; an old one lingers
            logger.warning("Removing old checkpoints from %s failed: %s", self.directory, exc)
        return final

    def _write(self, step: int, state: dict, final: str) -> None:
        host = socket.gethostname().replace(".", "_") or "host"
        tmp = os.path.join(self.directory,
                           f".ckpt-{step}.{host}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        self._clear_the_way(final, step)
        try:
            # The temporary file exists before the state is serialized, so a save killed at
            # any point leaves a file the next save recognises and removes (see _prune).
            with open(tmp, "wb") as f:
                write_checkpoint(f, step, state, self._key)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(self.directory)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            self._discard(tmp)
            raise CheckpointError(f"The state of step {step} cannot be pickled: {exc}") from exc
        except BaseException:
            self._discard(tmp)
            raise

    def _write_failed(self, step: int, final: str, exc: OSError) -> CheckpointError:
        """The error a failed save raises: what failed and which checkpoints are left; a disk
        fault (full, read-only, not writable) is not retryable and the agent is told so."""
        left = what_is_left(self.directory, self.steps)
        if exc.errno not in DISK_ERRNOS:
            return CheckpointError(f"Writing checkpoint {final!r} failed: {exc}. {left}")
        error = CheckpointDiskError(
            f"Saving the checkpoint of step {step} to {final!r} failed: {exc}. {left} This is "
            "the disk's fault and a restart would fail the same save, so the job is not "
            "restarted: free space or make the directory writable (or give another "
            "--checkpoint-dir), then start the job again.")
        report_not_retryable(error)
        return error

    def _clear_the_way(self, path: str, step: int) -> None:
        """Move aside whatever non-file sits under a checkpoint's name (a rename cannot replace
        a directory, and a user's entry is never deleted)."""
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            return  # a rename replaces it (a link, not what it points to)
        aside = move_aside(path)
        if aside is not None:
            logger.warning("%s was in the way of the checkpoint of step %d (%s, not a checkpoint "
                           "file): moved it aside to %s", path, step, kind_of(mode),
                           os.path.basename(aside))

    def _discard(self, tmp: str) -> None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("Cannot remove the temporary file %s: %s", tmp, exc)

    def _prune(self) -> None:
        for old in self.steps()[:-self.keep]:
            path = self.path(old)
            self._clear_the_way(path, old)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        # Temporary files of saves whose process died (on this host) are garbage.
        host = socket.gethostname().replace(".", "_") or "host"
        for name in os.listdir(self.directory):
            m = _TMP.fullmatch(name)
            if m and m.group("host") == host and not pid_alive(int(m.group("pid"))):
                logger.info("Removing %s, left by a save that was killed", name)
                self._discard(os.path.join(self.directory, name))

    # ------------------------------------------------------------------ load

    def load(self, step: int) -> dict:
        """Read and verify the checkpoint of `step`.

        Raises:
            CheckpointUnauthenticated: its MAC does not match this job's secret.
            CheckpointRefused: it names a global outside the allow-list.
            CheckpointCorrupt: it is truncated, damaged, of another format, too big to be held
                in memory here, or not a regular file (a FIFO, a directory, a symbolic link:
                refused without blocking).
            CheckpointError: it is missing.
        """
        path = self.path(step)
        started = time.perf_counter()
        try:
            with open_regular(path) as f:
                state = read_checkpoint(f, path, step, self._key, trusted=self.trusted,
                                        allow=self._allow)
                training_metrics.record_checkpoint_load(time.perf_counter() - started,
                                                        os.fstat(f.fileno()).st_size)
                return state
        except FileNotFoundError as exc:
            raise CheckpointError(f"There is no checkpoint of step {step} ({path!r}).") from exc
        except OSError as exc:
            raise CheckpointCorrupt(f"Checkpoint {path!r} cannot be read: {exc}") from exc

    def load_latest(self) -> Optional[tuple[int, dict]]:
        """The newest checkpoint that verifies, as (step, state); None if there is none.

        Damaged, foreign (another job's secret) and refused files are skipped with a warning
        that names them. If checkpoint files exist but none verifies, CheckpointError is raised
        rather than silently starting over.
        """
        steps = self.steps()
        problems = []
        for step in reversed(steps):
            try:
                state = self.load(step)
            except CheckpointCorrupt as exc:
                logger.warning("Skipping checkpoint of step %d: %s Falling back to the one before.",
                               step, exc)
                problems.append(str(exc))
                continue
            # The job resumes from here: a fall back past a damaged newer file would lose the
            # work since this step, and the last-checkpoint metrics must say so.
            with contextlib.suppress(OSError):
                training_metrics.record_usable_checkpoint(step, os.path.getmtime(self.path(step)))
            return step, state
        if problems:
            raise CheckpointError(
                f"None of the {len(steps)} checkpoints in {self.directory!r} is readable: "
                + " ".join(problems)
            )
        return None

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, keep={self.keep})"
