"""Consumer groups on a ring: each group sees every message at its own pace, with its own positions,
leases, retries and failed messages, and no push overwrites a message that some group still needs.

On PostgreSQL; SQL Server's procedures of the same names run the same steps on the T-SQL interpreter
against PostgreSQL's (tests/integration/test_tsql_ring_against_postgres.py, and
tests/unit/test_mssql_ring_procedures.py). Every test counts and checksums what went in and what each
group got.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from airflow_dbqueue import cli
from airflow_dbqueue.engine import (
    BatchState,
    ConfigurationError,
    DbQueue,
    GroupExistsError,
    GroupNotFoundError,
    LeaseExpiredError,
    QueueFullError,
    QueueNotFoundError,
)
from airflow_dbqueue.engine.models import DEFAULT_GROUP, OnLag
from tests.helpers import checksum, child_processes, held_horizon
from tests.integration.test_conformance import drain
from tests.integration.test_ring_rows import _flush_stats, _write_counts

if TYPE_CHECKING:
    from collections.abc import Callable

    from airflow_dbqueue.engine.ring import RingQueue

pytestmark = pytest.mark.integration


LAYOUTS = pytest.mark.parametrize("layout", ["slots", "rows"])
"""The tests so marked run on a ring of each layout: the slots layout (capacity in messages, ids from 1)
and the rows layout (capacity in pushes, a multiple of 4 and at least 8 * lanes; a push of k messages
is one row, its ids ``(row << 16) | 0 .. k - 1``)."""


def ring(dbq: DbQueue, name: str = "events", layout: str = "slots", **settings: Any) -> RingQueue:
    q = dbq.create_queue(name, design="ring", layout=layout, **settings)
    return q  # type: ignore[return-value]


@LAYOUTS
def test_each_group_gets_every_message_once_in_order(dbq: DbQueue, layout: str) -> None:
    """Three groups (the default one, one at least once, one at most once) each get all 500 messages,
    in id order, once; the default group's pops do not take anything from the others. (0.5 s)"""
    q = ring(dbq, layout=layout, capacity=64 if layout == "slots" else 32, lanes=4)
    audit, export = q.add_group("audit"), q.add_group("export")
    assert [g.name for g in q.groups()] == [DEFAULT_GROUP, "audit", "export"]
    sent = list(range(500))
    got: dict[str, list[Any]] = {DEFAULT_GROUP: [], "audit": [], "export": []}
    ids: dict[str, list[int]] = {k: [] for k in got}
    pushed: list[int] = []
    # The slots ring holds 64 messages, the rows ring 32 pushes (segments of 8, emptied 12 times over):
    # every group must keep up.
    step = 50 if layout == "slots" else 5
    for first in range(0, len(sent), step):
        pushed += q.push_batch(sent[first : first + step])
        for name, handle, how in ((DEFAULT_GROUP, q, "at-most-once"), ("audit", audit, "at-least-once")):
            for m in drain(handle, how, n=7):
                got[name].append(m.payload)
                ids[name].append(m.id)
        for m in export.pop(50) + export.pop(50):
            got["export"].append(m.payload)
            ids["export"].append(m.id)
    for name, payloads in got.items():
        assert (len(payloads), checksum(payloads)) == (len(sent), checksum(sent)), name
        assert ids[name] == pushed, name
    rows = [(r << 16) | k for r in range(100) for k in range(5)]
    assert pushed == (list(range(1, 501)) if layout == "slots" else rows)
    if layout == "rows":  # the ring went round: its segments were emptied and labelled again
        assert min(q.stats().extra["segment_generations"]) >= 9
    for handle in (q, audit, export):
        assert handle.stats().ready == 0


@LAYOUTS
def test_a_push_never_overwrites_a_message_a_group_still_needs(dbq: DbQueue, layout: str) -> None:
    """A group that lags holds the ring's floor: once the ring is full the next push waits and fails,
    though the default group took everything; a pop of the lagging group makes room; dropping it frees
    the ring at once. The lagging group gets every message intact. On the rows layout, room is a
    segment: the lagging group must pass one (by a lane's width) before it is emptied. (1 s)"""
    if layout == "rows":
        _rows_push_never_empties_a_segment_a_group_still_needs(dbq)
        return
    q = ring(dbq, capacity=8, lanes=2)
    slow = q.add_group("slow")
    q.push_timeout = 0.3
    first = [f"m{i}" for i in range(8)]
    q.push_batch(first)
    assert [m.payload for m in q.pop(8)] == first  # the default group is done with all of them
    late = ["late0", "late1"]
    with pytest.raises(QueueFullError):
        q.push_batch(late)  # a batch takes its numbers only when there is room: it took none
    assert q.stats().extra["floor"] == 1
    assert [m.payload for m in slow.pop(2)] == ["m0", "m1"]  # the slots of numbers 1 and 2 are free
    assert q.push_batch(late) == [9, 10]
    with pytest.raises(QueueFullError):
        q.push_batch(["x", "y"])
    rest = [m.payload for m in drain(slow, "at-least-once", n=3)]
    assert rest == [*first[2:], *late]
    assert q.drop_group("slow") is True
    more = [f"n{i}" for i in range(6)]
    assert q.push_batch(more) == list(range(11, 17))  # only the default group holds the floor (9)
    assert [m.payload for m in drain(q)] == late + more


