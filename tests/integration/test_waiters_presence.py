"""notify="auto" on the table design decides by who waits, not by what the queue holds.

While a process has a pop or an observer waiting on a queue, its listening connection holds the queue's
waiters' lock shared (hub.py); a push with notify="auto" notifies then, even into a queue whose ready
messages another transaction holds, and sends nothing when nobody waits. A waiter that arrives while a
push that decided "nobody waits" is uncommitted still finds its message without its poll, and so does
one whose listening connection was killed and made again (its lock is taken again before it looks).
Every poll here is far longer than the test, so a message found only by a poll shows as a pop that
timed out.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.aio import AsyncDbQueue
from airflow_dbqueue.engine.dialects.postgres import hub
from airflow_dbqueue.engine.queue import Queue
from tests.helpers import checksum, notified_so_far

pytestmark = pytest.mark.integration

POLL_S = 60.0
"""The waiters' poll: far longer than any wait here."""
PROMPT_S = 5.0
"""The most a message may wait for a waiter here (on a loaded machine)."""
ROUNDS = 24


def _until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _waiting(dbq: DbQueue) -> int:
    h = dbq.db._hub  # type: ignore[attr-defined]
    return 0 if h is None else sum(len(w) for w in h._waiters.values())


def _held(dbq: DbQueue, q: Queue) -> bool:
    """Whether the listening connection holds the queue's waiters' lock (on a hub without one: whether
    a pop waits)."""
    h = dbq.db._hub  # type: ignore[attr-defined]
    if h is None:
        return False
    channel = dbq.db.channel(q.settings.queue_id)
    held = getattr(h, "_held", None)
    return channel in held if held is not None else bool(h._waiters.get(channel))


class Popper:
    """One pop of one message that waits, in a thread; its payloads and how long it took."""

    def __init__(self, q: Queue) -> None:
        self.got: list[Any] = []
        self.took = 0.0
        self._q = q
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        self.got.extend(m.payload for m in self._q.pop(1, wait=20, poll_interval=POLL_S))
        self.took = time.monotonic() - start

    def join(self) -> None:
        self._thread.join(30)
        assert not self._thread.is_alive()


def _holding_one_ready(dbq: DbQueue, q: Queue, payload: Any) -> Any:
    """Push ``payload`` and claim it exactly once in a transaction left open (returned): the message is
    still ready to every other session (its claim is uncommitted) and locked, so no pop takes it."""
    q.push(payload)
    cm = dbq.transaction()
    c = cm.__enter__()
    assert [m.payload for m in q.pop(1, semantics="exactly-once", conn=c)] == [payload]
    return cm


def _push_to_a_waiter_past_a_held_message(dbq: DbQueue, q: Queue, meanwhile: Callable[[], None]) -> None:
    """The queue's ready message {"n": 0} held by another transaction's claim (no pop takes it); a pop
    that waits (registered: its listening connection holds the waiters' lock), ``meanwhile`` run, then
    {"n": 1} pushed: the waiter gets it before its poll, and the held message is there once its claim
    rolls back. Each message once."""
    holder = _holding_one_ready(dbq, q, {"n": 0})
    try:
        popper = Popper(q)
        _until(lambda: _waiting(dbq) == 1 and _held(dbq, q))
        meanwhile()
        time.sleep(0.3)  # the waiter has looked (again), and waits
        q.push({"n": 1})
        popper.join()
    finally:
        holder.__exit__(RuntimeError, RuntimeError("roll back"), None)
    assert popper.got == [{"n": 1}]
    assert popper.took < PROMPT_S, f"the pop took {popper.took:.1f}s: the push sent no NOTIFY"
    rest = [m.payload for m in q.pop(10)]
    assert rest == [{"n": 0}]
    assert checksum(popper.got + rest) == checksum([{"n": 0}, {"n": 1}])


def test_a_waiter_is_woken_by_a_push_while_the_queues_ready_message_is_held(default_dbq: DbQueue) -> None:
    """The queue has a ready message that another transaction's claim holds: a waiting pop cannot take
    it, and a push with notify="auto" still wakes the waiter at once (it asks who waits, not whether
    the queue had a ready message). That message goes back when its claim rolls back: nothing lost."""
    _push_to_a_waiter_past_a_held_message(default_dbq, default_dbq.create_queue("held"), lambda: None)


def test_a_push_sends_no_notify_when_nobody_waits(default_dbq: DbQueue) -> None:
    """A LISTEN of the test's own (it holds no waiters' lock) hears nothing of pushes into an empty queue
    nobody waits on; while a pop waits it hears a push; once that waiter left and the lock lingered its
    time, nothing again."""
    q = default_dbq.create_queue("quiet")
    channel = default_dbq.db.channel(q.settings.queue_id)
    sent = [{"n": i} for i in range(6)]
    dsn = default_dbq.db.dsn
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
        q.push(sent[0])  # into an empty queue
        q.push_batch(sent[1:3])
        assert notified_so_far(listener, dsn, channel) == 0, "a push notified though nobody waits"
        popped = [m.payload for m in q.pop(10)]

        popper = Popper(q)
        _until(lambda: _waiting(default_dbq) == 1 and _held(default_dbq, q))
        time.sleep(0.3)
        q.push(sent[3])
        popper.join()
        assert popper.took < PROMPT_S
        assert len(list(listener.notifies(timeout=1.0, stop_after=1))) == 1, "a waiter waited: no NOTIFY"

        _until(lambda: not _held(default_dbq, q), timeout=getattr(hub, "LINGER", 0) + 10)
        q.push_batch(sent[4:])
        assert notified_so_far(listener, dsn, channel) == 0, "the waiter left, a push still notified"
    popped += popper.got + [m.payload for m in q.pop(10)]
    assert len(popped) == len(sent)
    assert checksum(popped) == checksum(sent)


