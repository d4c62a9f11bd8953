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
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

from airflow_dbqueue.engine.dialects.indexes import IndexStep, IndexSurvey
from airflow_dbqueue.engine.errors import ConfigurationError

DbConnection: TypeAlias = Any
"""A connection of the dialect's database driver, with a transaction open."""

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
    #: True when the table design has deduplication keys on push (queries ``push_with`` and
    #: ``forget_dedup``, the ``dedup`` table).
    push_options: bool
    #: The ring layouts this dialect creates (``slots``; ``rows`` on PostgreSQL: queries ``ring_rows_*``).
    ring_layouts: tuple[str, ...]
    #: True when maintenance counts every table-design queue of the schema with one statement a table
    #: (queries ``stats_all``, ``table_flow_all``, ``sample_insert_all``, ``queue_rates_all`` and
    #: ``upkeep_due``) instead of a statement a queue.
    schema_passes: bool
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

    def render(
        self, name: str, params: Mapping[str, Any], identifiers: Mapping[str, str] | None = None
    ) -> str: ...

    def transaction(self, conn: DbConnection | None = None) -> contextlib.AbstractContextManager[Any]: ...

    def translate_errors(self) -> contextlib.AbstractContextManager[None]: ...

    def in_transaction(self, conn: DbConnection) -> bool: ...

    def guarded(self, conn: DbConnection | None) -> contextlib.AbstractContextManager[Any]:
        """Yield what to pass as ``conn`` so that a statement that fails leaves ``conn``'s transaction
        as it was before (a savepoint where one is needed); None stays None (a pooled connection)."""
        ...

    def channel(self, queue_id: int) -> str: ...

    # -- least-privilege roles ---------------------------------------------------------------------

    def grant(self, role: str, queue_id: int | None, actions: Sequence[str]) -> list[str]:
        """Let ``role`` take ``actions`` on queue ``queue_id`` (None: every queue); the actions added."""
        ...

    def revoke(self, role: str, queue_id: int | None, actions: Sequence[str]) -> list[str]:
        """Take ``actions`` on ``queue_id`` from ``role``; the actions it held."""
        ...

    def list_grants(self) -> list[tuple[str, str | None, str]]:
        """Every grant: ``(role, queue name or None for every queue, action)``."""
        ...

    def actions_on(self, queue_id: int | None) -> frozenset[str]:
        """What the session's role may do to queue ``queue_id`` (None: to every queue)."""
        ...

    def sees_all_activity(self) -> bool:
        """Whether the session's role sees every other session's transaction (PostgreSQL: superuser or
        ``pg_read_all_stats``, which ``pg_monitor`` has), which the horizon check needs."""
        ...

    def grant_new_ring(self, conn: DbConnection, queue_id: int) -> None:
        """Give a ring just made in ``conn``'s transaction to the roles that hold an action on every queue."""
        ...

    def listening(self, channel: str) -> contextlib.AbstractContextManager[Any]: ...

    def wake_waiter(self, channel: str) -> None:
        """Hand a wake to one pop of this process waiting on ``channel`` (nothing when none waits)."""
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
    #: Why the table design's partition recycling has nothing to do on this database (None: it runs,
    #: with the queries ``table_move_stragglers``, ``table_partitions`` and ``table_empty_partition``).
    table_recycling_skipped: str | None
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
