"""SQL Server through pyodbc: connections, named queries, parameters, error translation, retries.

Every statement the engine runs on SQL Server is a named block in ``queries.sql`` or ``schema.sql``
beside this file, under the names of the PostgreSQL dialect. This module composes them (schema name
bracket-quoted after validation), binds their parameters and runs each as one transaction.

- Parameters: the blocks are written with ``%(name)s`` like PostgreSQL's; :func:`to_positional` turns
  them into pyodbc's ``?`` with the values in order.
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
  ``DQ00n``; :func:`translate` maps both the same way.
- Maintenance (``engine/maintenance/``, through ``maintenance.py`` beside this file) runs on a
  connection of its own in autocommit mode (:meth:`MssqlDatabase.dedicated_connection`), like
  PostgreSQL's: the statements of :data:`OUTSIDE_TRANSACTION` run there as they are, everything else
  in a transaction of its own. Timeouts are the session's ``SET LOCK_TIMEOUT`` and the driver's query
  timeout (:meth:`MssqlDatabase.set_timeouts`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import json
import logging
import math
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from airflow_dbqueue.engine.dialects.base import (
    SchemaObject,
    describe_objects,
    engine_objects,
    ownership,
    refuse_foreign_objects,
    refuse_newer_schema,
)
from airflow_dbqueue.engine.dialects.mssql.maintenance import MssqlMaintenance
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
from airflow_dbqueue.engine.names import MSSQL_RESERVED_SCHEMAS, validate_identifier, validate_schema_name
from airflow_dbqueue.engine.sqlfile import load_queries, parse_named_queries, read_text

log = logging.getLogger(__name__)

_PKG = __package__ or "airflow_dbqueue.engine.dialects.mssql"
DEFAULT_DRIVER = "ODBC Driver 18 for SQL Server"

NOT_YET_PORTED: dict[str, str] = {
    name: "a ring's consumer groups besides its default one need ring_groups, the groups' rows in the ring "
    "tables keyed by their gid, and procedures that take a gid (ring_groups_supported is False: RingQueue "
    "raises NotSupportedError for any other group, docs/limits.md)"
    for name in ("ring_add_group", "ring_drop_group", "ring_groups", "ring_group_moved")
}
"""Named queries of the PostgreSQL dialect that this dialect does not have yet, with what they need.

