"""The queue operations of :class:`~airflow_dbqueue.hooks.dbqueue.DbQueueHook`, each the engine's: the
schema and its queues, consumer groups, messages, claims (what a task hands to the next through XCom),
inspection and failed-message admin. Every method that names a queue takes ``group=`` too.

Arguments and defaults are the engine's, but one: ``pop`` and ``claim`` lease their messages (at least
once) unless told otherwise, where the engine's pop finishes them (at most once). A task that fails
is retried, and a message it popped must come back to it then (see "Names and defaults" in
docs/concepts.md)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_dbqueue.engine import (
    ConfigurationError,
    FailedMessage,
    GroupInfo,
    GroupNotFoundError,
    Message,
    QueueNotFoundError,
    QueueSettings,
    Semantics,
)
from airflow_dbqueue.engine.models import RING_DEFAULT_LAG_TIMEOUT_S
from airflow_dbqueue.engine.queue import COUNT_CAP, Queue
from airflow_dbqueue.engine.renames import warn_renamed
from airflow_dbqueue.engine.ring import RingQueue
from airflow_dbqueue.engine.ring_rows import RowsRingQueue
from airflow_dbqueue.hooks.claims import (
    XCOM_MAX_MESSAGES,
    check_claimable,
    make_claim,
    message_to_xcom,
    receipt,
)

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue
    from airflow_dbqueue.engine.dialects.base import DbConnection

_SETTINGS_VIEWS: dict[type[Queue], type[Queue]] = {}


def _settings_view(queue: Queue) -> Queue:
    """``queue``, whose attributes also include its settings' (``design``, ``max_attempts``, ...) with a
    :class:`DeprecationWarning`: :meth:`QueueOperations.create_queue` returned the settings before it
    returned the queue, as the engine's does, and code reading them from its result keeps working."""
    design = type(queue)
    view = _SETTINGS_VIEWS.get(design)
    if view is None:

        def __getattr__(self: Queue, name: str) -> Any:
            if name.startswith("_") or name not in QueueSettings.__dataclass_fields__:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            warn_renamed("DbQueueHook.create_queue", f"its result's {name}", f"its result's settings.{name}")
            return getattr(self.settings, name)

        view = type(design.__name__, (design,), {"__getattr__": __getattr__, "__module__": design.__module__})
        _SETTINGS_VIEWS[design] = view
    queue.__class__ = view
    return queue


