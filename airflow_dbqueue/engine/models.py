"""Frozen dataclasses the engine returns, and the small enums of its vocabulary."""

from __future__ import annotations

import datetime as dt
import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

from airflow_dbqueue.engine.errors import ConfigurationError, PayloadTooLargeError, PayloadTypeError


class Semantics(enum.StrEnum):
    """Delivery semantics of a pop (the three of hasql-queue)."""

    AT_MOST_ONCE = "at-most-once"
    """Popped means gone: the message is finished by the pop itself and never redelivered."""
    AT_LEAST_ONCE = "at-least-once"
    """The pop leases the message; ``ack`` finishes it, ``nack`` or lease expiry delivers it again."""
    EXACTLY_ONCE = "exactly-once"
    """The pop runs in the caller's transaction and finishes the message when that transaction commits."""

    @classmethod
    def parse(cls, value: str | Semantics) -> Semantics:
        """Accept the enum or its string value (``at_most_once`` spelled with underscores too)."""
        if isinstance(value, Semantics):
            return value
        try:
            return cls(str(value).replace("_", "-").lower())
        except ValueError:
            choices = ", ".join(s.value for s in cls)
            raise ConfigurationError(f"unknown semantics {value!r}; choose one of {choices}") from None


class Design(enum.StrEnum):
    """How a queue is stored."""

    TABLE = "table"
    """Unbounded meta/data tables (after Al Zabir's meta/data queue)."""
    RING = "ring"
    """Preallocated ring buffer of slots (after Kejser's ring buffer in a table)."""


class RingLayout(enum.StrEnum):
    """How a ring stores its messages (chosen when it is created)."""

    SLOTS = "slots"
    """A preallocated slot a message, updated in place by pushes (the default on SQL Server, which has
    no other)."""
    ROWS = "rows"
    """A row a push in four insert-only segment tables emptied with ``TRUNCATE`` once every reader has
    passed them: no dead row on the hot path under a held xmin horizon (PostgreSQL only, and its
    default; see docs/limits.md)."""


class PayloadType(enum.StrEnum):
    """What a queue's payloads are, and how they are encoded to bytes in the data table."""

    JSON = "json"
    """Any JSON-serialisable value (dict, list, str, number, bool, None), stored as UTF-8 JSON."""
    TEXT = "text"
    """``str``, stored as UTF-8."""
    BYTES = "bytes"
    """``bytes``/``bytearray``/``memoryview``, stored as is."""


class NotifyMode(enum.StrEnum):
    """When a push sends a NOTIFY to wake waiting consumers."""

    AUTO = "auto"
    """Only when the queue had no ready message before the push: waiting consumers only wait on an
    empty queue, and a busy queue never pays NOTIFY's commit-time global lock."""
    ALWAYS = "always"
    NEVER = "never"
    """Waiting pops poll only."""


DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""A table queue's largest payload in bytes, unless it names another."""
DEFAULT_MAX_ATTEMPTS = 5
"""Deliveries of a message before it goes to the failed state, unless its queue names another number."""
DEFAULT_VISIBILITY_TIMEOUT_S = 30.0
"""Seconds a lease lasts, unless its queue or its pop says otherwise."""
DEFAULT_RETRY_BACKOFF_S = 1.0
"""Seconds before a nacked message is ready again at its first retry (doubling with each attempt) ..."""
DEFAULT_RETRY_BACKOFF_MAX_S = 300.0
"""... up to this many seconds."""
DEFAULT_DEDUP_WINDOW_S = 300.0
"""Seconds a push's deduplication key is remembered (SQS FIFO's five minutes), unless its queue names
another window."""


class OnExpiry(enum.StrEnum):
    """What becomes of a message not popped within its time to live."""

    FAIL = "fail"
    """The failed state, with ``last_error`` ``"expired"``: listed, counted and requeued as any failed
    message."""
    DROP = "drop"
    """Deleted (kept as discarded for the archiver where the queue archives)."""


