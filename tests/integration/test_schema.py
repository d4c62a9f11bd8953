"""The queue schema: install, migrations, version checks, and the named queries.

The migration test compares a normalized description of the catalog (tables, columns, constraints,
indexes, sequences, functions, triggers, ...) of a fresh install with one built by applying the
migrations from each older version; it keeps working as migrations are added.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.pq import ExecStatus

import airflow_dbqueue.engine as engine_pkg
from airflow_dbqueue.engine import DbQueue, InvalidNameError, SchemaError
from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase
from airflow_dbqueue.engine.dialects.postgres.schema import migrations, schema_sql
from airflow_dbqueue.engine.sqlfile import load_queries
from tests.dialects import run_sql
from tests.helpers import checksum
from tests.integration.test_conformance import drain

pytestmark = pytest.mark.integration

POSTGRES_PKG = "airflow_dbqueue.engine.dialects.postgres"
LATEST = schema_sql()[0]
MIGRATION_VERSIONS = [v for v, _ in migrations()]

# -- a normalized description of one schema's catalog ------------------------------------------------

# Each query takes the schema name as %(schema)s and returns rows in a stable order. Object names stay
# (they are part of the schema: queries and error messages name constraints), oids never appear, and
# the schema's own name is replaced by <schema> everywhere (see describe_schema).
_CATALOG: dict[str, str] = {
    "schema": """
        SELECT pg_get_userbyid(n.nspowner), n.nspacl::text, obj_description(n.oid, 'pg_namespace')
        FROM pg_namespace n WHERE n.nspname = %(schema)s""",
    "relations": """
        SELECT c.relname, c.relkind::text, c.relpersistence::text, am.amname,
               ARRAY(SELECT o FROM unnest(c.reloptions) AS o ORDER BY o),
               c.relreplident::text, c.relrowsecurity, c.relforcerowsecurity, c.relispartition,
               pg_get_partkeydef(c.oid), pg_get_userbyid(c.relowner), c.relacl::text,
               obj_description(c.oid, 'pg_class')
        FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_am am ON am.oid = c.relam
        WHERE n.nspname = %(schema)s
        ORDER BY c.relname""",
    # Column order is part of the schema (INSERT without a column list, SELECT *): position counts
    # live columns only, so a dropped column leaves no trace.
    "columns": """
        SELECT c.relname,
               row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum) AS position,
               a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity::text, a.attgenerated::text,
               CASE WHEN a.attcollation <> t.typcollation THEN co.collname END,
               col_description(c.oid, a.attnum)
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        JOIN pg_type t ON t.oid = a.atttypid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation
        WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY c.relname, a.attnum""",
    "constraints": """
        SELECT coalesce(c.relname, ty.typname), con.conname, con.contype::text,
               pg_get_constraintdef(con.oid, true), con.condeferrable, con.condeferred,
               con.convalidated, con.connoinherit
        FROM pg_constraint con
        JOIN pg_namespace n ON n.oid = con.connamespace
        LEFT JOIN pg_class c ON c.oid = con.conrelid
        LEFT JOIN pg_type ty ON ty.oid = con.contypid
        WHERE n.nspname = %(schema)s
        ORDER BY 1, 2""",
    "indexes": """
        SELECT t.relname, ic.relname, pg_get_indexdef(i.indexrelid), i.indisclustered,
               i.indisreplident, i.indisvalid
        FROM pg_index i
        JOIN pg_class ic ON ic.oid = i.indexrelid
        JOIN pg_class t ON t.oid = i.indrelid
        JOIN pg_namespace n ON n.oid = t.relnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY t.relname, ic.relname""",
    "sequences": """
        SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement, s.seqmax,
               s.seqmin, s.seqcache, s.seqcycle, tc.relname AS owned_by_table,
               ta.attname AS owned_by_column, d.deptype::text
        FROM pg_sequence s
        JOIN pg_class c ON c.oid = s.seqrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = c.oid
             AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')
        LEFT JOIN pg_class tc ON tc.oid = d.refobjid
        LEFT JOIN pg_attribute ta ON ta.attrelid = d.refobjid AND ta.attnum = d.refobjsubid
        WHERE n.nspname = %(schema)s
        ORDER BY c.relname""",
    "views": """
        SELECT c.relname, pg_get_viewdef(c.oid, true)
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND c.relkind IN ('v', 'm')
        ORDER BY c.relname""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), p.prokind::text,
               CASE WHEN p.prokind IN ('f', 'p') THEN pg_get_functiondef(p.oid) END,
               pg_get_userbyid(p.proowner), p.proacl::text
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1, 2""",
    "triggers": """
        SELECT c.relname, tg.tgname, pg_get_triggerdef(tg.oid, true), tg.tgenabled::text
        FROM pg_trigger tg
        JOIN pg_class c ON c.oid = tg.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND NOT tg.tgisinternal
        ORDER BY 1, 2""",
    "rules": """
        SELECT r.tablename, r.rulename, r.definition
        FROM pg_rules r WHERE r.schemaname = %(schema)s
        ORDER BY 1, 2""",
    "policies": """
        SELECT p.tablename, p.policyname, p.permissive, p.roles::text, p.cmd, p.qual, p.with_check
        FROM pg_policies p WHERE p.schemaname = %(schema)s
        ORDER BY 1, 2""",
    # Types defined on their own (enums, domains, ranges, composite types), not tables' row types
    # nor the array types PostgreSQL adds for every type.
    "types": """
        SELECT t.typname, t.typtype::text, format_type(t.typbasetype, t.typtypmod), t.typnotnull,
               t.typdefault,
               ARRAY(SELECT e.enumlabel::text FROM pg_enum e WHERE e.enumtypid = t.oid
                     ORDER BY e.enumsortorder)
        FROM pg_type t
        JOIN pg_namespace n ON n.oid = t.typnamespace
        LEFT JOIN pg_class c ON c.oid = t.typrelid
        WHERE n.nspname = %(schema)s AND (t.typrelid = 0 OR c.relkind = 'c')
          AND NOT (t.typcategory = 'A' AND t.typelem <> 0)
        ORDER BY t.typname""",
    "statistics": """
        SELECT s.stxname, pg_get_statisticsobjdef(s.oid)
        FROM pg_statistic_ext s JOIN pg_namespace n ON n.oid = s.stxnamespace
        WHERE n.nspname = %(schema)s
        ORDER BY 1""",
}


def _normalize(value: Any, schema: str) -> Any:
    if isinstance(value, str):
        return value.replace(f'"{schema}"', "<schema>").replace(schema, "<schema>")
    if isinstance(value, list | tuple):
        return tuple(_normalize(v, schema) for v in value)
    return value


def describe_schema(dsn: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """Return a normalized, comparable description of everything defined in ``schema``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            section: [_normalize(row, schema) for row in conn.execute(query, {"schema": schema})]
            for section, query in _CATALOG.items()
        }