The parity test checks that the PostgreSQL names are exactly this dialect's names plus these, so a new
PostgreSQL query fails the test until it is ported or listed here. The table design, maintenance and the
ring design are all ported, but for a ring's consumer groups besides its default one.
"""

POSTGRES_ONLY: dict[str, str] = {
    name: "Maintenance.compact_rings rewrites ring tables grown by row versions a held xmin horizon kept; "
    "SQL Server keeps old row versions in tempdb's version store, not in the table, and skips the step"
    for name in ("vacuum_full_table", "compact_relation_size", "compact_ring_layouts", "compact_ring_tables")
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

INLINE_INT_PARAMS: dict[str, dict[str, tuple[int, int]]] = {"set_timeouts": {"lock_ms": (-1, 2**31 - 1)}}
"""Parameters that T-SQL does not accept as parameters (``SET LOCK_TIMEOUT`` takes a constant), by query:
written into the text as integers after :func:`int_literal` checked them against the range given."""

ONLINE_REBUILD_EDITIONS: dict[int, str] = {
    3: "Enterprise, Developer or Evaluation",
    5: "Azure SQL Database",
    8: "Azure SQL Managed Instance",
}
"""``SERVERPROPERTY('EngineEdition')`` values whose engine rebuilds indexes with ``ONLINE = ON``."""

ENGINE_EDITIONS: dict[int, str] = {
    1: "Personal or Desktop Engine",
    2: "Standard (or Web, Business Intelligence)",
    4: "Express",
    6: "Azure Synapse dedicated SQL pool",
    9: "Azure SQL Edge",
    11: "Azure Synapse serverless SQL pool",
    **ONLINE_REBUILD_EDITIONS,
}
"""Names of the ``SERVERPROPERTY('EngineEdition')`` values, for reports."""


def edition_name(edition: int | None) -> str:
    """Return a readable name of an engine edition number (``"EngineEdition 12"`` when unknown)."""
    if edition is None:
        return "an unknown edition"
    return f"{ENGINE_EDITIONS.get(edition, 'EngineEdition')} ({edition})"


def rebuild_mode(edition: int | None) -> str:
    """Return how an index of a server of this engine edition is rebuilt without blocking the queue.

    ``"online rebuild"`` (``ALTER INDEX ... REBUILD WITH (ONLINE = ON)``) where the edition has online
    index operations (:data:`ONLINE_REBUILD_EDITIONS`), ``"reorganize"`` (``ALTER INDEX ... REORGANIZE``,
    online in every edition) otherwise, and for an edition this code does not know: an offline rebuild
    would lock the table for its whole duration, so it is never chosen.
    """
    return "online rebuild" if edition in ONLINE_REBUILD_EDITIONS else "reorganize"


def int_literal(value: Any, *, name: str, low: int, high: int) -> str:
    """Return ``value`` as the text of an integer in ``low..high`` for a T-SQL statement that takes a
    constant; raise :class:`ConfigurationError` for anything else (booleans, fractions, other text)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigurationError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    text = value.strip() if isinstance(value, str) else str(value)
    if not re.fullmatch(r"-?[0-9]{1,10}", text) or not low <= int(text) <= high:
        raise ConfigurationError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return str(int(text))


def lock_timeout_ms(seconds: float | None) -> int:
    """Return the ``SET LOCK_TIMEOUT`` value for ``seconds`` (``None``: wait without limit, -1).

    Rounded up to whole milliseconds and capped at 2**31 - 1; negative, NaN or infinite seconds raise
    :class:`ConfigurationError`.
    """
    if seconds is None:
        return -1
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise ConfigurationError(f"a lock timeout must be a finite number of seconds, got {seconds!r}")
    if seconds < 0:
        raise ConfigurationError(f"a lock timeout must be >= 0 seconds, got {seconds!r}")
    return min(2**31 - 1, math.ceil(seconds * 1000))


def query_timeout_s(seconds: float | None) -> int:
    """Return the driver's query timeout for ``seconds``: whole seconds, rounded up (0.2 s waits 1 s),
    at least 1 for any positive value; 0 (no timeout) for ``None`` or 0."""
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise ConfigurationError(f"a statement timeout must be a finite number of seconds, got {seconds!r}")
    if seconds < 0:
        raise ConfigurationError(f"a statement timeout must be >= 0 seconds, got {seconds!r}")
    return min(2**31 - 1, math.ceil(seconds))


