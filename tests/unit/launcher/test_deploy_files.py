"""deploy/: the Dockerfiles copy only paths that exist, Prometheus accepts its config, and the
dashboard only charts metric families that shoal's packages declare. The Kubernetes manifests
are checked rendered, in tests/integration/test_k8s_manifests.py and test_k8s_job_pods.py."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_copies_only_paths_that_exist(name):
    for line in (DEPLOY / name).read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"{name} copies missing path {source!r}"


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
