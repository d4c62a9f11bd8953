"""Least-privilege roles: the schema's owner grants other roles actions per queue, and the database
enforces them.

Each test makes roles of its own (dropped afterwards) and connects as them (the embedded server trusts
local logins). A role that attempts what it was not granted gets PermissionDeniedError naming the queue
and the action, and the data is checked afterwards to be unchanged; a role that goes around the engine
with SQL of its own finds the rows of other queues neither visible nor writable.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import psycopg.conninfo
import pytest

from airflow_dbqueue import cli
from airflow_dbqueue.engine import ConfigurationError, DbQueue, PermissionDeniedError
from tests.conftest import installed_dbq
from tests.dialects import run_sql
from tests.helpers import checksum

pytestmark = pytest.mark.integration


@pytest.fixture
def owner(pg_dsn: str, schema_name: str) -> Iterator[DbQueue]:
    """The schema, installed by the test's superuser (its owner), with a table queue and a ring."""
    with installed_dbq(pg_dsn, schema_name) as dbq:
        dbq.create_queue("orders")
        dbq.create_queue("events", design="ring", capacity=100)
        dbq.create_queue("other")
        yield dbq


@pytest.fixture
def role(pg_dsn: str) -> Iterator[Callable[[], str]]:
    """Make login roles of the test's own (no privileges of their own); dropped afterwards."""
    made: list[str] = []

    def make() -> str:
        name = f"dbq_role_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'CREATE ROLE "{name}" LOGIN')
        made.append(name)
        return name

    yield make
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        for name in made:
            c.execute(f'DROP OWNED BY "{name}"')
            c.execute(f'DROP ROLE "{name}"')


def as_role(pg_dsn: str, schema: str, role: str) -> DbQueue:
    return DbQueue(psycopg.conninfo.make_conninfo(pg_dsn, user=role), schema=schema, pool_size=2)


def _snapshot(owner: DbQueue) -> dict[str, Any]:
    """What the owner sees of every queue: its counts and the payloads ready in it."""
    out = {}
    for name in ("orders", "events", "other"):
        q = owner.queue(name)
        s = q.stats()
        out[name] = (s.ready, s.in_flight, s.failed, checksum(m.payload for m in q.peek(100)))
    return out


def test_a_role_with_push_on_one_queue(owner: DbQueue, role: Callable[[], str], pg_dsn: str) -> None:
    pusher = role()
    assert owner.grant(pusher, "orders", ["push"]) == ["push"]
    owner.queue("other").push({"secret": 1})
    with as_role(pg_dsn, owner.schema, pusher) as dbq:
        q = dbq.queue("orders")
        q.push_batch([{"n": 1}, {"n": 2}])
        before = _snapshot(owner)
        for call, action in (
            (lambda: q.pop(1), "pop"),
            (q.peek, "read"),
            (q.stats, "read"),
            (q.requeue_failed, "admin"),
        ):
            with pytest.raises(PermissionDeniedError) as refused:
                call()
            assert (refused.value.queue, refused.value.action) == ("orders", action)
        # Another queue: it cannot even see it, through the engine or around it.
        with pytest.raises(Exception, match="other"):
            dbq.queue("other")
        with pytest.raises(PermissionDeniedError, match="admin"):
            dbq.create_queue("new_one")
        with pytest.raises(PermissionDeniedError):
            dbq.maintain()
        assert _snapshot(owner) == before
    assert [m.payload for m in owner.queue("orders").pop(10)] == [{"n": 1}, {"n": 2}]


