"""The SQL Server ring against PostgreSQL's, step by step, without a SQL Server.

The same random steps (pushes of batches and of one, pushes that roll back after taking their numbers,
pops in the three semantics, pops while another transaction holds some or all of the lanes, acks and
nacks of whole leases and of parts, leases expired and reclaimed or left expired for readiness to count
and pops to reclaim, gap recovery, failed messages requeued, consumer groups added from now or from the
earliest message, dropped, and popped, acked and nacked each at its own pace, batches claimed, read by
the text of their batch query as a foreign reader runs it, acked, released and extended, maintenance) go
through ``RingQueue`` twice: on PostgreSQL (its real functions), and on the SQL Server dialect, whose named
queries run on the T-SQL interpreter of tests/tsql.py (the procedures of the SQL Server ``schema.sql`` as
written). After each step both must have answered the same (messages with their payloads, attempts and
deliveries, counts, errors) and hold the same ring: every slot's number and payload, every lane's
position, every lease (range, lanes' starts, messages), retry row and failed message, of every group,
the groups themselves, and the same stats of each group. At the end both queues are dropped, and their
handles must fail alike. What the interpreter leaves out is said in
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

from airflow_dbqueue.engine import Batch, DbQueue, DbQueueError, FailedMessage, Message
from airflow_dbqueue.engine.models import DEFAULT_GROUP, QueueSettings
from airflow_dbqueue.engine.ring import RingQueue
from tests import tsql
from tests.dialects import expire_leases, run_sql
from tests.helpers import checksum

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

pytestmark = pytest.mark.integration

MINE = "(queue_id = %(q)s OR queue_id < 0)"
"""The rows of the ring's groups: its default group's (its queue id) and the others' (their gids). Each
side's schema holds this one ring, and both hand out the same gids (-1, -2, ...)."""
STATE = {
    "slots": "SELECT slot, seq, payload FROM {schema}.ring_slots WHERE queue_id = %(q)s ORDER BY slot",
    "lanes": f"SELECT queue_id, lane, pos FROM {{schema}}.ring_lanes WHERE {MINE} ORDER BY queue_id, lane",
    "leases": f"SELECT queue_id, lo, hi, n, starts FROM {{schema}}.ring_leases WHERE {MINE} "
    "ORDER BY queue_id, lo",
    "retry": f"SELECT queue_id, id, state, attempts, deliveries FROM {{schema}}.ring_retry WHERE {MINE} "
    "ORDER BY queue_id, id",
    "failed": f"SELECT queue_id, id, attempts, payload FROM {{schema}}.ring_failed WHERE {MINE} "
    "ORDER BY queue_id, id",
    "groups": "SELECT gid, name, on_lag, lag_timeout_s, moved_pos FROM {schema}.ring_groups "
    "WHERE queue_id = %(q)s ORDER BY gid",
}


class _RolledBack(Exception):
    """Raised to end a transaction with a rollback."""


