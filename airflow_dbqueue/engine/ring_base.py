"""What every handle of a ring shares: its settings and state, the rows it reads back and the
receipts it settles. The ring design itself is described in :mod:`airflow_dbqueue.engine.ring`."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    DatabaseError,
    DeadlockError,
    GroupNotFoundError,
    LeaseExpiredError,
    LockTimeoutError,
    NotSupportedError,
    QueueNotFoundError,
)
from airflow_dbqueue.engine.models import (
    DEFAULT_GROUP,
    FailedMessage,
    GroupInfo,
    Message,
    NotifyMode,
    OnLag,
    PayloadType,
    messages_from_columns,
)
from airflow_dbqueue.engine.queue import Queue, check_seconds

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import Database, DbConnection
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
RING_DEFAULT_LANES = 8
"""A ring's default lanes (at most its capacity): up to this many consumers take messages at once."""
RING_MAX_LANES = 256
_NOTIFY_CODE = {NotifyMode.NEVER: 0, NotifyMode.AUTO: 1, NotifyMode.ALWAYS: 2}
_PUSH_ATTEMPTS = 20
_first = itemgetter(0)
_SETTLE_ACK = {
    "nack": False,
    "delay_s": None,
    "backoff_s": 0.0,
    "backoff_max_s": 0.0,
    "max_attempts": 1,
    "error": None,
}
_id = attrgetter("id")
_delivery = attrgetter("delivery")
_GROUP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,62}")
_ON_LAG_CODE = {OnLag.BLOCK: 0, OnLag.DROP_GROUP: 1}


def group_infos(rows: Iterable[Sequence[Any]], queue_id: int) -> list[GroupInfo]:
    """A ring's consumer groups from its ``ring_groups`` or ``ring_rows_groups`` rows (gid, name,
    created_at, on_lag, lag_timeout_s, moved_pos, moved_at, lowest position, ...): the default one
    (gid = the ring's queue_id) first, then by name."""
    out = []
    for row in rows:
        if row[0] == queue_id:
            out.append(GroupInfo(DEFAULT_GROUP, None, OnLag.BLOCK, None, int(row[7]), None))
            continue
        idle = (time.time() - row[6].timestamp()) if row[6] is not None else None
        out.append(
            GroupInfo(
                name=str(row[1]),
                created_at=row[2],
                on_lag=OnLag.DROP_GROUP if row[3] == 1 else OnLag.BLOCK,
                lag_timeout_s=float(row[4]),
                pop_position=int(row[7]),
                idle_s=None if idle is None else max(0.0, idle),
            )
        )
    out.sort(key=lambda g: (g.name != DEFAULT_GROUP, g.name))
    return out


log = logging.getLogger("airflow_dbqueue.engine.ring")  # the ring design's one logger, whichever module logs

RING_LANE_TIMEOUT_S = 5.0
"""A ring handle's default ``lane_timeout``: how long, in all, a pop or a claim outside a caller's
transaction waits for locks that other transactions hold (a lane another pop or a caller's transaction
holds, a table that a rotation's TRUNCATE or a compaction's VACUUM FULL locks). Each try waits up to its
statement's lock timeout (1 s) and fails when the lock stays held, or when it took nothing while another
transaction held a lane with messages; the handle tries again, in a new transaction, until this much
time has passed, and then answers that it found nothing."""

_T = TypeVar("_T")


