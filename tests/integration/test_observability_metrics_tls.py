"""The metrics port behind TLS with client certificates (Prometheus' exporter web config
format, SHOAL_METRICS_WEB_CONFIG): a real Prometheus scrapes it with its own tls_config, a
client without a certificate and plain HTTP get nothing, and bad configs fail with messages
that name the problem. Certificates come from the openssl command line."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest

from shoal.elastic import metrics
from tests.support.prometheus_server import PrometheusServer
from tests.support.requirements import missing


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        missing("the metrics TLS tests", "openssl is needed to make the test certificates "
                "(apt-get install openssl)")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=d)
    (d / "web.yml").write_text(
        "tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n"
        "  client_ca_file: ca.pem\n")
    return d


class TLSPrometheus(PrometheusServer):
    """PrometheusServer whose scrape job speaks HTTPS with a client certificate."""

    def __init__(self, targets, pki):
        super().__init__(targets)
        with open(self.config_path) as f:
            config = f.read()
        config = config.replace(
            "    static_configs:\n",
            "    scheme: https\n    tls_config:\n"
            f"      ca_file: {pki / 'ca.pem'}\n      cert_file: {pki / 'client.pem'}\n"
            f"      key_file: {pki / 'client.key'}\n    static_configs:\n")
        with open(self.config_path, "w") as f:
            f.write(config)


def test_prometheus_scrapes_over_tls_with_a_client_certificate(pki, monkeypatch):
    monkeypatch.setenv(metrics.WEB_CONFIG_ENV, str(pki / "web.yml"))
    metrics.set_run_id("tls-run")
    server = metrics.MetricsServer("127.0.0.1", 0, None)
    try:
        assert server.url.startswith("https://127.0.0.1:")
        with TLSPrometheus([f"127.0.0.1:{server.port}"], pki) as prom:
            up = prom.wait_for_series('shoal_elastic_restarts_total{run_id="tls-run"}', 30)
            assert {r["metric"]["reason"] for r in up} >= {"worker_failure"}
            assert prom.query("up")[0]["value"][1] == "1"
        # A client that trusts the server but brings no certificate is refused.
        anonymous = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(server.url, timeout=5, context=anonymous).read()
        # Plain HTTP gets no metrics either.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(server.url.replace("https", "http"), timeout=5).read()
        # With the client certificate it answers.
        mutual = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        mutual.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        body = urllib.request.urlopen(server.url, timeout=5, context=mutual).read().decode()
        assert 'shoal_job_info' in body or 'shoal_elastic_restarts_total' in body
    finally:
        server.stop(linger=0)


@pytest.mark.parametrize("text, message", [
    ("tls_server_config:\n  cert_file: server.pem\n",
     "tls_server_config needs cert_file and key_file"),
    ("http_server_config: {}\n",
     "unknown key(s) ['http_server_config']; shoal reads tls_server_config and basic_auth_users"),
    ("tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n"
     "  client_auth_type: RequireAndVerifyClientCert\n",
     "client_auth_type RequireAndVerifyClientCert needs client_ca_file"),
    ("tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n"
     "  min_version: TLS13\n", "tls_server_config: unsupported key(s) ['min_version']"),
])
def test_bad_web_configs_are_refused_with_the_reason(pki, tmp_path, text, message):
    path = pki / f"bad-{abs(hash(text))}.yml"
    path.write_text(text)
    with pytest.raises(metrics.WebConfigError) as info:
        metrics.MetricsServer("127.0.0.1", 0, None, web_config=str(path))
    assert str(info.value) == f"Metrics web config {path}: {message}"


def test_basic_auth_users(pki, tmp_path):
    try:
        import bcrypt
    except ImportError:
        bcrypt = None
    hashed = (bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode() if bcrypt
              else "$2y$04$invalidinvalidinvalidinvalidinvalidinvalidinvalid12")
    path = tmp_path / "auth.yml"
    path.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")
    if bcrypt is None:
        # Without bcrypt the format's hashes cannot be checked: refuse rather than serve open.
        with pytest.raises(metrics.WebConfigError) as info:
            metrics.MetricsServer("127.0.0.1", 0, None, web_config=str(path))
        assert str(info.value) == (f"Metrics web config {path}: basic_auth_users needs the "
                                   "bcrypt package (pip install bcrypt)")
        return
    server = metrics.MetricsServer("127.0.0.1", 0, None, web_config=str(path))
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url, timeout=5)
        assert info.value.code == 401
        request = urllib.request.Request(server.url, headers={
            "Authorization": "Basic " + __import__("base64").b64encode(b"prom:s3cret").decode()})
        assert b"shoal_elastic_restarts_total" in urllib.request.urlopen(request, timeout=5).read()
        wrong = urllib.request.Request(server.url, headers={
            "Authorization": "Basic " + __import__("base64").b64encode(b"prom:nope").decode()})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(wrong, timeout=5)
    finally:
        server.stop(linger=0)
