"""What a ring holds, read without taking it, and its failed messages
(:mod:`airflow_dbqueue.engine.ring`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow_dbqueue.engine.errors import (
    QueueNotFoundError,
)
from airflow_dbqueue.engine.models import (
    FailedMessage,
    Message,
    QueueStats,
)
from airflow_dbqueue.engine.queue import COUNT_CAP, _check_batch_size
from airflow_dbqueue.engine.ring_base import (
    RingBase,
    failed_messages,
)

RING_STATS_EXACT_CAP = 50_000
"""A ring's stats() counts the lanes' messages in their slots up to this many numbers to take
(PostgreSQL); above it, by arithmetic over the lanes' positions, marked ``extra["estimated"]``."""


class RingInspect(RingBase):
    """Peeking, counting, stats and failed messages of a ring's group."""

    def peek(self, n: int = 10) -> list[Message]:
        n = _check_batch_size(n)
        with self._or_gone():
            rows = self._db.fetchall("ring_peek", {"queue_id": self._qid, "n": n, "group": self._gid})
        if not rows:
            self._raise_if_gone()  # a dropped ring or group has nothing to show either
        return self._messages(rows)

    def count_ready(self, min_priority: int | None = None, cap: int = COUNT_CAP) -> int:
        if min_priority is not None and min_priority > 0:
            return 0  # every ring message has priority 0
        with self._or_gone():
            row = self._db.fetchone("ring_count_ready", self._readiness_params(cap))
        if not (row and row[0]):
            self._raise_if_gone()
        return int(row[0]) if row else 0

    def _readiness_params(self, cap: int) -> dict[str, Any]:
        return {
            "queue_id": self._qid,
            "cap": cap,
            "max_attempts": self.settings.max_attempts,
            "group": self._gid,
        }

    def readiness(
        self, min_priority: int | None = None, cap: int = COUNT_CAP
    ) -> tuple[int, tuple[int, int] | None]:
        with self._or_gone():
            row = self._db.fetchone("ring_ready_head", self._readiness_params(cap))
        if row is None or (row[1] is None and not row[3]):  # an empty ring that was dropped
            self._raise_if_gone()
        return self._readiness_row(row, min_priority)

    @staticmethod
    def _readiness_row(
        row: tuple[Any, ...] | None, min_priority: int | None
    ) -> tuple[int, tuple[int, int] | None]:
        if row is None or row[1] is None:
            return 0, None
        ready = 0 if min_priority is not None and min_priority > 0 else int(row[0])
        return ready, (int(row[1]), int(row[2]))

    def leased(self, receipts: Sequence[tuple[int, int]]) -> list[Message]:
        stubs = self._receipt_messages(receipts)
        if not stubs:
            return []
        rows = self._db.fetchall("ring_leased", self._receipt_params(stubs))
        if not rows and self._gid != self._qid:
            self._raise_if_gone()  # the leases of a group dropped meanwhile went with it
        return self._messages(rows)

    def stats(self, *, exact: bool = False) -> QueueStats:
        with self._or_gone():
            row = self._db.fetchone(
                "ring_stats",
                {"queue_id": self._qid, "group": self._gid, "cap": 2**62 if exact else RING_STATS_EXACT_CAP},
            )
        if row is None or row[5] is None or row[6] is None:  # no ring, or no such group any more
            self._raise_if_gone()
            raise QueueNotFoundError(self.name, self._db.schema)
        push_pos, pop_pos, floor = int(row[5]), int(row[6]), int(row[7])
        # The numbers from the floor to the push position hold slots (or wait for them: a push of one
        # takes its number before it finds the ring full), so the ring's fill is at most 1.
        used = min(self.capacity, max(0, push_pos - floor + 1))
        return QueueStats(
            queue=self.name,
            ready=row[0],
            delayed=row[1],
            in_flight=row[2],
            failed=row[3],
            finished=0,  # a ring does not archive: a finished slot is reused
            oldest_ready_age_s=row[4],
            extra={
                "capacity": self.capacity,
                "lanes": int(row[9]),
                "push_position": push_pos,
                "pop_position": pop_pos,
                "floor": floor,
                "ring_used": used,
                "ring_fill": round(used / self.capacity, 4),
                "gaps_skipped": int(row[8]),
                "group": self.group_name,
                # PostgreSQL: above RING_STATS_EXACT_CAP numbers to take, ready is the lanes' depth by
                # arithmetic (gaps and pushes in progress included) and the oldest age a lane head's.
                **({"estimated": True} if len(row) > 10 and row[10] else {}),
                # What the group has still to finish: what it can take now or later, and what it holds.
                "lag_messages": int(row[0]) + int(row[1]) + int(row[2]),
                "lag_seconds": float(row[4] or 0.0),
            },
        )

    def list_failed(self, limit: int = 100, after_id: int = 0) -> list[FailedMessage]:
        rows = self._db.fetchall(
            "ring_list_failed",
            {"queue_id": self._qid, "after_id": after_id, "limit": limit, "group": self._gid},
        )
        if not rows:
            self._raise_if_gone()
        return failed_messages(self.name, self.settings, rows)

    def delete_failed(self, ids: Sequence[int] | None = None) -> int:
        params = {"queue_id": self._qid, "all": ids is None, "ids": list(ids or []), "group": self._gid}
        return len(self._db.fetchall("ring_delete_failed", params))
