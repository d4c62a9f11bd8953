"""The table design (after Al Zabir's meta/data queue and hasql-queue): an unbounded queue of meta
rows with payloads apart.

Each operation is one named statement of the dialect; a batch is one round trip.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.batches import BatchLedger
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    LeaseExpiredError,
    NotSupportedError,
    QueueNotFoundError,
    ReceiptsNotHeldError,
)
from airflow_dbqueue.engine.models import (
    Batch,
    FailedMessage,
    Message,
    NotifyMode,
    OnExpiry,
    Ordering,
    PayloadType,
    QueueStats,
    Semantics,
    messages_from_columns,
)
from airflow_dbqueue.engine.queue import (
    COUNT_CAP,
    DEFAULT_CONSUMER,
    RECLAIM_LIMIT,
    _check_batch_size,
    check_keys,
    check_seconds,
)

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import Database, DbConnection
    from airflow_dbqueue.engine.maintenance.recycler import AutoRecycler
    from airflow_dbqueue.engine.models import QueueSettings

_PRIORITY_MIN, _PRIORITY_MAX = -32768, 32767
# A payload of at most this many bytes lives in its message's meta row, a larger one in data (PostgreSQL
# and SQL Server both: see their schema.sql). A push whose payloads all fit says so, and PostgreSQL's
# table_push() then writes them with one plain INSERT. The flag only chooses between two statements
# that store the same rows, so a wrong one costs time, never data.
_INLINE_PAYLOAD_BYTES = 1900


class TableQueue(BatchLedger):
    """A queue of the table design."""

    def __init__(self, db: Database, settings: QueueSettings) -> None:
        super().__init__(db, settings)
        self._qid = settings.queue_id
        self._channel = db.channel(settings.queue_id)
        self._last_reclaim = 0.0
        # Expired leases are reclaimed by the maintenance DAG; every pop (and claim) also reclaims at
        # most this often, so a queue without maintenance still redelivers, and what readiness counts
        # (expired leases included) is what a pop gets.
        self.reclaim_every = min(1.0, settings.visibility_timeout_s / 2)
        # The DbQueue's partition recycling (None: off), told of every push, pop and ack: it runs a
        # pass about a second after work, on a connection of its own.
        self.recycler: AutoRecycler | None = None
        # A queue whose messages may expire (created with a ttl) or that is ordered per key claims, acks
        # and nacks with the statements that read and keep its messages' meta_opt rows (the *_with
        # queries); every other queue's have none, and its statements touch no meta_opt row.
        self._checks: dict[str, bool] | None = None
        if settings.ttl_s is not None or settings.ordering is Ordering.PER_KEY:
            self._checks = {
                "expiring": settings.ttl_s is not None,
                "per_key": settings.ordering is Ordering.PER_KEY,
            }

    def _worked(self) -> None:
        if self.recycler is not None:
            self.recycler.poke()

    # -- push --------------------------------------------------------------------------------------

    def push_batch(
        self,
        payloads: Iterable[Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        conn: DbConnection | None = None,
        dedup_keys: Sequence[str] | None = None,
        ttl: float | None = None,
        keys: Sequence[str | None] | None = None,
    ) -> list[int]:
        items = list(payloads)
        dkeys = None if dedup_keys is None else check_keys(self.name, "dedup key", dedup_keys, len(items))
        okeys = None
        if keys is not None:
            if not self._db.push_options:
                raise NotSupportedError(
                    f"queue {self.name!r}: ordering keys need ordering per key, which the "
                    f"{self._db.dialect_name} dialect does not have (docs/sqlserver.md)"
                )
            if self.settings.ordering is not Ordering.PER_KEY:
                raise ConfigurationError(
                    f"queue {self.name!r}: ordering keys need a queue created with ordering='per_key'"
                )
            okeys = check_keys(self.name, "key", keys, len(items), optional=True)
        if (dkeys is not None or ttl is not None) and not self._db.push_options:
            what = "deduplication keys on push need" if dkeys is not None else "a time to live needs"
            raise NotSupportedError(
                f"queue {self.name!r}: {what} the table design's push with options, which the "
                f"{self._db.dialect_name} dialect does not have (docs/sqlserver.md)"
            )
        if ttl is None:
            ttl = self.settings.ttl_s
        elif self.settings.ttl_s is None:
            raise ConfigurationError(
                f"queue {self.name!r}: a message's ttl needs a queue created with a ttl (its default), "
                "whose pops check expiry"
            )
        if not items:
            return []
        if not isinstance(priority, int) or not _PRIORITY_MIN <= priority <= _PRIORITY_MAX:
            raise ConfigurationError(f"queue {self.name!r}: priority must be an integer in -32768..32767")
        delay = check_seconds(f"queue {self.name!r}: delay", delay)
        if ttl is not None:
            ttl = check_seconds(f"queue {self.name!r}: ttl", ttl, positive=True)
            if ttl <= delay:
                raise ConfigurationError(
                    f"queue {self.name!r}: a message delayed {delay} s would expire before it is due "
                    f"(ttl {ttl} s counts from the push); give a ttl above the delay"
                )
        encoded = self.settings.encode_all(items)
        mode = self.settings.notify
        params: dict[str, Any] = {
            "payloads": encoded,
            "queue_id": self._qid,
            "priority": priority,
            "delay_s": float(delay),
            # Delayed pushes never notify: a waiting pop wakes when the next delayed message is due.
            "notify": 0 if mode is NotifyMode.NEVER or delay > 0 else 2 if mode is NotifyMode.ALWAYS else 1,
            "channel": self._channel,
            "inline": max(map(len, encoded)) <= _INLINE_PAYLOAD_BYTES,
        }
        if dkeys is not None or ttl is not None or okeys is not None:
            return self._push_with(params, dkeys, okeys, ttl, conn)
        rows = self._db.fetchall("push", params, conn)
        if len(rows) != len(encoded):  # nothing was written: the queue was dropped
            raise QueueNotFoundError(self.name, self._db.schema)
        self._worked()
        return [r[0] for r in rows]

    def _push_with(
        self,
        params: dict[str, Any],
        keys: list[str] | None,
        okeys: list[str | None] | None,
        ttl: float | None,
        conn: DbConnection | None,
    ) -> list[int]:
        """Push with deduplication keys, ordering keys (one a payload each) or a time to live, with
        ``push``'s params. A deduplication key repeated within the batch sends its first payload only
        (with its ordering key), so the keys a statement claims are distinct."""
        del params["inline"]
        params["ttl_s"] = ttl
        params["okeys"] = okeys
        if keys is None:
            params["keys"] = None
            rows = self._db.fetchall("push_with", params, conn)
            if len(rows) != len(params["payloads"]):  # nothing was written: the queue was dropped
                raise QueueNotFoundError(self.name, self._db.schema)
            self._worked()
            return [r[0] for r in rows]
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        sent = list(first.values())
        if len(sent) < len(keys):
            payloads = params["payloads"]
            params["payloads"] = [payloads[i] for i in sent]
            if okeys is not None:
                params["okeys"] = [okeys[i] for i in sent]
        params["keys"] = list(first)
        rows = self._db.fetchall("push_with", params, conn)
        if len(rows) != len(sent):  # nothing was written: the queue was dropped
            raise QueueNotFoundError(self.name, self._db.schema)
        self._worked()
        ids = dict(zip(first, (r[0] for r in rows), strict=True))
        return [ids[k] for k in keys]

    # -- pop ---------------------------------------------------------------------------------------

    def _pop_once(
        self, n: int, semantics: Semantics, vt: float, consumer: str, conn: DbConnection | None
    ) -> list[Message]:
        # Every pop reclaims expired leases first (at most every reclaim_every): readiness counts
        # them as a pop would get them, so an observer that saw them ready is not followed by a pop of
        # none. In the caller's transaction (conn), the reclaim joins it.
        self._maybe_reclaim(conn)
        checks = self._checks
        if semantics is Semantics.AT_LEAST_ONCE:
            params: dict[str, Any] = {
                "queue_id": self._qid,
                "n": n,
                "visibility_timeout_s": vt,
                "consumer": consumer,
            }
            if checks is None:
                rows = self._db.fetchall("pop_lease", params, conn)
            else:
                rows = self._db.fetchall("pop_lease_with", {**params, **checks}, conn)
        else:
            params = {"queue_id": self._qid, "n": n, "archive": self.settings.archive}
            if checks is None:
                rows = self._db.fetchall("pop_take", params, conn)
            else:
                rows = self._db.fetchall("pop_take_with", {**params, **checks}, conn)
        return self._messages(rows)

    def _pop_payloads_once(self, n: int, semantics: Semantics, conn: DbConnection | None) -> list[Any]:
        if not self._db.payload_pops:
            return super()._pop_payloads_once(n, semantics, conn)
        self._maybe_reclaim(conn)
        params = {"queue_id": self._qid, "n": n, "archive": self.settings.archive}
        if self._checks is None:
            rows = self._db.fetchall("pop_take_payloads", params, conn)
        else:
            rows = self._db.fetchall("pop_take_payloads_with", {**params, **self._checks}, conn)
        return self.settings.decode_first_column(rows)

    def _maybe_reclaim(self, conn: DbConnection | None = None) -> None:
        self._worked()  # every pop and claim passes here
        now = time.monotonic()
        if now - self._last_reclaim >= self.reclaim_every:
            self._last_reclaim = now
            self._reclaim(RECLAIM_LIMIT, conn)
            if self.settings.ttl_s is not None:
                # A queue whose messages expire by default is swept by its pops too; one that only some
                # pushes give a ttl is swept by the upkeep. Either way no claim takes an expired message.
                self._expire(RECLAIM_LIMIT, conn)

    def _messages(self, rows: list[tuple[Any, ...]]) -> list[Message]:
        # Rows (id, priority, attempts, delivery, enqueued_at, lease_until, payload), read in binary: a
        # bytea is bytes already.
        if not rows:
            return []
        ids, priorities, attempts, deliveries, enqueued, until, payloads = zip(*rows, strict=True)
        if self.settings.payload_type is not PayloadType.BYTES:
            payloads = tuple(map(self.settings.decode, payloads))
        return messages_from_columns(
            ids, self.name, payloads, priorities, attempts, deliveries, enqueued, until
        )

    def _pushing(self) -> bool:
        row = self._db.fetchone("pushing", {"queue_id": self._qid})
        return bool(row and row[0])

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

    def ack(self, messages: Sequence[Message], *, conn: DbConnection | None = None) -> int:
        ids, deliveries = self._receipts(messages)
        if not ids:
            return 0
        params = {
            "ids": ids,
            "deliveries": deliveries,
            "queue_id": self._qid,
            "archive": self.settings.archive,
        }
        try:  # guarded: a lost lease must leave the caller's transaction usable
            with self._db.guarded(conn) as c:
                done = self._db.fetchall("ack" if self._checks is None else "ack_with", params, c)
        except ReceiptsNotHeldError:  # the statement changed nothing
            done = []
        if len(done) != len(ids):
            self._raise_lost(ids, deliveries, conn)
        self._worked()
        return len(done)

    def _raise_lost(self, ids: list[int], deliveries: list[int], conn: DbConnection | None) -> None:
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
        conn: DbConnection | None = None,
    ) -> int:
        if delay is not None:
            delay = check_seconds(f"queue {self.name!r}: nack delay", delay)
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
        done = self._db.fetchall("nack" if self._checks is None else "nack_with", params, conn)
        if len(done) != len(ids):
            self._raise_lost(ids, deliveries, conn)
        return len(done)

    def expire_messages(self, limit: int = RECLAIM_LIMIT) -> int:
        """Move up to ``limit`` ready messages whose time to live passed to the failed state (``last_error``
        ``"expired"``), or drop them (``on_expiry="drop"``); return how many. Pops never take them
        meanwhile; the upkeep and, on a queue with a ``ttl``, the pops call this."""
        return self._expire(limit, None)

    def _expire(self, limit: int, conn: DbConnection | None) -> int:
        if not self._db.push_options:
            return 0
        if self.settings.on_expiry is OnExpiry.DROP:
            params = {"queue_id": self._qid, "limit": limit, "archive": self.settings.archive}
            return len(self._db.fetchall("expire_drop", params, conn))
        return len(self._db.fetchall("expire_fail", {"queue_id": self._qid, "limit": limit}, conn))

    def reclaim_expired(self, limit: int = RECLAIM_LIMIT) -> int:
        return self._reclaim(limit, None)

    def _reclaim(self, limit: int, conn: DbConnection | None) -> int:
        rows = self._db.fetchall(
            "reclaim_expired",
            {"queue_id": self._qid, "max_attempts": self.settings.max_attempts, "limit": limit},
            conn,
        )
        return len(rows)

    # -- inspect and administer --------------------------------------------------------------------

    def peek(self, n: int = 10) -> list[Message]:
        params = {"queue_id": self._qid, "n": _check_batch_size(n), "opts": self._checks is not None}
        rows = self._db.fetchall("peek", params)
        return self._messages(rows)

    def count_ready(self, min_priority: int | None = None, cap: int = COUNT_CAP) -> int:
        row = self._db.fetchone("count_ready", self._readiness_params(min_priority, cap))
        return int(row[0]) if row else 0

    def _readiness_params(self, min_priority: int | None, cap: int) -> dict[str, Any]:
        return {
            "queue_id": self._qid,
            "min_priority": _PRIORITY_MIN if min_priority is None else min_priority,
            "cap": cap,
            "max_attempts": self.settings.max_attempts,
            "opts": self._checks is not None,  # whether its messages may have meta_opt rows to check
        }

    @staticmethod
    def _readiness_row(row: tuple[Any, ...] | None) -> tuple[int, tuple[int, int] | None]:
        if row is None:
            return 0, None
        return int(row[0]), (None if row[1] is None else (int(row[1]), int(row[2])))

    def readiness(
        self, min_priority: int | None = None, cap: int = COUNT_CAP
    ) -> tuple[int, tuple[int, int] | None]:
        return self._readiness_row(self._db.fetchone("ready_head", self._readiness_params(min_priority, cap)))

    def leased(self, receipts: Sequence[tuple[int, int]]) -> list[Message]:
        stubs = self._receipt_messages(receipts)
        if not stubs:
            return []
        ids, deliveries = self._receipts(stubs)
        rows = self._db.fetchall("leased", {"ids": ids, "deliveries": deliveries, "queue_id": self._qid})
        return self._messages(rows)

    def stats(self, *, exact: bool = False) -> QueueStats:
        cap = EXACT_COUNT if exact else STATS_EXACT_CAP
        row = self._db.fetchone("stats", {"queue_id": self._qid, "cap": cap})
        assert row is not None
        stats = stats_from_row(self.name, row)
        if stats.failed and self._db.push_options:
            expired = self._db.fetchone("count_expired", {"queue_id": self._qid, "cap": cap})
            if expired and expired[0]:
                stats.extra["expired"] = int(expired[0])
        return stats

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

    # -- batches -----------------------------------------------------------------------------------

    @property
    def _ledger_key(self) -> int:
        return self._qid

    def claim_batch(
        self,
        n: int,
        *,
        visibility_timeout: float | None = None,
        consumer: str | None = None,
        conn: DbConnection | None = None,
    ) -> Batch | None:
        vt = self._visibility_timeout(visibility_timeout)
        self._maybe_reclaim(conn)
        params = {
            "batch_id": uuid.uuid4(),
            "queue_id": self._qid,
            "n": _check_batch_size(n),
            "visibility_timeout_s": vt,
            "consumer": consumer or DEFAULT_CONSUMER,
        }
        if self._checks is None:
            row = self._db.fetchone("claim_batch", params, conn)
        else:
            row = self._db.fetchone("claim_batch_with", {**params, **self._checks}, conn)
        return None if row is None else self._batch(row)

    def maintain(self, *, limit: int = RECLAIM_LIMIT) -> dict[str, int]:
        """Reclaim expired leases, forget batches finished more than ``batch_retention_s`` ago and
        deduplication keys older than the queue's window, and expire messages whose time to live passed
        (up to ``limit`` of each)."""
        purged = self._purge_batches(limit)
        forgotten = 0
        if self._db.push_options:
            forget = {"queue_id": self._qid, "window_s": self.settings.dedup_window_s, "n": limit}
            forgotten = len(self._db.fetchall("forget_dedup", forget))
        reclaimed = self.reclaim_expired(limit)
        expired = self.expire_messages(limit)
        return {
            "reclaimed": reclaimed,
            "batches_purged": purged,
            "keys_forgotten": forgotten,
            "expired": expired,
        }

    def batch_query(self, batch_id: str) -> str:
        return self._db.render("batch_rows", self._batch_key(batch_id))

    def _held(self, receipts: Sequence[tuple[int, int]], conn: DbConnection) -> list[tuple[int, int]]:
        ids = [r[0] for r in receipts]
        deliveries = [r[1] for r in receipts]
        return list(
            self._db.fetchall(
                "held_receipts", {"ids": ids, "deliveries": deliveries, "queue_id": self._qid}, conn
            )
        )

    def _extend(self, receipts: Sequence[tuple[int, int]], seconds: float, conn: DbConnection) -> dt.datetime:
        ids = [r[0] for r in receipts]
        deliveries = [r[1] for r in receipts]
        params = {"ids": ids, "deliveries": deliveries, "queue_id": self._qid}
        rows = self._db.fetchall("extend_leases", {**params, "secs": seconds}, conn)
        if len(rows) != len(ids):
            self._raise_lost(ids, deliveries, conn)
        until: dt.datetime = rows[0][1]
        return until


STATS_EXACT_CAP = 50_000
EXACT_COUNT = 2**62
"""The cap of stats(exact=True): more than any queue holds."""
"""A table-design queue's stats count each state exactly up to this many messages; a state with more is
estimated from a sample (PostgreSQL), and the stats say so (``extra["estimated"]``)."""


def stats_from_row(name: str, row: Sequence[Any]) -> QueueStats:
    """A table-design queue's stats from a row of the ``stats`` query (or of ``stats_all`` without its
    queue id): ready, delayed, in flight, failed, finished, the oldest ready age, and whether any of them
    is an estimate (a seventh column where the dialect estimates); an eighth column, where the row has
    one, counts the failed messages that failed by expiry (``extra["expired"]`` when there are any)."""
    extra: dict[str, Any] = {}
    if len(row) > 6 and row[6]:
        extra["estimated"] = True
    if len(row) > 7 and row[7]:
        extra["expired"] = int(row[7])
    return QueueStats(
        queue=name,
        ready=int(row[0]),
        delayed=int(row[1]),
        in_flight=int(row[2]),
        failed=int(row[3]),
        finished=int(row[4]),
        oldest_ready_age_s=None if row[5] is None else float(row[5]),
        extra=extra,
    )
