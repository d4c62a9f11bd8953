"""The SQL Server dialect without a SQL Server: parity of query names, a T-SQL parse of every statement,
parameter conversion, error translation with real pyodbc exceptions, and a real pyodbc connect through
unixODBC and Microsoft's ODBC Driver 18 to a closed port. Tests that stand a fake in for the server say
``fake`` in their name (tests/fake_mssql.py). Only the tests that build pyodbc's exceptions or connect
through the driver import pyodbc (:func:`tests.fake_mssql.import_pyodbc`): the rest are pure Python and
run without it."""

from __future__ import annotations

import datetime as dt
import json
import re
import socket
import time
import uuid
from decimal import Decimal
from typing import Any

import pytest
import sqlglot
from sqlglot import exp

from airflow_dbqueue.engine import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailableError,
    DbQueue,
    DeadlockError,
    LockTimeoutError,
    QueueFullError,
    SchemaError,
    StatementTimeoutError,
)
from airflow_dbqueue.engine.dialects.factory import dialect_of_dsn
from airflow_dbqueue.engine.dialects.mssql import conninfo as ms_conninfo
from airflow_dbqueue.engine.dialects.mssql import dialect as ms
from airflow_dbqueue.engine.dialects.mssql import errors as ms_errors
from airflow_dbqueue.engine.dialects.mssql import schema as ms_schema
from airflow_dbqueue.engine.dialects.mssql.conninfo import parse_dsn
from airflow_dbqueue.engine.dialects.mssql.dialect import NOT_YET_PORTED, POSTGRES_ONLY, MssqlDatabase
from airflow_dbqueue.engine.dialects.mssql.errors import translate
from airflow_dbqueue.engine.dialects.mssql.params import (
    adapt_row,
    inline_int_params,
    render_named,
    to_positional,
)
from airflow_dbqueue.engine.queue import DEFAULT_CONSUMER, poll_pauses
from airflow_dbqueue.engine.sqlfile import load_queries, parse_named_queries, read_text
from tests.fake_mssql import FakeSqlServer, import_pyodbc

PG = "airflow_dbqueue.engine.dialects.postgres"
MS = "airflow_dbqueue.engine.dialects.mssql"


def tsql_statements(text: str) -> list[exp.Expression]:
    """Parse ``text`` as T-SQL with placeholders as ``?``; raise on a parse error or a vacuous parse."""
    text = re.sub(r"%\([a-z_]+\)s", "?", text)
    parsed = sqlglot.parse(text, read="tsql", error_level=sqlglot.ErrorLevel.RAISE)
    stmts = [s for s in parsed if s is not None]
    fallbacks = [s.sql() for s in stmts if isinstance(s, exp.Command)]
    if fallbacks:
        raise sqlglot.ParseError(f"parsed only as an opaque command: {fallbacks[0][:80]}")
    return stmts


def mssql_sql(name: str) -> str:
    """The text of a named query as the dialect sends it (identifiers composed, integers inlined)."""
    db = MssqlDatabase("mssql://u:p@localhost/db", schema="dbq")
    body = load_queries(MS, "queries")[name]
    names = (
        ("index", "meta_ready_idx"),
        ("table", "meta"),
        ("sequence", "message_id_seq"),
        ("routine", "ring_push"),
    )
    idents = {k: v for k, v in names if "{" + k + "}" in body}
    return inline_int_params(name, db.compose(body, idents or None), {"lock_ms": 1500})


OPAQUE_FORMS = {
    "vacuum_table": r"UPDATE STATISTICS \[dbq\]\.\[meta\]",
    "analyze_table": r"UPDATE STATISTICS \[dbq\]\.\[meta\]",
}
"""Statements sqlglot has no T-SQL grammar for (it reads them as opaque commands, which
:func:`tsql_statements` refuses): each is checked against its exact form instead."""


# -- parity and parse ------------------------------------------------------------------------------


def test_every_postgresql_query_name_is_ported_or_listed_as_not_yet_ported() -> None:
    pg = set(load_queries(PG, "queries"))
    mssql = set(load_queries(MS, "queries"))
    assert mssql <= pg, f"SQL Server queries without a PostgreSQL twin: {sorted(mssql - pg)}"
    missing = pg - mssql
    listed = set(NOT_YET_PORTED) | set(POSTGRES_ONLY)
    assert missing == listed, (
        f"not ported and not listed: {sorted(missing - listed)}; "
        f"listed but ported or gone: {sorted(listed - missing)}"
    )


RING_GROUP_QUERIES = {
    "ring_add_group",
    "ring_drop_group",
    "ring_groups",
    "ring_group_moved",
}
"""The queries of a ring's consumer groups besides its default one."""

RING_BATCH_QUERIES = {"ring_take_lease_ids", "ring_record_batch", "ring_batch_rows", "ring_extend_batch"}
"""The queries of a ring's batches (with the batch ledger's own: get_batch, lock_batch and the rest)."""


def test_the_table_design_maintenance_and_the_ring_are_fully_ported() -> None:
    """Every query the table design (with its deduplication keys, expiry and ordering per key:
    ``push_options``), the ring design with its consumer groups and batches, the client and maintenance
    run exists on SQL Server; a pop of payloads only of a queue with options runs pop_take_with, as the
    other pops of payloads run their take (``payload_pops = False``)."""
    assert NOT_YET_PORTED == {} and MssqlDatabase.push_options and not MssqlDatabase.payload_pops
    assert "pop_take_payloads_with" in POSTGRES_ONLY
    options = {"push_with", "forget_dedup", "expire_fail", "expire_drop", "count_expired"}
    options |= {"pop_lease_with", "pop_take_with", "claim_batch_with", "ack_with", "nack_with"}
    assert options <= set(load_queries(MS, "queries"))
    ring = {n for n in load_queries(PG, "queries") if n.startswith("ring_")} - POSTGRES_ONLY.keys()
    assert len(ring) == 33 and RING_GROUP_QUERIES | RING_BATCH_QUERIES <= ring <= set(
        load_queries(MS, "queries")
    )
    used = {"push", "pop_lease", "pop_take", "ack", "nack", "held_receipts", "reclaim_expired"}
    used |= {"claim_batch", "get_batch", "lock_batch", "finish_batch", "purge_batches", "batch_rows"}
    used |= {"maintenance_try_lock", "maintenance_unlock", "maintenance_lock_holder", "set_timeouts"}
    used |= {"reset_timeouts", "archive_batch", "purge_archive_batch", "vacuum_table", "analyze_table"}
    used |= {"reindex_concurrently", "drop_index_concurrently", "index_health", "table_health"}
    used |= {"xmin_holders", "queue_rates"}
    assert used <= set(load_queries(MS, "queries"))


def batch_statements(text: str) -> list[str]:
    """The statements of a T-SQL batch one by one, each without the ``IF``, ``ELSE`` or ``WHILE`` line
    and the ``BEGIN`` and ``END`` around it. sqlglot reads ``IF <condition> <statement>;`` as a block that
    takes in the rest of the batch, where a statement it can only read as an opaque command no longer
    shows at the top (:func:`tsql_statements` refuses those): each statement is parsed by itself here."""
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("--"))
    out = []
    for stmt in re.split(r";\s*\n", code):
        lines = [ln for ln in stmt.strip().splitlines() if ln.strip() not in ("BEGIN", "END", "ELSE")]
        while lines and re.match(r"(IF|WHILE|ELSE) ", lines[0]):
            lines = lines[1:]
        if lines:
            out.append("\n".join(lines))
    return out


@pytest.mark.parametrize("name", sorted(n for n in load_queries(MS, "queries") if n not in OPAQUE_FORMS))
def test_every_statement_of_a_tsql_batch_parses_by_itself(name: str) -> None:
    """Each statement of a named query parses as T-SQL on its own, those after an ``IF`` and in a
    ``WHILE`` too, and none only as an opaque command."""
    text = re.sub(r"%\([a-z_]+\)s", "?", mssql_sql(name))
    for stmt in batch_statements(text):
        assert tsql_statements(stmt), stmt


def test_an_opaque_statement_after_an_if_fails_only_the_parse_by_statement() -> None:
    """What the test above adds: push_with with a statement sqlglot reads only as an opaque command
    (``TABLES`` for ``TABLE``) after its first ``IF`` still passes the whole batch's parse."""
    text = re.sub(r"%\([a-z_]+\)s", "?", mssql_sql("push_with"))
    broken = text.replace("DECLARE @seen TABLE (", "DECLARE @seen TABLES (")
    assert broken != text and tsql_statements(broken)
    with pytest.raises(sqlglot.ParseError, match="opaque command"):
        for stmt in batch_statements(broken):
            tsql_statements(stmt)


@pytest.mark.parametrize("name", sorted(load_queries(MS, "queries")))
def test_every_tsql_query_parses_as_tsql(name: str) -> None:
    text = mssql_sql(name)
    if name in OPAQUE_FORMS:
        text = re.sub(r"^--.*\n", "", text, flags=re.MULTILINE).strip()
        assert re.fullmatch(OPAQUE_FORMS[name], text), text
        [cmd] = sqlglot.parse(text, read="tsql")
        assert isinstance(cmd, exp.Command)  # when sqlglot learns it, parse it like the others
        return
    stmts = tsql_statements(text)
    assert stmts


def test_the_schema_parses_as_tsql() -> None:
    version, body = ms_schema.schema_sql()
    stmts = tsql_statements(MssqlDatabase("mssql://h/db", schema="dbq").compose(body))
    assert version == 100  # release 1.0
    created = [s for s in stmts if isinstance(s, exp.Create)]
    assert len(created) >= 12  # tables, sequence, indexes


def read_blocks() -> dict[str, str]:
    """The blocks of the SQL Server schema.sql and functions.sql as written, in install order: ``schema``,
    then one a routine, named for it."""
    return {
        **parse_named_queries(read_text(MS, "schema.sql")),
        **parse_named_queries(read_text(MS, "functions.sql")),
    }


def schema_blocks() -> dict[str, str]:
    """The blocks of :func:`read_blocks`, composed for schema ``dbq``."""
    db = MssqlDatabase("mssql://h/db", schema="dbq")
    return {k: db.compose(v) for k, v in read_blocks().items()}


OPAQUE_PROCEDURE_STATEMENTS = (
    re.compile(r"WAITFOR DELAY @[a-z_]+;"),
    re.compile(
        r"INSERT INTO @out \((?:[a-z_]+, )*[a-z_]+\) EXEC \[dbq\]\.ring_take "
        r"(?:@[a-z_]+ = @?[a-z0-9_]+, )*@[a-z_]+ = @?[a-z0-9_]+;"
    ),
)
"""Procedure statements sqlglot has no T-SQL grammar for, each checked against its exact form instead
(``WAITFOR DELAY``, and ``INSERT ... EXEC``, which collects a procedure's result set into a table)."""
_CONTROL = re.compile(r"^(IF|WHILE) (.*)$", re.DOTALL)


