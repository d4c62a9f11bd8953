"""Many producer and consumer processes on one queue: nothing lost, nothing delivered twice.

Four producer processes and four consumer processes move 20,000 messages through one queue, once
for each delivery semantics (``$DBQUEUE_TEST_CONCURRENCY_MESSAGES`` moves as many as it says instead,
for a longer soak of the same checks: ``DBQUEUE_TEST_CONCURRENCY_MESSAGES=100000 scripts/test
tests/integration/test_concurrency.py``). Every payload carries a unique ``(producer, seq)`` and a
random value; producers report the ids they got back and a checksum of what they pushed, consumers report what
they received (exactly-once consumers write it into a results table in the pop's own transaction),
and the test compares counts, checksums and identities, then checks the queue is empty.

The children are forked from a fork server that holds no connection (``tests.helpers.child_processes``):
each builds its own :class:`DbQueue` from the DSN, schema and dialect, so no connection crosses a
``fork``. Each case runs on PostgreSQL, through a
real PgBouncer in transaction and in session mode, and on SQL Server when ``$DBQUEUE_TEST_MSSQL_DSN``
names one (skipped otherwise): the results table is written and read through the engine's connections
with SQL valid on both (``tests/dialects.py``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from typing import TYPE_CHECKING, Any

import pytest

from airflow_dbqueue.engine import DbQueue
from tests.dialects import ResultsTable, topologies, topology_dbq  # noqa: F401 - topology_dbq is the fixture "dbq", on topologies
from tests.helpers import child_processes, drained, payload_hash

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerProcess
    from multiprocessing.synchronize import Barrier, Event

    from airflow_dbqueue.engine import Message

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PRODUCERS = 4
CONSUMERS = 4
PER_PRODUCER = int(os.environ.get("DBQUEUE_TEST_CONCURRENCY_MESSAGES", "20000")) // PRODUCERS
PUSH_BATCH = 100
POP_BATCH = 100
RUN_LIMIT_S = 300.0
"""Upper bound of one run: a hang fails the test instead of waiting for pytest-timeout."""

RING_CAPACITY = 1000
"""Smaller than what is in flight (4 producers x 100 + 4 consumers x 100, and a backlog): the ring wraps
20 times (100 times for 100,000 messages) and fills, so pushes wait for pops."""

QUEUE = "conc"
RESULTS = ResultsTable(
    [("consumer", "integer"), ("msg_id", "bigint"), ("p", "integer"), ("s", "integer"), ("h", "bigint")]
)
"""The exactly-once consumers' table: what each popped, written in the pop's own transaction."""


def write_results(dbq: DbQueue, conn: Any, consumer: int, msgs: list[Message]) -> None:
    """Record what ``consumer`` popped, on ``conn``: in the pop's own transaction."""
    RESULTS.write(
        dbq, conn, [(consumer, m.id, m.payload["p"], m.payload["s"], payload_hash(m.payload)) for m in msgs]
    )


def read_results(dbq: DbQueue) -> list[tuple[int, int, int, int, int]]:
    """``(consumer, msg_id, p, s, h)`` of every committed result."""
    return [(int(c), int(i), int(p), int(s), int(h)) for c, i, p, s, h in RESULTS.read(dbq)]


def engine_kwargs(dbq: DbQueue) -> dict[str, Any]:
    """What a child passes to :class:`DbQueue` besides the DSN and schema to reach the database as ``dbq``
    does: its dialect, and its pooler and listen DSN where it has them."""
    engine: dict[str, Any] = {"dialect": dbq.dialect}
    if dbq.dialect == "postgresql":
        engine.update(pooler=dbq.db.pooler, listen_dsn=dbq.db.listen_dsn)  # type: ignore[attr-defined]
    return engine


# -- child processes (module level: a child imports this module to find them) -----------------------


def _producer(
    *,
    dsn: str,
    schema: str,
    engine: dict[str, Any],
    idx: int,
    count: int,
    batch: int,
    results: mp.Queue[Any],
    start: Barrier,
    deadline: float,
) -> None:
    try:
        with DbQueue(dsn, schema=schema, pool_size=1, **engine) as dbq:
            q = dbq.queue(QUEUE)
            # Every child has its connection before the first push, so the run is concurrent.
            start.wait(timeout=120)
            ids: list[int] = []
            checksum = 0
            for first in range(0, count, batch):
                if time.time() > deadline:
                    raise TimeoutError(f"producer {idx} passed the run's deadline")
                payloads = [
                    {"p": idx, "s": s, "v": os.urandom(6).hex()}
                    for s in range(first, min(count, first + batch))
                ]
                got = q.push_batch(payloads)
                if len(got) != len(payloads):
                    raise AssertionError(f"push_batch returned {len(got)} ids for {len(payloads)} payloads")
                ids.extend(got)
                checksum += sum(payload_hash(p) for p in payloads)
            results.put(("producer", idx, {"ids": ids, "checksum": checksum}))
    except BaseException:
        results.put(("error", f"producer {idx}", traceback.format_exc()))


