"""`core.use_deterministic_algorithms`: refuse (or warn about) ops whose results vary run to run.

On the host every core op is deterministic: numpy's reductions and BLAS calls give the same
bits for the same inputs and thread count. The ops that are not are on cuda, where cupy adds
floating-point values with atomics in an unspecified order (cupyx.scatter_add, behind indexing's
and embedding's backward). With the flag on such an op raises `NondeterministicError` naming
itself, as torch's alert does; with warn_only=True it warns instead.
"""

from __future__ import annotations

import warnings

from shoal.core.errors import ShoalError


class NondeterministicError(ShoalError, RuntimeError):
    """An op with no deterministic form ran while core.use_deterministic_algorithms(True)."""


class _Flags:
    enabled = False
    warn_only = False


def use_deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
    """Make ops with no deterministic form raise (or warn, with warn_only) when they run."""
    if not isinstance(mode, bool):
        raise TypeError(f"use_deterministic_algorithms: mode must be a bool, got {mode!r}.")
    _Flags.enabled = mode
    _Flags.warn_only = bool(warn_only) and mode


def are_deterministic_algorithms_enabled() -> bool:
    """Whether use_deterministic_algorithms(True) is in force."""
    return _Flags.enabled


def is_deterministic_algorithms_warn_only_enabled() -> bool:
    """Whether the deterministic mode only warns."""
    return _Flags.warn_only


def alert_not_deterministic(op: str) -> None:
    """Called by an op with no deterministic form: raise or warn when the flag is on."""
    if not _Flags.enabled:
        return
    msg = (
        f"{op} does not have a deterministic implementation, but you set "
        "'core.use_deterministic_algorithms(True)'. Turn it off for this op with "
        "core.use_deterministic_algorithms(False), or pass warn_only=True to be warned instead."
    )
    if _Flags.warn_only:
        warnings.warn(msg, UserWarning, stacklevel=3)
        return
    raise NondeterministicError(msg)
