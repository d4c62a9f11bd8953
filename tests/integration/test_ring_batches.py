"""Batches on rings: what the ring design adds to the batch conformance tests of test_batches.py.

A stateful property test drives a small ring with two consumer groups (its default one and a group
``g``) through pushes, batch claims, acks and releases and plain pops, on each layout. After every step
it checks that no push overwrote a slot, or emptied a segment, of an open batch of either group (each
open batch reads, by its batch query, exactly the payloads it claimed), and that the ring is full
exactly where the model says. Slots: a push succeeds when its last number lies less than a capacity
above the lowest number some group still needs, an open batch's first message included. Rows: a push
that needs a new segment (the first row of a generation past the first four) succeeds when every message
of the segment it empties was finished by every group and each group's lanes are past it by a lane's
width. A full ring raises QueueFullError having pushed nothing. The other tests: a batch read after its
lease expired and its slot was overwritten, or its segment emptied and reused, reads no payload; a
dropped group takes its batches with it; two groups each claim every message once, in batches of their
own.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import TYPE_CHECKING, Any, ClassVar

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from airflow_dbqueue.engine import BatchNotFoundError, BatchState, LeaseExpiredError, QueueFullError
from tests.helpers import checksum

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Queue

pytestmark = pytest.mark.integration

GROUPS = ("default", "g")


def read(pg_dsn: str, query: str) -> list[tuple[Any, ...]]:
    """Run a batch query as a foreign reader (Spark's JDBC source) does: its text, as it is."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        return c.execute(query.encode()).fetchall()


class RingBatchMachine(RuleBasedStateMachine):
    """A small ring and a model of what each group still needs: the ids it has not finished (claimed in
    an open batch, or not taken yet), for its default group and a group ``g``. Slots (``layout``): 3 to 8
    slots. Rows: 4 segments of 2 or 3 rows; each push is one row, and a message's id is its row's number
    shifted left 16 bits, plus its place in the row."""

    dbq: ClassVar[DbQueue]
    pg_dsn: ClassVar[str]
    layout: ClassVar[str] = "slots"
    _names = itertools.count()
    full_under_a_batch: ClassVar[int] = 0
    """Pushes refused while the floor was an open batch's first message (the case the test is for)."""
    full_under_a_group_batch: ClassVar[int] = 0
    """Of those, the pushes refused while that batch was group ``g``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = GROUPS
        self.handles: dict[str, Queue] = {}
        self.cap = 0
        self.seg = self.lanes = 0  # rows: a segment's rows, and the lanes
        self.next_number = 1  # slots: the next number; rows: the next row
        self.payloads: dict[int, int] = {}
        self.unfinished: dict[str, set[int]] = {g: set() for g in self.groups}
        self.taken: dict[str, set[int]] = {
            g: set() for g in self.groups
        }  # rows: the ids each group's lanes gave
        self.open: dict[str, list[tuple[str, list[int]]]] = {g: [] for g in self.groups}
        self.finished: dict[str, list[int]] = {g: [] for g in self.groups}
        self.counter = itertools.count()

    @initialize(cap=st.integers(3, 8), lanes=st.integers(1, 3))
    def make(self, cap: int, lanes: int) -> None:
        name = f"rb{next(self._names)}"
        settings: dict[str, Any] = {"visibility_timeout": 3600, "max_attempts": 100}
        if self.layout == "rows":
            self.seg = 2 if cap < 7 else 3  # small segments: many rotations within a run
            self.cap, self.lanes, self.next_number = 4 * self.seg, max(1, min(lanes, self.seg // 2)), 0
            settings |= {"layout": "rows", "capacity": self.cap, "lanes": self.lanes}
        else:
            self.cap = cap
            settings |= {"layout": "slots", "capacity": cap, "lanes": min(lanes, cap)}
        q = self.dbq.create_queue(name, design="ring", **settings)
        q.push_timeout = 0.0  # type: ignore[attr-defined]  # a full ring answers at once
        self.handles = {"default": q, "g": q.add_group("g")}  # type: ignore[attr-defined]

    def floor(self) -> int:
        """The lowest number some group still needs: the model of the ring's floor (slots)."""
        return min((min(u) for u in self.unfinished.values() if u), default=self.next_number)

    def batch_firsts(self) -> list[int]:
        return [ids[0] for g in self.groups for _, ids in self.open[g]]

    def fits(self, k: int) -> bool:
        """Whether a push of k messages fits, by the model; counts a refusal under an open batch."""
        if self.layout == "slots":
            if self.next_number + k - 1 < self.floor() + self.cap:
                return True
            if self.batch_firsts() and min(self.batch_firsts()) == self.floor():
                RingBatchMachine.full_under_a_batch += 1
                if any(ids[0] == self.floor() for _, ids in self.open["g"]):
                    RingBatchMachine.full_under_a_group_batch += 1
            return False
        r, s = self.next_number, self.seg
        if r < 4 * s or r % s:
            return True  # its segment holds its generation already
        gen = r // s
        old = range((gen - 4) * s, (gen - 3) * s)  # the rows of the segment it would empty
        # each group's lanes' floor: the row of the first message they have not given yet (FIFO, one
        # consumer a group); every group must be past the segment, and have finished its messages
        if all(
            min((i >> 16 for i in self.payloads if i not in self.taken[g]), default=r)
            >= (gen - 3) * s + self.lanes
            and not any(i >> 16 in old for i in self.unfinished[g])
            for g in self.groups
        ):
            return True
        if any(i >> 16 in old for i in self.batch_firsts()):
            RingBatchMachine.full_under_a_batch += 1
            if any(ids[0] >> 16 in old for _, ids in self.open["g"]):
                RingBatchMachine.full_under_a_group_batch += 1
        return False

    @rule(k=st.integers(2, 3))
    def push(self, k: int) -> None:
        """A push of a batch, which checks the ring's room before it takes numbers: a full ring takes
        none. (A push of one into the slots layout takes its number first, and a full ring leaves it as
        a gap, which holds the floor until it is given up: test_ring_stateful models that.)"""
        payloads = [next(self.counter) for _ in range(k)]
        q = self.handles["default"]
        if not self.fits(k):
            with pytest.raises(QueueFullError):
                q.push_batch(payloads)
            if self.layout == "slots":
                assert q.stats().extra["push_position"] == self.next_number - 1  # nothing taken
            return  # rows: the next push's ids (checked there) show that nothing was taken
        ids = q.push_batch(payloads)
        if self.layout == "slots":
            assert ids == list(range(self.next_number, self.next_number + k))
            self.next_number += k
        else:
            assert ids == [(self.next_number << 16) | j for j in range(k)]
            self.next_number += 1
        for i, p in zip(ids, payloads, strict=True):
            self.payloads[i] = p
            for g in self.groups:
                self.unfinished[g].add(i)

    @precondition(lambda self: self.layout == "rows")
    @rule()
    def fill(self) -> None:
        """Rows: push until the ring refuses one (at most a segment's worth), so that runs come round
        the ring often, with batches open."""
        for _ in range(self.seg):
            if not self.fits(2):
                break
            self.push(2)
        self.push(2)

    @rule(data=st.data(), n=st.integers(1, 5))
    def claim(self, data: st.DataObject, n: int) -> None:
        group = data.draw(st.sampled_from(self.groups))
        batch = self.handles[group].claim_batch(n, consumer=f"spark.{group}")
        taken = {i for _, ids in self.open[group] for i in ids}
        ready = sorted(self.unfinished[group] - taken)
        if batch is None:
            assert ready == []
            return
        ids = [i for i, _ in batch.receipts]
        assert ids == ready[:n]  # the lowest ready ids, FIFO (a released batch's come back first)
        self.open[group].append((batch.batch_id, ids))
        self.taken[group].update(ids)

    @precondition(lambda self: any(self.open.values()))
    @rule(data=st.data(), ack=st.booleans())
    def finish(self, data: st.DataObject, ack: bool) -> None:
        group = data.draw(st.sampled_from([g for g in self.groups if self.open[g]]))
        batch_id, ids = self.open[group].pop(data.draw(st.integers(0, len(self.open[group]) - 1)))
        q = self.handles[group]
        if ack:
            assert q.ack_batch(batch_id) == len(ids)
            self.unfinished[group] -= set(ids)
            self.finished[group] += [self.payloads[i] for i in ids]
        else:
            assert q.release_batch(batch_id, delay=0) == len(ids)
        assert q.get_batch(batch_id).state is (BatchState.ACKED if ack else BatchState.RELEASED)

    @rule(data=st.data(), n=st.integers(1, 4))
    def pop_and_ack(self, data: st.DataObject, n: int) -> None:
        group = data.draw(st.sampled_from(self.groups))
        q = self.handles[group]
        got = q.pop(n, semantics="at-least-once")
        assert q.ack(got) == len(got)
        taken = {i for _, ids in self.open[group] for i in ids}
        assert [m.id for m in got] == sorted(self.unfinished[group] - taken)[:n]
        assert [m.payload for m in got] == [self.payloads[m.id] for m in got]
        self.unfinished[group] -= {m.id for m in got}
        self.finished[group] += [m.payload for m in got]
        self.taken[group].update(m.id for m in got)

    @invariant()
    def open_batches_read_what_they_claimed(self) -> None:
        for group, batches in self.open.items():
            for batch_id, ids in batches:
                rows = read(self.pg_dsn, self.handles[group].batch_query(batch_id))
                assert [(r[1], json.loads(bytes(r[3]))) for r in rows] == [(i, self.payloads[i]) for i in ids]
                assert [r[0] for r in rows] == list(range(1, len(ids) + 1))

    @invariant()
    def the_floor_is_the_models(self) -> None:
        if not self.handles:
            return
        stats = self.handles["default"].stats()
        if self.layout == "slots":
            assert stats.extra["floor"] == self.floor()
            return
        for g in self.groups:  # each group's open batches' messages are in flight, the rest unfinished ready
            stats = self.handles[g].stats()
            in_flight = sum(len(ids) for _, ids in self.open[g])
            assert (stats.in_flight, stats.ready) == (in_flight, len(self.unfinished[g]) - in_flight)

    def teardown(self) -> None:
        """Every group's batches end and what is left is popped: each group finished every message
        pushed once (counted and checksummed)."""
        if not self.handles:
            return
        for group, q in self.handles.items():
            for batch_id, _ in self.open[group]:
                q.release_batch(batch_id, delay=0)
            while got := q.pop(self.cap):
                self.finished[group] += [m.payload for m in got]
            pushed = [self.payloads[i] for i in sorted(self.payloads)]
            assert len(self.finished[group]) == len(pushed)
            assert checksum(self.finished[group]) == checksum(pushed)
        self.dbq.drop_queue(self.handles["default"].name)


@pytest.mark.parametrize("layout", ["slots", "rows"])
def test_no_push_overwrites_a_slot_or_empties_a_segment_of_an_open_batch(
    dbq: DbQueue, pg_dsn: str, layout: str
) -> None:
    RingBatchMachine.dbq = dbq
    RingBatchMachine.pg_dsn = pg_dsn
    RingBatchMachine.layout = layout
    RingBatchMachine.full_under_a_batch = RingBatchMachine.full_under_a_group_batch = 0
    run_state_machine_as_test(
        RingBatchMachine,
        settings=settings(
            max_examples=25 if layout == "slots" else 15,  # rows: its fill rule makes longer runs
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    assert RingBatchMachine.full_under_a_batch > 0, "no push met a ring held full by an open batch"
    assert RingBatchMachine.full_under_a_group_batch > 0, "no push met a ring held full by group g's batch"


@pytest.mark.parametrize("layout", ["slots", "rows"])
def test_a_slot_overwritten_or_a_segment_reused_after_the_lease_expired_reads_no_payload(
    dbq: DbQueue, pg_dsn: str, layout: str
) -> None:
    """A batch whose lease ran out while its job still ran: its messages went to another consumer, who
    finished them, and pushes reused their slots (slots), or their segment was emptied and refilled
    (rows). The batch's reader then gets no payload for them (not the new messages of those slots or
    that segment), and the batch is refused at ack."""
    shape: dict[str, Any] = {"layout": "slots", "capacity": 4, "lanes": 1}
    if layout == "rows":
        shape = {"layout": "rows", "capacity": 8, "lanes": 1}
    q = dbq.create_queue("orders", design="ring", visibility_timeout=0.2, **shape)
    q.push_timeout = 0.0  # type: ignore[attr-defined]
    ids = q.push_batch(["a", "b"])
    batch = q.claim_batch(2)
    assert batch is not None
    time.sleep(0.3)
    again = q.pop(2, semantics="at-least-once")  # reclaims the expired lease first
    assert [m.payload for m in again] == ["a", "b"] and q.ack(again) == 2
    rows = read(pg_dsn, q.batch_query(batch.batch_id))  # still there: nothing reused them yet
    assert [(r[0], r[1], json.loads(bytes(r[3]))) for r in rows] == [(1, ids[0], "a"), (2, ids[1], "b")]
    sent = ["c", "d", "e", "f"]
    if layout == "slots":
        q.push_batch(sent)  # 5 and 6 take the slots of 1 and 2
    else:
        # rows 1 to 7 fill the ring's 4 segments of 2 rows; once popped, row 8 empties the segment of
        # row 0 (the batch's) and is written in it
        sent = [f"r{r}" for r in range(1, 8)]
        for p in sent:
            q.push_batch([p])
        popped = [m.payload for _ in range(4) for m in q.pop(10)]  # a pop reads up to two segments
        assert popped == sent
        sent = ["c", "d", "e", "f"]
        assert q.push_batch(sent) == [(8 << 16) | k for k in range(4)]
        assert q.stats().extra["segment_generations"] == [4, 1, 2, 3]
    rows = read(pg_dsn, q.batch_query(batch.batch_id))
    assert [(r[0], r[1], r[3]) for r in rows] == [(1, ids[0], None), (2, ids[1], None)]
    with pytest.raises(LeaseExpiredError):
        q.ack_batch(batch.batch_id)
    assert [m.payload for m in q.pop(4)] == sent


@pytest.mark.parametrize("layout", ["slots", "rows"])
def test_dropping_a_group_drops_its_batches_only(dbq: DbQueue, pg_dsn: str, layout: str) -> None:
    """A group's batches go with it (rows: with its own ledger tables); the default group's stay."""
    q = dbq.create_queue("orders", design="ring", layout=layout, capacity=16 if layout == "slots" else 64)
    g = q.add_group("g")  # type: ignore[attr-defined]
    q.push_batch(list(range(6)))
    mine, theirs = q.claim_batch(3), g.claim_batch(3)
    assert mine is not None and theirs is not None
    assert [b.batch_id for b in g.open_batches()] == [theirs.batch_id]
    assert [b.batch_id for b in q.open_batches()] == [mine.batch_id]
    with pytest.raises(BatchNotFoundError):
        q.get_batch(theirs.batch_id)  # each group's batches are its own
    ledgers = [q._own() + "b", g._own() + "b"] if layout == "rows" else ["batches"]  # type: ignore[attr-defined]
    q.drop_group("g")
    with psycopg.connect(pg_dsn) as c:
        left = c.execute(f'SELECT batch_id::text FROM "{dbq.schema}".{ledgers[0]}').fetchall()
        gone = [c.execute("SELECT to_regclass(%s)", [f'"{dbq.schema}".{t}']).fetchone() for t in ledgers[1:]]
    assert left == [(mine.batch_id,)]
    assert gone == [(None,)] * (len(ledgers) - 1)  # rows: the group's ledger table went with it
    assert q.ack_batch(mine.batch_id) == 3


@pytest.mark.parametrize("layout", ["slots", "rows"])
def test_two_groups_each_claim_every_message_once(dbq: DbQueue, pg_dsn: str, layout: str) -> None:
    """One ring of orders feeds two pipelines through two groups: each claims batches of its own at its
    own pace, reads them by batch query and acks them with its results in one transaction, and gets every
    order exactly once (counted and checksummed), whatever the other group does. (Rows: the ring holds
    256 pushes of up to 100 orders, room for all of them.)"""
    q = dbq.create_queue("orders", design="ring", layout=layout, capacity=256)
    rollup, fraud = q, q.add_group("fraud")  # type: ignore[attr-defined]  # the default group rolls up
    sent = [{"order": i, "amount": i % 97} for i in range(600)]
    got: dict[str, list[Any]] = {"rollup": [], "fraud": []}
    pushed = 0
    while pushed < len(sent) or any(h.stats().ready for h in (rollup, fraud)):
        if pushed < len(sent):
            room = 256 - q.stats().extra["ring_used"] if layout == "slots" else 100
            if room > 0:
                q.push_batch(sent[pushed : pushed + min(room, 100)])
                pushed += min(room, 100)
        for name, handle, size in (("rollup", rollup, 70), ("fraud", fraud, 45)):
            batch = handle.claim_batch(size)
            if batch is None:
                continue
            rows = read(pg_dsn, handle.batch_query(batch.batch_id))
            with dbq.transaction() as conn:
                assert handle.ack_batch(batch.batch_id, conn=conn) == len(rows)
                got[name] += [json.loads(bytes(r[3])) for r in rows]
    for name, payloads in got.items():
        assert len(payloads) == len(sent) and checksum(payloads) == checksum(sent), name
    for handle in (rollup, fraud):
        assert (handle.stats().ready, handle.stats().in_flight) == (0, 0)
    if layout == "slots":
        assert q.stats().extra["ring_used"] == 0


@pytest.mark.parametrize("group", [None, "g", "rows", "rows.g"])
def test_a_claim_gets_past_a_push_that_rolled_back(dbq: DbQueue, group: str | None) -> None:
    """A push that rolled back after taking its numbers leaves them unwritten at the head of the lanes;
    a claim (in a transaction, where a pop gives no gap up) has a pop of the group outside it give them
    up, so the first claim gets the messages behind them. ``rows``: a ring of the rows layout with one
    lane, whose claim gives up the row a push rolled back once every transaction older than its first
    look has ended (at once here); ``rows.g``: that ring's group ``g``."""
    rows = group is not None and group.startswith("rows")
    layout = {"layout": "rows", "lanes": 1} if rows else {"layout": "slots", "lanes": 2}
    q = dbq.create_queue("orders", design="ring", capacity=64, **layout)
    handle = q.add_group("g") if group in ("g", "rows.g") else q  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError), dbq.transaction() as conn:
        q.push_batch(["lost1", "lost2"], conn=conn)
        raise RuntimeError("rolled back")
    sent = [f"m{i}" for i in range(5)]
    ids = q.push_batch(sent)
    batch = dbq.queue("orders").claim_batch(10) if group == "rows" else handle.claim_batch(10)  # a new handle
    assert batch is not None and [i for i, _ in batch.receipts] == ids
    assert ids == ([(1 << 16) | k for k in range(5)] if rows else [3, 4, 5, 6, 7])
    assert handle.ack_batch(batch.batch_id) == 5
    if not rows:
        assert handle.stats().extra["gaps_skipped"] == 2
    assert handle.stats().ready == 0