@LAYOUTS
def _rows_push_never_empties_a_segment_a_group_still_needs(dbq: DbQueue) -> None:
    q = ring(dbq, layout="rows", capacity=16, lanes=2)  # four segments of 4 pushes
    slow = q.add_group("slow")
    q.push_timeout = 0.3
    first = [f"m{i}" for i in range(16)]
    for payload in first:  # 16 pushes of one: rows 0 to 15, every segment labelled from the start
        q.push(payload)
    assert [m.payload for m in drain(q)] == first  # the default group is done with all of them
    with pytest.raises(QueueFullError):
        q.push("late0")  # row 16 needs segment 0 (rows 0 to 3), which the slow group still needs
    assert [m.payload for m in slow.pop(6)] == first[:6]  # its lanes at rows 6 and 7: past segment 0
    late = ["late0", "late1", "late2", "late3"]
    assert [q.push(p) for p in late] == [r << 16 for r in range(16, 20)]
    with pytest.raises(QueueFullError):
        q.push("x")  # row 20 needs segment 1 (rows 4 to 7): the slow group is at row 6
    rest = [m.payload for m in drain(slow, "at-least-once", n=3)]
    assert rest == [*first[6:], *late]
    assert q.drop_group("slow") is True
    more = [f"n{i}" for i in range(6)]
    assert [q.push(p) for p in more] == [r << 16 for r in range(20, 26)]  # only the default group holds it
    assert [m.payload for m in drain(q)] == late + more


