"""The torch bridge stays beside the layers: no layer imports torch or the bridge (lazily or not),
and the bridge's own modules keep the house limits test_layout.py checks for the layers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LAYERS = ("core", "collectives", "rpc_agent", "elastic", "launcher")
BRIDGE = ROOT / "torch_bridge"


# Any import statement naming torch or the bridge, at any indentation (lazy imports count too);
# a regex over the text, since parsing every module of the layers would cost seconds.
_TORCH_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(?:torch|shoal\.torch_bridge)(?:\.[\w.]+)?[ \t]+import\b|"
    r"import[ \t][^#\n]*\b(?:torch|shoal\.torch_bridge)\b(?![\w']))", re.MULTILINE)


def test_no_layer_imports_torch_or_the_bridge():
    found = [f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
             for layer in LAYERS for path in sorted((ROOT / layer).rglob("*.py"))
             for match in _TORCH_IMPORT.finditer(path.read_text())]
    assert not found, "\n".join(found)


def test_the_import_pattern_sees_what_it_must():
    hits = ["import torch", "    import torch.distributed as dist", "from torch import nn",
            "import numpy, torch", "from shoal.torch_bridge import register",
            "    import shoal.torch_bridge  # noqa"]
    misses = ["import torchvision", "# torch's names", "x = torch_like", "from torchdata import x",
              "from torch's own tests, ported", "import torch's names as they are"]
    assert all(_TORCH_IMPORT.search(h) for h in hits)
    assert not any(_TORCH_IMPORT.search(m) for m in misses)


@pytest.mark.parametrize("path", sorted(BRIDGE.glob("*.py")), ids=lambda p: p.name)
def test_bridge_modules_keep_the_house_limits(path):
    source = path.read_text()
    assert len(source.splitlines()) <= 600, path
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}: {node.name}"
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            assert len(methods) <= 30, f"{path.name}: {node.name} has {len(methods)} methods"
            if not node.name.startswith("_"):
                assert ast.get_docstring(node), f"{path.name}: {node.name} has no docstring"
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") \
                and node.col_offset == 0:
            assert ast.get_docstring(node), f"{path.name}: {node.name} has no docstring"


def test_the_bridge_installs_as_shoal_torch_bridge():
    link = ROOT / "shoal" / "torch_bridge"
    assert link.is_symlink() and link.resolve() == BRIDGE.resolve()
    setup = (ROOT / "setup.py").read_text()
    assert '"torch_bridge"' in setup  # setup.py's LAYERS maps the folder to shoal.torch_bridge