def test_the_wake_race_each_message_without_the_poll(
    default_dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds of a waiter arriving while a push is held uncommitted (the push decided that nobody waits
    and holds the waiters' lock, so the waiter cannot register before the push's rows are committed),
    and of a waiter waiting before a push that is then held open. The queue's one older ready message
    is held by another transaction's claim throughout, so no pop takes it and the queue is never empty.
    Each round's message reaches its waiter long before the poll; every message once."""
    monkeypatch.setattr(hub, "LINGER", 0.0, raising=False)  # each round begins with nobody registered
    q = default_dbq.create_queue("race")
    holder = _holding_one_ready(default_dbq, q, {"held": True})
    got: list[Any] = []
    sent: list[Any] = []
    try:
        for i in range(ROUNDS):
            _until(lambda: not _held(default_dbq, q))
            payload = {"round": i}
            sent.append(payload)
            if i % 2 == 0:  # the waiter arrives while the push is uncommitted
                with default_dbq.transaction() as c:
                    q.push(payload, conn=c)
                    popper = Popper(q)
                    _until(lambda: _waiting(default_dbq) == 1)
                    time.sleep(0.05 + 0.01 * (i % 5))  # it tried the lock, looked, and waits or rechecks
            else:  # the waiter waits first; the push is held open a moment
                popper = Popper(q)
                _until(lambda: _waiting(default_dbq) == 1 and _held(default_dbq, q))
                time.sleep(0.05)
                with default_dbq.transaction() as c:
                    q.push(payload, conn=c)
                    time.sleep(0.05)
            popper.join()
            assert popper.got == [payload], f"round {i}: {popper.got}"
            assert popper.took < PROMPT_S, f"round {i}: the pop took {popper.took:.1f}s"
            got.extend(popper.got)
    finally:
        holder.__exit__(RuntimeError, RuntimeError("roll back"), None)
    got.extend(m.payload for m in q.pop(10))
    sent.append({"held": True})
    assert len(got) == len(sent)
    assert checksum(got) == checksum(sent)


def test_a_waiter_takes_its_lock_again_after_its_listening_connection_is_killed(default_dbq: DbQueue) -> None:
    """The listening connection's lock goes with its session: when it is killed, the connection made
    again takes the lock again before its waiter looks, so a push after that wakes the waiter though
    the queue's ready message is held by another transaction."""
    q = default_dbq.create_queue("killed")

    def kill_the_listening_connection() -> None:
        first = default_dbq.db._hub._conn  # type: ignore[attr-defined]
        with psycopg.connect(default_dbq.db.dsn, autocommit=True) as c:
            killed = c.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'airflow-dbqueue-listen'"
            ).fetchone()
        assert killed == (1,)
        h = default_dbq.db._hub  # type: ignore[attr-defined]
        _until(lambda: h._conn is not None and h._conn is not first and _held(default_dbq, q))

    _push_to_a_waiter_past_a_held_message(default_dbq, q, kill_the_listening_connection)


def test_the_async_face_waiter_and_observer_are_notified_while_the_ready_message_is_held(
    default_dbq: DbQueue,
) -> None:
    """The asyncio face: a waiting pop and an observer (``AsyncQueue.listening``, the trigger's) each
    register on its own listening connection, and a push into a queue whose ready message another
    transaction holds reaches both before any poll."""
    q = default_dbq.create_queue("aio")
    holder = _holding_one_ready(default_dbq, q, {"n": 0})

    async def body(adbq: AsyncDbQueue) -> tuple[list[Any], bool, float]:
        aq = await adbq.queue("aio")
        async with aq.listening() as notes:
            assert not await notes.wait(0.2)
            start = time.monotonic()
            pop = asyncio.create_task(aq.pop(1, wait=20, poll_interval=POLL_S))
            await asyncio.sleep(0.5)  # the pop waits
            await asyncio.to_thread(q.push, {"n": 1})
            messages = await pop
            took = time.monotonic() - start - 0.5
            noted = await notes.wait(PROMPT_S)
        return [m.payload for m in messages], noted, took

    async def main() -> tuple[list[Any], bool, float]:
        async with AsyncDbQueue(default_dbq.db.dsn, schema=default_dbq.schema) as adbq:
            return await body(adbq)

    try:
        got, noted, took = asyncio.run(main())
    finally:
        holder.__exit__(RuntimeError, RuntimeError("roll back"), None)
    assert got == [{"n": 1}]
    assert took < PROMPT_S, f"the async pop took {took:.1f}s"
    assert noted, "the observer heard no NOTIFY"
    rest = [m.payload for m in q.pop(10)]
    assert checksum(got + rest) == checksum([{"n": 0}, {"n": 1}])
