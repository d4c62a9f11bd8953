"""The asyncio face (``AsyncDbQueue``) beyond the conformance suite, which runs on both faces: exactly
once in the caller's ``AsyncConnection``, hundreds of asyncio consumers waiting on one queue in one
process, and cancellation at each place a call can be cancelled (waiting, a statement in flight, a
statement that finished as the cancel came, a caller's transaction). Every test counts and checksums
what went in and came out, and looks for what a cancelled call could leave behind: a lease, a message
taken but not returned, a transaction left open."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import (
    DatabaseUnavailableError,
    DbQueue,
    GroupNotFoundError,
    NotSupportedError,
    TransactionRequiredError,
)
from airflow_dbqueue.engine.aio import AsyncDbQueue, AsyncQueue
from airflow_dbqueue.engine.dialects.postgres import aio as pg_aio
from tests.helpers import checksum

pytestmark = pytest.mark.integration

DESIGNS = ["table", "ring"]


def run(dbq: DbQueue, body: Callable[[AsyncDbQueue], Awaitable[Any]], **kwargs: Any) -> Any:
    """Run ``body`` with an AsyncDbQueue on ``dbq``'s schema, on an event loop of its own."""

    async def main() -> Any:
        async with AsyncDbQueue(dbq.db.dsn, schema=dbq.schema, **kwargs) as adbq:
            return await body(adbq)

    return asyncio.run(main())


def open_transactions(dbq: DbQueue) -> list[tuple[Any, ...]]:
    """The sessions of this database left in a transaction (the engine's, the listening one, any)."""
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        return c.execute(
            "SELECT pid, application_name, state, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND state IN ('idle in transaction', 'idle in transaction (aborted)', 'active') "
            "AND backend_type = 'client backend'"
        ).fetchall()


def state_of(dbq: DbQueue, name: str) -> tuple[int, int, int]:
    """(ready, in flight, failed) of queue ``name``, counted exactly."""
    s = dbq.queue(name).stats(exact=True)
    return s.ready, s.in_flight, s.failed


@contextlib.contextmanager
def push_lock_held(dbq: DbQueue, name: str) -> Iterator[int]:
    """Hold queue ``name``'s push lock (what drop_queue takes) in a transaction of its own, so that a
    push of the table design waits in its statement until the block ends; yield the holder's pid."""
    queue_id = dbq.queue(name).settings.queue_id
    with psycopg.connect(dbq.db.dsn) as c:
        c.execute(dbq.db.query("drop_queue_lock"), {"queue_id": queue_id})
        try:
            yield c.info.backend_pid
        finally:
            c.rollback()


# -- exactly once in the caller's AsyncConnection ---------------------------------------------------


@pytest.mark.parametrize("design", DESIGNS)
def test_push_and_pop_commit_with_the_callers_async_transaction(dbq: DbQueue, design: str) -> None:
    """Pushes and exactly-once pops in an AsyncConnection's transaction commit with the caller's own
    writes, or roll back with them: what the results table holds is what was taken, once each."""
    pushed = [{"n": i} for i in range(40)]

    async def body(adbq: AsyncDbQueue) -> list[int]:
        q = await adbq.create_queue("orders", design=design)
        async with await psycopg.AsyncConnection.connect(dbq.db.dsn) as conn:
            await conn.execute(
                sql.SQL("CREATE TABLE {}.results (n integer PRIMARY KEY)").format(sql.Identifier(adbq.schema))
            )
            await conn.commit()
            with pytest.raises(RuntimeError):  # a push that rolls back with the caller's work
                async with conn.transaction():
                    await q.push_batch([{"n": -1}], conn=conn)
                    raise RuntimeError("the caller's work failed")
            # A ring's numbers that the rollback left unwritten are given up by the upkeep (pops in a
            # caller's transaction never give up a gap).
            await q.maintain()
            async with conn.transaction():
                await q.push_batch(pushed[:20], conn=conn)
            await q.push_batch(pushed[20:])
            with pytest.raises(TransactionRequiredError):
                await q.pop(1, semantics="exactly-once")
            with pytest.raises(RuntimeError):  # a pop that rolls back: its messages stay
                async with conn.transaction():
                    got = await q.pop(5, semantics="exactly-once", conn=conn)
                    assert len(got) == 5
                    raise RuntimeError("the caller's work failed")
            taken: list[int] = []
            while True:
                async with conn.transaction():
                    got = await q.pop(7, semantics="exactly-once", conn=conn)
                    for m in got:
                        await conn.execute(
                            sql.SQL("INSERT INTO {}.results VALUES (%s)").format(sql.Identifier(adbq.schema)),
                            (m.payload["n"],),
                        )
                if not got:
                    break
                taken += [m.payload["n"] for m in got]
            cur = await conn.execute(
                sql.SQL("SELECT n FROM {}.results ORDER BY n").format(sql.Identifier(adbq.schema))
            )
            written = [r[0] for r in await cur.fetchall()]
            await conn.commit()
        assert sorted(taken) == written
        return written

    written = run(dbq, body)
    assert checksum({"n": n} for n in written) == checksum(pushed)
    assert state_of(dbq, "orders") == (0, 0, 0)


