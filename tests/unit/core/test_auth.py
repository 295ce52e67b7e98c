"""The shared-secret handshake every listening socket runs, and where the secret comes from."""

import socket
import threading

import pytest

from core import auth
from core.errors import AuthenticationError


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
    with pytest.raises(AuthenticationError, match="rejected this job's secret|does not hold"):
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
    client.recv(36)
    client.sendall(b"\x00" * 10)
    client.close()
    t.join(5)
    assert "closed the connection during the auth handshake" in str(out[0])

    server, client = _pair()
    with pytest.raises(AuthenticationError, match="sent no auth proof for 'store' within 0.2s"):
        auth.server_handshake(server, b"k", "store", timeout=0.2)


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
