"""Crashes: consumers killed while they hold leases, and the PostgreSQL server killed under load.

What a commit promises: a push that returned its ids is in the queue, whatever crashes next; a
message popped at most once never comes back; a lease held by a dead consumer expires and its
messages are delivered again, to someone else, exactly once more. A call that raised has an
unknown outcome: it may or may not have happened, but never twice and never by halves.

The consumer tests run on PostgreSQL, and on SQL Server when ``$DBQUEUE_TEST_MSSQL_DSN`` names one
(skipped otherwise): their children get the dialect, and the finished rows are read with SQL valid on
both (``tests/dialects.py``). The consumers killed while they hold leases, and those killed in the middle
of a statement, run on either face (``DbQueue``, ``AsyncDbQueue``: PostgreSQL's). The server test kills
the embedded PostgreSQL server, so it is PostgreSQL's by nature.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue.engine import (
    DatabaseUnavailableError,
    DbQueue,
    LeaseExpiredError,
    TransientDatabaseError,
)
from airflow_dbqueue.engine.aio import AsyncDbQueue
from tests.dialects import dialect_dbq, run_sql  # noqa: F401 - dialect_dbq is the fixture "dbq"
from tests.faces import FACES
from tests.helpers import checksum, child_processes, drained, payload_hash

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerProcess
    from multiprocessing.synchronize import Event

    from airflow_dbqueue.engine import Message, Queue
    from airflow_dbqueue.engine.embedded import EmbeddedPostgres

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_LIMIT_S = 150.0
"""Upper bound of one test's traffic: a hang fails the test instead of waiting for pytest-timeout."""


def payload_key(payload: dict[str, Any]) -> tuple[Any, ...]:
    """The unique identity every test payload carries: (queue, producer, seq)."""
    return (payload.get("q"), payload["p"], payload["s"])


def _done_rows(dbq: DbQueue, queue_id: int) -> list[tuple[int, int, int, Any]]:
    """``(id, attempts, outcome, payload)`` of every finished message of a queue (it archives)."""
    rows = run_sql(
        dbq,
        "SELECT d.id, d.attempts, d.outcome, coalesce(d.payload, x.payload) "
        "FROM {schema}.done d LEFT JOIN {schema}.data x ON x.id = d.id WHERE d.queue_id = %(queue_id)s",
        {"queue_id": queue_id},
    )
    return [(r[0], r[1], r[2], json.loads(bytes(r[3]))) for r in rows]


def _meta_count(dbq: DbQueue, queue_id: int) -> int:
    rows = run_sql(
        dbq, "SELECT count(*) FROM {schema}.meta WHERE queue_id = %(queue_id)s", {"queue_id": queue_id}
    )
    return int(rows[0][0])


def _stop(procs: list[ForkServerProcess]) -> None:
    """Kill the children this test started that are still alive."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


# -- 1. a consumer killed while it holds leases ----------------------------------------------------


def _hold_leases(
    *,
    dsn: str,
    schema: str,
    dialect: str,
    queue: str,
    n: int,
    visibility_timeout: float,
    report: mp.Queue[Any],
    face: str = "sync",
) -> None:
    """Pop ``n`` messages under at-least-once, report them, and sleep until killed."""

    async def hold_async() -> None:
        async with AsyncDbQueue(dsn, schema=schema, pool_size=1) as adbq:
            q = await adbq.queue(queue)
            msgs = await q.pop(n, semantics="at-least-once", visibility_timeout=visibility_timeout)
            report.put(("held", msgs))
            await asyncio.sleep(300)

    try:
        if face == "async":
            asyncio.run(hold_async())
        else:
            with DbQueue(dsn, schema=schema, pool_size=1, dialect=dialect) as dbq:
                msgs = dbq.queue(queue).pop(
                    n, semantics="at-least-once", visibility_timeout=visibility_timeout
                )
                report.put(("held", msgs))
                time.sleep(300)
        report.put(("error", "the lease holder was not killed"))
    except BaseException:
        report.put(("error", traceback.format_exc()))


def _only_postgresql_has_the_async_face(dbq: DbQueue, face: str) -> None:
    if face == "async" and dbq.dialect != "postgresql":
        pytest.skip(
            "the asyncio face is PostgreSQL's (test_async_face.py: test_sql_server_has_no_async_face)"
        )


@pytest.mark.parametrize("face", FACES)
def test_sigkilled_consumer_leases_are_delivered_again_once(dbq: DbQueue, face: str) -> None:
    _only_postgresql_has_the_async_face(dbq, face)
    total, hold = 1000, 300
    q = dbq.create_queue("leases", visibility_timeout=2.0, max_attempts=5)
    sent = [{"p": 0, "s": i, "v": os.urandom(8).hex()} for i in range(total)]
    ids: list[int] = []
    for first in range(0, total, 250):
        ids += q.push_batch(sent[first : first + 250])
    by_id = dict(zip(ids, sent, strict=True))
    assert len(by_id) == total

    ctx = child_processes()
    report: mp.Queue[Any] = ctx.Queue()
    child = ctx.Process(
        target=_hold_leases,
        kwargs={
            "dsn": dbq.db.dsn,
            "schema": dbq.schema,
            "dialect": dbq.dialect,
            "queue": q.name,
            "n": hold,
            "visibility_timeout": 2.0,
            "report": report,
            "face": face,
        },
        name="lease-holder",
    )
    child.start()
    try:
        kind, held = report.get(timeout=120)
        assert kind == "held", held
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(timeout=30)
        assert child.exitcode == -signal.SIGKILL
    finally:
        _stop([child])
        report.close()

    held_ids = {m.id for m in held}
    assert len(held) == hold and len(held_ids) == hold
    assert all(m.attempts == 1 for m in held)
    assert held_ids == set(ids[:hold]), "the oldest messages are popped first"

    # Another consumer drains the queue: first the rest, then - once the dead consumer's leases
    # expire and are reclaimed - the held messages, each once more.
    delivered: list[Message] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        msgs = q.pop(100, semantics="at-least-once", visibility_timeout=60.0)
        if msgs:
            assert q.ack(msgs) == len(msgs)
            delivered += msgs
        elif drained(q):
            break
        else:
            time.sleep(0.1)
    counts = collections.Counter(m.id for m in delivered)
    assert len(delivered) == total, f"{len(delivered)} deliveries for {total} messages"
    assert set(counts) == set(ids) and max(counts.values()) == 1, "a message was lost or came twice"
    assert {m.id for m in delivered if m.attempts == 2} == held_ids
    assert {m.id for m in delivered if m.attempts == 1} == set(ids) - held_ids
    assert all(m.payload == by_id[m.id] for m in delivered), "a redelivered payload changed"
    assert sum(payload_hash(m.payload) for m in delivered) == sum(payload_hash(p) for p in sent)

    # The dead consumer's receipts are stale: acking them now must not finish anything twice.
    with pytest.raises(LeaseExpiredError):
        q.ack(held)
    st = q.stats(exact=True)
    assert (st.ready, st.delayed, st.in_flight, st.failed, st.finished) == (0, 0, 0, 0, total), st
    attempts = {i: a for i, a, _, _ in _done_rows(dbq, q.settings.queue_id)}
    assert attempts == {i: 2 if i in held_ids else 1 for i in ids}


# -- 1a. a consumer killed in the middle of a statement --------------------------------------------

STUCK_VT = 1.0
"""The visibility timeout of the killed consumer's leases: the survivor waits for it to pass."""