class Side:
    """One dialect's ring, and what its consumers hold leased."""

    def __init__(self, dbq: DbQueue, q: RingQueue, server: tsql.Server | None = None) -> None:
        self.dbq, self.q, self.server = dbq, q, server
        self.groups: dict[str, RingQueue] = {DEFAULT_GROUP: q}  # the handle of each group
        self.leased: dict[str, list[Message]] = {DEFAULT_GROUP: []}
        self.batches: dict[str, list[str]] = {DEFAULT_GROUP: []}  # the ids of each group's batches
        q.push_timeout = 0.0  # a full ring answers at once: both sides see it full at the same step
        q.reclaim_every = 0.0  # every pop at least once reclaims first, on both sides

    def add_group(self, name: str, start: str) -> Any:
        try:
            handle = self.q.add_group(name, start=start)
        except DbQueueError as exc:
            return type(exc).__name__
        handle.reclaim_every = 0.0
        self.groups[name], self.leased[name], self.batches[name] = handle, [], []
        return handle.group_name

    def drop_group(self, name: str) -> Any:
        self.groups.pop(name, None)
        self.leased.pop(name, None)
        self.batches.pop(name, None)
        return outcome(lambda: self.q.drop_group(name))

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, text in STATE.items():
            rows = [list(r) for r in run_sql(self.dbq, text, {"q": self.q.settings.queue_id})]
            if name == "leases":  # starts: a bigint[] on PostgreSQL, a JSON array on SQL Server
                for r in rows:
                    r[4] = json.loads(r[4]) if isinstance(r[4], str) else list(r[4])
            if name in ("slots", "failed"):
                for r in rows:
                    r[-1] = None if r[-1] is None else bytes(r[-1])
            out[name] = rows
        for name, handle in sorted(self.groups.items()):
            stats = handle.stats()
            # lag_seconds is a time, as oldest_ready_age_s
            extra = {k: v for k, v in stats.extra.items() if k != "lag_seconds"}
            out[f"stats {name}"] = (stats.ready, stats.delayed, stats.in_flight, stats.failed, extra)
        # what groups() says of each, but for the times (idle_s, created_at: clocks differ by design)
        out["listed"] = [(g.name, g.on_lag, g.lag_timeout_s, g.pop_position) for g in self.q.groups()]
        return out

    def hold(self, group: str, lanes: list[int], pg_dsn: str) -> Callable[[], None]:
        """Another transaction holds ``lanes`` of ``group`` (as a pop between its take and its commit);
        return what ends it."""
        qid = self.groups[group]._gid
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

    def read_batch(self, group: str, batch_id: str, pg_dsn: str) -> list[tuple[Any, ...]]:
        """A batch's rows as a foreign reader (Spark's JDBC source) gets them: its batch_query's text, run
        as it is; (ord, id, delivery, payload)."""
        text = self.groups[group].batch_query(batch_id)
        if self.server is None:
            with psycopg.connect(pg_dsn, autocommit=True) as c:
                rows = c.execute(text.encode()).fetchall()
        else:
            [rows] = self.server.batch(text)
        return [(int(o), int(i), int(d), None if p is None else bytes(p)) for o, i, d, p in rows]

    def lapse(self) -> None:
        """Run every open lease out (whole ring_leases rows and leased retry rows), reclaiming none."""
        past = (
            "now() - interval '1 second'"
            if self.dbq.dialect == "postgresql"
            else "DATEADD(second, -1, SYSUTCDATETIME())"
        )
        q = {"q": self.q.settings.queue_id}
        run_sql(self.dbq, f"UPDATE {{schema}}.ring_leases SET lease_until = {past} WHERE {MINE}", q)
        run_sql(self.dbq, f"UPDATE {{schema}}.ring_retry SET due_at = {past} WHERE {MINE} AND state = 2", q)

    def drop(self) -> None:
        """Drop the queue (on SQL Server, but for the drop's lock: see tsql.drop_queue)."""
        if self.dbq.dialect == "postgresql":
            assert self.dbq.drop_queue(self.q.name)
        else:
            tsql.drop_queue(self.dbq.db, self.q.settings.queue_id)

    def check_settled(self) -> None:
        """Nothing of any group is left to deliver: no retry row, lease or lane behind the push position."""
        for handle in self.groups.values():
            stats = handle.stats()
            assert (stats.ready, stats.in_flight) == (0, 0), handle.group_name

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
    if isinstance(got, RingQueue):
        return got.group_name
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
                layout="slots",
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
STEPS += ["add_group", "add_group", "drop_group", "maintain"]
STEPS += ["claim", "claim", "batch_read", "batch_ack", "batch_release", "batch_extend"]
SEMANTICS = {"pop": "at-most-once", "pop_lease": "at-least-once", "pop_own": "exactly-once"}
GROUP_NAMES = ["a", "b", "c"]
"""A small pool, so that a name is sometimes taken (GroupExistsError) or gone (GroupNotFoundError)."""


