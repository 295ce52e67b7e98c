"""`Checkpointer`: atomic, checksummed checkpoints of a training state, the newest `keep` kept.

One file per step, `ckpt-<step>.shoal`:

    b"SHOALCK1"                       magic
    pickle stream (protocol 5)        arrays' contiguous data left out of band
    out-of-band buffers, raw          in order
    trailer JSON                      {"step", "pickle_bytes", "buffers", "sha256"}
    trailer length (8 bytes, LE)
    b"SHOALEND"

The sha256 covers the pickle stream and the buffers; it is checked before anything is
unpickled. A save writes a temporary file in the same directory, fsyncs it, renames it over the
final name and fsyncs the directory, so a crash leaves either the old set of checkpoints or the
new one, never a half-written file under a checkpoint's name. `load_latest` still verifies each
file and falls back to the one before when a file is truncated or damaged.

Unpickling allows only plain Python containers, numpy arrays/dtypes/RNG states, ml_dtypes and
`core` classes unless the Checkpointer is `trusted`: a checkpoint directory may be shared, and a
pickle can run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import secrets
import socket
import struct
from typing import Iterable, Optional

from elastic.api import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "CheckpointCorrupt"]

MAGIC = b"SHOALCK1"
END = b"SHOALEND"
_TRAILER_LEN = struct.Struct("<Q")
_MAX_TRAILER = 1 << 20
_NAME = re.compile(r"ckpt-(\d{12})\.shoal")
_TMP = re.compile(r"\.ckpt-\d+\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp")


class CheckpointCorrupt(CheckpointError):
    """One checkpoint file is truncated, damaged or not a shoal checkpoint."""


# ----------------------------------------------------------------------------- safe unpickling

_SAFE_GLOBALS = {
    "builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool",
                 "str", "bytes", "bytearray", "slice", "range"},
    "collections": {"OrderedDict", "defaultdict", "deque", "Counter"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
    "numpy": {"ndarray", "dtype"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.numeric": {"_frombuffer"},
    "numpy.core.numeric": {"_frombuffer"},
    "numpy.random._pickle": {"__generator_ctor", "__bit_generator_ctor", "__randomstate_ctor"},
    "numpy.random.bit_generator": {"SeedSequence", "__pyx_unpickle_SeedSequence"},
    "numpy.random._generator": {"Generator"},
    "numpy.random.mtrand": {"RandomState"},
    "numpy.random._pcg64": {"PCG64", "PCG64DXSM"},
    "numpy.random._mt19937": {"MT19937"},
    "numpy.random._philox": {"Philox"},
    "numpy.random._sfc64": {"SFC64"},
}


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, file, buffers, path: str, extra: frozenset):
        super().__init__(file, buffers=buffers)
        self._path = path
        self._extra = extra

    def find_class(self, module: str, name: str):
        if f"{module}.{name}" in self._extra or name in _SAFE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "numpy.dtypes" and name.endswith("DType"):
            return super().find_class(module, name)
        if module == "ml_dtypes" or module.startswith("ml_dtypes.") or module == "core" or \
                module.startswith("core."):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise CheckpointError(
            f"Checkpoint {self._path!r} holds {module}.{name}, which is not on the list of types "
            "a checkpoint may contain (plain containers, numpy, ml_dtypes, core). Save state "
            "dicts of arrays, or pass Checkpointer(..., trusted=True) for files you trust."
        )


# ----------------------------------------------------------------------------- writer helpers

class _HashingWriter(io.RawIOBase):
    """A file wrapper that hashes and counts what passes through it."""

    def __init__(self, f, digest):
        self.f, self.digest, self.count = f, digest, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.f.write(view)
        self.count += view.nbytes
        return view.nbytes


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Checkpointer:
    """Saves `(step, state)` atomically into `directory`, keeping the newest `keep` files.

    Args:
        directory: created if missing; one directory per job.
        keep: how many checkpoints to keep (older ones are deleted after each save).
        trusted: unpickle any object (only for files you trust), not only the safe list.
        allow: extra 'module.Name' globals a checkpoint may contain.
    """

    def __init__(self, directory: str, keep: int = 3, *, trusted: bool = False,
                 allow: Iterable[str] = ()):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer keep must be an integer >= 1, got {keep!r}.")
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"Checkpointer directory must be a path, got {directory!r}.")
        self.directory = os.fspath(directory)
        self.keep = keep
        self.trusted = trusted
        self._allow = frozenset(allow)
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

        Raises:
            ValueError: a negative or non-integer step, or a state that is not a dict.
            CheckpointError: the state cannot be pickled or the file cannot be written.
        """
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10 ** 12:
            raise ValueError(f"Checkpoint step must be an integer in 0..10**12-1, got {step!r}.")
        if not isinstance(state, dict):
            raise ValueError(f"Checkpoint state must be a dict, got {type(state).__name__}.")
        final = self.path(step)
        host = socket.gethostname().replace(".", "_") or "host"
        tmp = os.path.join(self.directory,
                           f".ckpt-{step}.{host}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        digest = hashlib.sha256()
        buffers: list[pickle.PickleBuffer] = []
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                writer = _HashingWriter(f, digest)
                pickle.Pickler(writer, protocol=5, buffer_callback=buffers.append).dump(state)
                pickle_bytes = writer.count
                sizes = []
                for buf in buffers:
                    raw = buf.raw()
                    writer.write(raw)
                    sizes.append(raw.nbytes)
                trailer = json.dumps({"step": step, "pickle_bytes": pickle_bytes,
                                      "buffers": sizes, "sha256": digest.hexdigest()}).encode()
                f.write(trailer)
                f.write(_TRAILER_LEN.pack(len(trailer)))
                f.write(END)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            self._discard(tmp)
            raise CheckpointError(f"The state of step {step} cannot be pickled: {exc}") from exc
        except OSError as exc:
            self._discard(tmp)
            raise CheckpointError(
                f"Writing checkpoint {final!r} failed: {exc}; the previous checkpoints are intact."
            ) from exc
        except BaseException:
            self._discard(tmp)
            raise
        logger.info("Saved checkpoint of step %d to %s", step, final)
        self._prune(step)
        return final

    def _discard(self, tmp: str) -> None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass

    def _prune(self, newest: int) -> None:
        for old in self.steps()[:-self.keep]:
            try:
                os.unlink(self.path(old))
            except FileNotFoundError:
                pass
        # Temporary files of saves whose process died (on this host) are garbage.
        host = socket.gethostname().replace(".", "_") or "host"
        for name in os.listdir(self.directory):
            m = _TMP.fullmatch(name)
            if m and m.group("host") == host and not _pid_alive(int(m.group("pid"))):
                logger.info("Removing %s, left by a save that was killed", name)
                self._discard(os.path.join(self.directory, name))

    # ------------------------------------------------------------------ load

    def load(self, step: int) -> dict:
        """Read and verify the checkpoint of `step`.

        Raises:
            CheckpointCorrupt: the file is truncated, damaged or of another format.
            CheckpointError: it is missing, or holds types outside the safe list.
        """
        path = self.path(step)
        try:
            with open(path, "rb") as f:
                return self._read(f, path, step)
        except FileNotFoundError as exc:
            raise CheckpointError(f"There is no checkpoint of step {step} ({path!r}).") from exc
        except OSError as exc:
            raise CheckpointCorrupt(f"Checkpoint {path!r} cannot be read: {exc}") from exc

    def load_latest(self) -> Optional[tuple[int, dict]]:
        """The newest checkpoint that verifies, as (step, state); None if there is none.

        Damaged files are skipped with a warning. If checkpoint files exist but none verifies,
        CheckpointError is raised rather than silently starting over.
        """
        steps = self.steps()
        problems = []
        for step in reversed(steps):
            try:
                return step, self.load(step)
            except CheckpointCorrupt as exc:
                logger.warning("Skipping checkpoint of step %d: %s Falling back to the one before.",
                               step, exc)
                problems.append(str(exc))
        if problems:
            raise CheckpointError(
                f"None of the {len(steps)} checkpoints in {self.directory!r} is readable: "
                + " ".join(problems)
            )
        return None

    def _read(self, f, path: str, step: int) -> dict:
        size = os.fstat(f.fileno()).st_size
        floor = len(MAGIC) + _TRAILER_LEN.size + len(END)
        if size < floor:
            raise CheckpointCorrupt(f"Checkpoint {path!r} is truncated ({size} bytes).")
        if f.read(len(MAGIC)) != MAGIC:
            raise CheckpointCorrupt(f"Checkpoint {path!r} does not start with shoal's magic.")
        f.seek(size - _TRAILER_LEN.size - len(END))
        (trailer_len,) = _TRAILER_LEN.unpack(f.read(_TRAILER_LEN.size))
        if f.read(len(END)) != END:
            raise CheckpointCorrupt(
                f"Checkpoint {path!r} has no end marker: it is truncated or was cut off mid-save.")
        if trailer_len > min(_MAX_TRAILER, size - floor):
            raise CheckpointCorrupt(f"Checkpoint {path!r} has a bad trailer length {trailer_len}.")
        f.seek(size - _TRAILER_LEN.size - len(END) - trailer_len)
        try:
            trailer = json.loads(f.read(trailer_len))
            pickle_bytes = int(trailer["pickle_bytes"])
            sizes = [int(s) for s in trailer["buffers"]]
            expected = str(trailer["sha256"])
            saved_step = int(trailer["step"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorrupt(f"Checkpoint {path!r} has an unreadable trailer: {exc}") from exc
        body = size - floor - trailer_len
        if pickle_bytes < 0 or any(s < 0 for s in sizes) or pickle_bytes + sum(sizes) != body:
            raise CheckpointCorrupt(
                f"Checkpoint {path!r} holds {body} body bytes but its trailer describes "
                f"{pickle_bytes + sum(sizes)}.")
        if saved_step != step:
            raise CheckpointCorrupt(
                f"Checkpoint {path!r} says it is step {saved_step}, not {step}.")
        f.seek(len(MAGIC))
        digest = hashlib.sha256()
        stream = bytearray(pickle_bytes)
        if f.readinto(stream) != pickle_bytes:
            raise CheckpointCorrupt(f"Checkpoint {path!r} ended inside its pickle stream.")
        digest.update(stream)
        buffers = []
        for n in sizes:
            buf = bytearray(n)  # writable, so arrays loaded from it are writable too
            if f.readinto(buf) != n:
                raise CheckpointCorrupt(f"Checkpoint {path!r} ended inside an array buffer.")
            digest.update(buf)
            buffers.append(buf)
        if digest.hexdigest() != expected:
            raise CheckpointCorrupt(
                f"Checkpoint {path!r} fails its sha256 check: its contents were damaged.")
        try:
            if self.trusted:
                state = pickle.Unpickler(io.BytesIO(stream), buffers=buffers).load()
            else:
                state = _SafeUnpickler(io.BytesIO(stream), buffers, path, self._allow).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001  (verified bytes that still fail to load)
            raise CheckpointCorrupt(f"Checkpoint {path!r} does not unpickle: {exc!r}") from exc
        if not isinstance(state, dict):
            raise CheckpointCorrupt(f"Checkpoint {path!r} holds a {type(state).__name__}, not a dict.")
        return state

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, keep={self.keep})"
