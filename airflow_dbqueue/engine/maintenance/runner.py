"""The maintenance of one schema: each step as a method, :meth:`Maintenance.run` for all of them in
order under one hold of the lock, and :meth:`Maintenance.step` for one of them as ``run`` runs it (the
maintenance DAG runs each step as a task of its own through it, so the DAG and ``dbqueue maintain``
take the same steps in the same order, :data:`STEPS`, with the same settings)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.dialects.indexes import IndexHealth
from airflow_dbqueue.engine.errors import ConfigurationError
from airflow_dbqueue.engine.maintenance import horizon, samples
from airflow_dbqueue.engine.maintenance.archiver import Archiver
from airflow_dbqueue.engine.maintenance.compactor import RingCompactor
from airflow_dbqueue.engine.maintenance.config import (
    ARCHIVE_AFTER_S,
    BATCH_SIZE,
    COMPACT_BLOAT_RATIO,
    COMPACT_HORIZON_MIN_AGE_S,
    COMPACT_LOCK_TIMEOUT_S,
    COMPACT_MIN_BYTES,
    COMPACT_TIMEOUT_S,
    HORIZON_MIN_AGE_S,
    HORIZON_MIN_XID_AGE,
    PAUSE_S,
    RATE_WINDOW_S,
    RECYCLE_LOCK_TIMEOUT_S,
    RECYCLE_MIN_BYTES,
    RECYCLE_MOVE_LIMIT,
    REINDEX_BLOAT_RATIO,
    REINDEX_FRAGMENTATION_PCT,
    REINDEX_MIN_BYTES,
    REINDEX_TIMEOUT_S,
    SAMPLES_KEEP_S,
    STATEMENT_TIMEOUT_S,
    TIME_BUDGET_S,
    MaintenanceConfig,
)
from airflow_dbqueue.engine.maintenance.lock import SchemaLock
from airflow_dbqueue.engine.maintenance.metrics import metrics as collect_metrics
from airflow_dbqueue.engine.maintenance.queues import QueueOpener, Queues, upkeep
from airflow_dbqueue.engine.maintenance.recycler import TableRecycler
from airflow_dbqueue.engine.maintenance.reindexer import Reindexer
from airflow_dbqueue.engine.maintenance.results import BatchResult, XminHolder
from airflow_dbqueue.engine.maintenance.statistics import table_health
from airflow_dbqueue.engine.maintenance.statistics import vacuum as run_vacuum
from airflow_dbqueue.engine.queue import RECLAIM_LIMIT
from airflow_dbqueue.engine.renames import renamed_kwargs

log = logging.getLogger(__name__)

STEPS = (
    "check_horizon",
    "upkeep",
    "archive",
    "vacuum",
    "compact_rings",
    "rebuild_indexes",
    "sample",
    "metrics",
)
"""The steps of a full run, in the order :meth:`Maintenance.run` takes them (the last, ``metrics``, runs
even when another run holds the lock)."""

_OFF: dict[str, tuple[str, dict[str, Any]]] = {
    "vacuum": ("vacuum", {}),
    "compact_rings": ("compact_rings", {"actions": []}),
    "rebuild_indexes": ("reindex", {"actions": []}),
    "sample": ("samples", {"recorded": 0, "deleted": 0}),
}
"""The steps a setting of :class:`MaintenanceConfig` turns off: the setting, and what else the step's
result holds then."""


class Maintenance:
    """The maintenance steps of one schema. Obtain it with :meth:`DbQueue.maintenance`.

    Every step can run while producers and consumers run at full speed. Steps that change things
    take the schema's maintenance lock for their duration (unless a :meth:`lock` block holds it
    already); read-only steps (:meth:`index_health`, :meth:`xmin_holders`, :meth:`metrics`) do not.
    Each step is a service of its own (``archiver``, ``statistics``, ``reindexer``, ...) that calls the
    database only through the :class:`Database` protocol. Not thread-safe; use one per thread.
    """

    def __init__(self, db: Database, queues: QueueOpener) -> None:
        """Maintain ``db``'s schema, whose queues ``queues`` opens (the :class:`DbQueue` of ``db``)."""
        self._db = db
        self.dialect = db.dialect_name
        self.tables = db.tables
        """The schema's tables on this dialect, in the order :meth:`vacuum` visits them."""
        self.schema = db.schema
        self._lock = SchemaLock(db)
        self._queues = Queues(queues, db.schema, db)
        self._archiver = Archiver(db, self._lock, self._queues)
        self._reindexer = Reindexer(db, self._lock, lambda tables: self.vacuum(tables, analyze_only=True))
        self._compactor = RingCompactor(db, self._lock)
        self._recycler = TableRecycler(db, self._lock)
        self._steps: dict[str, Callable[[MaintenanceConfig, list[str]], dict[str, Any] | None]] = {
            "check_horizon": self._check_horizon_step,
            "upkeep": self._upkeep_step,
            "archive": self._archive_step,
            "vacuum": self._vacuum_step,
            "compact_rings": self._compact_step,
            "rebuild_indexes": self._reindex_step,
            "sample": self._sample_step,
            "metrics": self._metrics_step,
        }

    @renamed_kwargs(wait_s="lock_wait")
    @contextlib.contextmanager
    def lock(self, lock_wait: float = 0.0) -> Iterator[bool]:
        """Hold the schema's maintenance lock for the block; yield whether it was obtained.

        Waits up to ``lock_wait`` seconds for another run to finish; when it does not, logs which
        session holds the lock and yields ``False`` (the caller skips its work). Nested blocks reuse
        the lock held by the outer one.
        """
        with self._lock.hold(lock_wait) as got:
            yield got

    @renamed_kwargs(
        older_than_s="archive_after",
        pause_s="pause",
        time_budget_s="time_budget",
        lock_wait_s="lock_wait",
        statement_timeout_s="statement_timeout",
    )
    def archive(
        self,
        *,
        archive_after: float = ARCHIVE_AFTER_S,
        batch_size: int = BATCH_SIZE,
        pause: float = PAUSE_S,
        time_budget: float = TIME_BUDGET_S,
        queues: Sequence[str] | None = None,
        lock_wait: float = 0.0,
        statement_timeout: float = STATEMENT_TIMEOUT_S,
    ) -> BatchResult:
        """Move finished messages older than ``archive_after`` seconds into the archive, in bounded
        batches.

        One statement a batch of at most ``batch_size`` messages, ``pause`` seconds between batches,
        and no new batch once ``time_budget`` seconds are spent. Stops early at a short batch (nothing old
        enough is left). Each batch is its own transaction with a ``statement_timeout``, and a
        ``lock_timeout`` of one second: it never waits long for a lock (and skips locked rows).
        """
        return self._archiver.run(
            "archive",
            older_than_s=archive_after,
            batch_size=batch_size,
            pause_s=pause,
            time_budget_s=time_budget,
            queues=queues,
            lock_wait_s=lock_wait,
            statement_timeout_s=statement_timeout,
        )

    @renamed_kwargs(
        older_than_s="archive_retention",
        pause_s="pause",
        time_budget_s="time_budget",
        lock_wait_s="lock_wait",
        statement_timeout_s="statement_timeout",
    )
    def purge_archive(
        self,
        *,
        archive_retention: float,
        batch_size: int = BATCH_SIZE,
        pause: float = PAUSE_S,
        time_budget: float = TIME_BUDGET_S,
        queues: Sequence[str] | None = None,
        lock_wait: float = 0.0,
        statement_timeout: float = STATEMENT_TIMEOUT_S,
    ) -> BatchResult:
        """Delete messages archived more than ``archive_retention`` seconds ago, in bounded batches (the
        other settings as :meth:`archive` takes them)."""
        return self._archiver.run(
            "purge_archive",
            older_than_s=archive_retention,
            batch_size=batch_size,
            pause_s=pause,
            time_budget_s=time_budget,
            queues=queues,
            lock_wait_s=lock_wait,
            statement_timeout_s=statement_timeout,
        )

    def recover(
        self, queues: Sequence[str] | None = None, *, limit: int = RECLAIM_LIMIT
    ) -> dict[str, dict[str, int]]:
        """Run every queue's design upkeep (:meth:`Queue.maintain`); return what it did, by queue.

        The table design returns expired leases to ready (or failed); the ring design recovers its
        gaps here too. Safe to run alongside consumers (claims skip locked rows), so it takes no lock.
        """
        return upkeep(self._queues, queues, limit=limit, notes=[])

    @renamed_kwargs(lock_wait_s="lock_wait")
    def vacuum(
        self, tables: Sequence[str] | None = None, *, analyze_only: bool = False, lock_wait: float = 0.0
    ) -> dict[str, Any]:
        """Run ``VACUUM (ANALYZE, SKIP_LOCKED)`` (or only ``ANALYZE``) on the schema's tables.

        SQL Server has no VACUUM (its ghost cleanup task removes deleted rows on its own): both run
        ``UPDATE STATISTICS`` there, and the result says so (``statement``, ``note``); its dead-row
        counts are ``None`` (SQL Server keeps none).

        :param tables: the tables to visit (default: all of :attr:`tables`).
        :return: ``{"tables": {table: {"seconds", "dead_before", "dead_after"}}}``, or ``{"skipped": ...}``.
        """
        return run_vacuum(self._db, self._lock, tables, analyze_only=analyze_only, lock_wait_s=lock_wait)

    def recycle(
        self,
        *,
        recycle_move_limit: int = RECYCLE_MOVE_LIMIT,
        recycle_min_bytes: int = RECYCLE_MIN_BYTES,
        recycle_lock_timeout: float = RECYCLE_LOCK_TIMEOUT_S,
        lock_wait: float = 0.0,
    ) -> dict[str, Any]:
        """Empty the table design's partitions that hold no row any more (PostgreSQL).

        ``meta``, ``data`` and ``done`` are partitioned by generation (eight partitions each, ids
        moving through them 16,384 at a time). First each queue's floor is raised (the time below which
        none of its messages waits, where its pops start their walk of the ready index), under the
        queue's push lock taken without waiting. Then up to ``recycle_move_limit`` messages that would
        keep an old generation from emptying (delayed past the next second, or failed) move into the
        generation pushes write now, keeping their ids and receipts; then every partition of at least
        ``recycle_min_bytes`` that holds no row is emptied with TRUNCATE, which gives back its dead row
        versions and index entries also while the xmin horizon is held (VACUUM cannot then). Each
        partition waits at most ``recycle_lock_timeout`` seconds for its lock, in a transaction of its
        own that ends at once; one not granted is tried again by the next run. A run of the vacuum step
        recycles first; run this alone, every few seconds, to keep pops fast while a horizon is held.

        :return: ``{"floors_raised", "moved", "emptied" (partitions), "lock_not_granted", "freed_bytes",
            "longest_s" (the longest emptying: checks, lock wait and TRUNCATE), "longest_lock_s" (the
            longest an emptied partition's lock was held, from its grant to the end of the TRUNCATE)}``, or
            ``{"skipped": why}`` (SQL Server, or another run holds the lock).
        """
        return self._recycler.recycle(
            move_limit=recycle_move_limit,
            min_bytes=recycle_min_bytes,
            lock_timeout_s=recycle_lock_timeout,
            lock_wait_s=lock_wait,
        )

    def table_health(self) -> list[dict[str, Any]]:
        """Size and vacuum state of the schema's tables (JSON-safe dicts).

        On SQL Server the dead-row and vacuum columns are ``None``: it counts no dead rows and has no
        VACUUM; ``last_analyze`` is the newest statistics update.
        """
        return table_health(self._db)

    @renamed_kwargs(min_age_s="horizon_min_age", min_xid_age="horizon_min_xid_age")
    def xmin_holders(
        self, *, horizon_min_age: float = HORIZON_MIN_AGE_S, horizon_min_xid_age: int = HORIZON_MIN_XID_AGE
    ) -> list[XminHolder]:
        """Return what holds back the xmin horizon: old transactions (and prepared ones), and slots.

        While one of them holds it, VACUUM (auto or not) cannot remove the dead rows of any table, and
        queue tables bloat whatever maintenance does. On SQL Server (no xmin horizon): transactions of
        this database open longer than ``horizon_min_age`` seconds (they hold back log truncation) and
        snapshot transactions (they hold back row-version and ghost cleanup); ``horizon_min_xid_age`` is
        not used there.
        """
        return horizon.xmin_holders(self._db, min_age_s=horizon_min_age, min_xid_age=horizon_min_xid_age)

    @renamed_kwargs(min_age_s="horizon_min_age", min_xid_age="horizon_min_xid_age")
    def check_horizon(
        self, *, horizon_min_age: float = HORIZON_MIN_AGE_S, horizon_min_xid_age: int = HORIZON_MIN_XID_AGE
    ) -> list[XminHolder]:
        """:meth:`xmin_holders`, with a warning logged for each."""
        return horizon.check_horizon(self._db, min_age_s=horizon_min_age, min_xid_age=horizon_min_xid_age)

    def index_health(self) -> list[IndexHealth]:
        """Return every index of the schema with its size and a bloat estimate (B-tree indexes).

        Entry counts come from the last VACUUM or ANALYZE; :meth:`rebuild_indexes` analyzes first. On
        SQL Server, sizes, entries, page density and fragmentation are read from the indexes themselves
        (``sys.dm_db_index_physical_stats``, SAMPLED), and the estimate is the size at the fill factor.
        """
        return self._reindexer.index_health()

    @renamed_kwargs(
        bloat_ratio="reindex_bloat_ratio",
        min_bloat_bytes="reindex_min_bytes",
        timeout_s="reindex_timeout",
        lock_wait_s="lock_wait",
        fragmentation_pct="reindex_fragmentation_pct",
        horizon_min_age_s="horizon_min_age",
    )
    def rebuild_indexes(
        self,
        *,
        reindex_bloat_ratio: float = REINDEX_BLOAT_RATIO,
        reindex_min_bytes: int = REINDEX_MIN_BYTES,
        reindex_timeout: float = REINDEX_TIMEOUT_S,
        analyze: bool = True,
        only: Sequence[str] | None = None,
        lock_wait: float = 0.0,
        reindex_fragmentation_pct: float = REINDEX_FRAGMENTATION_PCT,
        horizon_min_age: float | None = None,
    ) -> dict[str, Any]:
        """Rebuild bloated indexes online and clean up INVALID ones; return what was done.

        First the INVALID indexes: one left by a failed ``REINDEX CONCURRENTLY`` (``<name>_ccnew``,
        ``<name>_ccold``) is dropped with ``DROP INDEX CONCURRENTLY``; an INVALID index of the schema
        itself is rebuilt. Then every valid B-tree index at least ``reindex_bloat_ratio`` times its
        estimated size and ``reindex_min_bytes`` above it is rebuilt with ``REINDEX INDEX
        CONCURRENTLY``, which blocks neither reads nor writes. Indexes of a table on which an index
        build is running are left alone. A rebuild that fails (``reindex_timeout`` seconds passed, or it
        was cancelled) is reported, and the INVALID index it left is dropped at once (or by the next
        run).

        On SQL Server the step reads page density and fragmentation (:func:`mssql_rebuild_reason`) and
        runs ``ALTER INDEX ... REBUILD WITH (ONLINE = ON)`` where the engine edition has online index
        operations, ``REORGANIZE`` otherwise (:func:`rebuild_mode`, decided from the edition the server
        reports now); the result names the ``mode`` and the ``edition``. A failed rebuild rolls back and
        leaves nothing to clean up (``leftovers`` says so); a disabled index is reported and left alone.

        :param analyze: ANALYZE the tables first, so the entry counts behind the estimate are fresh
            (PostgreSQL; SQL Server reads its indexes directly).
        :param only: rebuild exactly these indexes of the schema (by name), bloated or not; INVALID
            leftovers of failed rebuilds are dropped all the same.
        :param reindex_fragmentation_pct: SQL Server only: also rebuild indexes of at least
            ``reindex_min_bytes`` whose leaf level is at least this many percent fragmented.
        :param horizon_min_age: seconds; before each online operation, look for transactions open longer than
            this (:meth:`xmin_holders`; replication slots aside, which it does not wait for): an online
            rebuild waits for every transaction older than itself, so while there is one it would queue
            behind it until ``reindex_timeout``. The operation is then not run, and its action says so
            (``skip``, ``ok`` false, with the holders in ``error``); the next run tries again. ``None``
            (the default when called alone) does not look.
        """
        return self._reindexer.rebuild(
            bloat_ratio=reindex_bloat_ratio,
            min_bloat_bytes=reindex_min_bytes,
            timeout_s=reindex_timeout,
            analyze=analyze,
            only=only,
            lock_wait_s=lock_wait,
            fragmentation_pct=reindex_fragmentation_pct,
            horizon_min_age_s=horizon_min_age,
        )

    @renamed_kwargs(
        bloat_ratio="compact_bloat_ratio",
        min_bloat_bytes="compact_min_bytes",
        lock_timeout_s="compact_lock_timeout",
        timeout_s="compact_timeout",
        lock_wait_s="lock_wait",
        horizon_min_age_s="compact_horizon_min_age",
    )
    def compact_rings(
        self,
        *,
        compact_bloat_ratio: float = COMPACT_BLOAT_RATIO,
        compact_min_bytes: int = COMPACT_MIN_BYTES,
        compact_lock_timeout: float = COMPACT_LOCK_TIMEOUT_S,
        compact_timeout: float = COMPACT_TIMEOUT_S,
        lock_wait: float = 0.0,
        compact_horizon_min_age: float = COMPACT_HORIZON_MIN_AGE_S,
        only: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Rewrite the ring's tables that outgrew their size back to it (PostgreSQL): ``VACUUM FULL``.

        A ring's slots are overwritten in place (HOT updates into the room each page keeps), so the
        table keeps the size ``ring_create`` laid it out in (:func:`ring_slots_laid_out_bytes`) as long
        as VACUUM can remove old row versions. While a transaction holds back the xmin horizon it
        cannot; new versions then go to new pages, and the table stays that size after the horizon
        moves on (VACUUM frees the pages for reuse, it does not give them back). This step rewrites
        ``ring_slots`` when it is at least ``compact_bloat_ratio`` times its laid-out size and
        ``compact_min_bytes`` above it; and ``ring_lanes``, ``ring_leases`` and ``ring_retry`` on the same
        rule against their live rows at their fillfactor. The rewrite packs the slots as they are
        (the slots of smaller payloads share pages); pushes of larger payloads then grow it a little.

        ``VACUUM FULL`` holds an ACCESS EXCLUSIVE lock for its whole run: every push and pop of every
        ring of the schema waits for it (a pop that waits past its 1 s lock timeout returns nothing).
        It waits at most ``compact_lock_timeout`` seconds for the lock (queued behind it, pushes and
        pops wait too), then gives up and the next run tries again; ``compact_timeout`` seconds bound
        the rewrite. It is not run while a transaction open longer than ``compact_horizon_min_age``
        seconds holds the horizon: the rewrite
        would keep every row version that transaction may still see (:meth:`xmin_holders`).

        :param only: rewrite exactly these tables (of :data:`RING_TABLES`), grown or not.
        :return: ``{"actions": [{"table", "action", "ok", "seconds", "bytes_before", "bytes_after",
            "expected_bytes", "reason", "error"}]}``, or ``{"skipped": ...}``.
        """
        return self._compactor.compact(
            bloat_ratio=compact_bloat_ratio,
            min_bloat_bytes=compact_min_bytes,
            lock_timeout_s=compact_lock_timeout,
            timeout_s=compact_timeout,
            lock_wait_s=lock_wait,
            horizon_min_age_s=compact_horizon_min_age,
            only=only,
        )

    def horizon(self) -> dict[str, Any]:
        """The xmin horizon now: what holds it furthest back whatever its age (``oldest``), the dead and
        live rows and size of each table of the schema (``tables``), their dead rows (``dead_rows``) and
        a ``note`` when the role cannot see every session (:func:`horizon.now`)."""
        return horizon.now(self._db)

    def sample(
        self,
        queues: Sequence[str] | None = None,
        *,
        samples_keep: float = SAMPLES_KEEP_S,
        batch_size: int = BATCH_SIZE,
        lock_wait: float = 0.0,
    ) -> dict[str, Any]:
        """Record one sample of each queue in the schema's ``samples`` table, and delete samples older
        than ``samples_keep`` seconds in batches of ``batch_size``; return what was done.

        A sample holds the queue's depth by state and oldest ready age (its stats), its push and pop
        totals or counts since its previous sample (see :mod:`~airflow_dbqueue.engine.maintenance.samples`
        for where they come from), a ring's consumer groups' lag, and the schema's horizon now
        (:meth:`horizon`: the oldest holder's age in seconds and in transaction ids, and the dead rows of
        the schema's tables). Takes the maintenance lock.

        :return: ``{"skipped", "recorded", "deleted", "taken_at", "queues": {name: {"pushed", "popped",
            "push_total", "pop_total"}}, "notes", "horizon"}``; ``notes`` names queues dropped meanwhile,
            which are not sampled.
        """
        state = self.horizon()
        out = samples.record(
            self._db,
            self._lock,
            self._queues,
            queues,
            horizon=state,
            keep_s=samples_keep,
            batch_size=batch_size,
            lock_wait_s=lock_wait,
        )
        out["horizon"] = state
        return out

    def samples(
        self, *, window: float = SAMPLES_KEEP_S, queues: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """The samples of the last ``window`` seconds, by queue name, oldest first (each a dict of
        :data:`~airflow_dbqueue.engine.maintenance.samples.SAMPLE_FIELDS`; ``at`` in seconds since the
        epoch). Read-only; a role reads the samples of the queues it may see."""
        return samples.read(self._db, window_s=window, queues=queues)

    @renamed_kwargs(rate_window_s="rate_window", horizon_min_age_s="horizon_min_age")
    def metrics(
        self,
        queues: Sequence[str] | None = None,
        *,
        rate_window: float = RATE_WINDOW_S,
        horizon_min_age: float = HORIZON_MIN_AGE_S,
        horizon_min_xid_age: int = HORIZON_MIN_XID_AGE,
    ) -> dict[str, Any]:
        """Return the schema's queue metrics as a JSON-safe dict (for logs, XCom and a metrics system).

        ``queues``: by queue, depth by state (``ready``, ``delayed``, ``in_flight``, ``failed``,
        ``finished`` waiting for the archiver), ``oldest_ready_age_s``, and ``pushed_per_s`` and
        ``finished_per_s`` over the last ``rate_window`` seconds. ``tables``: sizes, live and dead
        rows. ``indexes``: sizes and bloat estimates. ``xmin_holders``: what holds back VACUUM.
        ``horizon``: what holds it furthest back now, whatever its age (``oldest``, with its ``xid_age``
        and ``age_s``), and the dead rows of the schema's tables (``dead_rows``; :meth:`horizon`).
        """
        return collect_metrics(
            self._db,
            self._queues,
            queues,
            rate_window_s=rate_window,
            horizon_min_age_s=horizon_min_age,
            horizon_min_xid_age=horizon_min_xid_age,
        )

    # -- every step, in order ------------------------------------------------------------------------

    def run(self, config: MaintenanceConfig | None = None) -> dict[str, Any]:
        """Run every step under one hold of the lock; return a JSON-safe report of each.

        Order (:data:`STEPS`): the xmin-horizon check, each queue's upkeep (lease reclaim; ring gaps),
        archiving and archive retention, VACUUM (ANALYZE), ring compaction (not while a transaction
        older than ``min(horizon_min_age_s, 10)`` holds the horizon), index rebuilds, a sample of each
        queue, metrics.

        ``horizon`` says what a held xmin horizon cost the run (:func:`horizon.costs`): what held it, the
        dead rows of each table after the VACUUM, the tables whose VACUUM left at least
        ``horizon_min_dead_rows`` dead rows it could not remove, and the compactions and rebuilds not
        started because of it. When
        another run holds the lock past ``lock_wait_s``, only the metrics are collected and ``skipped``
        says why.

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
        notes: list[str] = []
        results: dict[str, Any] = {}
        with self.lock(cfg.lock_wait_s) as got:
            if not got:
                report["skipped"] = self._lock.skip_reason
            else:
                for name in STEPS[:-1]:
                    results[name] = self._steps[name](cfg, notes)
                    _into_report(report, name, results[name])
        report["metrics"] = self._metrics_step(cfg, notes)
        if results and results.get("sample") is None:  # samples off: the horizon's figures all the same
            results["sample"] = {"horizon": self.horizon()}
        report["horizon"] = horizon.costs(results, min_dead_rows=cfg.horizon_min_dead_rows)
        report["notes"] = list(dict.fromkeys(notes))
        report["incomplete"] = _incomplete(report)
        if report["incomplete"]:
            log.warning(
                "dbqueue maintenance of schema %r: %d step(s) did not complete: %s",
                self.schema,
                len(report["incomplete"]),
                "; ".join(f"{i['action']} {i['object']}: {i['why']}" for i in report["incomplete"]),
            )
        report["seconds"] = round(time.monotonic() - started, 3)
        return report

    def step(self, name: str, config: MaintenanceConfig | None = None) -> dict[str, Any]:
        """Run one step of :meth:`run` (a name of :data:`STEPS`) with the settings ``run`` gives it;
        return its JSON-safe result.

        A step that changes things takes the lock itself (waiting up to ``lock_wait_s``), so steps run
        one by one, each as a task of a scheduler, do what ``run`` does: ``archive`` returns
        ``{"archive", "purge_archive"}`` (retention runs only when archiving was not skipped),
        ``check_horizon`` ``{"xmin_holders"}``, ``upkeep`` ``{"queues"}``, ``sample`` what :meth:`sample`
        returns, the others their method's result (:func:`horizon.costs` makes a run's ``horizon``
        section of these results); a step its setting turns off returns ``{"skipped": "<setting> is off"}``.
        """
        if name not in self._steps:
            raise ConfigurationError(f"no maintenance step {name!r}; choose from {STEPS}")
        out = self._steps[name](config or MaintenanceConfig(), [])
        if out is None:
            setting, rest = _OFF[name]
            return {"skipped": f"{setting} is off", **rest}
        return out

    # The steps as run() and step() take them: each appends the notes it makes to ``notes``, and
    # returns None when its setting turns it off.

    def _check_horizon_step(self, cfg: MaintenanceConfig, notes: list[str]) -> dict[str, Any]:
        if not self._db.sees_all_activity():
            log.warning("dbqueue: %s", horizon.NO_MONITOR_NOTE)
            notes.append(horizon.NO_MONITOR_NOTE)
        holders = self.check_horizon(
            horizon_min_age=cfg.horizon_min_age_s, horizon_min_xid_age=cfg.horizon_min_xid_age
        )
        return {"xmin_holders": [h.as_dict() for h in holders]}

    def _upkeep_step(self, cfg: MaintenanceConfig, notes: list[str]) -> dict[str, Any]:
        return {"queues": upkeep(self._queues, _queues(cfg), limit=cfg.reclaim_limit, notes=notes)}

    def _archive_step(self, cfg: MaintenanceConfig, notes: list[str]) -> dict[str, Any]:
        batch: dict[str, Any] = {
            "batch_size": cfg.batch_size,
            "pause": cfg.pause_s,
            "time_budget": cfg.time_budget_s,
            "queues": _queues(cfg),
            "lock_wait": cfg.lock_wait_s,
        }
        archived = self.archive(archive_after=cfg.archive_after_s, **batch)
        notes += archived.notes
        purged = None
        if archived.skipped is None and cfg.archive_retention_s is not None:
            purged = self.purge_archive(archive_retention=cfg.archive_retention_s, **batch).as_dict()
        return {"archive": archived.as_dict(), "purge_archive": purged}

    def _vacuum_step(self, cfg: MaintenanceConfig, notes: list[str]) -> dict[str, Any] | None:
        recycled = None
        if cfg.recycle:
            recycled = self.recycle(
                recycle_move_limit=cfg.recycle_move_limit,
                recycle_min_bytes=cfg.recycle_min_bytes,
                recycle_lock_timeout=cfg.recycle_lock_timeout_s,
                lock_wait=cfg.lock_wait_s,
            )
        if not cfg.vacuum:
            return None if recycled is None else {"recycle": recycled}
        out = self.vacuum(lock_wait=cfg.lock_wait_s)
        if recycled is not None:
            out["recycle"] = recycled
        return out

    def _compact_step(self, cfg: MaintenanceConfig, notes: list[str]) -> dict[str, Any] | None:
        if not cfg.compact_rings:
            return None
        return self.compact_rings(
            compact_bloat_ratio=cfg.compact_bloat_ratio,
            compact_min_bytes=cfg.compact_min_bytes,
            compact_lock_timeout=cfg.compact_lock_timeout_s,
            lock_wait=cfg.lock_wait_s,
            compact_horizon_min_age=min(cfg.horizon_min_age_s, COMPACT_HORIZON_MIN_AGE_S),
        )

    def _reindex_step(self, cfg: MaintenanceConfig, notes: list[str]) -> dict[str, Any] | None:
        if not cfg.reindex:
            return None
        return self.rebuild_indexes(
            reindex_bloat_ratio=cfg.reindex_bloat_ratio,
            reindex_min_bytes=cfg.reindex_min_bytes,
            reindex_timeout=cfg.reindex_timeout_s,
            analyze=not cfg.vacuum,  # the vacuum step analyzed the tables already
            lock_wait=cfg.lock_wait_s,
            reindex_fragmentation_pct=cfg.reindex_fragmentation_pct,
            horizon_min_age=cfg.horizon_min_age_s,
        )

    def _sample_step(self, cfg: MaintenanceConfig, notes: list[str]) -> dict[str, Any] | None:
        if not cfg.samples:
            return None
        out = self.sample(
            _queues(cfg),
            samples_keep=cfg.samples_keep_s,
            batch_size=cfg.batch_size,
            lock_wait=cfg.lock_wait_s,
        )
        notes += out["notes"]
        return out

    def _metrics_step(self, cfg: MaintenanceConfig, notes: list[str]) -> dict[str, Any]:
        out = self.metrics(
            _queues(cfg),
            rate_window=cfg.rate_window_s,
            horizon_min_age=cfg.horizon_min_age_s,
            horizon_min_xid_age=cfg.horizon_min_xid_age,
        )
        notes += out["notes"]
        return out


def _queues(cfg: MaintenanceConfig) -> list[str] | None:
    return list(cfg.queues) if cfg.queues is not None else None


_RUN_KEYS = {"vacuum": "vacuum", "compact_rings": "compact", "rebuild_indexes": "indexes"}
"""The keys of :meth:`Maintenance.run`'s report that hold a step's result as it is."""


def _into_report(report: dict[str, Any], name: str, out: dict[str, Any] | None) -> None:
    """Put what step ``name`` returned into :meth:`Maintenance.run`'s report (nothing for a step
    turned off)."""
    if out is None:
        return
    if name == "check_horizon":
        report["xmin_holders"] = out["xmin_holders"]
    elif name == "upkeep":
        report["upkeep"] = out["queues"]
    elif name == "sample":
        report["samples"] = {k: v for k, v in out.items() if k != "horizon"}
    elif name == "archive":
        report["archive"] = out["archive"]
        if out["purge_archive"] is not None:
            report["purge_archive"] = out["purge_archive"]
    else:
        report[_RUN_KEYS[name]] = out


def _incomplete(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The ring compactions and index rebuilds of ``report`` that did not do their work."""
    return [
        {"step": "compact", "object": a["table"], "action": a["action"], "why": a["error"]}
        for a in report.get("compact", {}).get("actions", [])
        if not a["ok"]
    ] + [
        {"step": "indexes", "object": a["index"], "action": a["action"], "why": a["error"] or a["reason"]}
        for a in report.get("indexes", {}).get("actions", [])
        if not a["ok"]
    ]