# -- many consumers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("design", DESIGNS)
def test_hundreds_of_asyncio_consumers_wait_on_one_queue(dbq: DbQueue, design: str) -> None:
    """300 consumers of one process wait on one queue (pop(wait=...)) while a producer pushes 3,000
    messages in batches of 1 to 50; each message is taken once, acked, and the consumers end their
    waits when it is drained. One listening connection serves them all, and the pool's 8 connections
    serve their looks."""
    consumers, total = 300, 3000
    pushed = [{"n": i, "pad": "x" * (i % 37)} for i in range(total)]

    async def body(adbq: AsyncDbQueue) -> tuple[list[Any], int]:
        q = await adbq.create_queue("many", design=design, visibility_timeout=120)
        got: list[Any] = []
        done = asyncio.Event()

        async def consume() -> None:
            while not done.is_set():
                msgs = await q.pop(5, semantics="at-least-once", wait=1.0, poll_interval=0.5)
                if msgs:
                    got.extend(m.payload for m in msgs)
                    await q.ack(msgs)
                    if len(got) >= total:
                        done.set()

        tasks = [asyncio.create_task(consume()) for _ in range(consumers)]
        await asyncio.sleep(0.5)  # every consumer waits
        i = 0
        size = 1
        while i < total:
            await q.push_batch(pushed[i : i + size])
            i += size
            size = size % 50 + 1
            await asyncio.sleep(0)
        await asyncio.wait_for(done.wait(), 120)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        pool = await adbq.db.pool()
        return got, pool.get_stats()["pool_max"]

    got, pool_max = run(dbq, body, pool_size=8)
    assert len(got) == total
    assert checksum(got) == checksum(pushed)
    assert pool_max == 8
    assert state_of(dbq, "many") == (0, 0, 0)


# -- cancellation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("design", DESIGNS)
def test_a_cancelled_waiting_pop_leaves_nothing_behind(dbq: DbQueue, design: str) -> None:
    """Pops cancelled in their wait (the timeouts of wait_for and asyncio.timeout, task.cancel()) hold
    nothing: a push after them is taken whole by the next pop, and no session is left in a transaction."""

    async def body(adbq: AsyncDbQueue) -> list[Any]:
        q = await adbq.create_queue("c", design=design)
        for _ in range(3):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(q.pop(semantics="at-least-once", wait=30), 0.2)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await q.pop(semantics="at-least-once", wait=30)
        waiting = [asyncio.create_task(q.pop(semantics="at-least-once", wait=30)) for _ in range(20)]
        await asyncio.sleep(0.3)
        for t in waiting:
            t.cancel()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        await q.push_batch([{"k": i} for i in range(10)])
        got = await q.pop(20, semantics="at-least-once")
        await q.ack(got)
        return [m.payload for m in got]

    got = run(dbq, body)
    assert checksum(got) == checksum({"k": i} for i in range(10))
    assert state_of(dbq, "c") == (0, 0, 0)
    assert open_transactions(dbq) == []


