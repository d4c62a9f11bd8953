"""PostgreSQL through psycopg 3: the connection pool and the named queries.

Every statement the engine runs on PostgreSQL is a named block in ``queries/``, ``schema.sql`` or
``functions.sql`` beside this file; this module only composes (schema name quoted by psycopg) and
executes them. The other parts of :class:`PostgresDatabase` are beside it: the schema, its functions
and migrations (``schema.py``), LISTEN/NOTIFY and async observers (``notify.py``), maintenance
(``maintenance.py``), the translation of driver errors (``errors.py``) and connection strings
(``conninfo.py``).
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import psycopg
from psycopg import IsolationLevel, sql
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from airflow_dbqueue.engine.dialects.base import (
    CONNECT_TIMEOUT_S,
    DEFAULT_SCHEMA,
    POOLER_NONE,
    POOLER_TRANSACTION,
    check_pooler,
)
from airflow_dbqueue.engine.dialects.postgres.conninfo import check_dsn, describe_dsn
from airflow_dbqueue.engine.dialects.postgres.errors import refused_login, translate
from airflow_dbqueue.engine.dialects.postgres.grants import PostgresGrants
from airflow_dbqueue.engine.dialects.postgres.hub import NotifyHub
from airflow_dbqueue.engine.dialects.postgres.maintenance import PostgresMaintenance
from airflow_dbqueue.engine.dialects.postgres.notify import PostgresNotify
from airflow_dbqueue.engine.dialects.postgres.schema import PostgresSchema
from airflow_dbqueue.engine.dialects.postgres.statements import BINARY_RESULTS, GENERIC_PLANS
from airflow_dbqueue.engine.errors import ConfigurationError, DatabaseUnavailableError, LoginError
from airflow_dbqueue.engine.names import (
    POSTGRESQL_RESERVED_SCHEMAS,
    validate_identifier,
    validate_schema_name,
)
from airflow_dbqueue.engine.sqlfile import load_queries

log = logging.getLogger(__name__)

_PKG = __package__ or "airflow_dbqueue.engine.dialects.postgres"


_TUPLES_OK = ExecStatus.TUPLES_OK

_WARNED_POLLING: set[str] = set()
"""The transaction poolers this process was warned about (no listen_dsn): once each."""
_QueryKey = str | tuple[str, tuple[tuple[str, str], ...]]
"""A composed query's key: its name, with the identifiers it was composed with when it has any."""
_COMPOSED_MAX = 1024
"""Composed queries kept at most (query(): it is emptied when full)."""