def test_sql_around_the_engine_sees_and_changes_only_granted_queues(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    """Enforced by the database: the role's own SQL reads no row of another queue, changes none, and
    cannot call the engine's functions to push into another queue either."""
    popper = role()
    owner.grant(popper, "orders", ["pop"])
    owner.queue("orders").push({"mine": 1})
    owner.queue("other").push_batch([{"secret": 1}, {"secret": 2}])
    other_id = owner.queue("other").settings.queue_id
    before = _snapshot(owner)
    s = owner.schema
    with psycopg.connect(psycopg.conninfo.make_conninfo(pg_dsn, user=popper), autocommit=True) as c:
        assert c.execute(f'SELECT count(*) FROM "{s}".meta WHERE queue_id = %s', (other_id,)).fetchone() == (
            0,
        )
        assert c.execute(f'SELECT count(*) FROM "{s}".meta').fetchone() == (1,)
        assert c.execute(f'SELECT name FROM "{s}".queues').fetchall() == [("orders",)]
        assert c.execute(f'DELETE FROM "{s}".meta WHERE queue_id = %s', (other_id,)).rowcount == 0
        # the engine's push function, called for a queue the role may not see, writes nothing
        pushed = c.execute(
            f'SELECT * FROM "{s}".table_push(%s, ARRAY[%s::bytea], 0::smallint, 0, 0, %s, true)',
            (other_id, b'{"x": 1}', "ch"),
        ).fetchall()
        assert pushed == []
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(f'SELECT * FROM "{s}".grants')
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(f"INSERT INTO \"{s}\".grants VALUES (%s, NULL, 'admin')", (popper,))
    assert _snapshot(owner) == before


@pytest.mark.parametrize("design", ["table", "ring", "ring-rows"])
def test_each_action_does_what_it_grants(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str, design: str
) -> None:
    """push, pop, read and admin, each granted alone on one queue of each design (and ring layout): the
    role does what it was granted, counted and checksummed, and is refused the rest."""
    name = {"ring": "events", "ring-rows": "stream"}.get(design, "orders")
    if design == "ring-rows":
        owner.create_queue("stream", design="ring", capacity=100, layout="rows")
    roles = {a: role() for a in ("push", "pop", "read", "admin")}
    for action, r in roles.items():
        owner.grant(r, name, [action])
    sent = [{"i": i} for i in range(20)]
    with as_role(pg_dsn, owner.schema, roles["push"]) as dbq:
        dbq.queue(name).push_batch(sent)
    with as_role(pg_dsn, owner.schema, roles["read"]) as dbq:
        q = dbq.queue(name)
        assert q.stats().ready == 20 and q.count_ready() == 20
        assert checksum(m.payload for m in q.peek(100)) == checksum(sent)
        with pytest.raises(PermissionDeniedError, match="may not pop"):
            q.pop(1)
        with pytest.raises(PermissionDeniedError, match="may not push"):
            q.push({"no": 1})
    with as_role(pg_dsn, owner.schema, roles["pop"]) as dbq:
        q = dbq.queue(name)
        got = q.pop(10, semantics="at-least-once")
        assert q.ack(got) == 10
        with dbq.transaction() as conn:
            got += q.pop(10, semantics="exactly-once", conn=conn)
        assert checksum(m.payload for m in got) == checksum(sent)
        with pytest.raises(PermissionDeniedError, match="may not push"):
            q.push({"no": 1})
        with pytest.raises(PermissionDeniedError, match="may not admin"):
            q.delete_failed()
    with as_role(pg_dsn, owner.schema, roles["admin"]) as dbq:
        q = dbq.queue(name)
        with pytest.raises(PermissionDeniedError, match="may not push"):
            q.push({"no": 1})
        assert q.stats().ready == 0
        assert q.requeue_failed() == 0
        if design == "ring-rows":
            # a group of the rows layout is tables of its own, which need CREATE on the schema
            with pytest.raises(PermissionDeniedError, match="permission denied for schema"):
                q.add_group("g")  # type: ignore[attr-defined]
            assert [g.name for g in owner.queue(name).groups()] == ["default"]  # type: ignore[attr-defined]
        if design != "table":
            # a ring's sequences (and a rows ring's tables) are its creator's: only the owner (or a
            # member of it) drops it
            with pytest.raises(PermissionDeniedError, match="owner of"):
                dbq.drop_queue(name)
            assert name in [s.name for s in owner.list_queues()]
            return
        assert dbq.drop_queue(name) is True
    assert name not in [s.name for s in owner.list_queues()]


def test_a_pop_role_runs_a_rings_batches_in_each_group(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    """pop granted on a ring: the role claims, extends, releases, reads (by the batch query, as a foreign
    reader logged in as the role) and acks batches of the ring's default group and of a group, whose
    ledger rows carry the group's key, which the policies let it touch as the ring's own. A role with
    pop on another queue sees none of it."""
    owner.queue("events").add_group("g")  # type: ignore[attr-defined]
    popper, other = role(), role()
    owner.grant(popper, "events", ["pop"])
    owner.grant(other, "orders", ["pop"])
    sent = [{"i": i} for i in range(12)]
    owner.queue("events").push_batch(sent)
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=popper)
    with as_role(pg_dsn, owner.schema, popper) as dbq:
        for group in (None, "g"):
            q = dbq.queue("events").group(group)
            first = q.claim_batch(5)
            assert first is not None and q.extend_batch(first.batch_id, 60) > first.lease_until
            assert q.release_batch(first.batch_id, delay=0) == 5
            batch = q.claim_batch(12)
            assert batch is not None and batch.size == 12
            assert [b.batch_id for b in q.open_batches()] == [batch.batch_id]
            with psycopg.connect(dsn, autocommit=True) as c:
                rows = c.execute(q.batch_query(batch.batch_id).encode()).fetchall()
            assert checksum(json.loads(bytes(r[3])) for r in rows) == checksum(sent)
            with dbq.transaction() as conn:
                assert q.ack_batch(batch.batch_id, conn=conn) == 12
            assert q.stats().ready == 0
    with as_role(pg_dsn, owner.schema, other) as dbq:
        assert "events" not in [s.name for s in dbq.list_queues()]
    with psycopg.connect(psycopg.conninfo.make_conninfo(pg_dsn, user=other)) as c:
        assert c.execute(f'SELECT count(*) FROM "{owner.schema}".batches').fetchone() == (0,)


def _sql_touches_only_its_ring(pg_dsn: str, role: str, s: str, mine_id: int, theirs_id: int) -> None:
    """The role's own SQL sees ring mine_id of the rows layout and reads, writes and empties nothing of
    ring theirs_id: neither its registry row nor its tables, sequences and functions."""
    with psycopg.connect(psycopg.conninfo.make_conninfo(pg_dsn, user=role), autocommit=True) as c:
        assert c.execute(f'SELECT queue_id FROM "{s}".ring_rows').fetchall() == [(mine_id,)]
        assert c.execute(f'DELETE FROM "{s}".ring_rows WHERE queue_id = %s', (theirs_id,)).rowcount == 0
        changed = c.execute(f'UPDATE "{s}".ring_rows SET lanes = 1 WHERE queue_id = %s', (theirs_id,))
        assert changed.rowcount == 0
        for statement in (
            f'SELECT count(*) FROM "{s}".ring_{theirs_id}_rq',
            f'SELECT count(*) FROM "{s}".ring_{theirs_id}_rq0',
            f'TRUNCATE "{s}".ring_{theirs_id}_rq0',
            f'INSERT INTO "{s}".ring_{theirs_id}_rpos0 VALUES (0, 999999)',
            f"SELECT nextval('\"{s}\".ring_{theirs_id}_rrows')",
            f'SELECT * FROM "{s}".ring_{theirs_id}_rpush(ARRAY[%s::bytea], 0, %s)',
        ):
            params = (b'{"x": 1}', "ch") if "rpush" in statement else None
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(statement, params)
        # its own ring's tables it reads
        assert c.execute(f'SELECT count(*) FROM "{s}".ring_{mine_id}_rq').fetchone() is not None


def test_a_role_pops_one_ring_of_the_rows_layout_and_touches_no_other(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    """push and pop granted on one ring of the rows layout: the role pushes past the ring's capacity (its
    pushes empty and reuse segments), pops every message at most once, at least once and exactly once,
    in a consumer group added after the grant, and in batches, counted and checksummed. Through the
    engine or with SQL of its own it reads, writes and empties nothing of another ring of that layout,
    nor of the slots ring."""
    mine = owner.create_queue("stream", design="ring", capacity=64, lanes=2, layout="rows")
    theirs = owner.create_queue("stream2", design="ring", capacity=64, lanes=2, layout="rows")
    worker = role()
    owner.grant(worker, "stream", ["push", "pop"])
    secret = [{"secret": i} for i in range(10)]
    theirs.push_batch(secret)
    owner.queue("events").push({"slots": 1})
    before = _snapshot(owner), checksum(m.payload for m in theirs.peek(100))
    got: list[Any] = []
    sent: list[Any] = []
    with as_role(pg_dsn, owner.schema, worker) as dbq:
        q = dbq.queue("stream")
        # 64 pushes a lap: three laps rotate every segment in again, twice
        for i in range(200):
            sent.append({"i": i})
            q.push(sent[-1])
            if i % 3 == 0:
                got += q.pop(2)
            elif i % 3 == 1:
                popped = q.pop(2, semantics="at-least-once")
                assert q.ack(popped) == len(popped)
                got += popped
            else:
                with dbq.transaction() as conn:
                    got += q.pop(2, semantics="exactly-once", conn=conn)
        while True:
            more = q.pop(50)
            if not more:
                break
            got += more
        assert len(got) == len(sent) and checksum(m.payload for m in got) == checksum(sent)
        # batches of the default group
        q.push_batch([{"b": i} for i in range(6)])
        batch = q.claim_batch(6)
        assert batch is not None and batch.size == 6
        with dbq.transaction() as conn:
            assert q.ack_batch(batch.batch_id, conn=conn) == 6
        # another queue: not even seen
        for other in ("stream2", "events"):
            with pytest.raises(Exception, match=other):
                dbq.queue(other)
    # a group added after the grant: its own tables go to the role too
    owner.queue("stream").add_group("g")  # type: ignore[attr-defined]
    owner.queue("stream").push_batch([{"g": i} for i in range(5)])
    with as_role(pg_dsn, owner.schema, worker) as dbq:
        g = dbq.queue("stream").group("g")
        seen = g.pop(10, semantics="at-least-once")
        assert g.ack(seen) == 5 and checksum(m.payload for m in seen) == checksum({"g": i} for i in range(5))
        assert sorted(m.payload["g"] for m in dbq.queue("stream").pop(10)) == list(range(5))
    _sql_touches_only_its_ring(pg_dsn, worker, owner.schema, mine.settings.queue_id, theirs.settings.queue_id)
    assert (_snapshot(owner), checksum(m.payload for m in theirs.peek(100))) == before
    assert sorted(m.payload["secret"] for m in theirs.pop(20)) == list(range(10))


def test_revoke_on_a_ring_of_the_rows_layout_takes_its_tables_back(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    """pop revoked, push kept: the role still pushes but neither pops nor writes the ring's position
    logs with SQL of its own; everything revoked, it reads none of the ring's tables."""
    ring = owner.create_queue("stream", design="ring", capacity=64, lanes=2, layout="rows")
    r = role()
    owner.grant(r, "stream", ["push", "pop"])
    owner.revoke(r, "stream", ["pop"])
    qid, s = ring.settings.queue_id, owner.schema
    with as_role(pg_dsn, owner.schema, r) as dbq:
        q = dbq.queue("stream")
        q.push_batch([1, 2, 3])
        with pytest.raises(PermissionDeniedError, match="may not pop"):
            q.pop(1)
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=r)
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute(f'SELECT sum(n) FROM "{s}".ring_{qid}_rq').fetchone() == (3,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(f'INSERT INTO "{s}".ring_{qid}_rpos0 VALUES (0, 999999)')
    owner.revoke(r, "stream", ["push"])
    with psycopg.connect(dsn, autocommit=True) as c, pytest.raises(psycopg.errors.InsufficientPrivilege):
        c.execute(f'SELECT count(*) FROM "{s}".ring_{qid}_rq0')
    assert sorted(m.payload for m in ring.pop(5)) == [1, 2, 3]


def test_grants_on_every_queue_reach_queues_made_later(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    admin, worker = role(), role()
    owner.grant(admin, None, ["admin"])
    owner.grant(worker, None, ["push", "pop"])
    with as_role(pg_dsn, owner.schema, admin) as dbq:
        dbq.create_queue("later")
        dbq.create_queue("later_ring", design="ring", capacity=50, layout="slots")
        dbq.create_queue("later_rows", design="ring", capacity=64, lanes=2, layout="rows")
        dbq.queue("later_rows").add_group("g")  # type: ignore[attr-defined]
        report = dbq.maintain()
        assert report["skipped"] is None
        # without pg_monitor the horizon check sees only the role's own sessions, and says so
        assert any("pg_monitor" in n for n in report["notes"]), report["notes"]
        # and the horizon section and the metrics carry the same note, not an error
        assert "pg_monitor" in report["horizon"]["note"]
        assert "pg_monitor" in report["metrics"]["horizon"]["note"]
        assert report["samples"]["recorded"] == 6 and report["samples"]["skipped"] is None
    with as_role(pg_dsn, owner.schema, worker) as dbq:
        for name in ("later", "later_ring", "later_rows", "orders"):
            q = dbq.queue(name)
            q.push_batch([1, 2, 3])
            assert sorted(m.payload for m in q.pop(5)) == [1, 2, 3]
        # the group the admin added: its own tables went to the worker with it
        assert sorted(m.payload for m in dbq.queue("later_rows").group("g").pop(5)) == [1, 2, 3]
        with pytest.raises(PermissionDeniedError):
            dbq.queue("orders").requeue_failed()


def test_revoke_takes_back_what_was_granted(owner: DbQueue, role: Callable[[], str], pg_dsn: str) -> None:
    r = role()
    owner.grant(r, "orders", ["push", "pop"])
    assert sorted(owner.revoke(r, "orders", ["pop"])) == ["pop"]
    assert owner.grants() == [(r, "orders", "push")]
    with as_role(pg_dsn, owner.schema, r) as dbq:
        q = dbq.queue("orders")
        q.push(1)
        with pytest.raises(PermissionDeniedError, match="may not pop"):
            q.pop(1)
    owner.revoke(r, "orders", ["push", "pop", "read", "admin"])
    assert owner.grants() == []
    with as_role(pg_dsn, owner.schema, r) as dbq, pytest.raises(PermissionDeniedError):
        dbq.queue("orders")  # no privilege left on the schema at all
    assert [m.payload for m in owner.queue("orders").pop(5)] == [1]


def test_bad_grants_are_refused(owner: DbQueue, role: Callable[[], str]) -> None:
    r = role()
    with pytest.raises(ConfigurationError, match="'write' is not an action"):
        owner.grant(r, "orders", ["write"])
    with pytest.raises(ConfigurationError, match="does not exist on the server"):
        owner.grant("no_such_role_here", "orders", ["push"])
    with pytest.raises(Exception, match="nope"):
        owner.grant(r, "nope", ["push"])
    assert owner.grants() == []


def test_the_grant_and_revoke_commands(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str, capsys: Any
) -> None:
    r = role()
    base = ["--dsn", pg_dsn, "--schema", owner.schema]
    assert cli.main([*base, "grant", r, "--queue", "orders", "--actions", "push,read"]) == 0
    assert cli.main([*base, "grants"]) == 0
    out = capsys.readouterr().out
    assert r in out and "orders" in out and "push" in out
    assert sorted((a for _, _, a in owner.grants())) == ["push", "read"]
    assert cli.main([*base, "revoke", r, "--queue", "orders", "--actions", "push"]) == 0
    assert owner.grants() == [(r, "orders", "read")]
    assert cli.main([*base, "grant", r, "--actions", "fly"]) == 2


def test_a_role_reads_the_samples_of_the_queues_it_may_see(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    """Samples carry their queue: a role granted read on one queue reads that queue's samples and no
    other's; a role without maintenance (admin) rights can neither write nor delete them."""
    owner.maintenance().sample()
    reader = role()
    owner.grant(reader, "orders", ["read"])
    with as_role(pg_dsn, owner.schema, reader) as dbq:
        seen = dbq.maintenance().samples(window=600)
        assert sorted(seen) == ["orders"] and len(seen["orders"]) == 1
        with psycopg.connect(psycopg.conninfo.make_conninfo(pg_dsn, user=reader), autocommit=True) as c:
            gone = c.execute(f'DELETE FROM "{owner.schema}".samples').rowcount
            assert gone == 0  # row-level security: only admins of a queue delete its samples
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(
                    f'INSERT INTO "{owner.schema}".samples (queue_id, ready, delayed, in_flight, failed) '
                    f'SELECT queue_id, 1, 0, 0, 0 FROM "{owner.schema}".queues WHERE name = %s',
                    ["orders"],
                )
    assert sorted(owner.maintenance().samples(window=600)) == ["events", "orders", "other"]


def test_a_role_samples_the_queues_it_administers(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    """A role that administers one queue and reads another samples the first; the second is noted."""
    keeper = role()
    owner.grant(keeper, "orders", ["admin"])
    owner.grant(keeper, "other", ["read"])
    with as_role(pg_dsn, owner.schema, keeper) as dbq:
        out = dbq.maintenance().sample()
    assert out["recorded"] == 1 and list(out["queues"]) == ["orders"]
    assert out["notes"] == ["queue 'other' not sampled: the role may not administer it"]
    assert {q: len(s) for q, s in owner.maintenance().samples(window=600).items()} == {"orders": 1}


def test_a_role_with_push_pushes_with_deduplication_keys(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    """Pushing with keys needs push alone (the dedup table's rows of the queue), and a pusher's keys
    are its queue's: the same key in another queue is another message."""
    pusher = role()
    owner.grant(pusher, "orders", ["push"])
    other = owner.queue("other").push({"other": 1}, dedup_key="k1")
    with as_role(pg_dsn, owner.schema, pusher) as dbq:
        q = dbq.queue("orders")
        ids = q.push_batch([{"n": 1}, {"n": 2}], dedup_keys=["k1", "k2"])
        assert q.push({"n": 1, "retry": True}, dedup_key="k1") == ids[0]
        assert other not in ids
    popped = owner.queue("orders").pop(10)
    assert [(m.id, m.payload) for m in popped] == [(ids[0], {"n": 1}), (ids[1], {"n": 2})]
    assert [m.payload for m in owner.queue("other").pop(10)] == [{"other": 1}]


def test_a_role_with_push_pushes_with_deduplication_keys_into_a_ring_of_the_rows_layout(
    owner: DbQueue, role: Callable[[], str], pg_dsn: str
) -> None:
    """A ring of the rows layout keeps its keys in a table of its own: push alone writes them (through
    rotations too, a capacity of 16 pushes), admin forgets them, and a role with push on another ring
    cannot read or write its keys."""
    ring = owner.create_queue("keyed", design="ring", capacity=16, lanes=2, layout="rows", dedup_window=60)
    owner.create_queue("keyed2", design="ring", capacity=16, lanes=2, layout="rows")
    pusher, stranger, admin = role(), role(), role()
    owner.grant(pusher, "keyed", ["push"])
    owner.grant(stranger, "keyed2", ["push"])
    owner.grant(admin, "keyed", ["admin"])
    pushed: list[Any] = [{"n": 1}, {"n": 2}]
    popped: list[Any] = []
    with as_role(pg_dsn, owner.schema, pusher) as dbq:
        q = dbq.queue("keyed")
        first = q.push_batch([{"n": 1}, {"n": 2}], dedup_keys=["k1", "k2"])
        for i in range(3, 40):
            assert q.push_batch([{"n": i}, {"n": 1, "retry": i}], dedup_keys=[f"k{i}", "k1"])[1] == first[0]
            pushed.append({"n": i})
            if i % 4 == 0:
                popped += [m.payload for m in ring.pop(10)]
    keys = f"{{schema}}.ring_{ring.settings.queue_id}_rkeys"
    with as_role(pg_dsn, owner.schema, stranger) as dbq:
        for sql in (f"SELECT count(*) FROM {keys}", f"INSERT INTO {keys} VALUES ('k1', 1, now())"):
            with pytest.raises(Exception, match="permission denied"):
                run_sql(dbq, sql)
    run_sql(owner, f"UPDATE {keys} SET pushed_at = now() - interval '61 s'")
    with as_role(pg_dsn, owner.schema, admin) as dbq:
        assert dbq.queue("keyed").maintain()["keys_forgotten"] == 39
    popped += [m.payload for m in ring.pop(100)]
    assert len(popped) == len(pushed) == 39 and checksum(popped) == checksum(pushed)
