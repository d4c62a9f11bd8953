"""The seam between the queue designs and a database: what a dialect offers the engine.

A dialect (``dialects/postgres``, ``dialects/mssql``) holds all of one database's SQL as named blocks
under the same names, and a class that runs them. The designs (``table.py``), the client and
maintenance (``engine/maintenance/``) only call the methods of :class:`Database` below, so they never
know which database they run on; what maintenance asks (timeouts of a session, index surveys, plans and
online rebuilds) each dialect answers in its ``maintenance.py``, and a driver's errors reach them only
as the engine's (:class:`LockTimeoutError`, :class:`StatementTimeoutError`, ...).

Connections are the objects of each dialect's own database driver; callers pass
back what :meth:`Database.transaction` gave them (exactly-once work), so they are typed
:data:`DbConnection` here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any, Protocol, TypeAlias, runtime_checkable
from urllib.parse import urlsplit

from airflow_dbqueue.engine.dialects.indexes import IndexStep, IndexSurvey
from airflow_dbqueue.engine.errors import ConfigurationError, ForeignObjectsError, SchemaError
from airflow_dbqueue.engine.sqlfile import parse_named_queries

DbConnection: TypeAlias = Any
"""A connection of the dialect's database driver, with a transaction open."""

AsyncDbConnection: TypeAlias = Any
"""An async connection of the dialect's database driver (PostgreSQL only), in autocommit:
what async observers (a trigger) run :meth:`Database.afetchone` and :meth:`Database.alisten` on."""

POSTGRESQL = "postgresql"
MSSQL = "mssql"
DIALECTS = (POSTGRESQL, MSSQL)

MSSQL_URL_SCHEMES = ("mssql", "mssql+pyodbc", "sqlserver")
"""The URL schemes of a connection string that names a SQL Server database (SQLAlchemy's among them)."""

DEFAULT_SCHEMA = "dbqueue"
"""The schema that holds the queue tables unless another is named."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds before an unreachable database raises :class:`DatabaseUnavailableError`."""

POOLER_NONE = "none"
"""The engine reaches the server directly, or through a pooler in session mode (one server connection a
client connection for as long as it lasts): sessions keep what they set up."""
POOLER_SESSION = "session"
"""A pooler in session mode: the same as :data:`POOLER_NONE` to the engine, named for the docs' sake."""
POOLER_TRANSACTION = "transaction"
"""A pooler that hands each transaction to whichever server connection is free (PgBouncer's
transaction mode, RDS Proxy, Supavisor, pgcat, Odyssey): nothing may outlive a transaction."""
POOLERS = (POOLER_NONE, POOLER_SESSION, POOLER_TRANSACTION)


def check_pooler(pooler: str | None) -> str:
    """Return what ``pooler`` names (:data:`POOLER_NONE` for None or ``session``), or raise
    :class:`ConfigurationError` naming the accepted values."""
    value = POOLER_NONE if pooler is None else str(pooler).strip().lower()
    if value not in POOLERS:
        raise ConfigurationError(f"pooler must be one of {', '.join(POOLERS)}, got {pooler!r}")
    return POOLER_NONE if value == POOLER_SESSION else value


class Listener(Protocol):
    """A wake-up source: :meth:`wait` returns True when something may have arrived; :meth:`pass_on`
    hands a wake to another waiter of the same queue once this one took something."""

    def wait(self, timeout: float) -> bool: ...

    def pass_on(self) -> None: ...


