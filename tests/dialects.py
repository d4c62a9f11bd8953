"""The ``dbq`` fixture of the suites that run on PostgreSQL and, given a DSN, on SQL Server.

A suite takes it by importing ``dialect_dbq`` (it registers under the name ``dbq``, overriding the
PostgreSQL-only one of ``tests/conftest.py`` in that module only).

:func:`run_sql` and :func:`insert_rows` run a test's own SQL (a results table, a look at the queue's
tables) on either dialect, through the engine's connections and error translation. The suites' own
writes built on them live here too, once: :func:`expire_leases` (a clock jump past leases) and
:class:`ResultsTable` (the exactly-once tests' table of what consumers wrote).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase
from airflow_dbqueue.engine.dialects.mssql.params import to_positional
from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase
from tests.conftest import installed_dbq

if TYPE_CHECKING:
    from airflow_dbqueue.engine import Queue

DIALECTS = ["postgresql", "mssql"]


@pytest.fixture(params=DIALECTS, name="dbq")
def dialect_dbq(request: pytest.FixtureRequest, schema_name: str) -> Iterator[DbQueue]:
    """A DbQueue on a fresh, installed schema of each dialect; dropped after the test."""
    dsn = request.getfixturevalue("pg_dsn" if request.param == "postgresql" else "mssql_dsn")
    with installed_dbq(dsn, schema_name, dialect=request.param) as q:
        yield q


TOPOLOGIES = ["postgresql", "pgbouncer-transaction", "pgbouncer-session", "mssql"]
"""The dialects, and PostgreSQL behind a real PgBouncer in each pool mode (``tests/pgbouncer.py``): in
transaction mode with ``pooler="transaction"`` and the server itself as ``listen_dsn``, as
docs/deploy.md tells a deployment behind a transaction pooler to configure it."""

OWN_SCHEMA = "own_schema"
"""The mark of a test of a suite on :func:`topology_dbq` that gets a schema of its own, freshly
installed and dropped after it: one that looks at the whole schema (every queue's rows, the list of
queues), which must then hold only what the test made."""


class Topology:
    """One of :data:`TOPOLOGIES`, where :func:`topology_dbq` opens its tests' ``DbQueue``: on a schema
    installed once and shared by the tests of a module (:meth:`shared`), or on a fresh one
    (:meth:`own`)."""

    def __init__(
        self, dsn: str, dialect: str | None, pooler: str | None = None, listen_dsn: str | None = None
    ) -> None:
        self.dsn, self.dialect, self.pooler, self.listen_dsn = dsn, dialect, pooler, listen_dsn
        self.schema: str | None = None
        """The shared schema, once installed."""

    def open(self, schema: str) -> DbQueue:
        return DbQueue(
            self.dsn,
            schema=schema,
            pool_size=8,
            dialect=self.dialect,
            pooler=self.pooler,
            listen_dsn=self.listen_dsn,
        )

    def own(self, schema: str) -> contextlib.AbstractContextManager[DbQueue]:
        return installed_dbq(
            self.dsn, schema, dialect=self.dialect, pooler=self.pooler, listen_dsn=self.listen_dsn
        )

    @contextlib.contextmanager
    def shared(self) -> Iterator[DbQueue]:
        """A ``DbQueue`` of its own on the shared schema (installed at the first call), which holds no
        queue when it is handed out: afterwards every queue in it is dropped (with all its rows and
        objects) and every :class:`ResultsTable`. When that fails, the schema is dropped whole (the
        next call installs another) and the error raised."""
        if self.schema is None:
            schema = f"t_{uuid.uuid4().hex[:12]}"
            with self.open(schema) as q:
                q.install()
            self.schema = schema
        q = self.open(self.schema)
        try:
            yield q
        finally:
            try:
                empty(q)
            except BaseException:
                self.drop()
                raise
            finally:
                q.close()

    def drop(self) -> None:
        """Drop the shared schema, if one was installed."""
        schema, self.schema = self.schema, None
        if schema is not None:
            with self.open(schema) as q:
                empty(q)  # its ResultsTables, which uninstall leaves
                q.uninstall()


def empty(dbq: DbQueue) -> None:
    """Drop every queue of ``dbq``'s schema and every :class:`ResultsTable` in it."""
    for settings in dbq.list_queues():
        dbq.drop_queue(settings.name, missing_ok=True)
    for name in sorted(ResultsTable.names):
        run_sql(dbq, "DROP TABLE IF EXISTS {schema}.{table}", identifiers={"table": name})