def _drain_until(q: Any, payload: str, timeout: float) -> list[Any]:
    """Every payload popped (at most once) until ``payload`` came or ``timeout`` seconds passed."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while True:
        out += [m.payload for m in drain(q)]
        if payload in out or time.monotonic() >= deadline:
            return out
        time.sleep(0.05)


@LAYOUTS
def test_a_groups_open_batch_holds_the_ring_until_it_is_acked(dbq: DbQueue, layout: str) -> None:
    """A group's open batch holds its messages' place in the ring as its leases do: with everything else
    taken by both groups, a push that needs the batch's slots (slots), or the segment of its rows (rows),
    is refused with QueueFullError until the group acks the batch; then it goes in. Counted and
    checksummed per group."""
    q = ring(dbq, layout=layout, capacity=8 if layout == "slots" else 16, lanes=1 if layout == "slots" else 2)
    q.push_timeout = 0.0
    g = q.add_group("g")
    sent = [f"m{i}" for i in range(8 if layout == "slots" else 16)]
    for p in sent:  # slots: numbers 1 to 8; rows: rows 0 to 15, one message each, every segment labelled
        q.push(p)
    batch = g.claim_batch(2)
    assert batch is not None
    got = {"default": [m.payload for m in drain(q)], "g": [m.payload for m in drain(g)]}
    with pytest.raises(QueueFullError):
        q.push("late")  # its slot, or the segment it needs, still holds g's open batch
    assert g.get_batch(batch.batch_id).state is BatchState.CLAIMED
    assert g.ack_batch(batch.batch_id) == 2
    got["g"] += sent[:2]  # the batch's messages, acked
    # The refused push may have taken its number before it found the slot taken (a push of one takes
    # it first): that number stays issued and unwritten, a gap at the head of both groups, which a pop
    # gives up once every transaction that was running when it saw the gap has ended, or after
    # gap_timeout. Another session's transaction with an xid stays open here (on a busy server one
    # may be), so the gap is given up by the timeout: "late" comes within it, not at once.
    q.gap_timeout = g.gap_timeout = 0.5
    holder = held_horizon(dbq.db.dsn, xid=True)
    try:
        q.push("late")
        got["default"] += _drain_until(q, "late", 10.0)
        got["g"] += _drain_until(g, "late", 10.0)
    finally:
        holder.close()
    for name, payloads in got.items():
        assert sorted(payloads) == sorted([*sent, "late"]) and checksum(payloads) == checksum(
            [*sent, "late"]
        ), name


@LAYOUTS
def test_start_now_or_earliest(dbq: DbQueue, layout: str) -> None:
    """A group added with start="now" sees what is pushed after it; one added with "earliest" also what
    some group has not taken yet. (0.3 s)"""
    q = ring(dbq, layout=layout, capacity=16 if layout == "slots" else 32, lanes=4)
    q.push_batch(["a", "b", "c", "d", "e"])
    assert [m.payload for m in q.pop(2)] == ["a", "b"]
    now, earliest = q.add_group("now"), q.add_group("earliest", start="earliest")
    q.push_batch(["f", "g"])
    assert [m.payload for m in drain(now)] == ["f", "g"]
    assert [m.payload for m in drain(earliest)] == ["c", "d", "e", "f", "g"]
    assert [m.payload for m in drain(q)] == ["c", "d", "e", "f", "g"]


@LAYOUTS
def test_leases_retries_and_failures_are_each_groups_own(dbq: DbQueue, layout: str) -> None:
    """A nack in one group delivers the message again in that group only; acks name a group's own
    receipts; a group's failed messages are its own; stats are each group's. (0.3 s)"""
    q = ring(
        dbq, layout=layout, capacity=16, lanes=2, max_attempts=2, retry_backoff=0.0, retry_backoff_max=0.0
    )
    g = q.add_group("g")
    pushed = q.push_batch(["x", "y", "z"])
    mine = q.pop(3, semantics="at-least-once")
    theirs = g.pop(3, semantics="at-least-once")
    assert [m.id for m in mine] == [m.id for m in theirs] == pushed
    assert q.stats().in_flight == 3 and g.stats().in_flight == 3
    assert q.ack(mine) == 3
    assert (q.stats().in_flight, g.stats().in_flight) == (0, 3)
    assert g.nack(theirs[:1], delay=0) == 1
    assert q.pop(3) == []
    again = g.pop(3, semantics="at-least-once")
    assert [(m.id, m.attempts) for m in again] == [(pushed[0], 2)]
    assert g.nack(again, delay=0, error="bad") == 1  # its second attempt: failed, in g only
    assert [(f.id, f.payload) for f in g.list_failed()] == [(pushed[0], "x")]
    assert q.list_failed() == []
    assert g.ack(theirs[1:]) == 2
    stats = g.stats()
    assert (stats.ready, stats.in_flight, stats.failed) == (0, 0, 1)
    assert stats.extra["group"] == "g" and stats.extra["lag_messages"] == 0
    with pytest.raises(ConfigurationError, match="every group"):
        g.requeue_failed()
    assert g.delete_failed() == 1


@LAYOUTS
def test_stats_show_each_groups_lag_in_messages_and_seconds(dbq: DbQueue, layout: str) -> None:
    q = ring(dbq, layout=layout, capacity=32 if layout == "slots" else 64)
    g = q.add_group("g")
    q.push_batch(list(range(10)))
    time.sleep(0.2)
    assert len(q.pop(10)) == 10
    assert len(g.pop(4, semantics="at-least-once")) == 4
    mine, theirs = q.stats().extra, g.stats().extra
    assert (mine["group"], mine["lag_messages"], mine["lag_seconds"]) == (DEFAULT_GROUP, 0, 0.0)
    assert theirs["group"] == "g" and theirs["lag_messages"] == 10  # 6 to take, 4 leased
    assert theirs["lag_seconds"] >= 0.2
    if layout == "slots":  # the slots ring's positions are message numbers (the rows ring's: groups())
        assert theirs["pop_position"] > mine["floor"] == 1
    else:
        assert [g.pop_position for g in q.groups()] == [1 << 16, 4]  # past row 0 (lane 1 next), in it


@LAYOUTS
def test_pop_takes_group_and_bad_groups_are_refused(dbq: DbQueue, layout: str) -> None:
    """pop(group=) and pop_payloads(group=) pop for the group; unknown names, names taken, bad names and
    options, the default group's drop and groups on a table-design queue each raise an error that names
    them, and change nothing. (0.2 s)"""
    q = ring(dbq, layout=layout)
    q.add_group("fraud")
    q.add_group("audit")
    q.push_batch(["a", "b"])
    assert [m.payload for m in q.pop(2, group="fraud")] == ["a", "b"]
    assert [m.payload for m in q.pop(2, group=DEFAULT_GROUP)] == ["a", "b"]
    assert q.pop_payloads(5, group="audit") == ["a", "b"]
    with pytest.raises(GroupNotFoundError, match="'nope'"):
        q.pop(group="nope")
    with pytest.raises(GroupNotFoundError, match="'nope'"):
        q.pop_payloads(group="nope")
    with pytest.raises(GroupNotFoundError, match="'nope'"):
        q.drop_group("nope")
    assert q.drop_group("nope", missing_ok=True) is False
    with pytest.raises(GroupExistsError, match="'fraud'"):
        q.add_group("fraud")
    for bad in ("", "a b", DEFAULT_GROUP, "x" * 64, "-x", None):
        with pytest.raises(ConfigurationError, match="group name"):
            q.add_group(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="start"):
        q.add_group("g", start="latest")
    with pytest.raises(ConfigurationError, match="on_lag"):
        q.add_group("g", on_lag="ignore")
    with pytest.raises(ConfigurationError, match="lag_timeout"):
        q.add_group("g", lag_timeout=0)
    with pytest.raises(ConfigurationError, match="cannot be dropped"):
        q.drop_group(DEFAULT_GROUP)
    stale = dbq.queue("events").group("fraud")
    with DbQueue(dbq.db.dsn, schema=dbq.schema) as other:  # another process drops it and adds it again
        other.queue("events").drop_group("fraud")  # type: ignore[attr-defined]
        other.queue("events").add_group("fraud")  # type: ignore[attr-defined]
    with pytest.raises(GroupNotFoundError, match="'fraud'"):
        stale.pop(1)
    q.push("c")
    assert [m.payload for m in q.pop(1, group="fraud")] == ["c"]  # the new group, looked up again
    assert [g.name for g in q.groups()] == [DEFAULT_GROUP, "audit", "fraud"]
    table = dbq.create_queue("tasks")
    with pytest.raises(ConfigurationError, match="ring design"):
        table.pop(group="fraud")
    with pytest.raises(ConfigurationError, match="ring design"):
        table.group("fraud")


@LAYOUTS
def test_maintenance_warns_about_or_drops_a_group_nobody_pops(
    dbq: DbQueue, caplog: pytest.LogCaptureFixture, layout: str
) -> None:
    """A group that has messages to take and has not moved for its lag timeout: on_lag="block" keeps it
    with a warning, "drop_group" drops it (and the floor rises); a group that pops, or has nothing to
    take, is left alone. (1 s)"""
    q = ring(dbq, layout=layout, capacity=16 if layout == "slots" else 64)
    q.add_group("stuck", lag_timeout=0.3)
    q.add_group("gone", on_lag="drop_group", lag_timeout=0.3)
    busy = q.add_group("busy", on_lag=OnLag.DROP_GROUP, lag_timeout=0.3)
    q.add_group("idle", on_lag="drop_group", lag_timeout=0.3)
    q.push_batch(list(range(6)))
    drain(q)
    drain(q.group("idle"))
    first = q.maintain()
    assert (first["groups_lagging"], first["groups_dropped"]) == (0, 0)  # each seen moving first
    time.sleep(0.4)
    assert [m.payload for m in busy.pop(2)] == [0, 1]
    with caplog.at_level(logging.WARNING, logger="airflow_dbqueue.engine.ring"):
        report = q.maintain()
    assert (report["groups_lagging"], report["groups_dropped"]) == (2, 1)
    assert [g.name for g in q.groups()] == [DEFAULT_GROUP, "busy", "idle", "stuck"]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "consumer group stuck has not popped" in warned and "on_lag=block" in warned
    assert "consumer group gone has not popped" in warned and "dropping it" in warned
    figures = dbq.maintenance().metrics()["queues"]["events"]["groups"]
    assert sorted(figures) == ["busy", "idle", "stuck"]  # the default group's are the queue's own
    assert figures["stuck"]["lag_messages"] == 6 and figures["stuck"]["idle_s"] >= 0.4
    assert (figures["idle"]["lag_messages"], figures["busy"]["lag_messages"]) == (0, 4)
    assert [m.payload for m in drain(q.group("stuck"))] == list(range(6))
    assert [m.payload for m in drain(busy)] == [2, 3, 4, 5]


@LAYOUTS
def test_a_group_that_took_everything_is_not_dropped_for_a_push_that_rolled_back(
    dbq: DbQueue, layout: str
) -> None:
    """A push that rolled back leaves its number issued and unwritten. A group that has taken every
    message and not moved since is not lagging: maintenance gives the number up before it looks at the
    groups, and the group stays (on_lag="drop_group"). (1 s)"""
    q = ring(dbq, layout=layout, capacity=16 if layout == "slots" else 64)
    q.add_group("caught_up", on_lag="drop_group", lag_timeout=0.3)
    pushed = q.push_batch(list(range(3)))
    assert [m.payload for m in drain(q.group("caught_up"))] == [0, 1, 2]
    assert q.maintain()["groups_lagging"] == 0  # seen moving
    with pytest.raises(RuntimeError), dbq.db.transaction() as conn:  # type: ignore[attr-defined]
        q.push(99, conn=conn)
        raise RuntimeError("the caller's transaction rolls back")
    time.sleep(0.4)
    report = q.maintain()
    assert (report["gaps_skipped"], report["groups_lagging"], report["groups_dropped"]) == (1, 0, 0)
    assert [g.name for g in q.groups()] == [DEFAULT_GROUP, "caught_up"]
    assert [m.payload for m in drain(q)] == [0, 1, 2] and pushed == (
        [1, 2, 3] if layout == "slots" else [0, 1, 2]
    )
    q.push(3)
    assert [m.payload for m in drain(q.group("caught_up"))] == [3]


@LAYOUTS
def test_two_groups_at_different_speeds_under_concurrency(dbq: DbQueue, layout: str) -> None:  # noqa: PLR0915
    """Two producers push 3,000 messages into a ring of 128; the default group's two consumers pop
    batches at most once, the slow group's two pop small batches at least once, acking each after a
    pause, and nack every 50th batch once. Back-pressure follows the slow group. Each group gets every
    message: at most once, none twice; at least once, every one acked once (those nacked come
    again). Counts and checksums per group. The rows ring holds 32 pushes (800 messages), in segments
    of 8 emptied as both groups pass them. (about 5 s; one scenario, its threads and its checks read
    best in one function)"""
    capacity = 128 if layout == "slots" else 32
    q = ring(dbq, layout=layout, capacity=capacity, lanes=4, retry_backoff=0.0, retry_backoff_max=0.0)
    slow = q.add_group("slow")
    q.push_timeout = 30.0
    total, producers = 3000, 2
    sent = [[f"{p}:{i}" for i in range(total // producers)] for p in range(producers)]
    fast_got: list[list[str]] = [[], []]
    slow_acked: list[list[str]] = [[], []]
    slow_nacked: list[list[str]] = [[], []]
    done = threading.Event()
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        for first in range(0, len(sent[p]), 25):
            q.push_batch(sent[p][first : first + 25])

    def fast(c: int) -> None:
        while not (done.is_set() and q.stats().ready == 0):
            msgs = q.pop(100)
            fast_got[c] += [m.payload for m in msgs]
            if not msgs:
                time.sleep(0.005)

    def slow_consumer(c: int) -> None:
        batches = 0
        while not (done.is_set() and slow.stats().extra["lag_messages"] == 0):
            msgs = slow.pop(10, semantics="at-least-once")
            if not msgs:
                time.sleep(0.005)
                continue
            batches += 1
            time.sleep(0.002)
            if batches % 50 == 0 and all(m.attempts == 1 for m in msgs):
                slow.nack(msgs, delay=0)
                slow_nacked[c] += [m.payload for m in msgs]
            else:
                slow.ack(msgs)
                slow_acked[c] += [m.payload for m in msgs]

    def guard(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(produce, p)) for p in range(producers)]
    consumers = [threading.Thread(target=guard, args=(fast, c)) for c in range(2)]
    consumers += [threading.Thread(target=guard, args=(slow_consumer, c)) for c in range(2)]
    for t in threads + consumers:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    for t in consumers:
        t.join(120)
    assert not errors, errors
    everything = [m for part in sent for m in part]
    fast_all = fast_got[0] + fast_got[1]
    assert (len(fast_all), checksum(fast_all)) == (total, checksum(everything))
    acked = slow_acked[0] + slow_acked[1]
    assert (len(acked), checksum(acked)) == (total, checksum(everything))
    nacked = slow_nacked[0] + slow_nacked[1]
    assert nacked and set(nacked) <= set(everything) and len(set(nacked)) == len(nacked)


def test_held_horizon_two_groups_of_the_rows_layout_write_no_dead_tuple(dbq: DbQueue) -> None:
    """While a REPEATABLE READ transaction holds the xmin horizon, a ring of the rows layout with two
    groups (the default one at most once, "audit" at least once, acking whole pops, acking and nacking
    parts of pops, and a lease reclaimed) goes round several times: its segments are emptied while both
    groups pass them, and nothing writes a tuple updated, deleted or dead in the ring's tables or the
    group's. Each group gets every message (counted and checksummed). (about 2 s)"""
    q = ring(dbq, layout="rows", capacity=32, lanes=2, max_attempts=3, retry_backoff=0, retry_backoff_max=0)
    q.add_group("audit")
    gid = -min(g for g in (r[0] for r in dbq.db.fetchall("ring_rows_group_ids", {"queue_id": q._qid})))  # type: ignore[attr-defined]
    sent = [{"n": i, "pad": "x" * 40} for i in range(600)]
    holder = held_horizon(dbq.db.dsn, xid=True)
    got: dict[str, list[Any]] = {"default": [], "audit": []}
    gens: list[int] = []

    def churn(one: DbQueue) -> None:
        mine = one.queue("events")
        audit = mine.group("audit")
        for k in range(0, len(sent), 5):  # 120 pushes through a ring of 32: both groups keep up
            mine.push_batch(sent[k : k + 5])
            got["default"] += [m.payload for m in mine.pop(5)]
            while msgs := audit.pop(7, semantics="at-least-once"):
                if msgs[0].attempts == 1 and msgs[0].id % 3 == 0:
                    audit.ack(msgs[:3])
                    audit.nack(msgs[3:])
                    got["audit"] += [m.payload for m in msgs[:3]]
                else:
                    audit.ack(msgs)
                    got["audit"] += [m.payload for m in msgs]
        last = mine.push_batch([{"last": 1}])
        got["default"] += [m.payload for m in mine.pop(1)]
        [m] = audit.pop(1, semantics="at-least-once", visibility_timeout=0.1)
        time.sleep(0.2)
        assert audit.reclaim_expired() == 1
        [again] = audit.pop(1, semantics="at-least-once")
        assert (again.id, again.attempts, [m.id]) == (m.id, 2, last)
        audit.ack([again])
        got["audit"].append(again.payload)
        gens.extend(mine.stats().extra["segment_generations"])

    try:
        _flush_stats(dbq.db.dsn, dbq.schema, churn)
        ring_counts = _write_counts(dbq.db.dsn, dbq.schema, f"ring\\_{q.settings.queue_id}\\_r%")
        group_counts = _write_counts(dbq.db.dsn, dbq.schema, f"ring\\_g{gid}\\_r%")
    finally:
        holder.close()
    for name, payloads in got.items():
        assert (len(payloads), checksum(payloads)) == (len(sent) + 1, checksum([*sent, {"last": 1}])), name
    assert min(gens) >= 12  # the ring went round: every segment emptied and labelled again, thrice or more
    print(f"under the hold (ins, upd, del, dead): ring {ring_counts}, group {group_counts}")
    assert sum(c[0] for n, c in group_counts.items() if n.endswith(("l0", "l1", "l2", "l3"))) > 20  # leases
    assert sum(c[0] for n, c in group_counts.items() if n.endswith(("r0", "r1", "r2", "r3"))) > 20  # retries
    assert sum(c[0] for n, c in ring_counts.items() if "_rpos" in n) > 20  # the default group's positions
    # the group's own 4 x 4 tables and its batch ledger's two; the ring's 4 x 6 (with the emptied
    # segments' totals, written by every rotation), its ledger's two and its deduplication keys' (which
    # pushes without keys never write)
    assert len(group_counts) == 18 and len(ring_counts) == 27
    assert sum(c[0] for n, c in ring_counts.items() if "_remptied" in n) >= 12  # a row a rotation
    changed = {n: c[1:] for n, c in {**ring_counts, **group_counts}.items() if c[1:] != (0, 0, 0)}
    assert changed == {}


