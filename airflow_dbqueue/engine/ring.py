"""The ring design: a preallocated table of slots that only pushes write, and consumers' positions.

After Kejser's "Implementing Message Queues in Relational Databases" and the LMAX Disruptor. A ring of
capacity C holds C rows in ``ring_slots`` for ever: a push is an UPDATE of a slot (HOT: no indexed
column changes), so the table never grows. Message ids are the numbers of the ring's push sequence;
number x lives in slot ``x % C``.

Consumers never write to the slots. As in the Disruptor, they advance positions of their own
(``ring_lanes``: the numbers are dealt to ``lanes`` lanes by ``x % lanes``, and each lane's position is
its next number no pop has taken), and producers are gated on the slowest of them: a push of x may
overwrite its slot only when x - C lies below the ring's *floor*, the lowest number that a consumer
may still need (a lane's position, an open lease, a message to deliver again).

Pushing (server-side ``ring_push``, ``ring_push_one``): take n contiguous numbers and write their
slots, in the caller's transaction. A slot not free yet is the ring pushing back: the push waits with
backoff up to ``push_timeout`` seconds, then raises :class:`QueueFullError` (nothing pushed).

Popping (``ring_take``, the fast path, and ``ring_pop``): a pop locks the lanes it takes from (SKIP
LOCKED, so concurrent pops take different lanes), reads the messages past their positions in id order,
stops at a number issued but not written yet, and moves the positions on: per message it only reads.
At most once, the take is the whole pop. At least once, the pop also writes one lease row for what it
took (``ring_leases``); ``ack`` of a whole lease deletes that row, and anything else (part of a lease,
``nack``, an expired lease) turns the messages concerned into rows of ``ring_retry``, which pops serve
first; after ``max_attempts`` a message is copied to ``ring_failed`` and its slot is free. Exactly once,
the take runs in the caller's transaction and the positions move when it commits.

Gaps: a push that rolled back (or whose process died) after taking its numbers leaves them unwritten,
because sequences are not transactional, and a lane's position stops at such a number. ``ring_pop``
reports the lowest one with the issued position and, when it stays, a list of the possible holders; a
later pop gives every such number up (its slot then holds it with no payload, and positions pass over
it) once every holder listed is gone, or, after ``gap_timeout`` seconds as a fallback (a holder alive
but stuck, or other transactions that keep the proof from holding), the run of unwritten numbers at the
head. Giving up is always safe: a late push of a given-up number finds the slot's seq moved on, fails
whole and is retried with new numbers, so it is neither lost nor delivered out of order with itself.

The list of holders (``snap`` below) is the dialect's. On PostgreSQL it is the transactions holding
their transactionid lock (``pg_locks``): a push takes an xid before its numbers, and the proof is that
none of them holds it any more. On SQL Server, which has no such view for an ordinary user, a push
locks one of the ring's push lanes (a row of ``ring_push_lanes``, until its transaction ends) before it
takes its numbers; the list is the lanes other transactions held, and the proof is that each has been
seen unlocked since (``docs/sqlserver.md``). Either way the position is read before the list is taken.

Consumer groups: a ring's default group's lanes, leases, retry and failed rows carry the
ring's queue id; another group's carry its gid (``ring_groups``, a negative number), so that each group
sees every message at its own pace, and the floor is the lowest number over the ring's rows and its
groups'. A handle of a group (:meth:`RingQueue.group`) passes its gid: to ``ring_take`` and ``ring_pop``
in place of the queue id (the default group's pops then plan as a ring without groups does), to the
other statements as ``group``.

The same class runs on both dialects, and under both faces (``bridge.py``): every statement is a named
query of the dialect.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine.bridge import pause as pause_for
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseError,
    GroupNotFoundError,
    LockTimeoutError,
    QueueFullError,
    RingNumbersSkippedError,
)
from airflow_dbqueue.engine.models import (
    DEFAULT_GROUP,
    RING_DEFAULT_LAG_TIMEOUT_S,
    Message,
    Semantics,
)
from airflow_dbqueue.engine.queue import DEFAULT_CONSUMER, RECLAIM_LIMIT
from airflow_dbqueue.engine.ring_base import (
    _NOTIFY_CODE,
    _PUSH_ATTEMPTS,
    _SETTLE_ACK,
    RING_DEFAULT_CAPACITY,
    RING_DEFAULT_LANES,
    RING_DEFAULT_PAYLOAD,
    RING_LANE_TIMEOUT_S,
    RING_MAX_CAPACITY,
    RING_MAX_LANES,
    RING_MAX_PAYLOAD,
    _first,
    _id,
    check_ring_push,
    nack_settle_params,
    waiting_out_locks,
)
from airflow_dbqueue.engine.ring_batches import RingBatches
from airflow_dbqueue.engine.ring_groups import RingGroups
from airflow_dbqueue.engine.ring_inspect import RingInspect

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import DbConnection

__all__ = [
    "RING_DEFAULT_CAPACITY",
    "RING_DEFAULT_LAG_TIMEOUT_S",
    "RING_DEFAULT_LANES",
    "RING_DEFAULT_PAYLOAD",
    "RING_LANE_TIMEOUT_S",
    "RING_MAX_CAPACITY",
    "RING_MAX_LANES",
    "RING_MAX_PAYLOAD",
    "RingQueue",
]


class RingQueue(RingGroups, RingInspect, RingBatches):
    """A queue of the ring design.

    FIFO by id, without priorities or delayed pushes (both raise :class:`ConfigurationError`). Under
    at-least-once a leased message keeps the ring's floor at or below it until it is acked, nacked or
    its lease expires: the ring cannot reuse its slot meanwhile, so pushes a whole ring ahead of it wait.

    Consumer groups: every ring has its default group (:data:`DEFAULT_GROUP`), which this handle pops
    for; :meth:`add_group` adds more, and :meth:`group` returns the handle of one, whose pops, acks,
    nacks, stats and failed messages are that group's. Each group sees every message at its own pace,
    and a slot is reused only when every group has passed its message.

    :attr push_timeout: seconds a push waits for a full ring before :class:`QueueFullError`.
    :attr gap_timeout: seconds after which a pop gives up a number that stays issued but unwritten
        even without proof that its holder is gone (a holder alive but stuck that long).
    :attr lane_timeout: seconds a pop outside a caller's transaction waits, in all, for locks other
        transactions hold (:data:`RING_LANE_TIMEOUT_S`), before it answers that it found nothing.
    """

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
        check_ring_push(self.name, priority=priority, delay=delay, dedup_keys=dedup_keys, ttl=ttl, keys=keys)
        if not items:
            return []
        if len(items) > self.capacity:
            raise ConfigurationError(
                f"queue {self.name!r}: a ring batch holds at most the capacity ({self.capacity}) messages, "
                f"got {len(items)}"
            )
        encoded = self.settings.encode_all(items)
        try:
            first = self._push_encoded(encoded, conn)
        except DatabaseError:
            self._raise_if_gone()
            raise
        return list(range(first, first + len(encoded)))

    def _push_encoded(self, encoded: list[bytes], conn: DbConnection | None) -> int:  # noqa: PLR0912
        """Push encoded payloads; return the first number. One attempt loop holds the push of one in a
        single statement, its retry after numbers given up as gaps, and the wait while the ring is
        full: split apart, each part would need the loop's state."""
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
                    # writes its number's slot if it is free under the floor this handle read last.
                    # Otherwise the number is written by ring_push, which reads the floor itself and
                    # waits for the slot (params["first"]), and the floor is read again for the next
                    # pushes. Once: a retry after a number given up as a gap goes through ring_push.
                    one = False
                    if not self._floor_read and self._db.ring_push_takes_floor:
                        self._read_floor()
                    row = self._db.fetchone(
                        "ring_push_one", {**params, "payload": encoded[0], "floor": self._floor}
                    )
                    if row is not None and row[0] is not None:
                        if row[0] > 0:  # the number, negated when its slot was not free
                            return int(row[0])
                        params["first"] = -int(row[0])
                        self._floor_read = False
                # The floor this handle read, unless a push of one just found its slot not free under it.
                params["floor"] = self._floor if self._floor_read else None
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
            if len(row) > 1 and row[1] is not None:  # PostgreSQL's push read the ring's floor
                self._floor = max(int(row[1]), self._floor or 0)
                self._floor_read = True
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
            # A lane stopped at a gap holds the floor down as a message would: help to give it up (a
            # pop of none, in a transaction of its own), so that gaps alone never keep a ring full.
            self._pop_slow(self._help_params, 0, None)
            pause_for(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)
            params["timeout_s"] = max(0.0, deadline - time.monotonic())

    def _read_floor(self) -> None:
        """Read the ring's floor for pushes of one. Any floor once read stays a safe bound (it never
        goes down), so threads that share this handle may keep whichever one they read last."""
        row = self._db.fetchone("ring_floor", {"queue_id": self._qid})
        self._floor = None if row is None or row[0] is None else int(row[0])
        self._floor_read = True

    def _full_error(self) -> QueueFullError:
        return QueueFullError(
            f"queue {self.name!r}: the ring (capacity {self.capacity}) stayed full for "
            f"{self.push_timeout:g}s; nothing of the batch was pushed"
        )

    def _pop_once(
        self, n: int, semantics: Semantics, vt: float, consumer: str, conn: DbConnection | None
    ) -> list[Message]:
        try:
            if conn is not None:
                return self._take(n, semantics, vt, consumer, conn)
            return waiting_out_locks(
                lambda: self._take(n, semantics, vt, consumer, None), [], self.lane_timeout
            )
        except DatabaseError:
            self._raise_if_gone()  # on a pooled connection: a caller's failed transaction stays as it is
            raise

    def _pop_payloads_once(self, n: int, semantics: Semantics, conn: DbConnection | None) -> list[Any]:
        vt = self.settings.visibility_timeout_s
        try:
            if conn is not None:
                return self._take(n, semantics, vt, DEFAULT_CONSUMER, conn, payloads=True)
            return waiting_out_locks(
                lambda: self._take(n, semantics, vt, DEFAULT_CONSUMER, None, payloads=True),
                [],
                self.lane_timeout,
            )
        except DatabaseError:
            self._raise_if_gone()
            raise

    def _take(
        self,
        n: int,
        semantics: Semantics,
        vt: float,
        consumer: str,
        conn: DbConnection | None,
        *,
        payloads: bool = False,
    ) -> list[Any]:
        """The messages of a pop (:class:`Message`), or with ``payloads`` only their payloads: then a
        batch taken on the fast path comes from ``ring_take_payloads``, which sends one column a
        message, where the dialect has it."""
        lease = semantics is Semantics.AT_LEAST_ONCE
        # Every pop reclaims expired leases first (at most every reclaim_every): readiness counts
        # them as a pop would get them. In the caller's transaction (conn), the reclaim joins it.
        now = time.monotonic()
        if now - self._last_reclaim >= self.reclaim_every:
            self._last_reclaim = now
            self._reclaim(RECLAIM_LIMIT, conn)
        with self._lock:
            fast = self._fast and self._gap is None
        if fast and n == 1 and not lease and conn is None and self._db.prepares_statements:
            # A pop of one at most once: one statement that takes from a lane no other pop holds
            # (ring_take_one); when it finds nothing, ring_take below waits for held lanes. Unprepared
            # (behind a transaction pooler) its planning costs more than the function ring_take, whose
            # inner statements keep their plans in the server's session.
            one = self._messages(self._db.fetchall("ring_take_one", self._one_params))
            if one:
                return [m.payload for m in one] if payloads else one
        params: dict[str, Any] = {
            # ring_take and ring_pop take a group besides the default one by its gid in place of the
            # ring's queue id, so that the default group's pops pass what a ring without groups does.
            "queue_id": self._gid,
            "capacity": self.capacity,
            "lanes": self.lanes,
            "n": n,
            "lease": lease,
            "visibility_timeout_s": vt,
            "consumer": consumer,
        }
        msgs: list[Any] = []
        if fast:
            # The fast path: one statement that takes from the lanes (ring_take), waiting for lanes that
            # other pops hold (not in a caller's transaction). An empty take goes on to ring_pop, which
            # serves messages due again, reports a gap at the head and gives it up.
            if lease:
                name = "ring_take_lease"
            else:
                name = "ring_take_payloads" if payloads and self._db.payload_pops else "ring_take"
            # Outside a caller's transaction, a take that found the lanes with messages held by other
            # transactions (for its lock timeout, or again after its wait) fails with LockTimeoutError,
            # having taken nothing: _pop_once pops again (waiting_out_locks).
            rows = self._db.fetchall(name, {**params, "wait": conn is None}, conn)
            msgs = self._payloads(rows) if payloads else self._messages(rows)
            if msgs:
                # A short take is handed over as it is, and the next pop goes through ring_pop: a pop
                # of one call writes one lease row, which its ack deletes in one statement.
                if len(msgs) < n:
                    with self._lock:
                        self._fast = False
                return msgs
        msgs = self._pop_slow(params, n, conn)
        with self._lock:
            self._fast = len(msgs) >= n
        return [m.payload for m in msgs] if payloads else msgs

    def _pop_slow(self, params: dict[str, Any], n: int, conn: DbConnection | None) -> list[Message]:
        """Pop up to ``n`` messages through ``ring_pop`` (``n`` may be 0: only the gap's handling).

        ``ring_pop`` reports the lowest lane position whose number is issued and not written; this keeps
        it with the time it was first seen and passes it back, so that a later call gives it up once
        its holders are gone, or after :attr:`gap_timeout`. It calls again at once (three calls at
        most) while the gap moves on towards being given up and the batch is not full.
        """
        msgs: list[Message] = []
        parts = 0
        for _ in range(3):
            with self._lock:
                gap, since = self._gap, self._gap_since
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
                        **params,
                        "n": n - len(msgs),
                        "own": conn is not None,
                        "gap": gap[0] if gap else None,
                        "gap_issued": gap[1] if gap else None,
                        "gap_snap": gap[2] if gap else None,
                        "force": force,
                    },
                    conn,
                )
            except LockTimeoutError:
                if conn is not None or not msgs:
                    # The caller's transaction failed with it: only the caller can redo its part. Outside
                    # one, nothing was taken: _pop_once pops again (waiting_out_locks).
                    raise
                break  # the lanes with messages are held by others: what an earlier call took is the pop's
            meta = rows.pop()
            rows.sort(key=_first)  # messages due again first, then the lanes': nearly always sorted
            got = self._messages(rows)
            msgs += got
            parts += 1 if got else 0
            if conn is not None:
                break  # in the caller's transaction: no gap is reported or given up
            gap_n = meta[6]
            with self._lock:
                if gap_n is None:
                    self._gap = self._gap_since = None
                else:
                    self._gap = (int(gap_n), int(meta[7]), None if meta[8] is None else str(meta[8]))
                    if self._gap_since is None or self._gap_since[0] != gap_n:
                        self._gap_since = (int(gap_n), time.monotonic())
            advanced = gap_n is not None and (
                not gap or gap[0] != gap_n or (gap[2] is None and meta[8] is not None)
            )
            if len(msgs) >= n or not advanced:
                break
        if parts > 1:
            msgs.sort(key=_id)
        return msgs

    def ack(self, messages: Sequence[Message], *, conn: DbConnection | None = None) -> int:
        params = self._receipt_params(messages)
        if not params["ids"]:
            return 0
        # The usual ack names whole leases (the messages of one pop): one statement deletes them.
        whole = self._db.fetchall("ring_ack", params, conn)
        if whole and sum(r[0] for r in whole) == len(params["ids"]):
            return len(params["ids"])
        return self._settle({**params, **_SETTLE_ACK}, conn)

    def nack(
        self,
        messages: Sequence[Message],
        *,
        delay: float | None = None,
        error: str | None = None,
        conn: DbConnection | None = None,
    ) -> int:
        nack = nack_settle_params(self.name, self.settings, delay, error)
        params = self._receipt_params(messages)
        if not params["ids"]:
            return 0
        return self._settle({**params, **nack}, conn)

    def reclaim_expired(self, limit: int = RECLAIM_LIMIT) -> int:
        n = self._reclaim(limit, None)
        if not n and self._gid != self._qid:
            self._raise_if_gone()  # a group dropped meanwhile has no leases to reclaim
        return n

    def _reclaim(self, limit: int, conn: DbConnection | None) -> int:
        rows = self._db.fetchall(
            "ring_reclaim_expired",
            {
                "queue_id": self._qid,
                "capacity": self.capacity,
                "lanes": self.lanes,
                "max_attempts": self.settings.max_attempts,
                "limit": limit,
                "group": self._gid,
            },
            conn,
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
        never touched: their holders are still running, or have written and lock their slots. Then the
        lanes stopped at given-up numbers move over them (``ring_pass``), so that the floor moves on.
        """
        skipped = self._skip_abandoned(wait)
        # Lanes stopped at given-up numbers move on over them, whoever gave them up: until a pop or
        # this passes them they keep the ring's floor down, so a ring nobody pops would stay full.
        self._db.fetchone(
            "ring_pass", {"queue_id": self._qid, "capacity": self.capacity, "lanes": self.lanes}
        )
        return skipped

    def _skip_abandoned(self, wait: float) -> int:
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
            pause_for(min(pause, left))
            pause = min(pause * 2, 0.1)

    def maintain(self, *, limit: int = RECLAIM_LIMIT) -> dict[str, int]:
        """Reclaim expired leases of every consumer group, give up the numbers of pushes that rolled back
        or died (:meth:`recover_gaps`), act on groups that nobody pops (:meth:`watch_groups`), and forget
        batches finished more than ``batch_retention_s`` ago: ``{"reclaimed": n, "gaps_skipped": m,
        "batches_purged": k}``, with ``"groups_lagging"`` and ``"groups_dropped"`` on a ring with groups
        besides the default one."""
        root = self._default()
        reclaimed = root.reclaim_expired(limit)
        others = root.groups()[1:]
        handles = [root]
        for info in others:
            try:
                handles.append(root.group(info.name))
                reclaimed += handles[-1].reclaim_expired(limit)
            except GroupNotFoundError:
                continue  # dropped meanwhile
        # Gaps first: a number issued and never written counts as one to take, so a group that has
        # taken everything would look as lagging behind a push that rolled back until it is given up.
        skipped = root.recover_gaps()
        watched = root.watch_groups() if others else {}  # the counts only where a ring has groups
        # Each group's batches finished more than batch_retention_s ago (a group dropped meanwhile took
        # its batches with it).
        purged = sum(h._purge_batches(limit) for h in handles)
        return {"reclaimed": reclaimed, "gaps_skipped": skipped, **watched, "batches_purged": purged}

    # -- failed messages ---------------------------------------------------------------------------

    def requeue_failed(self, ids: Sequence[int] | None = None) -> int:
        """Push failed messages again, oldest first, with a fresh attempt count.

        In a ring a requeued message gets a new id: its old number's slot has been reused. A push is seen
        by every consumer group, so on a ring with groups besides the default one this raises
        :class:`ConfigurationError` (a group's failed message would reach the other groups again).
        """
        if len(self.groups()) > 1:
            raise ConfigurationError(
                f"queue {self.name!r} has consumer groups besides {DEFAULT_GROUP!r}: a requeued message "
                "would be pushed again to every group; list_failed and push what the group needs, "
                "or delete_failed"
            )
        params = {"queue_id": self._qid, "all": ids is None, "ids": list(ids or []), "group": self._gid}
        with self._db.transaction() as conn:
            rows = sorted(self._db.fetchall("ring_take_failed", params, conn))
            payloads = [bytes(r[1]) for r in rows]
            for first in range(0, len(payloads), self.capacity):
                self._push_encoded(payloads[first : first + self.capacity], conn)
        return len(rows)
