"""SQL Server through pyodbc: connections, named queries, retries.

Every statement the engine runs on SQL Server is a named block in ``queries/`` or ``schema.sql``
beside this file, under the names of the PostgreSQL dialect. This module composes them (schema name
bracket-quoted after validation), binds their parameters and runs each as one transaction. The other
parts of :class:`MssqlDatabase` are beside it: parameters, literals and rows (``params.py``), connection
strings (``conninfo.py``), the translation of driver errors (``errors.py``), the schema and its steps
(``schema.py``) and maintenance (``maintenance.py``).

- Parameters: the blocks are written with ``%(name)s`` like PostgreSQL's; ``params.to_positional``
  turns them into pyodbc's ``?`` with the values in order.
- Lists: T-SQL has no arrays. A list parameter (receipt ids, deliveries, payloads) goes as one JSON
  array read with ``OPENJSON`` (SQL Server 2016+), bytes as hex strings (``CONVERT(varbinary, x, 2)``).
  Arrays the ring keeps in its tables (a lease's per-lane starts) and passes between its procedures
  (leases to split, push lanes still held) are JSON arrays too.
  Table-valued parameters would need a user-defined table type in the schema per shape, which pyodbc
  binds by type name and which must be dropped before the schema can be: JSON needs no catalog object.
- Errors: :meth:`MssqlDatabase.translate_errors` maps pyodbc's exceptions by SQLSTATE and native error
  number into the engine's family. A deadlock victim (1205) or a lock timeout (1222) of a statement
  whose transaction the dialect owns is retried (XACT_ABORT ON rolled all of it back); in the caller's
  transaction it is raised, since only the caller can redo its part.
- No LISTEN/NOTIFY: waiting pops poll (see ``Queue.pop``).
- The ring design's push, pop and gap recovery are stored procedures (``schema.sql``), which raise
  error 50000 with ``[DQ00n]`` at the start of the message where PostgreSQL's functions raise SQLSTATE
  ``DQ00n``; ``errors.translate`` maps both the same way.
- Maintenance (``engine/maintenance/``, through ``maintenance.py`` beside this file) runs on a
  connection of its own in autocommit mode (:meth:`MssqlDatabase.dedicated_connection`), like
  PostgreSQL's: the statements of :data:`OUTSIDE_TRANSACTION` run there as they are, everything else
  in a transaction of its own. Timeouts are the session's ``SET LOCK_TIMEOUT`` and the driver's query
  timeout (:meth:`MssqlDatabase.set_timeouts`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from airflow_dbqueue.engine.dialects.base import CONNECT_TIMEOUT_S, DEFAULT_SCHEMA
from airflow_dbqueue.engine.dialects.mssql.conninfo import odbc_connection_string, parse_dsn
from airflow_dbqueue.engine.dialects.mssql.errors import translate
from airflow_dbqueue.engine.dialects.mssql.maintenance import MssqlMaintenance
from airflow_dbqueue.engine.dialects.mssql.params import (
    adapt_row,
    inline_int_params,
    lock_timeout_ms,
    query_timeout_s,
    quote_identifier,
    render_named,
    to_positional,
)
from airflow_dbqueue.engine.dialects.mssql.schema import MssqlSchema
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    DbQueueError,
    NotSupportedError,
    TransientDatabaseError,
)
from airflow_dbqueue.engine.names import MSSQL_RESERVED_SCHEMAS, validate_identifier, validate_schema_name
from airflow_dbqueue.engine.sqlfile import load_queries

log = logging.getLogger(__name__)

_PKG = __package__ or "airflow_dbqueue.engine.dialects.mssql"

NOT_YET_PORTED: dict[str, str] = {}
"""Named queries of the PostgreSQL dialect that this dialect does not have yet, with what they need: none.

