"""Continuous archiving: finished messages older than a retention move from ``done`` (and their
payloads from ``data``) into ``archive``; an archive retention deletes archived rows later, the same way.

Both run in bounded batches of one statement each (``archive_batch``, ``purge_archive_batch``), each
its own transaction, with a pause between batches and a time budget per call. A batch skips rows other
sessions hold and holds its own row locks for one short statement, so push, pop and ack never wait for
it; its statement and lock timeouts bound it further.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from airflow_dbqueue.engine.dialects.base import Database
from airflow_dbqueue.engine.errors import ConfigurationError
from airflow_dbqueue.engine.maintenance.lock import SchemaLock
from airflow_dbqueue.engine.maintenance.queues import Queues
from airflow_dbqueue.engine.maintenance.results import BatchResult
from airflow_dbqueue.engine.queue import check_seconds

log = logging.getLogger(__name__)

BATCH_LOCK_TIMEOUT_S = 1.0
"""The most a batch waits for a lock: it skips locked rows, so a wait is on something else."""


# The named query of each step's batches.
_BATCH_QUERIES = {"archive": "archive_batch", "purge_archive": "purge_archive_batch"}


class Archiver:
    """Archiving and archive retention of one schema."""

    def __init__(self, db: Database, lock: SchemaLock, queues: Queues) -> None:
        self._db = db
        self._lock = lock
        self._queues = queues
        self.schema = db.schema

    def run(
        self,
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
        """Run ``step`` (``archive`` or ``purge_archive``) in batches; see :meth:`Maintenance.archive`."""
        age = "archive_after" if step == "archive" else "archive_retention"
        older_than_s = check_seconds(f"{step}: {age}", older_than_s)
        pause_s = check_seconds(f"{step}: pause", pause_s)
        time_budget_s = check_seconds(f"{step}: time_budget", time_budget_s)
        statement_timeout_s = check_seconds(f"{step}: statement_timeout", statement_timeout_s, positive=True)
        self._check_batch_size(step, batch_size)
        started = time.monotonic()
        notes: list[str] = []
        params = {"older_than_s": float(older_than_s), "n": batch_size, **self._queues.filter(queues, notes)}
        with self._lock.hold(lock_wait_s) as got:
            if not got:
                return BatchResult(self.schema, step, 0, 0, 0.0, "skipped", self._lock.skip_reason)
            conn = self._lock.conn
            with self._db.session_timeouts(
                conn, statement_s=statement_timeout_s, lock_s=BATCH_LOCK_TIMEOUT_S
            ):
                rows, batches, discarded, stopped = self._loop(
                    _BATCH_QUERIES[step],
                    params,
                    batch_size,
                    pause_s=pause_s,
                    budget_s=time_budget_s,
                    started=started,
                )
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

    def _check_batch_size(self, step: str, batch_size: int) -> None:
        """Refuse a batch size out of range; warn of one where the database may lock a whole table."""
        if not isinstance(batch_size, int) or not 1 <= batch_size <= 100_000:
            raise ConfigurationError(
                f"{step}: batch_size must be an integer in 1..100000, got {batch_size!r}"
            )
        escalation = self._db.escalation_rows
        if escalation is not None and batch_size > escalation:
            log.warning(
                "dbqueue %s: batch_size %d is above about %d rows, where the database may escalate a "
                "statement's row locks to a table lock that stalls pushes and pops; keep it lower",
                step,
                batch_size,
                escalation,
            )

    def _loop(
        self,
        query: str,
        params: dict[str, object],
        batch_size: int,
        *,
        pause_s: float,
        budget_s: float,
        started: float,
    ) -> tuple[int, int, int, str]:
        """Run batches until one comes back short or the time budget is spent: ``(rows, batches,
        discarded, why it stopped)``."""
        rows = batches = discarded = 0
        conn = self._lock.conn
        while True:
            with self._db.transaction(conn) as c:
                row = self._db.fetchone(query, params, c)
            # (rows the batch took, rows it moved): archive_batch deletes the finished rows of a dropped
            # queue without archiving them; purge_archive_batch moves what it takes.
            n = int(row[0]) if row else 0
            moved = int(row[1]) if row and len(row) > 1 else n
            rows += moved
            discarded += n - moved
            batches += 1
            if n < batch_size:
                return rows, batches, discarded, "drained"
            if time.monotonic() - started + pause_s >= budget_s:
                return rows, batches, discarded, "time budget"
            time.sleep(pause_s)
