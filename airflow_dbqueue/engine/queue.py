"""The queue interface that every design (table, ring) implements, and the parts they share."""

from __future__ import annotations

import abc
import datetime as dt
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_dbqueue.engine.access import guard_methods
from airflow_dbqueue.engine.bridge import FaceLock
from airflow_dbqueue.engine.bridge import pause as pause_for
from airflow_dbqueue.engine.errors import (
    ConfigurationError,
    NotSupportedError,
    PermissionDeniedError,
    TransactionRequiredError,
)
from airflow_dbqueue.engine.models import (
    RING_DEFAULT_LAG_TIMEOUT_S,
    Batch,
    FailedMessage,
    GroupInfo,
    Message,
    NotifyMode,
    OnLag,
    QueueSettings,
    QueueStats,
    Semantics,
)
from airflow_dbqueue.engine.renames import warn_renamed

if TYPE_CHECKING:
    from airflow_dbqueue.engine.dialects.base import Database, DbConnection

DEFAULT_CONSUMER = f"{socket.gethostname()}:{os.getpid()}"

_T = TypeVar("_T")

RECLAIM_LIMIT = 10_000
"""The most expired leases one reclaim (a queue's upkeep) returns."""
COUNT_CAP = 1_000_000
"""Where a count of ready messages stops (a readiness check never counts a deep queue to its end)."""


RECHECK_FIRST = 0.002
"""The first pause of a waiting pop that found nothing while a push was in progress; it doubles up to
the poll interval while pushes stay in progress."""

SPIN_PAUSES = (0.0, 0.001, 0.002, 0.005)
"""The first pauses of a polling wait: a short spin, for a message pushed a moment later."""


def poll_pauses(poll_interval: float) -> Iterator[float]:
    """Yield the pauses of a polling wait: :data:`SPIN_PAUSES`, then 10 ms doubling to ``poll_interval``."""
    yield from (min(p, poll_interval) for p in SPIN_PAUSES)
    pause = 0.01
    while True:
        yield min(pause, poll_interval)
        pause *= 2


def check_seconds(what: str, value: object, *, positive: bool = False) -> float:
    """Return ``value`` as seconds (a float), or raise :class:`ConfigurationError` naming ``what`` when it
    is not a finite number, is negative, or (with ``positive``) is zero: a NaN or an infinity would
    otherwise reach the database, or make a wait never end."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigurationError(f"{what} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigurationError(f"{what} must be a finite number of seconds {bound}, got {value!r}")
    return seconds


MAX_DEDUP_KEY_CHARS = 512
"""The longest deduplication key (characters)."""


def check_keys(queue: str, what: str, keys: object, n: int, *, optional: bool = False) -> list[Any]:
    """Return ``keys`` as a list of ``n`` keys, or raise :class:`ConfigurationError` naming ``what`` and the
    first that is not a non-empty string of at most :data:`MAX_DEDUP_KEY_CHARS` characters without NUL
    (``None`` too where ``optional``), or the count when it is not one a payload."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise ConfigurationError(f"queue {queue!r}: {what}s must be a sequence of strings, got {keys!r}")
    if len(keys) != n:
        raise ConfigurationError(
            f"queue {queue!r}: {what}s must hold one key a payload ({n}), got {len(keys)}"
        )
    for i, k in enumerate(keys):
        if k is None and optional:
            continue
        if not isinstance(k, str) or not 0 < len(k) <= MAX_DEDUP_KEY_CHARS or "\x00" in k:
            raise ConfigurationError(
                f"queue {queue!r}: {what} #{i} must be a non-empty string of at most "
                f"{MAX_DEDUP_KEY_CHARS} characters without NUL, got {k!r:.80}"
            )
    return list(keys)


def _check_batch_size(n: int) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n > 100_000:
        raise ConfigurationError(f"batch size must be an integer from 1 to 100000, got {n!r}")
    return n


