"""The PostgreSQL dialect's SQL files keep their rules: migrations are named for their release, and the
named queries call only functions that functions.sql defines, with as many arguments as it declares
(the client's contract with the schema, see functions.sql's opening lines)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from airflow_dbqueue.engine.dialects.ownership import FIRST_RELEASE, release_migrations, release_version
from airflow_dbqueue.engine.dialects.postgres import schema as pg_schema
from airflow_dbqueue.engine.errors import SchemaError
from airflow_dbqueue.engine.sqlfile import load_queries, read_text

PG = "airflow_dbqueue.engine.dialects.postgres"


def test_release_versions() -> None:
    assert [release_version(r) for r in ("1.0", "1.1", "1.10", "2.0")] == [100, 101, 110, 200]
    for bad in ("1", "0025", "1.100", "v1.1", "1.1.0"):
        with pytest.raises(SchemaError):
            release_version(bad)


def test_the_baseline_is_the_first_release_and_migrations_are_named_for_theirs() -> None:
    """schema.sql declares a release no older than the first; each migration is migrations/<release>.sql
    for a release after the first, and the last is schema.sql's own."""
    latest = pg_schema.schema_sql()[0]
    assert latest >= release_version(FIRST_RELEASE)
    folder = Path(pg_schema.__file__).parent / "migrations"
    names = sorted(p.name for p in folder.glob("*.sql"))
    assert all(re.fullmatch(r"[0-9]+\.[0-9]{1,2}\.sql", n) for n in names), names
    versions = [v for v, _ in pg_schema.migrations()]
    assert versions == sorted(set(versions)) and len(versions) == len(names)
    assert all(release_version(FIRST_RELEASE) < v <= latest for v in versions), versions
    assert not versions or versions[-1] == latest
    assert versions or latest == release_version(FIRST_RELEASE)


def test_a_migration_not_named_for_its_release_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "dbq_migrations_probe"
    (package / "migrations").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "migrations" / "1.1.sql").write_text("-- name: add\nALTER TABLE {schema}.meta ADD x int;\n")
    (package / "migrations" / "README.md").write_text("not a migration")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert release_migrations("dbq_migrations_probe") == [(101, ["ALTER TABLE {schema}.meta ADD x int"])]
    (package / "migrations" / "0026_more_columns.sql").write_text("-- name: add\nSELECT 1;\n")
    with pytest.raises(SchemaError, match=r"0026_more_columns\.sql"):
        release_migrations("dbq_migrations_probe")
    sys.modules.pop("dbq_migrations_probe", None)


_CREATE = re.compile(r"CREATE OR REPLACE FUNCTION \{schema\}\.(\w+)\(")
_CALL = re.compile(r"\{schema\}\.(\w+)\(")


def _arguments(text: str, open_paren: int) -> tuple[int, int]:
    """The number of top-level, comma-separated arguments between the parenthesis at ``open_paren``
    and its match (brackets and quoted strings nest), and where that match is."""
    depth, count, seen, quoted = 0, 0, False, False
    for i in range(open_paren, len(text)):
        ch = text[i]
        if quoted:
            quoted = ch != "'"
        elif ch == "'":
            quoted = True
        elif ch in "([":
            depth += 1
            if depth == 1:
                continue
        elif ch in ")]":
            depth -= 1
            if depth == 0:
                return (count + 1 if seen else 0), i
        elif ch == "," and depth == 1:
            count += 1
        if depth >= 1 and not ch.isspace():
            seen = True
    raise AssertionError(f"unbalanced parenthesis at {open_paren}")


def defined_functions() -> dict[str, int]:
    """``{name: number of arguments}`` of every function functions.sql defines (no defaults: none
    has), its OUT arguments left out."""
    text = read_text(PG, "functions.sql")
    out: dict[str, int] = {}
    for m in _CREATE.finditer(text):
        assert m.group(1) not in out, f"{m.group(1)} defined twice"
        n, end = _arguments(text, m.end() - 1)
        results = len(re.findall(r"[(,]\s*OUT\s", text[m.end() - 1 : end]))  # OUT: not passed
        out[m.group(1)] = n - results
    assert " DEFAULT " not in "".join(
        text[m.end() : _arguments(text, m.end() - 1)[1]] for m in _CREATE.finditer(text)
    ), "a function with argument defaults: count its arguments as a range"
    return out


def calls(text: str) -> list[tuple[str, int]]:
    """``(name, number of arguments)`` of every call of a schema's function in ``text``."""
    return [(m.group(1), _arguments(text, m.end() - 1)[0]) for m in _CALL.finditer(text)]


def test_the_named_queries_call_only_functions_that_functions_sql_defines() -> None:
    defined = defined_functions()
    assert len(defined) == 67
    made = calls("\n".join(load_queries(PG, "queries").values()))
    assert len(made) > 20, "found too few calls: the pattern is out of date"
    wrong = sorted({(n, k) for n, k in made if defined.get(n) != k})
    assert wrong == [], (
        f"calls of functions that functions.sql does not define with that many arguments: {wrong}"
    )


def test_the_functions_call_only_functions_that_functions_sql_defines() -> None:
    defined = defined_functions()
    text = read_text(PG, "functions.sql")
    bodies = _CREATE.sub("CREATE OR REPLACE FUNCTION defined(", text)
    wrong = sorted({(n, k) for n, k in calls(bodies) if defined.get(n) != k})
    assert wrong == []


def test_the_check_can_fail() -> None:
    assert calls("SELECT {schema}.ring_push(1, 'a, b', ARRAY[3, 4], f(5, 6))") == [("ring_push", 4)]
    assert calls("SELECT {schema}.ring_holders()") == [("ring_holders", 0)]
    assert defined_functions()["ring_holders"] == 0