def no_unwritten_numbers(state: dict[str, Any], capacity: int, gid: int) -> bool:
    """Whether every number from the lowest lane position of group ``gid`` to the push position is
    written (or given up): then no pop of it meets a gap, so none lists the holders of the gap proof,
    which differ by design while another transaction holds lanes (its transaction on PostgreSQL, no push
    lane on SQL Server)."""
    seq = {slot: number for slot, number, _ in state["slots"]}
    low = min(pos for g, _, pos in state["lanes"] if g == gid)
    issued = state[f"stats {DEFAULT_GROUP}"][4]["push_position"]
    return all(seq[x % capacity] >= x for x in range(low, issued + 1))


class Ledger:
    """What each consumer group should get: the payloads pushed since it was added, each finished once
    (popped at most or exactly once, or acked), failed, or drained at the end. A group added from the
    earliest message after pushes began may also get some pushed before it: of those, it is only checked
    that it got none twice and none that was not pushed."""

    def __init__(self) -> None:
        self.pushed: list[Any] = []
        self.since: dict[str, int] = {DEFAULT_GROUP: 0}
        self.exact: dict[str, bool] = {DEFAULT_GROUP: True}
        self.finished: dict[str, list[Any]] = {DEFAULT_GROUP: []}

    def add(self, name: str, start: str) -> None:
        self.since[name] = len(self.pushed)
        self.exact[name] = start == "now" or not self.pushed
        self.finished[name] = []

    def drop(self, name: str) -> None:
        for book in (self.since, self.exact, self.finished):
            book.pop(name, None)

    def check(self, name: str, failed: list[Any]) -> None:
        got, want = self.finished[name] + failed, self.pushed[self.since[name] :]
        if self.exact[name]:
            assert len(got) == len(want), name
            assert checksum(got) == checksum(want), name
            return
        keys = [json.dumps(p, sort_keys=True) for p in got]
        assert len(set(keys)) == len(keys), name  # none twice
        assert set(keys) <= {json.dumps(p, sort_keys=True) for p in self.pushed}, name
        assert {json.dumps(p, sort_keys=True) for p in want} <= set(keys), name