def _pop_and_hang(*, dsn: str, schema: str, group: str | None, semantics: str, n: int, report: Any) -> None:
    """Pop ``n`` messages for ``group``, report them, and sleep until killed (a consumer that dies)."""
    try:
        with DbQueue(dsn, schema=schema, pool_size=1) as dbq:
            msgs = dbq.queue("events").pop(n, semantics=semantics, visibility_timeout=1.0, group=group)
            report.put(("popped", [(m.id, m.payload) for m in msgs]))
            time.sleep(300)
    except BaseException:
        report.put(("error", traceback.format_exc()))


@LAYOUTS
def test_sigkilled_consumers_of_two_groups(dbq: DbQueue, layout: str) -> None:
    """Two consumers, one of each group, are SIGKILLed after their pops: the default group's (at most
    once) loses what it popped and nothing comes twice; the audit group's (at least once) held leases,
    whose messages come back once each when they expire. Then each group is drained by a consumer of
    its own: per group, counts and checksums of what was delivered. (about 4 s)"""
    q = ring(
        dbq,
        layout=layout,
        capacity=512,
        lanes=4,
        visibility_timeout=1.0,
        retry_backoff=0.0,
        retry_backoff_max=0.0,
    )
    audit = q.add_group("audit")
    sent = [{"s": i, "v": os.urandom(6).hex()} for i in range(400)]
    pushed = q.push_batch(sent)
    ctx = child_processes()
    popped: dict[str | None, list[tuple[int, Any]]] = {}
    for group, semantics in ((None, "at-most-once"), ("audit", "at-least-once")):
        report: Any = ctx.Queue()  # one a child: a process killed may leave a queue's lock held
        child = ctx.Process(
            target=_pop_and_hang,
            kwargs={
                "dsn": dbq.db.dsn,
                "schema": dbq.schema,
                "group": group,
                "semantics": semantics,
                "n": 50,
                "report": report,
            },
        )
        child.start()
        try:
            kind, got = report.get(timeout=120)
            assert kind == "popped", got
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
            child.join(timeout=30)
            assert child.exitcode == -signal.SIGKILL
        finally:
            if child.is_alive():
                child.kill()
                child.join(10)
        popped[group] = got
    assert [i for i, _ in popped[None]] == [i for i, _ in popped["audit"]] == pushed[:50]
    mine = [m.payload for m in drain(q)]  # the default group: the rest, each once
    assert [p for _, p in popped[None]] + mine == sent
    delivered = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(delivered) < len(sent):
        msgs = audit.pop(100, semantics="at-least-once")
        assert audit.ack(msgs) == len(msgs)
        delivered += msgs
        if not msgs:
            time.sleep(0.1)  # the dead consumer's leases expire after 1 s, and a pop reclaims them
    counts = collections.Counter(m.id for m in delivered)
    assert len(delivered) == len(sent) and max(counts.values()) == 1
    assert checksum(m.payload for m in delivered) == checksum(sent)
    assert {m.id for m in delivered if m.attempts == 2} == set(pushed[:50])
    with pytest.raises(LeaseExpiredError):  # the dead consumer's receipts finish nothing twice
        audit.ack_receipts([(i, 1) for i, _ in popped["audit"]])
    for handle in (q, audit):
        st = handle.stats()
        assert (st.ready, st.in_flight, st.failed) == (0, 0, 0)