RING_TABLES = "rings, ring_lanes, ring_groups, ring_slots, ring_leases, ring_retry, ring_failed"

HELD_UP_BY = {
    ("table", "pop"): "data",  # after its reclaim of expired leases, which reads meta alone
    ("table", "transaction"): "data",
    ("table", "ack"): "done",  # an ack moves its messages there
    ("ring", "pop"): RING_TABLES,
    ("ring", "transaction"): RING_TABLES,
    ("ring", "ack"): RING_TABLES,
}
"""The tables the test locks to hold up a consumer's statement, by design and what it runs."""


def _stuck(
    *, dsn: str, schema: str, queue: str, n: int, at: str, face: str, report: mp.Queue[Any], go: Event
) -> None:
    """Pop ``n`` messages, or ack them, once ``go`` is set, in a statement that the test holds up with a
    lock, until killed: ``pop`` (at least once), ``transaction`` (exactly once, in a transaction of the
    consumer's own connection, an ``AsyncConnection`` on the asyncio face) or ``ack`` (of an at-least-once
    pop made first, whose messages it reports as held)."""

    async def run_async() -> None:
        async with (
            AsyncDbQueue(dsn, schema=schema, pool_size=1) as adbq,
            await psycopg.AsyncConnection.connect(dsn) as conn,
            conn.transaction(),
        ):
            q = await adbq.queue(queue)
            held = (
                await q.pop(n, semantics="at-least-once", visibility_timeout=STUCK_VT) if at == "ack" else []
            )
            report.put(("ready", held))
            await asyncio.to_thread(go.wait, 120)
            if at == "ack":
                await q.ack(held)
            else:
                semantics = "exactly-once" if at == "transaction" else "at-least-once"
                await q.pop(
                    n,
                    semantics=semantics,
                    visibility_timeout=STUCK_VT,
                    conn=conn if at == "transaction" else None,
                )

    try:
        if face == "async":
            asyncio.run(run_async())
        else:
            with (
                DbQueue(dsn, schema=schema, pool_size=1) as dbq,
                psycopg.connect(dsn) as conn,
                conn.transaction(),
            ):
                q = dbq.queue(queue)
                held = q.pop(n, semantics="at-least-once", visibility_timeout=STUCK_VT) if at == "ack" else []
                report.put(("ready", held))
                go.wait(120)
                if at == "ack":
                    q.ack(held)
                else:
                    semantics = "exactly-once" if at == "transaction" else "at-least-once"
                    q.pop(
                        n,
                        semantics=semantics,
                        visibility_timeout=STUCK_VT,
                        conn=conn if at == "transaction" else None,
                    )
        report.put(("error", f"the {at} returned: the lock did not hold it up"))
    except BaseException:
        report.put(("error", traceback.format_exc()))


