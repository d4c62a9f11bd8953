"""Ring compaction: rewrite a ring's tables that outgrew the size they were laid out in (row versions
kept while a transaction held back the horizon) back to it. Only where the database keeps old row
versions in the table (PostgreSQL); elsewhere the step says why it has nothing to do."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DbQueueError,
    LockTimeoutError,
    StatementTimeoutError,
)
from airflow_dbqueue.engine.maintenance.horizon import held_back
from airflow_dbqueue.engine.maintenance.lock import SchemaLock
from airflow_dbqueue.engine.queue import check_seconds

log = logging.getLogger(__name__)

RING_TABLES = ("ring_slots", "ring_lanes", "ring_leases", "ring_retry")
"""The tables :meth:`Maintenance.compact_rings` rewrites when they outgrew their size."""


class RingCompactor:
    """Compaction of the ring tables of one schema (see :meth:`Maintenance.compact_rings`)."""

    def __init__(self, db: Database, lock: SchemaLock) -> None:
        self._db = db
        self._lock = lock
        self.schema = db.schema

    def compact(
        self,
        *,
        bloat_ratio: float,
        min_bloat_bytes: int,
        lock_timeout_s: float,
        timeout_s: float,
        lock_wait_s: float,
        horizon_min_age_s: float,
        only: Sequence[str] | None,
    ) -> dict[str, Any]:
        if not math.isfinite(bloat_ratio) or bloat_ratio < 1 or min_bloat_bytes < 0:
            raise ConfigurationError(
                "need a finite compact_bloat_ratio >= 1 and compact_min_bytes >= 0, "
                f"got {bloat_ratio} and {min_bloat_bytes}"
            )
        check_seconds("compact_lock_timeout", lock_timeout_s, positive=True)
        check_seconds("compact_timeout", timeout_s, positive=True)
        check_seconds("compact_horizon_min_age", horizon_min_age_s)
        wanted = tuple(only) if only is not None else None
        unknown = sorted(set(wanted or ()) - set(RING_TABLES))
        if unknown:
            raise ConfigurationError(f"{unknown} are not ring tables; choose from {RING_TABLES}")
        if self._db.ring_compaction_skipped is not None:
            return {"skipped": self._db.ring_compaction_skipped}
        with self._lock.hold(lock_wait_s) as got:
            if not got:
                return {"skipped": self._lock.skip_reason, "actions": []}
            actions = [
                self._compact(
                    table,
                    size,
                    expected,
                    reason,
                    lock_s=lock_timeout_s,
                    timeout_s=timeout_s,
                    horizon_s=horizon_min_age_s,
                )
                for table, size, expected, reason in self._grown(wanted, bloat_ratio, min_bloat_bytes)
            ]
        return {"actions": actions}

    def _grown(
        self, wanted: Sequence[str] | None, bloat_ratio: float, min_bloat_bytes: int
    ) -> list[tuple[str, int, int, str]]:
        """``(table, size, expected size, why)`` of each ring table to rewrite."""
        conn = self._lock.conn
        laid_out = sum(
            self._db.ring_laid_out_bytes(int(capacity), int(slot_bytes))
            for _, capacity, slot_bytes in self._db.fetchall("compact_ring_layouts", None, conn)
        )
        out = []
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
            out.append((table, int(size), expected, reason))
        return out

    def _compact(
        self,
        table: str,
        size: int,
        expected: int,
        reason: str,
        *,
        lock_s: float,
        timeout_s: float,
        horizon_s: float,
    ) -> dict[str, Any]:
        what = f"VACUUM FULL {self.schema}.{table}"
        action: dict[str, Any] = {
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
        held = held_back(
            self._db,
            what,
            horizon_s,
            "they hold the xmin horizon: the rewrite would keep every row version they may see",
        )
        if held is not None:
            action["action"], action["error"] = "skip", held
            return action
        conn = self._lock.conn
        log.info("dbqueue: %s (%s)", what, reason)
        t0 = time.monotonic()
        try:
            with self._db.session_timeouts(conn, statement_s=timeout_s, lock_s=lock_s):
                self._db.execute("vacuum_full_table", None, conn, identifiers={"table": table})
        except DbQueueError as exc:
            action["error"] = self._failure(what, exc, lock_s, timeout_s)
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

    def _failure(self, what: str, exc: DbQueueError, lock_s: float, timeout_s: float) -> str:
        """Why a rewrite failed: its lock not granted in time, its timeout, or the error."""
        if isinstance(exc, LockTimeoutError):
            return f"{what} gave up waiting {lock_s:g}s for its lock; the next run tries again"
        if isinstance(exc, StatementTimeoutError):
            return f"{what} was cancelled ({self._db.describe_statement_timeout(timeout_s)})"
        return f"{what} failed: {exc}"
