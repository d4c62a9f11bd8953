"""What psycopg and its pool raise, as the engine's errors (``engine/errors.py``): the one place the
PostgreSQL dialect reads a driver error."""

from __future__ import annotations

import re

import psycopg
import psycopg.errors
from psycopg_pool import PoolTimeout

from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailableError,
    DbQueueError,
    DeadlockError,
    ForeignObjectsError,
    LockTimeoutError,
    LoginError,
    PermissionDeniedError,
    QueueFullError,
    ReceiptsNotHeldError,
    RingNumbersSkippedError,
    SchemaError,
    StatementTimeoutError,
    TransientDatabaseError,
)

# SQLSTATEs that the server-side functions of functions.sql raise on purpose (class DQ is ours).
_RING_ROWS_LOG = re.compile(r"ring_g?[0-9]+_r(pos|l|d|r)[0-9]+_pkey")
"""The keys of a rows ring's insert-only logs (positions, leases, acks, retries) of its segments, for
the default group (``ring_<queue_id>_r``) and every other (``ring_g<n>_r``)."""

_RAISED_BY_FUNCTIONS: dict[str, type[DbQueueError]] = {
    "DQ001": QueueFullError,
    "DQ002": RingNumbersSkippedError,
    "DQ003": ConfigurationError,
    "DQ005": ReceiptsNotHeldError,
    "DQ006": ForeignObjectsError,
}


# What a server or PgBouncer answers to a login that no wait will let in (libpq reports a failed
# connection without its SQLSTATE, so its message is what tells them apart from a server that is down,
# starting or full).
_REFUSED_LOGIN = re.compile(
    r"FATAL:\s+(database \S+ does not exist|role \S+ does not exist|password authentication failed"
    r"|no pg_hba\.conf entry|pg_hba\.conf rejects|permission denied for database|no such database"
    r"|no such user|\S+ authentication failed)"
)


def refused_login(message: str) -> bool:
    """Whether a connection failure's first line says the login itself was refused."""
    return _REFUSED_LOGIN.search(message) is not None


def _after_fatal(message: str) -> str:
    return message.split("FATAL:", 1)[-1].strip()


def _connection_lost(exc: psycopg.Error, where: str) -> DbQueueError | None:
    """The engine's error for a connection that failed or ended (None: ``exc`` is not one): a login
    refused, a server that is unreachable or went away, a session the server ended."""
    if isinstance(exc, (psycopg.errors.IdleInTransactionSessionTimeout, psycopg.errors.IdleSessionTimeout)):
        # The server ended the session (a DBA's idle timeouts): the connection is gone with its
        # transaction, as when the server goes away mid-call.
        return DatabaseUnavailableError(f"PostgreSQL at {where} closed the connection: {primary(exc)}")
    if isinstance(exc, psycopg.OperationalError):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if refused_login(first):
            return LoginError(f"PostgreSQL at {where} refused the connection: {_after_fatal(first)}")
        return DatabaseUnavailableError(f"PostgreSQL at {where} is unreachable: {first}")
    return None


def translate(exc: Exception, *, schema: str, where: str, connect_timeout: float) -> Exception:  # noqa: PLR0911 - a return a kind, in test order
    """The engine's exception for ``exc`` (``exc`` itself when it is one already, or not a database
    error)."""
    if isinstance(exc, DbQueueError) or not isinstance(exc, (psycopg.Error, PoolTimeout)):
        return exc
    if isinstance(exc, PoolTimeout):
        return DatabaseUnavailableError(
            f"no connection to PostgreSQL at {where} within {connect_timeout:g}s: {exc}"
        )
    if isinstance(exc, (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName)):
        # One of the schema's own functions (table_push, ring_push...) is gone with its schema.
        message = exc.diag.message_primary or ""
        if f"{schema}." not in message and f'schema "{schema}"' not in message:
            return DatabaseError(f"PostgreSQL error at {where}: {exc}".strip())
        return SchemaError(
            f"the dbqueue schema {schema!r} is not installed at {where} "
            f"(run install(), or `dbqueue init`): {exc.diag.message_primary}"
        )
    if isinstance(exc, psycopg.errors.UndefinedTable):
        # Either no install, or one made by another build of the same schema version that lacks a
        # table this code reads: install() tells the two apart and names what is missing.
        return SchemaError(
            f"the dbqueue schema {schema!r} is not installed at {where}, or lacks a table this build "
            f"uses (run install(), or `dbqueue init`, which says which): {exc.diag.message_primary}"
        )
    # Deadlocks, lock and statement timeouts are OperationalErrors to psycopg, but the server is
    # fine: they must not read as "unreachable" (nor make connection() discard the pool).
    if isinstance(exc, psycopg.errors.DeadlockDetected):
        return DeadlockError(
            f"PostgreSQL at {where}: deadlock, this transaction was rolled back: {primary(exc)}"
        )
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return LockTimeoutError(
            f"PostgreSQL at {where}: a lock was not granted in time (lock_timeout): {primary(exc)}"
        )
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return StatementTimeoutError(
            f"PostgreSQL at {where}: the statement was cancelled (statement_timeout or "
            f"pg_cancel_backend): {primary(exc)}"
        )
    conflict = _serialization_conflict(exc, where)
    if conflict is not None:
        return conflict
    lost = _connection_lost(exc, where)
    if lost is not None:
        return lost
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return PermissionDeniedError(
            f"PostgreSQL at {where}: the connection's role may not do this ({primary(exc)}); the schema's "
            "owner grants actions with DbQueue.grant"
        )
    own = _RAISED_BY_FUNCTIONS.get(exc.sqlstate or "")
    if own is not None:  # raised on purpose by the server-side functions of functions.sql
        return own(exc.diag.message_primary or str(exc))
    return DatabaseError(f"PostgreSQL error at {where}: {exc}".strip())


def _serialization_conflict(exc: psycopg.Error, where: str) -> TransientDatabaseError | None:
    """A transaction that must run again: a serialization failure, or its rows-ring twin."""
    if isinstance(exc, psycopg.errors.SerializationFailure):
        return TransientDatabaseError(
            f"PostgreSQL at {where}: the statement was cancelled or its transaction rolled back "
            f"(statement_timeout, pg_cancel_backend, or a serialization failure): {primary(exc)}"
        )
    if isinstance(exc, psycopg.errors.UniqueViolation) and _RING_ROWS_LOG.fullmatch(
        exc.diag.constraint_name or ""
    ):
        # A ring of the rows layout logs each step of a lane as a row keyed by the lane and its next
        # position, written under the lane's lock. Read committed, the statement after the lock sees the
        # last step; a transaction at REPEATABLE READ or SERIALIZABLE whose snapshot is older than
        # another consumer's committed step does not, and its insert meets that step's key: the same
        # conflict the server reports as a serialization failure on an updated row.
        return TransientDatabaseError(
            f"PostgreSQL at {where}: could not serialize access: another consumer moved this ring's lane "
            f"after this transaction's snapshot was taken (REPEATABLE READ or SERIALIZABLE); run the "
            f"transaction again: {primary(exc)}"
        )
    return None


def primary(exc: psycopg.Error) -> str:
    """The server's primary message of ``exc`` (else its text, else its kind)."""
    return exc.diag.message_primary or str(exc).strip() or type(exc).__name__
