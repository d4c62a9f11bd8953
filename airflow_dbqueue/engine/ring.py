"""The ring design (seeds 000/001): a preallocated table of slots driven by a push and a pop position.

A ring of capacity C holds C rows in ``ring_slots`` for ever: pushes and pops are UPDATEs of them
(HOT: no indexed column changes), so the table never grows. Message ids are the numbers of the
ring's push sequence; number x lives in slot ``x % C``, and a push of x may only overwrite a slot
whose previous occupant ``x - C`` is finished.

Pushing (server-side ``ring_push``): take n contiguous numbers, write their slots, all in the caller's
transaction. A slot whose previous occupant is not finished is the ring pushing back: the push waits
with backoff up to ``push_timeout`` seconds, then raises :class:`QueueFullError` (nothing pushed).

Popping (server-side ``ring_pop``): each consumer keeps a lower bound ``lo`` of the lowest unfinished
number (finished numbers never become unfinished again, so any bound from a committed snapshot stays
valid) and claims the lowest ready messages of the window ``[lo, lo + C)`` with ``FOR UPDATE SKIP
LOCKED``, in id order. There is no pop sequence: a consumer that dies, gives up or rolls back holds no
number, and whatever it took but did not commit is ready again for the next pop.

Gaps: a push that rolled back (or whose process died) after taking its numbers leaves them unwritten,
because sequences are not transactional. A pop that finds the lowest unfinished number issued but
unwritten reports it with the issued position and, when it stays, a list of the possible holders;
a later pop gives every such number up (state skipped, seq set to the number) once every holder listed
is gone, or, after ``gap_timeout`` seconds as a fallback (a holder alive but stuck, or other
transactions that keep the proof from holding, such as pushers waiting on a full ring), the run of
unwritten numbers at the head. Skipping is always safe: a late push of a skipped number finds the
slot's seq moved on, fails whole and is retried with new numbers, so it is neither lost nor delivered
out of order with itself.

The list of holders (``snap`` below) is the dialect's. On PostgreSQL it is the transactions holding
their transactionid lock (``pg_locks``): a push takes an xid before its numbers, and the proof is that
none of them holds it any more. On SQL Server, which has no such view for an ordinary user, a push
locks one of the ring's lanes (a row of ``ring_lanes``, until its transaction ends) before it takes
its numbers; the list is the lanes other transactions held, and the proof is that each has been seen
unlocked since (``docs/sqlserver.md``). Either way the position is read before the list is taken.

The same class runs on both dialects: every statement is a named query of the dialect. Only the async
observers (:meth:`RingQueue.areadiness`, :meth:`RingQueue.alisten`) are PostgreSQL's alone (psycopg's
async connections and LISTEN).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    LeaseExpiredError,
    LockTimeoutError,
    QueueFullError,
    RingNumbersSkippedError,
)
from airflow_dbqueue.engine.models import (
    FailedMessage,
    Message,
    NotifyMode,
    QueueStats,
    Semantics,
    message_maker,
)
from airflow_dbqueue.engine.queue import Queue, _check_batch_size

if TYPE_CHECKING:
    import psycopg

    from airflow_dbqueue.engine.dialects.base import Database, DbConnection
    from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase
    from airflow_dbqueue.engine.models import QueueSettings

RING_MAX_PAYLOAD = 4000
"""Largest payload a ring slot holds (inline: about half a page, so a row and its next version share a
page and updates stay HOT). Larger payloads belong in the table design."""
RING_DEFAULT_PAYLOAD = 512
"""A ring's default ``max_payload_bytes``. The slots' pages are laid out for payloads of the queue's
``max_payload_bytes`` (a page holds about half a page of full slots), so a larger limit spreads the ring
over more pages."""
RING_DEFAULT_CAPACITY = 16384
RING_MAX_CAPACITY = 16_777_216
_NOTIFY_CODE = {NotifyMode.NEVER: 0, NotifyMode.AUTO: 1, NotifyMode.ALWAYS: 2}
_PUSH_ATTEMPTS = 20
_STALE_BOUND = 256
"""A claim whose first message lies more than this (or the batch size) past the consumer's bound makes
the next pop a ``ring_pop``, which moves the bound on."""
_first = itemgetter(0)
_make_message = message_maker()
_id = attrgetter("id")


class RingQueue(Queue):
    """A queue of the ring design.

    FIFO by id, without priorities or delayed pushes (both raise :class:`ConfigurationError`). Under
    at-least-once a leased message keeps its slot until it is acked, nacked or its lease expires: the
    ring cannot reuse that slot meanwhile, so pushes a whole ring ahead of it wait.

    :attr push_timeout: seconds a push waits for a full ring before :class:`QueueFullError`.
    :attr gap_timeout: seconds after which a pop gives up a number that stays issued but unwritten
        even without proof that its holder is gone (a holder alive but stuck that long).
    """

    def __init__(self, db: Database, settings: QueueSettings) -> None:
        super().__init__(db, settings)
        if settings.capacity is None:
            raise ConfigurationError(f"queue {settings.name!r} is a ring without a capacity")
        self._qid = settings.queue_id
        self.capacity = settings.capacity
        self._channel = db.channel(settings.queue_id)
        self._lock = threading.Lock()
        self._lo: int | None = None
        self._gap: tuple[int, int, str | None] | None = None  # (number, issued position, holders)
        self._gap_since: tuple[int, float] | None = None
        self._last_reclaim = 0.0
        self._fast = False  # the last pop came back full: the next one tries ring_claim first
        self.push_timeout = 30.0
        self.gap_timeout = 5.0
        self.reclaim_every_s = min(1.0, settings.visibility_timeout_s / 2)

    # -- push --------------------------------------------------------------------------------------

    def push_batch(
        self,
        payloads: Iterable[Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        conn: DbConnection | None = None,
    ) -> list[int]:
        items = list(payloads)
        if priority != 0:
            raise ConfigurationError(
                f"queue {self.name!r} is a ring: FIFO by id, without priorities (got priority={priority}); "
                "use the table design for priorities"
            )
        if delay != 0:
            raise ConfigurationError(
                f"queue {self.name!r} is a ring: a push cannot be delayed (got delay={delay}); "
                "use the table design for delayed messages"
            )
        if not items:
            return []
        if len(items) > self.capacity:
            raise ConfigurationError(
                f"queue {self.name!r}: a ring batch holds at most the capacity ({self.capacity}) messages, "
                f"got {len(items)}"
            )
        encode = self.settings.encode
        encoded = [encode(p, i) for i, p in enumerate(items)]
        first = self._push_encoded(encoded, conn)
        return list(range(first, first + len(encoded)))

    def _push_encoded(self, encoded: list[bytes], conn: DbConnection | None) -> int:
        params = {
            "queue_id": self._qid,
            "capacity": self.capacity,
            "payloads": encoded,
            "timeout_s": float(self.push_timeout),
            "notify": _NOTIFY_CODE[self.settings.notify],
            "channel": self._channel,
            "first": None,
        }
        one = conn is None and len(encoded) == 1
        deadline: float | None = None
        pause = 0.0005
        attempt = 0
        while True:
            try:
                if one:
                    # One message outside a caller's transaction: one statement (ring_push_one), which
                    # writes its number's slot if it is free. Otherwise the number is written by
                    # ring_push, which waits for the slot (params["first"]). Once: a retry after a
                    # number given up as a gap goes through ring_push.
                    one = False
                    row = self._db.fetchone("ring_push_one", {**params, "payload": encoded[0]})
                    if row is not None and row[0] is not None:
                        if len(row) < 2 or row[1]:  # SQL Server's row is the first number, always written
                            return int(row[0])
                        params["first"] = int(row[0])
                if conn is None:
                    row = self._db.fetchone("ring_push", params)
                else:  # a savepoint: a failed attempt leaves the caller's transaction usable
                    with self._db.transaction(conn):
                        row = self._db.fetchone("ring_push", params, conn)
            except RingNumbersSkippedError:
                attempt += 1
                if attempt == _PUSH_ATTEMPTS:
                    raise
                params["first"] = None
                continue  # our numbers were given up as gaps: nothing was written; new numbers
            except QueueFullError:
                raise self._full_error() from None
            assert row is not None
            if row[0] is not None:
                return int(row[0])
            # The ring is full for the batch and nothing was taken (PostgreSQL's ring_push checks before
            # its transaction takes an xid, which would hold back the pruning of the ring's old row
            # versions while it waited): wait here, between transactions, and ask again.
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.push_timeout
            if now >= deadline:
                raise self._full_error()
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.05)
            params["timeout_s"] = max(0.0, deadline - time.monotonic())

    def _full_error(self) -> QueueFullError:
        return QueueFullError(
            f"queue {self.name!r}: the ring (capacity {self.capacity}) stayed full for "
            f"{self.push_timeout:g}s; nothing of the batch was pushed"
        )

    # -- pop ---------------------------------------------------------------------------------------

    def _head(self) -> int:
        row = self._db.fetchone("ring_head", {"queue_id": self._qid})
        return int(row[0]) if row and row[0] is not None else 1

    def _pop_once(
        self, n: int, semantics: Semantics, vt: float, consumer: str, conn: DbConnection | None
    ) -> list[Message]:
        lease = semantics is Semantics.AT_LEAST_ONCE
        if lease:
            now = time.monotonic()
            if now - self._last_reclaim >= self.reclaim_every_s:
                self._last_reclaim = now
                self.reclaim_expired()
        msgs: list[Message] = [] if conn is not None else self._claim(n, lease, vt, consumer)
        if len(msgs) >= n:
            return msgs
        parts = 1 if msgs else 0
        for _ in range(3):
            with self._lock:
                lo = self._lo
                gap, since = self._gap, self._gap_since
            if lo is None:
                lo = self._head()
            force = (
                gap is not None
                and since is not None
                and since[0] == gap[0]
                and time.monotonic() - since[1] >= self.gap_timeout
            )
            try:
                rows = self._db.fetchall(
                    "ring_pop",
                    {
                        "queue_id": self._qid,
                        "capacity": self.capacity,
                        "lo": lo,
                        "n": n - len(msgs),
                        "lease": lease,
                        "visibility_timeout_s": vt,
                        "consumer": consumer,
                        "own": conn is not None,
                        "gap": gap[0] if gap else None,
                        "gap_issued": gap[1] if gap else None,
                        "gap_snap": gap[2] if gap else None,
                        "force": force,
                    },
                    conn,
                )
            except LockTimeoutError:
                if conn is not None:
                    raise  # the caller's transaction failed with it: only the caller can redo its part
                break  # see ring_pop: a claim that followed an update chain onto a push in progress
            meta = rows.pop()
            rows.sort(key=_first)  # in slot order within each part of the window, so nearly always sorted
            msgs += self._messages(rows)
            parts += 1 if rows else 0
            next_lo, gap_n = int(meta[6]), meta[7]
            if conn is not None:
                # The caller's transaction may still roll back what this or an earlier pop in it took:
                # its bound is not kept, and one call is made (a second would not see the first's take).
                break
            with self._lock:
                self._lo = max(self._lo or 0, next_lo)
                if gap_n is None:
                    self._gap = self._gap_since = None
                else:
                    self._gap = (int(gap_n), int(meta[8]), None if meta[9] is None else str(meta[9]))
                    if self._gap_since is None or self._gap_since[0] != gap_n:
                        self._gap_since = (int(gap_n), time.monotonic())
            # Go on only when the window moved a lot (a bound that was stale), or the gap at the head
            # moved on towards being skipped (newly seen, or now with its holders listed), and the batch
            # is not full.
            advanced = gap_n is not None and (
                not gap or gap[0] != gap_n or (gap[2] is None and meta[9] is not None)
            )
            if len(msgs) >= n or not (next_lo >= lo + self.capacity // 2 or advanced):
                break
        if conn is None:
            with self._lock:
                self._fast = len(msgs) >= n  # see _claim
        if parts > 1:
            # Each statement returns its messages in id order, but a later one may find a lower number
            # that committed in between: the batch is handed over in id order.
            msgs.sort(key=_id)
        return msgs

    def _claim(self, n: int, lease: bool, vt: float, consumer: str) -> list[Message]:
        """The fast path of a pop outside a caller's transaction: one statement (``ring_claim``) that
        claims the lowest ready messages from the consumer's bound to the end of the ring's slots.

        Used while the last pop came back full and no gap waits at the head; a short claim hands the
        rest to ``ring_pop`` (which moves the bound on, claims past the wrap and skips gaps), and so
        does the pop after a claim that found its first message far past the bound: the claim scans
        from the bound, so a stale bound costs a longer scan.
        """
        with self._lock:
            lo = self._lo
            fast = self._fast and self._gap is None
        if not fast or lo is None:
            return []
        try:
            rows = self._db.fetchall(
                "ring_claim",
                {
                    "queue_id": self._qid,
                    "capacity": self.capacity,
                    "lo": lo,
                    "n": n,
                    "lease": lease,
                    "visibility_timeout_s": vt,
                    "consumer": consumer,
                },
            )
        except LockTimeoutError:
            rows = []  # as in ring_pop: the claim's locks are released; ring_pop goes on
        if rows and rows[-1][0] is None:
            rows.pop()  # SQL Server: ring_pop's last row (the bound), without an id
        rows.sort(key=_first)
        if len(rows) < n or rows[0][0] - lo > max(_STALE_BOUND, n):
            with self._lock:
                self._fast = False
        return self._messages(rows)

    def _messages(self, rows: Sequence[tuple[Any, ...]]) -> list[Message]:
        # Positional (id, queue, payload, priority, attempts, delivery, enqueued_at, lease_until), through
        # message_maker: half the client CPU of Message(...) a message, in pops of thousands.
        decode, name, make = self.settings.decode, self.name, _make_message
        return [make(r[0], name, decode(r[5]), 0, r[1], r[2], r[3], r[4]) for r in rows]

    # -- finish ------------------------------------------------------------------------------------

    def _receipt_params(self, messages: Sequence[Message]) -> dict[str, Any]:
        receipts = list(dict.fromkeys(m.receipt for m in messages))
        ids = [r[0] for r in receipts]
        return {
            "ids": ids,
            "deliveries": [r[1] for r in receipts],
            "capacity": self.capacity,
            "queue_id": self._qid,
        }

    def _raise_lost(self, params: dict[str, Any], conn: DbConnection | None) -> None:
        held = set(self._db.fetchall("ring_held_receipts", params, conn))
        lost = [i for i, d in zip(params["ids"], params["deliveries"], strict=True) if (i, d) not in held]
        raise LeaseExpiredError(self.name, lost)

    def ack(self, messages: Sequence[Message], *, conn: DbConnection | None = None) -> int:
        params = self._receipt_params(messages)
        if not params["ids"]:
            return 0
        done = self._db.fetchall("ring_ack", params, conn)
        if len(done) != len(params["ids"]):
            self._raise_lost(params, conn)
        return len(done)

    def nack(
        self,
        messages: Sequence[Message],
        *,
        delay: float | None = None,
        error: str | None = None,
        conn: DbConnection | None = None,
    ) -> int:
        if delay is not None and delay < 0:
            raise ConfigurationError(f"queue {self.name!r}: nack delay must be >= 0 seconds, got {delay}")
        params = self._receipt_params(messages)
        if not params["ids"]:
            return 0
        params.update(
            delay_s=None if delay is None else float(delay),
            backoff_s=self.settings.retry_backoff_s,
            backoff_max_s=self.settings.retry_backoff_max_s,
            max_attempts=self.settings.max_attempts,
            error=error,
        )
        done = self._db.fetchall("ring_nack", params, conn)
        if len(done) != len(params["ids"]):
            self._raise_lost(params, conn)
        return len(done)

    def reclaim_expired(self, limit: int = 10_000) -> int:
        rows = self._db.fetchall(
            "ring_reclaim_expired",
            {"queue_id": self._qid, "max_attempts": self.settings.max_attempts, "limit": limit},
        )
        return len(rows)

    def recover_gaps(self, *, wait: float = 2.0) -> int:
        """Give up every number that a push took and will never write; return how many.

        Sequences are not transactional: a push that rolled back or whose process died leaves its
        numbers unwritten. Pops skip such a gap when it reaches the head of the ring; this finds them
        wherever they are, so a ring nobody pops recovers too (the maintenance DAG calls it through
        :meth:`maintain`). It reads the push position, then takes a snapshot, and gives up the numbers
        up to that position still unwritten once every holder the snapshot names is gone (PostgreSQL:
        its transactions have finished, a push taking an xid before its numbers; SQL Server: its lanes
        have each been seen unlocked, a push locking a lane before its numbers). It waits for that up
        to ``wait`` seconds, and otherwise gives nothing up: a holder alive but stuck keeps its numbers
        (pops give the head number up after :attr:`gap_timeout`). Numbers of pushes in progress are
        never touched: their holders are still running, or have written and lock their slots.
        """
        params: dict[str, Any] = {"queue_id": self._qid}
        row = self._db.fetchone("ring_unwritten", params)
        if row is None or not row[1]:
            return 0
        params["issued"] = int(row[0])
        snap = self._db.fetchone("ring_snapshot", params)  # a later statement: after the position was read
        assert snap is not None
        params["snap"] = snap[0]
        deadline = time.monotonic() + wait
        pause = 0.002
        while True:
            got = self._db.fetchone("ring_skip_abandoned", params)
            skipped = int(got[0]) if got else 0
            if skipped >= 0:
                return skipped
            if got is not None and len(got) > 1 and got[1] is not None:
                params["snap"] = got[1]  # SQL Server: the lanes still to be seen unlocked
            left = deadline - time.monotonic()
            if left <= 0:
                return 0  # some transaction of the snapshot is still running: the next run tries again
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)

    def maintain(self, *, limit: int = 10_000) -> dict[str, int]:
        """Reclaim expired leases, and give up the numbers of pushes that rolled back or died
        (:meth:`recover_gaps`): ``{"reclaimed": n, "gaps_skipped": m}``."""
        return {"reclaimed": self.reclaim_expired(limit), "gaps_skipped": self.recover_gaps()}

    # -- inspect and administer --------------------------------------------------------------------

    def peek(self, n: int = 10) -> list[Message]:
        rows = self._db.fetchall("ring_peek", {"queue_id": self._qid, "n": _check_batch_size(n)})
        return self._messages(rows)

    def count_ready(self, min_priority: int | None = None, cap: int = 1_000_000) -> int:
        if min_priority is not None and min_priority > 0:
            return 0  # every ring message has priority 0
        row = self._db.fetchone("ring_count_ready", {"queue_id": self._qid, "cap": cap})
        return int(row[0]) if row else 0

    def readiness(
        self, min_priority: int | None = None, cap: int = 1_000_000
    ) -> tuple[int, tuple[int, int] | None]:
        row = self._db.fetchone("ring_ready_head", {"queue_id": self._qid, "cap": cap})
        return self._readiness_row(row, min_priority)

    @staticmethod
    def _readiness_row(
        row: tuple[Any, ...] | None, min_priority: int | None
    ) -> tuple[int, tuple[int, int] | None]:
        if row is None or row[1] is None:
            return 0, None
        ready = 0 if min_priority is not None and min_priority > 0 else int(row[0])
        return ready, (int(row[1]), int(row[2]))

    def _postgres(self) -> PostgresDatabase:
        from airflow_dbqueue.engine.dialects.postgres import PostgresDatabase

        if not isinstance(self._db, PostgresDatabase):
            raise NotImplementedError(
                f"queue {self.name!r}: async observation (a trigger, a deferrable sensor) needs PostgreSQL; "
                f"on {self._db.dialect_name} use the synchronous readiness() (poke or reschedule mode)"
            )
        return self._db

    async def areadiness(
        self, aconn: psycopg.AsyncConnection[Any], min_priority: int | None = None, cap: int = 1_000_000
    ) -> tuple[int, tuple[int, int] | None]:
        pg = self._postgres()  # PostgreSQL only: psycopg's async connections
        with pg.translate_errors():
            cur = await aconn.execute(pg.query("ring_ready_head"), {"queue_id": self._qid, "cap": cap})
            return self._readiness_row(await cur.fetchone(), min_priority)

    async def alisten(self, aconn: psycopg.AsyncConnection[Any]) -> None:
        from psycopg import sql

        self._postgres()  # PostgreSQL only: LISTEN
        with self._db.translate_errors():
            await aconn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))

    def leased(self, receipts: Sequence[tuple[int, int]]) -> list[Message]:
        stubs = self._receipt_messages(receipts)
        if not stubs:
            return []
        return self._messages(self._db.fetchall("ring_leased", self._receipt_params(stubs)))

    def stats(self) -> QueueStats:
        row = self._db.fetchone("ring_stats", {"queue_id": self._qid})
        assert row is not None
        push_pos, pop_pos = int(row[5]), int(row[6])
        used = max(0, push_pos - pop_pos + 1)
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
                "push_position": push_pos,
                "pop_position": pop_pos,
                "ring_used": used,
                "ring_fill": round(used / self.capacity, 4),
                "gaps_skipped": int(row[7]),
            },
        )

    def list_failed(self, limit: int = 100, after_id: int = 0) -> list[FailedMessage]:
        rows = self._db.fetchall(
            "ring_list_failed", {"queue_id": self._qid, "after_id": after_id, "limit": limit}
        )
        decode = self.settings.decode
        return [
            FailedMessage(
                id=r[0],
                queue=self.name,
                priority=0,
                attempts=r[1],
                enqueued_at=r[2],
                last_error=r[3],
                payload=decode(r[4]),
            )
            for r in rows
        ]

    def requeue_failed(self, ids: Sequence[int] | None = None) -> int:
        """Push failed messages again, oldest first, with a fresh attempt count.

        In a ring a requeued message gets a new id: its old number's slot has been reused.
        """
        params = {"queue_id": self._qid, "all": ids is None, "ids": list(ids or [])}
        with self._db.transaction() as conn:
            rows = sorted(self._db.fetchall("ring_take_failed", params, conn))
            payloads = [bytes(r[1]) for r in rows]
            for first in range(0, len(payloads), self.capacity):
                self._push_encoded(payloads[first : first + self.capacity], conn)
        return len(rows)

    def delete_failed(self, ids: Sequence[int] | None = None) -> int:
        params = {"queue_id": self._qid, "all": ids is None, "ids": list(ids or [])}
        return len(self._db.fetchall("ring_delete_failed", params))
