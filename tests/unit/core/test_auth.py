"""The shared-secret handshake every listening socket runs, and where the secret comes from."""

import socket
import threading

import pytest

from shoal.core import auth
from shoal.core.errors import AuthenticationError, HandshakeInterrupted


def _pair():
    return socket.socketpair()


def _run_server(sock, token, purpose, out):
    try:
        auth.server_handshake(sock, token, purpose, timeout=5)
        out.append("ok")
    except AuthenticationError as exc:
        out.append(exc)
        sock.close()  # what every server does with a peer that failed


def test_matching_secrets_authenticate_both_ways():
    server, client = _pair()
    out = []
    t = threading.Thread(target=_run_server, args=(server, b"s3cret", "store", out))
    t.start()
    auth.client_handshake(client, b"s3cret", "store", timeout=5)
    t.join(5)
    assert out == ["ok"]


def test_a_wrong_secret_fails_on_both_sides():
    server, client = _pair()
    out = []
    t = threading.Thread(target=_run_server, args=(server, b"right", "store", out))
    t.start()
    with pytest.raises(AuthenticationError, match="refused this process's secret; check that "
                       "every process uses the same SHOAL_AUTH_TOKEN"):
        auth.client_handshake(client, b"wrong", "store", timeout=5)
    t.join(5)
    assert isinstance(out[0], AuthenticationError)
    assert "does not match this job's secret" in str(out[0])


def test_a_proof_for_one_purpose_does_not_open_another():
    server, client = _pair()
    out = []
    t = threading.Thread(target=_run_server, args=(server, b"k", "collectives", out))
    t.start()
    with pytest.raises(AuthenticationError):
        auth.client_handshake(client, b"k", "store", timeout=5)
    t.join(5)
    assert isinstance(out[0], AuthenticationError)


def test_garbage_and_silence_are_rejected_without_parsing():
    server, client = _pair()
    out = []
    t = threading.Thread(target=_run_server, args=(server, b"k", "store", out))
    t.start()
    client.recv(auth.GREETING_BYTES)
    client.sendall(b"\x00" * 10)
    client.close()
    t.join(5)
    assert "closed the connection before its auth proof" in str(out[0])

    server, client = _pair()
    with pytest.raises(AuthenticationError, match="sent no auth proof for 'store' within 0.2s"):
        auth.server_handshake(server, b"k", "store", timeout=0.2)


def _handshake_both(server_kwargs, client_kwargs):
    server, client = _pair()
    out = []

    def serve():
        try:
            out.append(auth.server_handshake(server, b"k", "store", timeout=5, **server_kwargs))
        except AuthenticationError as exc:
            out.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    try:
        return auth.client_handshake(client, b"k", "store", timeout=5, **client_kwargs), out
    finally:
        client.close()  # a client that gave up must not leave the server waiting for its proof
        t.join(5)
        server.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_handshake_ends_in_keys_both_ends_share(encrypt):
    client_link, out = _handshake_both(dict(encrypt=encrypt), dict(encrypt=encrypt))
    server_link = out[0]
    assert client_link.encrypt is encrypt and server_link.encrypt is encrypt
    server_link.opener.check([b"frame"], client_link.sealer.tag([b"frame"]))
    client_link.opener.check([b"reply"], server_link.sealer.tag([b"reply"]))


def test_ends_that_disagree_on_encryption_are_told_so_before_any_proof():
    with pytest.raises(AuthenticationError, match="The server for 'store' encrypts its "
                       "connections and this process does not encrypt: set SHOAL_ENCRYPT"):
        _handshake_both(dict(encrypt=True), dict(encrypt=False))


def test_client_refuses_a_server_that_is_not_shoal():
    server, client = _pair()
    server.sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 40)
    with pytest.raises(AuthenticationError, match="did not greet with shoal's handshake"):
        auth.client_handshake(client, b"k", "store", timeout=2)


