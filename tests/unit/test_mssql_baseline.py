"""The SQL Server baseline (release 1.0): ``schema.sql`` creates the tables, indexes and sequences, and
``functions.sql`` every procedure and function once, as PostgreSQL's files do; and what the two create is
what the last development schema (schema version 6, whose ``schema.sql`` ran versioned blocks in install
order) left after all of its blocks, table by table, column by column and routine by routine."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
import sqlglot
from sqlglot import exp

from airflow_dbqueue.engine.dialects.mssql import schema as ms_schema
from airflow_dbqueue.engine.dialects.ownership import FIRST_RELEASE, engine_objects, release_version
from airflow_dbqueue.engine.sqlfile import parse_named_queries, read_text

MS = "airflow_dbqueue.engine.dialects.mssql"
DEVELOPMENT_SCHEMA = (
    "1be67c7132f7a6700cd953c7855d8353dc8d4a68",
    "airflow_dbqueue/engine/dialects/mssql/schema.sql",
)
"""The commit and path of the last development schema.sql, which the baseline replaces."""
ADDED_SINCE = {"samples", "meta_opt", "dedup"}
"""Tables the baseline gained after it replaced the development schema (the project has not released, so
the baseline changes in place)."""
ADDED_INDEXES_SINCE = {"meta_opt_expiring_idx", "meta_opt_key_idx", "dedup_pushed_idx"}
"""Indexes of the tables added since (deduplication keys, expiry and ordering per key)."""
ADDED_COLUMNS_SINCE = {
    "queues": (
        {"dedup_window_s", "ttl_s", "on_expiry", "ordering"},
        {"queues_dedup_window_valid", "queues_ttl_valid", "queues_on_expiry_valid", "queues_ordering_valid"},
    )
}
"""Columns and constraints (by table) that the baseline's tables gained since, in place as well."""


def _without_added(name: str, table: dict[str, object]) -> dict[str, object]:
    """``table`` without the columns and constraints that :data:`ADDED_COLUMNS_SINCE` lists for it, which
    must be there."""
    columns, constraints = ADDED_COLUMNS_SINCE.get(name, (set(), set()))
    cols = table["columns"]
    cons = table["constraints"]
    assert isinstance(cols, list) and isinstance(cons, dict)
    assert columns <= {c[0] for c in cols} and constraints <= set(cons), name
    return {
        **table,
        "columns": [c for c in cols if c[0] not in columns],
        "constraints": {k: v for k, v in cons.items() if k not in constraints},
    }


CHANGED_SINCE = {"ring_drop_group", "ring_push"}
"""Routines whose text changed after the baseline replaced the development schema (``functions.sql`` is
re-applied by ``install()`` whenever it changes): a dropped group's batches go with it; a push whose
number was given up fails with DQ002 also once the ring has gone round over it."""

_ROUTINE = re.compile(r"^CREATE OR ALTER (PROCEDURE|FUNCTION) \{schema\}\.(\w+)", re.MULTILINE)

Catalogue = dict[str, dict[str, object]]


def _column(col: exp.ColumnDef) -> tuple[str, str, bool, tuple[str, ...]]:
    """(name, type, nullable, its other constraints) of a column definition."""
    nullable, others = True, []
    for c in col.args.get("constraints") or []:
        if isinstance(c.args.get("kind"), exp.NotNullColumnConstraint):
            nullable = bool(c.args["kind"].args.get("allow_null"))
        else:
            others.append(c.sql(dialect="tsql"))
    return col.name, col.args["kind"].sql(dialect="tsql"), nullable, tuple(others)


