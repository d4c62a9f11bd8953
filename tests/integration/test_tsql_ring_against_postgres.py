"""The SQL Server ring against PostgreSQL's, step by step, without a SQL Server.

The same random steps (pushes of batches and of one, pushes that roll back after taking their numbers,
pops in the three semantics, pops while another transaction holds some or all of the lanes, acks and
nacks of whole leases and of parts, leases expired and reclaimed or left expired for readiness to count
and pops to reclaim, gap recovery, failed messages requeued) go through ``RingQueue`` twice: on
PostgreSQL (its real functions), and on the SQL Server dialect, whose named queries run on the T-SQL
interpreter of tests/tsql.py (the procedures of the SQL Server ``schema.sql`` as written). After each
step both must have answered the same (messages with their payloads, attempts and deliveries, counts,
errors) and hold the same ring: every slot's number and payload, every lane's position, every lease
(range, lanes' starts, messages), retry row and failed message, and the same stats. At the end both
queues are dropped, and their handles must fail alike. What the interpreter leaves out is said in
tests/tsql.py (one session, no concurrency: lanes another transaction holds are rows it says are locked,
and that transaction never lets go, so a pop that waits for them times out on both sides). Only what is
the dialect's by design differs: the gap proof's list (transactions on PostgreSQL, push lanes on SQL
Server) and times.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from psycopg import sql

from airflow_dbqueue.engine import DbQueue, DbQueueError, FailedMessage, Message
from airflow_dbqueue.engine.models import QueueSettings
from airflow_dbqueue.engine.ring import RingQueue
from tests import tsql
from tests.dialects import expire_leases, run_sql
from tests.helpers import checksum

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

pytestmark = pytest.mark.integration

STATE = {
    "slots": "SELECT slot, seq, payload FROM {schema}.ring_slots WHERE queue_id = %(q)s ORDER BY slot",
    "lanes": "SELECT lane, pos FROM {schema}.ring_lanes WHERE queue_id = %(q)s ORDER BY lane",
    "leases": "SELECT lo, hi, n, starts FROM {schema}.ring_leases WHERE queue_id = %(q)s ORDER BY lo",
    "retry": "SELECT id, state, attempts, deliveries FROM {schema}.ring_retry WHERE queue_id = %(q)s "
    "ORDER BY id",
    "failed": "SELECT id, attempts, payload FROM {schema}.ring_failed WHERE queue_id = %(q)s ORDER BY id",
}


class _RolledBack(Exception):
    """Raised to end a transaction with a rollback."""


class Side:
    """One dialect's ring, and what its consumers hold leased."""

    def __init__(self, dbq: DbQueue, q: RingQueue, server: tsql.Server | None = None) -> None:
        self.dbq, self.q, self.server = dbq, q, server
        self.leased: list[Message] = []
        q.push_timeout = 0.0  # a full ring answers at once: both sides see it full at the same step
        q.reclaim_every_s = 0.0  # every pop at least once reclaims first, on both sides

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, text in STATE.items():
            rows = [list(r) for r in run_sql(self.dbq, text, {"q": self.q.settings.queue_id})]
            if name == "leases":  # starts: a bigint[] on PostgreSQL, a JSON array on SQL Server
                for r in rows:
                    r[3] = json.loads(r[3]) if isinstance(r[3], str) else list(r[3])
            if name in ("slots", "failed"):
                for r in rows:
                    r[-1] = None if r[-1] is None else bytes(r[-1])
            out[name] = rows
        stats = self.q.stats()
        extra = {k: v for k, v in stats.extra.items() if k != "lag_seconds"}  # a time, as oldest_ready_age_s
        out["stats"] = (stats.ready, stats.delayed, stats.in_flight, stats.failed, extra)
        return out

    def hold(self, lanes: list[int], pg_dsn: str) -> Callable[[], None]:
        """Another transaction holds ``lanes`` (as a pop between its take and its commit); return what
        ends it."""
        qid = self.q.settings.queue_id
        if self.dbq.dialect == "postgresql":
            conn = psycopg.connect(pg_dsn)
            conn.execute(
                sql.SQL(
                    "SELECT lane FROM {}.ring_lanes WHERE queue_id = %s AND lane = ANY(%s) FOR UPDATE"
                ).format(sql.Identifier(self.dbq.schema)),
                (qid, lanes),
            )
            return conn.close  # a rollback
        server = self.server
        assert server is not None
        for lane in lanes:
            server.lock("ring_lanes", (qid, lane), "U")
        return server.others.clear

    def lapse(self) -> None:
        """Run every open lease out (whole ring_leases rows and leased retry rows), reclaiming none."""
        past = (
            "now() - interval '1 second'"
            if self.dbq.dialect == "postgresql"
            else "DATEADD(second, -1, SYSUTCDATETIME())"
        )
        q = {"q": self.q.settings.queue_id}
        run_sql(self.dbq, f"UPDATE {{schema}}.ring_leases SET lease_until = {past} WHERE queue_id = %(q)s", q)
        run_sql(
            self.dbq,
            f"UPDATE {{schema}}.ring_retry SET due_at = {past} WHERE queue_id = %(q)s AND state = 2",
            q,
        )

    def drop(self) -> None:
        """Drop the queue (on SQL Server, but for the drop's lock: see tsql.drop_queue)."""
        if self.dbq.dialect == "postgresql":
            assert self.dbq.drop_queue(self.q.name)
        else:
            tsql.drop_queue(self.dbq.db, self.q.settings.queue_id)

    def abandon(self, n: int) -> Any:
        """A push of ``n`` messages through the engine in a transaction that rolls back: the numbers it
        took are never written (a ring without room for the batch takes none, and the push answers
        QueueFullError). Returns what the push answered."""
        answer: Any = None
        try:
            with self.dbq.transaction() as conn:
                answer = outcome(lambda: self.q.push_batch([{"lost": i} for i in range(n)], conn=conn))
                raise _RolledBack
        except _RolledBack:
            pass
        return answer


