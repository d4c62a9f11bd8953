"""The queue schema: install, upgrades and the functions re-applied under load, version checks, and
the named queries.

describe_schema is a normalized description of the catalog (tables, columns, constraints, indexes,
sequences, functions, triggers, ...) of one schema, for comparing two installs.
"""

from __future__ import annotations

import itertools
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
from airflow_dbqueue.engine.dialects.ownership import digest
from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase
from airflow_dbqueue.engine.dialects.postgres import schema as pg_schema
from airflow_dbqueue.engine.dialects.postgres.schema import schema_sql
from airflow_dbqueue.engine.sqlfile import load_queries
from tests.dialects import run_sql
from tests.helpers import checksum
from tests.integration.test_conformance import drain

pytestmark = pytest.mark.integration

POSTGRES_PKG = "airflow_dbqueue.engine.dialects.postgres"
LATEST = schema_sql()[0]

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
        for gen in range(8):  # the partitions, which hold the rows (schema.sql)
            part = f"{table}_{gen}"
            assert "vacuum_truncate=false" in options[part], (part, options[part])


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


# -- comparing installs ------------------------------------------------------------------------------


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
    "table storage option": "ALTER TABLE {schema}.meta_0 SET (fillfactor = 80)",
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


# The function of a ring of the rows layout that each of its hot statements calls ({fn}), after the
# ring's prefix (ring_<queue_id>_r).
_RING_ROWS_FUNCTIONS = {
    "ring_rows_push": "push",
    "ring_rows_push_ttl": "pushx",
    "ring_rows_push_keys": "pushk",
    "ring_rows_push_ordered": "pusho",
    "ring_rows_forget_keys": "forget",
    "ring_rows_take": "take",
    "ring_rows_pop_payloads": "take",
    "ring_rows_take_one": "take1",
    "ring_rows_pop_payload_one": "take1",
    "ring_rows_ack": "ack",
    "ring_rows_ack_notify": "ack",
    "ring_rows_settle_notify": "settle",
    "ring_rows_claim_batch": "bclaim",
    "ring_rows_get_batch": "bget",
    "ring_rows_set_batch": "bset",
    "ring_rows_open_batches": "bopen",
    "ring_rows_purge_batches": "bpurge",
    "ring_rows_batch_rows": "brows",
    "ring_rows_extend": "bextend",
    "ring_rows_leased": "leased",
}


