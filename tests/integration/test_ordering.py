"""Ordering per key (ordering="per_key"): a key's messages are handed out in push order, none while an
earlier one of the key is ready, delayed or in flight (leased, or taken by a pop not committed yet), and
keys do not hold each other back. The table design orders each key on its own; a ring of the rows layout
maps a key to a lane (a stable hash of the key modulo its lanes), whose FIFO gives the key's order, and
holds the lane while a message taken from it is leased: keys sharing a lane hold each other back.

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
from airflow_dbqueue.engine.ring_rows import RowsRingQueue
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
    with pytest.raises(
        NotSupportedError, match=r"rings of the rows layout only \(a ring of the slots layout"
    ):
        dbq.create_queue("r", design="ring", capacity=16, lanes=2, layout="slots", ordering="per_key")
    with pytest.raises(ConfigurationError, match="capacity / 4 must be a multiple of lanes"):
        dbq.create_queue("r", design="ring", capacity=48, lanes=5, layout="rows", ordering="per_key")
    with pytest.raises(ConfigurationError):
        dbq.create_queue("bad", ordering="per_customer")
    o = dbq.create_queue("o", ordering="per_key")
    for keys in (["k"], "kk", ["k", ""], ["k", 3]):
        with pytest.raises(ConfigurationError, match="key"):
            o.push_batch(["x", "y"], keys=keys)  # type: ignore[arg-type]
    ring = dbq.create_queue("ring", design="ring", capacity=16, layout="slots")
    rows = dbq.create_queue("rows", design="ring", capacity=16, lanes=2, layout="rows")
    with pytest.raises(NotSupportedError, match="ordering per key"):
        ring.push("x", key="k")
    with pytest.raises(ConfigurationError, match="ordering='per_key'"):  # the table design's error
        rows.push("x", key="k")
    for r in (ring, rows):
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


# -- a ring of the rows layout: a key maps to a lane ------------------------------------------------

ALO = "at-least-once"


def keyed_ring(dbq: DbQueue, name: str = "o", **kw: Any) -> RowsRingQueue:
    kw.setdefault("capacity", 64)
    kw.setdefault("lanes", 4)
    q = dbq.create_queue(name, design="ring", layout="rows", ordering="per_key", **kw)
    assert isinstance(q, RowsRingQueue) and q.settings.ordering is Ordering.PER_KEY
    return q


def keys_in_lanes(q: RowsRingQueue) -> dict[int, str]:
    """One key a lane (the first found), so that a test places messages in lanes of its choosing."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < q.lanes:
        out.setdefault(q.lane_of(f"k{i}"), f"k{i}")
        i += 1
    return out


def test_ring_a_lane_is_held_while_a_message_taken_from_it_is_leased(dbq: DbQueue) -> None:
    q = keyed_ring(dbq)
    lk = keys_in_lanes(q)
    a, b = lk[0], lk[1]
    sent = ["a1", "a2", "b1", "x", "a3", "b2"]
    ids = q.push_batch(sent[:4], keys=[a, a, b, None])  # x has no key: lane 3, its place in the batch
    ids += [q.push("a3", key=a), q.push("b2", key=b)]
    assert len(set(ids)) == 6 and ids[0] < ids[1] < ids[4] and ids[2] < ids[5]
    [a1] = q.pop(1, semantics=ALO)
    assert a1.payload == "a1"
    others = q.pop(10, semantics=ALO)  # lane 0 is held by a1: the other lanes' runs, past empty rows
    assert payloads(others) == ["b1", "x", "b2"]
    assert q.pop(10, semantics=ALO) == []
    assert q.ack([a1]) == 1
    rest = q.pop(10, semantics=ALO)
    assert payloads(rest) == ["a2", "a3"]
    assert q.pop(10, semantics=ALO) == []
    assert q.ack(others) == 3 and q.ack(rest) == 2
    assert drained(q) and q.pop(10, semantics=ALO) == []
    got = [a1, *others, *rest]
    assert sorted(m.id for m in got) == sorted(ids)
    assert checksum(payloads(got)) == checksum(sent)


def test_ring_a_nack_puts_the_message_back_at_its_lanes_front(dbq: DbQueue) -> None:
    q = keyed_ring(dbq, retry_backoff=0, max_attempts=10)
    lk = keys_in_lanes(q)
    a, b = lk[0], lk[1]
    q.push_batch(["a1", "a2", "a3"], keys=[a, a, a])
    q.push("b1", key=b)
    [a1] = q.pop(1, semantics=ALO)
    assert q.nack([a1], delay=0) == 1
    again = q.pop(10, semantics=ALO)
    assert [(m.payload, m.delivery) for m in again] == [("a1", 2), ("a2", 1), ("a3", 1), ("b1", 1)]
    assert q.ack(again) == 4 and drained(q)
    assert checksum(payloads(again)) == checksum(["a1", "a2", "a3", "b1"])


