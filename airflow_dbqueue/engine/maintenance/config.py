"""The settings of a full maintenance run (:meth:`Maintenance.run`, one :meth:`Maintenance.step`), and
their defaults as named constants: each step's method, the hook, the command line and the Queues page
take their defaults from here."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from airflow_dbqueue.engine.errors import ConfigurationError
from airflow_dbqueue.engine.maintenance.results import MiB
from airflow_dbqueue.engine.queue import RECLAIM_LIMIT, check_seconds

ARCHIVE_AFTER_S = 300.0
"""Finished messages older than this many seconds are archived."""
ARCHIVE_RETENTION_S = 7 * 24 * 3600.0
"""Archived messages older than this many seconds are deleted (a week)."""
BATCH_SIZE = 1000
"""Rows one statement of a batched step (archiving, retention) moves or deletes."""
PAUSE_S = 0.05
"""Seconds between the batches of a batched step."""
TIME_BUDGET_S = 60.0
"""The most seconds a batched step runs in one call."""
STATEMENT_TIMEOUT_S = 30.0
"""The statement timeout of one batch of a batched step."""
REINDEX_BLOAT_RATIO = 2.0
"""An index is rebuilt at this many times its estimated size ..."""
REINDEX_MIN_BYTES = MiB
"""... and this many bytes above it."""
REINDEX_FRAGMENTATION_PCT = 30.0
"""SQL Server: an index whose leaf level is this many percent fragmented is rebuilt too."""
REINDEX_TIMEOUT_S = 600.0
"""Statement and lock timeout of one online rebuild."""
COMPACT_TIMEOUT_S = REINDEX_TIMEOUT_S
"""Statement timeout of a ring compaction's rewrite."""
COMPACT_BLOAT_RATIO = 1.5
"""A ring table is rewritten at this many times its laid-out size ..."""
COMPACT_MIN_BYTES = 8 * MiB
"""... and this many bytes above it."""
COMPACT_LOCK_TIMEOUT_S = 2.0
"""The most seconds a ring table's rewrite waits for its exclusive lock."""
COMPACT_HORIZON_MIN_AGE_S = 10.0
"""A ring table is not rewritten while a transaction older than this many seconds holds the horizon."""
RECYCLE_MOVE_LIMIT = 10_000
"""The most delayed or failed messages one recycling moves out of old generations."""
RECYCLE_MIN_BYTES = 256 * 1024
"""A partition of the table design is emptied (TRUNCATE) when it holds no row and takes this many
bytes or more (an empty one, with its indexes, takes about 40 kB)."""
RECYCLE_LOCK_TIMEOUT_S = 0.05
"""The most seconds emptying a partition waits for its exclusive lock (pops queue behind it)."""
HORIZON_MIN_AGE_S = 300.0
"""Transactions open longer than this many seconds are reported as holding back cleanup."""
HORIZON_MIN_XID_AGE = 1_000_000
"""Replication slots holding an xmin older than this many transactions are reported."""
HORIZON_MIN_DEAD_ROWS = 1000
"""A table whose VACUUM left at least this many dead rows is named in a run's ``horizon`` section as what
the held horizon costs (fewer are the rows of transactions that were running at the time)."""
SAMPLES_KEEP_S = 24 * 3600.0
"""Samples older than this many seconds are deleted (a day)."""
RATE_WINDOW_S = 300.0
"""The window, in seconds, of the push and finish rates of the metrics."""


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
    :param recycle: empty the table design's partitions that hold no row any more (PostgreSQL,
        :meth:`Maintenance.recycle`; part of the vacuum step, before VACUUM).
    :param recycle_move_limit: the most delayed or failed messages moved out of old generations a run.
    :param recycle_min_bytes: empty only partitions of at least this many bytes.
    :param recycle_lock_timeout_s: the most emptying a partition waits for its lock.
    :param lock_wait_s: how long to wait for another run's lock before skipping.
    :param horizon_min_age_s: report transactions (and prepared ones) older than this holding the xmin.
    :param horizon_min_xid_age: report replication slots holding an xmin older than this many transactions.
    :param horizon_min_dead_rows: name a table whose VACUUM left at least this many dead rows in the
        run's ``horizon`` section.
    :param samples: record a sample of each queue (:meth:`Maintenance.sample`).
    :param samples_keep_s: delete samples older than this.
    :param rate_window_s: window of the push and finish rates.
    :param reclaim_limit: most expired leases a queue's upkeep returns in one call.
    """

    queues: tuple[str, ...] | None = None
    archive_after_s: float = ARCHIVE_AFTER_S
    archive_retention_s: float | None = ARCHIVE_RETENTION_S
    batch_size: int = BATCH_SIZE
    pause_s: float = PAUSE_S
    time_budget_s: float = TIME_BUDGET_S
    vacuum: bool = True
    reindex: bool = True
    reindex_bloat_ratio: float = REINDEX_BLOAT_RATIO
    reindex_min_bytes: int = REINDEX_MIN_BYTES
    reindex_fragmentation_pct: float = REINDEX_FRAGMENTATION_PCT
    reindex_timeout_s: float = REINDEX_TIMEOUT_S
    compact_rings: bool = True
    compact_bloat_ratio: float = COMPACT_BLOAT_RATIO
    compact_min_bytes: int = COMPACT_MIN_BYTES
    compact_lock_timeout_s: float = COMPACT_LOCK_TIMEOUT_S
    recycle: bool = True
    recycle_move_limit: int = RECYCLE_MOVE_LIMIT
    recycle_min_bytes: int = RECYCLE_MIN_BYTES
    recycle_lock_timeout_s: float = RECYCLE_LOCK_TIMEOUT_S
    lock_wait_s: float = 0.0
    horizon_min_age_s: float = HORIZON_MIN_AGE_S
    horizon_min_xid_age: int = HORIZON_MIN_XID_AGE
    horizon_min_dead_rows: int = HORIZON_MIN_DEAD_ROWS
    samples: bool = True
    samples_keep_s: float = SAMPLES_KEEP_S
    rate_window_s: float = RATE_WINDOW_S
    reclaim_limit: int = RECLAIM_LIMIT

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= 100_000:
            raise ConfigurationError(f"maintenance batch_size must be in 1..100000, got {self.batch_size}")
        for name in ("archive_after_s", "pause_s", "time_budget_s", "lock_wait_s", "horizon_min_age_s"):
            check_seconds(f"maintenance {name}", getattr(self, name))
        if self.archive_retention_s is not None:
            check_seconds("maintenance archive_retention_s (or None)", self.archive_retention_s)
        check_seconds("maintenance reindex_timeout_s", self.reindex_timeout_s, positive=True)
        check_seconds("maintenance rate_window_s", self.rate_window_s, positive=True)
        check_seconds("maintenance samples_keep_s", self.samples_keep_s, positive=True)
        if (
            isinstance(self.horizon_min_dead_rows, bool)
            or not isinstance(self.horizon_min_dead_rows, int)
            or (self.horizon_min_dead_rows < 0)
        ):
            raise ConfigurationError(
                f"horizon_min_dead_rows must be an integer >= 0, got {self.horizon_min_dead_rows!r}"
            )
        check_seconds("maintenance compact_lock_timeout_s", self.compact_lock_timeout_s, positive=True)
        check_seconds("maintenance recycle_lock_timeout_s", self.recycle_lock_timeout_s, positive=True)
        if self.recycle_move_limit < 0 or self.recycle_min_bytes < 0:
            raise ConfigurationError(
                "need recycle_move_limit >= 0 and recycle_min_bytes >= 0, got "
                f"{self.recycle_move_limit} and {self.recycle_min_bytes}"
            )
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
