"""Maintenance of a queue schema, around the clock and without a maintenance window (as Al Zabir's
"Building High Performance Queue in Database" asks of a queue of orders and tasks).

Queue tables die of bloat: every message leaves dead rows and dead index entries behind, and a
queue's indexes see inserts at one end and deletes at the other. :class:`Maintenance` keeps a
schema small and fast while producers and consumers run:

- **continuous archiving**: finished messages older than a retention move from ``done`` (and their
  payloads from ``data``) into ``archive``, in bounded batches of one statement each, with a pause
  between batches and a time budget per run; an archive retention deletes archived rows later, the
  same way. Each batch skips rows other sessions hold and holds its own row locks for one short
  statement, so push, pop and ack never wait for it.
- **design upkeep**: :meth:`Queue.maintain` of every queue (expired leases back to ready or failed
  for the table design; the ring design adds the recovery of its gaps there).
- **VACUUM / ANALYZE** of the schema's tables (``SKIP_LOCKED``), and a warning naming whatever holds
  back the xmin horizon (a long transaction, a replication slot, a prepared transaction), which
  keeps any VACUUM from removing dead rows.
- **online index rebuild**: ``REINDEX INDEX CONCURRENTLY`` of B-tree indexes whose size is well past
  what their entries need, and clean-up of the INVALID index a failed concurrent rebuild leaves.
- **metrics**: depth by state, age of the oldest ready message, push and finish rates, table sizes,
  dead rows and index bloat, as one JSON-safe dict.

Steps that change things hold the schema's maintenance lock (a session-level advisory lock on a
connection of their own), so two runs never fight: the second waits up to ``lock_wait_s`` and then
skips, saying which session holds the lock. A :class:`Maintenance` object is not thread-safe; use
one per thread.

**SQL Server** runs the same steps through the same named queries (``dialects/mssql/queries.sql``),
with its own meaning where PostgreSQL's has none: the lock is ``sp_getapplock`` owned by the session of
the run's own connection; archiving is ``DELETE TOP (n)`` with ``READPAST`` in one short transaction a
batch; there is no VACUUM (ghost records are the server's cleanup task's), so that step runs ``UPDATE
STATISTICS``; bloat is read from ``sys.dm_db_index_physical_stats`` (page density against the fill
factor, and fragmentation), and a bloated index is rebuilt with ``ALTER INDEX ... REBUILD WITH (ONLINE =
ON)`` where the engine edition has online index operations, ``REORGANIZE`` where it does not, decided
when the step runs and reported; a failed rebuild rolls back and leaves nothing to clean up; the
horizon check names long transactions (and snapshot transactions), which hold back log truncation and
version cleanup. None of it has run against a SQL Server yet (none can run where it was written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DbQueueError,
    LockTimeoutError,
    QueueNotFoundError,
    TransientDatabaseError,
)
from airflow_dbqueue.engine.queue import check_seconds

if TYPE_CHECKING:
    from airflow_dbqueue.engine.client import DbQueue
    from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase
    from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase
    from airflow_dbqueue.engine.queue import Queue

log = logging.getLogger(__name__)

APPLICATION_NAME = "airflow-dbqueue-maintenance"
"""``application_name`` of the connection a maintenance step runs on (and holds its lock with)."""
TABLES = (
    "meta",
    "data",
    "done",
    "archive",
    "queues",
    "batches",
    "ring_lanes",
    "ring_leases",
    "ring_retry",
    "ring_slots",
    "ring_failed",
)
"""The schema's tables, in the order VACUUM visits them (the dequeue paths first: a ring's pops update
``ring_lanes`` and write ``ring_leases``; its slots are overwritten in place by pushes)."""
MSSQL_TABLES = (
    "meta",
    "data",
    "done",
    "archive",
    "queues",
    "batches",
    "batch_items",
    "ring_lanes",
    "ring_leases",
    "ring_retry",
    "ring_push_lanes",
    "ring_slots",
    "ring_failed",
)
"""The tables of a schema on SQL Server (the batch ledger's items have a table of their own)."""
MSSQL_ESCALATION_ROWS = 5000
"""Rows one statement may lock on SQL Server before lock escalation may turn them into a table lock."""
MSSQL_NO_VACUUM = (
    "SQL Server has no VACUUM: the rows a DELETE leaves (ghost records) are removed by the server's ghost "
    "cleanup task; this step ran UPDATE STATISTICS"
)
MSSQL_NO_LEFTOVERS = (
    "nothing to clean up on SQL Server: a failed ALTER INDEX ... REBUILD rolls back and leaves no "
    "half-built index (PostgreSQL's REINDEX CONCURRENTLY can leave an INVALID one)"
)
_LEFTOVER = re.compile(r"_cc(new|old)\d*$")
"""Suffixes PostgreSQL gives the indexes of a REINDEX CONCURRENTLY in progress (or one that failed)."""
MiB = 1024 * 1024
REBUILD_WAITS_FOR = ("transaction", "prepared transaction", "snapshot transaction")
RING_TABLES = ("ring_slots", "ring_lanes", "ring_leases", "ring_retry")
"""The tables :meth:`Maintenance.compact_rings` rewrites when they outgrew their size."""
"""The kinds of :class:`XminHolder` an online index rebuild waits for (not a replication slot)."""


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, dt.datetime) else value


def _ms(seconds: float) -> str:
    return str(max(0, int(seconds * 1000)))