def test_ring_a_delayed_nack_holds_the_lane_until_due(dbq: DbQueue) -> None:
    q = keyed_ring(dbq, max_attempts=10)
    lk = keys_in_lanes(q)
    a, b = lk[0], lk[1]
    q.push_batch(["a1", "a2"], keys=[a, a])
    q.push("b1", key=b)
    [a1] = q.pop(1, semantics=ALO)
    nacking = time.monotonic()  # the nack runs after this: a1 is not due before it plus the delay
    assert q.nack([a1], delay=0.5) == 1
    first = q.pop(10, semantics=ALO)
    assert payloads(first) == ["b1"]  # a2 waits behind a1's delay
    assert q.pop(10, semantics=ALO) == [] or time.monotonic() >= nacking + 0.5
    out: list[Message] = []
    deadline = time.monotonic() + 10
    while not out and time.monotonic() < deadline:
        out = q.pop(10, semantics=ALO)
        time.sleep(0.05)
    assert time.monotonic() >= nacking + 0.5
    assert [(m.payload, m.delivery) for m in out] == [("a1", 2), ("a2", 1)]
    assert q.ack(first + out) == 3 and drained(q)
    assert checksum(payloads(first + out)) == checksum(["a1", "a2", "b1"])


def test_ring_a_gap_given_up_in_a_held_lane_keeps_it_held(dbq: DbQueue) -> None:
    """A push rolled back leaves a row unwritten in every lane; pops give it up (each passed lane's new
    position still names the lease that holds it), so the key's next message waits for the ack."""
    q = keyed_ring(dbq)
    lk = keys_in_lanes(q)
    a, b = lk[0], lk[1]
    q.push("a1", key=a)

    class Abort(Exception):
        pass

    with pytest.raises(Abort), dbq.transaction() as conn:
        q.push_batch(["lost a", "lost b"], keys=[a, b], conn=conn)
        raise Abort
    q.push_batch(["a2", "b1"], keys=[a, b])
    [a1] = q.pop(1, semantics=ALO)
    assert a1.payload == "a1"
    got: list[Message] = []
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:  # b1 once the rolled-back push's gap is given up
        got = q.pop(10, semantics=ALO)
        time.sleep(0.05)
    assert payloads(got) == ["b1"]
    for _ in range(5):
        assert q.pop(10, semantics=ALO) == []  # a2 waits for a1, gap or not
        time.sleep(0.05)
    assert q.ack([a1]) == 1
    [a2] = q.pop(10, semantics=ALO)
    assert a2.payload == "a2" and q.ack([*got, a2]) == 2 and drained(q)
    assert checksum(["a1", "b1", "a2"]) == checksum(payloads([a1, *got, a2]))


def test_ring_a_message_failed_for_good_releases_its_lane(dbq: DbQueue) -> None:
    q = keyed_ring(dbq, max_attempts=1)
    a = keys_in_lanes(q)[0]
    q.push_batch(["a1", "a2"], keys=[a, a])
    [a1] = q.pop(1, semantics=ALO)
    assert q.nack([a1], error="boom") == 1  # its last attempt: failed
    [a2] = q.pop(10, semantics=ALO)
    assert a2.payload == "a2" and q.ack([a2]) == 1
    assert [f.payload for f in q.list_failed()] == ["a1"] and drained(q)


def test_ring_an_expired_lease_keeps_the_lanes_order(dbq: DbQueue) -> None:
    q = keyed_ring(dbq)
    a, b = keys_in_lanes(q)[0], keys_in_lanes(q)[1]
    q.push_batch(["a1", "a2"], keys=[a, a])
    [a1] = q.pop(1, semantics=ALO, visibility_timeout=0.2)
    q.push("b1", key=b)
    time.sleep(0.3)
    q.reclaim_every = 3600.0  # this handle's pops reclaim nothing now: the lease ran out, not reclaimed
    assert payloads(q.pop(10, semantics=ALO)) == ["b1"]  # a2 waits while a1's lease is not reclaimed
    assert q.reclaim_expired() == 1
    again = q.pop(10, semantics=ALO)
    assert [(m.payload, m.delivery) for m in again] == [("a1", 2), ("a2", 1)]
    assert a1.id == again[0].id and q.ack(again) == 2