The parity test checks that the PostgreSQL names are exactly this dialect's names plus these and
:data:`POSTGRES_ONLY`, so a new PostgreSQL query fails the test until it is ported or listed here. The
table design (with its deduplication keys, expiry and ordering per key), maintenance and the ring design
with its consumer groups are all ported.
"""

POSTGRES_ONLY: dict[str, str] = {
    **{
        name: "the ring's rows layout (create_queue(layout='rows')) is PostgreSQL's: its segment tables are "
        "emptied with TRUNCATE once every reader passed them, which SQL Server's row versions (kept in "
        "tempdb, not the table) do not need; create_queue refuses the layout here"
        for name in (
            "ring_rows_create",
            "ring_rows_drop_all",
            "ring_rows_push",
            "ring_rows_push_ttl",
            "ring_rows_push_keys",
            "ring_rows_push_ordered",
            "ring_rows_forget_keys",
            "ring_rows_take",
            "ring_rows_pop_payloads",
            "ring_rows_take_one",
            "ring_rows_pop_payload_one",
            "ring_rows_has_function",
            "ring_rows_ack",
            "ring_rows_ack_notify",
            "ring_rows_settle",
            "ring_rows_settle_notify",
            "ring_rows_held",
            "ring_rows_reclaim",
            "ring_rows_look",
            "ring_rows_ready_head",
            "ring_rows_groups",
            "ring_rows_pushing",
            "ring_rows_ask",
            "ring_rows_next_due",
            "ring_rows_group_ids",
            "ring_rows_rotate",
            "ring_rows_label",
            "ring_rows_rotate_ahead",
            "ring_rows_gaps",
            "ring_rows_xmin",
            "ring_rows_depth",
            "ring_rows_claim_batch",
            "ring_rows_get_batch",
            "ring_rows_set_batch",
            "ring_rows_open_batches",
            "ring_rows_purge_batches",
            "ring_rows_batch_rows",
            "ring_rows_extend",
            "ring_rows_leased",
            "ring_rows_objects_of",
            "role_actions_on",
        )
    },
    **{
        name: "Maintenance.compact_rings rewrites ring tables grown by row versions a held xmin horizon "
        "kept; SQL Server keeps old row versions in tempdb's version store, not in the table, and skips "
        "the step"
        for name in (
            "vacuum_full_table",
            "compact_relation_size",
            "compact_ring_layouts",
            "compact_ring_tables",
        )
    },
    **{
        name: "Maintenance.recycle empties the PostgreSQL table design's generation partitions (a held xmin "
        "horizon keeps dead row versions in them); SQL Server keeps old row versions in tempdb's version "
        "store and its tables are not partitioned: the step is skipped"
        for name in ("table_move_stragglers", "table_partitions", "table_empty_partition")
    },
    **{
        name: "the table design's floor (functions.sql's table_floor) lets PostgreSQL 18's skip scan start "
        "a claim past the ready index's entries of messages popped since the last VACUUM; it is raised by "
        "the partition recycling, whose steps SQL Server skips (see above), and its claims are not bounded "
        "by one"
        for name in ("table_raise_floors", "table_make_floor")
    },
    **{
        name: "maintenance's passes over every table-design queue of a schema at once (schema_passes = "
        "False): on SQL Server it counts and samples a queue at a time, as docs/limits.md says"
        for name in ("stats_all", "upkeep_due", "table_flow_all", "sample_insert_all", "queue_rates_all")
    },
    **{
        name: "a pop of payloads only selects one column of a take's rows, which a procedure's rows cannot "
        "be (payload_pops = False): on SQL Server it runs the take itself and keeps the payloads"
        for name in ("pop_take_payloads", "pop_take_payloads_with", "ring_take_payloads")
    },
    **{
        name: "a waiting pop's look for pushes in progress (a push that may not NOTIFY) is the LISTEN/NOTIFY "
        "wait's; SQL Server has no NOTIFY, and its waiting pops poll"
        for name in ("pushing", "ring_pushing")
    },
    **{
        name: "the listening connection's lock that tells a notify='auto' push that somebody waits is the "
        "LISTEN/NOTIFY wait's; SQL Server has no NOTIFY, and its waiting pops poll"
        for name in ("waiters_hold", "waiters_release")
    },
    **{
        name: "per-queue grants are PostgreSQL's (row-level security and the privileges each grant gives a "
        "role on the tables and sequences); this dialect's grant and revoke raise NotSupportedError, and "
        "every role may take every action its database privileges allow"
        for name in (
            "role_exists",
            "grants_add",
            "grants_remove",
            "grants_list",
            "grants_of_role",
            "grants_roles_of_queue",
            "actions_on",
            "ring_sequences_of",
            "owned_tables",
            "server_version_num",
            "list_ring_ids",
        )
    },
    "sees_all_activity": "maintenance's horizon check asks whether its role sees every session; on SQL "
    "Server VIEW SERVER STATE decides, and the horizon queries say so when it is refused",
}
"""Named queries of the PostgreSQL dialect that have no use on SQL Server, with why."""

OUTSIDE_TRANSACTION = frozenset(
    {
        "maintenance_try_lock",
        "maintenance_unlock",
        "set_timeouts",
        "reset_timeouts",
        "vacuum_table",
        "analyze_table",
        "reindex_concurrently",
        "drop_index_concurrently",
    }
)
"""Statements that run as they are on an autocommit connection (maintenance's own), as PostgreSQL runs
VACUUM and REINDEX CONCURRENTLY outside a transaction block: an online rebuild inside a transaction would
hold its final schema lock until the commit, and the session's lock and settings need none. Any other
named query on an autocommit connection runs in a transaction of its own (a T-SQL batch of several
statements must commit or roll back whole)."""

# -- the database ----------------------------------------------------------------------------------


def _answers(conn: Any) -> bool:
    """Whether a pooled connection still answers a round trip (``SELECT 1``); pyodbc offers no cheaper
    way to tell a connection whose server went away."""
    try:
        cur = conn.cursor()
        try:
            cur.execute("SELECT 1")
            cur.fetchall()
        finally:
            cur.close()
        conn.rollback()
    except Exception:  # any failure means the connection cannot be used
        return False
    return True


def _execute(cur: Any, text: str, values: Sequence[Any]) -> None:
    """Run ``text`` on a pyodbc cursor; without values, as a plain batch (no parameters at all), so that
    a SET in it holds for the session rather than for a parameterized batch only."""
    if values:
        cur.execute(text, values)
    else:
        cur.execute(text)


class MssqlDatabase(MssqlSchema, MssqlMaintenance):
    """A dbqueue schema on one SQL Server database, through pyodbc.

    Constructing it does no I/O: connections are opened on first use and kept in a small pool.

    :param dsn: ``mssql://user:password@host:port/database?Encrypt=no`` or an ODBC connection string.
    :param schema: the schema that holds the queue tables (validated identifier).
    :param max_size: connections the pool may open.
    :param connect_timeout: seconds to wait for a connection before raising
        :class:`DatabaseUnavailableError`.
    :param retries: how often a deadlock victim or a lock timeout is run again (own transactions only).
    """

    dialect_name = "mssql"
    supports_notify = False
    ring_push_takes_floor = False  # its ring_push reads the floor under its own locks
    payload_pops = False  # a pop of payloads takes them from its procedures' whole rows
    push_options = True  # deduplication keys, expiry and ordering per key (push_with and the *_with claims)
    ring_layouts: tuple[str, ...] = ("slots",)  # the rows layout is PostgreSQL's (POSTGRES_ONLY)
    schema_passes = False  # maintenance counts a queue at a time (docs/limits.md)
    prepares_statements = True

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        max_size: int = 10,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        retries: int = 3,
    ) -> None:
        self.dsn = dsn
        self.schema = validate_schema_name(schema, MSSQL_RESERVED_SCHEMAS)
        self._attrs, self.where = parse_dsn(dsn)
        self._max_size = max(1, max_size)
        self._connect_timeout = connect_timeout
        self.retries = retries
        self._idle: list[tuple[Any, float]] = []
        """Idle pooled connections, with the monotonic time each was handed back."""
        self._slots = threading.BoundedSemaphore(self._max_size)
        self._lock = threading.Lock()

    # -- connections -------------------------------------------------------------------------------

    def connect(self, *, application_name: str | None = None, autocommit: bool = False) -> Any:
        """Open a new connection (XACT_ABORT on; autocommit off unless asked); raise the engine's errors.

        :param application_name: the connection's ``APP`` (``program_name`` in ``sys.dm_exec_sessions``).
        """
        try:
            import pyodbc
        except ImportError:
            raise ConfigurationError(
                "the SQL Server dialect needs pyodbc: pip install 'airflow-dbqueue[mssql]'"
            ) from None
        attrs = dict(self._attrs, APP=application_name) if application_name else self._attrs
        text = odbc_connection_string(attrs, self._connect_timeout)
        try:
            conn = pyodbc.connect(text, autocommit=autocommit, timeout=max(1, int(self._connect_timeout)))
        except pyodbc.Error as exc:
            raise translate(exc, where=self.where, schema=self.schema, connecting=True) from exc
        conn.timeout = 0
        cur = conn.cursor()
        cur.execute("SET XACT_ABORT ON; SET TRANSACTION ISOLATION LEVEL READ COMMITTED;")
        cur.close()
        conn.commit()
        return conn

    #: Seconds a pooled connection may sit idle before it is checked with a round trip when taken:
    #: a server restart takes longer than this, so a connection that was idle across one is checked,
    #: while connections in steady use are never.
    stale_after_s = 1.0

    def _acquire(self) -> Any:
        if not self._slots.acquire(timeout=self._connect_timeout):
            raise DatabaseUnavailableError(
                f"no connection to SQL Server at {self.where} within {self._connect_timeout:g}s: "
                f"all {self._max_size} are in use"
            )
        try:
            while True:
                with self._lock:
                    conn, since = self._idle.pop() if self._idle else (None, 0.0)
                if conn is None:
                    return self.connect()
                if time.monotonic() - since < self.stale_after_s or _answers(conn):
                    return conn
                # Dead after an idle spell (the server restarted?): so are the others that idled as
                # long, which would each fail a call; close them all, and open a new one.
                log.info("a pooled connection to SQL Server at %s is stale: closing idle ones", self.where)
                with contextlib.suppress(Exception):
                    conn.close()
                self.close()
        except BaseException:
            self._slots.release()
            raise

    def _release(self, conn: Any, *, broken: bool) -> None:
        try:
            if broken:
                with contextlib.suppress(Exception):
                    conn.close()
            else:
                with self._lock:
                    self._idle.append((conn, time.monotonic()))
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close the idle connections (the pool reopens on next use)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            with contextlib.suppress(Exception):
                conn.close()

    @contextlib.contextmanager
    def dedicated_connection(self, application_name: str) -> Iterator[Any]:
        """Yield a connection of its own (not pooled, autocommit), closed on exit.

        Maintenance holds a session-owned application lock on it for a whole run and changes session
        settings (lock and query timeouts): closing it releases both whatever happened, and no pooled
        connection is handed back with a lock or a setting.
        """
        conn = self.connect(application_name=application_name, autocommit=True)
        try:
            yield conn
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def set_timeouts(self, conn: Any, *, statement_s: float | None, lock_s: float | None) -> None:
        """Set the session's lock timeout and the driver's query timeout of ``conn`` (maintenance's own).

        SQL Server has no statement timeout of its own: the driver cancels a statement that runs past
        its query timeout (whole seconds, rounded up), and the statement's transaction rolls back
        (XACT_ABORT is on). ``None`` means no limit.
        """
        lock_ms = lock_timeout_ms(lock_s)
        conn.timeout = query_timeout_s(statement_s)
        self.execute("set_timeouts", {"lock_ms": lock_ms}, conn)

    def reset_timeouts(self, conn: Any) -> None:
        """Undo :meth:`set_timeouts`: wait for locks without limit, and no query timeout."""
        conn.timeout = 0
        self.execute("reset_timeouts", None, conn)

    @staticmethod
    def in_transaction(conn: Any) -> bool:
        """pyodbc connections without autocommit are always in a transaction."""
        return not conn.autocommit

    @contextlib.contextmanager
    def guarded(self, conn: Any | None) -> Iterator[Any | None]:
        """Yield ``conn`` as it is: no statement of this dialect fails on purpose inside a caller's
        transaction, so none needs a savepoint here (and None keeps the retries of pooled calls)."""
        yield conn

    @contextlib.contextmanager
    def transaction(self, conn: Any | None = None) -> Iterator[Any]:
        """Yield a connection in a transaction: ``conn`` joined as it is, or a pooled one that commits
        on success and rolls back on error.

        An autocommit ``conn`` (maintenance's own) gets a transaction of its own for the block, which
        commits on success and rolls back on error, as PostgreSQL's ``conn.transaction()`` does.
        """
        if conn is not None and conn.autocommit:
            conn.autocommit = False
            try:
                with self.translate_errors():
                    try:
                        yield conn
                        conn.commit()
                    except BaseException:
                        with contextlib.suppress(Exception):
                            conn.rollback()
                        raise
            finally:
                with contextlib.suppress(Exception):
                    conn.autocommit = True
            return
        if conn is not None:
            with self.translate_errors():
                yield conn
            return
        pooled = self._acquire()
        broken = False
        try:
            with self.translate_errors():
                try:
                    yield pooled
                    pooled.commit()
                except BaseException:
                    with contextlib.suppress(Exception):
                        pooled.rollback()
                    raise
        except DatabaseUnavailableError:
            broken = True
            raise
        finally:
            self._release(pooled, broken=broken)

    @contextlib.contextmanager
    def translate_errors(self) -> Iterator[None]:
        """Translate pyodbc exceptions into the engine's exception family."""
        try:
            yield
        except DbQueueError:
            raise
        except Exception as exc:
            if type(exc).__module__ != "pyodbc":
                raise
            raise translate(exc, where=self.where, schema=self.schema) from exc

    # -- named queries -----------------------------------------------------------------------------

    def query(self, name: str, identifiers: Mapping[str, str] | None = None) -> str:
        """Return the named query with ``{schema}`` (and ``identifiers``) bracket-quoted."""
        return self.compose(load_queries(_PKG, "queries")[name], identifiers)

    def compose(self, body: str, identifiers: Mapping[str, str] | None = None) -> str:
        """Replace ``{schema}`` and the given ``identifiers`` in ``body`` by quoted identifiers."""
        idents = {k: quote_identifier(validate_identifier(v)) for k, v in (identifiers or {}).items()}
        return body.format(schema=quote_identifier(self.schema), **idents)

    def statement(
        self, name: str, params: Mapping[str, Any] | None = None, identifiers: Mapping[str, str] | None = None
    ) -> tuple[str, list[Any]]:
        """Return the text and the positional values that running the named query sends to the server."""
        return to_positional(inline_int_params(name, self.query(name, identifiers), params), params)

    def _run(
        self,
        name: str,
        params: Mapping[str, Any] | None,
        conn: Any | None,
        identifiers: Mapping[str, str] | None,
        want: str,
    ) -> Any:
        text, values = self.statement(name, params, identifiers)
        if conn is not None and conn.autocommit and name in OUTSIDE_TRANSACTION:
            with self.translate_errors():
                cur = conn.cursor()
                try:
                    _execute(cur, text, values)
                    return self._result(name, cur, want)
                finally:
                    cur.close()
        attempt = 0
        while True:
            try:
                with self.transaction(conn) as c:
                    cur = c.cursor()
                    try:
                        _execute(cur, text, values)
                        return self._result(name, cur, want)
                    finally:
                        cur.close()
            except TransientDatabaseError as exc:
                attempt += 1
                if conn is not None or attempt > self.retries:
                    raise
                pause = min(1.0, 0.05 * 2**attempt) * (0.5 + random.random())
                log.info("retrying %s on SQL Server (%s) in %.2fs", name, type(exc).__name__, pause)
                time.sleep(pause)

    @staticmethod
    def _result(name: str, cur: Any, want: str) -> Any:
        if want == "rowcount":
            return int(cur.rowcount)
        # Skip what statements before the last SELECT left (row counts), to the first result set.
        while cur.description is None:
            if not cur.nextset():
                return [] if want == "all" else None
        if want == "one":
            row = cur.fetchone()
            return None if row is None else adapt_row(name, row)
        return [adapt_row(name, r) for r in cur.fetchall()]

    def fetchall(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: Any | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> list[tuple[Any, ...]]:
        """Run a named query and return all its rows."""
        rows: list[tuple[Any, ...]] = self._run(name, params, conn, identifiers, "all")
        return rows

    def fetchone(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: Any | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> tuple[Any, ...] | None:
        """Run a named query and return its first row (or None)."""
        row: tuple[Any, ...] | None = self._run(name, params, conn, identifiers, "one")
        return row

    def execute(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: Any | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> int:
        """Run a named statement and return its row count (-1 for a batch that SET NOCOUNT ON)."""
        count: int = self._run(name, params, conn, identifiers, "rowcount")
        return count

    def render(
        self, name: str, params: Mapping[str, Any], identifiers: Mapping[str, str] | None = None
    ) -> str:
        """Return the named query as text with its parameters as literals (for a Spark JDBC source)."""
        return render_named(self.query(name, identifiers), params)

    # -- no LISTEN/NOTIFY --------------------------------------------------------------------------

    def channel(self, queue_id: int) -> str:
        """A name for the queue's wake-ups; SQL Server has none, so waiting pops poll."""
        return f"dbq.{self.schema}.{queue_id}"

    _NO_GRANTS = (
        "per-queue grants are PostgreSQL's (row-level security); on SQL Server give a role the "
        "schema's privileges (GRANT ... ON SCHEMA::...) instead"
    )

    def grant(self, role: str, queue_id: int | None, actions: Sequence[str]) -> list[str]:
        raise NotSupportedError(self._NO_GRANTS)

    def revoke(self, role: str, queue_id: int | None, actions: Sequence[str]) -> list[str]:
        raise NotSupportedError(self._NO_GRANTS)

    def list_grants(self) -> list[tuple[str, str | None, str]]:
        return []

    def actions_on(self, queue_id: int | None) -> frozenset[str]:
        """Every action: the database's own privileges decide (no per-queue grants here)."""
        return frozenset(("push", "pop", "read", "admin"))

    def grant_new_ring(self, conn: Any, queue_id: int) -> None:
        return None

    def sees_all_activity(self) -> bool:
        """VIEW SERVER STATE decides what the horizon check sees; its queries say so when refused."""
        return True

    def listening(self, channel: str) -> contextlib.AbstractContextManager[Any]:
        """SQL Server has no LISTEN/NOTIFY: waiting pops poll instead."""
        raise NotSupportedError("SQL Server has no LISTEN/NOTIFY; waiting pops poll")

    def wake_waiter(self, channel: str) -> None:
        """Nothing to wake: without LISTEN/NOTIFY no pop waits on a channel."""