class QueueOperations:
    """The queue operations of :class:`~airflow_dbqueue.hooks.dbqueue.DbQueueHook` (a mixin of it: the
    hook supplies the engine, :meth:`get_conn`)."""

    if TYPE_CHECKING:

        def get_conn(self) -> DbQueue: ...

    # -- schema and queues -------------------------------------------------------------------------

    def install(self) -> int:
        """Create or migrate the queue schema, idempotently; return its version."""
        return self.get_conn().install()

    def create_queue(self, queue_name: str, *, install: bool = True, **settings: Any) -> Queue:
        """Create a queue (idempotently; installing the schema first by default) and return it, as
        :meth:`DbQueue.create_queue` does (its settings are its ``settings``).

        ``settings`` are those of :meth:`DbQueue.create_queue` (``design``, ``payload_type``,
        ``max_attempts``, ``visibility_timeout``, ``notify``, ``archive``, ...). An existing queue with
        other settings raises ``QueueExistsError``.
        """
        if install:
            self.install()
        return _settings_view(self.get_conn().create_queue(queue_name, **settings))

    def drop_queue(self, queue_name: str, *, missing_ok: bool | None = None) -> bool:
        """Drop a queue with all its messages; return whether it existed. A queue that does not exist
        raises ``QueueNotFoundError`` unless ``missing_ok``, as the engine's ``drop_queue`` does.

        Not given, ``missing_ok`` is still true for a queue that does not exist, with a
        ``DeprecationWarning``: it becomes false, the engine's default, in the next release.
        """
        if missing_ok is not None:
            return self.get_conn().drop_queue(queue_name, missing_ok=missing_ok)
        try:
            return self.get_conn().drop_queue(queue_name)
        except QueueNotFoundError:
            _warn_missing_ok("drop_queue", f"queue {queue_name!r}")
            return False

    def list_queues(self) -> list[QueueSettings]:
        """Return the settings of every queue in the schema."""
        return self.get_conn().list_queues()

    def get_queue(self, queue_name: str, group: str | None = None) -> Queue:
        """Return the engine's queue object (raises ``QueueNotFoundError`` when it does not exist), or
        with ``group`` the handle of that consumer group of a ring (``GroupNotFoundError`` when it has
        none such). Every method below that names a queue takes ``group=`` too."""
        return self.get_conn().queue(queue_name).group(group)

    def add_group(
        self,
        queue_name: str,
        group: str,
        *,
        start: str = "now",
        on_lag: str = "block",
        lag_timeout: float = RING_DEFAULT_LAG_TIMEOUT_S,
    ) -> None:
        """Add a consumer group to a ring (``start``: ``"now"`` or ``"earliest"``; see
        ``RingQueue.add_group``)."""
        self._ring(queue_name).add_group(group, start=start, on_lag=on_lag, lag_timeout=lag_timeout)

    def drop_group(self, queue_name: str, group: str, *, missing_ok: bool | None = None) -> bool:
        """Drop a ring's consumer group; return whether it existed. A group that does not exist raises
        ``GroupNotFoundError`` unless ``missing_ok``, as the engine's ``drop_group`` does.

        Not given, ``missing_ok`` is still true for a group that does not exist, with a
        ``DeprecationWarning``: it becomes false, the engine's default, in the next release.
        """
        ring = self._ring(queue_name)
        if missing_ok is not None:
            return ring.drop_group(group, missing_ok=missing_ok)
        try:
            return ring.drop_group(group)
        except GroupNotFoundError:
            _warn_missing_ok("drop_group", f"group {group!r} of queue {queue_name!r}")
            return False

    def groups(self, queue_name: str) -> list[GroupInfo]:
        """List a ring's consumer groups, the default one first."""
        return self._ring(queue_name).groups()

    def _ring(self, queue_name: str) -> RingQueue | RowsRingQueue:
        """A ring of either layout; a table queue raises, naming its design."""
        queue = self.get_queue(queue_name)
        if not isinstance(queue, (RingQueue, RowsRingQueue)):
            raise ConfigurationError(
                f"queue {queue_name!r} is a {queue.settings.design} queue: "
                "consumer groups need the ring design"
            )
        return queue

    # -- messages ----------------------------------------------------------------------------------

    def push(
        self,
        queue_name: str,
        payloads: Iterable[Any],
        *,
        priority: int = 0,
        delay: float = 0.0,
        conn: DbConnection | None = None,
        dedup_keys: Sequence[str] | None = None,
        ttl: float | None = None,
        keys: Sequence[str | None] | None = None,
    ) -> list[int]:
        """Push a batch in one statement (all or nothing); return the ids in payload order.

        ``dedup_keys``, ``ttl`` and ``keys`` (ordering keys) are :meth:`Queue.push_batch`'s.
        """
        return self.get_queue(queue_name).push_batch(
            payloads, priority=priority, delay=delay, conn=conn, dedup_keys=dedup_keys, ttl=ttl, keys=keys
        )

    def pop(
        self,
        queue_name: str,
        n: int = 1,
        *,
        semantics: Semantics | str = Semantics.AT_LEAST_ONCE,
        visibility_timeout: float | None = None,
        wait: float = 0.0,
        consumer: str | None = None,
        conn: DbConnection | None = None,
        group: str | None = None,
    ) -> list[Message]:
        """Pop up to ``n`` messages (leased by default: at-least-once). See :meth:`Queue.pop`."""
        return self.get_queue(queue_name, group).pop(
            n,
            semantics=semantics,
            visibility_timeout=visibility_timeout,
            wait=wait,
            consumer=consumer,
            conn=conn,
        )

    def ack(
        self,
        queue_name: str,
        messages: Sequence[Message],
        *,
        conn: DbConnection | None = None,
        group: str | None = None,
    ) -> int:
        """Finish leased messages; all or nothing (``LeaseExpiredError`` if a lease was lost)."""
        return self.get_queue(queue_name, group).ack(messages, conn=conn)

    def nack(
        self,
        queue_name: str,
        messages: Sequence[Message],
        *,
        delay: float | None = None,
        error: str | None = None,
        group: str | None = None,
    ) -> int:
        """Return leased messages for another try (or to the failed state after ``max_attempts``)."""
        return self.get_queue(queue_name, group).nack(messages, delay=delay, error=error)

    def ack_receipts(
        self, queue_name: str, receipts: Sequence[Sequence[int]], *, group: str | None = None
    ) -> int:
        """Finish deliveries known by their receipts ``[id, delivery]`` (e.g. from XCom)."""
        return self.get_queue(queue_name, group).ack_receipts([receipt(r) for r in receipts])

    def nack_receipts(
        self,
        queue_name: str,
        receipts: Sequence[Sequence[int]],
        *,
        delay: float | None = None,
        error: str | None = None,
        group: str | None = None,
    ) -> int:
        """Release deliveries known by their receipts ``[id, delivery]`` for another try."""
        return self.get_queue(queue_name, group).nack_receipts(
            [receipt(r) for r in receipts], delay=delay, error=error
        )

    def leased(
        self, queue_name: str, receipts: Sequence[Sequence[int]], *, group: str | None = None
    ) -> list[Message]:
        """Return the still-leased messages of ``receipts``, with payloads."""
        return self.get_queue(queue_name, group).leased([receipt(r) for r in receipts])

    # -- claims: what the pop operator and the claiming sensor hand to the next task ---------------

    def claim(
        self,
        queue_name: str,
        n: int,
        *,
        semantics: Semantics | str = Semantics.AT_LEAST_ONCE,
        visibility_timeout: float | None = None,
        wait: float = 0.0,
        xcom_max_messages: int = XCOM_MAX_MESSAGES,
        consumer: str | None = None,
        group: str | None = None,
    ) -> dict[str, Any]:
        """Pop up to ``n`` messages and describe them as a JSON-safe *claim* for XCom.

        A claim is ``{"queue_name", "semantics", "count", "receipts", "messages"}``, and ``"group"``
        when popped for a consumer group of a ring (whose receipts are that group's). ``receipts`` are
        ``[id, delivery]`` pairs of leased messages (at-least-once; empty for at-most-once).
        ``messages`` holds the messages with their payloads when there are at most
        ``xcom_max_messages`` of them; a larger leased batch stays claimed in the database and
        ``messages`` is ``None``: the next task reads it with :meth:`claimed_messages`. At-most-once
        pops finish the messages, so their payloads must fit in XCom: more than ``xcom_max_messages``
        is refused before anything is popped.
        """
        sem = Semantics.parse(semantics)
        check_claimable(sem, n, xcom_max_messages)
        queue = self.get_queue(queue_name, group)
        msgs = queue.pop(
            n, semantics=sem, visibility_timeout=visibility_timeout, wait=wait, consumer=consumer
        )
        return make_claim(
            queue_name,
            sem,
            msgs,
            queue.settings.payload_type,
            xcom_max_messages=xcom_max_messages,
            group=group,
        )

    def claimed_messages(self, claim: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Return the messages of a claim as JSON-safe dicts, reading them from the database if needed.

        Messages whose lease was lost since the claim are left out (they will be delivered again).
        """
        if claim.get("messages") is not None:
            return list(claim["messages"])
        queue = self.get_queue(claim["queue_name"], claim.get("group"))
        msgs = queue.leased([receipt(r) for r in claim.get("receipts") or []])
        return [message_to_xcom(m, queue.settings.payload_type) for m in msgs]

    def ack_claim(self, claim: Mapping[str, Any]) -> int:
        """Finish every leased message of a claim; all or nothing. A no-op for at-most-once claims."""
        receipts = claim.get("receipts") or []
        return self.ack_receipts(claim["queue_name"], receipts, group=claim.get("group")) if receipts else 0

    def nack_claim(
        self, claim: Mapping[str, Any], *, delay: float | None = None, error: str | None = None
    ) -> int:
        """Release every leased message of a claim for another try."""
        receipts = claim.get("receipts") or []
        if not receipts:
            return 0
        return self.nack_receipts(
            claim["queue_name"], receipts, delay=delay, error=error, group=claim.get("group")
        )

    # -- inspection and failed-message admin -------------------------------------------------------

    def stats(self, queue_name: str, *, group: str | None = None) -> dict[str, Any]:
        """Return the queue's depth by state as a JSON-safe dict."""
        return self.get_queue(queue_name, group).stats().as_dict()

    def peek(self, queue_name: str, n: int = 10, *, group: str | None = None) -> list[Message]:
        """Return up to ``n`` ready messages without claiming them."""
        return self.get_queue(queue_name, group).peek(n)

    def count_ready(
        self,
        queue_name: str,
        min_priority: int | None = None,
        cap: int = COUNT_CAP,
        *,
        group: str | None = None,
    ) -> int:
        """Count ready messages of at least ``min_priority``, stopping at ``cap``."""
        return self.get_queue(queue_name, group).count_ready(min_priority, cap)

    def list_failed(
        self, queue_name: str, limit: int = 100, after_id: int = 0, *, group: str | None = None
    ) -> list[FailedMessage]:
        """List failed (dead-letter) messages by id."""
        return self.get_queue(queue_name, group).list_failed(limit, after_id)

    def requeue_failed(
        self, queue_name: str, ids: Sequence[int] | None = None, *, group: str | None = None
    ) -> int:
        """Make failed messages ready again (all when ``ids`` is None)."""
        return self.get_queue(queue_name, group).requeue_failed(ids)

    def delete_failed(
        self, queue_name: str, ids: Sequence[int] | None = None, *, group: str | None = None
    ) -> int:
        """Discard failed messages (all when ``ids`` is None)."""
        return self.get_queue(queue_name, group).delete_failed(ids)

    def reclaim_expired(self, queue_name: str, *, group: str | None = None) -> int:
        """Return expired leases to ready (or failed); return how many moved."""
        return self.get_queue(queue_name, group).reclaim_expired()


def _warn_missing_ok(call: str, what: str) -> None:
    """Warn that ``call`` dropped nothing (``what`` does not exist) by the hook's old default."""
    warnings.warn(
        f"DbQueueHook.{call}: {what} does not exist, and missing_ok was not given: it returns False now, "
        "but missing_ok defaults to False in the next release, as in the engine, and this raises; "
        "pass missing_ok=True to keep it",
        DeprecationWarning,
        stacklevel=3,
    )
