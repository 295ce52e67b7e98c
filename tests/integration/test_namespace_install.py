"""shoal installs under one top-level name, `shoal`: a user project with its own `core/` and
`collectives/` packages imports them beside an installed shoal, in an editable install (the
one the test suite runs on) and from the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = """
import core, collectives                     # the user's own packages
from shoal import core as shoal_core
import shoal.collectives as dist

assert core.MINE == "user core" and collectives.MINE == "user collectives"
assert dist.TCPStore.__module__ == "shoal.collectives.store.tcp"
assert shoal_core.tensor([1.0, 2.0]).sum().item() == 3.0
from shoal.collectives.ddp import DistributedDataParallel
import shoal
print(shoal.__file__)
"""


@pytest.fixture
def user_project(tmp_path):
    for name in ("core", "collectives"):
        pkg = tmp_path / "project" / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f'MINE = "user {name}"\n')
    return tmp_path / "project"


def _run(project: Path, extra_path: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    out = subprocess.run([sys.executable, "-c", USER_CODE], cwd=project, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_user_project_with_its_own_core_imports_beside_the_editable_install(user_project):
    location = _run(user_project)
    assert Path(location).resolve() == ROOT / "shoal" / "__init__.py"


def test_the_wheel_installs_only_the_shoal_name_and_serves_a_user_project(user_project, tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("shoal-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"shoal", wheel.name.split("-py3")[0] + ".dist-info"}
    for module in ("shoal/core/tensor.py", "shoal/collectives/backends/tcp/mesh.py",
                   "shoal/rpc_agent/transport/grpc.py", "shoal/elastic/rendezvous/handler.py",
                   "shoal/launcher/cli.py", "shoal/examples/train_ddp.py"):
        assert module in names
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    location = _run(user_project, extra_path=str(site))
    assert Path(location).resolve() == site / "shoal" / "__init__.py"
