"""The table design (seeds 002 and 004): an unbounded queue of meta rows with payloads apart.

Each operation is one named statement of the dialect; a batch is one round trip.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.errors import ConfigurationError, LeaseExpiredError
from airflow_dbqueue.engine.models import FailedMessage, Message, NotifyMode, QueueStats, Semantics
from airflow_dbqueue.engine.queue import Queue, _check_batch_size

if TYPE_CHECKING:
    import psycopg

    from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase
    from airflow_dbqueue.engine.models import QueueSettings

_PRIORITY_MIN, _PRIORITY_MAX = -32768, 32767


class TableQueue(Queue):
    """A queue of the table design."""

    def __init__(self, db: PostgresDatabase, settings: QueueSettings) -> None:
        super().__init__(db, settings)
        self._qid = settings.queue_id
        self._channel = db.channel(settings.queue_id)
        self._last_reclaim = 0.0
        # Expired leases are reclaimed by the maintenance DAG; lease-taking pops also reclaim at
        # most this often, so a queue without maintenance still redelivers.
        self.reclaim_every_s = min(1.0, settings.visibility_timeout_s / 2)

    # -- push --------------------------------------------------------------------------------------

    def push_batch(
        self,
        payloads: Iterable[Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        conn: psycopg.Connection[Any] | None = None,
    ) -> list[int]:
        items = list(payloads)
        if not items:
            return []
        if not isinstance(priority, int) or not _PRIORITY_MIN <= priority <= _PRIORITY_MAX:
            raise ConfigurationError(f"queue {self.name!r}: priority must be an integer in -32768..32767")
        if delay < 0:
            raise ConfigurationError(f"queue {self.name!r}: delay must be >= 0 seconds, got {delay}")
        encode = self.settings.encode
        encoded = [encode(p, i) for i, p in enumerate(items)]
        params: dict[str, Any] = {
            "payloads": encoded,
            "queue_id": self._qid,
            "priority": priority,
            "delay_s": float(delay),
        }
        mode = self.settings.notify
        if mode is NotifyMode.NEVER or delay > 0:
            rows = self._db.fetchall("push", params, conn)
        else:
            params["channel"] = self._channel
            params["always"] = mode is NotifyMode.ALWAYS
            rows = self._db.fetchall("push_notify", params, conn)
        return [r[0] for r in rows]

    # -- pop ---------------------------------------------------------------------------------------

    def _pop_once(
        self, n: int, semantics: Semantics, vt: float, consumer: str, conn: psycopg.Connection[Any] | None
    ) -> list[Message]:
        if semantics is Semantics.AT_LEAST_ONCE:
            now = time.monotonic()
            if now - self._last_reclaim >= self.reclaim_every_s:
                self._last_reclaim = now
                self.reclaim_expired()
            rows = self._db.fetchall(
                "pop_lease",
                {"queue_id": self._qid, "n": n, "visibility_timeout_s": vt, "consumer": consumer},
                conn,
            )
        else:
            rows = self._db.fetchall(
                "pop_take", {"queue_id": self._qid, "n": n, "archive": self.settings.archive}, conn
            )
        return self._messages(rows)

    def _messages(self, rows: list[tuple[Any, ...]]) -> list[Message]:
        decode, name = self.settings.decode, self.name
        return [
            Message(
                id=r[0],
                queue=name,
                priority=r[1],
                attempts=r[2],
                delivery=r[3],
                enqueued_at=r[4],
                lease_until=r[5],
                payload=decode(r[6]),
            )
            for r in rows
        ]

    def _until_due(self, default: float) -> float:
        row = self._db.fetchone("next_due", {"queue_id": self._qid})
        if row is None or row[0] is None:
            return default
        return max(0.01, min(default, float(row[0])))

    # -- finish ------------------------------------------------------------------------------------

    @staticmethod
    def _receipts(messages: Sequence[Message]) -> tuple[list[int], list[int]]:
        """Distinct receipts as (ids, deliveries); two receipts of one id stay two (one is stale)."""
        receipts = list(dict.fromkeys(m.receipt for m in messages))
        return [r[0] for r in receipts], [r[1] for r in receipts]

    def ack(self, messages: Sequence[Message], *, conn: psycopg.Connection[Any] | None = None) -> int:
        ids, deliveries = self._receipts(messages)
        if not ids:
            return 0
        params = {
            "ids": ids,
            "deliveries": deliveries,
            "queue_id": self._qid,
            "archive": self.settings.archive,
        }
        done = self._db.fetchall("ack", params, conn)
        if len(done) != len(ids):
            self._raise_lost(ids, deliveries, conn)
        return len(done)

    def _raise_lost(
        self, ids: list[int], deliveries: list[int], conn: psycopg.Connection[Any] | None
    ) -> None:
        held = set(
            self._db.fetchall(
                "held_receipts", {"ids": ids, "deliveries": deliveries, "queue_id": self._qid}, conn
            )
        )
        raise LeaseExpiredError(
            self.name, [i for i, d in zip(ids, deliveries, strict=True) if (i, d) not in held]
        )

    def nack(
        self,
        messages: Sequence[Message],
        *,
        delay: float | None = None,
        error: str | None = None,
        conn: psycopg.Connection[Any] | None = None,
    ) -> int:
        if delay is not None and delay < 0:
            raise ConfigurationError(f"queue {self.name!r}: nack delay must be >= 0 seconds, got {delay}")
        ids, deliveries = self._receipts(messages)
        if not ids:
            return 0
        params = {
            "ids": ids,
            "deliveries": deliveries,
            "delay_s": None if delay is None else float(delay),
            "backoff_s": self.settings.retry_backoff_s,
            "backoff_max_s": self.settings.retry_backoff_max_s,
            "queue_id": self._qid,
            "max_attempts": self.settings.max_attempts,
            "error": error,
        }
        done = self._db.fetchall("nack", params, conn)
        if len(done) != len(ids):
            self._raise_lost(ids, deliveries, conn)
        return len(done)

    def reclaim_expired(self, limit: int = 10_000) -> int:
        rows = self._db.fetchall(
            "reclaim_expired",
            {"queue_id": self._qid, "max_attempts": self.settings.max_attempts, "limit": limit},
        )
        return len(rows)

    # -- inspect and administer --------------------------------------------------------------------

    def peek(self, n: int = 10) -> list[Message]:
        rows = self._db.fetchall("peek", {"queue_id": self._qid, "n": _check_batch_size(n)})
        return self._messages(rows)

    def count_ready(self, min_priority: int | None = None, cap: int = 1_000_000) -> int:
        row = self._db.fetchone("count_ready", self._readiness_params(min_priority, cap))
        return int(row[0]) if row else 0

    def _readiness_params(self, min_priority: int | None, cap: int) -> dict[str, Any]:
        return {
            "queue_id": self._qid,
            "min_priority": _PRIORITY_MIN if min_priority is None else min_priority,
            "cap": cap,
        }

    @staticmethod
    def _readiness_row(row: tuple[Any, ...] | None) -> tuple[int, tuple[int, int] | None]:
        if row is None:
            return 0, None
        return int(row[0]), (None if row[1] is None else (int(row[1]), int(row[2])))

    def readiness(
        self, min_priority: int | None = None, cap: int = 1_000_000
    ) -> tuple[int, tuple[int, int] | None]:
        return self._readiness_row(self._db.fetchone("ready_head", self._readiness_params(min_priority, cap)))

    async def areadiness(
        self, aconn: psycopg.AsyncConnection[Any], min_priority: int | None = None, cap: int = 1_000_000
    ) -> tuple[int, tuple[int, int] | None]:
        with self._db.translate_errors():
            cur = await aconn.execute(self._db.query("ready_head"), self._readiness_params(min_priority, cap))
            return self._readiness_row(await cur.fetchone())

    async def alisten(self, aconn: psycopg.AsyncConnection[Any]) -> None:
        from psycopg import sql

        with self._db.translate_errors():
            await aconn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))

    def leased(self, receipts: Sequence[tuple[int, int]]) -> list[Message]:
        stubs = self._receipt_messages(receipts)
        if not stubs:
            return []
        ids, deliveries = self._receipts(stubs)
        rows = self._db.fetchall("leased", {"ids": ids, "deliveries": deliveries, "queue_id": self._qid})
        return self._messages(rows)

    def stats(self) -> QueueStats:
        row = self._db.fetchone("stats", {"queue_id": self._qid})
        assert row is not None
        return QueueStats(
            queue=self.name,
            ready=row[0],
            delayed=row[1],
            in_flight=row[2],
            failed=row[3],
            finished=row[4],
            oldest_ready_age_s=row[5],
        )

    def list_failed(self, limit: int = 100, after_id: int = 0) -> list[FailedMessage]:
        rows = self._db.fetchall("list_failed", {"queue_id": self._qid, "after_id": after_id, "limit": limit})
        decode = self.settings.decode
        return [
            FailedMessage(
                id=r[0],
                queue=self.name,
                priority=r[1],
                attempts=r[2],
                enqueued_at=r[3],
                last_error=r[4],
                payload=decode(r[5]),
            )
            for r in rows
        ]

    def requeue_failed(self, ids: Sequence[int] | None = None) -> int:
        params = {"queue_id": self._qid, "all": ids is None, "ids": list(ids or [])}
        return len(self._db.fetchall("requeue_failed", params))

    def delete_failed(self, ids: Sequence[int] | None = None) -> int:
        params = {
            "queue_id": self._qid,
            "all": ids is None,
            "ids": list(ids or []),
            "archive": self.settings.archive,
        }
        return len(self._db.fetchall("delete_failed", params))
