"""Recycling of the table design's partitions: TRUNCATE the generations of ``meta``, ``data`` and
``done`` that hold no row any more, after moving the few delayed or failed messages that would keep
an old generation from emptying into the one pushes write now. Unlike VACUUM, a TRUNCATE gives the
space of dead row versions back (to the file system, with their index entries) also while the xmin
horizon is held, and with no lock held longer than a partition's check and truncation. Only where the
database keeps old row versions in the table (PostgreSQL); elsewhere the step says why it has nothing
to do."""

from __future__ import annotations

import logging
import time
from typing import Any

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.errors import ConfigurationError
from airflow_dbqueue.engine.maintenance.lock import SchemaLock
from airflow_dbqueue.engine.queue import check_seconds

log = logging.getLogger(__name__)


class TableRecycler:
    """The partition recycling of one schema (see :meth:`Maintenance.recycle`)."""

    def __init__(self, db: Database, lock: SchemaLock) -> None:
        self._db = db
        self._lock = lock

    def recycle(
        self, *, move_limit: int, min_bytes: int, lock_timeout_s: float, lock_wait_s: float
    ) -> dict[str, Any]:
        if move_limit < 0 or min_bytes < 0:
            raise ConfigurationError(
                f"need recycle_move_limit >= 0 and recycle_min_bytes >= 0, got {move_limit} and {min_bytes}"
            )
        check_seconds("recycle_lock_timeout", lock_timeout_s, positive=True)
        if self._db.table_recycling_skipped is not None:
            return {"skipped": self._db.table_recycling_skipped}
        with self._lock.hold(lock_wait_s) as got:
            if not got:
                return {"skipped": self._lock.skip_reason}
            moved = 0
            if move_limit:
                row = self._db.fetchone("table_move_stragglers", {"n": move_limit})
                moved = int(row[0]) if row else 0
            emptied: list[str] = []
            busy: list[str] = []
            freed = 0
            longest = locked = 0.0
            for table, gen, size, _current in self._db.fetchall("table_partitions"):
                if size < min_bytes:
                    continue
                t0 = time.monotonic()
                row = self._db.fetchone(
                    "table_empty_partition",
                    {"table": table, "gen": gen, "lock_timeout_ms": max(1, int(lock_timeout_s * 1000))},
                )
                longest = max(longest, time.monotonic() - t0)
                if row is None or row[0] is None:
                    busy.append(f"{table}_{gen}")
                elif row[0] >= 0:
                    emptied.append(f"{table}_{gen}")
                    freed += int(size)
                    locked = max(locked, float(row[0]) / 1000)
        out = {
            "moved": moved,
            "emptied": emptied,
            "lock_not_granted": busy,
            "freed_bytes": freed,
            "longest_s": round(longest, 4),
            "longest_lock_s": round(locked, 4),
        }
        if moved or emptied or busy:
            log.info("dbqueue partition recycling of schema %r: %s", self._db.schema, out)
        return out
