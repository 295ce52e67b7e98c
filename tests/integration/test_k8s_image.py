"""The images the Kubernetes manifests run, as far as they can be checked without a container
engine: dependencies pinned and installed before the code is copied, a numeric user, an init
process, OCI labels; and the packaging they install (license, classifiers, py.typed)."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (DEPLOY / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{name}: {line!r} is not an exact pin"
            pins[req.name.lower().replace("_", "-")] = spec.version
    return pins


@pytest.mark.parametrize("name, constraints", [
    ("Dockerfile", ["constraints.txt"]),
    ("Dockerfile.gpu", ["constraints.txt", "constraints-cuda12.txt"]),
])
def test_dependencies_are_installed_from_pins_before_the_code(name, constraints):
    steps = _instructions(name)
    copies = [i for i, (word, _) in enumerate(steps) if word == "COPY"]
    first_copy = steps[copies[0]][1]
    assert all(f"deploy/{c}" in first_copy for c in constraints), first_copy
    install = next(i for i, (word, args) in enumerate(steps)
                   if word == "RUN" and "pip install --requirement" in args)
    assert copies[0] < install < copies[1], "the pinned install must sit between the two COPYs"
    assert all(f"--requirement {c}" in steps[install][1] for c in constraints)
    code_install = next(args for word, args in steps[install + 1:] if word == "RUN")
    assert "--no-deps" in code_install and "pip check" in code_install


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_numeric_user_init_process_and_labels(name):
    steps = _instructions(name)
    (user,) = [args for word, args in steps if word == "USER"]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), user  # runAsNonRoot can check a number
    (entrypoint,) = [args for word, args in steps if word == "ENTRYPOINT"]
    assert entrypoint == '["/usr/bin/tini", "--", "shoal"]'
    labels = " ".join(args for word, args in steps if word == "LABEL")
    for key in ("title", "version", "licenses", "revision", "source", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels


@pytest.mark.parametrize("name, extra", [
    ("Dockerfile", {}),
    ("Dockerfile.gpu", {"CUPY_CACHE_DIR": "/tmp/cupy/kernel_cache",
                        "CUDA_CACHE_PATH": "/tmp/nv/ComputeCache"}),
])
def test_home_and_caches_point_at_tmp(name, extra):
    """User 10001 has no home directory (useradd --no-create-home) and Kubernetes mounts the
    root filesystem read-only with an emptyDir at /tmp: whatever writes under $HOME (cupy's
    kernel cache, matplotlib's config, XDG caches) must find /tmp instead."""
    steps = _instructions(name)
    env: dict[str, str] = {}
    for word, args in steps[[w for w, _ in steps].index("USER"):]:
        if word == "ENV":
            env.update(re.findall(r"(\w+)=(\S+)", args))
    expected = {"HOME": "/tmp", "XDG_CACHE_HOME": "/tmp/.cache",
                "MPLCONFIGDIR": "/tmp/matplotlib", **extra}
    assert {k: env.get(k) for k in expected} == expected
    assert any("--no-create-home" in args for word, args in steps if word == "RUN")


def test_pins_satisfy_pyproject_and_cover_every_runtime_dependency():
    pins = _pins("constraints.txt")
    for text in PYPROJECT["project"]["dependencies"]:
        req = Requirement(text)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"constraints.txt does not pin {name}"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} breaks {text!r}"
    # Their own dependencies too (from what is installed here), so the image resolves nothing.
    for name in list(pins):
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                assert req.name.lower().replace("_", "-") in pins, (name, text)
    gpu = _pins("constraints-cuda12.txt")
    (cuda12,) = PYPROJECT["project"]["optional-dependencies"]["cuda12"]
    assert Requirement(cuda12).specifier.contains(gpu["cupy-cuda12x"])


def test_license_classifiers_and_typing_marker():
    project = PYPROJECT["project"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert project["license"] == {"text": "Apache-2.0"}
    assert "License :: OSI Approved :: Apache Software License" in project["classifiers"]
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "shoal" / "py.typed").exists()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["shoal"]
    import shoal

    assert shoal.__version__ == project["version"]  # `shoal --version` tells the truth
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{project['version']}]" in changelog and "## [Unreleased]" in changelog


def test_one_version_everywhere():
    """pyproject, shoal.__version__, the images' VERSION label and the tags the manifests run
    agree (0.2.0 moved everything under the shoal namespace; README's 'Moved in 0.2')."""
    import shoal

    version = PYPROJECT["project"]["version"]
    assert version == shoal.__version__ == "0.2.0"
    for name in ("Dockerfile", "Dockerfile.gpu"):
        assert ("ARG", f"VERSION={version}") in _instructions(name)
    kubernetes = DEPLOY / "kubernetes"
    tags = re.findall(r"image: (shoal[-\w]*):(\S+)", "".join(
        p.read_text() for p in kubernetes.rglob("*.yaml")))
    tags += re.findall(r"newName: (shoal[-\w]*)\s+newTag: (\S+)", "".join(
        p.read_text() for p in kubernetes.rglob("kustomization.yaml")))
    assert {name for name, _ in tags} == {"shoal", "shoal-gpu"}
    assert {tag for _, tag in tags} == {version}
    assert "Moved in 0.2" in (ROOT / "README.md").read_text()