def topology_of(request: pytest.FixtureRequest, name: str) -> Topology:
    """The :class:`Topology` named ``name`` (one of :data:`TOPOLOGIES`), its servers started."""
    if name.startswith("pgbouncer-"):
        mode = name.removeprefix("pgbouncer-")
        server = request.getfixturevalue("pg_dsn")
        dsn = request.getfixturevalue("pgbouncer").dsn(mode)
        return Topology(dsn, None, pooler=mode, listen_dsn=server if mode == "transaction" else None)
    return Topology(request.getfixturevalue("pg_dsn" if name == "postgresql" else "mssql_dsn"), name)


@pytest.fixture(scope="module")
def topologies() -> Iterator[dict[str, Topology]]:
    """The :class:`Topology` of each of :data:`TOPOLOGIES` a module's tests took (:func:`topology_dbq`),
    by name; their shared schemas are dropped at the module's end, while the servers still run."""
    places: dict[str, Topology] = {}
    try:
        yield places
    finally:
        with contextlib.ExitStack() as stack:  # every one, whichever fails
            for place in places.values():
                stack.callback(place.drop)


@pytest.fixture(params=TOPOLOGIES, name="dbq")
def topology_dbq(
    request: pytest.FixtureRequest, topologies: dict[str, Topology], schema_name: str
) -> Iterator[DbQueue]:
    """A DbQueue on an installed schema of each of :data:`TOPOLOGIES` that holds no queue: the module's
    shared one of that topology (the test's queues are dropped after it), or with the mark
    :data:`OWN_SCHEMA` a fresh one of the test's own, dropped after it. A suite that takes it imports
    :func:`topologies` too."""
    place = topologies.get(request.param)
    if place is None:
        place = topologies[request.param] = topology_of(request, request.param)
    if request.node.get_closest_marker(OWN_SCHEMA) is not None:
        with place.own(schema_name) as q:
            yield q
        return
    with place.shared() as q:
        yield q


def behind_transaction_pooler(dbq: DbQueue) -> bool:
    """Whether ``dbq`` reaches its server through a pooler in transaction mode."""
    return bool(getattr(dbq.db, "transaction_pooled", False))


def postgres_only(dbq: DbQueue, why: str) -> None:
    if dbq.dialect != "postgresql":
        pytest.skip(f"PostgreSQL only on {dbq.dialect}: {why}")


def mssql_only(dbq: DbQueue, why: str) -> None:
    if dbq.dialect != "mssql":
        pytest.skip(f"SQL Server only on {dbq.dialect}: {why}")


def run_sql(
    dbq: DbQueue,
    body: str,
    params: Mapping[str, Any] | None = None,
    conn: Any | None = None,
    *,
    identifiers: Mapping[str, str] | None = None,
) -> list[tuple[Any, ...]]:
    """Run one statement written for both dialects; return its rows (``[]`` when it returns none).

    ``body`` is written as the engine's ``queries/`` are: ``{schema}`` and the ``identifiers``'
    placeholders (``{table}``) are quoted by the dialect (``"x"`` or ``[x]``), parameters are
    ``%(name)s``. With ``conn`` (from ``dbq.transaction()``) the statement joins that transaction;
    without, it runs in a transaction of its own on a pooled connection. Driver errors become the
    engine's (``DatabaseError``, ``DatabaseUnavailableError``...).
    """
    db = dbq.db
    if conn is None:
        with db.transaction() as own:
            return run_sql(dbq, body, params, own, identifiers=identifiers)
    with db.translate_errors():
        if isinstance(db, MssqlDatabase):
            text, values = to_positional(db.compose(body, identifiers), params)
            cur = conn.cursor()
            try:
                if values:
                    cur.execute(text, values)
                else:
                    cur.execute(text)
                return [tuple(r) for r in cur.fetchall()] if cur.description else []
            finally:
                cur.close()
        if not isinstance(db, PostgresDatabase):
            raise TypeError(f"no SQL runner for the {dbq.dialect} dialect")
        pg = conn.execute(db.compose(body, identifiers), params)
        return list(pg.fetchall()) if pg.description else []