def _consumer(
    *,
    dsn: str,
    schema: str,
    engine: dict[str, Any],
    idx: int,
    semantics: str,
    batch: int,
    producers_done: Event,
    results: mp.Queue[Any],
    start: Barrier,
    deadline: float,
) -> None:
    try:
        with DbQueue(dsn, schema=schema, pool_size=2, **engine) as dbq:
            q = dbq.queue(QUEUE)
            start.wait(timeout=120)
            got: list[tuple[int, int, int, int]] = []  # (id, producer, seq, payload hash)
            attempts_seen: set[int] = set()
            popped = 0
            while True:
                if time.time() > deadline:
                    raise TimeoutError(f"consumer {idx} passed the run's deadline")
                if semantics == "exactly-once":
                    with dbq.transaction() as conn:
                        msgs = q.pop(batch, semantics="exactly-once", conn=conn)
                        write_results(dbq, conn, idx, msgs)  # both commit, or neither
                else:
                    msgs = q.pop(batch, semantics=semantics)
                    if msgs and semantics == "at-least-once":
                        q.ack(msgs)
                if msgs:
                    popped += len(msgs)
                    attempts_seen.update(m.attempts for m in msgs)
                    if semantics != "exactly-once":
                        got.extend(
                            (m.id, m.payload["p"], m.payload["s"], payload_hash(m.payload)) for m in msgs
                        )
                    continue
                # Empty pop: finished once every producer is done and nothing is ready, delayed or
                # leased (an uncommitted exactly-once pop still counts as ready to the others).
                if producers_done.is_set() and drained(q):
                    break
                time.sleep(0.05)
            results.put(("consumer", idx, {"got": got, "popped": popped, "attempts": sorted(attempts_seen)}))
    except BaseException:
        results.put(("error", f"consumer {idx}", traceback.format_exc()))


# -- the test -----------------------------------------------------------------------------------------


