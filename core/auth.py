"""The job's shared secret and the HMAC challenge every listening socket runs first.

Protocol (fixed sizes, so nothing variable is parsed before the peer is trusted):

    server -> client   MAGIC (4 bytes) + mode (1) + server nonce (32 bytes)
    client -> server   client nonce (32) + HMAC(secret, b"c" + purpose + mode + s_nonce + c_nonce)
    server -> client   HMAC(secret, b"s" + purpose + mode + c_nonce + s_nonce) (32), or REFUSED

Both sides prove they hold the secret (mutual), the nonces stop replays, and `purpose` binds a
proof to one kind of port (store, collectives, rpc-data) so a proof for one cannot open another.
`mode` says whether the connection's frames are encrypted (SHOAL_ENCRYPT) as well as tagged;
both ends must agree, and a client that does not is told so before it proves anything.

A handshake ends in a `core.channel.Link`: keys derived from the secret and both nonces that
tag (or encrypt) every later frame, so a relay that forwarded the handshake cannot speak on the
connection afterwards (SHL3; SHL2 proved the secret but bound nothing after it).

The explicit REFUSED verdict (new in SHL2) lets a client tell "wrong secret" apart from "the
server dropped me before judging": a server under a flood of idle connections sheds the oldest
pending handshakes (see `core.admission`), and a client so dropped retries instead of being
told to check its secret. REFUSED is a fixed string, so it tells a wrong-secret client nothing
it did not know.
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
import time
from typing import Callable, Optional

from shoal.core import channel, settings
from shoal.core.errors import AuthenticationError, HandshakeInterrupted

logger = logging.getLogger(__name__)

MAGIC = b"SHL3"
NONCE_BYTES = 32
DIGEST_BYTES = 32
MODE_TAGGED = b"t"  # every frame carries an integrity tag
MODE_ENCRYPTED = b"e"  # every frame is encrypted (and so authenticated)
GREETING_BYTES = len(MAGIC) + 1 + NONCE_BYTES
REPLY_BYTES = NONCE_BYTES + DIGEST_BYTES
REFUSED = b"SHL3 refused: wrong secret......"
assert len(REFUSED) == DIGEST_BYTES
HANDSHAKE_TIMEOUT_S = 10.0
# How long a server waits for a client's proof after greeting it. A shoal client answers in
# microseconds; a connection that stays silent this long is an idle stranger holding a slot.
GREETING_TIMEOUT_S = 3.0

# Used only when the user set no secret at all; `shoal run` always sets a per-job one.
_INSECURE_DEFAULT = b"shoal-insecure-default-token"
# Placeholders that ship in deploy/ and documentation: known to everyone, so no secret.
_PLACEHOLDERS = frozenset({b"REPLACE-WITH-OUTPUT-OF-openssl-rand-hex-32", b"change-me", b"changeme"})
_warned_default = threading.Event()

_HOW_TO_SET = (
    "set SHOAL_AUTH_TOKEN or SHOAL_AUTH_TOKEN_FILE to the same random secret on every process "
    "(for example `openssl rand -hex 32`; shoal run does it for you)"
)


def load_token(explicit: Optional[bytes | str] = None) -> bytes:
    """Return the job's secret: `explicit`, else SHOAL_AUTH_TOKEN, else SHOAL_AUTH_TOKEN_FILE.

    Without any of them a fixed development token is used and a warning logged once, so that a
    bare `init_process_group("env://")` works the way torch users expect on one machine; every
    listener bound to a non-loopback address refuses it (`require_secret_for`).
    """
    if explicit is not None:
        token = explicit.encode() if isinstance(explicit, str) else bytes(explicit)
    elif settings.AUTH_TOKEN.is_set():
        token = settings.AUTH_TOKEN.get().encode()
    elif settings.AUTH_TOKEN_FILE.is_set():
        path = settings.AUTH_TOKEN_FILE.get()
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
                f"MASTER_ADDR is {master!r}, not a loopback address, and no secret is set: "
                f"{_HOW_TO_SET}; the development token is only allowed on one machine."
            )
        if not _warned_default.is_set():
            _warned_default.set()
            logger.warning(
                "No SHOAL_AUTH_TOKEN is set: using the insecure development token, which only "
                "loopback addresses accept. Set SHOAL_AUTH_TOKEN (shoal run does this for you)."
            )
        token = _INSECURE_DEFAULT
    if not token:
        raise AuthenticationError("The auth token is empty; give a non-empty secret.")
    if token.strip() in _PLACEHOLDERS:
        raise AuthenticationError(
            f"The auth token is the placeholder {token.strip().decode(errors='replace')!r} from "
            f"shoal's manifests, which everyone can read: {_HOW_TO_SET}."
        )
    return token


def is_development_token(token: bytes) -> bool:
    """True for the fixed token used when no secret was set."""
    return hmac.compare_digest(token, _INSECURE_DEFAULT)


def require_secret_for(token: bytes, host: str, what: str) -> None:
    """Refuse the development token for `what` (a listener or a dial) at a non-loopback host.

    The development token is in shoal's source: on an address other machines can reach it
    would let anyone who read the source in (and run code through RPC or a pickle).

    Raises:
        AuthenticationError: `token` is the development token and `host` is not loopback.
    """
    if is_development_token(token) and not is_loopback(host):
        shown = host if host else "all interfaces"
        raise AuthenticationError(
            f"{what} uses {shown!r}, which is not a loopback address, and no secret is set: "
            f"{_HOW_TO_SET}. The built-in development token is accepted on loopback only."
        )


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


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise HandshakeInterrupted(
                f"the peer closed the connection before {what} ({got} of {n} bytes arrived)"
            )
        got += k
    return bytes(buf)


def _mac(token: bytes, tag: bytes, purpose: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, tag + purpose + a + b, hashlib.sha256).digest()


def local_mode(encrypt: Optional[bool] = None) -> bytes:
    """This process's channel mode: `encrypt`, else the SHOAL_ENCRYPT setting."""
    if encrypt is None:
        encrypt = settings.ENCRYPT.get()
    return MODE_ENCRYPTED if encrypt else MODE_TAGGED