def insert_rows(
    dbq: DbQueue, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], conn: Any | None = None
) -> None:
    """Insert ``rows`` into ``{schema}.table`` with one multi-row ``INSERT ... VALUES`` (both dialects).

    SQL Server takes at most 1000 rows and 2100 parameters in one statement: keep batches below that.
    """
    if not rows:
        return
    if any(len(r) != len(columns) for r in rows):
        raise ValueError(f"every row must have {len(columns)} values ({', '.join(columns)})")
    names = {f"c{i}": c for i, c in enumerate(columns)}
    cols = ", ".join(f"{{c{i}}}" for i in range(len(columns)))
    values = ", ".join(
        "(" + ", ".join(f"%(r{j}_{i})s" for i in range(len(columns))) + ")" for j in range(len(rows))
    )
    params = {f"r{j}_{i}": v for j, row in enumerate(rows) for i, v in enumerate(row)}
    run_sql(
        dbq,
        f"INSERT INTO {{schema}}.{{table}} ({cols}) VALUES {values}",
        params,
        conn,
        identifiers={"table": table, **names},
    )


EXPIRE_SQL = {
    ("postgresql", "table"): "UPDATE {schema}.meta SET lease_until = now() - interval '1 second' "
    "WHERE id = ANY(%(ids)s)",
    ("postgresql", "ring"): "UPDATE {schema}.ring_retry SET due_at = now() - interval '1 second' "
    "WHERE queue_id = %(group)s AND state = 2 AND id = ANY(%(ids)s)",
    ("mssql", "table"): "UPDATE {schema}.meta SET lease_until = DATEADD(second, -1, SYSUTCDATETIME()) "
    "WHERE id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s))",
    ("mssql", "ring"): "UPDATE {schema}.ring_retry SET due_at = DATEADD(second, -1, SYSUTCDATETIME()) "
    "WHERE queue_id = %(group)s AND state = 2 "
    "AND id IN (SELECT CAST([value] AS bigint) FROM OPENJSON(%(ids)s))",
}
"""The clock jump of :func:`expire_leases`, by dialect and design (a list goes to SQL Server as a JSON
array; lease_until and due_at are timestamptz, or datetime2 in UTC)."""

SPLIT_SQL = {
    "postgresql": "SELECT {schema}.ring_split_leases(%(queue_id)s, %(capacity)s, %(lanes)s, ARRAY("
    "SELECT e.lo FROM {schema}.ring_leases e WHERE e.queue_id = %(group)s AND EXISTS ("
    "SELECT 1 FROM unnest(%(ids)s::bigint[]) AS i(id) "
    "WHERE i.id BETWEEN e.lo AND e.hi AND e.starts[mod(i.id, %(lanes)s)::integer + 1] <= i.id)), NULL, "
    "%(group)s::integer)",
    "mssql": "SET NOCOUNT ON; DECLARE @los nvarchar(max) = ("
    "SELECT N'[' + STRING_AGG(CAST(e.lo AS nvarchar(max)), N',') + N']' "
    "FROM {schema}.ring_leases e WHERE e.queue_id = %(group)s AND EXISTS ("
    "SELECT 1 FROM OPENJSON(%(ids)s) i CROSS APPLY OPENJSON(e.starts) j "
    "WHERE CAST(i.[value] AS bigint) BETWEEN e.lo AND e.hi "
    "AND j.[key] = CAST(CAST(i.[value] AS bigint) % %(lanes)s AS nvarchar(11)) "
    "AND CAST(j.[value] AS bigint) <= CAST(i.[value] AS bigint))); "
    "EXEC {schema}.ring_split_leases @queue_id = %(queue_id)s, @cap = %(capacity)s, @lanes = %(lanes)s, "
    "@los = @los, @error = NULL, @gid = %(group)s",
}
"""A ring leases a pop's messages as one row: the rows holding any of the ids are first split into one
leased retry row a message (as a partial ack would), so that only those ids expire: those of the ring
handle's consumer group."""


