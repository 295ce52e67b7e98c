"""The layout rules of docs/design.md, checked on the source: one `shoal` import namespace, imports
that point down the layers only, and no import cycles (core's binding of ops onto Tensor is
the one deliberate exception)."""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Bottom to top: a layer may import itself and the layers before it.
LAYERS = ("core", "collectives", "rpc_agent", "elastic", "launcher", "examples")
OLD_TOP_LEVEL = set(LAYERS)


def _modules():
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if "_generated" in path.parts:
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield "shoal." + ".".join(parts), path


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for every test of this file."""
    return ast.parse(path.read_text(), str(path))


MODULES = dict(_modules())
# Parsed while the file is collected: every test below reads these trees.
for _path in MODULES.values():
    _tree(_path)


def _imports(path: Path, top_level_only: bool):
    """(imported module, line) pairs; `top_level_only` keeps the module-level statements only
    (imports inside functions run later)."""
    tree = _tree(path)
    nodes = tree.body if top_level_only else [
        n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return _imports_of(nodes)


def _imports_of(nodes):
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            # `from package import submodule` depends on the submodule, not on what the
            # package's __init__ defines; any other name does depend on the module itself.
            if not all(sub in MODULES for sub in subs):
                yield node.module, node.lineno
            for sub in subs:
                if sub in MODULES:
                    yield sub, node.lineno


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_every_import_goes_through_the_shoal_namespace():
    bare = [f"{path.relative_to(ROOT)}:{line}: import {name}"
            for module, path in MODULES.items()
            for name, line in _imports(path, top_level_only=False)
            if name.split(".")[0] in OLD_TOP_LEVEL]
    assert not bare, "\n".join(bare)


def test_imports_point_down_the_layers():
    upward = [f"{path.relative_to(ROOT)}:{line}: {module} imports {name}"
              for module, path in MODULES.items()
              for name, line in _imports(path, top_level_only=False)
              if name.startswith("shoal.") and name.count(".") >= 1
              and name.split(".")[1] in LAYERS and _layer(name) > _layer(module)]
    assert not upward, "\n".join(upward)


def _graph() -> dict:
    graph = {}
    for module, path in MODULES.items():
        targets = set()
        for name, _ in _imports(path, top_level_only=True):
            # Importing a.b.c runs a and a.b first; a module's own enclosing packages are being
            # imported already when it runs, so those implicit edges are no dependency.
            parts = name.split(".")
            for k in range(2, len(parts) + 1):
                head = ".".join(parts[:k])
                implicit = k < len(parts)
                if head in MODULES and head != module and not (
                        implicit and module.startswith(head + ".")):
                    targets.add(head)
        graph[module] = targets
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_beyond_core_binding_ops_onto_tensor():
    cycles = _cycles(_graph())
    allowed = [c for c in cycles if all(m.startswith("shoal.core.") or m == "shoal.core"
                                        for m in c)]
    assert [c for c in cycles if c not in allowed] == []
    # core's one deliberate cycle: Tensor's methods are bound from core.ops, which build Tensors.
    for component in allowed:
        assert "shoal.core.tensor" in component, component


@pytest.mark.parametrize("name", ["core", "collectives", "rpc_agent", "elastic", "launcher"])
def test_no_layer_is_installed_under_a_generic_top_level_name(name):
    from importlib.util import find_spec

    spec = find_spec(name)
    # The repository root may be on sys.path during tests (the folder itself is found there);
    # an installed top-level package of that name would live in site-packages instead.
    assert spec is None or Path(spec.origin).resolve().is_relative_to(ROOT), spec


def _reaches(graph: dict, start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        if v not in seen:
            seen.add(v)
            todo.extend(graph.get(v, ()))
    return False


def _lazy_imports(path: Path):
    """Imports inside functions (not under `if TYPE_CHECKING`, which never runs)."""
    tree = _tree(path)
    top = {id(n) for n in tree.body}
    type_checking = {id(n) for node in tree.body if isinstance(node, ast.If)
                     and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    return _imports_of(n for n in ast.walk(tree)
                       if isinstance(n, (ast.Import, ast.ImportFrom))
                       and id(n) not in top and id(n) not in type_checking)


# core's deliberate cycle: Tensor's methods are the ops, which build Tensors. bind.py attaches
# the ops once both exist; Tensor and autograd reach back into them late.
DELIBERATE_LATE_IMPORTS = {"shoal.core.ops.bind", "shoal.core.tensor", "shoal.core.autograd"}


def test_no_late_import_dodges_a_cycle():
    """A function-level import that a module-level one would turn into a cycle only hides the
    cycle; the module graph should be fixed instead."""
    graph = _graph()
    dodges = []
    for module, path in MODULES.items():
        if module in DELIBERATE_LATE_IMPORTS:
            continue
        for name, line in _lazy_imports(path):
            if name in MODULES and name != module and _reaches(graph, name, module):
                dodges.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {name} late")
    assert not dodges, "\n".join(dodges)


# Sizes a reader can hold in mind (STYLE.md): a module of a few hundred lines, a function that
# fits a screen, a class whose methods one can list. Generated code is exempt.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_CLASS_METHODS = 30
# Public surfaces whose width is the API they mirror, not an implementation's: torch's Tensor and
# nn.Module methods, and the two seams' abstract classes (c10d's ProcessGroup and Store calls).
API_CLASSES = {"core/tensor.py:Tensor", "core/nn/module.py:Module",
               "collectives/api.py:ProcessGroup", "collectives/store/api.py:Store"}


def _product_files():
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if "_generated" not in path.parts:
                yield path


def test_no_product_module_is_over_the_size_limit():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in _product_files()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(big)


def test_no_function_is_over_the_size_limit():
    long = []
    for path in _product_files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # The signature's decorators are not body; the docstring is.
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_implementation_class_has_more_methods_than_the_limit():
    wide = []
    for path in _product_files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef) and (
                    f"{path.relative_to(ROOT)}:{node.name}" not in API_CLASSES):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > MAX_CLASS_METHODS:
                    wide.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} {n} methods")
    assert not wide, f"classes over {MAX_CLASS_METHODS} methods:\n" + "\n".join(wide)


@pytest.mark.parametrize("layer", LAYERS)
def test_the_tree_resolves_shoal_imports_without_an_install(layer):
    """shoal/<layer> links to the layer folder, so a type checker or a structure tool run on
    the checkout finds `shoal.<layer>.x` where Python finds it once installed (setup.py)."""
    link = ROOT / "shoal" / layer
    assert link.is_symlink() and link.resolve() == (ROOT / layer).resolve()
    assert (link / "__init__.py").is_file()


# Dotted names that are not Python modules: the gRPC service and the launcher's logger.
NOT_MODULES = {"shoal.rpc.Agent", "shoal.run"}
_DOTTED = re.compile(r"\bshoal(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_shoal_name_the_code_and_docs_cite_exists():
    """A docstring or page that names `shoal.x.y` names a module or attribute that exists (the
    0.2 move left ten that did not)."""
    texts = [*_product_files(), *sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    stale = sorted({f"{path.relative_to(ROOT)}: {name}" for path in texts
                    for name in _DOTTED.findall(path.read_text())
                    if name not in NOT_MODULES and not _resolves(name.rstrip("."))})
    assert not stale, "\n".join(stale)
