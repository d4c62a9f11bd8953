"""``DbQueueTrigger``: wait, asynchronously, until a queue can pop enough messages.

In the triggerer, every DbQueueTrigger on one Airflow connection and queue schema shares one stream
(Airflow's shared streams, ``shared_stream_key``): a single PostgreSQL connection LISTENs on the
channels of every queue watched there and runs each trigger's readiness check, at the trigger's own
pace or when its queue notifies, and each trigger decides from its own results whether to fire. Run
alone (``run()``), a trigger has a stream of its own. The stream is
:mod:`airflow_dbqueue.triggers.stream`; when a trigger fires, :mod:`airflow_dbqueue.triggers.firing`.
"""

from __future__ import annotations

import difflib
import inspect
import time
from collections.abc import AsyncIterator, Hashable
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_dbqueue.engine import ConfigurationError
from airflow_dbqueue.engine.queue import check_seconds
from airflow_dbqueue.hooks.dbqueue import DbQueueHook
from airflow_dbqueue.triggers.firing import Firing
from airflow_dbqueue.triggers.stream import APPLICATION_NAME, Stream, Watch, drop_shared, shared, stream_key

__all__ = ["APPLICATION_NAME", "POLL_INTERVAL_S", "DbQueueTrigger"]

POLL_INTERVAL_S = 5.0
"""Seconds between a trigger's readiness checks when no NOTIFY wakes it, unless it names another number."""