def test_ring_a_message_still_leased_after_a_partial_ack_holds_its_lane(dbq: DbQueue) -> None:
    q = keyed_ring(dbq)
    a = keys_in_lanes(q)[0]
    q.push_batch(["a1", "a2", "a3"], keys=[a, a, a])
    got = q.pop(10, semantics=ALO)
    assert payloads(got) == ["a1", "a2", "a3"]  # a lane's run, in order, to one consumer
    assert q.ack(got[1:]) == 2  # a1 stays leased (the lease is split)
    q.push("a4", key=a)
    assert q.pop(10, semantics=ALO) == []
    assert q.ack(got[:1]) == 1
    [a4] = q.pop(10, semantics=ALO)
    assert a4.payload == "a4" and q.ack([a4]) == 1 and drained(q)


def test_ring_a_take_not_committed_yet_holds_its_lane(dbq: DbQueue) -> None:
    """Exactly once: while one transaction has taken from a lane, another pop gets the other lanes'
    messages but nothing of that lane; after a rollback the lane's head comes back first."""
    q = keyed_ring(dbq)
    lk = keys_in_lanes(q)
    a, b = lk[0], lk[1]
    q.push_batch(["a1", "a2", "b1", "b2"], keys=[a, a, b, b])

    class Abort(Exception):
        pass

    with pytest.raises(Abort), dbq.transaction() as conn:
        assert payloads(q.pop(1, semantics="exactly-once", conn=conn)) == ["a1"]
        with dbq.transaction() as other:
            assert payloads(q.pop(10, semantics="exactly-once", conn=other)) == ["b1", "b2"]
        raise Abort
    with dbq.transaction() as conn:
        assert payloads(q.pop(10, semantics="exactly-once", conn=conn)) == ["a1", "a2"]
    assert q.pop(10) == [] and drained(q)


def test_ring_a_batch_respects_the_lanes(dbq: DbQueue) -> None:
    q = keyed_ring(dbq)
    lk = keys_in_lanes(q)
    a, b = lk[0], lk[1]
    ids = q.push_batch(["a1", "b1"], keys=[a, b]) + q.push_batch(["a2", "b2"], keys=[a, b])
    first = q.claim_batch(1)
    assert first is not None and [i for i, _ in first.receipts] == [ids[0]]
    second = q.claim_batch(100)
    assert second is not None and [i for i, _ in second.receipts] == [ids[1], ids[3]]
    assert q.claim_batch(100) is None  # lane 0 is held by the first batch
    q.release_batch(first.batch_id, delay=0)
    third = q.claim_batch(100)
    assert third is not None and list(third.receipts) == [(ids[0], 2), (ids[2], 1)]
    assert q.ack_batch(second.batch_id) == 2 and q.ack_batch(third.batch_id) == 2 and drained(q)


def test_ring_keys_with_expiry(dbq: DbQueue) -> None:
    q = keyed_ring(dbq, ttl=60)
    a = keys_in_lanes(q)[0]
    q.push("a1", key=a, ttl=0.2)
    q.push("a2", key=a)
    time.sleep(0.3)
    [a2] = q.pop(10, semantics=ALO)  # a1 expired at the lane's head: failed, and holds nothing
    assert a2.payload == "a2" and q.ack([a2]) == 1
    assert [(f.payload, f.last_error) for f in q.list_failed()] == [("a1", "expired")] and drained(q)


def test_ring_each_group_holds_lanes_by_its_own_leases(dbq: DbQueue) -> None:
    q = keyed_ring(dbq)
    g = q.add_group("g", start="earliest")
    a = keys_in_lanes(q)[0]
    q.push_batch(["a1", "a2"], keys=[a, a])
    [m] = q.pop(1, semantics=ALO)
    [n] = g.pop(1, semantics=ALO)
    assert (m.payload, n.payload) == ("a1", "a1")
    assert q.pop(10, semantics=ALO) == [] and g.pop(10, semantics=ALO) == []
    assert g.ack([n]) == 1
    assert q.pop(10, semantics=ALO) == []  # the default group's lane is still held by its own lease
    assert payloads(g.pop(10, semantics=ALO)) == ["a2"]
    assert q.ack([m]) == 1 and payloads(q.pop(10, semantics=ALO)) == ["a2"]