@pytest.mark.parametrize("at", ["pop", "transaction", "ack"])
@pytest.mark.parametrize("design", ["table", "ring"])
@pytest.mark.parametrize("face", FACES)
def test_a_consumer_sigkilled_in_its_statement_loses_and_doubles_nothing(
    dbq: DbQueue, face: str, design: str, at: str
) -> None:
    """A consumer is SIGKILLed while its pop, its exactly-once pop in its transaction, or its ack waits
    in the server for a lock the test holds; then the lock goes. Its transaction rolls back; a statement
    of its own (autocommit) commits whole or not at all (in the runs so far the table design's pop and
    both designs' acks committed, the ring's pop did not). Either way every message is finished once, by
    the consumer's ack or by a survivor: leases a pop wrote come back after their visibility timeout
    (delivered once more), the transaction's pop leaves the messages as they were, an ack finished all
    or none."""
    if dbq.dialect != "postgresql":
        pytest.skip("held up by LOCK TABLE and seen waiting in pg_stat_activity: PostgreSQL's")
    total = 20
    # ring: the slots layout, whose shared tables HELD_UP_BY locks
    extra: dict[str, Any] = {"design": "ring", "layout": "slots", "capacity": 64} if design == "ring" else {}
    q = dbq.create_queue("stuck", visibility_timeout=60.0, max_attempts=5, **extra)
    sent = [{"p": 0, "s": i, "v": os.urandom(8).hex()} for i in range(total)]
    ids = q.push_batch(sent)
    held = _sigkill_in(dbq, q.name, total, at=at, face=face, tables=HELD_UP_BY[design, at])

    delivered: list[Message] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not drained(q):
        msgs = q.pop(100, semantics="at-least-once")
        if msgs:
            assert q.ack(msgs) == len(msgs)
            delivered += msgs
        else:
            time.sleep(0.1)
    attempts = collections.Counter(m.attempts for m in delivered)
    if at == "pop":  # its lease was written, or not at all; never some of it
        assert attempts in ({1: total}, {2: total}), attempts
    elif at == "transaction":  # rolled back with the consumer's transaction
        assert attempts == {1: total}, attempts
    else:  # the ack finished them all, or none, which come back
        assert len(held) == total and attempts in (collections.Counter(), {2: total}), attempts
    finished = delivered or held  # by the survivor, or by the killed consumer's ack
    assert sorted(m.id for m in finished) == sorted(ids), "a message was lost or finished twice"
    assert checksum(m.payload for m in finished) == checksum(sent)
    st = q.stats(exact=True)
    assert (st.ready, st.in_flight, st.failed) == (0, 0, 0), st
    if design == "table":  # the table design keeps what it finished, once each
        done = _done_rows(dbq, q.settings.queue_id)
        assert sorted(i for i, _, _, _ in done) == sorted(ids) and st.finished == total
        assert checksum(p for _, _, _, p in done) == checksum(sent)


def _sigkill_in(dbq: DbQueue, queue: str, n: int, *, at: str, face: str, tables: str) -> list[Message]:
    """Run :func:`_stuck` in a child; once it is ready, lock ``tables`` and let it go; SIGKILL it once its
    statement waits for the lock, then let the lock go. Return what it held (an ack's pop)."""
    ctx = child_processes()
    report: mp.Queue[Any] = ctx.Queue()
    go = ctx.Event()
    kwargs = {"dsn": dbq.db.dsn, "schema": dbq.schema, "queue": queue, "n": n, "at": at, "face": face}
    child = ctx.Process(target=_stuck, kwargs={**kwargs, "report": report, "go": go}, name=f"stuck-in-{at}")
    locked = ", ".join(f'"{dbq.schema}".{t.strip()}' for t in tables.split(","))
    child.start()
    try:
        kind, held = report.get(timeout=120)
        assert kind == "ready", held
        with psycopg.connect(dbq.db.dsn) as locker:
            locker.execute(f"LOCK TABLE {locked} IN ACCESS EXCLUSIVE MODE")
            go.set()
            deadline = time.monotonic() + 120
            while not _waits_for_a_lock(dbq, locker.info.backend_pid):
                assert report.empty(), report.get()
                assert child.is_alive() and time.monotonic() < deadline, f"the {at} never waited for the lock"
                time.sleep(0.02)
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
            child.join(timeout=30)
            assert child.exitcode == -signal.SIGKILL
            locker.rollback()
    finally:
        _stop([child])
    assert report.empty(), report.get()
    report.close()
    return list(held)


def _waits_for_a_lock(dbq: DbQueue, holder: int) -> bool:
    """Whether a session waits for a lock that ``holder`` (a backend's pid) holds."""
    with psycopg.connect(dbq.db.dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", (holder,)
        ).fetchone()
    return bool(row and row[0])


# -- 1b. continuous traffic, one consumer killed again and again -----------------------------------

TRAFFIC_QUEUE = "traffic"
TRAFFIC_PRODUCERS = 2
TRAFFIC_CONSUMERS = 3  # steady ones, besides the victim
TRAFFIC_PUSH_BATCH = 50
TRAFFIC_POP_BATCH = 50
TRAFFIC_MAX_PER_PRODUCER = 40_000
KILLS = 4
HOLD_VT = 2.0