def waiting_out_locks(take: Callable[[], _T], nothing: _T, timeout: float) -> _T:
    """``take()``, tried again while it fails with :class:`LockTimeoutError` or :class:`DeadlockError`
    (its transaction rolled back: nothing was taken) until ``timeout`` seconds have passed since the first
    try; then ``nothing``. For a pop or claim outside a caller's transaction only: a caller's transaction
    that failed is the caller's to run again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return take()
        except (LockTimeoutError, DeadlockError) as exc:
            if time.monotonic() >= deadline:
                log.info("a pop found its locks held for %gs and took nothing: %s", timeout, exc)
                return nothing


def nack_settle_params(
    name: str, settings: QueueSettings, delay: float | None, error: str | None
) -> dict[str, Any]:
    """The settle parameters of a nack on a ring of either layout (``delay`` checked first; None: the
    queue's backoff), to join the receipts' parameters."""
    if delay is not None:
        delay = check_seconds(f"queue {name!r}: nack delay", delay)
    return {
        "nack": True,
        "delay_s": None if delay is None else float(delay),
        "backoff_s": settings.retry_backoff_s,
        "backoff_max_s": settings.retry_backoff_max_s,
        "max_attempts": settings.max_attempts,
        "error": error,
    }


def failed_messages(name: str, settings: QueueSettings, rows: Iterable[Sequence[Any]]) -> list[FailedMessage]:
    """Failed messages from ``ring_list_failed``'s (id, attempts, enqueued_at, last_error, payload) rows,
    for a ring of either layout."""
    decode = settings.decode
    return [
        FailedMessage(
            id=r[0],
            queue=name,
            priority=0,
            attempts=r[1],
            enqueued_at=r[2],
            last_error=r[3],
            payload=decode(r[4]),
        )
        for r in rows
    ]


def check_ring_push(
    name: str,
    *,
    priority: int,
    delay: float,
    dedup_keys: Sequence[str] | None,
    ttl: float | None,
    keys: Sequence[str | None] | None,
    rows: bool = False,
    per_key: bool = False,
) -> None:
    """Refuse, before anything is sent, what a push into a ring cannot do: priorities and delays on
    either layout, on the slots layout (not ``rows``) expiry, deduplication keys and ordering keys, and
    on the rows layout ordering keys without ordering per key (``per_key``) and deduplication keys with
    it."""
    if ttl is not None and not rows:
        raise NotSupportedError(
            f"queue {name!r} is a ring of the slots layout: expiry (ttl) is the table design's and the "
            "rows layout's (docs/limits.md)"
        )
    if dedup_keys is not None and not rows:
        raise NotSupportedError(
            f"queue {name!r} is a ring of the slots layout: deduplication keys on push are the table "
            "design's and the rows layout's (docs/limits.md); use one of those for them"
        )
    if keys is not None and not rows:
        raise NotSupportedError(
            f"queue {name!r} is a ring of the slots layout: ordering per key is the table design's and the "
            "rows layout's (docs/limits.md); use one of those for it"
        )
    if keys is not None and not per_key:
        raise ConfigurationError(
            f"queue {name!r}: ordering keys need a queue created with ordering='per_key'"
        )
    if dedup_keys is not None and per_key:
        raise NotSupportedError(
            f"queue {name!r} is a ring of the rows layout ordered per key: deduplication keys on push are "
            "not built with ordering keys on a ring (docs/limits.md); use a table-design queue for both"
        )
    if priority != 0:
        raise ConfigurationError(
            f"queue {name!r} is a ring: FIFO by id, without priorities (got priority={priority}); "
            "use the table design for priorities"
        )
    if delay != 0:
        raise ConfigurationError(
            f"queue {name!r} is a ring: a push cannot be delayed (got delay={delay}); "
            "use the table design for delayed messages"
        )


class RingBase(Queue):
    """A ring's handle: its settings and state, and what the parts of :class:`RingQueue` share."""

    def __init__(
        self,
        db: Database,
        settings: QueueSettings,
        *,
        group: str = DEFAULT_GROUP,
        gid: int | None = None,
    ) -> None:
        super().__init__(db, settings)
        if settings.capacity is None:
            raise ConfigurationError(f"queue {settings.name!r} is a ring without a capacity")
        self.group_name = group
        # The key of the group's lanes, leases, retry and failed rows: the ring's queue id for its
        # default group, a negative gid for another (ring_groups).
        self._gid = settings.queue_id if gid is None else gid
        self._groups: dict[str, Self] = {}  # the handles of other groups (the default group's only)
        self._qid = settings.queue_id
        self.capacity = settings.capacity
        self.lanes = settings.lanes or 1
        self._channel = db.channel(settings.queue_id)
        self._lock = threading.Lock()
        self._gap: tuple[int, int, str | None] | None = None  # (number, issued position, holders)
        self._gap_since: tuple[int, float] | None = None
        self._last_reclaim = 0.0
        self._fast = False  # the last pop came back full: the next one tries ring_take first
        self._one_params: dict[str, Any] = {  # ring_take_one's: a pop of one at most once
            "group": self._gid,
            "queue_id": self._qid,
            "capacity": self.capacity,
            "lanes": self.lanes,
        }
        # A floor of the ring (ring_floor, or the one a push of a batch read) that pushes pass to the
        # server instead of reading it on every call; read again when a push of one finds its slot not
        # free under it. A floor never goes down: any one read is a safe bound, the highest the newest.
        self._floor: int | None = None
        self._floor_read = False
        self._help_params: dict[str, Any] = {
            "queue_id": self._qid,
            "capacity": self.capacity,
            "lanes": self.lanes,
            "lease": False,
            "visibility_timeout_s": settings.visibility_timeout_s,
            "consumer": "push",
            "group": self._gid,
        }
        self.push_timeout = 30.0
        self.gap_timeout = 5.0
        self.lane_timeout = RING_LANE_TIMEOUT_S
        self.reclaim_every = min(1.0, settings.visibility_timeout_s / 2)
        self._root = cast("Self", self)  # a group's handle: its ring's default handle (RingQueue.group)

    def _pushing(self) -> bool:
        row = self._db.fetchone("ring_pushing", {"queue_id": self._qid, "group": self._gid})
        return bool(row and row[0])

    @contextlib.contextmanager
    def _or_gone(self) -> Iterator[None]:
        """Run a read of the ring's tables; when it fails (a ring dropped meanwhile takes its tables'
        rows and sequence with it, and a statement planned before may no longer open them), raise
        :class:`QueueNotFoundError` or :class:`GroupNotFoundError` if that is what happened."""
        try:
            yield
        except DatabaseError:
            self._raise_if_gone()
            raise

    def _raise_if_gone(self, conn: DbConnection | None = None) -> None:
        """Raise :class:`QueueNotFoundError` when this handle's ring was dropped (its queue row is gone,
        or names another queue now), or :class:`GroupNotFoundError` when its consumer group was: a
        ring's statements find no ring or group then, and fail or write nothing. ``conn``: read in the
        caller's transaction (one still usable: a caller's pool may hold no other connection)."""
        row = self._db.fetchone("get_queue", {"name": self.name}, conn)
        if row is None or row[0] != self._qid:
            raise QueueNotFoundError(self.name, self._db.schema) from None
        if self._gid != self._qid and not any(
            r[0] == self._gid for r in self._db.fetchall("ring_groups", {"queue_id": self._qid}, conn)
        ):
            root = self._default()
            with root._lock:  # group(name) looks the name up again (it may name a new group now)
                if root._groups.get(self.group_name) is self:
                    del root._groups[self.group_name]
            raise GroupNotFoundError(self.name, self.group_name) from None

    def _messages(self, rows: Sequence[tuple[Any, ...]]) -> list[Message]:
        # Rows (id, attempts, delivery, enqueued_at, lease_until, payload, ...); or, for messages on
        # their first delivery, (id, enqueued_at, payload) unleased and (id, enqueued_at, payload,
        # lease_until) leased, where one lease end is sent on one row and NULL on the others (ring_take).
        # Read in binary: a bytea is bytes.
        if not rows:
            return []
        width = len(rows[0])
        attempts: Iterable[int] = repeat(1)
        deliveries: Iterable[int] = repeat(1)
        until: Iterable[Any] = repeat(None)
        if width == 3:
            ids, enqueued, payloads = zip(*rows, strict=True)
        elif width == 4:
            ids, enqueued, payloads, ends = zip(*rows, strict=True)
            until = repeat(next(filter(None, ends), None))
        else:
            ids, attempts, deliveries, enqueued, until, payloads = list(zip(*rows, strict=True))[:6]
        if self.settings.payload_type is not PayloadType.BYTES:
            payloads = tuple(map(self.settings.decode, payloads))
        return messages_from_columns(
            ids, self.name, payloads, repeat(0), attempts, deliveries, enqueued, until
        )

    def _payloads(self, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
        # Rows (payload,) from ring_take_payloads, or whole messages' rows as _messages reads them.
        if rows and len(rows[0]) > 1:
            return [m.payload for m in self._messages(rows)]
        return self.settings.decode_first_column(rows)

    def _receipt_params(self, messages: Sequence[Message]) -> dict[str, Any]:
        ids = list(map(_id, messages))
        deliveries = list(map(_delivery, messages))
        if len(set(ids)) != len(ids):  # a message named twice: each receipt once, in order
            receipts = list(dict.fromkeys(zip(ids, deliveries, strict=True)))
            ids, deliveries = [r[0] for r in receipts], [r[1] for r in receipts]
        return {
            "ids": ids,
            "deliveries": deliveries,
            "capacity": self.capacity,
            "lanes": self.lanes,
            "queue_id": self._qid,
            "group": self._gid,
        }

    def _found_nothing(self, conn: DbConnection | None = None) -> None:
        if self._gid != self._qid:
            self._raise_if_gone(conn)

    def _raise_lost(self, params: dict[str, Any], conn: DbConnection | None) -> None:
        """Raise :class:`LeaseExpiredError` naming the receipts of ``params`` not held; or, on a group's
        handle, the error of the ring or group dropped meanwhile (its leases went with it)."""
        if self._gid != self._qid:
            self._raise_if_gone(conn)
        held = set(self._db.fetchall("ring_held_receipts", params, conn))
        lost = [i for i, d in zip(params["ids"], params["deliveries"], strict=True) if (i, d) not in held]
        raise LeaseExpiredError(self.name, lost)

    def _settle(self, params: dict[str, Any], conn: DbConnection | None) -> int:
        done = self._db.fetchall("ring_settle", params, conn)
        if len(done) != len(params["ids"]):
            self._raise_lost(params, conn)
        return len(done)

    def _default(self) -> Self:
        return self if self._gid == self._qid else self._root

    _root: Self
