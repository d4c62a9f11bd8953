"""Stateful property-based test: a small ring against a model, through wraps, gaps and leases.

Hypothesis interleaves pushes (committed, or rolled back after taking their numbers: gaps), pops under
all three semantics (exactly-once committed or rolled back), acks, nacks, lease expiries (a clock jump)
and drains, on rings of 2 to 6 slots, so that nearly every step wraps the ring or finds it full.

What must hold: ids are the push numbers in order (a rolled-back push spends its numbers); a pop
returns the lowest ready ids, in order, with their payloads, never a finished one; a push that the
model says fits (every predecessor a capacity back is finished) succeeds, and one that may not fit
either succeeds or raises QueueFullError having pushed nothing; depth by state always matches; and a
drain after every lease is settled delivers every ready message, so nothing is lost behind a gap.

It runs on PostgreSQL, and on SQL Server when ``$DBQUEUE_TEST_MSSQL_DSN`` names one (skipped
otherwise): the clock jump rewrites the leases' due times with each dialect's SQL (the conformance
suite's ``expire_leases``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, ClassVar

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

from airflow_dbqueue.engine import QueueFullError
from tests.dialects import dialect_dbq  # noqa: F401 - dialect_dbq is the fixture "dbq"
from tests.integration.test_conformance import expire_leases

if TYPE_CHECKING:
    from airflow_dbqueue.engine import DbQueue, Message
    from airflow_dbqueue.engine.ring import RingQueue

pytestmark = pytest.mark.integration

READY, HELD, DONE, FAILED = "ready", "held", "done", "failed"

SETTINGS = settings(
    max_examples=30, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclasses.dataclass
class Entry:
    id: int
    payload: int
    attempts: int = 0
    state: str = READY
    lease: Message | None = None


class _Rollback(Exception):
    pass


class RingMachine(RuleBasedStateMachine):
    dbq: ClassVar[DbQueue]
    _names = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.q: RingQueue | None = None
        self.cap = 0
        self.max_attempts = 0
        self.next_number = 1
        self.entries: dict[int, Entry] = {}
        self.gaps: set[int] = set()
        self.payloads = itertools.count()

    @property
    def queue(self) -> RingQueue:
        assert self.q is not None
        return self.q

    def _in(self, state: str) -> list[Entry]:
        return sorted((e for e in self.entries.values() if e.state == state), key=lambda e: e.id)

    @initialize(cap=st.integers(2, 6), max_attempts=st.sampled_from([1, 3]))
    def create(self, cap: int, max_attempts: int) -> None:
        self.cap, self.max_attempts = cap, max_attempts
        q = self.dbq.create_queue(
            f"r{next(self._names)}",
            design="ring",
            capacity=cap,
            max_attempts=max_attempts,
            visibility_timeout=600.0,
            retry_backoff=0.0,
            retry_backoff_max=0.0,
        )
        self.q = q  # type: ignore[assignment]
        self.queue.push_timeout = 0.05
        self.queue.reclaim_every_s = 3600.0  # reclaim only when the test says so

    # -- push --------------------------------------------------------------------------------------

    def _fits(self, k: int) -> bool:
        """Whether every predecessor (a capacity back) of the next k numbers is finished for sure."""
        for x in range(self.next_number, self.next_number + k):
            prev = x - self.cap
            if prev >= 1 and not (prev in self.entries and self.entries[prev].state in (DONE, FAILED)):
                return False
        return True

    @precondition(lambda self: self.q is not None)
    @rule(data=st.data())
    def push(self, data: st.DataObject) -> None:
        k = data.draw(st.integers(1, self.cap))
        payloads = [next(self.payloads) for _ in range(k)]
        fits = self._fits(k)
        numbers = list(range(self.next_number, self.next_number + k))
        # On PostgreSQL a batch finds the ring full before it takes numbers when the slot of its highest
        # number holds a message not finished; a push of one (ring_push_one) and SQL Server's push take
        # their numbers first, and a full ring leaves them as gaps.
        prev = self.entries.get(numbers[-1] - self.cap)
        takes_first = (
            k == 1 or self.dbq.dialect != "postgresql" or prev is None or prev.state in (DONE, FAILED)
        )
        try:
            ids = self.queue.push_batch(payloads)
        except QueueFullError:
            assert not fits, "a push that fits raised QueueFullError"
            if takes_first:
                self.gaps.update(numbers)
                self.next_number += k
            return
        self.next_number += k
        assert ids == numbers, (ids, numbers)
        for i, p in zip(ids, payloads, strict=True):
            self.entries[i] = Entry(i, p)

    @precondition(lambda self: self.q is not None)
    @rule(k=st.integers(1, 2))
    def push_rolled_back(self, k: int) -> None:
        if not self._fits(k):
            return  # it could wait for the whole push timeout; the push rule covers full rings
        with pytest.raises(_Rollback), self.dbq.transaction() as conn:
            ids = self.queue.push_batch(list(range(k)), conn=conn)
            assert ids == list(range(self.next_number, self.next_number + k))
            raise _Rollback
        self.gaps.update(range(self.next_number, self.next_number + k))
        self.next_number += k

    # -- pop ---------------------------------------------------------------------------------------

    def _check_prefix(self, msgs: list[Message]) -> list[Entry]:
        ready = self._in(READY)
        assert [m.id for m in msgs] == [e.id for e in ready[: len(msgs)]], "not the lowest ready ids in order"
        for m, e in zip(msgs, ready, strict=False):
            assert (m.payload, m.attempts) == (e.payload, e.attempts + 1)
        return ready[: len(msgs)]

    @precondition(lambda self: self.q is not None)
    @rule(
        how=st.sampled_from(["at-most-once", "at-least-once", "eo-commit", "eo-rollback"]),
        n=st.integers(1, 4),
    )
    def pop(self, how: str, n: int) -> None:
        if how.startswith("eo"):
            try:
                with self.dbq.transaction() as conn:
                    msgs = self.queue.pop(n, semantics="exactly-once", conn=conn)
                    taken = self._check_prefix(msgs)
                    if how == "eo-rollback":
                        raise _Rollback
            except _Rollback:
                return
            for e in taken:
                e.state = DONE
            return
        msgs = self.queue.pop(n, semantics=how)
        taken = self._check_prefix(msgs)
        for m, e in zip(msgs, taken, strict=True):
            e.attempts += 1
            if how == "at-least-once":
                e.state, e.lease = HELD, m
            else:
                e.state = DONE

    # -- finish ------------------------------------------------------------------------------------

    @precondition(lambda self: self.q is not None and self._in(HELD))
    @rule(data=st.data(), op=st.sampled_from(["ack", "nack", "expire"]))
    def finish(self, data: st.DataObject, op: str) -> None:
        held = self._in(HELD)
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, unique_by=lambda e: e.id))
        msgs = [e.lease for e in chosen if e.lease is not None]
        if op == "ack":
            assert self.queue.ack(msgs) == len(chosen)
        elif op == "nack":
            assert self.queue.nack(msgs, delay=0) == len(chosen)
        else:
            expire_leases(self.dbq, [e.id for e in chosen], self.queue)
            assert self.queue.reclaim_expired() == len(chosen)
        for e in chosen:
            e.lease = None
            if op == "ack":
                e.state = DONE
            else:
                e.state = FAILED if e.attempts >= self.max_attempts else READY

    @precondition(lambda self: self.q is not None)
    @rule()
    def drain(self) -> None:
        """Settle every lease, then pop until empty: every ready message comes out, in id order."""
        held = self._in(HELD)
        if held:
            assert self.queue.ack([e.lease for e in held if e.lease is not None]) == len(held)
            for e in held:
                e.state, e.lease = DONE, None
        want = [e.id for e in self._in(READY)]
        got: list[int] = []
        for _ in range(len(want) + 3):
            got += [m.id for m in self.queue.pop(self.cap)]
        assert got == want, "a ready message was not delivered (lost behind a gap?)"
        for i in got:
            self.entries[i].state = DONE
            self.entries[i].attempts += 1

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def depth_matches(self) -> None:
        if self.q is None:
            return
        s = self.q.stats()
        assert (s.ready, s.delayed, s.in_flight, s.failed) == (
            len(self._in(READY)),
            0,
            len(self._in(HELD)),
            len(self._in(FAILED)),
        )
        assert s.extra["push_position"] == self.next_number - 1
        assert s.extra["pop_position"] <= min(
            (e.id for e in self._in(READY) + self._in(HELD)), default=10**18
        )
        assert [(f.id, f.payload) for f in self.q.list_failed(limit=1000)] == [
            (e.id, e.payload) for e in self._in(FAILED)
        ]


def test_ring_matches_model(dbq: DbQueue) -> None:
    RingMachine.dbq = dbq
    try:
        run_state_machine_as_test(RingMachine, settings=SETTINGS)
    finally:
        del RingMachine.dbq
