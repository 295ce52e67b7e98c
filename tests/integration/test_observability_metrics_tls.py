"""The metrics port behind TLS with client certificates or basic auth (Prometheus' exporter web
config format, SHOAL_METRICS_WEB_CONFIG): a real Prometheus scrapes it with its own tls_config
and basic_auth (a `shoal run` job's workers included; a wrong password sees nothing), a client
without a certificate and plain HTTP get nothing, `shoal top` reads it with --cacert, --cert/--key
and --user with a password from a file or the environment, and bad configs and incomplete
credentials fail with messages that name the problem. Certificates come from the openssl
command line."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from shoal.elastic import metrics
from tests.support.prometheus_server import PrometheusServer
from tests.support.requirements import missing
from tests.support.shoal_run import ROOT, WORKERS, ShoalRun


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


# ------------------------------------------------------- shoal run behind TLS and basic auth

PASSWORD = "s3cret-metrics-pw"
METRICS_AT = r"Metrics of this node's agent and workers at (https://127\.0\.0\.1:(\d+)/metrics)"


@pytest.fixture(scope="module")
def basic_web_config(pki):
    """A web config with a server certificate (no client certificates) and one bcrypt user;
    the right and a wrong password in files beside it."""
    try:
        import bcrypt
    except ImportError:
        missing("the basic auth tests", "basic_auth_users needs bcrypt (pip install bcrypt; "
                "the test extra has it)")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    (pki / "web-basic.yml").write_text(
        "tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n"
        f"basic_auth_users:\n  prom: '{hashed}'\n")
    (pki / "password").write_text(PASSWORD + "\n")
    (pki / "wrong-password").write_text("not-it\n")
    return pki / "web-basic.yml"


class BasicAuthPrometheus(PrometheusServer):
    """Two scrape jobs of the same target over HTTPS: `shoal` with the right password (from a
    file, as a Prometheus config should hold it), `wrong` with a wrong one."""

    def __init__(self, target: str, pki):
        super().__init__([target])
        jobs = ""
        for job, password_file in (("shoal", "password"), ("wrong", "wrong-password")):
            jobs += (f"  - job_name: {job}\n    scheme: https\n"
                     f"    tls_config:\n      ca_file: {pki / 'ca.pem'}\n"
                     f"    basic_auth:\n      username: prom\n"
                     f"      password_file: {pki / password_file}\n"
                     f"    static_configs:\n      - targets: ['{target}']\n")
        with open(self.config_path) as f:
            head = f.read().split("scrape_configs:\n")[0]
        with open(self.config_path, "w") as f:
            f.write(head + "scrape_configs:\n" + jobs)


def _top_once(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shoal.launcher", "top", *args, "--once",
                           "--interval", "0.5"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_shoal_run_behind_basic_auth_is_scraped_by_prometheus_and_read_by_top(
        pki, basic_web_config, tmp_path):
    stop = tmp_path / "stop"
    args = ["--nproc-per-node", "2", "--metrics-port", "0", "--rdzv-id", "secured",
            str(WORKERS / "metrics_worker.py"), "--stop-file", str(stop)]
    env = {metrics.WEB_CONFIG_ENV: str(basic_web_config)}
    with ShoalRun(args, env=env, name="secured job") as run:
        try:
            match = run.wait_for(METRICS_AT, 30)
            url, target = match.group(1), f"127.0.0.1:{match.group(2)}"
            run.wait_for(r"\[rank 1\] rank 1 did 5 allreduces", 30)
            with BasicAuthPrometheus(target, pki) as prom:
                # The workers' series, through TLS and basic auth.
                ops = prom.wait_for_series(
                    'sum(shoal_collectives_op_duration_seconds_count{job="shoal", '
                    'run_id="secured", op="all_reduce"})', 30)
                assert float(ops[0]["value"][1]) >= 10
                up = prom.wait_for_series('up{job="wrong"}', 30)
                # The wrong password is refused and sees nothing.
                assert up[0]["value"][1] == "0"
                assert prom.query('{job="wrong", __name__=~"shoal_.+"}') == []
                assert prom.query('up{job="shoal"}')[0]["value"][1] == "1"

            cacert, password = str(pki / "ca.pem"), str(pki / "password")
            # shoal top with the CA and the password from a file, then from the environment.
            for extra, top_env in ((["--password-file", password], None),
                                   ([], {"SHOAL_METRICS_PASSWORD": PASSWORD})):
                out = _top_once(url, "--cacert", cacert, "--user", "prom", *extra, env=top_env)
                assert out.returncode == 0, out.stderr
                assert out.stdout.startswith("run secured  world 2  running 2"), out.stdout
            # A bare HOST:PORT with --cacert is https.
            out = _top_once(target, "--cacert", cacert, "--user", "prom", "--password-file",
                            password)
            assert out.returncode == 0, out.stderr
            # No password: 401; no CA: the server's certificate is not trusted.
            out = _top_once(url, "--cacert", cacert)
            assert out.returncode == 1
            assert out.stderr == f"shoal top: cannot read {url}: HTTP 401 Unauthorized\n"
            out = _top_once(url, "--user", "prom", "--password-file", password)
            assert out.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in out.stderr, out.stderr
        finally:
            stop.touch()
        assert run.wait(60) == 0, run.tail()


def test_shoal_top_reads_an_endpoint_that_requires_a_client_certificate(pki, monkeypatch):
    monkeypatch.setenv(metrics.WEB_CONFIG_ENV, str(pki / "web.yml"))
    metrics.set_run_id("mtls-run")
    server = metrics.MetricsServer("127.0.0.1", 0, None)
    try:
        cacert = str(pki / "ca.pem")
        out = _top_once(server.url, "--cacert", cacert, "--cert", str(pki / "client.pem"),
                        "--key", str(pki / "client.key"))
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("run mtls-run  world ?"), out.stdout
        refused = _top_once(server.url, "--cacert", cacert)  # no client certificate
        assert refused.returncode == 1
        assert refused.stderr.startswith(f"shoal top: cannot read {server.url}: "), refused.stderr
    finally:
        server.stop(linger=0)


@pytest.mark.parametrize("args, env, message", [
    (["--user", "prom"], {}, "--user 'prom' needs a password: give --password-file FILE or set "
     "SHOAL_METRICS_PASSWORD (never on the command line)."),
    (["--key", "client.key"], {}, "--key needs --cert (the client certificate the key belongs "
     "to)."),
    (["--password-file", "password"], {}, "--password-file needs --user (the basic auth user "
     "name)."),
    (["--user", "a:b"], {"SHOAL_METRICS_PASSWORD": "x"},
     "--user 'a:b': a basic auth user name cannot contain ':'."),
    (["--user", "prom", "--password-file", "empty"], {}, "--password-file 'empty' is empty."),
    (["http://127.0.0.1:1/metrics", "--cacert", "ca.pem"], {},
     "--cacert and --cert are for an https:// endpoint, not http://127.0.0.1:1/metrics"),
])
def test_shoal_top_refuses_incomplete_credentials(pki, basic_web_config, args, env, message):
    (pki / "empty").write_text("")
    done = subprocess.run([sys.executable, "-m", "shoal.launcher", "top", *args, "--once"],
                          cwd=pki, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": str(ROOT.parent), **env})
    assert done.returncode == 2
    assert done.stderr.endswith(f"shoal top: error: {message}\n"), done.stderr