def test_a_push_cancelled_in_its_statement_is_rolled_back(dbq: DbQueue) -> None:
    """A push whose statement waits (the queue's push lock is held) and is cancelled is cancelled on the
    server: nothing of it is written, and its connection goes back to the pool usable."""
    dbq.create_queue("p")

    async def body(adbq: AsyncDbQueue) -> list[Any]:
        q = await adbq.queue("p")
        with push_lock_held(dbq, "p"), pytest.raises(TimeoutError):
            await asyncio.wait_for(q.push_batch([{"lost": i} for i in range(5)]), 0.5)
        ids = await q.push_batch([{"kept": i} for i in range(5)])
        assert len(ids) == 5
        return [m.payload for m in await q.pop(10)]

    got = run(dbq, body, pool_size=1)  # one connection: the next push reuses the cancelled one's
    assert checksum(got) == checksum({"kept": i} for i in range(5))
    assert state_of(dbq, "p") == (0, 0, 0)
    assert open_transactions(dbq) == []


def test_a_connection_ended_during_a_call_raises_and_the_next_call_works(dbq: DbQueue) -> None:
    """The server ends the pooled connection of a push waiting in its statement (pg_terminate_backend):
    the push raises DatabaseUnavailableError and wrote nothing, and the next calls run on a new pool."""
    dbq.create_queue("e")

    async def body(adbq: AsyncDbQueue) -> list[Any]:
        q = await adbq.queue("e")
        with push_lock_held(dbq, "e") as holder:
            push = asyncio.create_task(q.push_batch([{"lost": i} for i in range(5)]))
            deadline = time.monotonic() + 30
            while not (pids := await asyncio.to_thread(blocked_by, dbq, holder)):
                assert not push.done() and time.monotonic() < deadline, "the push never waited for the lock"
                await asyncio.sleep(0.02)
            await asyncio.to_thread(run_sql_on, dbq, "SELECT pg_terminate_backend(%s)", pids[0])
            with pytest.raises(DatabaseUnavailableError, match="terminating connection"):
                await push
        await q.push_batch([{"kept": i} for i in range(5)])
        return [m.payload for m in await q.pop(10)]

    got = run(dbq, body, pool_size=1)
    assert checksum(got) == checksum({"kept": i} for i in range(5))
    assert state_of(dbq, "e") == (0, 0, 0)


def run_sql_on(dbq: DbQueue, statement: str, *args: Any) -> None:
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        c.execute(statement, args)