def test_ring_ordered_refusals_and_pushes_without_keys(dbq: DbQueue) -> None:
    q = keyed_ring(dbq, max_attempts=1)
    with pytest.raises(NotSupportedError, match="deduplication keys"):
        q.push("x", key="k", dedup_key="d")
    with pytest.raises(NotSupportedError, match="deduplication keys"):
        q.push("x", dedup_key="d")
    for keys in (["k"], ["k", ""], ["k", 3]):
        with pytest.raises(ConfigurationError, match="key"):
            q.push_batch(["x", "y"], keys=keys)  # type: ignore[arg-type]
    assert q.stats().ready == 0
    sent = [f"m{i}" for i in range(10)]
    ids = q.push_batch(sent)  # no keys: spread over the push's lanes, in no order of their own
    got = q.pop(100, semantics=ALO)
    assert sorted(m.id for m in got) == sorted(ids) and checksum(payloads(got)) == checksum(sent)
    assert q.nack(got) == 10  # failed for good: requeued without their keys
    assert q.requeue_failed() == 10
    again = q.pop(100)
    assert checksum(payloads(again)) == checksum(sent) and drained(q)


# -- what observers count on a ring ordered per key: what a pop could take now ----------------------


def looks(q: RowsRingQueue) -> tuple[int, tuple[int, int] | None, list[str], int, int]:
    """(count_ready, readiness's head, peek's payloads, stats' ready, stats' blocked) of ``q``."""
    st = q.stats()
    ready, head = q.readiness()
    assert q.count_ready() == ready
    return ready, head, payloads(q.peek(100)), st.ready, st.extra["blocked"]


def test_ring_observers_count_only_what_a_pop_could_take(dbq: DbQueue) -> None:
    """count_ready, readiness (a sensor's and a trigger's question), peek and stats().ready leave out the
    messages behind a held lane (a lease open, a message leased again, a nack's delay), which stats show
    as blocked; a lease past its end frees its lane for them, as the pop that reclaims it first finds."""
    q = keyed_ring(dbq, max_attempts=5)
    lk = keys_in_lanes(q)
    a, b = lk[0], lk[1]
    sent = ["a1", "a2", "a3", "b1"]
    ids = q.push_batch(sent, keys=[a, a, a, b])
    assert looks(q) == (4, (ids[0], 0), [*sent[:3], "b1"], 4, 0)
    [a1] = q.pop(1, semantics=ALO)
    assert looks(q) == (1, (ids[3], 0), ["b1"], 1, 2)  # a2, a3 wait for a1
    [b1] = q.pop(10, semantics=ALO)
    assert b1.payload == "b1" and looks(q) == (0, None, [], 0, 2)
    st = q.stats()
    assert (st.in_flight, st.extra["lag_messages"]) == (2, 4)
    assert q.pop(10, semantics=ALO) == []  # what the observers said
    assert q.ack([a1]) == 1
    assert looks(q) == (2, (ids[1], 0), ["a2", "a3"], 2, 0)
    run = q.pop(10, semantics=ALO)
    assert payloads(run) == ["a2", "a3"]
    assert q.ack(run[1:]) == 1  # a2 stays leased again (the lease is split): the lane stays held
    q.push("a4", key=a)
    assert looks(q) == (0, None, [], 0, 1)
    assert q.nack(run[:1], delay=0.5) == 1  # a2 waits out its delay: held still
    due = time.monotonic() + 0.5
    st = q.stats()
    assert (st.delayed, st.extra["blocked"], st.ready) == (1, 1, 0) and looks(q)[0] == 0
    assert q.pop(10, semantics=ALO) == [] or time.monotonic() >= due
    time.sleep(max(0.0, due - time.monotonic()) + 0.1)
    assert looks(q) == (2, (run[0].id, 1), ["a2", "a4"], 2, 0)
    last = q.pop(10, semantics=ALO)
    assert [(m.payload, m.delivery) for m in last] == [("a2", 2), ("a4", 1)]
    assert q.ack([b1, *last]) == 3 and drained(q)
    got = [a1, b1, run[1], *last]
    # A lease past its end holds nothing for the observers: the next pop reclaims it, then takes its
    # lane (the message due again first).
    c = keyed_ring(dbq, "o2", max_attempts=5)
    c.reclaim_every = 0.0
    c.push_batch(["c1", "c2"], keys=[a, a])
    [c1] = c.pop(1, semantics=ALO, visibility_timeout=0.2)
    assert looks(c) == (0, None, [], 0, 1)
    time.sleep(0.3)
    assert looks(c)[:2] == (2, (c1.id, 1))  # c1 (its lease ran out, an attempt left) and c2
    again = c.pop(10, semantics=ALO)
    assert [(m.payload, m.delivery) for m in again] == [("c1", 2), ("c2", 1)] and c.ack(again) == 2
    assert drained(c) and checksum(payloads(again)) == checksum(["c1", "c2"])
    assert sorted(m.id for m in got)[:4] == ids and checksum(payloads(got)) == checksum([*sent, "a4"])