@pytest.mark.parametrize("seed", range(12))
def test_random_steps_answer_and_leave_the_same_ring_on_both_dialects(  # noqa: PLR0912, PLR0915
    seed: int, sides: Callable[[int, int, int], tuple[Side, Side]], pg_dsn: str
) -> None:
    """Nothing is lost either: every group got every payload pushed since it was added, finished once
    (popped at most or exactly once, or acked), failed, or drained when the ring is drained at the end.

    Long on purpose: one scenario told in order, whose checks at the end need everything it built along the
    way; split, the parts would pass all of it around.
    """
    rng = random.Random(seed)
    capacity = rng.choice([4, 6, 8, 12])
    pg, ms = sides(seed, capacity, rng.randint(1, min(capacity, 4)))
    gap_timeout = rng.choice([0.0, 1e9])  # forced at the second sighting, or only with the proof
    for side in (pg, ms):
        side.q.gap_timeout = gap_timeout
    ledger = Ledger()
    log: list[str] = []

    def same(answers: list[Any]) -> Any:
        assert answers[0] == answers[1], "\n".join(log)
        return answers[0]

    for _ in range(45):
        step = rng.choice(STEPS)
        group = rng.choice(sorted(pg.groups))
        log.append(f"{step} {group}")
        if step in ("push", "push_one"):
            size = 1 if step == "push_one" else rng.randint(1, 4)
            payloads = [{"n": len(ledger.pushed) + i, "s": "x" * rng.randint(0, 30)} for i in range(size)]
            got = same([outcome(lambda s=s, p=payloads: s.q.push_batch(p)) for s in (pg, ms)])
            if isinstance(got, list):
                ledger.pushed += payloads
        elif step == "abandon":
            k = rng.randint(1, 2)
            same([s.abandon(k) for s in (pg, ms)])
        elif step == "add_group":
            name, start = rng.choice(GROUP_NAMES), rng.choice(["now", "earliest"])
            log[-1] += f" {name} {start}"
            if same([s.add_group(name, start) for s in (pg, ms)]) == name:
                ledger.add(name, start)
        elif step == "drop_group":
            name = rng.choice(GROUP_NAMES)
            log[-1] += f" {name}"
            stale = [s.groups.get(name) for s in (pg, ms)]
            if same([s.drop_group(name) for s in (pg, ms)]) is True:
                ledger.drop(name)
                # a handle of the dropped group finds it gone
                assert same([outcome(lambda h=h: h.pop(1)) for h in stale]) == "GroupNotFoundError"
        elif step == "maintain":
            same([outcome(s.q.maintain) for s in (pg, ms)])
        elif step.startswith("pop") or step == "held":
            n = rng.randint(1, 6)
            semantics = SEMANTICS[step if step != "held" else rng.choice(list(SEMANTICS))]
            held: list[int] = []
            if step == "held":
                if not no_unwritten_numbers(pg.state(), capacity, pg.groups[group]._gid):
                    continue
                lanes = pg.q.lanes
                # Some lanes, or every one (a pop that may wait then waits 1 s, and times out).
                held = rng.sample(range(lanes), lanes if rng.random() < 0.3 else rng.randint(1, lanes))
                log[-1] += f" {held} {semantics} {n}"
            answers = []
            for s in (pg, ms):
                handle = s.groups[group]
                end = s.hold(group, held, pg_dsn) if held else None
                try:
                    if semantics == "exactly-once":
                        with s.dbq.transaction() as conn:
                            got = handle.pop(n, semantics=semantics, conn=conn)
                    else:
                        got = handle.pop(n, semantics=semantics)
                finally:
                    if end is not None:
                        end()
                if semantics == "at-least-once":
                    s.leased[group] += got
                answers.append([msg(m) for m in got])
            got = same(answers)
            if semantics != "at-least-once":
                ledger.finished[group] += [m[1] for m in got]
        elif step in ("ack", "ack_part", "nack", "expire") and pg.leased[group]:
            leased = pg.leased[group]
            k = len(leased) if step == "ack" else rng.randint(1, len(leased))
            chosen = set(rng.sample(range(len(leased)), k))
            answers = []
            for s in (pg, ms):
                handle = s.groups[group]
                these = [m for i, m in enumerate(s.leased[group]) if i in chosen]
                s.leased[group] = [m for i, m in enumerate(s.leased[group]) if i not in chosen]
                if step.startswith("ack"):
                    answers.append(outcome(lambda h=handle, these=these: h.ack(these)))
                elif step == "nack":
                    answers.append(outcome(lambda h=handle, these=these: h.nack(these, delay=0, error="no")))
                else:
                    expire_leases(s.dbq, [m.id for m in these], handle)
                    answers.append(outcome(handle.reclaim_expired))
            if same(answers) == len(these) and step.startswith("ack"):
                ledger.finished[group] += [m.payload for m in these]
        elif step == "claim":
            n = rng.randint(1, 6)
            log[-1] += f" {n}"
            answers = []
            for s in (pg, ms):
                batch = outcome(lambda h=s.groups[group], n=n: h.claim_batch(n, consumer="spark"))
                if isinstance(batch, Batch):
                    s.batches[group].append(batch.batch_id)
                    batch = (batch.receipts, batch.state.value, batch.consumer)
                answers.append(batch)
            same(answers)
        elif step.startswith("batch_") and pg.batches[group]:
            k = rng.randrange(len(pg.batches[group]))
            rows = same([s.read_batch(group, s.batches[group][k], pg_dsn) for s in (pg, ms)])
            answers = []
            for s in (pg, ms):
                handle, batch_id = s.groups[group], s.batches[group][k]
                if step == "batch_ack":
                    answers.append(outcome(lambda h=handle, b=batch_id: h.ack_batch(b)))
                elif step == "batch_release":
                    answers.append(
                        outcome(lambda h=handle, b=batch_id: h.release_batch(b, delay=0, error="no"))
                    )
                elif step == "batch_extend":
                    until = outcome(lambda h=handle, b=batch_id: h.extend_batch(b, 3600))
                    answers.append(until if isinstance(until, str) else "extended")  # times differ
            got = same(answers) if answers else None
            if step == "batch_ack" and got:
                ledger.finished[group] += [json.loads(r[3]) for r in rows]
        elif step == "lapse":
            # Every open lease runs out and nobody reclaims it yet (its consumers were killed): readiness
            # counts its messages at once, as a pop would get them.
            for s in (pg, ms):
                s.lapse()
                for held_msgs in s.leased.values():
                    held_msgs.clear()
            same([(s.groups[group].count_ready(), s.groups[group].readiness()) for s in (pg, ms)])
        elif step == "recover":
            same([outcome(lambda s=s: s.q.recover_gaps(wait=0.5)) for s in (pg, ms)])
        elif step == "peek":
            same(
                [
                    (outcome(lambda h=h: h.peek(4)), h.count_ready(), h.readiness())
                    for h in (pg.groups[group], ms.groups[group])
                ]
            )
        elif step == "requeue":
            same(
                [
                    ([failed(f) for f in h.list_failed()], outcome(h.requeue_failed))
                    for h in (pg.groups[group], ms.groups[group])
                ]
            )
        log[-1] += f": {pg.state()[f'stats {group}'] if group in pg.groups else ''}"
        assert pg.state() == ms.state(), "\n".join(log)
    # The leases still open end, and the batches still open are released; then each group's part of the
    # rings is drained, handing out the same messages on both sides.
    for name in sorted(pg.groups):
        for k in range(len(pg.batches[name])):
            release = [
                lambda h=s.groups[name], b=s.batches[name][k]: h.release_batch(b, delay=0) for s in (pg, ms)
            ]
            same([outcome(r) for r in release])
        for s in (pg, ms):
            handle = s.groups[name]
            if s.leased[name]:
                expire_leases(s.dbq, [m.id for m in s.leased[name]], handle)
                s.leased[name].clear()
        same([outcome(s.groups[name].reclaim_expired) for s in (pg, ms)])
        failures = same([[failed(f) for f in s.groups[name].list_failed(capacity * 4)] for s in (pg, ms)])
        for _ in range(4 * capacity):
            got = same([outcome(lambda h=s.groups[name]: h.pop(capacity)) for s in (pg, ms)])
            if not got:
                break
            ledger.finished[name] += [m[1] for m in got]
        ledger.check(name, [f[1] for f in failures])
    assert pg.state() == ms.state()
    pg.check_settled()
    # Dropped: a push and a pop through the old handles find the queue gone (the procedures' DQ004 on
    # SQL Server, the functions' on PostgreSQL), a pop in the caller's transaction takes nothing.
    for s in (pg, ms):
        s.drop()
    assert same([outcome(lambda s=s: s.q.push({"late": 1})) for s in (pg, ms)]) == "QueueNotFoundError"
    assert same([outcome(lambda s=s: s.q.push_batch([1, 2])) for s in (pg, ms)]) == "QueueNotFoundError"
    for name in sorted(pg.groups):
        assert same([outcome(lambda h=s.groups[name]: h.pop(3)) for s in (pg, ms)]) == "QueueNotFoundError"

    def own(s: Side) -> Any:
        with s.dbq.transaction() as conn:
            return outcome(lambda: s.q.pop(3, semantics="exactly-once", conn=conn))

    assert same([own(s) for s in (pg, ms)]) == []
