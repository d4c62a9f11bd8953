"""Ordering per key (table design, ordering="per_key"): a key's messages are handed out in push order,
none while an earlier one of the key is ready, delayed or in flight (leased, or taken by a pop not
committed yet), and keys do not hold each other back.

Every test counts what went in and what came out, and compares checksums of the payloads.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import signal
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from airflow_dbqueue.engine import DbQueue
from airflow_dbqueue.engine.errors import ConfigurationError, NotSupportedError
from airflow_dbqueue.engine.models import Ordering
from tests.helpers import checksum, child_processes, drained, payload_hash
from tests.integration.test_crash import _Log, _read_log, _stop

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerProcess
    from multiprocessing.synchronize import Event

    from airflow_dbqueue.engine import Message

pytestmark = pytest.mark.integration


def payloads(msgs: list[Message]) -> list[Any]:
    return [m.payload for m in msgs]


def test_one_message_of_a_key_at_a_time_in_push_order(dbq: DbQueue) -> None:
    q = dbq.create_queue("o", ordering="per_key", retry_backoff=0, max_attempts=10)
    assert q.settings.ordering is Ordering.PER_KEY
    q.push_batch(["a1", "a2", "a3"], keys=["a", "a", "a"])
    q.push_batch(["b1", "x", "b2"], keys=["b", None, "b"])  # x has no key: ordered with nothing
    q.push("a4", key="a")
    first = q.pop(10, semantics="at-least-once")
    assert payloads(first) == ["a1", "b1", "x"]
    assert q.pop(10, semantics="at-least-once") == []  # every key's head is in flight
    assert q.count_ready() == 0 and q.peek(10) == []
    a1, b1, x = first
    assert q.nack([b1], delay=0) == 1  # back first: b2 still waits for it
    assert q.ack([a1, x]) == 2
    second = q.pop(10, semantics="at-least-once")
    assert payloads(second) == ["a2", "b1"]
    assert q.ack(second) == 2
    rest: list[Message] = []
    while batch := q.pop(10, semantics="at-least-once"):
        assert len({m.payload[0] for m in batch}) == len(batch)  # one a key
        rest += batch
        q.ack(batch)
    assert payloads(rest) == ["a3", "b2", "a4"]
    assert drained(q)
    got = [m.payload for m in first[:1] + first[2:] + second + rest]
    assert checksum(got) == checksum(["a1", "a2", "a3", "a4", "b1", "b2", "x"])


def test_an_expired_lease_keeps_the_keys_order(dbq: DbQueue) -> None:
    q = dbq.create_queue("o", ordering="per_key")
    q.push_batch([f"k{i}" for i in range(3)], keys=["k"] * 3)
    [m] = q.pop(10, semantics="at-least-once", visibility_timeout=0.2)
    assert m.payload == "k0"
    time.sleep(0.3)
    assert q.pop(10, semantics="at-least-once") == []  # k1 waits while k0's lease is not reclaimed
    assert q.reclaim_expired() == 1
    [again] = q.pop(10, semantics="at-least-once")
    assert (again.payload, again.delivery) == ("k0", 2)
    out = [again]
    q.ack([again])
    while batch := q.pop(10, semantics="at-least-once"):
        out += batch
        q.ack(batch)
    assert payloads(out) == ["k0", "k1", "k2"] and drained(q)


def test_a_take_not_committed_yet_holds_its_key(dbq: DbQueue) -> None:
    """Exactly once: while one transaction has taken a key's head, another pop gets the other keys'
    heads but nothing of that key; after a rollback the head comes back first."""
    q = dbq.create_queue("o", ordering="per_key")
    q.push_batch(["a1", "a2", "b1", "b2"], keys=["a", "a", "b", "b"])

    class Abort(Exception):
        pass

    with pytest.raises(Abort), dbq.transaction() as conn:
        assert payloads(q.pop(1, semantics="exactly-once", conn=conn)) == ["a1"]
        with dbq.transaction() as other:
            assert payloads(q.pop(10, semantics="exactly-once", conn=other)) == ["b1"]
        raise Abort
    with dbq.transaction() as conn:
        assert payloads(q.pop(10, semantics="exactly-once", conn=conn)) == ["a1", "b2"]
    assert payloads(q.pop(10)) == ["a2"] and drained(q)


def test_a_batch_claims_only_the_head_of_each_key(dbq: DbQueue) -> None:
    q = dbq.create_queue("o", ordering="per_key")
    ids = q.push_batch([f"m{i}" for i in range(12)], keys=[f"k{i % 3}" for i in range(12)])
    batch = q.claim_batch(100)
    assert batch is not None and [i for i, _ in batch.receipts] == ids[:3]
    assert q.claim_batch(100) is None
    assert q.ack_batch(batch.batch_id) == 3
    nxt = q.claim_batch(100)
    assert nxt is not None and [i for i, _ in nxt.receipts] == ids[3:6]
    q.release_batch(nxt.batch_id, delay=0)
    again = q.claim_batch(100)
    assert again is not None and [i for i, _ in again.receipts] == ids[3:6]


def test_keys_need_a_queue_ordered_per_key(dbq: DbQueue) -> None:
    q = dbq.create_queue("plain")
    with pytest.raises(ConfigurationError, match="ordering='per_key'"):
        q.push("x", key="k")
    for layout in ("slots", "rows"):
        with pytest.raises(NotSupportedError, match=r"table queues only \(a ring deals its pushes to lanes"):
            dbq.create_queue("r", design="ring", capacity=16, lanes=2, layout=layout, ordering="per_key")
    with pytest.raises(ConfigurationError):
        dbq.create_queue("bad", ordering="per_customer")
    o = dbq.create_queue("o", ordering="per_key")
    for keys in (["k"], "kk", ["k", ""], ["k", 3]):
        with pytest.raises(ConfigurationError, match="key"):
            o.push_batch(["x", "y"], keys=keys)  # type: ignore[arg-type]
    ring = dbq.create_queue("ring", design="ring", capacity=16)
    rows = dbq.create_queue("rows", design="ring", capacity=16, lanes=2, layout="rows")
    for r in (ring, rows):
        with pytest.raises(NotSupportedError, match="ordering per key"):
            r.push("x", key="k")
        assert r.stats().ready == 0
    dbq.drop_queue("rows")
    assert q.stats().ready == 0 and o.stats().ready == 0 and ring.stats().ready == 0
    assert {s.name for s in dbq.list_queues()} == {"plain", "o", "ring"}


def test_keys_and_deduplication_keys_together(dbq: DbQueue) -> None:
    q = dbq.create_queue("o", ordering="per_key")
    ids = q.push_batch(["a1", "a2", "a1 again"], keys=["a", "a", "a"], dedup_keys=["d1", "d2", "d1"])
    assert ids[2] == ids[0] and ids[1] > ids[0]
    assert q.push("a2 again", key="a", dedup_key="d2") == ids[1]
    out = []
    for _ in range(3):
        with dbq.transaction() as conn:
            out += payloads(q.pop(10, semantics="exactly-once", conn=conn))
    assert out == ["a1", "a2"] and drained(q)


# -- 4 producers, 4 consumers at least once, consumers SIGKILLed holding leases --------------------

CRASH_QUEUE = "ordered"
KEYS = 1000
PRODUCERS = 4
MIN_BATCHES = 5
PUSH_BATCH = 100
CONSUMERS = 4
KILLS = 4
POP_BATCH = 50
VT = 2.0
RUN_LIMIT_S = 180.0


def _producer(*, dsn: str, schema: str, idx: int, log_path: str, stop: Event) -> None:
    """Push batches of messages with random keys (shared with the other producers) until ``stop``, and
    at least ``MIN_BATCHES`` of them."""
    log = _Log(Path(log_path))
    try:
        rnd = random.Random(idx)
        with DbQueue(dsn, schema=schema, pool_size=1) as dbq:
            q = dbq.queue(CRASH_QUEUE)
            b = 0
            while b < MIN_BATCHES or not stop.is_set():
                keys = [f"k{rnd.randrange(KEYS)}" for _ in range(PUSH_BATCH)]
                items = [{"p": idx, "s": b * PUSH_BATCH + i, "k": k} for i, k in enumerate(keys)]
                ids = q.push_batch(items, keys=keys)
                log("push", [[i, p["k"], payload_hash(p)] for i, p in zip(ids, items, strict=True)])
                b += 1
                time.sleep(0.2)
        log("end", [])
    except BaseException:
        log("error", traceback.format_exc())


def _consumer(
    *, dsn: str, schema: str, log_path: str, done: Event, deadline: float, holding: Event | None = None
) -> None:
    """Pop at least once, log (after the pop), log the ack's start, ack; until ``done`` and drained. A
    victim (``holding``) pops one batch, logs it, says so and waits to be killed."""
    log = _Log(Path(log_path))
    try:
        with DbQueue(dsn, schema=schema, pool_size=1) as dbq:
            q = dbq.queue(CRASH_QUEUE)
            while time.time() < deadline:
                msgs = q.pop(POP_BATCH, semantics="at-least-once")
                after_pop = time.monotonic_ns()
                if msgs:
                    log(
                        "pop",
                        [
                            after_pop,
                            [[m.id, m.delivery, m.payload["k"], payload_hash(m.payload)] for m in msgs],
                        ],
                    )
                    if holding is not None:
                        holding.set()
                        time.sleep(300)
                        raise AssertionError("the victim was not killed")
                    time.sleep(random.random() * 0.01)  # the work
                    log("acking", [time.monotonic_ns(), [m.id for m in msgs]])
                    q.ack(msgs)
                    continue
                if done.is_set() and drained(q):
                    log("end", [])
                    return
                time.sleep(0.02)
            raise TimeoutError("consumer passed the run's deadline")
    except BaseException:
        log("error", traceback.format_exc())


@pytest.mark.slow
def test_per_key_order_under_producers_consumers_and_sigkills(dbq: DbQueue, tmp_path: Path) -> None:  # noqa: PLR0912, PLR0915
    """Long on purpose: one scenario told in order, checked at the end as test_crash's are.

    Four producers push batches of 100 over 1,000 keys shared between them while it runs; four consumers
    pop and ack
    at least once while four victims, one after another, pop a batch and are SIGKILLed holding it. Every
    message is acked, none is lost or changed (count, checksum); a victim's messages come back after
    their leases expire; and no message is handed out before an ack of the message of its key pushed
    before it has at least started (the clock of the log is the machine's monotonic clock, shared by the
    processes): a key's messages are processed one at a time, in push order.
    """
    q = dbq.create_queue(CRASH_QUEUE, ordering="per_key", visibility_timeout=VT, max_attempts=50)
    ctx = child_processes()
    done, stop = ctx.Event(), ctx.Event()
    deadline = time.time() + RUN_LIMIT_S
    common = {"dsn": dbq.db.dsn, "schema": dbq.schema}

    def consumer(name: str, holding: Event | None = None) -> ForkServerProcess:
        kw = {**common, "log_path": str(tmp_path / f"{name}.jsonl"), "done": done, "deadline": deadline}
        return ctx.Process(target=_consumer, kwargs={**kw, "holding": holding}, name=name)

    producers = [
        ctx.Process(
            target=_producer,
            kwargs={**common, "idx": i, "log_path": str(tmp_path / f"producer-{i}.jsonl"), "stop": stop},
            name=f"producer-{i}",
        )
        for i in range(PRODUCERS)
    ]
    steady = [consumer(f"consumer-{i}") for i in range(CONSUMERS)]
    procs: list[ForkServerProcess] = [*producers, *steady]
    killed: list[str] = []
    try:
        for p in procs:
            p.start()
        for k in range(KILLS):
            holding = ctx.Event()
            victim = consumer(f"victim-{k}", holding)
            procs.append(victim)
            victim.start()
            while not holding.wait(timeout=0.5):
                assert victim.is_alive() and time.time() < deadline, f"{victim.name} never held leases"
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
            victim.join(timeout=30)
            assert victim.exitcode == -signal.SIGKILL
            killed.append(victim.name)
        stop.set()
        for p in producers:
            p.join(timeout=max(0.1, deadline - time.time()))
            assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
        done.set()
        for p in steady:
            p.join(timeout=max(0.1, deadline + 10 - time.time()))
            assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
    finally:
        _stop(procs)

    pushed: dict[int, tuple[str, int]] = {}
    for p in producers:
        entries = _read_log(tmp_path / f"{p.name}.jsonl", killed=False)
        assert entries[-1][0] == "end", entries[-1:]
        for kind, rows in entries:
            for mid, key, h in rows if kind == "push" else []:
                assert mid not in pushed
                pushed[mid] = (key, h)
    assert len(pushed) >= PRODUCERS * MIN_BATCHES * PUSH_BATCH

    first_pop: dict[int, int] = {}  # id -> monotonic ns after its first delivery's pop returned
    ack_starts: dict[int, list[int]] = collections.defaultdict(list)
    deliveries: collections.Counter[int] = collections.Counter()
    delivered_hash: dict[int, int] = {}
    held: set[int] = set()
    for p in procs[len(producers) :]:
        was_killed = p.name in killed
        entries = _read_log(tmp_path / f"{p.name}.jsonl", killed=was_killed)
        assert not [r for kind, r in entries if kind == "error"], f"{p.name} failed: {entries[-1]}"
        assert was_killed or entries[-1][0] == "end", f"{p.name} did not finish"
        for kind, rows in entries:
            if kind == "pop":
                at, msgs = rows
                assert len({key for _, _, key, _ in msgs}) == len(msgs), "two messages of a key in one pop"
                for mid, _delivery, key, h in msgs:
                    assert pushed[mid] == (key, h), f"message {mid} came back changed"
                    first_pop[mid] = min(first_pop.get(mid, at), at)
                    deliveries[mid] += 1
                    delivered_hash[mid] = h
                    if was_killed:
                        held.add(mid)
            elif kind == "acking":
                at, ids = rows
                for mid in ids:
                    ack_starts[mid].append(at)
    assert drained(q) and q.stats().failed == 0
    assert set(ack_starts) == set(pushed) == set(first_pop), "a message was never delivered or acked"
    assert checksum(delivered_hash.values()) == checksum(h for _, h in pushed.values())
    assert held and all(deliveries[m] >= 2 for m in held), "a killed consumer's message did not come back"

    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for mid in sorted(pushed):
        by_key[pushed[mid][0]].append(mid)
    out_of_order = [
        (key, earlier, later)
        for key, ids in by_key.items()
        for earlier, later in itertools.pairwise(ids)
        if not first_pop[later] > min(ack_starts[earlier])
    ]
    assert out_of_order == [], f"handed out before the key's earlier message was acked: {out_of_order[:5]}"
    assert len(by_key) > KEYS * 0.8


def test_the_cli_creates_and_pushes_with_keys(dbq: DbQueue, capsys: pytest.CaptureFixture[str]) -> None:
    from airflow_dbqueue import cli

    base = ["--dsn", dbq.db.dsn, "--schema", dbq.schema]
    create = ["create", "o", "--ordering", "per_key", "--ttl", "3600", "--dedup-window", "60"]
    assert cli.main([*base, *create]) == 0
    capsys.readouterr()
    push = ["push", "o", '{"n": 1}', '{"n": 2}', "--key", "a", "--key", "a", "--dedup-key", "d1"]
    assert cli.main([*base, *push, "--dedup-key", "d2", "--ttl", "60"]) == 0
    ids = json.loads(capsys.readouterr().out)["ids"]
    assert cli.main([*base, *push, "--dedup-key", "d2"]) == 0  # the retry
    assert json.loads(capsys.readouterr().out)["ids"] == ids
    s = dbq.queue("o").settings
    assert (s.ordering, s.ttl_s, s.dedup_window_s) == (Ordering.PER_KEY, 3600.0, 60.0)
    q = dbq.queue("o")
    assert [m.payload for m in q.pop(10, semantics="at-least-once")] == [{"n": 1}]  # one of key a