# -- results ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class BatchResult:
    """What a batched step (archiving, archive retention) did in one run."""

    schema: str
    step: str
    """``archive`` or ``purge_archive``."""
    rows: int
    """Messages moved to the archive (``archive``) or deleted from it (``purge_archive``)."""
    batches: int
    seconds: float
    stopped: str
    """Why the run ended: ``drained`` (a short batch: nothing old enough is left), ``time budget`` or
    ``skipped`` (another run holds the lock; see ``skipped``)."""
    skipped: str | None = None
    discarded: int = 0
    """``archive``: finished messages of queues dropped meanwhile, deleted with their payloads instead
    of archived (nothing is archived for a queue that no longer exists)."""
    notes: tuple[str, ...] = ()
    """Queues named for the step that no longer exist, skipped."""

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict (for logs, XCom and the CLI)."""
        return {**dataclasses.asdict(self), "notes": list(self.notes)}


@dataclasses.dataclass(frozen=True, slots=True)
class IndexHealth:
    """One index of the schema, with an estimate of the size its entries need."""

    index: str
    table: str
    method: str
    valid: bool
    size_bytes: int
    entries: int | None
    """Entries counted by the last VACUUM or ANALYZE (``None`` when never counted)."""
    expected_bytes: int | None
    """Size a freshly built B-tree of ``entries`` entries would have (``None`` for other methods, or
    when ``entries`` is unknown). SQL Server: the size with the leaf pages filled to the fill factor
    (:func:`mssql_expected_bytes`)."""
    build_running: bool
    """An index build (CREATE INDEX or REINDEX CONCURRENTLY) is running on the table right now (on SQL
    Server: an index operation runs in the database, or a resumable one is paused on the table)."""
    fragmentation_pct: float | None = None
    """SQL Server: logical fragmentation of the leaf level, in percent (``None`` on PostgreSQL)."""
    page_density_pct: float | None = None
    """SQL Server: how full the leaf pages are on average, in percent (``None`` on PostgreSQL)."""
    fill_factor: int | None = None
    """SQL Server: the index's fill factor (100 for the default 0; ``None`` on PostgreSQL)."""

    @property
    def bloat_ratio(self) -> float | None:
        """``size_bytes / expected_bytes``: about 1 for a fresh index, more as it bloats."""
        if not self.expected_bytes:
            return None
        return self.size_bytes / self.expected_bytes

    @property
    def bloat_bytes(self) -> int | None:
        """Bytes beyond the expected size (0 when there are none)."""
        if self.expected_bytes is None:
            return None
        return max(0, self.size_bytes - self.expected_bytes)

    @property
    def leftover(self) -> bool:
        """An INVALID index left by a failed concurrent rebuild (``<name>_ccnew``, ``<name>_ccold``)."""
        return not self.valid and _LEFTOVER.search(self.index) is not None

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict (without the SQL Server measures on PostgreSQL)."""
        out = dataclasses.asdict(self)
        if self.fill_factor is None:
            for key in ("fragmentation_pct", "page_density_pct", "fill_factor"):
                del out[key]
        ratio = self.bloat_ratio
        out["bloat_ratio"] = None if ratio is None else round(ratio, 3)
        out["bloat_bytes"] = self.bloat_bytes
        return out


def expected_btree_bytes(entries: float, key_width: int, fillfactor: int, block_size: int) -> int:
    """Estimate the size of a freshly built B-tree index of ``entries`` entries.

    Each leaf entry is an 8-byte index tuple header plus the key columns, MAXALIGNed, plus a 4-byte
    line pointer; leaf pages are filled to ``fillfactor`` percent of what the page header (24 bytes) and
    the B-tree special space (16 bytes) leave. Inner pages hold one downlink a leaf page (none when a
    single leaf is the root), and the metapage is one more. Deduplication makes some indexes smaller
    than this: the estimate errs towards "not bloated".
    """
    tuple_bytes = 4 + 8 * math.ceil((8 + max(0, key_width)) / 8)
    usable = (block_size - 24 - 16) * max(10, min(100, fillfactor)) / 100
    leaf = max(1, math.ceil(max(0.0, entries) * tuple_bytes / usable))
    inner = math.ceil(leaf * tuple_bytes / usable) if leaf > 1 else 0
    return (1 + leaf + inner) * block_size


def ring_slots_laid_out_bytes(capacity: int, slot_bytes: int, block_size: int = 8192) -> int:
    """The heap size ``ring_create`` lays a PostgreSQL ring's slots out in.

    It writes every slot with a filler of ``5/4 slot_bytes`` at fillfactor 50 and then empties it, so
    a page holds as many slots as fit that filler row (24 bytes of tuple header, 20 of columns, the
    filler; 8-byte aligned; a 4-byte line pointer each) in the half page the fillfactor leaves, plus
    the one placed when the page crosses it. Checked against the size of rings made by create_queue.
    """
    row = -(-(24 + 20 + slot_bytes * 5 // 4) // 8) * 8
    per_page = max(1, (block_size - 24 - 4 - block_size // 2 - row) // (row + 4) + 1)
    return -(-capacity // per_page) * block_size


def mssql_expected_bytes(
    size_bytes: int, leaf_pages: int | None, page_density_pct: float | None, fill_factor: int
) -> int | None:
    """Estimate the size a SQL Server index would have with its leaf pages filled to its fill factor.

    The leaf level holds ``leaf_pages`` pages, ``page_density_pct`` percent full on average; rebuilt,
    it would need ``leaf_pages * density / fill_factor`` pages. The rest of ``size_bytes`` (upper
    levels, LOB pages) is taken as it is. ``None`` when the leaf level was not measured (a disabled
    index, or no ``VIEW DATABASE STATE``).
    """
    if leaf_pages is None or page_density_pct is None:
        return None
    leaf_bytes = leaf_pages * 8192
    needed = math.ceil(leaf_pages * page_density_pct / max(1, min(100, fill_factor))) if leaf_pages else 0
    return max(8192, size_bytes - leaf_bytes + needed * 8192)


def mssql_rebuild_reason(
    h: IndexHealth, *, bloat_ratio: float, min_bloat_bytes: int, fragmentation_pct: float
) -> str | None:
    """Return why a SQL Server index should be rebuilt (or reorganized), or ``None`` to leave it.

    Bloated: at least ``bloat_ratio`` times the size its leaf pages would have at the fill factor, and
    ``min_bloat_bytes`` above it. Fragmented: at least ``fragmentation_pct`` percent logical
    fragmentation, in an index of at least ``min_bloat_bytes`` (small indexes gain nothing from order).
    """
    ratio, extra = h.bloat_ratio, h.bloat_bytes
    density = f"{h.page_density_pct:.0f}%" if h.page_density_pct is not None else "?"
    if ratio is not None and extra is not None and ratio >= bloat_ratio and extra >= min_bloat_bytes:
        return (
            f"{h.size_bytes} bytes for about {h.expected_bytes} needed (x{ratio:.1f}): leaf pages "
            f"{density} full, fill factor {h.fill_factor}"
        )
    frag = h.fragmentation_pct
    if frag is not None and frag >= fragmentation_pct and h.size_bytes >= min_bloat_bytes:
        return f"{frag:.0f}% fragmented ({h.size_bytes} bytes, leaf pages {density} full)"
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class IndexAction:
    """One thing :meth:`Maintenance.rebuild_indexes` did (or tried) to an index."""

    index: str
    action: str
    """``reindex`` (bloated), ``rebuild invalid`` (an INVALID index of the schema), ``drop leftover``
    (the INVALID index of a failed concurrent rebuild), or ``skip`` (a build runs on its table). On
    SQL Server: ``online rebuild`` or ``reorganize`` (see :func:`rebuild_mode`), or ``skip`` (an index
    operation runs, or the index is disabled)."""
    ok: bool
    seconds: float
    size_before: int | None = None
    size_after: int | None = None
    reason: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict."""
        return dataclasses.asdict(self)


_MssqlAction = tuple[IndexHealth, str, bool, float, str, str | None]
"""What one SQL Server index step did: (index, action, ok, seconds, reason, error)."""


