"""A minimal pytree: tuples, lists, dicts (and namedtuples) of leaves, as torch.utils._pytree.

The transforms take and return nested containers of tensors (a model's parameter dict, a
(loss, aux) pair); these helpers flatten them to a list of leaves and rebuild them.
"""

from __future__ import annotations

from typing import Any, Callable


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """(leaves in order, a spec that tree_unflatten turns back into the same structure)."""
    leaves: list = []
    spec = _flatten(tree, leaves)
    return leaves, spec


def _flatten(tree: Any, leaves: list) -> Any:
    if isinstance(tree, dict):
        keys = list(tree)
        return ("dict", keys, [_flatten(tree[k], leaves) for k in keys])
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return ("namedtuple", type(tree), [_flatten(v, leaves) for v in tree])
    if isinstance(tree, (tuple, list)):
        return (type(tree).__name__, None, [_flatten(v, leaves) for v in tree])
    leaves.append(tree)
    return None


def tree_unflatten(leaves: list, spec: Any) -> Any:
    """The structure `spec` describes, filled with `leaves` in order."""
    it = iter(leaves)
    return _build(spec, it)


def _build(spec: Any, it: Any) -> Any:
    if spec is None:
        return next(it)
    kind, extra, children = spec
    values = [_build(c, it) for c in children]
    if kind == "dict":
        return dict(zip(extra, values))
    if kind == "namedtuple":
        return extra(*values)
    return tuple(values) if kind == "tuple" else list(values)


def tree_map(fn: Callable, tree: Any) -> Any:
    """The same structure with fn applied to every leaf."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) for x in leaves], spec)


def broadcast_prefix(prefix: Any, tree: Any, what: str) -> list:
    """One entry of `prefix` per leaf of `tree`: a leaf of prefix (an int, None) covers a whole
    subtree, as torch's in_dims/out_dims do."""
    out: list = []
    _broadcast(prefix, tree, out, what)
    return out


def _broadcast(prefix: Any, tree: Any, out: list, what: str) -> None:
    if prefix is None or isinstance(prefix, int):
        out.extend([prefix] * len(tree_flatten(tree)[0]))
        return
    if isinstance(prefix, dict) and isinstance(tree, dict):
        if set(prefix) != set(tree):
            raise ValueError(f"{what}: the keys {sorted(prefix)} do not match the input's "
                             f"keys {sorted(tree)}.")
        for k in tree:
            _broadcast(prefix[k], tree[k], out, what)
        return
    if isinstance(prefix, (tuple, list)) and isinstance(tree, (tuple, list)):
        if len(prefix) != len(tree):
            raise ValueError(f"{what}: {len(prefix)} entries for an input of {len(tree)} "
                             "entries; they must match (or be one int/None for all).")
        for p, t in zip(prefix, tree):
            _broadcast(p, t, out, what)
        return
    raise ValueError(f"{what}: expected an int, None, or a structure matching the input, got "
                     f"{type(prefix).__name__} for {type(tree).__name__}.")
