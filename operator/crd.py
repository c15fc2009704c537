"""Render the MLLMDeployment CRD from the pydantic models (`triptych crd [--out F]`).

Pydantic emits JSON Schema 2020-12; a CRD needs a *structural* OpenAPI v3 schema
(https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/#specifying-a-structural-schema).
`to_structural` bridges the two: `$ref`s are inlined, `anyOf [X, null]` becomes X with
`nullable: true`, maps keyed by an enum become objects with one property per key,
`additionalProperties: true` becomes `x-kubernetes-preserve-unknown-fields`, numeric
`exclusiveMinimum` becomes the boolean OpenAPI v3.0 form, titles go. `structural_problems`
checks the result against the structural rules, so the converter cannot silently regress.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import yaml

from triptych.kube import names
from triptych.operator.api import MLLMDeploymentSpec, MLLMDeploymentStatus

Schema = dict[str, Any]
CRD_PATH = Path(__file__).resolve().parent.parent / "crds" / "mllmdeployment.yaml"

_JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
_INT_OR_STRING = "x-kubernetes-int-or-string"
_PRESERVE = "x-kubernetes-preserve-unknown-fields"


def to_structural(schema: Schema) -> Schema:
    """Convert a pydantic JSON schema (with `$defs`) into a structural CRD schema."""
    defs = schema.get("$defs", {})
    root = {k: v for k, v in schema.items() if k != "$defs"}
    return _convert(root, defs)


def _resolve(node: Schema, defs: dict[str, Schema]) -> Schema:
    while "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        node = {**copy.deepcopy(target), **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _convert(node: Schema, defs: dict[str, Schema]) -> Schema:
    node = _resolve(node, defs)
    nullable = False
    if "anyOf" in node and not node.get(_INT_OR_STRING):
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']} structurally")
        nullable = len(options) < len(node["anyOf"])
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        node = {**_resolve(options[0], defs), **rest}
    out: Schema = {}
    for key, value in node.items():
        if key == "title" or (key == "default" and value is None):
            continue
        if key == "properties":
            out["properties"] = {k: _convert(v, defs) for k, v in value.items()}
        elif key == "items":
            out["items"] = _convert(value, defs)
        elif key == "additionalProperties":
            if value is True:
                out[_PRESERVE] = True
            elif isinstance(value, dict) and "propertyNames" not in node:
                out["additionalProperties"] = _convert(value, defs)
            # `false` is dropped: the API server prunes unknown fields instead.
        elif key == "propertyNames":
            keys = _resolve(value, defs)["enum"]
            values = _convert(node["additionalProperties"], defs)
            out["properties"] = {k: copy.deepcopy(values) for k in keys}
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        elif key == "anyOf":  # int-or-string: keep the two bare type branches
            out["anyOf"] = [{"type": o["type"]} for o in value]
        else:
            out[key] = value
    if nullable:
        out["nullable"] = True
    if out.get(_PRESERVE) and "type" not in out:
        out["type"] = "object"
    return out


def structural_problems(schema: Schema, path: str = "") -> list[str]:
    """Violations of the structural-schema rules (empty when the schema is structural)."""
    problems: list[str] = []
    here = path or "<root>"
    if "$ref" in schema or "$defs" in schema or "definitions" in schema:
        problems.append(f"{here}: $ref/$defs are not allowed")
    if "type" not in schema and not schema.get(_INT_OR_STRING) and not schema.get(_PRESERVE):
        problems.append(f"{here}: missing type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{here}: properties and additionalProperties are mutually exclusive")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in schema and not isinstance(schema[key], bool):
            problems.append(f"{here}: {key} must be a boolean in OpenAPI v3.0")
    if "propertyNames" in schema or "const" in schema:
        problems.append(f"{here}: propertyNames/const are not supported")
    for junctor in _JUNCTORS:
        for branch in _as_list(schema.get(junctor)):
            problems += _junctor_problems(branch, f"{here}.{junctor}", int_or_string=schema.get(_INT_OR_STRING))
    for key, sub in schema.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        problems += structural_problems(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_problems(schema["additionalProperties"], f"{path}{{}}")
    return problems


def _as_list(value: Any) -> list[Schema]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _junctor_problems(branch: Schema, where: str, *, int_or_string: bool) -> list[str]:
    if int_or_string and set(branch) == {"type"} and branch["type"] in ("integer", "string"):
        return []
    bad = {"description", "type", "default", "additionalProperties", "nullable"} & set(branch)
    return [f"{where}: {', '.join(sorted(bad))} not allowed inside a junctor"] if bad else []


def openapi_schema() -> Schema:
    spec = to_structural(MLLMDeploymentSpec.model_json_schema(by_alias=True))
    status = to_structural(MLLMDeploymentStatus.model_json_schema(by_alias=True))
    return {
        "type": "object",
        "description": "MLLMDeployment serves a multimodal LLM with Encode/Prefill/Decode disaggregation.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def build_crd() -> dict[str, Any]:
    ready = '.status.conditions[?(@.type=="Ready")].status'
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{names.PLURAL}.{names.GROUP}",
                     "labels": {names.LABEL_PART_OF: "triptych"}},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {"kind": names.KIND, "plural": names.PLURAL, "singular": names.SINGULAR,
                      "listKind": f"{names.KIND}List", "shortNames": list(names.SHORT_NAMES),
                      "categories": ["triptych"]},
            "versions": [{
                "name": names.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Topology", "type": "string", "jsonPath": ".status.topology"},
                    {"name": "Instances", "type": "string", "jsonPath": ".status.instances",
                     "description": "ready/desired worker instances"},
                    {"name": "Ready", "type": "string", "jsonPath": ready},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


def render_crd() -> str:
    header = "# Generated by `triptych crd --out crds/mllmdeployment.yaml` from operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def cli_main(args: argparse.Namespace) -> int:
    text = render_crd()
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0
