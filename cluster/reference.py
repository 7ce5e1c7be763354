"""docs/configuration.md: every cluster config key with its type, default and description, from the schema
itself (cluster/config.py and the sections it composes: cluster/autoscaling.py, router/config.py,
kvtransfer/config.py), so the reference cannot drift from the code.

    python -m cluster.reference              # rewrite the file (tests fail when it is stale)
"""
from __future__ import annotations

import json
import typing
from pathlib import Path

from pydantic import BaseModel

from cluster.config import ClusterConfig

DOC_PATH = Path(__file__).parents[1] / "docs" / "configuration.md"
HEAD = """# Configuration reference

One schema configures a Baton cluster: `deploy/cluster.yaml` for `baton serve` and `serve run deploy/serve.yaml`,
and the `cluster:` section of the Helm chart's values (`helm/baton`). Unknown keys are refused with their path and
a suggestion. Generated from the schema by `python -m cluster.reference`; do not edit by hand.
"""


def _type(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    if isinstance(annotation, type):
        text = annotation.__name__
    for m in ("cluster.config.", "cluster.autoscaling.", "router.config.", "kvtransfer.config."):
        text = text.replace(m, "")
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.default_factory is not None:
        return "(section)"
    return f"`{json.dumps(field.default)}`"


def _section(model: type[BaseModel], path: str, out: list[str], seen: set) -> None:
    rows, subs = [], []
    for name, field in model.model_fields.items():
        sub = next((a for a in (field.annotation, *typing.get_args(field.annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
        rows.append(f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {field.description} |")
        if sub is not None:
            subs.append((sub, f"{path}.{name}" if path else name))
    out += [f"## `{path or '(top level)'}`", "", (model.__doc__ or "").strip().replace("\n", " "), "",
            "| key | type | default | what it does |", "| --- | --- | --- | --- |", *rows, ""]
    for sub, p in subs:
        _section(sub, p, out, seen)


def render() -> str:
    out = [HEAD]
    _section(ClusterConfig, "", out, set())
    return "\n".join(out)


if __name__ == "__main__":
    DOC_PATH.write_text(render())
    print(f"wrote {DOC_PATH}")