@pytest.mark.parametrize("design", DESIGNS)
def test_a_pop_cancelled_as_its_statement_returns_gives_its_leases_back(
    dbq: DbQueue, design: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel arrives when the pop's statement has leased messages (too late to cancel it on the
    server): the pop gives them back before it raises, so they are ready again at once, not after their
    visibility timeout, with this delivery counted."""
    execute = pg_aio._execute
    victim: dict[str, asyncio.Task[Any]] = {}

    async def cancelling(conn: Any, statement: Any) -> Any:
        out = await execute(conn, statement)
        task = victim.pop("task", None) if out else None  # the pop's statement that took messages
        if task is not None:
            task.cancel()  # the statement has run: its leases are written
        return out

    monkeypatch.setattr(pg_aio, "_execute", cancelling)

    async def body(adbq: AsyncDbQueue) -> list[Any]:
        q = await adbq.create_queue("l", design=design, visibility_timeout=300)
        await q.push_batch([{"m": i} for i in range(6)])
        pop = asyncio.create_task(q.pop(4, semantics="at-least-once"))
        victim["task"] = pop
        with pytest.raises(asyncio.CancelledError):
            await pop
        assert "task" not in victim  # the cancel came from inside the statement's end
        got = await q.pop(10, semantics="at-least-once")
        await q.ack(got)
        return [(m.payload["m"], m.attempts) for m in got]

    got = run(dbq, body)
    assert checksum({"m": m} for m, _ in got) == checksum({"m": i} for i in range(6))
    assert sorted(a for _, a in got) == [1, 1, 2, 2, 2, 2]  # the cancelled delivery counts
    assert state_of(dbq, "l") == (0, 0, 0)
    assert open_transactions(dbq) == []


def test_a_claim_cancelled_as_its_statement_returns_releases_its_batch(
    dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a pop does: a claim_batch whose statement claimed a batch when the cancel came releases it
    before it raises, so its messages are ready again and the batch is released, not left claimed."""
    execute = pg_aio._execute
    victim: dict[str, asyncio.Task[Any]] = {}

    async def cancelling(conn: Any, statement: Any) -> Any:
        out = await execute(conn, statement)
        task = victim.pop("task", None) if out and b"claim" in statement[0].lower() else None
        if task is not None:
            task.cancel()
        return out

    monkeypatch.setattr(pg_aio, "_execute", cancelling)

    async def body(adbq: AsyncDbQueue) -> tuple[list[Any], list[Any]]:
        q = await adbq.create_queue("b", visibility_timeout=300)
        await q.push_batch([{"b": i} for i in range(4)])
        claim = asyncio.create_task(q.claim_batch(3))
        victim["task"] = claim
        with pytest.raises(asyncio.CancelledError):
            await claim
        assert "task" not in victim
        states = [b.state.value for b in await q.open_batches()]
        return states, [m.payload for m in await q.pop(10)]

    states, got = run(dbq, body)
    assert states == []  # released: no batch is open
    assert checksum(got) == checksum({"b": i} for i in range(4))
    assert state_of(dbq, "b") == (0, 0, 0)


@pytest.mark.parametrize("design", DESIGNS)
def test_cancelled_mid_transaction_rolls_back_pushes_and_pops(dbq: DbQueue, design: str) -> None:
    """A task cancelled inside ``async with dbq.transaction()`` after an exactly-once pop and a push:
    both roll back with the transaction, and its connection goes back to the pool idle."""

    async def body(adbq: AsyncDbQueue) -> list[Any]:
        q = await adbq.create_queue("t", design=design)
        await q.push_batch([{"t": i} for i in range(4)])
        entered = asyncio.Event()

        async def work() -> None:
            async with adbq.transaction() as conn:
                assert len(await q.pop(2, semantics="exactly-once", conn=conn)) == 2
                await q.push({"t": "rolled back"}, conn=conn)
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(work())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        got = await q.pop(10)
        return [m.payload for m in got]

    got = run(dbq, body, pool_size=1)
    assert checksum(got) == checksum({"t": i} for i in range(4))
    assert open_transactions(dbq) == []


HELD_UP_BY = {"table": "meta", "ring": "rings, ring_lanes, ring_groups, ring_slots, ring_leases"}
"""The tables whose lock holds up an exactly-once pop of each design in its statement."""