def schema_differences(a: dict[str, list[tuple[Any, ...]]], b: dict[str, list[tuple[Any, ...]]]) -> list[str]:
    """Human-readable differences between two descriptions (empty when they are equal)."""
    out = []
    for section in sorted(a.keys() | b.keys()):
        rows_a, rows_b = a.get(section, []), b.get(section, [])
        if rows_a == rows_b:
            continue
        only_a = [r for r in rows_a if r not in rows_b]
        only_b = [r for r in rows_b if r not in rows_a]
        if not only_a and not only_b:
            out.append(f"{section}: same rows in another order")
        for r in only_a:
            out.append(f"{section}: only in the first: {r}")
        for r in only_b:
            out.append(f"{section}: only in the second: {r}")
    return out


def recorded_versions(dsn: str, schema: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        q = sql.SQL("SELECT version FROM {}.schema_version ORDER BY version").format(sql.Identifier(schema))
        return [r[0] for r in conn.execute(q)]


def run_on_schema(dsn: str, schema: str, body: str, params: Mapping[str, Any] | None = None) -> None:
    """Run ``body`` (``{schema}`` is the quoted ``schema``) with tests/dialects.py's run_sql, through a
    DbQueue of its own (nothing of it installed or checked)."""
    with DbQueue(dsn, schema=schema, pool_size=1) as admin:
        run_sql(admin, body, params)


@pytest.fixture
def new_schema(pg_dsn: str) -> Iterator[Callable[[], str]]:
    """Hand out fresh schema names; every schema of those names is dropped after the test."""
    names: list[str] = []

    def make() -> str:
        names.append(f"t_{uuid.uuid4().hex[:12]}")
        return names[-1]

    yield make
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def fresh_install(dsn: str, schema: str) -> int:
    db = PostgresDatabase(dsn, schema=schema)
    try:
        return db.install()
    finally:
        db.close()


# -- install -----------------------------------------------------------------------------------------


def test_install_twice_is_idempotent(dbq: DbQueue, pg_dsn: str) -> None:
    q = dbq.create_queue("kept")
    q.push({"n": 1})
    before = describe_schema(pg_dsn, dbq.schema)
    versions = recorded_versions(pg_dsn, dbq.schema)
    assert versions == [LATEST]

    assert dbq.install() == LATEST
    assert dbq.install() == LATEST

    assert recorded_versions(pg_dsn, dbq.schema) == versions
    assert schema_differences(before, describe_schema(pg_dsn, dbq.schema)) == []
    [m] = dbq.queue("kept").pop()
    assert m.payload == {"n": 1}


def test_vacuum_never_truncates_the_churning_tables(dbq: DbQueue, pg_dsn: str) -> None:
    """VACUUM's truncation takes an ACCESS EXCLUSIVE lock that would stall every push and pop."""
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT c.relname, coalesce(c.reloptions, '{}') FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'",
            (dbq.schema,),
        ).fetchall()
    options = {name: set(opts) for name, opts in rows}
    for table in ("meta", "data", "done"):
        assert "vacuum_truncate=false" in options[table], (table, options[table])