def test_ring_observers_on_a_group_count_its_own_holds(dbq: DbQueue) -> None:
    q = keyed_ring(dbq)
    g = q.add_group("g", start="earliest")
    a, b = keys_in_lanes(q)[0], keys_in_lanes(q)[1]
    sent = ["a1", "a2", "b1"]
    q.push_batch(sent, keys=[a, a, b])
    [m] = q.pop(1, semantics=ALO)
    assert m.payload == "a1"
    assert looks(q)[::2] == (1, ["b1"], 1)
    assert looks(g)[::2] == (3, sent, 0)  # the group's lanes are held by its own leases only
    got = g.pop(10, semantics=ALO)
    assert g.ack(got) == 3 and checksum(payloads(got)) == checksum(sent)
    assert q.ack([m]) == 1 and looks(q)[0] == 2
    rest = q.pop(10, semantics=ALO)
    assert q.ack(rest) == 2 and checksum(payloads([m, *rest])) == checksum(sent) and drained(q)


def test_ring_without_ordering_keeps_its_counts(dbq: DbQueue) -> None:
    """A ring without ordering per key shows no blocked figure: its pops hold no lane past their commit."""
    q = dbq.create_queue("plain", design="ring", layout="rows", capacity=64, lanes=4)
    sent = ["p1", "p2", "p3"]
    q.push_batch(sent)
    [m] = q.pop(1, semantics=ALO)
    st = q.stats()
    assert (st.ready, st.in_flight, q.count_ready()) == (2, 1, 2) and "blocked" not in st.extra
    rest = q.pop(10, semantics=ALO)
    assert q.ack([m, *rest]) == 3 and checksum(payloads([m, *rest])) == checksum(sent) and drained(q)


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
RING_LANES = 16
RING_CAPACITY = 16384  # 4 segments of 256 pushes (a push ordered per key takes a row a lane)


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
@pytest.mark.parametrize("design", ["table", "ring"])
def test_per_key_order_under_producers_consumers_and_sigkills(  # noqa: PLR0912, PLR0915
    dbq: DbQueue, tmp_path: Path, design: str
) -> None:
    """Long on purpose: one scenario told in order, checked at the end as test_crash's are.

    Four producers push batches of 100 over 1,000 keys shared between them while it runs; four consumers
    pop and ack
    at least once while four victims, one after another, pop a batch and are SIGKILLed holding it. Every
    message is acked, none is lost or changed (count, checksum); a victim's messages come back after
    their leases expire; and no message is handed out before an ack of the message of its key pushed
    before it has at least started (the clock of the log is the machine's monotonic clock, shared by the
    processes): a key's messages are processed one at a time, in push order. On the ring (rows layout,
    16 lanes) a pop may hand out several messages of a key together, in push order, to one consumer
    (its lane's run): a message first handed out in a pop that also handed out (again, perhaps) the
    earlier one of its key, after it, is in order too.
    """
    ring = {"design": "ring", "layout": "rows", "capacity": RING_CAPACITY, "lanes": RING_LANES}
    q = dbq.create_queue(
        CRASH_QUEUE,
        ordering="per_key",
        visibility_timeout=VT,
        max_attempts=50,
        **(ring if design == "ring" else {}),  # type: ignore[arg-type]
    )
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
    first_in: dict[int, tuple[str, int]] = {}  # id -> that pop (its consumer, its time)
    pop_ids: dict[tuple[str, int], set[int]] = {}  # a pop (its consumer, its time) -> the ids it gave
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
                if design == "table":
                    assert len({key for _, _, key, _ in msgs}) == len(msgs), (
                        "two messages of a key in one pop"
                    )
                else:  # a lane's run: a key's messages in push (id) order
                    for key in {key for _, _, key, _ in msgs}:
                        of_key = [mid for mid, _, k, _ in msgs if k == key]
                        assert of_key == sorted(of_key), "a key's messages out of order in one pop"
                pop_ids[p.name or "", at] = {mid for mid, _, _, _ in msgs}
                for mid, _delivery, key, h in msgs:
                    assert pushed[mid] == (key, h), f"message {mid} came back changed"
                    if mid not in first_pop or at < first_pop[mid]:
                        first_pop[mid] = at
                        first_in[mid] = (p.name or "", at)
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
        and not (design == "ring" and earlier in pop_ids[first_in[later]])
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
