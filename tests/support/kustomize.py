"""`kubectl kustomize`, the real renderer, for the tests of deploy/kubernetes.

Debian 12's kubernetes-client (kubectl 1.20) bundles kustomize 2.0, so the manifests keep to
what it reads (`bases` for directories, `patchesStrategicMerge`); newer kubectl reads the same
files (with deprecation warnings, which `render` drops) and must give the same objects.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support.requirements import missing

RENDER_TIMEOUT_S = 60


def require_kubectl() -> str:
    """The kubectl executable; skips without one, or fails under CI=true."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        missing("the Kubernetes manifest tests",
                "kubectl is not installed (apt-get install kubernetes-client)")
    return kubectl


def render(directory: str | Path) -> list[dict]:
    """The objects `kubectl kustomize directory` produces.

    Raises:
        FileNotFoundError: kustomize could not read a file the kustomization names (the
            message is kubectl's).
        RuntimeError: any other rendering error (kubectl's message).
    """
    done = subprocess.run([require_kubectl(), "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=RENDER_TIMEOUT_S)
    if done.returncode != 0:
        error = done.stderr.strip()
        if "no such file or directory" in error.lower():
            raise FileNotFoundError(error)
        raise RuntimeError(f"kubectl kustomize {directory} failed: {error}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
