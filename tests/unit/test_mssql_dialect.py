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
    TransientDatabaseError,
)
from airflow_dbqueue.engine.dialects.base import dialect_of_dsn
from airflow_dbqueue.engine.dialects.mssql import dialect as ms
from airflow_dbqueue.engine.dialects.mssql.dialect import (
    NOT_YET_PORTED,
    MssqlDatabase,
    adapt_row,
    inline_int_params,
    parse_dsn,
    render_named,
    to_positional,
    translate,
)
from airflow_dbqueue.engine.queue import poll_pauses
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
    body = load_queries(MS, "queries.sql")[name]
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
    pg = set(load_queries(PG, "queries.sql"))
    mssql = set(load_queries(MS, "queries.sql"))
    assert mssql <= pg, f"SQL Server queries without a PostgreSQL twin: {sorted(mssql - pg)}"
    missing = pg - mssql
    assert missing == set(NOT_YET_PORTED), (
        f"not ported and not listed: {sorted(missing - set(NOT_YET_PORTED))}; "
        f"listed but ported or gone: {sorted(set(NOT_YET_PORTED) - missing)}"
    )


def test_the_table_design_maintenance_and_the_ring_are_fully_ported() -> None:
    """Every query the table design, the ring design, the client and maintenance run exists on SQL
    Server."""
    assert NOT_YET_PORTED == {}
    ring = {n for n in load_queries(PG, "queries.sql") if n.startswith("ring_")}
    assert len(ring) == 22 and ring <= set(load_queries(MS, "queries.sql"))
    used = {"push", "pop_lease", "pop_take", "ack", "nack", "held_receipts", "reclaim_expired"}
    used |= {"claim_batch", "get_batch", "lock_batch", "finish_batch", "purge_batches", "batch_rows"}
    used |= {"maintenance_try_lock", "maintenance_unlock", "maintenance_lock_holder", "set_timeouts"}
    used |= {"reset_timeouts", "archive_batch", "purge_archive_batch", "vacuum_table", "analyze_table"}
    used |= {"reindex_concurrently", "drop_index_concurrently", "index_health", "table_health"}
    used |= {"xmin_holders", "queue_rates"}
    assert used <= set(load_queries(MS, "queries.sql"))


@pytest.mark.parametrize("name", sorted(load_queries(MS, "queries.sql")))
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
    version, body = ms.schema_sql()
    stmts = tsql_statements(MssqlDatabase("mssql://h/db", schema="dbq").compose(body))
    assert version == 3
    created = [s for s in stmts if isinstance(s, exp.Create)]
    assert len(created) >= 12  # tables, sequence, indexes


def read_blocks() -> dict[str, str]:
    """The blocks of the SQL Server schema.sql as written."""
    return parse_named_queries(read_text(MS, "schema.sql"))


def schema_blocks() -> dict[str, str]:
    """The blocks of the SQL Server schema.sql, composed for schema ``dbq``."""
    db = MssqlDatabase("mssql://h/db", schema="dbq")
    return {k: db.compose(v) for k, v in parse_named_queries(read_text(MS, "schema.sql")).items()}


OPAQUE_PROCEDURE_STATEMENTS = (re.compile(r"WAITFOR DELAY @[a-z_]+;"),)
"""Procedure statements sqlglot has no T-SQL grammar for, each checked against its exact form instead."""
_CONTROL = re.compile(r"^(IF|WHILE) (.*)$", re.DOTALL)


def procedure_statements(text: str) -> tuple[exp.Create, list[exp.Expression], list[str]]:
    """Check a CREATE OR ALTER PROCEDURE of schema.sql statement by statement.

    The whole procedure must parse as one ``CREATE PROCEDURE`` (after its opaque statements, see
    :data:`OPAQUE_PROCEDURE_STATEMENTS`, are replaced by a no-op), and then every statement of its body
    is parsed alone as T-SQL (no opaque command accepted), because sqlglot is lenient inside a
    procedure's body. The body's layout makes that split exact: a statement ends with ``;`` at the end
    of a line; ``IF <condition>`` and ``WHILE <condition>`` run up to a line ``BEGIN``, and their
    condition is parsed as ``SELECT 1 WHERE <condition>``; blocks end with a line ``END;``; ``BREAK;``,
    ``CONTINUE;`` and ``RETURN;`` stand alone. Returns the procedure, the parsed statements and the opaque
    ones.
    """
    text = "\n".join(ln for ln in text.splitlines() if not ln.strip().startswith("--"))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    start = lines.index("BEGIN") + 1
    assert lines[start - 2].endswith("AS") or lines[start - 2] == "AS", lines[: start + 1]
    assert lines[-1] == "END", lines[-1]
    parsed: list[exp.Expression] = []
    opaque: list[str] = []
    depth, buf = 0, ""
    for line in lines[start:-1]:
        if not buf and line == "BEGIN":
            raise AssertionError("a BEGIN without IF or WHILE")
        if not buf and line == "END;":
            depth -= 1
            assert depth >= 0, "END; without BEGIN"
            continue
        if not buf and line in ("BREAK;", "CONTINUE;", "RETURN;"):
            continue
        if line == "BEGIN":
            control = _CONTROL.match(buf)
            assert control, f"BEGIN after {buf!r}"
            [cond] = tsql_statements(f"SELECT 1 WHERE {control.group(2)}")
            parsed.append(cond)
            depth, buf = depth + 1, ""
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
    assert depth == 0 and not buf, (depth, buf)
    whole = text
    for statement in opaque:
        whole = whole.replace(statement.split(";")[0] + ";", "SET NOCOUNT ON;")
    [proc] = tsql_statements(whole)
    assert isinstance(proc, exp.Create) and proc.args.get("kind") == "PROCEDURE", type(proc)
    return proc, parsed, opaque


