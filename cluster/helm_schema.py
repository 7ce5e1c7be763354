"""helm/baton/values.schema.json: the chart's own values, described here, plus `cluster`, which is ClusterConfig's
JSON schema (so a bad cluster key fails `helm install` just as it fails `baton serve`).

    python -m cluster.helm_schema            # rewrite the file (tests fail when it is stale)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig

SCHEMA_PATH = Path(__file__).parents[1] / "helm" / "baton" / "values.schema.json"


def _obj(props: dict[str, Any], description: str, required: list[str] | None = None) -> dict[str, Any]:
    d = {"type": "object", "description": description, "additionalProperties": False, "properties": props}
    if required:
        d["required"] = required
    return d


def _str(description: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **kw}


QUANTITY = {"anyOf": [{"type": "string", "pattern": r"^[0-9.]+(m|Ki|Mi|Gi|Ti|k|M|G|T)?$"},
                      {"type": "number", "exclusiveMinimum": 0}]}
TOLERATIONS = {"type": "array", "items": {"type": "object"}, "description": "Pod tolerations"}
NODE_SELECTOR = {"type": "object", "additionalProperties": {"type": "string"}, "description": "Pod node selector"}


def _pods(description: str) -> dict[str, Any]:
    return _obj({"resources": _obj({"cpu": {**QUANTITY, "description": "CPU request and limit"},
                                    "memory": {**QUANTITY, "description": "Memory request and limit"}},
                                   "Container resources (GPUs come from the pool's num_gpus)", ["cpu", "memory"]),
                 "nodeSelector": NODE_SELECTOR, "tolerations": TOLERATIONS}, description, ["resources"])


def values_schema() -> dict[str, Any]:
    cluster = ClusterConfig.model_json_schema()
    defs = cluster.pop("$defs")
    cluster["description"] = ("Baton's cluster config (cluster/config.py, as deploy/cluster.yaml); host, port and "
                              "model are set by the chart")
    props = {
        "image": _obj({"repository": _str("Image with Baton installed (deploy/Dockerfile.cuda)", minLength=1),
                       "tag": _str("Image tag", minLength=1),
                       "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"], "description": "Pull policy"}},
                      "The container image every Ray pod runs", ["repository", "tag"]),
        "imagePullSecrets": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}},
                             "description": "Secrets for a private registry"},
        "model": _obj({
            "source": {"enum": ["huggingface", "volume", "builtin"],
                       "description": "huggingface: download `id` at pod start; volume: a PVC; builtin: SmolLM2-135M"},
            "id": _str("Hugging Face model id (source huggingface)", pattern=r"^[\w.-]+/[\w.-]+$"),
            "tokenSecret": _obj({"name": _str("Secret holding a Hugging Face token (empty: none)"),
                                 "key": _str("Key of the token in that Secret", minLength=1)}, "Token for gated models"),
            "volume": _obj({"claimName": _str("PersistentVolumeClaim holding the model (source volume)"),
                            "mountPath": _str("Where pods mount it", pattern="^/"),
                            "path": _str("Model directory inside the volume")}, "A model on a volume"),
        }, "Where the model comes from", ["source"]),
        "ray": _obj({
            "version": _str("Ray version in the image (KubeRay's rayVersion)", pattern=r"^\d+\.\d+\.\d+"),
            "enableInTreeAutoscaling": {"type": "boolean", "description": "Let Ray's autoscaler add and remove "
                                                                         "worker pods as Serve scales the pools"},
            "idleTimeoutSeconds": {"type": "integer", "minimum": 0, "description": "Idle worker pods go after this"},
            "env": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "Environment of every Ray container (default: Ray Serve's throughput-optimized "
                                   "mode, cluster/serving.py SERVE_ENV)"},
            "head": _pods("The head pod: GCS, Serve controller and HTTP proxy (no pool replica)"),
            "workers": _obj({"prefill": _pods("Prefill worker pods (one replica each)"),
                             "decode": _pods("Decode worker pods (one replica each)")},
                            "One worker group per pool", ["decode"]),
        }, "The Ray cluster", ["version", "head", "workers"]),
        "cluster": cluster,
        "apiKeys": _obj({"secretName": _str("Secret holding the API keys, comma-separated (empty: no auth)"),
                         "key": _str("Key of the keys in that Secret", minLength=1)},
                        "API keys for the OpenAI API, from a Secret, as the env var cluster.auth.api_keys_env"),
        "service": _obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"], "description": "Service type"},
                         "port": {"type": "integer", "minimum": 1, "maximum": 65535, "description": "Service port"},
                         "annotations": {"type": "object", "description": "Service annotations"}},
                        "The Service in front of the OpenAI API"),
        "serviceMonitor": _obj({"enabled": {"type": "boolean", "description": "Create a ServiceMonitor"},
                                "interval": _str("Scrape interval", pattern=r"^\d+(ms|s|m)$"),
                                "labels": {"type": "object", "description": "Extra labels (your Prometheus' selector)"}},
                               "Prometheus operator scraping of /metrics"),
        "grafanaDashboard": _obj({"enabled": {"type": "boolean", "description": "Create the dashboard ConfigMap"},
                                  "labels": {"type": "object", "description": "Labels the Grafana sidecar watches"}},
                                 "The Grafana dashboard as a ConfigMap"),
    }
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "Baton Helm chart values",
            **_obj(props, "Values of the Baton chart", ["image", "model", "ray", "cluster"]), "$defs": defs}


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH}")
