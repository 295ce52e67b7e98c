"""`FileStore`: a store in one file shared by processes on one filesystem, as c10d's FileStore.

The file is an append-only log of records (`set`, `delete`, and a user-count delta). Each store
object keeps a cache of the log it has read and its read position; every operation first reads
what other processes appended since. Writers hold an exclusive `flock` for read-modify-append,
so `add` and `compare_set` are atomic across processes; readers hold a shared one. `flock`
belongs to an open file description, so each FileStore opens its own and a thread lock keeps
the threads of one object apart. The user count lives in the log too: the constructor adds one,
`close()` (or garbage collection) subtracts one, and whoever brings it to zero deletes the file.
Waits poll the file's size with a short backoff; that is cheap and this store is for one machine.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from typing import Optional

from shoal.collectives.store.rules import added, compare_set_outcome
from shoal.collectives.store.api import Store, missing_keys_message
from shoal.collectives.types import DEFAULT_STORE_TIMEOUT_S, StoreError, StoreTimeout
from shoal.core.timeouts import TimeoutLike

logger = logging.getLogger(__name__)

_RECORD = struct.Struct("!BII")  # kind, key length, value length
_SET, _DELETE, _USERS = 1, 2, 3
_POLL_S = (0.0005, 0.05)  # first and longest sleep between polls of the file

__all__ = ["FileStore"]


class FileStore(Store):
    """A store kept in the file `path`, shared by every process that opens the same path.

    Args:
        path: the file (created if missing; removed when the last user closes it).
        world_size: if given, having it open in more processes than this is an error (a stale
            file left by an earlier job is the usual cause); one process may open it several
            times (a process group and RPC on one file://, as torch allows).
        timeout: default for `get`/`wait` and for acquiring the file's lock.

    Raises:
        StoreError: the file cannot be opened, is corrupt, or has too many users.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        world_size: Optional[int] = None,
        timeout: TimeoutLike = DEFAULT_STORE_TIMEOUT_S,
    ):
        super().__init__(timeout)
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ValueError(f"FileStore world_size must be a positive int or None, got {world_size!r}.")
        self.path = os.fspath(path)
        self.world_size = world_size
        self._tlock = threading.RLock()
        self._fd: Optional[int] = None
        self._data: dict[str, bytes] = {}
        self._users = 0
        self._users_by_process: dict[str, int] = {}  # pid -> its open FileStore objects
        self._me = str(os.getpid()).encode()
        self._pos = 0
        self._closed = False
        self._open_and_join()

    # ------------------------------------------------------------------ file handling

    def _open_and_join(self) -> None:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise StoreError(f"FileStore cannot open {self.path!r}: {exc}") from exc
            self._fd, self._data, self._users, self._pos = fd, {}, 0, 0
            self._users_by_process = {}
            with self._locked(exclusive=True):
                # The last user of an earlier incarnation may have deleted the path between our
                # open and our lock; then this fd is an orphan and we open the path again.
                joined = self._still_linked()
                if joined:
                    self._append(_USERS, self._me, b"1")
                    users = sum(1 for n in self._users_by_process.values() if n > 0)
                    if self.world_size is not None and users > self.world_size:
                        self._append(_USERS, self._me, b"-1")
            if joined:
                break
            os.close(fd)
        if self.world_size is not None and users > self.world_size:
            os.close(fd)
            self._fd = None
            self._closed = True
            raise StoreError(
                f"FileStore {self.path!r} would be open in {users} processes but world_size is "
                f"{self.world_size}; is the file left over from an earlier job?"
            )

    def _still_linked(self) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._fd)
        return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)

    @contextlib.contextmanager
    def _locked(self, exclusive: bool):
        """Hold the thread lock and the file lock, refreshed; poll so a stuck holder times out."""
        with self._tlock:
            if self._fd is None:
                raise StoreError(f"This FileStore ({self.path!r}) is closed.")
            mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
            end = time.monotonic() + self.timeout
            delay = _POLL_S[0]
            while True:
                try:
                    fcntl.flock(self._fd, mode)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                        raise StoreError(f"FileStore cannot lock {self.path!r}: {exc}") from exc
                if time.monotonic() >= end:
                    raise StoreError(
                        f"FileStore could not lock {self.path!r} within {self.timeout:g}s; "
                        "another process holds it (stopped or hung?)."
                    )
                time.sleep(delay)
                delay = min(delay * 2, _POLL_S[1])
            try:
                self._refresh(truncate_tail=exclusive)
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _refresh(self, truncate_tail: bool) -> None:
        """Apply the records appended since our last read (caller holds the file lock)."""
        size = os.fstat(self._fd).st_size
        if size == self._pos:
            return
        if size < self._pos:
            raise StoreError(
                f"FileStore {self.path!r} shrank from {self._pos} to {size} bytes; something "
                "other than FileStore rewrote it."
            )
        data = _pread_all(self._fd, size - self._pos, self._pos)
        view = memoryview(data)
        pos = 0
        while len(view) - pos >= _RECORD.size:
            kind, klen, vlen = _RECORD.unpack_from(view, pos)
            end = pos + _RECORD.size + klen + vlen
            if kind not in (_SET, _DELETE, _USERS):
                raise StoreError(
                    f"FileStore {self.path!r} is corrupt: record kind {kind} at byte "
                    f"{self._pos + pos} is unknown."
                )
            if end > len(view):
                break
            key = bytes(view[pos + _RECORD.size:pos + _RECORD.size + klen]).decode()
            value = bytes(view[pos + _RECORD.size + klen:end])
            if kind == _SET:
                self._data[key] = value
            elif kind == _DELETE:
                self._data.pop(key, None)
            else:
                self._users += int(value)
                by_process = self._users_by_process
                by_process[key] = by_process.get(key, 0) + int(value)
            pos = end
        self._pos += pos
        if pos != len(view) and truncate_tail:
            # A writer died mid-record; nobody holds the lock now, so the torn tail can go.
            logger.warning(
                "FileStore %s: dropping a torn record of %d bytes at byte %d (a writer died).",
                self.path, len(view) - pos, self._pos,
            )
            os.ftruncate(self._fd, self._pos)

    def _append(self, kind: int, key: bytes, value: bytes, more: tuple = ()) -> None:
        """Append records in one write (caller holds the exclusive lock) and apply them."""
        parts = []
        for k, key_b, value_b in ((kind, key, value),) + more:
            parts += [_RECORD.pack(k, len(key_b), len(value_b)), key_b, value_b]
        blob = b"".join(parts)
        view = memoryview(blob)
        while view:
            view = view[os.write(self._fd, view):]
        self._refresh(truncate_tail=False)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Leave the store; the last user deletes the file."""
        with self._tlock:
            if self._closed or self._fd is None:
                self._closed = True
                return
            try:
                with self._locked(exclusive=True):
                    self._append(_USERS, self._me, b"-1")
                    if self._users <= 0 and self._still_linked():
                        os.unlink(self.path)
            finally:
                os.close(self._fd)
                self._fd = None
                self._closed = True

    def __del__(self):
        try:
            self.close()
        # Interpreter shutdown or a vanished file can raise anything; nothing is left to do.
        except Exception:  # noqa: BLE001 - __del__ must not raise
            pass

    def clone(self) -> "FileStore":
        """Another user of the same file (one more in num_users until closed)."""
        return FileStore(self.path, world_size=self.world_size, timeout=self.timeout)

    def num_users(self) -> int:
        """How many FileStore objects have this file open now."""
        with self._locked(exclusive=False):
            return self._users

    # ------------------------------------------------------------------ Store hooks

    def _append_value(self, key, value):
        with self._locked(exclusive=True):
            self._append(_SET, key.encode(), self._data.get(key, b"") + value)

    def _set(self, key, value):
        with self._locked(exclusive=True):
            self._append(_SET, key.encode(), value)

    def _wait_for(self, keys: list[str], timeout: float) -> dict[str, bytes]:
        end = time.monotonic() + timeout
        delay = _POLL_S[0]
        while True:
            with self._locked(exclusive=False):
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return {k: self._data[k] for k in keys}
                seen = self._pos
            left = end - time.monotonic()
            if left <= 0:
                raise StoreTimeout(missing_keys_message(f"FileStore {self.path!r}", missing, timeout))
            # Sleep until the file grows, checking its size (no lock) with a growing backoff.
            while left > 0:
                time.sleep(min(delay, left))
                delay = min(delay * 2, _POLL_S[1])
                if self._size() != seen:
                    break
                left = end - time.monotonic()

    def _size(self) -> int:
        with self._tlock:
            if self._fd is None:
                raise StoreError(f"This FileStore ({self.path!r}) is closed.")
            return os.fstat(self._fd).st_size

    def _get(self, key, timeout):
        return self._wait_for([key], timeout)[key]

    def _add(self, key, amount):
        with self._locked(exclusive=True):
            value = added(key, self._data.get(key, b"0"), amount)
            self._append(_SET, key.encode(), str(value).encode())
            return value

    def _compare_set(self, key, expected, desired):
        with self._locked(exclusive=True):
            swap, answer = compare_set_outcome(self._data.get(key), expected, desired)
            if swap:
                self._append(_SET, key.encode(), desired)
            return answer

    def _wait(self, keys, timeout):
        self._wait_for(keys, timeout)

    def _check(self, keys):
        with self._locked(exclusive=False):
            return all(k in self._data for k in keys)

    def _delete(self, key):
        with self._locked(exclusive=True):
            if key not in self._data:
                return False
            self._append(_DELETE, key.encode(), b"")
            return True

    def _num_keys(self):
        with self._locked(exclusive=False):
            return len(self._data)

    def _multi_get(self, keys, timeout):
        found = self._wait_for(keys, timeout)
        return [found[k] for k in keys]

    def _multi_set(self, keys, values):
        if not keys:
            return
        records = tuple((_SET, k.encode(), v) for k, v in zip(keys, values))
        with self._locked(exclusive=True):
            self._append(*records[0], more=records[1:])


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = os.pread(fd, min(n, 1 << 30), offset)
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)
