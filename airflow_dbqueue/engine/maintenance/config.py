"""The settings of a full maintenance run (:meth:`Maintenance.run`, one :meth:`Maintenance.step`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from airflow_dbqueue.engine.errors import ConfigurationError
from airflow_dbqueue.engine.maintenance.results import MiB
from airflow_dbqueue.engine.queue import check_seconds


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