class _Log:
    """Append-only JSON lines written with one ``write(2)`` each, so a SIGKILL loses no whole line."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, kind: str, rows: Any) -> None:
        os.write(self._fd, (json.dumps([kind, rows]) + "\n").encode())


def _read_log(path: Path, killed: bool) -> list[tuple[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    out = []
    for n, line in enumerate(lines):
        try:
            kind, rows = json.loads(line)
        except ValueError:
            if killed and n == len(lines) - 1:
                continue  # a line cut short by the kill
            raise
        out.append((kind, rows))
    return out


def _rows(msgs: list[Message]) -> list[list[Any]]:
    return [[m.id, m.attempts, m.payload["p"], m.payload["s"], payload_hash(m.payload)] for m in msgs]


def _traffic_producer(
    *, dsn: str, schema: str, dialect: str, idx: int, log_path: str, stop: Event, deadline: float
) -> None:
    log = _Log(Path(log_path))
    try:
        with DbQueue(dsn, schema=schema, pool_size=1, dialect=dialect) as dbq:
            q = dbq.queue(TRAFFIC_QUEUE)
            seq = 0
            while not stop.is_set() and seq < TRAFFIC_MAX_PER_PRODUCER:
                if time.time() > deadline:
                    raise TimeoutError(f"producer {idx} passed the run's deadline")
                payloads = [
                    {"p": idx, "s": s, "v": os.urandom(6).hex()} for s in range(seq, seq + TRAFFIC_PUSH_BATCH)
                ]
                got = q.push_batch(payloads)
                log(
                    "push", [[i, p["p"], p["s"], payload_hash(p)] for i, p in zip(got, payloads, strict=True)]
                )
                seq += TRAFFIC_PUSH_BATCH
                time.sleep(0.005)
        log("end", [])
    except BaseException:
        log("error", traceback.format_exc())


def _traffic_consumer(
    *,
    dsn: str,
    schema: str,
    dialect: str,
    log_path: str,
    producers_done: Event,
    deadline: float,
    hold_after: int | None = None,
    holding: Event | None = None,
) -> None:
    """Pop, log, ack, log - until the producers are done and the queue is drained.

    With ``hold_after``, the consumer is a victim: after that many batches it pops one more under a
    short lease, logs it, signals ``holding`` and sleeps until the test kills it.
    """
    log = _Log(Path(log_path))
    try:
        with DbQueue(dsn, schema=schema, pool_size=1, dialect=dialect) as dbq:
            q = dbq.queue(TRAFFIC_QUEUE)
            batches = 0
            while True:
                if time.time() > deadline:
                    raise TimeoutError("consumer passed the run's deadline")
                if hold_after is not None and batches >= hold_after:
                    assert holding is not None
                    msgs = q.pop(TRAFFIC_POP_BATCH, semantics="at-least-once", visibility_timeout=HOLD_VT)
                    if msgs:
                        log("pop", _rows(msgs))
                        holding.set()
                        time.sleep(300)
                        raise AssertionError("the victim was not killed")
                    time.sleep(0.02)
                    continue
                msgs = q.pop(TRAFFIC_POP_BATCH, semantics="at-least-once")
                if msgs:
                    log("pop", _rows(msgs))
                    q.ack(msgs)
                    log("ack", [m.id for m in msgs])
                    batches += 1
                    continue
                if producers_done.is_set() and drained(q):
                    break
                time.sleep(0.02)
        log("end", [])
    except BaseException:
        log("error", traceback.format_exc())


def _join_all(procs: list[ForkServerProcess], deadline: float) -> None:
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.time()))
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode} (still running: {p.is_alive()})"


def test_consumer_sigkilled_repeatedly_under_traffic(dbq: DbQueue, tmp_path: Path) -> None:  # noqa: PLR0915
    """Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around."""
    q = dbq.create_queue(TRAFFIC_QUEUE, visibility_timeout=60.0, max_attempts=50)
    ctx = child_processes()
    stop_producing, producers_done = ctx.Event(), ctx.Event()
    deadline = time.time() + RUN_LIMIT_S
    common = {"dsn": dbq.db.dsn, "schema": dbq.schema, "dialect": dbq.dialect, "deadline": deadline}

    def consumer(name: str, **kw: Any) -> ForkServerProcess:
        return ctx.Process(
            target=_traffic_consumer,
            kwargs={
                **common,
                "log_path": str(tmp_path / f"{name}.jsonl"),
                "producers_done": producers_done,
                **kw,
            },
            name=name,
        )

    producers = [
        ctx.Process(
            target=_traffic_producer,
            kwargs={
                **common,
                "idx": i,
                "log_path": str(tmp_path / f"producer-{i}.jsonl"),
                "stop": stop_producing,
            },
            name=f"producer-{i}",
        )
        for i in range(TRAFFIC_PRODUCERS)
    ]
    steady = [consumer(f"consumer-{i}") for i in range(TRAFFIC_CONSUMERS)]
    procs: list[ForkServerProcess] = producers + steady
    killed: list[str] = []
    try:
        for p in procs:
            p.start()
        for k in range(KILLS):
            holding = ctx.Event()
            victim = consumer(f"victim-{k}", hold_after=2 + k, holding=holding)
            procs.append(victim)
            victim.start()
            while not holding.wait(timeout=0.5):
                assert victim.is_alive(), f"{victim.name} exited before holding leases"
                assert time.time() < deadline, f"{victim.name} never held leases"
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
            victim.join(timeout=30)
            assert victim.exitcode == -signal.SIGKILL
            killed.append(victim.name)
        last = consumer("victim-final")  # the restarted consumer, this time left alone
        procs.append(last)
        last.start()
        time.sleep(1.0)
        stop_producing.set()
        _join_all(producers, deadline + 10)
        producers_done.set()
        _join_all([*steady, last], deadline + 10)
    finally:
        _stop(procs)

    # What was pushed.
    pushed: dict[int, tuple[int, int, int]] = {}
    for p in producers:
        entries = _read_log(tmp_path / f"{p.name}.jsonl", killed=False)
        assert entries and entries[-1][0] == "end", f"{p.name} did not finish: {entries[-1:]}"
        for kind, rows in entries:
            assert kind in ("push", "end"), (kind, rows)
            for mid, prod, seq, h in rows if kind == "push" else []:
                assert mid not in pushed, f"id {mid} returned to two pushes"
                pushed[mid] = (prod, seq, h)
    assert len(pushed) >= TRAFFIC_PRODUCERS * TRAFFIC_PUSH_BATCH
    assert len({(v[0], v[1]) for v in pushed.values()}) == len(pushed)

    # What was delivered, and what the killed consumers held when they died.
    deliveries: dict[int, list[int]] = collections.defaultdict(list)  # id -> attempts of each delivery
    acks: collections.Counter[int] = collections.Counter()
    holds: collections.Counter[int] = collections.Counter()
    delivered_hash: dict[int, int] = {}
    for p in procs[len(producers) :]:
        was_killed = p.name in killed
        entries = _read_log(tmp_path / f"{p.name}.jsonl", killed=was_killed)
        errors = [rows for kind, rows in entries if kind == "error"]
        assert not errors, f"{p.name} failed:\n{errors[0]}"
        assert was_killed or entries[-1][0] == "end", f"{p.name} did not finish"
        acked_here = {i for kind, rows in entries if kind == "ack" for i in rows}
        held_here = 0
        for kind, rows in entries:
            if kind != "pop":
                continue
            for mid, attempts, prod, seq, h in rows:
                assert pushed.get(mid) == (prod, seq, h), f"message {mid} came back with another payload"
                deliveries[mid].append(attempts)
                delivered_hash[mid] = h
                if was_killed and mid not in acked_here:
                    holds[mid] += 1
                    held_here += 1
        assert held_here > 0 or not was_killed, f"{p.name} was killed without holding leases"
        acks.update(i for kind, rows in entries if kind == "ack" for i in rows)

    assert len(killed) == KILLS
    # Nothing lost: every pushed message was delivered and acked exactly once.
    assert set(deliveries) == set(pushed), "a pushed message was never delivered (or an unknown one was)"
    assert set(acks) == set(pushed) and max(acks.values()) == 1
    # The only duplicates are the killed consumers' leases: one more delivery per lease held at death.
    wrong = {i: (sorted(a), holds[i]) for i, a in deliveries.items() if len(a) != 1 + holds[i]}
    assert not wrong, (
        f"deliveries not explained by the kills (attempts, holds): {dict(list(wrong.items())[:10])}"
    )
    assert all(sorted(a) == list(range(1, len(a) + 1)) for a in deliveries.values())
    assert sum(delivered_hash.values()) == sum(v[2] for v in pushed.values())

    st = q.stats(exact=True)
    assert (st.ready, st.delayed, st.in_flight, st.failed, st.finished) == (0, 0, 0, 0, len(pushed)), st
    done = _done_rows(dbq, q.settings.queue_id)
    assert len(done) == len(pushed)
    assert {i: a for i, a, _, _ in done} == {i: len(a) for i, a in deliveries.items()}


# -- 2. the PostgreSQL server killed under load ----------------------------------------------------

CRASH_SCHEMA = "crash"
CRASH_PUSH_BATCH = 50
CRASH_POP_BATCH = 50
SERVER_KILLS = 3


@dataclass
class ClientLog:
    """What one client thread saw. Only its own thread writes it; the test reads it after join."""

    name: str
    ok_pushes: list[tuple[list[int], list[dict[str, Any]]]] = field(default_factory=list)
    unknown_pushes: list[list[dict[str, Any]]] = field(default_factory=list)
    received: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)  # (id, attempts, payload)
    acked: list[tuple[int, int]] = field(default_factory=list)  # receipts whose ack returned
    unknown_pops: int = 0
    lease_lost: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    unexpected: list[str] = field(default_factory=list)
    ok_generation: int = -1
    """Server generation (restarts so far) when the latest successful call started."""


OUTAGE_ERRORS = (DatabaseUnavailableError, TransientDatabaseError)
"""What a client may meet while the server crashes and restarts: the server unreachable or the connection
broken, or a transaction rolled back by the server. Any other error (a SchemaError, a ConfigurationError,
a DatabaseError) is no outage: it stops the client and fails the test."""


def _client_thread(
    log: ClientLog, q: Queue, step: Callable[[ClientLog, Queue], None], stop: threading.Event, gen: list[int]
) -> None:
    """Run ``step`` until stopped. An outage error is an unknown outcome: note it, pause, go on; anything
    else is recorded as unexpected and ends the client."""
    try:
        while not stop.is_set():
            g = gen[0]
            try:
                step(log, q)
            except OUTAGE_ERRORS as exc:
                log.errors[type(exc).__name__] += 1
                time.sleep(0.2)
                continue
            log.ok_generation = g
    except BaseException:
        log.unexpected.append(traceback.format_exc())


def _producer_step(queue_tag: str, idx: int) -> Callable[[ClientLog, Queue], None]:
    seq = iter(range(10**9))

    def step(log: ClientLog, q: Queue) -> None:
        # Fresh payloads every call: a push whose outcome is unknown is never retried.
        payloads = [
            {"q": queue_tag, "p": idx, "s": next(seq), "v": os.urandom(6).hex()}
            for _ in range(CRASH_PUSH_BATCH)
        ]
        try:
            ids = q.push_batch(payloads)
        except OUTAGE_ERRORS:
            log.unknown_pushes.append(payloads)
            raise
        log.ok_pushes.append((ids, payloads))
        time.sleep(0.01)

    return step


def _pop(log: ClientLog, q: Queue, semantics: str) -> list[Message]:
    """Pop a batch and record it; a pop that raised has an unknown outcome and is counted as such."""
    try:
        msgs = q.pop(CRASH_POP_BATCH, semantics=semantics)
    except OUTAGE_ERRORS:
        log.unknown_pops += 1
        raise
    log.received += [(m.id, m.attempts, m.payload) for m in msgs]
    if not msgs:
        time.sleep(0.02)
    return msgs


def _at_most_once_step(log: ClientLog, q: Queue) -> None:
    _pop(log, q, "at-most-once")


def _at_least_once_step(log: ClientLog, q: Queue) -> None:
    msgs = _pop(log, q, "at-least-once")
    if not msgs:
        return
    try:
        q.ack(msgs)
    except LeaseExpiredError:
        log.lease_lost += 1  # nothing acked; they come again
        return
    log.acked += [m.receipt for m in msgs]


def test_server_sigkill_loses_no_acknowledged_message(embedded_server: EmbeddedPostgres) -> None:  # noqa: PLR0912, PLR0915
    """Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around."""
    dsn = embedded_server.dsn
    with DbQueue(dsn, schema=CRASH_SCHEMA, pool_size=2) as admin:
        admin.install()
        amo_id = admin.create_queue("amo", archive=True).settings.queue_id
        alo_id = admin.create_queue(
            "alo", visibility_timeout=3.0, max_attempts=1000, archive=True
        ).settings.queue_id

    plan: list[tuple[str, str, Callable[[ClientLog, Queue], None]]] = [
        *[(f"amo-producer-{i}", "amo", _producer_step("amo", i)) for i in range(2)],
        *[(f"alo-producer-{i}", "alo", _producer_step("alo", i)) for i in range(2)],
        *[(f"amo-consumer-{i}", "amo", _at_most_once_step) for i in range(2)],
        *[(f"alo-consumer-{i}", "alo", _at_least_once_step) for i in range(2)],
    ]
    stop = threading.Event()
    gen = [0]
    clients: list[DbQueue] = []
    logs: list[ClientLog] = []
    threads: list[threading.Thread] = []
    try:
        for name, queue, step in plan:
            client = DbQueue(dsn, schema=CRASH_SCHEMA, pool_size=2, connect_timeout=2.0)
            clients.append(client)
            log = ClientLog(name)
            logs.append(log)
            threads.append(
                threading.Thread(
                    target=_client_thread, args=(log, client.queue(queue), step, stop, gen), name=name
                )
            )
        for t in threads:
            t.start()

        def wait_all_ok(generation: int, limit: float) -> None:
            end = time.monotonic() + limit
            while any(lg.ok_generation < generation for lg in logs):
                assert time.monotonic() < end, {lg.name: lg.ok_generation for lg in logs}
                assert all(t.is_alive() for t in threads), [lg.unexpected for lg in logs if lg.unexpected]
                time.sleep(0.1)

        wait_all_ok(0, 60)
        for _ in range(SERVER_KILLS):
            time.sleep(2.0)  # traffic, then the crash
            assert embedded_server.postmaster_pid() is not None, "the server is not running"
            embedded_server.kill()  # SIGKILL, as a crash would
            time.sleep(0.5)
            embedded_server.start()
            gen[0] += 1
            # (c) without repair: every client works again against the restarted server.
            wait_all_ok(gen[0], 90)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        for client in clients:
            client.close()
    assert not any(t.is_alive() for t in threads)
    unexpected = [u for lg in logs for u in lg.unexpected]
    assert not unexpected, unexpected[0]
    errors = sum((lg.errors for lg in logs), collections.Counter[str]())
    print(f"outage errors the clients met: {dict(errors)}")
    assert errors["DatabaseUnavailableError"] > 0, f"the clients never noticed the crashes: {errors}"

    by_role: dict[str, list[ClientLog]] = collections.defaultdict(list)
    for lg in logs:
        by_role[lg.name.rsplit("-", 1)[0]].append(lg)

    # A final drain on the restarted server, as any later consumer would.
    with DbQueue(dsn, schema=CRASH_SCHEMA, pool_size=2) as admin:
        amo, alo = admin.queue("amo"), admin.queue("alo")
        drained_amo: list[tuple[int, int, dict[str, Any]]] = []
        while msgs := amo.pop(500, semantics="at-most-once"):
            drained_amo += [(m.id, m.attempts, m.payload) for m in msgs]
        drained_alo: list[tuple[int, int, dict[str, Any]]] = []
        acked_alo: list[tuple[int, int]] = []
        end = time.monotonic() + 60
        while time.monotonic() < end:  # leases taken by pops that raised expire after 3 s
            msgs = alo.pop(500, semantics="at-least-once", visibility_timeout=60.0)
            if msgs:
                alo.ack(msgs)
                drained_alo += [(m.id, m.attempts, m.payload) for m in msgs]
                acked_alo += [m.receipt for m in msgs]
            elif drained(alo):
                break
            else:
                time.sleep(0.2)
        for q in (amo, alo):
            st = q.stats()
            assert (st.ready, st.delayed, st.in_flight, st.failed) == (0, 0, 0, 0), st
        assert _meta_count(admin, amo_id) == 0
        assert _meta_count(admin, alo_id) == 0

        done_amo = _done_rows(admin, amo_id)
        done_alo = _done_rows(admin, alo_id)
        assert amo.stats(exact=True).finished == len(done_amo) and alo.stats(exact=True).finished == len(
            done_alo
        )

        _check_pushes("amo", by_role["amo-producer"], done_amo)
        _check_pushes("alo", by_role["alo-producer"], done_alo)
        _check_at_most_once(by_role["amo-consumer"], drained_amo, by_role["amo-producer"], done_amo)
        _check_at_least_once(
            by_role["alo-consumer"], drained_alo, acked_alo, by_role["alo-producer"], done_alo
        )

        # (c) The queues work on as before: a round trip on each, counted and checksummed.
        for q in (amo, alo):
            sent = [{"p": -1, "s": i, "v": os.urandom(4).hex()} for i in range(100)]
            ids = q.push_batch(sent)
            got = q.pop(200, semantics="at-least-once")
            assert sorted(m.id for m in got) == sorted(ids)
            assert sum(payload_hash(m.payload) for m in got) == sum(payload_hash(p) for p in sent)
            assert q.ack(got) == len(got)
            st = q.stats()
            assert (st.ready, st.delayed, st.in_flight, st.failed) == (0, 0, 0, 0), st


def _check_pushes(tag: str, producers: list[ClientLog], done: list[tuple[int, int, int, Any]]) -> None:
    """Every acknowledged push is finished (after the drain); an unknown one is all there or absent."""
    stored = {i: payload for i, _, _, payload in done}
    assert len(stored) == len(done), f"{tag}: a message finished twice"
    keys = collections.Counter(payload_key(p) for p in stored.values())
    assert not keys or max(keys.values()) == 1, f"{tag}: a payload is stored twice"
    acknowledged: dict[int, dict[str, Any]] = {}
    for lg in producers:
        for ids, payloads in lg.ok_pushes:
            acknowledged.update(zip(ids, payloads, strict=True))
    assert acknowledged, f"{tag}: no push succeeded"
    missing = [i for i in acknowledged if i not in stored]
    assert not missing, f"{tag}: {len(missing)} acknowledged pushes were lost, e.g. {missing[:10]}"
    assert all(stored[i] == p for i, p in acknowledged.items()), f"{tag}: a stored payload changed"
    unknown_keys: set[tuple[Any, ...]] = set()
    for lg in producers:
        for payloads in lg.unknown_pushes:
            present = sum(1 for p in payloads if payload_key(p) in keys)
            assert present in (0, len(payloads)), f"{tag}: a push that raised was half written ({present})"
            unknown_keys |= {payload_key(p) for p in payloads}
    acknowledged_keys = {payload_key(p) for p in acknowledged.values()}
    assert set(keys) <= acknowledged_keys | unknown_keys, f"{tag}: a stored payload nobody pushed"
    assert sum(payload_hash(stored[i]) for i in acknowledged) == sum(
        payload_hash(p) for p in acknowledged.values()
    )


def _check_at_most_once(
    consumers: list[ClientLog],
    drained: list[tuple[int, int, dict[str, Any]]],
    producers: list[ClientLog],
    done: list[tuple[int, int, int, Any]],
) -> None:
    received = [r for lg in consumers for r in lg.received] + drained
    assert received, "no message was received"
    ids = collections.Counter(i for i, _, _ in received)
    dups = [i for i, n in ids.items() if n > 1]
    # (b) popped at most once means never again, even across the server's crashes.
    assert not dups, f"{len(dups)} messages popped at most once were delivered again, e.g. {dups[:10]}"
    keys = collections.Counter(payload_key(p) for _, _, p in received)
    assert max(keys.values()) == 1, "a payload was delivered twice under at-most-once"
    assert all(a == 1 for _, a, _ in received)
    stored = {i: payload for i, _, _, payload in done}
    assert all(stored.get(i) == p for i, _, p in received), "a received message is not the finished one"
    # (a) Every acknowledged push was received, or finished by a pop whose call raised: such a pop
    # may have committed on the server while its reply was lost with the crash.
    acknowledged = {i for lg in producers for ids_, _ in lg.ok_pushes for i in ids_}
    unreceived = set(stored) - set(ids)
    unknown_pops = sum(lg.unknown_pops for lg in consumers)
    assert len(unreceived) <= unknown_pops * CRASH_POP_BATCH, (len(unreceived), unknown_pops)
    assert acknowledged <= set(ids) | unreceived


def _check_at_least_once(
    consumers: list[ClientLog],
    drained: list[tuple[int, int, dict[str, Any]]],
    drain_acks: list[tuple[int, int]],
    producers: list[ClientLog],
    done: list[tuple[int, int, int, Any]],
) -> None:
    received = [r for lg in consumers for r in lg.received] + drained
    stored = {i: (attempts, payload) for i, attempts, _, payload in done}
    attempts: dict[int, list[int]] = collections.defaultdict(list)
    for i, a, p in received:
        attempts[i].append(a)
        assert stored.get(i, (0, p))[1] == p, f"message {i} came back with another payload"
    # Every finished message was delivered, every delivered one finished (the drain emptied the
    # queue), and each delivery of a message is a new attempt.
    assert set(stored) == set(attempts), "a message was finished without delivery, or never finished"
    assert all(len(set(a)) == len(a) for a in attempts.values()), "one attempt was delivered twice"
    # An ack that returned finished exactly that delivery; no message was acked twice.
    receipts = [r for lg in consumers for r in lg.acked] + drain_acks
    acked_ids = collections.Counter(i for i, _ in receipts)
    assert not acked_ids or max(acked_ids.values()) == 1, "a message was acknowledged twice"
    assert all(stored[i][0] == a for i, a in receipts), "an ack that returned did not finish its delivery"
    # (a) Every acknowledged push was delivered and finished.
    acknowledged = {i for lg in producers for ids_, _ in lg.ok_pushes for i in ids_}
    assert acknowledged <= set(stored)


# -- the ring: the server killed between a pop's statement and its commit -----------------------------


@pytest.mark.parametrize("layout", ["slots", "rows"])
def test_ring_server_sigkill_between_a_pop_and_its_commit(
    embedded_server: EmbeddedPostgres, layout: str
) -> None:
    """A ring pop's work is moving its lanes' positions (and, at least once, writing a lease row), in
    the pop's transaction: the server killed after the pop's statement and before its commit loses
    that work, so the messages are delivered again and nothing twice. Each round pops in a caller's
    transaction under each semantics, kills the server with SIGKILL, restarts it, and pops again;
    at the end every message pushed came out of a committed pop once, with its payload."""
    dsn = embedded_server.dsn
    with DbQueue(dsn, schema="ringcrash", pool_size=2) as admin:
        admin.uninstall()  # a schema of its own for each layout's run
        admin.install()
        q = admin.create_queue("r", design="ring", capacity=128, max_attempts=100, layout=layout)
        sent = [{"i": i, "v": os.urandom(6).hex()} for i in range(120)]
        ids = q.push_batch(sent[:60]) + q.push_batch(sent[60:])
    committed: list[Message] = []
    for semantics in ("at-most-once", "at-least-once", "exactly-once", "at-most-once"):
        with DbQueue(dsn, schema="ringcrash", pool_size=2) as dbq:
            q = dbq.queue("r")
            conn = psycopg.connect(dsn)  # a transaction of the caller's
            try:
                lost = q.pop(10, semantics=semantics, conn=conn)
                assert len(lost) == 10, lost
                embedded_server.kill()  # the pop ran; its transaction never commits
            finally:
                with contextlib.suppress(psycopg.Error):
                    conn.close()
            embedded_server.start()
        with DbQueue(dsn, schema="ringcrash", pool_size=2) as dbq:
            q = dbq.queue("r")
            again = q.pop(10, semantics="at-least-once")
            # the same messages, first in line again: the killed pop moved nothing
            assert [(m.id, m.payload, m.attempts) for m in again] == [(m.id, m.payload, 1) for m in lost]
            assert q.ack(again) == 10
            committed += again
    with DbQueue(dsn, schema="ringcrash", pool_size=2) as dbq:
        q = dbq.queue("r")
        committed += drained_ring(q)
        st = q.stats()
        assert (st.ready, st.in_flight, st.failed, st.extra["lag_messages"]) == (0, 0, 0, 0), st
    assert [m.id for m in committed] == ids, "every message once, in order"
    assert checksum([m.payload for m in committed]) == checksum(sent)


def drained_ring(q: Queue) -> list[Message]:
    out: list[Message] = []
    while msgs := q.pop(50):
        out += msgs
    return out