def _collect(
    results: mp.Queue[Any], procs: list[ForkServerProcess], kind: str, want: int, deadline: float
) -> dict[int, Any]:
    """Gather ``want`` reports of ``kind`` from the children; fail on a child's error or death."""
    out: dict[int, Any] = {}
    while len(out) < want:
        if time.time() > deadline:
            raise AssertionError(f"only {len(out)} of {want} {kind} reports before the deadline")
        try:
            msg = results.get(timeout=0.5)
        except queue_mod.Empty:
            dead = [p.name for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise AssertionError(f"child processes died without reporting: {dead}") from None
            continue
        if msg[0] == "error":
            raise AssertionError(f"{msg[1]} failed:\n{msg[2]}")
        if msg[0] != kind:
            raise AssertionError(f"unexpected {msg[0]} report while waiting for {kind} reports")
        out[msg[1]] = msg[2]
    return out


@pytest.mark.parametrize("semantics", ["at-most-once", "at-least-once", "exactly-once"])
@pytest.mark.parametrize("design", ["table", "ring", "ring-rows"])
def test_many_processes_move_every_message_once(dbq: DbQueue, semantics: str, design: str) -> None:  # noqa: PLR0912, PLR0915
    """Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around. ``ring``: the slots layout; ``ring-rows``: the rows
    layout, of 64 pushes, so that its segments are emptied and reused many times over."""
    shape: dict[str, Any] = {
        "table": {},
        "ring": {"design": "ring", "layout": "slots", "capacity": RING_CAPACITY},
        "ring-rows": {"design": "ring", "layout": "rows", "capacity": 64},
    }[design]
    q = dbq.create_queue(QUEUE, payload_type="json", visibility_timeout=120.0, **shape)
    if semantics == "exactly-once":
        RESULTS.create(dbq)
    dsn, schema = dbq.db.dsn, dbq.schema
    engine = engine_kwargs(dbq)
    total = PRODUCERS * PER_PRODUCER
    ctx = child_processes()
    results: mp.Queue[Any] = ctx.Queue()
    producers_done = ctx.Event()
    start = ctx.Barrier(PRODUCERS + CONSUMERS)
    deadline = time.time() + RUN_LIMIT_S
    consumers = [
        ctx.Process(
            target=_consumer,
            kwargs={
                "dsn": dsn,
                "schema": schema,
                "engine": engine,
                "idx": i,
                "semantics": semantics,
                "batch": POP_BATCH,
                "producers_done": producers_done,
                "results": results,
                "start": start,
                "deadline": deadline,
            },
            name=f"consumer-{i}",
        )
        for i in range(CONSUMERS)
    ]
    producers = [
        ctx.Process(
            target=_producer,
            kwargs={
                "dsn": dsn,
                "schema": schema,
                "engine": engine,
                "idx": i,
                "count": PER_PRODUCER,
                "batch": PUSH_BATCH,
                "results": results,
                "start": start,
                "deadline": deadline,
            },
            name=f"producer-{i}",
        )
        for i in range(PRODUCERS)
    ]
    procs = consumers + producers
    try:
        for p in procs:
            p.start()
        pushed = _collect(results, procs, "producer", PRODUCERS, deadline + 10)
        producers_done.set()
        received = _collect(results, procs, "consumer", CONSUMERS, deadline + 10)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()

    # What went in: every producer pushed its share, and every id is distinct.
    id_to_key: dict[int, tuple[int, int]] = {}
    for idx, rep in pushed.items():
        assert len(rep["ids"]) == PER_PRODUCER
        for seq, mid in enumerate(rep["ids"]):
            assert mid not in id_to_key, f"id {mid} returned to two pushes"
            id_to_key[mid] = (idx, seq)
    assert len(id_to_key) == total
    pushed_checksum = sum(rep["checksum"] for rep in pushed.values())

    # What came out.
    popped = sum(rep["popped"] for rep in received.values())
    assert popped == total, f"consumers popped {popped} messages, {total} were pushed"
    assert all(rep["attempts"] in ([], [1]) for rep in received.values()), "a message was delivered twice"
    if semantics == "exactly-once":
        # Exactly-once consumers report only counts: what they got is what their transactions committed.
        assert all(rep["got"] == [] for rep in received.values())
        got_by_consumer: dict[int, list[tuple[int, int, int, int]]] = {k: [] for k in received}
        for consumer, mid, p, s, h in read_results(dbq):
            assert consumer in got_by_consumer, f"a result row of an unknown consumer {consumer}"
            got_by_consumer[consumer].append((mid, p, s, h))
        assert {k: len(v) for k, v in got_by_consumer.items()} == {
            k: rep["popped"] for k, rep in received.items()
        }, "a consumer's committed results differ from what its pops returned"
    else:
        got_by_consumer = {k: rep["got"] for k, rep in received.items()}
    deliveries = [g for got in got_by_consumer.values() for g in got]
    rows = len(deliveries)
    distinct_ids = len({g[0] for g in deliveries})
    distinct_payloads = len({(g[1], g[2]) for g in deliveries})
    checksum = sum(g[3] for g in deliveries)
    got_keys = {g[0]: (g[1], g[2]) for g in deliveries}

    assert rows == total, f"{rows} deliveries for {total} pushed messages"
    assert distinct_ids == total, f"{rows - distinct_ids} ids delivered twice"
    assert distinct_payloads == total, f"{rows - distinct_payloads} payloads delivered twice"
    assert checksum == pushed_checksum, "the delivered payloads differ from the pushed ones"
    assert got_keys == id_to_key, "a message id came back with another message's payload"

    # The queue ends empty (counted exactly: a table queue's stats estimate above 50,000 finished).
    st = q.stats(exact=True)
    assert (st.ready, st.delayed, st.in_flight, st.failed) == (0, 0, 0, 0), st
    # a table queue archives (every finished message waits in done); a ring reuses finished slots
    assert st.finished == (total if q.settings.archive else 0), st
    if design == "ring-rows":
        # every push counted once, and the default group finished every message
        assert (st.extra["push_total"], st.extra["pop_total"]) == (total, total), st
    if design == "ring":
        # Every number was delivered or skipped as a gap: a push is retried with new numbers when its
        # first ones were given up (after the gap timeout, under heavy load), so numbers may exceed ids.
        push_pos, pop_pos, gaps = (st.extra[k] for k in ("push_position", "pop_position", "gaps_skipped"))
        assert (push_pos, pop_pos) == (total + gaps, push_pos + 1), st
    assert q.pop(10, semantics="at-most-once") == []