def procedure_statements(text: str) -> tuple[exp.Create, list[exp.Expression], list[str]]:  # noqa: PLR0915
    """Check a CREATE OR ALTER PROCEDURE of schema.sql statement by statement.

    The whole procedure must parse as one ``CREATE PROCEDURE`` (after its opaque statements, see
    :data:`OPAQUE_PROCEDURE_STATEMENTS`, are replaced by a no-op), and then every statement of its body
    is parsed alone as T-SQL (no opaque command accepted), because sqlglot is lenient inside a
    procedure's body. The body's layout makes that split exact: a statement ends with ``;`` at the end
    of a line; ``IF <condition>`` and ``WHILE <condition>`` run up to a line ``BEGIN``, and their
    condition is parsed as ``SELECT 1 WHERE <condition>``; blocks end with a line ``END;``; ``BREAK;``,
    ``CONTINUE;`` and ``RETURN;`` stand alone; ``BEGIN TRY`` ... ``END TRY`` is followed by ``BEGIN CATCH``
    ... ``END CATCH;``, each on a line of its own, and ``THROW;`` stands alone in a CATCH block. Returns the
    procedure, the parsed statements and the opaque ones.

    Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around.
    """
    text = "\n".join(ln for ln in text.splitlines() if not ln.strip().startswith("--"))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    start = lines.index("BEGIN") + 1
    assert lines[start - 2].endswith("AS") or lines[start - 2] == "AS", lines[: start + 1]
    assert lines[-1] == "END", lines[-1]
    parsed: list[exp.Expression] = []
    opaque: list[str] = []
    blocks: list[str] = []  # the open blocks: BEGIN (of an IF or WHILE), TRY, CATCH
    buf, after_try = "", False
    for line in lines[start:-1]:
        assert not after_try or line == "BEGIN CATCH", f"END TRY, then {line!r}"
        after_try = False
        if not buf and line == "BEGIN":
            raise AssertionError("a BEGIN without IF or WHILE")
        if not buf and line in ("BEGIN TRY", "BEGIN CATCH"):
            blocks.append(line.split()[1])
            continue
        if not buf and line in ("END;", "END TRY", "END CATCH;"):
            want = {"END;": "BEGIN", "END TRY": "TRY", "END CATCH;": "CATCH"}[line]
            assert blocks and blocks.pop() == want, f"{line} without its BEGIN"
            after_try = line == "END TRY"
            continue
        if not buf and line in ("BREAK;", "CONTINUE;", "RETURN;"):
            continue
        if not buf and line == "THROW;":
            assert "CATCH" in blocks, "THROW; outside a CATCH block"
            continue
        if line == "BEGIN":
            control = _CONTROL.match(buf)
            assert control, f"BEGIN after {buf!r}"
            [cond] = tsql_statements(f"SELECT 1 WHERE {control.group(2)}")
            parsed.append(cond)
            blocks.append("BEGIN")
            buf = ""
            continue
        buf = f"{buf} {line}".strip()
        if buf.endswith(";") and not _CONTROL.match(buf):
            if any(p.fullmatch(buf) for p in OPAQUE_PROCEDURE_STATEMENTS):
                opaque.append(buf)
            else:
                got = tsql_statements(buf)
                assert len(got) == 1, (buf, got)
                parsed.extend(got)
            buf = ""
    assert not blocks and not buf and not after_try, (blocks, buf)
    whole = text
    for statement in opaque:  # it may span lines: matched token by token
        pattern = r"\s+".join(re.escape(token) for token in statement.split())
        whole, replaced = re.subn(pattern, "SET NOCOUNT ON;", whole, count=1)
        assert replaced == 1, statement
    [proc] = tsql_statements(whole)
    assert isinstance(proc, exp.Create) and proc.args.get("kind") == "PROCEDURE", type(proc)
    return proc, parsed, opaque


PROCEDURES = sorted(k for k, v in schema_blocks().items() if "\nCREATE OR ALTER PROCEDURE" in f"\n{v}")
FUNCTIONS = sorted(k for k, v in schema_blocks().items() if "\nCREATE OR ALTER FUNCTION" in f"\n{v}")


def test_the_schema_is_one_batch_and_each_routine_one_of_its_own() -> None:
    """schema.sql is one block, one batch (tables, indexes, sequences); functions.sql a block a routine
    (a CREATE PROCEDURE or FUNCTION must be alone in its batch), named for it, applied after it."""
    blocks = schema_blocks()
    compose = MssqlDatabase("mssql://h/db", schema="dbq").compose
    [first, *routines] = blocks
    assert first == "schema" and blocks["schema"] == compose(ms_schema.schema_sql()[1])
    assert sorted(routines) == sorted(ms_schema.functions_sql()[2])
    assert "CREATE TABLE [dbq].ring_groups (" in blocks["schema"]
    assert "CREATE SEQUENCE [dbq].group_gids AS int" in blocks["schema"]
    for table in ("meta", "done"):  # in the row (not a LOB), so meta's indexes still rebuild online
        create = re.search(rf"CREATE TABLE \[dbq\]\.{table} \((.*?)\n\);", blocks["schema"], re.DOTALL)
        assert create and "\n    payload varbinary(1900) NULL,\n" in create.group(1), table
    assert "CREATE TABLE [dbq].owned_objects (" in blocks["schema"]
    assert "CREATE SCHEMA" not in blocks["schema"]  # install() creates it, only when it is missing
    for name in (
        "rings",
        "ring_slots",
        "ring_failed",
        "ring_lanes",
        "ring_push_lanes",
        "ring_leases",
        "ring_retry",
    ):
        assert f"CREATE TABLE [dbq].{name} (" in blocks["schema"]
    assert "CREATE INDEX ring_lanes_pos_idx ON [dbq].ring_lanes (queue_id, pos);" in blocks["schema"]
    tsql_statements(blocks["schema"])


def test_every_ring_procedure_parses_statement_by_statement() -> None:
    assert PROCEDURES == [
        "ring_add_group",
        "ring_create",
        "ring_drop",
        "ring_drop_group",
        "ring_floor",
        "ring_floor_try",
        "ring_pass",
        "ring_pop",
        "ring_push",
        "ring_push_lanes_held",
        "ring_reclaim_expired",
        "ring_settle",
        "ring_skip_abandoned",
        "ring_skip_gap",
        "ring_split_leases",
        "ring_take",
    ]
    counts = {}
    for name in PROCEDURES:
        proc, parsed, opaque = procedure_statements(schema_blocks()[name])
        assert proc.this.this.name == name
        counts[name] = (len(parsed), opaque)
    # the full ring's WAITFOR DELAY, the push's only opaque statement
    assert counts["ring_push"][1] == ["WAITFOR DELAY @wait;"]
    [collect] = counts["ring_pop"][1]  # the take's messages, collected with INSERT ... EXEC
    assert collect.startswith(
        "INSERT INTO @out (id, attempts, deliveries, enqueued_at, lease_until, payload) EXEC"
    )
    assert all(not o for n, (_, o) in counts.items() if n not in ("ring_push", "ring_pop"))
    assert all(p >= 2 for p, _ in counts.values()), counts


def test_every_ring_function_is_one_inline_select() -> None:
    assert FUNCTIONS == ["ring_held", "ring_ready", "ring_series"]
    for name in FUNCTIONS:
        [create] = tsql_statements(schema_blocks()[name])
        assert isinstance(create, exp.Create) and create.args.get("kind") == "FUNCTION", name
        assert create.this.this.name == name
        assert "RETURNS TABLE\nAS\nRETURN (" in schema_blocks()[name]  # inline: expanded where it is used
        assert isinstance(create.expression, exp.Return), name
        body = create.expression.this
        assert isinstance(body, exp.Select | exp.Union | exp.Subquery), (name, type(body))


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("SET @k = @@ROWCOUNT;", "SET @k = @@ROWCOUNT +;"),
        ("DECLARE @k int;", "DECLARE @k int int;"),
        ("IF @lanes < @floor OR @floor IS NULL", "IF @lanes < @floor OR"),
        ("WAITFOR DELAY @wait;", "WAITFOR DELAY '00:00:01' + 1;"),
        ("SET @remaining = NULL;", "SET @remaining = NULL"),
        ("    END;\n    SELECT @k AS skipped", "    SELECT @k AS skipped"),
        ("SET @held = (SELECT count(*) FROM @h);", "SET @held = (SELECT count(*) FROM @h;"),
        ("@retries = 0, @wait = @wait;", "@retries = 0, @wait = @wait + 1;"),
        ("SET @count = (SELECT count(*) FROM @held);", "SET @count = (SELECT count(*) FROM @held WHERE);"),
        ("    END CATCH;\n", ""),
        ("    END TRY\n    BEGIN CATCH\n", "    END TRY\n    SET @floor = 0;\n    BEGIN CATCH\n"),
        (
            "        SET @floor = NULL;\n        IF ERROR_NUMBER()",
            "        SET @floor = NULL +;\n        IF ERROR_NUMBER()",
        ),
    ],
)
def test_the_procedure_check_is_not_vacuous_broken_bodies_are_rejected(good: str, bad: str) -> None:
    name = next(n for n in PROCEDURES if good in schema_blocks()[n])
    broken = schema_blocks()[name].replace(good, bad, 1)
    assert broken != schema_blocks()[name]
    with pytest.raises((sqlglot.ParseError, AssertionError)):
        procedure_statements(broken)


_EVENT = re.compile(
    r"(?P<create>CREATE (?:OR ALTER )?(?P<ckind>PROCEDURE|FUNCTION|TABLE) \[dbq\]\.(?P<cname>[a-z_]+))"
    r"|(?P<drop>DROP (?P<dkind>PROCEDURE|TABLE) (?:IF EXISTS )?\[dbq\]\.(?P<dname>[a-z_]+))"
    r"|(?P<call>(?:EXEC \[dbq\]\.(?P<proc>[a-z_]+))|\[dbq\]\.(?P<func>[a-z_]+)\()"
)
_REFERENCE = re.compile(r"\[dbq\]\.([a-z_]+)")