class Ordering(enum.StrEnum):
    """How a queue orders its messages besides priority and due time."""

    NONE = "none"
    PER_KEY = "per_key"
    """Pushes may give a message an ordering key: a key's messages are handed out one at a time, in
    push order (as SQS FIFO's message groups, or a Kafka partition's key)."""


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """A queue's stored settings (one row of the ``queues`` table)."""

    name: str
    queue_id: int
    design: Design = Design.TABLE
    payload_type: PayloadType = PayloadType.JSON
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    visibility_timeout_s: float = DEFAULT_VISIBILITY_TIMEOUT_S
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S
    retry_backoff_max_s: float = DEFAULT_RETRY_BACKOFF_MAX_S
    notify: NotifyMode = NotifyMode.AUTO
    archive: bool = True
    capacity: int | None = None
    """Slots of a ring queue (``None`` for the table design)."""
    lanes: int | None = None
    """Lanes of a ring queue (``None`` for the table design): its numbers are dealt to lanes by
    ``id % lanes``, and consumers popping at once take from different lanes."""
    dedup_window_s: float = DEFAULT_DEDUP_WINDOW_S
    """Seconds within which a second push of a deduplication key (``push(dedup_key=...)``) pushes
    nothing and returns the first push's id."""
    ttl_s: float | None = None
    """Seconds a message may wait to be popped, counted from its push, unless its push names another
    ``ttl`` (``None``: no limit); then it is never delivered and goes as ``on_expiry`` says."""
    on_expiry: OnExpiry = OnExpiry.FAIL
    """What becomes of a message whose time to live passed before a pop took it."""
    ordering: Ordering = Ordering.NONE
    """``per_key``: no message is handed out while a message of its ordering key pushed before it is
    ready, delayed or in flight (table design)."""
    layout: RingLayout | None = None
    """A ring's :class:`RingLayout` (``None`` for the table design)."""

    def encode_all(self, payloads: list[Any]) -> list[bytes]:
        """Encode a batch of payloads (:meth:`encode` of each, in order).

        A batch of ``bytes`` for a bytes queue, none over the limit, is checked by C loops (``map``)
        and passed on as it is: 0.3 us of client CPU a message less than encoding each on its own.
        """
        if (
            self.payload_type is PayloadType.BYTES
            and payloads
            and set(map(type, payloads)) == {bytes}
            and max(map(len, payloads)) <= self.max_payload_bytes
        ):
            return payloads
        encode = self.encode
        return [encode(p, i) for i, p in enumerate(payloads)]

    def encode(self, payload: Any, index: int = 0) -> bytes:
        """Encode one payload for storage, checking its type and size against the settings."""
        kind = self.payload_type
        if kind is PayloadType.BYTES:
            if not isinstance(payload, bytes | bytearray | memoryview):
                raise PayloadTypeError(
                    f"queue {self.name!r} takes bytes payloads; payload #{index} is {type(payload).__name__}"
                )
            data = bytes(payload)
        elif kind is PayloadType.TEXT:
            if not isinstance(payload, str):
                raise PayloadTypeError(
                    f"queue {self.name!r} takes text payloads; payload #{index} is {type(payload).__name__}"
                )
            try:
                data = payload.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"): no UTF-8 for it
                raise PayloadTypeError(
                    f"queue {self.name!r}: payload #{index} is not valid text: {exc.reason} at position "
                    f"{exc.start}"
                ) from None
        else:
            if isinstance(payload, bytes | bytearray | memoryview):
                raise PayloadTypeError(
                    f"queue {self.name!r} takes JSON payloads; payload #{index} is bytes "
                    "(create the queue with payload_type='bytes' for raw bytes)"
                )
            try:
                data = json.dumps(
                    payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False
                ).encode()
            except (TypeError, ValueError) as exc:
                raise PayloadTypeError(
                    f"queue {self.name!r}: payload #{index} is not JSON-serialisable: {exc}"
                ) from None
        if len(data) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                f"queue {self.name!r}: payload #{index} is {len(data)} bytes encoded; "
                f"the queue's limit (max_payload_bytes) is {self.max_payload_bytes}"
            )
        return data

    def decode(self, data: bytes) -> Any:
        """Decode a stored payload back to the Python value that was pushed."""
        if self.payload_type is PayloadType.BYTES:
            return bytes(data)
        if self.payload_type is PayloadType.TEXT:
            return bytes(data).decode("utf-8")
        return json.loads(data)

    def decode_first_column(self, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The payloads of ``rows`` whose first column is a stored payload read in binary, decoded in
        order: a bytes queue's are bytes already and are passed on as they are."""
        payloads = [r[0] for r in rows]
        if self.payload_type is PayloadType.BYTES:
            return payloads
        return list(map(self.decode, payloads))


class Message(NamedTuple):
    """A message returned by pop: an immutable record of the fields below.

    ``attempts`` counts deliveries towards ``max_attempts``, including this one (``requeue_failed``
    resets it). ``delivery`` counts every hand-out of the message and never resets: ``(id, delivery)``
    is the receipt that ``ack``/``nack`` check, so an ack from a consumer whose lease expired and was
    handed to another consumer cannot finish the other consumer's delivery.

    A named tuple, so that pops build thousands of them in C (:func:`messages_from_columns`); a
    message equals only another message with the same fields, never a plain tuple.
    """

    id: int
    queue: str
    payload: Any
    priority: int
    attempts: int
    delivery: int
    enqueued_at: dt.datetime
    lease_until: dt.datetime | None = None

    @property
    def receipt(self) -> tuple[int, int]:
        """``(id, delivery)``: what ack and nack use to recognise this delivery."""
        return (self.id, self.delivery)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Message):
            return tuple.__eq__(self, other)
        return False if isinstance(other, tuple) else NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return tuple.__hash__(self)


