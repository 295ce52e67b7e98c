"""Run the fast test loop with every dependency at the lower bound pyproject.toml declares.

pyproject.toml gives each dependency a lower and an upper bound; the main environment resolves
near the upper ones, so this is where the lower ones are tested. It builds a fresh virtual
environment (`.venv-lower`, ignored by git), installs shoal with its test extra constrained to
`name==lower` for every `>=` bound, prints what it resolved, and runs
`python -m pytest -m "not slow"` there. The exit status is pytest's.

    python scripts/lower_bounds.py [--venv DIR] [--keep] [pytest args...]

The README's test command runs it after the whole suite (`.ci/run` runs that command).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A requirement's name and its `>=` bound: "numpy>=1.26,<2.5" -> ("numpy", "1.26").
LOWER = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*[^;]*?>=\s*([^,;\s]+)")
EXTRAS = ("test",)


def lower_pins(pyproject: dict) -> list[str]:
    """`name==lower` for each runtime and test dependency that has a `>=` bound."""
    project = pyproject["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS:
        requirements += project["optional-dependencies"][extra]
    pins = []
    for requirement in requirements:
        match = LOWER.match(requirement)
        if match:
            pins.append(f"{match.group(1)}=={match.group(2)}")
    return pins


def run(cmd: list[str], **kwargs) -> None:
    """Run `cmd`, echoing it; a failure ends this script with the command's status."""
    print("+", " ".join(cmd), flush=True)
    status = subprocess.call(cmd, **kwargs)
    if status:
        sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-lower",
                        help="where to build the environment (default: .venv-lower)")
    parser.add_argument("--keep", action="store_true",
                        help="reuse an existing environment instead of building it afresh")
    args, pytest_args = parser.parse_known_args(argv)
    pins = lower_pins(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    python = args.venv / "bin" / "python"
    if not (args.keep and python.exists()):
        shutil.rmtree(args.venv, ignore_errors=True)
        run([sys.executable, "-m", "venv", str(args.venv)])
        constraints = args.venv / "lower-bounds.txt"
        constraints.write_text("\n".join(pins) + "\n")
        run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "-c", str(constraints), "-e", f"{ROOT}[test]"])
    print("Lower bounds under test:", ", ".join(pins), flush=True)
    run([str(python), "-m", "pip", "list", "--disable-pip-version-check", "--format=freeze"],
        stdout=sys.stdout)
    return subprocess.call([str(python), "-m", "pytest", "-m", "not slow", "-q", *pytest_args],
                           cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