def test_each_block_uses_only_what_earlier_blocks_made_and_the_last_one_leaves_nothing_dangling() -> None:
    """The install runs the blocks in file order: a procedure or function is created before a block that
    calls it, and after the last block every procedure and function names only objects that exist."""
    made: dict[str, str] = {}
    bodies: dict[str, str] = {}
    for name, block in schema_blocks().items():
        code = "\n".join(ln for ln in block.splitlines() if not ln.strip().startswith("--"))
        own = None
        for m in _EVENT.finditer(code):
            if m.group("create"):
                own = m.group("cname")
                made[own] = m.group("ckind")
                bodies[own] = code
            elif m.group("drop"):
                assert made.pop(m.group("dname"), None) == m.group("dkind"), (name, m.group(0))
                bodies.pop(m.group("dname"), None)
            else:
                callee = m.group("proc") or m.group("func")
                assert callee == own or made.get(callee) in ("PROCEDURE", "FUNCTION"), (
                    f"{name} calls {callee}"
                )
    routines = {o for o, k in made.items() if k in ("PROCEDURE", "FUNCTION")}
    assert routines == {
        "ring_create",
        "ring_drop",
        "ring_floor",
        "ring_floor_try",
        "ring_held",
        "ring_pass",
        "ring_pop",
        "ring_push",
        "ring_push_lanes_held",
        "ring_ready",
        "ring_add_group",
        "ring_drop_group",
        "ring_reclaim_expired",
        "ring_series",
        "ring_settle",
        "ring_skip_abandoned",
        "ring_skip_gap",
        "ring_split_leases",
        "ring_take",
    }
    tables = {o for o, k in made.items() if k == "TABLE"}
    assert {
        "rings",
        "ring_slots",
        "ring_lanes",
        "ring_push_lanes",
        "ring_leases",
        "ring_retry",
        "ring_failed",
        "ring_groups",
    } <= tables
    for obj in routines:
        dangling = set(_REFERENCE.findall(bodies[obj])) - set(made)
        assert not dangling, f"{obj} names {dangling}, which the last version no longer has"


def _final_tables() -> dict[str, list[str]]:
    """The columns of each table after every block of schema.sql, in order (CREATE, ALTER ... ADD and
    DROP COLUMN, DROP TABLE), read from sqlglot's parse."""
    tables: dict[str, list[str]] = {}
    for block in schema_blocks().values():
        if "\nCREATE OR ALTER " in f"\n{block}":
            continue
        for stmt in tsql_statements(block):
            if isinstance(stmt, exp.Create) and stmt.args.get("kind") == "TABLE":
                schema = stmt.this
                tables[schema.this.name] = [
                    c.name for c in schema.expressions if isinstance(c, exp.ColumnDef)
                ]
            elif isinstance(stmt, exp.Drop) and stmt.args.get("kind") == "TABLE":
                for t in stmt.args["tables"]:
                    del tables[t.name]
            elif isinstance(stmt, exp.Alter):
                cols = tables[stmt.this.name]
                for action in stmt.args.get("actions") or []:
                    if isinstance(action, exp.ColumnDef):
                        cols.append(action.name)
                    elif isinstance(action, exp.Drop) and action.args.get("kind") == "COLUMN":
                        for c in action.args["tables"]:
                            cols.remove(c.name)
    return tables


def _postgres_tables() -> dict[str, list[str]]:
    text = read_text(PG, "schema.sql")
    out = {}
    for name, body in re.findall(r"CREATE TABLE \{schema\}\.([a-z_]+) \((.*?)\n\)", text, flags=re.DOTALL):
        create = sqlglot.parse_one(f"CREATE TABLE {name} ({body})", read="postgres")
        out[name] = [c.name for c in create.this.expressions if isinstance(c, exp.ColumnDef)]
    return out


MSSQL_ONLY_RING_COLUMNS = {
    "rings": ["push_seq_id", "gap_seq_id", "push_lanes"],  # sys.sequences ids; the gap proof's lanes
}
"""Columns the SQL Server ring tables have beyond PostgreSQL's, and why."""

POSTGRES_ONLY_RING_TABLES = {"ring_rows"}
"""Ring tables of PostgreSQL's alone: the registry of the rings of the rows layout, which is
PostgreSQL-only (create_queue refuses it on SQL Server)."""


def test_the_ring_tables_end_with_postgresqls_columns() -> None:
    """A fresh install and a version-2 schema migrated by the same blocks end with the ring tables of
    PostgreSQL's schema.sql, column for column (and ring_push_lanes, the gap proof's own)."""
    ours, theirs = _final_tables(), _postgres_tables()
    ring = sorted(
        t for t in theirs if (t == "rings" or t.startswith("ring_")) and t not in POSTGRES_ONLY_RING_TABLES
    )
    assert ring == [
        "ring_failed",
        "ring_groups",
        "ring_lanes",
        "ring_leases",
        "ring_retry",
        "ring_slots",
        "rings",
    ]
    for table in ring:
        extra = MSSQL_ONLY_RING_COLUMNS.get(table, [])
        assert [c for c in ours[table] if c not in extra] == theirs[table], table
        assert set(extra) <= set(ours[table])
    assert ours["ring_push_lanes"] == ["queue_id", "lane", "pushes"]
    assert ours["ring_slots"] == ["queue_id", "slot", "seq", "enqueued_at", "payload"]


# -- the procedures' arithmetic, evaluated from the parsed T-SQL -----------------------------------------


def _tsql_mod(a: int, b: int) -> int:
    """T-SQL's % on integers: the sign of the dividend (C's truncating remainder), not Python's."""
    r = abs(a) % abs(b)
    return -r if a < 0 else r


def tsql_eval(node: exp.Expression, env: dict[str, Any]) -> Any:  # noqa: PLR0911, PLR0912
    """Evaluate a T-SQL scalar expression of integers (columns and @variables from ``env``, NULL as None)
    with T-SQL's semantics: NULL propagates, % and / truncate toward zero, CASE takes the first true WHEN.

    Long on purpose: one branch per kind of statement or node, read as a table.
    """
    if isinstance(node, exp.Paren | exp.Cast):
        return tsql_eval(node.this, env)
    if isinstance(node, exp.Column):
        return env[node.sql(dialect="tsql")]
    if isinstance(node, exp.Parameter):
        return env["@" + node.name]
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Literal):
        return int(node.this)
    if isinstance(node, exp.Neg):
        v = tsql_eval(node.this, env)
        return None if v is None else -v
    if isinstance(node, exp.Coalesce):
        for arg in [node.this, *node.expressions]:
            v = tsql_eval(arg, env)
            if v is not None:
                return v
        return None
    if isinstance(node, exp.Case):
        for branch in node.args["ifs"]:
            if tsql_eval(branch.this, env) is True:
                return tsql_eval(branch.args["true"], env)
        default = node.args.get("default")
        return None if default is None else tsql_eval(default, env)
    if isinstance(node, exp.In):
        v = tsql_eval(node.this, env)
        return None if v is None else v in [tsql_eval(e, env) for e in node.expressions]
    if isinstance(node, exp.And | exp.Or):
        a, b = tsql_eval(node.this, env), tsql_eval(node.expression, env)
        if isinstance(node, exp.And):
            return False if False in (a, b) else (None if None in (a, b) else True)
        return True if True in (a, b) else (None if None in (a, b) else False)
    binary = {
        exp.Add: lambda a, b: a + b,
        exp.Sub: lambda a, b: a - b,
        exp.Mul: lambda a, b: a * b,
        exp.Div: lambda a, b: int(a / b) if a * b >= 0 else -(abs(a) // abs(b)),
        exp.Mod: _tsql_mod,
        exp.EQ: lambda a, b: a == b,
        exp.NEQ: lambda a, b: a != b,
        exp.LT: lambda a, b: a < b,
        exp.LTE: lambda a, b: a <= b,
        exp.GT: lambda a, b: a > b,
        exp.GTE: lambda a, b: a >= b,
    }
    for kind, op in binary.items():
        if isinstance(node, kind):
            a, b = tsql_eval(node.this, env), tsql_eval(node.expression, env)
            return None if a is None or b is None else op(a, b)
    raise NotImplementedError(node.sql(dialect="tsql"))


def test_the_evaluator_is_t_sqls_not_pythons() -> None:
    e = sqlglot.parse_one(
        "SELECT -7 % 3, 7 % -3, -7 / 2, CASE WHEN @x IN (1, 2) THEN 1 END, coalesce(@y, 4)", read="tsql"
    )
    got = [tsql_eval(x, {"@x": None, "@y": None}) for x in e.expressions]
    assert got == [-1, 1, -3, None, 4]


def test_a_take_moves_each_lane_it_held_past_the_last_number_taken() -> None:
    """ring_take's new position of a lane it held: its first number after the last one taken (@top),
    unless the lane is already past it."""
    take = schema_blocks()["ring_take"]
    [update] = [
        s
        for s in procedure_statements(take)[1]
        if isinstance(s, exp.Update) and "@top" in s.sql(dialect="tsql")
    ]
    [assignment] = update.expressions
    assert assignment.this.name == "pos"
    for lanes in range(1, 9):
        for top in range(0, 40):
            for lane in range(lanes):
                for pos in (lane, top + 1 + lanes * 3 + lane):
                    got = tsql_eval(
                        assignment.expression, {"@top": top, "@lanes": lanes, "l.lane": lane, "l.pos": pos}
                    )
                    first = next(x for x in range(top + 1, top + 1 + lanes) if x % lanes == lane)
                    assert got == max(pos, first), (lanes, top, lane, pos)


# -- parity of the ring's queries: parameters and result columns -------------------------------------

_PLACEHOLDER = re.compile(r"%\(([a-z_]+)\)[sb]")

RING_PARAMETERS_POSTGRESQL_ONLY = {
    "ring_create": {"schema"},  # a procedure knows its own schema (OBJECT_SCHEMA_NAME(@@PROCID))
    "ring_push": {"notify", "channel", "floor"},  # no NOTIFY (waiting pops poll); reads the floor itself
    "ring_push_one": {"notify", "channel", "floor"},  # SQL Server's push reads the floor itself
    "ring_take_one": {"queue_id"},  # the procedure looks a group's ring up from its key
    "ring_stats": {"cap"},  # SQL Server counts every message of a deep ring (no estimate above a cap)
}
RING_PARAMETERS_MSSQL_ONLY = {
    "ring_snapshot": {"queue_id"},  # the gap proof's list is the ring's push lanes, not the server's xids
}


def test_the_ring_queries_take_postgresqls_parameters() -> None:
    """Each ring query binds the parameters of its PostgreSQL twin (RingQueue passes one dict to both),
    but for the few listed with their reason."""
    pg, mssql = load_queries(PG, "queries"), load_queries(MS, "queries")
    ring = {n for n in pg if n.startswith("ring_")} - POSTGRES_ONLY.keys()
    for name in sorted(ring | {"get_queue", "list_queues"}):
        theirs, ours = set(_PLACEHOLDER.findall(pg[name])), set(_PLACEHOLDER.findall(mssql[name]))
        assert theirs - ours == RING_PARAMETERS_POSTGRESQL_ONLY.get(name, set()), name
        assert ours - theirs == RING_PARAMETERS_MSSQL_ONLY.get(name, set()), name


@pytest.mark.parametrize(
    ("narrow", "whole"), [("ring_take_payloads", "ring_take"), ("pop_take_payloads", "pop_take")]
)
def test_a_pop_of_payloads_runs_the_take_the_whole_pop_runs(narrow: str, whole: str) -> None:
    """PostgreSQL's statements of a pop of payloads only select the payload column from the function
    call of the pop they narrow, with its parameters; SQL Server (payload_pops = False) runs that pop's
    own query instead, so there is nothing of theirs to port."""
    pg = load_queries(PG, "queries")

    def call(name: str) -> str:
        statement = " ".join(re.sub(r"^--.*\n", "", pg[name], flags=re.MULTILINE).split())
        return statement.split(" FROM ", 1)[1] if " FROM " in statement else ""

    assert narrow in POSTGRES_ONLY and not MssqlDatabase.payload_pops
    assert call(narrow) == call(whole) != ""
    assert call(narrow).startswith("{schema}.")
    assert _postgres_width(narrow) == 1
    assert set(_PLACEHOLDER.findall(pg[narrow])) == set(_PLACEHOLDER.findall(pg[whole]))


def _result_width(stmt: exp.Expression) -> int | None:
    """How many columns a statement returns (None: no result set)."""
    if isinstance(stmt, exp.Union):
        return _result_width(stmt.left)
    if isinstance(stmt, exp.Select):
        if all(isinstance(e, exp.EQ) and isinstance(e.this, exp.Parameter) for e in stmt.expressions):
            return None  # SELECT @x = ...: an assignment
        if (
            stmt.args.get("from") is None
            and stmt.args.get("where") is not None
            and stmt.sql().startswith("SELECT 1 ")
        ):
            return None  # an IF or WHILE condition, as procedure_statements parses it
        return len(stmt.expressions)
    returning = stmt.args.get("returning")
    if returning is not None and not returning.args.get("into"):
        return len(returning.expressions)
    return None


def _postgres_width(name: str) -> int | None:
    text = _PLACEHOLDER.sub("NULL", load_queries(PG, "queries")[name]).replace("{schema}", "dbq")
    return _result_width([s for s in sqlglot.parse(text, read="postgres") if s is not None][-1])


def _mssql_widths(name: str) -> set[int]:
    """The widths of every result set a SQL Server query can return: its last statement's, or, for an EXEC
    of a ring procedure, those of the procedure's result sets."""
    last = tsql_statements(mssql_sql(name))[-1]
    if isinstance(last, exp.Execute):
        proc = last.this.name
        statements = procedure_statements(schema_blocks()[proc])[1]
        return {w for w in map(_result_width, statements) if w is not None}
    width = _result_width(last)
    return set() if width is None else {width}


RING_RESULTS_DIFFERENT = {
    # PostgreSQL's adds the actions the session's role may take (its grants); the client reads them when
    # they are there, and a queue on SQL Server allows every action.
    "get_queue": (19, {18}),
    "ring_create": (1, set()),  # PostgreSQL's SELECT of a void function; the procedure returns no rows
    "ring_drop": (1, set()),
    "ring_push": (2, {1}),  # PostgreSQL's push sends the floor it read beside the first number
    "ring_take": (
        3,
        {6},
    ),  # the procedure returns ring_pop's messages; PostgreSQL sends three of their columns
    "ring_take_one": (3, {6}),  # as ring_take
    "ring_take_lease": (4, {6}),  # and four leased: the lease end once, the first delivery implied
    "ring_take_lease_ids": (2, {6}),  # and two for a claimed batch: no payload, read by its reader
    "ring_skip_abandoned": (
        1,
        {2},
    ),  # and the push lanes still to be seen unlocked, which recover_gaps passes back
}


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n in load_queries(PG, "queries")
        if (n.startswith("ring_") and n not in POSTGRES_ONLY) or n in ("get_queue", "list_queues")
    ),
)
def test_the_ring_queries_return_postgresqls_columns(name: str) -> None:
    want = _postgres_width(name)
    assert want is not None, name
    got = _mssql_widths(name)
    assert (want, got) == RING_RESULTS_DIFFERENT.get(name, (want, {want})), name


