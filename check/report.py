"""What a check reports: one Row per case, printed as a table and written as JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

PASS, FAIL, SKIP, INFO = "pass", "fail", "skip", "info"     # INFO: a measurement, nothing to pass


@dataclass
class Row:
    part: str                   # attention | models | speed | kv_pull
    case: str
    result: str                 # the figures as the table shows them
    status: str                 # PASS, FAIL, SKIP or INFO
    goal: str = ""              # a performance goal beside the figure, and whether it is met
    data: dict = field(default_factory=dict)      # every figure, for the JSON

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def part_summary(rows: list[Row]) -> dict:
    """Per part: how many rows and whether all passed (a part that did not run has no rows and did not pass)."""
    parts: dict[str, dict] = {}
    for r in rows:
        p = parts.setdefault(r.part, {"rows": 0, "failed": 0, "skipped": 0})
        p["rows"] += 1
        p["failed"] += r.status == FAIL
        p["skipped"] += r.status == SKIP
    for p in parts.values():
        p["passed"] = p["failed"] == 0
    return parts


def table(rows: list[Row]) -> str:
    """A fixed-width table, one line per row; long results wrap into the next lines of their column."""
    head = ("part", "case", "result", "goal", "status")
    cells = [head] + [(r.part, r.case, r.result, r.goal, r.status.upper()) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(head))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")


def row_to_dict(row: Row) -> dict:
    return asdict(row)


def row_from_dict(d: dict) -> Row:
    return Row(**d)


# -- Triton's interpreter: TRITON_INTERPRET must be set before triton is imported, so a part's CPU kernel cases
# run in a subprocess (`python -m check.<part>`) and send their rows back as JSON on stdout
def interpreted_rows(module: str) -> list[Row]:
    """The rows `python -m module` prints under TRITON_INTERPRET=1 (print_interpreted_rows, its side)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", module], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return [row_from_dict(d) for d in json.loads(proc.stdout)]


def print_interpreted_rows(module: str, rows: Callable[[], list[Row]]) -> None:
    """The subprocess's side: refuse to run outside the interpreter, else print the rows as JSON."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"run with TRITON_INTERPRET=1 ({module}'s CPU cases use Triton's interpreter)")
    print(json.dumps([row_to_dict(r) for r in rows()], default=str))
