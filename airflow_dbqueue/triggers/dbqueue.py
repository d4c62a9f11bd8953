"""``DbQueueTrigger``: wait, asynchronously, until a queue can pop enough messages."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import inspect
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_dbqueue.engine import ConfigurationError, NotifyMode
from airflow_dbqueue.engine.queue import check_seconds
from airflow_dbqueue.hooks.dbqueue import DbQueueHook, connection_dsn

if TYPE_CHECKING:
    from airflow_dbqueue.engine import Queue


def _open_queue(dsn: str, schema: str, queue_name: str) -> Queue:
    """Load a queue's settings with the sync engine (run in a thread) and close its pool again."""
    from airflow_dbqueue.engine import DbQueue

    dbq = DbQueue(dsn, schema=schema, pool_size=1)
    try:
        return dbq.queue(queue_name)
    finally:
        dbq.close()


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
    """Fire when a queue can pop at least ``min_messages`` (of at least ``min_priority``).

    The trigger only observes: it counts ready messages and never claims one, so running it twice (a
    triggerer restart, two triggerers) loses and duplicates nothing; whoever acts on the event pops.
    It waits on the queue's LISTEN/NOTIFY channel through psycopg's async connection and re-checks
    every ``poll_interval`` seconds as a fallback (delayed messages becoming due, ``notify='never'``
    queues, ``min_messages`` > 1 on ``notify='auto'`` queues, which notify only when they were empty).

    With ``rearm=False`` (the deferrable sensor) it fires once and ends. With ``rearm=True`` (the
    default, for ``AssetWatcher``) it keeps running and fires again only once the queue's head has
    moved (the message a pop would take first is another one, or the same one delivered again after a
    nack) or after the queue fell below ``min_messages``: a queue that nobody consumes fires once, not
    once per poll.

    :param queue_name: the queue to watch.
    :param dbqueue_conn_id: the Airflow connection to its database.
    :param min_messages: fire when at least this many messages are ready.
    :param min_priority: count only messages of at least this priority.
    :param poll_interval: seconds between checks when no NOTIFY arrives.
    :param use_notify: wait on LISTEN/NOTIFY (when the queue notifies); ``False`` polls only.
    :param rearm: keep watching after an event (see above).
    :param dbqueue_schema: schema of the queue tables; overrides the connection extra.

    Any other keyword raises ``ConfigurationError`` naming it (and the nearest argument it may mean),
    rather than being dropped.
    """

    def __init__(
        self,
        *,
        queue_name: str,
        dbqueue_conn_id: str = DbQueueHook.default_conn_name,
        min_messages: int = 1,
        min_priority: int | None = None,
        poll_interval: float = 5.0,
        use_notify: bool = True,
        rearm: bool = True,
        dbqueue_schema: str | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise ConfigurationError(_unknown_arguments(type(self), kwargs))
        super().__init__()
        self.queue_name = queue_name
        self.dbqueue_conn_id = dbqueue_conn_id
        self.min_messages = int(min_messages)
        self.min_priority = None if min_priority is None else int(min_priority)
        self.poll_interval = check_seconds("poll_interval", poll_interval, positive=True)
        self.use_notify = bool(use_notify)
        self.rearm = bool(rearm)
        self.dbqueue_schema = dbqueue_schema
        if self.min_messages < 1:
            raise ConfigurationError(f"min_messages must be >= 1, got {min_messages!r}")

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return the class path and the JSON-typed keyword arguments that rebuild this trigger."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "queue_name": self.queue_name,
                "dbqueue_conn_id": self.dbqueue_conn_id,
                "min_messages": self.min_messages,
                "min_priority": self.min_priority,
                "poll_interval": self.poll_interval,
                "use_notify": self.use_notify,
                "rearm": self.rearm,
                "dbqueue_schema": self.dbqueue_schema,
            },
        )

    def _event(self, ready: int, head: tuple[int, int] | None) -> TriggerEvent:
        return TriggerEvent(
            {
                "status": "success",
                "queue_name": self.queue_name,
                "ready": ready,
                "head": list(head) if head else None,
                "min_messages": self.min_messages,
                "min_priority": self.min_priority,
            }
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Observe the queue until it can pop ``min_messages``; yield an event (again, when rearmed)."""
        import psycopg

        conn = await DbQueueHook.aget_connection(self.dbqueue_conn_id)
        dsn, schema = await asyncio.to_thread(connection_dsn, conn)  # a token login may do I/O
        schema = self.dbqueue_schema or schema
        queue = await asyncio.to_thread(_open_queue, dsn, schema, self.queue_name)
        listen = self.use_notify and queue.settings.notify is not NotifyMode.NEVER
        aconn = await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, application_name="airflow-dbqueue-trigger"
        )
        try:
            if listen:
                # LISTEN before the first check: a push committed after the check wakes us.
                await queue.alisten(aconn)
            last_head: tuple[int, int] | None = None
            while True:
                ready, head = await queue.areadiness(aconn, self.min_priority, cap=self.min_messages)
                if ready < self.min_messages:
                    last_head = None  # drained below the threshold: the next fill fires again
                elif head != last_head:
                    self.log.info("queue %s has %s ready message(s)", self.queue_name, ready)
                    yield self._event(ready, head)
                    if not self.rearm:
                        return
                    last_head = head
                if listen:
                    async for _ in aconn.notifies(timeout=self.poll_interval, stop_after=1):
                        pass
                else:
                    await asyncio.sleep(self.poll_interval)
        finally:
            with contextlib.suppress(Exception):
                await aconn.close()