def inline_int_params(name: str, sql: str, params: Mapping[str, Any] | None) -> str:
    """Write the :data:`INLINE_INT_PARAMS` of query ``name`` into ``sql`` as checked integer literals."""
    ranges = INLINE_INT_PARAMS.get(name)
    if not ranges:
        return sql
    given = params or {}

    def repl(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in ranges:
            return m.group(0)
        if key not in given:
            raise ConfigurationError(f"no value for the query parameter {key!r}")
        low, high = ranges[key]
        return int_literal(given[key], name=key, low=low, high=high)

    return _NAMED.sub(repl, sql)


# -- parameters ------------------------------------------------------------------------------------

_NAMED = re.compile(r"%\(([a-z_][a-z0-9_]*)\)s")


def adapt_value(value: Any) -> Any:
    """Return ``value`` as pyodbc should bind it.

    Lists and tuples become one JSON array (bytes items as hex strings, for ``CONVERT(..., 2)``); UUIDs
    become text; aware datetimes become naive UTC (every time column is UTC ``datetime2``).
    """
    if isinstance(value, list | tuple):
        return json.dumps([v.hex() if isinstance(v, bytes | bytearray | memoryview) else v for v in value])
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def to_positional(sql: str, params: Mapping[str, Any] | None) -> tuple[str, list[Any]]:
    """Turn ``%(name)s`` placeholders into ``?`` and return the values in placeholder order.

    A name used twice is bound twice. A placeholder without a value raises :class:`ConfigurationError`;
    values that no placeholder names are ignored (a query may not need every value the design passes).
    """
    values: list[Any] = []
    given = params or {}

    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in given:
            raise ConfigurationError(f"no value for the query parameter {name!r}")
        values.append(adapt_value(given[name]))
        return "?"

    return _NAMED.sub(repl, sql), values


def sql_literal(value: Any) -> str:  # noqa: PLR0911
    """Return ``value`` as a T-SQL literal (for :meth:`MssqlDatabase.render`; never for user input)."""
    value = adapt_value(value)
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    if isinstance(value, dt.datetime):
        return f"CAST('{value.isoformat(sep=' ')}' AS datetime2(6))"
    if isinstance(value, str):
        return "N'" + value.replace("'", "''") + "'"
    raise ConfigurationError(f"cannot render a {type(value).__name__} as a T-SQL literal")


def render_named(sql: str, params: Mapping[str, Any]) -> str:
    """Replace ``%(name)s`` placeholders by T-SQL literals of ``params``."""

    def repl(m: re.Match[str]) -> str:
        if m.group(1) not in params:
            raise ConfigurationError(f"no value for the query parameter {m.group(1)!r}")
        return sql_literal(params[m.group(1)])

    return _NAMED.sub(repl, sql)


def quote_identifier(name: str) -> str:
    """Return ``name`` bracket-quoted (``]`` doubled), as T-SQL's QUOTENAME does."""
    return "[" + name.replace("]", "]]") + "]"


# -- results ---------------------------------------------------------------------------------------

# Queries whose rows carry receipt lists as JSON text (columns 2 and 3: ids, deliveries).
_JSON_LIST_COLUMNS: dict[str, tuple[int, ...]] = {
    "claim_batch": (2, 3),
    "get_batch": (2, 3),
    "lock_batch": (2, 3),
    "open_batches": (2, 3),
}


def adapt_row(name: str, row: Sequence[Any]) -> tuple[Any, ...]:
    """Return a pyodbc row as the engine expects it: naive datetimes as aware UTC (every time column
    is UTC), and the JSON lists of :data:`_JSON_LIST_COLUMNS` as lists."""
    out: list[Any] = [
        v.replace(tzinfo=dt.UTC) if isinstance(v, dt.datetime) and v.tzinfo is None else v for v in row
    ]
    for i in _JSON_LIST_COLUMNS.get(name, ()):
        out[i] = json.loads(out[i]) if out[i] is not None else []
    return tuple(out)


# -- connection strings ----------------------------------------------------------------------------


def bundled_driver() -> str | None:
    """Return the path of the ODBC Driver 18 shipped by the ``mssql-python-odbc`` wheel, if installed."""
    try:
        import mssql_python_odbc  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    libs = mssql_python_odbc.get_libs_dir()
    arch = os.uname().machine
    arch = {"aarch64": "arm64"}.get(arch, arch)
    for distro in ("debian_ubuntu", "rhel", "suse", "alpine"):
        found = sorted(glob.glob(os.path.join(libs, "linux", distro, arch, "lib", "libmsodbcsql-*.so*")))
        if found:
            return found[-1]
    return None


def default_driver() -> str:
    """The ODBC driver to name when a DSN names none: Driver 18 if registered, else the bundled one.

    Without pyodbc nothing can connect (:meth:`MssqlDatabase.connect` says what to install), but a
    connection string can still be built: it names the bundled driver, or Driver 18.
    """
    try:
        import pyodbc
    except ImportError:
        return bundled_driver() or DEFAULT_DRIVER
    if DEFAULT_DRIVER in pyodbc.drivers():
        return DEFAULT_DRIVER
    return bundled_driver() or DEFAULT_DRIVER


def parse_dsn(dsn: str) -> tuple[dict[str, str], str]:
    """Return ``(odbc_attributes, where)`` of an ``mssql://`` URL or an ODBC connection string.

    ``where`` is ``host:port/database`` without credentials, for error messages. A URL's query
    parameters pass through as ODBC attributes (``?Encrypt=no&TrustServerCertificate=yes``).
    """
    text = dsn.strip().removeprefix("odbc:")
    attrs: dict[str, str] = {}
    if "://" in text:
        url = urlsplit(text)
        try:
            url_port = url.port
        except ValueError:
            raise ConfigurationError(
                "the SQL Server connection URL is not valid: its port is not a port number (1..65535)"
            ) from None
        attrs["SERVER"] = f"tcp:{url.hostname or 'localhost'},{url_port or 1433}"
        if url.path.strip("/"):
            attrs["DATABASE"] = unquote(url.path.strip("/"))
        if url.username:
            attrs["UID"] = unquote(url.username)
        if url.password:
            attrs["PWD"] = unquote(url.password)
        for k, v in parse_qsl(url.query):
            attrs[k.upper() if k.lower() in ("driver", "encrypt") else k] = v
    else:
        for part in _split_odbc(text):
            key, _, value = part.partition("=")
            if key.strip():
                attrs[key.strip().upper()] = value.strip()
    server = attrs.get("SERVER", "localhost").removeprefix("tcp:")
    host, _, port = server.partition(",")
    where = f"{host or 'localhost'}:{port or 1433}/{attrs.get('DATABASE', '')}"
    return attrs, where


def _split_odbc(text: str) -> list[str]:
    """Split an ODBC connection string on ``;`` outside ``{...}`` values."""
    parts, cur, depth = [], "", 0
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth = max(0, depth - 1)
        if ch == ";" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def odbc_connection_string(attrs: Mapping[str, str], connect_timeout: float) -> str:
    """Return an ODBC connection string for ``attrs`` (driver defaulted, values braced when needed)."""
    out = dict(attrs)
    out.setdefault("DRIVER", default_driver())
    out.setdefault("LoginTimeout", str(max(1, int(connect_timeout))))
    out.setdefault("APP", "airflow-dbqueue")

    def value(v: str) -> str:
        if v.startswith("{") or not any(c in v for c in ";{}= "):
            return v
        return "{" + v.replace("}", "}}") + "}"

    return ";".join(f"{k}={value(str(v))}" for k, v in out.items())


# -- errors ----------------------------------------------------------------------------------------

_NATIVE = re.compile(r"\((\d+)\)\s*\(SQL\w+\)\s*$")
_UNAVAILABLE_STATES = frozenset({"08001", "08S01", "08004", "08007", "HYT00", "HYT01", "28000", "IM002"})
_UNINSTALLED = 208  # Invalid object name
_RAISED = 50000  # RAISERROR with a message text (the ring's procedures)
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


_STEP_BLOCK = re.compile(r"v([0-9]+)_[a-z0-9_]+")


def schema_steps() -> tuple[int, list[tuple[int, list[str]]]]:
    """Return ``(latest, [(version, [batch, ...])])`` of ``schema.sql``, versions 1..latest in order.

    Block ``schema`` is version 1; a block named ``vN_<what>`` belongs to version N (one batch each: a
    CREATE PROCEDURE must be alone in its batch). A fresh install runs every step; an install at version
    k runs the steps after k. Both run the same text, so a migrated schema is the fresh one.
    """
    text = read_text(_PKG, "schema.sql")
    m = re.search(r"SCHEMA_VERSION:\s*(\d+)", text)
    if not m:
        raise SchemaError("schema.sql does not declare its SCHEMA_VERSION")
    latest = int(m.group(1))
    steps: dict[int, list[str]] = {}
    for name, body in parse_named_queries(text).items():
        step = _STEP_BLOCK.fullmatch(name)
        if name == "schema":
            steps.setdefault(1, []).append(body)
        elif step:
            steps.setdefault(int(step.group(1)), []).append(body)
        else:
            raise SchemaError(f"schema.sql block {name!r} is neither 'schema' nor named vN_<what>")
    if sorted(steps) != list(range(1, latest + 1)):
        raise SchemaError(f"schema.sql has steps {sorted(steps)}, not 1..{latest} (its SCHEMA_VERSION)")
    return latest, sorted(steps.items())


def schema_sql() -> tuple[int, str]:
    """Return ``(latest version, sql)`` with the first version's tables (block ``schema``).

    The later versions' blocks are in :func:`schema_steps`."""
    latest, steps = schema_steps()
    return latest, steps[0][1][0]


class MssqlDatabase(MssqlMaintenance):
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
    ring_groups_supported = False  # one group a ring (docs/limits.md)

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "dbqueue",
        max_size: int = 10,
        connect_timeout: float = 10.0,
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
        return self.compose(load_queries(_PKG, "queries.sql")[name], identifiers)

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

    def render(self, name: str, params: Mapping[str, Any]) -> str:
        """Return the named query as text with its parameters as literals (for a Spark JDBC source)."""
        return render_named(self.query(name), params)

    # -- no LISTEN/NOTIFY --------------------------------------------------------------------------

    def channel(self, queue_id: int) -> str:
        """A name for the queue's wake-ups; SQL Server has none, so waiting pops poll."""
        return f"dbq.{self.schema}.{queue_id}"

    def listening(self, channel: str) -> contextlib.AbstractContextManager[Any]:
        """SQL Server has no LISTEN/NOTIFY: waiting pops poll instead."""
        raise NotImplementedError("SQL Server has no LISTEN/NOTIFY; waiting pops poll")

    # -- schema ------------------------------------------------------------------------------------

    def install(self) -> int:
        """Create or migrate the schema (idempotent; concurrent installs serialize on an app lock).

        A schema that does not exist is created (and recorded as the engine's); an existing one that
        holds no install must be empty, or :class:`ForeignObjectsError` names what it holds and nothing
        is done. Everything the install creates is recorded in ``owned_objects``.

        :return: the schema version now installed.
        """
        latest, steps = schema_steps()
        with self.transaction() as c:
            cur = c.cursor()
            try:
                cur.execute(*to_positional(self.query("install_lock"), {"schema": self.schema}))
                current = self._installed_version(cur)
                refuse_newer_schema(self.schema, self.where, current, latest)
                if current == latest:
                    return latest
                before = self._objects(cur)
                created_schema = False
                if current == 0:
                    if self._scalar(cur, "schema_exists"):
                        refuse_foreign_objects(self.schema, self.where, before)
                    else:
                        cur.execute(self.query("create_schema"))
                        created_schema = True
                for version, batches in steps:
                    if version <= current:
                        continue
                    for batch in batches:
                        cur.execute(self.compose(batch))
                    cur.execute(*to_positional(self.query("record_version"), {"version": version}))
                rings = [
                    r[0]
                    for r in cur.execute(
                        *to_positional(self.query("owned_ring_sequences"), {"schema": self.schema})
                    ).fetchall()
                ]
                own, schema_is_ours = ownership(
                    before,
                    self._objects(cur),
                    fresh=current == 0,
                    created_schema=created_schema,
                    engine_names=engine_objects(read_text(_PKG, "schema.sql")),
                    ring_sequences=rings,
                )
                if schema_is_ours:
                    own.add(("schema", self.schema))
                params = {"kinds": [k for k, _ in sorted(own)], "names": [n for _, n in sorted(own)]}
                cur.execute(*to_positional(self.query("record_owned"), params))
            finally:
                cur.close()
            log.info(
                "%s dbqueue schema %s at version %s on SQL Server",
                "installed" if current == 0 else f"migrated from version {current}:",
                self.schema,
                latest,
            )
        return latest

    def _scalar(self, cur: Any, name: str) -> Any:
        row = cur.execute(*to_positional(self.query(name), {"schema": self.schema})).fetchone()
        return row[0] if row else None

    def _installed_version(self, cur: Any) -> int:
        """The version of the install in the schema (0: none), read on ``cur``'s transaction."""
        if not self._scalar(cur, "schema_installed"):
            return 0
        got = cur.execute(self.query("schema_version")).fetchone()
        return int(got[0]) if got else 0

    def _objects(self, cur: Any) -> list[SchemaObject]:
        rows = cur.execute(*to_positional(self.query("schema_objects"), {"schema": self.schema})).fetchall()
        return [SchemaObject(str(kind), str(name), str(identity)) for kind, name, identity in rows]

    def drop_schema(self) -> None:
        """Drop what the engine created in the schema, and the schema when it is the engine's and empty.

        What is dropped is what ``owned_objects`` lists (and the rings' sequences, which ``rings``
        lists); an install of an older version is migrated first, which records it. Objects that are
        not the engine's stay, and so does the schema that holds them. When an object that is not the
        engine's refers to one of its tables (a view, a foreign key), :class:`ForeignObjectsError` names
        it and nothing is dropped. A schema without an install is left alone.
        """
        with self.transaction() as c:
            cur = c.cursor()
            try:
                cur.execute(*to_positional(self.query("install_lock"), {"schema": self.schema}))
                current = self._installed_version(cur) if self._scalar(cur, "schema_exists") else 0
            finally:
                cur.close()
        if current == 0:
            log.info(
                "dbqueue schema %s holds no install at %s: nothing to uninstall", self.schema, self.where
            )
            return
        latest = schema_steps()[0]
        if current < latest:
            self.install()  # records what the engine owns, as it does for any older install
        with self.transaction() as c:
            cur = c.cursor()
            try:
                cur.execute(*to_positional(self.query("install_lock"), {"schema": self.schema}))
                refuse_newer_schema(self.schema, self.where, self._installed_version(cur), latest)
                owned = {(str(k), str(n)) for k, n in cur.execute(self.query("owned_objects")).fetchall()}
                rings = cur.execute(
                    *to_positional(self.query("owned_ring_sequences"), {"schema": self.schema})
                ).fetchall()
                for (name,) in rings:
                    cur.execute(self.query("drop_owned_sequence", {"sequence": str(name)}))
                present = [o for o in self._objects(cur) if o.key in owned]
                for kind, query, ident in (
                    ("procedure", "drop_owned_routine", "routine"),
                    ("function", "drop_owned_routine", "routine"),  # they refer to tables: before them
                    ("table", "drop_owned_table", "table"),
                    ("sequence", "drop_owned_sequence", "sequence"),
                ):
                    for o in present:
                        if o.kind == kind and o.name != "owned_objects":
                            cur.execute(self.query(query, {ident: o.name}))
                if ("table", "owned_objects") in {o.key for o in present}:
                    cur.execute(self.query("drop_owned_table", {"table": "owned_objects"}))
                left = self._objects(cur)
                if ("schema", self.schema) in owned and not left:
                    cur.execute(self.query("drop_owned_schema"))
                    log.info("uninstalled dbqueue schema %s at %s", self.schema, self.where)
                else:
                    log.info(
                        "uninstalled dbqueue from schema %s at %s; the schema stays (%s)",
                        self.schema,
                        self.where,
                        f"it holds {describe_objects(left)}" if left else "the engine did not create it",
                    )
            finally:
                cur.close()
