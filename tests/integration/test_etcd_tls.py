"""etcd over TLS with client certificates and user/password, as torch's etcd rendezvous
configures it (`--rdzv-conf cacert=...,cert=...,key=...`), against a real etcd that serves only
TLS, asks for client certificates, and has authentication enabled.

The throwaway CA and certificates are made with openssl for each test module.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from shoal.elastic.api import RendezvousError, RendezvousSettings
from shoal.elastic.rendezvous.registry import create_backend, create_handler
from tests.support.etcd_server import require_etcd
from tests.support.requirements import missing
from tests.support.shoal_run import ROOT, WORKERS

PASSWORD = "pw-" + uuid.uuid4().hex[:8]
_SERVING = re.compile(rb"serving client requests on 127\.0\.0\.1:(\d+)")


def _openssl(*args, cwd):
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def _make_certs(d):
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=shoal-test-ca", cwd=d)
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=shoal-{name}", cwd=d)
        (d / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
                 f"{name}.ext", cwd=d)
    # A CA nobody trusts, to check that a wrong one is refused.
    _openssl("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.pem", "-days", "1",
             "-subj", "/CN=other-ca", cwd=d)


def _enable_auth(endpoint, d):
    """root user with a password, then authentication on (etcdctl is not installed here)."""
    import grpc
    from aetcd import rpc

    from shoal.elastic.rendezvous.etcd_client import run

    async def enable():
        creds = grpc.ssl_channel_credentials((d / "ca.pem").read_bytes(),
                                             (d / "client.key").read_bytes(),
                                             (d / "client.pem").read_bytes())
        async with rpc.secure_channel(endpoint, creds) as channel:
            auth = rpc.AuthStub(channel)
            await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=PASSWORD), timeout=5)
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"),
                                     timeout=5)
            await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)

    run(enable(), 15)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    binary = require_etcd()
    if shutil.which("openssl") is None:
        missing("the etcd TLS tests", "openssl is needed to make the test certificates "
                "(apt-get install openssl)")
    d = tmp_path_factory.mktemp("etcd-tls")
    _make_certs(d)
    log_path = d / "etcd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [binary, "--name", "tls", "--data-dir", str(d / "data"),
             "--listen-client-urls", "https://127.0.0.1:0",
             "--advertise-client-urls", "https://127.0.0.1:0",
             "--listen-peer-urls", "http://127.0.0.1:0",
             "--initial-advertise-peer-urls", "http://127.0.0.1:0",
             "--initial-cluster", "tls=http://127.0.0.1:0",
             "--cert-file", str(d / "server.pem"), "--key-file", str(d / "server.key"),
             "--trusted-ca-file", str(d / "ca.pem"), "--client-cert-auth"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        port = None
        while port is None:
            match = _SERVING.search(log_path.read_bytes())
            if match:
                port = int(match.group(1))
                break
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        endpoint = f"127.0.0.1:{port}"
        _enable_auth(endpoint, d)
        yield endpoint, d
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _options(d, **changes):
    options = dict(cacert=str(d / "ca.pem"), cert=str(d / "client.pem"),
                   key=str(d / "client.key"), user="root", password=PASSWORD)
    options.update(changes)
    return {k: v for k, v in options.items() if v is not None}


def test_a_round_and_the_store_over_tls_with_a_password(tls_etcd):
    endpoint, d = tls_etcd
    settings = RendezvousSettings("tls-job", 1, 1, last_call_timeout=0)
    handler = create_handler("etcd", f"https://{endpoint}", settings, "node-a", timeout=5,
                             **_options(d))
    try:
        info = handler.next_rendezvous()
        assert (info.round, info.participants) == (0, ["node-a"])
        handler.job_store.set("k", b"v")
        assert handler.job_store.get("k", 5) == b"v"
    finally:
        handler.shutdown()


@pytest.mark.parametrize("changes, words", [
    ({"password": "wrong", "user": "root"}, "authentication failed"),
    ({"cacert": "other.pem"}, "did not answer"),
    ({"cert": None, "key": None}, "did not answer"),
    # https with the system's CAs: they do not trust the test CA.
    ({"protocol": "https", "cacert": None}, "did not answer"),
    # http (no TLS) to a server that only speaks TLS.
    ({"protocol": "http", "cacert": None, "cert": None, "key": None}, "did not answer"),
])
def test_wrong_credentials_fail_with_the_endpoint_named(tls_etcd, changes, words):
    endpoint, d = tls_etcd
    changes = {k: (str(d / v) if v and v.endswith(".pem") else v) for k, v in changes.items()}
    started = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        backend, store = create_backend("etcd", endpoint, "tls-bad", timeout=2,
                                        **_options(d, **changes))
        backend.close()
    assert endpoint in str(info.value) and words in str(info.value).lower()
    assert time.monotonic() - started < 15


def test_shoal_run_over_tls(tls_etcd, tmp_path):
    endpoint, d = tls_etcd
    conf = ",".join(f"{k}={v}" for k, v in _options(d).items())
    done = subprocess.run(
        [sys.executable, "-m", "shoal.launcher", "run", "--rdzv-backend=etcd",
         f"--rdzv-endpoint={endpoint}", "--rdzv-id=tls-run", f"--rdzv-conf={conf}",
         "--nproc-per-node=2", str(WORKERS / "torchrun_worker.py"), "--meet"],
        cwd=ROOT, env={**os.environ, "SHOAL_AUTH_TOKEN": "tls-" + uuid.uuid4().hex},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count('"sum": 1') == 2


def _torch_conf(d) -> str:
    """torch's etcd-v2 spellings: protocol=https and ca_cert/ssl_cert/ssl_cert_key (plus
    shoal's user/password, which this etcd also asks for)."""
    return (f"protocol=https,ca_cert={d / 'ca.pem'},ssl_cert={d / 'client.pem'},"
            f"ssl_cert_key={d / 'client.key'},user=root,password={PASSWORD}")