def _unknown_arguments(cls: type, given: dict[str, Any]) -> str:
    """The error for keyword arguments ``cls`` does not take, with the nearest names it does."""
    known = [
        name
        for name, p in inspect.signature(cls).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    parts = []
    for name in sorted(given):
        near = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return (
        f"{cls.__name__} got unknown argument(s) {', '.join(parts)}; it takes {', '.join(known)} "
        "(MessageQueueTrigger(scheme='dbqueue', ...) passes its other keywords on to it)"
    )


class DbQueueTrigger(BaseEventTrigger):  # type: ignore[misc]
    """Fire when a queue can pop at least ``batch_size`` messages (of at least ``min_priority``), or at
    least ``min_messages`` of them have waited ``max_wait`` seconds.

    The trigger only observes: it counts what a pop could take (ready messages, and expired leases
    with attempts left, which a pop reclaims first) and never claims one, so running it twice (a
    triggerer restart, two triggerers) loses and duplicates nothing; whoever acts on the event pops.
    It waits on the queue's LISTEN/NOTIFY channel and re-checks every ``poll_interval`` seconds as a
    fallback (delayed messages becoming due, leases running out, ``notify='never'`` queues, more than
    one message wanted on ``notify='auto'`` queues, which notify only when they were empty). In the
    triggerer, the triggers on one connection and queue schema share one database connection.

    With ``rearm=False`` (the deferrable sensor) it fires once and ends. With ``rearm=True`` (the
    default, for ``AssetWatcher``) it keeps running and fires again once the queue's head has moved
    (the message a pop would take first is another one, or the same one delivered again after a nack
    or an expired lease) or after the queue fell below ``min_messages``: a queue that nobody consumes
    fires once, not once per poll. A watcher keeps the head it last fired for in Airflow's asset state
    store, so a restarted triggerer does not fire again for a queue that has not changed.

    ``max_wait`` bounds how long ready messages wait for an event: with ``batch_size`` above
    ``min_messages``, a smaller batch fires once it has waited that long (the batching of
    ``MessageQueueTrigger``'s ``batch_size``), and a queue whose head has not moved for ``max_wait``
    seconds since the last event fires again, so that a triggered run that failed before it took
    anything does not leave the queue stalled. Set it above the time a run takes to claim its batch.

    :param queue_name: the queue to watch.
    :param group: the consumer group of a ring whose messages count (default: its default group).
    :param dbqueue_conn_id: the Airflow connection to its database.
    :param min_messages: the fewest ready messages an event is fired for.
    :param min_priority: count only messages of at least this priority.
    :param poll_interval: seconds between checks when no NOTIFY arrives.
    :param use_notify: wait on LISTEN/NOTIFY (when the queue notifies); ``False`` polls only.
    :param rearm: keep watching after an event (see above).
    :param dbqueue_schema: schema of the queue tables; overrides the connection extra.
    :param batch_size: fire at once when this many are ready (at least ``min_messages``; default:
        ``min_messages``).
    :param max_wait: seconds after which at least ``min_messages`` ready messages fire even below
        ``batch_size``, and fire again when the head has not moved since the last event (None: never).
        Checked at each poll, so it fires up to ``poll_interval`` late.

    Any other keyword raises ``ConfigurationError`` naming it (and the nearest argument it may mean),
    rather than being dropped.
    """

    def __init__(
        self,
        *,
        queue_name: str,
        group: str | None = None,
        dbqueue_conn_id: str = DbQueueHook.default_conn_name,
        min_messages: int = 1,
        min_priority: int | None = None,
        poll_interval: float = POLL_INTERVAL_S,
        use_notify: bool = True,
        rearm: bool = True,
        dbqueue_schema: str | None = None,
        batch_size: int | None = None,
        max_wait: float | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise ConfigurationError(_unknown_arguments(type(self), kwargs))
        super().__init__()
        self.queue_name = queue_name
        self.group = group
        self.dbqueue_conn_id = dbqueue_conn_id
        self.min_messages = _count("min_messages", min_messages)
        self.min_priority = None if min_priority is None else int(min_priority)
        self.poll_interval = check_seconds("poll_interval", poll_interval, positive=True)
        self.use_notify = bool(use_notify)
        self.rearm = bool(rearm)
        self.dbqueue_schema = dbqueue_schema
        self.batch_size = None if batch_size is None else _count("batch_size", batch_size)
        if self.batch_size is not None and self.batch_size < self.min_messages:
            raise ConfigurationError(
                f"batch_size ({self.batch_size}) must be at least min_messages ({self.min_messages})"
            )
        self.max_wait = None if max_wait is None else check_seconds("max_wait", max_wait, positive=True)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return the class path and the JSON-typed keyword arguments that rebuild this trigger."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "queue_name": self.queue_name,
                "group": self.group,
                "dbqueue_conn_id": self.dbqueue_conn_id,
                "min_messages": self.min_messages,
                "min_priority": self.min_priority,
                "poll_interval": self.poll_interval,
                "use_notify": self.use_notify,
                "rearm": self.rearm,
                "dbqueue_schema": self.dbqueue_schema,
                "batch_size": self.batch_size,
                "max_wait": self.max_wait,
            },
        )

    # -- the shared stream (Airflow's triggerer) ---------------------------------------------------

    def shared_stream_key(self) -> Hashable:
        """Triggers on one connection and queue schema share one stream (one database connection)."""
        return stream_key(self.dbqueue_conn_id, self.dbqueue_schema)

    @classmethod
    async def open_shared_stream(cls, kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        """Run the stream of a connection and schema: readiness results of every trigger on it."""
        conn_id = kwargs.get("dbqueue_conn_id") or DbQueueHook.default_conn_name
        schema = kwargs.get("dbqueue_schema")
        at, stream = shared(stream_key(conn_id, schema))
        try:
            async for results in stream.run(conn_id, schema):
                yield results
        finally:
            drop_shared(at, stream)

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        """This trigger's events, from the results of its own checks on the shared stream."""
        _, stream = shared(self.shared_stream_key())
        async for event in self._observe(stream, shared_stream):
            yield event

    # -- alone ---------------------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Observe the queue on a stream of its own until it can pop enough; yield an event (again, when
        rearmed)."""
        stream = Stream()
        results = stream.run(self.dbqueue_conn_id, self.dbqueue_schema)
        try:
            async for event in self._observe(stream, results):
                yield event
        finally:
            await results.aclose()

    # -- what both do --------------------------------------------------------------------------------

    async def _observe(self, stream: Stream, results: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        threshold = self.batch_size or self.min_messages
        watch = Watch(
            self.queue_name,
            self.min_priority,
            threshold,
            self.poll_interval,
            self.use_notify,
            group=self.group,
        )
        firing = Firing(self.min_messages, threshold, self.max_wait, await self._stored_head())
        stream.add(watch)
        try:
            async for checked in results:
                got = checked.get(watch.id)
                if got is None:
                    continue
                if isinstance(got, BaseException):
                    raise got
                ready, head = got
                reason = firing.step(ready, head, time.monotonic())
                if reason is not None:
                    self.log.info("queue %s has %s ready message(s) (%s)", self.queue_name, ready, reason)
                    yield self._event(ready, head, reason)
                    if not self.rearm:
                        return
                    await self._store_head(head)
                deadline = firing.deadline()
                if deadline is not None and deadline < watch.due:
                    watch.due = deadline
                    stream.wake()
        finally:
            stream.remove(watch)

    def _event(self, ready: int, head: tuple[int, int] | None, reason: str) -> TriggerEvent:
        event: dict[str, Any] = {
            "status": "success",
            "queue_name": self.queue_name,
            "ready": ready,
            "head": list(head) if head else None,
            "min_messages": self.min_messages,
            "min_priority": self.min_priority,
            "reason": reason,
        }
        if self.group is not None:
            event["group"] = self.group
        return TriggerEvent(event)

    # -- the asset state store (watchers) ------------------------------------------------------------

    def _state_key(self) -> str:
        schema = self.dbqueue_schema or ""
        where = f"{self.dbqueue_conn_id}:{schema}:{self.queue_name}:{self.min_priority}"
        if self.group is not None:  # a group's head is its own; the default group keeps the key it had
            where += f":{self.group}"
        return f"airflow_dbqueue.last_head:{where}"

    async def _stored_head(self) -> tuple[int, int] | None:
        """The head this watcher last fired for, from the asset state store (None when there is none:
        not a watcher, nothing stored, or a store that cannot be read)."""
        store = getattr(self, "asset_state_store", None)
        if store is None or not self.rearm:
            return None
        try:
            value = await store.aget(self._state_key())
        except Exception as exc:  # several assets on one trigger, or the store failing: fire as if new
            self.log.warning("queue %s: no last head from the asset state store: %s", self.queue_name, exc)
            return None
        if (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            return int(value[0]), int(value[1])
        return None

    async def _store_head(self, head: tuple[int, int] | None) -> None:
        store = getattr(self, "asset_state_store", None)
        if store is None or head is None:
            return
        try:
            await store.aset(self._state_key(), list(head))
        except Exception as exc:  # the event is out already; a restart may fire it once more
            self.log.warning("queue %s: could not keep the last head: %s", self.queue_name, exc)


def _count(name: str, value: object) -> int:
    """A number of messages, at least 1, or ConfigurationError naming ``name``."""
    try:
        n: int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name} must be a whole number >= 1, got {value!r}") from None
    if n < 1:
        raise ConfigurationError(f"{name} must be >= 1, got {value!r}")
    return n