PROCEDURES = sorted(k for k, v in schema_blocks().items() if "\nCREATE OR ALTER PROCEDURE" in f"\n{v}")


def test_the_schema_steps_are_versions_one_to_latest() -> None:
    latest, steps = ms.schema_steps()
    assert latest == 3 and [v for v, _ in steps] == [1, 2, 3]
    assert steps[0][1] == [ms.schema_sql()[1]]
    blocks = schema_blocks()
    assert set(blocks) == {"schema", "v2_ring_tables", *PROCEDURES, "v3_owned_objects"}
    assert len(steps[1][1]) == len(blocks) - 2  # every v2_ block, one batch each
    assert steps[2][1] == [read_blocks()["v3_owned_objects"]]
    assert "CREATE TABLE [dbq].owned_objects (" in blocks["v3_owned_objects"]
    assert "CREATE SCHEMA" not in blocks["schema"]  # install() creates it, only when it is missing
    for name in ("rings", "ring_slots", "ring_failed", "ring_lanes"):
        assert f"CREATE TABLE [dbq].{name} (" in blocks["v2_ring_tables"]
    tsql_statements(blocks["v2_ring_tables"])


def test_every_ring_procedure_parses_statement_by_statement() -> None:
    assert PROCEDURES == [
        "v2_ring_create",
        "v2_ring_drop",
        "v2_ring_first_unfinished",
        "v2_ring_lanes_held",
        "v2_ring_pop",
        "v2_ring_push",
        "v2_ring_skip_abandoned",
        "v2_ring_skip_gap",
    ]
    counts = {}
    for name in PROCEDURES:
        proc, parsed, opaque = procedure_statements(schema_blocks()[name])
        assert proc.this.this.name == name.removeprefix("v2_")
        counts[name] = (len(parsed), len(opaque))
    assert counts["v2_ring_push"][1] == 1  # the full ring's WAITFOR DELAY, its only opaque statement
    assert all(o == 0 for n, (_, o) in counts.items() if n != "v2_ring_push")
    assert all(p >= 2 for p, _ in counts.values()), counts


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("SET @got = @@ROWCOUNT;", "SET @got = @@ROWCOUNT +;"),
        ("DECLARE @k int;", "DECLARE @k int int;"),
        ("IF @to1 > @a", "IF @to1 > @a AND"),
        ("WAITFOR DELAY @wait;", "WAITFOR DELAY '00:00:01' + 1;"),
        ("SET @remaining = NULL;", "SET @remaining = NULL"),
        ("    END;\n    SELECT @first;", "    SELECT @first;"),
    ],
)
def test_the_procedure_check_is_not_vacuous_broken_bodies_are_rejected(good: str, bad: str) -> None:
    name = next(n for n in PROCEDURES if good in schema_blocks()[n])
    broken = schema_blocks()[name].replace(good, bad, 1)
    assert broken != schema_blocks()[name]
    with pytest.raises((sqlglot.ParseError, AssertionError)):
        procedure_statements(broken)


def test_the_ring_claims_read_past_locked_slots_in_slot_order() -> None:
    pop = schema_blocks()["v2_ring_pop"]
    claims = re.findall(r"WITH c AS \(.*?OUTPUT inserted\.", pop, flags=re.DOTALL)
    assert len(claims) == 2  # one per part of the window
    for claim in claims:
        assert "SELECT TOP (@n" in claim and "WITH (ROWLOCK, READPAST, UPDLOCK)" in claim
        assert "ORDER BY s.slot)" in claim and "UPDATE c" in claim
    push = schema_blocks()["v2_ring_push"]
    assert "EXEC sys.sp_sequence_get_range @sequence_name = @seq, @range_size = @n" in push
    assert push.index("FROM [dbq].ring_lanes WITH (ROWLOCK, READPAST)") < push.index("@range_size = @n")
    assert "CACHE 1000" in schema_blocks()["v2_ring_create"]