@pytest.mark.parametrize("design", DESIGNS)
def test_a_pop_in_the_callers_transaction_cancelled_leaves_nothing_behind(dbq: DbQueue, design: str) -> None:
    """An exactly-once pop in the caller's own ``AsyncConnection`` cut short by ``asyncio.timeout`` while
    it waits on an empty queue, and cancelled while its statement waits for a lock in the server: the
    caller's transaction rolls back each time, its connection is idle and usable, no lease and no open
    transaction stays behind, and a pop in its next transaction takes every message."""
    sent = [{"x": i} for i in range(5)]

    async def body(adbq: AsyncDbQueue) -> list[Any]:
        # ring: the slots layout, whose shared tables HELD_UP_BY locks
        q = await adbq.create_queue("x", design=design, **({"layout": "slots"} if design == "ring" else {}))
        async with await psycopg.AsyncConnection.connect(dbq.db.dsn) as conn:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3), conn.transaction():
                    await q.pop(5, semantics="exactly-once", conn=conn, wait=30)
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            await q.push_batch(sent)
            with psycopg.connect(dbq.db.dsn) as locker:
                locker.execute(f"LOCK TABLE {qualified(dbq, HELD_UP_BY[design])} IN ACCESS EXCLUSIVE MODE")

                async def pop_in_transaction() -> None:
                    async with conn.transaction():
                        await q.pop(5, semantics="exactly-once", conn=conn)

                task = asyncio.create_task(pop_in_transaction())
                deadline = time.monotonic() + 30
                while not await asyncio.to_thread(blocked_by, dbq, locker.info.backend_pid):
                    assert not task.done() and time.monotonic() < deadline, (
                        "the pop never waited for the lock"
                    )
                    await asyncio.sleep(0.02)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                locker.rollback()
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            async with conn.transaction():
                got = await q.pop(10, semantics="exactly-once", conn=conn)
        return [m.payload for m in got]

    got = run(dbq, body)
    assert len(got) == 5 and checksum(got) == checksum(sent)
    assert state_of(dbq, "x") == (0, 0, 0)
    assert open_transactions(dbq) == []


def qualified(dbq: DbQueue, tables: str) -> str:
    """``tables`` (comma-separated) in ``dbq``'s schema, quoted."""
    return ", ".join(f'"{dbq.schema}".{t.strip()}' for t in tables.split(","))


def blocked_by(dbq: DbQueue, holder: int) -> list[int]:
    """The pids of the sessions that wait for a lock the backend ``holder`` holds."""
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (holder,)
        ).fetchall()
    return [r[0] for r in rows]


def test_the_sync_face_is_unchanged_beside_the_async_one(dbq: DbQueue) -> None:
    """Messages pushed by one face are popped by the other, through the same schema."""
    q = dbq.create_queue("both", design="ring")
    q.push_batch([{"s": i} for i in range(5)])

    async def body(adbq: AsyncDbQueue) -> list[Any]:
        aq = await adbq.queue("both")
        assert isinstance(aq, AsyncQueue)
        got = [m.payload for m in await aq.pop(5)]
        await aq.push_batch([{"a": i} for i in range(5)])
        return got

    got = run(dbq, body)
    assert checksum(got) == checksum({"s": i} for i in range(5))
    assert checksum(m.payload for m in q.pop(10)) == checksum({"a": i} for i in range(5))


def test_sql_server_has_no_async_face() -> None:
    """On SQL Server AsyncDbQueue refuses at once (constructing it does no I/O), naming what to use."""
    with pytest.raises(NotSupportedError, match=r"needs PostgreSQL.*use DbQueue"):
        AsyncDbQueue("mssql://user:pw@localhost:1433/app?Encrypt=no")


def test_waiting_costs_no_thread(dbq: DbQueue) -> None:
    """200 pops waiting at once run on the event loop's thread alone: the process has no more threads
    while they wait than before they started."""
    import threading

    async def body(adbq: AsyncDbQueue) -> tuple[int, int, float]:
        q = await adbq.create_queue("w")
        await q.push("warm")  # the pool is open
        await q.pop()
        before = threading.active_count()
        tasks = [asyncio.create_task(q.pop(wait=30)) for _ in range(200)]
        await asyncio.sleep(0.5)
        during = threading.active_count()
        started = time.monotonic()
        await q.push_batch(list(range(200)))
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert sorted(m.payload for r in results for m in r) == list(range(200))
        return before, during, time.monotonic() - started

    before, during, _ = run(dbq, body)
    assert during == before