def _sample_identifiers(name: str, rows_ring: int | None = None) -> dict[str, str]:
    """Real names for the identifier placeholders of a query, to plan it against an installed schema
    (``rows_ring``: the queue_id of a ring of the rows layout there, whose functions {fn} names)."""
    body = load_queries(POSTGRES_PKG, "queries")[name]
    real = {
        "table": "meta",
        "index": "meta_ready_idx",
        "sequence": "message_id_seq",
        "routine": "ring_holders",
        "fn": f"ring_{rows_ring}_r{_RING_ROWS_FUNCTIONS.get(name)}",
        # ring_rows_ask, a waiting pop's question: the group's lanes function and two sequences
        "lanes": f"ring_{rows_ring}_rlanes",
        "retrygen": f"ring_{rows_ring}_rretrygen",
        "rows": f"ring_{rows_ring}_rrows",
        # ring_rows_next_due: the group's retry log (a view over its segments)
        "retries": f"ring_{rows_ring}_rr",
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
    uninstall's drops, {fn} to the hot statements of a ring of the rows layout, which call its own
    functions, {lanes}, {retrygen} and {rows} to its waiting pops' question (ring_rows_ask), and
    {retries} to their look for the next message due again (ring_rows_next_due);
    anywhere else (say, in a comment that ended up in the block before it) they would break the query
    at run time."""
    raw = load_queries(POSTGRES_PKG, "queries")
    with_idents = sorted(name for name, body in raw.items() if _identifiers(body))
    assert with_idents == sorted(
        [
            "analyze_table",
            "drop_index_concurrently",
            "drop_owned_routine",
            "drop_owned_sequence",
            "drop_owned_table",
            "reindex_concurrently",
            "vacuum_full_table",
            "vacuum_table",
            "ring_rows_ask",
            "ring_rows_next_due",
            *_RING_ROWS_FUNCTIONS,
        ]
    )
    assert all(_identifiers(raw[name]) == {"fn": "sample_fn"} for name in _RING_ROWS_FUNCTIONS)
    assert set(_identifiers(raw["ring_rows_ask"])) == {"lanes", "retrygen", "rows"}
    assert set(_identifiers(raw["ring_rows_next_due"])) == {"retries"}


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
    rows_ring = dbq.create_queue("plans_rows", design="ring", layout="rows", capacity=64).settings.queue_id
    # The acks and settles that notify are those of a ring ordered per key (its functions take the ring's
    # notify setting and channel).
    keyed = dbq.create_queue(
        "plans_keyed", design="ring", layout="rows", capacity=64, lanes=4, ordering="per_key"
    ).settings.queue_id
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for i, name in enumerate(_query_names()):
            ring = keyed if name.endswith("_notify") else rows_ring
            text, _ = _server_placeholders(dbq.db.query(name, _sample_identifiers(name, ring)).decode())
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


# -- what install() does to an install of its own ------------------------------------------------------


def functions_applied(dsn: str, schema: str) -> str:
    """The SHA-256 of the functions.sql last applied, as owned_objects records it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        q = sql.SQL("SELECT name FROM {}.owned_objects WHERE kind = 'functions'").format(
            sql.Identifier(schema)
        )
        [(name,)] = conn.execute(q).fetchall()
        return str(name)


def forget_functions_applied(dsn: str, schema: str) -> None:
    """Record another SHA-256 for functions.sql, as if the install had applied an earlier edit of it."""
    run_on_schema(
        dsn, schema, "UPDATE {schema}.owned_objects SET name = repeat('0', 64) WHERE kind = 'functions'"
    )


def table_rows(dsn: str, schema: str) -> dict[str, list[str]]:
    """Every row of every table of ``schema`` but owned_objects, as text, in a stable order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename <> 'owned_objects' "
                "ORDER BY 1",
                [schema],
            )
        ]
        return {
            t: [
                r[0]
                for r in conn.execute(
                    sql.SQL("SELECT to_jsonb(x)::text AS r FROM {}.{} x ORDER BY r").format(
                        sql.Identifier(schema), sql.Identifier(t)
                    )
                )
            ]
            for t in tables
        }


def test_install_records_the_functions_it_applied(pg_dsn: str, new_schema: Callable[[], str]) -> None:
    schema = new_schema()
    assert fresh_install(pg_dsn, schema) == LATEST
    sha = pg_schema.functions_sql()[1]
    assert (
        functions_applied(pg_dsn, schema)
        == sha
        == digest((Path(engine_pkg.__file__).parent / "dialects/postgres/functions.sql").read_text("utf-8"))
    )
    assert recorded_versions(pg_dsn, schema) == [LATEST]


def test_changed_functions_are_applied_while_pushes_and_pops_run(  # noqa: PLR0915
    pg_dsn: str, new_schema: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """install() replaces every function whenever functions.sql changes, in one transaction, while
    producers and consumers of a table queue and a ring run: every message comes out once, with its
    payload, and no call fails. Two editions of the file alternate (the second with a comment in every
    function's body), so each install replaces the functions with a different body. (3 s)"""
    schema = new_schema()
    fresh_install(pg_dsn, schema)
    first = pg_schema.functions_sql()
    # Every function's body ends "\n$$;" but the rows layout's template, whose text ends "$x$ $t$;".
    edited = re.sub(
        r"\n(\$\$|\$x\$ \$t\$)(;|$)", r"\n    -- edited while pushes and pops run\n\1\2", first[0]
    )
    assert edited.count("-- edited") == 67
    editions = [first, (edited, digest(edited), first[2])]
    n_batches, size = 60, 25
    errors: list[BaseException] = []
    sent: dict[str, list[Any]] = {"t": [], "r": []}
    got: dict[str, list[Any]] = {"t": [], "r": []}
    produced = {"t": threading.Event(), "r": threading.Event()}

    def produce(name: str) -> None:
        try:
            with DbQueue(pg_dsn, schema=schema, pool_size=2) as d:
                q = d.queue(name)
                for b in range(n_batches):
                    batch = [{"q": name, "b": b, "i": i} for i in range(size)]
                    if b % 3 == 0:
                        for p in batch:
                            q.push(p)
                    else:
                        q.push_batch(batch)
                    sent[name] += batch
        except BaseException as exc:
            errors.append(exc)
        finally:
            produced[name].set()

    def consume(name: str) -> None:
        try:
            with DbQueue(pg_dsn, schema=schema, pool_size=2) as d:
                q = d.queue(name)
                for n in itertools.count():
                    done = produced[name].is_set()
                    semantics = "at-least-once" if n % 2 else "at-most-once"
                    msgs = q.pop(7, semantics=semantics)
                    if msgs and semantics == "at-least-once":
                        assert q.ack(msgs) == len(msgs)
                    got[name] += [m.payload for m in msgs]
                    if not msgs and done:
                        return
        except BaseException as exc:
            errors.append(exc)

    with DbQueue(pg_dsn, schema=schema) as admin:
        admin.create_queue("t", visibility_timeout=600)
        admin.create_queue("r", design="ring", capacity=64, visibility_timeout=600)
        threads = [threading.Thread(target=f, args=(n,)) for f in (produce, consume) for n in ("t", "r")]
        for th in threads:
            th.start()
        installs = 0
        while not all(e.is_set() for e in produced.values()) or installs < 4:
            edition = editions[(installs + 1) % 2]
            monkeypatch.setattr(pg_schema, "functions_sql", lambda e=edition: e)
            assert admin.install() == LATEST
            assert functions_applied(pg_dsn, schema) == edition[1]
            installs += 1
        for th in threads:
            th.join(120)
        assert not errors, errors
        for name in ("t", "r"):
            assert len(got[name]) == len(sent[name]) == n_batches * size
            assert checksum(got[name]) == checksum(sent[name])
            s = admin.queue(name).stats()
            assert (s.ready, s.in_flight, s.failed) == (0, 0, 0)
    assert installs >= 4
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        bodies = conn.execute(
            # functions.sql's, not those a ring of the rows layout makes of its own from its template
            "SELECT p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s AND p.proname !~ '^ring_g?[0-9]+_'",
            [schema],
        ).fetchall()
    assert len(bodies) == 67
    assert all(("-- edited" in b) == (functions_applied(pg_dsn, schema) == editions[1][1]) for (b,) in bodies)


def test_a_function_the_file_no_longer_defines_is_dropped(pg_dsn: str, new_schema: Callable[[], str]) -> None:
    """A function the engine created that functions.sql no longer defines (a name kept for one release
    after its successor came) is dropped by the next install that applies the file; one that is not the
    engine's stays."""
    schema = new_schema()
    fresh_install(pg_dsn, schema)
    run_on_schema(
        pg_dsn,
        schema,
        "CREATE FUNCTION {schema}.table_push_v0() RETURNS integer LANGUAGE sql AS 'SELECT 1'; "
        "CREATE FUNCTION {schema}.theirs() RETURNS integer LANGUAGE sql AS 'SELECT 2'; "
        "INSERT INTO {schema}.owned_objects VALUES ('function', 'table_push_v0')",
    )
    assert fresh_install(pg_dsn, schema) == LATEST  # the same file: nothing to apply
    assert {"table_push_v0", "theirs"} <= _function_names(pg_dsn, schema)
    forget_functions_applied(pg_dsn, schema)
    assert fresh_install(pg_dsn, schema) == LATEST
    names = _function_names(pg_dsn, schema)
    assert "table_push_v0" not in names and "theirs" in names
    assert names - {"theirs"} == pg_schema.functions_sql()[2]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT kind, name FROM {}.owned_objects WHERE name = 'table_push_v0'").format(
                sql.Identifier(schema)
            )
        ).fetchall()
    assert rows == []


