"""Named SQL blocks kept in ``.sql`` files, parsed once.

A file holds blocks introduced by a line ``-- name: <query_name>``; text before the first block is
ignored. Each dialect keeps its queries in its own folder (``queries/``, a file a concern) under the
same names.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_HEADER = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse_named_queries(text: str) -> dict[str, str]:
    """Split ``text`` into ``{name: sql}``; duplicate names are an error."""
    queries: dict[str, str] = {}
    matches = list(_HEADER.finditer(text))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[m.end() : end].strip()
        body = body.removesuffix(";").strip()
        if m.group(1) in queries:
            raise ValueError(f"query {m.group(1)!r} is defined twice")
        queries[m.group(1)] = body
    return queries


@cache
def load_queries(package: str, filename: str) -> dict[str, str]:
    """Load and parse the named queries of ``filename`` inside ``package`` (cached): a ``.sql`` file, or
    a folder of them (each dialect's ``queries``, one file a concern), whose names are one namespace: a
    name in two files is an error as it is in one."""
    where = resources.files(package).joinpath(filename)
    if not where.is_dir():
        return parse_named_queries(where.read_text(encoding="utf-8"))
    queries: dict[str, str] = {}
    for f in sorted((f for f in where.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name):
        for name, body in parse_named_queries(f.read_text(encoding="utf-8")).items():
            if name in queries:
                raise ValueError(f"query {name!r} is defined twice ({filename}/{f.name})")
            queries[name] = body
    return queries


def read_text(package: str, filename: str) -> str:
    """Return the text of a SQL resource file."""
    return resources.files(package).joinpath(filename).read_text(encoding="utf-8")