def catalogue(blocks: Iterable[str]) -> Catalogue:  # noqa: PLR0912
    """What SQL Server blocks, run in order, leave in a schema: each table's columns (in order, with type,
    nullability and column constraints), its named constraints and options, each index and sequence, and
    each procedure and function's text (comments and blank lines dropped; the last of each name).

    Long on purpose: one branch per kind of statement or node, read as a table.
    """
    tables: dict[str, dict[str, object]] = {}
    indexes: dict[str, object] = {}
    sequences: dict[str, object] = {}
    routines: dict[str, object] = {}
    for block in blocks:
        if m := _ROUTINE.search(block):
            code = [
                ln.rstrip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("--")
            ]
            routines[m.group(2)] = (m.group(1), "\n".join(code))
            continue
        for stmt in sqlglot.parse(block.replace("{schema}", "dbq"), read="tsql"):
            if isinstance(stmt, exp.Create) and stmt.args.get("kind") == "TABLE":
                schema = stmt.this
                tables[schema.this.name] = {
                    "columns": [_column(c) for c in schema.expressions if isinstance(c, exp.ColumnDef)],
                    "constraints": {
                        c.name: c.sql(dialect="tsql")
                        for c in schema.expressions
                        if isinstance(c, exp.Constraint)
                    },
                    "options": [],
                }
            elif isinstance(stmt, exp.Create) and str(stmt.args.get("kind")).endswith("INDEX"):
                indexes[stmt.this.name] = stmt.sql(dialect="tsql")
            elif isinstance(stmt, exp.Create) and stmt.args.get("kind") == "SEQUENCE":
                sequences[stmt.this.name] = stmt.sql(dialect="tsql")
            elif isinstance(stmt, exp.Drop) and stmt.args.get("kind") == "TABLE":
                for t in stmt.args["tables"]:
                    del tables[t.name]
                    for name in [n for n, sql in indexes.items() if f" ON dbq.{t.name} " in str(sql)]:
                        del indexes[name]
            elif isinstance(stmt, exp.Drop) and stmt.args.get("kind") == "PROCEDURE":
                for t in stmt.args["tables"]:
                    del routines[t.name]
            elif isinstance(stmt, exp.Alter):
                table = tables[stmt.this.name]
                columns: list[tuple[str, str, bool, tuple[str, ...]]] = table["columns"]  # type: ignore[assignment]
                constraints: dict[str, str] = table["constraints"]  # type: ignore[assignment]
                for action in stmt.args.get("actions") or []:
                    if isinstance(action, exp.ColumnDef):
                        columns.append(_column(action))
                    elif isinstance(action, exp.AlterColumn):
                        i = next(i for i, c in enumerate(columns) if c[0] == action.name)
                        nullable = action.args.get("allow_null") is not False
                        columns[i] = (
                            action.name,
                            action.args["dtype"].sql(dialect="tsql"),
                            nullable,
                            columns[i][3],
                        )
                    elif isinstance(action, exp.Drop) and action.args.get("kind") == "COLUMN":
                        gone = {c.name for c in action.args["tables"]}
                        columns[:] = [c for c in columns if c[0] not in gone]
                    elif isinstance(action, exp.Drop) and action.args.get("kind") == "CONSTRAINT":
                        for c in action.args["tables"]:
                            if constraints.pop(c.name, None) is None:  # a column's own: its default
                                named = f"CONSTRAINT {c.name} "
                                columns[:] = [
                                    (n, t, null, tuple(o for o in others if not o.startswith(named)))
                                    for n, t, null, others in columns
                                ]
                    elif isinstance(action, exp.AddConstraint):
                        for c in action.expressions:
                            constraints[c.name] = c.sql(dialect="tsql")
                    else:
                        assert isinstance(action, exp.AlterSet), action
                        table["options"].append(action.sql(dialect="tsql"))  # type: ignore[attr-defined]
            elif isinstance(stmt, exp.Set | exp.Declare) or stmt is None:
                continue
            else:  # the data the development blocks moved (INSERT, UPDATE, DELETE): no object
                assert isinstance(stmt, exp.Insert | exp.Update | exp.Delete), stmt.sql(dialect="tsql")[:100]
    return {"tables": tables, "indexes": indexes, "sequences": sequences, "routines": routines}


def baseline_blocks() -> list[str]:
    """schema.sql's blocks, then functions.sql's, as a fresh install runs them."""
    return [
        *parse_named_queries(read_text(MS, "schema.sql")).values(),
        *parse_named_queries(read_text(MS, "functions.sql")).values(),
    ]