def test_protocol_https_with_torchs_spellings_and_an_etcd_prefix(tls_etcd):
    endpoint, d = tls_etcd
    settings = RendezvousSettings("tls-prefix", 1, 1, last_call_timeout=0)
    handler = create_handler("etcd", endpoint, settings, "node-a", timeout=5,
                             protocol="https", ca_cert=str(d / "ca.pem"),
                             ssl_cert=str(d / "client.pem"), ssl_cert_key=str(d / "client.key"),
                             user="root", password=PASSWORD, etcd_prefix="/torchelastic/p2p")
    try:
        # The server speaks only TLS: a round means the channel was TLS.
        assert handler.next_rendezvous().participants == ["node-a"]
        handler.job_store.set("k", b"v")
        # The run's keys are under the prefix, read back over a client of our own.
        from shoal.elastic.rendezvous.etcd_client import EtcdClient
        from shoal.elastic.rendezvous.etcd_secure import EtcdSecurity

        client = EtcdClient([endpoint], 5, EtcdSecurity(**_options(d), protocol="https"))
        try:
            keys = client.call(lambda c: c.get_prefix(b"/torchelastic/p2p/tls-prefix/",
                                                      keys_only=True), "a key listing")
            names = sorted(kv.key.decode() for kv in keys)
        finally:
            client.close()
        assert "/torchelastic/p2p/tls-prefix/rdzv/state" in names
        assert any(n.startswith("/torchelastic/p2p/tls-prefix/store/") for n in names)
    finally:
        handler.shutdown()


def test_shoal_run_over_tls_with_torchs_etcd_v2_line(tls_etcd):
    endpoint, d = tls_etcd
    done = subprocess.run(
        [sys.executable, "-m", "shoal.launcher", "run", "--rdzv-backend=etcd-v2",
         f"--rdzv-endpoint={endpoint}", "--rdzv-id=tls-torch", f"--rdzv-conf={_torch_conf(d)}",
         "--nproc-per-node=2", str(WORKERS / "torchrun_worker.py"), "--meet"],
        cwd=ROOT, env={**os.environ, "SHOAL_AUTH_TOKEN": "tls-" + uuid.uuid4().hex},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count('"sum": 1') == 2
    assert "(etcd-v2 (etcd) backend" in done.stderr
