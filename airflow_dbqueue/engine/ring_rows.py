"""The ring's rows layout: a ring whose hot path writes no dead row (PostgreSQL only).

After PgQ's insert-only event tables. A push of n messages is one row of one of four segment tables of
the ring's own, with the batch's payloads as an array; message k of row r has the id ``(r << 16) | k``,
so ids rise in push order (FIFO by id) and a push holds at most :data:`ROWS_MAX_BATCH` messages. Rows
are dealt to lanes (``r % lanes``); a pop locks lanes as the slots layout does, takes their rows in row
order and logs each moved lane's new position in an insert-only log. A segment that every lane has
passed is emptied with ``TRUNCATE`` (a short lock, ``lock_timeout`` 50 ms, in a transaction of its own)
when a push needs it, or ahead of the pushes by :meth:`RowsRingQueue.maintain`. Nothing on the hot path
updates or deletes a row, so a held xmin horizon leaves no dead row behind it, and the tables stay at
the size of the rows the ring holds (a push with deduplication keys is the exception, in the ring's key
table only: see below). The SQL is in the dialect's ``functions.sql`` (``ring_rows_*``); the
hot path (push, pop, the ack of a whole pop) calls the ring's own functions by name. A pop of one has a
function of its own (``rtake1``: the lowest lane whose next row is written, locked, and its message
taken where the position is checked again, usually in two statements), which hands over to the general
pop when messages to deliver again may be due or it finds no such lane.

``capacity`` counts rows (pushes), not messages: four segments of ``capacity / 4`` rows. A ring is full
when the pushes reach a segment some lane still needs; a push then waits up to ``push_timeout`` seconds
and raises :class:`QueueFullError`.

Gaps: a push that took its row number and rolled back (or died) leaves that row unwritten, and its lane
stops there. A push takes its transaction id before its row number, so once every transaction that was
running when the gap was first seen has ended, the row can never be written: an empty pop, a full push
and :meth:`RowsRingQueue.maintain` then give it up (the lane's position passes it).

Totals (``stats().extra``, which maintenance's samples record): ``push_total``, the messages of the rows
the segments hold plus those of every segment emptied so far (the rotation that empties a segment writes
that sum, in its transaction, into a one-row table beside the segment, which the segment's next emptying
takes away with it), and ``pop_total``, the group's: the push total less its lag (ready, delayed, in
flight) and its messages past their time to live that no pop has reached yet, read in the same
snapshot. Nothing on the hot path counts them; a push rolled back counts
nothing.

At least once, with the slots layout's guarantees and only inserts: a pop also inserts one lease row in
the segment of its first message (its first and last ids, each moved lane's taken range, its end and
consumer), and the ack of that whole pop inserts one row naming the lease in a log beside it (its key
makes a second ack, or a reclaim, of the same lease write nothing). Anything else (an ack or nack of part
of a pop, a nack, an expired lease) first splits the lease: a done row for it and one row a message in
the retry log of the message's segment, leased as before; every later change of a message's delivery
state is a new row there, the newest (highest ``ver``, the log's key with the id, so two changes from the
same state cannot both be written) being its state: ready from a time, leased until a time, finished or
failed. Pops serve ready ones first, in id order, before the lanes' (looking only while a segment live
now has had one written in it, which a sequence records), leasing them again with attempts and
deliveries one higher; after ``max_attempts`` a message is copied with its payload to the schema's
``ring_failed``. A receipt whose lease is gone makes ack and nack raise :class:`LeaseExpiredError`,
writing nothing. Expired leases are reclaimed by pops (at most every ``reclaim_every``) and
:meth:`RowsRingQueue.maintain`. A segment is emptied only when every lane is past it, none of its leases
is open, none of its messages is to be delivered again or leased again, and the segment before it was
emptied (a lease may run into the next segment).

Observers: :meth:`RowsRingQueue.readiness` and :meth:`RowsRingQueue.count_ready` (what a sensor and a
trigger wait on) read the group's own ``ready``, one statement: the messages a pop could take now, leases
past their end with an attempt left included before anything reclaimed them (a pop reclaims them first),
and the id and deliveries of the one a pop takes first. :meth:`RowsRingQueue.stats` counts such a lease
in flight until it is reclaimed, and :meth:`RowsRingQueue.peek` (the group's own ``look``) shows the
ready messages with their attempts and deliveries so far (0 and 0 for one never delivered), as the slots
layout and the table design do.

Consumer groups (:mod:`airflow_dbqueue.engine.ring_rows_groups`): a group besides the default one
has its own position logs, leases, done rows, retry log and functions over the ring's segments; a
segment is emptied only when every group has passed it.

Batches (:mod:`airflow_dbqueue.engine.ring_rows_batches`): a claim is a pop at least once recorded under
a batch id in the group's own ledger, and its ack a done row, so they only insert too; ``leased()`` reads
held receipts' messages. Every consumer group has them.

Per-queue grants: the ring's own objects (and its groups') go to the roles that hold an action on it,
each action what it needs (``dialects/postgres/grants.py``); its registry row has row-level security.

Expiry (a ring created with a ``ttl``): a push's row carries its expiry (the ring's ``rpushx``; a push
without one runs ``rpush``). A pop passes an expired row at the head of a lane, before it takes anything
from that lane (so no lease's range holds it), logs the lane past it and copies its messages to
``ring_failed`` with ``last_error`` ``"expired"``, or drops them (``on_expiry="drop"``); a message due
again after its expiry gets a failed (or finished) retry row instead of a delivery. Only inserts; a ring
made without a ``ttl`` has the checks folded out of its functions. Nothing but a pop reaches an expired
row (:meth:`RowsRingQueue.maintain` does not), so :meth:`RowsRingQueue.stats` counts the messages past
their time to live that no pop has reached yet apart, in ``extra["expired_pending"]``, and neither
``ready`` nor ``delayed`` holds them; ``extra["expired"]`` counts the failed ones that failed by expiry,
as the table design's stats do. Both are exact: the pending ones are counted in the pass over the rows
past the lanes that counts ``ready`` (a row's expiry read beside its size; no scan of their own), and
the expired ones among the group's failed messages, as ``failed`` is counted.

Deduplication keys (``push(dedup_key=...)``, as the table design's, docs/concepts.md): a keyed push
runs the ring's ``rpushk``, which claims the keys in the ring's key table (``rkeys``) before it takes
its row number, so a push that waits for a racing push of one of its keys holds no number and leaves no
gap; the new messages of a batch (those of keys not pushed within the queue's ``dedup_window``) are one
row, the known keys return their first pushes' ids (a push of known keys only needs no row, so it returns
them from a full ring too). A push without keys never reads that table.
:meth:`RowsRingQueue.maintain` forgets keys older than the window.

Ordering per key (a ring created with ``ordering="per_key"``, ``push(key=...)``, docs/concepts.md): a
key maps to a lane (:meth:`RowsRingQueue.lane_of`, a stable hash of the key modulo ``lanes``), whose FIFO
gives the key's order. Every push of such a ring runs the ring's ``rpusho``: it takes a block of
``lanes`` row numbers starting at a multiple of ``lanes`` (the row sequence set to the block's end under
the push lock), writes each lane's messages of the push, in push order, as the lane's row of the block,
and an empty row (``n = 0``) in the other lanes, which pops pass, so no lane waits behind a number of
another's. Exactly once and at most once, a pop holds its lanes until it commits, as on any rows ring.
At least once, a lane is held while a message taken from it is not finished: each position entry such
a pop logs names its lease (a ``lo`` column only such a ring's position logs have), and a pop takes only
the lanes whose newest entry names no open lease and that have no message leased again or delayed in
the retry log (``rholds``); a lane's messages due again (a nack, a reclaim, a released batch) are taken
first in it, before its rows. So a pop (or a batch) takes a lane's run in order, at most ``lanes`` lanes
are in flight, and keys sharing a lane hold each other back. The observers (``readiness``,
``count_ready``, ``peek``, ``stats``) count and show only the free lanes' messages (``rblocked``: the
same holds, a lease or leased retry row past its end holding nothing, as a pop reclaims it first);
``stats()`` counts the messages behind a held lane apart, in ``extra["blocked"]``. The ack or nack
that frees a lane that may have something to take sends a NOTIFY on the ring's channel (the ring's
``notify`` setting, passed as a push passes it), so a pop waiting while every lane with messages was
held wakes; a lease that runs out frees its lane without a wake (a waiting pop finds it at a look of
its own). Only inserts, as everywhere on this layout; a ring without ordering per key has these lines
folded out of its functions at its creation (``@O`` in the template), and never notifies on an ack or
nack. Not with deduplication keys (:class:`NotSupportedError`).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_dbqueue.engine.bridge import pause as pause_for
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseError,
    GroupNotFoundError,
    LeaseExpiredError,
    NotSupportedError,
    QueueFullError,
    QueueNotFoundError,
    SchemaError,
)
from airflow_dbqueue.engine.models import (
    DEFAULT_GROUP,
    FailedMessage,
    Ordering,
    PayloadType,
    QueueStats,
    Semantics,
    messages_from_columns,
)
from airflow_dbqueue.engine.queue import (
    COUNT_CAP,
    RECLAIM_LIMIT,
    _check_batch_size,
    check_keys,
    check_seconds,
)
from airflow_dbqueue.engine.ring_base import (
    _NOTIFY_CODE,
    _SETTLE_ACK,
    RING_LANE_TIMEOUT_S,
    check_ring_push,
    failed_messages,
    nack_settle_params,
    waiting_out_locks,
)
from airflow_dbqueue.engine.ring_rows_batches import RowsRingBatches
from airflow_dbqueue.engine.ring_rows_groups import RowsRingGroups

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import Database, DbConnection
    from airflow_dbqueue.engine.models import Message, QueueSettings

ROWS_MAX_BATCH = 65535
"""Most messages one push of the rows layout holds: a message's place in its row is the low 16 bits
of its id."""
_GAP_CHECK_EVERY_S = 0.05
_LOOK_POP_ALONE_S = 0.05
"""How long the other waiting looks of a handle leave a row issued to the one that pops for it."""
_T = TypeVar("_T")


class RowsRingQueue(RowsRingGroups, RowsRingBatches):
    """A ring of the rows layout (see the module): at most, at least and exactly once, consumer groups
    (:mod:`airflow_dbqueue.engine.ring_rows_groups`) and each group's batches
    (:mod:`airflow_dbqueue.engine.ring_rows_batches`)."""

    # Every look of a waiter while a push runs is its question and an empty pop: of the waiters of this
    # process, one looks again for a push seen in progress (Queue._wait_listening).
    _one_recheck = True

    def __init__(
        self, db: Database, settings: QueueSettings, *, group: str = DEFAULT_GROUP, gid: int | None = None
    ) -> None:
        super().__init__(db, settings)
        if settings.capacity is None or settings.lanes is None:
            raise ConfigurationError(f"queue {settings.name!r} is a ring without a capacity")
        self.capacity = settings.capacity
        self.lanes = settings.lanes
        self._qid = settings.queue_id
        self._channel = db.channel(settings.queue_id)
        self._init_group(group, gid)
        # The ring's own functions, which the hot path calls by name (queries/ring.sql): the push is the
        # ring's, the pops and acks its group's.
        self._push_fn = {"fn": f"ring_{settings.queue_id}_rpush"}
        self._pushx_fn = {"fn": f"ring_{settings.queue_id}_rpushx"}
        self._pushk_fn = {"fn": f"ring_{settings.queue_id}_rpushk"}
        self._pusho_fn = {"fn": f"ring_{settings.queue_id}_rpusho"}
        # Ordered per key: every push is a block of one row a lane (rpusho), keyed or not.
        self._per_key = settings.ordering is Ordering.PER_KEY
        self._forget_fn = {"fn": f"ring_{settings.queue_id}_rforget"}
        self._has_pushk: bool | None = None  # whether the ring has it (read on the first keyed push)
        own = self._own()
        self._take_fn = {"fn": own + "take"}
        self._take1_fn = {"fn": own + "take1"}
        self._has_take1: bool | None = None  # whether the ring has it (read on the first pop of one)
        self._ack_fn = {"fn": own + "ack"}
        # Ordered per key: an ack or nack that frees a lane with something behind it wakes a waiting pop
        # (the group's own ack and settle, called with the ring's notify setting and channel), on a ring
        # whose functions have it (made with its rblocked; read on the first settle of a handle).
        self._settle_fn = {"fn": own + "settle"}
        self._wakes: bool | None = None if self._per_key else False
        # A waiting pop's question (ring_rows_ask): the group's lanes and retry generation, the ring's rows.
        self._ask_ids = {
            "lanes": own + "lanes",
            "retrygen": own + "retrygen",
            "rows": f"ring_{settings.queue_id}_rrows",
        }
        # The group's retry log (a view over its segments), where a waiting pop reads when the earliest
        # message to deliver again comes due (ring_rows_next_due).
        self._due_ids = {"retries": own + "r"}
        # Per thread: whether its last look's question said messages to deliver again may be in the
        # segments live now (read by _until_due just after that look, in the same thread).
        self._asked = threading.local()
        # When the waiting look that pops for a row issued began (None: none pops now).
        self._look_popping: float | None = None
        self._look_lock = threading.Lock()
        self.push_timeout = 30.0
        self.lane_timeout = RING_LANE_TIMEOUT_S
        self.reclaim_every = min(1.0, settings.visibility_timeout_s / 2)
        # What ring_rows_gaps returned last: (its transaction id, the row sequence's position read
        # before it); a row issued by then and still unwritten once every transaction before that id
        # has ended is a gap.
        self._seen: tuple[int | None, int | None] = (None, None)
        self._gaps_checked = 0.0
        self._last_reclaim = 0.0

    def _unsupported(self, what: str) -> NotSupportedError:
        return NotSupportedError(
            f"queue {self.name!r}: a ring of the rows layout does not support {what} yet "
            "(docs/limits.md); use a ring of the default slots layout for it"
        )

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
        check_ring_push(
            self.name,
            priority=priority,
            delay=delay,
            dedup_keys=dedup_keys,
            ttl=ttl,
            keys=keys,
            rows=True,
            per_key=self._per_key,
        )
        okeys = None if keys is None else check_keys(self.name, "key", keys, len(items), optional=True)
        if ttl is None:
            ttl = self.settings.ttl_s
        else:
            if self.settings.ttl_s is None:
                raise ConfigurationError(
                    f"queue {self.name!r}: a message's ttl needs a queue created with a ttl (its default), "
                    "whose pops check expiry"
                )
            ttl = check_seconds(f"queue {self.name!r}: ttl", ttl, positive=True)
        if not items:
            return []
        if len(items) > ROWS_MAX_BATCH:
            raise ConfigurationError(
                f"queue {self.name!r}: a push into a ring of the rows layout holds at most "
                f"{ROWS_MAX_BATCH} messages, got {len(items)}"
            )
        encoded = self.settings.encode_all(items)
        try:
            if self._per_key:
                return self._push_ordered(encoded, okeys, conn, ttl)
            if dkeys is not None:
                return self._push_keyed(encoded, dkeys, conn, ttl)
            first = self._push_rows(encoded, conn, ttl)
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        return list(range(first, first + len(encoded)))

    def _push_keyed(
        self, encoded: list[bytes], keys: list[str], conn: DbConnection | None, ttl: float | None
    ) -> list[int]:
        """Push with deduplication keys, one a payload (the ring's ``rpushk``): a key repeated within the
        batch sends its first payload only, so the keys the statement claims are distinct, and every
        occurrence gets that message's id. A ring made by a build without the ring's keyed push refuses
        keys (its functions are made once, at its creation)."""
        if not self._keyed():
            self._raise_if_gone()
            raise NotSupportedError(
                f"queue {self.name!r}: this ring of the rows layout was made by a build without "
                "deduplication keys; a ring created since has them (docs/limits.md)"
            )
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        params = {
            "payloads": [encoded[i] for i in first.values()] if len(first) < len(keys) else encoded,
            "keys": list(first),
            "ttl": ttl,
        }
        got = self._push_row("ring_rows_push_keys", params, conn, self._pushk_fn)
        ids = dict(zip(first, map(int, got), strict=True))
        return [ids[k] for k in keys]

    def lane_of(self, key: str) -> int:
        """The lane of ordering key ``key`` on this ring: a stable hash of the key (CRC-32 of its UTF-8
        bytes, the same in every process and release) modulo the ring's lanes."""
        return zlib.crc32(key.encode("utf-8")) % self.lanes

    def _push_ordered(
        self,
        encoded: list[bytes],
        keys: list[str | None] | None,
        conn: DbConnection | None,
        ttl: float | None,
    ) -> list[int]:
        """Push into a ring ordered per key (the ring's ``rpusho``): each message into its key's lane
        (:meth:`lane_of`), a message without a key into lane ``i % lanes`` (its place in the batch), as
        one block of one row a lane; return the ids in payload order. The payloads go sorted by lane
        (each lane's in push order) with each lane's count; message k of lane l's row has the id
        ``((first + l) << 16) | k``, ``first`` the block's first row."""
        lanes = [
            i % self.lanes if k is None else self.lane_of(k)
            for i, k in enumerate(keys if keys is not None else repeat(None, len(encoded)))
        ]
        order = sorted(range(len(encoded)), key=lanes.__getitem__)  # stable: push order in a lane
        counts = [0] * self.lanes
        places = []
        for lane in lanes:
            places.append(counts[lane])
            counts[lane] += 1
        params = {"payloads": [encoded[i] for i in order], "counts": counts, "ttl": ttl}
        first = int(self._push_row("ring_rows_push_ordered", params, conn, self._pusho_fn))
        return [((first + lane) << 16) | k for lane, k in zip(lanes, places, strict=True)]

    def _keyed(self) -> bool:
        """Whether the ring has deduplication keys (its ``rpushk`` and ``rforget``; read once a handle)."""
        if self._has_pushk is None:
            row = self._db.fetchone(
                "ring_rows_has_function", {"schema": self._db.schema, "fn": self._pushk_fn["fn"]}
            )
            self._has_pushk = bool(row and row[0])
        return self._has_pushk

    def _push_rows(self, encoded: list[bytes], conn: DbConnection | None, ttl: float | None = None) -> int:
        """Push encoded payloads as one row, expiring ``ttl`` seconds from now when given (the ring's
        ``rpushx``; without, its ``rpush``); return the first id (see :meth:`_push_row`)."""
        params: dict[str, Any] = {"payloads": encoded}
        query, fn = "ring_rows_push", self._push_fn
        if ttl is not None:
            params["ttl"] = ttl
            query, fn = "ring_rows_push_ttl", self._pushx_fn
        return int(self._push_row(query, params, conn, fn))

    def _push_row(
        self, query: str, params: dict[str, Any], conn: DbConnection | None, fn: dict[str, str]
    ) -> Any:
        """Run a push of the ring's (``query``, calling its function ``fn``) and return what it returns
        first. When the row's segment still holds an older generation, rotate it in (a transaction of
        its own) and push again; while some lane still needs it, wait with backoff up to
        ``push_timeout``, then raise :class:`QueueFullError`."""
        params["queue_id"] = self._qid
        params["notify"] = _NOTIFY_CODE[self.settings.notify]
        params["channel"] = self._channel
        deadline: float | None = None
        pause = 0.001
        while True:
            row = self._db.fetchone(query, params, conn, identifiers=fn)
            if row is None:
                raise QueueNotFoundError(self.name, self._db.schema)
            first, need = row
            if first is not None:
                return first
            rotated = self._db.fetchone("ring_rows_rotate", {"queue_id": self._qid, "gen": need})
            if rotated is not None and rotated[0]:
                self._db.execute("ring_rows_label", {"queue_id": self._qid, "gen": need})
                continue
            self._give_up_gaps(force=True)
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.push_timeout
            elif now >= deadline:
                raise QueueFullError(
                    f"queue {self.name!r}: the ring (rows layout, capacity {self.capacity} pushes) stayed "
                    f"full for {self.push_timeout:g}s; nothing of the batch was pushed"
                )
            pause_for(min(pause, max(0.0, deadline - now)))
            pause = min(pause * 2, 0.05)

    # -- pop ---------------------------------------------------------------------------------------

    def _pop_once(
        self, n: int, semantics: Semantics, vt: float, consumer: str, conn: DbConnection | None
    ) -> list[Message]:
        params = {
            "n": n,
            "lease": semantics is Semantics.AT_LEAST_ONCE,
            "visibility_timeout_s": vt,
            "consumer": consumer,
        }
        if n == 1 and self._one_path():
            rows = self._take(params, conn, "ring_rows_take_one", self._take1_fn)
        else:
            rows = self._take(params, conn, "ring_rows_take", self._take_fn)
        if not rows:
            return []
        return self._messages(rows)

    def _messages(self, rows: Sequence[Sequence[Any]]) -> list[Message]:
        """Messages from (id, attempts, deliveries, enqueued_at, lease_until, payload) rows."""
        ids, attempts, deliveries, enqueued, until, payloads = zip(*rows, strict=True)
        if self.settings.payload_type is not PayloadType.BYTES:
            payloads = tuple(map(self.settings.decode, payloads))
        return messages_from_columns(
            ids, self.name, payloads, repeat(0), attempts, deliveries, enqueued, until
        )

    def _pop_payloads_once(self, n: int, semantics: Semantics, conn: DbConnection | None) -> list[Any]:
        if n == 1 and self._one_path():
            rows = self._take({}, conn, "ring_rows_pop_payload_one", self._take1_fn)
        else:
            rows = self._take({"n": n}, conn, "ring_rows_pop_payloads", self._take_fn)
        return self.settings.decode_first_column(rows)

    def _one_path(self) -> bool:
        """Whether pops of one take the ring's own path for them (``rtake1``): a ring made by an older
        build lacks that function, and its pops of one take the general path (read once a handle)."""
        if self._has_take1 is None:
            row = self._db.fetchone(
                "ring_rows_has_function", {"schema": self._db.schema, "fn": self._take1_fn["fn"]}
            )
            self._has_take1 = bool(row and row[0])
        return self._has_take1

    def _take(
        self, params: dict[str, Any], conn: DbConnection | None, query: str, fn: dict[str, str]
    ) -> list[tuple[Any, ...]]:
        # Every pop reclaims expired leases first (at most every reclaim_every), whatever its semantics:
        # a message leased by a consumer that died comes back even if only other consumers pop. In the
        # caller's transaction (conn), the reclaim joins it.
        # wait: when other pops hold every lane with messages, wait for one (not in a caller's
        # transaction, which may hold lanes of its own, nor in a waiting pop's look, which reports a
        # push in progress then and looks again, or is woken when the holder took something).
        # Waiting, a take that found the lanes with rows held by other transactions (for its lock
        # timeout, or again after its wait) fails with LockTimeoutError, having taken nothing: it is tried
        # again, in a new transaction, for up to lane_timeout (waiting_out_locks).
        params["wait"] = conn is None and not getattr(self._asked, "looking", False)

        def take() -> list[tuple[Any, ...]]:
            rows = self._db.fetchall(query, params, conn, identifiers=fn)
            if not rows and conn is None and self._give_up_gaps():
                rows = self._db.fetchall(query, params, conn, identifiers=fn)
            return rows

        try:
            now = time.monotonic()
            if now - self._last_reclaim >= self.reclaim_every:
                self._last_reclaim = now
                self._reclaim(RECLAIM_LIMIT, conn)  # a group dropped meanwhile raises below, by name
            if conn is not None:
                return take()
            return waiting_out_locks(take, [], self.lane_timeout)
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise

    def _give_up_gaps(self, *, force: bool = False) -> int:
        """Give up the ring's gaps proven since this handle last looked (ring_rows_gaps); return how
        many rows were given up. At most every 50 ms unless ``force``. A handle's first look only sees
        where the ring is, so it looks again at once: a row that was unwritten then and still is, once
        every transaction older than that look has ended (a push that rolled back), is given up by the
        first call of a handle (an Airflow task's, say) too."""
        now = time.monotonic()
        if not force and now - self._gaps_checked < _GAP_CHECK_EVERY_S:
            return 0
        self._gaps_checked = now
        for _ in range(2):
            first_look = self._seen[0] is None
            row = self._db.fetchone(
                "ring_rows_gaps", {"queue_id": self._qid, "xmax": self._seen[0], "last": self._seen[1]}
            )
            if row is None:
                return 0
            self._seen = (int(row[0]), int(row[1]))
            if not first_look:
                return int(row[2])
        return 0

    def recover_gaps(self, *, wait: float = 2.0) -> int:
        """Give up the row numbers that a push took and will never write, where a lane stopped at one;
        return how many rows (with consumer groups: the most that one group passed).

        A push takes its row number from a sequence, which a rollback does not give back: a push that
        rolled back or whose process died leaves its row unwritten, and the lane stops there once its
        pops reach it. A lane's position is all this layout records of it (no update, no skip list), so a
        gap behind a message not taken yet is in nobody's way and is given up once the lane reaches it.
        Pops (an empty one), a full push and :meth:`maintain` give up gaps too; this does it for a ring
        nobody pops, and waits: it gives up what earlier looks of this handle proved, then looks at the
        ring (the row sequence's position, then its own transaction id) and gives up the rows issued by
        then and still unwritten at a lane's head once every transaction older than that look has ended
        (a push takes its transaction id before its row number, so such a row can never be written). It
        waits for that up to ``wait`` seconds, and otherwise gives nothing more up: a push still running
        keeps its row. A lane another pop holds at that moment is left for a later call.
        """
        wait = check_seconds(f"queue {self.name!r}: recover_gaps wait", wait)
        root = self._default()
        try:
            skipped = root._give_up_gaps(force=True)
            xmax = root._seen[0]
            deadline = time.monotonic() + wait
            pause = 0.002
            while xmax is not None:
                row = self._db.fetchone("ring_rows_xmin", {})
                if row is not None and int(row[0]) >= xmax:
                    return skipped + root._give_up_gaps(force=True)
                left = deadline - time.monotonic()
                if left <= 0:
                    break  # a transaction older than the look is still running: a later call gives it up
                pause_for(min(pause, left))
                pause = min(pause * 2, 0.1)
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        return skipped

    def _raise_if_gone(self, conn: DbConnection | None = None) -> None:
        """Raise :class:`QueueNotFoundError` when this handle's ring was dropped (its own functions and
        tables went with it, so its statements fail as if the schema were not installed), or
        :class:`GroupNotFoundError` when its group was. ``conn``: read in the caller's transaction (one
        still usable)."""
        row = self._db.fetchone("get_queue", {"name": self.name}, conn)
        if row is None or row[0] != self._qid:
            raise QueueNotFoundError(self.name, self._db.schema) from None
        self._raise_if_group_gone(conn)

    # -- finish: ack, nack, reclaim ------------------------------------------------------------------

    def _receipt_params(self, messages: Sequence[Message]) -> dict[str, Any]:
        receipts = list(dict.fromkeys((m.id, m.delivery) for m in messages))  # each receipt once, in order
        return {
            "queue_id": self._gid,
            "ids": [r[0] for r in receipts],
            "deliveries": [r[1] for r in receipts],
        }

    def ack(self, messages: Sequence[Message], *, conn: DbConnection | None = None) -> int:
        params = self._receipt_params(messages)
        if not params["ids"]:
            return 0
        # The usual ack names one whole lease (the messages of one pop): one done row closes it.
        try:
            if self._waking():
                row = self._db.fetchone(
                    "ring_rows_ack_notify", self._wake_params(params), conn, identifiers=self._ack_fn
                )
            else:
                row = self._db.fetchone("ring_rows_ack", params, conn, identifiers=self._ack_fn)
        except (DatabaseError, SchemaError):
            self._raise_if_gone()  # a group dropped meanwhile took its functions with it
            raise
        if row is not None and row[0] == len(params["ids"]):
            return len(params["ids"])
        return self._settle({**params, **_SETTLE_ACK}, conn)

    def _waking(self) -> bool:
        """Whether this handle's acks and nacks wake a waiting pop when they free a lane (a ring ordered
        per key, made by a build whose ack and settle take the ring's notify setting: it has rblocked,
        made with them; read once a handle). A ring without ordering holds no lane past a pop's commit."""
        if self._wakes is None:
            row = self._db.fetchone(
                "ring_rows_has_function", {"schema": self._db.schema, "fn": self._own() + "blocked"}
            )
            self._wakes = bool(row and row[0])
        return self._wakes

    def _wake_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return {**params, "notify": _NOTIFY_CODE[self.settings.notify], "channel": self._channel}

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

    def _settle(self, params: dict[str, Any], conn: DbConnection | None) -> int:
        """Ack or nack receipts all or nothing; raise :class:`LeaseExpiredError` naming the receipts
        whose lease was lost (nothing written then)."""
        try:
            if self._waking():
                done = self._db.fetchall(
                    "ring_rows_settle_notify", self._wake_params(params), conn, identifiers=self._settle_fn
                )
            else:
                done = self._db.fetchall("ring_rows_settle", params, conn)
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        if len(done) != len(params["ids"]):
            held = set(self._db.fetchall("ring_rows_held", params, conn))
            lost = [i for i, d in zip(params["ids"], params["deliveries"], strict=True) if (i, d) not in held]
            raise LeaseExpiredError(self.name, lost or list(params["ids"]))
        return len(done)

    def reclaim_expired(self, limit: int = RECLAIM_LIMIT) -> int:
        try:
            return self._reclaim(limit, None)
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise

    def _reclaim(self, limit: int, conn: DbConnection | None) -> int:
        params = {"queue_id": self._gid, "max_attempts": self.settings.max_attempts, "limit": limit}
        return len(self._db.fetchall("ring_rows_reclaim", params, conn))

    def maintain(self, *, limit: int = RECLAIM_LIMIT) -> dict[str, int]:
        """Reclaim expired leases of every consumer group, give up the gaps proven since the last call,
        act on groups that nobody pops (:meth:`watch_groups`), and rotate in the next segment when
        nothing needs the one it holds any more, so that pushes find it empty, forget every group's
        batches finished longer than ``batch_retention_s`` ago, and forget up to ``limit``
        deduplication keys older than the ring's ``dedup_window`` (``"keys_forgotten"``).
        ``"groups_lagging"`` and ``"groups_dropped"`` are counted on a ring with groups besides the
        default one."""
        root = self._default()
        others = root._group_handles()
        reclaimed = root.reclaim_expired(limit)
        purged = root._purge_batches(limit)
        for h in others:
            try:
                reclaimed += h.reclaim_expired(limit)
                purged += h._purge_batches(limit)
            except GroupNotFoundError:
                continue  # dropped meanwhile
        # Gaps first: a row issued and never written counts as one to take, so a group that has taken
        # everything would look as lagging behind a push that rolled back until it is given up. With
        # groups, twice: the second call proves what was issued up to the first (a gap is proven only
        # against a position read before it, which the call before may have read long ago).
        skipped = root._give_up_gaps(force=True)
        if others:
            skipped += root._give_up_gaps(force=True)
        watched = root.watch_groups() if others else {}
        row = self._db.fetchone("ring_rows_rotate_ahead", {"queue_id": self._qid})
        if row is not None and row[0] is not None:
            self._db.execute("ring_rows_label", {"queue_id": self._qid, "gen": row[0]})
        forgotten = 0
        if root._keyed():
            got = self._db.fetchone("ring_rows_forget_keys", {"n": limit}, identifiers=root._forget_fn)
            forgotten = int(got[0]) if got else 0
        return {
            "reclaimed": reclaimed,
            "gaps_skipped": skipped,
            "rotated_ahead": int(row is not None and row[0] is not None),
            "batches_purged": purged,
            "keys_forgotten": forgotten,
            **watched,
        }

    # -- inspect -------------------------------------------------------------------------------------

    def peek(self, n: int = 10) -> list[Message]:
        """Up to ``n`` ready messages in the order pops take them (those due again first, then the
        lanes'), taking nothing: each with its attempts and deliveries so far (0 and 0 for a message never
        delivered), as the slots layout and the table design show them. A lease past its end is in flight
        until reclaimed (:meth:`readiness` counts it); a message past its time to live is not ready, nor,
        on a ring ordered per key, one behind a held lane."""
        n = _check_batch_size(n)
        try:
            rows = self._db.fetchall("ring_rows_look", {"queue_id": self._gid, "n": n})
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        if not rows:
            self._raise_if_gone()  # a dropped ring or group has nothing to show either
            return []
        return self._messages(rows)

    def count_ready(self, min_priority: int | None = None, cap: int = COUNT_CAP) -> int:
        return self.readiness(min_priority, cap)[0]

    def readiness(
        self, min_priority: int | None = None, cap: int = COUNT_CAP
    ) -> tuple[int, tuple[int, int] | None]:
        """What a pop could take now, counted up to ``cap``, and the ``(id, delivery)`` of the message it
        would take first, in one statement (the ring's own ``ready``): leases past their end with an
        attempt left count at once, before a pop or :meth:`maintain` reclaims them, as on the slots
        layout and the table design (a pop reclaims them first), while :meth:`stats` shows them in flight
        until then. On a ring ordered per key, only the messages of the lanes a pop may take now (none
        of a lane held by an open lease, a message leased again or delayed: :meth:`stats` counts those
        in ``extra["blocked"]``). Every ring message has priority 0: ``min_priority`` above 0 counts
        none."""
        params = {"queue_id": self._gid, "cap": cap, "max_attempts": self.settings.max_attempts}
        try:
            row = self._db.fetchone("ring_rows_ready_head", params)
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        if row is None or row[1] is None:
            return 0, None
        ready = 0 if min_priority is not None and min_priority > 0 else int(row[0])
        return ready, (int(row[1]), int(row[2]))

    def _look(self, take: Callable[[], list[_T]]) -> tuple[bool, list[_T]]:
        """One look of a waiting pop: the question (ring_rows_ask), then the pop only when it may find
        something (a row issued and not taken, or messages to deliver again in the segments live now),
        or when the pop's reclaim of expired leases is due (which may make some to deliver again).
        Otherwise every row issued is taken and a push that takes a row from now on notifies, so the
        waiter waits for that NOTIFY: an idle look is one statement, not the question and an empty pop.
        A ring made by a build without the ring's own pop of one (and its retry generation) looks as the
        other designs do."""
        if not self._one_path():
            return super()._look(take)
        try:
            row = self._db.fetchone(
                "ring_rows_ask", {"seg_rows": self.capacity // 4}, identifiers=self._ask_ids
            )
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        pushing, to_take = (True, True) if row is None else (bool(row[0]), bool(row[1]))
        self._asked.again = to_take and not pushing
        if not (to_take or time.monotonic() - self._last_reclaim >= self.reclaim_every):
            return pushing, []
        if not pushing:
            return pushing, self._look_take(take)
        # A row issued and not taken: one waiting look of this handle pops for it at a time. Another
        # that sees it meanwhile would mostly find the same row taken (an empty pop, and a look for
        # gaps); it reports the push in progress instead and looks again soon (or waits for the wake
        # the popping look passes on once it took something). Not behind a pop that has run for
        # _LOOK_POP_ALONE_S already (one waiting for a lane another consumer holds): it pops too.
        now = time.monotonic()
        with self._look_lock:
            since = self._look_popping
            if since is not None and now - since < _LOOK_POP_ALONE_S:
                return pushing, []
            self._look_popping = now
        try:
            return pushing, self._look_take(take)
        finally:
            with self._look_lock:
                if self._look_popping == now:
                    self._look_popping = None

    def _look_take(self, take: Callable[[], list[_T]]) -> list[_T]:
        """``take`` in a waiting pop's look: without waiting for a lane other pops hold (:meth:`_take`)."""
        self._asked.looking = True
        try:
            return take()
        finally:
            self._asked.looking = False

    def _until_due(self, default: float) -> float:
        """Seconds until the earliest message to deliver again comes due (a nack with a delay, a retry's
        backoff), at most ``default``: asked only when this thread's last look said some may be in the
        segments live now (ring_rows_ask's retry generation), so that an idle waiter asks nothing more."""
        if not getattr(self._asked, "again", False):
            return default
        try:
            row = self._db.fetchone("ring_rows_next_due", {}, identifiers=self._due_ids)
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        if row is None or row[0] is None:
            return default
        return max(0.01, min(default, float(row[0])))

    def _pushing(self) -> bool:
        try:
            row = self._db.fetchone("ring_rows_pushing", {"queue_id": self._qid, "group": self._gid})
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        return bool(row and row[0])

    def stats(self, *, exact: bool = False) -> QueueStats:
        try:
            row = self._db.fetchone("ring_rows_depth", {"queue_id": self._gid})
        except (DatabaseError, SchemaError):
            self._raise_if_gone()
            raise
        if row is None:
            raise QueueNotFoundError(self.name, self._db.schema)
        ready, delayed, in_flight, failed, oldest_age, rows, gens, expired, pending, pushed, blocked = row
        # ready counts every waiting message; on a ring ordered per key, blocked is its part behind a lane
        # a pop may not take now (held by a lease, a message leased again or delayed), which stats show
        # apart: ready is then what a pop could take now, as count_ready counts it.
        lag = int(ready) + int(delayed) + int(in_flight)
        if blocked is not None:
            ready = int(ready) - int(blocked)
        extra: dict[str, Any] = {
            "layout": "rows",
            # In pushes (rows), a push of a batch being one row: rows_held counts the rows in the
            # segments not yet emptied, taken or not.
            "capacity": self.capacity,
            "lanes": self.lanes,
            "rows_held": int(rows),
            "segment_generations": list(gens),
            "group": self.group_name,
            # What the group has still to finish: what it can take now or later, and what it holds.
            "lag_messages": lag,
            "lag_seconds": float(oldest_age or 0.0),
            # Totals in messages since the ring was made, read in one snapshot with the lag: every
            # push's (a push rolled back counts nothing), and the push total less what this group has
            # not finished (its lag, and the messages past their time to live that no pop has reached
            # yet): what it has finished with (for a group added later, what was pushed before its
            # start too). None for a ring made by a build that did not count them.
            "push_total": None if pushed is None else int(pushed),
            "pop_total": None if pushed is None else int(pushed) - lag - int(pending or 0),
        }
        if blocked is not None:
            # Waiting behind a held lane: not ready for a pop now, but part of the group's lag.
            extra["blocked"] = int(blocked)
        if self.settings.ttl_s is not None and expired is not None:
            # A ring whose messages expire: the failed ones that failed by expiry (as the table design
            # counts them), and those past their time to live that no pop has reached yet, which a pop
            # will fail (or drop), counted apart from ready and delayed. Both exact (the module says how).
            extra["expired"] = int(expired)
            extra["expired_pending"] = int(pending)
        return QueueStats(
            queue=self.name,
            ready=int(ready),
            delayed=int(delayed),
            in_flight=int(in_flight),
            failed=int(failed),
            finished=0,
            oldest_ready_age_s=None if oldest_age is None else float(oldest_age),
            extra=extra,
        )

    def list_failed(self, limit: int = 100, after_id: int = 0) -> list[FailedMessage]:
        """Failed messages by id, after ``after_id``; the default lists from the first (this layout's
        first message has the id 0, which the default includes)."""
        after = -1 if after_id == 0 else after_id
        rows = self._db.fetchall(
            "ring_list_failed", {"queue_id": self._qid, "after_id": after, "limit": limit, "group": self._gid}
        )
        if not rows:
            self._raise_if_gone()
        return failed_messages(self.name, self.settings, rows)

    def requeue_failed(self, ids: Sequence[int] | None = None) -> int:
        """Push failed messages again, oldest first, with a fresh attempt count and new ids (their old
        rows are gone with their segments), in pushes of at most :data:`ROWS_MAX_BATCH`."""
        self._refuse_requeue_with_groups()
        params = {"queue_id": self._qid, "all": ids is None, "ids": list(ids or []), "group": self._gid}
        with self._db.transaction() as conn:
            rows = sorted(self._db.fetchall("ring_take_failed", params, conn))
            payloads = [bytes(r[1]) for r in rows]
            for first in range(0, len(payloads), ROWS_MAX_BATCH):
                if self._per_key:  # without their keys: a failed message's key is not kept
                    self._push_ordered(payloads[first : first + ROWS_MAX_BATCH], None, conn, None)
                else:
                    self._push_rows(payloads[first : first + ROWS_MAX_BATCH], conn)
        return len(rows)

    def delete_failed(self, ids: Sequence[int] | None = None) -> int:
        params = {"queue_id": self._qid, "all": ids is None, "ids": list(ids or []), "group": self._gid}
        return len(self._db.fetchall("ring_delete_failed", params))