def test_the_result_width_check_is_not_vacuous() -> None:
    assert _result_width(sqlglot.parse_one("SELECT @a = 1, @b = 2", read="tsql")) is None
    assert _result_width(sqlglot.parse_one("SELECT @a = 1, 2", read="tsql")) == 2
    assert _mssql_widths("ring_take") == {6} and _mssql_widths("ring_pop") == {9}
    assert _mssql_widths("ring_peek") == {6} and _postgres_width("ring_stats") == 11


# -- how the ring's procedures lock ------------------------------------------------------------------


def test_the_ring_reads_and_takes_past_locks_as_skip_locked_does() -> None:
    """The take locks lanes lowest position first past those other pops hold and reads slots past the
    locks of pushes in progress; ring_pass locks the lanes it can and reads slots past locks; the pop
    serves retry rows past those other pops hold; the push writes its slots past locks, gated on the
    floor, after it locked a push lane and before its numbers, and reads the floor again only after a
    wait."""
    take = schema_blocks()["ring_take"]
    lanes = re.findall(r"FROM \[dbq\]\.ring_lanes t WITH \(([A-Z, ]+)\)", take)
    assert lanes == [
        "ROWLOCK, UPDLOCK, READPAST",  # a pop of one
        "ROWLOCK, UPDLOCK, READPAST",  # a batch
        "ROWLOCK, UPDLOCK, READPAST",  # is every lane held by another pop?
        "ROWLOCK, UPDLOCK",  # then wait for the lowest one
        "ROWLOCK, UPDLOCK, READPAST",  # and take free ones, up to half the lanes
    ]
    assert "CREATE INDEX ring_lanes_pos_idx ON [dbq].ring_lanes (queue_id, pos);" in schema_blocks()["schema"]
    assert take.count("ORDER BY t.pos") == 4 and "ORDER BY t.lane" not in take  # lowest positions first
    assert "BEGIN\n    SET NOCOUNT ON;\n    SET LOCK_TIMEOUT 1000;\n" in take  # a wait lasts 1 s at most
    # Messages due again are looked for by the statements that lock lanes, and once more before a wait.
    retry = "FROM [dbq].ring_retry r WITH (READCOMMITTEDLOCK, READPAST)"
    assert take.count(retry) == 3
    assert take.count("AND NOT (@retries = 1 AND EXISTS (") == 2
    # A pop of one and a batch lock only lanes whose next number is written.
    locked_if_written = "WITH (ROWLOCK, UPDLOCK, READPAST)\n{}WHERE t.queue_id = @gid AND EXISTS ("
    assert take.count(locked_if_written.format(" " * 12)) == 1  # a pop of one
    assert take.count(locked_if_written.format(" " * 4)) == 1  # a batch
    slot_reads = re.findall(r"\[dbq\]\.ring_slots s(?: WITH \(([A-Z, ]+)\))?", take)
    # The written checks of a pop of one, of a batch and of the lanes waited for, the window's numbers (its
    # plain aggregate, and the window scan), and the payloads of a batch read past locks; a pop of one
    # reads its one slot, known written, plainly.
    assert slot_reads.count("READCOMMITTEDLOCK, READPAST") == 6 and slot_reads.count("") == 1
    passing = schema_blocks()["ring_pass"]
    passing_lanes = re.findall(r"FROM \[dbq\]\.ring_lanes t WITH \(([A-Z, ]+)\)", passing)
    passing_slots = re.findall(r"\[dbq\]\.ring_slots s(?: WITH \(([A-Z, ]+)\))?", passing)
    assert passing_lanes == ["ROWLOCK, UPDLOCK, READPAST"]
    assert passing_slots == ["READCOMMITTEDLOCK, READPAST"]
    pop = schema_blocks()["ring_pop"]
    assert pop.count("FROM [dbq].ring_retry t WITH (ROWLOCK, UPDLOCK, READPAST)") == 2
    assert "SET LOCK_TIMEOUT 1000;" in pop
    push = schema_blocks()["ring_push"]
    writes = re.findall(r"UPDATE s SET seq = @base[12] \+ s\.slot.*?;", push, flags=re.DOTALL)
    assert len(writes) == 2
    for write in writes:
        assert "WITH (ROWLOCK, READPAST)" in write and "s.seq < @floor" in write and "state" not in write
    lane = push.index("FROM [dbq].ring_push_lanes WITH (ROWLOCK, READPAST)")
    assert push.index("EXEC [dbq].ring_floor_try") < lane < push.index("@range_size = @n")
    # The floor of the room check serves the first write; each attempt after a wait reads it again.
    loop = push[push.index("    WHILE 1 = 1\n") :]
    assert loop.count("EXEC [dbq].ring_floor_try ") == 1
    assert "BEGIN\n        IF @floor IS NULL\n        BEGIN\n            EXEC [dbq].ring_floor_try " in loop
    assert "WAITFOR DELAY @wait;\n        SET @pause = " in loop
    assert "\n        SET @floor = NULL;\n    END;" in loop
    # Pushes and the pops' gap skips read the floor waiting 100 ms at most; the rest waits as it must.
    for name in ("ring_push", "ring_skip_gap"):
        assert (
            "EXEC [dbq].ring_floor_try " in schema_blocks()[name]
            and "ring_floor " not in schema_blocks()[name]
        )
    bounded = schema_blocks()["ring_floor_try"]
    assert "SET XACT_ABORT OFF;\n    SET LOCK_TIMEOUT 100;\n    SET @gone = 0;\n    BEGIN TRY\n" in bounded
    assert "BEGIN CATCH\n        SET @floor = NULL;\n        IF ERROR_NUMBER() <> 1222\n" in bounded
    assert "CACHE 1000" in schema_blocks()["ring_create"]
    floor = procedure_statements(schema_blocks()["ring_floor"])[1]
    reads = [
        s.sql(dialect="tsql") for s in floor if isinstance(s, exp.Set) and "SELECT" in s.sql(dialect="tsql")
    ]
    # the lanes, then the leases, then the retry rows (each the ring's own, then its groups')
    read = [next(t for t in ("ring_lanes", "ring_leases", "ring_retry") if t in r) for r in reads]
    assert read == ["ring_lanes"] * 2 + ["ring_leases"] * 2 + ["ring_retry"] * 2
    assert not any("READPAST" in r or "NOLOCK" in r for r in reads)  # committed rows, never skipped