def install_concurrently(dsn: str, schema: str, n: int) -> list[Any]:
    """Run install() from ``n`` threads at once, each with its own client; return versions or errors."""
    clients = [DbQueue(dsn, schema=schema, pool_size=1) for _ in range(n)]
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def install(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = clients[i].install()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=install, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        for c in clients:
            c.close()
    return results


def test_concurrent_install_on_a_fresh_schema(pg_dsn: str, new_schema: Callable[[], str]) -> None:
    reference = new_schema()
    fresh_install(pg_dsn, reference)
    expected = describe_schema(pg_dsn, reference)

    for _ in range(3):  # a few rounds: the race differs from run to run
        name = new_schema()
        assert install_concurrently(pg_dsn, name, 4) == [LATEST] * 4
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", [name]).fetchone()
        assert row == (1,)
        assert recorded_versions(pg_dsn, name) == [LATEST]
        assert schema_differences(expected, describe_schema(pg_dsn, name)) == []


# -- migrations --------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", MIGRATION_VERSIONS)
def test_migrating_from_an_old_version_gives_the_fresh_schema(
    pg_dsn: str, new_schema: Callable[[], str], start: int
) -> None:
    fresh, migrated = new_schema(), new_schema()
    assert fresh_install(pg_dsn, fresh) == LATEST  # runs schema.sql

    db = PostgresDatabase(pg_dsn, schema=migrated)
    try:
        db.migrate_to(start)
        assert recorded_versions(pg_dsn, migrated) == list(range(1, start + 1))
        assert db.install() == LATEST  # applies the migrations after `start`
    finally:
        db.close()

    assert recorded_versions(pg_dsn, migrated) == list(range(1, LATEST + 1))
    assert recorded_versions(pg_dsn, fresh) == [LATEST]
    diff = schema_differences(describe_schema(pg_dsn, fresh), describe_schema(pg_dsn, migrated))
    assert diff == [], "schema.sql and the migrations disagree:\n" + "\n".join(diff)


_MUTATIONS = {
    "added column": "ALTER TABLE {schema}.meta ADD COLUMN extra integer",
    "column default": "ALTER TABLE {schema}.meta ALTER COLUMN state SET DEFAULT 1",
    "nullability": "ALTER TABLE {schema}.done ALTER COLUMN outcome DROP NOT NULL",
    "column type": "ALTER TABLE {schema}.meta ALTER COLUMN priority TYPE integer",
    "column order": (
        "ALTER TABLE {schema}.meta DROP COLUMN consumer; ALTER TABLE {schema}.meta ADD COLUMN consumer text"
    ),
    "check constraint": (
        "ALTER TABLE {schema}.done DROP CONSTRAINT done_outcome_valid, "
        "ADD CONSTRAINT done_outcome_valid CHECK (outcome IN (1, 2, 3))"
    ),
    "index definition": (
        "DROP INDEX {schema}.meta_failed_idx; "
        "CREATE INDEX meta_failed_idx ON {schema}.meta (queue_id, id) WHERE state = 1"
    ),
    "table storage option": "ALTER TABLE {schema}.meta SET (fillfactor = 80)",
    "sequence option": "ALTER SEQUENCE {schema}.message_id_seq INCREMENT BY 2",
    "extra table": "CREATE TABLE {schema}.extra (id integer)",
    "function": "CREATE FUNCTION {schema}.f() RETURNS integer LANGUAGE sql AS 'SELECT 1'",
}


@pytest.mark.parametrize("mutation", list(_MUTATIONS), ids=list(_MUTATIONS))
def test_schema_comparison_detects_differences(
    pg_dsn: str, new_schema: Callable[[], str], mutation: str
) -> None:
    a, b = new_schema(), new_schema()
    fresh_install(pg_dsn, a)
    fresh_install(pg_dsn, b)
    assert schema_differences(describe_schema(pg_dsn, a), describe_schema(pg_dsn, b)) == []

    run_on_schema(pg_dsn, b, _MUTATIONS[mutation])

    assert schema_differences(describe_schema(pg_dsn, a), describe_schema(pg_dsn, b)) != []


# -- version checks ----------------------------------------------------------------------------------


def test_schema_newer_than_the_code_is_refused(dbq: DbQueue, pg_dsn: str) -> None:
    newer = LATEST + 41
    run_sql(dbq, "INSERT INTO {schema}.schema_version (version) VALUES (%(v)s)", {"v": newer})
    with pytest.raises(SchemaError) as info:
        dbq.install()
    message = str(info.value).replace(dbq.db.where, "<where>")
    assert re.search(rf"\b{newer}\b", message), message
    assert re.search(rf"\b{LATEST}\b", message), message
    assert dbq.schema in message
    assert recorded_versions(pg_dsn, dbq.schema) == [LATEST, newer]  # left alone
    with pytest.raises(SchemaError, match=rf"version {newer}, newer"):
        dbq.uninstall()  # nor dropped: this code cannot know what a newer version created
    assert recorded_versions(pg_dsn, dbq.schema) == [LATEST, newer]
    run_sql(dbq, "DELETE FROM {schema}.schema_version WHERE version = %(v)s", {"v": newer})


_CLIENT_CALLS: dict[str, Callable[[DbQueue], Any]] = {
    "create_queue": lambda d: d.create_queue("q"),
    "queue": lambda d: d.queue("q"),
    "list_queues": lambda d: d.list_queues(),
    "drop_queue": lambda d: d.drop_queue("q", missing_ok=True),
}


@pytest.mark.parametrize("call", list(_CLIENT_CALLS), ids=list(_CLIENT_CALLS))
@pytest.mark.parametrize("schema_exists", [False, True], ids=["no-schema", "empty-schema"])
def test_schema_never_installed(pg_dsn: str, schema_name: str, call: str, schema_exists: bool) -> None:
    if schema_exists:
        run_on_schema(pg_dsn, schema_name, "CREATE SCHEMA {schema}")
    dbq = DbQueue(pg_dsn, schema=schema_name)
    try:
        with pytest.raises(SchemaError, match=r"install") as info:
            _CLIENT_CALLS[call](dbq)
        assert not isinstance(info.value, psycopg.Error)
        assert schema_name in str(info.value)
    finally:
        run_on_schema(pg_dsn, schema_name, "DROP SCHEMA IF EXISTS {schema} CASCADE")
        dbq.close()


_QUEUE_CALLS: dict[str, Callable[[Any], Any]] = {
    "push": lambda q: q.push(1),
    "push_delayed": lambda q: q.push(1, delay=5),
    "pop": lambda q: q.pop(),
    "pop_at_least_once": lambda q: q.pop(semantics="at-least-once"),
    "stats": lambda q: q.stats(),
    "peek": lambda q: q.peek(),
    "count_ready": lambda q: q.count_ready(),
    "reclaim_expired": lambda q: q.reclaim_expired(),
    "list_failed": lambda q: q.list_failed(),
    "requeue_failed": lambda q: q.requeue_failed(),
    "delete_failed": lambda q: q.delete_failed(),
}


@pytest.mark.parametrize("call", list(_QUEUE_CALLS), ids=list(_QUEUE_CALLS))
def test_schema_dropped_under_an_open_queue(dbq: DbQueue, call: str) -> None:
    q = dbq.create_queue("q")
    dbq.uninstall()
    with pytest.raises(SchemaError, match=r"install"):
        _QUEUE_CALLS[call](q)


# -- named queries -----------------------------------------------------------------------------------


def _query_names() -> list[str]:
    return list(load_queries(POSTGRES_PKG, "queries"))


def _identifiers(body: str) -> dict[str, str]:
    """Sample values of a query's identifier placeholders other than {schema} ({table}, {index})."""
    return {k: f"sample_{k}" for k in re.findall(r"\{([a-z_]+)\}", body) if k != "schema"}


def _sample_identifiers(name: str) -> dict[str, str]:
    """Real names for the identifier placeholders of a query, to plan it against an installed schema."""
    body = load_queries(POSTGRES_PKG, "queries")[name]
    real = {
        "table": "meta",
        "index": "meta_ready_idx",
        "sequence": "message_id_seq",
        "routine": "ring_holders",
    }
    return {k: real[k] for k in _identifiers(body)}


def test_every_named_query_composes() -> None:
    raw = load_queries(POSTGRES_PKG, "queries")
    assert raw, "queries/ holds no named query"
    db = PostgresDatabase("host=unused.invalid", schema="sample_schema")  # composing does no I/O
    for name, body in raw.items():
        idents = _identifiers(body)
        text = db.query(name, idents).decode()
        assert "{" not in text, name
        assert ("{schema}" in body) == ('"sample_schema"' in text), name
        for value in idents.values():
            assert f'"{value}"' in text, name
        assert text.strip(), name


def test_only_utility_statements_take_identifier_placeholders() -> None:
    """{table}, {index}, {sequence} and {routine} belong to VACUUM, ANALYZE, REINDEX, DROP INDEX and
    uninstall's drops; anywhere else (say, in a comment that ended up in the block before it) they would
    break the query at run time."""
    raw = load_queries(POSTGRES_PKG, "queries")
    with_idents = sorted(name for name, body in raw.items() if _identifiers(body))
    assert with_idents == [
        "analyze_table",
        "drop_index_concurrently",
        "drop_owned_routine",
        "drop_owned_sequence",
        "drop_owned_table",
        "reindex_concurrently",
        "vacuum_full_table",
        "vacuum_table",
    ]


def test_identifier_placeholders_are_validated() -> None:
    db = PostgresDatabase("host=unused.invalid", schema="sample_schema")
    with pytest.raises(InvalidNameError):
        db.query("vacuum_table", {"table": 'meta"; DROP TABLE x; --'})
    assert db.query("vacuum_table", {"table": "meta"}).decode().endswith('"sample_schema"."meta"')


def _server_placeholders(text: str) -> tuple[str, dict[str, int]]:
    """Turn psycopg's %(name)s and %(name)b placeholders into PostgreSQL's $n, numbering each name once."""
    numbers: dict[str, int] = {}

    def number(m: re.Match[str]) -> str:
        return f"${numbers.setdefault(m.group(1), len(numbers) + 1)}"

    return re.sub(r"%\((\w+)\)[sb]", number, text).replace("%%", "%"), numbers


def test_every_named_query_parses_and_plans_on_the_server(dbq: DbQueue, pg_dsn: str) -> None:
    """PREPARE every query against an installed schema: catches unknown columns and type errors."""
    failures = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for i, name in enumerate(_query_names()):
            text, _ = _server_placeholders(dbq.db.query(name, _sample_identifiers(name)).decode())
            res = conn.pgconn.prepare(f"dbq_check_{i}".encode(), text.encode())
            if res.status != ExecStatus.COMMAND_OK:
                failures.append(f"{name}: {(res.error_message or b'').decode().strip()}")
        # The check itself must be able to fail.
        bad = conn.pgconn.prepare(
            b"dbq_check_bad", f'SELECT no_such_column FROM "{dbq.schema}".meta'.encode()
        )
        assert bad.status != ExecStatus.COMMAND_OK
    assert failures == []


def _engine_source() -> str:
    root = Path(engine_pkg.__file__).parent
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py")))


def _is_used(name: str, source: str) -> bool:
    """Whether ``name`` appears as a string literal in ``source``."""
    return re.search(rf"""["']{re.escape(name)}["']""", source) is not None


def test_every_named_query_is_used_by_the_engine() -> None:
    source = _engine_source()
    assert not _is_used("no_such_query_name", source)  # the check can fail
    unused = [n for n in _query_names() if not _is_used(n, source)]
    assert unused == [], f"named queries in queries/ that no engine module uses: {unused}"


def test_every_query_the_engine_names_exists() -> None:
    called = set(
        re.findall(
            r"""\.(?:query|fetchall|fetchone|execute)\(\s*["']([a-z_][a-z0-9_]*)["']""", _engine_source()
        )
    )
    assert called, "found no named-query call in the engine: the pattern is out of date"
    assert sorted(called - set(_query_names())) == []


def test_version_1_data_survives_the_migration_and_old_receipts_still_ack(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """Rows written under schema version 1 (receipts were (id, attempts)) work after migrating."""
    schema = new_schema()
    db = PostgresDatabase(pg_dsn, schema=schema)
    try:
        db.migrate_to(1)
        ident = sql.Identifier(schema)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(
                sql.SQL(
                    "INSERT INTO {s}.queues (name, design, payload_type, max_payload_bytes, max_attempts, "
                    "visibility_timeout_s, retry_backoff_s, retry_backoff_max_s, notify, archive) "
                    "VALUES ('old', 'table', 'json', 1000, 5, 30, 1, 10, 'auto', true)"
                ).format(s=ident)
            )
            # one message leased on its 2nd attempt by version-1 code, one ready
            c.execute(
                sql.SQL(
                    "INSERT INTO {s}.meta "
                    "(id, queue_id, state, attempts, process_at, enqueued_at, lease_until) "
                    "VALUES (1, 1, 1, 2, now(), now(), now() + interval '1 hour'), "
                    "(2, 1, 0, 0, now(), now(), NULL)"
                ).format(s=ident)
            )
            c.execute(sql.SQL("""INSERT INTO {s}.data VALUES (1, '"a"'), (2, '"b"')""").format(s=ident))
        with DbQueue(pg_dsn, schema=schema) as dbq:
            assert dbq.install() == schema_sql()[0]
            q = dbq.queue("old")
            assert q.ack_receipts([(1, 2)]) == 1  # the receipt version-1 code handed out
            [m] = q.pop(1, semantics="at-least-once")
            assert (m.id, m.payload, m.attempts, m.delivery) == (2, "b", 1, 1)
            assert q.ack([m]) == 1
            assert q.stats().finished == 2
    finally:
        db.drop_schema()
        db.close()


def test_version_11_rings_keep_their_messages_through_the_migration(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """A ring written under schema version 11 (consumers wrote the slots: finished, leased, nacked
    messages each had a state there) migrates with its messages: each one not finished is delivered
    once, with its payload; finished ones and a gap are not; and the ring goes on wrapping."""
    schema = new_schema()
    db = PostgresDatabase(pg_dsn, schema=schema)
    try:
        db.migrate_to(11)
        ident = sql.Identifier(schema)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            qid = c.execute(
                sql.SQL(
                    "INSERT INTO {s}.queues (name, design, payload_type, max_payload_bytes, max_attempts, "
                    "visibility_timeout_s, retry_backoff_s, retry_backoff_max_s, notify, archive) "
                    "VALUES ('old', 'ring', 'json', 100, 5, 30, 1, 10, 'never', false) RETURNING queue_id"
                ).format(s=ident)
            ).fetchone()[0]  # type: ignore[index]
            c.execute(sql.SQL("SELECT {s}.ring_create(%s, %s, 8, 100)").format(s=ident), [schema, qid])
            push = sql.SQL("SELECT {s}.ring_push(%s, 8, %s::bytea[], 5, 0, 'ch', NULL)").format(s=ident)
            payloads = [f'"m{i}"'.encode() for i in range(1, 7)]
            assert c.execute(push, [qid, payloads]).fetchone() == (1,)
            # as version-11 consumers left them: 1 popped at most once, 2 leased, 3 nacked for later,
            # 4 acked; 5 and 6 ready. Number 7 taken by a push that rolled back, 8 pushed.
            for stmt in (
                "UPDATE {s}.ring_slots SET state = 0, payload = NULL, attempts = 1, deliveries = 1 "
                "WHERE queue_id = %(q)s AND seq IN (1, 4)",
                "UPDATE {s}.ring_slots SET state = 2, attempts = 1, deliveries = 1, consumer = 'c', "
                "due_at = now() + interval '1 hour' WHERE queue_id = %(q)s AND seq = 2",
                "UPDATE {s}.ring_slots SET attempts = 1, deliveries = 1, "
                "due_at = now() + interval '1 hour' WHERE queue_id = %(q)s AND seq = 3",
            ):
                c.execute(sql.SQL(stmt).format(s=ident), {"q": qid})
            with c.transaction(force_rollback=True):
                assert c.execute(push, [qid, [b'"lost"']]).fetchone() == (7,)
            assert c.execute(push, [qid, [b'"m8"']]).fetchone() == (8,)
        with DbQueue(pg_dsn, schema=schema) as dbq:
            assert dbq.install() == schema_sql()[0]
            q = dbq.queue("old")
            assert (q.settings.capacity, q.settings.lanes) == (8, 8)
            st = q.stats()
            assert (st.ready, st.in_flight, st.extra["push_position"], st.extra["floor"]) == (5, 0, 8, 2), st
            got = drain(q)
            assert [(m.id, m.payload) for m in got] == [(2, "m2"), (3, "m3"), (5, "m5"), (6, "m6"), (8, "m8")]
            more = [f"n{i}" for i in range(20)]
            for first in range(0, 20, 4):  # the ring wraps over the migrated slots and the gap
                q.push_batch(more[first : first + 4])
                got += drain(q)
            assert [m.payload for m in got[5:]] == more
            assert [m.id for m in got[5:]] == list(range(9, 29))
            st = q.stats()
            assert (st.ready, st.in_flight, st.extra["gaps_skipped"], st.extra["ring_used"]) == (0, 0, 1, 0)
    finally:
        db.drop_schema()
        db.close()


def test_version_13_table_queues_keep_their_messages_through_the_migration(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """Messages of a table queue written under schema version 13 (every payload in data: ready ones,
    a large one, one leased, finished ones waiting in done for the archiver) come through the
    migration to 14, which keeps small payloads in the meta row: each is delivered or archived once
    with its payload, and new pushes beside them too."""
    schema = new_schema()
    db = PostgresDatabase(pg_dsn, schema=schema)
    try:
        db.migrate_to(13)
        ident = sql.Identifier(schema)
        old = [{"old": i, "pad": "y" * (3000 if i == 3 else 10)} for i in range(10)]
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            qid = c.execute(
                sql.SQL(
                    "INSERT INTO {s}.queues (name, design, payload_type, max_payload_bytes, max_attempts, "
                    "visibility_timeout_s, retry_backoff_s, retry_backoff_max_s, notify, archive) "
                    "VALUES ('old', 'table', 'json', 100000, 5, 30, 1, 10, 'never', true) RETURNING queue_id"
                ).format(s=ident)
            ).fetchone()[0]  # type: ignore[index]
            encoded = [json.dumps(p, separators=(",", ":")).encode() for p in old]
            ids = [
                r[0]
                for r in c.execute(
                    sql.SQL("SELECT * FROM {s}.table_push(%s, %s::bytea[], 0::smallint, 0, 0, 'ch')").format(
                        s=ident
                    ),
                    [qid, encoded],
                )
            ]
            assert len(ids) == 10
            # as version-13 code left them: 0 and 1 finished (in done, payloads in data), 2 leased
            c.execute(
                sql.SQL(
                    "WITH t AS (DELETE FROM {s}.meta WHERE id = ANY(%(f)s) RETURNING *) "
                    "INSERT INTO {s}.done (id, queue_id, priority, attempts, enqueued_at, outcome) "
                    "SELECT id, queue_id, priority, 1, enqueued_at, 1 FROM t"
                ).format(s=ident),
                {"f": ids[:2]},
            )
            c.execute(
                sql.SQL(
                    "UPDATE {s}.meta SET state = 1, attempts = 1, deliveries = 1, consumer = 'c', "
                    "lease_until = now() + interval '1 hour' WHERE id = %(i)s"
                ).format(s=ident),
                {"i": ids[2]},
            )
        with DbQueue(pg_dsn, schema=schema) as dbq:
            assert dbq.install() == schema_sql()[0]
            q = dbq.queue("old")
            new = [{"new": i} for i in range(5)] + [{"new": 5, "pad": "z" * 3000}]
            new_ids = q.push_batch(new)
            [(inline, in_data)] = run_sql(
                dbq,
                "SELECT count(*) FILTER (WHERE payload IS NOT NULL), "
                "(SELECT count(*) FROM {schema}.data WHERE id = ANY(%(n)s)) FROM {schema}.meta "
                "WHERE id = ANY(%(n)s)",
                {"n": new_ids},
            )
            assert (inline, in_data) == (5, 1)  # the new small payloads in their rows, the large in data
            assert q.ack_receipts([(ids[2], 1)]) == 1  # the lease version-13 code handed out
            got = drain(q, "at-least-once", n=4)
            assert checksum(m.payload for m in got) == checksum(old[3:] + new)
            assert q.stats().finished == 16
            result = dbq.maintenance().archive(archive_after=0, batch_size=5, pause=0, time_budget=10)
            assert result.rows == 16, result
            archived = run_sql(dbq, "SELECT payload FROM {schema}.archive")
            assert checksum(json.loads(bytes(r[0])) for r in archived) == checksum(old + new)
            [(left,)] = run_sql(
                dbq, "SELECT (SELECT count(*) FROM {schema}.data) + (SELECT count(*) FROM {schema}.done)"
            )
            assert left == 0
    finally:
        db.drop_schema()
        db.close()


def test_version_14_table_queues_keep_their_messages_through_the_migration(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """Messages of a table queue written under schema version 14 (small payloads in their meta rows, a
    large one in data, one leased, finished ones in done) come through the migration to 16, which
    makes the pops and the ack functions: the lease is acked by its receipt, the rest is popped at
    least once and at most once, and everything is archived once with its payload."""
    schema = new_schema()
    db = PostgresDatabase(pg_dsn, schema=schema)
    try:
        db.migrate_to(14)
        ident = sql.Identifier(schema)
        old = [{"old": i, "pad": "y" * (3000 if i == 3 else 10)} for i in range(10)]
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            qid = c.execute(
                sql.SQL(
                    "INSERT INTO {s}.queues (name, design, payload_type, max_payload_bytes, max_attempts, "
                    "visibility_timeout_s, retry_backoff_s, retry_backoff_max_s, notify, archive) "
                    "VALUES ('old', 'table', 'json', 100000, 5, 30, 1, 10, 'never', true) RETURNING queue_id"
                ).format(s=ident)
            ).fetchone()[0]  # type: ignore[index]
            encoded = [json.dumps(p, separators=(",", ":")).encode() for p in old]
            ids = [
                r[0]
                for r in c.execute(
                    sql.SQL("SELECT * FROM {s}.table_push(%s, %s::bytea[], 0::smallint, 0, 0, 'ch')").format(
                        s=ident
                    ),
                    [qid, encoded],
                )
            ]
            # as version-14 code left them: 0 and 1 finished (in done with their payloads), 2 leased
            c.execute(
                sql.SQL(
                    "WITH t AS (DELETE FROM {s}.meta WHERE id = ANY(%(f)s) RETURNING *) "
                    "INSERT INTO {s}.done (id, queue_id, priority, attempts, enqueued_at, outcome, payload) "
                    "SELECT id, queue_id, priority, 1, enqueued_at, 1, payload FROM t"
                ).format(s=ident),
                {"f": ids[:2]},
            )
            c.execute(
                sql.SQL(
                    "UPDATE {s}.meta SET state = 1, attempts = 1, deliveries = 1, consumer = 'c', "
                    "lease_until = now() + interval '1 hour' WHERE id = %(i)s"
                ).format(s=ident),
                {"i": ids[2]},
            )
        with DbQueue(pg_dsn, schema=schema) as dbq:
            assert dbq.install() == schema_sql()[0]
            q = dbq.queue("old")
            new = [{"new": i} for i in range(5)] + [{"new": 5, "pad": "z" * 3000}]
            q.push_batch(new)
            assert q.ack_receipts([(ids[2], 1)]) == 1  # the lease version-14 code handed out
            got = [m.payload for m in q.pop(3)]  # at most once
            got += [m.payload for m in drain(q, "at-least-once", n=4)]
            assert checksum(got) == checksum(old[3:] + new)
            assert q.stats().finished == 16
            result = dbq.maintenance().archive(archive_after=0, batch_size=5, pause=0, time_budget=10)
            assert result.rows == 16, result
            archived = run_sql(dbq, "SELECT payload FROM {schema}.archive")
            assert checksum(json.loads(bytes(r[0])) for r in archived) == checksum(old + new)
            [(left,)] = run_sql(
                dbq, "SELECT (SELECT count(*) FROM {schema}.data) + (SELECT count(*) FROM {schema}.done)"
            )
            assert left == 0
    finally:
        db.drop_schema()
        db.close()


def test_version_14_rings_keep_their_messages_and_push_one_at_a_time_after_the_migration(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """A ring written under schema version 14 keeps its messages through the migrations since (15 and
    17 replace the function behind a push of one, ring_push_one): the old messages come out once, in
    order, with their payloads, then the pushes of one made after it, as the ring wraps; a push of
    one into a full ring still waits for room and is written once."""
    schema = new_schema()
    db = PostgresDatabase(pg_dsn, schema=schema)
    try:
        db.migrate_to(14)
        ident = sql.Identifier(schema)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            qid = c.execute(
                sql.SQL(
                    "INSERT INTO {s}.queues (name, design, payload_type, max_payload_bytes, max_attempts, "
                    "visibility_timeout_s, retry_backoff_s, retry_backoff_max_s, notify, archive) "
                    "VALUES ('old', 'ring', 'json', 100, 5, 30, 1, 10, 'never', false) RETURNING queue_id"
                ).format(s=ident)
            ).fetchone()[0]  # type: ignore[index]
            c.execute(sql.SQL("SELECT {s}.ring_create(%s, %s, 8, 100, 4)").format(s=ident), [schema, qid])
            old = [f"old{i}" for i in range(6)]
            push = sql.SQL("SELECT {s}.ring_push(%s, 8, %s::bytea[], 5, 0, 'ch', NULL)").format(s=ident)
            assert c.execute(push, [qid, [json.dumps(p).encode() for p in old[:3]]]).fetchone() == (1,)
            one = sql.SQL("SELECT r_num, r_written FROM {s}.ring_push_one(%s, 8, %s::bytea, 0, 'ch')")
            for i, p in enumerate(old[3:], start=4):  # version 14's push of one, a set of one row
                assert c.execute(one.format(s=ident), [qid, json.dumps(p).encode()]).fetchone() == (i, True)
        with DbQueue(pg_dsn, schema=schema) as dbq:
            assert dbq.install() == schema_sql()[0]
            q = dbq.queue("old")
            q.push_timeout = 10.0
            new = [f"new{i}" for i in range(2)]
            assert [q.push(p) for p in new] == [7, 8]  # the ring is full now: 8 slots, none taken
            late: list[int] = []
            pusher = threading.Thread(target=lambda: late.append(q.push("late")))
            pusher.start()  # waits for room: number 9 needs the slot of number 1
            got = [(m.id, m.payload) for m in q.pop(3)]
            pusher.join(10)
            assert not pusher.is_alive() and late == [9]
            got += [(m.id, m.payload) for m in drain(q)]
            more = [f"more{i}" for i in range(20)]
            for p in more:  # pushes of one around the ring, two and a half times
                q.push(p)
                got += [(m.id, m.payload) for m in q.pop(1)]
            got += [(m.id, m.payload) for m in drain(q)]
            assert got == list(enumerate(old + new + ["late"] + more, start=1))
            assert q.stats().ready == 0
    finally:
        db.drop_schema()
        db.close()


def test_version_17_rings_keep_their_messages_positions_and_leases_through_the_migration(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """A ring written under schema version 17 (one consumer group) keeps everything through migrations
    18 and 19 (consumer groups): its lanes' positions (the messages taken are not delivered again), its
    open lease (whose receipts still ack), its failed message, and the messages not taken yet, which
    come out once, in order; a group added after it with start="earliest" gets those too. (1 s)"""
    schema = new_schema()
    db = PostgresDatabase(pg_dsn, schema=schema)
    try:
        db.migrate_to(17)
        ident = sql.Identifier(schema)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            qid = c.execute(
                sql.SQL(
                    "INSERT INTO {s}.queues (name, design, payload_type, max_payload_bytes, max_attempts, "
                    "visibility_timeout_s, retry_backoff_s, retry_backoff_max_s, notify, archive) "
                    "VALUES ('old', 'ring', 'json', 100, 1, 600, 0, 0, 'never', false) RETURNING queue_id"
                ).format(s=ident)
            ).fetchone()[0]  # type: ignore[index]
            c.execute(sql.SQL("SELECT {s}.ring_create(%s, %s, 16, 100, 4)").format(s=ident), [schema, qid])
            old = [f"old{i}" for i in range(9)]
            push = sql.SQL("SELECT {s}.ring_push(%s, 16, %s::bytea[], 5, 0, 'ch', NULL)").format(s=ident)
            assert c.execute(push, [qid, [json.dumps(p).encode() for p in old]]).fetchone() == (1,)
            take = sql.SQL("SELECT r_id FROM {s}.ring_take(%s, 16, 4, %s, %s, 600, 'c', true, true)")
            assert [r[0] for r in c.execute(take.format(s=ident), [qid, 2, False])] == [1, 2]  # finished
            assert [r[0] for r in c.execute(take.format(s=ident), [qid, 2, True])] == [3, 4]  # leased
            assert [r[0] for r in c.execute(take.format(s=ident), [qid, 1, True])] == [5]  # fails below
            settle = sql.SQL(
                "SELECT r_id, r_state FROM {s}.ring_settle(%s, 16, 4, ARRAY[5]::bigint[], ARRAY[1], true, "
                "0, 0, 0, 1, 'poison')"
            )
            assert c.execute(settle.format(s=ident), [qid]).fetchall() == [(5, 2)]
            before = c.execute(
                sql.SQL("SELECT lane, pos FROM {s}.ring_lanes WHERE queue_id = %s ORDER BY lane").format(
                    s=ident
                ),
                [qid],
            ).fetchall()
        with DbQueue(pg_dsn, schema=schema) as dbq:
            assert dbq.install() == schema_sql()[0] == 25
            rows = run_sql(dbq, "SELECT queue_id, lane, pos FROM {schema}.ring_lanes ORDER BY lane")
            assert [(lane, pos) for q, lane, pos in rows if q == qid] == before and len(rows) == len(before)
            q = dbq.queue("old")
            late = q.add_group("late", start="earliest")  # type: ignore[attr-defined]
            assert q.ack_receipts([(3, 1), (4, 1)]) == 2
            [f] = q.list_failed()
            assert (f.id, f.payload, f.last_error) == (5, "old4", "poison")
            got = [(m.id, m.payload) for m in drain(q)]
            assert got == list(enumerate(old, start=1))[5:]
            assert [(m.id, m.payload) for m in drain(late)] == got
            assert q.stats().extra["floor"] == 10 and late.list_failed() == []
    finally:
        db.drop_schema()
        db.close()


def test_version_20_table_queues_keep_their_messages_through_the_migration(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """Messages of a table queue written under schema version 20 (ready ones, a large one in data, a
    claimed batch, two plain leases, a failed one) come through the migration to 21, which drops
    meta_pkey: the batch is read by id and acked, the leases are read and acked by their receipts, the
    failed message is listed and requeued, and everything left is delivered once with its payload."""
    schema = new_schema()
    db = PostgresDatabase(pg_dsn, schema=schema)
    try:
        db.migrate_to(20)
        ident = sql.Identifier(schema)
        old = [{"old": i, "pad": "y" * (3000 if i == 3 else 10)} for i in range(10)]
        batch_id = uuid.uuid4()
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            qid = c.execute(
                sql.SQL(
                    "INSERT INTO {s}.queues (name, design, payload_type, max_payload_bytes, max_attempts, "
                    "visibility_timeout_s, retry_backoff_s, retry_backoff_max_s, notify, archive) "
                    "VALUES ('old', 'table', 'json', 100000, 5, 30, 0, 0, 'never', true) RETURNING queue_id"
                ).format(s=ident)
            ).fetchone()[0]  # type: ignore[index]
            encoded = [json.dumps(p, separators=(",", ":")).encode() for p in old]
            push = sql.SQL("SELECT * FROM {s}.table_push(%s, %s::bytea[], 0::smallint, 0, 0, 'ch', false)")
            ids = [r[0] for r in c.execute(push.format(s=ident), [qid, encoded])]
            lease = sql.SQL("SELECT r_id, r_deliveries FROM {s}.table_lease(%s, 4, 3600, 'c')")
            assert c.execute(lease.format(s=ident), [qid]).fetchall() == [(i, 1) for i in ids[:4]]
            c.execute(  # as version-20 code claimed a batch: its messages leased, its receipts recorded
                sql.SQL(
                    "INSERT INTO {s}.batches (batch_id, queue_id, ids, deliveries, consumer, lease_until) "
                    "VALUES (%s, %s, %s, ARRAY[1, 1], 'c', now() + interval '1 hour')"
                ).format(s=ident),
                [batch_id, qid, ids[:2]],
            )
            c.execute(
                sql.SQL(
                    "UPDATE {s}.meta SET state = 2, attempts = 5, last_error = 'poison' WHERE id = %s"
                ).format(s=ident),
                [ids[4]],
            )
        with DbQueue(pg_dsn, schema=schema) as dbq:
            assert dbq.install() == schema_sql()[0] == 25
            q = dbq.queue("old")
            with psycopg.connect(pg_dsn, autocommit=True) as c:
                rows = c.execute(q.batch_query(str(batch_id)).encode()).fetchall()
            assert [(r[1], json.loads(bytes(r[3]))) for r in rows] == list(zip(ids[:2], old[:2], strict=True))
            assert q.ack_batch(str(batch_id)) == 2
            got = [m.payload for m in q.leased([(ids[2], 1), (ids[3], 1)])]
            assert got == old[2:4] and q.ack_receipts([(ids[2], 1), (ids[3], 1)]) == 2
            [f] = q.list_failed()
            assert (f.id, f.payload, f.last_error) == (ids[4], old[4], "poison")
            assert q.requeue_failed([ids[4]]) == 1
            new = [{"new": i} for i in range(5)] + [{"new": 5, "pad": "z" * 3000}]
            q.push_batch(new)
            got += [m.payload for m in drain(q, "at-least-once", n=3)]
            assert checksum(got) == checksum(old[2:] + new)
            s = q.stats()
            assert (s.ready, s.in_flight, s.failed, s.finished) == (0, 0, 0, 16)
    finally:
        db.drop_schema()
        db.close()
