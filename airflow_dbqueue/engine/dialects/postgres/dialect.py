"""PostgreSQL through psycopg 3: connection pool, named queries, error translation, LISTEN/NOTIFY.

Every statement the engine runs on PostgreSQL is a named block in ``queries.sql`` or ``schema.sql``
beside this file; this module only composes (schema name quoted by psycopg) and executes them.
"""

from __future__ import annotations

import contextlib
import logging
import re
import select
import threading
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg import sql
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from airflow_dbqueue.engine.dialects.base import (
    SchemaObject,
    describe_objects,
    engine_objects,
    ownership,
    refuse_foreign_objects,
    refuse_newer_schema,
)
from airflow_dbqueue.engine.dialects.postgres.maintenance import PostgresMaintenance
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailableError,
    DbQueueError,
    DeadlockError,
    ForeignObjectsError,
    LockTimeoutError,
    QueueFullError,
    ReceiptsNotHeldError,
    RingNumbersSkippedError,
    SchemaError,
    StatementTimeoutError,
    TransientDatabaseError,
)
from airflow_dbqueue.engine.names import (
    POSTGRESQL_RESERVED_SCHEMAS,
    validate_identifier,
    validate_schema_name,
)
from airflow_dbqueue.engine.sqlfile import load_queries, parse_named_queries, read_text

log = logging.getLogger(__name__)

_PKG = __package__ or "airflow_dbqueue.engine.dialects.postgres"
_MIGRATION_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# SQLSTATEs that the server-side functions of schema.sql raise on purpose (class DQ is ours).
_RAISED_BY_FUNCTIONS: dict[str, type[DbQueueError]] = {
    "DQ001": QueueFullError,
    "DQ002": RingNumbersSkippedError,
    "DQ003": ConfigurationError,
    "DQ005": ReceiptsNotHeldError,
}