def test_every_error_the_procedures_raise_is_translated() -> None:
    text = read_text(MS, "functions.sql")
    codes = set(re.findall(r"RAISERROR \(N'\[(DQ\d{3})\]", text))
    assert codes == {"DQ001", "DQ002", "DQ003", "DQ004"}
    assert codes - {"DQ004"} <= set(ms_errors.RAISED_BY_PROCEDURES)


def test_the_claim_reads_past_locked_rows_and_updates_through_a_top_n_cte() -> None:
    for name in ("pop_lease", "pop_take", "claim_batch", "reclaim_expired"):
        text = mssql_sql(name)
        assert "WITH (ROWLOCK, READPAST, UPDLOCK)" in text, name
        assert "OUTPUT inserted." in text or "OUTPUT deleted." in text, name
        assert re.search(r"SELECT TOP \(\?\)", re.sub(r"%\([a-z_]+\)s", "?", text)), name


@pytest.mark.parametrize(
    "broken",
    [
        "SELEC id FROM [dbq].meta",
        "SELECT id FROM WHERE state = 0",
        "UPDATE [dbq].meta SET state = WHERE id = 1",
        "DECLARE @x TABLE (id bigint PRIMARY KEY; SELECT 1",
    ],
)
def test_the_tsql_parse_is_not_vacuous_broken_statements_are_rejected(broken: str) -> None:
    with pytest.raises(sqlglot.ParseError):
        tsql_statements(broken)


@pytest.mark.parametrize("name", ["pop_lease", "pop_take", "ack", "nack", "claim_batch", "lock_batch"])
def test_the_tsql_parse_is_not_vacuous_postgresql_statements_are_rejected(name: str) -> None:
    body = load_queries(PG, "queries")[name].replace("{schema}", "[dbq]")
    with pytest.raises(sqlglot.ParseError):
        tsql_statements(body)


# -- parameters ------------------------------------------------------------------------------------


def test_named_parameters_become_positional_in_order_with_repeats() -> None:
    sql, values = to_positional(
        "SELECT %(a)s, %(b)s, %(a)s WHERE x LIKE '%[^a]%'", {"a": 1, "b": "two", "unused": 3}
    )
    assert sql == "SELECT ?, ?, ? WHERE x LIKE '%[^a]%'"
    assert values == [1, "two", 1]


def test_a_missing_parameter_is_named() -> None:
    with pytest.raises(ConfigurationError, match="'n'"):
        to_positional("SELECT TOP (%(n)s) 1", {})


def test_lists_go_as_json_arrays_and_bytes_as_hex() -> None:
    key = uuid.uuid4()
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    _, values = to_positional(
        "%(ids)s %(payloads)s %(key)s %(when)s %(none)s %(flag)s",
        {
            "ids": [1, 2],
            "payloads": [b"\x00\xff", b"{}"],
            "key": key,
            "when": when,
            "none": None,
            "flag": True,
        },
    )
    assert values[0] == "[1, 2]"
    assert json.loads(values[1]) == ["00ff", "7b7d"]
    assert values[2] == str(key)
    assert values[3] == dt.datetime(2026, 1, 2, 1, 4, 5, 6)
    assert values[4:] == [None, True]


def test_render_binds_literals_and_quotes_strings() -> None:
    key = uuid.UUID(int=1)
    text = render_named("WHERE b = %(b)s AND q = %(q)s AND s = %(s)s", {"b": key, "q": 7, "s": "it's"})
    assert text == f"WHERE b = N'{key}' AND q = 7 AND s = N'it''s'"
    tsql_statements("SELECT 1 FROM t " + text)


def test_rows_get_utc_times_and_receipt_lists() -> None:
    row = adapt_row("get_batch", ("id", 0, "[3,4]", "[1,2]", None, dt.datetime(2026, 1, 1), None))
    assert row[2:4] == ([3, 4], [1, 2])
    assert row[5] == dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


# -- connection strings and dialect choice ---------------------------------------------------------


def test_urls_and_odbc_strings_parse_without_leaking_credentials() -> None:
    attrs, where = parse_dsn("mssql://sa:p%40ss@db.example:1434/app?Encrypt=no&TrustServerCertificate=yes")
    assert attrs["SERVER"] == "tcp:db.example,1434" and attrs["PWD"] == "p@ss" and attrs["ENCRYPT"] == "no"
    assert where == "db.example:1434/app"
    attrs, where = parse_dsn("DRIVER={ODBC Driver 18 for SQL Server};SERVER=tcp:h,1433;DATABASE=q;PWD={a;b}")
    assert attrs["PWD"] == "{a;b}" and where == "h:1433/q"
    text = ms_conninfo.odbc_connection_string({"SERVER": "h", "PWD": "a;b"}, 5)
    assert "PWD={a;b}" in text and "LoginTimeout=5" in text


@pytest.mark.parametrize(
    ("dsn", "dialect"),
    [
        ("postgresql://u@h/db", "postgresql"),
        ("host=h dbname=d", "postgresql"),
        ("mssql://u:p@h:1433/db", "mssql"),
        ("mssql+pyodbc://u:p@h/db", "mssql"),
        ("DRIVER={ODBC Driver 18 for SQL Server};SERVER=h;DATABASE=d", "mssql"),
        ("odbc:DSN=queues;UID=u", "mssql"),
    ],
)
def test_the_dsn_chooses_the_dialect(dsn: str, dialect: str) -> None:
    assert dialect_of_dsn(dsn) == dialect
    assert DbQueue(dsn).dialect == dialect  # no I/O


def test_polling_spins_then_sleeps_grow_to_the_interval() -> None:
    gen = poll_pauses(0.5)
    pauses = [next(gen) for _ in range(12)]
    assert pauses[:4] == [0.0, 0.001, 0.002, 0.005]
    assert pauses[4:8] == [0.01, 0.02, 0.04, 0.08]
    assert pauses[-1] == 0.5 and pauses == sorted(pauses)


# -- errors ----------------------------------------------------------------------------------------

DRIVER = "[Microsoft][ODBC Driver 18 for SQL Server]"


@pytest.mark.parametrize(
    ("error", "connecting", "kind", "words"),
    [
        (
            ("OperationalError", "HYT00", f"[HYT00] {DRIVER}Login timeout expired (0) (SQLDriverConnect)"),
            True,
            DatabaseUnavailableError,
            "login timeout",
        ),
        (
            ("OperationalError", "HYT00", f"[HYT00] {DRIVER}Query timeout expired (0) (SQLExecDirectW)"),
            False,
            StatementTimeoutError,
            "query timeout expired",
        ),
        (
            (
                "OperationalError",
                "08S01",
                f"[08S01] {DRIVER}Communication link failure (10054) (SQLExecDirectW)",
            ),
            False,
            DatabaseUnavailableError,
            "unreachable",
        ),
        (
            (
                "Error",
                "40001",
                f"[40001] {DRIVER}[SQL Server]Transaction (Process ID 57) was deadlocked on lock "
                "resources with another process and has been chosen as the deadlock victim. Rerun the "
                "transaction. (1205) (SQLExecDirectW)",
            ),
            False,
            DeadlockError,
            "deadlock victim",
        ),
        (
            (
                "Error",
                "HY000",
                f"[HY000] {DRIVER}[SQL Server]Lock request time out period exceeded. (1222) (SQLExecDirectW)",
            ),
            False,
            LockTimeoutError,
            "lock request timed out",
        ),
        (
            (
                "ProgrammingError",
                "42S02",
                f"[42S02] {DRIVER}[SQL Server]Invalid object name 'dbq.meta'. (208) (SQLExecDirectW)",
            ),
            False,
            SchemaError,
            "not installed",
        ),
        (
            (
                "IntegrityError",
                "23000",
                f"[23000] {DRIVER}[SQL Server]Violation of PRIMARY KEY constraint "
                "'meta_pkey'. (2627) (SQLExecDirectW)",
            ),
            False,
            DatabaseError,
            "[23000]",
        ),
    ],
)
def test_pyodbc_errors_are_translated(
    error: tuple[str, str, str], connecting: bool, kind: type, words: str
) -> None:
    name, state, text = error
    exc = getattr(import_pyodbc(), name)(state, text)
    got = translate(exc, where="h:1433/db", schema="dbq", connecting=connecting)
    assert type(got) is kind
    assert words in str(got) and "h:1433/db" in str(got)


def deadlock() -> Exception:
    """What pyodbc raises for a deadlock victim (SQLSTATE 40001, native error 1205)."""
    return import_pyodbc().Error(
        "40001", f"[40001] {DRIVER}[SQL Server]chosen as the deadlock victim. (1205) (SQLExecDirectW)"
    )


def test_a_deadlock_victim_is_run_again_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    db = MssqlDatabase("mssql://u:p@h/db", schema="dbq")
    fake = FakeSqlServer([deadlock(), deadlock(), [(1,), (2,)]]).attach(monkeypatch, db)
    monkeypatch.setattr(ms.time, "sleep", lambda s: None)
    assert db.fetchall("peek", {"queue_id": 1, "n": 2, "opts": False}) == [(1,), (2,)]
    assert (fake.rollbacks, fake.commits) == (2, 1)


def test_a_deadlock_in_the_callers_transaction_is_raised_on_a_fake_sql_server() -> None:
    fake = FakeSqlServer([deadlock(), [(1,)]])
    db = MssqlDatabase("mssql://u:p@h/db", schema="dbq")
    with pytest.raises(DeadlockError):
        db.fetchall("peek", {"queue_id": 1, "n": 2, "opts": False}, fake.connect())
    assert fake.script == [[(1,)]]  # not run again: only the caller can redo its transaction


def test_retries_give_up_after_the_limit_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    db = MssqlDatabase("mssql://u:p@h/db", schema="dbq", retries=3)
    fake = FakeSqlServer([deadlock() for _ in range(5)]).attach(monkeypatch, db)
    monkeypatch.setattr(ms.time, "sleep", lambda s: None)
    with pytest.raises(DeadlockError):
        db.fetchall("peek", {"queue_id": 1, "n": 2, "opts": False})
    assert len(fake.script) == 1  # 1 try + 3 retries


# -- a real driver ---------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_odbc_driver_18_is_loaded_and_a_closed_port_raises_database_unavailable() -> None:
    """A real connect: pyodbc -> unixODBC -> Microsoft ODBC Driver 18 -> 127.0.0.1:<closed port>."""
    import_pyodbc()
    driver = ms_conninfo.default_driver()
    assert (
        driver == ms_conninfo.DEFAULT_DRIVER
        or driver.endswith(tuple(f".so.{i}" for i in range(1, 9)))
        or ".so" in driver
    )
    port = _closed_port()
    dbq = DbQueue(f"mssql://sa:secret@127.0.0.1:{port}/queues?Encrypt=no", schema="dbq", connect_timeout=2)
    start = time.monotonic()
    with pytest.raises(DatabaseUnavailableError) as info:
        dbq.install()
    assert f"127.0.0.1:{port}" in str(info.value)
    assert "ODBC Driver 18 for SQL Server" in str(info.value.__cause__)  # the real driver answered
    assert "secret" not in str(info.value)
    assert time.monotonic() - start < 30


