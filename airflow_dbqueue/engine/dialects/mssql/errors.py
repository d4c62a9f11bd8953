"""What pyodbc raises, as the engine's errors (``engine/errors.py``): by SQLSTATE and SQL Server's native
error number, and the ``[DQ00n]`` codes the schema's procedures raise on purpose."""

from __future__ import annotations

import re

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

_NATIVE = re.compile(r"\((\d+)\)\s*\(SQL\w+\)\s*$")
_UNAVAILABLE_STATES = frozenset({"08001", "08S01", "08004", "08007", "HYT00", "HYT01", "28000", "IM002"})
_UNINSTALLED = 208  # Invalid object name
_RAISED = 50000  # RAISERROR with a message text (the ring's procedures)
# A SNAPSHOT transaction's write (or update-locked read) of a row that another transaction changed after it
# began: PostgreSQL's serialization failure, which the caller answers by running its transaction again.
_SNAPSHOT_CONFLICT = 3960
_RAISED_CODE = re.compile(r"\[(DQ\d{3})\]")
RAISED_BY_PROCEDURES: dict[str, type[DbQueueError]] = {
    "DQ001": QueueFullError,
    "DQ002": RingNumbersSkippedError,
    "DQ003": ConfigurationError,
    "DQ005": ReceiptsNotHeldError,
    "DQ006": ForeignObjectsError,
    "DQ007": DeadlockError,
}
"""What the ring's stored procedures (and ``drop_owned_table``) raise on purpose (``RAISERROR`` with
``[DQ00n]`` in the message), as PostgreSQL's functions raise SQLSTATE ``DQ00n``. DQ004 (a ring that does
not exist) stays a :class:`DatabaseError`, as on PostgreSQL. DQ006: an object that is not the engine's
refers to a table of the engine, so the uninstall dropped nothing. DQ007: a push's or a drop's queue lock
(``sp_getapplock``) was refused as a deadlock victim; the dialect runs its own statement again."""


def native_error(exc: BaseException) -> int | None:
    """Return SQL Server's native error number of a pyodbc exception (from its message), if any."""
    msg = str(exc.args[1]) if len(exc.args) > 1 else str(exc)
    m = _NATIVE.search(msg.strip())
    return int(m.group(1)) if m else None


def sqlstate(exc: BaseException) -> str:
    """Return the SQLSTATE of a pyodbc exception (its first argument)."""
    return str(exc.args[0]) if exc.args else ""


def translate(exc: Exception, *, where: str, schema: str, connecting: bool = False) -> DbQueueError:  # noqa: PLR0911
    """Return the engine's exception for a pyodbc exception.

    :param connecting: the error came while opening a connection (a timeout then is a login timeout).
    """
    state, number = sqlstate(exc), native_error(exc)
    message = (str(exc.args[1]) if len(exc.args) > 1 else str(exc)).strip().splitlines()[0]
    if number == _RAISED and (code := _RAISED_CODE.search(message)) and code.group(1) in RAISED_BY_PROCEDURES:
        text = _NATIVE.sub("", message[code.end() :]).strip()
        return RAISED_BY_PROCEDURES[code.group(1)](f"SQL Server at {where}: {text}")
    if number == _SNAPSHOT_CONFLICT:
        return TransientDatabaseError(
            f"SQL Server at {where}: a row this SNAPSHOT transaction reads to change was changed after it "
            f"began (an update conflict), transaction rolled back; run it again: {message}"
        )
    if number == 1205 or state == "40001":
        return DeadlockError(f"SQL Server at {where}: deadlock victim, transaction rolled back: {message}")
    if number == 1222:
        return LockTimeoutError(f"SQL Server at {where}: lock request timed out: {message}")
    if number == _UNINSTALLED:
        return SchemaError(
            f"the dbqueue schema {schema!r} is not installed at {where} (run install(), or `dbqueue init`): "
            f"{message}"
        )
    if state == "HYT00" and not connecting:
        return StatementTimeoutError(
            f"SQL Server at {where}: the statement was cancelled, its query timeout expired: {message}"
        )
    if connecting or state in _UNAVAILABLE_STATES or state.startswith("08"):
        what = "login timeout" if state == "HYT00" and connecting else "unreachable"
        return DatabaseUnavailableError(f"SQL Server at {where} is {what}: {message}")
    return DatabaseError(f"SQL Server error at {where}: [{state}] {message}")
