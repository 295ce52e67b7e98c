"""shoal installs under one top-level name, `shoal`: a user project with its own `core/` and
`collectives/` packages imports them beside an installed shoal, in an editable install (the
one the test suite runs on) and from the wheel."""

from __future__ import annotations

import os
import re
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
                   "shoal/launcher/cli.py", "shoal/examples/train_ddp.py", "shoal/py.typed"):
        assert module in names
    # The license travels in the metadata folder (dist-info/licenses/ from metadata 2.4 on).
    licenses = [n for n in names if n.split("/")[-1] == "LICENSE" and ".dist-info/" in n]
    assert len(licenses) == 1, names
    assert zipfile.ZipFile(wheel).read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    location = _run(user_project, extra_path=str(site))
    assert Path(location).resolve() == site / "shoal" / "__init__.py"
    _quick_start_from(site, user_project)


def _quick_start_from(site: Path, cwd: Path) -> None:
    """The README's quick start with nothing but the installed wheel: the example's --help,
    then the `shoal` script pip installed running it for a few steps on two workers."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHOAL_", "PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(site)
    where = subprocess.run(
        [sys.executable, "-c", "import shoal.examples.train_ddp as m; print(m.__file__)"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).resolve() == site / "shoal" / "examples" / "train_ddp.py"
    helped = subprocess.run([sys.executable, "-m", "shoal.examples.train_ddp", "--help"],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: ") and "--checkpoint-every" in helped.stdout
    script = site / "bin" / "shoal"
    run = subprocess.run(
        [str(script), "run", "--standalone", "--nproc-per-node=2", "-m",
         "shoal.examples.train_ddp", "--steps=4", "--checkpoint-every=2"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"\[rank 0\] final step 4 params_sha256 [0-9a-f]{64}", run.stdout), \
        run.stdout[-3000:]
