"""Checkpoint states as safetensors files: an export others read and an import back, keyed by the
job's secret as `Checkpointer`'s own files are.

A checkpoint's state (`{"model": model.state_dict(), "optim": ..., "epoch": 3}`) becomes one
safetensors file: its tensors under their dotted key paths ("model.fc.weight"), so that
`safetensors.torch.load_file` hands torch the model's weights by the names torch uses, and the
rest of the state (nesting, plain values, the step) as JSON in the header's metadata. The file's
metadata also carries an HMAC-SHA256 of its content under the checkpoint key of the job's secret
(`core.serialization.content_mac`); `load_safetensors` refuses a file without it or with another
job's. Nothing in the format can name code, so, unlike the checkpoint files' metadata pickle,
no allow-list is needed: a state that holds anything but containers, plain values and arrays
cannot be exported (`CheckpointError` names what and where).
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Optional

from shoal.core import serialization
from shoal.core.auth import load_token
from shoal.core.errors import ShoalError
from shoal.elastic.api import CheckpointError
from shoal.elastic.checkpoint import Checkpointer
from shoal.elastic.checkpoint_files import fsync_dir, open_regular
from shoal.elastic.checkpoint_format import (
    CheckpointCorrupt,
    CheckpointUnauthenticated,
    derive_key,
)

__all__ = ["save_safetensors", "load_safetensors", "export_safetensors", "import_safetensors"]

STEP_KEY = "shoal_step"


def _key(token: Optional[bytes | str]) -> bytes:
    try:
        return derive_key(load_token(token))
    except ShoalError as exc:
        raise CheckpointError(
            f"Safetensors checkpoints are authenticated with the job's secret, which cannot be "
            f"had: {exc}") from exc


def save_safetensors(path: str | os.PathLike, state: dict, step: Optional[int] = None, *,
                     token: Optional[bytes | str] = None) -> str:
    """Write `state` (and `step`) to `path` as an authenticated safetensors file, atomically."""
    if not isinstance(state, dict):
        raise ValueError(f"Checkpoint state must be a dict, got {type(state).__name__}.")
    extra = {} if step is None else {STEP_KEY: str(int(step))}
    try:
        blob = serialization.signed_safetensors(state, _key(token), extra)
    except serialization.SerializationError as exc:
        raise CheckpointError(f"The state cannot be exported to safetensors: {exc}") from exc
    final = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(final))
    tmp = os.path.join(directory, f".{os.path.basename(final)}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return final


def load_safetensors(path: str | os.PathLike, *, token: Optional[bytes | str] = None,
                     map_location: Any = None) -> tuple[Optional[int], dict]:
    """(step, state) from a file `save_safetensors` wrote under this job's secret.

    Raises:
        CheckpointUnauthenticated: no MAC, or not this job's (another secret, or changed).
        CheckpointCorrupt: not a readable safetensors file, or not a regular file.
    """
    name = os.fspath(path)
    try:
        with open_regular(name) as f:
            blob = f.read()
    except FileNotFoundError as exc:
        raise CheckpointError(f"There is no safetensors checkpoint {name!r}.") from exc
    except OSError as exc:
        raise CheckpointCorrupt(f"Safetensors checkpoint {name!r} cannot be read: {exc}") from exc
    try:
        state, metadata = serialization.verified_safetensors(blob, name, _key(token),
                                                             map_location)
    except serialization.UnauthenticatedFile as exc:
        raise CheckpointUnauthenticated(str(exc)) from exc
    except serialization.SerializationError as exc:
        raise CheckpointCorrupt(str(exc)) from exc
    if not isinstance(state, dict):
        raise CheckpointCorrupt(f"{name!r} holds a {type(state).__name__}, not a state dict.")
    step = metadata.get(STEP_KEY)
    return (int(step) if step is not None and step.isdigit() else None), state


def export_safetensors(checkpointer: Checkpointer, step: int, path: str | os.PathLike, *,
                       token: Optional[bytes | str] = None) -> str:
    """Verify `checkpointer`'s checkpoint of `step` and write it to `path` as safetensors."""
    return save_safetensors(path, checkpointer.load(step), step, token=token)


def import_safetensors(checkpointer: Checkpointer, path: str | os.PathLike,
                       step: Optional[int] = None, *,
                       token: Optional[bytes | str] = None) -> str:
    """Save an authenticated safetensors state into `checkpointer` (at its step, or `step`)."""
    saved_step, state = load_safetensors(path, token=token)
    step = saved_step if step is None else step
    if step is None:
        raise ValueError(f"{os.fspath(path)!r} records no step; pass step=.")
    return checkpointer.save(step, state)
