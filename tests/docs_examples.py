"""The code examples of README.md and docs/*.md, found by the marker line above each.

A fenced block preceded by ``<!-- example: KIND [key=value ...] -->`` is checked by a test of its kind:

- ``run`` (python): runs as a script against a fresh database (``$DBQUEUE_DSN``);
- ``shell`` (bash): each line runs in bash against a fresh database, with this environment's ``dbqueue``;
- ``import`` (python): its import statements run (the rest needs a cluster: a Spark job);
- ``parse`` (python): an Airflow DAG file; it is executed and must define a DAG;
- ``dag`` (python): an Airflow DAG file run with ``airflow dags test``; ``dag_id=``, ``queue=``,
  ``finished=`` (messages finished in that queue afterwards) and ``xcom=`` (a JSON object: task id ->
  expected return value) say what to check.

Every python block of those files must carry a marker, so no example goes unchecked.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_MARKER = re.compile(r"<!-- example: (\w+)(.*?)-->\s*\Z")
_OPTION = re.compile(r"(\w+)=(\{.*?\}(?=\s+\w+=|\s*$)|\S+)")


@dataclass(frozen=True)
class Example:
    """One marked code block."""

    kind: str
    options: dict[str, Any]
    language: str
    code: str
    where: str  # file:line of the block's opening fence

    def __str__(self) -> str:
        return self.where


def _options(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _OPTION.findall(text.strip()):
        out[key] = json.loads(value) if value.startswith("{") or value.isdigit() else value
    return out


def examples(path: Path) -> tuple[list[Example], list[str]]:
    """The marked blocks of ``path``, and the places of python blocks that carry no marker."""
    text = path.read_text(encoding="utf-8")
    found, unmarked = [], []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        where = f"{path.relative_to(REPO)}:{line}"
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before + "\n")
        if marker is None:
            if m.group(1) == "python":
                unmarked.append(where)
            continue
        found.append(Example(marker.group(1), _options(marker.group(2)), m.group(1), m.group(2), where))
    return found, unmarked


def all_examples(kind: str) -> list[Example]:
    return [e for path in DOC_FILES for e in examples(path)[0] if e.kind == kind]