def _function_names(dsn: str, schema: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {
            r[0]
            for r in conn.execute(
                "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = %s",
                [schema],
            )
        }


@pytest.mark.parametrize(
    "versions", [[25], list(range(1, 26))], ids=["last-development", "every-development"]
)
def test_an_install_of_a_development_version_is_refused(
    pg_dsn: str, new_schema: Callable[[], str], versions: list[int]
) -> None:
    """An install made before the first release (its schema_version holds development versions, not
    the release's) is neither upgraded nor uninstalled: SchemaError says how to reinstall."""
    schema = new_schema()
    fresh_install(pg_dsn, schema)
    with DbQueue(pg_dsn, schema=schema) as dbq:
        dbq.create_queue("kept").push({"n": 1})
        run_sql(dbq, "DELETE FROM {schema}.schema_version")
        for v in versions:
            run_sql(dbq, "INSERT INTO {schema}.schema_version (version) VALUES (%(v)s)", {"v": v})
        before = describe_schema(pg_dsn, schema)
        for call in (dbq.install, dbq.uninstall):
            with pytest.raises(SchemaError) as info:
                call()
            message = str(info.value)
            assert schema in message and "version 25" in message, message
            assert "development version" in message and "1.0" in message, message
            assert "uninstall it with the version that made it" in message, message
            assert "DROP SCHEMA" in message, message
        assert recorded_versions(pg_dsn, schema) == versions
        assert schema_differences(before, describe_schema(pg_dsn, schema)) == []
        assert run_sql(dbq, "SELECT count(*) FROM {schema}.meta") == [(1,)]


def test_an_install_of_another_build_without_a_table_is_refused(
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """An install recorded at this code's schema version that lacks a table this build creates (made by
    a development tree before the table was added) is refused by install() with a SchemaError that
    names the table and how to reinstall, and nothing in the schema changes; a call that reads the
    missing table says install() tells which."""
    schema = new_schema()
    fresh_install(pg_dsn, schema)
    with DbQueue(pg_dsn, schema=schema) as dbq:
        dbq.create_queue("kept").push({"n": 1})
        run_sql(dbq, "DROP TABLE {schema}.ring_rows")
        before = describe_schema(pg_dsn, schema)
        with pytest.raises(SchemaError) as info:
            dbq.install()
        message = str(info.value)
        assert schema in message and f"schema version {LATEST}" in message, message
        assert "ring_rows" in message and "another build" in message, message
        assert "DROP SCHEMA" in message and "Nothing was changed" in message, message
        assert schema_differences(before, describe_schema(pg_dsn, schema)) == []
        with pytest.raises(SchemaError, match=r"lacks a table this build uses.*ring_rows"):
            dbq.create_queue("r", design="ring", layout="rows", capacity=64)
        assert [m.payload for m in dbq.queue("kept").pop(5)] == [{"n": 1}]


# -- upgrades ------------------------------------------------------------------------------------------


def install_previous_release(dsn: str, schema: str) -> None:
    """An install as the previous release made it. No release has changed a table since the baseline,
    so this is the baseline itself; the release that adds migrations/<release>.sql makes it the
    previous release's schema.sql and functions.sql (from that release's tag)."""
    assert fresh_install(dsn, schema) == LATEST


def _states(q: Any) -> dict[str, Any]:
    s = q.stats().as_dict()
    return {k: v for k, v in s.items() if "age" not in k and "seconds" not in k}


def test_an_upgrade_keeps_messages_in_every_state(  # noqa: PLR0915
    pg_dsn: str, new_schema: Callable[[], str]
) -> None:
    """The upgrade harness: an install of the previous release holding messages in every state (a table
    queue's ready, delayed, leased, claimed in a batch, failed, finished and archived ones; a ring's
    ready, leased, to deliver again, delayed again and failed ones, and a consumer group behind the
    default one) comes through install() with the functions applied again: every row of every table is
    as it was, every receipt still acks, and each message comes out once with its payload."""
    schema = new_schema()
    install_previous_release(pg_dsn, schema)
    with DbQueue(pg_dsn, schema=schema) as dbq:
        t = dbq.create_queue("t", max_attempts=1, visibility_timeout=600, retry_backoff=0, archive=True)
        old = [{"t": i, "pad": "y" * (3000 if i == 3 else 10)} for i in range(12)]
        ids = t.push_batch(old[:10])
        t.push_batch(old[10:], delay=3600)
        finished = t.pop(2, semantics="at-most-once")
        assert dbq.maintenance().archive(archive_after=0, pause=0).rows == 2
        finished += t.pop(1, semantics="at-most-once")  # finished, in done
        leased = t.pop(2, semantics="at-least-once")
        batch = t.claim_batch(2)
        assert batch is not None
        [poison] = t.pop(1, semantics="at-least-once")
        assert t.nack([poison], error="poison") == 1  # failed: max_attempts 1

        r = dbq.create_queue(
            "r", design="ring", capacity=16, max_attempts=2, visibility_timeout=600, retry_backoff=0
        )
        late = r.add_group("late", start="earliest")  # type: ignore[attr-defined]
        ring_old = [f"r{i}" for i in range(10)]
        r.push_batch(ring_old)
        ring_done = r.pop(2, semantics="at-most-once")
        ring_leased = r.pop(2, semantics="at-least-once")
        [again] = r.pop(1, semantics="at-least-once")
        r.nack([again], delay=0)
        [again] = r.pop(1, semantics="at-least-once")
        r.nack([again], error="poison")  # failed: its second delivery
        [later] = r.pop(1, semantics="at-least-once")
        r.nack([later], delay=3600)  # delivered again in an hour
        ring_taken = [m.payload for m in late.pop(3, semantics="at-most-once")]

        rows = table_rows(pg_dsn, schema)
        states = [_states(q) for q in (t, r, late)]
        assert (states[0]["ready"], states[0]["delayed"], states[0]["in_flight"], states[0]["failed"]) == (
            2,
            2,
            4,
            1,
        )
        forget_functions_applied(pg_dsn, schema)

        assert dbq.install() == LATEST
        assert functions_applied(pg_dsn, schema) == pg_schema.functions_sql()[1]
        assert table_rows(pg_dsn, schema) == rows
        assert [_states(q) for q in (t, r, late)] == states

        assert t.ack(leased) == 2
        assert t.ack_batch(batch.batch_id) == 2
        [f] = t.list_failed()
        assert (f.id, f.payload, f.last_error) == (poison.id, poison.payload, "poison")
        assert t.requeue_failed([f.id]) == 1
        rest = drain(t, "at-least-once", n=3)
        batched = [i for i, _ in batch.receipts]
        assert sorted(m.id for m in rest) == sorted({*ids} - {m.id for m in finished + leased} - {*batched})
        delivered = [m.payload for m in finished + leased + rest]
        assert checksum(delivered) == checksum(
            [p for i, p in zip(ids, old, strict=False) if i not in batched]
        )
        assert _states(t)["delayed"] == 2

        assert r.ack(ring_leased) == 2
        [rf] = r.list_failed()
        assert (rf.id, rf.payload, rf.last_error) == (again.id, again.payload, "poison")
        ring_rest = [m.payload for m in drain(r)]
        taken = [m.payload for m in ring_done + ring_leased] + [again.payload, later.payload]
        assert sorted(taken + ring_rest) == sorted(ring_old)
        assert ring_taken + [m.payload for m in drain(late)] == ring_old