def expire_leases(dbq: DbQueue, ids: Iterable[int], q: Queue | None = None) -> None:
    """Move the clock past the leases of ``ids`` (tests only): rewrite their lease_until, or for a ring
    ``q`` the due time of their leased retry rows. Without ``q``, the ids are table-design messages."""
    design = "ring" if q is not None and q.settings.design == "ring" else "table"
    params: dict[str, Any] = {"ids": list(ids)}
    if q is not None and q.settings.layout == "rows":
        gid = getattr(q, "_gid", q.settings.queue_id)  # a consumer group's handle: its own objects
        _expire_rows_leases(dbq, f"ring_g{-gid}_r" if gid < 0 else f"ring_{gid}_r", params)
        return
    if design == "ring":
        assert q is not None
        params.update(queue_id=q.settings.queue_id, capacity=q.settings.capacity, lanes=q.settings.lanes)
        params["group"] = getattr(q, "_gid", q.settings.queue_id)
        run_sql(dbq, SPLIT_SQL[dbq.dialect], params)
    run_sql(dbq, EXPIRE_SQL[dbq.dialect, design], params)


def _expire_rows_leases(dbq: DbQueue, prefix: str, params: dict[str, Any]) -> None:
    """:func:`expire_leases` on a ring of the rows layout (or a group of one, whose own objects' names
    start with ``prefix``): its leases holding any of the ids are split (its own function
    ``<prefix>split``, as a partial ack would), and the newest row of each id in its retry log, leased
    now, is given an end in the past (an UPDATE, which the engine itself never makes)."""
    own = {"split": f"{prefix}split", "leases": f"{prefix}l"}
    run_sql(
        dbq,
        "SELECT {schema}.{split}(ARRAY(SELECT DISTINCT e.lo FROM {schema}.{leases} e "
        "CROSS JOIN unnest(%(ids)s::bigint[]) i(id) WHERE i.id BETWEEN e.lo AND e.hi "
        "AND e.starts[(i.id >> 16) %% cardinality(e.starts) + 1] <= i.id "
        "AND i.id < e.ends[(i.id >> 16) %% cardinality(e.starts) + 1]))",
        params,
        identifiers=own,
    )
    for k in range(4):
        run_sql(
            dbq,
            "UPDATE {schema}.{log} r SET due_at = now() - interval '1 second' "
            "WHERE r.id = ANY(%(ids)s) AND r.state = 2 "
            "AND r.ver = (SELECT max(x.ver) FROM {schema}.{log} x WHERE x.id = r.id)",
            params,
            identifiers={"log": f"{prefix}r{k}"},
        )


class ResultsTable:
    """A table of the exactly-once tests' own in the queue schema (dropped with it): consumers write
    what they popped into it in the pop's own transaction, and the test reads back what committed.

    :param columns: ``(name, SQL type)`` of each column, every one NOT NULL; the same types on both
        dialects (``integer``, ``bigint``).
    :param key: the columns of its primary key, if any (a duplicate write then breaks the key).
    """

    names: ClassVar[set[str]] = set()
    """The name of every results table: :func:`empty` drops them from a shared schema."""

    def __init__(self, columns: Sequence[tuple[str, str]], key: Sequence[str] = (), name: str = "eo_results"):
        ResultsTable.names.add(name)
        self.columns = [c for c, _ in columns]
        self.types = [t for _, t in columns]
        self.key = list(key)
        self.name = name
        self._idents = {"table": name, **{f"c{i}": c for i, c in enumerate(self.columns)}}

    def create(self, dbq: DbQueue) -> None:
        cols = ", ".join(f"{{c{i}}} {t} NOT NULL" for i, t in enumerate(self.types))
        if self.key:
            cols += ", PRIMARY KEY (" + ", ".join(f"{{c{self.columns.index(k)}}}" for k in self.key) + ")"
        run_sql(dbq, f"CREATE TABLE {{schema}}.{{table}} ({cols})", identifiers=self._idents)

    def write(self, dbq: DbQueue, conn: Any, rows: Sequence[Sequence[Any]]) -> None:
        """Insert ``rows`` on ``conn``: in the caller's (the pop's) transaction; no rows send nothing."""
        insert_rows(dbq, self.name, self.columns, rows, conn)

    def read(self, dbq: DbQueue) -> list[tuple[Any, ...]]:
        """Every committed row, sorted by its columns in order."""
        names = ", ".join(f"{{c{i}}}" for i in range(len(self.columns)))
        return run_sql(
            dbq, f"SELECT {names} FROM {{schema}}.{{table}} ORDER BY {names}", identifiers=self._idents
        )
