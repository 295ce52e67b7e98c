"""The job's shared secret and the HMAC challenge every listening socket runs first.

Protocol (fixed sizes, so nothing variable is parsed before the peer is trusted):

    server -> client   MAGIC (4 bytes) + server nonce (32 bytes)
    client -> server   client nonce (32) + HMAC(secret, b"c" + purpose + s_nonce + c_nonce) (32)
    server -> client   HMAC(secret, b"s" + purpose + c_nonce + s_nonce) (32)

Both sides prove they hold the secret (mutual), the nonces stop replays, and `purpose` binds a
proof to one kind of port (store, collectives, rpc-data) so a proof for one cannot open another.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import threading
from typing import Optional

from core.errors import AuthenticationError

logger = logging.getLogger(__name__)

MAGIC = b"SHL1"
NONCE_BYTES = 32
DIGEST_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0

# Used only when the user set no secret at all; `shoal run` always sets a per-job one.
_INSECURE_DEFAULT = b"shoal-insecure-default-token"
_warned_default = threading.Event()


def load_token(explicit: Optional[bytes | str] = None) -> bytes:
    """Return the job's secret: `explicit`, else SHOAL_AUTH_TOKEN, else SHOAL_AUTH_TOKEN_FILE.

    Without any of them a fixed development token is used and a warning logged once, so that a
    bare `init_process_group("env://")` works the way torch users expect on one machine.
    """
    if explicit is not None:
        token = explicit.encode() if isinstance(explicit, str) else bytes(explicit)
    elif os.environ.get("SHOAL_AUTH_TOKEN"):
        token = os.environ["SHOAL_AUTH_TOKEN"].encode()
    elif os.environ.get("SHOAL_AUTH_TOKEN_FILE"):
        path = os.environ["SHOAL_AUTH_TOKEN_FILE"]
        try:
            with open(path, "rb") as f:
                token = f.read().strip()
        except OSError as exc:
            raise AuthenticationError(
                f"SHOAL_AUTH_TOKEN_FILE names {path!r}, which cannot be read: {exc}"
            ) from exc
    else:
        master = os.environ.get("MASTER_ADDR")
        if master and not is_loopback(master):
            # A secret anyone can read in the source protects nothing on a real network.
            raise AuthenticationError(
                f"MASTER_ADDR is {master!r}, not a loopback address, and no secret is set: set "
                "SHOAL_AUTH_TOKEN or SHOAL_AUTH_TOKEN_FILE on every process (shoal run does it "
                "for you); the development token is only allowed on one machine."
            )
        if not _warned_default.is_set():
            _warned_default.set()
            logger.warning(
                "No SHOAL_AUTH_TOKEN is set: using the insecure development token. "
                "Set SHOAL_AUTH_TOKEN (shoal run does this for you) on shared networks."
            )
        token = _INSECURE_DEFAULT
    if not token:
        raise AuthenticationError("The auth token is empty; give a non-empty secret.")
    return token


def is_loopback(host: str) -> bool:
    """True for a name or address of this machine's loopback interface."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def generate_token() -> str:
    """A fresh random secret for one job (hex, 64 characters)."""
    return secrets.token_hex(32)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise AuthenticationError(
                f"The peer closed the connection during the auth handshake after {got} of {n} bytes."
            )
        got += k
    return bytes(buf)


def _mac(token: bytes, tag: bytes, purpose: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, tag + purpose + a + b, hashlib.sha256).digest()


def server_handshake(
    sock: socket.socket, token: bytes, purpose: str, timeout: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Challenge a freshly accepted peer; return only if it proves it holds `token`.

    The socket's previous timeout is restored on success.

    Raises:
        AuthenticationError: wrong proof, a closed connection, or no answer within `timeout`.
    """
    old_timeout = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        s_nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(MAGIC + s_nonce)
        reply = _recv_exact(sock, NONCE_BYTES + DIGEST_BYTES)
        c_nonce, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        expected = _mac(token, b"c", purpose.encode(), s_nonce, c_nonce)
        if not hmac.compare_digest(proof, expected):
            raise AuthenticationError(
                f"The peer's proof for {purpose!r} does not match this job's secret."
            )
        sock.sendall(_mac(token, b"s", purpose.encode(), c_nonce, s_nonce))
    except socket.timeout as exc:
        raise AuthenticationError(
            f"The peer sent no auth proof for {purpose!r} within {timeout:g}s."
        ) from exc
    except OSError as exc:
        if isinstance(exc, AuthenticationError):
            raise
        raise AuthenticationError(f"The auth handshake for {purpose!r} failed: {exc}") from exc
    sock.settimeout(old_timeout)


def client_handshake(
    sock: socket.socket, token: bytes, purpose: str, timeout: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Answer a server's challenge and check the server's own proof.

    Raises:
        AuthenticationError: the server is not a shoal port, holds another secret, or is silent.
    """
    old_timeout = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            raise AuthenticationError(
                f"The server for {purpose!r} did not greet with shoal's handshake; "
                "is this the right port?"
            )
        s_nonce = hello[len(MAGIC):]
        c_nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(c_nonce + _mac(token, b"c", purpose.encode(), s_nonce, c_nonce))
        server_proof = _recv_exact(sock, DIGEST_BYTES)
    except socket.timeout as exc:
        raise AuthenticationError(
            f"The server for {purpose!r} did not finish the auth handshake within {timeout:g}s."
        ) from exc
    except AuthenticationError as exc:
        raise AuthenticationError(
            f"The server for {purpose!r} rejected this job's secret or closed the connection "
            f"({exc})."
        ) from exc
    except OSError as exc:
        raise AuthenticationError(f"The auth handshake for {purpose!r} failed: {exc}") from exc
    if not hmac.compare_digest(server_proof, _mac(token, b"s", purpose.encode(), c_nonce, s_nonce)):
        raise AuthenticationError(
            f"The server for {purpose!r} does not hold this job's secret."
        )
    sock.settimeout(old_timeout)


def sign(token: bytes, purpose: str, payload: bytes) -> bytes:
    """HMAC-SHA256 of `payload` for transports whose handshake is a message (gRPC metadata)."""
    return hmac.new(token, purpose.encode() + b"\0" + payload, hashlib.sha256).digest()


def verify(token: bytes, purpose: str, payload: bytes, signature: bytes) -> bool:
    """Constant-time check of a `sign` result."""
    return hmac.compare_digest(sign(token, purpose, payload), signature)
