"""Compile shoal's sources to bytecode before a start-up benchmark.

An installed wheel has its bytecode written at install time, as torch's has in site-packages.
A source checkout writes it at first import, unless PYTHONDONTWRITEBYTECODE is set (as it is on
the machines these benchmarks ran on): then every fresh interpreter compiles each module edited
since the last cache again, which measured 40-45 ms per worker start for the 54 modules a worker
imports. The start-up benchmarks (`elastic.py`, `imports.py`, `torch_scripts.py`) call
`compile_sources()` first (`python bench/startup_cache.py` does it alone), so both sides start from bytecode, as installed packages do.
"""

from __future__ import annotations

import compileall
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "collectives", "rpc_agent", "elastic", "launcher", "torch_bridge")


def compile_sources() -> None:
    """Write (or refresh) the bytecode cache of every shoal package in this checkout."""
    for name in PACKAGES:
        compileall.compile_dir(str(ROOT / name), quiet=1)


if __name__ == "__main__":
    compile_sources()
