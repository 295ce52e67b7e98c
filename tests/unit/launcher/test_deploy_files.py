"""deploy/: the worker manifest's command parses, Prometheus accepts its config, and the
dashboard only charts metric families that shoal's packages declare."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from shoal.launcher.flags import parse_run

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"


def _list_after(text: str, key: str) -> list[str]:
    """The `- item` lines of the first YAML block list under `key:` (enough for our manifests)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"{key}:")
    indent = None
    items = []
    for line in lines[start + 1:]:
        stripped = line.strip()
        if not stripped.startswith("- "):
            break
        current = len(line) - len(line.lstrip())
        indent = current if indent is None else indent
        if current != indent:
            break
        items.append(stripped[2:].strip().strip('"'))
    return items


def test_worker_statefulset_runs_shoal_with_etcd_and_elastic_node_counts(monkeypatch):
    text = (DEPLOY / "kubernetes" / "workers.yaml").read_text()
    args = _list_after(text, "args")
    assert args[0] == "run"
    monkeypatch.chdir(ROOT)  # the image's working directory holds the repository's files
    settings = parse_run(args[1:], {})
    assert settings.rdzv_backend == "etcd" and settings.rdzv_endpoints
    assert settings.min_nodes < settings.max_nodes
    assert settings.metrics_port == 9400
    assert 'prometheus.io/scrape: "true"' in text and 'prometheus.io/port: "9400"' in text
    assert "clusterIP: None" in text  # headless Service
    assert "secretKeyRef" in text and "SHOAL_AUTH_TOKEN" in text
    secret = (DEPLOY / "kubernetes" / "secret.yaml").read_text()
    assert "name: shoal-auth" in secret and "kind: Secret" in secret
    etcd = (DEPLOY / "kubernetes" / "etcd.yaml").read_text()
    assert "kind: StatefulSet" in etcd and "kind: Service" in etcd


def test_dockerfile_copies_only_paths_that_exist():
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing path {source!r}"


def test_prometheus_accepts_the_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool (Debian's prometheus package) is missing in CI")
        pytest.skip("promtool is not installed")
    proc = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _declared_families() -> set[str]:
    names = set()
    for package in ("core", "collectives", "rpc_agent", "elastic"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](shoal_[a-z0-9_]+)[\"']", path.read_text()))
    return names


def test_dashboard_charts_every_package_with_declared_families_only():
    dashboard = json.loads((DEPLOY / "grafana" / "shoal-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|count|sum)$", "", name)
            for expr in exprs for name in re.findall(r"\bshoal_[a-z0-9_]+", expr)}
    for package in ("elastic", "collectives", "ddp", "rpc"):
        assert any(name.startswith(f"shoal_{package}_") for name in used), package
    missing = sorted(used - _declared_families())
    assert not missing, f"the dashboard charts families no package declares: {missing}"