def _describe(mode: bytes) -> str:
    return "encrypts its connections" if mode == MODE_ENCRYPTED else "does not encrypt"


class ServerChallenge:
    """The server's side of one handshake, split in steps so a non-blocking loop can drive it.

    Send `greeting`, read `REPLY_BYTES`, then `verdict(reply)` gives the bytes to send back: the
    server's proof when the client proved the secret, else REFUSED (and `admitted` stays False).
    """

    def __init__(self, token: bytes, purpose: str, encrypt: Optional[bool] = None):
        self._token = token
        self._purpose = purpose
        self._mode = local_mode(encrypt)
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self._c_nonce = b""
        self.greeting = MAGIC + self._mode + self._nonce
        self.admitted = False

    def verdict(self, reply: bytes) -> bytes:
        c_nonce, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:REPLY_BYTES]
        bound = self._purpose.encode() + self._mode
        expected = _mac(self._token, b"c", bound, self._nonce, c_nonce)
        if not hmac.compare_digest(proof, expected):
            return REFUSED
        self.admitted = True
        self._c_nonce = c_nonce
        return _mac(self._token, b"s", bound, c_nonce, self._nonce)

    def link(self, peer: str = "the peer") -> channel.Link:
        """The admitted connection's keys (call after a verdict that admitted the client)."""
        if not self.admitted:
            raise AuthenticationError("no link: the client has not proved the secret")
        return channel.pair(self._token, self._purpose, self._nonce, self._c_nonce, server=True,
                            encrypt=self._mode == MODE_ENCRYPTED, peer=peer)


def server_handshake(
    sock: socket.socket, token: bytes, purpose: str, timeout: float = HANDSHAKE_TIMEOUT_S,
    *, encrypt: Optional[bool] = None, peer: str = "the client",
) -> channel.Link:
    """Challenge a freshly accepted peer on a blocking socket; return the connection's keys,
    only if the peer holds `token`.

    Listening ports use `core.admission.Gatekeeper`, which runs the same steps for many peers
    at once; this blocking form serves tests and one-off tools. The socket's previous timeout
    is restored on success.

    Raises:
        AuthenticationError: wrong proof, a closed connection, or no answer within `timeout`.
    """
    old_timeout = sock.gettimeout()
    sock.settimeout(timeout)
    challenge = ServerChallenge(token, purpose, encrypt)
    try:
        sock.sendall(challenge.greeting)
        reply = _recv_exact(sock, REPLY_BYTES, "its auth proof")
        sock.sendall(challenge.verdict(reply))
    except socket.timeout as exc:
        raise AuthenticationError(
            f"The peer sent no auth proof for {purpose!r} within {timeout:g}s."
        ) from exc
    except OSError as exc:
        raise AuthenticationError(f"The auth handshake for {purpose!r} failed: {exc}") from exc
    if not challenge.admitted:
        raise AuthenticationError(
            f"The peer's proof for {purpose!r} does not match this job's secret."
        )
    sock.settimeout(old_timeout)
    return challenge.link(peer)