@dataclasses.dataclass(frozen=True, slots=True)
class XminHolder:
    """Something that holds back the xmin horizon, so VACUUM cannot remove dead rows."""

    kind: str
    """``transaction``, ``replication slot`` or ``prepared transaction``."""
    pid: int | None
    name: str
    """The application name (transactions), slot name or prepared transaction's gid."""
    user: str | None
    state: str | None
    age_s: float | None
    xid_age: int | None
    xact_start: str | None
    query_start: str | None
    query: str | None
    """The session's current or last statement (transactions), or the slot type."""

    def describe(self) -> str:
        """One line for a log."""
        age = f"{self.age_s:.0f}s" if self.age_s is not None else "?"
        bits = [f"{self.kind} {self.name!r}"]
        if self.pid is not None:
            bits.append(f"pid {self.pid}")
        if self.user:
            bits.append(f"user {self.user}")
        if self.state:
            bits.append(f"state {self.state}")
        bits.append(f"age {age}, {self.xid_age} transactions" if self.xid_age is not None else f"age {age}")
        if self.query_start:
            bits.append(f"query started {self.query_start}")
        if self.query:
            bits.append(f"query {self.query[:120]!r}")
        return ", ".join(bits)

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class MaintenanceConfig:
    """Settings of a full maintenance run (:meth:`Maintenance.run`). Times are in seconds.

    :param queues: the queues to maintain (archiving, upkeep, metrics); ``None``: every queue.
    :param archive_after_s: finished messages older than this are archived (0: all finished ones).
    :param archive_retention_s: archived messages older than this are deleted; ``None`` keeps them.
    :param batch_size: rows a batch statement moves or deletes.
    :param pause_s: pause between batches.
    :param time_budget_s: the most a batched step (archiving, retention) runs in one call.
    :param vacuum: run VACUUM (ANALYZE) on the schema's tables.
    :param reindex: rebuild bloated B-tree indexes online and clean up INVALID ones.
    :param reindex_bloat_ratio: rebuild an index when its size is at least this many times the estimate.
    :param reindex_min_bytes: ... and at least this many bytes above it.
    :param reindex_fragmentation_pct: SQL Server only: also rebuild an index of at least
        ``reindex_min_bytes`` whose leaf level is at least this many percent fragmented.
    :param reindex_timeout_s: statement and lock timeout of one REINDEX or DROP INDEX CONCURRENTLY.
    :param compact_rings: rewrite ring tables that outgrew their laid-out size (PostgreSQL,
        :meth:`Maintenance.compact_rings`).
    :param compact_bloat_ratio: ... when at least this many times that size,
    :param compact_min_bytes: ... and at least this many bytes above it.
    :param compact_lock_timeout_s: the most a rewrite waits for its exclusive lock (pushes and pops
        queue behind it meanwhile).
    :param lock_wait_s: how long to wait for another run's lock before skipping.
    :param horizon_min_age_s: report transactions (and prepared ones) older than this holding the xmin.
    :param horizon_min_xid_age: report replication slots holding an xmin older than this many transactions.
    :param rate_window_s: window of the push and finish rates.
    :param reclaim_limit: most expired leases a queue's upkeep returns in one call.
    """

    queues: tuple[str, ...] | None = None
    archive_after_s: float = 300.0
    archive_retention_s: float | None = 7 * 24 * 3600.0
    batch_size: int = 1000
    pause_s: float = 0.05
    time_budget_s: float = 60.0
    vacuum: bool = True
    reindex: bool = True
    reindex_bloat_ratio: float = 2.0
    reindex_min_bytes: int = MiB
    reindex_fragmentation_pct: float = 30.0
    reindex_timeout_s: float = 600.0
    compact_rings: bool = True
    compact_bloat_ratio: float = 1.5
    compact_min_bytes: int = 8 * MiB
    compact_lock_timeout_s: float = 2.0
    lock_wait_s: float = 0.0
    horizon_min_age_s: float = 300.0
    horizon_min_xid_age: int = 1_000_000
    rate_window_s: float = 300.0
    reclaim_limit: int = 10_000

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= 100_000:
            raise ConfigurationError(f"maintenance batch_size must be in 1..100000, got {self.batch_size}")
        for name in ("archive_after_s", "pause_s", "time_budget_s", "lock_wait_s", "horizon_min_age_s"):
            check_seconds(f"maintenance {name}", getattr(self, name))
        if self.archive_retention_s is not None:
            check_seconds("maintenance archive_retention_s (or None)", self.archive_retention_s)
        check_seconds("maintenance reindex_timeout_s", self.reindex_timeout_s, positive=True)
        check_seconds("maintenance rate_window_s", self.rate_window_s, positive=True)
        check_seconds("maintenance compact_lock_timeout_s", self.compact_lock_timeout_s, positive=True)
        if (
            not math.isfinite(self.compact_bloat_ratio)
            or self.compact_bloat_ratio < 1
            or self.compact_min_bytes < 0
        ):
            raise ConfigurationError(
                "need a finite compact_bloat_ratio >= 1 and compact_min_bytes >= 0, got "
                f"{self.compact_bloat_ratio} and {self.compact_min_bytes}"
            )
        if not math.isfinite(self.reindex_bloat_ratio):
            raise ConfigurationError(
                f"reindex_bloat_ratio must be a finite number, got {self.reindex_bloat_ratio}"
            )
        if self.reindex_bloat_ratio < 1 or self.reindex_min_bytes < 0 or self.reindex_timeout_s <= 0:
            raise ConfigurationError(
                "need reindex_bloat_ratio >= 1, reindex_min_bytes >= 0 and reindex_timeout_s > 0"
            )
        if not 0 <= self.reindex_fragmentation_pct <= 100:
            raise ConfigurationError(
                f"reindex_fragmentation_pct must be in 0..100, got {self.reindex_fragmentation_pct}"
            )
        if self.rate_window_s <= 0 or self.reclaim_limit < 1:
            raise ConfigurationError("need rate_window_s > 0 and reclaim_limit >= 1")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> MaintenanceConfig:
        """Build a config from a mapping (DAG params, an Airflow Variable); ``None`` values keep defaults.

        Unknown keys raise :class:`ConfigurationError`, so a misspelt setting is not silently ignored.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ConfigurationError(f"unknown maintenance settings {unknown}; known: {sorted(fields)}")
        kwargs = {k: v for k, v in values.items() if v is not None}
        if "queues" in kwargs:
            kwargs["queues"] = tuple(kwargs["queues"]) or None
        # archive_retention_s may be given as -1 or "" to mean "keep forever".
        if "archive_retention_s" in values and values["archive_retention_s"] in ("", -1):
            kwargs["archive_retention_s"] = None
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ConfigurationError(f"bad maintenance settings: {exc}") from None


# -- maintenance -----------------------------------------------------------------------------------


class Maintenance:
    """The maintenance steps of one schema. Obtain it with :meth:`DbQueue.maintenance`.

    Every step can run while producers and consumers run at full speed. Steps that change things
    take the schema's maintenance lock for their duration (unless a :meth:`lock` block holds it
    already); read-only steps (:meth:`index_health`, :meth:`xmin_holders`, :meth:`metrics`) do not.
    """

    def __init__(self, dbq: DbQueue) -> None:
        from airflow_dbqueue.engine.dialects.mssql import MssqlDatabase
        from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase

        db = dbq.db
        if not isinstance(db, PostgresDatabase | MssqlDatabase):
            raise NotImplementedError(f"maintenance is not available on {db.dialect_name}")
        self._dbq = dbq
        self._db: PostgresDatabase | MssqlDatabase = db
        self._ms: MssqlDatabase | None = db if isinstance(db, MssqlDatabase) else None
        self.dialect = db.dialect_name
        self.tables = MSSQL_TABLES if self._ms is not None else TABLES
        """The schema's tables on this dialect, in the order :meth:`vacuum` visits them."""
        self.schema = dbq.schema
        self._held: Any = None
        self._skip_reason: str | None = None
        self._horizon_age: float | None = None

    # -- the lock ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, wait_s: float = 0.0) -> Iterator[bool]:
        """Hold the schema's maintenance lock for the block; yield whether it was obtained.

        Waits up to ``wait_s`` seconds for another run to finish; when it does not, logs which
        session holds the lock and yields ``False`` (the caller skips its work). Nested blocks reuse
        the lock held by the outer one.
        """
        if self._held is not None:
            yield True
            return
        params = {"schema": self.schema}
        with self._db.dedicated_connection(APPLICATION_NAME) as conn:
            deadline = time.monotonic() + max(0.0, wait_s)
            announced = False
            while True:
                row = self._db.fetchone("maintenance_try_lock", params, conn)
                if row and row[0]:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._skip_reason = (
                        f"another maintenance run holds the lock of schema {self.schema!r} "
                        f"({self._describe_holder(conn)})" + (f"; waited {wait_s:g}s" if wait_s > 0 else "")
                    )
                    log.warning("dbqueue maintenance skipped: %s", self._skip_reason)
                    yield False
                    return
                if not announced:
                    log.info(
                        "dbqueue maintenance: waiting up to %gs for the lock of schema %r, held by %s",
                        wait_s,
                        self.schema,
                        self._describe_holder(conn),
                    )
                    announced = True
                time.sleep(min(0.25, left))
            self._held = conn
            self._skip_reason = None
            try:
                yield True
            finally:
                self._held = None
                with contextlib.suppress(DbQueueError):
                    self._db.fetchone("maintenance_unlock", params, conn)

    def _describe_holder(self, conn: Any) -> str:
        try:
            row = self._db.fetchone("maintenance_lock_holder", {"schema": self.schema}, conn)
        except DbQueueError as exc:
            return f"holder unknown: {exc}"
        if row is None:
            return "holder gone since"
        pid, app, addr, connected_s, state = row
        return (
            f"pid {pid}, application {app!r}, client {addr or 'local'}, connected {connected_s:.0f}s, {state}"
        )

    def _conn(self) -> Any:
        assert self._held is not None, "a maintenance step ran outside its lock"
        return self._held

    # -- archiving -----------------------------------------------------------------------------------

    def _queue_filter(self, queues: Sequence[str] | None, notes: list[str]) -> dict[str, Any]:
        if queues is None:
            return {"all_queues": True, "queue_ids": []}
        ids = []
        for name in queues:
            q = self._current(name)
            if q is None:
                notes.append(self._vanished_note(name, "skipped"))
            else:
                ids.append(q.settings.queue_id)
        return {"all_queues": False, "queue_ids": ids}

    def _current(self, name: str) -> Queue | None:
        """The queue of that name as the database has it now (not a handle of a queue dropped since it
        was cached), or None when there is none."""
        try:
            q = self._dbq.queue(name)
            if self._gone(name, q.settings.queue_id):
                q = self._dbq.queue(name)  # created again under the name since, or QueueNotFoundError
        except QueueNotFoundError:
            return None
        return q

    def _vanished_note(self, name: str, what: str) -> str:
        note = f"queue {name!r} no longer exists in schema {self.schema!r} (dropped meanwhile): {what}"
        log.info("dbqueue maintenance: %s", note)
        return note

    def _gone(self, name: str, queue_id: int) -> bool:
        """Whether queue ``name`` (as ``queue_id``) was dropped: asked of the database, not the cache."""
        return self._dbq._refresh_if_dropped(name, queue_id)

    def archive(
        self,
        *,
        older_than_s: float = 300.0,
        batch_size: int = 1000,
        pause_s: float = 0.05,
        time_budget_s: float = 60.0,
        queues: Sequence[str] | None = None,
        lock_wait_s: float = 0.0,
        statement_timeout_s: float = 30.0,
    ) -> BatchResult:
        """Move finished messages older than ``older_than_s`` into the archive, in bounded batches.

        One statement a batch of at most ``batch_size`` messages, ``pause_s`` between batches, and
        no new batch once ``time_budget_s`` is spent. Stops early at a short batch (nothing old
        enough is left). Each batch is its own transaction with a ``statement_timeout``, and a
        ``lock_timeout`` of one second: it never waits long for a lock (and skips locked rows).
        """
        return self._batches(
            "archive_batch",
            "archive",
            older_than_s=older_than_s,
            batch_size=batch_size,
            pause_s=pause_s,
            time_budget_s=time_budget_s,
            queues=queues,
            lock_wait_s=lock_wait_s,
            statement_timeout_s=statement_timeout_s,
        )

    def purge_archive(
        self,
        *,
        older_than_s: float,
        batch_size: int = 1000,
        pause_s: float = 0.05,
        time_budget_s: float = 60.0,
        queues: Sequence[str] | None = None,
        lock_wait_s: float = 0.0,
        statement_timeout_s: float = 30.0,
    ) -> BatchResult:
        """Delete archived messages archived more than ``older_than_s`` ago, in bounded batches."""
        return self._batches(
            "purge_archive_batch",
            "purge_archive",
            older_than_s=older_than_s,
            batch_size=batch_size,
            pause_s=pause_s,
            time_budget_s=time_budget_s,
            queues=queues,
            lock_wait_s=lock_wait_s,
            statement_timeout_s=statement_timeout_s,
        )

    def _batches(
        self,
        query: str,
        step: str,
        *,
        older_than_s: float,
        batch_size: int,
        pause_s: float,
        time_budget_s: float,
        queues: Sequence[str] | None,
        lock_wait_s: float,
        statement_timeout_s: float,
    ) -> BatchResult:
        if not isinstance(batch_size, int) or not 1 <= batch_size <= 100_000:
            raise ConfigurationError(
                f"{step}: batch_size must be an integer in 1..100000, got {batch_size!r}"
            )
        older_than_s = check_seconds(f"{step}: older_than_s", older_than_s)
        pause_s = check_seconds(f"{step}: pause_s", pause_s)
        time_budget_s = check_seconds(f"{step}: time_budget_s", time_budget_s)
        statement_timeout_s = check_seconds(
            f"{step}: statement_timeout_s", statement_timeout_s, positive=True
        )
        if self._ms is not None and batch_size > MSSQL_ESCALATION_ROWS:
            log.warning(
                "dbqueue %s: batch_size %d is above about %d rows, where SQL Server may escalate a "
                "statement's row locks to a table lock that stalls pushes and pops; keep it lower",
                step,
                batch_size,
                MSSQL_ESCALATION_ROWS,
            )
        started = time.monotonic()
        notes: list[str] = []
        params = {"older_than_s": float(older_than_s), "n": batch_size, **self._queue_filter(queues, notes)}
        timeouts = {"statement_ms": _ms(statement_timeout_s), "lock_ms": _ms(1.0), "local": True}
        with self.lock(lock_wait_s) as got:
            if not got:
                return BatchResult(self.schema, step, 0, 0, 0.0, "skipped", self._skip_reason)
            conn = self._conn()
            rows = batches = discarded = 0
            with self._session_timeouts(conn, statement_timeout_s, 1.0):
                while True:
                    with self._db.transaction(conn) as c:
                        if self._ms is None:  # PostgreSQL: for this transaction only
                            self._db.fetchone("set_timeouts", timeouts, c)
                        row = self._db.fetchone(query, params, c)
                    # (rows the batch took, rows it moved): archive_batch deletes the finished rows of
                    # a dropped queue without archiving them; purge_archive_batch moves what it takes.
                    n = int(row[0]) if row else 0
                    moved = int(row[1]) if row and len(row) > 1 else n
                    rows += moved
                    discarded += n - moved
                    batches += 1
                    if n < batch_size:
                        stopped = "drained"
                        break
                    if time.monotonic() - started + pause_s >= time_budget_s:
                        stopped = "time budget"
                        break
                    time.sleep(pause_s)
        result = BatchResult(
            self.schema,
            step,
            rows,
            batches,
            round(time.monotonic() - started, 3),
            stopped,
            discarded=discarded,
            notes=tuple(notes),
        )
        log.info(
            "dbqueue %s of schema %r: %d rows in %d batches, %.2fs (%s)",
            step,
            self.schema,
            rows,
            batches,
            result.seconds,
            stopped,
        )
        return result

    @contextlib.contextmanager
    def _session_timeouts(self, conn: Any, statement_s: float, lock_s: float) -> Iterator[None]:
        """SQL Server: the lock and query timeouts of the run's connection for the block (a T-SQL
        ``SET`` lasts for the session, not a transaction). PostgreSQL sets them per transaction."""
        if self._ms is None:
            yield
            return
        self._ms.set_timeouts(conn, statement_s=statement_s, lock_s=lock_s)
        try:
            yield
        finally:
            with contextlib.suppress(DbQueueError):
                self._ms.reset_timeouts(conn)

    # -- per-design upkeep -----------------------------------------------------------------------------

    def recover(
        self, queues: Sequence[str] | None = None, *, limit: int = 10_000
    ) -> dict[str, dict[str, int]]:
        """Run every queue's design upkeep (:meth:`Queue.maintain`); return what it did, by queue.

        The table design returns expired leases to ready (or failed); the ring design recovers its
        gaps here too. Safe to run alongside consumers (claims skip locked rows), so it takes no lock.
        """
        return self._recover(queues, limit=limit, notes=[])

    def _recover(
        self, queues: Sequence[str] | None, *, limit: int, notes: list[str]
    ) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for name, q in self._each_queue(queues, notes, "its upkeep was skipped"):
            try:
                out[name] = q.maintain(limit=limit)
            except Exception:
                if not self._gone(name, q.settings.queue_id):
                    raise
                notes.append(self._vanished_note(name, "its upkeep was skipped"))
                continue
            if any(out[name].values()):
                log.info("dbqueue upkeep of queue %r in schema %r: %s", name, self.schema, out[name])
        return out

    def _each_queue(
        self, queues: Sequence[str] | None, notes: list[str], what: str
    ) -> Iterator[tuple[str, Queue]]:
        """Yield ``(name, queue)`` for the named queues (or every queue), noting those that no longer
        exist: a queue may be dropped while maintenance runs, which is no failure of the run."""
        names = list(queues) if queues is not None else [s.name for s in self._dbq.list_queues()]
        for name in names:
            q = self._current(name)
            if q is None:
                notes.append(self._vanished_note(name, what))
                continue
            yield name, q

    # -- VACUUM, ANALYZE and the xmin horizon ------------------------------------------------------------

    def vacuum(
        self, tables: Sequence[str] | None = None, *, analyze_only: bool = False, lock_wait_s: float = 0.0
    ) -> dict[str, Any]:
        """Run ``VACUUM (ANALYZE, SKIP_LOCKED)`` (or only ``ANALYZE``) on the schema's tables.

        SQL Server has no VACUUM (its ghost cleanup task removes deleted rows on its own): both run
        ``UPDATE STATISTICS`` there, and the result says so (``statement``, ``note``); its dead-row
        counts are ``None`` (SQL Server keeps none).

        :param tables: the tables to visit (default: all of :attr:`tables`).
        :return: ``{"tables": {table: {"seconds", "dead_before", "dead_after"}}}``, or ``{"skipped": ...}``.
        """
        tables = self.tables if tables is None else tables
        for t in tables:
            if t not in self.tables:
                raise ConfigurationError(
                    f"{t!r} is not a table of the dbqueue schema on {self.dialect}; choose from {self.tables}"
                )
        with self.lock(lock_wait_s) as got:
            if not got:
                return {"skipped": self._skip_reason}
            conn = self._conn()
            before = {r["table"]: r["dead_tuples"] for r in self.table_health()}
            done: dict[str, Any] = {}
            for t in tables:
                t0 = time.monotonic()
                self._db.execute(
                    "analyze_table" if analyze_only else "vacuum_table", None, conn, identifiers={"table": t}
                )
                done[t] = {"seconds": round(time.monotonic() - t0, 3), "dead_before": before.get(t)}
            after = {r["table"]: r["dead_tuples"] for r in self.table_health()}
            for t in tables:
                done[t]["dead_after"] = after.get(t)
        if self._ms is not None:
            log.info("dbqueue UPDATE STATISTICS of schema %r: %s (%s)", self.schema, done, MSSQL_NO_VACUUM)
            return {"tables": done, "statement": "UPDATE STATISTICS", "note": MSSQL_NO_VACUUM}
        log.info("dbqueue %s of schema %r: %s", "ANALYZE" if analyze_only else "VACUUM", self.schema, done)
        return {"tables": done}

    def xmin_holders(self, *, min_age_s: float = 300.0, min_xid_age: int = 1_000_000) -> list[XminHolder]:
        """Return what holds back the xmin horizon: old transactions (and prepared ones), and slots.

        While one of them holds it, VACUUM (auto or not) cannot remove the dead rows of any table, and
        queue tables bloat whatever maintenance does. On SQL Server (no xmin horizon): transactions of
        this database open longer than ``min_age_s`` (they hold back log truncation) and snapshot
        transactions (they hold back row-version and ghost cleanup); ``min_xid_age`` is not used there.
        """
        rows = self._db.fetchall("xmin_holders", {"min_age_s": float(min_age_s), "min_xid_age": min_xid_age})
        return [
            XminHolder(
                kind=r[0],
                pid=r[1],
                name=r[2],
                user=r[3],
                state=r[4],
                age_s=None if r[5] is None else round(float(r[5]), 1),
                xid_age=r[6],
                xact_start=_iso(r[7]),
                query_start=_iso(r[8]),
                query=r[9],
            )
            for r in rows
        ]

    def check_horizon(self, *, min_age_s: float = 300.0, min_xid_age: int = 1_000_000) -> list[XminHolder]:
        """:meth:`xmin_holders`, with a warning logged for each."""
        holders = self.xmin_holders(min_age_s=min_age_s, min_xid_age=min_xid_age)
        what = (
            "cleanup is held back (the log cannot be truncated past it; under snapshot isolation row "
            "versions and ghost records stay)"
            if self._ms is not None
            else "the xmin horizon is held back (VACUUM cannot remove dead rows)"
        )
        for h in holders:
            log.warning("dbqueue: %s: %s", what, h.describe())
        return holders

    # -- indexes -------------------------------------------------------------------------------------

    def index_health(self) -> list[IndexHealth]:
        """Return every index of the schema with its size and a bloat estimate (B-tree indexes).

        Entry counts come from the last VACUUM or ANALYZE; :meth:`rebuild_indexes` analyzes first. On
        SQL Server, sizes, entries, page density and fragmentation are read from the indexes themselves
        (``sys.dm_db_index_physical_stats``, SAMPLED), and the estimate is the size at the fill factor.
        """
        if self._ms is not None:
            return self._mssql_index_health()[0]
        out = []
        for (
            name,
            table,
            method,
            valid,
            size,
            reltuples,
            key_width,
            fillfactor,
            block_size,
            running,
        ) in self._db.fetchall("index_health", {"schema": self.schema}):
            entries = None if reltuples is None or reltuples < 0 else int(reltuples)
            expected = (
                expected_btree_bytes(entries, key_width, fillfactor, block_size)
                if method == "btree" and entries is not None
                else None
            )
            out.append(IndexHealth(name, table, method, valid, int(size), entries, expected, running))
        return out

    def _mssql_index_health(self) -> tuple[list[IndexHealth], int | None]:
        """SQL Server: every index of the schema, and the server's engine edition."""
        out, edition = [], None
        for (
            name,
            table,
            method,
            valid,
            size,
            entries,
            leaf_pages,
            fragmentation,
            density,
            fill_factor,
            engine_edition,
            running,
        ) in self._db.fetchall("index_health", {"schema": self.schema}):
            edition = None if engine_edition is None else int(engine_edition)
            size_bytes = int(size)
            expected = mssql_expected_bytes(
                size_bytes,
                None if leaf_pages is None else int(leaf_pages),
                None if density is None else float(density),
                int(fill_factor),
            )
            out.append(
                IndexHealth(
                    name,
                    table,
                    method,
                    bool(valid),
                    size_bytes,
                    None if entries is None else int(entries),
                    expected,
                    bool(running),
                    None if fragmentation is None else round(float(fragmentation), 2),
                    None if density is None else round(float(density), 2),
                    int(fill_factor),
                )
            )
        return out, edition

    def rebuild_indexes(
        self,
        *,
        bloat_ratio: float = 2.0,
        min_bloat_bytes: int = MiB,
        timeout_s: float = 600.0,
        analyze: bool = True,
        only: Sequence[str] | None = None,
        lock_wait_s: float = 0.0,
        fragmentation_pct: float = 30.0,
        horizon_min_age_s: float | None = None,
    ) -> dict[str, Any]:
        """Rebuild bloated indexes online and clean up INVALID ones; return what was done.

        First the INVALID indexes: one left by a failed ``REINDEX CONCURRENTLY`` (``<name>_ccnew``,
        ``<name>_ccold``) is dropped with ``DROP INDEX CONCURRENTLY``; an INVALID index of the schema
        itself is rebuilt. Then every valid B-tree index at least ``bloat_ratio`` times its estimated
        size and ``min_bloat_bytes`` above it is rebuilt with ``REINDEX INDEX CONCURRENTLY``, which
        blocks neither reads nor writes. Indexes of a table on which an index build is running are
        left alone. A rebuild that fails (``timeout_s`` passed, or it was cancelled) is reported, and
        the INVALID index it left is dropped at once (or by the next run).

        On SQL Server the step reads page density and fragmentation (:func:`mssql_rebuild_reason`) and
        runs ``ALTER INDEX ... REBUILD WITH (ONLINE = ON)`` where the engine edition has online index
        operations, ``REORGANIZE`` otherwise (:func:`rebuild_mode`, decided from the edition the server
        reports now); the result names the ``mode`` and the ``edition``. A failed rebuild rolls back and
        leaves nothing to clean up (``leftovers`` says so); a disabled index is reported and left alone.

        :param analyze: ANALYZE the tables first, so the entry counts behind the estimate are fresh
            (PostgreSQL; SQL Server reads its indexes directly).
        :param only: rebuild exactly these indexes of the schema (by name), bloated or not; INVALID
            leftovers of failed rebuilds are dropped all the same.
        :param fragmentation_pct: SQL Server only: also rebuild indexes of at least ``min_bloat_bytes``
            whose leaf level is at least this many percent fragmented.
        :param horizon_min_age_s: before each online operation, look for transactions open longer than
            this (:meth:`xmin_holders`; replication slots aside, which it does not wait for): an online
            rebuild waits for every transaction older than itself, so while there is one it would queue
            behind it until ``timeout_s``. The operation is then not run, and its action says so
            (``skip``, ``ok`` false, with the holders in ``error``); the next run tries again. ``None``
            (the default when called alone) does not look.
        """
        if bloat_ratio < 1 or min_bloat_bytes < 0 or timeout_s <= 0:
            raise ConfigurationError("need bloat_ratio >= 1, min_bloat_bytes >= 0 and timeout_s > 0")
        if not 0 <= fragmentation_pct <= 100:
            raise ConfigurationError(f"fragmentation_pct must be in 0..100, got {fragmentation_pct}")
        if horizon_min_age_s is not None:
            horizon_min_age_s = check_seconds("horizon_min_age_s", horizon_min_age_s)
        self._horizon_age = horizon_min_age_s
        try:
            return self._rebuild_indexes(
                bloat_ratio=bloat_ratio,
                min_bloat_bytes=min_bloat_bytes,
                timeout_s=timeout_s,
                analyze=analyze,
                only=only,
                lock_wait_s=lock_wait_s,
                fragmentation_pct=fragmentation_pct,
            )
        finally:
            self._horizon_age = None

    def _held_back(
        self,
        what: str,
        age: float | None = None,
        consequence: str = "an online rebuild waits for every transaction older than itself",
    ) -> tuple[str, list[XminHolder]] | None:
        """``(error, holders)`` when transactions open longer than ``age`` (default: the rebuild's
        horizon age) are there, so that ``what`` should not run (``consequence`` says why), else None."""
        age = self._horizon_age if age is None else age
        if age is None:
            return None
        holders = [h for h in self.xmin_holders(min_age_s=age) if h.kind in REBUILD_WAITS_FOR]
        if not holders:
            return None
        named = "; ".join(h.describe() for h in holders[:3]) + (" ..." if len(holders) > 3 else "")
        error = (
            f"{what} not run: {len(holders)} transaction(s) open longer than {age:g}s, and {consequence} "
            f"({named}); the next run tries again"
        )
        log.warning("dbqueue: %s", error)
        return error, holders

    def _rebuild_indexes(
        self,
        *,
        bloat_ratio: float,
        min_bloat_bytes: int,
        timeout_s: float,
        analyze: bool,
        only: Sequence[str] | None,
        lock_wait_s: float,
        fragmentation_pct: float,
    ) -> dict[str, Any]:
        if self._ms is not None:
            return self._mssql_rebuild_indexes(
                bloat_ratio=bloat_ratio,
                min_bloat_bytes=min_bloat_bytes,
                fragmentation_pct=fragmentation_pct,
                timeout_s=timeout_s,
                only=only,
                lock_wait_s=lock_wait_s,
            )
        with self.lock(lock_wait_s) as got:
            if not got:
                return {"skipped": self._skip_reason, "actions": []}
            if analyze:
                self.vacuum(("meta", "data", "done", "archive"), analyze_only=True)
            actions: list[IndexAction] = []
            health = self.index_health()
            wanted = set(only) if only is not None else None
            unknown = sorted((wanted or set()) - {h.index for h in health})
            if unknown:
                raise ConfigurationError(f"no index {unknown} in schema {self.schema!r}")
            for h in health:
                if h.valid or (wanted is not None and h.index not in wanted and not h.leftover):
                    continue
                if h.build_running:
                    actions.append(
                        IndexAction(h.index, "skip", True, 0.0, h.size_bytes, reason="an index build runs")
                    )
                elif h.leftover:
                    actions.append(self._drop_leftover(h, timeout_s))
                else:
                    actions.append(self._reindex(h, "rebuild invalid", "INVALID", timeout_s))
            for h in health:
                if not h.valid or h.method != "btree" or h.build_running:
                    continue
                if wanted is not None and h.index not in wanted:
                    continue
                ratio, extra = h.bloat_ratio, h.bloat_bytes
                estimate = f"{h.size_bytes} bytes for about {h.expected_bytes} needed"
                if wanted is not None:
                    reason = f"asked for ({estimate})"
                elif ratio is None or extra is None or ratio < bloat_ratio or extra < min_bloat_bytes:
                    continue
                else:
                    reason = f"{estimate} (x{ratio:.1f})"
                actions.append(self._reindex(h, "reindex", reason, timeout_s))
        return {"actions": [a.as_dict() for a in actions]}

    def _mssql_rebuild_indexes(
        self,
        *,
        bloat_ratio: float,
        min_bloat_bytes: int,
        fragmentation_pct: float,
        timeout_s: float,
        only: Sequence[str] | None,
        lock_wait_s: float,
    ) -> dict[str, Any]:
        from airflow_dbqueue.engine.dialects.mssql.dialect import edition_name, rebuild_mode

        with self.lock(lock_wait_s) as got:
            if not got:
                return {"skipped": self._skip_reason, "actions": []}
            health, edition = self._mssql_index_health()
            mode = rebuild_mode(edition)
            why = f"{edition_name(edition)} " + (
                "rebuilds indexes online"
                if mode == "online rebuild"
                else "has no online index rebuild, so REORGANIZE (online in every edition)"
            )
            wanted = set(only) if only is not None else None
            unknown = sorted((wanted or set()) - {h.index for h in health})
            if unknown:
                raise ConfigurationError(f"no index {unknown} in schema {self.schema!r}")
            done: list[_MssqlAction] = []
            for h in health:
                if wanted is not None and h.index not in wanted:
                    continue
                if not h.valid:
                    done.append(
                        (h, "skip", True, 0.0, "disabled (ALTER INDEX ... DISABLE): left to its owner", None)
                    )
                    continue
                if h.build_running:
                    reason = (
                        "an index operation runs in this database, or a resumable one is paused on its table"
                    )
                    done.append((h, "skip", True, 0.0, reason, None))
                    continue
                if wanted is not None:
                    density = f"{h.page_density_pct:.0f}%" if h.page_density_pct is not None else "?"
                    found: str | None = f"asked for ({h.size_bytes} bytes, leaf pages {density} full)"
                else:
                    found = mssql_rebuild_reason(
                        h,
                        bloat_ratio=bloat_ratio,
                        min_bloat_bytes=min_bloat_bytes,
                        fragmentation_pct=fragmentation_pct,
                    )
                if found is not None:
                    done.append(self._mssql_rebuild(h, mode, found, timeout_s))
            after = (
                {x.index: x.size_bytes for x in self._mssql_index_health()[0]}
                if any(ok and action != "skip" for _, action, ok, *_ in done)
                else {}
            )
        actions = [
            IndexAction(
                h.index,
                action,
                ok,
                seconds,
                h.size_bytes,
                after.get(h.index) if ok and action != "skip" else None,
                reason,
                error,
            )
            for h, action, ok, seconds, reason, error in done
        ]
        return {
            "actions": [a.as_dict() for a in actions],
            "mode": mode,
            "engine_edition": edition,
            "edition": edition_name(edition),
            "why": why,
            "leftovers": MSSQL_NO_LEFTOVERS,
        }

    def _mssql_rebuild(self, h: IndexHealth, mode: str, reason: str, timeout_s: float) -> _MssqlAction:
        """SQL Server: rebuild (or reorganize) one index on the run's connection, within ``timeout_s``."""
        assert self._ms is not None
        held = self._held_back(f"ALTER INDEX {h.index} ON {self.schema}.{h.table} ({mode})")
        if held is not None:
            return h, "skip", False, 0.0, reason, held[0]
        conn = self._conn()
        t0 = time.monotonic()
        what = f"ALTER INDEX {h.index} ON {self.schema}.{h.table} " + (
            "REBUILD WITH (ONLINE = ON)" if mode == "online rebuild" else "REORGANIZE"
        )
        log.info("dbqueue: %s (%s)", what, reason)
        params = {"online": mode == "online rebuild", "max_duration_min": max(1, math.ceil(timeout_s / 60))}
        try:
            self._ms.set_timeouts(conn, statement_s=timeout_s, lock_s=timeout_s)
            try:
                row = self._ms.fetchone(
                    "reindex_concurrently", params, conn, identifiers={"index": h.index, "table": h.table}
                )
            finally:
                with contextlib.suppress(DbQueueError):
                    self._ms.reset_timeouts(conn)
        except DbQueueError as exc:
            error = self._describe_failure(what, exc, timeout_s)
            log.warning("dbqueue: %s; %s", error, MSSQL_NO_LEFTOVERS)
            return h, mode, False, round(time.monotonic() - t0, 3), reason, error
        if row is None or row[0] is None:
            error = f"index {h.index} is no longer on {self.schema}.{h.table}; nothing was run"
            return h, mode, False, round(time.monotonic() - t0, 3), reason, error
        return h, mode, True, round(time.monotonic() - t0, 3), reason, None

    def _with_timeouts(self, timeout_s: float) -> None:
        ms = _ms(timeout_s)
        self._db.fetchone("set_timeouts", {"statement_ms": ms, "lock_ms": ms, "local": False}, self._conn())

    def _reindex(self, h: IndexHealth, action: str, reason: str, timeout_s: float) -> IndexAction:
        held = self._held_back(f"REINDEX INDEX CONCURRENTLY {self.schema}.{h.index}")
        if held is not None:
            return IndexAction(h.index, "skip", False, 0.0, h.size_bytes, reason=reason, error=held[0])
        conn = self._conn()
        t0 = time.monotonic()
        log.info("dbqueue: REINDEX INDEX CONCURRENTLY %s.%s (%s)", self.schema, h.index, reason)
        try:
            self._with_timeouts(timeout_s)
            try:
                self._db.execute("reindex_concurrently", None, conn, identifiers={"index": h.index})
            finally:
                self._db.fetchall("reset_timeouts", None, conn)
        except DbQueueError as exc:
            error = self._describe_failure(
                f"REINDEX INDEX CONCURRENTLY {self.schema}.{h.index}", exc, timeout_s
            )
            log.warning("dbqueue: %s; dropping what it left", error)
            for left in self.index_health():
                if left.leftover and left.index.startswith(f"{h.index}_cc") and not left.build_running:
                    self._drop_leftover(left, timeout_s)
            return IndexAction(
                h.index,
                action,
                False,
                round(time.monotonic() - t0, 3),
                h.size_bytes,
                reason=reason,
                error=error,
            )
        after = next((x.size_bytes for x in self.index_health() if x.index == h.index), None)
        log.info("dbqueue: rebuilt %s.%s: %s -> %s bytes", self.schema, h.index, h.size_bytes, after)
        return IndexAction(
            h.index, action, True, round(time.monotonic() - t0, 3), h.size_bytes, after, reason
        )

    def _drop_leftover(self, h: IndexHealth, timeout_s: float) -> IndexAction:
        reason = "INVALID index left by a failed concurrent rebuild"
        held = self._held_back(f"DROP INDEX CONCURRENTLY {self.schema}.{h.index}")
        if held is not None:
            return IndexAction(h.index, "skip", False, 0.0, h.size_bytes, reason=reason, error=held[0])
        conn = self._conn()
        t0 = time.monotonic()
        log.info("dbqueue: DROP INDEX CONCURRENTLY %s.%s (%s)", self.schema, h.index, reason)
        try:
            self._with_timeouts(timeout_s)
            try:
                self._db.execute("drop_index_concurrently", None, conn, identifiers={"index": h.index})
            finally:
                self._db.fetchall("reset_timeouts", None, conn)
        except DbQueueError as exc:
            error = self._describe_failure(f"DROP INDEX CONCURRENTLY {self.schema}.{h.index}", exc, timeout_s)
            log.warning("dbqueue: %s; the next run tries again", error)
            return IndexAction(
                h.index,
                "drop leftover",
                False,
                round(time.monotonic() - t0, 3),
                h.size_bytes,
                None,
                reason,
                error,
            )
        return IndexAction(
            h.index, "drop leftover", True, round(time.monotonic() - t0, 3), h.size_bytes, 0, reason
        )

    def _describe_failure(self, what: str, exc: DbQueueError, timeout_s: float) -> str:
        if self._ms is not None:
            from airflow_dbqueue.engine.dialects.mssql.dialect import query_timeout_s

            if isinstance(exc, LockTimeoutError):
                return f"{what} gave up waiting for a lock after {timeout_s:g}s"
            if isinstance(exc, TransientDatabaseError) and "query timeout" in str(exc):
                return f"{what} was cancelled (query timeout of {query_timeout_s(timeout_s)}s)"
            return f"{what} failed: {exc}"
        import psycopg.errors

        cause = exc.__cause__
        if isinstance(cause, psycopg.errors.QueryCanceled):
            return f"{what} was cancelled (statement timeout of {timeout_s:g}s, or pg_cancel_backend)"
        if isinstance(cause, psycopg.errors.LockNotAvailable):
            return f"{what} gave up waiting for a lock after {timeout_s:g}s"
        return f"{what} failed: {exc}"

    # -- ring tables ---------------------------------------------------------------------------------

    def compact_rings(
        self,
        *,
        bloat_ratio: float = 1.5,
        min_bloat_bytes: int = 8 * MiB,
        lock_timeout_s: float = 2.0,
        timeout_s: float = 600.0,
        lock_wait_s: float = 0.0,
        horizon_min_age_s: float = 10.0,
        only: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Rewrite the ring's tables that outgrew their size back to it (PostgreSQL): ``VACUUM FULL``.

        A ring's slots are overwritten in place (HOT updates into the room each page keeps), so the
        table keeps the size ``ring_create`` laid it out in (:func:`ring_slots_laid_out_bytes`) as long
        as VACUUM can remove old row versions. While a transaction holds back the xmin horizon it
        cannot; new versions then go to new pages, and the table stays that size after the horizon
        moves on (VACUUM frees the pages for reuse, it does not give them back). This step rewrites
        ``ring_slots`` when it is at least ``bloat_ratio`` times its laid-out size and
        ``min_bloat_bytes`` above it; and ``ring_lanes``, ``ring_leases`` and ``ring_retry`` on the same
        rule against their live rows at their fillfactor. The rewrite packs the slots as they are
        (the slots of smaller payloads share pages); pushes of larger payloads then grow it a little.

        ``VACUUM FULL`` holds an ACCESS EXCLUSIVE lock for its whole run: every push and pop of every
        ring of the schema waits for it (a pop that waits past its 1 s lock timeout returns nothing).
        It waits at most ``lock_timeout_s`` for the lock (queued behind it, pushes and pops wait
        too), then gives up and the next run tries again; ``timeout_s`` bounds the rewrite. It is not
        run while a transaction open longer than ``horizon_min_age_s`` holds the horizon: the rewrite
        would keep every row version that transaction may still see (:meth:`xmin_holders`).

        :param only: rewrite exactly these tables (of :data:`RING_TABLES`), grown or not.
        :return: ``{"actions": [{"table", "action", "ok", "seconds", "bytes_before", "bytes_after",
            "expected_bytes", "reason", "error"}]}``, or ``{"skipped": ...}``.
        """
        if not math.isfinite(bloat_ratio) or bloat_ratio < 1 or min_bloat_bytes < 0:
            raise ConfigurationError(
                "need a finite bloat_ratio >= 1 and min_bloat_bytes >= 0, "
                f"got {bloat_ratio} and {min_bloat_bytes}"
            )
        check_seconds("lock_timeout_s", lock_timeout_s, positive=True)
        check_seconds("timeout_s", timeout_s, positive=True)
        check_seconds("horizon_min_age_s", horizon_min_age_s)
        wanted = tuple(only) if only is not None else None
        unknown = sorted(set(wanted or ()) - set(RING_TABLES))
        if unknown:
            raise ConfigurationError(f"{unknown} are not ring tables; choose from {RING_TABLES}")
        if self._ms is not None:
            return {
                "skipped": "SQL Server keeps no old row versions in a table (they go to tempdb's version "
                "store), so a held transaction does not grow the ring's tables; rebuild_indexes rebuilds "
                "their clustered indexes when they are fragmented"
            }
        with self.lock(lock_wait_s) as got:
            if not got:
                return {"skipped": self._skip_reason, "actions": []}
            conn = self._conn()
            laid_out = sum(
                ring_slots_laid_out_bytes(int(capacity), int(slot_bytes))
                for _, capacity, slot_bytes in self._db.fetchall("compact_ring_layouts", None, conn)
            )
            actions: list[dict[str, Any]] = []
            for table, size, fillfactor, live in self._db.fetchall(
                "compact_ring_tables", {"schema": self.schema}, conn
            ):
                if wanted is not None and table not in wanted:
                    continue
                expected = laid_out if live is None else -(-int(live) * 100 // int(fillfactor))
                expected = max(expected, 8192)
                estimate = f"{size} bytes for about {expected} expected"
                if wanted is not None:
                    reason = f"asked for ({estimate})"
                elif size < bloat_ratio * expected or size - expected < min_bloat_bytes:
                    continue
                else:
                    reason = f"{estimate} (x{size / expected:.1f})"
                actions.append(
                    self._compact(
                        table=table,
                        size=int(size),
                        expected=expected,
                        reason=reason,
                        lock_s=lock_timeout_s,
                        timeout_s=timeout_s,
                        horizon_s=horizon_min_age_s,
                    )
                )
        return {"actions": actions}

    def _compact(
        self,
        *,
        table: str,
        size: int,
        expected: int,
        reason: str,
        lock_s: float,
        timeout_s: float,
        horizon_s: float,
    ) -> dict[str, Any]:
        what = f"VACUUM FULL {self.schema}.{table}"
        action = {
            "table": table,
            "action": "compact",
            "ok": False,
            "seconds": 0.0,
            "bytes_before": size,
            "bytes_after": None,
            "expected_bytes": expected,
            "reason": reason,
            "error": None,
        }
        held = self._held_back(
            what,
            horizon_s,
            "they hold the xmin horizon: the rewrite would keep every row version they may see",
        )
        if held is not None:
            action["action"], action["error"] = "skip", held[0]
            return action
        conn = self._conn()
        log.info("dbqueue: %s (%s)", what, reason)
        t0 = time.monotonic()
        try:
            self._db.fetchone(
                "set_timeouts", {"statement_ms": _ms(timeout_s), "lock_ms": _ms(lock_s), "local": False}, conn
            )
            try:
                self._db.execute("vacuum_full_table", None, conn, identifiers={"table": table})
            finally:
                self._db.fetchall("reset_timeouts", None, conn)
        except DbQueueError as exc:
            import psycopg.errors

            cause = exc.__cause__
            if isinstance(cause, psycopg.errors.LockNotAvailable):
                action["error"] = f"{what} gave up waiting {lock_s:g}s for its lock; the next run tries again"
            elif isinstance(cause, psycopg.errors.QueryCanceled):
                action["error"] = (
                    f"{what} was cancelled (statement timeout of {timeout_s:g}s, or pg_cancel_backend)"
                )
            else:
                action["error"] = f"{what} failed: {exc}"
            log.warning("dbqueue: %s", action["error"])
            action["seconds"] = round(time.monotonic() - t0, 3)
            return action
        action["seconds"] = round(time.monotonic() - t0, 3)
        row = self._db.fetchone("compact_relation_size", {"schema": self.schema, "table": table}, conn)
        action["bytes_after"] = None if row is None else int(row[0])
        action["ok"] = True
        log.info(
            "dbqueue: compacted %s.%s in %ss: %s -> %s bytes",
            self.schema,
            table,
            action["seconds"],
            size,
            action["bytes_after"],
        )
        return action

    # -- metrics -------------------------------------------------------------------------------------

    def table_health(self) -> list[dict[str, Any]]:
        """Size and vacuum state of the schema's tables (JSON-safe dicts).

        On SQL Server the dead-row and vacuum columns are ``None``: it counts no dead rows and has no
        VACUUM; ``last_analyze`` is the newest statistics update.
        """
        out = []
        for name, heap, idx, total, live, dead, vacuumed, analyzed, autovacuums, vacuums in self._db.fetchall(
            "table_health", {"schema": self.schema}
        ):
            out.append(
                {
                    "table": name,
                    "table_bytes": int(heap),
                    "index_bytes": int(idx),
                    "total_bytes": int(total),
                    "live_tuples": int(live),
                    "dead_tuples": None if dead is None else int(dead),
                    "dead_ratio": None
                    if dead is None
                    else round(dead / (live + dead), 4)
                    if live + dead
                    else 0.0,
                    "last_vacuum": _iso(vacuumed),
                    "last_analyze": _iso(analyzed),
                    "autovacuum_count": None if autovacuums is None else int(autovacuums),
                    "vacuum_count": None if vacuums is None else int(vacuums),
                }
            )
        return out

    def metrics(
        self,
        queues: Sequence[str] | None = None,
        *,
        rate_window_s: float = 300.0,
        horizon_min_age_s: float = 300.0,
        horizon_min_xid_age: int = 1_000_000,
    ) -> dict[str, Any]:
        """Return the schema's queue metrics as a JSON-safe dict (for logs, XCom and a metrics system).

        ``queues``: by queue, depth by state (``ready``, ``delayed``, ``in_flight``, ``failed``,
        ``finished`` waiting for the archiver), ``oldest_ready_age_s``, and ``pushed_per_s`` and
        ``finished_per_s`` over the last ``rate_window_s`` seconds. ``tables``: sizes, live and dead
        rows. ``indexes``: sizes and bloat estimates. ``xmin_holders``: what holds back VACUUM.
        """
        if not math.isfinite(rate_window_s) or rate_window_s <= 0:
            raise ConfigurationError(f"rate_window_s must be a finite number > 0, got {rate_window_s}")
        notes: list[str] = []
        per_queue: dict[str, Any] = {}
        for name, q in self._each_queue(queues, notes, "left out of the metrics"):
            try:
                stats = q.stats().as_dict()
                row = self._db.fetchone(
                    "queue_rates", {"queue_id": q.settings.queue_id, "window_s": float(rate_window_s)}
                )
            except Exception:
                if not self._gone(name, q.settings.queue_id):
                    raise
                notes.append(self._vanished_note(name, "left out of the metrics"))
                continue
            pushed, finished = (int(row[0]), int(row[1])) if row else (0, 0)
            stats["design"] = q.settings.design.value
            stats["pushed_per_s"] = round(pushed / rate_window_s, 3)
            stats["finished_per_s"] = round(finished / rate_window_s, 3) if q.settings.archive else None
            per_queue[name] = stats
        return {
            "schema": self.schema,
            "at": dt.datetime.now(dt.UTC).isoformat(),
            "rate_window_s": rate_window_s,
            "queues": per_queue,
            "tables": {t.pop("table"): t for t in self.table_health()},
            "indexes": {i.index: i.as_dict() for i in self.index_health()},
            "xmin_holders": [
                h.as_dict()
                for h in self.xmin_holders(min_age_s=horizon_min_age_s, min_xid_age=horizon_min_xid_age)
            ],
            "notes": notes,
        }

    # -- everything --------------------------------------------------------------------------------------

    def run(self, config: MaintenanceConfig | None = None) -> dict[str, Any]:
        """Run every step under one hold of the lock; return a JSON-safe report of each.

        Order: the xmin-horizon check, each queue's upkeep (lease reclaim; ring gaps), archiving,
        archive retention, VACUUM (ANALYZE), ring compaction (not while a transaction older than
        ``min(horizon_min_age_s, 10)`` holds the horizon), index rebuilds, metrics. When another run holds the
        lock past ``lock_wait_s``, only the metrics are collected and ``skipped`` says why.

        A queue dropped while the run goes on is no failure: its steps are skipped, and ``notes`` says
        so (as does a queue named in ``queues`` that does not exist). ``incomplete`` lists the steps
        that did not do their work (``step``, ``object``, ``action``, ``why``): ring compactions that
        gave up or were not run, index rebuilds that failed (a timeout, a cancel) or were not run
        because transactions older than ``horizon_min_age_s`` would have held them up. ``dbqueue
        maintain`` exits with status 1 when it is not empty.
        """
        cfg = config or MaintenanceConfig()
        started = time.monotonic()
        report: dict[str, Any] = {"schema": self.schema, "skipped": None}
        queues = list(cfg.queues) if cfg.queues is not None else None
        notes: list[str] = []
        with self.lock(cfg.lock_wait_s) as got:
            if not got:
                report["skipped"] = self._skip_reason
            else:
                report["xmin_holders"] = [
                    h.as_dict()
                    for h in self.check_horizon(
                        min_age_s=cfg.horizon_min_age_s, min_xid_age=cfg.horizon_min_xid_age
                    )
                ]
                report["upkeep"] = self._recover(queues, limit=cfg.reclaim_limit, notes=notes)
                archived = self.archive(
                    older_than_s=cfg.archive_after_s,
                    batch_size=cfg.batch_size,
                    pause_s=cfg.pause_s,
                    time_budget_s=cfg.time_budget_s,
                    queues=queues,
                )
                notes += archived.notes
                report["archive"] = archived.as_dict()
                if cfg.archive_retention_s is not None:
                    report["purge_archive"] = self.purge_archive(
                        older_than_s=cfg.archive_retention_s,
                        batch_size=cfg.batch_size,
                        pause_s=cfg.pause_s,
                        time_budget_s=cfg.time_budget_s,
                        queues=queues,
                    ).as_dict()
                if cfg.vacuum:
                    report["vacuum"] = self.vacuum()
                if cfg.compact_rings:
                    report["compact"] = self.compact_rings(
                        bloat_ratio=cfg.compact_bloat_ratio,
                        min_bloat_bytes=cfg.compact_min_bytes,
                        lock_timeout_s=cfg.compact_lock_timeout_s,
                        horizon_min_age_s=min(cfg.horizon_min_age_s, 10.0),
                    )
                if cfg.reindex:
                    report["indexes"] = self.rebuild_indexes(
                        bloat_ratio=cfg.reindex_bloat_ratio,
                        min_bloat_bytes=cfg.reindex_min_bytes,
                        timeout_s=cfg.reindex_timeout_s,
                        analyze=not cfg.vacuum,
                        fragmentation_pct=cfg.reindex_fragmentation_pct,
                        horizon_min_age_s=cfg.horizon_min_age_s,
                    )
        report["metrics"] = self.metrics(
            queues,
            rate_window_s=cfg.rate_window_s,
            horizon_min_age_s=cfg.horizon_min_age_s,
            horizon_min_xid_age=cfg.horizon_min_xid_age,
        )
        notes += report["metrics"]["notes"]
        report["notes"] = list(dict.fromkeys(notes))
        report["incomplete"] = [
            {"step": "compact", "object": a["table"], "action": a["action"], "why": a["error"]}
            for a in report.get("compact", {}).get("actions", [])
            if not a["ok"]
        ] + [
            {"step": "indexes", "object": a["index"], "action": a["action"], "why": a["error"] or a["reason"]}
            for a in report.get("indexes", {}).get("actions", [])
            if not a["ok"]
        ]
        if report["incomplete"]:
            log.warning(
                "dbqueue maintenance of schema %r: %d step(s) did not complete: %s",
                self.schema,
                len(report["incomplete"]),
                "; ".join(f"{i['action']} {i['object']}: {i['why']}" for i in report["incomplete"]),
            )
        report["seconds"] = round(time.monotonic() - started, 3)
        return report