# -- the CLI ---------------------------------------------------------------------------------------


@LAYOUTS
def test_the_cli_lists_adds_drops_and_pops_groups(
    dbq: DbQueue, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    """``dbqueue groups`` lists each group with its position, its lag in messages and seconds and its
    on_lag; ``add-group`` and ``drop-group`` change them, and ``pop --group`` pops for one. Bad input is
    an error of the library's family, printed as ``dbqueue: error: ...`` with exit status 2: an unknown
    queue or group, a table-design queue, a bad name, start or on_lag."""
    base = ["--dsn", dbq.db.dsn, "--schema", dbq.schema]

    def run(*args: str) -> tuple[int, list[dict[str, Any]], str]:
        code = cli.main([*base, *args])
        out = capsys.readouterr()
        return code, [json.loads(line) for line in out.out.splitlines()], out.err

    create = ["create", "events", "--design", "ring", "--capacity", "64", "--lanes", "2"]
    assert run(*create, "--layout", layout)[0] == 0
    assert dbq.queue("events").settings.layout == layout
    # a layout for a table queue, a rows ring's capacity that is no multiple of 4, an unknown layout
    for bad in (
        ["create", "t", "--layout", "rows"],
        ["create", "t", "--design", "ring", "--capacity", "66", "--lanes", "2", "--layout", "rows"],
    ):
        code, _, err = run(*bad)
        assert code == 2 and "dbqueue: error:" in err and "t" not in [s.name for s in dbq.list_queues()]
    with pytest.raises(SystemExit):
        run("create", "t", "--design", "ring", "--layout", "cells")
    code, [row], _ = run(
        "add-group", "events", "audit", "--on-lag", "drop_group", "--lag-timeout", "60", "--start", "earliest"
    )
    assert code == 0
    assert (row["group"], row["on_lag"], row["lag_timeout_s"], row["lag_messages"]) == (
        "audit",
        "drop_group",
        60,
        0,
    )
    q = dbq.queue("events")
    pushed = [{"n": i} for i in range(10)]
    assert q.push_batch(pushed) == (list(range(1, 11)) if layout == "slots" else list(range(10)))
    got = q.pop(4)
    code, rows, _ = run("groups", "events")
    assert code == 0
    # Positions: the next message number of the group's lowest lane (slots); its lowest lane's next id,
    # here inside the one row pushed (rows).
    assert [(r["group"], r["pop_position"], r["lag_messages"], r["on_lag"]) for r in rows] == [
        ("default", 5 if layout == "slots" else 4, 6, "block"),
        ("audit", 1 if layout == "slots" else 0, 10, "drop_group"),
    ]
    assert all(r["lag_seconds"] >= 0 for r in rows) and rows[0]["lag_timeout_s"] is None
    assert rows[0]["created_at"] is None and rows[1]["created_at"] is not None
    code, popped, _ = run("pop", "events", "--group", "audit", "-n", "10")
    assert code == 0 and checksum([m["payload"] for m in popped]) == checksum(pushed)
    got += q.pop(10)
    assert checksum([m.payload for m in got]) == checksum(pushed)
    assert [r["lag_messages"] for r in run("groups", "events")[1]] == [0, 0]
    assert run("drop-group", "events", "audit")[:2] == (
        0,
        [{"queue": "events", "group": "audit", "dropped": True}],
    )
    assert [r["group"] for r in run("groups", "events")[1]] == ["default"]
    assert run("drop-group", "events", "audit", "--missing-ok")[1] == [
        {"queue": "events", "group": "audit", "dropped": False}
    ]
    dbq.create_queue("orders")
    for args, words in [
        (("groups", "nope"), "queue 'nope' does not exist in schema"),
        (("groups", "orders"), "queue 'orders' is a table queue: consumer groups need the ring design"),
        (("add-group", "orders", "a"), "consumer groups need the ring design"),
        (("drop-group", "events", "audit"), "queue 'events' has no consumer group 'audit'"),
        (("pop", "events", "--group", "audit"), "queue 'events' has no consumer group 'audit'"),
        (("add-group", "events", "bad name"), "a group name is 1 to 63 letters"),
        (("add-group", "events", "a", "--start", "later"), "start must be 'now' or 'earliest'"),
        (("add-group", "events", "a", "--on-lag", "never"), "unknown on_lag 'never'"),
        (("add-group", "events", "default"), "other than 'default'"),
    ]:
        code, out, err = run(*args)
        assert (code, out) == (2, []), args
        assert err.startswith("dbqueue: error: ") and words in err, (args, err)
    assert [g.name for g in q.groups()] == ["default"] and q.stats().ready == 0


@LAYOUTS
def test_a_dropped_groups_handle_refuses_every_read_with_group_not_found(dbq: DbQueue, layout: str) -> None:
    """What the handle of a dropped group reads fails as its pop does, naming the group: nothing is
    read as an empty queue, and no bare error escapes."""
    ring = dbq.create_queue(
        "dropped_reads", design="ring", layout=layout, capacity=20 if layout == "slots" else 64
    )
    ring.add_group("x")
    handle = ring.group("x")
    ring.push_batch(["a", "b"])
    ring.drop_group("x")
    for read in (handle.stats, handle.peek, handle.list_failed, handle.count_ready, handle.readiness):
        with pytest.raises(GroupNotFoundError, match="'x'"):
            read()
    assert [m.payload for m in ring.peek()] == ["a", "b"]  # the default group's are still there


@LAYOUTS
def test_a_dropped_groups_handle_refuses_acks_pops_and_batches_with_group_not_found(
    dbq: DbQueue, layout: str
) -> None:
    """The handle of a group dropped while it held a lease and an open batch: its acks, nacks, pops,
    claims and batch calls fail naming the group (as its reads do), not as a bare schema error, a lost
    lease or an empty queue; the default group's messages are all still there (counted and checksummed)."""
    ring = dbq.create_queue("dropped_acks", design="ring", layout=layout, capacity=64)
    handle = ring.add_group("x")  # type: ignore[attr-defined]
    sent = [{"n": i} for i in range(6)]
    ring.push_batch(sent)
    leased = handle.pop(2, semantics="at-least-once")
    batch = handle.claim_batch(2)
    assert len(leased) == 2 and batch is not None
    ring.drop_group("x")  # type: ignore[attr-defined]
    calls: dict[str, Callable[[], Any]] = {
        "ack": lambda: handle.ack(leased),
        "nack": lambda: handle.nack(leased),
        "pop": lambda: handle.pop(1),
        "pop at least once": lambda: handle.pop(1, semantics="at-least-once"),
        "pop_payloads": lambda: handle.pop_payloads(1),
        "reclaim_expired": handle.reclaim_expired,
        "claim_batch": lambda: handle.claim_batch(2),
        "get_batch": lambda: handle.get_batch(batch.batch_id),
        "open_batches": handle.open_batches,
        "batch_query": lambda: handle.batch_query(batch.batch_id),
        "ack_batch": lambda: handle.ack_batch(batch.batch_id),
        "release_batch": lambda: handle.release_batch(batch.batch_id),
        "extend_batch": lambda: handle.extend_batch(batch.batch_id, 60),
        "leased": lambda: handle.leased(batch.receipts),
    }
    wrong = {}
    for what, call in calls.items():
        try:
            call()
        except GroupNotFoundError as e:
            assert "'x'" in str(e), what
        except Exception as e:  # every call is tried, then the wrong ones named at once
            wrong[what] = repr(e)[:200]
        else:
            wrong[what] = "no error"
    assert wrong == {}, wrong
    got = [m.payload for m in ring.pop(10)]
    assert len(got) == len(sent) and checksum(got) == checksum(sent)


def test_dropping_a_group_or_the_ring_of_the_rows_layout_drops_their_own_objects(dbq: DbQueue) -> None:
    """A group of the rows layout has its own tables, sequences and functions; drop_group drops them
    (and leaves the ring's and the other group's), dropping the ring drops every group's."""

    def owned(prefix: str) -> int:
        """Relations and functions of the schema whose names start with ``prefix``."""
        with psycopg.connect(dbq.db.dsn, autocommit=True) as c:  # type: ignore[attr-defined]
            row = c.execute(
                "SELECT (SELECT count(*) FROM pg_class r WHERE r.relnamespace = %(s)s::regnamespace"
                "        AND left(r.relname, length(%(p)s)) = %(p)s)"
                "     + (SELECT count(*) FROM pg_proc f WHERE f.pronamespace = %(s)s::regnamespace"
                "        AND left(f.proname, length(%(p)s)) = %(p)s)",
                {"s": dbq.schema, "p": prefix},
            ).fetchone()
        return int(row[0]) if row else 0

    q = ring(dbq, layout="rows", capacity=64)
    a, b = q.add_group("a"), q.add_group("b")
    q.push_batch(["x", "y"])
    assert [m.payload for m in a.pop(2)] == [m.payload for m in b.pop(2)] == ["x", "y"]
    ring_own = owned(f"ring_{q.settings.queue_id}_r")
    mine = {g: owned(f"ring_g{-h._gid}_r") for g, h in (("a", a), ("b", b))}  # type: ignore[attr-defined]
    assert ring_own > 40 and mine["a"] == mine["b"] > 30
    assert q.drop_group("a") is True
    assert owned(f"ring_g{-a._gid}_r") == 0  # type: ignore[attr-defined]
    assert owned(f"ring_g{-b._gid}_r") == mine["b"] and owned(f"ring_{q.settings.queue_id}_r") == ring_own  # type: ignore[attr-defined]
    assert [m.payload for m in drain(q)] == ["x", "y"]
    assert dbq.drop_queue("events") is True
    assert owned(f"ring_g{-b._gid}_r") == owned(f"ring_{q.settings.queue_id}_r") == 0  # type: ignore[attr-defined]


def test_consumer_group_calls_on_a_table_queue_are_configuration_errors(dbq: DbQueue) -> None:
    q = dbq.create_queue("not_a_ring")
    for call in (lambda: q.add_group("g"), q.groups, lambda: q.drop_group("g"), lambda: q.group("g")):
        with pytest.raises(ConfigurationError, match="ring design"):
            call()


@pytest.mark.parametrize("layout", ["slots", "rows"])
def test_reads_of_a_ring_dropped_meanwhile_fail_as_queue_not_found(dbq: DbQueue, layout: str) -> None:
    """Readers in other threads while the ring is dropped (and made again under its name): every read
    either succeeds or raises QueueNotFoundError, never a bare database error."""
    errors: list[str] = []
    stop = threading.Event()

    def read(handle: RingQueue) -> None:
        while not stop.is_set():
            for call in (handle.stats, handle.peek, handle.count_ready, handle.readiness):
                try:
                    call()
                except QueueNotFoundError:
                    pass
                except Exception as exc:  # everything else is what the test looks for
                    errors.append(f"{type(exc).__name__}: {exc}")

    for _ in range(15):
        ring = dbq.create_queue("dropped_under", design="ring", capacity=48, layout=layout)
        ring.push_batch(list(range(10)))
        readers = [threading.Thread(target=read, args=(ring,)) for _ in range(3)]
        for t in readers:
            t.start()
        time.sleep(0.05)
        dbq.drop_queue("dropped_under")
        time.sleep(0.05)
        stop.set()
        for t in readers:
            t.join(30)
        stop.clear()
    assert errors == []


def test_a_dropped_groups_pop_whose_reclaim_is_due_names_the_group(dbq: DbQueue) -> None:
    """A pop on a handle of a group dropped since, when its reclaim of expired leases is due (the first
    thing a pop does), raises GroupNotFoundError naming the group, not a SchemaError about functions the
    group took with it."""
    q = ring(dbq, layout="rows")
    q.add_group("fraud")
    stale = q.group("fraud")
    q.drop_group("fraud")
    stale.reclaim_every = 0.0
    with pytest.raises(GroupNotFoundError, match="'fraud'"):
        stale.pop(1)