def client_handshake(
    sock: socket.socket, token: bytes, purpose: str, timeout: float = HANDSHAKE_TIMEOUT_S,
    *, encrypt: Optional[bool] = None, peer: str = "the server",
) -> channel.Link:
    """Answer a server's challenge, check the server's own proof, and return the keys of the
    connection.

    Raises:
        AuthenticationError: the server is not a shoal port, refused this secret, or holds
            another one.
        HandshakeInterrupted: the server closed the connection or stayed silent before its
            verdict (worth retrying: it may be shedding load).
    """
    old_timeout = sock.gettimeout()
    sock.settimeout(timeout)
    step = "greeting"
    try:
        hello = _recv_exact(sock, GREETING_BYTES, "its greeting")
        if hello[: len(MAGIC)] != MAGIC:
            raise AuthenticationError(
                f"The server for {purpose!r} did not greet with shoal's handshake "
                f"(it sent {hello[:len(MAGIC)]!r}); is this the right port, and the same shoal "
                "version?"
            )
        mode, s_nonce = hello[len(MAGIC):len(MAGIC) + 1], hello[len(MAGIC) + 1:]
        mine = local_mode(encrypt)
        if mode != mine:
            raise AuthenticationError(
                f"The server for {purpose!r} {_describe(mode)} and this process "
                f"{_describe(mine)}: set SHOAL_ENCRYPT to the same value on every process.")
        c_nonce = secrets.token_bytes(NONCE_BYTES)
        step = "verdict"
        bound = purpose.encode() + mode
        sock.sendall(c_nonce + _mac(token, b"c", bound, s_nonce, c_nonce))
        verdict = _recv_exact(sock, DIGEST_BYTES, "its verdict")
    except socket.timeout as exc:
        raise HandshakeInterrupted(
            f"The server for {purpose!r} accepted the connection but sent no {step} within "
            f"{timeout:g}s; is it a shoal port, and is it overloaded?"
        ) from exc
    except HandshakeInterrupted as exc:
        raise HandshakeInterrupted(f"The server for {purpose!r}: {exc}.") from exc
    except AuthenticationError:
        raise
    except OSError as exc:
        raise HandshakeInterrupted(
            f"The auth handshake for {purpose!r} broke before its {step}: {exc}"
        ) from exc
    if hmac.compare_digest(verdict, REFUSED):
        raise AuthenticationError(
            f"The server for {purpose!r} refused this process's secret; check that every "
            "process uses the same SHOAL_AUTH_TOKEN."
        )
    if not hmac.compare_digest(verdict, _mac(token, b"s", bound, c_nonce, s_nonce)):
        raise AuthenticationError(
            f"The server for {purpose!r} does not hold this job's secret."
        )
    sock.settimeout(old_timeout)
    return channel.pair(token, purpose, s_nonce, c_nonce, server=False,
                        encrypt=mode == MODE_ENCRYPTED, peer=peer)


def dial_link(
    connect: Callable[[float], socket.socket],
    token: bytes,
    purpose: str,
    timeout: float,
    *,
    prepare: Optional[Callable[[socket.socket], None]] = None,
    peer: str = "the server",
) -> tuple[socket.socket, channel.Link]:
    """Connect with `connect(timeout_left)` and run the client handshake, retrying a server that
    dropped the connection before its verdict (it sheds load) until `timeout` runs out; return
    the socket and the keys its frames must carry.

    Connection errors (refused, unreachable) are raised at once: callers that expect a server
    that is not up yet retry those themselves.

    Raises:
        AuthenticationError: the server refused the secret (never retried).
        HandshakeInterrupted: every attempt within `timeout` was dropped before a verdict.
        OSError: the connection itself failed.
    """
    end = time.monotonic() + timeout
    delay = 0.005
    while True:
        left = end - time.monotonic()
        sock = connect(max(0.01, left))
        try:
            if prepare is not None:
                prepare(sock)
            link = client_handshake(sock, token, purpose,
                                    timeout=max(0.01, min(left, HANDSHAKE_TIMEOUT_S)), peer=peer)
            return sock, link
        except HandshakeInterrupted:
            sock.close()
            left = end - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.25)
        except BaseException:
            sock.close()
            raise


def sign(token: bytes, purpose: str, payload: bytes) -> bytes:
    """HMAC-SHA256 of `payload` for transports whose handshake is a message (gRPC metadata)."""
    return hmac.new(token, purpose.encode() + b"\0" + payload, hashlib.sha256).digest()


def verify(token: bytes, purpose: str, payload: bytes, signature: bytes) -> bool:
    """Constant-time check of a `sign` result."""
    return hmac.compare_digest(sign(token, purpose, payload), signature)
