"""DbQueueTriggers on Airflow's shared streams: one database connection serves every trigger on it.

The triggerer routes triggers whose ``shared_stream_key()`` is equal through one
:class:`~airflow.triggers.shared_stream.SharedStreamManager` group. These tests drive Airflow's own
manager the way the triggerer does (subscribe, ``filter_shared_stream``, unsubscribe), on one event
loop, against the real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_dbqueue.engine import DbQueue, QueueNotFoundError
from airflow_dbqueue.triggers.dbqueue import APPLICATION_NAME, DbQueueTrigger
from tests.helpers import checksum

pytestmark = pytest.mark.integration


def stream_connections(dsn: str) -> int:
    """Connections of the triggers' streams open on the server now."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (APPLICATION_NAME,)
        ).fetchone()
    return int(row[0]) if row else 0


async def connections(dsn: str, n: int) -> bool:
    """Whether exactly ``n`` stream connections are open (asked from a thread: psycopg's sync API)."""
    return await asyncio.to_thread(stream_connections, dsn) == n


class Subscribers:
    """Triggers subscribed to Airflow's shared stream manager as the triggerer subscribes them; their
    events and errors by trigger id."""

    def __init__(self, manager: SharedStreamManager) -> None:
        self.manager = manager
        self.events: dict[int, list[dict[str, Any]]] = {}
        self.errors: dict[int, BaseException] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}

    def add(self, trigger_id: int, trigger: DbQueueTrigger) -> None:
        self.events[trigger_id] = []
        self.tasks[trigger_id] = asyncio.create_task(self._run(trigger_id, trigger))

    async def _run(self, trigger_id: int, trigger: DbQueueTrigger) -> None:
        key = trigger.shared_stream_key()
        stream = self.manager.subscribe(trigger_id=trigger_id, trigger=trigger, key=key)
        try:
            async for event in trigger.filter_shared_stream(stream):
                self.events[trigger_id].append(event.payload)
        except Exception as exc:
            self.errors[trigger_id] = exc
        finally:
            await self.manager.unsubscribe(trigger_id, key)

    async def stop(self, trigger_id: int) -> None:
        task = self.tasks[trigger_id]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(what: str, check: Callable[[], bool | Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_one_connection_serves_every_trigger_on_a_connection_and_schema(
    airflow_conn: str, dbq: DbQueue
) -> None:
    """Four triggers on two queues (one of them a sensor's, which fires once) and one on a queue that
    does not exist share one connection: each fires for its own queue only, the missing queue fails its
    trigger alone, and the connection closes when the last trigger leaves."""
    a = dbq.create_queue("a", notify="always")
    b = dbq.create_queue("b", notify="always")
    dsn = dbq.db.dsn
    slow_poll = 60.0  # only a NOTIFY can fire these triggers in time

    async def scenario() -> None:
        subs = Subscribers(SharedStreamManager())
        subs.add(1, DbQueueTrigger(queue_name="a", poll_interval=slow_poll))
        subs.add(2, DbQueueTrigger(queue_name="a", min_messages=2, poll_interval=slow_poll))
        subs.add(3, DbQueueTrigger(queue_name="b", poll_interval=slow_poll, rearm=False))
        subs.add(4, DbQueueTrigger(queue_name="b", min_messages=3, poll_interval=slow_poll))
        subs.add(5, DbQueueTrigger(queue_name="absent", poll_interval=slow_poll))
        await until("the missing queue's trigger to fail", lambda: 5 in subs.errors)
        assert isinstance(subs.errors[5], QueueNotFoundError)
        await asyncio.sleep(0.5)  # every trigger has checked its queue: empty, nothing fired
        assert await asyncio.to_thread(stream_connections, dsn) == 1
        assert all(subs.events[i] == [] for i in (1, 2, 3, 4))

        [ida] = await asyncio.to_thread(a.push_batch, [{"to": "a"}])
        await until("trigger 1's event", lambda: len(subs.events[1]) == 1, timeout=slow_poll / 3)
        assert subs.events[1][0]["head"] == [ida, 0] and subs.events[1][0]["queue_name"] == "a"
        assert subs.events[2] == [] and subs.events[3] == [] and subs.events[4] == []

        idb = await asyncio.to_thread(b.push_batch, [{"to": "b"}, {"to": "b"}, {"to": "b"}])
        await until("b's events", lambda: len(subs.events[3]) == 1 and len(subs.events[4]) == 1, 20)
        assert subs.events[3][0]["head"] == [idb[0], 0] and subs.events[4][0]["ready"] == 3
        await until("the sensor's trigger to end", subs.tasks[3].done)
        assert await asyncio.to_thread(stream_connections, dsn) == 1  # the others go on

        await asyncio.to_thread(a.push_batch, [{"to": "a"}])  # a's head stays: only 2 fires
        await until("trigger 2's event", lambda: len(subs.events[2]) == 1, timeout=slow_poll / 3)
        assert len(subs.events[1]) == 1 and len(subs.events[4]) == 1
        assert not {1, 2, 3, 4} & subs.errors.keys()

        for i in (1, 2, 4):
            await subs.stop(i)
        await until("the stream's connection to close", lambda: connections(dsn, 0))

    asyncio.run(asyncio.wait_for(scenario(), 120))
    got = a.pop(10) + b.pop(10)
    assert checksum(m.payload for m in got) == checksum([{"to": "a"}] * 2 + [{"to": "b"}] * 3)


def test_a_trigger_joining_a_running_stream_checks_at_once(airflow_conn: str, dbq: DbQueue) -> None:
    """A trigger that subscribes while the stream waits (on a long poll) is checked at once, not at the
    stream's next poll: a queue that already holds messages fires for it straight away."""
    q = dbq.create_queue("late")

    async def scenario() -> None:
        subs = Subscribers(SharedStreamManager())
        subs.add(1, DbQueueTrigger(queue_name="late", min_messages=5, poll_interval=300))
        await until("the stream to connect", lambda: connections(dbq.db.dsn, 1))
        await asyncio.sleep(0.3)  # it has checked and waits
        await asyncio.to_thread(q.push_batch, [1, 2])  # a NOTIFY, but trigger 1 wants 5
        subs.add(2, DbQueueTrigger(queue_name="late", poll_interval=300))
        await until("the late trigger's event", lambda: len(subs.events[2]) == 1, timeout=10)
        assert subs.events[1] == []
        for i in (1, 2):
            await subs.stop(i)

    asyncio.run(asyncio.wait_for(scenario(), 60))