def test_a_waiting_pop_on_a_ring_ordered_per_key_is_woken_by_the_ack_that_frees_its_lane(
    dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the asyncio face: a pop waits while the only lane with messages is held (its poll a minute
    away, nothing pushed); the ack that frees the lane wakes it (its wait ends by a wake, not a
    timeout), and it takes the lane's run in order. readiness counts nothing while the lane is held.
    Counted and checksummed."""
    wakes: list[float] = []
    real_wait = pg_aio.AsyncWaiter.wait

    def counting_wait(waiter: pg_aio.AsyncWaiter, timeout: float) -> bool:
        got = real_wait(waiter, timeout)
        if got:
            wakes.append(time.monotonic())
        return got

    monkeypatch.setattr(pg_aio.AsyncWaiter, "wait", counting_wait)
    sent = ["a1", "a2", "a3"]

    async def body(adbq: AsyncDbQueue) -> tuple[list[Any], int, float]:
        q = await adbq.create_queue(
            "k", design="ring", layout="rows", capacity=64, lanes=4, ordering="per_key"
        )
        await q.push_batch(sent, keys=["a"] * 3)
        first = await q.pop(1, semantics="at-least-once")
        assert await q.readiness() == (0, None)
        task = asyncio.create_task(q.pop(10, semantics="at-least-once", wait=30, poll_interval=60))
        await asyncio.sleep(2.0)  # it has looked, found the lane held, and waits
        assert not task.done()
        before = len(wakes)
        freed = time.monotonic()
        assert await q.ack(first) == 1
        got = await asyncio.wait_for(task, 40)
        took = time.monotonic() - freed
        assert await q.ack(got) == len(got)
        return [m.payload for m in first + got], len(wakes) - before, took

    out, woken, took = run(dbq, body)
    assert out == sent and checksum(out) == checksum(sent)
    assert woken >= 1, "the waiter was not woken: it found the lane at a look of its own"
    assert took < 5.0


@pytest.mark.parametrize("layout", ["slots", "rows"])
def test_a_rings_groups_and_their_batches_on_the_async_face(dbq: DbQueue, layout: str) -> None:
    """On each ring layout, awaited: a group added, listed and popped at least once beside the default
    group; its batches claimed, read by their batch query and leased(), acked in the caller's
    AsyncConnection, released and claimed again; after it is dropped, its handle's ack raises
    GroupNotFoundError. Each group gets every message once (counted and checksummed)."""
    pushed = [{"g": i} for i in range(30)]

    async def body(adbq: AsyncDbQueue) -> dict[str, Any]:
        ring = await adbq.create_queue("fan", design="ring", layout=layout, capacity=64)
        audit = await ring.add_group("audit")
        assert [g.name for g in await ring.groups()] == ["default", "audit"]
        assert await ring.group("audit") is not ring
        await ring.push_batch(pushed[:15])
        await ring.push_batch(pushed[15:])
        got: dict[str, list[Any]] = {"default": [m.payload for m in await ring.pop(40)], "audit": []}
        leased = await ring.pop(5, semantics="at-least-once", group="audit")
        assert await audit.ack(leased) == 5
        got["audit"] += [m.payload for m in leased]
        first = await audit.claim_batch(10, consumer="async-test")
        assert first is not None and first.size == 10
        assert [b.batch_id for b in await audit.open_batches()] == [first.batch_id]
        assert [m.payload for m in await audit.leased(first.receipts)] == pushed[5:15]
        assert await audit.release_batch(first.batch_id, delay=0) == 10
        while batch := await audit.claim_batch(7):
            with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
                rows = c.execute((await audit.batch_query(batch.batch_id)).encode()).fetchall()
            async with adbq.transaction() as conn:
                assert await audit.ack_batch(batch.batch_id, conn=conn) == batch.size
            got["audit"] += [json.loads(bytes(r[3])) for r in rows]
        held = await audit.pop(1, semantics="at-least-once")
        assert held == []
        await ring.push({"g": "late"})
        held = await audit.pop(1, semantics="at-least-once")
        assert await ring.drop_group("audit") is True
        with pytest.raises(GroupNotFoundError, match="'audit'"):
            await audit.ack(held)
        got["default"] += [m.payload for m in await ring.pop(5)]
        return got

    got = run(dbq, body)
    for name in ("default", "audit"):
        want = pushed + ([{"g": "late"}] if name == "default" else [])
        assert len(got[name]) == len(want) and checksum(got[name]) == checksum(want), name


@pytest.mark.parametrize("layout", ["slots", "rows"])
def test_recover_gaps_on_each_ring_layout_on_the_async_face(dbq: DbQueue, layout: str) -> None:
    """On each ring layout, awaited: a push rolled back in the caller's AsyncConnection leaves one number
    (a slot, a row) unwritten between the others. recover_gaps gives it up: the slots layout's wherever
    it is, the rows layout's once it is at the head of its lane (behind a message not taken yet it is in
    nobody's way; a pop stops the lane there). Every message comes out once, in id order (counted and
    checksummed)."""
    sent = [{"g": i} for i in range(8)]

    async def body(adbq: AsyncDbQueue) -> tuple[list[int], list[Any], list[Any], tuple[int, int]]:
        ring = await adbq.create_queue("gappy", design="ring", layout=layout, capacity=64, lanes=4)
        ids = [await ring.push(p) for p in sent[:4]]
        with contextlib.suppress(ZeroDivisionError):
            async with adbq.transaction() as conn:
                await ring.push({"lost": True}, conn=conn)
                1 / 0  # noqa: B018 # rolls the push back
        ids += [await ring.push(p) for p in sent[4:]]
        before = await ring.recover_gaps(wait=5.0)
        first = await ring.pop(100)  # the rows layout: up to the gap
        after = await ring.recover_gaps(wait=5.0)
        rest = await ring.pop(100)
        return ids, first, rest, (before, after)

    ids, first, rest, skipped = run(dbq, body)
    assert skipped == ((1, 0) if layout == "slots" else (0, 1))
    assert len(rest) == (0 if layout == "slots" else 1)
    got = first + rest
    assert sorted(m.id for m in got) == ids
    assert [m.id for m in got] == ids
    assert checksum(m.payload for m in got) == checksum(sent)


def test_groups_and_batches_on_the_async_face(dbq: DbQueue) -> None:
    """A ring's consumer groups each see every message, and a table queue's batches are claimed, acked
    in the caller's AsyncConnection, released and extended, all awaited."""
    pushed = [{"g": i} for i in range(12)]

    async def body(adbq: AsyncDbQueue) -> dict[str, Any]:
        ring = await adbq.create_queue("fan", design="ring", capacity=64)
        audit = await ring.add_group("audit")
        assert [g.name for g in await ring.groups()] == ["default", "audit"]
        await ring.push_batch(pushed)
        default_got = [m.payload for m in await ring.pop(20)]
        leased = await ring.pop(20, semantics="at-least-once", group="audit")
        assert await audit.ack(leased) == len(leased)
        assert await ring.drop_group("audit") is True

        table = await adbq.create_queue("work")
        await table.push_batch(pushed)
        first = await table.claim_batch(5, consumer="async-test")
        second = await table.claim_batch(5)
        assert first is not None and second is not None
        await table.extend_batch(second.batch_id, 60)
        assert await table.release_batch(second.batch_id, delay=0, error="retry later") == 5
        async with adbq.transaction() as conn:
            assert await table.ack_batch(first.batch_id, conn=conn) == 5
        assert "SELECT" in (await table.batch_query(first.batch_id)).upper()
        rest = [m.payload for m in await table.pop(20)]
        done = [m.payload for m in await (await adbq.queue("work")).pop(20)]
        return {"default": default_got, "audit": [m.payload for m in leased], "rest": rest + done}

    got = run(dbq, body)
    assert checksum(got["default"]) == checksum(pushed)
    assert checksum(got["audit"]) == checksum(pushed)
    # 12 pushed, 5 acked in the first batch: the 2 never claimed and the 5 released come back, once each
    assert len(got["rest"]) == 7
    assert len({p["g"] for p in got["rest"]}) == 7 and all(p in pushed for p in got["rest"])
    s = dbq.queue("work").stats(exact=True)
    assert (s.ready, s.in_flight, s.failed) == (0, 0, 0)