def development_blocks() -> list[str]:
    """The blocks of the last development schema.sql, in install order (from the repository's history)."""
    commit, path = DEVELOPMENT_SCHEMA
    root = Path(__file__).resolve().parents[2]
    try:
        text = subprocess.run(
            ["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the repository's history (git) is not at hand")
    return list(parse_named_queries(text).values())


def test_the_baseline_creates_what_the_development_schema_left() -> None:
    """A fresh install of the baseline holds the tables (columns in the order a migrated install had
    them), indexes, sequences, procedures and functions (their final text) that every block of the last
    development schema left, and nothing else but the tables added since (:data:`ADDED_SINCE`, with their
    indexes, :data:`ADDED_INDEXES_SINCE`) and the columns (:data:`ADDED_COLUMNS_SINCE`); its two dropped
    procedures are in neither. The routines changed since (:data:`CHANGED_SINCE`) are there under the same
    names."""
    before, after = catalogue(development_blocks()), catalogue(baseline_blocks())
    assert sorted(set(after["tables"]) - ADDED_SINCE) == sorted(before["tables"])
    assert set(after["tables"]) >= ADDED_SINCE
    for name, table in before["tables"].items():
        assert _without_added(name, after["tables"][name]) == table, name
    assert set(after["indexes"]) >= ADDED_INDEXES_SINCE
    assert {k: v for k, v in after["indexes"].items() if k not in ADDED_INDEXES_SINCE} == before["indexes"]
    assert after["sequences"] == before["sequences"]
    assert sorted(after["routines"]) == sorted(before["routines"])
    for name, routine in before["routines"].items():
        if name not in CHANGED_SINCE:
            assert after["routines"][name] == routine, name
    assert all(after["routines"][name] != before["routines"][name] for name in CHANGED_SINCE)
    assert not {"ring_first_unfinished", "ring_lanes_held"} & set(after["routines"])


def test_the_catalogue_follows_alters() -> None:
    got = catalogue(
        [
            "CREATE TABLE {schema}.t (a int NOT NULL CONSTRAINT t_a_df DEFAULT 0, b int NULL, "
            "CONSTRAINT t_b_valid CHECK (b > 0));\n"
            "CREATE INDEX t_b_idx ON {schema}.t (b);\n"
            "ALTER TABLE {schema}.t ADD c int NULL;\n"
            "ALTER TABLE {schema}.t ALTER COLUMN c int NOT NULL;\n"
            "ALTER TABLE {schema}.t DROP CONSTRAINT t_a_df;\n"
            "ALTER TABLE {schema}.t DROP CONSTRAINT t_b_valid;\n"
            "ALTER TABLE {schema}.t DROP COLUMN b;\n"
            "ALTER TABLE {schema}.t SET (LOCK_ESCALATION = DISABLE);",
            "CREATE OR ALTER PROCEDURE {schema}.p\nAS\nBEGIN\n    -- a comment\n    SET NOCOUNT ON;\nEND",
        ]
    )
    table = got["tables"]["t"]
    assert [(n, null, others) for n, _, null, others in table["columns"]] == [
        ("a", False, ()),
        ("c", False, ()),
    ]  # type: ignore[index]
    assert table["constraints"] == {}  # type: ignore[index]
    assert ["LOCK_ESCALATION" in o for o in table["options"]] == [True]  # type: ignore[index]
    assert list(got["indexes"]) == ["t_b_idx"]
    assert got["routines"] == {
        "p": ("PROCEDURE", "CREATE OR ALTER PROCEDURE {schema}.p\nAS\nBEGIN\n    SET NOCOUNT ON;\nEND")
    }


def test_the_files_are_the_baseline_of_the_first_release() -> None:
    """schema.sql holds tables, indexes and sequences only, in one batch, and declares the first release;
    functions.sql defines every routine once, a batch each named for it, and nothing else."""
    version, tables = ms_schema.schema_sql()
    assert version == release_version(FIRST_RELEASE)
    assert list(parse_named_queries(read_text(MS, "schema.sql"))) == ["schema"]
    assert not _ROUTINE.search(tables) and "CREATE OR ALTER" not in tables
    blocks = parse_named_queries(read_text(MS, "functions.sql"))
    for name, body in blocks.items():
        assert [m.group(2) for m in _ROUTINE.finditer(body)] == [name], name
        assert not re.search(r"^(CREATE|ALTER|DROP) (TABLE|INDEX|SEQUENCE)\b", body, re.MULTILINE), name
    batches, _, names = ms_schema.functions_sql()
    assert names == frozenset(blocks) and len(batches) == len(blocks)
    assert {k for k, _ in engine_objects(read_text(MS, "functions.sql"))} == {"procedure", "function"}
    assert not ms_schema.migrations()