class NamedStatements(Protocol):
    """What runs a dialect's named queries on its schema: the part of :class:`Database` that the
    dialect's own mixins (its maintenance) call on the class they are mixed into."""

    schema: str

    def fetchall(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: DbConnection | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> list[tuple[Any, ...]]: ...

    def fetchone(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: DbConnection | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> tuple[Any, ...] | None: ...

    def execute(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        conn: DbConnection | None = None,
        *,
        identifiers: Mapping[str, str] | None = None,
    ) -> int: ...


@runtime_checkable
class Database(NamedStatements, Protocol):
    """One dbqueue schema on one database, through one driver."""

    dialect_name: str
    where: str
    dsn: str
    #: True when the database can wake a waiting pop (LISTEN/NOTIFY); False means polling.
    supports_notify: bool
    #: True when a ring's push of one takes a floor its caller read earlier (query ``ring_floor``)
    #: instead of reading the floor on every call.
    ring_push_takes_floor: bool
    #: True when a pop of payloads only has statements of its own that send one column a message
    #: (queries ``pop_take_payloads``, ``ring_take_payloads``).
    payload_pops: bool
    #: False when no statement of a session may be prepared (PostgreSQL behind a transaction pooler):
    #: a statement other than a call of the schema's functions is then planned on every call, so the
    #: designs take the functions' paths, whose inner plans the server keeps a session (``ring_take``
    #: rather than ``ring_take_one``).
    prepares_statements: bool

    def close(self) -> None: ...

    def install(self) -> int: ...

    def drop_schema(self) -> None:
        """Drop what the engine created in the schema (its own catalogue ``owned_objects`` says what),
        and the schema itself when the engine created it and nothing else is left in it."""
        ...

    def render(self, name: str, params: Mapping[str, Any]) -> str: ...

    def transaction(self, conn: DbConnection | None = None) -> contextlib.AbstractContextManager[Any]: ...

    def translate_errors(self) -> contextlib.AbstractContextManager[None]: ...

    def in_transaction(self, conn: DbConnection) -> bool: ...

    def guarded(self, conn: DbConnection | None) -> contextlib.AbstractContextManager[Any]:
        """Yield what to pass as ``conn`` so that a statement that fails leaves ``conn``'s transaction
        as it was before (a savepoint where one is needed); None stays None (a pooled connection)."""
        ...

    def channel(self, queue_id: int) -> str: ...

    def listening(self, channel: str) -> contextlib.AbstractContextManager[Any]: ...

    # -- async observers (a trigger, a deferrable sensor) ------------------------------------------

    #: True when the dialect's driver has async connections (:meth:`aconnect`) for :meth:`afetchone`,
    #: :meth:`alisten` and :meth:`anotifies`; False means observers poll with the synchronous queries.
    async_observers: bool

    async def aconnect(self, application_name: str) -> AsyncDbConnection:
        """Open an async connection of its own to the database, in autocommit; the caller closes it."""
        ...

    async def afetchone(
        self, aconn: AsyncDbConnection, name: str, params: Mapping[str, Any]
    ) -> tuple[Any, ...] | None:
        """Run the named query on the caller's async connection; return its first row (None: none)."""
        ...

    async def alisten(self, aconn: AsyncDbConnection, channel: str) -> None:
        """LISTEN on ``channel`` on the caller's async connection."""
        ...

    async def anotifies(self, aconn: AsyncDbConnection, timeout: float | None) -> set[str]:
        """The channels of the next NOTIFY on ``aconn`` (and any that arrived with it), or none after
        ``timeout`` seconds (None: no limit)."""
        ...

    # -- what maintenance asks (engine/maintenance/; each dialect's maintenance.py answers) ----------

    #: The schema's tables, in the order the vacuum step visits them.
    tables: tuple[str, ...]
    #: Rows one statement may lock before the database may turn them into a table lock (None: never).
    escalation_rows: int | None
    #: ``(statement, note)`` of what the vacuum step runs where the database has no VACUUM (None: it has).
    no_vacuum: tuple[str, str] | None
    #: What a transaction open too long holds back on this database, for the horizon check's warning.
    horizon_warning: str
    #: Why the ring compaction has nothing to do on this database (None: it runs).
    ring_compaction_skipped: str | None
    #: Why a failed online rebuild leaves nothing behind (None: it may leave an index to drop,
    #: :meth:`leftovers_of`).
    leftovers_note: str | None
    #: Index entry counts come from table statistics, so a rebuild decision wants them fresh.
    index_counts_need_analyze: bool

    def dedicated_connection(self, application_name: str) -> contextlib.AbstractContextManager[Any]:
        """A connection of its own (not pooled, autocommit), closed on exit with whatever it holds."""
        ...

    def session_timeouts(
        self, conn: DbConnection, *, statement_s: float, lock_s: float
    ) -> contextlib.AbstractContextManager[None]:
        """Bound every statement of ``conn`` (a dedicated connection) for the block: a statement that
        runs past ``statement_s`` raises :class:`StatementTimeoutError`, one that waits past ``lock_s``
        for a lock :class:`LockTimeoutError`."""
        ...

    def describe_statement_timeout(self, timeout_s: float) -> str:
        """How a message names the limit a :class:`StatementTimeoutError` of ``timeout_s`` hit."""
        ...

    def ring_laid_out_bytes(self, capacity: int, slot_bytes: int) -> int:
        """The size a ring's slots table was laid out in (where :attr:`ring_compaction_skipped` is None)."""
        ...

    def index_survey(self) -> IndexSurvey:
        """Every index of the schema with its size and a bloat estimate."""
        ...

    def index_plan(
        self,
        survey: IndexSurvey,
        *,
        only: Sequence[str] | None,
        bloat_ratio: float,
        min_bloat_bytes: int,
        fragmentation_pct: float,
    ) -> list[IndexStep]:
        """The steps that keep the indexes small, in the order to take them (``only``: exactly these
        indexes, bloated or not)."""
        ...

    def rebuild_index(self, conn: DbConnection, step: IndexStep, timeout_s: float) -> bool:
        """Rebuild ``step``'s index online on ``conn`` within ``timeout_s``; False when the index is no
        longer there."""
        ...

    def drop_index(self, conn: DbConnection, step: IndexStep, timeout_s: float) -> None:
        """Drop ``step``'s index (a leftover of a failed rebuild) online on ``conn`` within ``timeout_s``."""
        ...

    def leftovers_of(self, index: str) -> list[IndexStep]:
        """The drops of what a failed rebuild of ``index`` left behind."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class SchemaObject:
    """One object of a schema as the database's catalog lists it; ``kind`` and ``name`` are its key."""

    kind: str
    """``table``, ``sequence``, ``function``, ``procedure``, ``view`` ... as the dialect names it."""
    name: str
    identity: str = dataclasses.field(default="", compare=False)
    """How the database describes it (schema-qualified, with a function's arguments), for messages."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.name)


_CREATES = re.compile(
    r"^\s*CREATE\s+(?:OR\s+(?:REPLACE|ALTER)\s+)?(TABLE|SEQUENCE|FUNCTION|PROCEDURE)\s+\{schema\}\.(\w+)",
    re.IGNORECASE | re.MULTILINE,
)


def engine_objects(sql_text: str) -> frozenset[tuple[str, str]]:
    """Return the ``(kind, name)`` of every table, sequence, function and procedure that a SQL file of
    the dialect creates in ``{schema}``."""
    return frozenset((kind.lower(), name) for kind, name in _CREATES.findall(sql_text))


def describe_objects(objects: Iterable[SchemaObject], limit: int = 20) -> str:
    """One line naming up to ``limit`` objects (``kind identity``), for an error message."""
    items = [f"{o.kind} {o.identity or o.name}" for o in objects]
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def refuse_foreign_objects(schema: str, where: str, found: list[SchemaObject]) -> None:
    """Raise :class:`ForeignObjectsError` when a schema that holds no dbqueue install holds anything:
    a fresh install goes only into a schema of its own, or an empty one."""
    if found:
        raise ForeignObjectsError(
            f"schema {schema!r} at {where} already holds {len(found)} object(s) that are not the "
            f"engine's: {describe_objects(found)}. Nothing was installed: give the queues a schema of "
            "their own (one that does not exist yet, or an empty one)",
            [f"{o.kind} {o.identity or o.name}" for o in found],
        )


OWNED_TABLE = ("table", "owned_objects")
"""The engine's catalogue of what it created in a schema: a table of the schema itself."""


def ownership(
    before: list[SchemaObject],
    after: list[SchemaObject],
    *,
    fresh: bool,
    created_schema: bool,
    engine_names: frozenset[tuple[str, str]],
    ring_sequences: Iterable[str],
) -> tuple[set[tuple[str, str]], bool]:
    """Return what a SQL Server install should record in the engine's catalogue: ``(keys, schema_is_ours)``.

    Every object the install created (in ``after`` but not in ``before``) is the engine's. The schema
    is the engine's when this install created it. An install made before the engine kept a catalogue
    (``before`` holds no ``owned_objects`` table) was made by ``CREATE SCHEMA IF NOT EXISTS``: its
    objects are recognised by the names the engine's schema file creates (``engine_names``), and its
    schema counts as the engine's when it holds nothing else (but the rings' own sequences).
    """
    before_keys = {o.key for o in before}
    own = {o.key for o in after if o.key not in before_keys}
    if fresh:
        return own, created_schema
    if OWNED_TABLE in before_keys:
        return own, False
    rings = {("sequence", name) for name in ring_sequences}
    own |= {o.key for o in after if o.key in before_keys and o.key in engine_names}
    foreign = [o for o in before if o.key not in engine_names and o.key not in rings]
    return own, not foreign


FIRST_RELEASE = "1.0"
"""The release whose schema is each dialect's baseline: the oldest install that this code upgrades."""
FUNCTIONS_KIND = "functions"
"""The kind of the ``owned_objects`` row whose name is the SHA-256 of the routines file last applied."""

_RELEASE = re.compile(r"([0-9]+)\.([0-9]{1,2})")
_DECLARED = re.compile(r"SCHEMA_VERSION:\s*(\S+)")
_MIGRATION_FILE = re.compile(r"([0-9]+\.[0-9]{1,2})\.sql")


def release_version(release: str) -> int:
    """The schema version a release records in ``schema_version``: ``major * 100 + minor``
    (``"1.0"`` is 100, ``"1.1"`` 101)."""
    m = _RELEASE.fullmatch(release)
    if not m:
        raise SchemaError(f"{release!r} is not a release name (major.minor, as 1.0 or 1.12)")
    return int(m.group(1)) * 100 + int(m.group(2))


def declared_version(text: str, filename: str) -> int:
    """The version a schema file declares in its ``SCHEMA_VERSION: <release>`` line."""
    m = _DECLARED.search(text)
    if not m:
        raise SchemaError(f"{filename} does not declare its SCHEMA_VERSION")
    return release_version(m.group(1))


def release_migrations(package: str) -> list[tuple[int, list[str]]]:
    """Return ``[(version, [block, ...])]`` of the package's ``migrations/<release>.sql`` files in
    release order: one a release that changed a table, each upgrading an install of the release
    before it. A file's named blocks run in file order, each as one statement batch."""
    folder = resources.files(package).joinpath("migrations")
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        m = _MIGRATION_FILE.fullmatch(entry.name)
        if not m:
            raise SchemaError(f"migration file {entry.name!r} is not named for its release (1.1.sql)")
        found.append(
            (release_version(m.group(1)), list(parse_named_queries(entry.read_text("utf-8")).values()))
        )
    return sorted(found)


def digest(text: str) -> str:
    """The SHA-256 of a routines file, as ``owned_objects`` records it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def refuse_older_schema(schema: str, where: str, current: int) -> None:
    """Raise :class:`SchemaError` when a schema holds an install made by a development version before
    the first release (a schema version below :data:`FIRST_RELEASE`'s): this code does not upgrade it."""
    if 0 < current < release_version(FIRST_RELEASE):
        raise SchemaError(
            f"schema {schema!r} at {where} holds an install of a development version of airflow-dbqueue "
            f"made before release {FIRST_RELEASE} (schema version {current}), which this version cannot "
            "upgrade or uninstall. Reinstall: uninstall it with the version that made it "
            "(DbQueue.uninstall()), or drop the schema with everything in it (DROP SCHEMA ... CASCADE), "
            "then install again"
        )


def refuse_newer_schema(schema: str, where: str, current: int, latest: int) -> None:
    """Raise :class:`SchemaError` when an installed schema is newer than this code knows (installs
    and migrations never downgrade or touch it)."""
    if current > latest:
        raise SchemaError(
            f"schema {schema!r} at {where} is at version {current}, newer than this code's {latest}; "
            "upgrade airflow-dbqueue"
        )


def dialect_of_dsn(dsn: str) -> str:
    """Return the dialect a connection string names: ``postgresql`` or ``mssql``.

    SQL Server is named by a URL scheme of :data:`MSSQL_URL_SCHEMES` (``mssql://``) or by
    an ODBC connection string (``DRIVER=...;SERVER=...``, or ``odbc:`` followed by one). Everything else
    is a PostgreSQL connection string or URL, for libpq.
    """
    text = dsn.strip()
    scheme = urlsplit(text).scheme.lower() if "://" in text else ""
    if scheme in ("postgres", "postgresql"):
        return POSTGRESQL
    if scheme in MSSQL_URL_SCHEMES:
        return MSSQL
    lowered = text.lower()
    if lowered.startswith("odbc:") or (
        ";" in text and any(k in lowered for k in ("driver=", "server=", "dsn="))
    ):
        return MSSQL
    return POSTGRESQL


def make_database(
    dsn: str,
    *,
    dialect: str | None = None,
    schema: str,
    pool_size: int,
    connect_timeout: float,
    pooler: str | None = None,
    listen_dsn: str | None = None,
) -> Database:
    """Build the dialect's :class:`Database` for ``dsn`` (no I/O: pools open on first use).

    ``pooler`` and ``listen_dsn`` are PostgreSQL's (see :class:`PostgresDatabase`)."""
    name = (dialect or dialect_of_dsn(dsn)).lower()
    pooler = check_pooler(pooler)
    if name in ("postgres", POSTGRESQL):
        from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase

        return PostgresDatabase(
            dsn,
            schema=schema,
            min_size=1,
            max_size=pool_size,
            connect_timeout=connect_timeout,
            pooler=pooler,
            listen_dsn=listen_dsn,
        )
    if name in (MSSQL, "sqlserver", "odbc"):
        if pooler != POOLER_NONE or listen_dsn:
            raise ConfigurationError(
                "pooler and listen_dsn are PostgreSQL's: SQL Server has no transaction pooler and no LISTEN"
            )
        from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase

        return MssqlDatabase(dsn, schema=schema, max_size=pool_size, connect_timeout=connect_timeout)
    raise ConfigurationError(f"unknown dialect {dialect!r}; choose one of {', '.join(DIALECTS)}")