def msg(m: Message) -> tuple[Any, ...]:
    return (m.id, m.payload, m.attempts, m.delivery)


def failed(f: FailedMessage) -> tuple[Any, ...]:
    return (f.id, f.payload, f.attempts, f.last_error)


def outcome(call: Callable[[], Any]) -> Any:
    """What a call answered, or the engine's error it raised (by type)."""
    try:
        got = call()
    except DbQueueError as exc:
        return type(exc).__name__
    if isinstance(got, list) and got and isinstance(got[0], Message):
        return [msg(m) for m in got]
    return got


@pytest.fixture
def sides(
    dbq: DbQueue, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[int, int, int], tuple[Side, Side]]]:
    """Rings of the same settings, made by create_queue, on PostgreSQL and on the interpreted SQL
    Server."""

    def make(seed: int, capacity: int, lanes: int) -> tuple[Side, Side]:
        made = []
        for side in (dbq, DbQueue("mssql://u:p@h/db", schema="dbq")):
            server = None
            if side.dialect == "mssql":
                server = tsql.ring_server(tsql.schema_blocks())
                tsql.InterpretedSqlServer(server).attach(monkeypatch, side.db)
            q = side.create_queue(
                f"r{seed}",
                design="ring",
                capacity=capacity,
                lanes=lanes,
                max_attempts=3,
                visibility_timeout=3600,
            )
            assert isinstance(q, RingQueue)
            made.append(Side(side, q, server))
        pg, ms = made
        settings: QueueSettings = pg.q.settings
        assert ms.q.settings == settings  # the same queue id too: each is the first of its schema
        return pg, ms

    yield make


STEPS = ["push", "push", "push_one", "abandon", "pop", "pop", "pop_lease", "pop_lease", "pop_own"]
STEPS += ["ack", "ack_part", "nack", "expire", "lapse", "recover", "peek", "requeue", "held"]
SEMANTICS = {"pop": "at-most-once", "pop_lease": "at-least-once", "pop_own": "exactly-once"}


def no_unwritten_numbers(state: dict[str, Any], capacity: int) -> bool:
    """Whether every number from the lowest lane position to the push position is written (or given
    up): then no pop meets a gap, so none lists the holders of the gap proof, which differ by design
    while another transaction holds lanes (its transaction on PostgreSQL, no push lane on SQL Server)."""
    seq = {slot: number for slot, number, _ in state["slots"]}
    low = min(pos for _, pos in state["lanes"])
    return all(seq[x % capacity] >= x for x in range(low, state["stats"][4]["push_position"] + 1))


