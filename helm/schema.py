"""Generate ``helm/specserve/values.schema.json``.

    python helm/schema.py            # (make helm-schema) rewrite it
    python helm/schema.py --check    # exit 1 when the committed schema is stale

The ``specserve`` value is an AppConfig, so its schema is the pydantic model's own JSON schema
(same bounds, same "unknown key" refusals as ``deploy/``); the rest (pods, ingress,
monitoring, secrets) is written here. Helm validates values against it on install, upgrade,
lint and template.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "specserve" / "values.schema.json"

STR = {"type": "string"}
BOOL = {"type": "boolean"}
OBJ = {"type": "object"}
QUANTITY = {"type": ["string", "integer", "number"], "pattern": r"^[0-9.]+[A-Za-z]*$"}
COUNT = {"type": ["integer", "null"], "minimum": 0}


def strict(properties: dict, required: tuple = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties,
            **({"required": list(required)} if required else {})}


RESOURCES = strict({"requests": {"type": "object", "additionalProperties": QUANTITY},
                    "limits": {"type": "object", "additionalProperties": QUANTITY}})
LIST_OF_OBJECTS = {"type": "array", "items": OBJ}


def group(doc: str) -> dict:
    return {**strict({
        "replicas": {**COUNT, "description": "Pods; null: specserve.num_units."},
        "minReplicas": COUNT, "maxReplicas": COUNT, "resources": RESOURCES,
        "nodeSelector": {"type": "object", "additionalProperties": STR},
        "tolerations": LIST_OF_OBJECTS, "affinity": OBJ, "runtimeClassName": STR,
        "shmSize": QUANTITY,
        "gpuMemoryGiB": {"type": "number", "exclusiveMinimum": 0, "maximum": 4096,
                         "description": "Memory of one GPU of the group as CUDA counts it (GiB): "
                                        "what the memory estimate must fit (docs/MEMORY.md)."}}),
        "description": doc}


def monitor() -> dict:
    return strict({"enabled": BOOL, "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
                   "labels": {"type": "object", "additionalProperties": STR}})


def chart_schema(app_schema: dict) -> dict:
    defs = app_schema.pop("$defs", {})
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "specserve Helm values",
        **strict({
            "image": strict({"repository": {"type": "string", "minLength": 1}, "tag": STR,
                             "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}),
            "imagePullSecrets": LIST_OF_OBJECTS,
            "rayVersion": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+$"},
            "specserve": {**app_schema, "description": "AppConfig (services/specserve/app_config.py)"},
            "head": strict({"resources": RESOURCES,
                            "nodeSelector": {"type": "object", "additionalProperties": STR},
                            "tolerations": LIST_OF_OBJECTS, "affinity": OBJ, "shmSize": QUANTITY}),
            "target": group("The tensor-parallel target group."),
            "draft": group("The draft group (method draft_model only)."),
            "env": LIST_OF_OBJECTS,
            "hubToken": strict({"value": STR, "existingSecret": STR,
                                "key": {"type": "string", "minLength": 1}}),
            "apiKeys": strict({"values": {"type": "array", "items": {"type": "string", "minLength": 16}},
                               "existingSecret": STR, "key": {"type": "string", "minLength": 1}}),
            "modelCache": strict({"enabled": BOOL, "existingClaim": STR, "size": QUANTITY,
                                  "storageClassName": STR,
                                  "accessModes": {"type": "array", "minItems": 1, "items": {
                                      "enum": ["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany",
                                               "ReadWriteOncePod"]}}}),
            "service": strict({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                               "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                               "annotations": {"type": "object", "additionalProperties": STR}}),
            "ingress": strict({"enabled": BOOL, "className": STR,
                               "annotations": {"type": "object", "additionalProperties": STR},
                               "hosts": {"type": "array", "items": strict({
                                   "host": {"type": "string", "minLength": 1},
                                   "paths": {"type": "array", "minItems": 1, "items": strict({
                                       "path": {"type": "string", "pattern": "^/"},
                                       "pathType": {"enum": ["Prefix", "Exact", "ImplementationSpecific"]}},
                                       ("path", "pathType"))}}, ("host", "paths"))},
                               "tls": {"type": "array", "items": strict({
                                   "secretName": {"type": "string", "minLength": 1},
                                   "hosts": {"type": "array", "items": STR}}, ("secretName",))}}),
            "httpRoute": strict({"enabled": BOOL, "parentRefs": LIST_OF_OBJECTS,
                                 "hostnames": {"type": "array", "items": STR},
                                 "requestTimeout": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"}}),
            "monitoring": strict({
                "serviceMonitor": monitor(), "podMonitor": monitor(),
                "prometheusRule": strict({"enabled": BOOL,
                                          "labels": {"type": "object", "additionalProperties": STR}}),
                "dashboards": strict({"enabled": BOOL, "label": {"type": "string", "minLength": 1},
                                      "labelValue": STR, "folder": STR})}),
            "podDisruptionBudget": strict({"enabled": BOOL,
                                           "maxUnavailable": {"type": "integer", "minimum": 0}}),
            "networkPolicy": strict({"enabled": BOOL,
                                     "allowedNamespaceLabels": LIST_OF_OBJECTS,
                                     "monitoringNamespaceLabels": LIST_OF_OBJECTS}),
            "serviceAccount": strict({"create": BOOL, "name": STR,
                                      "annotations": {"type": "object", "additionalProperties": STR}}),
            "commonLabels": {"type": "object", "additionalProperties": STR},
            "podAnnotations": {"type": "object", "additionalProperties": STR},
            "preflight": strict({
                "enabled": BOOL,
                "image": strict({"repository": {"type": "string", "minLength": 1}, "tag": STR,
                                 "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}),
                "resources": RESOURCES,
                "backoffLimit": {"type": "integer", "minimum": 0},
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1}}),
            "global": OBJ,
        }),
        "$defs": defs,
    }


def render() -> str:
    sys.path.insert(0, str(HERE.parent / "services"))
    from specserve.app_config import AppConfig

    app = AppConfig.model_json_schema(mode="validation")
    app.pop("title", None)
    return json.dumps(chart_schema(app), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail when the committed schema is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(HERE.parent)} is stale; run `make helm-schema`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
