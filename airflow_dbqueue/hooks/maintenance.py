"""The maintenance DAG's steps on a hook: each step of the engine's :class:`Maintenance` with JSON-safe
results, and the queue metrics also sent through Airflow's metrics. Their defaults are the engine's
(``airflow_dbqueue.engine.maintenance.config``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine import MaintenanceConfig
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
    REINDEX_BLOAT_RATIO,
    REINDEX_FRAGMENTATION_PCT,
    REINDEX_MIN_BYTES,
    REINDEX_TIMEOUT_S,
    TIME_BUDGET_S,
)
from airflow_dbqueue.engine.queue import RECLAIM_LIMIT
from airflow_dbqueue.engine.renames import renamed_kwargs
from airflow_dbqueue.hooks.metrics import emit_metrics

if TYPE_CHECKING:
    import logging

    from airflow_dbqueue.engine import DbQueue, Maintenance


class MaintenanceSteps:
    """The maintenance steps of :class:`~airflow_dbqueue.hooks.dbqueue.DbQueueHook` (a mixin of it: the
    hook supplies the engine, :meth:`get_conn`, and its logger)."""

    if TYPE_CHECKING:
        log: logging.Logger

        def get_conn(self) -> DbQueue: ...

    def maintenance(self) -> Maintenance:
        """Return the engine's maintenance steps for this schema."""
        return self.get_conn().maintenance()

    @renamed_kwargs(
        older_than_s="archive_after", pause_s="pause", time_budget_s="time_budget", lock_wait_s="lock_wait"
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
    ) -> dict[str, Any]:
        """Move finished messages older than ``archive_after`` seconds into the archive in bounded
        batches.

        See :meth:`Maintenance.archive`. Returns a JSON-safe dict; ``skipped`` says why when another
        maintenance run held the schema's lock for longer than ``lock_wait`` seconds.
        """
        return (
            self.maintenance()
            .archive(
                archive_after=archive_after,
                batch_size=batch_size,
                pause=pause,
                time_budget=time_budget,
                queues=queues,
                lock_wait=lock_wait,
            )
            .as_dict()
        )

    @renamed_kwargs(
        older_than_s="archive_retention",
        pause_s="pause",
        time_budget_s="time_budget",
        lock_wait_s="lock_wait",
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
    ) -> dict[str, Any]:
        """Delete messages archived more than ``archive_retention`` seconds ago in bounded batches."""
        return (
            self.maintenance()
            .purge_archive(
                archive_retention=archive_retention,
                batch_size=batch_size,
                pause=pause,
                time_budget=time_budget,
                queues=queues,
                lock_wait=lock_wait,
            )
            .as_dict()
        )

    def recover(
        self, queues: Sequence[str] | None = None, *, limit: int = RECLAIM_LIMIT
    ) -> dict[str, dict[str, int]]:
        """Run each queue's design upkeep: reclaim expired leases (and, for ring queues, recover gaps)."""
        return self.maintenance().recover(queues, limit=limit)

    @renamed_kwargs(lock_wait_s="lock_wait")
    def vacuum(self, *, lock_wait: float = 0.0) -> dict[str, Any]:
        """VACUUM (ANALYZE) the schema's tables, skipping any that another session has locked.

        SQL Server has no VACUUM (its ghost cleanup task removes deleted rows): there the step runs
        UPDATE STATISTICS, and the result says so.
        """
        return self.maintenance().vacuum(lock_wait=lock_wait)

    @renamed_kwargs(
        bloat_ratio="compact_bloat_ratio",
        min_bloat_bytes="compact_min_bytes",
        lock_timeout_s="compact_lock_timeout",
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
    ) -> dict[str, Any]:
        """Rewrite ring tables that outgrew their laid-out size; see :meth:`Maintenance.compact_rings`
        (PostgreSQL; skipped on SQL Server, whose tables keep no old row versions)."""
        return self.maintenance().compact_rings(
            compact_bloat_ratio=compact_bloat_ratio,
            compact_min_bytes=compact_min_bytes,
            compact_lock_timeout=compact_lock_timeout,
            compact_timeout=compact_timeout,
            lock_wait=lock_wait,
            compact_horizon_min_age=compact_horizon_min_age,
        )

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
        lock_wait: float = 0.0,
        reindex_fragmentation_pct: float = REINDEX_FRAGMENTATION_PCT,
        horizon_min_age: float | None = None,
    ) -> dict[str, Any]:
        """Rebuild bloated indexes online; see :meth:`Maintenance.rebuild_indexes`.

        PostgreSQL: REINDEX INDEX CONCURRENTLY, and INVALID leftovers of failed rebuilds are dropped.
        SQL Server: ALTER INDEX ... REBUILD WITH (ONLINE = ON) where the engine edition allows it,
        REORGANIZE otherwise (the result's ``mode`` and ``edition`` say which);
        ``reindex_fragmentation_pct`` applies there only. With ``horizon_min_age`` (seconds), a rebuild
        is not run while a transaction open longer than that would hold it up (its action is ``skip``
        with ``ok`` false).
        """
        return self.maintenance().rebuild_indexes(
            reindex_bloat_ratio=reindex_bloat_ratio,
            reindex_min_bytes=reindex_min_bytes,
            reindex_timeout=reindex_timeout,
            lock_wait=lock_wait,
            reindex_fragmentation_pct=reindex_fragmentation_pct,
            horizon_min_age=horizon_min_age,
        )

    @renamed_kwargs(min_age_s="horizon_min_age", min_xid_age="horizon_min_xid_age")
    def check_horizon(
        self, *, horizon_min_age: float = HORIZON_MIN_AGE_S, horizon_min_xid_age: int = HORIZON_MIN_XID_AGE
    ) -> list[dict[str, Any]]:
        """Return (and log a warning for) whatever holds back cleanup, as JSON-safe dicts.

        PostgreSQL: the xmin horizon (VACUUM cannot remove dead rows). SQL Server: long transactions of
        the database and snapshot transactions (log truncation, row-version and ghost cleanup).
        """
        m = self.maintenance()
        holders = m.xmin_holders(horizon_min_age=horizon_min_age, horizon_min_xid_age=horizon_min_xid_age)
        what = (
            "Cleanup is held back (log truncation, row versions and ghost records)"
            if m.dialect == "mssql"
            else "The xmin horizon is held back (VACUUM cannot remove dead rows)"
        )
        for h in holders:
            self.log.warning("%s: %s", what, h.describe())
        return [h.as_dict() for h in holders]

    @renamed_kwargs(rate_window_s="rate_window")
    def queue_metrics(
        self, queues: Sequence[str] | None = None, *, rate_window: float = RATE_WINDOW_S, emit: bool = True
    ) -> dict[str, Any]:
        """Return the schema's queue metrics as a JSON-safe dict, and send them through Airflow's metrics.

        See :meth:`Maintenance.metrics` for the dict and :func:`emit_metrics` for the metric names.
        """
        metrics = self.maintenance().metrics(queues, rate_window=rate_window)
        if emit:
            sent = emit_metrics(metrics)
            self.log.info("Sent %d dbqueue gauges for schema %s", sent, metrics["schema"])
        return metrics

    def maintenance_step(
        self, name: str, config: MaintenanceConfig | Mapping[str, Any] | None = None, *, emit: bool = True
    ) -> dict[str, Any]:
        """Run one step of :meth:`maintain` (a name of ``STEPS``) as ``maintain`` runs it; return its
        JSON-safe result (see :meth:`Maintenance.step`). The maintenance DAG runs each step as a task
        of its own through this. The ``metrics`` step's result is also sent through Airflow's metrics
        unless ``emit`` is false.
        """
        if config is None or isinstance(config, Mapping):
            config = MaintenanceConfig.from_mapping(config or {})
        out = self.maintenance().step(name, config)
        if name == "metrics" and emit:
            sent = emit_metrics(out)
            self.log.info("Sent %d dbqueue gauges for schema %s", sent, out["schema"])
        return out

    def maintain(
        self, config: MaintenanceConfig | Mapping[str, Any] | None = None, *, emit: bool = True
    ) -> dict[str, Any]:
        """Run every maintenance step once under the schema's lock; return the JSON-safe report.

        ``config`` is a :class:`MaintenanceConfig` or a mapping of its fields (``None`` values keep
        the defaults). The report's ``metrics`` are also sent through Airflow's metrics unless ``emit``
        is false.
        """
        if config is None or isinstance(config, Mapping):
            config = MaintenanceConfig.from_mapping(config or {})
        report = self.maintenance().run(config)
        if report["skipped"]:
            self.log.warning("dbqueue maintenance skipped: %s", report["skipped"])
        if emit:
            emit_metrics(report["metrics"])
        return report