class Queue(abc.ABC):
    """One named queue. Obtain it from :meth:`DbQueue.queue` or :meth:`DbQueue.create_queue`.

    Every method that touches the database takes an optional ``conn``: a connection of the dialect's
    driver, from :meth:`DbQueue.transaction`, whose open transaction the call joins (exactly-once work).
    Without it, each call is its own transaction.
    """

    reclaim_every: float
    """Seconds between the reclaims of expired leases that pops run first (at most this often)."""
    _may: frozenset[str] | None = None
    _waited = False
    """Whether the last pop of this handle waited on the listening connection (a hint, shared by threads)."""
    _one_recheck = False
    """Whether, of the pops of this process waiting on the queue, only one looks again for a push seen in
    progress (the newest that saw one; :meth:`_wait_listening`), the others waiting for a wake: a design
    whose every look while pushes run would otherwise be an empty pop of each waiter."""
    """The actions the connection's role may take on this queue (None: every one, as its owner)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard_methods(cls)

    def __init__(self, db: Database, settings: QueueSettings) -> None:
        self._db = db
        self.settings = settings
        self.name = settings.name
        # One waiting pop of this handle asks whether a push is in progress at a time: the question
        # holds the queue's push lock for an instant, and two at once would each see the other's.
        self._asking = FaceLock()

    def restrict(self, actions: frozenset[str] | None) -> None:
        """Let this handle take only ``actions`` (None: every action), as the role may."""
        self._may = actions

    def require(self, action: str) -> None:
        """Raise :class:`PermissionDeniedError` unless the connection's role may take ``action`` on
        this queue (see :data:`~airflow_dbqueue.engine.access.NEEDED_BY`); nothing is sent."""
        if self._may is not None and action not in self._may:
            raise PermissionDeniedError(
                f"queue {self.name!r}: the connection's role may not {action} here (it may "
                f"{', '.join(sorted(self._may)) or 'nothing'}); the schema's owner grants actions with "
                "DbQueue.grant",
                queue=self.name,
                action=action,
            )

    @property
    def reclaim_every_s(self) -> float:
        """The old name of :attr:`reclaim_every` (deprecated)."""
        warn_renamed(type(self).__name__, "reclaim_every_s", "reclaim_every")
        return self.reclaim_every

    @reclaim_every_s.setter
    def reclaim_every_s(self, value: float) -> None:
        warn_renamed(type(self).__name__, "reclaim_every_s", "reclaim_every")
        self.reclaim_every = value

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._db.schema}.{self.name} ({self.settings.design})>"

    # -- push --------------------------------------------------------------------------------------

    def push(
        self,
        payload: Any,
        *,
        priority: int = 0,
        delay: float = 0.0,
        conn: DbConnection | None = None,
        dedup_key: str | None = None,
        ttl: float | None = None,
        key: str | None = None,
    ) -> int:
        """Push one message and return its id.

        :param dedup_key: a deduplication key (a non-empty string of at most
            :data:`MAX_DEDUP_KEY_CHARS` characters; table design and a ring of the rows layout): when a
            push of the same key into this queue committed within the queue's ``dedup_window``,
            nothing is pushed and that push's id is returned, also when the two pushes race in
            separate transactions (the later one waits for the earlier one's transaction; if that
            rolled back, the later one pushes).
        :param ttl: seconds the message may wait to be popped, from now (table design and a ring of the
            rows layout; default: the queue's ``ttl``); a message not popped by then is never
            delivered, and goes as the queue's ``on_expiry`` says (failed with ``last_error``
            ``"expired"``, or dropped).
        :param key: the message's ordering key, on a queue created with ``ordering="per_key"``: no pop
            or claim hands it out while a message of the same key pushed before it is ready, delayed
            or in flight, so a key's messages are processed one at a time, in push order.
        """
        if dedup_key is None and ttl is None and key is None:
            return self.push_batch([payload], priority=priority, delay=delay, conn=conn)[0]
        ids = self.push_batch(
            [payload],
            priority=priority,
            delay=delay,
            conn=conn,
            dedup_keys=None if dedup_key is None else [dedup_key],
            ttl=ttl,
            keys=None if key is None else [key],
        )
        return ids[0]

    @abc.abstractmethod
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
        """Push many messages in one round trip; return their ids in payload order.

        Every payload is encoded and checked before anything is sent: one bad payload fails the
        whole batch and nothing of it is written.

        :param dedup_keys: one deduplication key a payload (see :meth:`push`); a key repeated within
            the batch pushes its first payload only, and every occurrence gets that message's id.
        :param ttl: the batch's time to live (see :meth:`push`).
        :param keys: one ordering key a payload (``None``: that message has none; see :meth:`push`).
        """

    # -- pop ---------------------------------------------------------------------------------------

    def pop(
        self,
        n: int = 1,
        *,
        semantics: Semantics | str = Semantics.AT_MOST_ONCE,
        visibility_timeout: float | None = None,
        wait: float = 0.0,
        poll_interval: float = 1.0,
        consumer: str | None = None,
        conn: DbConnection | None = None,
        group: str | None = None,
    ) -> list[Message]:
        """Pop up to ``n`` messages; wait up to ``wait`` seconds for at least one.

        :param semantics: ``at-most-once`` (popped means finished), ``at-least-once`` (leased for
            ``visibility_timeout`` seconds until ``ack``/``nack``), or ``exactly-once`` (finished when
            the caller's transaction ``conn`` commits; required).
        :param wait: seconds to wait for a message when the queue is empty; woken by NOTIFY where
            the queue notifies, polling every ``poll_interval`` seconds otherwise (and as a fallback).
        :param group: the consumer group to pop for (a ring's, :meth:`group`); its messages are then
            acked and nacked through ``queue.group(name)``.
        """
        if group is not None:
            return self.group(group).pop(
                n,
                semantics=semantics,
                visibility_timeout=visibility_timeout,
                wait=wait,
                poll_interval=poll_interval,
                consumer=consumer,
                conn=conn,
            )
        sem, n, vt, wait, poll = self._pop_arguments(
            semantics,
            n,
            visibility_timeout=visibility_timeout,
            wait=wait,
            poll_interval=poll_interval,
            conn=conn,
        )
        who = consumer or DEFAULT_CONSUMER
        return self._pop_or_wait(lambda: self._pop_once(n, sem, vt, who, conn), conn, wait=wait, poll=poll)

    def pop_payloads(
        self,
        n: int = 1,
        *,
        semantics: Semantics | str = Semantics.AT_MOST_ONCE,
        wait: float = 0.0,
        poll_interval: float = 1.0,
        conn: DbConnection | None = None,
        group: str | None = None,
    ) -> list[Any]:
        """Pop up to ``n`` messages as :meth:`pop` does and return only their payloads, in the order
        :meth:`pop` returns messages.

        For consumers that need nothing else of a message: on PostgreSQL the database sends one column a
        message and no :class:`Message` is built, which halves the client's instructions a message
        popped at batch 100. A payload carries no receipt, so ``semantics`` is ``at-most-once`` or
        ``exactly-once`` (in the caller's transaction ``conn``); at least once, use :meth:`pop`.
        """
        if group is not None:
            return self.group(group).pop_payloads(
                n, semantics=semantics, wait=wait, poll_interval=poll_interval, conn=conn
            )
        sem, n, _, wait, poll = self._pop_arguments(
            semantics, n, visibility_timeout=None, wait=wait, poll_interval=poll_interval, conn=conn
        )
        if sem is Semantics.AT_LEAST_ONCE:
            raise ConfigurationError(
                f"queue {self.name!r}: pop_payloads returns no receipts to ack, so it pops at most once "
                "or exactly once; pop at least once with pop()"
            )
        return self._pop_or_wait(lambda: self._pop_payloads_once(n, sem, conn), conn, wait=wait, poll=poll)

    def _pop_arguments(
        self,
        semantics: Semantics | str,
        n: int,
        *,
        visibility_timeout: float | None,
        wait: float,
        poll_interval: float,
        conn: DbConnection | None,
    ) -> tuple[Semantics, int, float, float, float]:
        """A pop's arguments checked: (semantics, n, visibility timeout, wait, poll interval), or
        :class:`ConfigurationError` (:class:`TransactionRequiredError` for exactly once without an open
        transaction) before anything is sent."""
        sem = Semantics.parse(semantics)
        n = _check_batch_size(n)
        wait = check_seconds(f"queue {self.name!r}: pop's wait", wait)
        poll_interval = check_seconds(f"queue {self.name!r}: pop's poll_interval", poll_interval)
        if sem is Semantics.EXACTLY_ONCE:
            self._require_transaction(conn)
        vt = self._visibility_timeout(visibility_timeout)
        return sem, n, vt, wait, max(0.01, poll_interval)

    def _visibility_timeout(self, value: float | None) -> float:
        """A pop's or claim's visibility timeout: the queue's setting, or ``value`` checked."""
        if value is None:
            return self.settings.visibility_timeout_s
        return check_seconds(f"queue {self.name!r}: visibility_timeout", value, positive=True)

    def _pop_or_wait(
        self, take: Callable[[], list[_T]], conn: DbConnection | None, *, wait: float, poll: float
    ) -> list[_T]:
        """Call ``take``; when it finds nothing, wait up to ``wait`` seconds for something to take.

        A pop that will wait on the listening connection, on a handle whose last pop waited there,
        registers before its first look instead (:meth:`_pop_waiting` looks at once): a consumer that
        waits pop after pop then looks once a pop where it would look twice."""
        deadline = time.monotonic() + wait
        notified = wait > 0 and self._notified(conn)
        if not (notified and self._waited):
            got = take()
            if got:
                self._waited = False
                self._took(conn)
            if got or wait <= 0:
                return got
        self._waited = notified
        return self._pop_waiting(take, conn, deadline=deadline, poll=poll)

    def _notified(self, conn: DbConnection | None) -> bool:
        """Whether a pop waits on the listening connection (woken by NOTIFY), not by polling alone."""
        return conn is None and self._db.supports_notify and self.settings.notify is not NotifyMode.NEVER

    def _pop_waiting(
        self, take: Callable[[], list[_T]], conn: DbConnection | None, *, deadline: float, poll: float
    ) -> list[_T]:
        """Call ``take`` again until it returns something or ``deadline`` (monotonic) passes: woken by
        NOTIFY where the queue notifies, polling every ``poll`` seconds otherwise."""
        got: list[_T] = []
        if not self._db.supports_notify:
            # No wake-ups on this database (SQL Server): Kejser's advice for a table queue, a short spin, then
            # sleeps that grow up to ``poll``.
            for pause in poll_pauses(poll):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                pause_for(min(pause, left))
                if got := take():
                    break
            return got
        if not self._notified(conn):
            while not got and (left := deadline - time.monotonic()) > 0:
                pause_for(min(poll, left))
                got = take()
            return got
        return self._wait_listening(take, deadline=deadline, poll=poll)

    def _wait_listening(self, take: Callable[[], list[_T]], *, deadline: float, poll: float) -> list[_T]:
        """:meth:`_pop_waiting` on the listening connection: woken by a NOTIFY, or a wake passed on."""
        got: list[_T] = []
        with self._db.listening(self._db.channel(self.settings.queue_id)) as listener:
            # LISTEN is in place before the first check, so a push committed after it wakes us (or
            # another waiter of this queue, which passes the wake on once it took something). Each
            # check first asks whether a push is in progress: one that saw a message ready that a pop
            # has taken since sends no NOTIFY under notify="auto". With none in progress, every push
            # begun before the question is committed and the check sees it; with one, the waiter looks
            # again soon (backing off) rather than leave its message to the poll.
            # With _one_recheck, one waiter of the queue in this process (the newest that saw a push in
            # progress) looks again for it; another that sees one waits for a wake, as it would when no
            # push runs: the recheck's holder takes what that push writes and passes the wake on, and
            # hands a wake on when it leaves holding the recheck (hub.py).
            pause = RECHECK_FIRST
            looks = 0
            rechecking = False
            while True:
                pushing, got = self._look(take)
                looks += 1
                if got or (left := deadline - time.monotonic()) <= 0:
                    break
                if pushing and self._one_recheck and not rechecking:
                    listener.take_recheck()
                    rechecking = True
                elif rechecking and not (pushing and listener.rechecks()):
                    listener.recheck_done()  # no push in progress, or a newer waiter looks for it
                    rechecking = False
                if pushing and (rechecking or not self._one_recheck):
                    listener.wait(min(pause, left))
                    pause = min(2 * pause, poll)
                elif listener.polls:
                    listener.wait(min(poll, left, self._until_due(poll)))
                    pause = RECHECK_FIRST
                else:  # the channel's poller looks every poll and when a delayed message is due
                    listener.wait(left)
                    pause = RECHECK_FIRST
            if rechecking and got:
                listener.recheck_done()  # it passes the wake on; leaving with the recheck hands one on
            if got:
                listener.pass_on()  # more may be ready, and a push into a busy queue sends no NOTIFY
                if looks == 1:
                    self._waited = False  # found at once: the queue is busy, the next pop looks first
        return got

    def _look(self, take: Callable[[], list[_T]]) -> tuple[bool, list[_T]]:
        """One look of a waiting pop: whether a push may be in progress (:meth:`_pushing`), asked
        first, and what ``take`` found. Designs whose question also tells that a pop would find nothing
        override it to skip the pop then."""
        with self._asking:
            pushing = self._pushing()
        return pushing, take()

    def _took(self, conn: DbConnection | None) -> None:
        """After a pop that waited for nothing took messages: hand a wake to one waiting pop of this
        queue in this process, as a waiter that took something does (a push into the queue while the
        messages taken were ready sent no NOTIFY under notify="auto"). Nothing when nobody waits."""
        if self._notified(conn):
            self._db.wake_waiter(self._db.channel(self.settings.queue_id))

    def group(self, name: str | None) -> Queue:
        """Return the handle of this queue's consumer group ``name``, whose pops, acks, nacks, stats and
        failed messages are that group's (``None``: this handle). Consumer groups are the ring
        design's: on other designs any name raises :class:`ConfigurationError`."""
        if name is None:
            return self
        raise ConfigurationError(
            f"queue {self.name!r} is a {self.settings.design} queue: consumer groups need the ring design "
            f"(got group={name!r})"
        )

    def add_group(
        self,
        name: str,
        *,
        start: str = "now",
        on_lag: OnLag | str = OnLag.BLOCK,
        lag_timeout: float = RING_DEFAULT_LAG_TIMEOUT_S,
    ) -> Queue:
        """Add a consumer group (the ring design's; other designs raise :class:`ConfigurationError`)."""
        raise self._no_groups("add_group")

    def groups(self) -> list[GroupInfo]:
        """List the consumer groups (the ring design's; other designs raise :class:`ConfigurationError`)."""
        raise self._no_groups("groups")

    def drop_group(self, name: str, *, missing_ok: bool = False) -> bool:
        """Drop a consumer group (the ring design's; other designs raise :class:`ConfigurationError`)."""
        raise self._no_groups("drop_group")

    def _no_groups(self, call: str) -> ConfigurationError:
        return ConfigurationError(
            f"queue {self.name!r} is a {self.settings.design} queue: consumer groups ({call}) need the "
            "ring design"
        )

    def _pushing(self) -> bool:
        """Whether a push into this queue may be in progress (one that may send no NOTIFY), which a
        waiting pop asks before each look. Designs that can tell override it."""
        return False

    def _until_due(self, default: float) -> float:
        """Seconds until the next delayed message is due (``default`` when none is delayed)."""
        return default

    def _require_transaction(self, conn: DbConnection | None) -> None:
        if conn is None:
            raise TransactionRequiredError(
                "exactly-once pop needs the caller's transaction: pass conn= from DbQueue.transaction()"
            )
        if not self._db.in_transaction(conn):
            raise TransactionRequiredError(
                "exactly-once pop needs an open transaction on conn (use DbQueue.transaction())"
            )

    @abc.abstractmethod
    def _pop_once(
        self, n: int, semantics: Semantics, vt: float, consumer: str, conn: DbConnection | None
    ) -> list[Message]:
        """Claim up to n messages without waiting."""

    def _pop_payloads_once(self, n: int, semantics: Semantics, conn: DbConnection | None) -> list[Any]:
        """The payloads of up to n messages claimed at most once or exactly once, without waiting."""
        return [
            m.payload
            for m in self._pop_once(n, semantics, self.settings.visibility_timeout_s, DEFAULT_CONSUMER, conn)
        ]

    # -- finish ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def ack(self, messages: Sequence[Message], *, conn: DbConnection | None = None) -> int:
        """Finish leased messages. All or nothing: raise :class:`LeaseExpiredError` if any lease is lost."""

    @abc.abstractmethod
    def nack(
        self,
        messages: Sequence[Message],
        *,
        delay: float | None = None,
        error: str | None = None,
        conn: DbConnection | None = None,
    ) -> int:
        """Return leased messages for another try after ``delay`` seconds (default: the queue's backoff).

        A message that has used ``max_attempts`` deliveries goes to the failed state instead.
        All or nothing, like :meth:`ack`.
        """

    @abc.abstractmethod
    def reclaim_expired(self, limit: int = RECLAIM_LIMIT) -> int:
        """Return messages whose lease expired to ready (or failed); return how many moved."""

    def maintain(self, *, limit: int = RECLAIM_LIMIT) -> dict[str, int]:
        """Run this design's upkeep (the maintenance DAG calls it for every queue); return what it did.

        The table design returns expired leases to ready or failed (``{"reclaimed": n}``). A design
        with repairs of its own adds them here: the ring design recovers its gaps (slots whose push
        rolled back after taking a sequence number, or whose consumer died holding one), so maintenance
        runs them without knowing the design. Safe to run while producers and consumers run.
        """
        return {"reclaimed": self.reclaim_expired(limit)}

    # -- inspect and administer --------------------------------------------------------------------

    @abc.abstractmethod
    def peek(self, n: int = 10) -> list[Message]:
        """Return up to n ready messages without claiming them."""

    @abc.abstractmethod
    def count_ready(self, min_priority: int | None = None, cap: int = COUNT_CAP) -> int:
        """Count ready messages (of at least ``min_priority``), stopping at ``cap``."""

    @abc.abstractmethod
    def stats(self, *, exact: bool = False) -> QueueStats:
        """Return the queue's depth by state and the age of its oldest ready message.

        On PostgreSQL a state of more than 50,000 messages is estimated (``extra["estimated"]``
        says so), so that stats of a deep queue answer in milliseconds; ``exact=True`` counts every
        message instead, at the cost of reading them all."""

    @abc.abstractmethod
    def list_failed(self, limit: int = 100, after_id: int = 0) -> list[FailedMessage]:
        """List failed messages by id, ``limit`` at a time after ``after_id``."""

    @abc.abstractmethod
    def requeue_failed(self, ids: Sequence[int] | None = None) -> int:
        """Make failed messages ready again with a fresh attempt count (all when ``ids`` is None)."""

    @abc.abstractmethod
    def delete_failed(self, ids: Sequence[int] | None = None) -> int:
        """Discard failed messages (all when ``ids`` is None); archived when the queue archives."""

    # -- observers and receipts (the Airflow face hands work on between tasks by receipt) ------------

    def readiness(
        self, min_priority: int | None = None, cap: int = COUNT_CAP
    ) -> tuple[int, tuple[int, int] | None]:
        """Return ``(ready, head)``: ready messages (of at least ``min_priority``, counted up to ``cap``)
        and the ``(id, delivery)`` of the message a pop would take first (``None`` when none is ready).

        Observers (a sensor, a trigger) use the head to tell a queue that was consumed (or whose head
        was nacked back) from one that nobody touched. Designs may override this with one statement.
        """
        ready = self.count_ready(min_priority, cap)
        head = self.peek(1)
        return ready, (head[0].receipt if head else None)

    @property
    def channel(self) -> str:
        """The name of this queue's NOTIFY channel: pushes notify it, waiting pops LISTEN on it."""
        return self._db.channel(self.settings.queue_id)

    def _unsupported(self, what: str) -> NotSupportedError:
        """The refusal of ``what``, which this queue's design does not offer (yet)."""
        return NotSupportedError(f"queue {self.name!r}: {self.settings.design} queues do not support {what}")

    def leased(self, receipts: Sequence[tuple[int, int]]) -> list[Message]:
        """Return the messages of ``receipts`` (``(id, delivery)``) whose lease is still held, with payloads.

        A task handed only receipts (a large batch left claimed by another task) reads its batch here;
        receipts whose lease was lost are missing from the result.
        """
        raise self._unsupported("leased()")

    def ack_receipts(self, receipts: Sequence[tuple[int, int]], *, conn: DbConnection | None = None) -> int:
        """:meth:`ack` deliveries known only by their receipts ``(id, delivery)``; all or nothing."""
        return self.ack(self._receipt_messages(receipts), conn=conn)

    def nack_receipts(
        self,
        receipts: Sequence[tuple[int, int]],
        *,
        delay: float | None = None,
        error: str | None = None,
        conn: DbConnection | None = None,
    ) -> int:
        """:meth:`nack` deliveries known only by their receipts ``(id, delivery)``; all or nothing."""
        return self.nack(self._receipt_messages(receipts), delay=delay, error=error, conn=conn)

    # -- batches: claimed together, read elsewhere by id (a Spark job), acked or released whole ------

    def claim_batch(
        self,
        n: int,
        *,
        visibility_timeout: float | None = None,
        consumer: str | None = None,
        conn: DbConnection | None = None,
    ) -> Batch | None:
        """Claim up to ``n`` ready messages at least once, under one lease and a new batch id.

        No payload leaves the database: a reader elsewhere fetches the batch with :meth:`batch_query`.
        Finish it with :meth:`ack_batch` or :meth:`release_batch`; a batch neither acked nor released
        (its claimer died) comes back when its lease expires. Returns None when nothing is ready.
        """
        raise self._unsupported("batches (claim_batch and the rest)")

    def get_batch(self, batch_id: str) -> Batch:
        """Return the batch with this id (any state); raise :class:`BatchNotFoundError` if unknown."""
        raise self._unsupported("batches (claim_batch and the rest)")

    def open_batches(self, limit: int = 100, *, consumer_prefix: str | None = None) -> list[Batch]:
        """Return claimed batches not yet acked or released, oldest first (a claimer may have died);
        with ``consumer_prefix``, only those whose consumer starts with it."""
        raise self._unsupported("batches (claim_batch and the rest)")

    def batch_query(self, batch_id: str) -> str:
        """SQL text (parameters bound) returning the batch's ``ord, id, delivery, payload`` rows,
        ``ord`` numbering them 1..size: for readers that take a query string, such as Spark's JDBC
        source (which can partition its reads on ``ord``)."""
        raise self._unsupported("batches (claim_batch and the rest)")

    def ack_batch(self, batch_id: str, *, conn: DbConnection | None = None) -> int:
        """Finish every message of a claimed batch; all or nothing, like :meth:`ack`.

        Pass the ``conn`` of a transaction that also writes the batch's results, and results and ack
        commit together (exactly once). Acking an acked batch again returns 0; acking a released one,
        or one whose lease was lost, raises and acknowledges nothing.
        """
        raise self._unsupported("batches (claim_batch and the rest)")

    def release_batch(
        self,
        batch_id: str,
        *,
        delay: float | None = None,
        error: str | None = None,
        conn: DbConnection | None = None,
    ) -> int:
        """Give a claimed batch's messages back for another try (:meth:`nack` of those still held).

        Returns how many were released; releasing a finished batch again returns 0.
        """
        raise self._unsupported("batches (claim_batch and the rest)")

    def extend_batch(self, batch_id: str, visibility_timeout: float) -> dt.datetime:
        """Push the lease of a claimed batch out to ``visibility_timeout`` seconds from now; return it.

        Raises :class:`LeaseExpiredError` (changing nothing) when any of its leases was already lost.
        """
        raise self._unsupported("batches (claim_batch and the rest)")

    def _receipt_messages(self, receipts: Sequence[tuple[int, int]]) -> list[Message]:
        out = []
        for r in receipts:
            try:
                mid, delivery = r
            except (TypeError, ValueError):
                raise ConfigurationError(f"a receipt is a pair (id, delivery), got {r!r}") from None
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (mid, delivery)):
                raise ConfigurationError(f"a receipt is a pair of integers (id, delivery), got {r!r}")
            out.append(Message(mid, self.name, None, 0, 0, delivery, _NO_TIME))
        return out


_NO_TIME = dt.datetime.min.replace(tzinfo=dt.UTC)


guard_methods(Queue)
