"""Validate custom resources against their CustomResourceDefinition's schema, as the API server
would on `kubectl apply --validate=strict`.

The schemas are the CRDs' own `openAPIV3Schema` (tests/data/crds, with their source and
version). Kubernetes' structural-schema rules become JSON Schema: a field a schema does not
declare is an error (strict field validation) unless the node says
`x-kubernetes-preserve-unknown-fields`; `x-kubernetes-int-or-string` takes either; `nullable`
admits null. CEL rules (`x-kubernetes-validations`) need the API server and are not evaluated:
the tests check what they guard (immutability, cross-field rules) where it matters.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import jsonschema

CRDS = Path(__file__).resolve().parents[1] / "data" / "crds"


class UnknownKind(LookupError):
    """No stored CRD defines this apiVersion and kind."""


@functools.lru_cache(maxsize=None)
def _crds() -> dict:
    """{(group, version, kind): (scope, JSON schema)} of every stored CRD."""
    out = {}
    for path in sorted(CRDS.glob("*.json.gz")):
        crd = json.loads(gzip.decompress(path.read_bytes()))
        for version, schema in crd["versions"].items():
            out[(crd["group"], version, crd["kind"])] = (crd["scope"], _structural(schema))
    return out


def _structural(node):
    """The JSON Schema a Kubernetes structural schema node means."""
    if isinstance(node, list):
        return [_structural(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _structural(v) for k, v in node.items()
           if k not in ("x-kubernetes-validations", "nullable")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (node.get("type") == "object" and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        # Strict: a field no schema declares is refused (a typo must not vanish).
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def scope(obj: dict) -> str:
    """"Namespaced" or "Cluster" for a custom resource's kind."""
    return _lookup(obj)[0]


def _lookup(obj: dict):
    group, _, version = obj["apiVersion"].rpartition("/")
    try:
        return _crds()[(group, version, obj["kind"])]
    except KeyError:
        raise UnknownKind(f"No stored CRD for {obj['apiVersion']} {obj['kind']} "
                          f"(tests/data/crds).") from None


def validate(obj: dict) -> None:
    """Raise jsonschema.ValidationError (with the path of the offending field) unless `obj`
    fits its CRD's schema; UnknownKind for a kind without a stored CRD."""
    namespaced, schema = _lookup(obj)
    # metadata is the API server's (ObjectMeta), declared only as an object in CRDs.
    schema = {**schema, "properties": {**schema.get("properties", {}), "metadata": {
        "type": "object"}}}
    jsonschema.Draft7Validator(schema).validate(obj)
    if (namespaced == "Cluster") != ("namespace" not in obj["metadata"]):
        raise jsonschema.ValidationError(
            f"{obj['kind']} {obj['metadata']['name']} is {namespaced}-scoped but its metadata "
            f"{'has' if 'namespace' in obj['metadata'] else 'lacks'} a namespace.")
