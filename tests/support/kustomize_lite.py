"""A small renderer for the subset of kustomize that deploy/kubernetes uses, for the tests.

No kustomize can be installed from Debian (its kubernetes-client 1.20 bundles kustomize 2.0,
which predates directories in `resources` and `patches`) or PyPI, so the tests render the
manifests with this, and also with `kubectl kustomize` wherever one is installed, and check
that both give the same objects (tests/integration/test_k8s_manifests.py).

Supported, with kustomize's meaning:
- `resources`: YAML files (several documents each, anchors allowed) and directories holding a
  kustomization.yaml, rendered first;
- `namespace`: set on every namespaced object (a Namespace object is left alone);
- `secretGenerator`: `files` (`key=path` or `path`), `literals`, `type`, `options.labels`,
  with `generatorOptions.disableNameSuffixHash: true` only (hashed names are not supported);
- `patches` with a `path` to a strategic-merge patch, matched by kind and name; lists merge by
  the Kubernetes merge keys below, other lists are replaced, a null deletes a key;
- `images`: `name` -> `newName`/`newTag` on every container and init container.
Anything else in a kustomization raises ValueError naming the key, so the subset cannot drift
unnoticed.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "namespace", "resources", "secretGenerator",
              "generatorOptions", "patches", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}
# Strategic merge keys of the list fields the manifests patch (from the Kubernetes API).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}


def render(directory: str | Path) -> list[dict]:
    """The objects the kustomization in `directory` produces."""
    root = Path(directory)
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN_KEYS
    if unknown:
        raise ValueError(f"{root}/kustomization.yaml uses {sorted(unknown)}, which "
                         "kustomize_lite does not render.")
    objects: list[dict] = []
    for entry in spec.get("resources", []):
        path = root / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    objects += _secrets(root, spec)
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{root}: only `patches: - path:` is supported, got {patch}.")
        for doc in yaml.safe_load_all((root / patch["path"]).read_text()):
            target = _find(objects, doc["kind"], doc["metadata"]["name"])
            objects[objects.index(target)] = merge(target, doc)
    for image in spec.get("images", []):
        for obj in objects:
            _retag(obj, image)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return objects


def _secrets(root: Path, spec: dict) -> list[dict]:
    options = spec.get("generatorOptions", {})
    made = []
    for gen in spec.get("secretGenerator", []):
        if not options.get("disableNameSuffixHash"):
            raise ValueError(f"{root}: hashed generator names are not supported; set "
                             "generatorOptions.disableNameSuffixHash: true.")
        data = {}
        for item in gen.get("files", []):
            key, _, path = item.rpartition("=") if "=" in item else ("", "", item)
            data[key or Path(path).name] = (root / path).read_bytes()
        for item in gen.get("literals", []):
            key, _, value = item.partition("=")
            data[key] = value.encode()
        secret = {"apiVersion": "v1", "kind": "Secret",
                  "metadata": {"name": gen["name"]}, "type": gen.get("type", "Opaque"),
                  "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
        labels = gen.get("options", {}).get("labels")
        if labels:
            secret["metadata"]["labels"] = dict(labels)
        made.append(secret)
    return made


def _find(objects: list[dict], kind: str, name: str) -> dict:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise ValueError(f"A patch targets {kind}/{name}, which no resource defines.")


def merge(base: Any, patch: Any, key: str = "") -> Any:
    """`patch` merged into a copy of `base` the strategic-merge way."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        field = MERGE_KEYS[key]
        out = copy.deepcopy(base)
        added = []
        for item in patch:
            match = next((i for i, b in enumerate(out) if b.get(field) == item.get(field)), None)
            if match is None:
                added.append(copy.deepcopy(item))
            else:
                out[match] = merge(out[match], item)
        return added + out  # as kustomize: items only the patch has come first, in its order
    return copy.deepcopy(patch)


def _retag(node: Any, image: dict) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                for container in v:
                    name, _, tag = container.get("image", "").partition(":")
                    if name == image["name"]:
                        container["image"] = (f"{image.get('newName', name)}:"
                                              f"{image.get('newTag', tag)}")
            else:
                _retag(v, image)
    elif isinstance(node, list):
        for v in node:
            _retag(v, image)