def messages_from_columns(  # noqa: PLR0917 - the fields in order, as Message(...) takes them
    ids: Iterable[int],
    queue: str,
    payloads: Iterable[Any],
    priorities: Iterable[int],
    attempts: Iterable[int],
    deliveries: Iterable[int],
    enqueued_at: Iterable[dt.datetime],
    lease_until: Iterable[dt.datetime | None],
) -> list[Message]:
    """The messages whose fields are the columns given (the queue's name is one for all), built in C.

    Pops transpose their rows with ``zip(*rows)`` and pass constant fields as :func:`itertools.repeat`:
    no Python call runs per message. Building each message through a Python call costs the client
    about 8,000 instructions a message, more than the driver's reading of its row.
    """
    fields = zip(ids, repeat(queue), payloads, priorities, attempts, deliveries, enqueued_at, lease_until)
    return list(map(tuple.__new__, repeat(Message), fields))


class BatchState(enum.StrEnum):
    """Where a claimed batch stands: claimed (leased), acked, or released for another try."""

    CLAIMED = "claimed"
    ACKED = "acked"
    RELEASED = "released"

    @classmethod
    def from_code(cls, code: int) -> BatchState:
        return (cls.CLAIMED, cls.ACKED, cls.RELEASED)[code]

    @property
    def code(self) -> int:
        return (BatchState.CLAIMED, BatchState.ACKED, BatchState.RELEASED).index(self)


@dataclass(frozen=True, slots=True)
class Batch:
    """Messages claimed together under one lease and one id (see :meth:`Queue.claim_batch`).

    The payloads stay in the database: a reader in another process (a Spark job) fetches them by
    ``batch_id``. ``receipts`` are the ``(id, delivery)`` of each message, in claim order.
    """

    batch_id: str
    queue: str
    state: BatchState
    receipts: tuple[tuple[int, int], ...]
    claimed_at: dt.datetime
    lease_until: dt.datetime
    consumer: str | None = None
    finished_at: dt.datetime | None = None
    last_error: str | None = None

    @property
    def size(self) -> int:
        """How many messages the batch holds."""
        return len(self.receipts)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-safe summary (for logs and XCom); receipts are left out, being possibly many."""
        return {
            "batch_id": self.batch_id,
            "queue": self.queue,
            "state": self.state.value,
            "size": self.size,
            "first_id": self.receipts[0][0] if self.receipts else None,
            "claimed_at": self.claimed_at.isoformat(),
            "lease_until": self.lease_until.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "consumer": self.consumer,
            "last_error": self.last_error,
        }


@dataclass(frozen=True, slots=True)
class FailedMessage:
    """A message in the failed (dead-letter) state."""

    id: int
    queue: str
    payload: Any
    priority: int
    attempts: int
    enqueued_at: dt.datetime
    last_error: str | None


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A snapshot of one queue's depth by state.

    The table design counts each state exactly up to 50,000 messages (``STATS_EXACT_CAP`` of
    ``engine/table.py``), so that a queue's stats cost what it holds and no more than that; on
    PostgreSQL a state with more is estimated from a sample of the table (within a few percent), and
    ``extra["estimated"]`` (in :meth:`as_dict`: ``"estimated": true``) says that some figure is an
    estimate. Maintenance's metrics and samples count every queue of a schema exactly, in one pass.
    """

    queue: str
    ready: int
    delayed: int
    in_flight: int
    failed: int
    finished: int
    """Finished messages kept for archiving (zero when the queue does not archive)."""
    oldest_ready_age_s: float | None
    """Seconds since the oldest ready message was pushed; ``None`` when nothing is ready."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict (for logs, XCom and the CLI)."""
        out: dict[str, Any] = {
            "queue": self.queue,
            "ready": self.ready,
            "delayed": self.delayed,
            "in_flight": self.in_flight,
            "failed": self.failed,
            "finished": self.finished,
            "oldest_ready_age_s": self.oldest_ready_age_s,
        }
        out.update(self.extra)
        return out


DEFAULT_GROUP = "default"
"""The name of the consumer group every ring has (and every call without ``group=`` uses)."""

RING_DEFAULT_LAG_TIMEOUT_S = 3600.0
"""A consumer group's default lag timeout: an hour without a pop while it has messages to take."""


class OnLag(enum.StrEnum):
    """What maintenance does with a ring's consumer group that nobody pops for its lag timeout."""

    BLOCK = "block"
    """Keep it, with a warning: it holds the ring's floor, so pushes wait for it once the ring is full."""
    DROP_GROUP = "drop_group"
    """Drop it (its positions, leases and failed messages), so that it cannot stall the producers."""

    @classmethod
    def parse(cls, value: OnLag | str) -> OnLag:
        """Accept the enum or its string value."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigurationError(f"unknown on_lag {value!r}; choose one of {choices}") from None


@dataclass(frozen=True)
class GroupInfo:
    """One consumer group of a ring, as :meth:`RingQueue.groups` lists it."""

    name: str
    created_at: dt.datetime | None
    """When it was added (``None`` for the default group, which the ring was created with)."""
    on_lag: OnLag
    lag_timeout_s: float | None
    """Seconds without a pop (while it has messages to take) before maintenance acts on ``on_lag``."""
    pop_position: int
    """Its lowest lane position: the next number none of its pops has taken."""
    idle_s: float | None
    """Seconds since maintenance last saw its positions move (``None``: not watched, the default group)."""