def test_every_error_the_procedures_raise_is_translated() -> None:
    text = read_text(MS, "schema.sql")
    codes = set(re.findall(r"RAISERROR \(N'\[(DQ\d{3})\]", text))
    assert codes == {"DQ001", "DQ002", "DQ003", "DQ004"}
    assert codes - {"DQ004"} <= set(ms.RAISED_BY_PROCEDURES)


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
    body = load_queries(PG, "queries.sql")[name].replace("{schema}", "[dbq]")
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
    text = ms.odbc_connection_string({"SERVER": "h", "PWD": "a;b"}, 5)
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
            TransientDatabaseError,
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
    assert db.fetchall("peek", {"queue_id": 1, "n": 2}) == [(1,), (2,)]
    assert (fake.rollbacks, fake.commits) == (2, 1)


def test_a_deadlock_in_the_callers_transaction_is_raised_on_a_fake_sql_server() -> None:
    fake = FakeSqlServer([deadlock(), [(1,)]])
    db = MssqlDatabase("mssql://u:p@h/db", schema="dbq")
    with pytest.raises(DeadlockError):
        db.fetchall("peek", {"queue_id": 1, "n": 2}, fake.connect())
    assert fake.script == [[(1,)]]  # not run again: only the caller can redo its transaction


def test_retries_give_up_after_the_limit_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    db = MssqlDatabase("mssql://u:p@h/db", schema="dbq", retries=3)
    fake = FakeSqlServer([deadlock() for _ in range(5)]).attach(monkeypatch, db)
    monkeypatch.setattr(ms.time, "sleep", lambda s: None)
    with pytest.raises(DeadlockError):
        db.fetchall("peek", {"queue_id": 1, "n": 2})
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
    driver = ms.default_driver()
    assert (
        driver == ms.DEFAULT_DRIVER
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
    """Every statement sent parses as T-SQL and binds one value per ``?``."""
    for text, values in fake.executed:
        assert text.count("?") == len(values), text
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
    assert "FROM [dbq].done d JOIN [dbq].data x ON x.id = d.id WHERE d.queue_id = ?" in done
    assert meta == "SELECT count(*) FROM [dbq].meta WHERE queue_id = ?"
    assert done_values == meta_values == [5]
    _check_sent(fake)


def test_the_conformance_suites_own_sql_on_a_fake_sql_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exactly-once results table, the row counts, the backoff test's clock and the caller's own
    connection of tests/integration/test_conformance.py, as they go to pyodbc."""
    from airflow_dbqueue.engine import Message
    from tests.integration.test_conformance import (
        RESULTS,
        callers_connection,
        count_rows,
        due_in,
        make_due_now,
        read_results,
        write_results,
    )

    script: list[Any] = [[], [], [(0,), (1,)], [(3,)], [(0,)], [], [(Decimal("199.998"),)]]
    dbq, fake = _suites_dbq(monkeypatch, script)
    now = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    msgs = [Message(10 + i, "eo", {"n": i}, 0, 1, 1, now) for i in range(2)]
    RESULTS.create(dbq)
    with dbq.transaction() as conn:
        write_results(dbq, conn, msgs)
        write_results(dbq, conn, [])  # an empty pop sends nothing
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
    one JSON array, and for a ring its queue id first."""
    from airflow_dbqueue.engine.models import Design, QueueSettings
    from airflow_dbqueue.engine.ring import RingQueue
    from tests.dialects import expire_leases

    dbq, fake = _suites_dbq(monkeypatch, [None, None])
    ring = RingQueue(
        dbq.db, QueueSettings(name="r", queue_id=4, design=Design.RING, max_payload_bytes=512, capacity=8)
    )
    expire_leases(dbq, [7, 9])
    expire_leases(dbq, [3], ring)
    (table_text, table_values), (ring_text, ring_values) = fake.executed
    assert table_text.startswith("UPDATE [dbq].meta SET lease_until = DATEADD(second, -1, SYSUTCDATETIME())")
    assert table_values == ["[7, 9]"]
    assert ring_text.startswith("UPDATE [dbq].ring_slots SET due_at = DATEADD(second, -1, SYSUTCDATETIME())")
    assert ring_values == [4, "[3]"]
    assert (fake.commits, fake.rollbacks) == (2, 0)
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
    settings = QueueSettings(name="r", queue_id=1, design=Design.RING, max_payload_bytes=512, capacity=8)
    return RingQueue(db, settings), fake


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
    still locked and hands back [7], which the next try is asked about; then 2 numbers are given up."""
    q, fake = _ring_on_fake_sql_server(monkeypatch, [[(9, 1)], [("[3,7]",)], [(-1, "[7]")], [(2, None)]])
    assert q.recover_gaps(wait=5.0) == 2
    sent = [values for _, values in fake.executed]
    assert sent[2] == [1, 9, "[3,7]"] and sent[3] == [1, 9, "[7]"]
    assert fake.script == []