def test_token_sources_and_the_development_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("SHOAL_AUTH_TOKEN", "from-env")
    assert auth.load_token() == b"from-env"
    assert auth.load_token("explicit") == b"explicit"
    monkeypatch.delenv("SHOAL_AUTH_TOKEN")
    path = tmp_path / "token"
    path.write_text("from-file\n")
    monkeypatch.setenv("SHOAL_AUTH_TOKEN_FILE", str(path))
    assert auth.load_token() == b"from-file"
    monkeypatch.setenv("SHOAL_AUTH_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(AuthenticationError, match="cannot be read"):
        auth.load_token()
    monkeypatch.delenv("SHOAL_AUTH_TOKEN_FILE")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert auth.load_token() == auth._INSECURE_DEFAULT
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    with pytest.raises(AuthenticationError, match="'10.0.0.7', not a loopback address"):
        auth.load_token()


def test_a_server_that_closes_before_its_verdict_is_not_blamed_on_the_secret():
    # What a client sees when a loaded server sheds its pending handshake: retry, not "check
    # your secret".
    server, client = _pair()
    server.sendall(auth.MAGIC + auth.MODE_TAGGED + b"n" * auth.NONCE_BYTES)
    server.close()
    with pytest.raises(HandshakeInterrupted, match="before its verdict"):
        auth.client_handshake(client, b"k", "store", timeout=2)
    server, client = _pair()
    server.close()
    with pytest.raises(HandshakeInterrupted, match="closed the connection before its greeting"):
        auth.client_handshake(client, b"k", "store", timeout=2)


def test_a_server_that_accepts_but_never_speaks_is_not_blamed_on_the_secret():
    server, client = _pair()
    with pytest.raises(HandshakeInterrupted, match="accepted the connection but sent no "
                       "greeting within 0.2s; is it a shoal port"):
        auth.client_handshake(client, b"k", "store", timeout=0.2)
    server.close()


def _connect_shedding(first_shed: int, attempts: list):
    """A connect function whose first `first_shed` servers drop the connection unjudged."""

    def connect(timeout):
        server, client = _pair()
        attempts.append(server)
        if len(attempts) <= first_shed:
            server.close()
        else:
            threading.Thread(target=_run_server, args=(server, b"k", "store", []),
                             daemon=True).start()
        return client

    return connect


def test_dial_retries_a_shed_connection_and_never_a_refused_secret():
    attempts = []
    auth.dial_link(_connect_shedding(2, attempts), b"k", "store", timeout=5)[0].close()
    assert len(attempts) == 3
    attempts = []
    with pytest.raises(AuthenticationError, match="refused this process's secret"):
        auth.dial_link(_connect_shedding(0, attempts), b"wrong", "store", timeout=5)
    assert len(attempts) == 1  # a refused secret is final


def test_dial_gives_up_when_its_timeout_runs_out():
    def connect(timeout):
        server, client = _pair()
        server.close()
        return client

    with pytest.raises(HandshakeInterrupted, match="before its greeting"):
        auth.dial_link(connect, b"k", "store", timeout=0.2)


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "10.1.2.3", "myhost.example"])
def test_the_development_token_is_refused_off_loopback(host):
    with pytest.raises(AuthenticationError, match="not a loopback address, and no secret is set: "
                       "set SHOAL_AUTH_TOKEN or SHOAL_AUTH_TOKEN_FILE"):
        auth.require_secret_for(auth._INSECURE_DEFAULT, host, "a store")
    auth.require_secret_for(b"a real secret", host, "a store")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_the_development_token_serves_loopback(host):
    auth.require_secret_for(auth._INSECURE_DEFAULT, host, "a store")


def test_the_manifest_placeholder_is_no_secret(monkeypatch):
    monkeypatch.setenv("SHOAL_AUTH_TOKEN", "REPLACE-WITH-OUTPUT-OF-openssl-rand-hex-32")
    with pytest.raises(AuthenticationError, match="is the placeholder .* which everyone can read"):
        auth.load_token()