def migrations() -> list[tuple[int, str]]:
    """Return ``[(version, sql)]`` of every migration file, in order."""
    found = []
    for entry in resources.files(_PKG).joinpath("migrations").iterdir():
        m = _MIGRATION_FILE.match(entry.name)
        if m:
            found.append((int(m.group(1)), parse_named_queries(entry.read_text(encoding="utf-8"))["migrate"]))
    found.sort()
    versions = [v for v, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise SchemaError(f"migration files are not numbered 1..n without gaps: {versions}")
    return found


def schema_sql() -> tuple[int, str]:
    """Return ``(version, sql)`` of the current full schema."""
    text = read_text(_PKG, "schema.sql")
    m = re.search(r"SCHEMA_VERSION:\s*(\d+)", text)
    if not m:
        raise SchemaError("schema.sql does not declare its SCHEMA_VERSION")
    return int(m.group(1)), parse_named_queries(text)["schema"]


_TUPLES_OK = ExecStatus.TUPLES_OK


_INTEGER_OPTIONS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def check_dsn(dsn: str) -> None:
    """Raise :class:`ConfigurationError` for a connection string that libpq cannot use, without any I/O.

    libpq checks a string's syntax and option names when it parses it, but a port or a timeout that is
    not a number only when it connects: the pool then retried it until its timeout and reported the
    database as unreachable. Values are never echoed (a password may be among them).
    """
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigurationError(f"the PostgreSQL connection string is not valid: {first}") from None
    for port in str(info.get("port") or "").split(","):
        if port.strip() and not (port.strip().isdigit() and 1 <= int(port) <= 65535):
            raise ConfigurationError(
                f"the PostgreSQL connection string is not valid: port {port.strip()!r} is not a port "
                "number (1..65535)"
            )
    for name in _INTEGER_OPTIONS:
        value = str(info.get(name) or "").strip()
        if value and not value.lstrip("-").isdigit():
            raise ConfigurationError(
                f"the PostgreSQL connection string is not valid: {name} {value!r} is not an integer"
            )
    sslmode = info.get("sslmode")
    if sslmode and sslmode not in _SSLMODES:
        raise ConfigurationError(
            f"the PostgreSQL connection string is not valid: sslmode {sslmode!r} is not one of "
            f"{', '.join(_SSLMODES)}"
        )


def describe_dsn(dsn: str) -> str:
    """Return ``host:port/dbname`` of a DSN or URI, without credentials, for error messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return "<unparsable connection string>"
    host = info.get("host") or info.get("hostaddr") or "localhost"
    return f"{host}:{info.get('port') or 5432}/{info.get('dbname') or info.get('user') or ''}"


class PostgresDatabase(PostgresMaintenance):
    """A dbqueue schema on one PostgreSQL database.

    The pool is created closed and opened on first use: constructing this object does no I/O.

    :param dsn: libpq connection string or URI.
    :param schema: the schema that holds the queue tables (validated identifier).
    :param min_size: connections the pool keeps open.
    :param max_size: connections the pool may open.
    :param connect_timeout: seconds to wait for a connection before raising
        :class:`DatabaseUnavailableError`.
    """

    dialect_name = "postgresql"
    supports_notify = True
    ring_push_takes_floor = True
    ring_groups_supported = True

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "dbqueue",
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: float = 10.0,
        application_name: str = "airflow-dbqueue",
    ) -> None:
        check_dsn(dsn)
        self.dsn = dsn
        self.schema = validate_schema_name(schema, POSTGRESQL_RESERVED_SCHEMAS)
        self.where = describe_dsn(dsn)
        self._min_size = min_size
        self._max_size = max(min_size, max_size)
        self._connect_timeout = connect_timeout
        self._application_name = application_name
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()
        self._composed: dict[str, bytes] = {}

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
                    configure=_configure_connection,
                    kwargs={
                        "autocommit": True,
                        "application_name": self._application_name,
                        "connect_timeout": max(1, int(self._connect_timeout)),
                    },
                )
                try:
                    pool.open(wait=True, timeout=self._connect_timeout)
                except PoolTimeout as exc:
                    pool.close(timeout=0)
                    raise DatabaseUnavailableError(
                        f"cannot connect to PostgreSQL at {self.where} within {self._connect_timeout:g}s: "
                        f"{self._last_connect_error() or exc}"
                    ) from None
                self._pool = pool
            return self._pool

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
    ) -> _R:
        """Run one statement on ``conn`` or a pooled connection and return ``result`` of its cursor: what
        connection() and translate_errors() do, without their context managers, which cost a statement
        of one message a sixth of the client's instructions."""
        if conn is not None:
            try:
                return result(conn.execute(query, params, binary=binary))
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
            out = result(pooled.execute(query, params, binary=binary))
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
        """
        with self.translate_errors():
            conn = psycopg.connect(
                self.dsn,
                autocommit=True,
                application_name=application_name,
                connect_timeout=max(1, int(self._connect_timeout)),
                prepare_threshold=None,
            )
        try:
            _configure_connection(conn)
            yield conn
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.close()

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

    def _translated(self, exc: Exception) -> Exception:  # noqa: PLR0911 - a return a kind, in test order
        """The engine's exception for ``exc`` (``exc`` itself when it is one already, or not a database
        error)."""
        if isinstance(exc, DbQueueError) or not isinstance(exc, (psycopg.Error, PoolTimeout)):
            return exc
        if isinstance(exc, PoolTimeout):
            return DatabaseUnavailableError(
                f"no connection to PostgreSQL at {self.where} within {self._connect_timeout:g}s: {exc}"
            )
        if isinstance(exc, (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName)):
            # One of the schema's own functions (table_push, ring_push...) is gone with its schema.
            message = exc.diag.message_primary or ""
            if f"{self.schema}." not in message and f'schema "{self.schema}"' not in message:
                return DatabaseError(f"PostgreSQL error at {self.where}: {exc}".strip())
            return SchemaError(
                f"the dbqueue schema {self.schema!r} is not installed at {self.where} "
                f"(run install(), or `dbqueue init`): {exc.diag.message_primary}"
            )
        if isinstance(exc, psycopg.errors.UndefinedTable):
            return SchemaError(
                f"the dbqueue schema {self.schema!r} is not installed at {self.where} "
                f"(run install(), or `dbqueue init`): {exc.diag.message_primary}"
            )
        # Deadlocks, lock and statement timeouts are OperationalErrors to psycopg, but the server is
        # fine: they must not read as "unreachable" (nor make connection() discard the pool).
        if isinstance(exc, psycopg.errors.DeadlockDetected):
            return DeadlockError(
                f"PostgreSQL at {self.where}: deadlock, this transaction was rolled back: {_primary(exc)}"
            )
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return LockTimeoutError(
                f"PostgreSQL at {self.where}: a lock was not granted in time (lock_timeout): {_primary(exc)}"
            )
        if isinstance(exc, psycopg.errors.QueryCanceled):
            return StatementTimeoutError(
                f"PostgreSQL at {self.where}: the statement was cancelled (statement_timeout or "
                f"pg_cancel_backend): {_primary(exc)}"
            )
        if isinstance(exc, psycopg.errors.SerializationFailure):
            return TransientDatabaseError(
                f"PostgreSQL at {self.where}: the statement was cancelled or its transaction rolled back "
                f"(statement_timeout, pg_cancel_backend, or a serialization failure): {_primary(exc)}"
            )
        if isinstance(exc, psycopg.OperationalError):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return DatabaseUnavailableError(f"PostgreSQL at {self.where} is unreachable: {first}")
        own = _RAISED_BY_FUNCTIONS.get(exc.sqlstate or "")
        if own is not None:  # raised on purpose by the server-side functions of schema.sql
            return own(exc.diag.message_primary or str(exc))
        return DatabaseError(f"PostgreSQL error at {self.where}: {exc}".strip())

    def close(self) -> None:
        """Close the pool (it is reopened on next use)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    # -- named queries ---------------------------------------------------------------------------

    def query(self, name: str, identifiers: Mapping[str, str] | None = None) -> bytes:
        """Return the named query composed for this schema (cached).

        :param identifiers: values of the query's other identifier placeholders (``{table}``,
            ``{index}``: utility statements such as VACUUM and REINDEX cannot take bound parameters).
            Each must be a valid identifier; it is quoted by psycopg, never pasted in.
        """
        key = name if not identifiers else f"{name}:{sorted(identifiers.items())}"
        q = self._composed.get(key)
        if q is None:
            body = load_queries(_PKG, "queries.sql")[name]
            q = self.compose(body, identifiers)
            if not identifiers:
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
        return self._run(self.query(name, identifiers), params, conn, name in BINARY_RESULTS, _all_rows)

    def fetchone(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: psycopg.Connection[Any] | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> tuple[Any, ...] | None:
        """Run a named query and return its first row (or None)."""
        return self._run(self.query(name, identifiers), params, conn, False, _first_row)

    def render(self, name: str, params: Mapping[str, Any]) -> str:
        """Return the named query as text with its parameters bound client-side, for a reader that
        cannot bind parameters itself (a Spark JDBC source takes a query string)."""
        with self.connection() as c, self.translate_errors():
            return psycopg.ClientCursor(c).mogrify(self.query(name), params)

    def execute(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: psycopg.Connection[Any] | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> int:
        """Run a named statement and return its row count."""
        return self._run(self.query(name, identifiers), params, conn, False, _row_count)

    # -- LISTEN/NOTIFY -----------------------------------------------------------------------------

    def channel(self, queue_id: int) -> str:
        """Return the NOTIFY channel of a queue (at most 63 bytes: schema names are at most 40)."""
        return f"dbq.{self.schema}.{queue_id}"

    @contextlib.contextmanager
    def listening(self, channel: str) -> Iterator[Listener]:
        """Yield a :class:`Listener` on ``channel``, holding one pooled connection until exit."""
        with self.connection() as c:
            c.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            try:
                yield Listener(c, self)
            finally:
                with contextlib.suppress(psycopg.Error):
                    c.execute("UNLISTEN *")

    # -- schema ------------------------------------------------------------------------------------

    def install(self) -> int:
        """Create or migrate the schema, idempotently and safely when run concurrently.

        A schema that does not exist is created (and recorded as the engine's); an existing one that
        holds no install must be empty, or :class:`ForeignObjectsError` names what it holds and
        nothing is done. Everything the install creates is recorded in ``owned_objects``.

        :return: the schema version now installed.
        """
        latest, full = schema_sql()
        steps = migrations()
        if steps[-1][0] != latest:
            raise SchemaError(
                f"schema.sql declares version {latest} but the last migration is {steps[-1][0]}"
            )
        with self.transaction() as c:
            c.execute(self.query("install_lock"), {"schema": self.schema})
            current = self._installed_version(c)
            refuse_newer_schema(self.schema, self.where, current, latest)
            if current == latest:
                return latest
            before = self._objects(c)
            created_schema = False
            if current == 0:
                if self._fetch_one(c, "schema_exists"):
                    refuse_foreign_objects(self.schema, self.where, before)
                else:
                    c.execute(self.query("create_schema"))
                    created_schema = True
                c.execute(self.compose(full))
                c.execute(self.query("record_version"), {"version": latest})
                log.info("installed dbqueue schema %s at version %s", self.schema, latest)
            else:
                for version, body in steps:
                    if version > current:
                        c.execute(self.compose(body))
                        c.execute(self.query("record_version"), {"version": version})
                        log.info("migrated dbqueue schema %s to version %s", self.schema, version)
            rings = [r[0] for r in c.execute(self.query("owned_ring_sequences"), {"schema": self.schema})]
            own, schema_is_ours = ownership(
                before,
                self._objects(c),
                fresh=current == 0,
                created_schema=created_schema,
                engine_names=_engine_names(),
                ring_sequences=rings,
            )
            if schema_is_ours:
                own.add(("schema", self.schema))
            kinds, names = [k for k, _ in sorted(own)], [n for _, n in sorted(own)]
            c.execute(self.query("record_owned"), {"kinds": kinds, "names": names})
        return latest

    def _fetch_one(self, c: psycopg.Connection[Any], name: str) -> Any:
        row = c.execute(self.query(name), {"schema": self.schema}).fetchone()
        return row[0] if row else None

    def _installed_version(self, c: psycopg.Connection[Any]) -> int:
        """The version of the install in the schema (0: none), read in ``c``'s transaction."""
        if not self._fetch_one(c, "schema_installed"):
            return 0
        row = c.execute(self.query("schema_version")).fetchone()
        return int(row[0]) if row else 0

    def _objects(self, c: psycopg.Connection[Any]) -> list[SchemaObject]:
        rows = c.execute(self.query("schema_objects"), {"schema": self.schema}).fetchall()
        return [SchemaObject(kind, name, identity) for kind, name, identity in rows]

    def migrate_to(self, version: int) -> None:
        """Apply migrations 1..version to a schema that does not exist yet (for tests and upgrades)."""
        with self.transaction() as c:
            c.execute(self.query("install_lock"), {"schema": self.schema})
            for v, body in migrations():
                if v <= version:
                    c.execute(self.compose(body))
                    c.execute(self.query("record_version"), {"version": v})

    def drop_schema(self) -> None:
        """Drop what the engine created in the schema, and the schema when it is the engine's and empty.

        What is dropped is what ``owned_objects`` lists (and the rings' sequences, which ``rings``
        lists); an install of an older version is migrated first, which records it. Objects that are
        not the engine's stay, and so does the schema that holds them. When an object that is not the
        engine's depends on one of its objects (a view over ``meta``), :class:`ForeignObjectsError`
        names it and nothing is dropped. A schema without an install is left alone.
        """
        with self.transaction() as c:
            c.execute(self.query("install_lock"), {"schema": self.schema})
            current = self._installed_version(c) if self._fetch_one(c, "schema_exists") else 0
        if current == 0:
            log.info(
                "dbqueue schema %s holds no install at %s: nothing to uninstall", self.schema, self.where
            )
            return
        latest = schema_sql()[0]
        if current < latest:
            self.install()  # records what the engine owns, as it does for any older install
        try:
            with self.transaction() as c:
                c.execute(self.query("install_lock"), {"schema": self.schema})
                refuse_newer_schema(self.schema, self.where, self._installed_version(c), latest)
                owned = {(k, n) for k, n in c.execute(self.query("owned_objects"))}
                for name in [
                    r[0] for r in c.execute(self.query("owned_ring_sequences"), {"schema": self.schema})
                ]:
                    c.execute(self.query("drop_owned_sequence", {"sequence": name}))
                present = [o for o in self._objects(c) if o.key in owned]
                for kind, query, ident in (
                    ("function", "drop_owned_routine", "routine"),
                    ("table", "drop_owned_table", "table"),
                    ("sequence", "drop_owned_sequence", "sequence"),
                ):
                    for o in present:
                        if o.kind == kind:
                            c.execute(self.query(query, {ident: o.name}))
                left = self._objects(c)
                if ("schema", self.schema) in owned and not left:
                    c.execute(self.query("drop_owned_schema"))
                    log.info("uninstalled dbqueue schema %s at %s", self.schema, self.where)
                else:
                    log.info(
                        "uninstalled dbqueue from schema %s at %s; the schema stays (%s)",
                        self.schema,
                        self.where,
                        f"it holds {describe_objects(left)}" if left else "the engine did not create it",
                    )
        except DatabaseError as exc:
            cause = exc.__cause__
            if isinstance(cause, psycopg.errors.DependentObjectsStillExist):
                found = (cause.diag.message_detail or _primary(cause)).splitlines()
                raise ForeignObjectsError(
                    f"uninstall of schema {self.schema!r} at {self.where} refused: objects that are not "
                    f"the engine's depend on its own ({'; '.join(found)}). Nothing was dropped: drop "
                    "or move them first",
                    found,
                ) from exc
            raise


def _engine_names() -> frozenset[tuple[str, str]]:
    """The tables, sequences and functions that the schema file and the migrations create."""
    texts = [read_text(_PKG, "schema.sql")]
    texts += [
        e.read_text(encoding="utf-8")
        for e in resources.files(_PKG).joinpath("migrations").iterdir()
        if _MIGRATION_FILE.match(e.name)
    ]
    return frozenset().union(*(engine_objects(t) for t in texts))


BINARY_RESULTS = frozenset(
    {
        "push",
        "pop_lease",
        "pop_take",
        "ack",
        "nack",
        "leased",
        "peek",
        "ring_pop",
        "ring_take",
        "ring_ack",
        "ring_settle",
        "ring_leased",
        "ring_peek",
    }
)
"""Hot queries whose rows come back in binary format: payloads arrive as raw bytes rather than hex
text, and timestamps without text parsing (client CPU per message at batch 100).
Their columns are integers, timestamps, bytea and text only. Their array parameters are sent in binary too
(``%(name)b`` in queries.sql), which skips psycopg's per-element quoting of text arrays."""


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
    if conn.closed or conn.broken:
        return False
    try:
        # poll(), not select(): a worker process may hold more than FD_SETSIZE (1024) descriptors.
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        readable = bool(poller.poll(0))
    except (OSError, ValueError, psycopg.Error):
        return False
    if not readable:
        return True
    try:
        conn.execute("")
    except psycopg.Error:
        return False
    return True


def _primary(exc: psycopg.Error) -> str:
    return exc.diag.message_primary or str(exc).strip() or type(exc).__name__


def _configure_connection(conn: psycopg.Connection[Any]) -> None:
    """Session settings of every pooled connection.

    psycopg prepares a statement after a few runs, and PostgreSQL may then switch it to a generic
    plan. A consumer whose first pops find the queue empty gets a generic plan built for empty tables
    (sequential scans of meta and data) and keeps it: pops ran ~60x slower (345 ms against 5.7 ms for
    1,000 messages). Custom plans cost a little planning on every call and never get stuck.

    Times come back in UTC (the same instants, as aware datetimes): psycopg reads a timestamptz in a
    UTC session without a time zone lookup, 0.30 against 0.58 us of client CPU a row for (id,
    timestamptz, 300-byte payload) in a named zone such as Etc/UTC, and pops read one or two a message.
    """
    conn.execute("SET plan_cache_mode = force_custom_plan")
    conn.execute("SET TimeZone = 'UTC'")


class Listener:
    """A connection that LISTENs on one channel; :meth:`wait` returns when a notification arrives."""

    def __init__(self, conn: psycopg.Connection[Any], db: PostgresDatabase) -> None:
        self._conn = conn
        self._db = db

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; return True if a notification arrived."""
        if timeout <= 0:
            return False
        with self._db.translate_errors():
            got = False
            for _ in self._conn.notifies(timeout=timeout, stop_after=1):
                got = True
            return got
