"""The job's shared secret for `shoal run` and `shoal store`: from --auth-token-file, else
SHOAL_AUTH_TOKEN (or SHOAL_AUTH_TOKEN_FILE for the store), else, for a one-node run only, a
fresh one."""

from __future__ import annotations

from shoal.core import settings as core_settings
from shoal.core.auth import generate_token, load_token
from shoal.core.errors import AuthenticationError
from shoal.launcher import flags

_FILE_FLAG = "argument --auth-token-file/--auth_token_file"


def run_token(settings: flags.RunSettings) -> str:
    """`shoal run`'s secret: --auth-token-file, else SHOAL_AUTH_TOKEN, else a fresh one (a
    usage error when several nodes must share it, or for a placeholder secret)."""
    if settings.auth_token_file is not None:
        token = _read(settings.auth_token_file)
        if not token:
            flags.run_parser().error(
                f"{_FILE_FLAG}: {settings.auth_token_file!r} is empty; put the job's secret "
                "in it")
        _check(token, _FILE_FLAG, flags.run_parser())
        return token.decode("utf-8", errors="surrogateescape")
    if core_settings.AUTH_TOKEN.is_set():
        token = core_settings.AUTH_TOKEN.get()
        _check(token, core_settings.AUTH_TOKEN.name, flags.run_parser())
        return token
    if settings.max_nodes > 1:
        flags.run_parser().error(
            f"{_FILE_FLAG}: a job of several nodes needs one shared secret; give "
            f"--auth-token-file or set {core_settings.AUTH_TOKEN.name} on every node")
    return generate_token()


def store_token(settings: flags.StoreSettings) -> bytes:
    """`shoal store`'s secret: --auth-token-file, else either variable; never the development
    fallback, since a standalone store is meant for other machines (a usage error without)."""
    if settings.auth_token_file is not None:
        token = _read(settings.auth_token_file)
    elif core_settings.AUTH_TOKEN.is_set() or core_settings.AUTH_TOKEN_FILE.is_set():
        try:
            token = load_token()
        except AuthenticationError as exc:  # a placeholder, or a file that cannot be read
            flags.store_parser().error(f"the job's secret: {exc}")
    else:
        token = b""
    if not token:
        flags.store_parser().error(
            f"{_FILE_FLAG}: the store needs the job's secret; give --auth-token-file or "
            f"set {core_settings.AUTH_TOKEN.name}")
    _check(token, "the job's secret", flags.store_parser())
    return token


def _check(token: bytes | str, source: str, parser) -> None:
    """A usage error now for a secret core.auth refuses (a manifest's placeholder), instead of
    the store dial refusing it later, which reads as an unreachable store."""
    try:
        load_token(token)
    except AuthenticationError as exc:
        parser.error(f"{source}: {exc}")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read().strip()