class PostgresDatabase(PostgresSchema, PostgresNotify, PostgresMaintenance, PostgresGrants):
    """A dbqueue schema on one PostgreSQL database.

    The pool is created closed and opened on first use: constructing this object does no I/O.

    :param dsn: libpq connection string or URI.
    :param schema: the schema that holds the queue tables (validated identifier).
    :param min_size: connections the pool keeps open.
    :param max_size: connections the pool may open.
    :param connect_timeout: seconds to wait for a connection before raising
        :class:`DatabaseUnavailableError`.
    :param pooler: what sits between the engine and the server: ``none`` (a direct connection, or a
        pooler in session mode) or ``transaction`` (a pooler that hands each transaction to whichever
        server connection is free, such as PgBouncer's transaction mode). Behind a transaction pooler
        nothing outlives a transaction on a server connection: statements go unprepared (psycopg's
        unnamed statement), connections get no session settings, and whatever needs a session
        (LISTEN, maintenance's lock and timeouts) goes to ``listen_dsn``.
    :param listen_dsn: a connection string that reaches the same database with a session of its own
        (the server itself, or a pooler in session mode). Waiting pops and observers LISTEN there, and
        maintenance holds its lock there. Without it, behind a transaction pooler waiting pops and
        observers poll, and maintenance is refused.
    """

    dialect_name = "postgresql"
    ring_push_takes_floor = True
    payload_pops = True
    push_options = True
    ring_layouts: tuple[str, ...] = ("slots", "rows")
    schema_passes = True
    prepares_statements = True  # not behind a transaction pooler (__init__)

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        application_name: str = "airflow-dbqueue",
        pooler: str = POOLER_NONE,
        listen_dsn: str | None = None,
    ) -> None:
        check_dsn(dsn)
        if listen_dsn is not None:
            check_dsn(listen_dsn)
        self.dsn = dsn
        self.pooler = check_pooler(pooler)
        self.listen_dsn = listen_dsn or None
        self.transaction_pooled = self.pooler == POOLER_TRANSACTION
        # Behind a transaction pooler a LISTEN would hold on whichever server connection ran it: wake-ups
        # need a session of their own (listen_dsn), or waiting pops poll.
        self.supports_notify = not self.transaction_pooled or self.listen_dsn is not None
        # A named prepared statement lives on one server connection; behind a transaction pooler the
        # next transaction may run on another, where the name is unknown or names another statement.
        self._prepared = frozenset() if self.transaction_pooled else GENERIC_PLANS
        self.prepares_statements = not self.transaction_pooled
        self.schema = validate_schema_name(schema, POSTGRESQL_RESERVED_SCHEMAS)
        self.where = describe_dsn(dsn)
        if not self.supports_notify and self.where not in _WARNED_POLLING:
            _WARNED_POLLING.add(self.where)
            log.warning(
                "dbqueue: %s is a transaction pooler and no listen_dsn is given: waiting pops, sensors "
                "and triggers poll instead of waking on NOTIFY, and maintenance cannot run. Give "
                "listen_dsn, a connection string that reaches the database directly or through a pooler "
                "in session mode",
                self.where,
            )
        self._min_size = min_size
        self._max_size = max(min_size, max_size)
        self._connect_timeout = connect_timeout
        self._application_name = application_name
        self._pool: ConnectionPool | None = None
        self._hub: NotifyHub | None = None
        # Behind a transaction pooler the server's default isolation cannot be set for a session: when
        # it is not READ COMMITTED, each statement runs in a READ COMMITTED transaction of its own.
        self._own_transactions = False
        self._lock = threading.Lock()
        self._composed: dict[_QueryKey, bytes] = {}

    # -- connections ---------------------------------------------------------------------------

    def _get_pool(self) -> ConnectionPool:
        pool = self._pool
        if pool is not None:
            return pool
        with self._lock:
            if self._pool is None:
                pool = ConnectionPool(
                    self.dsn,
                    min_size=self._min_size,
                    max_size=self._max_size,
                    open=False,
                    timeout=self._connect_timeout,
                    name=f"dbqueue-{self.schema}",
                    configure=self._configure,
                    kwargs=self._connect_kwargs(self._application_name),
                )
                started = time.monotonic()
                self._refuse_login()
                try:
                    left = self._connect_timeout - (time.monotonic() - started)
                    if left <= 0:
                        raise PoolTimeout("the first connection attempt took the whole connect timeout")
                    pool.open(wait=True, timeout=left)
                except PoolTimeout as exc:
                    pool.close(timeout=0)
                    why = self._last_connect_error()
                    if why is not None and refused_login(why):
                        raise LoginError(
                            f"PostgreSQL at {self.where} refused the connection: {why}"
                        ) from None
                    raise DatabaseUnavailableError(
                        f"cannot connect to PostgreSQL at {self.where} within {self._connect_timeout:g}s: "
                        f"{why or exc}"
                    ) from None
                self._pool = pool
            return self._pool

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """Set up a new pooled connection: :func:`_configure_connection` where it keeps its session;
        behind a transaction pooler, only the client side, and a look at the server's default isolation
        (the same for every server connection of the pooler's pool: one database, one role)."""
        if not self.transaction_pooled:
            _configure_connection(conn)
            return
        conn.isolation_level = IsolationLevel.READ_COMMITTED
        row = conn.execute("SHOW default_transaction_isolation").fetchone()
        if row is not None and row[0] != "read committed" and not self._own_transactions:
            log.info(
                "dbqueue: %s runs transactions at %s by default; behind the transaction pooler each of "
                "the engine's statements runs in a READ COMMITTED transaction of its own",
                self.where,
                row[0],
            )
            self._own_transactions = True

    def _connect_kwargs(self, application_name: str, *, session: bool = False) -> dict[str, Any]:
        """psycopg's arguments for a connection of the engine: autocommit, named, bounded; behind a
        transaction pooler (unless ``session``: a connection to ``listen_dsn``) never prepared."""
        kwargs: dict[str, Any] = {
            "autocommit": True,
            "application_name": application_name,
            "connect_timeout": max(1, int(self._connect_timeout)),
        }
        if self.transaction_pooled and not session:
            kwargs["prepare_threshold"] = None
        return kwargs

    def _refuse_login(self) -> None:
        """Connect once before the pool does: a login the server refuses (no such database or role, a
        wrong password, no pg_hba.conf entry) raises :class:`LoginError` at once, where the pool would
        retry it until the connect timeout. A server that is down, starting or full is left to the
        pool, which waits for it."""
        try:
            psycopg.connect(self.dsn, connect_timeout=max(1, int(self._connect_timeout))).close()
        except psycopg.OperationalError as exc:
            translated = self._translated(exc)
            if isinstance(translated, LoginError):
                raise translated from None

    def _last_connect_error(self) -> str | None:
        try:
            with psycopg.connect(self.dsn, connect_timeout=2):
                return None
        except psycopg.Error as exc:
            return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

    @contextlib.contextmanager
    def connection(self, conn: psycopg.Connection[Any] | None = None) -> Iterator[psycopg.Connection[Any]]:
        """Yield ``conn`` when the caller gives one (its transaction is joined), else a pooled one."""
        if conn is not None:
            with self.translate_errors():
                yield conn
            return
        with self.translate_errors():
            pool, pooled = self._checkout()
        try:
            yield pooled
            _end_statement(pooled)
        except BaseException as exc:
            translated = self._failed(pool, pooled, exc)
            if translated is exc:
                raise
            raise translated from exc
        pool.putconn(pooled)

    def _failed(
        self, pool: ConnectionPool, pooled: psycopg.Connection[Any], exc: BaseException
    ) -> BaseException:
        """Hand ``pooled`` back after ``exc`` and return what to raise: the engine's error for it. When
        the server is unreachable the connection is closed and its pool replaced instead."""
        translated = self._translated(exc) if isinstance(exc, Exception) else exc
        if isinstance(translated, DatabaseUnavailableError):
            pooled.close()  # not handed back: the pool it came from is replaced
            self._discard_pool(pool)
        else:
            if not pooled.closed and pooled.info.transaction_status != TransactionStatus.IDLE:
                with contextlib.suppress(psycopg.Error):
                    pooled.rollback()
            pool.putconn(pooled)
        return translated

    def _run(
        self,
        query: bytes,
        params: Mapping[str, Any] | None,
        conn: psycopg.Connection[Any] | None,
        binary: bool,
        result: Callable[[psycopg.Cursor[Any]], _R],
        *,
        prepare: bool = False,
    ) -> _R:
        """Run one statement on ``conn`` or a pooled connection and return ``result`` of its cursor: what
        connection() and translate_errors() do, without their context managers, which cost a statement
        of one message a sixth of the client's instructions."""
        if conn is not None:
            try:
                return result(conn.execute(query, params, binary=binary, prepare=prepare))
            except Exception as exc:
                translated = self._translated(exc)
                if translated is exc:
                    raise
                raise translated from exc
        try:
            pool, pooled = self._checkout()
        except Exception as exc:
            translated = self._translated(exc)
            if translated is exc:
                raise
            raise translated from exc
        try:
            if self._own_transactions:
                with pooled.transaction():
                    out = result(pooled.execute(query, params, binary=binary, prepare=prepare))
            else:
                out = result(pooled.execute(query, params, binary=binary, prepare=prepare))
            _end_statement(pooled)
        except BaseException as exc:
            failed = self._failed(pool, pooled, exc)
            if failed is exc:
                raise
            raise failed from exc
        pool.putconn(pooled)
        return out

    def _checkout(self) -> tuple[ConnectionPool, psycopg.Connection[Any]]:
        """Take a pooled connection that is sound, for a call; replace the pool when one is stale.

        A connection that sat in the pool while the server restarted is dead, and its socket says so:
        the server sent its end (an error message, then EOF) to an idle connection, which otherwise
        receives nothing (a notification on a connection that listened is the exception, and a round
        trip tells the two apart). One readiness check of the socket (no round trip) finds it; then
        every idle connection of the pool is as stale, so the pool is replaced and the call gets a new
        connection, waiting up to the connect timeout while the server is not back yet.
        """
        for _ in range(3):
            pool = self._get_pool()
            try:
                conn = pool.getconn()
            except PoolClosed:
                continue  # replaced by another thread meanwhile: take the new one
            if _sound(conn):
                return pool, conn
            log.info("a pooled connection to %s is stale (the server restarted?): new pool", self.where)
            conn.close()
            self._discard_pool(pool)
        pool = self._get_pool()
        return pool, pool.getconn()

    @contextlib.contextmanager
    def dedicated_connection(self, application_name: str) -> Iterator[psycopg.Connection[Any]]:
        """Yield a connection of its own (not pooled, autocommit), closed on exit.

        Maintenance holds a session-level advisory lock on it for a whole run, and runs statements
        that cannot run in a transaction block (VACUUM, REINDEX CONCURRENTLY): closing it releases
        the lock whatever happened, and no pooled connection is handed back with a lock or a setting.
        It is a session of its own: on ``listen_dsn`` when one is given. Behind a transaction pooler
        without one there is no session to hold a lock or a setting (they would stay behind on a server
        connection that the pooler hands to others), so it raises :class:`ConfigurationError`.
        """
        dsn = self.session_dsn(f"{application_name} (maintenance's lock and timeouts)")
        with self.translate_errors():
            conn = psycopg.connect(
                dsn, **self._connect_kwargs(application_name, session=True), prepare_threshold=None
            )
        try:
            _configure_connection(conn)
            yield conn
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def session_dsn(self, what: str) -> str:
        """The DSN of a connection that keeps its session for ``what``: ``listen_dsn`` when one is
        given, else the engine's own DSN unless that reaches a transaction pooler
        (:class:`ConfigurationError` naming ``what``)."""
        if self.listen_dsn is not None:
            return self.listen_dsn
        if self.transaction_pooled:
            raise ConfigurationError(
                f"{what} needs a session of its own, which a transaction pooler at {self.where} does not "
                "keep: give listen_dsn (DbQueue(..., listen_dsn=...), $DBQUEUE_LISTEN_DSN, or the "
                "connection's listen host and port), a connection string that reaches the database "
                "directly or through a pooler in session mode"
            )
        return self.dsn

    def _notify_hub(self) -> NotifyHub:
        """The one listening connection of this object's waiting pops (made on first use)."""
        with self._lock:
            if self._hub is None:
                self._hub = NotifyHub(self._listen_connect, self.waiters_lock)
            return self._hub

    def waiters_lock(self, channel: str) -> tuple[bytes, bytes, dict[str, Any]] | None:
        """The waiters' lock of a channel of this schema (hub.py's ``presence``): the statements that
        try it shared and release it, and their parameters; None for another channel."""
        prefix, _, queue_id = channel.rpartition(".")
        if prefix != f"dbq.{self.schema}" or not queue_id.isdigit():
            return None
        return self.query("waiters_hold"), self.query("waiters_release"), {"queue_id": int(queue_id)}

    def wake_waiter(self, channel: str) -> None:
        """Hand a wake to one pop of this object waiting on ``channel`` (nothing when none waits)."""
        hub = self._hub
        if hub is not None:
            hub.wake_one(channel)

    def _listen_connect(self) -> psycopg.Connection[Any]:
        dsn = self.session_dsn("LISTEN")
        with self.translate_errors():
            return psycopg.connect(
                dsn, **self._connect_kwargs(f"{self._application_name}-listen", session=True)
            )

    def _discard_pool(self, pool: ConnectionPool) -> None:
        """Replace a pool after a connection failure: the server may have restarted.

        Its idle connections are likely dead, and psycopg_pool's reconnect backoff doubles without a
        cap (1, 2, 4 ... s), so a fresh pool on the next call recovers faster than the old one would.
        The old pool is closed in a thread of its own, given the time its workers may need to finish a
        connection attempt (the connect timeout): the call does not wait for it, and the pool has no
        reason to complain that a worker did not stop in time.
        """
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
        grace = self._connect_timeout + 5

        def close() -> None:
            with contextlib.suppress(Exception):
                pool.close(timeout=grace)

        threading.Thread(target=close, name=f"dbqueue-close-{pool.name}", daemon=True).start()

    @contextlib.contextmanager
    def transaction(self, conn: psycopg.Connection[Any] | None = None) -> Iterator[psycopg.Connection[Any]]:
        """Yield a connection inside a transaction that commits on success and rolls back on error."""
        with self.connection(conn) as c, self.translate_errors(), c.transaction():
            yield c

    @staticmethod
    def in_transaction(conn: psycopg.Connection[Any]) -> bool:
        """Return whether ``conn`` has a transaction open (exactly-once pops need one)."""
        return not (conn.autocommit and conn.info.transaction_status.name == "IDLE")

    @contextlib.contextmanager
    def guarded(self, conn: psycopg.Connection[Any] | None) -> Iterator[psycopg.Connection[Any] | None]:
        """Yield what to pass as ``conn`` so that a failing statement leaves its transaction as it was.

        None (a pooled autocommit connection) and autocommit connections need nothing: a failed
        statement is its own transaction. A transaction in progress gets a savepoint. An idle
        connection without autocommit is rolled back on error, which undoes only the implicit
        transaction that the failed statement opened.
        """
        if conn is None or (conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE):
            yield conn
            return
        with self.translate_errors():
            if conn.info.transaction_status == TransactionStatus.INTRANS:
                with conn.transaction():
                    yield conn
                return
            try:
                yield conn
            except BaseException:
                if conn.info.transaction_status == TransactionStatus.INERROR:
                    conn.rollback()
                raise

    @contextlib.contextmanager
    def translate_errors(self) -> Iterator[None]:
        """Translate psycopg and pool exceptions into the engine's exception family."""
        try:
            yield
        except Exception as exc:
            translated = self._translated(exc)
            if translated is exc:
                raise
            raise translated from exc

    def _translated(self, exc: Exception) -> Exception:
        """The engine's exception for ``exc`` (``exc`` itself when it is one already, or not a database
        error)."""
        return translate(exc, schema=self.schema, where=self.where, connect_timeout=self._connect_timeout)

    def close(self) -> None:
        """Close the pool (it is reopened on next use)."""
        with self._lock:
            pool, self._pool = self._pool, None
            hub, self._hub = self._hub, None
        if hub is not None:
            hub.close()
        if pool is not None:
            pool.close()

    # -- named queries ---------------------------------------------------------------------------

    def query(self, name: str, identifiers: Mapping[str, str] | None = None) -> bytes:
        """Return the named query composed for this schema (cached).

        :param identifiers: values of the query's other identifier placeholders (``{table}``,
            ``{index}``: utility statements such as VACUUM and REINDEX cannot take bound parameters).
            Each must be a valid identifier; it is quoted by psycopg, never pasted in.
        """
        key: _QueryKey = name if not identifiers else (name, tuple(identifiers.items()))
        q = self._composed.get(key)
        if q is None:
            body = load_queries(_PKG, "queries")[name]
            q = self.compose(body, identifiers)
            # Kept with identifiers too (a ring of the rows layout's own functions, which its pushes and
            # pops call by name); maintenance's names of tables and indexes come and go, so the cache is
            # emptied when it has grown past what one schema's queries and queues need.
            if len(self._composed) >= _COMPOSED_MAX:
                self._composed.clear()
            self._composed[key] = q
        return q

    def compose(self, body: str, identifiers: Mapping[str, str] | None = None) -> bytes:
        """Replace ``{schema}`` (and the given ``identifiers``) in ``body`` by quoted identifiers."""
        # Only identifier placeholders are substituted; literal braces are not used in our SQL.
        idents = {k: sql.Identifier(validate_identifier(v)) for k, v in (identifiers or {}).items()}
        return sql.SQL(body).format(schema=sql.Identifier(self.schema), **idents).as_string(None).encode()

    def fetchall(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: psycopg.Connection[Any] | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> list[tuple[Any, ...]]:
        """Run a named query and return all its rows."""
        return self._run(
            self.query(name, identifiers),
            params,
            conn,
            name in BINARY_RESULTS,
            _all_rows,
            prepare=name in self._prepared,
        )

    def fetchone(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: psycopg.Connection[Any] | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> tuple[Any, ...] | None:
        """Run a named query and return its first row (or None)."""
        return self._run(
            self.query(name, identifiers), params, conn, False, _first_row, prepare=name in self._prepared
        )

    def render(
        self, name: str, params: Mapping[str, Any], identifiers: Mapping[str, str] | None = None
    ) -> str:
        """Return the named query as text with its parameters bound client-side, for a reader that
        cannot bind parameters itself (a Spark JDBC source takes a query string)."""
        with self.connection() as c, self.translate_errors():
            return psycopg.ClientCursor(c).mogrify(self.query(name, identifiers), params)

    def execute(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: psycopg.Connection[Any] | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> int:
        """Run a named statement and return its row count."""
        return self._run(
            self.query(name, identifiers), params, conn, False, _row_count, prepare=name in self._prepared
        )


"""Hot queries whose rows come back in binary format: payloads arrive as raw bytes rather than hex
text, and timestamps without text parsing (client CPU per message at batch 100).
Their columns are integers, timestamps, bytea and text only. Their array parameters are sent in binary too
(``%(name)b`` in queries/), which skips psycopg's per-element quoting of text arrays."""


_R = TypeVar("_R")


def _all_rows(cur: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    # The result's status, not cur.description, which builds a Column per field on every call (about
    # a tenth of a ring pop's client time at batch 1).
    res = cur.pgresult
    return cur.fetchall() if res is not None and res.status == _TUPLES_OK else []


def _first_row(cur: psycopg.Cursor[Any]) -> tuple[Any, ...] | None:
    return cur.fetchone()


def _row_count(cur: psycopg.Cursor[Any]) -> int:
    return cur.rowcount


def _end_statement(pooled: psycopg.Connection[Any]) -> None:
    """Pooled connections are autocommit: a statement leaves nothing to commit, unless the caller began
    a transaction on the connection and left it open."""
    if pooled.info.transaction_status != TransactionStatus.IDLE:
        pooled.commit()


def _sound(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle pooled connection can take a statement: not closed, and its socket has nothing
    to read (a dead server's connection has its error and EOF waiting), or else a round trip works."""
    readable = has_input(conn)
    if readable is None or not readable:
        return readable is False
    try:
        conn.execute("")
    except psycopg.Error:
        return False
    return True


def has_input(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool | None:
    """Whether an idle connection's socket has something to read, without a round trip (None: the
    connection is closed or broken, or its socket cannot be polled)."""
    if conn.closed or conn.broken:
        return None
    try:
        # poll(), not select(): a worker process may hold more than FD_SETSIZE (1024) descriptors.
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError, psycopg.Error):
        return None


def _configure_connection(conn: psycopg.Connection[Any]) -> None:
    """Session settings of every pooled connection (and of maintenance's and listeners' own).

    Isolation: every claim of the engine is written for READ COMMITTED (a pop skips the rows others
    locked, and takes what committed since its statement began), so the engine's statements run at READ
    COMMITTED whatever the role's or database's ``default_transaction_isolation``: under SERIALIZABLE,
    concurrent pops failed with serialization failures of the engine's own statements. psycopg opens the
    engine's transactions (``DbQueue.transaction()`` among them) with ``BEGIN ISOLATION LEVEL READ
    COMMITTED``; a caller's own connection keeps its level.

    Plans (statements.GENERIC_PLANS): a statement of the engine is sent unprepared unless it only calls
    one of the schema's functions, so PostgreSQL plans it for its parameters on every call. A generic
    plan, made once a prepared statement has run a few times, can stick: a consumer whose first pops
    found the queue empty kept sequential scans of meta and data, and pops ran ~60x slower (345 ms
    against 5.7 ms for 1,000 messages). A call of a function plans the same whatever its arguments, so
    those are prepared and reused in this session's default mode (``auto``), which turns them generic:
    a pop of one through ``ring_take`` costs the server about 56,000 fewer instructions than when
    planned on every call, a push of one about 31,000. The functions that read tables whose size
    changes fix the plan mode of their own statements (``SET plan_cache_mode``, functions.sql).

    Times come back in UTC (the same instants, as aware datetimes): psycopg reads a timestamptz in a
    UTC session without a time zone lookup, 0.30 against 0.58 us of client CPU a row for (id,
    timestamptz, 300-byte payload) in a named zone such as Etc/UTC, and pops read one or two a message.
    """
    conn.isolation_level = IsolationLevel.READ_COMMITTED
    conn.execute("SET TimeZone = 'UTC'; SET default_transaction_isolation = 'read committed'")