# -- the integration suites' own SQL on SQL Server (tests/dialects.py) -------------------------------
# The concurrency and crash suites write and read their own tables through run_sql/insert_rows, with
# SQL meant for both dialects; on SQL Server they have never run. Here: what they send to pyodbc.


def _suites_dbq(monkeypatch: pytest.MonkeyPatch, script: list[Any]) -> tuple[DbQueue, FakeSqlServer]:
    dbq = DbQueue("mssql://u:p@h/db", schema="dbq")
    assert isinstance(dbq.db, MssqlDatabase)
    return dbq, FakeSqlServer(script).attach(monkeypatch, dbq.db)


def _check_sent(fake: FakeSqlServer) -> None:
    """Every statement sent parses as T-SQL and binds one value per ``?`` (outside quoted text and
    comments)."""
    for text, values in fake.executed:
        code = re.sub(r"N?'(?:[^']|'')*'|--[^\n]*", "", text)
        assert code.count("?") == len(values), text
        tsql_statements(text)


def test_the_concurrency_suites_results_table_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_dbqueue.engine import Message
    from tests.helpers import payload_hash
    from tests.integration.test_concurrency import RESULTS, read_results, write_results

    committed = [(2, 10, 0, 1, 99), (3, 11, 1, 0, 7)]
    dbq, fake = _suites_dbq(monkeypatch, [[], [], committed])
    now = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    msgs = [Message(10 + i, "conc", {"p": i, "s": 1 - i, "v": "ab"}, 0, 1, 1, now) for i in range(2)]
    RESULTS.create(dbq)
    with dbq.transaction() as conn:
        write_results(dbq, conn, 2, msgs)
        write_results(dbq, conn, 2, [])  # an empty pop sends nothing
    assert read_results(dbq) == committed
    (ddl, _), (insert, values), (select, _) = fake.executed
    assert ddl == (
        "CREATE TABLE [dbq].[eo_results] ([consumer] integer NOT NULL, [msg_id] bigint NOT NULL, "
        "[p] integer NOT NULL, [s] integer NOT NULL, [h] bigint NOT NULL)"
    )
    assert insert == (
        "INSERT INTO [dbq].[eo_results] ([consumer], [msg_id], [p], [s], [h]) "
        "VALUES (?, ?, ?, ?, ?), (?, ?, ?, ?, ?)"
    )
    assert values == [2, 10, 0, 1, payload_hash(msgs[0].payload), 2, 11, 1, 0, payload_hash(msgs[1].payload)]
    assert select == (
        "SELECT [consumer], [msg_id], [p], [s], [h] FROM [dbq].[eo_results] "
        "ORDER BY [consumer], [msg_id], [p], [s], [h]"
    )
    assert (fake.commits, fake.rollbacks) == (3, 0)
    _check_sent(fake)


def test_the_crash_suites_reads_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.test_crash import _done_rows, _meta_count

    payload = {"p": 0, "s": 3, "v": "ff"}
    dbq, fake = _suites_dbq(monkeypatch, [[(7, 2, 1, json.dumps(payload).encode())], [(0,)]])
    assert _done_rows(dbq, 5) == [(7, 2, 1, payload)]
    assert _meta_count(dbq, 5) == 0
    (done, done_values), (meta, meta_values) = fake.executed
    assert "FROM [dbq].done d LEFT JOIN [dbq].data x ON x.id = d.id WHERE d.queue_id = ?" in done
    assert meta == "SELECT count(*) FROM [dbq].meta WHERE queue_id = ?"
    assert done_values == meta_values == [5]
    _check_sent(fake)


def test_the_conformance_suites_own_sql_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exactly-once results table, the row counts, the backoff test's clock and the caller's own
    connection of tests/integration/test_conformance.py, as they go to pyodbc."""
    from tests.integration.test_conformance import (
        RESULTS,
        callers_connection,
        count_rows,
        due_in,
        make_due_now,
        read_results,
    )

    script: list[Any] = [[], [], [(0,), (1,)], [(3,)], [(0,)], [], [(Decimal("199.998"),)]]
    dbq, fake = _suites_dbq(monkeypatch, script)
    RESULTS.create(dbq)
    with dbq.transaction() as conn:
        RESULTS.write(dbq, conn, [[0], [1]])  # what pop_exactly_once writes for two messages
        RESULTS.write(dbq, conn, [])  # an empty pop sends nothing
    assert read_results(dbq) == [0, 1]
    assert count_rows(dbq, "meta", 5) == 3
    assert count_rows(dbq, "data") == 0
    make_due_now(dbq, 42)
    assert due_in(dbq, 42) == pytest.approx(199.998)
    with callers_connection(dbq) as own:
        assert own is fake.connections[-1] and own.closed is False
    assert fake.script == []
    sent = [text for text, _ in fake.executed]
    assert sent == [
        "CREATE TABLE [dbq].[eo_results] ([n] integer NOT NULL, PRIMARY KEY ([n]))",
        "INSERT INTO [dbq].[eo_results] ([n]) VALUES (?), (?)",
        "SELECT [n] FROM [dbq].[eo_results] ORDER BY [n]",
        "SELECT count(*) FROM [dbq].[meta] WHERE queue_id = ?",
        "SELECT count(*) FROM [dbq].[data]",
        "UPDATE [dbq].meta SET process_at = SYSUTCDATETIME() WHERE id = ?",
        "SELECT DATEDIFF_BIG(millisecond, SYSUTCDATETIME(), process_at) / 1000.0 "
        "FROM [dbq].meta WHERE id = ?",
    ]
    assert [values for _, values in fake.executed] == [[], [0, 1], [], [5], [], [42], [42]]
    assert (fake.commits, fake.rollbacks) == (7, 0)
    _check_sent(fake)


def test_the_shared_clock_jump_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/dialects.expire_leases, as the conformance and stateful suites send it to pyodbc: the ids as
    one JSON array; for a ring, the leases holding them are split into retry rows first
    (ring_split_leases, with the ring's queue id, capacity and lanes), whose due times then pass."""
    from airflow_dbqueue.engine.models import Design, QueueSettings
    from airflow_dbqueue.engine.ring import RingQueue
    from tests.dialects import expire_leases

    dbq, fake = _suites_dbq(monkeypatch, [None, None, None])
    ring = RingQueue(
        dbq.db,
        QueueSettings(name="r", queue_id=4, design=Design.RING, max_payload_bytes=512, capacity=8, lanes=2),
    )
    expire_leases(dbq, [7, 9])
    expire_leases(dbq, [3], ring)
    (table_text, table_values), (split_text, split_values), (ring_text, ring_values) = fake.executed
    assert table_text.startswith("UPDATE [dbq].meta SET lease_until = DATEADD(second, -1, SYSUTCDATETIME())")
    assert table_values == ["[7, 9]"]
    assert split_text.startswith("SET NOCOUNT ON; DECLARE @los nvarchar(max) = (")
    assert split_text.endswith(
        "EXEC [dbq].ring_split_leases @queue_id = ?, @cap = ?, @lanes = ?, @los = @los, @error = NULL, "
        "@gid = ?"
    )
    # the group's key, ids, lanes; then queue_id, capacity, lanes, the group's key (the default group's: 4)
    assert split_values == [4, "[3]", 2, 4, 8, 2, 4]
    assert ring_text.startswith("UPDATE [dbq].ring_retry SET due_at = DATEADD(second, -1, SYSUTCDATETIME())")
    assert "AND state = 2 AND id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(?))" in ring_text
    assert ring_values == [4, "[3]"]
    assert (fake.commits, fake.rollbacks) == (3, 0)
    _check_sent(fake)


def test_the_suites_sql_on_a_closed_port_raises_database_unavailable() -> None:
    """run_sql goes through the dialect's own connect and error translation (real pyodbc and driver)."""
    from tests.dialects import run_sql

    import_pyodbc()
    port = _closed_port()
    dbq = DbQueue(f"mssql://sa:secret@127.0.0.1:{port}/queues?Encrypt=no", schema="dbq", connect_timeout=1)
    with pytest.raises(DatabaseUnavailableError, match=f"127.0.0.1:{port}"):
        run_sql(dbq, "SELECT 1")


# -- the ring on a fake SQL Server: the engine's decisions around the procedures' errors -------------


def _raised(code: str, text: str) -> Exception:
    """What pyodbc raises for a RAISERROR of the ring's procedures (native error 50000)."""
    return import_pyodbc().ProgrammingError(
        "42000", f"[42000] {DRIVER}[SQL Server][{code}] {text} (50000) (SQLExecDirectW)"
    )


def _ring_on_fake_sql_server(monkeypatch: pytest.MonkeyPatch, script: list[Any]) -> tuple[Any, Any]:
    from airflow_dbqueue.engine.models import Design, QueueSettings
    from airflow_dbqueue.engine.ring import RingQueue

    db = MssqlDatabase("mssql://u:p@h/db", schema="dbq")
    fake = FakeSqlServer(script).attach(monkeypatch, db)
    monkeypatch.setattr(ms.time, "sleep", lambda s: None)
    settings = QueueSettings(
        name="r", queue_id=1, design=Design.RING, max_payload_bytes=512, capacity=8, lanes=4
    )
    q = RingQueue(db, settings)
    # The scripts below are a pop's own statements: the handle's reclaim of expired leases, which a
    # pop runs first at most once per reclaim_every, is taken as just done.
    q._last_reclaim, q.reclaim_every = time.monotonic(), float("inf")
    return q, fake


def _sent(fake: FakeSqlServer, procedure: str) -> list[list[Any]]:
    """The values bound to each statement that ran ``procedure`` (or the named query's text)."""
    return [values for text, values in fake.executed if f"[dbq].{procedure} " in text]


def test_a_snapshot_update_conflict_is_transient() -> None:
    """Error 3960 (a SNAPSHOT transaction's update lock on a row changed since it began: a push of a
    deduplication key another push committed meanwhile) is PostgreSQL's serialization failure: the
    caller runs its transaction again."""
    from airflow_dbqueue.engine.errors import TransientDatabaseError

    exc = import_pyodbc().ProgrammingError(
        "42000",
        f"[42000] {DRIVER}[SQL Server]Snapshot isolation transaction aborted due to update conflict. "
        "(3960) (SQLExecDirectW)",
    )
    got = translate(exc, where="h", schema="dbq")
    assert type(got) is TransientDatabaseError and "run it again" in str(got)