@pytest.mark.parametrize("seed", range(12))
def test_random_steps_answer_and_leave_the_same_ring_on_both_dialects(  # noqa: PLR0912, PLR0915
    seed: int, sides: Callable[[int, int, int], tuple[Side, Side]], pg_dsn: str
) -> None:
    """Nothing is lost either: every payload pushed was finished once (popped at most or exactly once, or
    acked), or is failed, or comes out of the ring when it is drained at the end.

    Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around.
    """
    rng = random.Random(seed)
    capacity = rng.choice([4, 6, 8, 12])
    pg, ms = sides(seed, capacity, rng.randint(1, min(capacity, 4)))
    gap_timeout = rng.choice([0.0, 1e9])  # forced at the second sighting, or only with the proof
    for side in (pg, ms):
        side.q.gap_timeout = gap_timeout
    pushed: list[Any] = []
    finished: list[Any] = []
    log: list[str] = []

    def same(answers: list[Any]) -> Any:
        assert answers[0] == answers[1], "\n".join(log)
        return answers[0]

    for _ in range(45):
        step = rng.choice(STEPS)
        log.append(step)
        if step in ("push", "push_one"):
            size = 1 if step == "push_one" else rng.randint(1, 4)
            payloads = [{"n": len(pushed) + i, "s": "x" * rng.randint(0, 30)} for i in range(size)]
            got = same([outcome(lambda s=s, p=payloads: s.q.push_batch(p)) for s in (pg, ms)])
            if isinstance(got, list):
                pushed += payloads
        elif step == "abandon":
            k = rng.randint(1, 2)
            same([s.abandon(k) for s in (pg, ms)])
        elif step.startswith("pop") or step == "held":
            n = rng.randint(1, 6)
            semantics = SEMANTICS[step if step != "held" else rng.choice(list(SEMANTICS))]
            held: list[int] = []
            if step == "held":
                if not no_unwritten_numbers(pg.state(), capacity):
                    continue
                lanes = pg.q.lanes
                # Some lanes, or every one (a pop that may wait then waits 1 s, and times out).
                held = rng.sample(range(lanes), lanes if rng.random() < 0.3 else rng.randint(1, lanes))
                log[-1] += f" {held} {semantics} {n}"
            answers = []
            for s in (pg, ms):
                end = s.hold(held, pg_dsn) if held else None
                try:
                    if semantics == "exactly-once":
                        with s.dbq.transaction() as conn:
                            got = s.q.pop(n, semantics=semantics, conn=conn)
                    else:
                        got = s.q.pop(n, semantics=semantics)
                finally:
                    if end is not None:
                        end()
                if semantics == "at-least-once":
                    s.leased += got
                answers.append([msg(m) for m in got])
            got = same(answers)
            if semantics != "at-least-once":
                finished += [m[1] for m in got]
        elif step in ("ack", "ack_part", "nack", "expire") and pg.leased:
            k = len(pg.leased) if step == "ack" else rng.randint(1, len(pg.leased))
            chosen = set(rng.sample(range(len(pg.leased)), k))
            answers = []
            for s in (pg, ms):
                these = [m for i, m in enumerate(s.leased) if i in chosen]
                s.leased = [m for i, m in enumerate(s.leased) if i not in chosen]
                if step.startswith("ack"):
                    answers.append(outcome(lambda s=s, these=these: s.q.ack(these)))
                elif step == "nack":
                    answers.append(outcome(lambda s=s, these=these: s.q.nack(these, delay=0, error="no")))
                else:
                    expire_leases(s.dbq, [m.id for m in these], s.q)
                    answers.append(outcome(s.q.reclaim_expired))
            if same(answers) == len(these) and step.startswith("ack"):
                finished += [m.payload for m in these]
        elif step == "lapse":
            # Every open lease runs out and nobody reclaims it yet (its consumers were killed): readiness
            # counts its messages at once, as a pop would get them.
            for s in (pg, ms):
                s.lapse()
                s.leased.clear()
            same([(s.q.count_ready(), s.q.readiness()) for s in (pg, ms)])
        elif step == "recover":
            same([outcome(lambda s=s: s.q.recover_gaps(wait=0.5)) for s in (pg, ms)])
        elif step == "peek":
            same([(outcome(lambda s=s: s.q.peek(4)), s.q.count_ready(), s.q.readiness()) for s in (pg, ms)])
        elif step == "requeue":
            same([([failed(f) for f in s.q.list_failed()], outcome(s.q.requeue_failed)) for s in (pg, ms)])
        log[-1] += f": {pg.state()['stats']}"
        assert pg.state() == ms.state(), "\n".join(log)
    # The leases still open end; then both rings are drained, handing out the same messages.
    for s in (pg, ms):
        if s.leased:
            expire_leases(s.dbq, [m.id for m in s.leased], s.q)
            s.leased.clear()
    same([outcome(s.q.reclaim_expired) for s in (pg, ms)])
    failures = same([[failed(f) for f in s.q.list_failed(capacity * 4)] for s in (pg, ms)])
    for _ in range(4 * capacity):
        got = same([outcome(lambda s=s: s.q.pop(capacity)) for s in (pg, ms)])
        if not got:
            break
        finished += [m[1] for m in got]
    assert pg.state() == ms.state()
    assert pg.q.stats().ready == 0 and pg.q.stats().in_flight == 0
    assert len(finished) + len(failures) == len(pushed)
    assert checksum(finished + [f[1] for f in failures]) == checksum(pushed)
    # Dropped: a push and a pop through the old handles find the queue gone (the procedures' DQ004 on
    # SQL Server, the functions' on PostgreSQL), a pop in the caller's transaction takes nothing.
    for s in (pg, ms):
        s.drop()
    assert same([outcome(lambda s=s: s.q.push({"late": 1})) for s in (pg, ms)]) == "QueueNotFoundError"
    assert same([outcome(lambda s=s: s.q.push_batch([1, 2])) for s in (pg, ms)]) == "QueueNotFoundError"
    assert same([outcome(lambda s=s: s.q.pop(3)) for s in (pg, ms)]) == "QueueNotFoundError"

    def own(s: Side) -> Any:
        with s.dbq.transaction() as conn:
            return outcome(lambda: s.q.pop(3, semantics="exactly-once", conn=conn))

    assert same([own(s) for s in (pg, ms)]) == []