def test_the_procedures_errors_are_translated_by_their_code() -> None:
    got = translate(
        _raised("DQ001", "ring 1 stayed full for 300 ms (capacity 8)"), where="h:1433/db", schema="dbq"
    )
    assert type(got).__name__ == "QueueFullError"
    assert str(got) == "SQL Server at h:1433/db: ring 1 stayed full for 300 ms (capacity 8)"
    skipped = translate(_raised("DQ002", "ring 1: numbers 3 .. 4 were given up"), where="h", schema="dbq")
    assert type(skipped).__name__ == "RingNumbersSkippedError"
    bad = translate(_raised("DQ003", "a ring batch holds 1 to 8"), where="h", schema="dbq")
    assert type(bad) is ConfigurationError
    missing = translate(_raised("DQ004", "ring 9 does not exist"), where="h", schema="dbq")
    assert type(missing) is DatabaseError  # as on PostgreSQL
    other = translate(_raised("XX999", "someone else's RAISERROR"), where="h", schema="dbq")
    assert type(other) is DatabaseError


def test_a_ring_push_whose_numbers_were_skipped_is_retried_whole_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The procedure raised DQ002 (its numbers 3 and 4 were given up): the engine rolls that transaction
    back and pushes again, and the second call's first number is the batch's."""
    q, fake = _ring_on_fake_sql_server(
        monkeypatch, [_raised("DQ002", "numbers 3 .. 4 were given up"), [(5,)]]
    )
    assert q.push_batch(["c", "d"]) == [5, 6]
    assert (fake.rollbacks, fake.commits) == (1, 1)
    assert fake.script == []


def test_a_full_ring_on_a_fake_sql_server_raises_queue_full_naming_the_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q, fake = _ring_on_fake_sql_server(
        monkeypatch, [_raised("DQ001", "ring 1 stayed full for 300 ms (capacity 8)")]
    )
    q.push_timeout = 0.3
    with pytest.raises(
        QueueFullError, match=r"'r': the ring \(capacity 8\) stayed full for 0.3s; nothing of the batch"
    ):
        q.push_batch(["a"])
    assert (fake.rollbacks, fake.commits) == (1, 0)


def test_gap_recovery_waits_on_the_lanes_still_locked_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """recover_gaps: position 9 with unwritten numbers, lanes [3,7] held; the first proof finds lane 7
    still locked and hands back [7], which the next try is asked about; then 2 numbers are given up, and
    the lanes stopped at them move on (ring_pass, with the ring's capacity and lanes)."""
    q, fake = _ring_on_fake_sql_server(
        monkeypatch, [[(9, 1)], [("[3,7]",)], [(-1, "[7]")], [(2, None)], [(3,)]]
    )
    assert q.recover_gaps(wait=5.0) == 2
    sent = [values for _, values in fake.executed]
    assert sent[2] == [1, 9, "[3,7]"] and sent[3] == [1, 9, "[7]"]
    assert _sent(fake, "ring_pass") == [[1, 8, 4]]  # queue_id, capacity, lanes
    assert "@moved = @moved OUTPUT;\nSELECT @moved" in fake.executed[-1][0]
    assert fake.script == []
    _check_sent(fake)


def _message_row(msg_id: int, payload: bytes = b'"x"') -> tuple[Any, ...]:
    """A message row of ring_pop as the procedure returns it (nine columns, the last three NULL)."""
    when = dt.datetime(2026, 1, 1)
    return (msg_id, 1, 1, when, None, payload, None, None, None)


def _meta_row(gap: int | None = None, issued: int | None = None, snap: str | None = None) -> tuple[Any, ...]:
    return (None, None, None, None, None, None, gap, issued, snap)


def test_a_push_of_one_whose_slot_is_not_free_is_written_by_ring_push_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ring_push_one took number 5 and found its slot not free (it returned -5): the engine writes that number
    with ring_push (first = 5), which waits for the slot, and nothing else is taken."""
    q, fake = _ring_on_fake_sql_server(monkeypatch, [[(-5,)], [(5,)]])
    assert q.push_batch(["a"]) == [5]
    [one] = _sent(fake, "ring_push")[:1]
    assert one == [1, 8, b'"a"']  # queue_id, capacity, the payload as varbinary
    assert "@once = 1" in fake.executed[0][0] and "@once = 0" in fake.executed[1][0]
    assert fake.executed[1][1] == [1, 8, json.dumps([b'"a"'.hex()]), 30.0, 5]
    assert (fake.commits, fake.rollbacks) == (2, 0)
    _check_sent(fake)


def test_a_full_ring_pushes_back_between_transactions_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ring was full before anything was taken (ring_push_one and ring_push return no number): the
    engine waits between transactions and asks again, with a new number each time only once it is let in.
    Between its calls it pops none (ring_pop of 0, in a transaction of its own), so that a gap holding the
    floor down is given up: the first such pop saw number 5 unwritten at the head, and the next one passes
    it back."""
    from airflow_dbqueue.engine import ring

    monkeypatch.setattr(ring.time, "sleep", lambda s: None)
    script: list[Any] = [[(None,)], [(None,)], [_meta_row(5, 9)], [(None,)], [_meta_row()], [(7,)]]
    q, fake = _ring_on_fake_sql_server(monkeypatch, script)
    assert q.push_batch(["a"]) == [7]
    pushes = _sent(fake, "ring_push")
    assert len(pushes) == 4
    assert [values[-1] for values in pushes[1:]] == [None, None, None]  # first: no number taken before
    pops = _sent(fake, "ring_pop")
    # queue_id, capacity, lanes, n, lease, visibility timeout, consumer, own; gap, its issued position,
    # its push lanes, force
    assert pops == [
        [1, 8, 4, 0, False, 30.0, "push", False, None, None, None, False],
        [1, 8, 4, 0, False, 30.0, "push", False, 5, 9, None, False],
    ]
    assert (fake.commits, fake.rollbacks) == (6, 0) and fake.script == []  # a transaction each
    _check_sent(fake)


def test_a_pop_reports_a_gap_lists_the_push_lanes_and_passes_them_back_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first ring_pop took 3 and saw number 5 unwritten at the head; the second, told about 5, found
    it still there and listed the push lanes held ([2]); the third passes number, position and lanes back
    (for ring_skip_gap's proof), and takes 6 once 5 is given up. The batch comes back in id order."""
    script: list[Any] = [
        [_message_row(3), _meta_row(5, 9)],
        [_meta_row(5, 9, "[2]")],
        [_message_row(6), _meta_row()],
    ]
    q, fake = _ring_on_fake_sql_server(monkeypatch, script)
    got = q.pop(2)
    assert [m.id for m in got] == [3, 6] and got[0].payload == "x"
    pops = _sent(fake, "ring_pop")
    common = [1, 8, 4, None, False, 30.0, DEFAULT_CONSUMER, False]
    assert [p[:3] + p[4:8] for p in pops] == [common[:3] + common[4:]] * 3
    assert [p[3] for p in pops] == [2, 1, 1]  # what is left of the batch
    assert [p[8:] for p in pops] == [
        [None, None, None, False],
        [5, 9, None, False],
        [5, 9, "[2]", False],
    ]
    assert q._gap is None  # the last pop saw no gap
    _check_sent(fake)


def test_a_full_pop_takes_the_fast_path_next_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pop that came back full makes the next one start with ring_take (no retries due, no gap): one
    statement, with the parameters of the take; a pop of one at most once takes without waiting for
    held lanes (ring_take_one), and only when that finds nothing, waiting (ring_take)."""
    script: list[Any] = [[_message_row(1), _meta_row()], [_message_row(2)[:6]], [], [_message_row(3)[:6]]]
    q, fake = _ring_on_fake_sql_server(monkeypatch, script)
    assert [m.id for m in q.pop(1)] == [1]
    assert [m.id for m in q.pop(1)] == [2]
    assert [m.id for m in q.pop(1)] == [3]
    one, one_again, take = _sent(fake, "ring_take")
    assert one == one_again == [1, 8, 4]  # the group's key, the capacity and the lanes
    assert take == [1, 8, 4, 1, False, 30.0, DEFAULT_CONSUMER, True]  # wait: not in a caller's transaction
    _check_sent(fake)


def test_a_pop_whose_lanes_stay_locked_returns_empty_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ring_pop's lanes stayed held past its LOCK_TIMEOUT (error 1222, which rolls its transaction back):
    the dialect runs it again up to its retries, and the engine pops again until the handle's
    lane_timeout has passed (none here: one pop of the dialect's tries), then returns nothing for this
    pop; in the caller's transaction the error is raised at once, once the queue is found still there (a
    pooled lookup: the caller's transaction is left as it is)."""
    timeout = import_pyodbc().Error(
        "HY000", f"[HY000] {DRIVER}[SQL Server]Lock request time out period exceeded. (1222) (SQLExecDirectW)"
    )
    q, fake = _ring_on_fake_sql_server(monkeypatch, [timeout] * 4)
    q.lane_timeout = 0.0
    assert q.pop(3) == []
    assert (fake.commits, fake.rollbacks) == (0, 4) and fake.script == []
    q2, fake2 = _ring_on_fake_sql_server(monkeypatch, [timeout, [(1,)]])
    caller = fake2.connect()
    with pytest.raises(LockTimeoutError):
        q2.pop(3, semantics="exactly-once", conn=caller)
    assert fake2.script == []
    [own] = _sent(fake2, "ring_pop")  # not run again: only the caller can redo its transaction
    assert own[7] is True  # own: in the caller's transaction
    [lookup] = [e for e in fake2.log if "FROM [dbq].queues q WHERE name = ?" in e.text]
    assert lookup.values == ["r"] and fake2.log[-1] is lookup
    assert (caller.commits, caller.rollbacks) == (0, 0)


def test_acks_delete_a_whole_lease_or_settle_the_rest_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ack naming a whole lease is ring_ack alone; anything else goes to ring_settle (ack: nack 0);
    receipts that lost their lease are named from ring_held_receipts, and nothing was acked."""
    from airflow_dbqueue.engine import LeaseExpiredError, Message

    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    msgs = [Message(i, "r", "x", 0, 1, 1, now, now) for i in (3, 4)]
    script: list[Any] = [[(2,)], [], [(3, 0), (4, 0)], [], [(3, 0)], [(3, 1)]]
    q, fake = _ring_on_fake_sql_server(monkeypatch, script)
    assert q.ack(msgs) == 2
    assert q.ack(msgs) == 2
    with pytest.raises(LeaseExpiredError) as info:
        q.ack(msgs)
    assert info.value.ids == [4]
    acks = [v for t, v in fake.executed if "DELETE e OUTPUT deleted.n" in t]
    assert acks == [[1, 4, "[3, 4]", "[1, 1]"]] * 3  # the group's key (the queue id), lanes, ids, deliveries
    settles = _sent(fake, "ring_settle")
    assert settles == [[1, 8, 4, "[3, 4]", "[1, 1]", False, None, 0.0, 0.0, 1, None, 1]] * 2
    [held] = [v for t, v in fake.executed if "[dbq].ring_held(" in t]
    assert held == [1, 4, "[3, 4]", "[1, 1]", 1]
    _check_sent(fake)


def test_a_nack_sends_the_queues_backoff_and_attempts_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_dbqueue.engine import Message

    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    q, fake = _ring_on_fake_sql_server(monkeypatch, [[(3, 1)]])
    assert q.nack([Message(3, "r", "x", 0, 2, 2, now, now)], delay=1.5, error="boom") == 1
    [settle] = _sent(fake, "ring_settle")
    s = q.settings
    assert settle == [
        1,
        8,
        4,
        "[3]",
        "[2]",
        True,
        1.5,
        s.retry_backoff_s,
        s.retry_backoff_max_s,
        s.max_attempts,
        "boom",
        1,  # the default group's key: the queue id
    ]
    _check_sent(fake)


def test_maintenance_of_a_ring_reclaims_and_recovers_gaps_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """maintain(): expired leases (ring_reclaim_expired, with the ring's capacity and lanes), then the gap
    recovery: position 9 with unwritten numbers, no push lane held, 2 numbers given up, and the lanes moved
    over given-up numbers, and the batches of its default group finished a week ago forgotten. The ring
    has its default group alone (ring_groups), so no group is watched."""
    default = (1, None, None, None, None, None, None, 5, 26, 9)
    q, fake = _ring_on_fake_sql_server(
        monkeypatch, [[(3, 1), (4, 2)], [default], [(9, 1)], [("[]",)], [(2, None)], [(1,)], []]
    )
    assert q.maintain(limit=50) == {"reclaimed": 2, "gaps_skipped": 2, "batches_purged": 0}
    assert _sent(fake, "ring_reclaim_expired") == [[1, 8, 4, q.settings.max_attempts, 50, 1]]
    assert fake.executed[1][1] == [1] and "CROSS APPLY" in fake.executed[1][0]  # ring_groups
    assert fake.executed[2][1] == [1] and "EXEC [dbq].ring_floor" in fake.executed[2][0]
    assert _sent(fake, "ring_skip_abandoned") == [[1, 9, "[]"]]
    assert _sent(fake, "ring_pass") == [[1, 8, 4]] and fake.script == []
    [purge] = fake.statements("DELETE FROM old OUTPUT deleted.batch_id INTO @gone")  # purge_batches
    assert purge.values == [7 * 24 * 3600.0, 50, 1]  # the retention, the limit, the default group's key
    _check_sent(fake)


def test_the_queue_row_carries_a_rings_capacity_and_lanes_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """get_queue's row carries the ring's capacity and lanes (NULL for the table design), which RingQueue
    runs on, before the queue's dedup window."""
    row = (
        3,
        "r",
        "ring",
        "json",
        512,
        5,
        30.0,
        1.0,
        60.0,
        "auto",
        False,
        1024,
        8,
        300.0,
        None,
        "fail",
        "none",
        "slots",  # layout
    )
    dbq, fake = _suites_dbq(monkeypatch, [[row]])
    q = dbq.queue("r")
    assert (q.settings.capacity, q.settings.lanes, type(q).__name__) == (1024, 8, "RingQueue")
    [(text, values)] = fake.executed
    assert (
        values == ["r"]
        and "(SELECT r.lanes FROM [dbq].rings r WHERE r.queue_id = q.queue_id) AS lanes" in text
    )
    _check_sent(fake)


def test_the_conformance_suites_lease_expiry_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """expire_leases on a ring (tests/integration/test_conformance.py): the leases holding the ids are split
    into retry rows (ring_split_leases), whose leases then end, as on PostgreSQL."""
    from airflow_dbqueue.engine.models import Design, QueueSettings
    from airflow_dbqueue.engine.ring import RingQueue
    from tests.integration.test_conformance import expire_leases

    dbq, fake = _suites_dbq(monkeypatch, [[], []])
    settings = QueueSettings(
        name="r", queue_id=7, design=Design.RING, max_payload_bytes=512, capacity=16, lanes=4
    )
    expire_leases(dbq, [3, 4], RingQueue(dbq.db, settings))
    (split, split_values), (expire, expire_values) = fake.executed
    assert split_values == [7, "[3, 4]", 4, 7, 16, 4, 7] and expire_values == [7, "[3, 4]"]
    assert split.endswith(
        "EXEC [dbq].ring_split_leases @queue_id = ?, @cap = ?, @lanes = ?, @los = @los, @error = NULL, "
        "@gid = ?"
    )
    assert expire.startswith("UPDATE [dbq].ring_retry SET due_at = DATEADD(second, -1, SYSUTCDATETIME())")
    assert fake.commits == 2
    _check_sent(fake)


def _queue_row(ttl_s: float | None, ordering: str) -> tuple[Any, ...]:
    """A get_queue row of table-design queue 3, "orders" (client._SETTINGS_COLUMNS)."""
    return (3, "orders", "table", "json", 1024, 5, 30.0, 1.0, 300.0, "auto", True, None, None, 300.0,
            ttl_s, "fail", ordering, None)  # fmt: skip


def _texts(*names: str) -> list[str]:
    """The texts the dialect sends for the named queries (placeholders as ``?``)."""
    db = MssqlDatabase("mssql://u:p@h/db", schema="dbq")
    return [re.sub(r"%\([a-z_]+\)s", "?", db.query(n)) for n in names]


def test_keys_ttls_and_ordering_keys_are_one_push_with_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push with deduplication keys, ordering keys or a ttl is one push_with batch: its values are the
    queue, the delay, the ttl, the keys and ordering keys as JSON arrays (a key repeated within the batch
    sent once, with its first payload and ordering key; a payload without an ordering key as null) and the
    payloads; its rows (id, new) map every payload to its message, a repeated or known key to the first
    push's id."""
    dbq, fake = _suites_dbq(monkeypatch, [[_queue_row(3600.0, "per_key")], [(7, 1), (5, 0), (8, 1)]])
    q = dbq.queue("orders")
    ids = q.push_batch(["a", "b", "c", "d"], dedup_keys=["k1", "k2", "k1", "k3"], keys=["x", None, "x", "y"])
    assert ids == [7, 5, 7, 8]
    (_, _), (text, values) = fake.executed
    assert text == _texts("push_with")[0]
    hexes = [json.dumps(p).encode().hex() for p in ("a", "b", "d")]
    assert values == [3, 0.0, 3600.0, '["k1", "k2", "k3"]', '["x", null, "y"]', json.dumps(hexes), 0]
    _check_sent(fake)


def test_no_options_push_with_nothing_but_a_ttl_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A push of a queue with a ttl and no keys sends NULL keys and ordering keys, and its ttl (the
    queue's, or the push's own)."""
    dbq, fake = _suites_dbq(monkeypatch, [[_queue_row(60.0, "none")], [(4, 1)], [(5, 1)]])
    q = dbq.queue("orders")
    assert q.push("a") == 4 and q.push("b", ttl=30) == 5
    assert [v[:5] for _, v in fake.executed[1:]] == [[3, 0.0, 60.0, None, None], [3, 0.0, 30.0, None, None]]
    _check_sent(fake)


def test_a_queue_with_options_pops_claims_acks_nacks_and_upkeeps_with_them_on_a_fake_sql_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queue with a ttl or ordered per key pops, claims, acks and nacks with the *_with statements and
    its checks (expiring, per_key); its pops sweep expired messages after reclaiming leases; its upkeep
    forgets deduplication keys older than the window and expires messages (expire_fail, or expire_drop
    where on_expiry is drop); its stats count the failed messages that expired."""
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    later = now + dt.timedelta(seconds=30)
    leased = [(7, 0, 1, 1, now, later, b'"a"'), (9, 0, 1, 1, now, later, b'"b"')]
    batch = (uuid.uuid4(), 0, "[11]", "[1]", "c", now, later, None, None)
    script: list[Any] = [[_queue_row(None, "per_key")], [], leased, [(7,)], [(9, 0)], [batch]]
    script += [[], [("old-key",)], [], [], [(1, 0, 0, 2, 0, None)], [(2,)]]
    dbq, fake = _suites_dbq(monkeypatch, script)
    q = dbq.queue("orders")
    a, b = q.pop(2, semantics="at-least-once")
    assert (a.id, b.id, a.payload) == (7, 9, "a")
    assert q.ack([a]) == 1 and q.nack([b], delay=0) == 1
    claimed = q.claim_batch(10)
    assert claimed is not None and list(claimed.receipts) == [(11, 1)]
    assert q.maintain() == {"reclaimed": 0, "batches_purged": 0, "keys_forgotten": 1, "expired": 0}
    assert q.stats().extra == {"expired": 2}
    sent = [t for t, _ in fake.executed[1:]]
    names = ["reclaim_expired", "pop_lease_with", "ack_with", "nack_with", "claim_batch_with"]
    names += ["purge_batches", "forget_dedup", "reclaim_expired", "expire_fail", "stats", "count_expired"]
    assert sent == _texts(*names)
    values = [v for _, v in fake.executed]
    assert values[2][1:3] == [False, True]  # expiring, per_key (the queue has no ttl: no sweep)
    assert (values[7][0], values[7][2]) == (300.0, 3)  # forget_dedup: the window, the queue
    _check_sent(fake)
    dbq2, fake2 = _suites_dbq(monkeypatch, [[(*_queue_row(60.0, "none")[:15], "drop", "none", None)], []])
    assert dbq2.queue("orders").expire_messages(10) == 0
    assert [t for t, _ in fake2.executed[1:]] == _texts("expire_drop")


def test_the_rings_rows_layout_is_refused_at_create_time_naming_it_postgresql_only() -> None:
    """On SQL Server ``create_queue(design="ring", layout="rows")`` raises before anything is sent."""
    from airflow_dbqueue.engine import DbQueue, NotSupportedError

    with (
        DbQueue("mssql://u:p@localhost/db", schema="dbq") as dbq,
        pytest.raises(NotSupportedError, match="rows layout is PostgreSQL-only"),
    ):
        dbq.create_queue("r", design="ring", layout="rows")
